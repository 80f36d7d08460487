"""`python -m edge_client` / `moa-edge`: generate on the edge with a verify server (or without one).

    moa-edge "Why is the sky blue?"                         speculative decoding with the server on 127.0.0.1:8765
    moa-edge --server wss://gpu-box:8765 --token $TOKEN     an interactive chat (no prompt given)
    moa-edge --mode api "..."                               the baseline: the server generates and streams
    moa-edge --mode offline "..."                           never connect: the edge drafter alone
    moa-edge --disconnect-after 32 --offline-for 2 "..."    experiment: drop the link, resync 2 s later

Text streams to stdout as tokens are accepted; text made offline (unverified) is dim on a terminal and is decoded
under a guard against loops that copies what the text repeats (--no-repeat-ngram, --max-newlines,
--repetition-penalty, --no-copy, --offline-temperature; verified text never is). Under
`--on-reconnect verify` offline text the target rejects is withdrawn: the stream prints ⟲ after it and goes on
with the target's text (--json holds the final text only); a reply that ends offline waits up to --resync-wait
seconds for the server to verify it. Events and a status line go to stderr.

exit status: 0 done; 1 error; 2 bad arguments; 3 under --on-reconnect verify, a reply ended with tokens the
target never checked (the server did not come back within --resync-wait; --json says verified false and how many)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TextIO

from edge_client.bundle import BundleError
from edge_client.client import DEFAULT_SERVER, MODES, POLICIES, EdgeError, EdgeSession, LinkDown, Prompt, Result
from moa_core.drafting import OfflineGuard
from moa_core.lookup import COPY_TOKENS
from moa_core.protocol import ROW_DTYPES, sampling_problem
from edge_client.runtime import PROVIDER_ALIASES, choose_providers
from moa_core.tree import TreeConfig

DIM, RESET = "\033[2m", "\033[0m"
REWIND_MARK = "⟲"
EXIT_UNVERIFIED = 3


def parse_tree(text: str) -> TreeConfig | str:
    if text == "auto":
        return text
    try:
        return TreeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_offline_guard_arguments(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The offline guard's flags (shared with `python -m bench offline`); `offline_guard(args)` reads them."""
    d = OfflineGuard()
    group.add_argument("--no-repeat-ngram", type=int, default=d.no_repeat_ngram, metavar="N", help="offline tokens "
                       "never complete an N-gram already in the last --guard-window tokens; 0 = off (default: "
                       "%(default)s)")
    group.add_argument("--max-newlines", type=int, default=d.max_newlines, metavar="M", help="offline tokens never "
                       "make a run of more than M newlines; 0 = off (default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty, metavar="R",
                       help="offline tokens: penalise the tokens of the last --guard-window tokens; 1 = off (default: "
                       "%(default)s)")
    group.add_argument("--guard-window", type=int, default=d.window, metavar="W", help="how many recent tokens the "
                       "rules look at (default: %(default)s)")
    group.add_argument("--no-copy", dest="copy", action="store_false", help="offline tokens: do not copy what the "
                       "text repeats (by default, when its last tokens occurred before, the token that followed "
                       "them is taken, as prompt lookup would draft it)")
    group.add_argument("--copy-min-ngram", type=int, default=d.copy_min_ngram, choices=(1, 2, 3), help="offline "
                       "tokens copy when at least the last N tokens occurred before (default: %(default)s)")


def offline_guard(args: argparse.Namespace) -> OfflineGuard | None:
    """The guard the flags ask for; None when every rule is off."""
    if args.no_repeat_ngram == 0 and args.max_newlines == 0 and args.repetition_penalty == 1 and not args.copy:
        return None
    return OfflineGuard(args.no_repeat_ngram, args.max_newlines, args.repetition_penalty, args.guard_window,
                        args.copy, args.copy_min_ngram)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moa-edge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="one user turn; without it, an interactive chat (/exit or EOF ends it)")
    p.add_argument("--bundle", help="edge bundle directory (default: the shipped MoA drafter's, exported on first "
                   "use under $MOA_CACHE or ~/.cache/moa-edge/bundles/default-moa)")
    p.add_argument("--server", default=DEFAULT_SERVER, help="ws:// or wss:// URL (default: %(default)s)")
    p.add_argument("--token", default=os.environ.get("MOA_TOKEN"),
                   help="the server's bearer token (default: $MOA_TOKEN)")
    p.add_argument("--mode", choices=MODES, default="speculative",
                   help="speculative: draft here, verify on the server; api: the server generates (baseline); "
                   "offline: never connect (default: %(default)s)")
    p.add_argument("--system", help="a system message for the chat")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=256, help="default: %(default)s")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    g.add_argument("--seed", type=int, help="seed of the edge's draft sampling")
    g.add_argument("--tree", type=parse_tree, default="auto", help="draft tree 'depth,topk,total' or 'auto' (the "
                   "budget the bundle's acceptance was measured with, cut to the server's limit) (default: auto)")
    g.add_argument("--copy-tokens", type=int, default=COPY_TOKENS, metavar="N", help="trees also verify up to "
                   "N tokens copied from where the text's last tokens occurred before (in api mode the server verifies "
                   "them); 0 = off (default: %(default)s)")
    g.add_argument("--no-handover", dest="handover", action="store_false", help="with --tree auto: keep speculating "
                   "to the end of a reply even once it stops paying (by default the server then generates the rest "
                   "of the reply alone, continuing its cache)")
    n = p.add_argument_group("link")
    n.add_argument("--on-reconnect", choices=POLICIES, default="keep", help="after an offline stretch the server "
                   "keeps the offline tokens, or verifies them and the edge rewinds to the first disagreement "
                   "(default: %(default)s)")
    n.add_argument("--row-dtype", choices=ROW_DTYPES, default="fp16", help="memory rows on the wire (default: "
                   "%(default)s)")
    n.add_argument("--timeout", type=float, default=15.0, help="seconds to wait for a reply before going offline "
                   "(default: %(default)s)")
    n.add_argument("--resync-wait", type=float, default=30.0, metavar="S", help="with --on-reconnect verify: seconds "
                   "a reply that reached its end offline waits for the server to verify it (default: %(default)s)")
    n.add_argument("--ca-file", help="PEM file of the CA certificates to trust for a wss:// server (e.g. a private "
                   "CA or a self-signed server certificate)")
    n.add_argument("--disconnect-after", type=int, metavar="N", help="experiment: drop the link after N verified "
                   "tokens")
    n.add_argument("--offline-for", type=float, metavar="S", help="with --disconnect-after: reconnect after S seconds "
                   "(default: stay offline to the end)")
    o = p.add_argument_group("offline (unverified) tokens")
    o.add_argument("--offline-temperature", type=float, metavar="T", help="sampling temperature of offline tokens; 0 "
                   "= greedy (default: --temperature)")
    add_offline_guard_arguments(o)
    r = p.add_argument_group("runtime and output")
    r.add_argument("--providers", default="auto", choices=("auto", *PROVIDER_ALIASES),
                   help="ONNX Runtime providers (default: %(default)s)")
    r.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: its own choice)")
    r.add_argument("--json", action="store_true", help="print one JSON object per reply at the end (text, token_ids, "
                   "finish_reason, verified, unverified_tokens, stats) instead of streaming")
    r.add_argument("-q", "--quiet", action="store_true", help="no events or status line on stderr")
    return p


def status_line(session: EdgeSession) -> str:
    s = session.stats
    state = s.mode if s.mode != "speculative" else ("online" if session.online else "offline")
    parts = [f"[{state}] {s.new_tokens} tokens in {s.total_s:.2f} s ({s.tokens_per_s:.1f} tokens/s)",
             f"tau {s.tau:.2f}", f"{s.server_calls} server calls", f"{s.offline_tokens} offline tokens",
             f"{s.bytes_up / 1024:.1f} KiB up, {s.bytes_down / 1024:.1f} KiB down",
             f"network wait {s.network_wait_s:.2f} s"]
    if s.rewound_tokens:
        parts.append(f"{s.rewound_tokens} rewound")
    return ", ".join(parts)


class Console(logging.Handler):
    """Streamed text on stdout, events on stderr: each event on a line of its own, even when text stops mid-line."""

    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        super().__init__()
        self.out, self.err, self.tty = out, err, out.isatty()
        self.mid_line = False

    def write(self, text: str, dim: bool = False) -> None:
        if text:
            self.out.write(f"{DIM}{text}{RESET}" if dim and self.tty else text)
            self.out.flush()
            self.mid_line = not text.endswith("\n")

    def emit(self, record: logging.LogRecord) -> None:
        self.err.write(("\n" if self.mid_line else "") + f"[moa-edge] {record.getMessage()}\n")
        self.err.flush()
        self.mid_line = False


def reply(session: EdgeSession, prompt: Prompt, args: argparse.Namespace, console: Console) -> Result:
    """Stream one reply (or print its JSON at the end), then the status line on stderr."""
    chunks = session.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, drop_after=args.disconnect_after,
                              offline_for=args.offline_for)
    for chunk in chunks:
        if not args.json:
            console.write(REWIND_MARK if chunk.rewind else "")
            console.write(chunk, dim=chunk.offline)
    result = session.result
    console.write(json.dumps({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                              "verified": result.verified, "unverified_tokens": result.unverified,
                              "stats": session.stats.as_dict()}) + "\n" if args.json else "\n")
    if not args.quiet:
        logging.getLogger("moa.edge").warning(status_line(session))
    return result


def chat(session: EdgeSession, args: argparse.Namespace, console: Console) -> list[Result]:
    """Read user turns from stdin until EOF or /exit; the whole conversation is the prompt of each reply."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    results = []
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            return results
        if line in ("/exit", "/quit"):
            return results
        if line:
            messages.append({"role": "user", "content": line})
            results.append(reply(session, messages, args, console))
            messages.append({"role": "assistant", "content": results[-1].text})


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every argument error, before the bundle and ONNX Runtime load (exit status 2)."""
    if args.offline_for is not None and args.disconnect_after is None:
        parser.error("--offline-for needs --disconnect-after")
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--threads", args.threads, 1),
                             ("--disconnect-after", args.disconnect_after, 0), ("--offline-for", args.offline_for, 0),
                             ("--resync-wait", args.resync_wait, 0), ("--top-k", args.top_k, 0),
                             ("--copy-tokens", args.copy_tokens, 0)):
        if value is not None and value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    if (problem := sampling_problem(args.temperature, args.top_p, args.top_k)) is not None:
        parser.error(problem.replace("temperature", "--temperature").replace("top_p", "--top-p")
                     .replace("top_k", "--top-k"))
    if args.ca_file is not None:
        if not args.server.startswith("wss://"):
            parser.error("--ca-file is for a wss:// server")
        if not Path(args.ca_file).is_file():
            parser.error(f"--ca-file {args.ca_file}: no such file")
    if args.bundle is not None and not Path(args.bundle).is_dir():
        parser.error(f"--bundle {args.bundle}: no such directory")
    try:
        choose_providers(args.providers)
    except ValueError as e:
        parser.error(f"--providers {args.providers}: {e}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    console = Console()
    logger = logging.getLogger("moa.edge")
    logger.addHandler(console)
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        with EdgeSession(args.bundle, args.server, args.token, args.mode, args.tree, args.on_reconnect,
                         args.row_dtype, args.timeout, providers=args.providers, threads=args.threads,
                         resync_wait_s=args.resync_wait, cafile=args.ca_file, offline_guard=offline_guard(args),
                         offline_temperature=args.offline_temperature, copy_tokens=args.copy_tokens,
                         handover=args.handover) as session:
            if args.prompt is not None:
                messages = [{"role": "system", "content": args.system}] if args.system else []
                results = [reply(session, messages + [{"role": "user", "content": args.prompt}], args, console)]
            else:
                results = chat(session, args, console)
    except LinkDown as e:
        print(f"moa-edge: error: {e} (is the server running? --mode offline generates without one)", file=sys.stderr)
        return 1
    except (EdgeError, BundleError) as e:
        print(f"moa-edge: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    unverified = sum(r.unverified for r in results)
    if args.on_reconnect == "verify" and args.mode == "speculative" and unverified:
        print(f"moa-edge: {unverified} token(s) of the reply were never verified by the target: the server did not "
              f"come back within --resync-wait {args.resync_wait:g} s", file=sys.stderr)
        return EXIT_UNVERIFIED
    return 0


if __name__ == "__main__":
    sys.exit(main())

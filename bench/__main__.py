"""`python -m bench single|edge|serve|offline|targets ...` runs a benchmark; `python -m bench prompts ...` writes a
prompt set.

    python -m bench single --prompts sharegpt --methods vanilla,lookup,eagle,moa --max-new-tokens 128 \\
        --limit 10 --out runs/bench_single
    python -m bench edge --prompts sharegpt --methods api,eagle,moa --max-new-tokens 128 --limit 10 \\
        --out runs/bench_edge
    python -m bench offline --prompts sharegpt --methods moa,eagle,lookup --cuts 16,64 --limit 10 \\
        --out runs/bench_offline
    python -m bench serve --prompts sharegpt --clients 1,2,4,8 --link lan --link 4g --max-new-tokens 64 \\
        --out runs/bench_serve
    python -m bench targets --prompts sharegpt --builds fp32,fp32-mkl,int8,bf16 --limit 10 --out runs/targets
    python -m bench prompts --set mixed --n 40 --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from bench.edge import PLAIN_METHODS
from bench.prompts import SETS, Prompt, PromptsError, builtin_prompts, load_prompts, write_prompts
from bench.runs import BenchError
from edge_client.__main__ import add_offline_guard_arguments, offline_guard
from edge_client.core import EdgeError
from models.registry import LOAD_ERRORS
from moa_core.lookup import COPY_TOKENS
from server.process import ServerStartError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("single", help="vanilla vs prompt lookup vs EAGLE-2 vs MoA on one device (PyTorch)")
    e = sub.add_parser("edge", help="api (the server generates) vs EAGLE and MoA edge bundles against the verify "
                       "server, from the edge client's side")
    o = sub.add_parser("offline", help="the disconnection experiment: MoA vs EAGLE vs prompt lookup continuing alone "
                       "after N verified tokens, scored against the target's own continuation (PyTorch, one device)")
    for b, methods in ((s, "vanilla,lookup,eagle,moa"), (e, ",".join(PLAIN_METHODS)), (o, "moa,eagle,lookup")):
        b.add_argument("--prompts", required=True, help=f"Spec-Bench jsonl file or a built-in set: {', '.join(SETS)}")
        variants = {s: "; vanilla+copy, eagle+copy, moa+copy: with copy chains (--copy-tokens)",
                    e: "; api+copy, eagle+copy, moa+copy: with copy chains (--copy-tokens); eagle-stay, moa-stay: "
                       "no handover to the server mid-reply"}.get(b, "")
        b.add_argument("--methods", default=methods, help=f"comma-separated, from {methods}{variants} (default: "
                       f"{methods})")
        b.add_argument("--out", required=True, help="output directory")
        b.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (prompt i uses seed+i)")
        b.add_argument("--limit", type=int, default=None, help="run the first N prompts only")
        b.add_argument("--no-progress", action="store_true")
    for b in (s, e):
        b.add_argument("--max-new-tokens", type=int, default=128)
        b.add_argument("--copy-tokens", type=int, default=COPY_TOKENS, help="longest copy chain of the +copy methods "
                       "(default: %(default)s)")
        b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        b.add_argument("--tree", default="auto", help="auto (cost model per method) or depth,topk,total_tokens")
    for b in (s, o):
        b.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
        b.add_argument("--target", default="default", help="target alias, Hugging Face id or path (tiny for a smoke "
                       "run)")
        b.add_argument("--dtype", default="float32")
        b.add_argument("--device", default="cpu")
        b.add_argument("--moa", default="moa", help="MoA drafter: the shipped one (moa) or a directory")
        b.add_argument("--eagle", default="eagle", help="EAGLE drafter: the shipped one (eagle) or a directory")
    o.add_argument("--cuts", default="16,64", help="drop the link after this many verified tokens (comma-separated; "
                   "default: %(default)s)")
    o.add_argument("--offline-tokens", type=int, default=32, help="tokens generated offline per cut (default: "
                   "%(default)s)")
    o.add_argument("--offline-temperature", type=float, default=0.0, help="0 = greedy (default)")
    add_offline_guard_arguments(o)
    for b, where in ((s, "the target"), (e, "the servers started here"), (o, "the target")):
        b.add_argument("--quantize", default="none", choices=("none", "int8"), help=f"{where}: none (as loaded) or "
                       "int8 (int8 Linear layers, CPU); every method runs the same target")
    e.add_argument("--threads", type=int, default=None,
                   help="ONNX Runtime threads on the edge, and torch threads of the servers started here")
    e.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "int8"),
                   help="dtype of the shipped drafters' bundles (exported on first use)")
    e.add_argument("--moa-bundle", default=None, help="MoA edge bundle directory (default: the shipped drafter's)")
    e.add_argument("--eagle-bundle", default=None, help="EAGLE edge bundle directory (default: the shipped drafter's)")
    e.add_argument("--moa-server", default=None, help="ws(s):// URL of a server with the MoA memory head (also "
                   "serves api); default: start one on loopback with the shipped drafter")
    e.add_argument("--eagle-server", default=None, help="ws(s):// URL of a server with the EAGLE memory head; "
                   "default: start one on loopback with the shipped drafter")
    e.add_argument("--token", default=None, help="bearer token for the servers")
    q = sub.add_parser("targets", aliases=["quantize"], help="builds of the target side by side (kernels, int8, "
                       "bf16): greedy agreement, call-shape consistency, weights, tokens/s, verify times")
    q.add_argument("--builds", default="fp32,int8", help="comma-separated, the first one the reference: "
                   "fp32 (oneDNN GEMM on a CPU), fp32-mkl (MKL GEMM), int8, bf16 (default: %(default)s)")
    q.add_argument("--prompts", required=True, help=f"Spec-Bench jsonl file or a built-in set: {', '.join(SETS)}")
    q.add_argument("--limit", type=int, default=None, help="run the first N prompts only")
    q.add_argument("--max-new-tokens", type=int, default=64)
    q.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    q.add_argument("--target", default="default", help="target alias, Hugging Face id or path")
    q.add_argument("--out", required=True, help="output directory")
    v = sub.add_parser("serve", help="many edges, one server: N concurrent api / EAGLE / MoA clients against "
                       "batching and FIFO servers behind an emulated link (total and per-client tokens/s, TTFT)")
    v.add_argument("--prompts", default="sharegpt", help=f"Spec-Bench jsonl file or a built-in set: {', '.join(SETS)}; "
                   "every client count answers each prompt's first turn once, client i prompts i, i+N, ... "
                   "(default: %(default)s)")
    v.add_argument("--clients", default="1,2,4,8", help="concurrent client counts (default: %(default)s)")
    v.add_argument("--link", action="append", default=None, help="emulated link, repeatable: lan, wifi, 4g, none or "
                   "rtt=MS[,bw=MBIT][,jitter=MS] (default: lan)")
    v.add_argument("--methods", default=",".join(PLAIN_METHODS), help="comma-separated, from api,eagle,moa; api+copy, "
                   "eagle+copy, moa+copy: with copy chains (default: %(default)s)")
    v.add_argument("--batching", default="on,off", help="server modes to compare: on (batching), off (FIFO) "
                   "(default: %(default)s)")
    v.add_argument("--max-new-tokens", type=int, default=64)
    v.add_argument("--tree", default="3,2,6", help="the edges' tree depth,topk,total_tokens, or auto (the cost "
                   "model, which may let the server generate alone) (default: %(default)s)")
    v.add_argument("--threads", type=int, default=None, help="torch threads of the servers (default: torch's)")
    v.add_argument("--edge-threads", type=int, default=1, help="ONNX Runtime threads per edge (default: %(default)s)")
    v.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "int8"), help="the shipped drafters' bundles")
    v.add_argument("--quantize", default="none", choices=("none", "int8"), help="the servers' target")
    v.add_argument("--target", default=None, help="the servers' --target (default: theirs)")
    for d in ("moa", "eagle"):
        v.add_argument(f"--{d}-drafter", default=None, help=f"the {d} server's --drafter (default: {d})")
        v.add_argument(f"--{d}-bundle", default=None, help=f"{d} edge bundle directory (default: the shipped one's)")
    v.add_argument("--token", default=None, help="bearer token (MOA_TOKENS of the servers started here)")
    v.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    v.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    v.add_argument("--out", required=True, help="output directory")
    v.add_argument("--no-progress", action="store_true")
    w = sub.add_parser("prompts", help="write a built-in prompt set as Spec-Bench jsonl")
    w.add_argument("--set", required=True, choices=SETS)
    w.add_argument("--n", type=int, default=None, help="first N prompts (default: all)")
    w.add_argument("--out", required=True)
    for parser in (s, e, o, q, v, w):
        parser.add_argument("--heldout", default=None, help="draw the sharegpt set from this held-out split "
                            "(heldout.jsonl written by models.train); default: the shipped "
                            "bench/sharegpt_heldout.jsonl")
    return p.parse_args(argv)


def load_models(args: argparse.Namespace, methods: list[str]):
    """The target and the drafter directories of the methods that need one (single and offline)."""
    import torch

    from models.defaults import resolve_drafter_path
    from models.registry import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    drafters = {m: str(resolve_drafter_path(getattr(args, m))) for m in ("moa", "eagle")
                if m in {x.removesuffix("+copy") for x in methods}}
    return load_target(args.target, dtype=args.dtype, device=args.device, quantize=args.quantize), drafters


def single(args: argparse.Namespace, methods: list[str], prompts: list[Prompt]) -> tuple[dict, list]:
    from bench.single import build_engines, run_single

    target, drafters = load_models(args, methods)
    engines = build_engines(target, methods, args.tree, drafters, args.copy_tokens)
    return run_single(target, engines, prompts, args.max_new_tokens, args.temperature, args.seed, drafters,
                      progress=not args.no_progress)


def edge(args: argparse.Namespace, methods: list[str], prompts: list[Prompt]) -> tuple[dict, list]:
    from bench.edge import run_edge

    def pick(kind: str) -> dict[str, str]:  # --moa-bundle / --eagle-server ... -> {drafter: value}
        return {d: getattr(args, f"{d}_{kind}") for d in ("moa", "eagle") if getattr(args, f"{d}_{kind}")}

    return run_edge(methods, prompts, args.max_new_tokens, args.temperature, args.seed, args.tree, args.dtype,
                    pick("bundle"), pick("server"), args.token, args.threads, args.quantize, args.copy_tokens,
                    progress=not args.no_progress)


def offline(args: argparse.Namespace, methods: list[str], prompts: list[Prompt]) -> tuple[dict, list]:
    from bench.offline import build_continuers, run_offline

    target, drafters = load_models(args, methods)
    continuers = build_continuers(target, methods, drafters, offline_guard(args), args.offline_temperature)
    cuts = [int(c) for c in args.cuts.split(",")]
    results, records = run_offline(target, continuers, prompts, cuts, args.offline_tokens, args.seed,
                                   progress=not args.no_progress)
    results["settings"]["drafters"] = drafters
    return results, records


def benchmark(args: argparse.Namespace) -> None:
    """Run one benchmark and write results.json, results.md, results.png, outputs.jsonl and prompts.jsonl."""
    from bench.report import markdown_table, plot, write_markdown

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    prompts = load_prompts(args.prompts, args.limit, args.heldout)
    results, runs = {"single": single, "edge": edge, "offline": offline}[args.command](args, methods, prompts)
    results["settings"]["prompts"] = args.prompts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_prompts(prompts, out / "prompts.jsonl")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    rows = (r if isinstance(r, dict) else asdict(r) for r in runs)  # offline records are dicts already
    (out / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot(results, out / "results.png")
    write_markdown(results, out / "results.md", "results.png")
    print(markdown_table(results))
    print(f"\nwrote {out}/results.json, results.md, results.png, outputs.jsonl, prompts.jsonl")


def targets(args: argparse.Namespace) -> None:
    """Builds of the target side by side; writes results.json and results.md."""
    import torch

    from bench.targets import load_build, markdown, run_targets

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit, args.heldout)
    builds = [b.strip() for b in args.builds.split(",") if b.strip()]
    results = run_targets({b: load_build(args.target, b) for b in builds}, prompts, args.max_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {out}/results.json, results.md")


def serve(args: argparse.Namespace) -> None:
    """Many clients against batching and FIFO servers; writes results.json, results.md, results.png, outputs.jsonl."""
    import os

    from bench.link import parse_link
    from bench.serve import ServeConfig, markdown, run_serve, write

    def ints(text: str, flag: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise ValueError(f"{flag} needs positive integers, got {text!r}")
        return values

    modes = [m.strip() for m in args.batching.split(",") if m.strip()]
    if not modes or set(modes) - {"on", "off"}:
        raise ValueError(f"--batching takes on, off or on,off, got {args.batching!r}")
    config = ServeConfig(
        clients=ints(args.clients, "--clients"), links=[parse_link(x) for x in (args.link or ["lan"])],
        methods=[m.strip() for m in args.methods.split(",") if m.strip()], batching=modes,
        max_new_tokens=args.max_new_tokens, tree=args.tree, threads=args.threads, edge_threads=args.edge_threads,
        dtype=args.dtype, quantize=args.quantize, server_args=["--target", args.target] if args.target else [],
        drafters={d: getattr(args, f"{d}_drafter") for d in ("moa", "eagle") if getattr(args, f"{d}_drafter")},
        bundles={d: getattr(args, f"{d}_bundle") for d in ("moa", "eagle") if getattr(args, f"{d}_bundle")},
        token=args.token, progress=not args.no_progress)
    if args.token:
        os.environ.setdefault("MOA_TOKENS", args.token)  # the servers started here accept it
    prompts = load_prompts(args.prompts, args.limit, args.heldout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = run_serve(config, prompts, partial=out / "partial.jsonl")
    write(results, out)
    write_prompts(prompts, out / "prompts.jsonl")
    print(markdown(results))
    print(f"wrote {out}/results.json, results.md, results.png, outputs.jsonl, prompts.jsonl")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.command in ("single", "edge", "offline"):
            benchmark(args)
        elif args.command == "serve":
            serve(args)
        elif args.command in ("targets", "quantize"):
            targets(args)
        else:
            prompts = builtin_prompts(args.set, args.heldout)[: args.n]
            write_prompts(prompts, args.out)
            print(f"wrote {len(prompts)} prompts to {args.out}")
    except (PromptsError, ValueError, BenchError, ServerStartError, EdgeError, *LOAD_ERRORS) as e:
        sys.exit(f"error: {e}")  # what the user can fix; anything else is a bug and keeps its traceback


if __name__ == "__main__":
    main()

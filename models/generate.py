"""Generate text on one device: `python -m models.generate --drafter moa "prompt"`.

Streams the answer to stdout and a stats line to stderr; `--json` prints one JSON object instead (text, token_ids,
stats, finish_reason). `--chat FILE.json` takes chat messages (a list of {role, content}, or {"messages": [...]}).

    python -m models.generate --drafter moa "Write a haiku about the sea."
    python -m models.generate --drafter lookup --chat chat.json --max-new-tokens 256 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from moa_core.lookup import COPY_TOKENS

DRAFTERS = ("moa", "eagle", "lookup", "none")
QUANTIZE = ("none", "int8")  # models.target.QUANTIZE, without importing torch before --help
QUANTIZE_HELP = "target Linear layers: none (as loaded, the default) or int8 (CPU; about 2x faster, see the README)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m models.generate", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", help="the user message (or use --chat)")
    p.add_argument("--chat", help="JSON file with chat messages")
    p.add_argument("--drafter", default="moa", help=f"{' | '.join(DRAFTERS)} or a drafter directory")
    p.add_argument("--target", default="default", help="target alias, Hugging Face id or path")
    p.add_argument("--tree", default="auto", help="auto (cost model) or depth,topk,total_tokens")
    p.add_argument("--copy-tokens", type=int, default=None, help="also verify up to N tokens copied from where "
                   f"the text's last tokens occurred before; 0 = off (default: {COPY_TOKENS} with moa or eagle, 0 with "
                   "none; lookup takes none)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft-precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="the PyTorch drafter's: auto = bf16 where the hardware has bf16 matmuls (the target verifies "
                        "in --dtype, so output is unchanged)")
    p.add_argument("--quantize", default="none", choices=QUANTIZE, help=QUANTIZE_HELP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.chat is None):
        p.error("give either a prompt or --chat FILE.json")
    return args


def read_chat(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ValueError(f"{path}: expected a list of {{role, content}} messages or {{\"messages\": [...]}}")
    return messages


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from models.registry import load_drafter, load_target
    from models.engine import SpeculativeEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        prompt = read_chat(args.chat) if args.chat else args.prompt
        target = load_target(args.target, dtype=args.dtype, device=args.device, quantize=args.quantize)
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the answer (tree auto reports its choice)
            name = args.drafter
            drafter = None if name == "none" else name if name == "lookup" else load_drafter(name, target)
            engine = SpeculativeEngine(target, drafter, tree=args.tree, copy_tokens=args.copy_tokens,
                                       draft_precision=args.draft_precision)
    except (OSError, ValueError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    streamer = None if args.json else lambda text: print(text, end="", flush=True)
    res = engine.generate(prompt, args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.stop, streamer,
                          args.seed)
    s = res.stats
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": s.as_dict(),
                          "finish_reason": res.finish_reason}))
    else:
        print()
        print(f"[{args.drafter}, tree {s.tree}] {s.new_tokens} tokens in {s.total_s:.2f} s ({s.tokens_per_s:.1f} "
              f"tokens/s), tau {s.tau:.2f}, {s.target_forwards} target forwards, finish: {res.finish_reason}",
              file=sys.stderr)


if __name__ == "__main__":
    main()

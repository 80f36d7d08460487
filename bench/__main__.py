"""`python -m bench single ...` runs the single-device benchmark; `python -m bench prompts ...` writes a prompt set.

    python -m bench single --prompts sharegpt --methods vanilla,lookup,eagle,moa --max-new-tokens 128 \\
        --limit 10 --out runs/bench_single
    python -m bench prompts --set mixed --n 40 --out prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from bench.prompts import HELDOUT, SETS, PromptsError, builtin_prompts, load_prompts, write_prompts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("single", help="vanilla vs prompt lookup vs EAGLE-2 vs MoA on one device")
    s.add_argument("--prompts", required=True, help=f"Spec-Bench jsonl file or a built-in set: {', '.join(SETS)}")
    s.add_argument("--methods", default="vanilla,lookup,eagle,moa", help="comma-separated: vanilla,lookup,eagle,moa")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (prompt i uses seed+i)")
    s.add_argument("--tree", default="auto", help="auto (cost model per method) or depth,topk,total_tokens")
    s.add_argument("--limit", type=int, default=None, help="run the first N prompts only")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    s.add_argument("--target", default="default", help="target alias, Hugging Face id or path (tiny for a smoke run)")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--device", default="cpu")
    s.add_argument("--moa", default="moa", help="MoA drafter: the shipped one (moa) or a directory")
    s.add_argument("--eagle", default="eagle", help="EAGLE drafter: the shipped one (eagle) or a directory")
    s.add_argument("--no-progress", action="store_true")
    w = sub.add_parser("prompts", help="write a built-in prompt set as Spec-Bench jsonl")
    w.add_argument("--set", required=True, choices=SETS)
    w.add_argument("--n", type=int, default=None, help="first N prompts (default: all)")
    w.add_argument("--out", required=True)
    for parser in (s, w):
        parser.add_argument("--heldout", default=str(HELDOUT), help="held-out split behind the sharegpt set")
    return p.parse_args(argv)


def single(args: argparse.Namespace) -> None:
    import torch

    from bench.report import markdown_table, plot, write_markdown
    from bench.single import build_engines, run_single
    from models.defaults import resolve_drafter_path
    from models.target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    prompts = load_prompts(args.prompts, args.limit, args.heldout)
    drafters = {m: str(resolve_drafter_path(getattr(args, m))) for m in ("moa", "eagle") if m in methods}
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    engines = build_engines(target, methods, args.tree, drafters)
    results, runs = run_single(target, engines, prompts, args.max_new_tokens, args.temperature, args.seed,
                               drafters, progress=not args.no_progress)
    results["settings"]["prompts"] = args.prompts
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_prompts(prompts, out / "prompts.jsonl")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "outputs.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in runs))
    plot(results, out / "results.png")
    write_markdown(results, out / "results.md", "results.png")
    print(markdown_table(results))
    print(f"\nwrote {out}/results.json, results.md, results.png, outputs.jsonl, prompts.jsonl")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.command == "single":
            single(args)
        else:
            prompts = builtin_prompts(args.set, args.heldout)[: args.n]
            write_prompts(prompts, args.out)
            print(f"wrote {len(prompts)} prompts to {args.out}")
    except (PromptsError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()

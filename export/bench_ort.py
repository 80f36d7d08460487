"""Draft-step latency on ONNX Runtime, fp32 against int8, and bundle sizes.

    python -m export.bench_ort --drafter default --out runs/bench_ort.json

Exports the drafter as an fp32 and an int8 bundle (parity checked, acceptance skipped), then times one draft
step for 1 token and for a tree frontier of 4 tokens over a self-attention cache of 256 slots and 256 memory
rows (zeros of the right shapes: latency does not depend on the values). `--drafter untrained` times
an untrained drafter of the default size, for when no trained one has been shipped yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Sequence

import onnxruntime

from moa_core.budget import draft_inputs, time_calls
from edge_client.bundle import load_bundle
from edge_client.runtime import OrtDraftStep
from export.to_onnx import export_bundle


def time_step(step: OrtDraftStep, args: tuple, repeats: int) -> dict:
    times = [t * 1e3 for t in time_calls(lambda: step(*args), repeats, warmup=3)]
    return {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": min(times)}


def bench_bundle(path: Path, cache: int, rows: int, repeats: int, threads: int | None) -> dict:
    step = OrtDraftStep(load_bundle(path), providers="cpu", threads=threads)
    b = step.bundle
    result = {"provider": step.provider,
              "bundle_mib": {n: r["bytes"] / 2**20 for n, r in step.bundle.meta["files"].items()},
              "parity": step.bundle.meta["checks"]["parity"]}
    for n in (1, 4):
        result[f"step_{n}_tokens"] = time_step(step, draft_inputs(step, n, b.row_width, b.hidden_size, cache, rows),
                                               repeats)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.bench_ort", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="default",
                        help="drafter directory, default | moa | eagle, or 'untrained' (a fresh default-size MoA)")
    parser.add_argument("--target", default="default", help="the drafter's target (default: %(default)s)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--bundles", default=None, help="where to keep the exported bundles (default: a temp dir)")
    parser.add_argument("--cache", type=int, default=256, help="self-attention cache slots (default %(default)s)")
    parser.add_argument("--memory", type=int, default=256, help="memory rows (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per case (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="ORT intra-op threads, 0 = ORT's choice (default 1)")
    args = parser.parse_args(argv)

    from models.registry import build_drafter, load_target

    target = load_target(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        drafter = args.drafter
        if drafter == "untrained":
            drafter = Path(tmp) / "untrained"
            build_drafter("moa", target).save_pretrained(drafter)
        root = Path(args.bundles or tmp)
        report = {"drafter": args.drafter, "untrained": args.drafter == "untrained", "target": target.name,
                  "cache": args.cache, "memory": args.memory, "repeats": args.repeats, "threads": args.threads,
                  "onnxruntime": onnxruntime.__version__, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
        for dtype in ("fp32", "int8"):
            export_bundle(drafter, root / dtype, dtype, target, heldout_prompts=(), log=lambda s: None)
            report[dtype] = bench_bundle(root / dtype, args.cache, args.memory, args.repeats, args.threads or None)
            r = report[dtype]
            print(f"{dtype}: drafter.onnx {r['bundle_mib']['drafter.onnx']:.1f} MiB, 1 token "
                  f"{r['step_1_tokens']['median_ms']:.2f} ms, 4 tokens {r['step_4_tokens']['median_ms']:.2f} ms "
                  f"(median of {args.repeats}, cache {args.cache}, memory {args.memory}, {r['provider']})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

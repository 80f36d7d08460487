"""Draft-step latency on ONNX Runtime, fp32 against int8, and bundle sizes.

    python -m export.bench_ort --drafter default --out runs/bench_ort.json

Exports the drafter as an fp32 and an int8 bundle (parity checked, acceptance skipped), then times one draft
step for 1 token and for a tree frontier of 4 tokens over a self-attention cache of 256 slots and 256 memory
rows (random inputs of the right shapes: latency does not depend on the values). `--drafter untrained` times
an untrained drafter of the default size, for when no trained one has been shipped yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime

from edge_client.bundle import load_bundle
from edge_client.runtime import OrtDraftStep
from export.to_onnx import export_bundle


def step_inputs(step: OrtDraftStep, n: int, cache: int, rows: int, rng: np.random.Generator) -> tuple:
    """DraftStep arguments for n tokens (a tree frontier: each sees the cache and itself) after `cache` slots."""
    b = step.bundle
    h, d = b.cache_shape
    mask = np.zeros((n, cache + n), np.float32)
    mask[:, cache:] = np.where(np.eye(n, dtype=bool), 0.0, -np.inf)
    memory = rng.standard_normal((rows, b.row_width), dtype=np.float32)
    features = rng.standard_normal((n, b.meta["hidden_size"]), dtype=np.float32)
    return (rng.integers(0, b.meta["vocab_size"], n), np.full(n, cache), rng.standard_normal((h, cache, d), np.float32),
            rng.standard_normal((h, cache, d), np.float32), mask, memory, features)


def time_step(step: OrtDraftStep, args: tuple, repeats: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        step(*args)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step(*args)
        times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": min(times)}


def bench_bundle(path: Path, cache: int, rows: int, repeats: int, threads: int | None) -> dict:
    step = OrtDraftStep(load_bundle(path), providers="cpu", threads=threads)
    rng = np.random.default_rng(0)
    result = {"provider": step.provider,
              "bundle_mib": {n: r["bytes"] / 2**20 for n, r in step.bundle.meta["files"].items()},
              "parity": step.bundle.meta["checks"]["parity"]}
    for n in (1, 4):
        result[f"step_{n}_tokens"] = time_step(step, step_inputs(step, n, cache, rows, rng), repeats)
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

    from models.drafter import build_drafter
    from models.target import load_target

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

"""What one training step costs, phase by phase: the frozen target forward (or reading the feature cache), the
drafter forward, the loss, the backward; MoA and EAGLE, fp32 and bf16 autocast, side by side in one run.

    python -m bench.train_step --threads 1 --out runs/bench_train_step

Writes results.json, results.md and results.png (stacked seconds per step). Sequences are random token ids with
the shape of real batches (`--batch` x `--length`, a response mask over all but the first 64 positions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from models.data import Encoded
from models.drafter import trainable_parameters
from models.features import FeatureCache, build_cache
from models.registry import load_drafter, load_target
from models.train import TrainConfig, collate, train_step_loss

PHASES = ("target", "drafter+loss", "backward")


def time_step(drafter, target, batch, cfg: TrainConfig, cache: FeatureCache | None, step: int) -> dict:
    ids, resp, lens = collate(batch)
    t0 = time.perf_counter()
    if cache is not None:
        full = cache.step(list(range(len(batch))), ids.shape[1])
    else:
        full = target.full_forward(ids, attention_mask=torch.ones_like(ids), precision=cfg.precision)
    t1 = time.perf_counter()
    (loss, _), tokens = train_step_loss(drafter, target, ids, resp, lens, cfg, step, 0.0, full)
    t2 = time.perf_counter()
    loss.backward()
    drafter.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return {"target": t1 - t0, "drafter+loss": t2 - t1, "backward": t3 - t2, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default")
    p.add_argument("--archs", default="moa,eagle")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per case (after one warm-up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = load_target(args.target)
    g = torch.Generator().manual_seed(0)
    batch = [Encoded(str(i), torch.randint(0, target.spec.vocab_size, (args.length,), generator=g).tolist(),
                     [0] * 64 + [1] * (args.length - 64)) for i in range(args.batch)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_cache(target, batch, Path(tmp), precision="fp32", tokens_per_batch=args.batch * args.length)
        cache = FeatureCache.open(tmp, batch, target, need_kv=True)
        for arch in args.archs.split(","):
            drafter = load_drafter(arch, target).float().train()
            trainable_parameters(drafter)
            for precision in args.precisions.split(","):
                cfg = TrainConfig(arch=arch, precision=precision)
                for source, c in (("target", None), ("cache", cache)):
                    times = [time_step(drafter, target, batch, cfg, c, i) for i in range(args.repeats + 1)][1:]
                    med = {k: statistics.median(t[k] for t in times) for k in PHASES}
                    total = sum(med.values())
                    rows.append({"arch": arch, "precision": precision, "features": source, **med, "step_s": total,
                                 "tokens_per_s": times[0]["tokens"] / total})
                    print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("target", "batch", "length", "repeats", "threads")}
    (out / "results.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2) + "\n")
    lines = ["| drafter | precision | features from | target s | drafter+loss s | backward s | step s | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arch']} | {r['precision']} | {r['features']} | {r['target']:.2f} | {r['drafter+loss']:.2f} | "
              f"{r['backward']:.2f} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} |" for r in rows]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out / "results.png")


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['arch']}\n{r['precision']}\n{r['features']}" for r in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 4))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [r[phase] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per step")
    ax.set_title("Training step cost by phase")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()

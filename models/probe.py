"""Linear probes: how much of the target's next-token view each stage of MoA's memory path still carries.

For every response position of some training rows, ridge-regress the target's last hidden state (the LM head's
input) from a feature: the last target layer's raw [key; value], the last two layers', the plain mean of all
layers', and for each drafter its LSA output m_t and its memory row. The score is the top-1 agreement, through
the target's LM head, of the probe's prediction with the target's own next token on held-out rows' positions.
A stage that scores far below the one before it loses what the drafter would need (README, "Why MoA is stuck").

    python -m models.probe --drafter models/default/moa --data data/leg14 --out runs/probe.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from models.data import Encoded, load_encoded, write_json
from models.drafter import Drafter
from models.registry import load_drafter, load_target
from models.target import Target


@torch.no_grad()
def features(target: Target, drafters: dict[str, Drafter], rows: list[Encoded], max_len: int = 512
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each probed feature (n, width) at the rows' response positions, and the target's last hidden state (n, H)."""
    out: dict[str, list[torch.Tensor]] = {}
    hidden = []
    for row in rows:
        ids = torch.tensor([row.ids[:max_len]], device=target.device)
        resp = torch.tensor(row.response_mask[:max_len], dtype=torch.bool, device=target.device)
        step = target.full_forward(ids)
        kv = torch.cat([step.keys[0], step.values[0]], dim=-1)  # (L, n, 2w)
        found = {"last layer [k;v]": kv[-1], "last 2 layers [k;v]": kv[-2:].permute(1, 0, 2).flatten(1),
                 "mean of all layers [k;v]": kv.mean(0)}
        positions = torch.arange(ids.shape[1], device=ids.device).view(1, -1)
        for name, d in drafters.items():
            m = d.summary(step)
            found[f"{name}: m_t"] = m[0]
            found[f"{name}: memory row"] = d.ca.memory(m, positions)[0]  # CA's key and value
        for key, value in found.items():
            out.setdefault(key, []).append(value[resp].double())
        hidden.append(step.hidden[0][resp].double())
    return {k: torch.cat(v) for k, v in out.items()}, torch.cat(hidden)


def ridge_top1(x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor, head: torch.nn.Module,
               alpha: float = 1e-2) -> float:
    """Fit y ~ [x, 1] W with a ridge of alpha x the mean squared feature per row; top-1 agreement through `head`."""
    def bias(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.ones(len(t), 1, dtype=t.dtype, device=t.device)], dim=1)

    x, x_test = bias(x), bias(x_test)
    ridge = alpha * x.pow(2).mean() * len(x) * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    w = torch.linalg.solve(x.T @ x + ridge, x.T @ y)
    dtype = head.weight.dtype
    with torch.no_grad():
        agree = head((x_test @ w).to(dtype)).argmax(-1) == head(y_test.to(dtype)).argmax(-1)
    return agree.double().mean().item()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="target alias, HF id or local path")
    p.add_argument("--drafter", nargs="*", default=[], help="MoA drafters whose m_t and memory rows to probe")
    p.add_argument("--data", required=True, help="data directory with train.jsonl and heldout.jsonl (models.train)")
    p.add_argument("--train-rows", type=int, default=60, help="rows whose positions fit the probes")
    p.add_argument("--heldout-rows", type=int, default=12, help="held-out rows whose positions score them")
    p.add_argument("--alpha", type=float, default=1e-2, help="ridge strength, relative to the features' scale")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="", help="write the scores here as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    drafters = {path: load_drafter(path, target).float() for path in args.drafter}
    if any(d.arch != "moa" for d in drafters.values()):
        p.error("--drafter takes MoA drafters (the probes read m_t and memory rows)")
    data = Path(args.data)
    x, y = features(target, drafters, load_encoded(data / "train.jsonl")[: args.train_rows])
    x_test, y_test = features(target, drafters, load_encoded(data / "heldout.jsonl")[: args.heldout_rows])
    scores = {"train_positions": len(y), "heldout_positions": len(y_test)}
    for name in x:
        scores[name] = round(ridge_top1(x[name], y, x_test[name], y_test, target.lm_head, args.alpha), 4)
        print(f"{name:<50s} width {x[name].shape[1]:5d}  top-1 {scores[name]:.3f}", flush=True)
    if args.out:
        write_json(args.out, scores)
    return scores


if __name__ == "__main__":
    main()

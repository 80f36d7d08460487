"""Held-out evaluation that predicts speed: per-depth top-1 agreement after a sync point.

For sync points s inside held-out responses, the drafter is fed the true tokens x_{s+1}, x_{s+2}, ... with the
memory frozen at s, exactly as it drafts a chain at run time (EAGLE feeds its own predicted features back). At
depth d we compare its top-1 token with the target's greedy token at s+d. The expected chain acceptance length
(bonus token included) is 1 + sum_d prod_{j<=d} a_j; `tau_measured` is 1 + the mean run of leading matches.
Top-w agreement (the target's token among the drafter's w best) feeds the tree cost model. Given several drafters,
each after the first is compared with it on the same answers (`paired_difference`): is a gap more than the noise?

`rows` sends the drafter's view of the target (MoA's memory rows, EAGLE's hidden states) through the wire codec
first, as the edge receives it in client-server mode:

    python -m models.evaluate --drafter models/default/moa models/default/eagle --rows fp32,int8 --out runs/eval.json
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from moa_core import protocol
from moa_core.budget import expected_tau
from models.data import DataStats, Encoded, as_encoded, encode_samples, iter_source, write_json
from models.drafter import Drafter
from models.moa import extend
from models.registry import LOAD_ERRORS, load_drafter, load_target
from models.target import Target

ROWS = ("fp32",) + protocol.ROW_DTYPES
RESAMPLES = 2000  # bootstrap resamples of the answers for a difference's interval


@torch.no_grad()
def chain_agreement(
    drafter: Drafter,
    target: Target,
    samples: list[Encoded],
    depth: int = 6,
    sync_every: int = 7,
    max_len: int = 512,
    rows: str = "fp32",
) -> dict:
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}, got {rows!r}")
    was_training = drafter.training
    drafter.eval()
    widths = (1, 2, 4, 8)
    hits = torch.zeros(len(widths), depth)  # target's greedy token within the drafter's top-w, per depth
    total = 0
    runs: list[int] = []
    answer_hits, answer_points = [], []  # per answer: top-1 hits per depth, sync points (for paired_difference)
    for sample in samples:
        ids = torch.tensor(sample.ids[:max_len]).view(1, -1)
        resp = sample.response_mask[:max_len]
        t = ids.shape[1]
        full = target.full_forward(ids)
        greedy = target.lm_head(full.hidden[0]).argmax(-1)
        positions = torch.arange(t).view(1, t)
        memory = wire(drafter.memory_rows(full, positions), rows)
        hidden = wire(full.hidden, rows)
        mask = torch.full((t, t), float("-inf"), dtype=full.hidden.dtype).triu(1).view(1, 1, t, t)
        whole = drafter.draft_step(ids, positions, None, None, mask, memory=memory, features=_shift(hidden))
        starts = [s for s in range(t - depth - 1) if resp[s + 1] and resp[s + depth] and (s % sync_every == 0)]
        before = hits[0].clone()
        for s in starts:
            k, v = whole.keys[:, :, : s + 1], whole.values[:, :, : s + 1]
            feat = hidden[:, s : s + 1]
            # TLI: the target's last layers see its own K/V of the verified tokens, then the drafted ones'
            tli = {"tli_past": drafter.target_context(full.keys[:, :, : s + 1], full.values[:, :, : s + 1])} \
                if drafter.tli_layers else {}
            run, leading = 0, True
            for d in range(1, depth + 1):
                i = s + d
                out = drafter.draft_step(ids[:, i : i + 1], positions[:, i : i + 1], k, v, None,
                                         memory=memory[:, : s + 1], features=feat, **tli)
                k, v, feat = out.keys, out.values, out.features
                if tli:
                    tli["tli_past"] = extend(tli["tli_past"], out.tli_kv)
                ranked = drafter.token_ids(out.logits[0, -1].topk(max(widths)).indices)
                for w_i, w in enumerate(widths):
                    hits[w_i, d - 1] += bool((ranked[:w] == greedy[i]).any())
                ok = bool(ranked[0] == greedy[i])
                leading = leading and ok
                run += leading
            runs.append(run)
            total += 1
        answer_hits.append((hits[0] - before).int().tolist())
        answer_points.append(len(starts))
    drafter.train(was_training)
    rates = (hits / max(total, 1)).tolist()
    return {"depth_agreement": rates[0], "expected_tau": expected_tau(rates[0]),
            "tau_measured": 1 + sum(runs) / max(len(runs), 1), "sync_points": total,
            "depth_agreement_topk": {str(w): r for w, r in zip(widths, rates)},
            "per_answer": {"hits": answer_hits, "sync_points": answer_points}}


def paired_difference(a: dict, b: dict, seed: int = 0) -> dict:
    """b's expected tau minus a's (two `chain_agreement` results on the same answers), with a 95 % interval from
    resampling the answers, the same resample for both: two drafters share the hard answers, so the gap between
    them is far less noisy than either figure alone."""
    points = np.asarray(a["per_answer"]["sync_points"])
    if not np.array_equal(points, b["per_answer"]["sync_points"]):
        raise ValueError("the two drafters were scored on different answers or sync points")
    picks = np.random.default_rng(seed).integers(0, len(points), (RESAMPLES, len(points)))

    def taus(hits: list[list[int]]) -> np.ndarray:
        rates = np.asarray(hits, dtype=np.float64)[picks].sum(1) / np.maximum(points[picks].sum(1), 1)[:, None]
        return 1 + np.cumprod(rates, axis=1).sum(1)

    spread = taus(b["per_answer"]["hits"]) - taus(a["per_answer"]["hits"])
    return {"difference": b["expected_tau"] - a["expected_tau"], "answers": len(points),
            "ci95": [float(np.quantile(spread, 0.025)), float(np.quantile(spread, 0.975))]}


def wire(x: torch.Tensor, rows: str) -> torch.Tensor:
    """x (..., width) as the edge gets it: through protocol.encode_rows / decode_rows (fp32: unchanged)."""
    if rows == "fp32":
        return x
    flat = x.detach().reshape(-1, x.shape[-1]).float().cpu().numpy()
    back = protocol.decode_rows(protocol.encode_rows(flat, rows))
    return torch.from_numpy(back).to(x.device, x.dtype).view_as(x)


def _shift(hidden: torch.Tensor) -> torch.Tensor:
    """EAGLE's input features: position t gets the target feature of t-1."""
    return torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="default", help="target alias, HF id or local path")
    p.add_argument("--drafter", nargs="+", default=["moa", "eagle"],
                   help="drafters to evaluate: paths or default|moa|eagle (default: the shipped two)")
    p.add_argument("--heldout", default="datasets/smollm2-heldout.jsonl.gz",
                   help="held-out conversations (jsonl, .gz or not; a models.train data dir's heldout.jsonl works), "
                        "in file order (default: the target's answers to the benchmark prompts, as in training)")
    p.add_argument("--samples", type=int, default=52, help="conversations evaluated (the first N that encode)")
    p.add_argument("--depth", type=int, default=6, help="chain depth after each sync point")
    p.add_argument("--sync-every", type=int, default=7, help="a sync point every N response positions")
    p.add_argument("--max-len", type=int, default=512, help="truncate conversations to this many tokens")
    p.add_argument("--rows", default="fp32", help=f"comma-separated codecs of the drafter's view, from {ROWS}")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", default="", help="write the results here as JSON")
    args = p.parse_args(argv)
    codecs = args.rows.split(",")
    if bad := [c for c in codecs if c not in ROWS]:
        p.error(f"--rows: unknown {bad}, choose from {ROWS}")
    torch.set_num_threads(args.threads)
    try:
        return evaluate(args, codecs)
    except LOAD_ERRORS as e:
        sys.exit(f"error: {e}")


def evaluate(args: argparse.Namespace, codecs: list[str]) -> dict:
    """Each drafter of `args.drafter` on the held-out answers, the first one paired against the others."""
    target = load_target(args.target)
    drafters = {path: load_drafter(path, target) for path in args.drafter}  # a bad path fails before any work
    stats = DataStats()
    rows = encode_samples(iter_source(args.heldout), target.tokenizer, args.max_len, stats, args.samples)
    if not rows:
        sys.exit(f"error: --heldout {args.heldout}: no usable conversation ({stats.summary()})")
    samples = as_encoded(rows)
    results: dict = {"heldout": args.heldout, "samples": len(samples), "data": stats.summary(), "drafters": {},
                     "comparisons": {}}
    for path, drafter in drafters.items():
        for codec in codecs:
            ev = chain_agreement(drafter, target, samples, args.depth, args.sync_every, args.max_len, codec)
            results["drafters"].setdefault(path, {})[codec] = ev
            depths = " ".join(f"{a:.3f}" for a in ev["depth_agreement"])
            print(f"{path:<28s} {codec:<5s} expected tau {ev['expected_tau']:.4f}  measured {ev['tau_measured']:.3f}"
                  f"  depth 1..{args.depth}: {depths}", flush=True)
            if path != args.drafter[0]:
                first = args.drafter[0]
                diff = paired_difference(results["drafters"][first][codec], ev)
                results["comparisons"].setdefault(f"{path} - {first}", {})[codec] = diff
                print(f"{'':<28s} {codec:<5s} minus {first}: {diff['difference']:+.4f} (95 % interval "
                      f"{diff['ci95'][0]:+.4f} .. {diff['ci95'][1]:+.4f}, {diff['answers']} answers resampled)",
                      flush=True)
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()

"""Held-out evaluation that predicts speed: per-depth top-1 agreement after a sync point.

For sync points s inside held-out responses, the drafter is fed the true tokens x_{s+1}, x_{s+2}, ... with the
memory frozen at s, exactly as it drafts a chain at run time (EAGLE feeds its own predicted features back). At
depth d we compare its top-1 token with the target's greedy token at s+d. The expected chain acceptance length
(bonus token included) is 1 + sum_d prod_{j<=d} a_j; `tau_measured` is 1 + the mean run of leading matches.
Top-w agreement (the target's token among the drafter's w best) feeds the tree cost model.
"""

from __future__ import annotations

import torch

from moa_core.budget import expected_tau
from models.data import Encoded
from models.drafter import Drafter
from models.target import Target


@torch.no_grad()
def chain_agreement(
    drafter: Drafter,
    target: Target,
    samples: list[Encoded],
    depth: int = 6,
    sync_every: int = 7,
    max_len: int = 512,
) -> dict:
    was_training = drafter.training
    drafter.eval()
    widths = (1, 2, 4, 8)
    hits = torch.zeros(len(widths), depth)  # target's greedy token within the drafter's top-w, per depth
    total = 0
    runs: list[int] = []
    for sample in samples:
        ids = torch.tensor(sample.ids[:max_len]).view(1, -1)
        resp = sample.response_mask[:max_len]
        t = ids.shape[1]
        full = target.full_forward(ids)
        greedy = target.lm_head(full.hidden[0]).argmax(-1)
        positions = torch.arange(t).view(1, t)
        memory = drafter.memory_rows(full, positions)
        mask = torch.full((t, t), float("-inf"), dtype=full.hidden.dtype).triu(1).view(1, 1, t, t)
        whole = drafter.draft_step(ids, positions, None, None, mask, memory=memory, features=_shift(full.hidden))
        starts = [s for s in range(t - depth - 1) if resp[s + 1] and resp[s + depth] and (s % sync_every == 0)]
        for s in starts:
            k, v = whole.keys[:, :, : s + 1], whole.values[:, :, : s + 1]
            feat = full.hidden[:, s : s + 1]
            run, leading = 0, True
            for d in range(1, depth + 1):
                i = s + d
                out = drafter.draft_step(ids[:, i : i + 1], positions[:, i : i + 1], k, v, None,
                                         memory=memory[:, : s + 1], features=feat)
                k, v, feat = out.keys, out.values, out.features
                ranked = drafter.token_ids(out.logits[0, -1].topk(max(widths)).indices)
                for w_i, w in enumerate(widths):
                    hits[w_i, d - 1] += bool((ranked[:w] == greedy[i]).any())
                ok = bool(ranked[0] == greedy[i])
                leading = leading and ok
                run += leading
            runs.append(run)
            total += 1
    drafter.train(was_training)
    rates = (hits / max(total, 1)).tolist()
    return {"depth_agreement": rates[0], "expected_tau": expected_tau(rates[0]),
            "tau_measured": 1 + sum(runs) / max(len(runs), 1), "sync_points": total,
            "depth_agreement_topk": {str(w): r for w, r in zip(widths, rates)}}


def _shift(hidden: torch.Tensor) -> torch.Tensor:
    """EAGLE's input features: position t gets the target feature of t-1."""
    return torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)

"""`--tree auto`: the draft tree budget (depth, frontier width) that maximises predicted tokens per second.

Tokens per second of a tree with depth D and frontier width k is tau(D, k) / (draft time + verify time + link
time), where tau(D, k) = 1 + sum_{d<=D} prod_{j<=d} a_j(k) uses the drafter's held-out top-k agreement per depth
(from its training record), the draft time is one priming call plus D-1 calls over k frontier nodes, the verify
time is the target's forward over 1 + D*k tokens, and the link time is one round trip (0 on one device). All
times are measured where they are spent: on one device by the engine (models/costmodel.py); between an edge and a
server, the server measures its verify times at start and sends them in `welcome`, the edge measures its own
draft step and the round trip. On a CPU a bigger verify costs much more; on a big GPU 64 tokens cost about what
one does, and the same code picks a wider tree. Torch-free: the edge uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from edge_client.tree import TreeConfig

DEPTHS = range(1, 9)
WIDTHS = (1, 2, 4, 8)
MAX_TREE = 65  # the largest verify measured: root + 8 x 8
FALLBACK_AGREEMENT = [0.6, 0.5, 0.45, 0.4, 0.35, 0.3]  # used when a drafter has no held-out record


def expected_tau(agreement: list[float]) -> float:
    """Expected tokens per target forward of a chain with these per-depth acceptance rates (bonus included)."""
    tau, prod = 1.0, 1.0
    for a in agreement:
        prod *= a
        tau += prod
    return tau


def agreement_table(topk: Mapping | None) -> dict[int, list[float]]:
    """Per-width, per-depth acceptance estimates: a training record's `depth_agreement_topk` ({width: [a_1..]}),
    or a generic guess without one."""
    if not topk:
        return {w: [min(0.95, 1 - (1 - a) ** w) for a in FALLBACK_AGREEMENT] for w in WIDTHS}
    return {int(w): list(v) for w, v in topk.items()}


def tree_sizes(limit: int = MAX_TREE) -> list[int]:
    """Token counts of every candidate verify (root + depth * width), up to `limit`."""
    return sorted({1} | {n for d in DEPTHS for w in WIDTHS if (n := 1 + d * w) <= limit})


def time_calls(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def time_call(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of `fn` after one warm-up call."""
    return float(np.median(time_calls(fn, repeats)))


def measure_verify(forward: Callable[[int], object], limit: int = MAX_TREE) -> dict[int, float]:
    """Seconds of `forward(n)` (a target forward over n new tokens) for every candidate size, timed at a few sizes
    and interpolated linearly between them. 1 and 2 are both timed: on a CPU one token takes a matrix-vector path
    and two already cost up to twice as much, which decides whether a chain pays."""
    sizes = tree_sizes(limit)
    probe = sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s <= sizes[-1]} | {sizes[-1]})
    measured = [time_call(lambda: forward(n)) for n in probe]
    return {n: float(np.interp(n, probe, measured)) for n in sizes}


def draft_inputs(step, n: int, row_width: int, hidden_size: int, context: int = 256, memory: int = 256) -> tuple:
    """Arguments of one draft step over a tree frontier of n nodes (each sees the cache and itself) after `context`
    cached slots, with `memory` memory rows, for any step with the DraftStep signature. Latency does not depend on
    the values, so they are zeros."""
    heads, head_dim = step.cache_shape
    cache = np.zeros((heads, context, head_dim), np.float32)
    mask = np.zeros((n, context + n), np.float32)
    mask[:, context:] = np.where(np.eye(n, dtype=bool), 0.0, -np.inf)
    return (np.full(n, 1), np.full(n, context), cache, cache, mask, np.zeros((memory, row_width), np.float32),
            np.zeros((n, hidden_size), np.float32))


def measure_draft(step, row_width: int, hidden_size: int, context: int = 256) -> dict[int, float]:
    """Seconds of one draft step over w nodes (w in WIDTHS) with a draft cache and memory of `context` (ONNX Runtime
    on the edge, PyTorch on one device)."""
    def timed(w: int) -> float:
        args = draft_inputs(step, w, row_width, hidden_size, context, context)
        return time_call(lambda: step(*args))

    return {w: timed(w) for w in WIDTHS}


@dataclass
class Choice:
    tree: TreeConfig
    tau: float  # predicted tokens per round
    tokens_per_s: float  # predicted
    baseline_tokens_per_s: float  # one token per target forward of 1: vanilla, or the server alone (api)

    @property
    def pays(self) -> bool:
        return self.tokens_per_s >= self.baseline_tokens_per_s

    def describe(self) -> str:
        return (f"depth={self.tree.depth} topk={self.tree.topk} total_tokens={self.tree.total_tokens}, predicted tau "
                f"{self.tau:.2f}, {self.tokens_per_s:.1f} tokens/s vs {self.baseline_tokens_per_s:.1f} without a drafter")


def choose(agreement: dict[int, list[float]], draft_s: Mapping[int, float], verify_s: Mapping[int, float],
           link_s: float = 0.0) -> Choice:
    """The budget with the most predicted tokens per second among those whose verify size was measured."""
    best: Choice | None = None
    for w in WIDTHS:
        acc = agreement.get(w)
        if not acc:
            continue
        for depth in DEPTHS:
            n = 1 + depth * w
            if n not in verify_s:
                continue
            tau = expected_tau((acc + [acc[-1] * 0.9 ** i for i in range(1, 9)])[:depth])
            seconds = draft_s[1] + (depth - 1) * draft_s[w] + verify_s[n] + link_s
            if best is None or tau / seconds > best.tokens_per_s:
                best = Choice(TreeConfig(depth, w, depth * w), tau, tau / seconds, 0.0)
    if best is None:
        raise ValueError("no candidate tree: no measured verify size fits")
    best.baseline_tokens_per_s = 1.0 / verify_s[1]
    return best

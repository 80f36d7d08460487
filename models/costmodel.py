"""`--tree auto`: choose the draft tree budget from a measured cost model.

Tokens per second of a tree with depth D and frontier width k is tau(D, k) / (draft time + verify time), where
tau(D, k) = 1 + sum_{d<=D} prod_{j<=d} a_j(k) uses the drafter's held-out top-k agreement per depth (from its
training record), the draft time is one priming call plus D-1 calls over k frontier nodes, and the verify time
is the target's measured forward time over 1 + D*k tokens on this machine. On a CPU a bigger verify costs much
more; on a big GPU 64 tokens cost about what 1 does, and the same code picks a wider tree.
"""

from __future__ import annotations

import time

import numpy as np

from edge_client.tree import TreeConfig
from models.evaluate import expected_tau

DEPTHS = range(1, 9)
WIDTHS = (1, 2, 4, 8)
FALLBACK_AGREEMENT = [0.6, 0.5, 0.45, 0.4, 0.35, 0.3]  # used when a drafter has no held-out record


def agreement_table(drafter) -> dict[int, list[float]]:
    """Per-width, per-depth acceptance estimates from the drafter's training record."""
    record = getattr(drafter, "training_record", None) or {}
    topk = record.get("heldout", {}).get("depth_agreement_topk")
    if not topk:
        return {w: [min(0.95, 1 - (1 - a) ** w) for a in FALLBACK_AGREEMENT] for w in WIDTHS}
    return {int(w): list(v) for w, v in topk.items()}


def _time(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def measure(engine, context: int = 256) -> dict:
    """Target forward time by token count and drafter step time by node count, on this machine."""
    target = engine.target
    runner = target.new_runner()
    ids = [i % target.spec.vocab_size for i in range(10, 10 + context)]  # any in-vocabulary ids will do
    runner.forward(ids)

    def verify(n):
        runner.forward(ids[:n])
        runner.crop(context)

    sizes = sorted({1} | {1 + d * w for d in DEPTHS for w in WIDTHS if 1 + d * w <= 65})
    probe = [s for s in (1, 4, 8, 16, 32, 64) if s <= max(sizes)] + [max(sizes)]
    measured = {n: _time(lambda: verify(n)) for n in sorted(set(probe))}
    xs = sorted(measured)
    verify_s = {n: float(np.interp(n, xs, [measured[x] for x in xs])) for n in sizes}

    step = engine.step
    h, d = step.cache_shape
    k = np.zeros((h, context, d), dtype=np.float32)
    memory = np.zeros((context, step.drafter.row_width), dtype=np.float32)
    feats = np.zeros((8, target.spec.hidden_size), dtype=np.float32)

    def draft(n):
        mask = np.zeros((n, context + n), dtype=np.float32)
        step(np.array(ids[:n]), np.arange(n) + context, k, k, mask, memory, feats[:n])

    draft_s = {w: _time(lambda: draft(w)) for w in WIDTHS}
    return {"verify_s": verify_s, "draft_s": draft_s}


def choose(agreement: dict[int, list[float]], costs: dict) -> tuple[TreeConfig, dict]:
    best, best_rate, table = None, -1.0, []
    for w in WIDTHS:
        acc = agreement.get(w)
        if not acc:
            continue
        for depth in DEPTHS:
            a = (acc + [acc[-1] * 0.9 ** i for i in range(1, 9)])[:depth]
            tau = expected_tau(a)
            n = 1 + depth * w
            if n not in costs["verify_s"]:
                continue
            seconds = costs["draft_s"][1] + (depth - 1) * costs["draft_s"][w] + costs["verify_s"][n]
            rate = tau / seconds
            table.append({"depth": depth, "topk": w, "total_tokens": depth * w, "tau": tau, "s": seconds})
            if rate > best_rate:
                best, best_rate = TreeConfig(depth, w, depth * w), rate
    return best, {"candidates": table, "tokens_per_s": best_rate}


def auto_tree(engine, verbose: bool = True) -> TreeConfig:
    costs = measure(engine)
    tree, info = choose(agreement_table(engine.drafter), costs)
    if verbose:
        vanilla = 1.0 / costs["verify_s"][1]
        print(f"tree auto: depth={tree.depth} topk={tree.topk} total_tokens={tree.total_tokens} "
              f"(predicted {info['tokens_per_s']:.1f} tokens/s vs vanilla {vanilla:.1f}; verify of 1 token "
              f"{costs['verify_s'][1]*1e3:.0f} ms, draft step {costs['draft_s'][1]*1e3:.1f} ms)", flush=True)
        if info["tokens_per_s"] < vanilla:
            print("tree auto: warning: with this drafter's measured acceptance, speculation is predicted to be "
                  "slower than vanilla decoding on this machine", flush=True)
    return tree

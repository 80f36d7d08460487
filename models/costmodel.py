"""`--tree auto` on one device, and the server's costs for the edge's: the target side of moa_core/budget.py
(which states the cost model)."""

from __future__ import annotations

import numpy as np

from moa_core.budget import (MAX_TREE, Costs, TreeTuner, agreement_table, by_size, time_call, time_interleaved,
                             verify_probes)
from moa_core.tree import DraftTree
from models.target import Target, TargetStep
from models.verify import verify_tree

CONTEXTS = (128, 512)  # where verify rounds are timed: a short prompt, and a long chat


def _slice(step: TargetStep, start: int, end: int) -> TargetStep:
    return TargetStep(None, step.hidden[start:end], step.keys[:, start:end], step.values[:, start:end])


def measure_costs(target: Target, memory_head=None, limit: int = MAX_TREE) -> Costs:
    """Time what rounds cost on this target: verify rounds as the engine and the server run them (tree forward,
    the LM head over every row, keep, the root's memory rows when `memory_head` is given), plain decode steps,
    memory rows per token and the prefill, at each of CONTEXTS. Decode steps and verify rounds are timed in turns:
    what decides the budget is their ratio."""
    ids = [10 + i % (target.spec.vocab_size - 10) for i in range(max(CONTEXTS) + limit)]  # any in-vocabulary ids

    def rows(step: TargetStep, start: int) -> None:
        if memory_head is not None:
            memory_head.memory_rows(step, list(range(start, start + step.hidden.shape[0])))

    verify_s, decode_s = [], []
    for context in CONTEXTS:
        runner = target.new_runner()
        prefill = runner.forward(ids[:context], logits="last")

        def verify(n: int) -> None:
            tree = DraftTree(np.asarray(ids[context + 1:context + n]), np.arange(-1, n - 2), np.arange(1, n),
                             np.zeros((n, 1), np.int64), np.zeros((n, 1), np.float32))
            verified = verify_tree(runner, ids[context], tree)
            rows(verified.step, context)
            runner.crop(context)

        def decode() -> None:
            runner.forward(ids[context:context + 1])
            runner.crop(context)

        timed = time_interleaved({"decode": decode, **{n: (lambda n=n: verify(n)) for n in verify_probes(limit)}},
                                 repeats=3)
        decode_s.append(timed.pop("decode"))
        verify_s.append(by_size(timed, limit))
    one, five = (time_call(lambda k=k: rows(_slice(prefill, 0, k), 0)) for k in (1, 5))
    n = CONTEXTS[0]
    prefill_s = time_call(lambda: target.new_runner().forward(ids[:n], logits="last"), repeats=1) / n
    prompt_rows_s = time_call(lambda: rows(_slice(prefill, 0, n), 0), repeats=1) / n
    return Costs(list(CONTEXTS), verify_s, decode_s, max(0.0, (five - one) / 4), prefill_s, prompt_rows_s)


def auto_tree(engine, verbose: bool = True) -> TreeTuner:
    """Measure the target and the drafter on this machine and pick the budget (printed when `verbose`); the tuner
    chooses it again from the rounds observed."""
    costs = engine.costs
    context = sum(CONTEXTS) / 2
    draft_s = engine.draft_s
    tuner = TreeTuner(agreement_table(engine.drafter.agreement_topk), draft_s, costs.verify(context),
                      row_s=costs.row_s, baseline_s=costs.decode(context))
    choice = tuner.choice
    if verbose:
        print(f"tree auto: {choice.describe()} (verify round of 1 token {costs.verify(context)[1] * 1e3:.0f} ms, "
              f"decode step {costs.decode(context) * 1e3:.0f} ms, draft step {draft_s[1] * 1e3:.1f} ms)", flush=True)
        if not choice.pays:
            print("tree auto: with this drafter's measured acceptance, speculation is predicted to be slower than "
                  "vanilla decoding on this machine: decoding plainly, trying speculation again now and then",
                  flush=True)
    return tuner

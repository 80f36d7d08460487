"""`--tree auto` on one device, and the server's verify costs for the edge's: the target side of
edge_client/budget.py (which states the cost model)."""

from __future__ import annotations

from edge_client.budget import MAX_TREE, agreement_table, choose, measure_draft, measure_verify
from edge_client.tree import TreeConfig
from models.target import Target


def measure_target(target: Target, context: int = 256, limit: int = MAX_TREE) -> dict[int, float]:
    """Seconds of a target forward over n new tokens after `context` cached ones, for every candidate tree size."""
    runner = target.new_runner()
    ids = [i % target.spec.vocab_size for i in range(10, 10 + context + limit)]  # any in-vocabulary ids will do
    runner.forward(ids[:context])

    def forward(n: int) -> None:
        runner.forward(ids[context:context + n])
        runner.crop(context)

    return measure_verify(forward, limit)


def auto_tree(engine, verbose: bool = True) -> TreeConfig:
    """Measure the target and the drafter on this machine and pick the budget (printed when `verbose`)."""
    verify_s = measure_target(engine.target)
    draft_s = measure_draft(engine.step, engine.drafter.row_width, engine.target.spec.hidden_size)
    choice = choose(agreement_table(engine.drafter.agreement_topk), draft_s, verify_s)
    if verbose:
        print(f"tree auto: {choice.describe()} (verify of 1 token {verify_s[1] * 1e3:.0f} ms, draft step "
              f"{draft_s[1] * 1e3:.1f} ms)", flush=True)
        if not choice.pays:
            print("tree auto: warning: with this drafter's measured acceptance, speculation is predicted to be "
                  "slower than vanilla decoding on this machine", flush=True)
    return choice.tree

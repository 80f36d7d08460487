"""Tree auto's cost model (moa_core/budget.py): the budget follows the measured costs."""

import json

import numpy as np
import pytest

from moa_core.budget import WIDTHS, Choice, Forecast, agreement_table, choose, expected_tau, tree_sizes

AGREEMENT = agreement_table({"1": [0.6] * 6, "2": [0.7] * 6, "4": [0.8] * 6, "8": [0.85] * 6})
DRAFT = {w: 0.001 for w in WIDTHS}


def test_expected_tau():
    assert expected_tau([]) == 1.0 and expected_tau([0.5, 0.5]) == 1.75


def test_budget_follows_the_costs():
    flat = {n: 0.010 for n in tree_sizes()}  # a big GPU: 65 tokens cost what 1 does
    steep = {n: 0.010 * n for n in tree_sizes()}  # a small CPU: every token costs
    gpu, cpu = choose(AGREEMENT, DRAFT, flat), choose(AGREEMENT, DRAFT, steep)
    assert gpu.tree.total_tokens > cpu.tree.total_tokens
    assert gpu.tokens_per_s > gpu.baseline_tokens_per_s and gpu.tau > cpu.tau
    far = choose(AGREEMENT, DRAFT, steep, link_s=0.2)  # a slow link: fewer, bigger rounds pay
    assert far.tree.total_tokens > cpu.tree.total_tokens


def test_budget_stays_within_the_measured_sizes():
    small = {n: 0.01 for n in tree_sizes(limit=9)}  # a server that verifies at most 9 tokens
    choice = choose(AGREEMENT, DRAFT, small)
    assert choice.tree.total_tokens + 1 <= 9
    assert choose(agreement_table(None), DRAFT, small).tree.total_tokens + 1 <= 9  # no record: a generic guess


def test_single_device_tree_auto_measures_and_picks(tiny, capsys):
    from models.registry import build_drafter
    from models.engine import SpeculativeEngine

    tree = SpeculativeEngine(tiny, build_drafter("moa", tiny), tree="auto").tree
    assert tree.total_tokens == tree.depth * tree.topk and 1 + tree.total_tokens in tree_sizes()
    assert f"tree auto: depth={tree.depth} topk={tree.topk}" in capsys.readouterr().out


def test_pacer_follows_what_it_observes():
    """Predicted to pay; observed rounds that lose switch to the baseline; probes bring speculation back once the
    rounds pay again."""
    from moa_core.budget import Pacer

    choice = choose(AGREEMENT, DRAFT, {n: 0.010 for n in tree_sizes()})
    pacer = Pacer(choice, probe_after=8)
    assert choice.pays and pacer.pays and pacer.speculate()
    for _ in range(12):  # 1 token per 30 ms against 10 ms per baseline token: within about 1 / weight rounds
        pacer.observe(True, 1, 0.030)
    assert not pacer.pays and not pacer.speculate()
    for _ in range(7):
        pacer.observe(False, 1, 0.010)
    assert not pacer.speculate()
    pacer.observe(False, 1, 0.010)
    assert pacer.speculate() and not pacer.pays  # a probe
    for _ in range(10):  # the machine changed: rounds pay now
        pacer.observe(True, 4, 0.012)
    assert pacer.pays and pacer.speculate()


def test_pacer_is_not_fooled_by_a_load_that_comes_and_goes():
    """The baseline's rate was observed on a quiet machine; then the load doubles every target forward while
    speculation runs. Counted as observed, the rounds would lose to the stale baseline and speculation would be
    dropped; with the target's time taken at its predicted cost the verdict stays."""
    from moa_core.budget import Pacer

    choice = choose(AGREEMENT, DRAFT, {n: 0.010 for n in tree_sizes()})
    naive, pacer = Pacer(choice), Pacer(choice)
    for p in (naive, pacer):
        for _ in range(5):
            p.observe(False, 1, 0.010, 0.010, 0.010)
    for _ in range(30):  # 2 tokens per round: 2 ms drafting, a 10 ms verify that now takes 25 ms
        naive.observe(True, 2, 0.027)
        pacer.observe(True, 2, 0.027, 0.025, 0.010)
    assert not naive.pays and pacer.pays
    for _ in range(30):  # fewer tokens per round is what the load cannot hide: dropped
        pacer.observe(True, 1, 0.027, 0.025, 0.010)
    assert not pacer.pays


def replay(pacer, replies: list[list[int]], round_s: float, plain_s: float) -> float:
    """Speedup over plain decoding of a Pacer (None: always speculate) on recorded acceptance: per reply, the tokens
    each speculative round of a fixed tree gained; a round that starts k tokens into a recorded one gains the rest."""
    seconds = tokens = 0.0
    for reply in replies:
        gain = [n - k for n in reply for k in range(n)]
        if pacer is not None:
            pacer.restart()
        i = 0
        while i < len(gain):
            speculate = pacer is None or pacer.speculate()
            n = min(gain[i] if speculate else 1, len(gain) - i)
            if pacer is not None:
                pacer.observe(speculate, n, round_s if speculate else plain_s)
            seconds, tokens, i = seconds + (round_s if speculate else plain_s), tokens + n, i + n
    return tokens * plain_s / seconds


def test_pacer_keeps_a_drafter_that_pays_through_unlucky_rounds():
    """Replayed acceptance of 128-token replies, a round costing 1.9 decode steps: a drafter gaining 2.6 tokens a
    round in runs of luck pays 1.3x always speculating, and the Pacer keeps nearly all of it; one gaining 1.3 loses
    a third, and the Pacer stays near plain decoding; when half the prompts draft well and half badly, it follows
    them. The control, the Pacer as it was (weight 0.3, each reply judged by the end of the last), dropped the good
    drafter after a few unlucky rounds and kept 1.0x."""
    from moa_core.budget import Pacer
    from moa_core.tree import TreeConfig

    rng = np.random.default_rng(0)

    def replies(p: list[float], n: int = 40) -> list[list[int]]:
        out = []
        for _ in range(n):
            gains = list(1 + rng.choice(len(p), 128, p=p))
            out.append(gains[: int(np.searchsorted(np.cumsum(gains), 128)) + 1])
        return out

    good, bad, slim = replies([0.2, 0.3, 0.3, 0.2]), replies([0.75, 0.2, 0.05]), replies([0.3, 0.3, 0.2, 0.2])
    mixed = [r for pair in zip(good[:20], bad[:20]) for r in pair]
    round_s, plain_s = 0.130, 0.068
    choice = Choice(TreeConfig(3, 4, 12), 2.58, round_s, plain_s)  # what the cost model predicted
    always = replay(None, good, round_s, plain_s)
    assert always > 1.25 and replay(None, bad, round_s, plain_s) < 0.75
    assert replay(Pacer(choice), good, round_s, plain_s) > 0.95 * always
    assert replay(Pacer(choice), bad, round_s, plain_s) > 0.98
    assert replay(Pacer(choice), mixed, round_s, plain_s) > 1.05
    # a drafter that pays by less (2.3 tokens a round): ten unlucky rounds average below break-even often, and a
    # drop lasts the reply; the band keeps it, the Pacer that dropped it as soon as it looked slower did not
    slim_always = replay(None, slim, round_s, plain_s)
    assert 1.1 < slim_always < 1.25
    assert replay(Pacer(choice), slim, round_s, plain_s) > 0.98 * slim_always
    assert replay(Pacer(choice, drop_margin=0.0), slim, round_s, plain_s) < 0.96 * slim_always

    class Before(Pacer):
        def restart(self) -> None:  # the verdict carried over from the end of the last reply
            pass

    assert replay(Before(choice, weight=0.3), good, round_s, plain_s) < 1.1


def test_pacer_retimes_a_verify_round_against_a_decode_step():
    """Start-up timed a verify round as cheap as a decode step (a load spike while the decode step was timed);
    really it costs 4 of them. Counted at the prediction, speculation would run on at a loss; re-timed side by
    side every few rounds, the verify round's cost is corrected and speculation dropped. A load that slows both
    modes alike moves nothing."""
    from moa_core.budget import Pacer

    choice = choose(AGREEMENT, DRAFT, {n: 0.010 for n in tree_sizes()})
    trusting, pacer = Pacer(choice), Pacer(choice, retime_after=4)
    for p in (trusting, pacer):
        for _ in range(40):
            if p.speculate():  # 2 tokens a round: 1 ms drafting, a verify predicted at 10 ms that takes 40
                p.observe(True, 2, 0.041, 0.040, 0.010)
            else:
                p.observe(False, 1, 0.010, 0.010, 0.010)
    assert trusting.pays and trusting.verify_scale == 1.0
    assert not pacer.pays and pacer.verify_scale > 2.0

    loaded = Pacer(choice, retime_after=4)
    for _ in range(40):  # everything at 2.5x its prediction, both modes alike
        if loaded.speculate():
            loaded.observe(True, 2, 0.026, 0.025, 0.010)
        else:
            loaded.observe(False, 1, 0.025, 0.025, 0.010)
    assert loaded.pays and loaded.verify_scale == pytest.approx(1.0)


def test_tree_tuner_follows_the_tokens_rounds_gain():
    """Where every verified token costs, the held-out table picks a tree 3 deep and 4 wide; rounds that gain less than
    it predicts make the tuner scale the table down until it predicts them, and choose a smaller tree, which
    is then predicted faster than the first at the scaled rates. Rounds that gain what was predicted change
    nothing."""
    from moa_core.budget import Pacer, TreeTuner, predict

    steep = {n: 0.004 + 0.0001 * n for n in tree_sizes()}
    tuner = TreeTuner(AGREEMENT, DRAFT, steep, baseline_s=0.005)
    first = tuner.choice
    pacer = Pacer(first)
    low = int(first.tau)
    for i in range(200):  # rounds that gain what it predicted, on average
        tuner.observe(first.tree, low + (i < 200 * (first.tau - low)))
    assert tuner.scale() == pytest.approx(1.0, abs=0.05) and tuner.retune(pacer) is None
    assert tuner.choice.tree == first.tree and tuner.observed() == {first.tree: 200}
    for _ in range(200):  # rounds that beat the table: it stays the ceiling (they say nothing of deeper drafts)
        tuner.observe(first.tree, first.tree.depth + 1)
    assert tuner.scale() == 1.0 and tuner.retune(pacer) is None

    tuner = TreeTuner(AGREEMENT, DRAFT, steep, baseline_s=0.005)
    for _ in range(400):
        tuner.observe(first.tree, 2)  # 2 tokens a round, far below the prediction
    note = tuner.retune(pacer)
    second = tuner.choice
    assert note and str(second.tree.depth) in note and tuner.scale() < 0.8
    assert 1 + second.tree.total_tokens < 1 + first.tree.total_tokens
    table = tuner.scaled(tuner.scale())
    assert predict(first.tree, table, DRAFT, steep).tau == pytest.approx((400 * 2 + 32 * first.tau) / 432, rel=0.01)
    assert second.tokens_per_s > predict(first.tree, table, DRAFT, steep).tokens_per_s
    assert pacer.rates()[0] == pytest.approx(second.tokens_per_s)  # the pacer follows the new tree

    again = TreeTuner(AGREEMENT, DRAFT, steep, baseline_s=0.005, margin=10.0)  # nothing is 10x faster: it stays
    for _ in range(400):
        again.observe(first.tree, 2)
    assert again.retune(Pacer(first)) is None and again.choice.tree == first.tree


def test_costs_travel_and_interpolate():
    from moa_core.budget import Costs

    costs = Costs([100, 500], [{1: 0.01, 9: 0.02}, {1: 0.03, 9: 0.06}], [0.009, 0.027], 0.001, 0.002, 0.0005)
    back = Costs.from_wire(json.loads(json.dumps(costs.to_wire())))
    assert back == costs
    assert back.verify(300) == pytest.approx({1: 0.02, 9: 0.04}) and back.decode(300) == pytest.approx(0.018)
    assert back.verify_at(300, 5) == pytest.approx(0.03)


def test_forecast_starts_at_the_prior_and_follows_what_it_observes():
    f = Forecast(lambda prompt, new: (0.01 * prompt, 0.1 * new), min_tokens=32)
    assert f.seconds(100, 50) == pytest.approx(1.0 + 5.0)
    before = f.copy()
    f.observe(100, 2.0, 40, 8.0)  # this machine is twice as slow as measured
    assert before.seconds(100, 50) == pytest.approx(6.0)  # a copy keeps the forecast made before
    assert f.seconds(100, 50) == pytest.approx(2.0 + 10.0)
    f.observe(100, 1.0, 40, 4.0)  # ... and then as fast as measured: the older generation counts half
    assert f.seconds(100, 50) == pytest.approx(100 * 2.0 / 150 + 50 * 8.0 / 60)
    assert Forecast(lambda prompt, new: None).seconds(10, 10) is None
    few = Forecast(lambda prompt, new: None, min_tokens=32)
    few.observe(40, 0.4, 10, 1.0)  # the prefill is known, the per-token cost not yet
    assert few.seconds(10, 10) is None
    few.observe(40, 0.4, 30, 3.0)
    assert few.seconds(10, 10) == pytest.approx(10 * 0.6 / 60 + 10 * 3.5 / 35)

"""Single-device engine on tiny float64 targets (and their int8 versions): lossless greedy, lossless sampling, tree
masks."""

import logging
from collections import Counter

import numpy as np
import pytest
import torch

from moa_core.budget import tree_sizes
from moa_core.tree import DraftTree, TreeConfig, ancestor_matrix, build_tree, graft
from moa_core.lookup import COPY_TOKENS
from models.engine import SpeculativeEngine, TorchDraftStep
from models.verify import Sampling, tree_mask_and_positions
from tests.helpers import (chi_square_p, first_two, greedy_continuations, joint_first_two, lossless_forwards,
                           train_tiny)


@pytest.fixture(scope="module")
def drafters(tiny):
    return {arch: train_tiny(tiny, arch) for arch in ("moa", "eagle")}


def test_tree_mask_sees_exactly_the_ancestors():
    parents = np.array([-1, -1, 0, 0, 2, 1])
    depths = np.array([1, 1, 2, 2, 3, 2])
    tree = DraftTree(np.arange(6), parents, depths, np.zeros((7, 1), np.int64), np.zeros((7, 1), np.float32))
    mask, pos = tree_mask_and_positions(tree, 10, torch.float64, "cpu")
    assert pos.tolist() == [10, 11, 11, 12, 12, 13, 12]
    for i in range(7):
        seen = {j for j in range(7) if mask[i, j] == 0}
        expected, node = {0, i}, i - 1
        while node >= 0:
            expected.add(node + 1)
            node = int(parents[node])
        assert seen == expected, i
    with pytest.raises(ValueError, match="parent must precede"):
        ancestor_matrix(np.array([-1, 2, 0]))


def test_tree_budget_is_a_subtree():
    rng = np.random.default_rng(0)

    def expand(nodes, tokens, parents, depths):
        logits = rng.normal(size=(len(nodes), 10)).astype(np.float32) * 3
        from moa_core.tree import topk_logprobs
        return topk_logprobs(logits, 6)

    for cfg in [TreeConfig(5, 1, 5), TreeConfig(4, 3, 9), TreeConfig(6, 4, 20)]:
        tree = build_tree(expand, cfg)
        assert len(tree) == min(cfg.total_tokens, len(tree))
        assert len(tree) <= cfg.total_tokens and tree.depths.max() <= cfg.depth
        for i, p in enumerate(tree.parents):
            assert p < i and (p == -1 or tree.depths[p] == tree.depths[i] - 1)
        if cfg.topk == 1:
            assert tree.parents.tolist() == [-1, 0, 1, 2, 3]


@pytest.mark.parametrize("arch", ["moa", "eagle"])
@pytest.mark.parametrize("tree", ["5,1,5", "4,2,8", "5,4,16"])
def test_greedy_is_lossless(tiny, drafters, arch, tree):
    vanilla, spec = lossless_forwards(tiny, SpeculativeEngine(tiny, drafters[arch], tree=tree))
    assert spec < 0.6 * vanilla, (vanilla, spec)  # the drafter really gets paths accepted


def test_graft_follows_the_tree_then_adds_a_chain():
    q = np.ones((4, 2), np.int64)
    tree = DraftTree(np.array([5, 6, 7]), np.array([-1, -1, 0]), np.array([1, 1, 2]), q, q.astype(np.float32),
                     origin=np.array([0, 2, 4]))
    out = graft(tree, [5, 7, 8, 9])  # 5 and 7 are nodes 0 and 2, 8 and 9 are new below node 2
    assert out.tokens.tolist() == [5, 6, 7, 8, 9] and out.parents.tolist() == [-1, -1, 0, 2, 3]
    assert out.depths.tolist() == [1, 1, 2, 3, 4] and out.origin.tolist() == [0, 2, 4, -1, -1]
    assert out.q_ids.shape == (6, 2) and not out.q_probs[4:].any()  # no draft distribution below copied nodes
    assert graft(tree, [6]).tokens.tolist() == [5, 6, 7]  # already in the tree: nothing added
    assert graft(tree, [1, 2]).parents.tolist() == [-1, -1, 0, -1, 3]  # a new branch at the root


@pytest.mark.parametrize("arch", ["moa", "eagle"])
def test_copy_chains_are_lossless(tiny, drafters, arch):
    """Copy chains grafted onto the drafter's tree, alone in rounds the Pacer decodes plainly, and without a
    drafter."""
    vanilla = SpeculativeEngine(tiny, None)
    grafted = SpeculativeEngine(tiny, drafters[arch], tree="4,2,8", copy_tokens=8)
    alone = SpeculativeEngine(tiny, drafters[arch], tree="auto", copy_tokens=8)
    undrafted = SpeculativeEngine(tiny, None, copy_tokens=8)
    losing = SpeculativeEngine(tiny, None, copy_tokens=8)
    for _ in range(10):  # the drafter does not pay: plain rounds, and copy rounds where the text repeats
        alone.pacer.observe(True, 1, 1.0)
        losing.copy_pacer(8).observe(True, 1, 1.0)  # nor would copies under sampling (a high temperature)
    copied = [0, 0, 0]
    for sample in greedy_continuations(tiny, 3, seed=0) + greedy_continuations(tiny, 2, seed=7):
        prompt = sample.ids[:6]
        want = vanilla.generate(prompt, max_new_tokens=40).token_ids
        for i, engine in enumerate((grafted, alone, undrafted)):
            out = engine.generate(prompt, max_new_tokens=40)
            assert out.token_ids == want
            copied[i] += out.stats.copy_rounds
        out = losing.generate(prompt, max_new_tokens=40)
        assert out.token_ids == want and out.stats.copy_rounds > 0  # greedy copies always
        sampled = losing.generate(prompt, max_new_tokens=40, temperature=0.5, seed=0)
        assert sampled.stats.copy_rounds <= 1  # plain decoding (a probe after 64 tokens at most: none in 40)
    assert min(copied) > 0, copied  # the tiny target's text repeats: chains were really verified
    with pytest.raises(ValueError, match="copy_tokens must be >= 0"):
        SpeculativeEngine(tiny, drafters[arch], copy_tokens=-1)
    with pytest.raises(ValueError, match="copy_tokens must be >= 0"):
        SpeculativeEngine(tiny, "lookup", copy_tokens=8)
    assert SpeculativeEngine(tiny, None).copy_tokens == 0 == SpeculativeEngine(tiny, "lookup").copy_tokens
    assert SpeculativeEngine(tiny, drafters[arch]).copy_tokens == COPY_TOKENS
    sampled = 0  # sampling copies too (its distribution: test_sampling_keeps_the_target_distribution)
    for seed in range(3):  # with the tree fixed (no Pacer decides on timings), a seed repeats the text
        a, b = (grafted.generate([3, 5, 7], max_new_tokens=40, temperature=0.5, seed=seed) for _ in range(2))
        assert len(a.token_ids) > 0 and a.token_ids == b.token_ids
        sampled += a.stats.copy_rounds
    assert sampled > 0


def test_int8_warns_on_a_cpu_without_int8_dot_products(tmp_path, caplog, monkeypatch):
    import models.quant as quant

    cpus = {"avx2": "flags\t\t: fpu sse avx avx2 fma\n", "vnni": "flags\t\t: avx2 avx512f avx512_vnni\n",
            "arm": "Features\t: fp asimd asimddp\n"}
    for name, text in cpus.items():
        (tmp_path / name).write_text(text)
    assert [quant.int8_matmuls_native(tmp_path / n) for n in (*cpus, "unreadable")] == [False, True, True, None]
    for native, warned in ((False, True), (True, False), (None, False)):
        caplog.clear()
        monkeypatch.setattr(quant, "int8_matmuls_native", lambda: native)
        with caplog.at_level(logging.WARNING, logger="moa.quant"):
            assert quant.quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())) == 1
        assert ("twice as slowly" in caplog.text) == warned


def test_int8_target_is_batch_invariant_and_greedy_lossless():
    """Per-token activation scales, an exact integer matmul and row-by-row attention: a token's output does not depend
    on the rest of the call, so a tree verify sees what one-token decoding sees and greedy speculation on the int8
    target equals its vanilla decoding."""
    from models.quant import Int8Linear
    from models.tiny import tiny_target

    tiny = tiny_target(dtype=torch.float32)
    drafter = train_tiny(tiny, "moa")
    weights = tiny.fingerprint
    tiny.quantize_int8()
    assert isinstance(tiny.lm_head, Int8Linear) and tiny.fingerprint != weights == tiny.weights_fingerprint
    x = torch.randn(5, tiny.spec.hidden_size)
    assert torch.equal(tiny.lm_head(x)[1:2], tiny.lm_head(x[1:2]))  # the layer itself: exact, row by row
    runner = tiny.new_runner()
    runner.forward([5, 9, 11])
    alone = runner.forward([20]).logits[0]
    runner.crop(3)
    assert torch.equal(runner.forward([20, 70, 3, 44]).logits[0], alone)
    vanilla, spec = SpeculativeEngine(tiny, None), SpeculativeEngine(tiny, drafter, tree="4,2,8")
    forwards = [0, 0]
    for sample in greedy_continuations(tiny, 3, seed=1):
        a, b = vanilla.generate(sample.ids[:6], max_new_tokens=40), spec.generate(sample.ids[:6], max_new_tokens=40)
        assert a.token_ids == b.token_ids
        forwards[0] += a.stats.target_forwards
        forwards[1] += b.stats.target_forwards
    assert forwards[1] < 0.8 * forwards[0], forwards  # paths really get accepted


def test_real_int8_target_is_call_shape_invariant_and_greedy_lossless():
    """The real target in int8: a chain verified in one call, a tree whose accepted path is not its first branch, and
    a prefill give the logits of one-token decoding bit for bit (with a fused attention kernel they differ by up to
    ~2 and flip argmaxes), and greedy speculation with the shipped MoA drafter equals int8 vanilla decoding."""
    from models.registry import load_drafter, load_target

    target = load_target("default", quantize="int8")
    prompt = target.encode_chat([{"role": "user", "content": "Explain how a bicycle gear works."}])
    runner = target.new_runner()
    seq = [int(runner.forward(prompt, logits="last").logits[0].argmax())]
    alone = []
    for _ in range(10):
        alone.append(runner.forward(seq[-1:]).logits[0])
        seq.append(int(alone[-1].argmax()))
    alone = torch.stack(alone)
    runner.crop(len(prompt))
    assert torch.equal(runner.forward(seq[:10]).logits, alone)  # a chain
    runner.crop(len(prompt))
    wrong = (seq[1] + 7) % target.spec.vocab_size
    parents = np.array([-1, -1, 1, 2])  # root, then a wrong first child, the true path under the second one
    tree = DraftTree(np.array([wrong, *seq[1:4]]), parents, np.array([1, 1, 2, 3]), np.zeros((5, 1), np.int64),
                     np.zeros((5, 1), np.float32))
    mask, positions = tree_mask_and_positions(tree, len(prompt), torch.float32, "cpu")
    logits = runner.forward([seq[0], wrong, *seq[1:4]], positions=positions, tree_mask=mask).logits
    assert torch.equal(logits[[0, 2, 3, 4]], alone[:4])
    prefilled = target.new_runner()
    assert torch.equal(prefilled.forward(prompt + seq[:3]).logits[-3:], alone[:3])  # a prefill of the same tokens
    vanilla = SpeculativeEngine(target, None)
    spec = SpeculativeEngine(target, load_drafter("default", target), tree="4,2,8")
    for question in ("What is the capital of France?", "Write a haiku about the sea."):
        p = target.encode_chat([{"role": "user", "content": question}])
        assert spec.generate(p, max_new_tokens=32).token_ids == vanilla.generate(p, max_new_tokens=32).token_ids


def test_each_generation_is_predicted_before_it_runs(tiny, drafters):
    spec = SpeculativeEngine(tiny, drafters["moa"], tree="auto")  # tree auto measures the costs
    prompt = greedy_continuations(tiny, 1, seed=3)[0].ids[:6]
    first = spec.generate(prompt, max_new_tokens=40).stats
    assert first.new_tokens == 40
    assert first.predicted_s == pytest.approx(sum(spec.prior_s(len(prompt), 40)))  # nothing observed: the model
    second = spec.generate(prompt, max_new_tokens=40).stats
    prefill = spec.prior_s(len(prompt), 40)[0]  # 6 prompt tokens observed: too few, still the model's
    # 40 new tokens observed: the forecast follows their cost, the first generation's time less its prefill
    assert prefill < second.predicted_s < prefill + first.total_s
    assert SpeculativeEngine(tiny, None).generate(prompt, max_new_tokens=4).stats.predicted_s is None  # not measured


def test_engine_decodes_plainly_while_speculation_does_not_pay(tiny, drafters, caplog):
    vanilla = SpeculativeEngine(tiny, None)
    spec = SpeculativeEngine(tiny, drafters["moa"], tree="auto", copy_tokens=0)  # the drafter's rounds alone
    prompt = greedy_continuations(tiny, 1, seed=3)[0].ids[:6]
    want = vanilla.generate(prompt, max_new_tokens=30).token_ids
    assert spec.predict_s(len(prompt), 30) > 0 and spec.choice is not None
    for _ in range(10):  # rounds that made one token a second (a tiny target's real rates are too close to call)
        spec.pacer.observe(True, 1, 1.0)
    with caplog.at_level(logging.WARNING, logger="moa.engine"):
        out = spec.generate(prompt, max_new_tokens=30)
    said = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert said in ([], ["tree auto: speculation does not pay"])  # at most once (tree auto may have said it)
    assert out.token_ids == want and out.stats.plain_rounds == len(out.stats.acceptance_lengths) == 30
    for _ in range(100):  # rounds that pay (the 1-second rounds fade at 0.9 a round)
        spec.pacer.observe(True, 8, 1e-5)
    out = spec.generate(prompt, max_new_tokens=30)
    assert out.token_ids == want and out.stats.plain_rounds < len(out.stats.acceptance_lengths)


def test_tree_auto_is_chosen_again_from_the_rounds(tiny, drafters):
    """Each generation runs the tree the tuner holds when it starts; every speculative round of the drafter is
    observed; outputs stay lossless whatever the tree. Costs where speculation always pays: a verify round
    cheap against a decode step."""
    from moa_core.budget import Costs

    verify = {n: 0.001 + 0.0001 * n for n in tree_sizes()}
    costs = Costs([128, 512], [verify, verify], [0.01, 0.01], 0.0, 0.0, 0.0)
    spec = SpeculativeEngine(tiny, drafters["moa"], tree="auto", copy_tokens=0, costs=costs)
    vanilla = SpeculativeEngine(tiny, None)
    rounds = 0
    for seed in range(4):
        prompt = greedy_continuations(tiny, 1, seed=seed)[0].ids[:6]
        out = spec.generate(prompt, max_new_tokens=40)
        assert out.token_ids == vanilla.generate(prompt, max_new_tokens=40).token_ids
        assert out.stats.tree == str(spec.tree) == str(spec.tuner.choice.tree) == str(spec.choice.tree)
        rounds += len(out.stats.acceptance_lengths) - out.stats.plain_rounds
        assert sum(spec.tuner.observed().values()) == rounds > 0
    assert 0 < spec.tuner.scale() <= 1


def test_stop_strings_and_streaming(tiny):
    engine = SpeculativeEngine(tiny, None)
    full = engine.generate("hello", max_new_tokens=30)
    stop = full.text[5:8]
    chunks, ids = [], []
    cut = engine.generate("hello", max_new_tokens=30, stop=[stop], streamer=chunks.append,
                          token_streamer=lambda _text, new: ids.extend(new))
    assert cut.finish_reason == "stop" and stop in cut.text and len(cut.token_ids) < len(full.token_ids)
    assert full.text.startswith(cut.text.rstrip())
    assert "".join(chunks).startswith(cut.text[:5]) and ids[:len(cut.token_ids)] == cut.token_ids


def test_generate_continues_a_target_cache(tiny, tiny_moa):
    prompt = [5, 6, 7, 8, 9]
    engine = SpeculativeEngine(tiny, None)
    runner = tiny.new_runner()
    runner.forward(prompt[:3])
    continued = engine.generate(prompt, max_new_tokens=12, runner=runner)
    assert continued.token_ids == engine.generate(prompt, max_new_tokens=12).token_ids
    assert continued.stats.cached_tokens == 3 and runner.length > len(prompt)
    with pytest.raises(ValueError, match="plain decoding"):
        SpeculativeEngine(tiny, tiny_moa).generate(prompt, runner=tiny.new_runner())


def sample_first_two(tiny, drafter, prompt, root, sampling, n, residual, copy=None):
    import models.verify as verify

    step = TorchDraftStep(drafter)
    pre = tiny.new_runner()
    rows = step.memory_rows(pre.forward(prompt), list(range(len(prompt))))
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    counts = Counter()
    original = verify.residual
    if residual == "p":  # broken on purpose: p is not updated after a rejection
        verify.residual = lambda p, q: p
    if residual == "copy":  # broken on purpose: p keeps a rejected copy (a one-hot q)
        verify.residual = lambda p, q: p if q.max() == 1 else original(p, q)
    runner = tiny.new_runner()
    runner.forward(prompt)
    try:
        for _ in range(n):
            counts[first_two(runner, step, prompt, rows, root, sampling, g, rng, copy)] += 1
    finally:
        verify.residual = original
    return counts


@pytest.mark.parametrize("sampling,quantize,draft_vocab,copy", [
    (Sampling(1.0), "none", None, False), (Sampling(0.8, top_k=8, top_p=0.9), "none", None, False),
    (Sampling(1.0), "int8", None, False), (Sampling(1.0), "none", [0, 2, 3, 6, 7, 9, 11], False),
    (Sampling(1.0), "none", None, True)])
def test_sampling_keeps_the_target_distribution(sampling, quantize, draft_vocab, copy):
    """Also on an int8 target, with a reduced draft vocabulary (q is zero outside it, the residual covers the
    rest), and with a copy chain grafted onto the tree (its nodes tried first, as one-hot proposals)."""
    from models.registry import build_drafter
    from models.tiny import tiny_target

    tiny = tiny_target(vocab_size=12, seed=3, dtype=torch.float64 if quantize == "none" else torch.float32)
    if quantize == "int8":
        tiny.quantize_int8()
    torch.manual_seed(1)
    drafter = build_drafter("moa", tiny).eval()  # untrained: q differs from p, so the residual matters
    drafter.set_draft_vocab(draft_vocab)
    prompt, root, n = [3, 5, 7, 4, 9], 6, 2000
    n_broken = 500  # enough: a broken residual scores p < 1e-11 there in every setting
    joint = joint_first_two(tiny, prompt, root, sampling)
    chain = None
    if copy:  # the two most likely tokens: the chain is often right, and shares its first node with the drafted tree
        first = int(joint.sum(1).argmax())
        chain = [first, int(joint[first].argmax())]
    good = chi_square_p(sample_first_two(tiny, drafter, prompt, root, sampling, n, "max(p-q,0)", chain), joint, n)
    assert good > 1e-3, good
    if copy:
        broken = chi_square_p(sample_first_two(tiny, drafter, prompt, root, sampling, n_broken, "copy", chain), joint,
                              n_broken)
        assert broken < 1e-6, broken
    if quantize == "none":  # the test's power does not depend on the target's weights: shown once per setting
        broken = chi_square_p(sample_first_two(tiny, drafter, prompt, root, sampling, n_broken, "p"), joint, n_broken)
        assert broken < 1e-6, broken


def test_drafting_precision(tiny):
    """auto drafts in bf16 only a float32 drafter on hardware with bf16 matmuls (the tiny float64 ones stay as they
    are); bf16 and fp32 are asked for; the draft step is a copy, the memory head keeps the drafter's dtype."""
    from models.engine import drafting_dtype
    from models.registry import build_drafter
    from models.target import bf16_supported

    exact = build_drafter("moa", tiny)
    single = build_drafter("moa", tiny).float()
    assert drafting_dtype("auto", exact) is None and drafting_dtype("fp32", single) is None
    assert drafting_dtype("bf16", exact) == torch.bfloat16
    assert drafting_dtype("auto", single) == (torch.bfloat16 if bf16_supported("cpu") else None)
    with pytest.raises(ValueError, match="draft_precision"):
        drafting_dtype("fp16", single)
    engine = SpeculativeEngine(tiny, exact, tree="2,2,4", draft_precision="bf16")
    assert engine.step.dtype == torch.bfloat16 and engine.memory_head.dtype == exact.lm_head.weight.dtype
    assert next(exact.parameters()).dtype == torch.float64  # the caller's drafter is left as it was

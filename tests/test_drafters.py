"""MoA and EAGLE drafters on a tiny random float64 target: the properties docs/design.md §3 promises."""

import pytest
import torch

from models.drafter import FingerprintMismatch
from models.registry import build_drafter, load_drafter
from models.sync import depth_weights, last_sync_points, loss_positions, memory_mask, self_attention_mask
from models.target import causal_mask
from tests.helpers import tree_attention_mask

T = 24


def sequence(tiny, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, tiny.spec.vocab_size, (1, T), generator=g)
    resp = torch.zeros(1, T, dtype=torch.bool)
    resp[0, 8:] = True
    step = tiny.full_forward(ids)
    last = last_sync_points(resp, 3, 5, g)
    return ids, step, last, resp


def masks(last, restrict=False):
    lengths = torch.tensor([T])
    return (self_attention_mask(last, lengths, torch.tensor([restrict]), torch.float64),
            memory_mask(last, torch.float64))


@pytest.fixture(params=["moa", "eagle"])
def drafter(request, tiny):
    torch.manual_seed(1)
    d = build_drafter(request.param, tiny).eval()
    for name, p in d.named_parameters():  # random, non-trivial weights everywhere
        if not name.startswith(("embed", "lm_head")):
            torch.nn.init.normal_(p, std=0.3)
    return d


def positions():
    return torch.arange(T).view(1, T)


def test_sync_points_follow_the_response(tiny):
    ids, step, last, resp = sequence(tiny)
    last = last[0].tolist()
    for i in range(1, 9):  # prompt: every position is a sync point
        assert last[i] == i - 1
    gaps = [b - a for a, b in zip(sorted(set(last[9:])), sorted(set(last[9:]))[1:])]
    assert gaps and all(3 <= g <= 5 for g in gaps[1:] or gaps)
    assert all(last[i] < i for i in range(T))
    lp = loss_positions(resp, torch.tensor([last]))
    assert not lp[0, :8].any() and lp[0, 8:-1].all() and not lp[0, -1]


def test_ca_ignores_memory_after_the_sync_point(tiny, drafter):
    if drafter.arch != "moa":
        pytest.skip("EAGLE has no cross-attention")
    ids, step, last, _ = sequence(tiny)
    sa, mm = masks(last)
    mem = drafter.memory_rows(step, positions())
    base = drafter.draft_step(ids, positions(), None, None, sa, memory=mem, memory_mask=mm).logits
    i = 15
    s = int(last[0, i])
    perturbed = mem.clone()
    perturbed[0, s + 1 :] += torch.randn_like(perturbed[0, s + 1 :])
    out = drafter.draft_step(ids, positions(), None, None, sa, memory=perturbed, memory_mask=mm).logits
    assert torch.allclose(out[0, : i + 1][last[0, : i + 1] <= s], base[0, : i + 1][last[0, : i + 1] <= s])
    assert torch.allclose(out[0, i], base[0, i])
    perturbed = mem.clone()
    perturbed[0, s] += 1.0
    out = drafter.draft_step(ids, positions(), None, None, sa, memory=perturbed, memory_mask=mm).logits
    assert not torch.allclose(out[0, i], base[0, i])


def test_self_attention_is_causal_and_tree_masked(tiny, drafter):
    ids, step, last, _ = sequence(tiny)
    mem = drafter.memory_rows(step, positions())
    feats = step.hidden
    run = lambda x, mask: drafter.draft_step(x, positions(), None, None, mask.view(1, 1, T, T), memory=mem,
                                             features=feats).logits[0]
    base = run(ids, causal_mask(T, torch.float64))
    changed = ids.clone()
    changed[0, 10] = (changed[0, 10] + 1 - 3) % (tiny.spec.vocab_size - 3) + 3
    out = run(changed, causal_mask(T, torch.float64))
    assert torch.allclose(out[:10], base[:10]) and not torch.allclose(out[10], base[10])
    # a tree over the last 6 positions: two branches of 3 from position 17
    parents = list(range(-1, 17)) + [17, 18, 19, 17, 21, 22]
    tree = tree_attention_mask(parents, torch.float64)
    base = run(ids, tree)
    changed = ids.clone()
    changed[0, 18] = 3 if changed[0, 18] != 3 else 4  # first branch: must not reach the second
    out = run(changed, tree)
    assert torch.allclose(out[21:], base[21:]) and not torch.allclose(out[19], base[19])


def test_training_forward_equals_token_by_token_drafting(tiny, drafter):
    ids, step, last, _ = sequence(tiny, seed=3)
    sa, mm = masks(last)
    train = drafter.lm_head(drafter.train_forward(ids, step, positions(), sa, mm).features)[0]
    mem = drafter.memory_rows(step, positions())
    hk, d = drafter.cache_shape()
    k = torch.zeros(1, hk, 0, d, dtype=torch.float64)
    v = torch.zeros_like(k)
    for i in range(1, T):
        s = int(last[0, i])
        feat = step.hidden[:, i - 1 : i]
        pos = torch.tensor([[i]])
        # the cache holds tokens 0..i-1, processed earlier; drafting step i uses memory frozen at s
        if i == 1:
            first = drafter.draft_step(ids[:, :1], torch.tensor([[0]]), k, v, None, memory=mem[:, :1],
                                       features=torch.zeros_like(step.hidden[:, :1]))
            k, v = first.keys, first.values
        out = drafter.draft_step(ids[:, i : i + 1], pos, k, v, None, memory=mem[:, : s + 1], features=feat)
        k, v = out.keys, out.values
        assert torch.allclose(out.logits[0, 0], train[i], atol=1e-9), f"position {i}"


def test_curriculum_restricts_self_attention(tiny):
    ids, step, last, _ = sequence(tiny)
    sa = self_attention_mask(last, torch.tensor([T]), torch.tensor([True]), torch.float64)[0, 0]
    for i in range(T):
        visible = (sa[i] == 0).nonzero().flatten().tolist()
        assert visible == list(range(int(last[0, i]) + 1, i + 1))


def test_memory_head_is_incremental(tiny, drafter):
    ids, step, _, _ = sequence(tiny)
    whole = drafter.memory_rows(step, positions())
    runner = tiny.new_runner()
    parts = []
    for a, b in [(0, 5), (5, 6), (6, 17), (17, T)]:
        s = runner.forward(ids[0, a:b])
        batched = type(s)(None, s.hidden[None], s.keys[None], s.values[None])
        parts.append(drafter.memory_rows(batched, torch.arange(a, b).view(1, -1)))
    assert torch.allclose(torch.cat(parts, dim=1), whole, atol=1e-9)


def test_save_load_round_trip_and_fingerprint(tmp_path, tiny, drafter):
    from models.tiny import tiny_target

    drafter.save_pretrained(tmp_path / "d", dtype=torch.float64)
    loaded = load_drafter(tmp_path / "d", tiny)
    assert loaded.arch == drafter.arch
    for (n1, p1), (n2, p2) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    other = tiny_target(seed=5)
    with pytest.raises(FingerprintMismatch, match="trained for target"):
        load_drafter(tmp_path / "d", other)


def test_unknown_drafter_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="unknown drafter architecture"):
        build_drafter("medusa", tiny)
    with pytest.raises(FileNotFoundError, match="unknown drafter"):
        load_drafter(tmp_path / "nope", tiny)


def test_depth_weights_favour_the_first_drafts_after_a_sync():
    last = torch.tensor([[-1, 0, 1, 2, 2, 2, 5, 5]])
    mask = torch.tensor([[False, True, True, True, True, True, True, False]])
    w = depth_weights(mask, last, 0.5)
    assert w.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.5, 0.25, 1.0, 0.0]]
    assert torch.equal(depth_weights(mask, last, 1.0), mask.float())


def test_weighted_lsa_pool_starts_at_the_mean(tmp_path, tiny):
    """Switching a trained MoA drafter to the learned per-layer pool keeps its memory rows; the weights then act
    per layer and survive save / load."""
    torch.manual_seed(2)
    d = build_drafter("moa", tiny).eval()
    ids, step, _, _ = sequence(tiny)
    before = d.memory_rows(step, positions())
    d.use_weighted_pool()
    torch.testing.assert_close(d.memory_rows(step, positions()), before)
    with torch.no_grad():
        d.lsa_weights.zero_()
        d.lsa_weights[-1] = 1.0  # the last layer alone
    only_last = d.memory_rows(step, positions())
    assert not torch.allclose(only_last, before)
    d.save_pretrained(tmp_path / "w")
    again = load_drafter(tmp_path / "w", tiny)
    assert again.config.lsa_pool == "weighted"
    torch.testing.assert_close(again.memory_rows(step, positions()), only_last.to(again.lsa_proj.weight.dtype))
    with pytest.raises(ValueError, match="lsa_pool"):
        build_drafter("moa", tiny, lsa_pool="max")


def test_lsa_skip_starts_at_zero_and_reads_the_last_layers(tmp_path, tiny):
    """The skip from the last layers' raw [key; value] keeps a trained drafter's memory rows when added; once
    trained, those layers reach m_t through it as well as through the pool (the first layer only through the
    pool), and it survives save / load."""
    torch.manual_seed(3)
    d = build_drafter("moa", tiny).eval()
    ids, step, _, _ = sequence(tiny)
    before = d.memory_rows(step, positions())
    d.use_lsa_skip(2)
    torch.testing.assert_close(d.memory_rows(step, positions()), before)
    with torch.no_grad():
        d.lsa_skip.weight.normal_(0, 0.05)
    trained = d.memory_rows(step, positions())
    assert not torch.allclose(trained, before)

    def shift(layer: int) -> torch.Tensor:  # how m_t (before CA's norm) moves when one layer's values move
        moved = step.values.clone()
        moved[:, layer] += 1.0
        return d.layer_summary(step.keys, moved) - d.layer_summary(step.keys, step.values)

    with_skip = shift(0), shift(-1)
    skip, d.lsa_skip = d.lsa_skip, None
    pool_only = shift(0), shift(-1)
    d.lsa_skip = skip
    torch.testing.assert_close(with_skip[0], pool_only[0])  # the first layer reaches m_t through the pool only
    assert not torch.allclose(with_skip[1], pool_only[1])  # the last one through the skip as well
    d.save_pretrained(tmp_path / "s")
    again = load_drafter(tmp_path / "s", tiny)
    assert again.config.lsa_skip_layers == 2
    torch.testing.assert_close(again.memory_rows(step, positions()), trained.to(again.lsa_proj.weight.dtype))
    with pytest.raises(ValueError, match="reads 2 layers"):
        again.use_lsa_skip(1)
    with pytest.raises(ValueError, match="lsa_skip_layers"):
        build_drafter("moa", tiny, lsa_skip_layers=tiny.spec.n_layers + 1)


@pytest.mark.parametrize("source", ["summary", "hidden"])
def test_fused_memory_starts_at_zero_and_reads_the_newest_visible_row(tmp_path, tiny, source):
    """--fused-memory keeps a trained drafter's features when added (the Linear starts at zero); rows carry m_t or
    the target's h_t after CA's key and value; once trained, a position's features move with the fused part of its
    last sync point's row and with no other; drafting with all rows visible reads the newest; it survives save /
    load, and a second source is refused."""
    torch.manual_seed(6)
    d = build_drafter("moa", tiny).eval()
    ids, step, last, _ = sequence(tiny)
    sa, mem = masks(last)
    before = d.train_forward(ids, step, positions(), sa, mem).features
    d.use_fused_memory(source)
    out = d.train_forward(ids, step, positions(), sa, mem)
    torch.testing.assert_close(out.features, before)
    assert d.row_width == d.ca.row_width + d.config.hidden_size
    fused = d.summary(step) if source == "summary" else step.hidden
    torch.testing.assert_close(out.memory[..., d.ca.row_width:], fused)
    with torch.no_grad():
        d.fuse.weight.normal_(0, 0.3)
    memory = d.memory_rows(step, positions()).detach().requires_grad_(True)
    out = d.train_forward(ids, step, positions(), sa, mem, memory)
    assert not torch.allclose(out.features, before)
    i = int(last[0, -1]) + 1  # a position past its last sync point s
    (grad,) = torch.autograd.grad(out.features[0, i].sum(), memory)
    summary = grad[0, :, d.ca.row_width:].abs().sum(-1)
    assert summary[last[0, i]] > 0 and summary[: last[0, i]].sum() == 0 and summary[last[0, i] + 1:].sum() == 0
    # drafting: every row visible, the newest one is fused
    n = int(last[0, -1]) + 1
    full = d.draft_step(ids[:, n - 1:n], positions()[:, n - 1:n], None, None, None, memory=memory[:, :n].detach())
    cut = d.draft_step(ids[:, n - 1:n], positions()[:, n - 1:n], None, None, None,
                       memory=memory[:, :n].detach(), memory_mask=torch.zeros(1, 1, 1, n, dtype=torch.float64))
    torch.testing.assert_close(full.features, cut.features)
    d.save_pretrained(tmp_path / "f", dtype=torch.float64)
    again = load_drafter(tmp_path / "f", tiny)
    assert again.config.fused_memory == source and again.added_parameters()[-1] is again.fuse.weight
    torch.testing.assert_close(again.memory_rows(step, positions()), memory.detach())
    with pytest.raises(ValueError, match="fuses the"):
        again.use_fused_memory("summary" if source == "hidden" else "hidden")
    with pytest.raises(ValueError, match="fused_memory"):
        build_drafter("moa", tiny, fused_memory="keys")


def test_widened_memory_keeps_the_drafter_and_carries_more(tmp_path, tiny):
    """CA widened to more key/value heads (the new ones copies of the heads their query heads read) drafts exactly
    as before from wider memory rows, and survives save / load."""
    torch.manual_seed(4)
    d = build_drafter("moa", tiny).eval()
    ids, step, last, _ = sequence(tiny)
    sa, mem = masks(last)
    before = d.train_forward(ids, step, positions(), sa, mem).features
    old = d.config.ca_kv_heads
    wide = old * (d.config.ca_heads // old)
    d.widen_memory(wide)
    out = d.train_forward(ids, step, positions(), sa, mem)
    torch.testing.assert_close(out.features, before)
    assert out.memory.shape[-1] == d.row_width == 2 * wide * d.config.head_dim
    d.save_pretrained(tmp_path / "w", dtype=torch.float64)
    again = load_drafter(tmp_path / "w", tiny)
    assert again.config.ca_kv_heads == wide
    torch.testing.assert_close(again.train_forward(ids, step, positions(), sa, mem).features.double(), before)
    with pytest.raises(ValueError, match="widen"):
        again.widen_memory(wide + 1)

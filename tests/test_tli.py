"""Target layer inference (MoA with `tli`): the drafts go through copies of the target's last layers, which read
the target's own cache of the verified tokens. On tiny float64 targets."""

import pytest
import torch

from models.drafter import OneDeviceOnly
from models.engine import SpeculativeEngine
from models.moa import extend
from models.registry import build_drafter, load_drafter
from models.target import causal_mask
from models.train import TrainConfig, make_drafter
from tests.helpers import greedy_continuations, lossless_forwards, train_tiny
from tests.test_drafters import T, masks, positions, sequence


@pytest.fixture
def tli_drafter(tiny):
    torch.manual_seed(1)
    d = build_drafter("moa", tiny, tli=1).eval()
    for name, p in d.named_parameters():  # random, non-trivial weights in the drafter's own layers
        if d.is_own(name):
            torch.nn.init.normal_(p, std=0.3)
    return d


@pytest.mark.parametrize("verified", [0, 9, T - 1])
def test_the_target_tail_reproduces_the_target(tiny, tli_drafter, verified):
    """Fed the target's own hidden state before its last layer, the tail gives the target's last hidden state, with
    the first `verified` slots read from the target's cache and the rest computed by the tail itself."""
    ids = torch.randint(3, tiny.spec.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    full = tiny.full_forward(ids)
    last_input = tiny.model.model(input_ids=ids, output_hidden_states=True).hidden_states[-2]
    past = tli_drafter.target_context(full.keys[:, :, :verified], full.values[:, :, :verified])
    mask = causal_mask(T, torch.float64).view(1, 1, T, T)
    out, added = tli_drafter.tli(last_input, positions(), mask, past, verified)
    assert torch.allclose(out, full.hidden, atol=1e-10)
    assert added[0][0].shape[2] == T - verified
    # the K/V the tail added are the target's own
    assert torch.allclose(extend(past, added)[0][0], tli_drafter.target_context(full.keys, full.values)[0][0])


def test_tli_training_forward_equals_token_by_token_drafting(tiny, tli_drafter):
    """The training pass (one masked forward) gives each position the logits drafting gives it after its last sync
    point: the tail sees the target's K/V up to s(i), then its own."""
    ids, _, last, _ = sequence(tiny, seed=3)
    step = tiny.full_forward(ids)
    sa, mm = masks(last)
    train = tli_drafter.lm_head(tli_drafter.train_forward(ids, step, positions(), sa, mm).head_input)[0]
    whole = tli_drafter.draft_step(ids, positions(), None, None, sa, memory=tli_drafter.memory_rows(step, positions()))
    mem = tli_drafter.memory_rows(step, positions())
    for s in sorted(set(last[0].tolist()))[1:-1]:
        k, v = whole.keys[:, :, : s + 1], whole.values[:, :, : s + 1]
        past = tli_drafter.target_context(step.keys[:, :, : s + 1], step.values[:, :, : s + 1])
        for i in range(s + 1, T):
            if int(last[0, i]) != s:
                break
            out = tli_drafter.draft_step(ids[:, i : i + 1], torch.tensor([[i]]), k, v, None, memory=mem[:, : s + 1],
                                         tli_past=past)
            k, v, past = out.keys, out.values, extend(past, out.tli_kv)
            assert torch.allclose(out.logits[0, 0], train[i], atol=1e-9), f"position {i} after sync point {s}"


@pytest.fixture(scope="module")
def tli_moa(tiny):
    return train_tiny(tiny, "moa", tli=1)


@pytest.mark.parametrize("tree", ["5,1,5", "4,2,8"])
@pytest.mark.parametrize("copy_tokens", [0, 4])
def test_tli_engine_is_lossless_and_gets_drafts_accepted(tiny, tli_moa, tree, copy_tokens):
    vanilla, spec = lossless_forwards(tiny, SpeculativeEngine(tiny, tli_moa, tree=tree, copy_tokens=copy_tokens))
    assert spec < 0.6 * vanilla, (vanilla, spec)  # the drafts through the target's last layer get accepted


def test_tli_is_saved_without_the_target_layers_and_refused_for_edges(tmp_path, tiny, tli_drafter):
    from export.to_onnx import ExportError, export_bundle
    from server.session import Model

    tli_drafter.save_pretrained(tmp_path / "d", dtype=torch.float64)
    from safetensors.torch import load_file

    assert not [k for k in load_file(str(tmp_path / "d" / "model.safetensors")) if k.startswith("tli.")]
    back = load_drafter(tmp_path / "d", tiny)
    assert back.config.tli == 1
    ids, step, last, _ = sequence(tiny)
    sa, mm = masks(last)
    a = tli_drafter.train_forward(ids, step, positions(), sa, mm).head_input
    assert torch.allclose(back.train_forward(ids, step, positions(), sa, mm).head_input, a)
    with pytest.raises(OneDeviceOnly, match="one device only"):
        Model(tiny, back)
    with pytest.raises(ExportError, match="target layer inference"):
        export_bundle(tmp_path / "d", tmp_path / "bundle", target=tiny)
    assert not (tmp_path / "bundle").exists()  # nothing written, not even the directory


def test_tli_options_are_checked(tiny):
    with pytest.raises(ValueError, match="for MoA drafters"):
        make_drafter(TrainConfig(arch="eagle", tli=1), tiny, [])
    with pytest.raises(ValueError, match="tli is 1..2"):
        build_drafter("moa", tiny, tli=3)


def test_calibration_matches_the_tail_input_to_the_target(tiny, tli_drafter):
    """After `calibrate_target_layers`, the drafter's tail input has, per dimension, the target's mean and spread."""
    sequences = [s.ids for s in greedy_continuations(tiny, 3, new=20)]
    tli_drafter.calibrate_target_layers(tiny, sequences)
    xs, inners = [], []
    for seq in sequences:
        ids = torch.tensor([seq])
        t = ids.shape[1]
        causal = causal_mask(t, torch.float64).view(1, 1, t, t)
        out = tli_drafter.train_forward(ids, tiny.full_forward(ids), torch.arange(t).view(1, t), causal, causal)
        xs.append(tli_drafter.tail_input(out.features)[0])
        inners.append(tiny.model.model(input_ids=ids, output_hidden_states=True).hidden_states[-2][0])
    x, inner = torch.cat(xs), torch.cat(inners)
    assert torch.allclose(x.mean(0), inner.mean(0), atol=1e-6) and torch.allclose(x.std(0), inner.std(0), atol=1e-6)

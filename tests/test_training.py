"""Training pipeline on the tiny target: feature cache, reduced draft vocabulary, warm starts, target-layer init,
batched on-policy regeneration."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from models.data import token_frequencies
from models.registry import build_drafter, load_drafter
from models.features import FeatureCache, build_cache, main as features_main
from models.regenerate import answer_batch, main as regenerate_main
from models.drafter import distill_loss
from models.train import TrainConfig, collate, main as train_main, make_drafter, train_step_loss
from tests.helpers import chi_square_p, greedy_continuations


@pytest.fixture(scope="module")
def samples(tiny):
    return greedy_continuations(tiny, 6, new=24)


@pytest.fixture(scope="module")
def cache(tiny, samples, tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    build_cache(tiny, samples, out, topk=tiny.spec.vocab_size, precision="fp32", tokens_per_batch=64)
    return out


def write_conversations(tiny, path, n: int, seed: int):
    """n conversations of the tiny target's greedy answers, as models.train reads them."""
    rows = [{"id": s.id, "conversations": [{"role": "user", "content": tiny.tokenizer.decode(s.ids[:6])},
                                           {"role": "assistant", "content": tiny.tokenizer.decode(s.ids[6:])}]}
            for s in greedy_continuations(tiny, n, new=30, seed=seed)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("arch", ["moa", "eagle"])
def test_feature_cache_gives_the_in_loop_loss(tiny, samples, cache, arch):
    """A step on cached features (fp16, full top-k) has the loss of a step that runs the target."""
    torch.manual_seed(0)
    drafter = build_drafter(arch, tiny).float()
    features = FeatureCache.open(cache, samples, tiny, need_kv=arch == "moa")
    cfg = TrainConfig(sync_min=2, sync_max=5, precision="fp32", ce_fraction=1.0)
    index = [1, 4, 2]
    ids, resp, lens = collate([samples[i] for i in index])
    (live, _), n = train_step_loss(drafter, tiny, ids, resp, lens, cfg, 3, 0.0)
    (cached, _), m = train_step_loss(drafter, tiny, ids, resp, lens, cfg, 3, 0.0, features.step(index, ids.shape[1]))
    assert n == m
    assert abs(live.item() - cached.item()) < 2e-3 * abs(live.item()), (live.item(), cached.item())
    # the cache is tied to its data and its target
    with pytest.raises(ValueError, match="other training data"):
        FeatureCache.open(cache, samples[:3], tiny, need_kv=False)


def test_feature_cache_resumes(tiny, samples, cache, tmp_path):
    """A stopped build continues where it was and writes the same arrays."""
    build_cache(tiny, samples[:2], tmp_path, topk=8, precision="fp32", tokens_per_batch=64)
    out = tmp_path / "again"
    build_cache(tiny, samples, out, topk=tiny.spec.vocab_size, precision="fp32", tokens_per_batch=64)
    progress = json.loads((out / "progress.json").read_text())
    (out / "progress.json").write_text(json.dumps({"batches": 1, "wall_s": progress["wall_s"]}))
    np.load(out / "hidden.npy", mmap_mode="r+")[-5:] = 0  # a later batch that "was not written yet"
    build_cache(tiny, samples, out, topk=tiny.spec.vocab_size, precision="fp32", tokens_per_batch=64)
    for name in ("hidden", "keys", "topk_ids"):
        np.testing.assert_array_equal(np.load(out / f"{name}.npy"), np.load(cache / f"{name}.npy"))


def test_draft_vocab_maps_ids_and_survives_save(tiny, samples, tmp_path):
    drafter = build_drafter("moa", tiny).float()
    vocab = token_frequencies(samples).most_common_ids(40)
    assert len(set(vocab)) == 40
    drafter.set_draft_vocab(vocab)
    x = torch.randn(1, 3, tiny.spec.hidden_size)
    full = drafter.lm_head(x)
    local = drafter.head(x)
    assert local.shape[-1] == 40
    torch.testing.assert_close(local, full[..., drafter.draft_vocab])
    assert drafter.token_ids(local.argmax(-1)).tolist() == drafter.draft_vocab[local.argmax(-1)].tolist()
    index = drafter.vocab_index()
    assert (index[drafter.draft_vocab] == torch.arange(40)).all() and (index >= 0).sum() == 40
    drafter.save_pretrained(tmp_path / "d")
    again = load_drafter(tmp_path / "d", tiny)
    assert again.draft_vocab.tolist() == sorted(vocab)
    torch.testing.assert_close(again.head.weight.float(), drafter.head.weight)
    with pytest.raises(ValueError, match="distinct"):
        drafter.set_draft_vocab([1, 1, 2])


def test_target_layer_init_copies_the_target_layers(tiny):
    moa = build_drafter("moa", tiny)
    moa.init_from_target(tiny)
    layers = tiny.model.model.layers
    torch.testing.assert_close(moa.sa.self_attn.q_proj.weight, layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(moa.ca.mlp.down_proj.weight, layers[-1].mlp.down_proj.weight)
    eagle = build_drafter("eagle", tiny)
    eagle.init_from_target(tiny)
    torch.testing.assert_close(eagle.layer.input_layernorm.weight, layers[-1].input_layernorm.weight)


def test_batched_regeneration_equals_one_at_a_time(tiny):
    prompts = [[5, 9, 11, 3], [7, 8], [20, 21, 22, 23, 24, 25]]
    eos = {int(tiny.tokenizer.eos_token_id)}
    batched = answer_batch(tiny.model, prompts, 12, eos, pad=0)
    for p, got in zip(prompts, batched):
        assert got == answer_batch(tiny.model, [p], 12, eos, pad=0)[0]
        assert 0 < len(got) <= 12


def test_sampled_regeneration_keeps_the_target_distribution(tiny):
    """At temperature T the first answer token of many copies of one prompt follows softmax(logits / T)."""
    prompt, n, temperature = [5, 9, 11, 3], 4000, 0.7
    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits.double() / temperature, -1)
    answers = answer_batch(tiny.model, [prompt] * n, 1, set(), pad=0, temperature=temperature,
                           generator=torch.Generator().manual_seed(3))
    counts: dict = {}
    for (t,) in answers:
        counts[(0, t)] = counts.get((0, t), 0) + 1
    assert chi_square_p(counts, probs.view(1, -1), n) > 1e-3
    greedy = answer_batch(tiny.model, [prompt] * n, 1, set(), pad=0)
    assert sum(a != g for a, g in zip(answers, greedy)) > n // 10  # it really samples


def test_sampled_regeneration_resumes_beside_greedy_rows(tmp_path):
    """Sampled rows get the suffix '@tT' and the temperature in generated_by; a resumed run adds only new prompts,
    and the greedy rows in the same file do not count as answered at that temperature."""
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": f"tell me {i}"}]})
                              + "\n" for i in range(4)))
    out = tmp_path / "out.jsonl"
    common = ["--target", "tiny", "--source", str(source), "--out", str(out), "--max-new-tokens", "4"]
    regenerate_main([*common, "--n", "2"])
    regenerate_main([*common, "--n", "4", "--temperature", "0.8"])
    regenerate_main([*common, "--n", "5", "--temperature", "0.8"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["p0", "p1", "p0@t0.8", "p1@t0.8", "p2@t0.8"]
    assert "temperature 0.8" in rows[-1]["generated_by"] and "temperature" not in rows[0]["generated_by"]
    with pytest.raises(SystemExit):
        regenerate_main([*common, "--temperature", "-1"])


def test_training_legs_accumulate(tiny, tmp_path, samples):
    """The feature CLI builds the data split and its cache; a run continued with --init adds a leg to the drafter's
    training record; --steps 0 applies a draft vocab."""
    source = write_conversations(tiny, tmp_path / "convs.jsonl", 12, seed=5)
    common = ["--target", "tiny", "--data", str(tmp_path / "data"), "--source", str(source), "--n-heldout", "2",
              "--tokens-per-step", "256", "--eval-every", "100", "--eval-samples", "1", "--final-eval-samples", "1",
              "--precision", "fp32"]
    features_main(["--target", "tiny", "--data", str(tmp_path / "data"), "--source", str(source), "--n-heldout", "2",
                   "--precision", "fp32", "--topk", "8"])  # builds the split as models.train would, then the cache
    common += ["--features", str(tmp_path / "data" / "features")]
    train_main(["--arch", "moa", "--out", str(tmp_path / "a"), "--steps", "3", *common])
    train_main(["--arch", "moa", "--out", str(tmp_path / "b"), "--steps", "2", "--init", str(tmp_path / "a/drafter"),
                *common])
    train_main(["--arch", "moa", "--out", str(tmp_path / "c"), "--steps", "0", "--init", str(tmp_path / "b/drafter"),
                "--draft-vocab", "32", *common])
    record = json.loads((tmp_path / "c/drafter/training_record.json").read_text())
    assert [leg["steps"] for leg in record["legs"]] == [3, 2, 0]
    assert record["steps"] == 5 and record["tokens_seen"] == sum(leg["tokens"] for leg in record["legs"])
    assert record["draft_vocab_size"] == 32
    assert load_drafter(tmp_path / "c/drafter", tiny).draft_vocab.numel() == 32

    # a leg that switches to the weighted pool and adds the LSA skip: the pooling weights and the skip (from zero)
    # take one AdamW step of ~ pool_lr_scale x the lr (Adam's first step moves each parameter by about the lr;
    # lr 5e-4 / 50 warm-up steps at step 0)
    train_main(["--arch", "moa", "--out", str(tmp_path / "d"), "--steps", "1", "--init", str(tmp_path / "c/drafter"),
                "--lsa-pool", "weighted", "--pool-lr-scale", "100", "--lsa-skip-layers", "1",
                "--fused-memory", "hidden", *common])
    d = load_drafter(tmp_path / "d/drafter", tiny)
    moved = (d.lsa_weights - 1 / tiny.spec.n_layers).abs().max().item()
    assert 5e-4 < moved < 2e-3
    assert d.config.lsa_skip_layers == 1 and 5e-4 < d.lsa_skip.weight.abs().max().item() < 2e-3
    assert d.config.fused_memory == "hidden" and 5e-4 < d.fuse.weight.abs().max().item() < 2e-3

    # the campaign's curves: the continued run starts where the drafter it continued ended
    from bench.campaign import main as campaign_main

    campaign_main(["--runs", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "campaign")])
    a, b = json.loads((tmp_path / "campaign/campaign.json").read_text())
    assert b["prior"]["tokens"] == a["final"]["tokens"] > 0 and len(b["legs"]) == 2
    assert [leg["tokens"] for leg in b["legs"]] == [a["final"]["tokens"], b["final"]["tokens"]]
    assert b["fit"] is None  # two legs: too few to fit
    assert (tmp_path / "campaign/campaign.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        campaign_main(["--runs", str(tmp_path / "data"), "--out", str(tmp_path / "campaign")])


def test_ema_saves_the_moving_average_and_resumes_it(tiny, tmp_path):
    """--ema saves the moving average of the weights (one step of decay d from the init: d x init + (1 - d) x the
    last weights), scores the last weights to eval_last.json, and a resumed run continues the average."""
    from safetensors.torch import load_file

    source = write_conversations(tiny, tmp_path / "convs.jsonl", 8, seed=5)
    common = ["--target", "tiny", "--arch", "moa", "--data", str(tmp_path / "data"), "--source", str(source),
              "--n-heldout", "2", "--tokens-per-step", "256", "--eval-every", "100", "--eval-samples", "1",
              "--final-eval-samples", "2", "--precision", "fp32", "--schedule", "constant", "--warmup", "1",
              "--lr", "1e-3"]
    train_main([*common, "--out", str(tmp_path / "init"), "--steps", "1"])
    common += ["--init", str(tmp_path / "init/drafter")]
    train_main([*common, "--out", str(tmp_path / "last"), "--steps", "1"])
    train_main([*common, "--out", str(tmp_path / "ema"), "--steps", "1", "--ema", "0.25"])
    init, last, ema = (load_file(str(tmp_path / f"{x}/drafter/model.safetensors")) for x in ("init", "last", "ema"))
    moved = 0.0
    for name, value in ema.items():
        if value.is_floating_point():
            expected = 0.25 * init[name].float() + 0.75 * last[name].float()
            torch.testing.assert_close(value.float(), expected, rtol=2e-3, atol=1e-5)
            moved = max(moved, (value.float() - last[name].float()).abs().max().item())
    assert moved > 1e-4  # the average is not the last weights
    scored = [json.loads((tmp_path / x).read_text()) for x in ("last/eval.json", "ema/eval_last.json")]
    assert scored[0] == scored[1]  # the same last weights, the same held-out answers
    record = json.loads((tmp_path / "ema/drafter/training_record.json").read_text())
    assert record["legs"][-1]["heldout_last_weights"]["expected_tau"] == scored[1]["expected_tau"]

    train_main([*common, "--out", str(tmp_path / "ema"), "--steps", "3", "--ema", "0.25", "--resume"])
    train_main([*common, "--out", str(tmp_path / "straight"), "--steps", "3", "--ema", "0.25"])
    resumed, straight = (load_file(str(tmp_path / f"{x}/drafter/model.safetensors")) for x in ("ema", "straight"))
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def test_legs_side_by_side_average_into_one_leg(tiny, tmp_path):
    """Two legs from one drafter on disjoint shards average into one leg that saw both shards' tokens: the
    tokens-weighted mean of the weights, scored on the legs' held-out answers; a next leg and the campaign's curves
    continue from it. Drafters that are not legs of one drafter are refused."""
    from safetensors.torch import load_file

    from bench.campaign import main as campaign_main
    from models.average import main as average_main

    heldout = write_conversations(tiny, tmp_path / "heldout.jsonl", 2, seed=9)
    common = ["--target", "tiny", "--arch", "moa", "--tokens-per-step", "256", "--eval-every", "100",
              "--eval-samples", "1", "--final-eval-samples", "2", "--precision", "fp32", "--heldout-source",
              str(heldout)]
    first = write_conversations(tiny, tmp_path / "first.jsonl", 6, seed=5)
    train_main([*common, "--data", str(tmp_path / "d0"), "--source", str(first), "--out", str(tmp_path / "a"),
                "--steps", "2"])
    for shard, seed, steps in (("b1", 6, 2), ("b2", 7, 3)):
        source = write_conversations(tiny, tmp_path / f"{shard}.jsonl", 6, seed=seed)
        train_main([*common, "--data", str(tmp_path / f"d{shard}"), "--source", str(source), "--out",
                    str(tmp_path / shard), "--init", str(tmp_path / "a/drafter"), "--steps", str(steps),
                    "--seed", str(seed)])
    record = average_main([str(tmp_path / "b1"), str(tmp_path / "b2/drafter"), "--out", str(tmp_path / "ab"),
                           "--target", "tiny"])
    b1, b2 = (json.loads((tmp_path / f"{x}/drafter/training_record.json").read_text()) for x in ("b1", "b2"))
    assert len(record["legs"]) == 2 and record["legs"][0] == b1["legs"][0]
    leg = record["legs"][-1]
    assert leg["average_of"] == [b1["legs"][-1], b2["legs"][-1]] and leg["steps"] == 5
    assert leg["tokens"] == b1["legs"][-1]["tokens"] + b2["legs"][-1]["tokens"]
    assert leg["wall_time_s"] == max(b1["legs"][-1]["wall_time_s"], b2["legs"][-1]["wall_time_s"])
    assert record["tokens_seen"] == sum(x["tokens"] for x in record["legs"])
    w1, w2 = (b["legs"][-1]["tokens"] for b in (b1, b2))
    s1, s2, avg = (load_file(str(tmp_path / f"{x}/drafter/model.safetensors")) for x in ("b1", "b2", "ab"))
    name = next(k for k, v in avg.items() if v.is_floating_point() and not torch.equal(s1[k], s2[k]))
    assert torch.equal(avg[name], ((s1[name].float() * w1 + s2[name].float() * w2) / (w1 + w2)).to(avg[name].dtype))
    ev = json.loads((tmp_path / "ab/eval.json").read_text())
    assert ev["expected_tau"] == record["heldout"]["expected_tau"] and sum(ev["per_answer"]["sync_points"]) > 0
    assert ev["per_answer"]["sync_points"] == json.loads((tmp_path / "b1/eval.json").read_text())["per_answer"][
        "sync_points"]  # the same answers as the legs': paired_difference applies

    train_main([*common, "--data", str(tmp_path / "db1"), "--source", str(tmp_path / "b1.jsonl"), "--out",
                str(tmp_path / "c"), "--init", str(tmp_path / "ab/drafter"), "--steps", "1"])
    c = json.loads((tmp_path / "c/drafter/training_record.json").read_text())
    assert c["legs"][:2] == record["legs"] and c["tokens_seen"] == record["tokens_seen"] + c["legs"][-1]["tokens"]
    campaign_main(["--runs", str(tmp_path / "a"), str(tmp_path / "ab"), "--out", str(tmp_path / "campaign")])
    curves = json.loads((tmp_path / "campaign/campaign.json").read_text())
    assert [x["tokens"] for x in curves[1]["legs"]] == [b1["legs"][0]["tokens"], record["tokens_seen"]]

    for drafters, why in (([tmp_path / "a", tmp_path / "b1"], "not start from the same drafter"),
                          ([tmp_path / "b1"], "at least two"),
                          ([tmp_path / "b1", tmp_path / "nowhere"], "nowhere")):
        with pytest.raises(SystemExit, match=why):
            average_main([*map(str, drafters), "--out", str(tmp_path / "bad"), "--target", "tiny"])
    with pytest.raises(SystemExit, match="trained for target"):
        average_main([str(tmp_path / "b1"), str(tmp_path / "b2"), "--out", str(tmp_path / "bad"), "--target",
                      "tiny:1"])
    assert not (tmp_path / "bad").exists()  # refused before writing anything


def test_the_campaign_fit_says_how_many_tokens_reach_a_goal():
    """The log fit recovers a known curve, fits only the legs scored on the last leg's held-out set, and says
    "never" when the legs do not gain."""
    import math

    from bench.campaign import log_fit

    legs = [{"tokens": t, "expected_tau": 1.0 + 0.1 * math.log(t), "heldout": "h.jsonl:52"} for t in (1e6, 2e6, 4e6)]
    early = {"tokens": 1e5, "expected_tau": 3.0, "heldout": "old.jsonl:24"}  # another set: left out of the fit
    fit = log_fit([early, *legs], goal=2.5)
    assert fit["legs"] == 3 and fit["per_doubling"] == pytest.approx(0.1 * math.log(2))
    assert fit["tokens_to_goal"] == pytest.approx(math.exp(15.0), rel=1e-6)
    flat = [dict(leg, expected_tau=1.5) for leg in legs]
    assert log_fit(flat, goal=2.5)["tokens_to_goal"] is None
    assert log_fit(legs[:2], goal=2.5) is None


def test_sync_loss_is_the_loss_with_memory_up_to_the_own_position(tiny, samples):
    """--sync-weight w adds w x the loss of every response position whose CA sees the memory row of the position
    itself (depth 0), and that pass really reads the own row; EAGLE refuses it."""
    from models.sync import loss_positions, memory_mask
    from models.target import causal_mask

    torch.manual_seed(0)
    drafter = build_drafter("moa", tiny).float()
    ids, resp, lens = collate(samples[:3])
    base = TrainConfig(sync_min=2, sync_max=5, precision="fp32", ce_fraction=1.0)
    (plain, _), _ = train_step_loss(drafter, tiny, ids, resp, lens, base, 3, 0.0)
    (total, logs), _ = train_step_loss(drafter, tiny, ids, resp, lens, replace(base, sync_weight=0.5), 3, 0.0)
    b, t = ids.shape
    pos = torch.arange(t).view(1, t).expand(b, t)
    sa = causal_mask(t).view(1, 1, t, t)
    step = tiny.full_forward(ids, attention_mask=(pos < lens.view(b, 1)).long())
    memory = drafter.memory_rows(step, pos).detach().requires_grad_(True)
    own = drafter.train_forward(ids, step, pos, sa, memory_mask(pos), memory)
    weights = loss_positions(resp, pos) & (pos < lens.view(b, 1))
    own_loss, _ = distill_loss(own.features, step.hidden, drafter.head, weights, base.ce_weight, 1.0)
    assert abs(total.item() - plain.item() - 0.5 * own_loss.item()) < 1e-4 * total.item()
    assert logs["sync_loss"] == pytest.approx(own_loss.item(), rel=1e-4)
    i = int(resp[0].nonzero()[3])
    (grad,) = torch.autograd.grad(own.features[0, i].sum(), memory)
    assert grad[0, i].abs().sum() > 0 and grad[0, i + 1 :].abs().sum() == 0
    with pytest.raises(ValueError, match="sync-weight"):
        make_drafter(replace(base, arch="eagle", sync_weight=0.5), tiny, samples)
    with pytest.raises(ValueError, match="lsa-skip-layers"):
        make_drafter(replace(base, arch="eagle", lsa_skip_layers=1), tiny, samples)
    with pytest.raises(ValueError, match="fused-memory"):
        make_drafter(replace(base, arch="eagle", fused_memory="summary"), tiny, samples)
    with pytest.raises(ValueError, match="pool-lr-scale"):  # the plain mean has no weights to scale
        make_drafter(replace(base, pool_lr_scale=50.0), tiny, samples)


def test_sync_fused_last_fuses_the_last_sync_points_entry(tiny, samples):
    """At depth 0 CA reads the position's own memory row; the fused entry is that row's too by default (own), and
    with --sync-fused last it is the last sync point's before the position, as in drafting."""
    from models.sync import last_sync_points, memory_mask
    from models.target import causal_mask

    torch.manual_seed(0)
    drafter = build_drafter("moa", tiny).float()
    drafter.use_fused_memory("hidden")
    torch.nn.init.normal_(drafter.fuse.weight, std=0.1)
    ids, resp, _ = collate(samples[:1])
    t = ids.shape[1]
    pos = torch.arange(t).view(1, t)
    step = tiny.full_forward(ids)
    memory = drafter.memory_rows(step, pos).detach().requires_grad_(True)
    last = last_sync_points(resp, 3, 3, torch.Generator().manual_seed(0))
    i = int(resp[0].nonzero()[4])
    assert 0 <= last[0, i] < i
    width = drafter.ca.row_width
    for fused, source in ((None, i), (memory_mask(last), int(last[0, i]))):
        out = drafter.train_forward(ids, step, pos, causal_mask(t).view(1, 1, t, t), memory_mask(pos), memory,
                                    fused_mask=fused)
        (grad,) = torch.autograd.grad(out.features[0, i].sum(), memory)
        assert grad[0, :, width:].abs().sum(-1).nonzero().flatten().tolist() == [source]
        assert grad[0, i, :width].abs().sum() > 0
    base = TrainConfig(sync_min=2, sync_max=5, precision="fp32", sync_fused="last")
    with pytest.raises(ValueError, match="sync-fused last needs"):
        make_drafter(replace(base, sync_weight=0.5), tiny, samples)  # no fused memory
    with pytest.raises(ValueError, match="sync-fused mix needs"):
        make_drafter(replace(base, sync_fused="mix"), tiny, samples)
    with pytest.raises(ValueError, match="own, last or mix"):
        make_drafter(replace(base, sync_fused="first"), tiny, samples)
    sync = {}
    for how in ("own", "last"):
        cfg = replace(base, sync_weight=0.5, sync_min=3, sync_max=3, sync_fused=how)
        (_, logs), _ = train_step_loss(drafter, tiny, ids, resp, torch.tensor([t]), cfg, 1, 0.0)
        sync[how] = logs["sync_loss"]
    assert sync["own"] != pytest.approx(sync["last"], rel=1e-6)


def test_sync_fused_mix_draws_own_or_last_per_sequence():
    """--sync-fused mix: each sequence's depth-0 fused entry is wholly its own row's or wholly its last sync
    point's, and a batch gets both."""
    from models.sync import memory_mask
    from models.train import depth0_fused_mask

    b, t = 16, 12
    positions = torch.arange(t).view(1, t).expand(b, t)
    last = (positions - 3).clamp(min=0)
    g = torch.Generator().manual_seed(0)
    assert depth0_fused_mask("own", last, positions, g, torch.float32) is None
    assert torch.equal(depth0_fused_mask("last", last, positions, g, torch.float32), memory_mask(last))
    mixed = depth0_fused_mask("mix", last, positions, g, torch.float32)
    kinds = []
    for row in range(b):
        if torch.equal(mixed[row], memory_mask(last)[row]):
            kinds.append("last")
        else:
            assert torch.equal(mixed[row], memory_mask(positions)[row])
            kinds.append("own")
    assert set(kinds) == {"own", "last"}


def test_probes_score_what_each_stage_of_the_memory_path_carries(tiny, tiny_moa, tmp_path):
    """models.probe: a probe from the target's own last hidden state agrees with it everywhere, one from noise
    hardly; the CLI scores every stage of a drafter's memory path in [0, 1] and writes them."""
    from dataclasses import asdict

    from models.probe import main as probe_main, ridge_top1

    rows = greedy_continuations(tiny, 10, new=30, seed=7)
    data = tmp_path / "data"
    data.mkdir()
    for name, part in (("train", rows[:8]), ("heldout", rows[8:])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in part))
    hidden = torch.cat([tiny.full_forward(torch.tensor([r.ids])).hidden[0].double() for r in rows])
    fit, test = hidden[:240], hidden[240:]
    assert ridge_top1(fit, fit, test, test, tiny.lm_head, alpha=1e-9) == 1.0
    noise = torch.randn_like(hidden, dtype=torch.float64)
    assert ridge_top1(noise[:240], fit, noise[240:], test, tiny.lm_head) < 0.5

    tiny_moa.save_pretrained(tmp_path / "moa")
    scores = probe_main(["--target", "tiny", "--drafter", str(tmp_path / "moa"), "--data", str(data),
                         "--train-rows", "8", "--heldout-rows", "2", "--out", str(tmp_path / "probe.json")])
    assert scores["heldout_positions"] == 60
    stages = [k for k in scores if "positions" not in k]
    assert len(stages) == 5 and all(0.0 <= scores[k] <= 1.0 for k in stages)
    assert json.loads((tmp_path / "probe.json").read_text()) == scores


def test_paired_difference_tells_a_real_gap_from_noise():
    """Two drafters scored on the same answers: one that agrees more on every answer has a gap whose 95 % interval
    excludes 0; with the same agreement on average but different answers, the interval contains 0; the same drafter
    against itself gives exactly 0; results on different answers are refused."""
    from models.evaluate import paired_difference

    rng = np.random.default_rng(0)
    points = rng.integers(10, 40, 50)

    def scored(rate: np.ndarray) -> dict:  # hits per depth: each answer's own rate at every depth
        hits = rng.binomial(points[:, None], rate[:, None] * np.ones((1, 6)))
        rates = hits.sum(0) / points.sum()
        return {"expected_tau": float(1 + np.cumprod(rates).sum()),
                "per_answer": {"hits": hits.tolist(), "sync_points": points.tolist()}}

    hard = rng.uniform(0.2, 0.7, 50)  # answers differ in how predictable they are
    base, better = scored(hard), scored(hard + 0.15)
    gap = paired_difference(base, better)
    assert gap["difference"] > 0 and gap["ci95"][0] > 0 and gap["answers"] == 50
    shuffled = scored(rng.permutation(hard))  # as good on average, on other answers
    assert paired_difference(base, shuffled)["ci95"][0] < 0 < paired_difference(base, shuffled)["ci95"][1]
    assert paired_difference(base, base) == {"difference": 0.0, "answers": 50, "ci95": [0.0, 0.0]}
    fewer = {**base, "per_answer": {**base["per_answer"], "sync_points": (points + 1).tolist()}}
    with pytest.raises(ValueError, match="different answers"):
        paired_difference(base, fewer)


def test_evaluate_scores_drafters_through_the_wire_codec(tiny, tiny_moa, tmp_path):
    """models.evaluate: int8 rows are what the edge decodes (quantised within max|x|/254 per row, fp32 untouched);
    the CLI scores each drafter and codec on held-out conversations and writes them; unknown codecs are refused."""
    from models.evaluate import chain_agreement, main as evaluate_main, wire

    x = torch.randn(2, 5, 40, dtype=torch.float64) * 10
    assert wire(x, "fp32") is x
    q = wire(x, "int8")
    assert q.shape == x.shape and q.dtype == x.dtype and not torch.equal(q, x)
    assert ((q - x).abs() <= x.abs().amax(-1, keepdim=True) / 254 + 1e-6).all()
    with pytest.raises(ValueError, match="rows"):
        chain_agreement(tiny_moa, tiny, [], rows="bf16")

    answers = ["the robot paints a red sky.", "nine plus one is ten, not eleven.", "cats sleep all day long!"]
    convs = tmp_path / "heldout.jsonl"
    convs.write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": "tell me something"}, {"from": "gpt", "value": a}]}) + "\n"
        for i, a in enumerate(answers)))
    tiny_moa.save_pretrained(tmp_path / "moa")
    moa, other = str(tmp_path / "moa"), str(tmp_path / "other")
    build_drafter("moa", tiny).save_pretrained(other)  # an untrained one: the CLI compares it with the first
    out = evaluate_main(["--target", "tiny", "--drafter", moa, other, "--heldout", str(convs), "--samples", "2",
                         "--rows", "fp32,int8", "--out", str(tmp_path / "eval.json")])
    assert out["samples"] == 2
    for codec in ("fp32", "int8"):
        ev = out["drafters"][moa][codec]
        assert ev["sync_points"] > 0 and all(0.0 <= a <= 1.0 for a in ev["depth_agreement"])
        per = ev["per_answer"]  # what paired_difference resamples adds up to the figures
        assert len(per["hits"]) == 2 and sum(per["sync_points"]) == ev["sync_points"]
        assert np.allclose(np.sum(per["hits"], axis=0) / ev["sync_points"], ev["depth_agreement"])
        diff = out["comparisons"][f"{other} - {moa}"][codec]
        tau = out["drafters"][other][codec]["expected_tau"] - ev["expected_tau"]
        assert diff["answers"] == 2 and diff["difference"] == pytest.approx(tau)
        assert diff["ci95"][0] <= diff["ci95"][1]
    assert json.loads((tmp_path / "eval.json").read_text()) == out
    with pytest.raises(SystemExit):
        evaluate_main(["--target", "tiny", "--drafter", moa, "--heldout", str(convs), "--rows", "bf16"])


def test_the_training_clis_say_what_is_wrong_before_any_work(tmp_path, capsys):
    """A missing source, a drafter path that is not one or a drafter of another target: `error: ...` and the exit,
    not a traceback, and not after a first drafter was evaluated (evaluate loads every drafter first)."""
    from models.evaluate import main as evaluate_main
    from models.registry import load_target

    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(SystemExit, match=f"error: no conversations file at {missing}"):
        regenerate_main(["--target", "tiny", "--source", missing, "--out", str(tmp_path / "out.jsonl")])
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(SystemExit, match="error: no conversations file"):
        train_main(["--target", "tiny", "--arch", "moa", "--data", str(tmp_path / "data"), "--source", missing,
                    "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit):
        train_main(["--target", "tiny", "--arch", "medusa", "--out", str(tmp_path / "run")])
    assert "invalid choice: 'medusa'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--target", "tiny", "--arch", "moa", "--ema", "1", "--out", str(tmp_path / "run")])
    assert "--ema is a decay in [0, 1)" in capsys.readouterr().err
    build_drafter("moa", load_target("tiny")).save_pretrained(tmp_path / "good")
    build_drafter("moa", load_target("tiny:1")).save_pretrained(tmp_path / "other")  # trained for another target
    with pytest.raises(SystemExit, match="error: .*not a directory"):
        evaluate_main(["--target", "tiny", "--drafter", str(tmp_path / "good"), str(tmp_path / "nothing")])
    assert "expected tau" not in capsys.readouterr().out  # nothing was evaluated
    with pytest.raises(SystemExit, match="error: drafter .* was trained for target 'tiny-llama-1'"):
        evaluate_main(["--target", "tiny", "--drafter", str(tmp_path / "other")])

"""Export to an edge bundle and the torch-free edge runtime: parity, identical draft trees, bundle checks, int8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from edge_client.bundle import BUNDLE_FILE, GRAPH_FILE, TOKENIZER_FILE, BundleError, load_bundle
from edge_client.chat import ChatTemplate, ChatTokenizer
from moa_core.drafting import DraftSession
from edge_client.runtime import OrtDraftStep, choose_providers
from moa_core.tree import TreeConfig
from export.to_onnx import ExportError, export_bundle
from models.registry import build_drafter, load_drafter, load_target
from models.engine import TorchDraftStep
from models.verify import verify_tree
from tests.helpers import run_blocked

PROMPTS = ("hello there", "What is 2 plus 2?")
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "OK, thanks!"}],
]


@pytest.fixture(scope="module")
def target():
    return load_target("tiny")  # float32: the graph is float32


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """arch -> (drafter dir, fp32 bundle dir, bundle.json) for an untrained tiny drafter of each architecture."""
    out = {}
    for arch in ("moa", "eagle"):
        root = tmp_path_factory.mktemp(arch)
        build_drafter(arch, target).save_pretrained(root / "drafter")
        meta = export_bundle(root / "drafter", root / "bundle", "fp32", target, parity_prompts=PROMPTS,
                             heldout_prompts=PROMPTS, max_new_tokens=12, log=lambda s: None)
        out[arch] = (root / "drafter", root / "bundle", meta)
    return out


def assert_same_trees(target, drafter, bundle, prompt: str, rounds: int = 4, tree=TreeConfig(4, 3, 12)) -> None:
    """Greedy speculative rounds on the target: the ORT and the torch DraftSession draft the very same trees."""
    torch_step, ort_step = TorchDraftStep(drafter), OrtDraftStep(bundle, providers="cpu")
    ids = target.encode_chat([{"role": "user", "content": prompt}])
    runner = target.new_runner()
    step = runner.forward(ids)
    sessions = [DraftSession(torch_step), DraftSession(ort_step)]
    rows = torch_step.memory_rows(step, list(range(len(ids))))
    for s in sessions:
        s.add_verified(ids, rows)
    root = int(step.logits[-1].argmax())
    for _ in range(rounds):
        ref, got = (s.draft(root, tree) for s in sessions)
        for field in ("tokens", "parents", "depths"):
            np.testing.assert_array_equal(getattr(got, field), getattr(ref, field))
        np.testing.assert_allclose(got.q_probs, ref.q_probs, atol=1e-4)
        verified = verify_tree(runner, root, ref)
        base = len(sessions[0].tokens)
        rows = torch_step.memory_rows(verified.step, list(range(base, base + 1 + len(verified.path))))
        for s, t in zip(sessions, (ref, got)):
            s.accept(t, root, verified.path, rows)
        root = verified.next_token


# ---- parity and trees ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["moa", "eagle"])
def test_parity_and_acceptance_recorded(exported, arch):
    _, bundle_dir, meta = exported[arch]
    p, a = meta["checks"]["parity"], meta["checks"]["acceptance"]
    assert p["max_abs_logits"] <= 1e-4 and p["top1_agreement"] == 1.0 and p["rows"] > 10
    assert a["tau_ort"] == a["tau_torch"] >= 1.0
    assert json.loads((bundle_dir / BUNDLE_FILE).read_text()) == meta
    assert set(meta["graph"]["inputs"]) == {"ids", "positions", "past_k", "past_v", "mask",
                                            "memory" if arch == "moa" else "features"}
    assert meta["graph"]["inputs"]["mask"] == [1, 1, "n", "T + n"]
    assert meta["graph"]["outputs"]["present_k"][2] == "T + n"


@pytest.mark.parametrize("arch", ["moa", "eagle"])
def test_ort_trees_equal_torch_trees(exported, target, arch):
    drafter_dir, bundle_dir, _ = exported[arch]
    drafter = load_drafter(drafter_dir, target).float()
    for prompt in PROMPTS:
        assert_same_trees(target, drafter, bundle_dir, prompt)


def test_reduced_draft_vocab_bundle(target, tmp_path):
    """A drafter with a reduced draft vocabulary exports its id map; ORT drafts the same trees, in target ids."""
    drafter = build_drafter("moa", target)
    drafter.set_draft_vocab(list(range(3, 60)))
    drafter.save_pretrained(tmp_path / "drafter")
    meta = export_bundle(tmp_path / "drafter", tmp_path / "bundle", "fp32", target, parity_prompts=PROMPTS,
                         heldout_prompts=(), log=lambda s: None)
    assert meta["draft_vocab_size"] == 57 and "draft_vocab.npy" in meta["files"]
    step = OrtDraftStep(tmp_path / "bundle", providers="cpu")
    assert step.draft_vocab.tolist() == list(range(3, 60))
    assert_same_trees(target, load_drafter(tmp_path / "drafter", target).float(), tmp_path / "bundle", PROMPTS[1])
    np.save(tmp_path / "bundle" / "draft_vocab.npy", np.arange(57))
    with pytest.raises(BundleError, match="sha256"):
        load_bundle(tmp_path / "bundle")



def test_memory_path_options_bundle(target, tmp_path):
    """A MoA drafter with the LSA skip, a widened CA and the target's fused hidden state exports; its wider memory
    rows are in the bundle's layout and ORT drafts the same trees as PyTorch."""
    torch.manual_seed(5)
    drafter = build_drafter("moa", target)
    drafter.use_lsa_skip(2)
    drafter.widen_memory(drafter.config.ca_heads)
    drafter.use_fused_memory("hidden")
    torch.nn.init.normal_(drafter.lsa_skip.weight, std=0.05)
    torch.nn.init.normal_(drafter.fuse.weight, std=0.02)
    drafter.save_pretrained(tmp_path / "drafter")
    meta = export_bundle(tmp_path / "drafter", tmp_path / "bundle", "fp32", target, parity_prompts=PROMPTS,
                         heldout_prompts=(), log=lambda s: None)
    c = drafter.config
    assert meta["memory"]["row_width"] == drafter.row_width == 2 * c.ca_heads * c.head_dim + c.hidden_size
    assert meta["memory"]["fields"][-1]["name"] == "hidden"
    assert_same_trees(target, load_drafter(tmp_path / "drafter", target).float(), tmp_path / "bundle", PROMPTS[1])

# ---- the bundle ------------------------------------------------------------------------------------------------
def test_bundle_round_trip_and_fingerprint(exported, target):
    _, bundle_dir, meta = exported["moa"]
    bundle = load_bundle(bundle_dir)
    drafter = build_drafter("moa", target)
    assert (bundle.arch, bundle.dtype, bundle.fingerprint) == ("moa", "fp32", target.fingerprint)
    assert bundle.cache_shape == drafter.cache_shape() and bundle.row_width == drafter.row_width
    assert bundle.keeps_draft_cache and set(bundle.eos_token_ids) == target.eos_token_ids
    assert target.fingerprint in bundle.describe()
    assert meta["protocol_version"] >= 1 and meta["opset"] == 23
    tok = bundle.chat_tokenizer()
    for messages in MESSAGES:
        ids = tok.encode_chat(messages)
        assert ids == target.encode_chat(messages)
        assert tok.decode(ids) == target.tokenizer.decode(ids, skip_special_tokens=True)
    step = OrtDraftStep(bundle)
    assert step.provider in choose_providers("auto")


def corrupt(bundle_dir: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(bundle_dir, copy)
    edit(copy)
    return copy


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def set_protocol(directory: Path, version: int) -> None:
    meta = json.loads((directory / BUNDLE_FILE).read_text())
    meta["protocol_version"] = version
    (directory / BUNDLE_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("edit, message", [
    (lambda d: flip_byte(d / GRAPH_FILE), "drafter.onnx: sha256 does not match"),
    (lambda d: (d / TOKENIZER_FILE).unlink(), "tokenizer.json: missing"),
    (lambda d: (d / GRAPH_FILE).write_bytes((d / GRAPH_FILE).read_bytes()[:-10]), "drafter.onnx: .* bytes"),
    (lambda d: set_protocol(d, 99), "protocol version 99 is not supported"),
    (lambda d: (d / BUNDLE_FILE).unlink(), "not an edge bundle"),
    (lambda d: (d / BUNDLE_FILE).write_text("{"), "bundle.json: not valid JSON"),
])
def test_corrupt_bundle_refused(exported, tmp_path, edit, message):
    bad = corrupt(exported["moa"][1], tmp_path, edit)
    with pytest.raises(BundleError, match=message):
        load_bundle(bad)
    with pytest.raises(BundleError, match=message):
        OrtDraftStep(bad)


def test_edge_runs_bundle_without_torch(exported):
    _, bundle_dir, _ = exported["eagle"]
    code = f"""
import numpy as np
from edge_client.bundle import load_bundle
from moa_core.drafting import DraftSession
from edge_client.runtime import OrtDraftStep
from moa_core.tree import TreeConfig
bundle = load_bundle({str(bundle_dir)!r})
ids = bundle.chat_tokenizer().encode_chat([{{"role": "user", "content": "hi"}}])
session = DraftSession(OrtDraftStep(bundle))
session.add_verified(ids, np.zeros((len(ids), bundle.row_width), np.float32))
print(len(session.draft(ids[-1], TreeConfig(3, 2, 5))))
"""
    out = run_blocked(code)
    assert out.returncode == 0 and out.stdout.strip() == "5", out.stderr


# ---- int8, errors, CLI -----------------------------------------------------------------------------------------
def test_int8_bundle_loads_and_runs(exported, target, tmp_path):
    drafter_dir, fp32_dir, _ = exported["moa"]
    meta = export_bundle(drafter_dir, tmp_path / "int8", "int8", target, parity_prompts=PROMPTS[:1],
                         heldout_prompts=(), log=lambda s: None)
    assert meta["dtype"] == "int8" and "acceptance" not in meta["checks"]
    assert 0 < meta["checks"]["parity"]["top1_agreement"] <= 1
    graph = onnx.load(str(tmp_path / "int8" / GRAPH_FILE))
    weights = [t for t in graph.graph.initializer if len(t.dims) >= 2]
    assert weights and all(t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) for t in weights)  # LM head, embedding too
    assert (tmp_path / "int8" / GRAPH_FILE).stat().st_size < (fp32_dir / GRAPH_FILE).stat().st_size
    bundle = load_bundle(tmp_path / "int8")
    session = DraftSession(OrtDraftStep(bundle))
    ids = target.encode_chat(MESSAGES[0])
    session.add_verified(ids, np.random.default_rng(0).standard_normal((len(ids), bundle.row_width)))
    tree = session.draft(ids[-1], TreeConfig(3, 2, 5))
    assert len(tree) == 5 and np.isfinite(tree.q_probs).all()


def test_export_errors(exported, target, tmp_path):
    drafter_dir = exported["moa"][0]
    with pytest.raises(ExportError, match="unknown drafter"):
        export_bundle(tmp_path / "nowhere", tmp_path / "out", target=target)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ExportError, match="not writable"):
        export_bundle(drafter_dir, blocker / "out", target=target)
    with pytest.raises(ExportError, match="fp16"):
        export_bundle(drafter_dir, tmp_path / "out", "fp16", target=target)
    with pytest.raises(ExportError, match="fingerprint"):
        export_bundle(drafter_dir, tmp_path / "out", target=load_target("tiny:1"))
    no_fp = tmp_path / "no_fp"
    shutil.copytree(drafter_dir, no_fp)
    config = json.loads((no_fp / "config.json").read_text())
    del config["target_fingerprint"]
    (no_fp / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="no target_fingerprint"):
        export_bundle(no_fp, tmp_path / "out", target=target)
    assert not (tmp_path / "out").exists()  # nothing written by failed exports, not even the directory
    with pytest.raises(ValueError, match="not available"):
        choose_providers(["NoSuchExecutionProvider"])


def test_cli_help(capsys):
    from export.to_onnx import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and "--dtype" in out and "bundle.json" in out


# ---- chat templates --------------------------------------------------------------------------------------------
def test_chat_template_matches_transformers_smollm2(real_target_dir):
    from transformers import AutoTokenizer

    directory = real_target_dir
    hf = AutoTokenizer.from_pretrained(directory)
    tok = ChatTokenizer(directory / "tokenizer.json", ChatTemplate(hf.chat_template, hf.special_tokens_map),
                        [hf.eos_token_id])
    for messages in MESSAGES:
        for gen in (True, False):
            text = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert tok.template.render(messages, gen) == text
            ids = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            assert tok.encode_chat(messages, gen) == list(ids if isinstance(ids, list) else ids["input_ids"])
    # the edge's special tokens (never copied offline) are transformers' too
    assert tok.special_token_ids() >= set(hf.all_special_ids) | {hf.eos_token_id}


# ---- the real default drafter ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_default_moa_bundle_on_real_target(real_target, tmp_path):
    from models.defaults import DEFAULTS_DIR

    if not (DEFAULTS_DIR / "moa" / "config.json").exists():
        pytest.skip("models/default/moa has not been shipped yet")
    meta = export_bundle("default", tmp_path / "bundle", "fp32", real_target, heldout_prompts=(), log=print)
    assert meta["checks"]["parity"]["top1_agreement"] == 1.0
    drafter = load_drafter("default", real_target).float()
    assert_same_trees(real_target, drafter, tmp_path / "bundle", "What is the capital of France?", rounds=3)

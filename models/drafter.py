"""What every drafter shares: the two deployment halves, saving with the target fingerprint, the loss
(`models.registry` builds and loads drafters).

A drafter has two halves:
- the **memory head** (`memory_rows`): the target's activations of verified tokens -> memory rows. It runs where
  the target runs (the server).
- the **draft step** (`draft_step`): token ids + positions + its own self-attention cache + memory rows (MoA) or
  parent features (EAGLE) + a float tree mask -> logits, output features and the grown cache. It runs on the edge.

The token embedding and the LM head are the target's (frozen, shared); checkpoints hold drafter weights only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from models.target import Target, TargetStep, hash_weights

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
RECORD_FILE = "training_record.json"  # the training record, also inside config.json ("training")
# the target's own weights (the draft head: rows of its LM head; tli: copies of its last layers): never saved
SHARED_PREFIXES = ("embed.", "lm_head.", "draft_head.", "tli.")


class FingerprintMismatch(ValueError):
    """A drafter was loaded against a target it was not trained for."""


class OneDeviceOnly(ValueError):
    """A drafter that drafts on the target's device only (target layer inference) was asked to draft on edges."""


@dataclass
class DraftOutput:
    logits: torch.Tensor  # (B, n, V)
    features: torch.Tensor  # (B, n, H): the drafter's estimate of the target's last hidden state (TLI: of the
    # hidden state entering the target's last `tli` layers)
    keys: torch.Tensor  # (B, h_kv, T+n, d): self-attention cache after this step
    values: torch.Tensor
    memory: torch.Tensor | None = None  # (B, T, R): MoA's memory rows of a training pass, for reuse
    head_input: torch.Tensor | None = None  # (B, n, H) what the LM head reads when it is not `features` (MoA's TLI)
    tli_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # MoA's TLI: per layer the K/V the new rows added


class Drafter(nn.Module):
    """Base class of MoA and EAGLE drafters."""

    arch: ClassVar[str]
    config_class: ClassVar[type]
    # True when the SA cache entries of accepted draft nodes stay valid after verification (MoA: SA sees tokens
    # only). False when they must be recomputed from the target's true features (EAGLE).
    keeps_draft_cache: ClassVar[bool]

    @property
    def agreement_topk(self) -> dict | None:
        """Held-out top-k agreement per depth from the training record ({width: [a_1, ..]}), if it has one: what
        tree auto predicts tau with."""
        return ((self.training_record or {}).get("heldout") or {}).get("depth_agreement_topk")

    def __init__(self, config, target: Target):
        super().__init__()
        self.config = config
        self.training_record: dict | None = None  # set by models.registry.load_drafter from config.json
        self.target_fingerprint = target.weights_fingerprint
        self.target_name = target.name
        spec = target.spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.embed.weight = nn.Parameter(target.model.get_input_embeddings().weight.detach().clone(), False)
        self.lm_head.weight = nn.Parameter(target.lm_head.weight.detach().clone(), False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("draft_vocab", None)
        self.draft_head: nn.Linear | None = None

    # --- the reduced draft vocabulary (FR-Spec, EAGLE-3) ----------------------------------------------------
    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft only over these target-vocabulary ids: the head is those rows of the target's LM head, and
        `token_ids` maps the drafter's output indices back. None restores the full vocabulary."""
        if ids is None:
            self.draft_vocab, self.draft_head = None, None
            return
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.lm_head.weight.device).sort().values
        if len(ids) and (ids[0] < 0 or ids[-1] >= self.lm_head.weight.shape[0] or len(ids.unique()) != len(ids)):
            raise ValueError("a draft vocabulary is a set of distinct target-vocabulary ids")
        self.draft_vocab = ids
        head = nn.Linear(self.lm_head.in_features, len(ids), bias=False)
        head.weight = nn.Parameter(self.lm_head.weight.detach()[ids].clone(), requires_grad=False)
        self.draft_head = head

    @property
    def head(self) -> nn.Module:
        """The LM head drafting uses: the draft head when the vocabulary is reduced, else the target's."""
        return self.draft_head if self.draft_head is not None else self.lm_head

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the drafter's logits -> target-vocabulary token ids."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def vocab_index(self) -> torch.Tensor | None:
        """Target-vocabulary id -> index into the drafter's logits (-1 outside the draft vocabulary), or None."""
        if self.draft_vocab is None:
            return None
        index = torch.full((self.lm_head.weight.shape[0],), -1, dtype=torch.long, device=self.draft_vocab.device)
        index[self.draft_vocab] = torch.arange(len(self.draft_vocab), device=self.draft_vocab.device)
        return index

    # --- the two halves -------------------------------------------------------------------------------------
    def memory_rows(self, step: TargetStep, positions: torch.Tensor) -> torch.Tensor:
        """Target activations of n verified tokens (batched: keys/values (B,L,n,w), hidden (B,n,H)) -> (B,n,R)."""
        raise NotImplementedError

    def draft_step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor | None,
        past_v: torch.Tensor | None,
        mask: torch.Tensor | None,
        memory: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        with_logits: bool = True,
    ) -> DraftOutput:
        raise NotImplementedError

    def train_forward(
        self, ids: torch.Tensor, step: TargetStep, positions: torch.Tensor, sa_mask: torch.Tensor,
        memory_mask: torch.Tensor, memory: torch.Tensor | None = None,
    ) -> DraftOutput:
        """The training pass over whole sequences (B, T), with the target's activations of every position.

        Returns features only (logits None): the loss applies the LM head where it needs it. `memory` reuses the
        memory rows of an earlier pass over the same batch (MoA)."""
        raise NotImplementedError

    @property
    def row_width(self) -> int:
        """Floats per memory row."""
        raise NotImplementedError

    def cache_shape(self) -> tuple[int, int]:
        """(h_kv, head_dim) of the self-attention cache."""
        raise NotImplementedError

    @property
    def tli_layers(self) -> int:
        """How many of the target's last layers the drafter drafts through (MoA's target layer inference; 0: none)."""
        return getattr(self.config, "tli", 0)

    def added_parameters(self) -> list[nn.Parameter]:
        """Parameters added to the paper's architecture that start where they keep a trained drafter's function
        (at zero, or at the plain mean): at the drafter's own lr they barely move in a leg (`--pool-lr-scale`)."""
        return []

    def target_layers(self) -> dict[str, int]:
        """Which of the drafter's decoder layers have the target's layer shape, and which target layer (index)
        initialises each under `--layer-init target`."""
        raise NotImplementedError

    def init_from_target(self, target: Target) -> None:
        """Copy target layers into the drafter's (same parameter names as Hugging Face Llama layers)."""
        layers = target.model.model.layers
        for name, index in self.target_layers().items():
            state = layers[index % len(layers)].state_dict()
            missing, unexpected = getattr(self, name).load_state_dict(state, strict=False)
            if [k for k in missing if "rotary" not in k] or unexpected:
                raise ValueError(f"target layer {index} does not fit the drafter's {name}: missing {missing}, "
                                 f"unexpected {unexpected}")

    # --- save / load ----------------------------------------------------------------------------------------
    @staticmethod
    def is_own(name: str) -> bool:
        """Whether parameter `name` is the drafter's own (trained, saved), not one of the target's shared weights."""
        return not name.startswith(SHARED_PREFIXES)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if self.is_own(k)}

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float32, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
                 for k, v in self.trainable_state_dict().items()}
        save_file(state, str(path / WEIGHTS_FILE))
        meta = {
            "arch": self.arch,
            "config": asdict(self.config),
            "target": self.target_name,
            "target_fingerprint": self.target_fingerprint,
            "draft_vocab_size": 0 if self.draft_vocab is None else len(self.draft_vocab),
            **(extra or {}),
        }
        (path / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def trainable_parameters(drafter: Drafter) -> list[nn.Parameter]:
    """The drafter's own parameters (the shared target weights stay frozen); sets requires_grad accordingly."""
    params = []
    for name, p in drafter.named_parameters():
        p.requires_grad_(drafter.is_own(name))
        if p.requires_grad:
            params.append(p)
    return params


def distill_loss(
    features: torch.Tensor,
    target_hidden: torch.Tensor,
    lm_head: nn.Module,
    weights: torch.Tensor,
    ce_weight: float = 0.1,
    ce_fraction: float = 1.0,
    generator: torch.Generator | None = None,
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    vocab_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SmoothL1(feature, target hidden) + ce_weight * CE against the target's next-token distribution (forward KL).

    features/target_hidden (B, T, H); weights (B, T) say how much each position counts (0: not at all; a bool
    mask works too). The CE term needs the LM head on both sides, the costliest part on CPU: `ce_fraction` < 1
    takes it on a random share of positions.
    The target's distribution is softmax(lm_head(target_hidden)) over the head's vocabulary, or, from a feature
    cache, `target_topk` (ids (B,T,k) in the target vocabulary, probs (B,T,k)), mapped by `vocab_index` into a
    reduced draft vocabulary and renormalised over what falls inside it.
    """
    target_hidden = target_hidden.to(features.dtype)
    m = weights.to(torch.float32)
    l1 = (F.smooth_l1_loss(features.float(), target_hidden.float(), reduction="none").mean(-1) * m).sum()
    l1 = l1 / m.sum().clamp(min=1e-9)
    pos = (m > 0).nonzero(as_tuple=True)
    if ce_fraction < 1.0 and len(pos[0]) > 1:
        keep = torch.randperm(len(pos[0]), generator=generator)[: max(1, int(len(pos[0]) * ce_fraction))]
        pos = (pos[0][keep], pos[1][keep])
    if not len(pos[0]):
        return l1, {"loss": l1.item(), "smooth_l1": l1.item(), "ce": 0.0, "top1": 0.0}
    logq = torch.log_softmax(lm_head(features[pos]).float(), -1)
    if target_topk is None:
        with torch.no_grad():
            p = torch.softmax(lm_head(target_hidden[pos]).float(), -1)
        ce = -(p * logq).sum(-1)
        best = p.argmax(-1)
    else:
        ids, p = target_topk[0][pos], target_topk[1][pos].float()
        if vocab_index is not None:
            ids = vocab_index[ids]
            p = p * (ids >= 0)
        best = ids[:, 0]  # the target's top-1 (-1 when outside the draft vocabulary: never agreed with)
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
        ce = -(p * logq.gather(-1, ids.clamp(min=0))).sum(-1)
    ce = (ce * m[pos]).sum() / m[pos].sum()
    acc = (logq.argmax(-1) == best).float().mean()
    loss = l1 + ce_weight * ce
    return loss, {"loss": loss.item(), "smooth_l1": l1.item(), "ce": ce.item(), "top1": acc.item()}


def require_edge_drafter(drafter: Drafter) -> Drafter:
    """`drafter`, if it can draft on an edge from memory rows alone; a TLI drafter reads the target's cache."""
    tli = drafter.tli_layers
    if tli:
        raise OneDeviceOnly(f"this MoA drafter uses target layer inference (tli={tli}): its drafts go through the "
                            "target's last layers and their cache, so it drafts on one device only (models.generate, "
                            "bench single), not from an edge bundle or for a verify server")
    return drafter


def drafter_fingerprint(drafter: Drafter) -> str:
    """Architecture, config and weights (as float16, like the target's) of a drafter: 16 hex digits."""
    h = hashlib.sha256(json.dumps({"arch": drafter.arch, "config": asdict(drafter.config)}, sort_keys=True).encode())
    hash_weights(h, drafter.trainable_state_dict())
    return h.hexdigest()[:16]


def bundle_fingerprint(target: Target, drafter: Drafter | None) -> str:
    """What an edge bundle and the server must share: `tokenizer=<hex>;target=<hex>;memory=<hex>`.

    `memory=none` when the server has no drafter; `protocol.fingerprint_diff` names the parts that differ.
    `target` names the weights, not their quantisation: a bundle exported for the float target also serves its int8
    version (the int8 K/V move the memory rows by about a percent; the acceptance it costs is in the README).
    """
    vocab = json.dumps(sorted(target.tokenizer.get_vocab().items()), separators=(",", ":")).encode()
    memory = drafter_fingerprint(drafter) if drafter is not None else "none"
    return f"tokenizer={hashlib.sha256(vocab).hexdigest()[:16]};target={target.weights_fingerprint};memory={memory}"

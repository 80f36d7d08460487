"""The EAGLE-1 drafter (Li et al., 2024), our baseline: input Linear([f_{t-1}; E(x_t)]), one decoder layer, the
target's LM head. Its memory rows are the target's last hidden states of verified tokens; while drafting, and
offline, it feeds its own predicted features back."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.drafter import Drafter, DraftOutput
from models.layers import DecoderLayer, LayerConfig
from models.target import Target, TargetSpec, TargetStep


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    feature_noise: float = 0.2  # uniform noise on input features during training (EAGLE: U(-0.1, 0.1)*2)

    @classmethod
    def for_target(cls, spec: TargetSpec, **overrides) -> "EagleConfig":
        values = dict(hidden_size=spec.hidden_size, vocab_size=spec.vocab_size, n_heads=spec.n_heads,
                      n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
                      rope_theta=spec.rope_theta, rms_norm_eps=spec.rms_norm_eps)
        values.update(overrides)
        return cls(**values)

    def layer(self) -> LayerConfig:
        return LayerConfig(self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim, self.intermediate_size,
                           self.rope_theta, self.rms_norm_eps)


class EagleDrafter(Drafter):
    arch = "eagle"
    config_class = EagleConfig
    keeps_draft_cache = False

    def __init__(self, config: EagleConfig, target: Target):
        super().__init__(config, target)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config.layer())

    @property
    def row_width(self) -> int:
        return self.config.hidden_size

    def target_layers(self) -> dict[str, int]:
        return {"layer": -1}

    def cache_shape(self) -> tuple[int, int]:
        return self.config.n_kv_heads, self.config.head_dim

    def memory_rows(self, step: TargetStep, positions: torch.Tensor) -> torch.Tensor:
        return step.hidden.to(self.fc.weight.dtype)

    def draft_step(self, ids, positions, past_k, past_v, mask, memory=None, features=None, memory_mask=None,
                   with_logits=True):
        """`features` (B, n, H): for each token x_t, the feature of position t-1 (its parent's)."""
        x = self.fc(torch.cat([features, self.embed(ids)], dim=-1))
        x, k, v = self.layer(x, positions, mask, past_k, past_v)
        return DraftOutput(self.head(x) if with_logits else None, x, k, v)

    def train_forward(self, ids, step: TargetStep, positions, sa_mask, memory_mask=None, memory=None) -> DraftOutput:
        """Teacher forcing on the target's features, shifted by one, with uniform noise while training."""
        hidden = step.hidden.to(self.fc.weight.dtype)
        features = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
        if self.training and self.config.feature_noise > 0:
            features = features + (torch.rand_like(features) - 0.5) * self.config.feature_noise
        return self.draft_step(ids, positions, None, None, sa_mask, features=features, with_logits=False)

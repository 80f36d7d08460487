"""Sync points and the masks that make one training pass on-policy (docs/design.md §3).

A sync point is a position whose target activations the drafter may use: at run time, after a verification
that ends at position s, the drafter drafts s+1, s+2, ... with the memory frozen at s. Every non-response
position is a sync point (the prompt is prefilled); inside a response every k-th position is one, k drawn per
sequence. For position i, `last_sync[i]` is the last sync point strictly before i (-1 if none): CA at i sees
memory rows 0..last_sync[i], SA sees embeddings 0..i (or, under the curriculum, last_sync[i]+1..i).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def last_sync_points(response_mask: torch.Tensor, k_min: int, k_max: int, generator: torch.Generator) -> torch.Tensor:
    """response_mask (B, T) bool -> last_sync (B, T) long."""
    b, t = response_mask.shape
    out = torch.full((b, t), -1, dtype=torch.long)
    for row in range(b):
        resp = response_mask[row].tolist()
        k = int(torch.randint(k_min, k_max + 1, (1,), generator=generator))
        last, next_sync = -1, None
        for i in range(t):
            out[row, i] = last
            if not resp[i]:
                last, next_sync = i, None  # prompt positions are all sync points
                continue
            if next_sync is None:  # first response position: the first sync lands 1..k positions later
                next_sync = i - 1 + int(torch.randint(1, k + 1, (1,), generator=generator))
            if i == next_sync:
                last, next_sync = i, i + k
    return out


def memory_mask(last_sync: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, 1, T, T): query i sees memory rows j <= last_sync[i] (row 0 when none, such positions carry no loss)."""
    t = last_sync.shape[1]
    j = torch.arange(t)
    visible = j.view(1, 1, t) <= last_sync.clamp(min=0).unsqueeze(-1)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, NEG_INF).unsqueeze(1)


def self_attention_mask(
    last_sync: torch.Tensor, lengths: torch.Tensor, restrict: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(B, 1, T, T) causal over real tokens; rows of `restrict`ed sequences see only last_sync[i]+1..i."""
    b, t = last_sync.shape
    i = torch.arange(t).view(1, t, 1)
    j = torch.arange(t).view(1, 1, t)
    visible = (j <= i) & (j < lengths.view(b, 1, 1))
    since_sync = j > last_sync.unsqueeze(-1)
    visible = torch.where(restrict.view(b, 1, 1), visible & since_sync, visible) | (i == j)
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, NEG_INF).unsqueeze(1)


def loss_positions(response_mask: torch.Tensor, last_sync: torch.Tensor) -> torch.Tensor:
    """Positions i whose next token x_{i+1} is a drafted response token: resp[i] & resp[i+1] & memory exists."""
    nxt = torch.zeros_like(response_mask)
    nxt[:, :-1] = response_mask[:, 1:]
    return response_mask & nxt & (last_sync >= 0)


def depth_weights(loss_mask: torch.Tensor, last_sync: torch.Tensor, decay: float) -> torch.Tensor:
    """(B, T) float: loss weight decay**(d-1) at draft depth d = i - last_sync[i] (1 = the first draft after a sync).

    Acceptance is a product over depths, so depth 1 weighs most at run time; decay 1 weighs every depth alike."""
    depth = torch.arange(last_sync.shape[1]).view(1, -1) - last_sync
    return loss_mask.float() * decay ** (depth - 1).clamp(min=0).float()

"""Attention that gives each query row the result it gets when decoded alone: the int8 target's other half of being
call-shape invariant.

A fused attention kernel reduces over the whole key axis of a call, masked keys included, and blocks its work by
the call's shape, so a tree verify's row differs from the same token's one-token decode by ~1e-6. Int8 Linear
layers (models/quant.py) are exact row by row, but they round activations to int8, and such a difference now and
then moves a value across a rounding step: on the real target the logits of 12 tokens verified in one call differ
from one-by-one decoding by up to 2.3, with argmax flips. Here every row runs on its own over exactly the keys it
sees, in cache order: a prefix of the cache is a view (a chain, a decode step), other tree rows gather their keys.
That is the computation a one-token decode of the same token runs, so the results are the same bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RowKeys = list  # per query row: the number of leading cache slots it sees (int), or their indices (tensor)


def row_keys(mask: torch.Tensor) -> RowKeys:
    """The keys each query row sees under a float additive (1, 1, n, T) mask (0 = visible)."""
    visible = mask[0, 0] == 0
    counts = visible.sum(1)
    prefix = (visible == (torch.arange(visible.shape[1], device=mask.device) < counts[:, None])).all(1)
    return [int(c) if p else visible[i].nonzero()[:, 0] for i, (c, p) in enumerate(zip(counts, prefix.tolist()))]


def rowwise_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: RowKeys,
                      scaling: float) -> torch.Tensor:
    """query (1, H, n, d), key/value (1, H_kv, T, d) -> (1, n, H, d), each row attending over its keys only."""
    outs = []
    for i, keys in enumerate(rows):
        if isinstance(keys, int):
            k, v = key[:, :, :keys], value[:, :, :keys]
        else:
            k, v = key.index_select(2, keys), value.index_select(2, keys)
        outs.append(F.scaled_dot_product_attention(query[:, :, i : i + 1], k, v, scale=scaling, enable_gqa=True))
    return torch.cat(outs, 2).transpose(1, 2)

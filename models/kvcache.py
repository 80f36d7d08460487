"""A KV cache that appends in place: each layer's keys/values are views into buffers with spare room.

transformers' `DynamicLayer` concatenates on every forward (a copy of the whole cache per layer per call). Here a
forward writes its new slots into the buffer and the layer's keys/values become longer views of it; the buffer
doubles when full. `crop` (inherited) shortens the views, and `TargetRunner.keep_path` moves accepted tree nodes up
inside them, so a verify round copies only its own new slots.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_CAPACITY = 256


class GrowingLayer(DynamicLayer):
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if self.buffers is None or new > self.buffers[0].shape[-2]:
            capacity = max(MIN_CAPACITY, 2 * new)
            self.buffers = tuple(self._grown(x, states, capacity) for x, states in
                                 ((self.keys, key_states), (self.values, value_states)))
        k, v = self.buffers
        k[..., old:new, :] = key_states
        v[..., old:new, :] = value_states
        self.keys, self.values = k[..., :new, :], v[..., :new, :]
        return self.keys, self.values

    @staticmethod
    def _grown(cached: torch.Tensor, states: torch.Tensor, capacity: int) -> torch.Tensor:
        b, h, _, d = states.shape
        buffer = states.new_empty(b, h, capacity, d)
        if cached.numel():
            buffer[..., : cached.shape[-2], :] = cached
        return buffer


def growing_cache(config) -> DynamicCache:
    """A `DynamicCache` for `config` whose full-attention layers append in place (sliding-window ones stay as is)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache

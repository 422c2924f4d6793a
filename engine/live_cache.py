"""The live KV cache of one request: a transformers DynamicCache whose layers grow in blocks, not per token.

transformers' DynamicLayer appends by `torch.cat([keys, new])`: every decoded token copies the whole context of
every layer (at 1k tokens on the embedded model, ~46 MB per step). A `GrowingLayer` keeps each layer's keys and
values in a buffer with room for BLOCK_TOKENS more positions and writes new positions in place; `keys` and
`values` are views of the filled part, so everything that reads them (attention, kv_range, the store) sees what
a DynamicLayer would hold, value for value. One copy per BLOCK_TOKENS tokens instead of one per token.

Code that assigns `layer.keys` / `layer.values` itself (the CacheBlend pass, crop) keeps working: an update
first checks that `keys` is still a prefix view of the buffer and otherwise starts a new buffer from it.
Writes go only past the filled length, so a view handed out earlier never changes, except after a crop, which
gives positions back to be written again (as it does for a DynamicLayer, whose crop slices a view too).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

BLOCK_TOKENS = 256


class GrowingLayer(DynamicLayer):
    def __init__(self):
        super().__init__()
        self._key_buffer: torch.Tensor | None = None  # [B, H_kv, capacity, D]; keys is [:, :, :length] of it
        self._value_buffer: torch.Tensor | None = None

    def _is_prefix_view(self) -> bool:
        buffer = self._key_buffer
        return (buffer is not None and self.keys is not None and self.keys.data_ptr() == buffer.data_ptr()
                and self.keys.stride() == buffer.stride() and self.values.data_ptr() == self._value_buffer.data_ptr()
                and self.values.stride() == self._value_buffer.stride() and self.keys.shape[:2] == buffer.shape[:2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, H_kv, T_new, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        new_length = length + key_states.shape[-2]
        if not self._is_prefix_view() or new_length > self._key_buffer.shape[-2]:
            self._grow(length, new_length, key_states, value_states)
        self._key_buffer[:, :, length:new_length].copy_(key_states)
        self._value_buffer[:, :, length:new_length].copy_(value_states)
        self.keys = self._key_buffer[:, :, :new_length]
        self.values = self._value_buffer[:, :, :new_length]
        return self.keys, self.values

    def _grow(self, length: int, new_length: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = -(-(new_length + 1) // BLOCK_TOKENS) * BLOCK_TOKENS  # room for the next token at least
        batch, heads, _, key_dim = key_states.shape
        # Zeros, not empty: the room past the filled part is read, masked, by the CUDA-graph decode step
        # (engine.graph_decode), whose 0-weight x value products must not meet a NaN from recycled memory.
        keys = torch.zeros(batch, heads, capacity, key_dim, dtype=key_states.dtype, device=key_states.device)
        values = torch.zeros(batch, heads, capacity, value_states.shape[-1], dtype=value_states.dtype,
                             device=value_states.device)
        if length:
            keys[:, :, :length].copy_(self.keys)
            values[:, :, :length].copy_(self.values)
        self._key_buffer, self._value_buffer = keys, values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()

    def capacity_bytes(self) -> int:
        """What the buffers hold, free room included."""
        if self._key_buffer is None or not self._is_prefix_view():
            return (self.keys.nbytes + self.values.nbytes) if self.is_initialized and self.keys is not None else 0
        return self._key_buffer.nbytes + self._value_buffer.nbytes


class GrowingCache(DynamicCache):
    """A DynamicCache of GrowingLayers (one per layer, created on first use like DynamicCache's own)."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = GrowingLayer

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
# torch splits a CPU copy of this many values or more between its OpenMP threads, which then spin for
# milliseconds on the cores the block kernel's own threads need (engine.rotary_table): a grow, and a reused chunk's
# KV written into the buffers, copy in pieces below it.
SERIAL_COPY_VALUES = 32768


def copy_positions(target: torch.Tensor, source: torch.Tensor) -> None:
    """target[:, :, :T] = source [B, H, T, D]; on the CPU in pieces of positions that torch copies on the calling
    thread."""
    length = source.shape[-2]
    per_position = source.shape[0] * source.shape[1] * source.shape[3]
    step = length if source.device.type != "cpu" else max(1, (SERIAL_COPY_VALUES - 1) // max(per_position, 1))
    for start in range(0, length, step):
        end = min(start + step, length)
        target[:, :, start:end].copy_(source[:, :, start:end])


class GrowingLayer(DynamicLayer):
    """`keys` / `values` are views of the buffers' filled part, made when read: growing by a position is an integer
    update (a decode step touches every layer of every request in the batch; slicing two views per layer per step
    was a tenth of a batched step). A tensor assigned to `keys` / `values` from outside (the CacheBlend pass, crop,
    lazy initialization) is kept as given until the next update, which takes it back into a buffer.

    `generation` changes whenever the buffers are replaced or `keys` / `values` are assigned: code that holds the
    buffers' addresses (the one-call forward) knows them good, and the layer growing only by `advance`, while it
    stays the same."""

    def __init__(self):
        self._key_buffer: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self._value_buffer: torch.Tensor | None = None
        self._length = 0  # positions filled in the buffers
        self._capacity = 0  # positions the buffers hold
        self.generation = 0
        self.rewrites = 0  # times positions it held may have been given other values (not growth, not a crop)
        self._keys: torch.Tensor | None = None  # a tensor assigned from outside; None: the buffers' filled part
        self._values: torch.Tensor | None = None
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:
        if self._keys is None and self._key_buffer is not None:
            return self._key_buffer[:, :, :self._length]
        return self._keys

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys = tensor
        self.generation += 1
        self.rewrites += 1

    @property
    def values(self) -> torch.Tensor | None:
        if self._values is None and self._value_buffer is not None:
            return self._value_buffer[:, :, :self._length]
        return self._values

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values = tensor
        self.generation += 1
        self.rewrites += 1

    def get_seq_length(self) -> int:
        """DynamicLayer's: the positions filled (read from the count where keys and values are the buffers' filled
        part, without making a view of them: every forward asks it of every request)."""
        if self._keys is None and self._key_buffer is not None:
            return self._length
        return super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicLayer.crop, which leaves the positions it keeps as they were: not counted in `rewrites`
        (GrowingCache.crops records where the cache was cut). Where keys and values are the buffers' filled part,
        only the count goes down: the buffers stay, and with them `generation` (a rejected draft is cut back at
        most steps, and making views to slice them and taking them back into the buffers at the next update was
        3% of a decode step)."""
        if tokens_to_remove < 0 and self._keys is None and self._values is None and self._key_buffer is not None:
            self._length = max(0, self._length + tokens_to_remove)
            return
        rewrites = self.rewrites
        super().crop(tokens_to_remove)
        self.rewrites = rewrites

    def _is_prefix_view(self) -> bool:
        """Whether keys and values are the buffers' first positions (the buffers can grow in place)."""
        buffer = self._key_buffer
        if buffer is None:
            return False
        if self._keys is None and self._values is None:
            return True
        keys, values = self.keys, self.values
        return (keys is not None and values is not None and keys.data_ptr() == buffer.data_ptr()
                and keys.stride() == buffer.stride() and values.data_ptr() == self._value_buffer.data_ptr()
                and values.stride() == self._value_buffer.stride() and keys.shape[:2] == buffer.shape[:2]
                and keys.shape[-2] == values.shape[-2])

    def _extend(self, rows: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> int:
        """Makes room for `rows` more positions and counts them filled; returns where they start."""
        if not self.is_initialized:
            self.lazy_initialization(like_keys, like_values)
        prefix = self._is_prefix_view()
        length = self._length if prefix and self._keys is None else (self.keys.shape[-2] if self.keys.numel() else 0)
        new_length = length + rows
        if not prefix or new_length > self._key_buffer.shape[-2]:
            self._grow(length, new_length, like_keys, like_values)
        self._keys = self._values = None
        self._length = new_length
        return length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, H_kv, T_new, D]
        rows = key_states.shape[-2]
        start = self._extend(rows, key_states, value_states)
        copy_positions(self._key_buffer[:, :, start:], key_states)  # a reused chunk's KV: in pieces, as a grow
        copy_positions(self._value_buffer[:, :, start:], value_states)
        return self.keys, self.values

    def fill(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """What the first update() of a layer does (buffers for its positions with room to grow, the values
        copied in), without transformers' lazy initialization of empty tensors and update's checks."""
        if self.is_initialized:
            raise ValueError("fill() starts an empty layer; this one holds positions")
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        rows = key_states.shape[-2]
        self._grow(0, rows, key_states, value_states)
        copy_positions(self._key_buffer, key_states)
        copy_positions(self._value_buffer, value_states)
        self._length = rows

    def reserve(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Extends the filled part by `rows` positions whose values the caller writes (the one-call forward's C
        code does, straight into the buffers); returns the key and value buffers. `like`: a tensor of the
        layer's [B, H_kv, *, D] shape and dtype. What update() does without copying anything in."""
        self._extend(rows, like, like)
        return self._key_buffer, self._value_buffer

    def _grow(self, length: int, new_length: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = -(-(new_length + 1) // BLOCK_TOKENS) * BLOCK_TOKENS  # room for the next token at least
        batch, heads, _, key_dim = key_states.shape
        # Uninitialised: nothing reads past the filled part but the CUDA-graph decode step (engine.graph_decode),
        # which zeroes that room itself; zeroing a new request's buffers here (12 MB on the embedded model, pages
        # faulted in and cleared) was 8% of a batched CPU step.
        keys = torch.empty(batch, heads, capacity, key_dim, dtype=key_states.dtype, device=key_states.device)
        values = torch.empty(batch, heads, capacity, value_states.shape[-1], dtype=value_states.dtype,
                             device=value_states.device)
        if length:
            copy_positions(keys, self.keys)
            copy_positions(values, self.values)
        self._key_buffer, self._value_buffer = keys, values
        self._capacity = capacity
        self.generation += 1

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        self._length = self._capacity = 0
        self.generation += 1
        self.rewrites += 1
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
        self.crops: list[int] = []  # the length after each crop, in order

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.crops.append(self.get_seq_length())

    def rewrites(self, num_layers: int) -> int:
        """The first `num_layers` layers' `rewrites`: while it and `crops` stay the same, every position the
        cache held keeps its bits (it grows, and may move to bigger buffers, by copying them)."""
        return sum(layer.rewrites for layer in self.layers[:num_layers])

    def append(self, kv) -> None:
        """Layer i's keys and values kv[i] ([B, H_kv, T, D] each) appended to it, as update() would for every layer;
        a layer still empty is filled at once (GrowingLayer.fill: a new request's reused prefix, copied in without
        update's per-layer bookkeeping, which took longer than the copies)."""
        for index, (keys, values) in enumerate(kv):
            while len(self.layers) <= index:
                self.layers.append(GrowingLayer())
            layer = self.layers[index]
            if layer.is_initialized:
                layer.update(keys, values)
            else:
                layer.fill(keys, values)

    def reserve(self, num_layers: int, rows: int, like: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """GrowingLayer.reserve for the first `num_layers` layers (made where missing): their buffers."""
        while len(self.layers) < num_layers:
            self.layers.append(GrowingLayer())
        return [self.layers[i].reserve(rows, like) for i in range(num_layers)]

    def generations(self, num_layers: int) -> tuple[int, ...]:
        """The first `num_layers` layers' `generation`s."""
        return tuple(layer.generation for layer in self.layers[:num_layers])

    def advance(self, num_layers: int, rows: int) -> bool:
        """What `reserve` does where it needs no new buffer: the first `num_layers` layers' filled parts extended
        by `rows` positions, in the buffers they have now, whose values the caller writes. Only where every one of
        them holds its keys and values in its buffers (nothing assigned from outside) with room for `rows` more;
        otherwise False, and nothing changed (then `reserve`)."""
        layers = self.layers[:num_layers]
        if len(layers) < num_layers:
            return False
        for layer in layers:
            if layer._keys is not None or layer._values is not None or layer._key_buffer is None \
                    or layer._length + rows > layer._capacity:
                return False
        for layer in layers:
            layer._length += rows
        return True

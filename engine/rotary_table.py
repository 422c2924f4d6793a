"""The rotary embedding's cos and sin looked up, not computed, on every forward.

A decoder's `rotary_emb(x, position_ids)` computes cos(p * f) and sin(p * f) for the forward's positions. On the
CPU, torch hands cosines and sines of 128 values or more (a check of two drafted tokens, a batched step, a
prefill) to MKL's vector math, which runs them on torch's OpenMP threads; those threads then spin for
milliseconds waiting for more work, on the cores the block kernel's own threads need. Measured on the embedded
model (2 cores): a forward of 5 positions cost 2.2x a one-position step with the spinning threads and 1.5x
without them.

`use_rotary_table` makes the model's rotary module gather rows of a table instead: cos and sin of every position
below the table's size, computed once by the module's own forward over those positions and grown (doubled) when
a forward reaches past it. Each value is the module's elementwise product p * f, then cos, sin and the module's
attention scaling, the same function of p whatever other positions are computed with it: a row of the table is
bit for bit what a call for that position returns (tests compare them). Positions from MAX_ROWS on are computed by
the module as before. Only for rotary types whose frequencies
do not depend on the forward ("dynamic" and "longrope" change theirs with the context length) and only on the CPU.
"""

from __future__ import annotations

import torch

# rope_type values whose inv_freq is fixed at load: cos and sin are a function of the position alone.
FIXED_FREQUENCY_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
FIRST_ROWS = 1024  # the first table's positions; doubled past the highest position a forward asks for
# Positions from here on are computed by the module, not tabled: a table this long is 64 MiB at a head of 128, and
# doubling past a far position would allocate for every position below it.
MAX_ROWS = 1 << 16


class RotaryTable:
    """The forward of a rotary module (installed on the instance by use_rotary_table): rows gathered from a
    table of the module's own results. `computed_positions`: how many positions' rows the table holds."""

    def __init__(self, original):
        self.original = original  # the module's own forward
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: [positions, head_dim] float32

    @property
    def computed_positions(self) -> int:
        return 0 if self._table is None else self._table[0].shape[0]

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor):
        if position_ids.device.type != "cpu" or position_ids.dtype not in (torch.int32, torch.int64) or \
                position_ids.numel() == 0:
            return self.original(x, position_ids)
        low, high = int(position_ids.min()), int(position_ids.max())
        if low < 0 or high >= MAX_ROWS:
            return self.original(x, position_ids)
        cos, sin = self._reaching(high)
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)  # [B, T, head_dim]

    def rows(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin [len(positions), head_dim] float32 of non-negative `positions` (a Python list: no reduction
        over a tensor to find their range), the rows __call__ returns for them; None past MAX_ROWS or for none."""
        high = max(positions, default=MAX_ROWS)
        if high >= MAX_ROWS or min(positions) < 0:
            return None
        cos, sin = self._reaching(high)
        at = torch.tensor(positions, dtype=torch.int64)
        return cos[at], sin[at]

    def _reaching(self, high: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table, grown first where it does not hold position `high`."""
        table = self._table
        return table if table is not None and high < table[0].shape[0] else self._grow(high + 1)

    def _grow(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = max(FIRST_ROWS, self.computed_positions)
        while rows < needed:
            rows *= 2
        probe = torch.zeros(1, 1, 1, dtype=torch.float32)
        cos, sin = self.original(probe, torch.arange(rows)[None])  # float32: the module computes in float32
        table = (cos[0].contiguous(), sin[0].contiguous())
        self._table = table  # one assignment: a forward on another thread sees the old table or the new one
        return table


def use_rotary_table(model) -> bool:
    """Installs a RotaryTable as the forward of `model`'s rotary module where its cos and sin depend on the
    position alone and it computes on the CPU; returns whether the module looks its rows up (now or before)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    module = getattr(decoder, "rotary_emb", None)
    if module is None:
        return False
    if isinstance(module.__dict__.get("forward"), RotaryTable):
        return True
    inv_freq, rope_type = getattr(module, "inv_freq", None), getattr(module, "rope_type", None)
    if not isinstance(rope_type, str) or rope_type not in FIXED_FREQUENCY_TYPES or \
            not isinstance(inv_freq, torch.Tensor) or inv_freq.device.type != "cpu":
        return False  # rope_type a dict: one rotary per layer type (Gemma 3), each with its own frequencies
    module.forward = RotaryTable(module.forward)
    return True

"""KIVI-style asymmetric quantization of one layer's keys and values, as pure functions.

Keys carry a few outlier channels with large magnitude, so they are quantized per channel: each group is
`group_size` consecutive tokens of one channel d, and an outlier only widens its own channel's range. Values
have no such structure and are consumed per token by attention, so they are quantized per token: each group
is `group_size` consecutive channels of one token.

Within a group, with levels = 2**bits - 1:

    zero  = min(group)                      (rounded down to the stats dtype)
    scale = (max(group) - zero) / levels    (rounded up to the stats dtype)
    code  = clamp(round((x - zero) / scale), 0, levels)
    x_hat = code * scale + zero

Rounding zero down and scale up keeps [zero, zero + levels * scale] covering the whole group, so nothing is
clipped and |x - x_hat| <= scale / 2 up to float arithmetic. A constant group has scale 0 and comes back exact
whenever its value is representable in the stats dtype.

Stats are float16 for float16 input (that is what makes the storage ratio worthwhile) and float32 otherwise
(bfloat16's range does not fit float16), unless the caller picks `stats_dtype` (the KV tiers store float16 stats
for float32 KV whose range fits float16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AXES = ("channel", "token")
BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes and per-group stats of a [B, H, T, D] tensor.

    Codes live in the grouped layout [B, H, X, P]: X is the axis that is not grouped (D for "channel", T for
    "token") and P the grouped axis padded up to a multiple of group_size. `data` is that layout flattened,
    one code per byte for 8 bits, two per byte for 4 bits (even index in the low nibble). `scale` and `zero`
    are [B, H, X, P // group_size].
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    axis: str
    group_size: int
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))


def _check(bits: int, axis: str, group_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype == torch.float16 else torch.float32


def _round_toward(v: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """v (float64) cast to dtype, moved one step toward `direction` (+-inf) where the cast went the other way."""
    c = v.to(dtype)
    overshot = c.double() > v if direction < 0 else c.double() < v
    return torch.where(overshot, torch.nextafter(c, torch.full_like(c, direction)), c)


def _to_grouped_layout(x: torch.Tensor, axis: str) -> torch.Tensor:
    # x: [B, H, T, D] -> [B, H, X, L], L the grouped axis
    return x.transpose(-1, -2) if axis == "channel" else x


def quantize(x: torch.Tensor, *, bits: int, axis: str, group_size: int = 32,
             stats_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Quantize x: [B, H, T, D] with groups of group_size along T ("channel") or D ("token")."""
    _check(bits, axis, group_size)
    if x.dim() != 4:
        raise ValueError(f"expected a 4-D [B, H, T, D] tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    levels = 2**bits - 1
    stats_dtype = stats_dtype or _stats_dtype(x.dtype)
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32

    g = _to_grouped_layout(x, axis)  # [B, H, X, L]
    length = g.shape[-1]
    num_groups = -(-length // group_size)
    pad = num_groups * group_size - length
    if pad:
        # Repeating the last real value never widens a group's [min, max].
        g = torch.cat([g, g[..., -1:].expand(*g.shape[:-1], pad)], dim=-1)
    g = g.reshape(*g.shape[:-1], num_groups, group_size)  # [B, H, X, G_n, G]

    lo = g.amin(dim=-1).double()  # [B, H, X, G_n]
    hi = g.amax(dim=-1).double()
    zero = _round_toward(lo, stats_dtype, float("-inf"))
    scale = _round_toward((hi - zero.double()) / levels, stats_dtype, float("inf"))

    safe_scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(work_dtype)[..., None]
    codes = torch.round((g.to(work_dtype) - zero.to(work_dtype)[..., None]) / safe_scale)
    codes = codes.clamp_(0, levels).to(torch.uint8).flatten()
    if bits == 4:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        codes = codes[0::2] | (codes[1::2] << 4)
    return QuantizedTensor(codes, scale, zero, bits, axis, group_size, tuple(x.shape), x.dtype)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The [B, H, T, D] tensor q was made from, up to quantization error, in its original dtype."""
    grouped_shape = (*q.scale.shape, q.group_size)  # [B, H, X, G_n, G]
    num_codes = q.scale.numel() * q.group_size
    codes = q.data
    if q.bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten()[:num_codes]
    assert codes.numel() == num_codes, (codes.numel(), num_codes)
    work_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    codes = codes.reshape(grouped_shape).to(work_dtype)
    g = codes * q.scale.to(work_dtype)[..., None] + q.zero.to(work_dtype)[..., None]

    b, h, t, d = q.shape
    length = t if q.axis == "channel" else d
    g = g.reshape(*grouped_shape[:-2], -1)[..., :length]  # [B, H, X, L]
    return _to_grouped_layout(g, q.axis).to(q.dtype).contiguous()


def quantize_kv(
    k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int = 32, value_group_size: int | None = None,
    stats_dtype: torch.dtype | None = None,
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Keys per channel (groups of `group_size` tokens), values per token (groups of `value_group_size`
    channels, default `group_size`) (KIVI)."""
    return (
        quantize(k, bits=bits, axis="channel", group_size=group_size, stats_dtype=stats_dtype),
        quantize(v, bits=bits, axis="token", group_size=value_group_size or group_size, stats_dtype=stats_dtype),
    )


def dequantize_kv(qk: QuantizedTensor, qv: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize(qk), dequantize(qv)


def bytes_ratio(x: torch.Tensor, q: QuantizedTensor) -> float:
    """How many times smaller q is than x as stored."""
    return x.numel() * x.element_size() / q.nbytes

"""KIVI-style KV quantization against a float64 reference written out group by group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv.kv_quant import bytes_ratio, dequantize, dequantize_kv, quantize, quantize_kv


def f32_down(v: float) -> float:
    """The largest float32 <= v."""
    c = np.float32(v)
    return float(np.nextafter(c, np.float32(-np.inf)) if float(c) > v else c)


def f32_up(v: float) -> float:
    """The smallest float32 >= v."""
    c = np.float32(v)
    return float(np.nextafter(c, np.float32(np.inf)) if float(c) < v else c)


def reference_round_trip(x: torch.Tensor, bits: int, axis: str, group_size: int) -> torch.Tensor:
    """Quantize and dequantize a float64 [B, H, T, D] tensor one group at a time, stats stored in float32."""
    levels = 2**bits - 1
    out = torch.empty_like(x)
    b_n, h_n, t_n, d_n = x.shape
    for b in range(b_n):
        for h in range(h_n):
            lines = range(d_n) if axis == "channel" else range(t_n)
            for i in lines:
                line = x[b, h, :, i] if axis == "channel" else x[b, h, i, :]
                rebuilt = out[b, h, :, i] if axis == "channel" else out[b, h, i, :]
                for start in range(0, line.numel(), group_size):
                    group = line[start : start + group_size].tolist()
                    zero = f32_down(min(group))
                    scale = f32_up((max(group) - zero) / levels)
                    for j, value in enumerate(group):
                        if scale == 0:
                            rebuilt[start + j] = zero
                            continue
                        code = min(max(round((value - zero) / scale), 0), levels)
                        rebuilt[start + j] = code * scale + zero
    return out


def keys_like(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_round_trip_matches_float64_reference(bits, axis):
    x = keys_like((2, 2, 16, 8), seed=bits) * 3.0
    got = dequantize(quantize(x, bits=bits, axis=axis, group_size=8))
    want = reference_round_trip(x, bits, axis, 8)
    assert got.dtype == torch.float64 and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # The reference is not trivially equal to x: quantization does lose information.
    assert (got - x).abs().max() > 1e-3


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_error_is_at_most_half_a_step_in_every_group(bits, axis, dtype):
    x = keys_like((1, 3, 32, 16), seed=7, dtype=dtype) * 5.0 + 1.0
    q = quantize(x, bits=bits, axis=axis, group_size=8)
    err = (dequantize(q).double() - x.double()).abs()
    # Group the error the way groups are defined: along T per channel, or along D per token.
    grouped = err.transpose(-1, -2) if axis == "channel" else err
    per_group_max = grouped.reshape(*grouped.shape[:-1], -1, 8).amax(dim=-1)  # [B, H, X, G_n]
    assert per_group_max.shape == q.scale.shape
    bound = q.scale.double() / 2 + 1e-6 * x.abs().max().item()
    assert (per_group_max <= bound).all()
    # The bound is close to tight: somewhere an error uses most of the half step.
    assert (per_group_max / (q.scale.double() / 2)).max() > 0.9


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_constant_groups_come_back_exactly(bits, axis, dtype):
    x = torch.full((1, 2, 8, 8), -3.25, dtype=dtype)
    x[0, 1] = 0.5
    q = quantize(x, bits=bits, axis=axis, group_size=4)
    assert (q.scale == 0).all()
    assert torch.equal(dequantize(q), x)


def test_int4_packing_round_trips_all_sixteen_codes():
    g = torch.Generator().manual_seed(3)
    # Each token holds a permutation of 0..15: min 0, max 15, so scale is 1 and codes equal values.
    rows = torch.stack([torch.randperm(16, generator=g) for _ in range(2 * 6)]).to(torch.float32)
    x = rows.reshape(1, 2, 6, 16)
    q = quantize(x, bits=4, axis="token", group_size=16)
    assert q.data.dtype == torch.uint8 and q.data.numel() == x.numel() // 2
    assert torch.equal(q.scale, torch.ones_like(q.scale)) and torch.equal(q.zero, torch.zeros_like(q.zero))
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_odd_lengths_are_padded_and_trimmed(bits, axis):
    x = keys_like((1, 2, 13, 7), seed=11)
    q = quantize(x, bits=bits, axis=axis, group_size=4)
    grouped_len = 13 if axis == "channel" else 7
    assert q.scale.shape[-1] == -(-grouped_len // 4)
    got = dequantize(q)
    assert got.shape == x.shape
    torch.testing.assert_close(got, reference_round_trip(x, bits, axis, 4), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_come_back_in_their_dtype(dtype):
    k = keys_like((1, 2, 32, 16), seed=5, dtype=dtype)
    v = keys_like((1, 2, 32, 16), seed=6, dtype=dtype)
    qk, qv = quantize_kv(k, v, bits=8, group_size=16)
    k_hat, v_hat = dequantize_kv(qk, qv)
    assert k_hat.dtype == dtype and v_hat.dtype == dtype
    assert qk.scale.dtype == (torch.float16 if dtype == torch.float16 else torch.float32)
    # 8-bit steps on unit-normal data are about 0.03; half a step plus the dtype's own rounding.
    assert (k_hat.double() - k.double()).abs().max() < 0.03
    assert (v_hat.double() - v.double()).abs().max() < 0.03


def test_storage_ratio_against_float16():
    x = keys_like((1, 4, 128, 64), seed=1, dtype=torch.float16)
    # Group 32: two float16 stats per 32 codes cost one extra bit per element.
    assert bytes_ratio(x, quantize(x, bits=8, axis="channel")) == pytest.approx(16 / 9)
    assert bytes_ratio(x, quantize(x, bits=4, axis="channel")) == pytest.approx(16 / 5)
    # Group 128 amortises the stats to a quarter bit per element.
    assert bytes_ratio(x, quantize(x, bits=8, axis="channel", group_size=128)) >= 1.9
    assert bytes_ratio(x, quantize(x, bits=4, axis="token", group_size=64)) >= 3.5
    assert bytes_ratio(x, quantize(x, bits=4, axis="channel", group_size=128)) >= 3.5


def test_outlier_channel_favours_per_channel_quantization_of_keys():
    k = keys_like((1, 2, 64, 32), seed=9)
    k[..., 5] = k[..., 5] * 10.0 + 40.0  # one channel far larger than the rest, as in real keys
    err = {
        axis: (dequantize(quantize(k, bits=4, axis=axis, group_size=32)) - k).abs().mean().item()
        for axis in ("channel", "token")
    }
    assert err["channel"] < 0.25 * err["token"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=3, axis="channel"), "3"),
        (dict(bits=16, axis="token"), "16"),
        (dict(bits=8, axis="head"), "head"),
        (dict(bits=8, axis="token", group_size=0), "0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(torch.zeros(1, 1, 4, 4), **kwargs)


def test_non_4d_input_raises_value_error_with_its_shape():
    with pytest.raises(ValueError, match=r"\(4, 4\)"):
        quantize(torch.zeros(4, 4), bits=8, axis="token")

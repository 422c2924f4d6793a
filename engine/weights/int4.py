"""Int4 weights: the canonical group layout, round-to-nearest quantization, and `Int4Linear` with its matmul paths.

Canonical layout, per output row and per group of G consecutive input columns:

    w = (q - zero) * scale + offset      q, zero: integers in 0..15;  scale, offset: float32

Weights quantized here (RTN) and AWQ checkpoints have no offset (offset = 0: the AWQ convention); GGUF Q4_1 blocks
have zero = 0 and offset = m (w = q * d + m), Q4_0 blocks zero = 8 and no offset, Q4_K sub-blocks zero = 0, scale
d * sc and offset -(dmin * m) (engine.weights.gguf_int4). The reference
path evaluates exactly this expression in float32, in this order, so it reproduces the source's own dequantization
bit for bit. `in_features` that G does not divide are padded to a multiple of G with columns whose code equals the
group's zero (they dequantize to exactly 0 and never change a result); a layer with offsets is never padded.

Matmul paths, chosen once per layer at load (`pick_kernel`):
- "reference": dequantize to the activation dtype, then F.linear. Runs everywhere; it defines the numerics.
- "cpu_int4pack": torch's `_weight_int4pack_mm_for_cpu`; "tinygemm": torch's `_weight_int4pack_mm` (CUDA,
  compute capability >= 8.0). Both take per group [scale, offset] with w = (q - 8) * scale + offset, so the
  canonical zero and offset become the kernel's offset (8 - zero) * scale + offset once, at load. Both compute in
  bfloat16 (the CPU
  kernel's float32 variant is a scalar loop, ~20x slower than its bfloat16 one on AVX-512 machines; tinygemm
  has bfloat16 only): activations are cast to bfloat16 and the result back to the activation dtype.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GROUP_SIZES
from ..config import INT4_KERNELS as KERNELS

log = logging.getLogger(__name__)

LEVELS = 15  # codes 0..15
KERNEL_ZERO = 8  # the int4pack kernels read code q as (q - 8)
FAST_DTYPE = torch.bfloat16
# A decoder layer's linears: "model.layers.3.self_attn.q_proj", "model.language_model.layers.0.mlp.up_proj".
DECODER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")


def padded_features(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def quantize_rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest, asymmetric min/max per group. weight: [out, in] float.

    Returns codes uint8 [out, in_padded], scales float32 [out, groups], zeros uint8 [out, groups]. The range of
    each group is widened to include 0, so the integer zero always lies in 0..15 and every element is within
    scale/2 of its dequantized value (a group of only positive weights would otherwise clamp its zero).
    """
    check_group_size(group_size)
    out_features, in_features = weight.shape
    pad = padded_features(in_features, group_size) - in_features
    w = weight.detach().to(torch.float32)
    lo = F.pad(w, (0, pad), value=float("inf")).view(out_features, -1, group_size).amin(-1).clamp(max=0)
    hi = F.pad(w, (0, pad), value=float("-inf")).view(out_features, -1, group_size).amax(-1).clamp(min=0)
    scales = (hi - lo) / LEVELS
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: any scale is exact
    zeros = torch.round(-lo / scales).clamp(0, LEVELS)
    grouped = F.pad(w, (0, pad)).view(out_features, -1, group_size)  # padding 0 -> code == zero -> exactly 0
    codes = torch.round(grouped / scales[..., None] + zeros[..., None]).clamp(0, LEVELS)
    return codes.reshape(out_features, -1).to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, in_features: int,
                     dtype: torch.dtype = torch.float32, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The [out, in_features] weight of canonical codes: (q - zero) * scale (+ offset) in float32, cast to dtype."""
    out_features, padded = codes.shape
    group_size = padded // scales.shape[1]
    q = codes.reshape(out_features, -1, group_size).to(torch.float32)
    w = (q - zeros[..., None].to(torch.float32)) * scales[..., None].to(torch.float32)
    if offsets is not None:
        w = w + offsets[..., None].to(torch.float32)
    return w.reshape(out_features, padded)[:, :in_features].to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[out, K] codes 0..15 -> [out, K/2] uint8; column 2i in the low nibble, 2i+1 in the high one."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def _inner_k_tiles(padded_in: int) -> int:
    return next(t for t in (8, 4, 2) if padded_in % (t * 16) == 0)


PACK_ROWS = 1024  # rows of int32 codes at a time for the CPU kernel's packing (a multiple of its 64-row tiles)


def _to_kernel_layout(kernel: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      offsets: torch.Tensor | None = None):
    """(packed weight, scales_and_zeros [groups, out, 2] bfloat16) for an int4pack kernel, on codes' device."""
    # w = (q - zero) * scale + offset = (q - 8) * scale + kernel_offset
    kernel_offsets = (KERNEL_ZERO - zeros.to(torch.float32)) * scales
    if offsets is not None:
        kernel_offsets = kernel_offsets + offsets.to(torch.float32)
    scales_and_zeros = torch.stack([scales, kernel_offsets], dim=-1).transpose(0, 1).contiguous().to(FAST_DTYPE)
    if kernel == "cpu_int4pack":
        # The kernel takes int32 codes (8 bytes a weight's worth of nibble): converted PACK_ROWS rows at a time
        # into the packed weight, whose rows come out the same in slices of whole 64-row tiles as at once.
        out_features, padded = codes.shape
        packed = torch.empty(out_features, padded // 2, dtype=torch.uint8, device=codes.device)
        for start in range(0, out_features, PACK_ROWS):
            rows = codes[start:start + PACK_ROWS].to(torch.int32).contiguous()
            packed[start:start + PACK_ROWS] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(rows, 2)
    else:  # tinygemm takes [out, K/2] uint8 with the even column in the high nibble
        pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(codes.shape[1]))
    return packed, scales_and_zeros


def shape_problem(kernel: str, out_features: int, padded_in: int) -> str | None:
    if kernel == "cpu_int4pack" and out_features % 16:
        return f"the CPU int4 kernel needs out_features divisible by 16, got {out_features}"
    if kernel == "tinygemm" and out_features % 8:
        return f"tinygemm needs out_features divisible by 8, got {out_features}"
    return None


@functools.lru_cache(maxsize=None)
def kernel_unavailable(kernel: str, device: str) -> str | None:
    """Why `kernel` cannot run on `device` (a probe matmul checked against the reference), or None when it can."""
    dev = torch.device(device)
    if kernel == "reference":
        return None
    if kernel == "cpu_int4pack":
        if dev.type != "cpu":
            return f"cpu_int4pack runs on the CPU, not on {device}"
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
    elif kernel == "tinygemm":
        if dev.type != "cuda":
            return f"tinygemm runs on CUDA, not on {device}"
        if torch.cuda.get_device_capability(dev) < (8, 0):
            return f"tinygemm needs compute capability >= 8.0, this GPU has {torch.cuda.get_device_capability(dev)}"
    else:
        raise ValueError(f"kernel must be one of {KERNELS} or 'auto', got {kernel!r}")
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(32, 128, generator=gen)
        x = torch.randn(3, 128, generator=gen)
        probe = Int4Linear.from_float(weight.to(dev), None, 32, kernel)
        got = probe(x.to(dev)).float().cpu()
        want = x @ Int4Linear.from_float(weight, None, 32, "reference").dequantize(torch.float32).t()
    except (RuntimeError, NotImplementedError) as exc:
        return f"{kernel} failed on {device}: {type(exc).__name__}: {exc}"
    if not torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max())):
        return f"{kernel} on {device} disagrees with the reference path (max error {(got - want).abs().max():.3g})"
    return None


def pick_kernel(requested: str, device: torch.device) -> tuple[str, str | None]:
    """(the kernel to use on device, why a faster one is not used). `requested` "auto" takes the fastest that
    runs; an explicit kernel that cannot run on the device is a ValueError."""
    if requested != "auto":
        reason = kernel_unavailable(requested, str(device))
        if reason is not None:
            raise ValueError(f"int4 kernel {requested!r} is unavailable: {reason}")
        return requested, None
    fast = {"cpu": "cpu_int4pack", "cuda": "tinygemm"}.get(device.type)
    if fast is None:
        return "reference", f"no int4 kernel for {device.type} devices"
    reason = kernel_unavailable(fast, str(device))
    return ("reference", reason) if reason else (fast, None)


class Int4Linear(nn.Module):
    """A linear layer over int4 weights held in the layout of one matmul path (`kernel`).

    Buffers (all on one device; a layout is specific to its kernel, so move a model before quantizing it):
      reference:     packed uint8 [out, in_padded/2], scales float32 [out, groups], zeros uint8 [out, groups],
                     offsets float32 [out, groups] or None (no offset)
      cpu_int4pack:  packed uint8 [out, in_padded/2] (the kernel's order), scales_and_zeros bf16 [groups, out, 2]
      tinygemm:      packed int32 [out/8, in_padded/(16*k_tiles), 32, k_tiles/2], scales_and_zeros as above
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, kernel: str, origin: str = "rtn"):
        super().__init__()
        check_group_size(group_size)
        assert kernel in KERNELS, kernel
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.padded_in = padded_features(in_features, group_size)
        self.kernel = kernel
        # "rtn" (quantized at load) | "awq" (an AWQ checkpoint) | "gguf-q4_0" / "gguf-q4_1" / "gguf-q4_k" (GGUF blocks
        # as they are)
        self.origin = origin
        self.fallback_reason: str | None = None  # why the reference path runs where a fast one was wanted
        self.bias: nn.Parameter | None = None

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, in_features: int,
                   bias: torch.Tensor | None, kernel: str, origin: str = "rtn",
                   offsets: torch.Tensor | None = None) -> "Int4Linear":
        """From canonical codes uint8 [out, in_padded], scales [out, groups], zeros [out, groups] (integers) and
        optional offsets [out, groups] (float)."""
        out_features, padded = codes.shape
        group_size = padded // scales.shape[1]
        assert scales.shape == zeros.shape == (out_features, padded // group_size), (codes.shape, scales.shape)
        assert offsets is None or (offsets.shape == scales.shape and padded == in_features), (offsets, in_features)
        layer = cls(in_features, out_features, group_size, kernel, origin)
        assert layer.padded_in == padded, (in_features, padded, group_size)
        problem = shape_problem(kernel, out_features, padded)
        if problem is not None:
            raise ValueError(problem)
        scales = scales.to(torch.float32)
        if kernel == "reference":
            layer.register_buffer("packed", pack_nibbles(codes).contiguous())
            layer.register_buffer("scales", scales.contiguous())
            layer.register_buffer("zeros", zeros.to(torch.uint8).contiguous())
            layer.register_buffer("offsets", None if offsets is None else offsets.to(torch.float32).contiguous())
        else:
            packed, scales_and_zeros = _to_kernel_layout(kernel, codes, scales, zeros, offsets)
            layer.register_buffer("packed", packed)
            layer.register_buffer("scales_and_zeros", scales_and_zeros)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int, kernel: str) -> "Int4Linear":
        codes, scales, zeros = quantize_rtn(weight, group_size)
        return cls.from_codes(codes, scales, zeros, weight.shape[1], bias, kernel)

    def to_kernel(self, kernel: str, device: torch.device) -> "Int4Linear":
        """This reference-layout layer in `kernel`'s layout on `device` (the same codes, scales, zeros and
        offsets). For loading on the host and laying each layer out where it will run, one at a time."""
        assert self.kernel == "reference", f"only the reference layout keeps the codes, this is {self.kernel}"
        moved = lambda t: None if t is None else t.to(device)  # noqa: E731
        bias = None if self.bias is None else self.bias.detach().to(device)
        layer = Int4Linear.from_codes(unpack_nibbles(self.packed.to(device)), moved(self.scales), moved(self.zeros),
                                      self.in_features, bias, kernel, self.origin, moved(self.offsets))
        layer.fallback_reason = self.fallback_reason
        return layer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The [out, in] weight this layer multiplies by: exact for the reference path; the kernel's own bfloat16
        dequantization (read back through an identity matmul) for the fast paths."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        if self.kernel == "reference":
            return dequantize_codes(unpack_nibbles(self.packed), self.scales, self.zeros, self.in_features, dtype,
                                    self.offsets)
        rows = []
        for start in range(0, self.padded_in, 1024):  # identity rows in blocks: [<=1024, in_padded]
            block = torch.arange(start, min(start + 1024, self.padded_in), device=self.packed.device)
            eye = torch.zeros(len(block), self.padded_in, device=self.packed.device, dtype=FAST_DTYPE)
            eye[torch.arange(len(block), device=block.device), block] = 1
            rows.append(self._fast_mm(eye))  # [block, out]
        return torch.cat(rows).t()[:, :self.in_features].to(dtype).contiguous()

    def _fast_mm(self, x2: torch.Tensor) -> torch.Tensor:
        x2 = x2.to(FAST_DTYPE).contiguous()
        if self.kernel == "cpu_int4pack":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if self.kernel == "reference":
            weight = dequantize_codes(unpack_nibbles(self.packed), self.scales, self.zeros, self.in_features, x.dtype,
                                      self.offsets)
            return F.linear(x, weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        if self.padded_in != self.in_features:
            x2 = F.pad(x2, (0, self.padded_in - self.in_features))
        y = self._fast_mm(x2).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"kernel={self.kernel}, origin={self.origin}")


def decoder_linears(model) -> list[tuple[str, nn.Linear]]:
    """(name, module) of every nn.Linear inside the decoder layers (the output head is never one of them)."""
    head = model.get_output_embeddings()
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not head and DECODER_LINEAR.search(name)]


def replace_module(model, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def quantize_model(model, group_size: int = 128, kernel: str = "auto", *,
                   layers_from: Callable[[str, nn.Linear, str], "Int4Linear | None"] | None = None) -> dict:
    """Replaces every nn.Linear of the decoder layers with an Int4Linear, in place, one layer at a time so the
    float weight of each is freed before the next is replaced. Embeddings and the output head stay.

    `layers_from(name, linear, kernel)`, when given, may return the layer already in int4 (e.g. read from the
    source's own blocks, engine.weights.gguf_int4); a layer it returns None for is quantized here (RTN at `group_size`).
    Returns a report: format, kernels used (with counts), origins, fallbacks (layer, reason), bytes before/after.
    """
    check_group_size(group_size)
    linears = decoder_linears(model)
    if not linears:
        raise ValueError(f"no nn.Linear inside decoder layers of {type(model).__name__}: nothing to quantize")
    kernels: Counter = Counter()
    fallbacks: list[tuple[str, str]] = []
    float_bytes = int4_bytes = 0
    chosen: dict[torch.device, tuple[str, str | None]] = {}
    num_linears = len(linears)
    linears.reverse()
    while linears:  # popped, so each float weight is freed once its module is replaced
        name, linear = linears.pop()
        device = linear.weight.device
        if device not in chosen:
            chosen[device] = pick_kernel(kernel, device)
            if chosen[device][1]:
                log.info("int4 on %s: reference path (%s)", device, chosen[device][1])
        path, reason = chosen[device]
        new = layers_from(name, linear, path) if layers_from is not None else None
        if new is None:
            problem = shape_problem(path, linear.out_features, padded_features(linear.in_features, group_size))
            if problem is not None:
                log.info("int4 %s: reference path (%s)", name, problem)
                fallbacks.append((name, problem))
                path, reason = "reference", problem
            new = Int4Linear.from_float(linear.weight, linear.bias, group_size, path)
            new.fallback_reason = reason
        float_bytes += module_bytes(linear)
        int4_bytes += module_bytes(new)
        kernels[new.kernel] += 1
        replace_module(model, name, new)
        del linear, new
    return {"format": weights_format(model), "num_linears": num_linears, "kernels": dict(kernels),
            "fallbacks": fallbacks, "reason": next((r for _, r in chosen.values() if r), None),
            "float_bytes": float_bytes, "int4_bytes": int4_bytes}


def layer_format(layer) -> str:
    """ "int4-g128" (RTN at load), "awq-int4-g128", "gguf-q4_1-g32" (GGUF blocks as they are)."""
    if layer.origin == "rtn":
        return f"int4-g{layer.group_size}"
    if layer.origin == "awq":
        return f"awq-int4-g{layer.group_size}"
    return f"{layer.origin}-g{layer.group_size}"


def weights_format(model) -> str:
    """The decoder linears' int4 formats, most common first, joined by "+" ("gguf-q4_1-g32+int4-g128")."""
    head = model.get_output_embeddings()
    counts = Counter(layer_format(m) for m in model.modules() if isinstance(m, Int4Linear) and m is not head)
    return "+".join(label for label, _ in counts.most_common())

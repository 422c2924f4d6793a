"""Reading GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel / optimum, desc_act=False) with our own code: no
auto-gptq, no gptqmodel, no pickle.

config.json's quantization_config: quant_method "gptq", bits 4, desc_act false, group_size G (32, 64, 128, any
multiple of 32, or -1: one group per row, G = in_features), sym true or false (it changes what the zeros are, not
how they are stored), checkpoint_format (or format) "gptq" or "gptq_v2", pack_dtype (when present) "int32".
Tensors of a quantized linear `name` (K = in_features, N = out_features):
    name.qweight  int32 [K/8, N]     codes packed along K: nibble j (bits 4j..4j+3) of word [i, n] is row 8i + j
    name.qzeros   int32 [K/G, N/8]   zeros packed along N: nibble j of word [g, c] is column 8c + j
    name.scales   fp16  [K/G, N]     (bf16 / fp32 read too: each converts to float32 exactly)
    name.g_idx    int32 [K]          the group of each input row; with desc_act=False it must be k // G (checked)
    name.bias     (optional, float)
The weight is w[k, n] = scale[g, n] * (q[k, n] - zero[g, n]), g = k // G, where the stored nibble z is zero - 1
in the classic format (checkpoint_format "gptq": AutoGPTQ's pack() subtracts 1 before packing and its forward
adds 1 back: w = scale * (q - (z + 1))) and the zero itself in "gptq_v2" (GPTQModel). Symmetric checkpoints
store z = 7 (zero 8). A classic zero can be 16 (z stored 15: AutoGPTQ's pack of a zero 0 wraps to -1, whose
nibble is 15), which no 4-bit canonical zero holds: such a group keeps zero 15 and takes the offset -scale
(engine.weights.int4's canonical w = (q - zero) * scale + offset), which is the same weight, not a clipped one.

Roundings: none on the reference path. A code difference (q - zero) is an integer of at most 5 bits and the
scale an fp16, so (q - zero) * scale is exact in float32, and so is adding the offset -scale (the sum,
(q - 16) * scale, is representable); the dequantized weight in fp16 is then AutoGPTQ's own fp16
scale * (q - zero), bit for bit. The int4pack kernels hold each group's scale and offset (8 - zero) * scale in
bfloat16 (engine.weights.int4). Groups larger than the kernels' largest (128) are cut into groups of 128 (64, 32) that
repeat the scale and zero: the same weights.

Every tensor is checked against the config from the files' headers (dtype, shape, bit width, group size) before
anything sized by them is read, then g_idx by value; each problem is a GPTQFormatError naming the tensor. Other
tensors (norms, embeddings, the head) are float and read as engine.weights.float_int4 reads them. A quantized output
head, per-module overrides ("dynamic") and act-order (desc_act=True) checkpoints are refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from .float_int4 import (
    FLOAT_DTYPES,
    CheckpointError,
    SafetensorsFolder,
    check_tensors,
    fill_floats,
    float_parameters,
    model_names,
    read_float,
    report_layers,
)
from .gguf_loader import Progress, meta_model, release_freed_memory
from .int4 import (
    GROUP_SIZES,
    KERNELS,
    Int4Linear,
    decoder_linears,
    dequantize_codes,
    pick_kernel,
    replace_module,
    shape_problem,
)

log = logging.getLogger(__name__)

PARTS = ("qweight", "qzeros", "scales")  # the tensors every quantized linear has (g_idx and bias may be absent)
INDEX_DTYPES = ("I32", "I64")  # g_idx
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what is added to a stored zero
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class GPTQFormatError(CheckpointError):
    """A GPTQ checkpoint this loader does not read (act-order, another bit width or format, a tensor that
    disagrees with the config)."""


def gptq_settings(config_json: dict) -> dict | None:
    """The quantization_config of a GPTQ checkpoint's config.json (None when the model is not GPTQ)."""
    quant = config_json.get("quantization_config") or {}
    if not isinstance(quant, dict) or str(quant.get("quant_method", "")).lower() != "gptq":
        return None
    return quant


def is_gptq_folder(folder: Path) -> bool:
    path = Path(folder) / "config.json"
    try:
        return path.is_file() and gptq_settings(json.loads(path.read_text())) is not None
    except (OSError, ValueError):
        return False


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> uint8 codes [K, N]: nibble j of word [i, n] is row 8i + j."""
    nibbles = (packed.to(torch.int32)[:, None, :] >> _SHIFTS[None, :, None]) & 0xF  # [K/8, 8, N]
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """qzeros int32 [R, N/8] -> uint8 [R, N]: nibble j of word [r, c] is column 8c + j."""
    nibbles = (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF  # [R, N/8, 8]
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def checked_settings(quant: dict) -> tuple[int, int]:
    """(group size, -1 for one group per row; what is added to a stored zero) of a quantization_config."""
    try:
        bits, group_size = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    except (TypeError, ValueError):
        raise GPTQFormatError(f"bits / group_size must be integers, got {quant.get('bits')!r} / "
                              f"{quant.get('group_size')!r}") from None
    fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
    if bits != 4:
        raise GPTQFormatError(f"only 4-bit GPTQ is supported, got bits={bits}")
    if quant.get("desc_act", False):
        raise GPTQFormatError("act-order GPTQ (desc_act=true: input rows in a permuted group order) is not supported; "
                              "only desc_act=false checkpoints are")
    if fmt not in ZERO_OFFSET:
        raise GPTQFormatError(f"checkpoint_format {fmt!r} is not supported (only {', '.join(ZERO_OFFSET)})")
    if str(quant.get("pack_dtype", "int32")).lower().removeprefix("torch.") != "int32":
        raise GPTQFormatError(f"pack_dtype {quant.get('pack_dtype')!r} is not supported (only int32)")
    if quant.get("dynamic"):
        raise GPTQFormatError("per-module GPTQ settings (quantization_config.dynamic) are not supported")
    if group_size != -1 and (group_size <= 0 or group_size % min(GROUP_SIZES)):
        raise GPTQFormatError(f"group_size must be -1 or a multiple of {min(GROUP_SIZES)}, got {group_size}")
    return group_size, ZERO_OFFSET[fmt]


def _kernel_group(group_size: int) -> int:
    """The largest group size an Int4Linear takes that divides the checkpoint's."""
    return next(g for g in sorted(GROUP_SIZES, reverse=True) if group_size % g == 0)


def _expected_parts(name: str, linear: nn.Linear, group_size: int, with_g_idx: bool) -> dict[str, tuple[tuple, tuple]]:
    """{tensor name: (shape, dtypes)} of a quantized linear, from its meta module; the sizes are checked to be
    whole first."""
    k, n = linear.in_features, linear.out_features
    g = k if group_size == -1 else group_size
    if k % g or g % min(GROUP_SIZES) or n % 8:
        raise GPTQFormatError(f"{name}: a [{n}, {k}] linear does not split into groups of {g} input rows "
                              f"(a multiple of {min(GROUP_SIZES)}) and words of 8 output columns")
    parts = {f"{name}.qweight": ((k // 8, n), ("I32",)), f"{name}.qzeros": ((k // g, n // 8), ("I32",)),
             f"{name}.scales": ((k // g, n), FLOAT_DTYPES)}
    if with_g_idx:
        parts[f"{name}.g_idx"] = ((k,), INDEX_DTYPES)
    return parts


def gptq_codes(tensors: SafetensorsFolder, names: dict[str, str], name: str, linear: nn.Linear, group_size: int,
               zero_offset: int):
    """Canonical (codes uint8 [N, K], scales float32 [N, K/g], zeros uint8 [N, K/g], offsets float32 or None) of a
    checked quantized linear, g the kernel group (the module docstring)."""
    k = linear.in_features
    g = k if group_size == -1 else group_size
    if f"{name}.g_idx" in names:
        g_idx = tensors.get(names[f"{name}.g_idx"])
        if not torch.equal(g_idx.to(torch.int64), torch.arange(k) // g):
            raise GPTQFormatError(f"tensor {names[f'{name}.g_idx']!r} is not k // {g} for every input row k, which "
                                  f"desc_act=false checkpoints hold (an act-order or reordered layer)")
    scales = tensors.get(names[f"{name}.scales"]).to(torch.float32)  # [K/G, N]
    if not torch.isfinite(scales).all():
        raise GPTQFormatError(f"tensor {names[f'{name}.scales']!r} holds a non-finite scale")
    codes = unpack_rows(tensors.get(names[f"{name}.qweight"])).t().contiguous()  # [N, K]
    zeros = unpack_columns(tensors.get(names[f"{name}.qzeros"])).to(torch.int16) + zero_offset  # [K/G, N]: 0..16
    scales, zeros = scales.t(), zeros.t()  # [N, K/G]
    repeat = g // _kernel_group(g)
    if repeat > 1:  # groups cut into the kernels' size, each repeating its scale and zero
        scales, zeros = scales.repeat_interleave(repeat, dim=1), zeros.repeat_interleave(repeat, dim=1)
    offsets = None
    high = zeros > 15
    if bool(high.any()):  # zero 16: zero 15 and offset -scale, the same weight (the module docstring)
        offsets = torch.where(high, -scales, torch.zeros_like(scales))
        zeros = torch.where(high, torch.full_like(zeros, 15), zeros)
    return codes, scales.contiguous(), zeros.to(torch.uint8).contiguous(), offsets


def _gptq_layer(canonical, linear: nn.Linear, bias: torch.Tensor | None, kernel: str | None, name: str,
                device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The Int4Linear (kernel given) or dequantized nn.Linear (kernel None) of one quantized linear."""
    codes, scales, zeros, offsets = canonical
    if kernel is None:
        dense = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None, device="meta")
        dense.weight = nn.Parameter(
            dequantize_codes(codes, scales, zeros, linear.in_features, dtype, offsets).to(device), requires_grad=False)
        if bias is not None:
            dense.bias = nn.Parameter(bias, requires_grad=False)
        return dense
    problem = shape_problem(kernel, linear.out_features, linear.in_features)
    if problem is not None:
        log.info("GPTQ int4 %s: reference path (%s)", name, problem)
        kernel = "reference"
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    layer = Int4Linear.from_codes(to(codes), to(scales), to(zeros), linear.in_features, bias, kernel, origin="gptq",
                                  offsets=to(offsets))
    layer.fallback_reason = problem
    return layer


def load_gptq_model(folder: Path, config, device: torch.device, dtype: torch.dtype, *, dequantize: bool = False,
                    kernel: str = "auto", progress: Progress | None = None):
    """A GPTQ checkpoint as a model in eval mode on `device`: quantized linears as Int4Linear (or, with
    `dequantize`, as float nn.Linear in `dtype`), every other tensor (embeddings, norms, lm_head) in `dtype`.
    `progress(done, total, what)` after each decoder layer and once when the rest is in place."""
    quant = config.quantization_config
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    group_size, zero_offset = checked_settings(quant)
    tensors = SafetensorsFolder(folder, GPTQFormatError)
    model = meta_model(config, dtype)
    names = model_names(tensors, model, GPTQFormatError)
    linears = decoder_linears(model)
    quantized = {name for name, _ in linears if f"{name}.qweight" in names}
    stray = sorted(key for name, key in names.items() if name.endswith(".qweight")
                   and name.removesuffix(".qweight") not in quantized)
    if stray:
        raise GPTQFormatError(f"quantized tensors outside the decoder layers' linears (a quantized head?) are not "
                              f"supported: {', '.join(stray[:6])}")
    if not quantized:
        raise GPTQFormatError(f"{folder}: config.json says GPTQ but no decoder linear has a .qweight tensor")
    expected = {name: (tuple(p.shape), FLOAT_DTYPES) for name, p in float_parameters(model).items()}
    for name, linear in linears:
        if name in quantized:
            del expected[f"{name}.weight"]
            expected.update(_expected_parts(name, linear, group_size, f"{name}.g_idx" in names))
    check_tensors(tensors, names, expected, model, GPTQFormatError)
    reason = None
    if not dequantize:
        assert kernel == "auto" or kernel in KERNELS, kernel
        kernel, reason = pick_kernel(kernel, device)
        if reason:
            log.info("GPTQ int4 on %s: reference path (%s)", device, reason)
    layer_done, total = report_layers(progress, [name for name, _ in linears])
    for position, (name, linear) in enumerate(linears):
        if name in quantized:
            bias = read_float(tensors, names[f"{name}.bias"], dtype, device) if linear.bias is not None else None
            canonical = gptq_codes(tensors, names, name, linear, group_size, zero_offset)
            layer = _gptq_layer(canonical, linear, bias, None if dequantize else kernel, name, device, dtype)
            if isinstance(layer, Int4Linear):
                layer.fallback_reason = layer.fallback_reason or reason
            replace_module(model, name, layer)
        layer_done(position)
    fill_floats(model, tensors, names, dtype, device)  # float decoder linears too (not quantized in the file)
    model.to(device)
    model.eval()
    release_freed_memory()
    if progress is not None:
        progress(total, total, "output head, embeddings and norms")
    return model

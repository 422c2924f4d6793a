"""Reading AWQ int4 checkpoints (AutoAWQ's GEMM layout) with our own code: no autoawq, no pickle.

Tensors of a quantized linear `name` (K = in_features, N = out_features, G = group size):
    name.qweight  int32 [K, N/8]     codes, 8 output columns per word
    name.qzeros   int32 [K/G, N/8]   integer zeros, packed the same way
    name.scales   fp16  [K/G, N]
    name.bias     (optional, float)
Within each int32, nibble j (bits 4j..4j+3) holds output column AWQ_ORDER[j] of its 8: codes 0..7 for columns
0..7 pack to 0x75316420. The weight is w[k, n] = (q - zero) * scale, which is our canonical convention, so a
layer becomes an Int4Linear (or a dequantized nn.Linear) after one transpose.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from .int4 import KERNELS, Int4Linear, check_group_size, dequantize_codes, pick_kernel, shape_problem

log = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class AWQFormatError(ValueError):
    """An AWQ checkpoint this loader does not read (another version, bit width, or missing tensors)."""


def awq_settings(config_json: dict) -> dict | None:
    """The quantization_config of an AWQ checkpoint's config.json (None when the model is not AWQ)."""
    quant = config_json.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() != "awq":
        return None
    return quant


def is_awq_folder(folder: Path) -> bool:
    path = Path(folder) / "config.json"
    try:
        return path.is_file() and awq_settings(json.loads(path.read_text())) is not None
    except (OSError, ValueError):
        return False


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] in AutoAWQ order -> uint8 codes [R, C] in column order."""
    nibbles = (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF  # [R, C/8, 8]: nibble j
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_ORDER)] = nibbles  # column AWQ_ORDER[j] <- nibble j
    return columns.reshape(packed.shape[0], -1).to(torch.uint8)


def _checked_settings(quant: dict) -> tuple[int, list[str]]:
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    version = str(quant.get("version", "gemm")).lower()
    group_size = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if bits != 4 or version != "gemm" or not quant.get("zero_point", True):
        raise AWQFormatError(f"only 4-bit GEMM AWQ with zero points is supported, got bits={bits}, "
                             f"version={version!r}, zero_point={quant.get('zero_point', True)}")
    check_group_size(group_size)
    return group_size, list(quant.get("modules_to_not_convert") or [])


def _layer_index(name: str) -> int | None:
    """The decoder layer a module name is inside (".layers.<i>."), or None."""
    parts = name.split(".")
    for before, after in zip(parts, parts[1:]):
        if before == "layers" and after.isdigit():
            return int(after)
    return None


class _Tensors:
    """Every tensor of the folder's *.safetensors files by name, read lazily (safetensors never runs code)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self._files = {}
        self._where: dict[str, str] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._files[str(path)] = handle
            for key in handle.keys():
                self._where[key] = str(path)
        if not self._where:
            raise AWQFormatError(f"{folder} holds no .safetensors files (AWQ weights are read from safetensors only)")

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, key: str) -> torch.Tensor:
        return self._files[self._where[key]].get_tensor(key)


def _awq_layer(tensors: _Tensors, name: str, linear: nn.Linear, group_size: int, kernel: str | None,
               device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The Int4Linear (kernel given) or dequantized nn.Linear (kernel None) of one AWQ linear."""
    codes = unpack_awq(tensors.get(f"{name}.qweight")).t()  # [N, K]
    zeros = unpack_awq(tensors.get(f"{name}.qzeros")).t()  # [N, K/G]
    scales = tensors.get(f"{name}.scales").to(torch.float32).t()  # [N, K/G]
    bias = tensors.get(f"{name}.bias").to(dtype) if f"{name}.bias" in tensors else None
    expected = (linear.out_features, linear.in_features)
    if tuple(codes.shape) != expected or tuple(scales.shape) != (expected[0], expected[1] // group_size) \
            or zeros.shape != scales.shape:
        raise AWQFormatError(f"{name}: qweight/scales/qzeros shapes {tuple(codes.shape)}/{tuple(scales.shape)}/"
                             f"{tuple(zeros.shape)} do not fit a [{expected[0]}, {expected[1]}] linear, "
                             f"group {group_size}")
    if kernel is None:
        dense = nn.Linear(linear.in_features, linear.out_features, bias=bias is not None, device=device, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(dequantize_codes(codes, scales, zeros, linear.in_features, dtype))
            if bias is not None:
                dense.bias.copy_(bias)
        return dense.requires_grad_(False)
    problem = shape_problem(kernel, linear.out_features, linear.in_features)
    if problem is not None:
        log.info("AWQ int4 %s: reference path (%s)", name, problem)
        kernel = "reference"
    codes, scales, zeros = (t.contiguous().to(device) for t in (codes, scales, zeros))
    layer = Int4Linear.from_codes(codes, scales, zeros, linear.in_features,
                                  bias.to(device) if bias is not None else None, kernel, origin="awq")
    layer.fallback_reason = problem
    return layer


def load_awq_model(folder: Path, config, device: torch.device, dtype: torch.dtype, *, dequantize: bool = False,
                   kernel: str = "auto", progress=None):
    """An AWQ checkpoint as a model in eval mode on `device`: quantized linears as Int4Linear (or, with
    `dequantize`, as float nn.Linear), every other tensor (embeddings, norms, lm_head) as `dtype`.
    `progress(done, total, what)` after each decoder layer's linears (engine.weights.loader.load_model)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    quant = config.quantization_config if isinstance(config.quantization_config, dict) else \
        config.quantization_config.to_dict()
    group_size, not_converted = _checked_settings(quant)
    tensors = _Tensors(folder)
    reason = None
    if not dequantize:
        assert kernel == "auto" or kernel in KERNELS, kernel
        kernel, reason = pick_kernel(kernel, device)
        if reason:
            log.info("AWQ int4 on %s: reference path (%s)", device, reason)
    # Parameters on the meta device (no memory); buffers such as RoPE's inv_freq are computed for real.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    head = model.get_output_embeddings()
    quantized: set[str] = set()
    num_layers = int(getattr(config.get_text_config(), "num_hidden_layers", 0) or 0)
    reported = -1
    for name, module in list(model.named_modules()):
        layer_index = _layer_index(name)
        if progress is not None and layer_index is not None and layer_index > reported and num_layers:
            if reported >= 0:
                progress(reported + 1, num_layers + 1, f"layer {reported + 1} of {num_layers}")
            reported = layer_index
        if not isinstance(module, nn.Linear) or module is head or any(skip in name for skip in not_converted):
            continue
        if f"{name}.qweight" not in tensors:
            continue
        layer = _awq_layer(tensors, name, module, group_size, None if dequantize else kernel, device, dtype)
        if isinstance(layer, Int4Linear):
            layer.fallback_reason = layer.fallback_reason or reason
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        quantized.add(name)
    if progress is not None and num_layers and reported >= 0:
        progress(reported + 1, num_layers + 1, f"layer {reported + 1} of {num_layers}")
    if not quantized:
        raise AWQFormatError(f"{folder}: config.json says AWQ but no tensor ends in .qweight")
    owned = {f"{name}.{part}" for name in quantized for part in ("qweight", "qzeros", "scales", "bias")}
    plain = {key: tensors.get(key) for key in tensors.keys() if key not in owned}
    plain = {key: t.to(dtype) if t.is_floating_point() else t for key, t in plain.items()}
    model.load_state_dict(plain, strict=False, assign=True)
    if head is not None and head.weight.is_meta and getattr(config.get_text_config(), "tie_word_embeddings", False):
        head.weight = model.get_input_embeddings().weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise AWQFormatError(f"{folder}: no tensors for {', '.join(missing[:5])}"
                             f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
    model.to(device)
    model.eval()
    return model

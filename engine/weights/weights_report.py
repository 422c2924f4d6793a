"""What a load holds, for info() and the front ends: the weights' format and kernels, their bytes, the head and
the table (a WeightsReport, engine.reports), and one line of it (describe_weights)."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from ..reports import GgufTensors, WeightsChoice, WeightsReport
from .gguf_blocks import BlockLinear
from .head import Int8Linear, head_format
from .int4 import DECODER_LINEAR, Int4Linear, decoder_linears, weights_format


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weights_report(model) -> WeightsReport:
    """What the weights are and what they hold (WeightsReport says each field). Decoder linears in int8 rows (a
    GGUF's 5/6/8-bit tensors with weights="int4") count as "int8" in `format` and by their kernel in `kernel`. `gguf`
    and `choice` are what engine.weights.gguf_loader and engine.weights.loader.load_model left on the model; a model
    built elsewhere has neither. `streaming` is the engine's to add (it knows whether layers stream)."""
    params = list(model.parameters())  # tied weights once
    resident = _tensor_bytes(params) + _tensor_bytes(model.buffers())
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear) and m is not output]
    int8 = [(n, m) for n, m in model.named_modules()
            if isinstance(m, Int8Linear) and m is not output and DECODER_LINEAR.search(n)]
    blocks = [(n, m) for n, m in model.named_modules()
              if isinstance(m, BlockLinear) and m is not output and DECODER_LINEAR.search(n)]
    linears = decoder_linears(model) + int8 + blocks + [(n, m) for n, m in model.named_modules()
                                                        if isinstance(m, Int4Linear) and m is not output]
    linear_bytes = sum(_tensor_bytes([*m.parameters(), *m.buffers()]) for _, m in linears)
    float32_bytes = sum(4 * m.out_features * (m.in_features + (m.bias is not None)) for _, m in linears)
    floating = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    reason = None
    if int4 or int8 or blocks:
        block_formats = [label for label, _ in Counter(head_format(m) for _, m in blocks).most_common()]
        fmt = "+".join(block_formats + ([weights_format(model)] if int4 else []) + (["int8"] if int8 else []))
        kernels = {m.kernel for m in int4} | {m.kernel for _, m in int8} | {m.kernel for _, m in blocks}
        kernel = "+".join(sorted(kernels))
        reason = "; ".join(sorted({m.fallback_reason for m in int4 if m.fallback_reason})) or None
    else:
        fmt = str(floating).replace("torch.", "")
        kernel = "dense"
    shared = isinstance(output, nn.Linear) and isinstance(inputs, nn.Embedding) and output.weight is inputs.weight
    head_bytes = 0 if shared else _tensor_bytes([*output.parameters(), *output.buffers()])
    mix = getattr(model, "gguf_tensors", None)
    choice = getattr(model, "weights_choice", None)
    return WeightsReport(
        format=fmt, kernel=kernel, fallback_reason=reason, head=head_format(output),
        head_kernel=getattr(output, "kernel", "dense"), embedding=head_format(inputs), resident_bytes=resident,
        linear_bytes=linear_bytes, linear_float32_bytes=float32_bytes, head_bytes=head_bytes,
        num_int4_linears=len(int4),
        gguf=None if mix is None else {label: GgufTensors(**entry) for label, entry in mix.items()},
        choice=None if choice is None else WeightsChoice(**choice),
        attention=getattr(model.config, "_attn_implementation", None))


def describe_weights(weights: WeightsReport) -> str:
    """One line of what a load holds: the format, why "auto" chose it, the bytes, and a GGUF's mix of what each
    tensor type became."""
    text = f"weights {weights.format}, {weights.resident_bytes / 2**20:,.0f} MiB"
    if weights.choice is not None and weights.choice.asked == "auto":
        text += f" (auto: {weights.choice.why})"
    if weights.gguf:
        text += "; " + ", ".join(f"{label} x{entry.tensors}" for label, entry in weights.gguf.items())
    return text

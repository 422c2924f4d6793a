"""What a load holds, for info() and the front ends: the weights' format and kernels, their bytes, the head and
the table, and one line of it (describe_weights)."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from .gguf_blocks import BlockLinear
from .head import Int8Linear, head_format
from .int4 import DECODER_LINEAR, Int4Linear, decoder_linears, weights_format


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weights_report(model) -> dict:
    """What the weights are and what they hold: `format` of the decoder linears ("float32", "bfloat16", ...,
    "int4-g128" (quantized at load), "awq-int4-g128", "gguf-q4_1-g32" (GGUF 4-bit codes as int4 groups), "gguf-q4_k"
    (a GGUF type's blocks as the file holds them: engine.weights.gguf_blocks), several joined by "+", most common
    first), `kernel` (the linears' matmul path: "dense", "reference", "cpu_int4pack", "tinygemm", "gguf_blocks", or
    several joined by "+"), `fallback_reason` (why a faster int4 path is not used, or None), `head` and
    `embedding` (the output head's and the input table's format: "float32", "int8", "int4-g32"), `head_kernel` (the
    head's matmul path: "dense", "cpu_int8pack", "reference", ...), `resident_bytes` (every
    parameter and buffer held, packed weights, scales and zeros included), `linear_bytes` (the decoder layers'
    linears as held), `linear_float32_bytes` (the same linears in float32) and `head_bytes` (the head as held,
    0 when it shares its float weight with the embedding table). Decoder linears in int8 rows (a GGUF's 5/6/8-bit
    tensors with weights="int4") count as "int8" in `format` and by their kernel in `kernel`. `gguf` (a model
    loaded by engine.weights.gguf_loader, else None): per "<GGUF type>-><form>" ("Q4_K->int4", "Q6_K->int8",
    "F32->float32") the number of tensors, their bytes in the file and as held. `choice`: what weights="auto"
    (or the asked format) became and why (engine.weights.loader.load_model), None for a model built elsewhere;
    `attention`: the attention implementation ("sdpa", or under quantized CPU kernels "rows_exact", else "sdpa_float64":
    engine.exact_attention)."""
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
    return {"format": fmt, "kernel": kernel, "fallback_reason": reason, "head": head_format(output),
            "head_kernel": getattr(output, "kernel", "dense"),
            "embedding": head_format(inputs), "resident_bytes": resident, "linear_bytes": linear_bytes,
            "linear_float32_bytes": float32_bytes, "head_bytes": head_bytes, "num_int4_linears": len(int4),
            "gguf": getattr(model, "gguf_tensors", None), "choice": getattr(model, "weights_choice", None),
            "attention": getattr(model.config, "_attn_implementation", None)}


def describe_weights(weights: dict) -> str:
    """One line of what a load holds (weights_report): the format, why "auto" chose it, the bytes,
    and a GGUF's mix of what each tensor type became."""
    text = f"weights {weights['format']}, {weights['resident_bytes'] / 2**20:,.0f} MiB"
    choice = weights.get("choice") or {}
    if choice.get("asked") == "auto":
        text += f" (auto: {choice['why']})"
    mix = weights.get("gguf")
    if mix:
        text += "; " + ", ".join(f"{label} x{entry['tensors']}" for label, entry in mix.items())
    return text

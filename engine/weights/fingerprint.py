"""A loaded model's identity: the key every stored KV of it is filed under (engine.keys), so that KV computed by
one model, number format, kernel path or attention arithmetic is never served to another."""

from __future__ import annotations

import hashlib
import json

import torch

from .gguf_blocks import ATTENTION_NUMERICS, BlockEmbedding, BlockLinear, vector_path
from .gguf_blocks import numerics as block_numerics
from .head import Int4Embedding, Int8Embedding, Int8Linear
from .int4 import Int4Linear


def fingerprint(model) -> str:
    """A stable identity of the weights, dtype, RoPE/attention config and attention implementation.

    Weights: names, shapes and a strided sample of every parameter's values (hashing all bytes of a
    multi-GB model at each start would cost seconds), and of every int4 layer's buffers (packed codes, scales,
    zeros; int8 codes and scales) with its group size and matmul path (the paths round differently, so their KV
    must never be shared).
    Deterministic across processes and machines.
    """
    h = hashlib.blake2b(digest_size=16)
    config = model.config.to_dict()
    relevant = {k: config.get(k) for k in sorted(config) if k not in ("_name_or_path", "transformers_version",
                                                                       "_model_name_or_path", "quantization_config")}
    h.update(json.dumps(relevant, sort_keys=True, default=str).encode())
    # The attention implementation (sdpa, eager, ...) rounds differently, and to_dict() leaves it out.
    attention = getattr(model.config, '_attn_implementation', None)
    if attention == "rows_exact":  # engine.exact_attention's kernel: its arithmetic's version too, and whether
        # this build sums in vector chains (AVX2 and AVX-512 alike) or in order (portable C: other last bits)
        portable = "-portable" if vector_path() == "portable C" else ""
        attention = f"{attention}-{ATTENTION_NUMERICS}{portable}"
    h.update(f"attn:{attention}".encode())
    for name, param in model.named_parameters():
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // 64)
        sample = flat[::step][:64].to(torch.float32).cpu().numpy().tobytes()
        h.update(name.encode())
        h.update(str(tuple(param.shape)).encode())
        h.update(str(param.dtype).encode())
        h.update(sample)
    for name, module in model.named_modules():
        if getattr(module, "own_rounding", False):  # engine.block_forward's norms and SiLU round their own way
            h.update(f"{name}:{type(module).__name__}".encode())
        if not isinstance(module, (Int4Linear, Int4Embedding, Int8Linear, Int8Embedding, BlockLinear, BlockEmbedding)):
            continue
        if isinstance(module, BlockLinear):  # the kernel's float sums: the same on every machine of one path
            h.update(f"blocks:{block_numerics()}".encode())
        h.update(f"{name}:{type(module).__name__}:g{getattr(module, 'group_size', 0)}:"
                 f"{getattr(module, 'kernel', 'rows')}:{getattr(module, 'type_name', '')}".encode())
        for buffer_name, buffer in module.named_buffers():
            flat = buffer.reshape(-1)
            step = max(1, flat.numel() // 64)
            sample = flat[::step][:64].cpu()
            sample = sample.to(torch.float32) if sample.is_floating_point() else sample.to(torch.int64)
            h.update(buffer_name.encode())
            h.update(str(tuple(buffer.shape)).encode())
            h.update(str(buffer.dtype).encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()

"""Attention whose result for a position does not depend on how the prompt was cut into forwards.

Reuse never changes an answer only if a position's KV is the same whether it was computed in an uncached
prefill, in a warm of a shorter prompt, in a piece after an EXACT hit, or one token at a time while decoding
(the answer's KV is stored and reused by the next turn). Everything in a decoder layer but attention is per
position and, on the CPU's int4pack / int8pack kernels, bit for bit the same however many rows run together
(measured: a row's output is equal for 1 to 300 rows). Float32 attention is not: its kernels choose their
blocking by the query and key counts, and a position's output moves by ~1e-7 between shapes. With float32
weights that stays ~1e-5 in the logits; the int4 kernels round their input to bfloat16, and a 1e-7 move that
straddles a bfloat16 rounding becomes a 4e-3 one, which grows over the layers (0.125 in the embedded model's
logits after an EXACT hit).

So quantized models on the CPU compute attention in float64 (ATTENTION, registered in transformers' attention
and mask registries; the inputs are the float32 queries and cached keys and values, the output goes back to
float32): two kernel shapes then differ by ~1e-16, and the output's float32 rounding absorbs that unless the
float64 values straddle a float32 rounding, which happens for about one element in 10^8 and then still has to
straddle a bfloat16 rounding downstream (one in 2^16) to matter. That is not bit-identity by construction; the
greedy divergence rate over many prompts is measured (bench, tests) and is zero. Cost: attention at twice its
float32 time (prefill +15% at 700 tokens on the embedded model; decode +0.15 ms a layer at 1k context).
"""

from __future__ import annotations

import torch

ATTENTION = "sdpa_float64"
_registered = False


def register() -> str:
    """Registers ATTENTION with transformers (once per process) and returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(ATTENTION, float64_attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        _registered = True
    return ATTENTION


def float64_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """transformers' sdpa attention on float64 copies of its inputs, the output in the query's dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(torch.float64)
    out, weights = sdpa_attention_forward(module, query.to(torch.float64), key.to(torch.float64),
                                          value.to(torch.float64), attention_mask, *args, **kwargs)
    return out.to(query.dtype), weights


def needs_exact_attention(model) -> bool:
    """Whether `model` rounds activations in its linears on the CPU (to bfloat16 in the int4pack / int8pack
    kernels, to int8 blocks in engine.gguf_blocks) under float32 attention, where attention's shape-dependent
    roundings would change reused answers."""
    from .gguf_blocks import KERNEL, BlockLinear
    from .head import Int8Linear
    from .int4 import Int4Linear

    device = next(iter([*model.parameters(), *model.buffers()])).device
    if device.type != "cpu" or model.config._attn_implementation not in ("sdpa", ATTENTION):
        return False
    kernels = {getattr(m, "kernel", None) for m in model.modules()
               if isinstance(m, (Int4Linear, Int8Linear, BlockLinear))}
    return bool(kernels & {"cpu_int4pack", "cpu_int8pack", KERNEL})


def use_exact_attention(model) -> bool:
    """Switches `model` to ATTENTION when needs_exact_attention says so; returns whether it did."""
    if not needs_exact_attention(model):
        return False
    name = register()
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config._attn_implementation = name
    return True

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

Where the C kernels build (engine.weights.gguf_blocks' library, engine/exact_attention.c), quantized CPU models use
ROWS instead: attention computed one query row at a time in float32, keys in position order, each dot product
and weighted sum in a fixed order (`row_attention`). A row's result then depends only on its query and on the
keys and values it attends: bit-identical by construction however the prompt was cut, however many rows run
together and whatever the thread count, and faster than either sdpa path at decode (no float64 copies of the
cache). Masks: causal (none given), or a boolean or 0/-inf additive mask; anything else (soft-capping, sinks,
biases) falls back to the float64 path for that call.
"""

from __future__ import annotations

import torch

ATTENTION = "sdpa_float64"
ROWS = "rows_exact"
EXACT = (ATTENTION, ROWS)  # the attention implementations whose result does not depend on the forward's cut
_registered: set[str] = set()
# keyword arguments that change the maths beyond a masked softmax: those calls take the float64 path
_NOT_ROWS = ("softcap", "s_aux", "sinks", "position_bias")


def register(name: str = ATTENTION) -> str:
    """Registers `name` (ATTENTION or ROWS) with transformers (once per process) and returns it."""
    if name not in _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(name, float64_attention if name == ATTENTION else row_attention)
        AttentionMaskInterface.register(name, sdpa_mask)
        _registered.add(name)
    return name


def rows_unavailable() -> str | None:
    """Why ROWS cannot run here (its C kernel cannot be built or loaded), or None."""
    from .weights.gguf_blocks import unavailable

    return unavailable("cpu")


def rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, causal: bool,
         scale: float) -> torch.Tensor:
    """[B, nq, H, D] float32: query [B, H, nq, D], key / value [B, KVH, nk, D] (KVH divides H), mask bool
    [B or 1, 1 or H, nq, nk] (True: attend) or None (`causal`: the queries are the last nq positions)."""
    import ctypes

    from .weights.gguf_blocks import library

    batch, heads, nq, dim = query.shape
    kv_heads, nk = key.shape[1], key.shape[2]
    if heads % kv_heads or key.shape != value.shape or key.shape[0] != batch or key.shape[3] != dim:
        raise ValueError(f"attention shapes do not fit: q {list(query.shape)}, k {list(key.shape)}, "
                         f"v {list(value.shape)}")
    q = query.to(torch.float32).contiguous()
    k, v = _rows_of(key), _rows_of(value)
    if k.stride()[:2] != v.stride()[:2]:
        k, v = k.contiguous(), v.contiguous()
    mask_heads = 1
    if mask is not None:
        mask_heads = mask.shape[1]
        if mask.dtype != torch.bool or mask.dim() != 4 or mask_heads not in (1, heads) or \
                tuple(mask.shape[2:]) != (nq, nk) or mask.shape[0] not in (1, batch):
            raise ValueError(f"an attention mask of {mask.dtype} {list(mask.shape)} for q {list(query.shape)}, "
                             f"k {list(key.shape)}")
        mask = mask.expand(batch, mask_heads, nq, nk).contiguous().view(torch.uint8)
    out = torch.empty(batch, nq, heads, dim, dtype=torch.float32)
    status = library().kvb_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                                     None if mask is None else mask.data_ptr(), mask_heads, int(causal),
                                     out.data_ptr(), batch, heads, kv_heads, nq, nk, dim, ctypes.c_float(scale),
                                     1 if nq * batch == 1 else max(1, torch.get_num_threads()))
    if status != 0:
        raise MemoryError("no scratch memory for attention")
    return out


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """`t` [B, KVH, n, D] in float32 as the kernel reads it: rows of D contiguous values, D apart (a cache's view
    of its first n positions is already so: no copy), any batch and head strides; else a contiguous copy."""
    t = t.to(torch.float32)
    return t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous()


def row_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface over `rows`: (output [B, q, H, D] in the query's dtype, None)."""
    if any(kwargs.get(name) is not None for name in _NOT_ROWS) or query.device.type != "cpu" or \
            (module.training and dropout):
        return float64_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, **kwargs)
    nk = key.shape[2]
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :nk] if attention_mask.ndim == 4 else attention_mask
        if mask.dtype != torch.bool:  # additive: 0 attends, -inf does not; other values are biases
            if not bool(((mask == 0) | (mask == float("-inf"))).all()):
                return float64_attention(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, **kwargs)
            mask = mask == 0
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return rows(query, key, value, mask, bool(causal), float(scale)).to(query.dtype), None


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
    kernels, to int8 blocks in engine.weights.gguf_blocks) under float32 attention, where attention's shape-dependent
    roundings would change reused answers."""
    from .weights.gguf_blocks import KERNEL, BlockLinear
    from .weights.head import Int8Linear
    from .weights.int4 import Int4Linear

    device = next(iter([*model.parameters(), *model.buffers()])).device
    if device.type != "cpu" or model.config._attn_implementation not in ("sdpa", *EXACT):
        return False
    kernels = {getattr(m, "kernel", None) for m in model.modules()
               if isinstance(m, (Int4Linear, Int8Linear, BlockLinear))}
    return bool(kernels & {"cpu_int4pack", "cpu_int8pack", KERNEL})


def use_exact_attention(model) -> bool:
    """Switches `model` to ROWS (ATTENTION where its kernel cannot be had) when needs_exact_attention says so;
    returns whether it did."""
    if not needs_exact_attention(model):
        return False
    name = register(ROWS if rows_unavailable() is None else ATTENTION)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config._attn_implementation = name
    return True

"""The CacheBlend pass: one batched forward pass over the rest of a prompt whose KV is partly reused.

Everything from the first APPROXIMATE token on runs as one pass over full-length per-layer K/V: the exact prefix
already in the cache, then the cached (re-rotated) KV of the reused segments and placeholders where tokens are
computed. With repair "cacheblend" the first layers run for every token; at the probe layer each reused token's
fresh value is compared with its cached value, and only the `blend_ratio` most deviating reused tokens (plus every
computed token) go on through the remaining layers, attending to a cache that mixes their fresh KV with everyone
else's cached KV. With "selective" the computed tokens alone go through every layer, which equals computing them
one run at a time but costs one forward pass instead of one per seam.

The pass drives Llama-family decoder layers directly (`blend_unavailable` says where it cannot run).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .config import RepairConfig
from .paged import KV, SpillingCache, kv_range
from .plan import Segment

BLEND_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "olmo2", "smollm3"})


def blend_unavailable(model) -> str | None:
    """Why the batched pass cannot run on `model` (a sliding attention window, or layers it does not know), or
    None when it can."""
    config = model.config
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding attention window"
    if config.model_type not in BLEND_MODEL_TYPES:
        return f"model type {config.model_type!r}"
    return None


def blend(model, ids: Sequence[int], segments: list[Segment], pieces: list[KV | None], cache, repair: RepairConfig,
          device) -> tuple[torch.Tensor, int]:
    """Fills `cache` from `segments[0].start` to the end of the prompt `ids` with one blend pass. `pieces[i]` is
    the cached (re-rotated) KV of `segments[i]`, or None where its tokens are computed; the cache holds the exact
    prefix before. Returns the last position's logits [V] and the number of reused tokens recomputed."""
    start = segments[0].start
    num_layers = model.config.num_hidden_layers
    reused = torch.zeros(len(ids) - start, dtype=torch.bool, device=device)
    for seg, kv in zip(segments, pieces):
        if kv is not None:
            reused[seg.start - start:seg.end - start] = True
    layers_k, layers_v = [], []
    spilled = isinstance(cache, SpillingCache)
    prefix = kv_range(cache, 0, start) if spilled and start > 0 else None  # pages included
    for layer in range(num_layers):
        ks, vs = [], []
        if start > 0:
            ks.append(prefix[layer][0] if prefix else cache.layers[layer].keys)
            vs.append(prefix[layer][1] if prefix else cache.layers[layer].values)
        for seg, kv in zip(segments, pieces):
            if kv is None:
                ks.append(_zeros_kv(model, seg.num_tokens, device))
                vs.append(_zeros_kv(model, seg.num_tokens, device))
            else:
                ks.append(kv[layer][0])
                vs.append(kv[layer][1])
        layers_k.append(torch.cat(ks, dim=2).contiguous())
        layers_v.append(torch.cat(vs, dim=2).contiguous())
    logits = blend_forward(model, ids, start, layers_k, layers_v, reused, repair, device)
    for layer in range(num_layers):
        if layer < len(cache.layers) and start > 0 and not spilled:
            cache.layers[layer].keys, cache.layers[layer].values = layers_k[layer], layers_v[layer]
        else:
            if layer < len(cache.layers) and start > 0:
                cache.layers[layer].reset()  # refilled whole below; the layer spills again by its budget
            cache.update(layers_k[layer], layers_v[layer], layer)
    repaired = int(round(repair.blend_ratio * int(reused.sum()))) if repair.mode == "cacheblend" else 0
    return logits, repaired


def _zeros_kv(model, num_tokens, device):
    """Placeholder K or V [1, H_kv, T, D] for tokens the blend pass computes (overwritten at every layer)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return torch.zeros(1, heads, num_tokens, head_dim, dtype=model.dtype, device=device)


class BlendCache:
    """The cache the decoder layers see during a CacheBlend pass.

    For layer l it holds K/V for every prompt position: the exact prefix, then the cached (re-rotated) KV of
    the blended range. `update` writes the active tokens' fresh K/V over their positions and returns the whole
    K/V, so the active queries attend to a mix of fresh and cached KV. At the probe layer it first records how
    far each active token's fresh value is from its cached value."""

    def __init__(self, layers_k: list[torch.Tensor], layers_v: list[torch.Tensor], offset: int):
        self.keys = layers_k  # per layer [1, H_kv, n, D]
        self.values = layers_v
        self.offset = offset  # first position of the blended range
        self.active: torch.Tensor | None = None  # positions of the active tokens [A]
        self.probe_layer = -1
        self.deviation: torch.Tensor | None = None  # [A] at the probe layer

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if layer_idx == self.probe_layer:
            cached = v[:, :, self.active]  # [1, H_kv, A, D]
            self.deviation = (value_states - cached).float().norm(dim=-1).mean(dim=(0, 1))
        k[:, :, self.active] = key_states
        v[:, :, self.active] = value_states
        return k, v


def blend_forward(model, ids: Sequence[int], start: int, layers_k, layers_v, reused: torch.Tensor,
                  repair: RepairConfig, device) -> torch.Tensor:
    """One batched pass over positions [start, n): `layers_k/v` hold per layer the full-length KV (the exact
    prefix [0, start) and cached KV where `reused` [n - start] is True; anything elsewhere is overwritten).
    cacheblend: every token through the layers up to the probe, then the computed tokens and the most deviating
    reused ones. selective: the computed tokens (seams and new text) alone through every layer, which equals
    computing them one run at a time but costs one forward pass instead of one per seam. Returns the last
    position's logits [V]; `layers_k/v` end up as the cache to decode from."""
    decoder = model.get_decoder()
    n = len(ids)
    positions = torch.arange(start, n, device=device)
    hidden = decoder.embed_tokens(torch.tensor([ids[start:]], device=device))
    cache = BlendCache(layers_k, layers_v, start)
    cache.active = positions
    num_reused = int(reused.sum())
    probe_layer = repair.probe_layer if repair.mode == "cacheblend" else -1
    cache.probe_layer = probe_layer
    if probe_layer < 0:  # selective: only the computed tokens, through every layer
        keep = torch.nonzero(~reused).squeeze(1)
        hidden = hidden[:, keep]
        cache.active = positions[keep]
    for layer_idx, layer in enumerate(decoder.layers[: model.config.num_hidden_layers]):
        if layer_idx == probe_layer + 1 and probe_layer >= 0:
            keep = _select(cache.deviation, reused, repair.blend_ratio, num_reused, repair.blend_select)
            hidden = hidden[:, keep]
            cache.active = positions[keep]
        active = cache.active
        # Query at position p sees every key at a position <= p.
        mask = (torch.arange(n, device=device)[None, :] <= active[:, None])[None, None]
        cos_sin = decoder.rotary_emb(hidden, active[None])
        hidden = layer(hidden, attention_mask=mask, position_ids=active[None], past_key_values=cache,
                       use_cache=True, position_embeddings=cos_sin)
    hidden = decoder.norm(hidden[:, -1:])
    return model.lm_head(hidden)[0, -1]


def _select(deviation: torch.Tensor, reused: torch.Tensor, ratio: float, num_reused: int,
            how: str = "deviation") -> torch.Tensor:
    """Indices (into the blended range, sorted) of every computed token plus the `ratio` most deviating
    reused tokens ("random": as many reused tokens drawn with a fixed seed, the same on every run: a control for
    the selection). The last token is always computed (it is never reused)."""
    num_keep = int(round(ratio * num_reused))
    if how == "random":
        draw = torch.rand(deviation.shape[0], generator=torch.Generator().manual_seed(0))
        deviation = draw.to(deviation.device)
    score = deviation.masked_fill(~reused, float("inf"))
    keep = torch.topk(score, int((~reused).sum()) + num_keep).indices
    return torch.sort(keep).values

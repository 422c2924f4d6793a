"""Long generations under a device budget: the live conversation's KV spills whole cold pages to host RAM, and
attention still covers the whole context exactly.

A `SpillingCache` is a DynamicCache whose layers keep the newest tokens on the device and move the oldest ones, a
page of `page_tokens` at a time, to the host once the device part of the layer is over its share of the budget.
Page j of a layer holds positions [j * P, (j + 1) * P); the device part holds [num_pages * P, seq_len).

Attention over a layer with pages is computed block by block (each page copied to the query's device for the
moment it is used, then the device part), merging the partial results by log-sum-exp (flash-decoding): a running
row maximum, a running sum of exponentials and a running weighted sum of values. It is the same softmax as one
pass over the whole context, up to float rounding.

How the paged attention is reached: models call `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)`
right after `past_key_values.update(...)`. Inside `with spilling(cache):` that registry entry is a dispatcher
that takes the paged path only when the keys it is handed are the device part of a layer of a cache made active
on the calling thread and that layer has pages; for every other call (other threads, other caches, layers that
never spilled) it calls the registered function unchanged. The entry is restored when the last `spilling` block
in the process exits.

Over 400 lines: one mechanism, the live KV spilled to host pages, with attention over the pages and its place in
transformers' cache."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .exact_attention import ATTENTION, ROWS, rows
from .live_cache import GrowingCache

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k, v), each [1, H_kv, T, D] (as engine.kv.tiers.KV)

PAGE_TOKENS = 128

# Keyword arguments some attention modules pass that change the maths beyond a causal softmax: never paged.
_UNPAGEABLE_KWARGS = ("sliding_window", "softcap", "position_bias", "s_aux", "sinks")


# ----------------------------------------------------------------------------------------------------- the maths

def attend_blocks(query: torch.Tensor, blocks: Iterable[tuple[int, torch.Tensor, torch.Tensor]], query_start: int,
                  scaling: float, work: torch.dtype | None = None) -> torch.Tensor:
    """Causal softmax attention of `query` over key/value blocks, merged by log-sum-exp.

    query: [B, H, q, D], the queries of positions [query_start, query_start + q).
    blocks: (start, k, v) in position order, k [B, H_kv, T, D] and v [B, H_kv, T, Dv] holding positions
        [start, start + T); together they cover [0, query_start + q). They may live on another device (a host
        page): each is copied to the query's device while it is used.
    H is a multiple of H_kv: query head h reads kv head h // (H // H_kv), as transformers' repeat_kv.
    Returns [B, H, q, Dv] in the query's dtype. Works in `work` (default float32, float64 for float64 inputs).
    """
    batch, num_heads, q_len, head_dim = query.shape
    if work is None:
        work = torch.float64 if query.dtype == torch.float64 else torch.float32
    device = query.device
    q_pos = torch.arange(query_start, query_start + q_len, device=device)
    m = acc = total = grouped = None
    expected_start = 0
    for start, k, v in blocks:
        assert start == expected_start, f"blocks must be contiguous from 0: got {start}, expected {expected_start}"
        num_tokens = k.shape[2]
        expected_start += num_tokens
        k = k.to(device, non_blocking=True).to(work)
        v = v.to(device, non_blocking=True).to(work)
        if grouped is None:
            num_kv_heads = k.shape[1]
            assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
            groups = num_heads // num_kv_heads
            # [B, H_kv, G * q, D]: row g * q + i is query i of head kv * G + g.
            grouped = query.to(work).reshape(batch, num_kv_heads, groups * q_len, head_dim)
            row_pos = q_pos.repeat(groups)  # [G * q]
            m = torch.full((batch, num_kv_heads, groups * q_len, 1), float("-inf"), dtype=work, device=device)
            total = torch.zeros_like(m)
            acc = torch.zeros(batch, num_kv_heads, groups * q_len, v.shape[-1], dtype=work, device=device)
        scores = torch.matmul(grouped, k.transpose(2, 3)) * scaling  # [B, H_kv, G * q, T]
        if start + num_tokens - 1 > query_start:  # some key lies after some query
            k_pos = torch.arange(start, start + num_tokens, device=device)
            scores = scores.masked_fill(k_pos[None, :] > row_pos[:, None], float("-inf"))
        # The first block starts at position 0, which every query sees: m is finite from then on, so a row that
        # sees nothing of a later block gets exp(-inf) = 0 there, never NaN.
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        weights = torch.exp(scores - m_new)
        correction = torch.exp(m - m_new)
        total = total * correction + weights.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.matmul(weights, v)
        m = m_new
    assert expected_start == query_start + q_len, f"blocks cover [0, {expected_start}), need {query_start + q_len}"
    out = (acc / total).reshape(batch, num_heads, q_len, acc.shape[-1])
    return out.to(query.dtype)


# ------------------------------------------------------------------------------------------------------ the cache

class SpillingLayer(DynamicLayer):
    """One layer's KV: host pages of the oldest positions, then the device part (`keys`/`values`, what
    DynamicLayer holds). After every update the device part holds at most max(cap, page_tokens - 1) tokens,
    where cap is the number of tokens that fit in `budget_bytes`."""

    is_croppable = False  # pages are not taken back

    def __init__(self, budget_bytes: int, page_tokens: int, host_device: torch.device):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.page_tokens = page_tokens
        self.host_device = host_device
        self.pages: list[tuple[torch.Tensor, torch.Tensor]] = []  # host; page j: positions [j*P, (j+1)*P)

    @property
    def spilled_tokens(self) -> int:
        return len(self.pages) * self.page_tokens

    def update(self, key_states, value_states, *args, **kwargs):
        super().update(key_states, value_states)
        self._spill_over_budget()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.spilled_tokens + super().get_seq_length()

    def reset(self) -> None:
        self.pages = []
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a SpillingCache cannot be cropped (its pages are not taken back)")

    def blocks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(start, k, v) for every page, then the device part: the whole context in position order."""
        for j, (k, v) in enumerate(self.pages):
            yield j * self.page_tokens, k, v
        yield self.spilled_tokens, self.keys, self.values

    def device_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes if self.is_initialized else 0

    def host_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.pages)

    def _spill_over_budget(self) -> None:
        device_tokens = self.keys.shape[2]
        bytes_per_token = (self.keys.nbytes + self.values.nbytes) // max(device_tokens, 1)
        cap = self.budget_bytes // max(bytes_per_token, 1)
        if device_tokens <= cap:
            return
        size = self.page_tokens
        num_pages = min(-(-(device_tokens - cap) // size), device_tokens // size)
        if num_pages == 0:
            return
        for j in range(num_pages):
            self.pages.append((_to_host(self.keys[:, :, j * size:(j + 1) * size], self.host_device),
                               _to_host(self.values[:, :, j * size:(j + 1) * size], self.host_device)))
        # A copy, not a view: a view would keep the whole old tensor (the spilled part too) on the device.
        self.keys = self.keys[:, :, num_pages * size:].clone()
        self.values = self.values[:, :, num_pages * size:].clone()


def _to_host(t: torch.Tensor, host_device: torch.device) -> torch.Tensor:
    """An independent copy of `t` on the host; pinned when it comes from a GPU, so pages go back asynchronously."""
    pin = t.device.type == "cuda" and host_device.type == "cpu"
    page = torch.empty(t.shape, dtype=t.dtype, device=host_device, pin_memory=pin)
    page.copy_(t)  # synchronous: the device tensor is freed right after
    return page


class SpillingCache(DynamicCache):
    """A DynamicCache with a device byte budget for its KV, counted over all layers (each layer gets an equal
    share). Forward passes over it, and any update once it has spilled, run inside `with spilling(cache):`."""

    def __init__(self, num_layers: int, device_budget_bytes: int, page_tokens: int = PAGE_TOKENS,
                 host_device: str | torch.device = "cpu", attn_implementation: str = "sdpa"):
        if device_budget_bytes <= 0:
            raise ValueError(f"device_budget_bytes must be positive, got {device_budget_bytes}")
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        host_device = torch.device(host_device)
        layer_budget = device_budget_bytes // num_layers
        Cache.__init__(self, layers=[SpillingLayer(layer_budget, page_tokens, host_device)
                                     for _ in range(num_layers)])
        self.device_budget_bytes = device_budget_bytes
        self.page_tokens = page_tokens
        self.attn_implementation = attn_implementation

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # Outside `spilling`, the model's own attention would see the device part only: silently wrong outputs.
        # Checked before (nothing changes) and after (this update spilled the first page).
        self._check_active(layer_idx)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._check_active(layer_idx)
        return keys, values

    def _check_active(self, layer_idx: int) -> None:
        if layer_idx < len(self.layers) and self.layers[layer_idx].pages and self not in _active_caches():
            raise RuntimeError("a SpillingCache that has spilled must be used inside `with spilling(cache):`")

    @property
    def spilled_tokens(self) -> int:
        """Leading positions whose KV is on the host (the same in every layer once a forward pass is done)."""
        return max((layer.spilled_tokens for layer in self.layers), default=0)

    @property
    def num_pages_spilled(self) -> int:
        return sum(len(layer.pages) for layer in self.layers)

    @property
    def device_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)

    @property
    def host_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.layers)


def spill_stats(cache: Cache) -> dict[str, int]:
    """The spilling counters of any cache (zeros, and device_bytes 0, for a plain DynamicCache), for Stats."""
    if not isinstance(cache, SpillingCache):
        return {"spilled_tokens": 0, "num_pages_spilled": 0, "device_bytes": 0, "host_bytes": 0}
    return {"spilled_tokens": cache.spilled_tokens, "num_pages_spilled": cache.num_pages_spilled,
            "device_bytes": cache.device_bytes, "host_bytes": cache.host_bytes}


def kv_range(cache: Cache, start: int, end: int) -> KV:
    """An independent copy of positions [start, end) of every layer, on the layer's device, whether those
    positions were spilled or not (plain DynamicCaches too): per layer (k, v), each [1, H_kv, end - start, D]."""
    length = cache.get_seq_length()
    if not 0 <= start <= end <= length:
        raise ValueError(f"range [{start}, {end}) is not inside the cache's {length} positions")
    out = []
    for layer in cache.layers:
        blocks = layer.blocks() if isinstance(layer, SpillingLayer) else [(0, layer.keys, layer.values)]
        pieces = [(k[:, :, max(start - s, 0):end - s], v[:, :, max(start - s, 0):end - s])
                  for s, k, v in blocks if s < end and s + k.shape[2] > start]
        pieces = pieces or [(layer.keys[:, :, :0], layer.values[:, :, :0])]  # an empty range
        device = layer.keys.device
        # torch.cat always allocates: the result never aliases a page or the device part.
        out.append((torch.cat([k.to(device) for k, _ in pieces], dim=2),
                    torch.cat([v.to(device) for _, v in pieces], dim=2)))
    return tuple(out)


# ----------------------------------------------------------------------------------------- what can be paged

def spill_unsupported(model) -> str | None:
    """Why the paged attention would not be exact for `model`, or None when it is: every layer full causal
    attention with Llama-style modules (RoPE'd keys from the cache straight into the registered attention
    function, GQA by num_key_value_groups, module.scaling), no softcapping, no sinks."""
    config = model.config.get_text_config(decoder=True)
    name = getattr(config, "model_type", type(model).__name__)
    layer_types, _ = get_layer_types_and_kwargs(config)
    other = sorted(set(layer_types) - {"full_attention"})
    if other:
        return f"{name} has {', '.join(other)} layers (sliding-window/chunked/linear attention); only full " \
               f"attention can spill to host memory"
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"{name} caps attention logits (attn_logit_softcapping={softcap}); paged attention does not"
    impl = model.config._attn_implementation
    if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
        return f"{name} uses attention implementation {impl!r}, which is not in transformers' attention registry"
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        return f"{name} is not a Llama-style decoder (no .layers); paged attention does not know its attention"
    for index, decoder_layer in enumerate(layers):
        attn = getattr(decoder_layer, "self_attn", None)
        missing = [a for a in ("layer_idx", "num_key_value_groups", "scaling") if not hasattr(attn, a)]
        if attn is None or missing:
            return f"{name} layer {index} has no Llama-style self_attn (missing {missing or ['self_attn']})"
        if hasattr(attn, "sinks"):
            return f"{name} layer {index} has attention sinks; paged attention does not"
        if not getattr(attn, "is_causal", True):
            return f"{name} layer {index} is not causal"
        module = sys.modules[type(attn).__module__]
        if getattr(module, "ALL_ATTENTION_FUNCTIONS", None) is not ALL_ATTENTION_FUNCTIONS:
            return f"{name} layer {index} does not look its attention up in transformers' shared registry"
        if impl == "eager" and not hasattr(module, "eager_attention_forward"):
            return f"{name} has no module-level eager_attention_forward to fall back to"
    return None


def make_cache(model, device_budget_bytes: int | None, page_tokens: int = PAGE_TOKENS,
               host_device: str | torch.device = "cpu") -> DynamicCache:
    """A GrowingCache (a DynamicCache that grows in blocks) without a budget, else a SpillingCache for `model`
    (ValueError, with the reason,
    for a model whose attention cannot be paged exactly)."""
    if device_budget_bytes is None:
        return GrowingCache()
    reason = spill_unsupported(model)
    if reason is not None:
        raise ValueError(f"cannot spill the KV cache to host memory: {reason}")
    config = model.config.get_text_config(decoder=True)
    return SpillingCache(config.num_hidden_layers, device_budget_bytes, page_tokens, host_device,
                         model.config._attn_implementation)


# ------------------------------------------------------------------------------- hooking the attention registry

_local = threading.local()  # .caches: the SpillingCaches active on this thread
_hook_lock = threading.Lock()
_hooks: dict[str, list] = {}  # attention implementation -> [number of active `spilling` blocks, registered before]


def _active_caches() -> list[SpillingCache]:
    if not hasattr(_local, "caches"):
        _local.caches = []
    return _local.caches


@contextmanager
def spilling(cache: Cache):
    """Makes `cache` active on this thread so that attention over its spilled layers is paged. A no-op for any
    cache that is not a SpillingCache, so callers can wrap every forward pass unconditionally."""
    if not isinstance(cache, SpillingCache):
        yield cache
        return
    _install(cache.attn_implementation)
    caches = _active_caches()
    caches.append(cache)
    try:
        yield cache
    finally:
        caches.remove(cache)
        _uninstall(cache.attn_implementation)


def _install(impl: str) -> None:
    with _hook_lock:
        if impl in _hooks:
            _hooks[impl][0] += 1
            return
        registered = ALL_ATTENTION_FUNCTIONS.get(impl)  # None for "eager": models then use their own module's
        ALL_ATTENTION_FUNCTIONS[impl] = _dispatcher(registered)  # the shared instance's local override
        _hooks[impl] = [1, registered]


def _uninstall(impl: str) -> None:
    with _hook_lock:
        _hooks[impl][0] -= 1
        if _hooks[impl][0]:
            return
        registered = _hooks.pop(impl)[1]
        del ALL_ATTENTION_FUNCTIONS[impl]  # drops our override: the global registration shows through again
        if ALL_ATTENTION_FUNCTIONS.get(impl) is not registered:  # there was a local override before ours
            ALL_ATTENTION_FUNCTIONS[impl] = registered


def _dispatcher(registered):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        layer = _spilled_layer(module, key)
        if layer is None:
            fallback = registered or sys.modules[type(module).__module__].eager_attention_forward
            return fallback(module, query, key, value, attention_mask, *args, **kwargs)
        return _paged_attention(module, query, layer, kwargs)

    return attention


def _spilled_layer(module, key: torch.Tensor) -> SpillingLayer | None:
    """The layer with pages whose device part is `key` (the tensor its update just returned), among the caches
    active on this thread; None for any other attention call."""
    index = getattr(module, "layer_idx", None)
    for cache in _active_caches():
        if index is not None and index < len(cache.layers):
            layer = cache.layers[index]
            if layer.keys is key:
                return layer if layer.pages else None
    return None


def _paged_attention(module, query: torch.Tensor, layer: SpillingLayer, kwargs: dict):
    """What the registered function returns, (output [B, q, H, Dv], None), computed over pages + device part.
    The causal mask comes from absolute positions (batch 1, no padding), not from `attention_mask`."""
    bad = [k for k in _UNPAGEABLE_KWARGS if kwargs.get(k) is not None]
    if bad or module.training or query.shape[0] != 1:
        raise ValueError(f"paged attention is exact for eval, batch 1, plain causal attention only; got "
                         f"{bad or ''} training={module.training} batch={query.shape[0]}")
    scaling = kwargs.get("scaling")
    scaling = module.scaling if scaling is None else scaling
    q_len = query.shape[2]
    assert query.shape[1] == layer.keys.shape[1] * module.num_key_value_groups, "GQA groups as the module says"
    # A model on exact attention (engine.exact_attention) gets it here too: its paged and unpaged forwards then
    # differ by float64 roundings only, so spilling changes no answer of a bfloat16-kernel model.
    # Under ROWS the pages and the device part are joined and attended in one pass of the same kernel, which
    # gives each row what the unpaged call gives it, bit for bit.
    config = getattr(module, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == ROWS:
        blocks = list(layer.blocks())
        key = torch.cat([k.to(query.device) for _, k, _ in blocks], dim=2)
        value = torch.cat([v.to(query.device) for _, _, v in blocks], dim=2)
        return rows(query, key, value, None, True, scaling).to(query.dtype), None
    out = attend_blocks(query, layer.blocks(), layer.get_seq_length() - q_len, scaling,
                        work=torch.float64 if implementation == ATTENTION else None)
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------- attention one query at a time (drafts)

@contextmanager
def rowwise_attention(model):
    """Within the block, attention over several new positions runs one query position at a time, each over the
    keys up to it, through the same registered function and arguments a one-token decode step uses: so a
    forward that checks drafted tokens computes, for every position, the attention a decode step would (the
    rest of a decoder layer is per position already). With bfloat16 int4 kernels the difference matters: the
    ~1e-6 float32 differences between attention shapes flip bfloat16 roundings and grow over the layers to
    changed greedy tokens. Only for models whose attention can be paged (the caller checks that
    spill_unsupported(model) is None: full causal attention through the registry)."""
    impl = model.config._attn_implementation
    registered = ALL_ATTENTION_FUNCTIONS.get(impl)
    if registered is None:  # "eager": the model's own module function, which has no registry entry to wrap
        yield
        return

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]  # query [B, H, q, D]; key/value [B, H_kv, kv, D]
        if q_len == 1:
            return registered(module, query, key, value, attention_mask, *args, **kwargs)
        rows = []
        for i in range(q_len):
            end = kv_len - q_len + 1 + i
            row, _ = registered(module, query[:, :, i:i + 1], key[:, :, :end], value[:, :, :end], None, *args,
                                **kwargs)
            rows.append(row)  # [B, 1, H, D]
        return torch.cat(rows, dim=1), None

    with _hook_lock:
        previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(impl)  # an override already there (put back after)
        ALL_ATTENTION_FUNCTIONS[impl] = attention
    try:
        yield
    finally:
        with _hook_lock:
            del ALL_ATTENTION_FUNCTIONS[impl]
            if previous is not None:
                ALL_ATTENTION_FUNCTIONS[impl] = previous


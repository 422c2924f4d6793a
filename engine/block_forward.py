"""A Llama-family model over GGUF blocks, all its layers in one call of C (engine/block_forward.c).

transformers' forward runs ~40 PyTorch operations and a dozen module calls per layer; on a small model at decode
that overhead takes longer than the arithmetic (the embedded 135M model: ~16 ms of a 30 ms step on a 2-core
AVX2 machine, against llama.cpp's whole 10 ms step). Where every linear of every layer is a BlockLinear
(engine.weights.gguf_blocks), attention is ROWS (engine.exact_attention) and the cache is a GrowingCache,
`use_block_forward` routes a forward over input ids into `kvb_decoder_packed`, which runs the layers, writes the
cache and returns the last hidden states; the embedding, the final norm and the head stay the model's own modules.
A batch of requests (engine.batching) runs through the same call: their rows packed one after the other, each
request's attention over its own cache (`OneCallForward.packed`), every other step per row.

The two ways give the same bits: the model's RMS norms and SiLU become RowNorm and RowSiLU, which call the C
functions the one-call forward calls, the linears and attention are the same kernels, and the rest (rotary
embedding, residual adds, the SiLU gate's product, biases) are elementwise float operations done in PyTorch's
order (tested: logits and cache equal bit for bit, prefill and decode). So routing is a speed choice only:
calls the one-call forward does not take (masks, position ids, batches, other caches: engine.batching, the
CacheBlend pass, spilling caches) fall back to transformers' forward and still compute the same numbers.
"""

from __future__ import annotations

import ctypes
import operator
import threading
import weakref

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .exact_attention import ROWS
from .live_cache import GrowingCache, GrowingLayer
from .rotary_table import RotaryTable
from .shared_beginnings import SharedBeginnings
from .weights import gguf_blocks
from .weights.gguf_blocks import BlockLinear

ARCHITECTURES = ("llama", "qwen2", "mistral")
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
MAX_HEAD_DIM = 512


class RowNorm(nn.Module):
    """RMS norm by the C kernel (kvb_rmsnorm): each row's sum of squares in a fixed order, so a row's result is
    the same in any forward; float32 in, float32 out (other dtypes through float32)."""

    own_rounding = True  # not transformers' rounding: part of the model's fingerprint (engine.weights.fingerprint)

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).contiguous(), requires_grad=False)
        self.variance_epsilon = float(eps)
        self.hidden_size = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size or x.device.type != "cpu":
            raise ValueError(f"a norm of {self.hidden_size} features on the CPU got {list(x.shape)} on {x.device}")
        rows = x.reshape(-1, self.hidden_size).to(torch.float32).contiguous()
        out = torch.empty_like(rows)
        gguf_blocks.library().kvb_rmsnorm(rows.data_ptr(), self.weight.data_ptr(), rows.shape[0], self.hidden_size,
                                          ctypes.c_float(self.variance_epsilon), out.data_ptr())
        return out.reshape(x.shape).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class RowSiLU(nn.Module):
    """x / (1 + exp(-x)) by the C kernel (kvb_silu), the function the one-call forward uses."""

    own_rounding = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise ValueError(f"RowSiLU runs on the CPU, not on {x.device}")
        flat = x.to(torch.float32).contiguous()
        out = torch.empty_like(flat)
        gguf_blocks.library().kvb_silu(flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.to(x.dtype)


class _Weight(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64), ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                *[(name, _Weight) for _, name in PROJECTIONS]]


class _Cache(ctypes.Structure):  # one request's buffers in one layer
    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("head_stride", ctypes.c_int64)]


def _config(model):
    return model.config.get_text_config()


def _norm(module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a plain RMS norm (weight times x / rms, no offset), or None."""
    if isinstance(module, RowNorm):
        return module.weight, module.variance_epsilon
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__ not in ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm") or weight is None \
            or eps is None or weight.dim() != 1:
        return None
    return weight, eps


def unsupported(model) -> str | None:
    """Why the one-call forward cannot run `model`, or None."""
    cfg = _config(model)
    if cfg.model_type not in ARCHITECTURES:
        return f"a {cfg.model_type} model (the one-call forward runs {', '.join(ARCHITECTURES)})"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)}"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp > 1"
    if getattr(cfg, "sliding_window", None) is not None and \
            (cfg.model_type != "qwen2" or getattr(cfg, "use_sliding_window", False)):
        return "sliding-window attention"
    if any(kind != "full_attention" for kind in (getattr(cfg, "layer_types", None) or ())):
        return "layers that are not full attention"
    if model.config._attn_implementation != ROWS:
        return f"attention {model.config._attn_implementation} (the one-call forward computes {ROWS})"
    why = gguf_blocks.unavailable("cpu")
    if why is not None:
        return why
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(inner, "rotary_emb", None) is None or _norm(getattr(inner, "norm", None)) is None:
        return "not a Llama-shaped module tree"
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for layer in layers:
        if layer._forward_pre_hooks or layer._forward_hooks:  # layer streaming swaps a layer's bytes in its hooks
            return "decoder layers with forward hooks (layer streaming)"
        attention = layer.self_attn
        head_dim = getattr(attention, "head_dim", 0)
        if not 0 < head_dim <= MAX_HEAD_DIM or head_dim % 2 or heads % kv_heads:
            return f"head size {head_dim}"
        norms = [_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm), _norm(inner.norm)]
        if any(n is None for n in norms):
            return f"norms of type {type(layer.input_layernorm).__name__}"
        if len({float(eps) for _, eps in norms}) != 1:
            return "norms with different epsilons"
        if getattr(attention, "scaling", None) != layers[0].self_attn.scaling:
            return "attention scales that differ between layers"
        if getattr(attention, "q_norm", None) is not None or getattr(attention, "k_norm", None) is not None:
            return "query/key norms"
        for part, name in PROJECTIONS:
            linear = getattr(getattr(layer, part), name, None)
            if not isinstance(linear, BlockLinear) or linear.blocks.device.type != "cpu":
                return f"{part}.{name} is {type(linear).__name__}, not GGUF blocks"
            if linear.bias is not None and (linear.bias.dtype != torch.float32 or not linear.bias.is_contiguous()):
                return f"a {linear.bias.dtype} bias"
        shapes = {name: (getattr(getattr(layer, part), name).out_features,
                         getattr(getattr(layer, part), name).in_features) for part, name in PROJECTIONS}
        hidden, inter = cfg.hidden_size, shapes["gate_proj"][0]
        expected = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
                    "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
                    "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        if shapes != expected:
            return f"projection shapes {shapes}"
    return None


# Every module, parameter and buffer assigned to a module anywhere in the process (Module.__setattr__ and the
# register_* calls, through torch's global registration hooks) counts here: while the count stands, no module the
# one-call forward reads from was replaced that way, and a forward checks only what such assignments do not show
# (tensors written into a module's dicts directly, as Module._apply does, and a bias held as a plain attribute).
# Checking all ~1000 places before every forward was ~5% of a one-stream decode step (py-spy): read right after
# the layers' call has streamed the weights through the caches, each one is a miss.
_registrations = [0]
_hooks_lock = threading.Lock()
_hooks: list = []


def _count_registration(module, name, value) -> None:
    _registrations[0] += 1


def _watch_registrations() -> None:
    with _hooks_lock:
        if not _hooks:
            from torch.nn.modules import module as torch_module

            _hooks.extend(register(_count_registration) for register in (
                torch_module.register_module_module_registration_hook,
                torch_module.register_module_parameter_registration_hook,
                torch_module.register_module_buffer_registration_hook))


def use_block_forward(model) -> bool:
    """Makes `model`'s norms RowNorm and its SiLU RowSiLU, and routes its forwards over input ids into the
    one-call forward where it can take them (see the module's docstring); False (the model unchanged) where
    unsupported(model) says why not."""
    if isinstance(getattr(model, "forward", None), OneCallForward):
        return True
    if unsupported(model) is not None:
        return False
    inner = model.model
    for layer in inner.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, RowNorm(*_norm(getattr(layer, name))))
        layer.mlp.act_fn = RowSiLU()
    inner.norm = RowNorm(*_norm(inner.norm))
    _watch_registrations()
    model.forward = OneCallForward(model, model.forward)
    return True


def uses_block_forward(model) -> bool:
    return isinstance(getattr(model, "forward", None), OneCallForward)


class OneCallForward:
    """`model.forward` for use_block_forward: the one-call forward for a plain forward over input ids and a
    GrowingCache, the model's own forward for every other call."""

    def __init__(self, model, original):
        self.model, self.original = model, original
        self._layers = None  # ctypes array of _Layer, built on first use
        # with it: (hidden size, heads, kv heads, head size, intermediate size, the first layer's attention module)
        self._shape: tuple | None = None
        self._modules: tuple = ()  # what the array points into: rebuilt when any of them changed
        self._places: tuple = ()  # where each of those was read: (mapping, key)
        # those a registration hook does not see replaced: their mappings, keys and objects, three tuples
        self._unhooked: tuple = ((), (), ())
        self._registrations = -1  # _registrations when the places were last found to hold what the array read
        self.one_call_forwards = 0  # forwards the one-call path ran (for tests and stats)
        # a cache -> (its layers' generations, the C call's entries for their buffers); gone with the cache
        self._buffer_arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._shared = SharedBeginnings()  # where requests of a step begin alike

    def __deepcopy__(self, memo):  # a copied model gets its own arrays (they point into its own tensors)
        import copy

        return OneCallForward(copy.deepcopy(self.model, memo), copy.deepcopy(self.original, memo))

    def _takes(self, input_ids, past_key_values, kwargs) -> bool:
        if kwargs.get("attention_mask") is not None or kwargs.get("position_ids") is not None or \
                kwargs.get("inputs_embeds") is not None or kwargs.get("labels") is not None or \
                kwargs.get("use_cache") is False or kwargs.get("output_attentions") or \
                kwargs.get("output_hidden_states") or torch.is_grad_enabled():
            return False
        if set(kwargs) - {"attention_mask", "position_ids", "inputs_embeds", "labels", "use_cache",
                          "output_attentions", "output_hidden_states", "logits_to_keep", "return_dict"}:
            return False
        if not isinstance(kwargs.get("logits_to_keep", 0), int) or kwargs.get("return_dict") is False:
            return False
        if not _growing(past_key_values):
            return False
        return (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] == 1 and
                input_ids.shape[1] > 0 and input_ids.device.type == "cpu" and
                input_ids.dtype in (torch.long, torch.int32) and self.model.config._attn_implementation == ROWS)

    def __call__(self, input_ids=None, past_key_values=None, **kwargs):
        if not self._takes(input_ids, past_key_values, kwargs):
            return self.original(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
        return self._one_call(input_ids, past_key_values, kwargs.get("logits_to_keep", 0))

    def _current_modules(self) -> tuple[tuple, tuple, tuple]:
        """Every module and tensor the layer array points into, where each was read ((mapping, key) pairs, a
        parent's before its children's), and which of those places a registration hook does not see written (a
        buffer replaced by Module._apply, a bias that is a plain attribute). Read through the modules' own dicts,
        not Module.__getattr__ (~700 names)."""
        places, unhooked = [], []

        def read(mapping, key, hooked=True):
            if not hooked:
                unhooked.append(len(places))
            places.append((mapping, key))
            return mapping.get(key)

        layers = read(read(self.model._modules, "model")._modules, "layers")
        for index in list(layers._modules):
            layer = read(layers._modules, index)
            read(layer._modules, "input_layernorm")
            read(layer._modules, "post_attention_layernorm")
            for part, name in PROJECTIONS:
                linear = read(read(layer._modules, part)._modules, name)
                read(linear._buffers, "blocks", hooked=False)
                read(linear._parameters, "bias")
                read(linear.__dict__, "bias", hooked=False)
        return tuple(places), tuple(mapping.get(key) for mapping, key in places), tuple(unhooked)

    def _still_converted(self) -> bool:
        """Whether the norms and SiLU are still the ones use_block_forward put in (the C path computes theirs)."""
        inner = self.model.model
        return isinstance(inner.norm, RowNorm) and all(
            isinstance(layer.input_layernorm, RowNorm) and isinstance(layer.post_attention_layernorm, RowNorm)
            and isinstance(layer.mlp.act_fn, RowSiLU) for layer in inner.layers)

    def _build(self, modules: tuple) -> None:
        layers = self.model.model.layers
        cfg, attention = _config(self.model), layers[0].self_attn
        self._shape = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, attention.head_dim,
                       layers[0].mlp.gate_proj.out_features, attention)
        array = (_Layer * len(layers))()
        for i, layer in enumerate(layers):
            entry = array[i]
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            for part, name in PROJECTIONS:
                linear = getattr(getattr(layer, part), name)
                weight = getattr(entry, name)
                weight.type = linear.type_id
                weight.n, weight.k = linear.out_features, linear.in_features
                weight.row_bytes = linear.blocks.shape[1]
                weight.w = linear.blocks.data_ptr()
                weight.bias = None if linear.bias is None else linear.bias.data_ptr()
        self._layers, self._modules = array, modules

    def _ready(self) -> bool:
        """The layer array points at the model's current modules (rebuilt when one changed); False when the model no
        longer has what the one-call forward computes. Before every forward: where nothing was assigned to any
        module since the last check (_registrations), only the tensors an assignment would not show; otherwise
        every place the array's modules were read from (the parents first, so a replaced parent shows)."""
        registrations = _registrations[0]
        if registrations == self._registrations and \
                all(map(operator.is_, map(dict.get, *self._unhooked[:2]), self._unhooked[2])):
            return True
        if not self._still_converted():
            return False
        places, held = self._places, self._modules
        if not (places and all(map(operator.is_, [mapping.get(key) for mapping, key in places], held))
                and len(held[1]._modules) == len(self._layers)):  # held[1]: the layers' list (no layer added)
            places, modules, unhooked = self._current_modules()
            if unsupported(self.model) is not None:
                return False
            self._build(modules)
            self._places = places
            self._unhooked = (tuple(places[i][0] for i in unhooked), tuple(places[i][1] for i in unhooked),
                              tuple(modules[i] for i in unhooked))
        self._registrations = registrations
        return True

    def _one_call(self, input_ids: torch.Tensor, cache: GrowingCache, logits_to_keep: int):
        hidden = self._layers_over(input_ids.reshape(-1), [(cache, input_ids.shape[1])]) if self._ready() else None
        if hidden is None:
            return self.original(input_ids=input_ids, past_key_values=cache, use_cache=True,
                                 logits_to_keep=logits_to_keep)
        kept = hidden if not logits_to_keep else hidden[-logits_to_keep:]
        logits = self.model.lm_head(self.model.model.norm(kept))
        return CausalLMOutputWithPast(logits=logits[None], past_key_values=cache)

    def layers_only(self, input_ids: torch.Tensor, cache) -> bool:
        """Feeds `input_ids` [1, n] over `cache` through the layers in one call, no head (a prefill piece before
        the last); False (nothing computed) where the one-call forward does not take the call."""
        if not self._takes(input_ids, cache, {}) or not self._ready():
            return False
        return self._layers_over(input_ids.reshape(-1), [(cache, input_ids.shape[1])]) is not None

    def packed(self, tokens: list[list[int]], caches: list, keeps: list[int | None] | None = None
               ) -> list[torch.Tensor | None] | None:
        """Several requests' tokens, each fed over its own cache (positions from its length; a request's tokens
        attend to each other causally) in one call: each one's logits [len, V], or of its last `keeps[i]` tokens
        only (None for 0: no head for it). None (nothing computed) where the one-call forward cannot take them,
        for the caller's other path."""
        if torch.is_grad_enabled() or self.model.config._attn_implementation != ROWS or not caches or \
                not all(_growing(c) for c in caches) or any(not t for t in tokens) or not self._ready():
            return None
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long)
        hidden = self._layers_over(ids, [(cache, len(ts)) for ts, cache in zip(tokens, caches)])
        if hidden is None:
            return None
        keeps = keeps or [None] * len(tokens)
        rows, counts, start = [], [], 0
        for ts, keep in zip(tokens, keeps):
            kept = len(ts) if keep is None else min(keep, len(ts))
            rows += range(start + len(ts) - kept, start + len(ts))
            counts.append(kept)
            start += len(ts)
        kept_hidden = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, dtype=torch.long)]
        logits = self.model.lm_head(self.model.model.norm(kept_hidden)) if rows else None
        out, at = [], 0
        for count in counts:
            out.append(logits[at:at + count] if count else None)
            at += count
        return out

    def _layers_over(self, ids: torch.Tensor, segments: list[tuple[GrowingCache, int]]) -> torch.Tensor | None:
        """The last layer's hidden states [rows, hidden] of `ids` (the segments' rows one after the other), their
        keys and values written into each segment's cache; None (the caches as they were) where the rotary table
        does not match the heads."""
        inner, (hidden_size, heads, kv_heads, head_dim, inter, attention) = self.model.model, self._shape
        m = ids.shape[0]
        starts = [cache.layers[0].get_seq_length() if cache.layers else 0 for cache, _ in segments]
        hidden = inner.embed_tokens(ids[None]).to(torch.float32).reshape(m, hidden_size).contiguous()
        cos, sin = _rotary(inner, hidden, [p for (_, rows), start in zip(segments, starts)
                                           for p in range(start, start + rows)])
        if cos.shape[1] != head_dim:
            return None
        n_layers = len(self._layers)
        buffers = (_Cache * (len(segments) * n_layers))()
        like = torch.empty(1, kv_heads, 0, head_dim, dtype=torch.float32)
        arrays = []
        for s, (cache, rows) in enumerate(segments):
            # the buffers grown by `rows` positions, whose real values the C call writes
            arrays.append(self._grown(cache, n_layers, rows, like))
            ctypes.memmove(ctypes.addressof(buffers) + s * n_layers * ctypes.sizeof(_Cache),
                           ctypes.addressof(arrays[-1]), n_layers * ctypes.sizeof(_Cache))
        rows = (ctypes.c_int64 * len(segments))(*[r for _, r in segments])
        first = (ctypes.c_int64 * len(segments))(*starts)
        lead, shared = self._leads([cache for cache, _ in segments], starts, n_layers, arrays)
        status = gguf_blocks.library().kvb_decoder_packed(
            ctypes.addressof(self._layers), n_layers, ctypes.addressof(buffers), len(segments),
            ctypes.addressof(rows), ctypes.addressof(first), hidden.data_ptr(), m, hidden_size,
            heads, kv_heads, head_dim, inter, cos.data_ptr(), sin.data_ptr(),
            ctypes.c_float(inner.norm.variance_epsilon), ctypes.c_float(attention.scaling),
            max(1, torch.get_num_threads()), None if lead is None else ctypes.addressof(lead),
            None if shared is None else ctypes.addressof(shared))
        if status != 0:
            for (cache, _), start in zip(segments, starts):  # the positions were not computed: give them back
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, :start], layer.values[:, :, :start]
            raise MemoryError("no scratch memory for the forward") if status == -2 else \
                RuntimeError(f"the one-call forward failed ({status})")
        self.one_call_forwards += 1
        return hidden

    def _leads(self, caches: list[GrowingCache], starts: list[int], n_layers: int, arrays: list | None = None
               ) -> tuple:
        """(lead, shared) for the C call: where requests of the step begin alike (engine.shared_beginnings).
        `arrays`: each cache's buffers as the C call takes them (None: found here)."""
        if arrays is None:
            arrays = [self._grown(c, n_layers, 0, c.layers[0].keys[:, :, :0]) for c in caches]
        return self._shared.leads(caches, starts, n_layers, arrays)

    @property
    def shared_forwards(self) -> int:
        """Forwards where a request read its beginning in another's cache."""
        return self._shared.forwards

    def _grown(self, cache: GrowingCache, n_layers: int, rows: int, like: torch.Tensor) -> ctypes.Array:
        """`cache`'s first `n_layers` layers grown by `rows` positions: their buffers as the C call takes them. The
        array is kept for the cache while its layers' generations stay the same (a decode step only counts its
        positions then: making 30 layers' entries for every request of a batched step was ~5% of its time)."""
        known = self._buffer_arrays.get(cache)
        if known is not None and known[0] == cache.generations(n_layers) and cache.advance(n_layers, rows):
            return known[1]
        array = (_Cache * n_layers)(*[_Cache(keys.data_ptr(), values.data_ptr(), keys.stride(1))
                                      for keys, values in cache.reserve(n_layers, rows, like)])
        self._buffer_arrays[cache] = (cache.generations(n_layers), array)
        return array


def _growing(cache) -> bool:
    return type(cache) is GrowingCache and set(map(type, cache.layers)) <= {GrowingLayer}


def _rotary(inner, hidden: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), head size] float32 at `positions`: the rows of the rotary module's table where it
    looks them up (engine.rotary_table, without a tensor of positions to reduce), else what its forward returns;
    the same bits either way."""
    table = inner.rotary_emb.__dict__.get("forward")
    found = table.rows(positions) if isinstance(table, RotaryTable) else None
    if found is not None:
        return found
    m = len(positions)
    cos, sin = inner.rotary_emb(hidden[None], position_ids=torch.tensor([positions], dtype=torch.int64))
    return cos.reshape(m, -1).to(torch.float32).contiguous(), sin.reshape(m, -1).to(torch.float32).contiguous()

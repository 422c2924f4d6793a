"""A decode step captured once as a CUDA graph and replayed: one token over a GrowingCache, without the host.

On a GPU a decode step of transformers' forward is ~900 small kernels, each launched from Python (~15-25 us of
host time apiece), while the card needs ~3 us for most of them: the engine decoded a 7B-shaped int4 model at 5% of
the card's bandwidth limit, host-bound (docs/benchmarks.md, "On a GPU"). A CUDA graph records the step's
kernels once and replays them with one launch.

A graph replays fixed addresses and shapes, so the step is written for that: the token and its position are
written into two small device tensors the graph reads; each layer's new key and value are written into the live
cache's own block buffer (engine.live_cache.GrowingLayer) at that position (`index_copy_`), and attention runs
over the whole buffer, the positions past the new token masked out. (Masked positions still meet the values
in the product with the attention weights, 0 x value: the step zeroes the room past the filled part once per
set of buffers, since the cache leaves it uninitialised.)
A graph therefore belongs to one set of buffers: it is captured again when the cache grows into new ones (every
BLOCK_TOKENS tokens) or a new request brings its own. Afterwards the layers' `keys` / `values` views are moved
one position on, so everything else (the store, crop, a drafted forward through transformers) sees the cache it
always has.

The step computes what transformers' forward computes for a Llama-family decoder (the model's own modules for the
embedding, norms, linears, MLP, rotary table and head; attention by scaled_dot_product_attention), but not in the
same kernels: its logits match the eager step's to the rounding of the model's dtype, not bit for bit. Every
one-token decode step of an engine takes the same path, reused prompt or not, so reuse still changes no answer.
Calls it does not take (several tokens, a cache that spills, a model under layer streaming) run as before.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .live_cache import GrowingCache, GrowingLayer

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # frequencies fixed at load (no per-call update to capture)


def graph_decode_unavailable(model, *, enabled: bool = True, streaming: bool = False,
                             spilling: bool = False) -> str | None:
    """Why a decode step of `model` cannot be captured as a CUDA graph, or None when it can. `enabled`: the
    engine's cuda_graphs option; `streaming`: layer streaming moves its weights between steps; `spilling`: its live
    KV pages out to host memory (live_kv_bytes)."""
    if not enabled:
        return "cuda_graphs=False"
    if streaming:
        return "layer streaming moves the weights between steps"
    if spilling:
        return "the live KV spills to host memory (live_kv_bytes)"
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {MODEL_TYPES}"
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(decoder, name) for name in ("embed_tokens", "norm", "rotary_emb")):
        return f"{type(model).__name__} is not laid out as model.layers / embed_tokens / norm / rotary_emb"
    rope_type = getattr(decoder.rotary_emb, "rope_type", None)
    if rope_type not in ROPE_TYPES:
        return f"rotary type {rope_type!r} updates its frequencies per call"
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"the model must sit whole on one CUDA device, not on {sorted(map(str, devices))}"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "the model's modules are hooked (offloading moves weights between steps)"
    return None


class GraphDecode:
    """The one-token decode step of `model` (graph_decode_unavailable(model) is None), replayed from a CUDA graph.
    `capture=False` runs the same step eagerly (on any device): the arithmetic without the graph, for tests."""

    def __init__(self, model, *, capture: bool = True):
        self.model = model
        self.decoder = model.model
        self.capture = capture
        self.config = model.config.get_text_config(decoder=True)
        self.head_dim = self.decoder.layers[0].self_attn.head_dim
        self.dtype = self.decoder.embed_tokens.weight.dtype
        device = self.decoder.embed_tokens.weight.device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)  # what the graph reads: the token ...
        self.position = torch.zeros(1, 1, dtype=torch.long, device=device)  # ... and the position it is written at
        self._graph = None
        self._graph_buffers: tuple = ()  # the buffers the graph was captured over
        self._cleared_buffers: tuple = ()  # the buffers whose unfilled room was zeroed (held: never recycled)
        self._logits: torch.Tensor | None = None  # [1, 1, V], the graph's output (overwritten by each replay)
        self.captures = 0  # graphs captured so far (one per set of buffers) ...
        self.capture_s = 0.0  # ... and the host time they took, warm-up runs included

    def usable(self, cache) -> list[GrowingLayer] | None:
        """The cache's layers when this step can extend them by one token, else None."""
        if not isinstance(cache, GrowingCache) or len(cache.layers) != len(self.decoder.layers):
            return None
        layers = cache.layers
        if not all(isinstance(layer, GrowingLayer) and layer.is_initialized and layer._is_prefix_view()
                   for layer in layers):
            return None
        length = layers[0].keys.shape[-2]
        for layer in layers:
            if (layer.keys.shape[-2] != length or layer.keys.shape[0] != 1 or layer.keys.dtype != self.dtype
                    or layer.keys.device != self.token.device):
                return None
        return layers

    @torch.inference_mode()
    def __call__(self, token_id: int, cache) -> torch.Tensor | None:
        """Feeds `token_id` at the end of `cache` (extending it by one position): next-token logits [V] (a tensor
        of its own), or None when this cache cannot be stepped here (the caller runs the usual forward)."""
        layers = self.usable(cache)
        if layers is None:
            return None
        length = layers[0].keys.shape[-2]
        window = getattr(self.config, "sliding_window", None)
        if window is not None and getattr(self.config, "use_sliding_window", True) and length + 1 > window:
            return None  # past the window the model attends to part of the cache only
        for layer in layers:
            if length + 1 > layer._key_buffer.shape[-2]:
                layer._grow(length, length + 1, layer.keys, layer.values)
                layer.keys = layer._key_buffer[:, :, :length]
                layer.values = layer._value_buffer[:, :, :length]
        buffers = tuple((layer._key_buffer, layer._value_buffer) for layer in layers)
        if not self._same_buffers(buffers, self._cleared_buffers):
            # the room past the filled part is attended, masked (0 x value): zeros there, whatever memory the
            # cache was given (a CPU cache's is uninitialised: a NaN there would make every logit NaN); once per
            # set of buffers, before anything in a new block is written
            for keys, values in buffers:
                keys[:, :, length:].zero_()
                values[:, :, length:].zero_()
            self._cleared_buffers = buffers
        self.token.fill_(token_id)
        self.position.fill_(length)
        if not self.capture:
            logits = self._step(buffers)
        else:
            if not self._captured_over(buffers):
                self._record(buffers)
            self._graph.replay()
            logits = self._logits
        for layer, (keys, values) in zip(layers, buffers):
            layer.keys = keys[:, :, :length + 1]
            layer.values = values[:, :, :length + 1]
        return logits[0, -1].clone()

    def _captured_over(self, buffers: tuple) -> bool:
        return self._same_buffers(buffers, self._graph_buffers)

    @staticmethod
    def _same_buffers(buffers: tuple, seen: tuple) -> bool:
        return len(buffers) == len(seen) and all(
            k.data_ptr() == gk.data_ptr() and v.data_ptr() == gv.data_ptr() and k.shape == gk.shape
            for (k, v), (gk, gv) in zip(buffers, seen))

    def _record(self, buffers: tuple) -> None:
        """Captures the step over `buffers` into a private memory pool (the previous graph and its output
        are dropped first, which frees theirs: sharing one pool across captures trips an allocator assertion
        in torch 2.11 once the graph that made it is gone).
        A warm-up run on a side stream first, as capture requires; it writes the same key and value at the
        same position as the replay that follows."""
        start = time.perf_counter()
        self._graph, self._logits, self._graph_buffers = None, None, ()
        side = torch.cuda.Stream(device=self.token.device)
        side.wait_stream(torch.cuda.current_stream(self.token.device))
        with torch.cuda.stream(side):
            self._step(buffers)
        torch.cuda.current_stream(self.token.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._step(buffers)
        self._graph, self._logits, self._graph_buffers = graph, logits, buffers
        self.captures += 1
        self.capture_s += time.perf_counter() - start

    def _step(self, buffers: tuple) -> torch.Tensor:
        """The decoder over one token at self.position, its KV written into `buffers`; logits [1, 1, V]."""
        decoder = self.decoder
        capacity = buffers[0][0].shape[-2]
        # Positions up to the new token's are attended to: [1, 1, 1, capacity]
        visible = (torch.arange(capacity, device=self.token.device) <= self.position[0]).view(1, 1, 1, capacity)
        hidden = decoder.embed_tokens(self.token)  # [1, 1, hidden]
        cos, sin = decoder.rotary_emb(hidden, self.position)  # [1, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, 1, D]: over every head
        where = self.position[0]  # [1]: the index along the cache's position dim
        for layer, (key_buffer, value_buffer) in zip(decoder.layers, buffers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, 1, -1, self.head_dim)
            k = attn.k_proj(x).view(1, 1, -1, self.head_dim)
            v = attn.v_proj(x).view(1, 1, -1, self.head_dim).transpose(1, 2)  # [1, H_kv, 1, D]
            if hasattr(attn, "q_norm"):  # Qwen3: an RMS norm over each head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)  # [1, H, 1, D]
            key_buffer.index_copy_(2, where, k.to(key_buffer.dtype))
            value_buffer.index_copy_(2, where, v.to(value_buffer.dtype))
            out = F.scaled_dot_product_attention(q, key_buffer, value_buffer, attn_mask=visible, scale=attn.scaling,
                                                 enable_gqa=q.shape[1] != key_buffer.shape[1])
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(decoder.norm(hidden))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding in transformers' half-split layout (rotate_half): x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

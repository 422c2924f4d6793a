"""Layer streaming: decoder layers whose weights live off the compute device and are copied, one whole layer at a
time, into one of k slots on it while earlier layers compute (for int4 models larger than the device's memory).

- plan_streaming: which decoder layers stay resident under a byte budget and which stream (a StreamPlan).
- layer_layout / layer_image: where each tensor of a decoder layer lies in its one contiguous byte image.
- enable_streaming: hooks on the streamed layers (a LayerStreamer) that, before a layer runs, have a copy engine
  (engine.weights.copy_engines) make it resident in a slot and point its parameters and buffers at views of that slot.

A decoder layer's weights are all its parameters and buffers, whatever modules hold them (Int4Linear, merged
projections, norms, biases): nothing here knows a module type. Everything outside the decoder layers (embeddings,
final norm, output head, rotary tables) is always resident.

Over 400 lines: layer streaming as one mechanism: the plan, the layers' byte images and the hooks that swap them in."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .copy_engines import CopyEngine

MIB = 1 << 20
# Every tensor in an image starts at a multiple of this: a uint8 view at that offset can be re-viewed as any dtype
# (the storage offset must be a multiple of the element size), aligned as torch's own allocations are.
ALIGN = 64
ACTIVATION_TOKENS = 512  # the prefill chunk the default activation estimate is sized for


# -- layouts -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpan:
    offset: int  # bytes from the start of the image
    num_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorPlace:
    module: str  # path inside the decoder layer ("self_attn.q_proj"; "" is the layer itself)
    kind: str  # "parameter" | "buffer"
    name: str
    span: int  # index into LayerLayout.spans; a tensor held under two names has one span


@dataclass(frozen=True)
class LayerLayout:
    places: tuple[TensorPlace, ...]
    spans: tuple[TensorSpan, ...]
    image_bytes: int  # the image's size, alignment padding included: what a slot must hold
    tensor_bytes: int  # the tensors' own bytes: what the layer holds when resident


def _tables(module: nn.Module):
    return (("parameter", module._parameters), ("buffer", module._buffers))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def layer_tensors(layer: nn.Module):
    """(module path, kind, name, tensor) of every parameter and buffer held in `layer` (None entries skipped)."""
    for path, module in layer.named_modules():
        for kind, table in _tables(module):
            for name, tensor in table.items():
                if tensor is not None:
                    yield path, kind, name, tensor


def layer_layout(layer: nn.Module) -> LayerLayout:
    places, spans, span_of, end = [], [], {}, 0
    for path, kind, name, tensor in layer_tensors(layer):
        if id(tensor) not in span_of:
            if tensor.layout != torch.strided or tensor.is_quantized:
                raise ValueError(f"{path}.{name}: cannot stream a {tensor.layout} / quantized tensor")
            span_of[id(tensor)] = len(spans)
            spans.append(TensorSpan(end, _nbytes(tensor), tuple(tensor.shape), tensor.dtype))
            end = -(-(end + _nbytes(tensor)) // ALIGN) * ALIGN
        places.append(TensorPlace(path, kind, name, span_of[id(tensor)]))
    return LayerLayout(tuple(places), tuple(spans), end, sum(s.num_bytes for s in spans))


def layer_image(layer: nn.Module, layout: LayerLayout) -> torch.Tensor:
    """uint8 [layout.image_bytes] on the CPU: the layer's tensors' bytes at their spans (padding zero)."""
    image = torch.zeros(layout.image_bytes, dtype=torch.uint8)
    done = set()
    for place in layout.places:
        if place.span in done:
            continue
        done.add(place.span)
        span = layout.spans[place.span]
        tensor = _table(layer, place)[place.name]
        # non-contiguous tensors are stored (and later viewed) contiguous: the same values
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        image[span.offset:span.offset + span.num_bytes].copy_(flat)
    return image


def _table(layer: nn.Module, place: TensorPlace) -> dict:
    module = layer.get_submodule(place.module)
    return module._parameters if place.kind == "parameter" else module._buffers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """model.model.layers (decoder-only causal LMs), or model.model.language_model.layers (multimodal wrappers)."""
    base = getattr(model, "model", None)
    for owner in (base, getattr(base, "language_model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has no model.layers ModuleList: no decoder layers to stream")


def _unique_tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    tensors = {id(t): t for t in module.parameters()}  # tied parameters once
    tensors.update({id(t): t for t in module.buffers()})
    return tensors


def always_resident_bytes(model: nn.Module) -> int:
    """Bytes of every tensor outside the decoder layers (embeddings, norms, head; a tied head once)."""
    inside = {i for layer in decoder_layers(model) for i in _unique_tensors(layer)}
    return sum(_nbytes(t) for i, t in _unique_tensors(model).items() if i not in inside)


def activation_estimate(model: nn.Module, num_tokens: int = ACTIVATION_TOKENS) -> int:
    """Device bytes a forward of `num_tokens` takes besides weights and KV, roughly: per token the residual stream
    and attention projections (~6 hidden vectors) and the MLP's gate, up and product (3 intermediate vectors) in
    the activation dtype, one float32 attention score matrix per head, and one row of float32 logits (twice: the
    logits and their softmax)."""
    config = model.config.get_text_config()
    element = torch.empty((), dtype=getattr(model, "dtype", torch.float32)).element_size()
    per_token = (6 * config.hidden_size + 3 * config.intermediate_size) * element
    scores = config.num_attention_heads * num_tokens * num_tokens * 4
    return num_tokens * per_token + scores + 2 * 4 * config.vocab_size


# -- the plan ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamPlan:
    resident_layers: tuple[int, ...]  # decoder layers held on the compute device, ascending
    streamed_layers: tuple[int, ...]  # decoder layers copied into a slot before each use, ascending
    resident_bytes: int  # the resident decoder layers' tensors
    streamed_bytes: int  # the streamed decoder layers' tensors (held off the device)
    slot_bytes: int  # one slot: the largest streamed layer's image (0 when nothing streams)
    min_budget_bytes: int  # the smallest budget any plan fits in
    num_slots: int
    always_resident_bytes: int  # everything outside the decoder layers
    reserved_bytes: int  # KV + activations + context: device memory the weights leave free
    budget_bytes: int

    @property
    def streams(self) -> bool:
        return bool(self.streamed_layers)

    @property
    def device_bytes(self) -> int:
        """What the plan holds on the device: weights, slots and the reserve (never more than budget_bytes)."""
        slots = self.num_slots * self.slot_bytes if self.streams else 0
        return self.always_resident_bytes + self.resident_bytes + slots + self.reserved_bytes

    def describe(self) -> str:
        if not self.streams:
            return f"all {len(self.resident_layers)} decoder layers resident ({self.resident_bytes / MIB:.1f} MiB)"
        return (f"{len(self.resident_layers)} decoder layers resident ({self.resident_bytes / MIB:.1f} MiB), "
                f"{len(self.streamed_layers)} streamed ({self.streamed_bytes / MIB:.1f} MiB) through "
                f"{self.num_slots} slots of {self.slot_bytes / MIB:.1f} MiB")


def pick_streamed(sizes: list[int], num_streamed: int) -> list[int]:
    """The `num_streamed` layers to stream: the largest ones (so the most stay resident); among layers of one
    size, evenly spread over the stack, so each copy overlaps the compute of the resident layers in between."""
    largest = sorted(range(len(sizes)), key=lambda i: -sizes[i])[:num_streamed]
    picked = []
    for size, count in Counter(sizes[i] for i in largest).items():
        same = [i for i, s in enumerate(sizes) if s == size]
        picked += [same[(2 * j + 1) * len(same) // (2 * count)] for j in range(count)]
    return sorted(picked)


def plan_streaming(model: nn.Module, budget_bytes: int, *, num_slots: int = 2, kv_bytes: int = 0,
                   activation_bytes: int | None = None, context_bytes: int = 0) -> StreamPlan:
    """Which decoder layers stay resident in `budget_bytes` of device memory and which stream through `num_slots`
    slots. The budget covers everything outside the decoder layers, the resident layers, the slots (each the
    size of the largest streamed layer), `kv_bytes` (the live KV cache), `activation_bytes` (default:
    activation_estimate) and `context_bytes` (anything else the caller keeps on the device). As many layers stay
    resident as fit; when all do, nothing streams. A budget no plan fits in is a ValueError naming the minimum."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be at least 1, got {num_slots}")
    layouts = [layer_layout(layer) for layer in decoder_layers(model)]
    sizes = [layout.tensor_bytes for layout in layouts]
    always = always_resident_bytes(model)
    activations = activation_estimate(model) if activation_bytes is None else activation_bytes
    reserved = kv_bytes + activations + context_bytes

    def cost(streamed: list[int]) -> int:
        slots = num_slots * max((layouts[i].image_bytes for i in streamed), default=0) if streamed else 0
        return always + reserved + sum(sizes) - sum(sizes[i] for i in streamed) + slots

    # Fewest streamed first; costs need not fall with every layer streamed (k slots may outweigh the layers).
    options = [pick_streamed(sizes, n) for n in range(len(sizes) + 1)]
    costs = [cost(streamed) for streamed in options]
    minimum = min(costs)
    if budget_bytes < minimum:
        raise ValueError(f"a weight budget of {budget_bytes} bytes ({budget_bytes / MIB:.1f} MiB) is below the "
                         f"minimum of {minimum} bytes ({minimum / MIB:.1f} MiB) for this model with {num_slots} "
                         f"slots: {always} bytes outside the decoder layers, {reserved} bytes of KV, activations "
                         f"and context, and {num_slots} slots of the largest layer")
    streamed = next(s for s, c in zip(options, costs) if c <= budget_bytes)
    resident = [i for i in range(len(sizes)) if i not in streamed]
    return StreamPlan(
        resident_layers=tuple(resident), streamed_layers=tuple(streamed),
        resident_bytes=sum(sizes[i] for i in resident), streamed_bytes=sum(sizes[i] for i in streamed),
        slot_bytes=max((layouts[i].image_bytes for i in streamed), default=0), min_budget_bytes=minimum,
        num_slots=num_slots, always_resident_bytes=always, reserved_bytes=reserved, budget_bytes=budget_bytes)


def kv_cache_bytes(model: nn.Module, num_tokens: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of the keys and values of `num_tokens` positions over every decoder layer (batch 1)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = torch.empty((), dtype=dtype or model.dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * num_tokens * element


# -- the scheduler -----------------------------------------------------------------------------------------------

Binding = list[tuple[dict, str, torch.Tensor]]  # (module._parameters or _buffers, name, tensor): one layer's tensors


def _bind(layer: nn.Module, layout: LayerLayout, flat: torch.Tensor) -> Binding:
    """The layer's tensors as views of `flat` (a slot or a host image), Parameters where they were Parameters."""
    views: dict[tuple[int, str], torch.Tensor] = {}
    binding = []
    for place in layout.places:
        if (place.span, place.kind) not in views:
            span = layout.spans[place.span]
            view = flat[span.offset:span.offset + span.num_bytes].view(span.dtype).view(span.shape)
            views[place.span, place.kind] = nn.Parameter(view, requires_grad=False) if place.kind == "parameter" \
                else view
        binding.append((_table(layer, place), place.name, views[place.span, place.kind]))
    return binding


def _point(binding: Binding) -> None:
    for table, name, tensor in binding:
        table[name] = tensor


class LayerStreamer:
    """The streamed layers' bookkeeping: which layer each slot holds, the hooks, the counters. Made by
    enable_streaming; the bytes themselves live in the copy engine.

    Invariants (NOTE): a slot is issued into only after its occupant's release; the layers in the window (the one
    about to run and the next num_slots - 1 streamed after it, wrapping to the first at the end of a pass) are
    never evicted; between its forward calls a streamed layer's tensors are views of its host image (so the
    model's state_dict stays right), during its forward views of its slot."""

    def __init__(self, model: nn.Module, plan: StreamPlan, copy_engine: CopyEngine, layouts: dict[int, LayerLayout]):
        self.model = model
        self.plan = plan
        self.engine = copy_engine
        self.order = list(plan.streamed_layers)  # the streamed layers in the order a forward runs them
        self.position = {layer: p for p, layer in enumerate(self.order)}
        self.layouts = layouts
        self._slot_bindings: dict[int, list[Binding]] = {}  # per layer, per slot
        self._host_bindings: dict[int, Binding] = {}
        self.occupant: list[int | None] = [None] * copy_engine.num_slots
        self.slot_of: dict[int, int] = {}
        self._loaded_at = [-1] * copy_engine.num_slots  # the copy count when each slot was last filled
        self._released = [True] * copy_engine.num_slots
        self._handles = []
        self.num_passes = self.num_copies = self.bytes_copied = self.num_tokens = 0

    def adopt(self, index: int, layer: nn.Module) -> None:
        """Point a stored layer at its host image (its own tensors are freed here), make its slot views, hook it."""
        layout = self.layouts[index]
        self._host_bindings[index] = _bind(layer, layout, self.engine.host(index))
        self._slot_bindings[index] = [_bind(layer, layout, self.engine.slot(s)) for s in range(self.engine.num_slots)]
        _point(self._host_bindings[index])
        self._handles.append(layer.register_forward_pre_hook(
            lambda _module, args, kwargs: self.before_layer(index, args, kwargs), with_kwargs=True))
        self._handles.append(layer.register_forward_hook(
            lambda _module, _args, _output: self.after_layer(index), always_call=True))

    # The hooks -------------------------------------------------------------------------------------------------

    def before_layer(self, layer: int, args: tuple, kwargs: dict) -> None:
        position = self.position[layer]
        if position == 0:
            self.num_passes += 1
            hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, hidden]
            self.num_tokens += math.prod(hidden.shape[:-1])
        self._fill_window(position)
        slot = self.slot_of[layer]
        self.engine.wait(slot)
        self._released[slot] = False
        _point(self._slot_bindings[layer][slot])

    def after_layer(self, layer: int) -> None:
        # Also after a forward that raised (always_call): the slot must not stay held.
        slot = self.slot_of[layer]
        self.engine.release(slot)
        self._released[slot] = True
        _point(self._host_bindings[layer])
        # Refill the slot now rather than at the next streamed layer's start: the copy then overlaps the
        # compute of every resident layer in between (and, after the last one, the tail of the pass).
        self._fill_window(self.position[layer] + 1)

    def _fill_window(self, position: int) -> None:
        n = len(self.order)
        window = [self.order[(position + d) % n] for d in range(min(self.engine.num_slots, n))]
        for layer in window:
            if layer not in self.slot_of:
                self._issue(layer, self._free_slot(window))

    def _free_slot(self, window: list[int]) -> int:
        """The slot filled longest ago among those whose occupant is not in the window (one always is: the
        window holds at most num_slots layers)."""
        slot = min((s for s, held in enumerate(self.occupant) if held not in window),
                   key=lambda s: self._loaded_at[s])
        assert self._released[slot], f"slot {slot} still holds layer {self.occupant[slot]} computing"
        if self.occupant[slot] is not None:
            del self.slot_of[self.occupant[slot]]
        return slot

    def _issue(self, layer: int, slot: int) -> None:
        self.engine.issue(layer, slot)
        self.occupant[slot] = layer
        self.slot_of[layer] = slot
        self._loaded_at[slot] = self.num_copies
        self.num_copies += 1
        self.bytes_copied += self.layouts[layer].image_bytes

    # What the caller asks ---------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since enable_streaming: weight passes (forwards through the streamed layers), copies and
        bytes copied, tokens computed and tokens per weight pass (what one pass of copies is spread over)."""
        return {"weight_passes": self.num_passes, "copies": self.num_copies, "bytes_copied": self.bytes_copied,
                "tokens": self.num_tokens,
                "tokens_per_pass": self.num_tokens / self.num_passes if self.num_passes else 0.0,
                "streamed_layers": len(self.order), "num_slots": self.engine.num_slots,
                "slot_bytes": self.engine.slot_bytes, "resident_bytes": self.resident_bytes()}

    def resident_bytes(self) -> int:
        """Bytes held on the compute device: tensors outside the streamed layers that are on it, and the slots."""
        layers = decoder_layers(self.model)
        streamed = {id(t) for i in self.order for *_, t in layer_tensors(layers[i])}
        held = sum(_nbytes(t) for i, t in _unique_tensors(self.model).items()
                   if i not in streamed and t.device == self.engine.device)
        return held + self.engine.slots_bytes()

    def disable(self) -> None:
        """Every streamed layer resident again (fresh device tensors with the same values), hooks removed, the
        copy engine closed. The device must have room for the whole model (streaming was there because it had not:
        measured on a card capped at 8 GiB, a 32B-shaped model's disable() runs out of memory)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for layer in self.order:
            fresh: dict[int, torch.Tensor] = {}
            for table, name, tensor in self._host_bindings[layer]:
                if id(tensor) not in fresh:
                    copy = tensor.detach().to(self.engine.device, copy=True)
                    fresh[id(tensor)] = nn.Parameter(copy, requires_grad=False) \
                        if isinstance(tensor, nn.Parameter) else copy
                table[name] = fresh[id(tensor)]
        self._slot_bindings.clear()
        self._host_bindings.clear()
        self.order, self.slot_of = [], {}
        self.engine.close()


def _check_streamable(layer: nn.Module, index: int) -> None:
    # A tensor kept as a plain attribute would be read from wherever it was, never from the slot.
    for path, module in layer.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                raise ValueError(f"decoder layer {index} holds a tensor outside its parameters and buffers "
                                 f"({path or 'the layer'}.{name}): it cannot be streamed")


def enable_streaming(model: nn.Module, plan: StreamPlan, copy_engine: CopyEngine) -> LayerStreamer:
    """Streams `plan.streamed_layers` of `model` through `copy_engine`: each layer's bytes are written to the
    engine once (its device tensors freed), and hooks copy it into a slot before it runs. The rest of the model
    must already be on the engine's device. Numerics are unchanged: a layer computes on the same bytes, viewed
    with the same shapes and dtypes."""
    layers = decoder_layers(model)
    if len(plan.resident_layers) + len(plan.streamed_layers) != len(layers):
        raise ValueError(f"the plan covers {len(plan.resident_layers) + len(plan.streamed_layers)} decoder layers, "
                         f"the model has {len(layers)}")
    if copy_engine.num_slots != plan.num_slots:
        raise ValueError(f"the plan is for {plan.num_slots} slots, the copy engine has {copy_engine.num_slots}")
    streamed = {i: layers[i] for i in plan.streamed_layers}
    inside = {id(m) for layer in streamed.values() for m in layer.modules()}
    elsewhere = {id(t): t for m in model.modules() if id(m) not in inside
                 for _, table in _tables(m) for t in table.values() if t is not None}
    for tensor in elsewhere.values():
        if tensor.device != copy_engine.device:
            raise ValueError(f"a resident tensor is on {tensor.device}, the copy engine computes on "
                             f"{copy_engine.device}: move the model there first")
    for index, layer in streamed.items():
        _check_streamable(layer, index)
        if any(id(t) in elsewhere for *_, t in layer_tensors(layer)):
            raise ValueError(f"decoder layer {index} shares a tensor with the rest of the model: it cannot stream")
    layouts = {i: layer_layout(layer) for i, layer in streamed.items()}
    slot_bytes = max((layout.image_bytes for layout in layouts.values()), default=0)
    if plan.streams and slot_bytes != plan.slot_bytes:
        raise ValueError(f"the plan's slots hold {plan.slot_bytes} bytes, this model's largest streamed layer "
                         f"{slot_bytes}: plan the model as it is now")
    streamer = LayerStreamer(model, plan, copy_engine, layouts)
    if plan.streams:
        copy_engine.setup({i: layout.image_bytes for i, layout in layouts.items()}, slot_bytes)
    for index, layer in streamed.items():  # one layer's image at a time in memory
        copy_engine.store(index, layer_image(layer, layouts[index]))
        streamer.adopt(index, layer)
    return streamer

"""Layer streaming for a loaded model, as the engine facade sets it up: whether it can run, the default budget,
the copy engine for the device, the measured copy bandwidth, the decode speed that bandwidth allows, and what
info() and memory() report (engine.weights.streaming plans and hooks; engine.weights.copy_engines moves the bytes).

Streaming needs int4 decoder layers (an AWQ checkpoint, or weights="int4"): float layers would cross the link
at four to eight times the bytes, and they are not what this path is for. It runs on CUDA (pinned host images,
a copy stream) and on the CPU (images in a memory-mapped file, copied into a RAM arena: for machines with less
RAM than the model).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import STREAM_SLOTS
from ..reports import WeightStreaming
from . import loader
from .copy_engines import CopyEngine, CpuCopyEngine, CudaCopyEngine
from .int4 import Int4Linear
from .streaming import LayerStreamer, StreamPlan, decoder_layers, enable_streaming, kv_cache_bytes, plan_streaming

log = logging.getLogger(__name__)

DEFAULT_SLOTS = STREAM_SLOTS  # the option's default (engine.config.LoadOptions.stream_slots)
PLANNED_CONTEXT = 4096  # KV positions the planner keeps room for (capped by the model's own context)
DEVICE_SHARE = 0.9  # of free device memory (CUDA) or available RAM (CPU) that the default budget takes
BANDWIDTH_PROBE_BYTES = 64 << 20


def _quant_method(model_config) -> str:
    quant = getattr(model_config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(method).lower()


def streaming_refusal(model_config, device: torch.device, weights: str) -> str | None:
    """Why streaming cannot run for a model of `model_config` loaded with `weights` on `device`, from the config
    alone (so a wrong choice fails before the weights are read), or None when it can."""
    if device.type not in ("cpu", "cuda"):
        return f"layer streaming runs on CUDA GPUs and on the CPU, not on {device.type}"
    awq = _quant_method(model_config) == "awq"
    if weights == "float" or (weights == "auto" and not awq):
        return ("needs int4 weights: an AWQ checkpoint, or Weights: int4 (float decoder layers are not streamed)"
                if weights == "auto" else "needs int4 weights; Weights: float keeps every layer in float")
    return None


available_memory = loader.available_memory  # free VRAM (CUDA) or available RAM (CPU), in bytes


def default_budget(device: torch.device) -> int:
    return int(available_memory(device) * DEVICE_SHARE)


def copy_engine_for(device: torch.device, num_slots: int, folder: str | os.PathLike) -> CopyEngine:
    if device.type == "cuda":
        return CudaCopyEngine(device, num_slots)
    return CpuCopyEngine(folder, num_slots)


def measure_bandwidth(engine: CopyEngine, layer: int, rounds: int = 3) -> float:
    """Bytes per second of one layer's copy into slot 0, the best of `rounds` (the copy is the steady state's
    whole cost per streamed layer)."""
    best = float("inf")
    size = engine.host(layer).numel()
    for _ in range(rounds):
        start = time.perf_counter()
        engine.issue(layer, 0)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        engine.release(0)
        best = min(best, time.perf_counter() - start)
    return size / max(best, 1e-9)


def probe_bandwidth(device: torch.device, num_bytes: int = BANDWIDTH_PROBE_BYTES) -> float:
    """Bytes per second of a plain host-to-device copy of `num_bytes` (from pinned memory on CUDA), before any
    model is loaded: what Model > Choose model predicts streaming speed from."""
    pin = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        target.copy_(host, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return num_bytes / max(best, 1e-9)


def stage_for_streaming(model, device: torch.device, kernel: str) -> None:
    """A model loaded on the host with int4 layers in the reference layout, made ready for streaming on
    `device` without ever holding all of it there: each decoder layer is laid out for `kernel` on the device and
    moved back to the host at once (peak: one layer), and everything outside the decoder layers is moved to the
    device (a tied head and table stay one tensor). start_streaming then moves the layers the plan keeps
    resident. In place."""
    from torch import nn

    layers = decoder_layers(model)
    for layer in layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, Int4Linear) and module.kernel == "reference" and kernel != "reference":
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, child, module.to_kernel(kernel, device))
        layer.to("cpu")
    inside = {id(m) for layer in layers for m in layer.modules()}
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if id(module) in inside:
            continue
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None or tensor.device == device:
                    continue
                if id(tensor) not in moved:
                    data = tensor.detach().to(device)
                    moved[id(tensor)] = nn.Parameter(data, requires_grad=False) \
                        if isinstance(tensor, nn.Parameter) else data
                table[key] = moved[id(tensor)]


def load_for_streaming(source, device: torch.device, dtype: torch.dtype, *, weights: str, group_size: int,
                       kernel: str, head: str, cache_dir=None, progress=None):
    """(model, tokenizer) for streaming on a CUDA `device`: loaded on the host in the reference layout, then
    staged (stage_for_streaming) so a model larger than the card never has to fit on it whole. The output head
    stays as loaded under head="auto" (the int8 kernel is the CPU's)."""
    from .head import quantize_head
    from .int4 import pick_kernel

    model, tokenizer = loader.load_model(source, torch.device("cpu"), dtype, weights=weights, group_size=group_size,
                                         kernel="reference", head="float", cache_dir=cache_dir,
                                         progress=progress)
    stage_for_streaming(model, device, pick_kernel(kernel, device)[0])
    if head not in ("auto", "float"):
        quantize_head(model, head, group_size=group_size, kernel=kernel)
    return model, tokenizer


@functools.lru_cache(maxsize=None)
def _probed_bandwidth(device: str) -> float:
    return probe_bandwidth(torch.device(device))


def streaming_estimate(source, sizes: dict, *, device: str = "auto", num_slots: int = DEFAULT_SLOTS) -> dict:
    """Before a load: whether streaming could run per weight format, and the decode speed the copy link would
    allow for `source` with the default budget. `sizes` is engine.weights.weight_sizes.estimate(source). Returns
    {"unavailable": {format: reason or None}, "budget_bytes", "bandwidth_bytes_per_s", "streamed_bytes" (int4
    decoder bytes the budget leaves off the device, 0 when everything fits), "predicted_decode_tokens_per_s"
    (None when nothing would stream)}. A rough plan: the same arithmetic as plan_streaming on estimated sizes
    (KV for the planned context, slots of an average layer; activations left out)."""
    src = loader.resolve_source(source)
    dev = loader.pick_device(device)
    config = loader.read_config(src)
    # "auto" is what resolve_weights made of this source (a 4-bit GGUF loads as int4, so it can stream)
    unavailable = {weights: streaming_refusal(config, dev, sizes["auto"]["loads"] if weights == "auto" else weights)
                   for weights in ("auto", "float", "int4")}
    text = config.get_text_config()
    layers = int(text.num_hidden_layers)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    element = torch.empty((), dtype=getattr(torch, sizes["dtype"])).element_size()
    context = min(int(getattr(text, "max_position_embeddings", 0) or PLANNED_CONTEXT), PLANNED_CONTEXT)
    kv = 2 * layers * kv_heads * head_dim * context * element
    decoder = sizes["int4"] - sizes["outside_layers"]
    budget = default_budget(dev)
    room = budget - sizes["outside_layers"] - kv - num_slots * decoder // max(layers, 1)
    streamed = max(0, decoder - max(room, 0))
    bandwidth = _probed_bandwidth(str(dev)) if streamed else 0.0
    return {"unavailable": unavailable, "budget_bytes": budget, "bandwidth_bytes_per_s": bandwidth,
            "streamed_bytes": streamed, "fits": room >= 0,
            "predicted_decode_tokens_per_s": bandwidth / streamed if streamed else None}


@dataclass
class Streaming:
    """Streaming as it runs under one engine: the plan, the hooks and the measured bandwidth."""
    plan: StreamPlan
    streamer: LayerStreamer
    bandwidth_bytes_per_s: float  # one layer's copy into a slot, measured at start

    @property
    def predicted_decode_tokens_per_s(self) -> float | None:
        """The ceiling the link sets: one token reads every streamed layer once (None when nothing streams)."""
        if not self.plan.streams:
            return None
        return self.bandwidth_bytes_per_s / self.plan.streamed_bytes

    def report(self) -> WeightStreaming:
        plan = self.plan
        return WeightStreaming(
            resident_layers=list(plan.resident_layers), streamed_layers=list(plan.streamed_layers),
            resident_bytes=self.streamer.resident_bytes(), streamed_bytes=plan.streamed_bytes,
            min_budget_bytes=plan.min_budget_bytes, budget_bytes=plan.budget_bytes, num_slots=plan.num_slots,
            slot_bytes=plan.slot_bytes, bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            predicted_decode_tokens_per_s=self.predicted_decode_tokens_per_s)

    def counters(self) -> tuple[int, int]:
        """(weight passes, tokens computed) so far: a request's share is the difference across it."""
        stats = self.streamer.stats()
        return stats["weight_passes"], stats["tokens"]


def start_streaming(model, device: torch.device, *, budget_bytes: int | None, num_slots: int = DEFAULT_SLOTS,
                    max_context: int = PLANNED_CONTEXT, context_bytes: int = 0,
                    folder: str | os.PathLike | None = None) -> Streaming:
    """Plans `model` (int4, on `device` or staged for it by stage_for_streaming) under `budget_bytes` (None:
    default_budget) and streams what does not fit. ValueError naming the minimum when the budget is too small for any
    plan."""
    budget = default_budget(device) if budget_bytes is None else int(budget_bytes)
    kv = kv_cache_bytes(model, min(max_context, PLANNED_CONTEXT))
    plan = plan_streaming(model, budget, num_slots=num_slots, kv_bytes=kv, context_bytes=context_bytes)
    layers = decoder_layers(model)
    for index in plan.resident_layers:  # a staged model (stage_for_streaming) has every layer on the host
        layers[index].to(device)
    if folder is None:
        from platformdirs import user_cache_dir

        folder = Path(user_cache_dir("KVBoost", "KVBoost")) / "streaming"
    engine = copy_engine_for(device, num_slots, folder)
    streamer = enable_streaming(model, plan, engine)
    bandwidth = measure_bandwidth(engine, plan.streamed_layers[0]) if plan.streams else 0.0
    log.info("layer streaming: %s; copy bandwidth %.2f GB/s", plan.describe(), bandwidth / 1e9)
    return Streaming(plan, streamer, bandwidth)

"""The layer-streaming part of `python -m bench.gpu_check`: a Qwen2.5-32B-shaped stack of random int4 layers
streamed through engine.weights.streaming on a card capped at 8 GiB, without downloads.

Measured: bare pinned host-to-device bandwidth (one copy of a layer's image against one copy per tensor of the
same bytes); per layer, the copy alone, the compute alone (one token) and the two overlapped (a streamed pass);
streamed decode tokens/s against the bound the copy bandwidth sets (streamed bytes per token / bandwidth);
prefill tokens/s on 512 tokens; one 8-token pass against a 1-token pass; and the VRAM peak against the cap.

The layers are built one at a time on the device (tinygemm's layout is made there) and moved to host memory
right away, so the cap is never exceeded while building; the planner then keeps as many resident as the budget
allows. `dry_run`: tiny shapes on the CPU with the CPU copy engine, end to end.
"""

from __future__ import annotations

import sys
import tempfile
import time

import torch
from torch import nn

from engine.weights.copy_engines import CpuCopyEngine, CudaCopyEngine
from engine.weights.streaming import enable_streaming, layer_layout, plan_streaming

CAP_BYTES = 8 << 30  # the card the issue is about
KV_BYTES = 1 << 30  # room for a 4k-token KV of a 32B model (64 layers x 8 KV heads x 128 x 2 x bf16 = 256 KB/token)
ACTIVATION_BYTES = 1 << 30
NUM_SLOTS = 2


class StreamLayer(nn.Module):
    """One decoder layer's int4 linears (q, k, v, o, gate, up, down) and the flow between them, no attention."""

    def __init__(self, shape, kernel: str, device: torch.device, seed: int, make_layer):
        super().__init__()
        dims = {"q": (shape.hidden, shape.hidden), "k": (shape.hidden, shape.kv_dim), "v": (shape.hidden, shape.kv_dim),
                "o": (shape.hidden, shape.hidden), "gate": (shape.hidden, shape.intermediate),
                "up": (shape.hidden, shape.intermediate), "down": (shape.intermediate, shape.hidden)}
        for i, (name, (k, n)) in enumerate(dims.items()):
            self.add_module(name, make_layer(k, n, kernel, device, seed=seed + i))

    def forward(self, x):  # x: [1, T, hidden]
        q, k, v = self.q(x), self.k(x), self.v(x)
        x = x + self.o(q) + 0 * (k.sum() + v.sum())
        x = x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        return x / x.abs().amax().clamp(min=1)  # random weights: keep values finite over many layers


class Decoder(nn.Module):
    """What engine.weights.streaming expects of a model: the layers at .model.layers."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x)
        return x


def _timed(fn, device: torch.device, iters: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def _copy_bandwidth(image: torch.Tensor, layout, device: torch.device, iters: int) -> tuple[float, float]:
    """(bytes/s of one copy of `image` into a device buffer, bytes/s of one copy per tensor span of it)."""
    target = torch.empty(image.numel(), dtype=torch.uint8, device=device)
    whole = _timed(lambda: target.copy_(image, non_blocking=True), device, iters)

    def per_tensor():
        for span in layout.spans:
            end = span.offset + span.num_bytes
            target[span.offset:end].copy_(image[span.offset:end], non_blocking=True)
    pieces = _timed(per_tensor, device, iters)
    return image.numel() / whole, image.numel() / pieces


def check_streaming(shape, kernel: str, device: torch.device, make_layer, *, dry_run: bool, iters: int) -> dict:
    """Run it before anything else holds device memory: the cap counts everything this process has allocated.
    The cap is lifted again when it returns."""
    try:
        with torch.inference_mode():
            return _check(shape, kernel, device, make_layer, dry_run=dry_run, iters=iters)
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
            torch.cuda.empty_cache()


def _allocated(device: torch.device, stages: dict, stage: str) -> None:
    """Device bytes allocated at `stage` (a run that hits the cap says where the memory went)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        stages[stage] = torch.cuda.memory_allocated(device) / 2**30
        print(f"  streaming, {stage}: {stages[stage]:.2f} GiB allocated", file=sys.stderr, flush=True)


def _check(shape, kernel, device, make_layer, *, dry_run, iters) -> dict:
    cap = None
    stages: dict[str, float] = {}
    _allocated(device, stages, "before")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        cap = min(CAP_BYTES, total)
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        torch.cuda.reset_peak_memory_stats(device)
    layers = []
    for index in range(shape.num_layers):  # built on the device, kept on the host until the plan says where
        layers.append(StreamLayer(shape, kernel, device, 1000 * index, make_layer).to("cpu"))
    model = Decoder(layers).eval()
    _allocated(device, stages, "layers built, on the host")
    layer_bytes = layer_layout(layers[0]).tensor_bytes
    kv, activations = (0, 0) if dry_run else (KV_BYTES, ACTIVATION_BYTES)
    minimum = plan_streaming(model, 1 << 62, num_slots=NUM_SLOTS, kv_bytes=kv,
                             activation_bytes=activations).min_budget_bytes
    # On the card: what the cap leaves; dry run: room for half the layers, so both kinds run.
    budget = max(minimum, (cap - (512 << 20)) if cap else minimum + (shape.num_layers // 2) * layer_bytes)
    plan = plan_streaming(model, budget, num_slots=NUM_SLOTS, kv_bytes=kv, activation_bytes=activations)
    for index in plan.resident_layers:
        layers[index].to(device)
    _allocated(device, stages, f"{len(plan.resident_layers)} resident layers on the device")
    folder = tempfile.TemporaryDirectory(prefix="kvboost-gpu-check-")
    engine = CudaCopyEngine(device, NUM_SLOTS) if device.type == "cuda" else CpuCopyEngine(folder.name, NUM_SLOTS)
    streamer = enable_streaming(model, plan, engine)
    _allocated(device, stages, "streaming enabled (slots)")
    report = {"allocated_gb_by_stage": stages, "plan_budget_gb": plan.budget_bytes / 2**30,
              "plan_reserved_gb": plan.reserved_bytes / 2**30, "slot_gb": plan.slot_bytes / 2**30,
              "resident_gb": plan.resident_bytes / 2**30, "model": shape.name, "num_layers": shape.num_layers,
              "layer_mb": layer_bytes / 2**20,
              "cap_gb": cap / 2**30 if cap else None, "budget_gb": budget / 2**30,
              "resident_layers": len(plan.resident_layers), "streamed_layers": len(plan.streamed_layers)}
    if not plan.streams:
        report["note"] = "everything fits: nothing streamed"
        return report
    first = plan.streamed_layers[0]
    image, layout = engine.host(first), streamer.layouts[first]
    one_copy, per_tensor = _copy_bandwidth(image, layout, device, iters)
    _allocated(device, stages, "copy bandwidth measured")
    x1 = torch.randn(1, 1, shape.hidden, device=device, dtype=torch.bfloat16)
    resident_one = plan.resident_layers[0] if plan.resident_layers else None
    copy_s = _timed(lambda: (engine.issue(first, 0), engine.wait(0), engine.release(0)), device, iters)
    compute_s = _timed(lambda: layers[resident_one](x1), device, iters) if resident_one is not None else float("nan")
    pass_1 = _timed(lambda: model(x1), device, iters)
    _allocated(device, stages, "one-token passes")
    x8 = torch.randn(1, 8, shape.hidden, device=device, dtype=torch.bfloat16)
    pass_8 = _timed(lambda: model(x8), device, iters)
    x512 = torch.randn(1, 512 if not dry_run else 64, shape.hidden, device=device, dtype=torch.bfloat16)
    prefill_s = _timed(lambda: model(x512), device, max(1, iters // 4))
    bound = one_copy / plan.streamed_bytes  # tokens/s the link allows: every streamed byte crosses once a token
    decode = 1 / pass_1
    report.update({
        "pinned_one_copy_gb_s": one_copy / 1e9, "pinned_per_tensor_gb_s": per_tensor / 1e9,
        "streamed_mb_per_token": plan.streamed_bytes / 2**20,
        "copy_ms_per_layer": 1e3 * copy_s, "compute_ms_per_layer": 1e3 * compute_s,
        "overlapped_ms_per_layer": 1e3 * pass_1 / shape.num_layers,
        "decode_tokens_per_s": decode, "bound_tokens_per_s": bound, "share_of_bound": decode / bound,
        "prefill_tokens_per_s": x512.shape[1] / prefill_s, "pass_8_over_pass_1": pass_8 / pass_1,
        "tokens_per_pass": streamer.stats()["tokens_per_pass"],
    })
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        report.update({"vram_peak_gb": peak / 2**30, "within_cap": peak <= cap})
    if device.type == "cuda":  # disable() makes every layer resident again: the capped card never holds them all
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    streamer.disable()
    folder.cleanup()
    return report


def table(report: dict) -> str:
    if "note" in report:
        return f"streaming: {report['note']}"
    keys = ["model", "num_layers", "resident_layers", "streamed_layers", "layer_mb", "pinned_one_copy_gb_s",
            "pinned_per_tensor_gb_s", "copy_ms_per_layer", "compute_ms_per_layer", "overlapped_ms_per_layer",
            "decode_tokens_per_s", "bound_tokens_per_s", "share_of_bound", "prefill_tokens_per_s",
            "pass_8_over_pass_1", "vram_peak_gb", "cap_gb"]
    cells = [report.get(k, "-") for k in keys]
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys),
                      "| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |"])

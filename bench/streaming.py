"""`python -m bench streaming`: int4 layer streaming against the same int4 model held resident, in one process:
decode and prefill speed, the weight bytes held on the compute device against the budget, and whether the greedy
tokens and logits stay the same bit for bit.

Rows: all layers resident; every layer streamed through k slots for each k of --slots (the smallest budget); and
half the layers resident with the first k (a budget halfway). The model is the default one (or --model) quantized
to int4 at load (load_model(weights="int4"): a GGUF's Q4 blocks as they are); each streamed row is a copy of it
made before streaming. On the CPU the streamed layers live in a memory-mapped file in a temporary folder (or
--folder) and are copied into a RAM arena (CpuCopyEngine); on CUDA in pinned host memory (CudaCopyEngine).

All rows stay loaded and are timed interleaved, step by step (median step), so a stall of the shared machine hits
them alike. Decode: greedy steps with a DynamicCache after a ~128-token prefill; prefill: ~512 tokens, best of two.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from typing import Sequence

import torch
from transformers import DynamicCache

from bench.decode import prompt_ids
from engine.weights.copy_engines import CpuCopyEngine, CudaCopyEngine
from engine.weights.loader import load_model, pick_device, quiet_transformers, resolve_source
from engine.weights.streaming import decoder_layers, enable_streaming, kv_cache_bytes, layer_layout, plan_streaming
from engine.weights.weights_report import weights_report

MIB = 1 << 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def decode_run(models: dict, ids: list[int], num_new: int, device) -> tuple[dict, dict, dict]:
    """({row: decode tokens/s (median step)}, {row: greedy tokens}, {row: logits of every step}): each decode step
    runs on every row in turn."""
    caches, tokens, logits, steps = {}, {}, {}, {name: [] for name in models}
    for name, model in models.items():
        caches[name] = DynamicCache()
        out = model(input_ids=torch.tensor([ids], device=device), past_key_values=caches[name], use_cache=True)
        logits[name] = [out.logits[0, -1].float().cpu()]
        tokens[name] = [int(out.logits[0, -1].argmax())]
    for _ in range(num_new):
        for name, model in models.items():
            start = time.perf_counter()
            out = model(input_ids=torch.tensor([[tokens[name][-1]]], device=device), past_key_values=caches[name],
                        use_cache=True)
            sync(device)
            steps[name].append(time.perf_counter() - start)
            logits[name].append(out.logits[0, -1].float().cpu())
            tokens[name].append(int(out.logits[0, -1].argmax()))
    return {name: 1 / statistics.median(s) for name, s in steps.items()}, tokens, logits


@torch.inference_mode()
def prefill_speed(models: dict, ids: list[int], device, repeats: int = 2) -> dict[str, float]:
    """{row: prefill tokens/s, the best of `repeats`}, rows interleaved."""
    best = {name: 0.0 for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model(input_ids=torch.tensor([ids], device=device), past_key_values=DynamicCache(), use_cache=True,
                  logits_to_keep=1)
            sync(device)
            best[name] = max(best[name], len(ids) / (time.perf_counter() - start))
    return best


def run(source=None, device="cpu", slots: Sequence[int] = (2, 4), num_new: int = 16, decode_context: int = 128,
        prefill_tokens: int = 512, folder: str | None = None) -> list[dict]:
    quiet_transformers()
    dev = pick_device(device)
    model, tokenizer = load_model(resolve_source(source), dev, torch.float32, weights="int4")
    t0 = time.perf_counter()
    report = weights_report(model)
    kv = kv_cache_bytes(model, prefill_tokens + num_new)
    with tempfile.TemporaryDirectory(prefix="bench-streaming-", dir=folder) as scratch:
        everything = plan_streaming(model, 1 << 60, kv_bytes=kv)
        half = sum(layer_layout(layer).tensor_bytes for layer in decoder_layers(model)) // 2
        budgets = [(k, plan_streaming(model, 1 << 60, num_slots=k, kv_bytes=kv).min_budget_bytes) for k in slots]
        budgets.append((slots[0], budgets[0][1] + half))
        models, plans, streamers = {"resident": model}, {"resident": everything}, {}
        for k, budget in budgets:
            copy_ = copy.deepcopy(model)
            plan = plan_streaming(copy_, budget, num_slots=k, kv_bytes=kv)
            name = f"k={k}, {len(plan.streamed_layers)}/{len(decoder_layers(copy_))} layers streamed"
            engine = CudaCopyEngine(dev, k) if dev.type == "cuda" else CpuCopyEngine(scratch, k)
            streamers[name] = enable_streaming(copy_, plan, engine)
            models[name], plans[name] = copy_, plan
        decode_run(models, prompt_ids(tokenizer, 16), 2, dev)  # warm-up: first-call costs
        before = {name: dict(s.stats()) for name, s in streamers.items()}
        decode_tps, tokens, logits = decode_run(models, prompt_ids(tokenizer, decode_context), num_new, dev)
        print(f"  decode done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        prefill_tps = prefill_speed(models, prompt_ids(tokenizer, prefill_tokens, offset=200), dev)
        print(f"  prefill done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        rows = []
        for name, model_ in models.items():
            plan, streamer = plans[name], streamers.get(name)
            decoded = {key: streamer.stats()[key] - before[name][key] for key in ("bytes_copied", "weight_passes")} \
                if streamer else {"bytes_copied": 0, "weight_passes": 0}
            rows.append({
                "row": name, "format": report.format, "kernel": report.kernel,
                "budget_mib": plan.budget_bytes / MIB if plan.streams else float("nan"),
                "min_budget_mib": plan.min_budget_bytes / MIB,
                "weights_mib": (streamer.resident_bytes() if streamer else report.resident_bytes) / MIB,
                "planned_mib": plan.device_bytes / MIB,
                "copied_mib_per_pass": decoded["bytes_copied"] / max(1, decoded["weight_passes"]) / MIB,
                "tokens_per_pass": streamer.stats()["tokens_per_pass"] if streamer else float("nan"),
                "prefill_tps": prefill_tps[name], "decode_tps": decode_tps[name],
                "same_tokens": tokens[name] == tokens["resident"],
                "same_logits": all(torch.equal(a, b) for a, b in zip(logits[name], logits["resident"])),
            })
        for streamer in streamers.values():
            streamer.disable()  # closes the layer files before the folder goes
    return rows


def table(rows: list[dict], decode_context: int, prefill_tokens: int) -> str:
    head = ("| row | weights | budget MiB | min budget MiB | held on device MiB (weights + slots) | planned MiB "
            f"(+ KV, activations) | MiB copied / weight pass | prefill tok/s @{prefill_tokens} | "
            f"decode tok/s @{decode_context} | same tokens | same logits |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['row']} | {r['format']} {r['kernel']} | {r['budget_mib']:.1f} | "
                     f"{r['min_budget_mib']:.1f} | "
                     f"{r['weights_mib']:.1f} | {r['planned_mib']:.1f} | {r['copied_mib_per_pass']:.1f} | "
                     f"{r['prefill_tps']:.0f} | {r['decode_tps']:.1f} | {'yes' if r['same_tokens'] else 'NO'} | "
                     f"{'yes' if r['same_logits'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench streaming", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--slots", default="2,4", help="slot counts of the all-streamed rows, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed")
    parser.add_argument("--context", type=int, default=128, help="the prompt before the decode steps, in tokens")
    parser.add_argument("--prefill", type=int, default=512, help="the prefill timed, in tokens")
    parser.add_argument("--folder", default=None, help="where the CPU rows' layer files go (default: the temp dir)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine spinning intra-op threads make step "
                             "times swing; 0 keeps torch's default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows = run(args.model, args.device, [int(k) for k in args.slots.split(",")], args.new_tokens, args.context,
               args.prefill, args.folder)
    print(f"threads: {torch.get_num_threads()}, torch {torch.__version__}")
    print(table(rows, args.context, args.prefill))
    return 0


if __name__ == "__main__":
    sys.exit(main())

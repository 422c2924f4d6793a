"""`python -m bench exactness`: does reuse ever change an answer? Greedy answers with EXACT/PREFIX hits against
uncached runs on the same weights, over many prompts, for each weight format the embedded model loads in.

For each prompt (a passage of the Python documentation as the system message, a question about it):
  1. the cached engine answers it cold (storing the prompt's chunks and, after the answer, the answer's);
  2. it answers the same messages again (an EXACT hit of the whole prompt);
  3. it answers a follow-up turn (the first turn and its answer reused: PREFIX/EXACT hits, a new suffix);
each answer against an engine with reuse="off" on the same loaded weights. A divergence is a prompt whose greedy
tokens differ anywhere; the rate is divergences over answers compared. Weight formats (FORMATS, `--formats`):
float (the file dequantized), int4 (weights="auto": the file's Q4_1 codes on torch's int4 kernel), q4_1-blocks
(the same codes as the file's blocks on the block kernel, engine.weights.gguf_blocks), and from a Q8_0 copy of the
embedded model written by llama.cpp's quantizer (when llama-cpp-python is found: KVBOOST_LLAMA_PYTHON or this
Python) q8_0-blocks (auto: its blocks) and int8-rows (torch's kernels: int8 rows of its values).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# row -> (source: None the embedded model, "q8" its Q8_0 copy; weights; kernel)
FORMATS = {"float": (None, "float", "auto"), "int4": (None, "auto", "auto"),
           "q4_1-blocks": (None, "auto", "gguf_blocks"), "q8_0-blocks": ("q8", "auto", "auto"),
           "int8-rows": ("q8", "auto", "cpu_int4pack")}
QUESTIONS = ("What is this passage about? Answer in one sentence.", "Give one example from the passage.")
FOLLOW_UP = "Explain that in simpler words."


def q8_0_copy() -> Path | None:
    """The embedded model requantized to Q8_0 by llama.cpp's quantizer (cached), or None without llama.cpp."""
    from bench.shapes import LLAMA_QUANTIZE, cache_folder, llama_python
    from engine.weights.loader import default_model_path

    target = cache_folder() / "SmolLM2-135M-Instruct.Q8_0.gguf"
    if target.is_file():
        return target
    python = llama_python()
    if python is None:
        return None
    part = target.with_suffix(".part")
    done = subprocess.run([python, "-c", LLAMA_QUANTIZE, str(default_model_path()), str(part), "2",
                           "LLAMA_FTYPE_MOSTLY_Q8_0"], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"llama.cpp's quantizer failed, no int8 row: {done.stderr[-500:]}", file=sys.stderr)
        return None
    part.replace(target)
    return target


def prompts(tokenizer, count: int) -> list[list[dict]]:
    from bench.text import Corpus

    corpus = Corpus(tokenizer)
    out: list[list[dict]] = []
    while len(out) < count:
        _name, passages = corpus.passages(200, 2)
        for passage in passages:
            for question in QUESTIONS:
                out.append([{"role": "system", "content": f"Answer from this passage.\n\n{passage}"},
                            {"role": "user", "content": question}])
    return out[:count]


def run_format(label: str, source, weights: str, count: int, new_tokens: int, kernel: str = "auto") -> dict:
    from engine import KVBoost

    cached = KVBoost.from_pretrained(source, device="cpu", weights=weights, kernel=kernel, disk_cache_bytes=0,
                                     quiet=True)
    plain = cached.with_options(reuse="off")
    compared = diverged = reused = 0
    kinds: dict[str, int] = {}
    t0 = time.perf_counter()
    for number, messages in enumerate(prompts(cached.tokenizer, count), 1):
        first = cached.chat(messages, max_new_tokens=new_tokens)
        again = cached.chat(messages, max_new_tokens=new_tokens)
        follow = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": FOLLOW_UP}]
        turn2 = cached.chat(follow, max_new_tokens=new_tokens)
        want = (plain.chat(messages, max_new_tokens=new_tokens), plain.chat(follow, max_new_tokens=new_tokens))
        for got, expected in ((first, want[0]), (again, want[0]), (turn2, want[1])):
            compared += 1
            diverged += got.token_ids != expected.token_ids
        for result in (again, turn2):
            reused += result.stats.reused_tokens
            for _start, _end, kind in result.stats.chunks:
                kinds[kind] = kinds.get(kind, 0) + 1
        print(f"  {label}: prompt {number}/{count}, {diverged} diverged of {compared}", file=sys.stderr, flush=True)
    return {"format": label, "weights": f"{cached.info().weights.format} ({cached.info().weights.kernel})",
            "prompts": count,
            "answers_compared": compared, "diverged": diverged, "rate": diverged / compared,
            "reused_tokens": reused, "chunk_kinds": kinds, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench exactness", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--new", type=int, default=32, help="greedy tokens per answer")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"any of {', '.join(FORMATS)}")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    wanted = args.formats.split(",")
    unknown = [f for f in wanted if f not in FORMATS]
    if unknown:
        parser.error(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    q8 = q8_0_copy() if any(FORMATS[f][0] == "q8" for f in wanted) else None
    rows = []
    for name in wanted:
        source, weights, kernel = FORMATS[name]
        if source == "q8" and q8 is None:
            print(f"  {name}: skipped (no Q8_0 copy without llama.cpp)", file=sys.stderr)
            continue
        rows.append(run_format(name, str(q8) if source == "q8" else None, weights, args.prompts, args.new, kernel))
    print("| weights | format | prompts | answers compared | diverged | rate | reused tokens | hits |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        hits = ", ".join(f"{k} {v}" for k, v in sorted(r["chunk_kinds"].items()))
        print(f"| {r['format']} | {r['weights']} | {r['prompts']} | {r['answers_compared']} | {r['diverged']} | "
              f"{r['rate']:.1%} | {r['reused_tokens']} | {hits} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["diverged"] == 0 for r in rows) else 1

"""KV tiers, side by side in one run: restart from the disk tier vs cold prefill in fresh processes, eviction
policies on a skewed document trace, memory per 1k tokens per kv_quant, and quantized-KV answer quality.

    python bench/kv_tiers.py                 # everything (about 5 minutes on a laptop CPU)
    python bench/kv_tiers.py restart trace   # some sections
    python bench/kv_tiers.py --json out.json

Not a pass/fail test: target lines say PASS or MISS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTIONS = ("restart", "trace", "memory", "quality")
NUM_DOCS = 5
DOC_TOKENS = 380  # the rag workload's documents (bench.text.FULL)
RESTART_PROCESSES = 3


def rag_messages(tokenizer, num_docs=NUM_DOCS, doc_tokens=DOC_TOKENS):
    """The rag workload's prompt: documents from the Python docs and a question, as one user message."""
    from bench.text import Corpus

    corpus = Corpus(tokenizer)
    docs = [corpus.passages(doc_tokens, 1) for _ in range(num_docs)]
    parts = [f"Document {i + 1} ({topic}):\n{text}" for i, (topic, (text,)) in enumerate(docs)]
    question = f"Which document explains {docs[-1][0]!r}, and what does it say about it? Answer briefly."
    content = "Answer using these documents.\n\n" + "\n\n".join(parts) + f"\n\nQuestion: {question}"
    return [{"role": "user", "content": content}]


# -- restart: one child process per measurement -------------------------------------------------------------
def child(argv) -> int:
    """`--child warm|restore FOLDER QUANT`: load the model, then warm the rag prompt into FOLDER, or measure in
    this fresh process: the rag prompt served from the disk tier, then the same prompt with cold prefill."""
    from cli.kvboost import quiet_transformers
    from engine import KVBoost

    quiet_transformers()
    action, folder, quant = argv
    base = KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0)
    messages = rag_messages(base.tokenizer)
    engine = base.with_options(disk_cache_dir=folder, disk_cache_bytes=None, kv_quant=quant, cpu_cache_bytes=0)
    if action == "warm":
        ids = engine.encode(messages)
        info = engine.warm(ids[:-1])  # everything but the last token: the next request reuses all of it
        print(json.dumps({"tokens": info["tokens"], "stored": info["entries_stored"]}))
        return 0
    cold = base.with_options(reuse="off")
    base.with_options(reuse="off").generate("Hello", max_new_tokens=2)  # one-time torch start-up costs
    restored = engine.generate(messages, max_new_tokens=8)
    plain = cold.generate(messages, max_new_tokens=8)
    disk = engine.cache_stats().tiers.disk
    print(json.dumps({
        "prompt_tokens": restored.stats.prompt_tokens, "restore_ttft_ms": restored.stats.ttft_ms,
        "cold_ttft_ms": plain.stats.ttft_ms, "reused_by_tier": restored.stats.reused_by_tier,
        "read_bytes": disk.read_bytes, "read_ms": disk.read_ms, "same_tokens": restored.token_ids ==
        plain.token_ids}))
    return 0


def run_child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_restart(print_) -> dict:
    results = {}
    for quant in ("none", "int8"):
        with tempfile.TemporaryDirectory() as folder:
            warm = run_child("warm", folder, quant)
            runs = [run_child("restore", folder, quant) for _ in range(RESTART_PROCESSES)]
        restore = statistics.median(r["restore_ttft_ms"] for r in runs)
        cold = statistics.median(r["cold_ttft_ms"] for r in runs)
        read_mb_s = statistics.median(r["read_bytes"] / 1e6 / (r["read_ms"] / 1000) for r in runs)
        results[quant] = {"warm": warm, "runs": runs, "restore_ttft_ms": restore, "cold_ttft_ms": cold,
                          "speedup": cold / restore, "read_mb_s": read_mb_s,
                          "read_mb": runs[0]["read_bytes"] / 1e6}
    print_("## Restart: rag prompt in a fresh process, disk tier vs cold prefill\n")
    print_(f"{NUM_DOCS} documents of ~{DOC_TOKENS} tokens + a question; each row is the median of "
           f"{RESTART_PROCESSES} fresh processes (model loaded, then the prompt from disk, then the same prompt "
           "with plain prefill, after one tiny warm-up request). Bandwidth: payload bytes read and checked / "
           "time in the disk tier's reads. The files are in the OS page cache (written just before), as after "
           "a quick app restart.\n")
    print_("| disk kv_quant | prompt tokens | from disk | cold TTFT | restore TTFT | speedup | read | read bandwidth | "
           "same greedy tokens |")
    print_("|---|---|---|---|---|---|---|---|---|")
    for quant, r in results.items():
        run = r["runs"][0]
        print_(f"| {quant} | {run['prompt_tokens']} | {run['reused_by_tier'].get('disk', 0)} | "
               f"{r['cold_ttft_ms']:.0f} ms | {r['restore_ttft_ms']:.0f} ms | {r['speedup']:.1f}x | "
               f"{r['read_mb']:.1f} MB | {r['read_mb_s']:.0f} MB/s | "
               f"{sum(x['same_tokens'] for x in r['runs'])}/{len(r['runs'])} |")
    lossless = results["none"]["speedup"]  # the default: reuse never changes an answer
    print_(f"\nTarget >= 10x faster TTFT from the lossless (default) disk tier: "
           f"{'PASS' if lossless >= 10 else 'MISS'} ({lossless:.1f}x)\n")
    return results


# -- trace: eviction policies on a skewed document trace -----------------------------------------------------
def zipf_trace(num_hot: int, num_cold: int, length: int, hot_share: float, seed: int) -> list[int]:
    """Document ids: `hot_share` of the requests go to `num_hot` documents (Zipf-weighted among them), the rest
    uniformly to `num_cold` long-tail documents."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(num_hot)]
    cold = [num_hot + i for i in range(num_cold)]
    trace = []
    for _ in range(length):
        if rng.random() < hot_share:
            trace.append(rng.choices(range(num_hot), weights)[0])
        else:
            trace.append(rng.choice(cold))
    return trace


def bench_trace(engine, print_, policies: dict | None = None, seed: int = 12) -> dict:
    """Replays the trace against the real chunk store (device tier only) under a tight budget, with real KV
    (each document's chunks computed once by the model): a request looks up its document's chunks by chained
    key, counts hits, and stores the misses, as the engine does."""
    from engine.chunking import chunk_spans
    from engine.keys import content_key
    from engine.kv.eviction import POLICIES
    from engine.kv.records import kv_nbytes
    from engine.kv.store import ChunkStore
    from engine.plan import chain_keys
    from engine.prefill import slice_kv

    num_hot, num_cold, doc_tokens = 6, 60, 256
    rng = random.Random(7)
    vocab = engine.tokenizer.vocab_size
    scratch = engine.with_options(disk_cache_bytes=0, cpu_cache_bytes=0)
    docs = []  # (keys, tokens per chunk, kv per chunk)
    for d in range(num_hot + num_cold):
        ids = [rng.randrange(100, vocab - 100) for _ in range(doc_tokens)]
        spans, num_complete = chunk_spans(ids, scratch.config.reuse.chunking, scratch._breaks)
        keys = chain_keys(ids, spans, num_complete, scratch._root)
        kv = scratch.model(input_ids=__import__("torch").tensor([ids]), use_cache=True).past_key_values
        layers = tuple((layer.keys, layer.values) for layer in kv.layers)
        docs.append([(keys[i], ids[s:e], slice_kv(layers, s, e)) for i, (s, e) in enumerate(spans[:num_complete])])
    chunk_bytes = kv_nbytes(docs[0][0][2])
    budget = chunk_bytes * 2 * (num_hot + 2)  # the hot set and a little more
    results = {}
    for hot_share in (0.5, 0.7, 0.9):
        trace = zipf_trace(num_hot, num_cold, 600, hot_share, seed=seed)
        row = {}
        for name, make_policy in (policies or POLICIES).items():
            store = ChunkStore(budget, make_policy())
            hits = lookups = 0
            for d in trace:
                parent = scratch._root
                for key, tokens, kv in docs[d]:
                    lookups += 1
                    record = store.get_chunk(key)
                    if record is not None:
                        hits += 1
                        store.touch(record, "EXACT")
                    else:
                        store.put_chunk(key, parent, content_key("bench", tokens), 0, tokens, kv)
                    parent = key
            row[name] = hits / lookups
        results[hot_share] = row
    print_("## Eviction: skewed document trace under a tight budget\n")
    print_(f"{num_hot} hot documents (Zipf-weighted) and {num_cold} long-tail documents (the rest of the requests, "
           f"uniformly), {doc_tokens} tokens each, 600 requests (trace seed {seed}; importance-LRU's hit_weight "
           f"was picked on seed 11); device-tier budget = {budget // chunk_bytes} chunks (the hot set is "
           f"{2 * num_hot}). Hit rate = chunks found / chunks looked up.\n")
    print_("| share of requests to hot documents | LRU hit rate | importance-LRU hit rate | relative |")
    print_("|---|---|---|---|")
    for share, row in results.items():
        rel = row["importance-lru"] / row["lru"] - 1 if row["lru"] else math.inf
        print_(f"| {share:.0%} | {row['lru']:.1%} | {row['importance-lru']:.1%} | {rel:+.0%} |")
    mean_rel = statistics.mean(r["importance-lru"] / r["lru"] - 1 for r in results.values() if r["lru"])
    print_(f"\nTarget importance-LRU >= 10% relative better: {'PASS' if mean_rel >= 0.10 else 'MISS'} "
           f"(mean {mean_rel:+.0%})\n")
    return {str(k): v for k, v in results.items()}


# -- memory per 1k tokens --------------------------------------------------------------------------------------
def bench_memory(engine, print_) -> dict:
    import torch

    from engine.kv.payload_file import encode_file
    from engine.kv.records import kv_nbytes
    from engine.kv.tiers import encode_kv

    messages = rag_messages(engine.tokenizer)
    ids = engine.encode(messages)[:1024]
    out = engine.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    kv = tuple((layer.keys, layer.values) for layer in out.layers)
    chunks = [tuple((k[:, :, s:s + 128], v[:, :, s:s + 128]) for k, v in kv) for s in range(0, len(ids), 128)]
    fp16 = sum(2 * (k.numel() + v.numel()) for k, v in kv)
    per_1k = 1000 / len(ids)
    results = {"computed": {"bytes": kv_nbytes(kv) * per_1k, "dtype": str(kv[0][0].dtype)},
               "fp16": {"bytes": fp16 * per_1k}}
    for quant in ("none", "int8", "int4"):
        stored = [encode_kv(c, quant, torch.device("cpu")) for c in chunks]
        files = sum(len(encode_file(s, "ns", b"k" * 16)) for s in stored)
        results[quant] = {"bytes": sum(s.nbytes for s in stored) * per_1k, "file_bytes": files * per_1k}
    print_("## Memory per 1k tokens of cached context\n")
    print_(f"{Path(engine.name).name}: {engine.model.config.num_hidden_layers} layers, "
           f"{engine.model.config.num_key_value_heads} KV heads of {kv[0][0].shape[-1]}; chunks of 128 tokens.\n")
    print_("| kv_quant | in memory | on disk (with headers) | vs float16 |")
    print_("|---|---|---|---|")
    for quant in ("none", "int8", "int4"):
        r = results[quant]
        print_(f"| {quant}{' (' + results['computed']['dtype'].replace('torch.', '') + ')' if quant == 'none' else ''} "
               f"| {r['bytes'] / 2**20:.2f} MiB | {r['file_bytes'] / 2**20:.2f} MiB | "
               f"{fp16 * per_1k / r['bytes']:.2f}x smaller |")
    print_(f"| float16 (reference) | {fp16 * per_1k / 2**20:.2f} MiB | | 1.00x |")
    int8 = fp16 * per_1k / results["int8"]["bytes"]
    int4 = fp16 * per_1k / results["int4"]["bytes"]
    print_(f"\nTargets int8 >= 1.9x, int4 >= 3.5x smaller than float16: "
           f"{'PASS' if int8 >= 1.9 else 'MISS'} ({int8:.2f}x), {'PASS' if int4 >= 3.5 else 'MISS'} ({int4:.2f}x)\n")
    return results


# -- quality of quantized reuse -------------------------------------------------------------------------------
def bench_quality(engine, print_, num_prompts: int = 8) -> dict:
    """Each prompt: documents warmed into a store that keeps KV as `kv_quant` (device tier), then the question
    served from it, vs the same with unquantized reuse (itself identical to plain prefill)."""
    import torch

    from bench.text import Corpus

    corpus = Corpus(engine.tokenizer)
    prompts = []
    for _ in range(num_prompts):
        topic, (a, b) = corpus.passages(300, 2)
        prompts.append(([{"role": "system", "content": f"Documentation of {topic}:\n\n{a}\n\n{b}"}],
                        {"role": "user", "content": f"What does the documentation of {topic!r} say? Be brief."}))
    results = {}
    reference = {}
    for quant in ("none", "int8", "int4"):
        first = agree32 = 0
        prefix_lens, kls = [], []
        for i, (system, question) in enumerate(prompts):
            eng = engine.with_options(disk_cache_bytes=0, cpu_cache_bytes=0, kv_quant={"device": quant})
            eng.warm(system)
            result = eng.chat(system + [question], max_new_tokens=32, return_logits=True)
            if quant == "none":
                reference[i] = result
                continue
            ref = reference[i]
            first += result.token_ids[:1] == ref.token_ids[:1]
            agree32 += result.token_ids == ref.token_ids
            n = 0
            while n < min(len(result.token_ids), len(ref.token_ids)) and result.token_ids[n] == ref.token_ids[n]:
                n += 1
            prefix_lens.append(n)
            p = torch.log_softmax(ref.first_logits.double(), -1)
            q = torch.log_softmax(result.first_logits.double(), -1)
            kls.append(float((p.exp() * (p - q)).sum()))
        if quant != "none":
            results[quant] = {"first_token": first / num_prompts, "all_32": agree32 / num_prompts,
                              "mean_common_prefix": statistics.mean(prefix_lens), "mean_kl": statistics.mean(kls)}
    print_("## Quality of quantized KV on the real model\n")
    print_(f"{num_prompts} prompts (two ~300-token documentation passages in the system message, a question); "
           "the documents are warmed into a store keeping KV as kv_quant, the question reuses them. Compared "
           "with unquantized reuse (greedy, 32 tokens); KL of the next-token distribution at the first answer "
           "token.\n")
    print_("| kv_quant | first token agrees | all 32 tokens agree | mean common prefix | mean KL |")
    print_("|---|---|---|---|---|")
    for quant, r in results.items():
        print_(f"| {quant} | {r['first_token']:.0%} | {r['all_32']:.0%} | {r['mean_common_prefix']:.1f} tokens | "
               f"{r['mean_kl']:.5f} |")
    print_()
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sections", nargs="*", choices=(*SECTIONS, []), default=[])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sections = args.sections or list(SECTIONS)

    from cli.kvboost import quiet_transformers
    from engine import KVBoost

    quiet_transformers()
    lines: list[str] = []

    def print_(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    import torch

    print_(f"# KV tiers bench\n\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
           f"{os.cpu_count()} CPUs\n")
    results = {}
    engine = None
    if set(sections) - {"restart"}:
        engine = KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        if "memory" in sections:
            results["memory"] = bench_memory(engine, print_)
        if "trace" in sections:
            results["trace"] = bench_trace(engine, print_)
    if "quality" in sections:
        results["quality"] = bench_quality(engine, print_)
    if "restart" in sections:
        results["restart"] = bench_restart(print_)
    print_(f"_{time.perf_counter() - t0:.0f} s_")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TTFT through the OpenAI-compatible server, reuse on vs off side by side, and concurrent streams.

Two servers run in this process on free loopback ports over one loaded model: one engine with reuse="chunk",
one with reuse="off". Every request goes to "off" first, then to "chunk", so machine noise hits both alike.
TTFT is measured by the client: from sending the request to the first streamed content token, through the real
`openai` package.

    python bench/server.py               # rag + multiturn + concurrency (about 5 minutes on a laptop CPU)
    python bench/server.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stream_ttft(client, messages, max_tokens) -> tuple[float, float, str, dict]:
    """(TTFT ms, total ms, text, kvboost stats) of one streamed chat request."""
    t0 = time.perf_counter()
    ttft, text, stats = None, "", {}
    for chunk in client.chat.completions.create(model="bench", messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.content or ""
        if delta and ttft is None:
            ttft = (time.perf_counter() - t0) * 1000
        text += delta
        if chunk.choices[0].finish_reason:
            stats = chunk.model_extra.get("kvboost", {})
    total = (time.perf_counter() - t0) * 1000
    return ttft if ttft is not None else total, total, text, stats


def workloads(tokenizer, quick: bool):
    from bench.text import Corpus

    corpus = Corpus(tokenizer)
    num_docs, doc_tokens, turns = (3, 150, 3) if quick else (5, 380, 6)
    docs = [corpus.passages(doc_tokens, 1) for _ in range(num_docs)]
    doc_text = "\n\n".join(f"Document {i + 1} ({topic}):\n{text}" for i, (topic, (text,)) in enumerate(docs))
    rag = [[{"role": "system", "content": "Answer using these documents.\n\n" + doc_text},
            {"role": "user", "content": f"What does the document about {topic!r} say? Answer briefly."}]
           for topic, _ in docs]
    topic, passages = corpus.passages(120 if quick else 150, turns)
    return {"rag": rag, "multiturn": (topic, passages)}


def run(quick: bool = False) -> int:
    import openai

    from cli.kvboost import quiet_transformers
    from engine import KVBoost
    from server.thread import ServerThread

    quiet_transformers()
    max_tokens = 8 if quick else 32
    base = KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0)
    servers = {mode: ServerThread(base.with_options(reuse=mode), model_id="bench").start() for mode in ("off", "chunk")}
    assert all(s.wait_started(30) for s in servers.values()), "a server did not start"
    clients = {mode: openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=600)
               for mode, s in servers.items()}
    for client in clients.values():
        stream_ttft(client, [{"role": "user", "content": "Hi"}], 2)  # one-time start-up costs
    texts = workloads(base.tokenizer, quick)
    rows = []
    for q, messages in enumerate(texts["rag"]):
        row = {"workload": "rag", "step": f"question {q + 1}"}
        for mode, client in clients.items():
            row[mode] = stream_ttft(client, messages, max_tokens)
        rows.append(row)
    topic, passages = texts["multiturn"]
    history: list[dict] = []
    for t, passage in enumerate(passages):
        history.append({"role": "user", "content": f"Explain this passage about {topic} briefly.\n\n{passage}"})
        row = {"workload": "multiturn", "step": f"turn {t + 1}"}
        for mode, client in clients.items():
            row[mode] = stream_ttft(client, history, max_tokens)
        rows.append(row)
        history.append({"role": "assistant", "content": row["off"][2]})

    print(f"# Server bench{' (quick)' if quick else ''}\n")
    print(f"{Path(base.name).name} on CPU, greedy, {max_tokens} new tokens; TTFT measured by the openai client "
          "(request sent -> first streamed token), through HTTP on 127.0.0.1.\n")
    print("| workload | request | prompt tokens | reused | TTFT reuse off | TTFT reuse on | speedup | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        off, on = row["off"], row["chunk"]
        print(f"| {row['workload']} | {row['step']} | {on[3].get('prompt_tokens', '?')} | "
              f"{on[3].get('reused_tokens', 0) / max(1, on[3].get('prompt_tokens', 1)):.0%} | {off[0]:.0f} ms | "
              f"{on[0]:.0f} ms | {off[0] / on[0]:.1f}x | {'yes' if off[2] == on[2] else 'no'} |")
    for workload in ("rag", "multiturn"):
        later = [r for r in rows if r["workload"] == workload][1:]
        off = statistics.mean(r["off"][0] for r in later)
        on = statistics.mean(r["chunk"][0] for r in later)
        print(f"\n{workload}, requests after the first: mean TTFT {off:.0f} ms off vs {on:.0f} ms on = "
              f"{off / on:.1f}x")

    print("\n## Concurrent streams (reuse on)\n")
    print("N clients send the same-sized chat request at once (each its own question); the server decodes them "
          "together (continuous batching; `python -m bench batching` compares it with one at a time).\n")
    print("| streams | TTFT first / median / last | total time per stream (median) | all finished in |")
    print("|---|---|---|---|")
    for n in (1, 2, 4) if quick else (1, 2, 4, 8):
        results: list = [None] * n

        def ask(i):
            messages = [{"role": "user", "content": f"Question {i}: name {i + 2} animals that live in the sea."}]
            results[i] = stream_ttft(clients["chunk"], messages, max_tokens)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = (time.perf_counter() - t0) * 1000
        ttfts = sorted(r[0] for r in results)
        print(f"| {n} | {ttfts[0]:.0f} / {statistics.median(ttfts):.0f} / {ttfts[-1]:.0f} ms | "
              f"{statistics.median(r[1] for r in results):.0f} ms | {wall:.0f} ms |")
    for s in servers.values():
        s.stop()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    return run(args.quick)


if __name__ == "__main__":
    sys.exit(main())

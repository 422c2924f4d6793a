"""Continuous batching through the real server: N concurrent streams, one at a time (--max-batch 1, the server as
it was) against decoded together (the default), side by side in one run, through the `openai` client on
127.0.0.1.

For N = 1, 2, 4, 8 streams (each its own question, greedy, the same max_tokens) it measures the time until all
have finished, the aggregate decode rate (completion tokens of all streams / that time) and the median TTFT,
and checks that every stream's text is the same on both servers. Then a newcomer: the TTFT of one request sent
while 7 others are decoding, against its TTFT alone on the same server.

    python -m bench batching                   # float weights, 48 new tokens per stream
    python -m bench batching --weights int4 --tokens 32
    python -m bench batching --weights int4 --engine-only   # the same streams without HTTP and clients
    python -m bench batching --engine-only --streams 8 --model FILE.gguf   # a real model's size (bench shapes)
    python -m bench batching --weights int4 --engine-only --streams 8 --by-step   # what a forward costs by requests

`--by-step` also times every forward pass of both workers (decoding steps only, no prompt pieces) by the number of
requests in it, one new token each: a pass of k requests against k passes of one is the most batching can gain
at k requests, whatever the Python around the passes costs. Each pass is also taken apart: inside the layers' one C
call its phases (the weights' products, the activations' rounding for them, attention, the row steps: norms,
rotary, residual adds, gating), the rest of that call (mostly the Python that prepares it: the requests' caches'
bookkeeping), the head, and the Python around them (the checks before the call, the final norm's
wrapper and the logits split between the requests after it).

`--engine-only` sends the same questions straight to the engine's worker (engine.worker.EngineWorker, max_batch 1
against 8; the chat template applied here), no server, no HTTP, no client threads: what batching gains in the
engine alone, against what reaches a client.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QUESTIONS = ["Name {n} animals that live in the sea.", "Give {n} tips for sleeping well.",
             "List {n} countries in Europe and their capitals.", "Describe {n} uses of a paperclip.",
             "Name {n} famous scientists and what they found.", "Give {n} reasons to learn to cook.",
             "List {n} fruits that are red.", "Explain {n} ways to save energy at home."]


def stream(client, question: str, max_tokens: int, started: threading.Event | None = None) -> dict:
    """One streamed chat request: TTFT and total ms (client side), text, completion tokens, kvboost stats."""
    t0 = time.perf_counter()
    ttft, text, stats, tokens = None, "", {}, 0
    for chunk in client.chat.completions.create(model="bench", messages=[{"role": "user", "content": question}],
                                                temperature=0, max_tokens=max_tokens, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.content or ""
        if delta and ttft is None:
            ttft = (time.perf_counter() - t0) * 1000
            if started is not None:
                started.set()
        text += delta
        if chunk.choices[0].finish_reason:
            stats = chunk.model_extra.get("kvboost", {})
    total = (time.perf_counter() - t0) * 1000
    return {"ttft": ttft if ttft is not None else total, "total": total, "text": text, "tokens": tokens,
            "stats": stats}


def concurrent(client, questions: list[str], max_tokens: int) -> tuple[float, list[dict]]:
    """All questions sent at once, each from its own thread: (wall ms until the last finished, results)."""
    results: list = [None] * len(questions)

    def ask(i):
        results[i] = stream(client, questions[i], max_tokens)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - t0) * 1000, results


def newcomer(client, question: str, max_tokens: int, others: list[str]) -> dict:
    """`question` sent once every one of `others` has its first token (they are decoding)."""
    started = [threading.Event() for _ in others]
    results: list = [None] * len(others)

    def ask(i):
        results[i] = stream(client, others[i], max_tokens * 3, started[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(others))]
    for t in threads:
        t.start()
    for event in started:
        event.wait(600)
    result = stream(client, question, max_tokens)
    result["others_done_before"] = sum(r is not None for r in results)
    for t in threads:
        t.join()
    return result


def run(weights: str, max_tokens: int, counts: list[int], model: str | None = None) -> int:
    import openai

    from cli.kvboost import quiet_transformers
    from engine import KVBoost
    from server.thread import ServerThread

    quiet_transformers()
    base = KVBoost.from_pretrained(model, device="cpu", disk_cache_bytes=0, weights=weights, quiet=True)
    servers = {"fifo": ServerThread(base.with_options(), model_id="bench", max_batch=1).start(),
               "batched": ServerThread(base.with_options(), model_id="bench", max_batch=8).start()}
    assert all(s.wait_started(30) for s in servers.values()), "a server did not start"
    clients = {name: openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=900)
               for name, s in servers.items()}
    for client in clients.values():
        stream(client, "Hi", 2)  # one-time start-up costs
    rows = []
    for n in counts:
        questions = [QUESTIONS[i % len(QUESTIONS)].format(n=3 + i // len(QUESTIONS)) for i in range(n)]
        row = {"n": n}
        for name, client in clients.items():  # FIFO first, then batched: machine noise hits both alike
            row[name] = concurrent(client, questions, max_tokens)
        rows.append(row)
    late = "Name three colors of the rainbow."
    others = [QUESTIONS[i].format(n=5) for i in range(7)]
    arrivals = {}
    for name, client in clients.items():
        alone = stream(client, late, max_tokens)
        joined = newcomer(client, late, max_tokens, others)
        arrivals[name] = (alone, joined)
    for s in servers.values():
        s.stop()

    print(f"# Batching bench ({weights} weights)\n")
    print(f"{Path(base.name).name} on CPU, greedy, up to {max_tokens} new tokens per stream; every stream its own "
          "question, sent at once through the openai client to kvboost-server on 127.0.0.1. `one at a time` is "
          "--max-batch 1 (the server before batching), `batched` the default (8).\n")
    print("| streams | all done, one at a time | all done, batched | sooner | tok/s one at a time | tok/s batched "
          "| median TTFT one at a time / batched | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        (fifo_ms, fifo), (batch_ms, batched) = row["fifo"], row["batched"]
        same = sum(a["text"] == b["text"] for a, b in zip(fifo, batched))
        fifo_rate = sum(r["tokens"] for r in fifo) / (fifo_ms / 1000)
        batch_rate = sum(r["tokens"] for r in batched) / (batch_ms / 1000)
        print(f"| {row['n']} | {fifo_ms / 1000:.1f} s | {batch_ms / 1000:.1f} s | {fifo_ms / batch_ms:.2f}x | "
              f"{fifo_rate:.1f} | {batch_rate:.1f} | {statistics.median(r['ttft'] for r in fifo):.0f} / "
              f"{statistics.median(r['ttft'] for r in batched):.0f} ms | {same}/{row['n']} |")
    print("\nA newcomer sent while 7 streams decode, against the same request alone on the same server:\n")
    print("| server | TTFT alone | TTFT while 7 decode | ratio | same text |")
    print("|---|---|---|---|---|")
    for name, (alone, joined) in arrivals.items():
        label = "one at a time" if name == "fifo" else "batched"
        print(f"| {label} | {alone['ttft']:.0f} ms | {joined['ttft']:.0f} ms | {joined['ttft'] / alone['ttft']:.2f}x "
              f"| {'yes' if alone['text'] == joined['text'] else 'no'} |")
    return 0


PHASES = ("products", "rounding", "attention", "row steps")  # block_forward.c's, in kvb_forward_phases' order


class Pass(NamedTuple):
    """One forward pass timed by ForwardTimes: its requests and tokens, whether a prompt piece was among them, its
    seconds, and of those: the one-call forward's layers (OneCallForward._layers_over: the C call and the Python
    that prepares it), the linears run from Python (BlockLinear.forward: the head, where the layers run in one C
    call), and inside the layers' C call each of PHASES."""

    requests: int
    tokens: int
    prompt: bool
    seconds: float
    layers: float
    linears: float
    phases: tuple[float, ...]


class ForwardTimes:
    """While entered, every forward pass of a request (engine.runner.ModelRunner.forward, one alone) or of several
    (engine.batching.Batch._answer with more than one) is timed and taken apart: `passes`, a Pass each."""

    def __init__(self):
        self.passes: list[Pass] = []
        self._parts = [0.0, 0.0]  # the pass running: its layers' and its Python-run linears' seconds so far

    def __enter__(self):
        import ctypes

        from engine.batching import Batch
        from engine.block_forward import OneCallForward
        from engine.runner import ModelRunner
        from engine.weights import gguf_blocks
        from engine.weights.gguf_blocks import BlockLinear

        self._originals = answer, forward, layers, linear = (Batch._answer, ModelRunner.forward,
                                                             OneCallForward._layers_over, BlockLinear.forward)
        passes, parts = self.passes, self._parts
        library = None if gguf_blocks.unavailable("cpu") else gguf_blocks.library()
        sums = (ctypes.c_double * len(PHASES))()

        def phases() -> tuple[float, ...]:
            if library is None:
                return (0.0,) * len(PHASES)
            library.kvb_forward_phases(sums)
            return tuple(sums)

        def timed(run, forwards):
            tokens, prompt = sum(len(f.tokens) for f in forwards), any(f.prompt for f in forwards)
            parts[:] = [0.0, 0.0]
            before = phases()
            start = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - start
            spent = tuple(after - earlier for after, earlier in zip(phases(), before))
            passes.append(Pass(len(forwards), tokens, prompt, seconds, *parts, spent))
            return out

        def part(index, run):
            start = time.perf_counter()
            try:
                return run()
            finally:
                parts[index] += time.perf_counter() - start

        def answer_timed(batch, members, engine):
            if len(members) == 1:  # its one forward is ModelRunner.forward's
                return answer(batch, members, engine)
            return timed(lambda: answer(batch, members, engine), [m.waiting for m in members])

        Batch._answer = answer_timed
        ModelRunner.forward = lambda runner, item: timed(lambda: forward(runner, item), [item])
        OneCallForward._layers_over = lambda self, ids, segments: part(0, lambda: layers(self, ids, segments))
        BlockLinear.forward = lambda self, x: part(1, lambda: linear(self, x))
        self._library = library
        if library is not None:
            library.kvb_forward_timing(1)
        return self

    def __exit__(self, *exc_info) -> None:
        from engine.batching import Batch
        from engine.block_forward import OneCallForward
        from engine.runner import ModelRunner
        from engine.weights.gguf_blocks import BlockLinear

        if self._library is not None:
            self._library.kvb_forward_timing(0)
        Batch._answer, ModelRunner.forward, OneCallForward._layers_over, BlockLinear.forward = self._originals

    def table(self) -> list[str]:
        """Decoding passes (one token a request) by requests: the median ms, k one-request passes against it, and
        the medians of its parts: inside the layers' C call each of PHASES, then the rest of that call (mostly the
        Python that prepares it), the linears run from Python (the head), and the rest (Python around them)."""
        by: dict[int, list[tuple[float, ...]]] = {}
        for p in self.passes:
            if not p.prompt and p.tokens == p.requests:
                by.setdefault(p.requests, []).append((p.seconds, *p.phases, p.layers - sum(p.phases), p.linears,
                                                      p.seconds - p.layers - p.linears))
        one = statistics.median(row[0] for row in by[1]) if 1 in by else None
        lines = ["| requests in a pass | passes | median ms | k passes of one / this one | "
                 + " | ".join(PHASES) + " | the rest of the layers' call | head | Python around |",
                 "|---|---|---|---|" + "---|" * (len(PHASES) + 3)]
        for k in sorted(by):
            ms, *parts = (1000 * statistics.median(column) for column in zip(*by[k]))
            gain = f"{k * one / (ms / 1000):.2f}x" if one else "-"
            lines.append(f"| {k} | {len(by[k])} | {ms:.2f} | {gain} | " + " | ".join(f"{x:.2f}" for x in parts) + " |")
        return lines


def engine_only(weights: str, max_tokens: int, counts: list[int], rounds: int = 3, model: str | None = None,
                document: int = 0, same_document: bool = False, by_step: bool = False) -> int:
    """The streams of `run` through two engine workers, one at a time (max_batch 1) against batched (8): the
    median over `rounds` of the wall time until all finished. With `document` > 0 every stream asks about its own
    passage of ~that many tokens (chat tabs over dropped files), each prompt read once by both workers before the
    rounds, so the rounds time answers over long cached contexts; `same_document`: all of them about the first
    passage (one file asked about in several conversations), each its own question."""
    from cli.kvboost import quiet_transformers
    from engine import KVBoost
    from engine.generate import Result
    from engine.worker import EngineWorker

    quiet_transformers()
    base = KVBoost.from_pretrained(model, device="cpu", disk_cache_bytes=0, weights=weights, quiet=True)
    workers = {"fifo": (EngineWorker(name="bench-fifo", max_batch=1), base.with_options()),
               "batched": (EngineWorker(name="bench-batched", max_batch=8), base.with_options())}

    def all_done(name: str, prompts: list[list[int]]) -> tuple[float, list[str]]:
        worker, engine = workers[name]
        start = time.perf_counter()
        jobs = [worker.submit(lambda cancel, ids=ids: engine.stream(ids, cancel=cancel, max_new_tokens=max_tokens,
                                                                    temperature=0.0)) for ids in prompts]
        texts = [next(event.text for event in job if isinstance(event, Result)) for job in jobs]
        return time.perf_counter() - start, texts

    passages = []
    if document:
        from bench.text import Corpus

        corpus = Corpus(base.tokenizer)
        while len(passages) < max(counts):
            passages += corpus.passages(document, 4)[1]
    print(f"# Batching in the engine alone ({Path(base.name).name}, {base.info().weights.format} weights, up to "
          f"{max_tokens} new tokens per stream, medians of {rounds} rounds"
          + (f", every stream over {'one' if same_document else 'its own'} ~{document}-token passage, read before "
             "the rounds" if document else "")
          + ")\n")
    steps: dict[int, list[str]] = {}
    print("| streams | all done, one at a time | all done, batched | sooner | same text |")
    print("|---|---|---|---|---|")
    for n in counts:
        questions = [QUESTIONS[i % len(QUESTIONS)].format(n=3 + i // len(QUESTIONS)) for i in range(n)]
        if document:
            asks = ["In {k} short points, what does the text above explain?", "Which {k} words of the text above "
                    "matter most?", "Write {k} questions the text above answers.", "Summarize the text above in {k} "
                    "sentences."]
            questions = [f"{passages[0]}\n\n" + asks[i % 4].format(k=3 + i // 4) if same_document else
                         f"{passages[i]}\n\nIn {3 + i % 3} short points, what does the text above explain?"
                         for i in range(n)]
        prompts = [list(base.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=True)["input_ids"])
                   for q in questions]
        for name in workers:
            all_done(name, prompts if document else prompts[:1])  # one-time start-up costs (and the passages)
        seconds = {name: [] for name in workers}
        texts = {}
        with ForwardTimes() if by_step else contextlib.nullcontext() as timed:
            for _ in range(rounds):  # alternating: the machine's noise hits both alike
                for name in workers:
                    spent, texts[name] = all_done(name, prompts)
                    seconds[name].append(spent)
        fifo, batched = statistics.median(seconds["fifo"]), statistics.median(seconds["batched"])
        same = sum(a == b for a, b in zip(texts["fifo"], texts["batched"]))
        print(f"| {n} | {fifo:.2f} s | {batched:.2f} s | {fifo / batched:.2f}x | {same}/{n} |")
        if timed is not None:
            steps[n] = timed.table()
    for n, lines in steps.items():
        print(f"\nThe forward passes of {n} streams' rounds (both ways), decoding steps only:\n")
        print("\n".join(lines))
    for worker, _ in workers.values():
        worker.stop()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or hub name (default: the embedded model)")
    parser.add_argument("--weights", default="float", choices=["float", "int4", "auto"])
    parser.add_argument("--tokens", type=int, default=48, help="max new tokens per stream (default 48)")
    parser.add_argument("--streams", default="1,2,4,8", help="comma-separated stream counts (default 1,2,4,8)")
    parser.add_argument("--engine-only", action="store_true",
                        help="the same streams straight to the engine's worker: no server, HTTP or clients")
    parser.add_argument("--rounds", type=int, default=3, help="with --engine-only: rounds each way (median)")
    parser.add_argument("--document", type=int, default=0,
                        help="with --engine-only: every stream asks about its own passage of ~this many tokens")
    parser.add_argument("--same-document", action="store_true",
                        help="with --document: every stream asks about the same passage (its own question)")
    parser.add_argument("--by-step", action="store_true",
                        help="with --engine-only: also the forward passes' times by the requests in them")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.streams.split(",")]
    except ValueError:
        parser.error(f"--streams: comma-separated counts, got {args.streams!r}")
    if not counts or any(not 1 <= n <= 64 for n in counts) or args.rounds < 1 or args.tokens < 1:
        parser.error("--streams: counts from 1 to 64; --rounds and --tokens: at least 1")
    if not 0 <= args.document <= 8000 or (args.document and not args.engine_only) or \
            (args.same_document and not args.document):
        parser.error("--document: 0 to 8000 tokens, with --engine-only; --same-document: with --document")
    if args.by_step and not args.engine_only:
        parser.error("--by-step: with --engine-only")
    if args.engine_only:
        return engine_only(args.weights, args.tokens, counts, args.rounds, args.model, args.document,
                           args.same_document, args.by_step)
    return run(args.weights, args.tokens, counts, args.model)


if __name__ == "__main__":
    sys.exit(main())

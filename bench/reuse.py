"""Side-by-side time-to-first-token of the reuse modes on three workloads, in one process, on one model.

Every request is sent to each engine ("off" first, then the other modes: "prefix" and "chunk" by default)
before the next request, so machine noise hits all modes alike. The engines share the loaded weights; each
workload starts them with empty stores. Text is the Python documentation that ships with Python
(`pydoc_data.topics`), cut to token budgets with the engine's own tokenizer, so runs are reproducible without
downloads.

The first request of a workload has nothing to reuse in any mode; medians, reuse and agreement in the
summary are over the requests after it ("warm" requests). Greedy decoding throughout: "agree" compares a
mode's generated token ids with those of "off" on the same prompt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from dataclasses import asdict
from typing import Sequence, TextIO

import torch

from engine.config import REUSE_MODES

from .modes import PEER, engine_for, mode_options
from .needle_qa import run_needle
from .results import REFERENCE, Target, Workload, step_table, summary_table, workload_dict
from .steps import Progress, add_approx_targets, measure
from .text import FULL, QUICK, Corpus, Sizes, Texts, cut_texts, permutations

DEFAULT_MODES = ("off", "prefix", "chunk")
WORKLOADS = ("multiturn", "sysprompt", "rag", "needle")

SPEEDUP_TARGET = 5.0
FLAT_TTFT_TARGET = 1.3  # chunk TTFT of the last turn over that of turn 2


TURN_QUESTIONS = (
    "What is this passage about, in one sentence?",
    "Which Python keywords does it mention?",
    "Give a short example of what it describes.",
    "What mistake could a beginner make here?",
    "Which terms does it define?",
    "How does this relate to the previous passage?",
    "What is the most important rule in it?",
    "Summarize everything so far in two sentences.",
)
SYSTEM_QUESTIONS = (
    "What is the main subject of this documentation?",
    "Which statement is described first?",
    "Name one keyword that appears in the grammar.",
    "What happens when an exception is raised?",
    "Is there an example of nested blocks?",
    "Which section would a beginner read first?",
    "What does the word 'suite' mean here?",
    "List two rules from the text.",
)


def warm_up(engines: dict) -> None:
    """One tiny request per engine, so the first measured request pays no one-time costs; then empty stores."""
    for engine in engines.values():
        engine.chat([{"role": "user", "content": "Say hi."}], max_new_tokens=2)
        engine.clear_cache()


def run_multiturn(engines, texts: Texts, corpus: Corpus, sizes: Sizes, progress: Progress) -> Workload:
    wl = Workload("multiturn", f"one chat of {sizes.num_turns} turns; each user turn is a ~{sizes.turn_tokens}"
                  f"-token passage of {texts.turn_topic!r} and a question; the history holds the replies of "
                  f"{REFERENCE!r}",
                  {"topic": texts.turn_topic, "num_turns": sizes.num_turns, "turn_tokens": sizes.turn_tokens,
                   "max_new_tokens": sizes.max_new_tokens})
    history: list[dict] = []
    for turn, passage in enumerate(texts.turn_passages, start=1):
        question = TURN_QUESTIONS[(turn - 1) % len(TURN_QUESTIONS)]
        history.append({"role": "user", "content": f"Passage {turn}:\n\n{passage}\n\n{question}"})
        progress(f"multiturn: turn {turn}/{sizes.num_turns}")
        step = measure(engines, f"turn {turn}", history, sizes.max_new_tokens)
        wl.steps.append(step)
        # Every mode continues the same conversation: the reference reply goes into the history.
        history.append({"role": "assistant", "content": step.requests[REFERENCE].text})
    second, last = wl.warm_steps()[0], wl.steps[-1]
    for mode in wl.modes[1:]:
        wl.targets.append(Target(wl.name, mode, f"{last.label} TTFT speedup vs off",
                                 last.requests[REFERENCE].ttft_ms / last.requests[mode].ttft_ms,
                                 SPEEDUP_TARGET, True))
    if "chunk" in wl.modes:
        wl.targets.append(Target(wl.name, "chunk", f"{last.label} / {second.label} TTFT",
                                 last.requests["chunk"].ttft_ms / second.requests["chunk"].ttft_ms,
                                 FLAT_TTFT_TARGET, False))
    return wl


def run_sysprompt(engines, texts: Texts, corpus: Corpus, sizes: Sizes, progress: Progress) -> Workload:
    system = f"You answer questions about this part of the Python reference.\n\n{texts.system_doc}"
    wl = Workload("sysprompt", f"a ~{sizes.system_tokens}-token system prompt ({texts.system_topic!r}) and "
                  f"{sizes.num_questions} different short questions",
                  {"topic": texts.system_topic, "system_tokens": corpus.count_tokens(system),
                   "num_questions": sizes.num_questions, "max_new_tokens": sizes.max_new_tokens})
    for q in range(sizes.num_questions):
        progress(f"sysprompt: question {q + 1}/{sizes.num_questions}")
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": SYSTEM_QUESTIONS[q % len(SYSTEM_QUESTIONS)]}]
        wl.steps.append(measure(engines, f"question {q + 1}", messages, sizes.max_new_tokens))
    summary = wl.summary()
    for mode in wl.modes[1:]:
        wl.targets.append(Target(wl.name, mode, f"median TTFT speedup vs off (questions 2..{sizes.num_questions})",
                                 summary[mode]["speedup"], SPEEDUP_TARGET, True))
    return wl


def run_rag(engines, texts: Texts, corpus: Corpus, sizes: Sizes, progress: Progress) -> Workload:
    docs = texts.docs
    orders = permutations(len(docs), sizes.num_queries)
    wl = Workload("rag", f"{len(docs)} documents of ~{sizes.doc_tokens} tokens and a question, "
                  f"{sizes.num_queries} queries, each with the documents in a different order (no target: "
                  "reordered documents are left to approximate reuse)",
                  {"topics": [t for t, _ in docs], "doc_tokens": [corpus.count_tokens(d) for _, d in docs],
                   "orders": orders, "num_queries": sizes.num_queries, "max_new_tokens": sizes.max_new_tokens})
    for q, order in enumerate(orders):
        progress(f"rag: query {q + 1}/{sizes.num_queries}")
        parts = [f"Document {i + 1} ({docs[d][0]}):\n{docs[d][1]}" for i, d in enumerate(order)]
        asked = docs[order[-1 - q % len(docs)]][0]
        question = f"Which document explains {asked!r}, and what does it say about it? Answer briefly."
        content = "Answer using these documents.\n\n" + "\n\n".join(parts) + f"\n\nQuestion: {question}"
        label = f"query {q + 1} [{' '.join(str(d + 1) for d in order)}]"
        messages = [{"role": "user", "content": content}]
        step = measure(engines, label, messages, sizes.max_new_tokens)
        ids = engines[REFERENCE].encode(messages)
        for request in step.requests.values():
            request.doc_hit_pct = doc_hit_pct(engines[REFERENCE], ids, [d[1] for d in docs], request.chunks)
        wl.steps.append(step)
    add_approx_targets(wl)
    return wl


def doc_hit_pct(engine, ids: list[int], doc_texts: list[str], chunks) -> float:
    """Share of the documents' tokens that `chunks` rows serve from the store. Each document is found in the
    prompt by its own tokens (the first and last two dropped: they may merge with neighbours)."""
    covered = total = 0
    for text in doc_texts:
        core = engine.tokenizer(text, add_special_tokens=False)["input_ids"][2:-2]
        start = next((i for i in range(len(ids) - len(core) + 1) if ids[i:i + len(core)] == core), None)
        if start is None:
            continue
        end = start + len(core)
        total += len(core)
        covered += sum(max(0, min(e, end) - max(s, start)) for s, e, kind in chunks if kind != "MISS")
    return 100 * covered / total if total else 0.0


def runners() -> dict:
    return {"multiturn": run_multiturn, "sysprompt": run_sysprompt, "rag": run_rag, "needle": run_needle}


# -- reporting ----------------------------------------------------------------------------------------------
def _meta(engine, modes: Sequence[str], quick: bool) -> dict:
    import transformers

    return {
        "model": engine.name, "device": str(engine.device), "dtype": str(next(engine.model.parameters()).dtype),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "machine": platform.platform(), "chunking": asdict(engine.config.reuse.chunking), "modes": list(modes),
        "quick": quick,
    }


# -- entry points -------------------------------------------------------------------------------------------
def run(workloads: list[str], *, engine=None, out: TextIO = sys.stdout, quick: bool = False,
        modes: Sequence[str] = DEFAULT_MODES, progress: Progress | None = None, needle_warm: str = "alone") -> dict:
    """Runs the named workloads ("all" for every one) and prints Markdown tables to `out`. Returns every raw
    number as a JSON-ready dict. `engine`: a loaded KVBoost (default: the embedded model); its reuse setting
    does not matter, each of `modes` gets its own engine over the same weights ("off" is always run: it is
    the reference)."""
    names = list(WORKLOADS) if "all" in workloads else list(dict.fromkeys(workloads))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"workloads must be among {WORKLOADS + ('all',)}, got {workloads!r}")
    modes = list(dict.fromkeys([REFERENCE, *modes]))
    for mode in modes:
        mode_options(mode)  # raises ValueError naming a bad one
    if PEER in modes:
        from .peer import peer_available

        reason = peer_available()
        if reason is not None:
            print(f"(peer row skipped: {reason})\n", file=out)
            modes.remove(PEER)
    if len(modes) < 2:
        raise ValueError(f"name at least one mode besides {REFERENCE!r}, got {list(modes)!r}")
    progress = progress or (lambda _msg: None)
    if engine is None:
        from engine.engine import KVBoost

        progress("loading model")
        engine = KVBoost.from_pretrained(disk_cache_bytes=0)  # every run starts cold: no entries from the last
    sizes = dataclasses.replace(QUICK if quick else FULL, needle_warm=needle_warm)
    t_start = time.perf_counter()
    meta = _meta(engine, modes, quick)
    chunking = engine.config.reuse.chunking
    print(f"# KVBoost bench{' (quick)' if quick else ''}\n", file=out)
    print(f"model {meta['model']} on {meta['device']} ({meta['dtype']}), torch {meta['torch']} with "
          f"{meta['torch_threads']} threads, transformers {meta['transformers']}, chunks of "
          f"{chunking.size} ({chunking.mode}); greedy, {sizes.max_new_tokens} new "
          "tokens per request. Summary numbers exclude each workload's first (cold) request.\n", file=out)

    corpus = Corpus(engine.tokenizer)
    texts = cut_texts(corpus, sizes)
    done: list[Workload] = []
    for name in WORKLOADS:
        if name not in names:
            continue
        engines = {mode: engine_for(engine, mode) for mode in modes}
        warm_up(engines)
        wl = runners()[name](engines, texts, corpus, sizes, progress)
        done.append(wl)
        print(f"## {wl.name}\n\n{wl.description}.\n\n{step_table(wl, sizes.max_new_tokens)}\n", file=out)
        for target in wl.targets:
            print(f"- {target.line()}", file=out)
        print(file=out, flush=True)
    targets = [t for wl in done for t in wl.targets]
    print(f"## summary\n\n{summary_table(done, sizes.max_new_tokens)}\n", file=out)
    for target in targets:
        print(f"- {target.line()}", file=out)
    wall_s = time.perf_counter() - t_start
    print(f"\n{len(done)} workload(s) in {wall_s:.0f} s", file=out, flush=True)
    meta["wall_s"] = wall_s
    return {"meta": meta, "workloads": {wl.name: workload_dict(wl) for wl in done}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvboost bench",
        description="Time to first token of reuse modes off / prefix / chunk, side by side (see bench/README.md).")
    parser.add_argument("workloads", nargs="*", default=["all"], metavar="WORKLOAD",
                        help=f"any of {', '.join(WORKLOADS)}, or all (default)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: fewer, shorter requests")
    parser.add_argument("--json", metavar="PATH", help="also write every raw number to PATH")
    parser.add_argument("--model", metavar="SOURCE", default=None,
                        help="model folder, .gguf file or cached hub id (default: embedded SmolLM2-135M)")
    parser.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:1, ...")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated reuse modes to compare with off, among {', '.join(REUSE_MODES)} "
                             f"(default: {','.join(DEFAULT_MODES)})")
    parser.add_argument("--needle-warm", choices=("alone", "layout"), default="alone",
                        help="needle: reuse engines warm each document alone after the system prompt (default, as "
                             "the app does), or all of them in one prompt (each one's KV saw others before it)")
    args = parser.parse_args(argv)
    bad = [w for w in args.workloads if w not in WORKLOADS + ("all",)]
    if bad:
        parser.error(f"unknown workload(s) {', '.join(bad)}; choose from {', '.join(WORKLOADS)}, all")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        for mode in modes:
            mode_options(mode)
    except ValueError as exc:
        parser.error(str(exc))
    if not [m for m in modes if m != REFERENCE]:
        parser.error(f"--modes takes reuse modes besides off, got {args.modes!r}")

    from engine.engine import KVBoost

    def progress(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    try:
        # Opened before the run, so an unwritable path fails now rather than after minutes of measuring.
        json_file = open(args.json, "w", encoding="utf-8") if args.json else None
    except OSError as exc:
        print(f"kvboost bench: cannot write --json file: {exc}", file=sys.stderr)
        return 1
    progress("loading model")
    try:
        engine = KVBoost.from_pretrained(args.model, device=args.device, disk_cache_bytes=0)
    except ValueError as exc:  # ModelLoadError, UnsupportedModelError, a bad device
        print(f"kvboost bench: {exc}", file=sys.stderr)
        return 1
    results = run(args.workloads, engine=engine, quick=args.quick, modes=modes, progress=progress,
                  needle_warm=args.needle_warm)
    if json_file is not None:
        with json_file:
            json.dump(results, json_file, indent=1)
        progress(f"raw numbers written to {args.json}")
    return 0

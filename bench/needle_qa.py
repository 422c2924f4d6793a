"""The needle-QA workload of `kvboost bench`: what approximate reuse costs in answers (bench.needle)."""

from __future__ import annotations

from . import needle
from .results import REFERENCE, Target, Workload
from .steps import add_approx_targets, measure

ACCURACY_SLACK_POINTS = 2.0


def run_needle(engines, texts, corpus, sizes, progress) -> Workload:
    docs = needle.make_documents(num_docs=sizes.needle_docs, chars=sizes.needle_chars)
    questions = needle.make_questions(docs, sizes.needle_questions, docs_per_prompt=sizes.needle_docs_per_prompt)
    warmed = ("pre-warmed each document alone, as the app does for a dropped file" if sizes.needle_warm == "alone"
              else "pre-warmed all the documents in one prompt after the system prompt, in the order they were "
                   "made (each document's KV saw other documents before it)")
    wl = Workload("needle", f"{len(questions)} questions, each over {sizes.needle_docs_per_prompt} of "
                  f"{len(docs)} documents (~{sizes.needle_chars} characters of Python documentation, one planted "
                  f"5-digit code each) in a new order; every reuse engine {warmed}; accuracy = the code is in the "
                  "reply",
                  {"num_docs": len(docs), "num_questions": len(questions), "chars": sizes.needle_chars,
                   "docs_per_prompt": sizes.needle_docs_per_prompt, "warm": sizes.needle_warm})
    for mode, engine in engines.items():
        if mode != REFERENCE:
            if sizes.needle_warm == "layout":
                engine.warm(needle.layout_messages(docs, list(range(len(docs)))))
                continue
            for doc in docs:
                engine.warm(needle.warm_messages(doc))
    for i, question in enumerate(questions, start=1):
        progress(f"needle: question {i}/{len(questions)}")
        step = measure(engines, f"q{i} {question.answer} [{' '.join(str(d + 1) for d in question.doc_order)}]",
                       needle.messages_for(docs, question), max_new_tokens=24)
        for request in step.requests.values():
            request.correct = needle.is_correct(request.text, question)
        wl.steps.append(step)
    add_approx_targets(wl)
    summary = wl.summary()
    for mode in wl.modes[1:]:
        gap = summary[REFERENCE]["accuracy_pct"] - summary[mode]["accuracy_pct"]
        wl.targets.append(Target(wl.name, mode, "accuracy points below off", gap, ACCURACY_SLACK_POINTS, False,
                                 unit=""))
    return wl

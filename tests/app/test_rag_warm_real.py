"""The retrieved layout's approximate pre-warm on the real model: passages warmed as questions carry them (behind
the system message, labelled, among other passages) give answers closer to full prefill than passages warmed
alone.

Measured on these four prompts (KL of the approximate next-token distribution from full prefill's; no repair,
then CacheBlend): warmed alone 0.153 / 0.055, warmed in the layout 0.058 / 0.021; the share of the prompt reused
rises from 0.86-0.92 to 0.91-0.93 (the labels are reused too)."""

from __future__ import annotations

import pytest
from quality import kl

from app import rag
from bench import needle

SYSTEM = "You are a helpful assistant."
ORDERS = [(2, 0, 3), (1, 4, 5), (5, 3, 0), (4, 1, 2)]


@pytest.fixture(scope="module")
def workload():
    docs = needle.make_documents(num_docs=6, chars=700)
    rows = [({"name": f"{d.name}.txt"}, [{"id": i, "text": d.text, "page": None, "section": None}])
            for i, d in enumerate(docs)]
    prompts = []
    for order in ORDERS:
        hits = [{**rows[k][1][0], "name": rows[k][0]["name"]} for k in order]
        question = f"What is the archive code of the {docs[order[-1]].name} collection?"
        prompts.append([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": rag.retrieved_user_prompt(question, hits, set())}])
    return rows, prompts


def mean_kl(smollm, warm_inputs, prompts, refs) -> float:
    engine = smollm.with_options(reuse="approx", repair="none", disk_cache_bytes=0)
    engine.clear_cache()
    for item in warm_inputs:
        engine.warm(item)
    kls = []
    for messages, ref in zip(prompts, refs):
        result = engine.chat(messages, max_new_tokens=1, return_logits=True)
        assert sum(e - s for s, e, kind in result.stats.chunks if kind == "APPROXIMATE") > \
            0.8 * result.stats.prompt_tokens  # the passages were found
        kls.append(kl(ref.first_logits, result.first_logits))
    return sum(kls) / len(kls)


def test_passages_warmed_as_questions_carry_them_answer_closer_to_full_prefill(smollm, workload):
    rows, prompts = workload
    refs = [smollm.with_options(reuse="off").chat(m, max_new_tokens=1, return_logits=True) for m in prompts]
    alone = mean_kl(smollm, [p["text"] for _, passages in rows for p in passages], prompts, refs)
    layout = mean_kl(smollm, rag.warm_inputs(SYSTEM, "retrieved", rows, approximate=True), prompts, refs)
    assert layout < 0.6 * alone, (layout, alone)

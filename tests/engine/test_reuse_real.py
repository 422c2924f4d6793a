"""EXACT and PREFIX reuse on the real model reproduce full prefill: logits and greedy tokens."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch
from transformers import DynamicCache

from engine.prefill import prefill

DOC = pydoc_data.topics.topics["assignment"][:3000]
QUESTION = "In one sentence, what does an augmented assignment do?"


def reused_logits(eng, ids):
    plan = eng._plan(ids, eng.config.reuse.mode)
    with torch.inference_mode():
        logits, _ = prefill(eng.model, plan, eng.store, DynamicCache(), eng.device)
    return plan, logits


@pytest.mark.parametrize("reuse", ["chunk", "prefix"])
def test_reuse_after_warm_reproduces_full_prefill_logits(smollm, reuse):
    eng = smollm.with_options(reuse=reuse)
    eng.warm([{"role": "system", "content": DOC}])
    ids = eng.encode([{"role": "system", "content": DOC}, {"role": "user", "content": QUESTION}])
    plan, logits = reused_logits(eng, ids)
    kinds = {kind for _, _, kind in plan.chunk_rows()}
    assert plan.reused_tokens > 0.8 * len(ids)
    assert ("EXACT" if reuse == "chunk" else "PREFIX") in kinds
    full = eng.full_prefill_logits(ids)
    assert torch.max(torch.abs(logits - full)).item() < 1e-4


def test_warm_then_generate_64_greedy_tokens_identical_across_modes(smollm):
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": QUESTION}]
    outputs = {}
    for reuse in ("off", "prefix", "chunk"):
        eng = smollm.with_options(reuse=reuse)
        eng.warm([messages[0]])
        res = eng.chat(messages, max_new_tokens=64)
        outputs[reuse] = res
    assert outputs["off"].stats.reused_tokens == 0
    assert outputs["chunk"].stats.reused_tokens > 0.8 * outputs["chunk"].stats.prompt_tokens
    assert outputs["prefix"].stats.reused_tokens > 0.8 * outputs["prefix"].stats.prompt_tokens
    assert len(outputs["off"].token_ids) >= 16
    assert outputs["prefix"].token_ids == outputs["off"].token_ids
    assert outputs["chunk"].token_ids == outputs["off"].token_ids


@pytest.mark.slow
def test_eight_turn_chat_is_identical_and_recomputes_only_new_text(smollm):
    topics = ["for", "while", "if", "function", "class", "try", "with", "import"]
    engines = {reuse: smollm.with_options(reuse=reuse) for reuse in ("off", "prefix", "chunk")}
    history: list[dict] = []
    previous_prompt, previous_answer = 0, []
    for turn, topic in enumerate(topics, start=1):
        history.append({"role": "user", "content": f"Explain the Python `{topic}` statement briefly. "
                                                    + pydoc_data.topics.topics[topic][:300]})
        results = {reuse: eng.chat(history, max_new_tokens=64) for reuse, eng in engines.items()}
        off = results["off"]
        for reuse in ("prefix", "chunk"):
            assert results[reuse].token_ids == off.token_ids, f"turn {turn}: {reuse} diverged from full prefill"
        if turn > 1:
            chunk = results["chunk"].stats
            # Everything up to the previous answer is reused; only the re-rendered end of the previous answer
            # and the new message are computed.
            assert chunk.reused_tokens >= previous_prompt
            new_tokens = chunk.prompt_tokens - previous_prompt - len(previous_answer)
            assert chunk.recomputed_tokens <= new_tokens + 8
        previous_prompt = off.stats.prompt_tokens
        previous_answer = off.token_ids
        history.append({"role": "assistant", "content": off.text})


def test_chunk_mode_reuses_chunks_after_a_miss(smollm):
    eng = smollm.with_options(reuse="chunk")
    ids = eng.encode(DOC)
    eng.warm(ids)
    plan = eng._plan(ids + [13], "chunk")
    eng.store._remove(plan.keys[2])  # a hole: chunk 2 is gone, chunks 3.. stay
    plan, logits = reused_logits(eng, ids + [13])
    kinds = [kind for _, _, kind in plan.chunk_rows()]
    assert kinds[:3] == ["EXACT", "EXACT", "MISS"]
    assert "EXACT" in kinds[3:]
    full = eng.full_prefill_logits(ids + [13])
    assert torch.max(torch.abs(logits - full)).item() < 1e-4


def test_identical_prompt_twice_recomputes_only_the_last_token(smollm):
    eng = smollm.with_options(reuse="chunk")
    messages = [{"role": "user", "content": DOC[:2000]}]
    first = eng.chat(messages, max_new_tokens=8)
    second = eng.chat(messages, max_new_tokens=8)
    assert second.stats.recomputed_tokens == 1
    assert second.token_ids == first.token_ids


def test_default_model_knows_the_capital_of_france(smollm):
    res = smollm.with_options().chat([{"role": "user", "content": "What is the capital of France?"}],
                                     max_new_tokens=24)
    assert "Paris" in res.text
    assert res.finish_reason == "stop"
    assert res.stats.ttft_ms > 0


def test_chunk_rows_cover_the_prompt_in_order(smollm):
    eng = smollm.with_options(reuse="chunk")
    eng.warm(DOC[:1500])
    stats = eng.generate(DOC[:1500] + " And so on.", max_new_tokens=2).stats
    rows = stats.chunks
    assert rows[0][0] == 0 and rows[-1][1] == stats.prompt_tokens
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert all(end - start <= eng.config.reuse.chunking.size for start, end, _ in rows)
    assert sum(end - start for start, end, kind in rows if kind != "MISS") == stats.reused_tokens


@pytest.mark.parametrize("chunking", ["semantic", "adaptive"])
def test_semantic_and_adaptive_chunks_are_reused_exactly(smollm, chunking):
    eng = smollm.with_options(reuse="chunk", chunking=chunking)
    eng.warm([{"role": "system", "content": DOC}])
    ids = eng.encode([{"role": "system", "content": DOC}, {"role": "user", "content": QUESTION}])
    plan, logits = reused_logits(eng, ids)
    sizes = [end - start for start, end, kind in plan.chunk_rows() if kind == "EXACT"]
    assert plan.reused_tokens > 0.8 * len(ids)
    assert len(set(sizes)) > 1  # cuts moved to sentence/paragraph ends, not every 128 tokens
    assert torch.max(torch.abs(logits - eng.full_prefill_logits(ids))).item() < 1e-4

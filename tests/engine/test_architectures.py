"""KV reuse reproduces full prefill on every supported RoPE architecture, sliding-window ones included.

Each architecture is a tiny random-weight model (2 layers, 4 query / 2 KV heads, vocab 512) built once per
module; prompts are token ids, so the tokenizer is a word-level stand-in. References are computed in the same
run: full prefill without a cache, greedy decoding without a cache, or the engine with reuse="off".
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, ATOL, CHUNK, EOS, SLIDING_ARCHS, VOCAB, WINDOW, build_model, build_tokenizer, random_ids
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
)

from engine import EngineConfig, KVBoost, UnsupportedModelError
from engine.prefill import prefill

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tiny_models():
    built: dict[str, torch.nn.Module] = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = build_model(arch)
        return built[arch]

    return get


def make_engine(tiny_models, tokenizer, arch: str) -> KVBoost:
    # window: the adaptive-chunking window must be under size/2 even for fixed chunking (validated always).
    config = EngineConfig.of(reuse="chunk", chunk_size=CHUNK, chunk_window=4,
                             disk_cache_bytes=0)  # memory only: the disk tier has its own tests
    eng = KVBoost(tiny_models(arch), tokenizer, config, name=f"tiny-{arch}")
    assert eng._eos_ids == {EOS}
    return eng


@pytest.fixture(params=list(ARCHS))
def engine(request, tiny_models, tokenizer):
    """A reuse="chunk" engine with an empty store over the tiny model of one architecture."""
    return make_engine(tiny_models, tokenizer, request.param)


@pytest.fixture(params=SLIDING_ARCHS)
def sliding_engine(request, tiny_models, tokenizer):
    return make_engine(tiny_models, tokenizer, request.param)


def reused_logits(eng: KVBoost, ids: list[int], mode: str = "chunk"):
    """The plan for `ids` against the engine's store, and the next-token logits [V] of running it."""
    plan = eng._plan(ids, mode)
    with torch.inference_mode():
        logits, _ = prefill(eng.model, plan, eng.store, DynamicCache(), eng.device)
    return plan, logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.max(torch.abs(a - b)).item()


def kinds(plan) -> list[str]:
    return [kind for _, _, kind in plan.chunk_rows()]


def greedy_without_cache(eng: KVBoost, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from a full prefill of everything so far (no KV cache at all)."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(eng.full_prefill_logits(ids + out))))
    return out


# -- logits --------------------------------------------------------------------------------------------------

def test_exact_reuse_matches_full_prefill_logits(engine):
    prefix = random_ids(100, seed=1)
    ids = prefix + random_ids(40, seed=2)
    engine.warm(prefix)
    plan, logits = reused_logits(engine, ids)
    assert plan.reused_tokens >= len(prefix) // CHUNK * CHUNK
    assert "EXACT" in kinds(plan)
    assert kinds(plan)[-1] == "MISS"
    assert max_diff(logits, engine.full_prefill_logits(ids)) < ATOL


def test_corrupted_reused_kv_changes_logits(engine):
    """The 1e-4 comparison above can fail: doubling the values of one reused chunk moves the logits far."""
    prefix = random_ids(100, seed=1)
    ids = prefix + random_ids(40, seed=2)
    engine.warm(prefix)
    plan = engine._plan(ids, "chunk")
    key = [s for s in plan.segments if s.kind == "EXACT"][-1].record.key
    tier = engine.store.device_tier
    doubled = tuple((k, 2 * v) for k, v in engine.store.payload(key))
    tier.remove(key)
    tier.put(key, tier.encode(doubled))
    _, logits = reused_logits(engine, ids)
    assert max_diff(logits, engine.full_prefill_logits(ids)) > 100 * ATOL


def test_chunk_mode_reuses_chunks_after_a_miss(engine):
    ids = random_ids(100, seed=3)
    engine.warm(ids)
    prompt = ids + random_ids(20, seed=4)
    plan = engine._plan(prompt, "chunk")
    engine.store._remove(plan.keys[2])  # a middle chunk: [32, 48)

    plan, logits = reused_logits(engine, prompt)
    rows = plan.chunk_rows()
    assert rows[:3] == [(0, 16, "EXACT"), (16, 32, "EXACT"), (32, 48, "MISS")]
    assert [kind for _, _, kind in rows[3:6]] == ["EXACT"] * 3
    assert max_diff(logits, engine.full_prefill_logits(prompt)) < ATOL
    # "prefix" reuse stops at the first miss.
    prefix_plan = engine._plan(prompt, "prefix")
    first_miss = kinds(prefix_plan).index("MISS")
    assert set(kinds(prefix_plan)[first_miss:]) == {"MISS"}
    assert prefix_plan.reused_tokens == 32
    # The tail stored by warm() (tokens [96, 100)) is found after the hole as well.
    assert (96, 100, "PREFIX") in rows


# -- generation ----------------------------------------------------------------------------------------------

def test_warm_then_generate_64_greedy_tokens_identical_across_modes(engine):
    prefix = random_ids(100, seed=5)
    prompt = prefix + random_ids(30, seed=6)
    reference = greedy_without_cache(engine, prompt, 64)
    for reuse in ("off", "chunk", "prefix"):
        eng = engine.with_options(reuse=reuse)
        eng.warm(prefix)
        res = eng.generate(prompt, max_new_tokens=64)
        assert res.finish_reason == "length"
        assert res.token_ids == reference, f"reuse={reuse} diverged from greedy decoding without a cache"
        if reuse == "off":
            assert res.stats.reused_tokens == 0
        else:
            assert res.stats.reused_tokens >= len(prefix) // CHUNK * CHUNK


def test_eight_turn_conversation_identical_and_reuses_history(engine):
    engines = {reuse: engine.with_options(reuse=reuse) for reuse in ("off", "chunk", "prefix")}
    prompt = random_ids(40, seed=10)
    previous_prompt: list[int] = []
    previous_answer: list[int] = []
    for turn in range(1, 9):
        if turn > 1:
            prompt = previous_prompt + previous_answer + random_ids(12, seed=10 + turn)
        results = {reuse: eng.generate(prompt, max_new_tokens=8) for reuse, eng in engines.items()}
        off = results["off"]
        assert len(off.token_ids) == 8
        for reuse in ("chunk", "prefix"):
            assert results[reuse].token_ids == off.token_ids, f"turn {turn}: {reuse} diverged from reuse=off"
            stats = results[reuse].stats
            if turn == 1:
                assert stats.reused_tokens == 0
            else:
                # The previous turn left its prompt and answer in the store (chunks + tail), all but the last
                # answer token, which was sampled but never fed to the model.
                assert stats.reused_tokens >= len(previous_prompt) + len(previous_answer) - 1, f"turn {turn}"
        previous_prompt, previous_answer = prompt, off.token_ids


# -- sliding-window attention --------------------------------------------------------------------------------

def test_sliding_window_reuse_beyond_the_window_matches_full_prefill(sliding_engine):
    """The engine's cache holds every position on every layer; the model's mask must apply the window. Reused
    chunks lie both far outside the window of the last token and inside its reach (2 layers x 32 back),
    and the window really changes the logits."""
    eng = sliding_engine
    config = eng.model.config
    prefix = random_ids(200, seed=20)
    ids = prefix + random_ids(10, seed=21)
    assert config.sliding_window == WINDOW < len(ids)
    eng.warm(prefix)
    plan, logits = reused_logits(eng, ids)
    exact_starts = [start for start, _, kind in plan.chunk_rows() if kind == "EXACT"]
    assert exact_starts and exact_starts[0] + CHUNK < len(ids) - 4 * WINDOW
    full = eng.full_prefill_logits(ids)
    assert max_diff(logits, full) < ATOL

    # The reference itself is windowed: without the window the same weights give other logits.
    config.sliding_window = 4096
    try:
        unwindowed = eng.full_prefill_logits(ids)
    finally:
        config.sliding_window = WINDOW
    assert max_diff(unwindowed, full) > 100 * ATOL


def test_sliding_window_decode_past_the_window_matches_no_cache_greedy(sliding_engine):
    prefix = random_ids(200, seed=22)
    prompt = prefix + random_ids(30, seed=23)
    sliding_engine.warm(prefix)
    res = sliding_engine.generate(prompt, max_new_tokens=48)
    assert res.stats.reused_tokens >= len(prefix) // CHUNK * CHUNK
    assert res.token_ids == greedy_without_cache(sliding_engine, prompt, 48)


# -- unsupported ---------------------------------------------------------------------------------------------

def test_model_without_rope_is_rejected(tokenizer):
    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=2048), dtype=torch.float32)
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        KVBoost(gpt2, tokenizer, EngineConfig.of(chunk_size=CHUNK, chunk_window=4))


def test_a_small_reusable_share_is_recomputed_instead(tiny_models, tokenizer):
    """Reusing a few tokens in front of a long prompt costs more (masked attention) than it saves."""
    eng = make_engine(tiny_models, tokenizer, "llama")
    head = random_ids(20, seed=1)
    eng.warm(head)
    long_prompt = head + random_ids(200, seed=2)
    assert eng.generate(long_prompt, max_new_tokens=1).stats.reused_tokens == 0
    short_prompt = head + random_ids(30, seed=3)
    assert eng.generate(short_prompt, max_new_tokens=1).stats.reused_tokens >= 19

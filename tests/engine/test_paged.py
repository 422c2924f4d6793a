"""Spilling the live KV to host pages: the log-sum-exp merge against a float64 softmax, greedy decoding under a
small device budget identical to an unbounded run (tiny models and the real one), kv_range over spilled pages,
the registry hook being inert for everyone else, and the refusals."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import build_model, random_ids
from transformers import AutoModelForCausalLM, DynamicCache, Gemma2Config, GPT2Config
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.paged import (
    SpillingCache,
    attend_blocks,
    kv_range,
    make_cache,
    spill_stats,
    spill_unsupported,
    spilling,
)

PAGE = 16
PROMPT = 120  # prefilled as a block of FIRST_BLOCK tokens (base model, no logits), then the rest
FIRST_BLOCK = 90
STEPS = 200
LOGITS_ATOL = 1e-5  # tiny float32 models: logits are O(1), the two runs differ by summation order only


# ------------------------------------------------------------------------------------------ the maths alone

def reference_attention(query, k, v, query_start, scaling):
    """One float64 softmax over the whole context, GQA by repeat_interleave (transformers' repeat_kv order)."""
    groups = query.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = query.double() @ k.transpose(2, 3) * scaling
    q_pos = torch.arange(query_start, query_start + query.shape[2])
    scores = scores.masked_fill(torch.arange(k.shape[2])[None, :] > q_pos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def split_blocks(k, v, page, device_from):
    """Pages of `page` tokens up to `device_from`, then the rest as one block (a SpillingLayer's blocks())."""
    starts = list(range(0, device_from, page)) + [device_from]
    ends = starts[1:] + [k.shape[2]]
    return [(s, k[:, :, s:e], v[:, :, s:e]) for s, e in zip(starts, ends)]


@pytest.mark.parametrize("query_start, q_len, device_from", [
    (36, 1, 32),   # decode: one query after 4 pages and a device part
    (5, 30, 24),   # prefill across page boundaries: early queries see nothing of later pages
    (0, 35, 32),   # a first prefill that spills its own tokens
])
def test_merged_pages_match_one_float64_softmax(query_start, q_len, device_from):
    torch.manual_seed(0)
    num_heads, num_kv_heads, dim = 6, 2, 16  # GQA, 3 query heads per kv head
    length = query_start + q_len
    query = torch.randn(1, num_heads, q_len, dim)
    k, v = torch.randn(1, num_kv_heads, length, dim) * 3, torch.randn(1, num_kv_heads, length, dim)
    scaling = dim ** -0.5
    expected = reference_attention(query, k, v, query_start, scaling)

    out = attend_blocks(query, split_blocks(k, v, 8, device_from), query_start, scaling)
    assert out.dtype == torch.float32
    assert torch.max(torch.abs(out.double() - expected)).item() < 1e-5
    assert not torch.isnan(out).any()

    exact = attend_blocks(query.double(), split_blocks(k.double(), v.double(), 8, device_from), query_start, scaling)
    assert torch.max(torch.abs(exact - expected)).item() < 1e-12


def test_a_causal_mask_is_applied_across_page_boundaries():
    """Changing a key after a query's position must not change that query's output, however it is paged."""
    torch.manual_seed(1)
    query = torch.randn(1, 4, 20, 8)
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    before = attend_blocks(query, split_blocks(k, v, 4, 12), 0, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 10:], v2[:, :, 10:] = 100.0, -100.0
    after = attend_blocks(query, split_blocks(k2, v2, 4, 12), 0, 0.5)
    assert torch.equal(before[:, :, :10], after[:, :, :10])
    assert not torch.allclose(before[:, :, 10:], after[:, :, 10:])


# ------------------------------------------------------------------------------------ greedy loops on models

def kv_bytes_per_token(model) -> int:
    """K and V of one position over all layers."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.finfo(model.dtype).bits // 8
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element


def greedy(model, ids, cache, steps, eos_ids=(), first_block=None, on_step=None):
    """generate.py's pattern: a base-model block (no logits), the rest of the prompt with logits_to_keep=1, then
    one token per forward pass, every sampled token fed back. Returns (tokens, every next-token logits [n, V])."""
    tokens, all_logits = [], []
    with torch.inference_mode():
        with spilling(cache):
            if first_block:
                model.get_decoder()(input_ids=torch.tensor([ids[:first_block]]), past_key_values=cache,
                                    use_cache=True)
            out = model(input_ids=torch.tensor([ids[first_block or 0:]]), past_key_values=cache, use_cache=True,
                        logits_to_keep=1)
        logits = out.logits[0, -1]
        all_logits.append(logits.float())
        for _ in range(steps):
            if on_step is not None:
                on_step(cache)
            token = int(torch.argmax(logits))
            if token in eos_ids:
                break
            tokens.append(token)
            with spilling(cache):
                logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]
            all_logits.append(logits.float())
    return tokens, torch.stack(all_logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_tiny_model_under_a_quarter_budget_decodes_like_an_unbounded_cache(arch, one_thread):
    model = build_model(arch)
    ids = random_ids(PROMPT, seed=3)
    final = PROMPT + STEPS
    budget = final * kv_bytes_per_token(model) // 4
    page_bytes = PAGE * kv_bytes_per_token(model)
    expected_tokens, expected_logits = greedy(model, ids, DynamicCache(), STEPS, first_block=FIRST_BLOCK)

    cache = make_cache(model, budget, page_tokens=PAGE)
    assert isinstance(cache, SpillingCache)
    seen = []

    def check(c):
        assert c.device_bytes <= budget + page_bytes
        seen.append((c.get_seq_length(), c.spilled_tokens))

    tokens, logits = greedy(model, ids, cache, STEPS, first_block=FIRST_BLOCK, on_step=check)
    assert tokens == expected_tokens
    assert torch.max(torch.abs(logits - expected_logits)).item() < LOGITS_ATOL
    # The first block (90 tokens) is over the budget (80 tokens) on its own: the prefill spilled already.
    assert seen[0] == (PROMPT, PAGE * ((PROMPT - final // 4 + PAGE - 1) // PAGE))
    assert cache.get_seq_length() == final
    assert cache.spilled_tokens >= final - final // 4 - PAGE
    assert cache.num_pages_spilled == model.config.num_hidden_layers * cache.spilled_tokens // PAGE
    assert cache.host_bytes == cache.spilled_tokens * kv_bytes_per_token(model)
    assert 0 < cache.device_bytes <= budget
    assert spill_stats(cache) == {"spilled_tokens": cache.spilled_tokens, "num_pages_spilled": cache.num_pages_spilled,
                                  "device_bytes": cache.device_bytes, "host_bytes": cache.host_bytes}
    assert spill_stats(DynamicCache())["spilled_tokens"] == 0


def test_kv_range_of_a_spilled_cache_equals_the_unbounded_cache(one_thread):
    """Filled by direct updates (as append_kv does), so both caches hold bit-identical KV."""
    torch.manual_seed(0)
    num_layers, heads, dim = 3, 2, 8
    per_token = 2 * num_layers * heads * dim * 4
    spilled = SpillingCache(num_layers, 40 * per_token, page_tokens=8)
    plain = DynamicCache()
    with spilling(spilled):
        for size in (5, 60, 1, 1, 17):  # the 60-token block is over the budget on its own
            for layer in range(num_layers):
                k, v = torch.randn(1, heads, size, dim), torch.randn(1, heads, size, dim)
                spilled.update(k, v, layer)
                plain.update(k, v, layer)
    assert spilled.get_seq_length() == plain.get_seq_length() == 84
    assert spilled.spilled_tokens == 48 and spilled.device_bytes <= 40 * per_token
    for start, end in [(0, 84), (3, 7), (6, 30), (40, 60), (47, 49), (48, 84), (80, 84), (10, 10), (84, 84)]:
        got, expected = kv_range(spilled, start, end), kv_range(plain, start, end)
        for (gk, gv), (ek, ev) in zip(got, expected):
            assert gk.shape == (1, heads, end - start, dim)
            assert torch.equal(gk, ek) and torch.equal(gv, ev)
    copy = kv_range(spilled, 0, 84)
    copy[0][0].zero_()  # an independent copy: the pages are untouched
    assert torch.equal(kv_range(spilled, 0, 84)[0][0], kv_range(plain, 0, 84)[0][0])
    with pytest.raises(ValueError, match="not inside"):
        kv_range(spilled, 80, 85)


def test_kv_range_after_a_spilled_generation_matches_the_unbounded_one(one_thread):
    model = build_model("llama")
    ids = random_ids(PROMPT, seed=4)
    plain, spilled = DynamicCache(), make_cache(model, 60 * kv_bytes_per_token(model), page_tokens=PAGE)
    greedy(model, ids, plain, 40)
    greedy(model, ids, spilled, 40)
    assert spilled.spilled_tokens > 0
    for start, end in [(0, PROMPT), (10, 50), (PROMPT - 5, PROMPT + 39)]:
        for (gk, gv), (ek, ev) in zip(kv_range(spilled, start, end), kv_range(plain, start, end)):
            assert torch.allclose(gk, ek, atol=1e-5) and torch.allclose(gv, ev, atol=1e-5)


def test_two_spilling_conversations_interleaved_on_one_thread(one_thread):
    """Generators of two requests can be stepped alternately: each forward finds its own cache's pages."""
    model = build_model("llama")
    a_ids, b_ids = random_ids(50, seed=5), random_ids(70, seed=6)
    expected_a, _ = greedy(model, a_ids, DynamicCache(), 30)
    expected_b, _ = greedy(model, b_ids, DynamicCache(), 30)
    budget = 32 * kv_bytes_per_token(model)
    caches = [make_cache(model, budget, page_tokens=8), make_cache(model, budget, page_tokens=8)]
    got = [[], []]
    with torch.inference_mode(), spilling(caches[0]), spilling(caches[1]):
        logits = [model(input_ids=torch.tensor([ids]), past_key_values=c, use_cache=True).logits[0, -1]
                  for ids, c in zip((a_ids, b_ids), caches)]
        for _ in range(30):
            for i in (0, 1):
                got[i].append(int(torch.argmax(logits[i])))
                logits[i] = model(input_ids=torch.tensor([[got[i][-1]]]), past_key_values=caches[i],
                                  use_cache=True).logits[0, -1]
    assert got == [expected_a, expected_b]
    assert all(c.spilled_tokens > 0 for c in caches)


def test_the_real_model_greedy_chat_under_a_small_budget_matches_unbounded(smollm, one_thread):
    model = smollm.model
    messages = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper who finds a "
                                            "message in a bottle. Describe the sea, the weather and the town."}]
    ids = smollm.encode(messages)
    eos = smollm._find_eos_ids()
    expected, expected_logits = greedy(model, ids, DynamicCache(), 100, eos_ids=eos)
    assert len(expected) >= 60  # the context really grows well past the budget

    budget = 48 * kv_bytes_per_token(model)  # 48 positions of the ~150 the conversation reaches
    cache = make_cache(model, budget, page_tokens=32)
    tokens, logits = greedy(model, ids, cache, 100, eos_ids=eos)
    assert tokens == expected
    assert torch.max(torch.abs(logits - expected_logits)).item() < 1e-3
    assert cache.spilled_tokens >= len(ids) + len(tokens) - 48 - 32
    assert cache.device_bytes <= budget


# ----------------------------------------------------------------------------------------------- inertness

def plain_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True).logits[0]


def test_the_hook_is_inert_for_other_threads_and_gone_afterwards(one_thread):
    model = build_model("llama")
    ids = random_ids(40, seed=7)
    before = plain_logits(model, ids)
    cache = make_cache(model, 16 * kv_bytes_per_token(model), page_tokens=8)
    greedy(model, ids, cache, 20)
    assert cache.spilled_tokens > 0

    inside, release = threading.Event(), threading.Event()
    registered = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)  # sdpa, or batching's split of it (inert)

    def hold_a_spilling_block():
        with spilling(cache):
            inside.set()
            release.wait(30)

    holder = threading.Thread(target=hold_a_spilling_block)
    holder.start()
    try:
        assert inside.wait(30)
        assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is not registered  # hooked now
        during = plain_logits(model, ids)
    finally:
        release.set()
        holder.join()
    assert torch.equal(during, before)
    assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is registered
    assert torch.equal(plain_logits(model, ids), before)


def test_a_spilled_cache_outside_its_block_is_refused(one_thread):
    model = build_model("llama")
    cache = make_cache(model, 16 * kv_bytes_per_token(model), page_tokens=8)
    greedy(model, random_ids(40, seed=8), cache, 2)
    length = cache.get_seq_length()
    with pytest.raises(RuntimeError, match="inside `with spilling"), torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == length  # refused before anything was appended


# --------------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_sliding_window_models_are_refused(arch):
    model = build_model(arch)
    with pytest.raises(ValueError, match="sliding_attention"):
        make_cache(model, 1 << 20)
    assert isinstance(make_cache(model, None), DynamicCache)  # without a budget nothing is refused


def test_softcapping_and_non_llama_attention_are_refused():
    torch.manual_seed(0)
    gemma2 = AutoModelForCausalLM.from_config(
        Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, layer_types=["full_attention"] * 2),
        attn_implementation="eager")
    assert "attn_logit_softcapping=50.0" in spill_unsupported(gemma2)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2))
    with pytest.raises(ValueError, match="not a Llama-style decoder"):
        make_cache(gpt2, 1 << 20)
    assert spill_unsupported(build_model("llama")) is None


def test_bad_budgets_are_refused():
    model = build_model("llama")
    with pytest.raises(ValueError, match="device_budget_bytes must be positive, got 0"):
        make_cache(model, 0)
    with pytest.raises(ValueError, match="page_tokens must be positive, got -1"):
        make_cache(model, 1024, page_tokens=-1)

"""The CUDA-graph decode step's arithmetic, run eagerly on the CPU (GraphDecode(capture=False): the same step the
graph records): its logits and the cache it leaves equal transformers' one-token forward over a GrowingCache,
step after step and across a block boundary of the cache; and where it refuses. The captured graph itself runs in
tests/gpu/test_graph_decode.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_model, build_tokenizer, random_ids

from engine import DecodeConfig, EngineConfig, KVBoost
from engine.graph_decode import GraphDecode, graph_decode_unavailable
from engine.live_cache import BLOCK_TOKENS, GrowingCache

STEPS = 12


def _prefilled(model, prompt: list[int]) -> tuple[GrowingCache, torch.Tensor]:
    cache = GrowingCache()
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return cache, out.logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_graph_step_computes_what_the_forward_computes(arch):
    model = build_model(arch)
    if arch == "mistral":
        model.config.sliding_window = None  # the prompt crosses a cache block: longer than the tests' window
    step = GraphDecode(model, capture=False)
    prompt = random_ids(BLOCK_TOKENS - STEPS // 2, seed=3)  # decoding crosses into the cache's second block
    reference, logits = _prefilled(model, prompt)
    graphed, _ = _prefilled(model, prompt)
    for _ in range(STEPS):
        token = int(logits.argmax())
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=reference, use_cache=True).logits[0, -1]
        stepped = step(token, graphed)
        assert stepped is not None
        torch.testing.assert_close(stepped, logits, atol=1e-4, rtol=1e-4)
    assert graphed.get_seq_length() == reference.get_seq_length() == len(prompt) + STEPS
    for mine, theirs in zip(graphed.layers, reference.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_the_room_past_the_filled_part_may_hold_anything():
    """The step attends over the whole buffer, the unfilled room masked; a CPU cache leaves that room
    uninitialised (recycled memory may hold NaN, and 0 x NaN is NaN): the step must not depend on what is there."""
    model = build_model("llama")
    step = GraphDecode(model, capture=False)
    prompt = random_ids(40, seed=6)
    reference, logits = _prefilled(model, prompt)
    poisoned, _ = _prefilled(model, prompt)
    with torch.inference_mode():
        for layer in poisoned.layers:
            layer._key_buffer[:, :, len(prompt):] = float("nan")
            layer._value_buffer[:, :, len(prompt):] = float("inf")
    for _ in range(3):
        token = int(logits.argmax())
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=reference, use_cache=True).logits[0, -1]
        torch.testing.assert_close(step(token, poisoned), logits, atol=1e-4, rtol=1e-4)


def test_the_graph_step_takes_over_a_cache_transformers_keeps_writing():
    # a drafted forward through transformers between two graph steps: each sees what the other wrote
    model = build_model("llama")
    step = GraphDecode(model, capture=False)
    prompt = random_ids(40, seed=4)
    reference, _ = _prefilled(model, prompt)
    mixed, _ = _prefilled(model, prompt)
    tokens = random_ids(6, seed=5)
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([tokens]), past_key_values=reference, use_cache=True).logits[0]
        assert step(tokens[0], mixed) is not None
        model(input_ids=torch.tensor([tokens[1:4]]), past_key_values=mixed, use_cache=True)
        mixed.crop(-1)  # as a rejected draft is cut back: tokens[3] is fed again below
    for token in tokens[3:]:
        last = step(token, mixed)
    torch.testing.assert_close(last, expected[-1], atol=1e-4, rtol=1e-4)


def test_the_graph_step_refuses_what_it_cannot_extend():
    model = build_model("llama")
    step = GraphDecode(model, capture=False)
    assert step(5, GrowingCache()) is None  # nothing prefilled: no buffers to write into
    with torch.inference_mode():
        plain = model(input_ids=torch.tensor([random_ids(8, seed=6)]), use_cache=True).past_key_values
    assert step(5, plain) is None  # a DynamicCache, not a GrowingCache


def test_models_the_graph_cannot_take_are_named_with_the_reason():
    assert "CUDA" in graph_decode_unavailable(build_model("llama"))  # on the CPU
    assert "gemma2" in graph_decode_unavailable(build_model("gemma2"))
    assert "phi3" in graph_decode_unavailable(build_model("phi3"))
    model = build_model("llama")  # the engine's own reasons come before the model's
    assert graph_decode_unavailable(model, streaming=True) == "layer streaming moves the weights between steps"
    assert "live_kv_bytes" in graph_decode_unavailable(model, spilling=True)
    assert graph_decode_unavailable(model, enabled=False) == "cuda_graphs=False"


def test_an_engine_on_the_cpu_says_why_it_decodes_without_graphs():
    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0), name="tiny")
    assert "cpu" in engine.info().cuda_graphs_unavailable
    off = engine.with_options(cuda_graphs=False)
    assert off.info().cuda_graphs_unavailable == "cuda_graphs=False"
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(decode=DecodeConfig(cuda_graphs="yes")).validate()

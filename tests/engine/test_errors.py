"""Bad input gets a clear exception naming the problem, and the engine keeps working."""

from __future__ import annotations

import threading

import pytest

from engine import KVBoost, ModelLoadError, Result, UnsupportedModelError


@pytest.mark.parametrize("kwargs, word", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": [""]}, "stop"),
    ({"seed": "x"}, "seed"),
])
def test_invalid_sampling_values_are_named(smollm, kwargs, word):
    with pytest.raises(ValueError, match=word):
        smollm.generate("Hello", **kwargs)
    assert smollm.generate("Hello", max_new_tokens=2).stats.prompt_tokens > 0


def test_empty_prompt_and_messages_are_rejected(smollm):
    with pytest.raises(ValueError, match="empty"):
        smollm.generate("")
    with pytest.raises(ValueError, match="empty"):
        smollm.chat([])
    with pytest.raises(ValueError, match="role"):
        smollm.chat([{"content": "hi"}])


def test_prompt_longer_than_context_is_rejected_and_engine_recovers(smollm):
    too_long = list(range(100, 100 + smollm.max_context + 5))
    with pytest.raises(ValueError, match=str(smollm.max_context)):
        smollm.generate(too_long)
    assert smollm.generate("Hello there", max_new_tokens=3).token_ids


def test_unknown_model_path_and_hub_id(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        KVBoost.from_pretrained(str(tmp_path / "nope" / "model.gguf"))
    with pytest.raises(ModelLoadError, match="not found"):
        KVBoost.from_pretrained(str(tmp_path / "a" / "b" / "c"))
    with pytest.raises(ModelLoadError, match="local HuggingFace cache"):
        KVBoost.from_pretrained("kvboost-test/definitely-not-cached-model")
    with pytest.raises(ModelLoadError, match="config.json"):
        KVBoost.from_pretrained(str(tmp_path))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00\x13garbage" * 100)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        KVBoost.from_pretrained(str(bad))


def test_non_rope_model_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(folder)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    tok.save_pretrained(folder)
    with pytest.raises(UnsupportedModelError, match="RoPE"):
        KVBoost.from_pretrained(str(folder))


def test_invalid_engine_options_are_named(smollm):
    with pytest.raises(ValueError, match="reuse"):
        smollm.with_options(reuse="sometimes")
    with pytest.raises(ValueError, match="chunk_size"):
        smollm.with_options(chunk_size=3)
    with pytest.raises(ValueError, match="chunking"):
        smollm.with_options(chunking="random")


def test_closing_a_stream_midway_leaves_the_cache_consistent(smollm):
    eng = smollm.with_options(reuse="chunk")
    off = smollm.with_options(reuse="off")
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper. " * 30}]
    stream = eng.stream(messages, max_new_tokens=64)
    for i, _event in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert all(r.ref_count == 0 for r in eng.store.records.values())
    assert eng.store.num_bytes == sum(r.num_bytes for r in eng.store.records.values())
    again = eng.chat(messages, max_new_tokens=24)
    assert again.stats.reused_tokens > 0
    assert again.token_ids == off.chat(messages, max_new_tokens=24).token_ids


def test_cancel_event_stops_at_the_next_token(smollm):
    eng = smollm.with_options(reuse="chunk")
    cancel = threading.Event()
    events = []
    for event in eng.stream("Count from one to one hundred: one, two,", max_new_tokens=64, cancel=cancel):
        events.append(event)
        if len(events) == 2:
            cancel.set()
    result = events[-1]
    assert isinstance(result, Result)
    assert result.finish_reason == "cancelled"
    assert len(result.token_ids) <= 3
    assert all(r.ref_count == 0 for r in eng.store.records.values())


def test_same_seed_same_sample_and_stop_strings(smollm):
    prompt = [{"role": "user", "content": "Tell me a short story about a cat."}]
    a = smollm.chat(prompt, max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    b = smollm.chat(prompt, max_new_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    assert a.token_ids == b.token_ids
    greedy = smollm.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=24)
    assert "Paris" in greedy.text
    cut = smollm.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=24,
                      stop=["Paris"])
    assert cut.finish_reason == "stop"
    assert "Paris" not in cut.text
    assert greedy.text.startswith(cut.text)
    short = smollm.chat([{"role": "user", "content": "Describe Paris at length."}], max_new_tokens=5)
    assert short.finish_reason == "length" and len(short.token_ids) == 5


def test_breaking_out_of_a_stream_loop_leaves_the_engine_usable(smollm):
    """No garbage collection between the break and the next request: the stream goes with its last reference."""
    import gc

    gc.disable()
    try:
        for _event in smollm.stream("Tell me about lighthouses.", max_new_tokens=16):
            break
        assert smollm.generate("Hello", max_new_tokens=2).token_ids
    finally:
        gc.enable()


def test_leaving_a_with_block_closes_the_stream(smollm):
    with smollm.stream("Tell me about lighthouses.", max_new_tokens=16) as stream:
        next(stream)
        kept = stream  # still referenced after the block
    assert smollm.generate("Hello", max_new_tokens=2).token_ids
    assert list(kept) == []


def test_the_engine_is_free_once_the_result_is_handed_out(smollm):
    stream = smollm.stream("Hello", max_new_tokens=4)
    result = None
    while not isinstance(result, Result):
        result = next(stream)
    # The stream is still referenced and was not asked for its end: the engine serves the next request anyway.
    assert smollm.generate("Hello", max_new_tokens=2).token_ids
    assert result.stats.prompt_tokens > 0
    assert list(stream) == []

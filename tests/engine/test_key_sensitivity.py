"""The chained chunk key is the promise behind every EXACT hit: a chunk's key is equal iff every token before and in
the chunk is equal. Each token of a prompt, wherever it sits in its chunk (the first and the last included), must
move the key of its own chunk and of every later one, and must leave the keys of earlier chunks alone. Keys are
computed as the engine computes them: chunk_spans cuts the prompt, plan_prompt chains the keys from the root."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.chunking import NO_BREAK, PARAGRAPH_BREAK, SENTENCE_BREAK, chunk_spans
from engine.config import ChunkingConfig
from engine.keys import content_key, root_key
from engine.plan import plan_prompt

PERIOD, NEWLINES = 7, 9
FINGERPRINT = "tiny-llama|fixed-8"
ROOT = root_key(FINGERPRINT)


def breaks(token_id: int) -> int:
    return {PERIOD: SENTENCE_BREAK, NEWLINES: PARAGRAPH_BREAK}.get(token_id, NO_BREAK)


def chunk_keys(ids: list[int], cfg: ChunkingConfig, root: bytes = ROOT) -> tuple[list[tuple[int, int]], list[bytes]]:
    """(complete spans, their chained keys) of a prompt, as the engine plans it."""
    spans, num_complete = chunk_spans(ids, cfg, breaks)
    plan = plan_prompt(list(ids), spans, num_complete, root, None, "off")
    return spans[:num_complete], plan.keys


def chunk_of(spans, position: int) -> int | None:
    """The index of the complete chunk holding `position`, None for the tail."""
    for index, (start, end) in enumerate(spans):
        if start <= position < end:
            return index
    return None


def other_token(token: int, delta: int) -> int:
    """Another token id of the same break class (so the chunk cuts stay where they were)."""
    candidate = 20 + (token - 20 + delta) % 1000 if token >= 20 else 20 + delta
    return candidate if candidate != token else candidate + 1


def assert_change_moves_exactly_later_keys(ids, position, new_token, cfg):
    spans, keys = chunk_keys(ids, cfg)
    changed = list(ids)
    changed[position] = new_token
    changed_spans, changed_keys = chunk_keys(changed, cfg)
    assert changed_spans == spans  # the same cuts: only the keys can tell the prompts apart
    hit = chunk_of(spans, position)
    for index, (before, after) in enumerate(zip(keys, changed_keys)):
        if hit is None or index < hit:
            assert before == after, f"token {position} (chunk {hit}) moved the key of earlier chunk {index}"
        else:
            assert before != after, f"token {position} (chunk {hit}) left the key of chunk {index} unchanged"


def test_every_token_of_a_small_prompt_moves_its_chunks_key_and_every_later_one():
    """Exhaustive: each of the 35 positions of a prompt of four complete chunks and a tail, each replaced by a
    neighbouring id and by a far one (the first and last token of every chunk included)."""
    cfg = ChunkingConfig(mode="fixed", size=8)
    ids = [20 + (i * 37) % 500 for i in range(4 * 8 + 3)]
    spans, keys = chunk_keys(ids, cfg)
    assert len(spans) == 4 and len(set(keys)) == 4
    for position in range(len(ids)):
        for new_token in (ids[position] + 1, ids[position] - 1, ids[position] + (1 << 20), 0):
            assert_change_moves_exactly_later_keys(ids, position, new_token, cfg)


@pytest.mark.parametrize("mode", ["fixed", "semantic", "adaptive"])
def test_every_token_moves_the_keys_in_every_chunking_mode(mode):
    """Exhaustive over a prompt with sentence and paragraph ends, so semantic and adaptive cuts are not at fixed
    places; each token is replaced by one of the same break class (the cuts stay, the keys must not)."""
    cfg = ChunkingConfig(mode=mode, size=16, window=4)
    rng = random.Random(5)
    ids = [rng.choice([PERIOD, NEWLINES] + list(range(20, 60)) * 4) for _ in range(90)]
    spans, _ = chunk_keys(ids, cfg)
    assert len(spans) >= 4
    for position in range(len(ids)):
        if breaks(ids[position]) == NO_BREAK:
            assert_change_moves_exactly_later_keys(ids, position, other_token(ids[position], 3), cfg)


prompts = st.lists(st.sampled_from([PERIOD, NEWLINES]) | st.integers(20, (1 << 31) - 1), min_size=8, max_size=120)


@settings(max_examples=300, deadline=None)
@given(prompts, st.sampled_from(["fixed", "semantic", "adaptive"]), st.integers(8, 24), st.data())
def test_any_changed_token_moves_the_keys_of_its_chunk_and_every_later_one(ids, mode, size, data):
    position = data.draw(st.integers(0, len(ids) - 1))
    # outside fixed mode a token's break class places the cuts: replace a token by another of the same class
    assume(mode == "fixed" or breaks(ids[position]) == NO_BREAK)
    low = 0 if mode == "fixed" else 20
    new_token = data.draw(st.integers(low, (1 << 31) - 1).filter(lambda t: t != ids[position]))
    assert_change_moves_exactly_later_keys(ids, position, new_token, ChunkingConfig(mode=mode, size=size, window=3))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=100), st.lists(st.integers(0, 1 << 20), max_size=60),
       st.lists(st.integers(0, 1 << 20), max_size=60), st.integers(8, 20))
def test_prompts_sharing_a_prefix_share_exactly_the_keys_of_the_chunks_inside_it(prefix, rest_a, rest_b, size):
    cfg = ChunkingConfig(mode="fixed", size=size)
    a, b = prefix + rest_a, prefix + rest_b
    spans_a, keys_a = chunk_keys(a, cfg)
    spans_b, keys_b = chunk_keys(b, cfg)
    common = len(prefix)
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    for index, ((start, end), key_a) in enumerate(zip(spans_a, keys_a)):
        if index >= len(keys_b):
            break
        assert spans_b[index] == (start, end)
        if end <= common:
            assert key_a == keys_b[index]
        else:
            assert key_a != keys_b[index], f"chunk {index} differs at token {common} but kept its key"


def test_the_same_prompt_under_another_fingerprint_shares_no_key():
    cfg = ChunkingConfig(mode="fixed", size=8)
    ids = list(range(100, 140))
    _, keys = chunk_keys(ids, cfg)
    _, other = chunk_keys(ids, cfg, root_key(FINGERPRINT + "x"))
    assert not set(keys) & set(other)
    assert keys == chunk_keys(ids, cfg)[1]  # and the same prompt, the same keys


def test_the_content_key_moves_with_every_token_and_not_with_the_position():
    chunk = [20 + (i * 53) % 700 for i in range(16)]
    key = content_key(ROOT.hex(), chunk)
    # the same tokens as chunk 0 of one prompt and chunk 3 of another: one content key (no position in it)
    cfg = ChunkingConfig(mode="fixed", size=16)
    for ids in (chunk + list(range(30, 78)), list(range(30, 78)) + chunk):
        spans, _ = chunk_keys(ids, cfg)
        assert key in {content_key(ROOT.hex(), ids[s:e]) for s, e in spans}
    for position in range(len(chunk)):
        for new_token in (chunk[position] + 1, chunk[position] ^ (1 << 24), 0):
            changed = list(chunk)
            changed[position] = new_token
            assert content_key(ROOT.hex(), changed) != key, f"token {position} left the content key unchanged"
    assert content_key(ROOT.hex(), chunk[:-1]) != key and content_key(ROOT.hex(), chunk + [0]) != key
    assert content_key(root_key("another model").hex(), chunk) != key


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=64), st.data())
def test_any_changed_token_moves_the_content_key(chunk, data):
    position = data.draw(st.integers(0, len(chunk) - 1))
    new_token = data.draw(st.integers(0, (1 << 31) - 1).filter(lambda t: t != chunk[position]))
    changed = list(chunk)
    changed[position] = new_token
    assert content_key(ROOT.hex(), changed) != content_key(ROOT.hex(), chunk)

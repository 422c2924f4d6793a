"""Chunk boundaries, keys and the store's bookkeeping, without a model."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from engine.chunking import PARAGRAPH_BREAK, SENTENCE_BREAK, NO_BREAK, chunk_spans, classify_token_text
from engine.config import ChunkingConfig
from engine.eviction import LRU, ImportanceLRU
from engine.keys import chain_key, content_key, root_key
from engine.store import ChunkStore

PERIOD, NEWLINES = 7, 9


def breaks(token_id: int) -> int:
    return {PERIOD: SENTENCE_BREAK, NEWLINES: PARAGRAPH_BREAK}.get(token_id, NO_BREAK)


def random_ids(n, seed=0):
    rng = random.Random(seed)
    return [rng.choice([PERIOD] + [NEWLINES] + list(range(20, 60)) * 6) for _ in range(n)]


@pytest.mark.parametrize("mode", ["fixed", "semantic", "adaptive"])
def test_chunkers_cover_the_prompt_and_are_prefix_stable(mode):
    cfg = ChunkingConfig(mode=mode, size=32, window=6)
    ids = random_ids(600)
    full, full_complete = chunk_spans(ids, cfg, breaks)
    assert full[0][0] == 0 and full[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(full, full[1:]))
    for cut in range(1, 600, 37):
        spans, complete = chunk_spans(ids[:cut], cfg, breaks)
        assert spans[:complete] == full[:complete], f"cut at {cut} moved a complete chunk"
        assert len(spans) - complete <= 1


def test_adaptive_moves_cuts_to_nearby_breaks_only():
    cfg = ChunkingConfig(mode="adaptive", size=32, window=6)
    ids = random_ids(800, seed=3)
    spans, complete = chunk_spans(ids, cfg, breaks)
    for start, end in spans[:complete]:
        assert abs((end - start) - 32) <= 6
        if end - start != 32:
            assert breaks(ids[end - 1]) != NO_BREAK


def test_semantic_cuts_at_paragraphs_when_present():
    cfg = ChunkingConfig(mode="semantic", size=32)
    ids = [30] * 20 + [NEWLINES] + [31] * 5 + [PERIOD] + [32] * 60
    spans, _ = chunk_spans(ids, cfg, breaks)
    assert spans[0] == (0, 21)  # the paragraph break wins over the later sentence end


def test_token_text_classification():
    assert classify_token_text(".") == SENTENCE_BREAK
    assert classify_token_text("\n\n") == PARAGRAPH_BREAK
    assert classify_token_text("word") == NO_BREAK


def test_chain_keys_depend_on_the_whole_prefix_and_content_keys_do_not():
    root = root_key("model-a")
    a = chain_key(chain_key(root, [1, 2, 3]), [4, 5])
    b = chain_key(chain_key(root, [1, 2, 9]), [4, 5])
    assert a != b
    assert content_key("model-a", [4, 5]) == content_key("model-a", [4, 5])
    assert content_key("model-a", [4, 5]) != content_key("model-b", [4, 5])
    assert root_key("model-a") != root_key("model-b")


def test_keys_are_deterministic_across_processes():
    code = ("from engine.keys import chain_key, root_key; "
            "print(chain_key(root_key('fp'), [1, 2, 300000]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == chain_key(root_key("fp"), [1, 2, 300000]).hex()


def kv(num_tokens, value=1.0, layers=2):
    t = torch.full((1, 2, num_tokens, 4), value)
    return tuple((t.clone(), t.clone()) for _ in range(layers))


def put(store, name, num_tokens=4, value=1.0):
    key = name.encode()
    assert store.put_chunk(key, b"root", content_key("fp", [len(name)]), 0, list(range(num_tokens)),
                           kv(num_tokens, value))
    return key


def test_lru_evicts_least_recently_used_first_and_respects_budget():
    one = sum(t.numel() * 4 for pair in kv(4) for t in pair)
    store = ChunkStore(budget_bytes=3 * one, policy=LRU())
    a, b, c = put(store, "a"), put(store, "b"), put(store, "c")
    store.touch(store.records[a], "EXACT")  # a is now the most recent
    assert store.eviction_order() == [b, c, a]
    d = put(store, "d")
    assert set(store.records) == {a, c, d}
    assert store.num_bytes <= store.budget_bytes
    assert store.counters.evicted == 1


def test_entries_in_use_are_never_evicted():
    one = sum(t.numel() * 4 for pair in kv(4) for t in pair)
    store = ChunkStore(budget_bytes=2 * one)
    a, b = put(store, "a"), put(store, "b")
    store.acquire(store.records[a])
    store.acquire(store.records[b])
    assert not store.put_chunk(b"c", b"root", b"x", 0, [1, 2, 3, 4], kv(4))
    assert set(store.records) == {a, b}
    store.release(store.records[a])
    assert store.put_chunk(b"c", b"root", b"x", 0, [1, 2, 3, 4], kv(4))
    assert set(store.records) == {b, b"c"}


def test_entry_larger_than_budget_is_rejected():
    store = ChunkStore(budget_bytes=10)
    assert not store.put_chunk(b"big", b"root", b"x", 0, [1], kv(4))
    assert store.counters.rejected == 1 and store.num_bytes == 0


@pytest.mark.parametrize("policy, hot_survives", [(LRU(), False), (ImportanceLRU(), True)])
def test_importance_lru_keeps_hot_entries_that_lru_evicts(policy, hot_survives):
    one = sum(t.numel() * 4 for pair in kv(4) for t in pair)
    store = ChunkStore(budget_bytes=3 * one, policy=policy)
    hot = put(store, "hot")
    for _ in range(20):
        store.touch(store.records[hot], "EXACT")
    x, y = put(store, "x"), put(store, "y")
    store.touch(store.records[x], "EXACT")
    store.touch(store.records[y], "EXACT")  # hot is now the least recently used
    put(store, "z")
    assert (hot in store.records) == hot_survives


def test_longer_tail_supersedes_its_prefix():
    store = ChunkStore(budget_bytes=1 << 20)
    store.put_tail(b"t1", b"parent", 0, [1, 2, 3], kv(3))
    store.put_tail(b"t2", b"parent", 0, [1, 2, 3, 4, 5], kv(5))
    store.put_tail(b"t3", b"parent", 0, [1, 9], kv(2))
    assert {r.key for r in store.tails_under(b"parent")} == {b"t2", b"t3"}


def test_engine_package_never_imports_qt():
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "engine"
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.split(".")[0] in ("PySide6", "PyQt5", "PyQt6", "qasync"), f"{path} imports {name}"

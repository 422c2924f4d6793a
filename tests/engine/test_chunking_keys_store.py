"""Chunk boundaries, keys and the store's bookkeeping, without a model."""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys

import pytest
import torch

from engine.chunking import NO_BREAK, PARAGRAPH_BREAK, SENTENCE_BREAK, chunk_spans, classify_token_text
from engine.config import ChunkingConfig
from engine.keys import chain_key, content_key, root_key
from engine.kv.eviction import LRU, ImportanceLRU
from engine.kv.store import ChunkStore

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


def importance_lru_order(entries, hit_weight=2.0):
    """Eviction order by the rule in engine/kv/eviction.py and docs/engine.md, from `entries`: name -> [importance,
    hits, last_access]. An entry hit h times is kept as if touched hit_weight * log1p(h) * N operations later
    (N: entries competing), scaled by its importance over the competitors' mean; ties go to the older."""
    n = len(entries)
    mean = sum(e[0] for e in entries.values()) / n

    def key(name):
        importance, hits, last = entries[name]
        return (last + hit_weight * math.log1p(hits) * n * importance / mean, last)

    return sorted(entries, key=key)


def test_importance_lru_keeps_the_entry_with_more_energy_among_equally_hit_ones():
    """Entries with KV of different norms: with the same hit count, the one with the larger norm outlives
    less important entries touched after it. Every element of an entry's K and V is `value`, so the L2 norm
    of each 4-dim vector, hence its importance, is 2 * value."""
    one = sum(t.numel() * 4 for pair in kv(4) for t in pair)
    store = ChunkStore(budget_bytes=4 * one, policy=ImportanceLRU())
    clock = itertools.count(1)  # one tick per store operation, as the store's logical clock
    model = {}

    def put_entry(name, value):
        put(store, name, value=value)
        model[name] = [2 * value, 0, next(clock)]

    def touch(name):
        store.touch(store.records[name.encode()], "EXACT")
        model[name][1] += 1
        model[name][2] = next(clock)

    for name, value in [("dim", 0.5), ("bright", 2.0), ("plain", 1.0), ("cold", 1.0)]:
        put_entry(name, value)
    for name in ["bright", "dim", "plain", "bright", "dim", "plain"]:  # two hits each, bright the oldest
        touch(name)
    assert {k: store.records[k.encode()].importance for k in model} == pytest.approx(
        {k: e[0] for k, e in model.items()})
    # by hand: N = 4, mean importance 2.25, bonus 2 * ln 3 * 4 * importance / 2.25:
    # cold 4, dim 9 + 3.91, plain 10 + 7.81, bright 8 + 15.62
    assert importance_lru_order(model) == ["cold", "dim", "plain", "bright"]
    assert store.eviction_order() == [b"cold", b"dim", b"plain", b"bright"]
    # without the importance factor bright would go second (8 + 8.79 < 9 + 8.79): importance decides here
    flat = {k: [1.0, e[1], e[2]] for k, e in model.items()}
    assert importance_lru_order(flat) == ["cold", "bright", "dim", "plain"]

    evicted = []
    for name in ["new1", "new2", "new3"]:
        victim = importance_lru_order(model)[0]
        before = set(store.records)
        put_entry(name, 1.0)
        del model[victim]
        assert before - set(store.records) == {victim.encode()}
        evicted.append(victim)
        for _ in range(3):  # the newcomers are hot: the original entries are the ones that leave
            touch(name)
    assert evicted == ["cold", "dim", "plain"]
    assert b"bright" in store.records


def test_longer_tail_supersedes_its_prefix():
    store = ChunkStore(budget_bytes=1 << 20)
    store.put_tail(b"t1", b"parent", 0, [1, 2, 3], kv(3))
    store.put_tail(b"t2", b"parent", 0, [1, 2, 3, 4, 5], kv(5))
    store.put_tail(b"t3", b"parent", 0, [1, 9], kv(2))
    assert {r.key for r in store.tails_under(b"parent")} == {b"t2", b"t3"}


def test_a_refreshed_entry_is_the_last_to_be_evicted_and_an_unknown_key_is_not_stored():
    store = ChunkStore(budget_bytes=1 << 20, policy=LRU())
    store.put_tail(b"old", b"parent", 0, [1, 2, 3], kv(3))
    store.put_tail(b"new", b"other", 0, [4, 5], kv(2))
    assert store.eviction_order()[0] == b"old"
    before = store.num_bytes
    assert store.refresh(b"old") and not store.refresh(b"missing")
    assert store.eviction_order() == [b"new", b"old"] and store.num_bytes == before
    assert b"missing" not in store.records


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
                assert name.split(".")[0] not in ("PySide6", "PyQt5", "PyQt6", "qasync"), f"{path} imports {name}"

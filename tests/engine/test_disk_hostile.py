"""The disk KV tier against a hostile or unlucky folder: index rows and payload files edited by hand or by other
software. Every case must end in a MISS or a dropped row: never a touched file outside the folder, a hang, an
exception at start-up, or an answer that differs from computing the prompt from scratch."""

from __future__ import annotations

import os
import sqlite3
import threading

import numpy as np
import pytest
import torch
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.config import KVQuantConfig
from engine.kv.disk import INDEX_FILENAME, DiskTier
from engine.kv.eviction import LRU
from engine.kv.store import ChunkStore

DOC = random_ids(6 * CHUNK + 5, seed=41)
OTHER_DOC = random_ids(6 * CHUNK + 5, seed=42)
QUESTION = random_ids(5, seed=43)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(one_thread):
    return build_model("llama"), build_tokenizer()


def engine_on(tiny, folder, **config) -> KVBoost:
    model, tokenizer = tiny
    fields = dict(chunk_size=CHUNK, cpu_cache_bytes=0, disk_cache_dir=str(folder),
                  disk_cache_bytes=1 << 30)
    fields.update(config)
    return KVBoost(model, tokenizer, EngineConfig.of(**fields), name="tiny-llama")


@pytest.fixture(scope="module")
def cold(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, EngineConfig.of(reuse="off"), name="tiny-llama")
    return lambda ids: engine.generate(ids, max_new_tokens=NEW_TOKENS).token_ids


def index(folder) -> sqlite3.Connection:
    return sqlite3.connect(folder / INDEX_FILENAME, isolation_level=None)


def payload_files(folder):
    return sorted((folder / "payloads").rglob("*.kv"))


# -- 0: exact stays exact after a restart; quantized tiers are an opt-in reported as QUANTIZED ----------------
def test_default_tiers_are_lossless_and_a_restart_serves_exact_hits(tiny, tmp_path, cold):
    folder = tmp_path / "kv"
    first = engine_on(tiny, folder, cpu_cache_bytes=None)
    tiers = first.cache_stats().tiers
    assert tiers.host.kv_quant == "none" and tiers.disk.kv_quant == "none"
    first.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    restarted = engine_on(tiny, folder, cpu_cache_bytes=None)  # a fresh store: everything comes from disk
    result = restarted.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    kinds = {kind for _, _, kind in result.stats.chunks}
    assert result.stats.reused_by_tier.get("disk", 0) >= 6 * CHUNK
    assert "QUANTIZED" not in kinds and ("EXACT" in kinds or "PREFIX" in kinds)
    assert result.token_ids == cold(DOC + QUESTION)


@pytest.mark.parametrize("where", ["disk", "host"])
def test_hits_on_quantized_kv_are_reported_as_quantized_never_exact(tiny, tmp_path, where):
    folder = tmp_path / "kv"
    if where == "disk":  # int8 on disk, read back by a fresh process's store
        make = lambda: engine_on(tiny, folder, kv_quant=KVQuantConfig(disk="int8"))  # noqa: E731
        writer = make()
        writer.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
        reader = make()
    else:  # no device room, an int8 host tier, no disk: every entry lives quantized in RAM
        reader = engine_on(tiny, folder, cache_bytes=0, cpu_cache_bytes=1 << 30, disk_cache_bytes=0,
                           kv_quant=KVQuantConfig(host="int8"))
        reader.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    result = reader.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    kinds = [kind for _, _, kind in result.stats.chunks]
    assert "QUANTIZED" in kinds
    assert "EXACT" not in kinds and "PREFIX" not in kinds
    hits = reader.cache_stats().hits
    assert hits["QUANTIZED"] > 0 and hits["EXACT"] == 0 and hits["PREFIX"] == 0
    # KV computed after quantized KV is not the computed KV either: its next hit is QUANTIZED as well
    follow_up = reader.generate(DOC + QUESTION + result.token_ids + QUESTION, max_new_tokens=NEW_TOKENS)
    later = [kind for start, _, kind in follow_up.stats.chunks if start >= len(DOC)]
    assert "EXACT" not in later and "PREFIX" not in later


# -- 1: rows name files only inside the folder; only regular files are opened --------------------------------
@pytest.mark.parametrize("name", ["../../victim.txt", "ABSOLUTE", "payloads/../../victim.txt"])
def test_a_row_naming_a_file_outside_the_folder_never_touches_it(tiny, tmp_path, name, cold):
    folder = tmp_path / "kv"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    engine_on(tiny, folder).warm(DOC)
    target = str(victim) if name == "ABSOLUTE" else name
    with index(folder) as db:
        db.execute("UPDATE entries SET file = ?", [target])
    # a store already holding the records reads through the row: a MISS, the row dropped
    restarted = engine_on(tiny, folder)
    assert restarted.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS).token_ids == cold(DOC + QUESTION)
    assert victim.read_text() == "precious"
    with index(folder) as db:
        db.execute("UPDATE entries SET file = ?", [target])
    maintenance = DiskTier(folder)
    report = maintenance.verify()
    assert report["bad"] and all(b["problem"] == "malformed index row" for b in report["bad"])
    with index(folder) as db:
        db.execute("UPDATE entries SET file = ?", [target])
    maintenance.clear()
    maintenance.close()
    assert victim.read_text() == "precious"


def test_load_through_a_row_whose_file_was_renamed_outside_is_a_miss(tmp_path):
    """The store's own load path (not just start-up) refuses a row that names a foreign path."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    disk = DiskTier(tmp_path / "kv", 1 << 30, "none", namespace="ns")
    store = ChunkStore(0, LRU(), disk=disk)
    from engine.keys import chain_key

    root = b"r" * 16
    key = chain_key(root, range(8))
    kv = tuple((torch.ones(1, 2, 8, 4), torch.ones(1, 2, 8, 4)) for _ in range(2))
    assert store.put_chunk(key, root, b"c" * 16, 0, range(8), kv)
    disk.db.execute("UPDATE entries SET file = ?", [str(victim)])
    record = store.records[key]
    store.acquire(record)
    assert not store.fetch(record)
    store.release(record)
    assert victim.read_text() == "precious" and disk.counters.bad == 1


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_a_payload_that_is_not_a_regular_file_is_a_miss_without_blocking(tiny, tmp_path, kind, cold):
    folder = tmp_path / "kv"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    engine_on(tiny, folder).warm(DOC)
    for path in payload_files(folder):
        path.unlink()
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink":
            path.symlink_to(victim)
        else:
            path.mkdir()
    answers = []
    worker = threading.Thread(
        target=lambda: answers.append(engine_on(tiny, folder).generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)),
        daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "reading the cache blocked on a payload that is not a regular file"
    assert answers[0].token_ids == cold(DOC + QUESTION)
    assert answers[0].stats.reused_tokens == 0
    assert victim.read_text() == "precious"
    DiskTier(folder).clear()
    assert victim.read_text() == "precious"


# -- 2: a malformed row is a dropped row, never an exception at start-up --------------------------------------
@pytest.mark.parametrize("damage", [
    "UPDATE entries SET tokens = 'not a blob' WHERE id = (SELECT MIN(id) FROM entries)",
    "UPDATE entries SET tokens = X'010203' WHERE id = (SELECT MIN(id) FROM entries)",
    "UPDATE entries SET parent = 'zz-not-hex' WHERE id = (SELECT MIN(id) FROM entries)",
    "UPDATE entries SET key = 'nothex' WHERE id = (SELECT MIN(id) FROM entries)",
    "UPDATE entries SET start = 'x', num_bytes = -5 WHERE id = (SELECT MIN(id) FROM entries)",
    "UPDATE entries SET importance = 'NaN', hits = 1.5 WHERE id = (SELECT MIN(id) FROM entries)",
    "UPDATE entries SET kind = 'weird', content_key = 12 WHERE id = (SELECT MIN(id) FROM entries)",
])
def test_a_malformed_row_never_stops_a_model_load(tiny, tmp_path, damage, cold):
    folder = tmp_path / "kv"
    writer = engine_on(tiny, folder)
    writer.warm(DOC)
    with index(folder) as db:
        rows = db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        db.execute(damage)
    engine = engine_on(tiny, folder)  # raised in ChunkStore.__init__ -> sync_disk before the fix
    assert engine.disk_error is None
    with index(folder) as db:
        assert db.execute("SELECT COUNT(*) FROM entries").fetchone()[0] == rows - 1  # only the bad row went
    result = engine.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == cold(DOC + QUESTION)
    assert result.stats.reused_by_tier.get("disk", 0) > 0  # the good rows still serve


# -- 3: a row's tokens are proven against the payload and the prompt ------------------------------------------
@pytest.mark.parametrize("rekey", [False, True])
def test_a_tail_row_rewritten_to_another_questions_tokens_is_never_reused(tiny, tmp_path, rekey, cold):
    """The tail of one conversation over DOC (its question and answer) relabelled as another question's tokens:
    a prompt with that other question walks DOC's chunks to the forged tail. It must be computed, not served the
    first conversation's KV. With `rekey` the row's key is recomputed to match (the payload file untouched)."""
    from engine.keys import chain_key

    folder = tmp_path / "kv"
    engine_on(tiny, folder).generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    with index(folder) as db:
        key, parent, start, tokens = db.execute(
            "SELECT key, parent, start, tokens FROM entries WHERE kind = 'tail'").fetchone()
        n = len(tokens) // 4
        prompt = DOC + random_ids(n + 4, seed=44)  # the same document, another question
        forged = prompt[start:start + n]
        new_key = chain_key(bytes.fromhex(parent) + b"tail", forged).hex() if rekey else key
        db.execute("UPDATE entries SET tokens = ?, key = ? WHERE key = ?",
                   [np.asarray(forged, dtype="<i4").tobytes(), new_key, key])
    result = engine_on(tiny, folder).generate(prompt, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == cold(prompt)
    assert result.stats.reused_tokens <= start  # DOC's chunks, never the forged tail


# -- 4: smaller ---------------------------------------------------------------------------------------------
def test_reused_tokens_read_from_disk_are_counted_as_disk_after_a_replan(tiny, tmp_path):
    folder = tmp_path / "kv"
    engine_on(tiny, folder).warm(DOC)
    files = payload_files(folder)
    with index(folder) as db:
        last = db.execute("SELECT file FROM entries ORDER BY start DESC LIMIT 1").fetchone()[0]
    (folder / last).write_bytes(b"damaged")  # the last chunk fails its check after the others were promoted
    assert len(files) > 2
    result = engine_on(tiny, folder).generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    assert result.stats.reused_tokens > 0
    assert result.stats.reused_by_tier == {"disk": result.stats.reused_tokens}


def test_a_read_only_folder_names_the_real_error(tiny, tmp_path):
    folder = tmp_path / "mnt"
    folder.mkdir()
    if os.system(f"mount -t tmpfs -o size=8m tmpfs '{folder}' 2>/dev/null") != 0:
        pytest.skip("needs mount (root) for a read-only folder")
    try:
        writer = engine_on(tiny, folder / "kv")
        writer.warm(DOC)  # a cache folder written earlier...
        writer.store.disk.close()
        assert os.system(f"mount -o remount,ro '{folder}'") == 0  # ...then read-only (a full or locked-down disk)
        engine = engine_on(tiny, folder / "kv")
        assert engine.disk_error is not None
        assert "rollback" not in engine.disk_error.lower()
        assert "read-only file system" in engine.disk_error.lower()
        assert engine.generate(DOC, max_new_tokens=2).token_ids  # the engine still answers, from memory
    finally:
        os.system(f"umount -l '{folder}'")

"""The disk tier across real processes: a restart serves what an earlier process computed, and two processes
writing, evicting and reading one folder at once never serve anything wrong."""

from __future__ import annotations

import json
import subprocess
import sys

import disk_worker  # the same document/question definitions as the worker processes
import pytest
from processes import SUPPORT, child_env
from tiny_models import build_model, build_tokenizer

from engine.kv.disk import DiskTier

WORKER = SUPPORT / "disk_worker.py"


def run_worker(folder, budget, quant, mode, *seeds, wait=True):
    env = child_env()
    args = [sys.executable, str(WORKER), str(folder), str(budget), quant, mode, *map(str, seeds)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return finish(proc) if wait else proc


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_answers():
    """Greedy answers computed here without any cache: what every process must produce."""
    from engine import EngineConfig, KVBoost

    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(reuse="off"), name="tiny-llama")
    return lambda seed: engine.generate(disk_worker.document(seed) + disk_worker.QUESTION,
                                        max_new_tokens=disk_worker.NEW_TOKENS).token_ids


def test_a_fresh_process_answers_from_what_an_earlier_one_warmed(tmp_path, cold_answers):
    folder = tmp_path / "kv"
    run_worker(folder, 1 << 30, "none", "warm", 1, 2)
    second = run_worker(folder, 1 << 30, "none", "ask", 1, 2)
    for seed in ("1", "2"):
        # the whole document (10 chunks) came from disk; the question was computed
        assert second["reused_by_tier"][seed].get("disk", 0) >= disk_worker.DOC_TOKENS
        assert second["answers"][seed] == cold_answers(int(seed))
    assert second["stats"]["tier_hits"]["disk"] >= 20
    assert second["stats"]["tiers"]["disk"]["reads"] >= 20


def test_int8_disk_entries_survive_a_restart_too(tmp_path, cold_answers):
    folder = tmp_path / "kv"
    run_worker(folder, 1 << 30, "int8", "warm", 3)
    second = run_worker(folder, 1 << 30, "int8", "ask", 3)
    assert second["reused_by_tier"]["3"].get("disk", 0) >= disk_worker.DOC_TOKENS
    # int8 KV is not bit-exact, so answers are compared by the quality bench, not here; a "none" process on
    # the same folder must not see the int8 entries (another setting, another namespace)
    other = run_worker(folder, 1 << 30, "none", "ask", 3)
    assert other["reused_by_tier"]["3"] == {}
    assert other["answers"]["3"] == cold_answers(3)


def test_two_processes_read_each_others_entries_while_evicting_under_a_tight_budget(tmp_path, cold_answers):
    """A and B warm six documents each into one folder whose budget holds about 95 of their 120 chunks (no
    device tier: every hit is a file read), meet, then each asks about the other's documents and its own. Each
    must be served the other's files (counted per document), both evict all along, and every answer is the cold
    one."""
    folder = tmp_path / "kv"
    budget = 900_000
    a_seeds, b_seeds = [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]
    a = run_worker(folder, budget, "none", "exchange:a:b", *a_seeds, "--", *b_seeds, wait=False)
    b = run_worker(folder, budget, "none", "exchange:b:a", *b_seeds, "--", *a_seeds, wait=False)
    results = {"a": finish(a), "b": finish(b)}
    for name, result in results.items():
        assert "disk_error" not in result["stats"], result["stats"].get("disk_error")  # both got the disk tier
        for seed, answer in result["answers"].items():
            assert answer == cold_answers(int(seed)), f"{name}: document {seed} answered differently"
    from_peer = {name: sum(result["reused_by_tier"][str(seed)].get("disk", 0) for seed in peer)
                 for (name, result), peer in zip(results.items(), (b_seeds, a_seeds))}
    assert from_peer["a"] >= disk_worker.DOC_TOKENS and from_peer["b"] > 0, from_peer
    assert all(r["stats"]["tiers"]["disk"]["reads"] > 0 for r in results.values())
    evicted = sum(r["stats"]["tiers"]["disk"]["evicted"] for r in results.values())
    assert evicted > 0  # the budget really was tight
    disk = DiskTier(folder)
    try:
        assert disk.num_bytes() <= budget
        report = disk.verify(repair=False)
        assert report["bad"] == [] and report["checked"] > 0
        assert disk.stats()["entries"] == report["checked"]
    finally:
        disk.close()
    # whatever survived is served to a third process, with the cold answers
    third = run_worker(folder, budget, "none", "ask", 25)
    assert third["answers"]["25"] == cold_answers(25)


HOLD_FRESH_INDEX = """
import sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("CREATE TABLE IF NOT EXISTS warming_up (x)")
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT INTO warming_up VALUES (1)")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
db.execute("COMMIT")
"""


def test_a_new_folder_being_set_up_by_another_process_still_gets_the_disk_tier(tmp_path):
    """Two processes opening a new folder at once: while one holds the fresh index (not yet in WAL mode), the
    other's switch to WAL is answered "database is locked" at once, not after the busy timeout. Reproduced
    deterministically here with a process holding a write on the fresh index for 1.5 s."""
    folder = tmp_path / "kv"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FRESH_INDEX, str(folder / "index.sqlite3"), "1.5"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        disk = DiskTier(folder, None, "none", namespace="ns")  # raised "database is locked" before the fix
        assert disk.budget_bytes > 0
        disk.close()
    finally:
        holder.wait(timeout=30)


def test_a_process_sees_another_processes_new_entries_at_its_next_request(tmp_path, cold_answers):
    folder = tmp_path / "kv"
    here = disk_worker.make_engine(str(folder), 1 << 30, "none", device_bytes=0)  # opened before the other wrote
    run_worker(folder, 1 << 30, "none", "warm", 30)
    result = here.generate(disk_worker.document(30) + disk_worker.QUESTION, max_new_tokens=disk_worker.NEW_TOKENS)
    assert result.stats.reused_by_tier.get("disk", 0) >= disk_worker.DOC_TOKENS  # no explicit sync needed
    assert result.token_ids == cold_answers(30)


def test_an_entry_another_process_evicted_is_a_miss_and_computed_again(tmp_path, cold_answers):
    folder = tmp_path / "kv"
    budget = 200_000  # about two documents' chunks
    here = disk_worker.make_engine(str(folder), budget, "none", device_bytes=0)
    here.warm(disk_worker.document(31))
    known = set(here.store.records)
    run_worker(folder, budget, "none", "warm", 40, 41, 42, 43)  # evicts everything `here` wrote
    disk = DiskTier(folder)
    try:
        with disk._lock:
            left = {bytes.fromhex(k) for (k,) in disk.db.execute("SELECT key FROM entries").fetchall()}
    finally:
        disk.close()
    assert known and not known & left
    result = here.generate(disk_worker.document(31) + disk_worker.QUESTION, max_new_tokens=disk_worker.NEW_TOKENS)
    assert result.token_ids == cold_answers(31)
    assert here.cache_stats().disk_misses > 0  # it tried its records, found their rows gone
    assert result.stats.reused_by_tier.get("disk", 0) == 0

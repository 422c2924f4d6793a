"""The disk tier across real processes: a restart serves what an earlier process computed, and two processes
writing, evicting and reading one folder at once never serve anything wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.disk import DiskTier
from tiny_models import build_model, build_tokenizer

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WORKER = HERE / "disk_worker.py"

sys.path.insert(0, str(HERE))
import disk_worker  # noqa: E402  (the same document/question definitions as the worker processes)


def run_worker(folder, budget, quant, mode, *seeds, wait=True):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]))
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

    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig(reuse="off"), name="tiny-llama")
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


def test_two_processes_share_one_folder_under_a_tight_budget(tmp_path, cold_answers):
    folder = tmp_path / "kv"
    budget = 120_000  # about 5 of the 12 documents' chunks: both processes evict all along
    a = run_worker(folder, budget, "none", "warm+ask-disk-only", 10, 11, 12, 13, 14, 15, wait=False)
    b = run_worker(folder, budget, "none", "warm+ask-disk-only", 20, 21, 22, 23, 24, 25, wait=False)
    results = [finish(a), finish(b)]
    for result in results:
        for seed, answer in result["answers"].items():
            assert answer == cold_answers(int(seed)), f"document {seed} answered differently"
    disk = DiskTier(folder)
    try:
        assert disk.num_bytes() <= budget
        report = disk.verify(repair=False)
        assert report["bad"] == [] and report["checked"] > 0
        stats = disk.stats()
        assert stats["entries"] == report["checked"]
    finally:
        disk.close()
    evicted = sum(r["stats"]["tiers"]["disk"]["evicted"] for r in results)
    assert evicted > 0  # the budget really was tight
    # whatever survived is served to a third process, with the cold answers
    third = run_worker(folder, budget, "none", "ask", 25)
    assert third["answers"]["25"] == cold_answers(25)

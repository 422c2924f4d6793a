"""Exact stays exact after a restart, with the default settings: a multi-turn chat run in two fresh processes on
one cache folder gives, on every turn, the tokens of plain full prefill; the second process is served from the
disk tier, and its hits are EXACT/PREFIX (lossless), never QUANTIZED."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import chat_worker  # the same conversation as the worker processes
import pytest
from processes import SUPPORT, child_env


def run_chat(folder: Path) -> dict:
    env = child_env(KVBOOST_CACHE_DIR=str(folder))
    out = subprocess.run([sys.executable, str(SUPPORT / "chat_worker.py")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_restarted_chat_with_default_settings_is_token_identical_to_full_prefill(smollm, tmp_path):
    plain = smollm.with_options(reuse="off")

    def answer(messages):
        result = plain.chat(messages, max_new_tokens=chat_worker.NEW_TOKENS)
        return result.text, result.token_ids, {}

    reference = [turn["token_ids"] for turn in chat_worker.conversation(answer)]
    folder = tmp_path / "kv"
    first = run_chat(folder)
    # every tier keeps KV as computed unless the user opts in (int8 on host and disk changed 1 of 4 turns)
    assert first["kv_quant"] == {"device": "none", "host": "none", "disk": "none"}
    second = run_chat(folder)  # a restart: a fresh process on the same folder
    for name, run in (("first", first), ("restarted", second)):
        for index, (turn, want) in enumerate(zip(run["turns"], reference)):
            # what served the turn, for a failure that shows once in many runs (seen once in CI, never here)
            assert turn["token_ids"] == want, (f"{name} process, turn {index}: chunks {turn['chunks']}, "
                                               f"tiers {turn['reused_by_tier']}")
    from_disk = sum(turn["reused_by_tier"].get("disk", 0) for turn in second["turns"])
    assert from_disk > 0 and second["turns"][0]["reused_by_tier"].get("disk", 0) > 0
    kinds = {kind for turn in second["turns"] for _, _, kind in turn["chunks"]}
    assert "QUANTIZED" not in kinds and kinds & {"EXACT", "PREFIX"}
    assert second["hits"].get("QUANTIZED", 0) == 0

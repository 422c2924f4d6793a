"""A process's first answer is computed like every later one: on a loaded machine torch's first vectorized cos()
on fresh CPU threads was, now and then, 1.5e-4 off, so the first request's rotary tables (and its logits) differed
from the second's (3 of 14 fresh processes); engine.thread_math.settle_thread_math runs those functions once first."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from processes import ROOT, child_env

CHILD = """
import hashlib, json
from engine import KVBoost
engine = KVBoost.from_pretrained(device="cpu", disk_cache_bytes=0, reuse="off", speculative=None)
messages = [{"role": "user", "content": "What is the capital of France?"}]
digests = [hashlib.sha1(engine.generate(messages, max_new_tokens=2, temperature=0, return_logits=True)
                        .first_logits.numpy().tobytes()).hexdigest() for _ in range(2)]
print(json.dumps(digests))
"""
PROCESSES = 10


@pytest.mark.slow
def test_the_first_request_of_a_fresh_process_on_a_loaded_machine_gives_the_later_requests_logits():
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for _ in range(PROCESSES):
            done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=child_env(), capture_output=True,
                                  text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
            first, second = json.loads(done.stdout.strip().splitlines()[-1])
            assert first == second
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()

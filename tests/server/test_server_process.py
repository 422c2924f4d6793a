"""`kvboost-server` as users start it: a real process on a free loopback port, stopped by the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import free_port, wait_healthy

BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_kvboost_server_serves_the_default_model_with_an_api_key():
    port = free_port()
    proc = subprocess.Popen([str(BIN / "kvboost-server"), "--port", str(port), "--api-key", "k1",
                             "--model-name", "smol", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        weights = httpx.get(f"http://127.0.0.1:{port}/health").json()["weights"]  # what was loaded
        # the file's Q4_1 layers as int4 layers (an AVX-512 CPU) or as its blocks (elsewhere)
        assert weights["format"].startswith("gguf-q4_1") and weights["choice"]["asked"] == "auto"
        assert sum(entry["tensors"] for conversion, entry in weights["gguf"].items()
                   if conversion in ("Q4_1->int4", "Q4_1->blocks")) == 210 and weights["resident_bytes"] > 0
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k1", max_retries=0)
        resp = client.chat.completions.create(model="smol", temperature=0, max_tokens=12,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in resp.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k2", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode in (0, -signal.SIGINT)
    err = proc.stderr.read()
    assert "layer 1 of 30 (1/31)" in err and "(31/31)" in err  # a line per tenth of the load off a terminal
    assert "Q4_1->int4 x210" in err or "Q4_1->blocks x210" in err  # then what was loaded


def test_kvboost_server_refuses_a_bad_model_with_the_reason(tmp_path):
    proc = subprocess.run([str(BIN / "kvboost-server"), "--model", str(tmp_path / "missing"), "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "kvboost-server: error:" in proc.stderr

"""The server fixture: a real server on a free loopback port over the session's real model, stopped when the
module ends."""

from __future__ import annotations

import pytest
from server_helpers import RunningServer


@pytest.fixture(scope="module")
def server(smollm):
    running = RunningServer(smollm.with_options())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def fifo_server(smollm):
    """A server that decodes one request at a time, in arrival order (kvboost-server --max-batch 1)."""
    running = RunningServer(smollm.with_options(), max_batch=1)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

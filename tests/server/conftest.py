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


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

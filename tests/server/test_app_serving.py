"""The desktop app serving its model over the API: the window's requests and the API's run on one torch thread,
in turn, and stopping the API leaves the window's work alone. The app's real EngineClient (Qt offscreen), real
HTTP on 127.0.0.1, a real tiny engine."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import free_port, wait_until  # noqa: E402
from tiny_models import CHUNK, build_model, build_tokenizer  # noqa: E402

WAIT_MS = 60_000
WINDOW_WORD = 400  # the window's prompts start with this token, the API's with 100 + their number


def recording_engine():
    """A real KVBoost over a tiny Llama that notes, for each stream, who asked (by the prompt's first token) and
    the thread it runs on, then streams as KVBoost does."""
    from engine import EngineConfig, KVBoost

    class Recording(KVBoost):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.streams: list[tuple[str, int]] = []

        def stream(self, prompt, **kwargs):
            first = prompt[0]
            who = "window" if first == WINDOW_WORD else f"api{first - 100}" if 100 < first < 200 else "test"
            self.streams.append((who, threading.get_ident()))
            return super().stream(prompt, **kwargs)

    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return Recording(build_model("llama"), tokenizer,
                     EngineConfig.of(chunk_size=CHUNK, disk_cache_bytes=0))


@pytest.fixture
def serving(qtbot):
    """The app's engine client over the recording engine, serving it on a free port; (client, engine, base URL)."""
    from app.engine_client import EngineClient

    engine = recording_engine()
    client = EngineClient()
    with qtbot.waitSignal(client.model_loaded, timeout=WAIT_MS):
        client.use_engine(engine)
    with qtbot.waitSignal(client.server_started, timeout=WAIT_MS) as started:
        client.start_server(free_port())
    yield client, engine, started.args[0].removesuffix("/v1")
    client.shutdown()


def window_chat(qtbot, client, tokens: int = 4):
    """A chat from the window, as a tab sends it; its answer (app.answers.Answer)."""
    request = client.chat([{"role": "user", "content": f"w{WINDOW_WORD} w401 w402"}],
                          {"max_new_tokens": tokens, "temperature": 0})
    qtbot.waitUntil(lambda: request.done, timeout=WAIT_MS)
    return request.answer


def api_completion(url: str, number: int, timeout: float = 60) -> httpx.Response:
    body = {"model": "model", "prompt": [100 + number, 5, 6, 7], "max_tokens": 3, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


class Holding:
    """The engine generating on the test's thread, paused between two tokens: jobs on the worker wait for it."""

    def __init__(self, engine):
        self._generation = engine.stream([WINDOW_WORD + 50] * 8, max_new_tokens=4000, temperature=0)

    def __enter__(self):
        next(self._generation)
        return self

    def __exit__(self, *exc):
        self._generation.close()


def test_the_window_and_the_api_run_on_one_engine_thread(qtbot, serving):
    client, engine, url = serving
    answer = window_chat(qtbot, client)
    assert answer.finish_reason == "length"
    response = api_completion(url, 1)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert [who for who, _ in engine.streams] == ["window", "api1"]
    idents = {ident for _, ident in engine.streams}
    assert len(idents) == 1 and threading.get_ident() not in idents
    (engine_thread,) = [t for t in threading.enumerate() if t.ident in idents]
    assert engine_thread.name == "kvboost-engine"  # the app's worker, not a thread of the server's own
    assert not any(t.name == "kvboost-server-engine" for t in threading.enumerate())


def test_a_window_request_queued_behind_api_requests_runs_before_the_later_ones(qtbot, serving):
    client, engine, url = serving
    with ThreadPoolExecutor(max_workers=4) as pool:
        with Holding(engine):
            responses = []
            for number in range(1, 5):
                responses.append(pool.submit(api_completion, url, number))
                if number == 1:  # taken by the worker, waiting for the engine
                    wait_until(lambda: health(url)["running"] == 1, what="the first API request to be taken")
                else:
                    wait_until(lambda: health(url)["waiting"] == number - 1, what=f"API request {number} to queue")
            request = client.chat([{"role": "user", "content": f"w{WINDOW_WORD} w401"}],
                                  {"max_new_tokens": 2, "temperature": 0})
        assert all(r.result().status_code == 200 for r in responses)
    qtbot.waitUntil(lambda: request.done, timeout=WAIT_MS)
    order = [who for who, _ in engine.streams if who != "test"]
    assert order == ["api1", "window", "api2", "api3", "api4"]
    assert len({ident for who, ident in engine.streams if who != "test"}) == 1


def test_stopping_the_api_cancels_its_requests_and_leaves_the_window_running(qtbot, serving):
    client, engine, url = serving
    stopped = []
    client.server_stopped.connect(lambda: stopped.append(True))
    with ThreadPoolExecutor(max_workers=1) as pool:
        with Holding(engine):
            request = client.chat([{"role": "user", "content": f"w{WINDOW_WORD} w401"}],
                                  {"max_new_tokens": 6, "temperature": 0})
            qtbot.waitUntil(lambda: engine.streams[-1][0] == "window", timeout=WAIT_MS)
            waiting = pool.submit(api_completion, url, 7)
            wait_until(lambda: health(url)["waiting"] == 1, what="the API request to queue behind the window's")
            client.stop_server()
        # The engine is free: the window's answer runs to its end, then the API's request is dropped unrun.
        qtbot.waitUntil(lambda: request.done, timeout=WAIT_MS)
        answer = request.answer
        assert answer.finish_reason == "length" and answer.stats["generated_tokens"] == 6
        response = waiting.result(timeout=60)
        assert response.status_code == 499 and response.json()["error"]["code"] == "cancelled"
    qtbot.waitUntil(lambda: bool(stopped), timeout=WAIT_MS)
    assert "api7" not in [who for who, _ in engine.streams]  # cancelled before it ran: it never did
    assert client.server_url is None
    # The worker is the app's: it goes on serving the window.
    assert window_chat(qtbot, client).finish_reason == "length"

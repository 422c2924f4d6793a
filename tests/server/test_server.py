"""The OpenAI-compatible server, through the real `openai` client and raw HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_helpers import EngineBusy, RunningServer, wait_until

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "smollm2"


def test_chat_answers_like_the_engine_with_usage_and_cache_stats(client, server):
    resp = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=24)
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    direct = server.engine.with_options(reuse="off").chat(FRANCE, max_new_tokens=24)
    assert choice.message.content == direct.text
    assert resp.usage.prompt_tokens == len(server.engine.encode(FRANCE))
    assert resp.usage.completion_tokens == direct.stats.generated_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    stats = resp.model_extra["kvboost"]
    assert stats["prompt_tokens"] == resp.usage.prompt_tokens and stats["ttft_ms"] > 0
    assert sum(stats["tokens_by_kind"].values()) == stats["prompt_tokens"]


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(client):
    kwargs = dict(model="smollm2", messages=FRANCE, temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["kvboost"]["prompt_tokens"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_raw_stream_ends_with_done(server):
    body = {"model": "smollm2", "messages": FRANCE, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert all(json.loads(d)["object"] == "chat.completion.chunk" for d in data[:-1])


def test_a_follow_up_turn_reuses_the_conversation(client):
    first = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=16)
    history = FRANCE + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model="smollm2", messages=history, temperature=0, max_tokens=16)
    stats = second.model_extra["kvboost"]
    assert stats["reused_tokens"] >= 0.7 * stats["prompt_tokens"]


def test_completions_with_max_tokens_and_stop(client):
    resp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                     temperature=0)
    assert resp.choices[0].text.strip() and resp.usage.completion_tokens <= 8
    assert resp.choices[0].finish_reason in ("length", "stop")
    stopped = client.completions.create(model="smollm2", prompt="Count: one, two, three, four, five, six,",
                                        max_tokens=30, temperature=0, stop=[","])
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == resp.choices[0].text


def test_a_seed_makes_sampling_repeatable(client):
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Tell me a story."}], temperature=0.9,
                  top_p=0.95, max_tokens=20)
    a = client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kwargs).choices[0].message.content
    assert a == b


def test_openai_errors_carry_the_right_status_and_code(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=FRANCE)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "word " * 9000}])
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model="smollm2", messages=FRANCE, n=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=3)


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b'{"model": "smollm2"}', 400, "messages"),
    (b'{"model": "smollm2", "messages": []}', 400, "messages"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', 400,
     "max_tokens"),
    (b'{"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages.0.role"),
    (b'{"model": "smollm2", "messages": "hi"}', 400, "messages"),
    (b'[1, 2]', 400, None),
])
def test_malformed_requests_get_openai_error_json(server, body, status, param):
    resp = httpx.post(server.url + "/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_a_json_body_is_read_whatever_the_content_type(server):
    body = b'{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}'
    resp = httpx.post(server.url + "/v1/completions", content=body,
                      headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"]


def test_chunked_bodies_are_read_and_limited(server):
    def pieces(total, step=1 << 16):
        yield b'{"model": "smollm2", "prompt": "'
        for _ in range(total // step):
            yield b"a" * step
        yield b'", "max_tokens": 1}'

    resp = httpx.post(server.url + "/v1/completions", content=pieces(6 << 20))  # no Content-Length
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
    small = httpx.post(server.url + "/v1/completions", content=(p for p in [b'{"model": "smollm2", "prompt": "Hi",',
                                                                            b' "max_tokens": 1}']))
    assert small.status_code == 200, small.text


def test_oversized_bodies_and_unknown_routes(server):
    big = b'{"model": "smollm2", "prompt": "' + b"a" * (5 << 20) + b'"}'
    resp = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
    resp = httpx.get(server.url + "/v1/files")
    assert resp.status_code == 404 and "error" in resp.json()
    resp = httpx.get(server.url + "/v1/chat/completions")
    assert resp.status_code == 405 and "error" in resp.json()


def test_api_key_is_required_when_set(smollm):
    running = RunningServer(smollm.with_options(), api_key="s3cret")
    try:
        resp = httpx.get(running.url + "/v1/models")
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        resp = httpx.get(running.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert resp.status_code == 401
        good = openai.OpenAI(base_url=running.url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["smollm2"]
        bad = openai.OpenAI(base_url=running.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        running.stop()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-at-a-time"])
def test_concurrent_streams_get_the_answers_they_get_alone(batched, server, fifo_server):
    """Requests queued behind a busy engine: batched, those that arrive while others decode are decoded with
    them (the last three together); with --max-batch 1, one at a time in arrival order."""
    from openai import OpenAI

    server = server if batched else fifo_server
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    questions = [f"Name a {thing}." for thing in ("color", "fruit", "planet", "animal")]
    alone = {q: client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                               temperature=0, max_tokens=12).choices[0].message.content
             for q in questions}
    idle(server)
    results: dict[str, tuple] = {}
    first_token_at: dict[str, float] = {}

    def ask(q):
        text, stats = "", None
        for c in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                                temperature=0, max_tokens=12, stream=True):
            if c.choices:
                if c.choices[0].delta.content and q not in first_token_at:
                    first_token_at[q] = time.monotonic()
                text += c.choices[0].delta.content or ""
                if c.choices[0].finish_reason:
                    stats = c.model_extra["kvboost"]
        results[q] = (text, stats)

    threads, sent_at, queued_at = [], [], []
    with EngineBusy(server.engine):  # every request queues behind this generation, in a known order
        for i, q in enumerate(questions):
            threads.append(threading.Thread(target=ask, args=(q,)))
            sent_at.append(time.monotonic())
            threads[-1].start()
            if i == 0:  # taken by the scheduler, waiting for the engine
                wait_until(lambda: server.scheduler.num_running == 1, what="the first request to be taken")
            else:  # queued behind it before the next one is sent
                wait_until(lambda: server.scheduler.num_waiting == i, what=f"request {i} to queue")
            queued_at.append(time.monotonic())
    engine_free_at = time.monotonic()
    for t in threads:
        t.join(timeout=300)
    assert {q: r[0] for q, r in results.items()} == alone
    if batched:  # the first ran alone until the engine was free; then the others joined it
        assert all(results[q][1]["batched_forwards"] > 0 for q in questions[1:])
        return
    assert not any(results[q][1]["batched_forwards"] for q in questions)
    # One at a time in arrival order: each stream's first token comes a whole generation after the one before.
    assert sorted(questions, key=first_token_at.__getitem__) == questions
    # Each reported wait is the real one: the three behind the first were queued (the server had them) until at
    # least the engine came free, and every wait ended before its first token reached the client. (Their sizes
    # need not grow in arrival order: a request sent later waits less when the one before it took less time to
    # generate than the gap between the two sends.)
    for i, q in enumerate(questions):
        wait_s = results[q][1]["queue_ms"] / 1000
        assert wait_s <= first_token_at[q] - sent_at[i], (q, wait_s)
        if i:
            assert wait_s >= engine_free_at - queued_at[i], (q, wait_s)


def idle(server) -> None:
    """Waits until the previous request has fully ended, so the scheduler's counts are final."""
    deadline = time.monotonic() + 30
    while server.scheduler.num_running or server.scheduler.num_waiting:
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)


LONG = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 4000, "temperature": 0}


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(server):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a very long essay."}],
            "max_tokens": 4000, "temperature": 0, "stream": True}
    idle(server)
    served, cancelled = server.scheduler.num_served, server.scheduler.num_cancelled
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if '"content"' in line and '""' not in line:
                break  # one real token arrived; leave
    deadline = time.monotonic() + 30
    while server.scheduler.num_served == served:  # 4000 tokens would take minutes
        assert time.monotonic() < deadline, "the generation went on after the client left"
        time.sleep(0.1)
    assert server.scheduler.num_running == 0
    assert server.scheduler.num_cancelled == cancelled + 1  # stopped by the cancel, not by its own end


def test_a_non_streaming_client_that_gives_up_cancels_its_generation(server):
    idle(server)
    served, cancelled = server.scheduler.num_served, server.scheduler.num_cancelled
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=LONG, timeout=2)
    deadline = time.monotonic() + 30
    while server.scheduler.num_served == served:
        assert time.monotonic() < deadline, "the generation went on after the client left"
        time.sleep(0.1)
    assert server.scheduler.num_cancelled == cancelled + 1


def test_a_waiting_request_whose_client_left_never_runs(fifo_server):
    server = fifo_server  # one at a time: the second request waits (batched, it would join the first)
    idle(server)
    served, skipped = server.scheduler.num_served, server.scheduler.num_skipped
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=120) as resp:
        lines = resp.iter_lines()  # kept: a dropped iterator closes the stream, and the server cancels it
        next(lines)  # the long one is running
        assert server.scheduler.num_running == 1
        with pytest.raises(httpx.TimeoutException):  # this one waits behind it, then its client gives up
            httpx.post(server.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 5},
                       timeout=1.5)
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while server.scheduler.num_waiting or server.scheduler.num_running:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert server.scheduler.num_served == served + 1  # the long one only
    assert server.scheduler.num_skipped == skipped + 1


def test_web_pages_and_foreign_hosts_are_refused_without_an_api_key(server):
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 1}
    resp = httpx.post(server.url + "/v1/completions", json=body, headers={"Origin": "https://evil.example"})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "origin_not_allowed"
    resp = httpx.post(server.url + "/v1/completions", json=body, headers={"Host": "evil.example"})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "host_not_allowed"
    assert httpx.post(server.url + "/v1/completions", json=body,
                      headers={"Host": f"localhost:{server.port}"}).status_code == 200


def test_deeply_nested_json_is_a_400_not_a_crash(server):
    resp = httpx.post(server.url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_the_command_line_takes_a_batch_size_of_at_least_one(capsys):
    from cli.server import build_server_parser

    assert build_server_parser().parse_args([]).max_batch == 8
    assert build_server_parser().parse_args(["--max-batch", "1"]).max_batch == 1
    with pytest.raises(SystemExit):
        build_server_parser().parse_args(["--max-batch", "0"])
    assert "must be at least 1" in capsys.readouterr().err

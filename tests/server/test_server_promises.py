"""What docs/guide/server.md promises, each checked over real HTTP on 127.0.0.1 against
a real server over the real model: the queue limit, error statuses, the API key from the environment, and the
request and response fields it names."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import EngineBusy, RunningServer, free_port, wait_healthy, wait_until

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ERROR_FIELDS = {"message", "type", "param", "code"}


def idle(server) -> None:
    wait_until(lambda: not server.scheduler.num_running and not server.scheduler.num_waiting,
               what="the server to go idle")


def openai_client(running, api_key="unused"):
    return openai.OpenAI(base_url=running.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def engine_with_chat_template(smollm, template: str):
    """An engine over the session's model whose tokenizer (a copy: the session's own is left as it is) renders
    chats with `template`."""
    from engine import KVBoost

    tokenizer = copy.deepcopy(smollm.tokenizer)
    tokenizer.chat_template = template
    assert smollm.tokenizer.chat_template != template
    return KVBoost(smollm.model, tokenizer, smollm.config, fingerprint=smollm.fingerprint, name=smollm.name)


# -- the queue ------------------------------------------------------------------------------------------------
def test_past_64_waiting_requests_the_next_is_a_429_and_the_server_goes_on(server):
    """The default server (no max_queue given): one request running, 64 waiting, then 429."""
    idle(server)
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 1, "stream": True}
    limits = httpx.Limits(max_connections=80, max_keepalive_connections=0)
    with httpx.Client(base_url=server.url, timeout=60, limits=limits) as http:
        with EngineBusy(server.engine), contextlib.ExitStack() as clients:  # clients leave first
            # A streamed request is answered 200 as soon as it is queued, so each of these is in the queue.
            first = clients.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert first.status_code == 200
            wait_until(lambda: server.scheduler.num_running == 1, what="the first request to be taken")
            for i in range(64):
                resp = clients.enter_context(http.stream("POST", "/v1/completions", json=body))
                assert resp.status_code == 200, (i, resp.read())
            assert server.scheduler.num_waiting == 64
            refused = clients.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert refused.status_code == 429, "a 65th request was queued"
            refused.read()
            error = refused.json()["error"]
            assert set(error) == ERROR_FIELDS
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert "64" in error["message"]
        # The 65 clients left and the engine is free again: the queue drains and the next request is answered.
        idle(server)
        answer = http.post("/v1/completions", json={**body, "stream": False})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 1


# -- errors -----------------------------------------------------------------------------------------------------
def test_an_engine_failure_is_a_500_json_and_the_next_request_is_served(client, server):
    """A real failure inside generation: the model's embedding layer raises, as a device fault would."""
    idle(server)

    def fault(_module, _args):
        raise RuntimeError("device fault in the embedding")

    body = {"model": "smollm2", "messages": FRANCE, "max_tokens": 6, "temperature": 0}
    handle = server.engine.model.get_input_embeddings().register_forward_pre_hook(fault)
    try:
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as streamed:
            data = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
    finally:
        handle.remove()
    assert resp.status_code == 500 and resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == ERROR_FIELDS and error["type"] == "server_error"
    assert "RuntimeError" in error["message"] and "device fault in the embedding" in error["message"]
    # Streamed, the status line went out before the failure: the error is one event, then [DONE].
    errors = [json.loads(d)["error"] for d in data if d != "[DONE]" and "error" in json.loads(d)]
    assert len(errors) == 1 and errors[0]["type"] == "server_error" and data[-1] == "[DONE]"
    # The engine was left usable: the next request answers as the engine alone does.
    after = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=6)
    direct = server.engine.with_options(reuse="off").chat(FRANCE, max_new_tokens=6)
    assert after.choices[0].message.content == direct.text


def test_a_broken_chat_template_is_a_500_json_and_the_next_request_is_served(smollm):
    """Not a refusal but a bug in the template (a division by zero while rendering): unexpected, so 500."""
    template = ("{% for m in messages %}{% if m['content'] == 'crash' %}{{ 1 / 0 }}{% endif %}<|im_start|>"
                "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    running = RunningServer(engine_with_chat_template(smollm, template))
    try:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "crash"}], "max_tokens": 4}
        resp = httpx.post(running.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 500 and resp.headers["content-type"] == "application/json", resp.text
        error = resp.json()["error"]
        assert set(error) == ERROR_FIELDS and error["type"] == "server_error"
        assert "ZeroDivisionError" in error["message"]
        ok = openai_client(running).chat.completions.create(model="smollm2", max_tokens=4, temperature=0,
                                                            messages=FRANCE)
        assert ok.choices[0].message.content and ok.usage.completion_tokens >= 1
    finally:
        running.stop()


def test_a_chat_template_refusal_is_a_400_naming_the_messages(smollm):
    """A template that forbids system messages (as several models' templates do) refuses with raise_exception."""
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    engine = engine_with_chat_template(smollm, template)
    running = RunningServer(engine)
    try:
        client = openai_client(running)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="smollm2", max_tokens=4, temperature=0,
                                           messages=[{"role": "system", "content": "Be brief."}, *FRANCE])
        assert err.value.status_code == 400
        error = err.value.body
        assert set(error) == ERROR_FIELDS and error["type"] == "invalid_request_error"
        assert error["param"] == "messages" and "System role not supported" in error["message"]
        # The same template without a system message renders, and the answer is the engine's own.
        ok = client.chat.completions.create(model="smollm2", max_tokens=6, temperature=0, messages=FRANCE)
        assert ok.choices[0].message.content == engine.with_options(reuse="off").chat(FRANCE, max_new_tokens=6).text
    finally:
        running.stop()


# -- the API key --------------------------------------------------------------------------------------------------
def test_the_api_key_is_read_from_KVBOOST_API_KEY(smollm, monkeypatch):
    """kvboost-server's options, as its main reads them, with the key only in the environment."""
    from cli.server import build_server_parser

    monkeypatch.delenv("KVBOOST_API_KEY", raising=False)
    assert build_server_parser().parse_args([]).api_key is None
    monkeypatch.setenv("KVBOOST_API_KEY", "from-the-env")
    assert build_server_parser().parse_args(["--api-key", "from-the-flag"]).api_key == "from-the-flag"
    args = build_server_parser().parse_args(["--port", str(free_port())])
    running = RunningServer(smollm.with_options(), api_key=args.api_key)
    try:
        assert httpx.get(running.url + "/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai_client(running, "unused").models.list()
        assert [m.id for m in openai_client(running, "from-the-env").models.list().data] == ["smollm2"]
    finally:
        running.stop()


@pytest.mark.slow
def test_a_kvboost_server_process_requires_the_key_from_KVBOOST_API_KEY():
    port = free_port()
    env = {**os.environ, "KVBOOST_API_KEY": "env-key"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvboost-server"), "--port", str(port),
                             "--model-name", "smol", "--device", "cpu"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        resp = httpx.get(url + "/v1/models")
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=url + "/v1", api_key="env-key", max_retries=0, timeout=120)
        assert [m.id for m in good.models.list().data] == ["smol"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_web_page_is_served_once_an_api_key_is_set_and_refused_without(smollm, server):
    origin = {"Origin": "https://notes.example"}
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    refused = httpx.post(server.url + "/v1/completions", json=body, headers=origin)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
    running = RunningServer(smollm.with_options(), api_key="page-key")
    try:
        resp = httpx.post(running.url + "/v1/completions", json=body,
                          headers={**origin, "Authorization": "Bearer page-key"}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"]
        without_key = httpx.post(running.url + "/v1/completions", json=body, headers=origin)
        assert without_key.status_code == 401 and without_key.json()["error"]["code"] == "invalid_api_key"
    finally:
        running.stop()


# -- request and response fields ------------------------------------------------------------------------------
def test_max_completion_tokens_limits_the_answer(client, server):
    direct = server.engine.with_options(reuse="off")
    assert direct.chat(FRANCE, max_new_tokens=32).stats.generated_tokens > 3  # the limit is what stops it
    resp = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_completion_tokens=3)
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == direct.chat(FRANCE, max_new_tokens=3).text


def test_streamed_completions_end_with_usage_when_asked(client, server):
    prompt = "The capital of France is"
    direct = server.engine.with_options(reuse="off").generate(prompt, max_new_tokens=6)
    kwargs = dict(model="smollm2", prompt=prompt, max_tokens=6, temperature=0, stream=True)
    chunks = list(client.completions.create(stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.text
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(server.engine.tokenizer(prompt)["input_ids"])
    assert usage.completion_tokens == direct.stats.generated_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    plain = list(client.completions.create(**kwargs))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


DOCUMENT = " ".join(f"Note {i}: the archive box {i} holds the letters of the year {1900 + i}." for i in range(40))


def test_kvboost_stats_count_reused_tokens_by_the_tier_they_came_from(smollm, tmp_path):
    """A document warmed by one engine into a disk folder is served to the server's engine from disk, then,
    asked again, from the device tier it was promoted to."""
    writer = smollm.with_options(disk_cache_dir=tmp_path / "kv", disk_cache_bytes=None)
    warmed = writer.warm(DOCUMENT)
    assert warmed["entries_stored"] > 0 and warmed["tokens"] > 256
    running = RunningServer(smollm.with_options(disk_cache_dir=tmp_path / "kv", disk_cache_bytes=None))
    try:
        client = openai_client(running)
        prompt = DOCUMENT + " Which year are the letters in box 7 from?"
        stats = [client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
                 .model_extra["kvboost"] for _ in range(2)]
    finally:
        running.stop()
    from_disk, from_device = stats
    document_tokens = len(smollm.tokenizer(DOCUMENT)["input_ids"])
    # At least its complete 128-token chunks come from disk; the question was never warmed.
    assert 128 * (document_tokens // 128) <= from_disk["reused_tokens"] <= document_tokens
    assert from_disk["reused_by_tier"] == {"disk": from_disk["reused_tokens"]}
    assert from_device["reused_tokens"] >= from_disk["reused_tokens"]
    assert from_device["reused_by_tier"] == {"device": from_device["reused_tokens"]}
    for s in stats:
        assert sum(s["tokens_by_kind"].values()) == s["prompt_tokens"] == len(smollm.encode(prompt))

"""Property tests of the request schema: whatever JSON (or bytes) a client sends, parsing gives a request the engine
can run or an OpenAI-style 400, never another exception. Through `parse_body` directly, then a few of the
nastiest generated bodies through the real server."""

from __future__ import annotations

import json
import math

import httpx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from server.app import sampling_kwargs
from server.schema import APIError, ChatBody, CompletionBody, parse_body

CHARS = st.characters() | st.characters(categories=["Cs"])  # lone surrogates too
TEXT = st.lists(CHARS, max_size=12).map("".join)  # (st.text(CHARS) would drop them)
NUMBERS = (st.integers() | st.floats() | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**300, -0.0, 5e-324, 1e-300])
           | st.floats(min_value=0, max_value=2))
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)


def field(plausible):
    """A value for one field: usually plausible, often anything at all."""
    return plausible | JSON


MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={"content": field(TEXT | st.lists(st.fixed_dictionaries({"type": field(st.just("text")),
                                                                      "text": field(TEXT)}), max_size=3))}),
    max_size=3)
PLAUSIBLE = {"temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "n": st.integers(0, 2),
             "stream": st.booleans(), "stop": TEXT | st.lists(TEXT, max_size=5), "seed": st.integers(),
             "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
             "max_tokens": st.integers(-1, 10**20), "max_completion_tokens": st.integers(), "echo": st.booleans(),
             "logprobs": st.integers()}
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": TEXT}), min_size=1, max_size=2)
PROMPTS = TEXT | st.lists(TEXT, max_size=2) | st.lists(st.integers(), max_size=3)
EXTRA = st.dictionaries(TEXT, JSON, max_size=2)  # fields the server does not know


def merged(*parts):
    return st.tuples(*parts).map(lambda dicts: {k: v for d in dicts for k, v in d.items()})


def body(required: dict, fields: dict):
    """A body of `required` and some of `fields`, then up to two fields (known or not) set to anything."""
    known = st.sampled_from(sorted({*required, *fields}))
    return merged(EXTRA, st.fixed_dictionaries(required, optional=fields), st.dictionaries(known, JSON, max_size=2))


CHAT = body({"model": st.just("smollm2"), "messages": VALID_MESSAGES}, PLAUSIBLE)
COMPLETION = body({"model": st.just("smollm2"), "prompt": PROMPTS}, PLAUSIBLE)
ANYTHING = st.fixed_dictionaries({}, optional={"model": field(st.just("smollm2")), "messages": field(MESSAGES),
                                               "prompt": field(PROMPTS), **{k: field(v) for k, v in PLAUSIBLE.items()}})
BODIES = st.one_of(CHAT, COMPLETION, ANYTHING, JSON)
NUMBER_FIELDS = ("temperature", "top_p", "n", "seed", "max_tokens", "max_completion_tokens", "logprobs")
BOOL_FIELDS = ("stream", "echo")


def encoded(value) -> bytes:
    return json.dumps(value).encode()  # NaN, Infinity and \ud800 escapes come out as Python writes them


def walk(value):
    """Every scalar in a parsed request."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from walk(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from walk(v)
    else:
        yield value


def assert_openai_400(exc: APIError) -> None:
    assert exc.status == 400 and exc.type == "invalid_request_error" and exc.message
    error = json.loads(exc.response().body)["error"]  # renders: no lone surrogate in the message either
    assert set(error) == {"message", "type", "param", "code"}


def check(raw: bytes, model: type[BaseModel]) -> None:
    try:
        body = parse_body(raw, model)
    except APIError as exc:
        event(f"refused: {exc.code}")
        assert_openai_400(exc)
        return
    event("parsed")
    assert isinstance(body, model)
    sent = json.loads(raw)
    # chat's logprobs is a switch or null (OpenAI's chat API); completions' is a count
    numbers = set(NUMBER_FIELDS)
    logprobs = model.model_fields.get("logprobs")
    if logprobs is not None and logprobs.annotation in (bool, bool | None):
        numbers.discard("logprobs")
        assert sent.get("logprobs") is None or type(sent["logprobs"]) is bool, sent["logprobs"]
    for name in numbers & set(model.model_fields):  # read strictly: no true for 1, no "0.5" for 0.5
        assert sent.get(name) is None or type(sent[name]) in (int, float), (name, sent[name])
    for name in set(BOOL_FIELDS) & set(model.model_fields):
        assert name not in sent or type(sent[name]) is bool, (name, sent[name])
    for value in walk(body):
        if isinstance(value, str):
            value.encode("utf-8")  # valid Unicode
        elif isinstance(value, float):
            assert math.isfinite(value)
    for name in ("n", "seed", "max_tokens", "max_completion_tokens"):
        value = getattr(body, name, None)
        assert value is None or type(value) is int, (name, value)
    assert type(body.stream) is bool and type(body.temperature) is float and type(body.top_p) is float
    try:  # what the server makes of it next is a run of the engine or a 400
        sampling_kwargs(body, getattr(body, "max_tokens", None) or 16)
    except APIError as exc:
        assert_openai_400(exc)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BODIES)
def test_any_json_body_is_a_chat_request_or_a_400(value):
    check(encoded(value), ChatBody)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BODIES)
def test_any_json_body_is_a_completion_request_or_a_400(value):
    check(encoded(value), CompletionBody)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | BODIES.map(encoded).flatmap(
    lambda raw: st.integers(0, len(raw)).map(lambda cut: raw[:cut])))  # bytes, and JSON cut short
def test_any_bytes_are_a_request_or_a_400(raw):
    check(raw, ChatBody)
    check(raw, CompletionBody)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(CHAT)
def test_nasty_generated_bodies_through_the_server_get_an_answer_or_a_400(server, value):
    value["max_tokens"], value["max_completion_tokens"] = 1, None  # answers stay short
    resp = httpx.post(server.url + "/v1/chat/completions", content=encoded(value),
                      headers={"content-type": "application/json"}, timeout=120)
    assert resp.status_code in (200, 400), resp.text[:500]
    if resp.status_code == 400:
        assert resp.json()["error"]["type"] == "invalid_request_error"

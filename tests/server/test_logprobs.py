"""Logprobs through the real `openai` client on 127.0.0.1: chat's `logprobs`/`top_logprobs` and the legacy
completions' `logprobs`, whole and streamed, and a model whose logits turn NaN answering with an error."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from damaged_models import damaged_head

COLORS = [{"role": "user", "content": "Name three colors."}]


def check_chat_token(item, num_top: int) -> None:
    """One token's entry: a log-probability, its text's bytes, and (greedy) the chosen token first of its top."""
    assert item.logprob <= 0
    assert item.bytes == list(item.token.encode("utf-8"))
    assert len(item.top_logprobs) == num_top
    assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
    tops = [t.logprob for t in item.top_logprobs]
    assert tops == sorted(tops, reverse=True)
    assert sum(math.exp(lp) for lp in tops) <= 1 + 1e-6


def test_chat_logprobs_describe_the_answer_without_changing_it(client, server):
    kwargs = dict(model="smollm2", messages=COLORS, temperature=0, max_tokens=20)
    plain = client.chat.completions.create(**kwargs).choices[0]
    choice = client.chat.completions.create(logprobs=True, top_logprobs=3, **kwargs).choices[0]
    assert plain.logprobs is None
    assert choice.message.content == plain.message.content
    content = choice.logprobs.content
    direct = server.engine.with_options(reuse="off").generate(COLORS, max_new_tokens=20)
    assert len(content) == len(direct.token_ids)  # one per answer token (an ending EOS is none)
    assert "".join(item.token for item in content) == choice.message.content
    for item in content:
        check_chat_token(item, 3)
    # The answer's first token decides between a few openings: it is not certain.
    assert content[0].logprob < -0.01


def test_logprobs_are_the_log_softmax_of_the_models_raw_logits(client, server):
    """The first token's logprobs against the prompt's logits from the engine itself: sampled at temperature 1.5,
    they are still those of the raw logits."""
    direct = server.engine.with_options(reuse="off").generate(COLORS, max_new_tokens=1, temperature=1.5, seed=7,
                                                               return_logits=True)
    expected = direct.first_logits.double().log_softmax(-1)
    choice = client.chat.completions.create(model="smollm2", messages=COLORS, temperature=1.5, seed=7, max_tokens=1,
                                            logprobs=True, top_logprobs=5).choices[0]
    first = choice.logprobs.content[0]
    assert first.logprob == pytest.approx(float(expected[direct.token_ids[0]]), abs=1e-5)
    top_ids = expected.topk(5).indices.tolist()
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(expected[top_ids].tolist(), abs=1e-5)
    spelled = [server.engine.tokenizer.decode([i], clean_up_tokenization_spaces=False) for i in top_ids]
    assert [t.token for t in first.top_logprobs] == spelled


def test_streamed_chat_carries_each_chunks_tokens_logprobs(client):
    kwargs = dict(model="smollm2", messages=COLORS, temperature=0, max_tokens=20, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    items = []
    for c in chunks:
        if c.choices[0].logprobs is not None:
            items += c.choices[0].logprobs.content
            assert c.choices[0].delta.content == "".join(i.token for i in c.choices[0].logprobs.content)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert [(i.token, i.logprob) for i in items] == [(i.token, i.logprob) for i in whole.logprobs.content]
    for item in items:
        check_chat_token(item, 3)


def test_completions_logprobs_in_the_legacy_shape_whole_and_streamed(client):
    kwargs = dict(model="smollm2", prompt="The three primary colors are", temperature=0, max_tokens=12)
    plain = client.completions.create(**kwargs).choices[0]
    choice = client.completions.create(logprobs=2, **kwargs).choices[0]
    assert plain.logprobs is None and choice.text == plain.text
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == logprob and top[token] == logprob  # greedy: the chosen token is the likeliest
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in client.completions.create(stream=True, logprobs=2, **kwargs):
        if c.choices and c.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(c.choices[0].logprobs, key)
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}


@pytest.mark.parametrize("extra, param", [({"top_logprobs": 3}, "top_logprobs"),
                                          ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
                                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                          ({"logprobs": True, "top_logprobs": -1}, "top_logprobs")])
def test_chat_refuses_top_logprobs_it_cannot_give(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2", messages=COLORS, max_tokens=2, **extra)
    assert err.value.body["param"] == param


@pytest.mark.parametrize("logprobs", [6, -1])
def test_completions_refuse_logprobs_out_of_range(server, logprobs):
    resp = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2, "logprobs": logprobs})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logprobs"


def test_a_model_answering_nan_fails_the_request_with_a_server_error(client, server):
    with damaged_head(server.engine):
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model="smollm2", messages=COLORS, temperature=0, max_tokens=8)
        assert "NaN/infinite logits" in err.value.body["message"] and "damaged" in err.value.body["message"]
        chunks = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "smollm2", "prompt": "Hi", "max_tokens": 4, "stream": True, "temperature": 0.7}).text
        assert "NaN/infinite logits" in chunks and chunks.rstrip().endswith("data: [DONE]")
    assert client.chat.completions.create(model="smollm2", messages=COLORS, temperature=0, max_tokens=4).choices[0] \
        .message.content  # the model put back answers again

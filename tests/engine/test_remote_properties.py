"""The shared tier fuzzed with hypothesis, over a fake RESP server on 127.0.0.1 (tests/support/fake_resp.py).

Values: payloads with valid checksums made by the project's own encoder, of any layer count, KV heads, head dim,
token count, dtype and quantization, and with layers or k/v that differ from each other: the tier serves one
exactly when it is the model's KV for the entry, and an engine served one answers as a full prefill does.
Replies: any sequence of RESP-looking lines, lengths (huge, negative, not numbers), aggregates, RESP3 types and
garbage, sent at once, dripped, cut off or never finished, to the handshake or to GET: get_many returns a dict of
only the valid values, within its deadline and without allocating what a reply announces.
"""

from __future__ import annotations

import time
import tracemalloc

import pytest
import torch
from fake_resp import CLOSE, Drip, FakeResp, Silence, bulk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.keys import chain_key
from engine.kv.payload_file import encode_file, read_header
from engine.kv.remote_tier import RemoteEntry, RemoteTier
from engine.kv.tiers import KVLayout, StoredKV, decode_kv, encode_kv

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
ROOT = b"\0" * 16
TOKENS = tuple(range(5, 5 + CHUNK))
ENTRY = RemoteEntry(chain_key(ROOT, TOKENS), ROOT, 0, TOKENS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _kv(layers, heads, dim, tokens, dtype, v_dim=None):
    g = torch.Generator().manual_seed(0)
    return tuple((torch.randn(1, heads, tokens, dim, generator=g).to(dtype),
                  torch.randn(1, heads, tokens, v_dim or dim, generator=g).to(dtype)) for _ in range(layers))


@st.composite
def payloads(draw):
    """(a StoredKV as some writer could have encoded it, whether it is exactly the LAYOUT's KV of ENTRY in `quant`)."""
    quant = draw(st.sampled_from(["none", "int8", "int4"]))
    layers = draw(st.sampled_from([1, 2, 2, 2, 3]))
    heads = draw(st.sampled_from([1, 2, 2, 4]))
    dim = draw(st.sampled_from([8, 16, 16, 32]))
    tokens = draw(st.sampled_from([CHUNK - 1, CHUNK, CHUNK, CHUNK + 1]))
    dtype = draw(st.sampled_from(DTYPES[:1] * 3 + DTYPES[1:]))
    v_dim = draw(st.sampled_from([None, None, None, dim // 2]))
    stored = encode_kv(_kv(layers, heads, dim, tokens, dtype, v_dim), quant, torch.device("cpu"))
    odd_layer = draw(st.sampled_from([None, None, "shape", "dtype"]))
    if odd_layer is not None and layers > 1:  # one layer unlike the others
        other = _kv(1, heads * 2 if odd_layer == "shape" else heads, dim, tokens,
                    torch.float16 if odd_layer == "dtype" else dtype)
        stored = StoredKV(stored.layers[:-1] + encode_kv(other, quant, torch.device("cpu")).layers, quant, tokens)
    else:
        odd_layer = None
    label = draw(st.sampled_from(["as encoded", "as encoded", "another quant", "another token count"]))
    if label == "another quant":
        # another than the one encoded (drawing "none" again relabelled nothing, yet counted as a lie)
        others = [q for q in ("none", "int8", "int4") if q != stored.quant]
        stored = StoredKV(stored.layers, draw(st.sampled_from(others)), stored.num_tokens)
    elif label == "another token count":
        stored = StoredKV(stored.layers, stored.quant, draw(st.sampled_from([tokens - 1, tokens + 1])))
    exact = (layers, heads, dim, tokens, dtype, v_dim, odd_layer) == (2, 2, 16, CHUNK, torch.float32, None, None)
    return stored, exact and label == "as encoded"


def served(tier: RemoteTier, fake: FakeResp, stored: StoredKV, entry: RemoteEntry = ENTRY) -> dict:
    fake.values[tier.key(entry.key).encode()] = encode_file(stored, tier.namespace, entry.key, entry.fields())
    return tier.get_many([entry])


@SETTINGS
@given(payloads(), st.sampled_from(["none", "int8"]))
def test_a_value_is_served_exactly_when_it_is_the_models_kv(payload, tier_quant):
    stored, exact = payload
    with FakeResp() as fake:
        tier = RemoteTier(fake.url, "ns-test", tier_quant, layout=LAYOUT)
        found = served(tier, fake, stored)
        usable = exact and stored.quant == tier_quant
        assert (ENTRY.key in found) == usable, (stored.quant, tier_quant, tier.counters)
        assert (tier.counters.bad, tier.counters.errors) == (0 if usable else 1, 0)
        if usable:  # what is served decodes to the model's KV shapes
            kv = decode_kv(found[ENTRY.key], torch.device("cpu"))
            assert KVLayout.of_kv(kv) == LAYOUT and kv[0][0].shape[2] == CHUNK
        tier.close()


@pytest.fixture(scope="module")
def tiny(one_thread):
    model = build_model("llama")
    tokenizer = build_tokenizer()
    doc = random_ids(4 * CHUNK, seed=71) + random_ids(5, seed=72)
    cold = KVBoost(model, tokenizer, EngineConfig.of(reuse="off"), name="tiny").generate(doc, max_new_tokens=4)
    return model, tokenizer, doc, cold.token_ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(payloads())
def test_an_engine_served_any_value_answers_as_a_full_prefill(tiny, payload):
    """Every chunk of the document is in the store as the fuzzed payload, under each chunk's own key and entry (as
    one engine wrote them, then rewritten)."""
    model, tokenizer, doc, cold = tiny
    stored, exact = payload
    usable = exact and stored.quant == "none"
    with FakeResp() as fake:
        config = EngineConfig.of(chunk_size=CHUNK, cpu_cache_bytes=0, disk_cache_bytes=0,
                                 remote_cache=fake.url)
        writer = KVBoost(model, tokenizer, config, name="tiny")
        writer.warm(doc)
        assert writer.store.remote.flush(5) and writer.store.remote.counters.writes == 4
        namespace = writer.store.remote.namespace
        for key, value in list(fake.values.items()):
            if key.endswith(b":namespaces"):
                continue
            chunk_key = bytes.fromhex(key.decode().rsplit(":", 1)[1])
            entry = read_header(bytearray(value))[0]["entry"]
            fake.values[key] = encode_file(stored, namespace, chunk_key, entry)
        reader = KVBoost(model, tokenizer, config, name="tiny")
        result = reader.generate(doc, max_new_tokens=4)
        assert result.token_ids == cold or usable  # a usable payload of random KV changes the answer, rightly
        assert result.stats.reused_by_tier.get("remote", 0) == (4 * CHUNK if usable else 0)
        counters = reader.store.remote.counters
        assert counters.errors == 0 and counters.hits == (4 if usable else 0)
        # each value is bad, or unread when one before it was too long to read past
        assert usable or (counters.bad >= 1 and counters.bad + counters.unread == 4), counters


# -- replies ---------------------------------------------------------------------------------------------------
TYPES = b"+-:$*%~,(#_=!>|x\x00"
LENGTHS = st.one_of(st.integers(-3, 200), st.sampled_from([10 ** 12, 2 * 10 ** 9, 2 ** 63, 1 << 20, 1 << 24]))
VALID = encode_file(encode_kv(_kv(2, 2, 16, CHUNK, torch.float32), "none", torch.device("cpu")), "ns-test",
                    ENTRY.key, ENTRY.fields())
LINES = st.one_of(
    st.builds(lambda kind, body: bytes([kind]) + body + b"\r\n", st.sampled_from(TYPES),
              st.binary(max_size=40).map(lambda b: b.replace(b"\r\n", b""))),
    st.builds(lambda kind, n, body, end: bytes([kind]) + str(n).encode() + b"\r\n" + body + end,
              st.sampled_from(b"$=!*%~>|"), LENGTHS, st.binary(max_size=80), st.sampled_from([b"\r\n", b"", b"xy"])),
    st.binary(max_size=120),
    st.just(bulk(VALID)),
    st.just(b"$-1\r\n"),
)
REPLIES = st.lists(LINES, min_size=1, max_size=4).map(b"".join)
DELIVERY = st.sampled_from(["at once", "at once", "dripped", "then hang up", "then silence"])


def deliver(reply: bytes, how: str):
    """`reply` as FakeResp sends it: at once, dripped, or followed by a hang-up or a silence."""
    if how == "dripped":
        return Drip(reply, every_s=0.01, piece=max(1, len(reply) // 20), max_s=3)
    if how == "then silence":
        return [reply, Silence(max_s=2)]
    if how == "then hang up":
        return [reply, CLOSE]
    return reply


@SETTINGS
@given(get_replies=st.lists(st.tuples(REPLIES, DELIVERY), min_size=1, max_size=3),
       handshake=st.one_of(st.none(), st.tuples(REPLIES, DELIVERY)))
def test_any_reply_is_a_dict_of_valid_values_within_the_deadline_and_bounded_memory(get_replies, handshake):
    answers = iter(get_replies)

    def script(command):
        if command[0] in (b"AUTH", b"SELECT") and handshake is not None:
            return deliver(*handshake)
        if command[0] == b"GET":
            reply = next(answers, None)
            return None if reply is None else deliver(*reply)
        return None

    with FakeResp(script) as fake:
        url = fake.url.replace("127.0.0.1", ":pw@127.0.0.1").replace("/0", "/2")
        tier = RemoteTier(url, "ns-test", max_value_bytes=1 << 20, timeout_s=0.25)
        entries = [ENTRY, RemoteEntry(chain_key(ROOT, [1]), ROOT, 0, (1,))]
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            found = tier.get_many(entries)
        finally:
            seconds = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert isinstance(found, dict) and set(found) <= {ENTRY.key}
        assert seconds < tier.read_budget(CHUNK + 1) + 1.0, seconds
        assert peak < 8 << 20, peak
        tier.close()

"""The shared KV tier against a hostile or broken store. Values with a valid checksum that are not KV this model can
use (other layers, heads, head dims, dtypes, quantized parts), a store that is not Redis (replies of the wrong type,
huge lengths, replies that never end or drip), a key of the wrong type: each is a MISS for that key, counted and
deleted where it is a value; never an exception out of the tier, a failed request, memory by the size a reply
announces, a request held for longer than its deadline, or an outage of the whole tier for one bad key."""

from __future__ import annotations

import dataclasses
import time
import tracemalloc

import pytest
import torch
from fake_resp import CLOSE, Drip, Endless, FakeResp, Silence, bulk
from redis_server import NEEDS_REDIS, running_redis
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.config import KVQuantConfig
from engine.keys import chain_key
from engine.kv.kv_quant import QuantizedTensor, quantize
from engine.kv.payload_file import decode_bytes, encode_file, read_header
from engine.kv.records import ChunkRecord
from engine.kv.remote_tier import RemoteEntry, RemoteTier
from engine.kv.tiers import StoredKV, decode_kv, encode_kv

DOC_CHUNKS = 10
DOC = random_ids(DOC_CHUNKS * CHUNK, seed=61)
QUESTION = random_ids(7, seed=62)
NEW_TOKENS = 8
ROOT = b"\0" * 16
ENTRY = RemoteEntry(chain_key(ROOT, [5, 6, 7]), ROOT, 0, (5, 6, 7))
MEMORY_BOUND = 64 << 20  # Python allocations while one hostile reply is read


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


@pytest.fixture(scope="module")
def tiny(one_thread):
    return build_model("llama"), build_tokenizer()


@pytest.fixture(scope="module")
def cold(tiny):
    model, tokenizer = tiny
    engine = KVBoost(model, tokenizer, EngineConfig.of(reuse="off"), name="tiny-llama")
    return engine.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS).token_ids


def engine_on(tiny, url, quant="none") -> KVBoost:
    """An engine with nothing of its own (no host or disk tier): a machine that only has the shared store."""
    model, tokenizer = tiny
    config = EngineConfig.of(chunk_size=CHUNK, cpu_cache_bytes=0, disk_cache_bytes=0,
                             kv_quant=KVQuantConfig(disk=quant), remote_cache=url)
    return KVBoost(model, tokenizer, config, name="tiny-llama")


def ask(engine):
    return engine.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)


# -- values with a valid checksum that are not this model's KV ----------------------------------------------------
def _parts(stored: StoredKV, change) -> StoredKV:
    return dataclasses.replace(stored, layers=tuple((change(k), change(v)) for k, v in stored.layers))


def _requantized(stored: StoredKV, **options) -> StoredKV:
    kv = decode_kv(stored, torch.device("cpu"))
    layers = tuple((quantize(k, **{"bits": 8, "axis": "channel", "group_size": 128, **options}),
                    quantize(v, bits=8, axis="token", group_size=v.shape[-1])) for k, v in kv)
    return dataclasses.replace(stored, layers=layers)


def _cut_scales(stored: StoredKV) -> StoredKV:
    k, v = stored.layers[0]
    broken = QuantizedTensor(k.data, k.scale[..., :0], k.zero[..., :0], k.bits, k.axis, k.group_size, k.shape,
                             k.dtype)
    return dataclasses.replace(stored, layers=((broken, v),) + stored.layers[1:])


LOSSLESS_CHANGES = {
    "one layer fewer": lambda s: dataclasses.replace(s, layers=s.layers[:1]),
    "one layer more": lambda s: dataclasses.replace(s, layers=s.layers + s.layers[:1]),
    "another head dim": lambda s: _parts(s, lambda t: t[..., :8].contiguous()),
    "more KV heads": lambda s: _parts(s, lambda t: torch.cat([t, t], dim=1)),
    "fewer KV heads": lambda s: _parts(s, lambda t: t[:, :1].contiguous()),
    "k and v of different shapes": lambda s: dataclasses.replace(
        s, layers=tuple((k, v[..., :12].contiguous()) for k, v in s.layers)),
    "float16": lambda s: _parts(s, lambda t: t.half()),
    "bfloat16 values in one layer": lambda s: dataclasses.replace(
        s, layers=((s.layers[0][0], s.layers[0][1].bfloat16()),) + s.layers[1:]),
    "quantized parts in a lossless value": lambda s: _requantized(s),
}
INT8_CHANGES = {
    "a quantized part whose scales are cut": _cut_scales,
    "lossless parts in a quantized value": lambda s: dataclasses.replace(
        s, layers=decode_kv(s, torch.device("cpu"))),
    "4-bit codes in an 8-bit value": lambda s: _requantized(s, bits=4),
    "keys grouped per token": lambda s: _requantized(s, axis="token", group_size=16),
    "keys in groups of another size": lambda s: _requantized(s, group_size=64),
}


def _shared_document(tiny, server, quant):
    """The document's chunks in the store as one engine shared them: {start: (key, value)}."""
    writer = engine_on(tiny, server.url, quant)
    writer.warm(DOC)
    assert writer.store.remote.flush(10)
    client = server.client()
    by_start = {}
    for key in client.keys("kvboost:*"):
        if key == b"kvboost:namespaces":
            continue
        value = client.get(key)
        header = read_header(bytearray(value))[0]
        by_start[header["entry"]["start"]] = (key, value)
    assert len(by_start) == DOC_CHUNKS
    return writer.store.remote.namespace, by_start


def _rewritten(value: bytes, namespace: str, key: bytes, change) -> bytes:
    """`value` with its KV changed by `change`, encoded and checksummed by the project's own writer."""
    chunk_key = bytes.fromhex(key.decode().rsplit(":", 1)[1])
    good = decode_bytes(torch.frombuffer(bytearray(value), dtype=torch.uint8), namespace, chunk_key)
    header = read_header(bytearray(value))[0]
    return encode_file(change(good), namespace, chunk_key, header["entry"])


@NEEDS_REDIS
@pytest.mark.parametrize("quant,change", [("none", name) for name in LOSSLESS_CHANGES] +
                         [("int8", name) for name in INT8_CHANGES])
def test_a_value_that_checks_but_is_not_this_models_kv_is_a_counted_miss_and_deleted(tiny, redis_server, cold,
                                                                                      quant, change):
    namespace, by_start = _shared_document(tiny, redis_server, quant)
    key, good = by_start[3 * CHUNK]
    changes = LOSSLESS_CHANGES if quant == "none" else INT8_CHANGES
    client = redis_server.client()
    client.set(key, _rewritten(good, namespace, key, changes[change]))
    reader = engine_on(tiny, redis_server.url, quant)
    result = ask(reader)  # no exception out of the request
    remote = reader.cache_stats().tiers.remote
    assert (remote.bad, remote.hits, remote.errors) == (1, DOC_CHUNKS - 1, 0)
    # the bad value never entered a memory tier: its chunk was computed, the others came from the store
    assert result.stats.reused_by_tier == {"remote": (DOC_CHUNKS - 1) * CHUNK}
    assert reader.store.remote.flush(10)
    if quant == "int8":  # deleted; the chunk computed again over quantized KV is lossy, which is never shared
        assert client.exists(key) == 0
        return
    assert result.token_ids == cold
    # deleted, and the chunk computed again was shared afresh: the next machine is served the good value
    assert client.get(key) == good
    again = ask(engine_on(tiny, redis_server.url, quant))
    assert again.stats.reused_by_tier == {"remote": DOC_CHUNKS * CHUNK}


# -- a store that is not Redis, or a broken one ------------------------------------------------------------------
def _read_one(fake: FakeResp, url: str | None = None, **options):
    """get_many of one entry; (result, tier, seconds, peak bytes Python allocated meanwhile)."""
    tier = RemoteTier(url or fake.url, "ns-test", **options)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        found = tier.get_many([ENTRY])
    finally:
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return found, tier, seconds, peak


def test_a_store_answering_hello_with_ok_is_spoken_to_in_resp2():
    """A `protocol=3` in the URL does not switch on a handshake whose answer would be trusted unchecked."""
    with FakeResp(lambda c: b"+OK\r\n" if c[0] == b"HELLO" else None) as fake:
        found, tier, _, _ = _read_one(fake, fake.url + "?protocol=3")
        assert found == {} and b"HELLO" not in fake.names() and b"GET" in fake.names()
        assert (tier.counters.misses, tier.counters.errors) == (1, 0)
        tier.close()


WRONG_TYPES = {
    "integer 10^12": b":1000000000000\r\n",
    "integer 2*10^9": b":2000000000\r\n",
    "negative integer": b":-5\r\n",
    "simple string": b"+OK\r\n",
    "array": b"*2\r\n$1\r\na\r\n$1\r\nb\r\n",
    "array of 10^12": b"*1000000000000\r\n",
    "nested arrays": b"*1\r\n" * 100_000 + b":1\r\n",
    "map": b"%1\r\n+a\r\n+b\r\n",
    "set": b"~1\r\n+a\r\n",
    "double": b",1.5\r\n",
    "bignum": b"(123456789012345678901234567890\r\n",
    "boolean": b"#t\r\n",
    "null": b"_\r\n",
    "verbatim string": b"=7\r\ntxt:abc\r\n",
    "bulk length 10^12": b"$1000000000000\r\n",
}


@pytest.mark.parametrize("name", sorted(WRONG_TYPES))
def test_a_reply_of_another_type_where_a_value_belongs_is_a_bad_value(name):
    with FakeResp(lambda c: WRONG_TYPES[name] if c[0] == b"GET" else None) as fake:
        found, tier, seconds, peak = _read_one(fake)
        assert found == {}
        assert tier.counters.bad == 1 and tier.counters.errors == 0 and tier.breaker.state == "closed"
        assert peak < MEMORY_BOUND and seconds < 1.0, (peak, seconds)
        tier.close()


def test_a_bulk_string_that_never_ends_is_refused_by_its_announced_length():
    with FakeResp(lambda c: Endless(b"$1500000000\r\n") if c[0] == b"GET" else None) as fake:
        found, tier, seconds, peak = _read_one(fake)
        assert found == {} and tier.counters.bad == 1
        assert peak < MEMORY_BOUND and seconds < 1.0, (peak, seconds)
        tier.close()


def test_a_value_within_the_limit_that_never_ends_costs_the_deadline_and_the_limit():
    """Announced at 50 MB (within the limit), sent at ~6 MB/s: the read ends at its deadline, having held at most the
    value's announced size; the store was answering, so the key is unread, not bad, and the tier stays on."""
    slow = Drip(b"$50000000\r\n" + b"x" * 50_000_000, every_s=0.01, piece=1 << 16)
    with FakeResp(lambda c: slow if c[0] == b"GET" else None) as fake:
        found, tier, seconds, peak = _read_one(fake, max_value_bytes=60_000_000)
        assert found == {} and seconds < 1.0 and peak < MEMORY_BOUND
        assert (tier.counters.unread, tier.counters.bad, tier.breaker.state) == (1, 0, "closed")
        tier.close()


def test_a_value_a_little_over_the_limit_is_read_past_and_the_next_key_served():
    first, second = (RemoteEntry(chain_key(ROOT, [n] * CHUNK), ROOT, 0, (n,) * CHUNK) for n in (5, 6))
    kv = tuple((torch.randn(1, 2, CHUNK, 16), torch.randn(1, 2, CHUNK, 16)) for _ in range(2))
    good = encode_file(encode_kv(kv, "none", torch.device("cpu")), "ns-test", second.key, second.fields())
    with FakeResp() as fake:
        tier = RemoteTier(fake.url, "ns-test", max_value_bytes=len(good))
        fake.values[tier.key(first.key).encode()] = b"x" * (len(good) + 100)
        fake.values[tier.key(second.key).encode()] = good
        assert list(tier.get_many([first, second])) == [second.key]
        assert (tier.counters.bad, tier.counters.hits, tier.counters.unread, tier.counters.errors) == (1, 1, 0, 0)
        tier.close()


def test_a_store_that_drips_its_reply_holds_a_request_for_its_deadline_not_a_minute():
    """One byte every 30 ms: each socket read succeeds, so only a deadline for the whole call bounds it."""
    with FakeResp(lambda c: Drip(bulk(b"x" * 2000)) if c[0] == b"GET" else None) as fake:
        found, tier, seconds, _ = _read_one(fake)
        assert found == {} and seconds < 1.5, seconds
        # a store that answers, slowly, is not an outage: the key is unread this time, the tier stays on
        assert tier.counters.unread == 1 and tier.counters.errors == 0 and tier.breaker.state == "closed"
        tier.close()


@pytest.mark.parametrize("reply", [Silence(), CLOSE, b"\x00\xffgarbage\r\n", b"-ERR no such thing\r\n", b"$-7\r\n",
                                   b"$abc\r\n", b"+" + b"x" * 100_000],
                         ids=["silent", "hangs up", "garbage", "an error reply", "negative bulk length",
                              "bulk length not a number", "a line without end"])
def test_a_store_that_does_not_answer_or_not_in_resp_is_a_counted_error_that_opens_the_breaker(reply):
    with FakeResp(lambda c: reply if c[0] == b"GET" else None) as fake:
        found, tier, seconds, _ = _read_one(fake)
        assert found == {} and seconds < 1.5
        assert tier.counters.errors == 1 and tier.breaker.state == "open"
        assert tier.get_many([ENTRY]) == {} and tier.counters.skipped == 1
        tier.close()


@pytest.mark.parametrize("script", [
    lambda c: b":2000000000\r\n" if c[0] == b"GET" else None,
    lambda c: b"*3\r\n:1\r\n:2\r\n:3\r\n" if c[0] == b"GET" else None,
    lambda c: b"+OK\r\n" if c[0] in (b"HELLO", b"GET") else None,
    lambda c: b"$-1\r\n" if c[0] in (b"AUTH", b"SELECT", b"HELLO") else None,
    lambda c: b"\x00\xffgarbage\r\n",
    lambda c: Drip(bulk(b"x" * 500)) if c[0] == b"GET" else None,
], ids=["integer", "array", "ok everywhere", "nil handshake", "garbage", "drip"])
def test_an_engine_over_a_broken_store_answers_as_a_full_prefill(tiny, cold, script):
    with FakeResp(script) as fake:
        engine = engine_on(tiny, fake.url.replace("/0", "/2?protocol=3"))
        t0 = time.perf_counter()
        result = ask(engine)
        assert result.token_ids == cold and result.stats.reused_by_tier == {}
        assert time.perf_counter() - t0 < 3.0


@NEEDS_REDIS
def test_a_hash_under_a_chunk_key_is_that_keys_miss_not_an_outage(redis_server):
    tier = RemoteTier(redis_server.url, "ns-test")
    kv = tuple((torch.randn(1, 2, CHUNK, 16), torch.randn(1, 2, CHUNK, 16)) for _ in range(2))
    stored = encode_kv(kv, "none", torch.device("cpu"))
    entries = []
    for first in (0, 100, 200):
        tokens = tuple(range(first, first + CHUNK))
        record = ChunkRecord(chain_key(ROOT, tokens), ROOT, None, "chunk", 0, tokens, stored.nbytes)
        assert tier.put(record, stored)
        entries.append(RemoteEntry(record.key, ROOT, 0, tokens))
    assert tier.flush()
    client = redis_server.client()
    wrong = tier.key(entries[1].key)
    client.delete(wrong)
    client.hset(wrong, "field", "value")
    found = tier.get_many(entries)
    assert sorted(found) == sorted([entries[0].key, entries[2].key])
    assert (tier.counters.bad, tier.counters.errors, tier.breaker.state) == (1, 0, "closed")
    assert tier.flush() and client.exists(wrong) == 0  # deleted like any bad value
    assert sorted(tier.get_many(entries)) == sorted(found)  # and the tier still serves the others
    tier.close()

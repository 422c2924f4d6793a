"""The shared tier's own RESP2 client over each way a store is reached, against a real redis-server: a unix socket,
TLS (rediss://, the server's certificate checked against the test's CA; another CA is a counted error), an ACL user
(redis://user:password@), a database other than 0; a pooled connection the store closed is replaced without an
error; and URL options the tier does not take are refused when it is built, never at the first request."""

from __future__ import annotations

import pytest
import torch
from redis_server import BINARY, RedisServer, make_certificates
from tiny_models import CHUNK

from engine.keys import chain_key
from engine.kv.records import ChunkRecord
from engine.kv.remote_tier import RemoteEntry, RemoteTier
from engine.kv.tiers import encode_kv

pytestmark = pytest.mark.skipif(BINARY is None, reason="redis-server is not installed")
ROOT = b"\0" * 16


def shared_and_read_back(url: str) -> RemoteTier:
    """One tier writes a chunk, a second one (another machine) reads it back; returns the reader."""
    kv = tuple((torch.randn(1, 2, CHUNK, 16), torch.randn(1, 2, CHUNK, 16)) for _ in range(2))
    stored = encode_kv(kv, "none", torch.device("cpu"))
    tokens = tuple(range(7, 7 + CHUNK))
    record = ChunkRecord(chain_key(ROOT, tokens), ROOT, None, "chunk", 0, tokens, stored.nbytes)
    writer = RemoteTier(url, "ns-test")
    assert writer.put(record, stored) and writer.flush(5)
    assert writer.counters.writes == 1, writer.stats()
    writer.close()
    reader = RemoteTier(url, "ns-test")
    found = reader.get_many([RemoteEntry(record.key, ROOT, 0, tokens)])
    assert list(found) == [record.key], reader.stats()
    assert torch.equal(found[record.key].layers[1][0], kv[1][0])
    return reader


@pytest.fixture
def server(tmp_path):
    try:
        tls = make_certificates(tmp_path)
    except ImportError:  # the test certificates are made with `cryptography`
        tls = None
    server = RedisServer(tmp_path, unix_socket=True, tls=tls, user=("alice", "wonder")).start()
    yield server
    server.stop()


def test_over_a_unix_socket(server):
    shared_and_read_back(server.unix_url).close()


def test_over_tls_with_the_servers_certificate_checked(server, tmp_path):
    if server.tls is None:
        pytest.skip("the package cryptography (which makes the test certificates) is not installed")
    shared_and_read_back(server.tls_url).close()
    (tmp_path / "other").mkdir()
    other_ca = make_certificates(tmp_path / "other")["ca"]
    stranger = RemoteTier(server.tls_url.replace(str(server.tls["ca"]), str(other_ca)), "ns-test")
    assert stranger.get_many([RemoteEntry(chain_key(ROOT, [1]), ROOT, 0, (1,))]) == {}
    assert stranger.counters.errors == 1 and "certificate" in stranger.breaker.last_error
    stranger.close()
    plain = RemoteTier(f"redis://127.0.0.1:{server.tls_port}/0", "ns-test")  # TLS port, plain client: an error
    assert plain.get_many([RemoteEntry(chain_key(ROOT, [1]), ROOT, 0, (1,))]) == {}
    assert plain.counters.errors == 1
    plain.close()


def test_as_an_acl_user_and_in_another_database(server):
    reader = shared_and_read_back(f"redis://alice:wonder@127.0.0.1:{server.port}/3")
    assert reader.counters.errors == 0
    reader.close()
    assert server.client().dbsize() == 0  # it all went to database 3
    wrong = RemoteTier(f"redis://alice:guess@127.0.0.1:{server.port}/3", "ns-test")
    assert wrong.get_many([RemoteEntry(chain_key(ROOT, [1]), ROOT, 0, (1,))]) == {}
    assert wrong.counters.errors == 1 and "AUTH" in wrong.breaker.last_error and "guess" not in str(wrong.stats())
    wrong.close()


def test_a_pooled_connection_the_store_closed_is_replaced_without_an_error(server):
    reader = shared_and_read_back(server.url)
    server.client().client_kill_filter(_type="normal", skipme=True)  # drops the reader's idle connection
    entry = RemoteEntry(chain_key(ROOT, [1]), ROOT, 0, (1,))
    assert reader.get_many([entry]) == {}
    assert (reader.counters.errors, reader.counters.misses, reader.breaker.state) == (0, 1, "closed")
    reader.close()


@pytest.mark.parametrize("url,what", [
    ("redis://h:6379/0?socket_timeout=5", "socket_timeout"),
    ("redis://h:6379/0?protocol=4", "protocol"),
    ("redis://h:6379/x", "db"),
    ("redis://h:6379/0?ssl_ca_certs=/x", "rediss"),
    ("unix://", "path"),
])
def test_url_options_the_tier_does_not_take_are_refused_when_it_is_built(url, what):
    with pytest.raises(ValueError, match=what):
        RemoteTier(url, "ns-test")


def test_a_reader_held_up_longer_than_the_silence_limit_still_takes_what_the_store_sent():
    """On a loaded machine the reading thread itself can be kept off the CPU past the silence limit while the
    store's answer waits in the socket: that is not a silent store (it failed a two-process test under CPU
    burners). Only a wait in which nothing arrives counts as silence."""
    import time

    from fake_resp import FakeResp

    from engine.kv import resp

    with FakeResp() as server:
        server.values[b"k"] = b"x" * 4_000_000  # more than one receive takes
        pool = resp.Pool(resp.parse_url(server.url), silence_s=0.1)
        deadline = time.monotonic() + 5.0
        conn = resp.start(pool, [("GET", "k")], deadline)  # the first byte of the answer is in
        time.sleep(0.3)  # the reader held up: three silence limits
        reply = conn.read_reply(deadline, 1 << 23)
        assert reply.kind == "bulk" and reply.value == b"x" * 4_000_000
        conn.close()

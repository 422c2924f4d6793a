"""The shared KV tier on Redis or Valkey (through redis-py), below the disk tier: chunk KV one machine computed
answers prompts on every machine pointed at the same store.

Keys:   kvboost:<namespace>:<chained chunk key, hex>. The namespace (remote_namespace) hashes everything that
        changes the bytes of a chunk's KV: the model fingerprint and the chunking (both in the engine's root key),
        the payload format version, this tier's kv_quant, the device type, dtype and the torch / transformers
        versions. Entries of another model or setting have other keys, so they are never even read.
Values: the disk tier's payload format (engine.payload_file): a header saying what the KV is of (namespace, key,
        parent, position, token ids) and the data, under one checksum. A value that fails any check (format,
        size, namespace, key, the prompt's own tokens, checksum, tensor shapes) is a MISS, counted and deleted.

Only exact chunks with the computed values are shared: tails belong to one conversation, APPROXIMATE and lossy
entries never leave the machine (a lossy value would be served as exact elsewhere).

The store being slow, gone or hung is never the user's problem:
- every call has connect and read timeouts of `timeout_s` (tens of ms) and no retries (redis-py's default retries
  with back-off would hold a request for seconds);
- a circuit breaker: the first failure opens it; for `retry_s` nothing is sent (reads are misses, writes are
  skipped), logged once per outage; then one call is let through as a trial, and its success closes it;
- writes go through a bounded queue to one background thread; when the queue is full a write is dropped and
  counted, the request never waits for the store.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from .payload_file import FORMAT_VERSION, PayloadError, decode_bytes, encode_file
from .tiers import QUANT_MODES, StoredKV

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")
KEY_PREFIX = "kvboost"
NAMESPACES_KEY = f"{KEY_PREFIX}:namespaces"  # hash: namespace -> what it stands for (kvboost cache stats)
DEFAULT_TIMEOUT_S = 0.05
DEFAULT_RETRY_S = 5.0
QUEUE_ITEMS = 256
QUEUE_BYTES = 256 << 20
# Failures of the store or the link (refused, reset, timed out, auth, a reply redis-py cannot parse): each one
# opens the breaker. A full store refusing a write (OutOfMemoryError) is not one: it still serves reads.
FAILURES = (redis.RedisError, OSError)


def check_url(url) -> str:
    """`url` if it names a Redis/Valkey store redis-py can open; ValueError saying why otherwise."""
    if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES:
        raise ValueError(f"remote_cache must be a redis://, rediss:// or unix:// URL or None, got {shown_url(url)!r}")
    return url


def shown_url(url) -> str:
    """The URL with its password replaced by ***, for logs, stats and the app."""
    if not isinstance(url, str):
        return repr(url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***" if parts.username else ":***"
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))


def remote_namespace(root: bytes, quant: str, device_type: str, dtype) -> str:
    """The namespace of one engine's entries: equal only for engines whose chunk KV is byte for byte the same."""
    import transformers

    torch_version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    settings = f"v{FORMAT_VERSION}|{quant}|{device_type}|{dtype}|torch {torch_version}|transformers " \
               f"{transformers.__version__}"
    return hashlib.blake2b(root + b"|remote|" + settings.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class RemoteEntry:
    """A chunk the prompt needs: its key and what its KV must be of (checked against the value's header)."""

    key: bytes
    parent: bytes
    start: int
    tokens: tuple[int, ...]

    def fields(self) -> dict:
        return {"kind": "chunk", "parent": self.parent.hex(), "start": self.start,
                "tokens": [int(t) for t in self.tokens], "exact": True, "lossy": False}


@dataclass
class RemoteCounters:
    lookups: int = 0  # keys asked for
    hits: int = 0
    misses: int = 0  # keys absent (never written, or evicted by the store)
    bad: int = 0  # values that failed a check: served as MISS and deleted
    read_bytes: int = 0
    read_ms: float = 0.0
    writes: int = 0
    written_bytes: int = 0
    dropped: int = 0  # writes dropped because the queue was full (the store too slow)
    skipped: int = 0  # reads and writes not tried while the breaker was open
    refused: int = 0  # writes the store refused because it is full (maxmemory under noeviction)
    errors: int = 0  # failed calls (each one opened or kept open the breaker)


class Breaker:
    """Closed (calls go through), open (none for `retry_s` after a failure), half-open (one trial call)."""

    def __init__(self, retry_s: float, what: str, clock=time.monotonic):
        self.retry_s = retry_s
        self.what = what
        self.state = "closed"
        self.trips = 0
        self.last_error: str | None = None
        self._clock = clock
        self._open_until = 0.0
        self._lock = threading.Lock()

    def waiting(self) -> bool:
        """Open, and its wait not over yet (asks nothing of the state: no trial is handed out)."""
        return self.state == "open" and self._clock() < self._open_until

    def allow(self) -> bool:
        """Whether to make a call now; a True while not closed makes this call the trial, which must end in
        succeeded() or failed()."""
        with self._lock:
            if self.state == "closed":
                return True
            if self.state == "open" and self._clock() >= self._open_until:
                self.state = "half-open"  # this caller's call is the trial; others wait for its outcome
                return True
            return False

    def succeeded(self) -> None:
        with self._lock:
            if self.state == "closed":
                return
            self.state = "closed"
        log.warning("shared KV tier %s answers again", self.what)

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            first = self.state == "closed"
            self.state = "open"
            self._open_until = self._clock() + self.retry_s
            self.trips += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        if first:  # once per outage, not once per call
            log.warning("shared KV tier %s failed (%s); not used for %.1f s at a time until it answers",
                        self.what, self.last_error, self.retry_s)


class RemoteTier:
    """Chunk payloads in a Redis/Valkey store shared by machines, within `namespace`."""

    name = "remote"

    def __init__(self, url: str, namespace: str, quant: str = "none", *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry_s: float = DEFAULT_RETRY_S, queue_items: int = QUEUE_ITEMS, queue_bytes: int = QUEUE_BYTES,
                 describe: dict | None = None):
        if quant not in QUANT_MODES:
            raise ValueError(f"kv_quant for the remote tier must be one of {QUANT_MODES}, got {quant!r}")
        self.url = shown_url(check_url(url))
        self.namespace = namespace
        self.quant = quant
        self.counters = RemoteCounters()
        self.breaker = Breaker(retry_s, self.url)
        self._describe = describe
        try:
            # Passwords, ACL users (redis://user:pass@host) and TLS (rediss://) come with the URL; its query
            # string may override the timeouts, never the retries.
            self.client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                                               retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                                               health_check_interval=0)
        except ValueError as exc:
            raise ValueError(f"remote_cache {self.url}: {exc}") from None
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._queue_items = queue_items
        self._queue_bytes = queue_bytes
        self._busy = False  # the writer holds an item taken off the queue
        self._cond = threading.Condition()
        self._closed = False
        self._writer: threading.Thread | None = None
        _LIVE.add(self)

    def key(self, chunk_key: bytes) -> str:
        return f"{KEY_PREFIX}:{self.namespace}:{chunk_key.hex()}"

    # -- reading (the request's thread) -------------------------------------------------------------------
    def get_many(self, entries: list[RemoteEntry]) -> dict[bytes, StoredKV]:
        """The payloads of `entries` the store holds and that pass every check, by key (one round trip)."""
        if not entries:
            return {}
        if not self.breaker.allow():
            self.counters.skipped += 1
            return {}
        t0 = time.perf_counter()
        try:
            # One round trip, one GET per chunk: the store starts sending the first value at once instead of
            # building one reply of every value first (tens of MB for a long prompt).
            pipe = self.client.pipeline(transaction=False)
            for entry in entries:
                pipe.get(self.key(entry.key))
            values = pipe.execute()
        except FAILURES as exc:
            self._failed(exc)
            return {}
        self.breaker.succeeded()
        self.counters.lookups += len(entries)
        found: dict[bytes, StoredKV] = {}
        for entry, value in zip(entries, values):
            if value is None:
                self.counters.misses += 1
                continue
            stored = self._checked(entry, value)
            if stored is None:
                self.counters.bad += 1
                self._enqueue(("delete", entry.key, None, None), 0)
                continue
            self.counters.hits += 1
            self.counters.read_bytes += len(value)
            found[entry.key] = stored
        self.counters.read_ms += (time.perf_counter() - t0) * 1000
        return found

    def _checked(self, entry: RemoteEntry, value: bytes) -> StoredKV | None:
        """The value as a payload when it is exactly the KV of `entry` in this namespace, else None."""
        try:
            stored = decode_bytes(torch.frombuffer(bytearray(value), dtype=torch.uint8), self.namespace, entry.key,
                                  expect=entry.fields())
        except (PayloadError, ValueError, RuntimeError) as exc:
            log.warning("shared KV entry %s is a miss: %s", entry.key.hex()[:12], exc)
            return None
        num_tokens = len(entry.tokens)
        if stored.quant != self.quant or stored.num_tokens != num_tokens:
            return None
        # Every layer's k and v: [1, H_kv, T, D] with T the chunk's tokens (the header is under the checksum, this
        # is the last check that it describes a chunk this engine can use).
        shapes = {tuple(part.shape) for layer in stored.layers for part in layer}
        if any(len(s) != 4 or s[0] != 1 or s[2] != num_tokens for s in shapes):
            return None
        return stored

    # -- writing (a background thread) --------------------------------------------------------------------
    def put(self, record, stored: StoredKV) -> bool:
        """Queues `record`'s payload for the store; False when it was dropped (queue full) or skipped (the
        breaker is open). Never waits for the store."""
        if self.breaker.waiting():
            self.counters.skipped += 1
            return False
        entry = RemoteEntry(record.key, record.parent, record.start, tuple(record.tokens))
        return self._enqueue(("set", record.key, entry, stored), stored.nbytes)

    def _enqueue(self, item, num_bytes: int) -> bool:
        with self._cond:
            if self._closed:
                return False
            if len(self._queue) >= self._queue_items or self._queued_bytes + num_bytes > self._queue_bytes:
                self.counters.dropped += 1
                return False
            self._queue.append((item, num_bytes))
            self._queued_bytes += num_bytes
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="kvboost-remote-writer", daemon=True)
                self._writer.start()
            self._cond.notify_all()
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                (item, num_bytes) = self._queue.popleft()
                self._queued_bytes -= num_bytes
                self._busy = True
            try:
                self._write(item)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, item) -> None:
        op, key, entry, stored = item
        if not self.breaker.allow():
            self.counters.skipped += 1
            return
        try:
            if op == "delete":
                self.client.delete(self.key(key))
            else:
                blob = encode_file(stored, self.namespace, key, entry.fields())
                if self._describe is not None:
                    self.client.hsetnx(NAMESPACES_KEY, self.namespace, json.dumps(self._describe, sort_keys=True))
                    self._describe = None
                self.client.set(self.key(key), blob)
                self.counters.writes += 1
                self.counters.written_bytes += len(blob)
        except redis.OutOfMemoryError as exc:
            # Full under a policy that refuses writes (noeviction): the store answers, and what it holds is still
            # worth reading, so this is no outage for the breaker. Logged once, counted each time.
            if not self.counters.refused:
                log.warning("shared KV tier %s is full and refuses writes (%s); set maxmemory-policy allkeys-lru",
                            self.url, exc)
            self.counters.refused += 1
        except FAILURES as exc:
            self._failed(exc)
            return
        self.breaker.succeeded()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every queued write was sent (or given up); False when `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (for at most `timeout_s`), stops the writer and closes the connections."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join(timeout_s)
        self.client.close()
        _LIVE.discard(self)

    def _failed(self, exc: BaseException) -> None:
        self.counters.errors += 1
        self.breaker.failed(exc)

    # -- reporting (counters only: a UI thread calls this every second) -----------------------------------
    def stats(self) -> dict:
        return {"url": self.url, "namespace": self.namespace, "kv_quant": self.quant, "state": self.breaker.state,
                "breaker_trips": self.breaker.trips, "last_error": self.breaker.last_error,
                "queued": len(self._queue), **vars(self.counters)}


_LIVE: "weakref.WeakSet[RemoteTier]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """A process that ends right after a request (`kvboost warm`) still shares what it computed (briefly)."""
    for tier in list(_LIVE):
        tier.flush(timeout_s=5.0)

"""The shared KV tier on Redis or Valkey, below the disk tier: chunk KV one machine computed answers prompts on
every machine pointed at the same store. engine.kv.resp speaks to the store (RESP2 only, every reply bounded).

Keys:   kvboost:<namespace>:<chained chunk key, hex>. The namespace (remote_namespace) hashes everything that
        changes the bytes of a chunk's KV: the model fingerprint and the chunking (both in the engine's root key),
        the payload format version, this tier's kv_quant, the device type, dtype and the torch / transformers
        versions. Entries of another model or setting have other keys, so they are never even read.
Values: the disk tier's payload format (engine.kv.payload_file): a header saying what the KV is of (namespace, key,
        parent, position, token ids) and the data, under one checksum. A value is used only when every check
        passes: format, size, namespace, key, the prompt's own tokens, checksum, and every tensor against the
        running model (engine.kv.tiers.KVLayout: layers, KV heads, head dim, dtype, quantized parts as this tier's
        kv_quant writes them). Anything else where a value belongs (a value failing a check, one longer than
        `max_value_bytes`, an integer, array or other reply, a WRONGTYPE error) is a MISS, counted `bad` and
        deleted from the store; it never reaches a memory tier, and never fails the request.

Only exact chunks with the computed values are shared: tails belong to one conversation, APPROXIMATE and lossy
entries never leave the machine (a lossy value would be served as exact elsewhere). What was read from the store
is not written back to it.

The store being slow, gone, hung or hostile is never the user's problem:
- a read may take as long as the prefill it saves: the tokens it would restore at this engine's measured prefill
  rate (observe_prefill; DEFAULT_PREFILL_TOKENS_PER_S before one was measured), at least `timeout_s` and at most
  `max_wait_s`, for the whole call (connect and handshake included). What arrived by then is used; the rest is
  `unread` and computed. Such a slow read is not a failure;
- a store that refuses or drops connections, is silent for `timeout_s` while an answer is awaited, or does not
  answer in RESP2 is failing: a circuit breaker opens on the first failure; for `retry_s` nothing is sent (reads
  are misses, writes are skipped), logged once per outage; then one call is let through as a trial, and its
  success closes it. A bad value and a write the store refuses (full, read-only) do not open it;
- writes go through a bounded queue to one background thread, each within `max_wait_s`; when the queue is full
  a write is dropped and counted, the request never waits for the store.

Over 400 lines: the shared tier's one subject: its keys, values checked before use, the circuit breaker, writes
behind."""

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

import torch

from .payload_file import FORMAT_VERSION, decode_bytes, encode_file
from .resp import SCHEMES, DeadlinePassed, Pool, Reply, StoreError, exchange, parse_url, start
from .tiers import QUANT_MODES, KVLayout, StoredKV

log = logging.getLogger(__name__)

KEY_PREFIX = "kvboost"
NAMESPACES_KEY = f"{KEY_PREFIX}:namespaces"  # hash: namespace -> what it stands for (kvboost cache stats)
DEFAULT_TIMEOUT_S = 0.25
DEFAULT_MAX_WAIT_S = 10.0
DEFAULT_RETRY_S = 5.0
# The prefill rate assumed before this engine measured its own: a small model on a CPU (SmolLM2-135M on two cores,
# 1130 tokens: 440 tokens/s idle, 34 with five CPU burners), so that a first request waits for the store rather
# than recompute under load. Only a store that keeps answering, slowly, is waited for that long.
DEFAULT_PREFILL_TOKENS_PER_S = 200.0
RATE_WEIGHT = 0.3  # of each new prefill in the running rate
DEFAULT_MAX_VALUE_BYTES = 256 << 20  # without a model to size it from (engine.kv.tiered_store sizes it per model)
QUEUE_ITEMS = 256
QUEUE_BYTES = 256 << 20


def check_url(url) -> str:
    """`url` if it is a redis://, rediss:// or unix:// URL; ValueError saying why otherwise (engine.kv.resp.parse_url
    reads the rest)."""
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
    bad: int = 0  # values that failed a check, or replies that are no value: served as MISS and deleted
    unread: int = 0  # keys not read: the read's time was up, or a reply before them could not be read to its end
    read_bytes: int = 0
    read_ms: float = 0.0
    writes: int = 0
    written_bytes: int = 0
    dropped: int = 0  # writes dropped because the queue was full, or not done within max_wait_s (a slow store)
    skipped: int = 0  # reads and writes not tried while the breaker was open
    refused: int = 0  # writes the store answered with an error (full under noeviction, read-only, no permission)
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
    """Chunk payloads in a Redis/Valkey store shared by machines, within `namespace`. `layout`: the running model's
    KV (None: each value is checked against what its own first part says)."""

    name = "remote"

    def __init__(self, url: str, namespace: str, quant: str = "none", *, layout: KVLayout | None = None,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S, retry_s: float = DEFAULT_RETRY_S,
                 queue_items: int = QUEUE_ITEMS, queue_bytes: int = QUEUE_BYTES, describe: dict | None = None):
        if quant not in QUANT_MODES:
            raise ValueError(f"kv_quant for the remote tier must be one of {QUANT_MODES}, got {quant!r}")
        self.url = shown_url(check_url(url))
        try:
            # Passwords, ACL users (redis://user:pass@host), TLS (rediss://) and the database come with the URL.
            self._pool = Pool(parse_url(url), timeout_s)
        except ValueError as exc:
            raise ValueError(f"remote_cache {self.url}: {exc}") from None
        self.namespace = namespace
        self.quant = quant
        self.layout = layout
        self.max_value_bytes = max_value_bytes
        self.timeout_s = timeout_s
        self.max_wait_s = max(max_wait_s, timeout_s)
        self.prefill_tokens_per_s: float | None = None
        self.counters = RemoteCounters()
        self.breaker = Breaker(retry_s, self.url)
        self._describe = describe
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

    # -- timing ----------------------------------------------------------------------------------------------
    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """This engine computed `num_tokens` prompt tokens in `seconds` (engine.reuse measures each prefill)."""
        if num_tokens <= 0 or not seconds > 0:
            return
        rate = num_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if old is None else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * rate

    def read_budget(self, num_tokens: int) -> float:
        """Seconds a read restoring `num_tokens` tokens may take: what computing them would, within
        [timeout_s, max_wait_s]."""
        saved = num_tokens / (self.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S)
        return min(self.max_wait_s, max(self.timeout_s, saved))

    # -- reading (the request's thread) -------------------------------------------------------------------
    def get_many(self, entries: list[RemoteEntry]) -> dict[bytes, StoredKV]:
        """The payloads of `entries` the store holds and that pass every check, by key (one round trip, within
        read_budget). Never raises: whatever goes wrong is counted, and what was not read is not there."""
        if not entries:
            return {}
        if not self.breaker.allow():
            self.counters.skipped += 1
            return {}
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.read_budget(sum(len(e.tokens) for e in entries))
        self.counters.lookups += len(entries)
        found: dict[bytes, StoredKV] = {}
        read, conn = 0, None
        try:
            # One round trip, one GET per chunk: the store starts sending the first value at once instead of
            # building one reply of every value first (tens of MB for a long prompt).
            conn = start(self._pool, [("GET", self.key(e.key)) for e in entries], deadline)
            for entry in entries:
                reply = conn.read_reply(deadline, self.max_value_bytes)
                read += 1
                self._take(entry, reply, found)
                if not conn.in_step:
                    break
            self._pool.give(conn)
        except DeadlinePassed:  # slow, not failing: what was read is used, the rest is unread
            if conn is not None:
                conn.close()
        except Exception as exc:  # StoreError, or anything else out of the client: counted, never raised
            if conn is not None:
                conn.close()
            self._failed(exc)
            self.counters.read_ms += (time.perf_counter() - t0) * 1000
            return found
        self.counters.unread += len(entries) - read
        self.breaker.succeeded()
        self.counters.read_ms += (time.perf_counter() - t0) * 1000
        return found

    def _take(self, entry: RemoteEntry, reply: Reply, found: dict) -> None:
        """Counts one GET's reply and keeps its payload in `found` when it is a value this engine can use."""
        if reply.kind == "nil":
            self.counters.misses += 1
            return
        if reply.kind == "error" and not bytes(reply.value).startswith(b"WRONGTYPE"):
            raise StoreError(f"GET answered {reply.shown()}")
        if reply.kind == "bulk":
            stored, why = self._checked(entry, reply.value)
            if stored is not None:
                self.counters.hits += 1
                self.counters.read_bytes += len(reply.value)
                found[entry.key] = stored
                return
        else:  # WRONGTYPE, an integer, an array, a bulk string longer than any value: not a value of this tier
            why = f"{reply.shown()} where a value belongs"
        log.warning("shared KV entry %s is a miss: %s", entry.key.hex()[:12], why)
        self.counters.bad += 1
        self._enqueue(("delete", entry.key, None, None), 0)

    def _checked(self, entry: RemoteEntry, value: bytearray) -> tuple[StoredKV | None, str | None]:
        """(the value as a payload, None) when it is exactly the KV of `entry` for this model in this namespace,
        else (None, why)."""
        try:
            stored = decode_bytes(torch.frombuffer(value, dtype=torch.uint8), self.namespace, entry.key,
                                  expect=entry.fields())
            layout = self.layout or KVLayout.of_stored(stored)
            why = "no layout" if layout is None else layout.mismatch(stored, self.quant, len(entry.tokens))
        except Exception as exc:  # PayloadError says what; anything else is a value no check foresaw
            return None, f"{type(exc).__name__}: {exc}"
        return (None, why) if why is not None else (stored, None)

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
        commands, blob, describe = [("DEL", self.key(key))], b"", self._describe
        try:
            if op == "set":
                blob = encode_file(stored, self.namespace, key, entry.fields())
                commands = [("SET", self.key(key), blob)]
                if describe is not None:
                    commands.insert(0, ("HSETNX", NAMESPACES_KEY, self.namespace, json.dumps(describe,
                                                                                          sort_keys=True)))
            replies = exchange(self._pool, commands, time.monotonic() + self.max_wait_s)
            refusals = [r for r in replies if r.kind == "error"]
            if op == "set" and not refusals and (replies[-1].kind, bytes(replies[-1].value or b"")) != \
                    ("simple", b"OK"):
                raise StoreError(f"SET answered {replies[-1].shown()}, not +OK")
        except DeadlinePassed:  # a slow store: this write may or may not have happened
            self.counters.dropped += 1
            return
        except Exception as exc:
            self._failed(exc)
            return
        if refusals:
            # Full under a policy that refuses writes (noeviction), a read-only replica, an ACL: the store answers,
            # and what it holds is still worth reading, so this is no outage for the breaker. Logged once.
            if not self.counters.refused:
                hint = "; set maxmemory-policy allkeys-lru" if bytes(refusals[0].value).startswith(b"OOM") else ""
                log.warning("shared KV tier %s refuses writes (%s)%s", self.url, refusals[0].shown(), hint)
            self.counters.refused += 1
        elif op == "set":
            self.counters.writes += 1
            self.counters.written_bytes += len(blob)
        if describe is not None and not refusals:
            self._describe = None
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
        self._pool.clear()
        _LIVE.discard(self)

    def _failed(self, exc: BaseException) -> None:
        self.counters.errors += 1
        self._pool.clear()  # the store failed: connections kept from before are suspect too
        self.breaker.failed(exc)

    # -- reporting (counters only: a UI thread calls this every second) -----------------------------------
    def stats(self) -> dict:
        return {"url": self.url, "namespace": self.namespace, "kv_quant": self.quant, "state": self.breaker.state,
                "breaker_trips": self.breaker.trips, "last_error": self.breaker.last_error,
                "queued": len(self._queue), "prefill_tokens_per_s": self.prefill_tokens_per_s,
                "max_value_bytes": self.max_value_bytes, **vars(self.counters)}


_LIVE: "weakref.WeakSet[RemoteTier]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """A process that ends right after a request (`kvboost warm`) still shares what it computed (briefly)."""
    for tier in list(_LIVE):
        tier.flush(timeout_s=5.0)

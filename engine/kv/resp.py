"""A small RESP2 client for the shared KV tier (engine.kv.remote_tier): connections to a Redis or Valkey store over TCP,
TLS (rediss://) or a unix socket, and replies read within the bounds the tier sets.

redis-py is not used on this path: its parser allocates what a reply announces and descends into any aggregate,
its timeouts apply to each socket read (a store that drips a byte at a time holds a call for ever), and its RESP3
handshake takes the answer to HELLO on trust. Here:
- RESP2 only: HELLO is never sent, whatever `protocol=` the URL carries. The handshake is AUTH and SELECT, each
  answered +OK or the connection fails.
- Every exchange has one deadline for the whole of it (connect, TLS handshake, AUTH/SELECT, sending, every
  reply). A store that has not answered by then, or that stops for its silence limit, is StoreSilent (failing);
  a deadline that passes while bytes flow is DeadlinePassed (slow: this call took too long, the store is not
  failing). The silence limit is `silence_s` on a machine with a CPU to spare, and grows with the tasks waiting
  for a CPU (`silence_limit`): on a machine loaded to 15 on two cores a healthy store on the same machine was seen
  off the CPU for 274 ms, which a fixed 250 ms read as an outage.
- A bulk string is allocated only after its announced length was checked against the caller's limit (a longer one
  is a "too large" reply, never kept); a line is at most MAX_LINE bytes; an aggregate (array, map, set, ...) is
  never read into: it is reported as what it is, and the connection, now out of step with its replies, is closed.

Over 400 lines: a whole wire client, one subject: URLs, TLS, the pool, pipelined exchanges under deadlines, every
reply bounded."""

from __future__ import annotations

import os
import re
import select
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

SCHEMES = ("redis", "rediss", "unix")
TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password",
               "ssl_check_hostname")
URL_OPTIONS = ("db", "protocol", *TLS_OPTIONS)
MAX_LINE = 64 << 10  # a status, error or length line longer than this is not RESP
RECV_BYTES = 256 << 10
_LENGTH = re.compile(rb"-?[0-9]{1,19}")
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def cpu_load() -> float:
    """Tasks that want a CPU, per CPU this process may run on: the larger of the running count now and the
    1-minute load average (/proc/loadavg on Linux, os.getloadavg elsewhere); 0 where neither can be read."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        fields = open("/proc/loadavg", encoding="ascii").read().split()
        waiting = max(float(fields[0]), float(fields[3].split("/")[0]))
    except (OSError, ValueError, IndexError):
        try:
            waiting = os.getloadavg()[0]
        except (AttributeError, OSError):
            return 0.0
    return waiting / max(1, cpus)


def silence_limit(silence_s: float, load: float) -> float:
    """How long a store may send nothing before it counts as failing, with `load` tasks per CPU wanting one: a
    store sharing a machine with them gets the CPU about once in `load` turns, so a silence that long is its
    wait, not an outage."""
    return silence_s * max(1.0, load)


class StoreError(Exception):
    """The store cannot be used now: unreachable, refusing, hanging up, silent, or not answering in RESP2."""


class StoreSilent(StoreError):
    """Nothing came from the store for the silence limit while an answer was awaited."""


class DeadlinePassed(Exception):
    """The exchange's deadline passed while the store was still answering."""


@dataclass(frozen=True)
class Reply:
    """One reply: kind "bulk" (value: the bytes), "nil", "simple" / "error" / "integer" (value: the line),
    "too large" (a bulk string longer than allowed, never read; size: its announced length) or "other" (an
    aggregate or a RESP3 type; value: its type byte)."""

    kind: str
    value: bytes | bytearray | None = None
    size: int = 0

    def shown(self) -> str:
        if self.kind in ("simple", "error", "integer"):
            return f"{self.kind} {bytes(self.value[:120])!r}"
        if self.kind == "too large":
            return f"a bulk string of {self.size} bytes"
        return self.kind if self.kind != "other" else f"a reply of RESP type {bytes(self.value)!r}"


@dataclass(frozen=True)
class Address:
    host: str | None
    port: int
    path: str | None  # a unix socket
    username: str | None
    password: str | None
    db: int
    tls: ssl.SSLContext | None


def parse_url(url: str) -> Address:
    """redis://[[user]:password@]host[:port][/db], rediss:// (TLS), unix://[[user]:password@]/path[?db=N];
    ValueError saying what is wrong (never showing the password)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"the scheme must be one of {SCHEMES}, got {parts.scheme!r}")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(URL_OPTIONS))
    if unknown:
        raise ValueError(f"URL options {unknown} are not supported here (supported: {', '.join(URL_OPTIONS)}; the "
                         "timing is set by remote_timeout_s and remote_max_wait_s)")
    options = {name: values[-1] for name, values in query.items()}
    if options.get("protocol", "2") not in ("2", "3"):
        raise ValueError(f"protocol must be 2 or 3 (RESP2 is spoken either way), got {options['protocol']!r}")
    db, path, host, port = 0, None, None, 0
    if parts.scheme == "unix":
        path = unquote(parts.path)
        if not path:
            raise ValueError("a unix:// URL names the socket's path, e.g. unix:///run/redis/redis.sock")
    else:
        host = parts.hostname or "localhost"
        port = parts.port or 6379
        if unquote(parts.path).strip("/"):
            db = _number("db", unquote(parts.path).strip("/"))
    if "db" in options:
        db = _number("db", options["db"])
    if parts.scheme != "rediss" and set(options) & set(TLS_OPTIONS):
        raise ValueError("ssl_* options need a rediss:// URL")
    tls = _tls_context(options) if parts.scheme == "rediss" else None
    return Address(host, port, path, unquote(parts.username) if parts.username else None,
                   unquote(parts.password) if parts.password is not None else None, db, tls)


def _number(name: str, text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
    return int(text)


def _tls_context(options: dict) -> ssl.SSLContext:
    reqs = options.get("ssl_cert_reqs", "required").lower()
    if reqs not in _CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {sorted(_CERT_REQS)}, got {reqs!r}")
    try:
        context = ssl.create_default_context(cafile=options.get("ssl_ca_certs"), capath=options.get("ssl_ca_path"))
        if options.get("ssl_certfile"):
            context.load_cert_chain(options["ssl_certfile"], options.get("ssl_keyfile"),
                                    options.get("ssl_password"))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS certificates cannot be loaded: {exc}") from None
    check = options.get("ssl_check_hostname", "true").lower() in ("1", "true", "yes", "on")
    context.check_hostname = check and reqs != "none"
    context.verify_mode = _CERT_REQS[reqs]
    return context


def encode(*args) -> bytes:
    """One command as RESP2 sends it: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, (bytes, bytearray)) else str(arg).encode()
        out += [b"$%d\r\n" % len(raw), raw, b"\r\n"]
    return b"".join(out)


class Connection:
    """One connection to the store, used by one thread at a time (the Pool hands it out)."""

    def __init__(self, address: Address, silence_s: float):
        self.address = address
        self.silence_s = silence_s
        self._silence_s = silence_s  # this exchange's limit: silence_s stretched by the machine's load at its start
        self.sock: socket.socket | None = None
        self.in_step = True  # False once a reply was not read to its end: what follows cannot be told apart
        self._buf = bytearray()
        self._pos = 0
        self._progress = 0.0  # when a byte last went either way (or the exchange began)
        self._answered = False  # a byte came from the store since the exchange began

    # -- the exchange's clock -------------------------------------------------------------------------------
    def _wait(self, deadline: float) -> float:
        """Seconds the next socket operation may block: up to the deadline or the silence limit, whichever is
        first; raises when that moment has passed."""
        now = time.monotonic()
        left = min(deadline, self._progress + self._silence_s) - now
        if left <= 0:
            if not self._answered or now - self._progress >= self._silence_s:
                raise StoreSilent(f"the store sent nothing for {(now - self._progress) * 1000:.0f} ms")
            raise DeadlinePassed("the deadline passed while the store was answering")
        return left

    def begin(self) -> None:
        """Starts an exchange's clock: nothing was answered yet."""
        self._progress = time.monotonic()
        self._answered = False
        self._silence_s = silence_limit(self.silence_s, cpu_load())

    # -- connecting ----------------------------------------------------------------------------------------
    def open(self, deadline: float) -> None:
        """Connects, with TLS and AUTH/SELECT as the address says; StoreError when that fails."""
        a = self.address
        self.begin()
        try:
            if a.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock = sock
                sock.settimeout(self._wait(deadline))
                sock.connect(a.path)
            else:
                sock = socket.create_connection((a.host, a.port), timeout=self._wait(deadline))
                self.sock = sock
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except socket.timeout:
            raise StoreSilent("connecting timed out") from None
        except OSError as exc:
            raise StoreError(f"cannot connect: {exc.strerror or exc}") from None
        self.begin()
        if a.tls is not None:
            self._start_tls(deadline)
        if a.password is not None:
            self._expect_ok(("AUTH", a.username, a.password) if a.username else ("AUTH", a.password), deadline)
        if a.db:
            self._expect_ok(("SELECT", a.db), deadline)

    def _start_tls(self, deadline: float) -> None:
        """The TLS handshake, non-blocking, so that the deadline bounds all of it (not each record)."""
        self.sock.setblocking(False)
        try:
            self.sock = self.address.tls.wrap_socket(self.sock, server_hostname=self.address.host,
                                                     do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            raise StoreError(f"TLS failed: {exc}") from None
        while True:
            try:
                self.sock.do_handshake()
                break
            except ssl.SSLWantReadError:
                ready = select.select([self.sock], [], [], self._wait(deadline))[0]
            except ssl.SSLWantWriteError:
                ready = select.select([], [self.sock], [], self._wait(deadline))[1]
            except OSError as exc:  # ssl.SSLError included: a certificate refused, not TLS at all
                raise StoreError(f"TLS handshake failed: {exc}") from None
            if ready:
                self.begin()
        self.begin()

    def _expect_ok(self, command: tuple, deadline: float) -> None:
        self.send(encode(*command), deadline)
        reply = self.read_reply(deadline, MAX_LINE)
        if reply.kind == "simple" and bytes(reply.value) == b"OK":
            return
        raise StoreError(f"{command[0]} answered {reply.shown()}, not +OK")

    # -- sending and reading -------------------------------------------------------------------------------
    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self.sock.settimeout(self._wait(deadline))
            try:
                sent = self.sock.send(view)
            except socket.timeout:
                continue
            except OSError as exc:
                raise StoreError(f"sending failed: {exc.strerror or exc}") from None
            self._progress = time.monotonic()
            view = view[sent:]

    def _recv(self, into: memoryview | None, deadline: float) -> int:
        """Takes what the store sends next (into `into`, else onto the buffer); its size, at least 1. A silence
        limit that passed while bytes were already waiting in the socket is the reader's delay (a loaded machine
        kept this thread off the CPU), not the store's: those bytes are taken."""
        while True:
            try:
                wait = self._wait(deadline)
            except StoreSilent:
                if not self._bytes_waiting():
                    raise
                wait = 0.001  # at once: the bytes are here
            self.sock.settimeout(wait)
            try:
                if into is not None:
                    got = self.sock.recv_into(into)
                else:
                    data = self.sock.recv(RECV_BYTES)
                    got = len(data)
                    self._buf += data
            except socket.timeout:
                continue
            except OSError as exc:
                raise StoreError(f"reading failed: {exc.strerror or exc}") from None
            if got == 0:
                raise StoreError("the store closed the connection")
            self._progress = time.monotonic()
            self._answered = True
            return got

    def _bytes_waiting(self) -> bool:
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        try:
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return False

    def wait_for_answer(self, deadline: float) -> None:
        """Returns once the first byte of an answer is here."""
        if self._pos == len(self._buf):
            self._fill(deadline)

    def _fill(self, deadline: float) -> None:
        del self._buf[:self._pos]
        self._pos = 0
        self._recv(None, deadline)

    def _line(self, deadline: float) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._pos)
            if end >= 0:
                line = bytes(self._buf[self._pos:end])
                self._pos = end + 2
                return line
            if len(self._buf) - self._pos > MAX_LINE:
                raise StoreError(f"a reply line longer than {MAX_LINE} bytes: not RESP")
            self._fill(deadline)

    def _exact(self, size: int, deadline: float) -> bytearray:
        out = bytearray(size)
        have = min(size, len(self._buf) - self._pos)
        out[:have] = self._buf[self._pos:self._pos + have]
        self._pos += have
        view = memoryview(out)
        while have < size:
            have += self._recv(view[have:], deadline)
        view.release()
        return out

    def _skip(self, size: int, deadline: float) -> None:
        """Reads past `size` bytes without keeping them."""
        have = min(size, len(self._buf) - self._pos)
        self._pos += have
        scratch = memoryview(bytearray(min(size, RECV_BYTES)))
        while have < size:
            have += self._recv(scratch[:min(size - have, len(scratch))], deadline)

    def read_reply(self, deadline: float, max_bulk: int) -> Reply:
        """The next reply, a bulk string at most `max_bulk` bytes long: a longer one is "too large", read past
        without being kept when it is at most twice that (a value of another setting, say), else left unread
        (the connection is then out of step)."""
        line = self._line(deadline)
        kind, rest = line[:1], line[1:]
        if kind in (b"$", b"=", b"!"):  # bulk; RESP3's verbatim string and blob error are read as long
            if not _LENGTH.fullmatch(rest):
                raise StoreError(f"a bulk length of {rest[:40]!r}: not RESP")
            size = int(rest)
            if size == -1 and kind == b"$":
                return Reply("nil")
            if size < 0:
                raise StoreError(f"a bulk length of {size}: not RESP")
            if size > 2 * max_bulk:  # not worth reading past: the connection is given up
                self.in_step = False
                return Reply("too large", size=size)
            value = self._exact(size, deadline) if size <= max_bulk else self._skip(size, deadline)
            if self._line(deadline):
                raise StoreError("a bulk string longer than its announced length: not RESP")
            if value is None:
                return Reply("too large", size=size)
            return Reply("bulk", value) if kind == b"$" else Reply("other", kind)
        if kind in (b"+", b"-", b":"):
            return Reply({b"+": "simple", b"-": "error", b":": "integer"}[kind], rest)
        if kind in (b",", b"(", b"#", b"_"):  # RESP3's one-line types
            return Reply("other", kind)
        if kind in (b"*", b"%", b"~", b">", b"|"):  # aggregates: never descended into
            self.in_step = False
            return Reply("other", kind)
        raise StoreError(f"a reply starting {line[:16]!r}: not RESP")

    def idle_and_open(self) -> bool:
        """Nothing unread and nothing arriving: a store that sends what was not asked for (or hung up) is not
        spoken to on this connection again."""
        if self.sock is None or self._pos != len(self._buf):
            return False
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False
        try:
            return not select.select([self.sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self.in_step = False
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


class Pool:
    """Idle connections to one store; each is taken by one thread at a time (requests read, the writer writes)."""

    def __init__(self, address: Address, silence_s: float, max_idle: int = 2):
        self.address = address
        self.silence_s = silence_s
        self.max_idle = max_idle
        self._idle: list[Connection] = []

    def take(self, deadline: float) -> tuple[Connection, bool]:
        """(a connection, whether it was open already). list.pop is atomic: no lock is needed."""
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                break
            if conn.idle_and_open():
                return conn, True
            conn.close()
        conn = Connection(self.address, self.silence_s)
        try:
            conn.open(deadline)
        except BaseException:
            conn.close()
            raise
        return conn, False

    def give(self, conn: Connection) -> None:
        if conn.in_step and conn.sock is not None and conn.idle_and_open() and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    def clear(self) -> None:
        while self._idle:
            try:
                self._idle.pop().close()
            except IndexError:
                return


def start(pool: Pool, commands: list[tuple], deadline: float) -> Connection:
    """A connection with `commands` sent and the first byte of their answer in. A pooled connection the store
    closed meanwhile (a restart, an idle timeout) is replaced by a new one, once."""
    data = b"".join(encode(*command) for command in commands)
    while True:
        conn, pooled = pool.take(deadline)
        try:
            conn.begin()
            conn.send(data, deadline)
            conn.wait_for_answer(deadline)
            return conn
        except StoreError as exc:
            conn.close()
            if not pooled or isinstance(exc, StoreSilent):
                raise
            pool.clear()
        except BaseException:
            conn.close()
            raise


def exchange(pool: Pool, commands: list[tuple], deadline: float, max_bulk: int = MAX_LINE) -> list[Reply]:
    """The replies to `commands`, sent in one round trip."""
    conn = start(pool, commands, deadline)
    try:
        replies = []
        for _ in commands:
            replies.append(conn.read_reply(deadline, max_bulk))
            if not conn.in_step:
                raise StoreError(f"{replies[-1].shown()} where a short reply belongs")
    except BaseException:
        conn.close()
        raise
    pool.give(conn)
    return replies

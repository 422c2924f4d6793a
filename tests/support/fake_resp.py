"""A fake Redis on 127.0.0.1 for the shared-tier tests: a socket server thread that reads RESP commands and answers
each as its script says, so a test can be a store that is not Redis, or a broken one.

The script is a function of the command (a list of bytes, the name upper-cased) returning what to send: bytes (sent
as they are), Drip (a few bytes at a time), Endless (a head, then bytes until the client hangs up), Silence (never a
reply), CLOSE (hang up) or a list of these in turn, or None for the default: a small store that keeps SET values in a
dict and answers
AUTH/SELECT/CLIENT/PING/HELLO/GET/SET/DEL/HSETNX as Redis 7 does.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Drip:
    data: bytes
    every_s: float = 0.03
    max_s: float = 4.0  # then the server hangs up (so that a test of a client without a deadline still ends)
    piece: int = 1  # bytes sent each time


@dataclass(frozen=True)
class Endless:
    head: bytes
    max_s: float = 4.0


@dataclass(frozen=True)
class Silence:
    max_s: float = 4.0


CLOSE = object()


def bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)


class FakeResp:
    def __init__(self, script=None):
        self.script = script or (lambda command: None)
        self.values: dict[bytes, bytes] = {}
        self.commands: list[list[bytes]] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._stopped = threading.Event()
        self._clients: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def __enter__(self) -> "FakeResp":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def names(self) -> list[bytes]:
        return [c[0] for c in self.commands]

    def stop(self) -> None:
        """Stops serving; shutdown(), unlike close(), wakes the threads blocked in accept() and recv()."""
        self._stopped.set()
        for sock in [self._listener, *self._clients]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self._thread.join(5)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as Redis does: no Nagle delays
            self._clients.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        reader = client.makefile("rb")
        try:
            while not self._stopped.is_set():
                command = _read_command(reader)
                if command is None:
                    return
                command[0] = command[0].upper()
                self.commands.append(command)
                reply = self.script(command)
                if reply is None:
                    reply = self._default(command)
                if not self._send(client, reply):
                    return
        except OSError:
            return
        finally:
            try:
                client.close()
            except OSError:
                pass

    def _send(self, client: socket.socket, reply) -> bool:
        """Sends `reply`; False when the connection is over."""
        if reply is CLOSE:
            return False
        if isinstance(reply, bytes):
            client.sendall(reply)
            return True
        if isinstance(reply, list):  # one reply after another (e.g. bytes, then CLOSE)
            return all(self._send(client, part) for part in reply)
        start = time.monotonic()
        if isinstance(reply, Drip):
            for i in range(0, len(reply.data), reply.piece):
                if self._stopped.is_set() or time.monotonic() - start > reply.max_s:
                    return False
                client.sendall(reply.data[i:i + reply.piece])
                time.sleep(reply.every_s)
            return True
        if isinstance(reply, Endless):
            client.sendall(reply.head)
            junk = b"x" * (1 << 16)
            client.settimeout(0.5)
            while not self._stopped.is_set() and time.monotonic() - start < reply.max_s:
                try:
                    client.sendall(junk)
                except socket.timeout:
                    continue
            return False
        if isinstance(reply, Silence):
            self._stopped.wait(reply.max_s)
            return False
        raise TypeError(f"not a scripted reply: {reply!r}")

    def _default(self, command: list[bytes]) -> bytes:
        name, args = command[0], command[1:]
        if name in (b"AUTH", b"SELECT", b"CLIENT"):
            return b"+OK\r\n"
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"HELLO":  # as Redis 7 answers it
            fields = [b"server", b"redis", b"version", b"7.0.15", b"proto", int(args[0]) if args else 2, b"id", 1,
                      b"mode", b"standalone", b"role", b"master", b"modules", []]
            items = b"".join(b":%d\r\n" % f if isinstance(f, int) else b"*0\r\n" if isinstance(f, list) else bulk(f)
                             for f in fields)
            return (b"%%%d\r\n" % (len(fields) // 2) if args and args[0] == b"3" else b"*%d\r\n" % len(fields)) + items
        if name == b"GET":
            return bulk(self.values.get(args[0]))
        if name == b"SET":
            self.values[args[0]] = args[1]
            return b"+OK\r\n"
        if name == b"DEL":
            return b":%d\r\n" % sum(self.values.pop(k, None) is not None for k in args)
        if name == b"HSETNX":
            return b":1\r\n"
        return b"-ERR unknown command\r\n"


def _read_command(reader) -> list[bytes] | None:
    """One command as a client sends it (an array of bulk strings), or None when the client hung up."""
    line = reader.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return line.split()  # an inline command
    parts = []
    for _ in range(int(line[1:])):
        header = reader.readline()
        if not header.startswith(b"$"):
            return None
        size = int(header[1:])
        parts.append(reader.read(size + 2)[:size])
    return parts

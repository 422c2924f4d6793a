"""What the server refuses at the door, before a request reaches the engine: a missing or wrong API key, a web
page's request without one (Origin) and DNS rebinding (Host), bodies over the size limit, and clients too slow
to send their request head, body or next request (Timeouts)."""

from __future__ import annotations

import asyncio
import functools
import hmac
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .schema import APIError, error_response


@dataclass(frozen=True)
class Timeouts:
    """How long the server waits on a client, in seconds."""

    header_s: float = 30.0  # for a request head: from connecting, or from its first byte after a keep-alive pause
    body_s: float = 30.0  # for a request body, from the end of its head (then 408 and the connection closes)
    keep_alive_s: float = 5.0  # idle between requests on one connection


class Guard:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers):
    API key, body size (Content-Length and chunked bodies alike), a body that arrives within `body_timeout`
    seconds of the request head, and, without an API key, no requests from web pages (an Origin header) and,
    on loopback, no Host but this machine's (DNS rebinding)."""

    LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")

    def __init__(self, app, api_key: str | None, max_body_bytes: int, loopback_only: bool, body_timeout: float):
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.loopback_only = loopback_only
        self.body_timeout = body_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope["path"], headers)
        if refusal is not None:
            return await refusal(scope, receive, send)
        limit, received, body_done = self.max_body_bytes, 0, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout

        async def limited_receive():
            # Errors raise inside the handler's body read: the APIError handler answers, and `connection: close`
            # ends a connection whose body was not read to its end.
            nonlocal received, body_done
            if body_done:  # from here on, receive() only waits for the client to go (streaming responses)
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout:g} s",
                               code="request_timeout", headers={"connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise APIError(413, f"request body over {limit} bytes", code="body_too_large",
                                   headers={"connection": "close"})
            return message

        await self.app(scope, limited_receive, send)

    def _refusal(self, path: str, headers: dict):
        if self.api_key is None:
            if "origin" in headers:
                return error_response(403, "requests from web pages need the server to run with an API key "
                                      "(--api-key)", code="origin_not_allowed")
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if self.loopback_only and name not in self.LOOPBACK_HOSTS:
                return error_response(403, f"host {host!r} is not this machine", code="host_not_allowed")
        elif path != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return error_response(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                                      code="invalid_api_key")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return error_response(413, f"request body over {self.max_body_bytes} bytes", code="body_too_large")
        return None


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline whenever the server waits on a client outside a request it is
    answering: a request head must be in within `header_timeout` seconds of the connection (or of its first byte
    after a keep-alive pause, which uvicorn times itself), and so must the unread rest of an answered request's
    body. Past it the connection closes. uvicorn has no such deadline: without it, a client sending a byte a
    second holds a connection forever."""

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._answering():
            self._disarm()
        else:
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._answering() and self.conn.their_state is h11.SEND_BODY:  # the app did not read it all
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _answering(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if not self._answering() and not self.transport.is_closing():
            self.transport.close()


def server_options(timeouts: Timeouts = Timeouts()) -> dict:
    """uvicorn's settings (for uvicorn.run or uvicorn.Config) that apply the head and keep-alive deadlines of
    `timeouts`; the app applies the body's."""
    return {"http": functools.partial(TimedH11Protocol, header_timeout=timeouts.header_s),
            "timeout_keep_alive": timeouts.keep_alive_s, "timeout_graceful_shutdown": 2}

"""One request handle per answer (and per pre-warm): what a tab holds while its answer is made.

`EngineClient.chat()` returns a ChatRequest; its signals are heard by whoever holds it (the tab that asked), not
broadcast to every tab. Whichever backend answers (app.backends: the engine on its worker thread, or a remote
server on a thread of its own) reports through the `post_*` methods, from any thread; the request hands each
report to its own thread's event loop, so its public signals are always emitted there, never while the code that
made the request is still running: connecting right after `chat()` returns never misses one.

The finished answer is an `Answer`: the text, why it ended, the engine's statistics and the cache map's segments.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field

from PySide6.QtCore import QObject, Qt, Signal

# How an answer can end besides its finish_reason from the engine ("stop", "length"): stopped by the user or by
# quitting ("cancelled"), or a remote server's stream that broke off after some text ("interrupted").
CANCELLED, INTERRUPTED = "cancelled", "interrupted"


@dataclass(frozen=True)
class Answer:
    """A finished answer.

    `stats`: the engine's request statistics (engine.generate.Stats.to_dict(); a remote answer's own), None when
    the answer never ran; `segments`: the prompt's spans and how each was obtained (reused, computed) for the cache
    map; `saved_ms`: the prefill time the reused tokens saved, estimated from this session's measured prefill rate
    (None until one was measured, or for a remote answer); `error`: what broke a remote answer off, if anything."""

    text: str
    finish_reason: str
    stats: dict | None = None
    segments: list[dict] = field(default_factory=list)
    saved_ms: float | None = None
    error: str | None = None

    @classmethod
    def cancelled(cls) -> "Answer":
        """The answer of a request stopped before it ran."""
        return cls(text="", finish_reason=CANCELLED)

    def to_dict(self) -> dict:
        """The answer as the chat view and the smoke test read it (and as it is stored)."""
        return asdict(self)


@dataclass(frozen=True)
class WarmReport:
    """What a pre-warm did, summed over its texts (engine.KVBoost.warm reports each)."""

    tokens: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0
    ms: float = 0.0
    prefill_ms: float = 0.0
    done: int = 0  # texts warmed
    cancelled: bool = False

    def plus(self, report: dict) -> "WarmReport":
        """These totals with one more text's report added."""
        return WarmReport(self.tokens + report["tokens"], self.computed_tokens + report["computed_tokens"],
                          self.reused_tokens + report["reused_tokens"], self.ms + report["ms"],
                          self.prefill_ms + report["prefill_ms"], self.done + 1, self.cancelled)


class _Request(QObject):
    """What both handles share: an id, a cancel event, and reports posted from any thread that come out as
    signals on the handle's own thread."""

    _posted = Signal(str, object)  # (what, value): emitted on any thread, delivered queued to this object's

    def __init__(self, request_id: int, parent=None):
        super().__init__(parent)
        self.id = request_id
        self.cancel_event = threading.Event()
        self.done = False  # its end (finished or failed) has been delivered
        self.error: str | None = None
        self._silent = False  # silence(): nothing more is delivered
        # Queued even when posted on this thread: the public signals never fire inside the call that posts them.
        self._posted.connect(self._deliver, Qt.ConnectionType.QueuedConnection)

    def cancel(self) -> None:
        """Stops it: before it runs, it never will; while it runs, at its next step."""
        self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def silence(self) -> None:
        """No more signals from it, whatever its backend still reports (the app is quitting: what is on screen has
        been saved, and a late "cancelled" must not overwrite it)."""
        self._silent = True

    def _post(self, what: str, value=None) -> None:
        try:
            self._posted.emit(what, value)
        except RuntimeError:  # the handle is gone (its tab closed): nobody is listening
            pass

    def post_failed(self, message: str) -> None:
        self._post("failed", message)

    def _deliver(self, what: str, value) -> None:
        if self.done or self._silent:  # one end per request; anything after it is stale
            return
        if what == "failed":
            self.done, self.error = True, value
            self.failed.emit(value)
        else:
            self._deliver_own(what, value)

    def _deliver_own(self, what: str, value) -> None:
        raise NotImplementedError


class ChatRequest(_Request):
    """One answer being made. Signals (on the thread that made it): started, prompt_read(tokens read, tokens in
    all) while a long prompt is read (the local engine only), token(text delta), then either finished(Answer) or
    failed(message)."""

    started = Signal()
    prompt_read = Signal(int, int)
    token = Signal(str)
    finished = Signal(object)  # Answer
    failed = Signal(str)

    def __init__(self, request_id: int, parent=None):
        super().__init__(request_id, parent)
        self.answer: Answer | None = None

    # -- the backend's side (any thread) ---------------------------------------------------------------------
    def post_started(self) -> None:
        self._post("started")

    def post_prompt_read(self, done: int, total: int) -> None:
        self._post("prompt_read", (done, total))

    def post_token(self, text: str) -> None:
        self._post("token", text)

    def post_finished(self, answer: Answer) -> None:
        self._post("finished", answer)

    def _deliver_own(self, what: str, value) -> None:
        if what == "started":
            self.started.emit()
        elif what == "prompt_read":
            self.prompt_read.emit(*value)
        elif what == "token":
            self.token.emit(value)
        else:
            self.done, self.answer = True, value
            self.finished.emit(value)


class WarmRequest(_Request):
    """One pre-warm of a tab's documents. Signals: progressed(texts done, texts in all), then finished(WarmReport)
    or failed(message)."""

    progressed = Signal(int, int)
    finished = Signal(object)  # WarmReport
    failed = Signal(str)

    def __init__(self, request_id: int, parent=None):
        super().__init__(request_id, parent)
        self.report: WarmReport | None = None

    def post_progress(self, done: int, total: int) -> None:
        self._post("progress", (done, total))

    def post_finished(self, report: WarmReport) -> None:
        self._post("finished", report)

    def _deliver_own(self, what: str, value) -> None:
        if what == "progress":
            self.progressed.emit(*value)
        else:
            self.done, self.report = True, value
            self.finished.emit(value)

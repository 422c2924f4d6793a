"""Helpers shared by the app tests."""

from __future__ import annotations

WAIT_MS = 180_000  # generous: this machine may be shared with other work


def send(qtbot, tab, text: str, *, timeout: int = WAIT_MS, on_token=None):
    """Types `text` in the tab's composer, presses Enter, waits for the answer; returns it (app.answers.Answer).
    `on_token(text)` hears the answer's pieces. The tab's request reports on the event loop, so connecting to it
    after the key press misses nothing."""
    from PySide6.QtCore import Qt

    tab.composer.setPlainText(text)
    qtbot.keyClick(tab.composer, Qt.Key_Return)
    assert tab.request is not None, "the message was not sent"
    if on_token is not None:
        tab.request.token.connect(on_token)
    with qtbot.waitSignal(tab.request.finished, timeout=timeout) as blocker:
        pass
    return blocker.args[0]


def result_of(qtbot, request, *, timeout: int = WAIT_MS):
    """Waits for a request handle (app.answers: ChatRequest, WarmRequest) to finish; returns its Answer or
    WarmReport. A request reports on the event loop, so waiting right after `client.chat()` misses nothing."""
    with qtbot.waitSignal(request.finished, timeout=timeout) as blocker:
        pass
    return blocker.args[0]

"""Helpers shared by the app tests."""

from __future__ import annotations

WAIT_MS = 180_000  # generous: this machine may be shared with other work


def send(qtbot, tab, text: str, *, timeout: int = WAIT_MS) -> dict:
    """Types `text` in the tab's composer, presses Enter, waits for the answer; returns the answer dict."""
    from PySide6.QtCore import Qt

    tab.composer.setPlainText(text)
    with qtbot.waitSignal(tab.client.generation_finished, timeout=timeout) as blocker:
        qtbot.keyClick(tab.composer, Qt.Key_Return)
    return blocker.args[1]

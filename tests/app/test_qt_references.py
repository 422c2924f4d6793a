"""The Qt binding the app runs on keeps Python's reference counts: PySide6 6.12.0 drops one reference to True at
every signal delivered to a Python callable, so a long session (every streamed token is two deliveries, the
memory meter one a second) ends with "Fatal Python error: bool_dealloc" once True's count reaches zero.
pyproject.toml keeps that version out; this test fails on any version that brings the defect back."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Qt, Signal


class Sender(QObject):
    fired = Signal()
    posted = Signal(str, object)  # the shape of app.answers' reports

    def __init__(self):
        super().__init__()
        self.heard = 0

    def hear(self, *args) -> None:
        self.heard += 1


def test_signals_delivered_to_python_keep_the_reference_counts(qapp):
    sender = Sender()
    sender.fired.connect(sender.hear, Qt.ConnectionType.DirectConnection)
    sender.posted.connect(sender.hear, Qt.ConnectionType.QueuedConnection)
    sender.posted.connect(lambda what, value: None, Qt.ConnectionType.QueuedConnection)
    before = sys.getrefcount(True), sys.getrefcount(None)
    for _ in range(500):
        sender.fired.emit()
        sender.posted.emit("token", "x")
    while sender.heard < 1000:
        qapp.processEvents()
    after = sys.getrefcount(True), sys.getrefcount(None)
    # Unrelated code may take or drop a few references meanwhile; the defect drops one per delivery (1500 here).
    assert after[0] > before[0] - 100 and after[1] > before[1] - 100, (before, after)

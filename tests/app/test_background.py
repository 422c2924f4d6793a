"""Work off the UI thread (app.background): results and errors come back on the UI thread, nothing comes back to
an owner that is gone, and no other app module starts threads or thread pools."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

from PySide6.QtWidgets import QWidget

from app.background import Background

APP = Path(__file__).resolve().parents[2] / "app"
THREAD_MAKERS = {"Thread", "ThreadPoolExecutor", "QThread", "Timer"}


def test_a_result_and_an_error_come_back_on_the_ui_thread(qtbot):
    owner = QWidget()
    qtbot.addWidget(owner)
    background = Background(owner)
    ui_thread, seen = threading.get_ident(), []

    def slow_square():
        seen.append(("worker", threading.get_ident()))
        return 7 * 7

    background.run(slow_square, lambda value: seen.append(("result", threading.get_ident(), value)))
    background.run(lambda: 1 / 0, lambda _: None, lambda exc: seen.append(("error", threading.get_ident(),
                                                                           type(exc).__name__)))
    qtbot.waitUntil(lambda: len(seen) == 3)
    assert seen[0][0] == "worker" and seen[0][1] != ui_thread
    assert sorted(item for item in seen[1:]) == [("error", ui_thread, "ZeroDivisionError"),
                                                  ("result", ui_thread, 49)]


def test_nothing_comes_back_to_an_owner_that_is_gone(qtbot):
    owner = QWidget()
    background = Background(owner)
    release, called = threading.Event(), []
    background.run(lambda: release.wait(10), called.append)
    owner.deleteLater()  # the dialog closed while its call runs
    qtbot.waitUntil(lambda: not _alive(background), timeout=5000)
    release.set()
    qtbot.wait(200)
    assert called == []


def _alive(qobject) -> bool:
    try:
        qobject.objectName()
    except RuntimeError:  # its C++ object is deleted
        return False
    return True


def test_only_app_background_starts_threads():
    makers = []
    for path in sorted(APP.glob("*.py")):
        if path.name == "background.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if name in THREAD_MAKERS:
                    makers.append(f"{path.name}:{node.lineno} {name}")
    assert makers == []

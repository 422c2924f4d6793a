"""Keyboard and screen readers: every control that takes the focus in the main window has a name a screen reader
says, and the parts no menu entry reaches (message box, message search, model picker, sidebar) have shortcuts."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QAccessible
from PySide6.QtWidgets import QApplication, QWidget


@pytest.fixture
def shown(qtbot, db, client):
    from app.main_window import MainWindow

    window = MainWindow(db, client, theme_choice="light")
    qtbot.addWidget(window)
    window.resize(1024, 700)
    window.show()
    qtbot.waitExposed(window)
    window.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window)
    return window


def spoken_name(widget: QWidget) -> str:
    interface = QAccessible.queryAccessibleInterface(widget)
    return widget.accessibleName() or (interface.text(QAccessible.Name) if interface is not None else "")


def test_every_control_that_takes_the_focus_has_a_name_a_screen_reader_says(shown):
    window = shown
    window.current_tab().chat_view.add_message({"id": 1, "role": "user", "content": "Show `x` in code"})
    answer = window.current_tab().chat_view.add_message(
        {"id": 2, "role": "assistant", "content": "```python\nx = 1\n```\nSee [the docs](https://example.org).",
         "stats": {"ttft_ms": 30.0, "prompt_tokens": 12, "reused_tokens": 0}})
    answer.map_button.setChecked(True)  # the cache map shown too
    window.new_conversation()  # a second tab: its controls too
    window.tabs.setCurrentIndex(0)
    QApplication.processEvents()
    focusable = [w for w in window.findChildren(QWidget) if w.isVisible() and w.focusPolicy() != Qt.NoFocus]
    assert len(focusable) >= 8  # the message box, Send, Add documents, search, list, model picker, tabs, messages
    unnamed = [f"{type(w).__name__} {w.objectName()!r}" for w in focusable if not spoken_name(w).strip()]
    assert unnamed == []


@pytest.mark.parametrize("keys, wanted", [
    ((Qt.Key_L, Qt.ControlModifier), lambda window: window.current_tab().composer),
    ((Qt.Key_F, Qt.ControlModifier), lambda window: window.search_edit),
    ((Qt.Key_M, Qt.ControlModifier | Qt.ShiftModifier), lambda window: window.toolbar.model_picker),
])
def test_a_shortcut_moves_the_focus_to_each_part_no_menu_entry_reaches(qtbot, shown, keys, wanted):
    window = shown
    window.sidebar.hide()  # Ctrl+F brings the sidebar back for its search field
    window.current_tab().chat_view.setFocus()
    qtbot.keyClick(window, keys[0], keys[1])
    qtbot.waitUntil(lambda: QApplication.focusWidget() is wanted(window))
    assert wanted(window).isVisible()


def test_ctrl_b_hides_and_shows_the_sidebar_and_the_stop_entry_names_esc(qtbot, shown):
    window = shown
    assert window.sidebar.isVisible()
    qtbot.keyClick(window, Qt.Key_B, Qt.ControlModifier)
    qtbot.waitUntil(lambda: not window.sidebar.isVisible())
    qtbot.keyClick(window, Qt.Key_B, Qt.ControlModifier)
    qtbot.waitUntil(window.sidebar.isVisible)
    entries = [a.text() for menu in window.menuBar().actions() for a in menu.menu().actions()]
    assert "Stop answer\tEsc" in entries
    assert all("&" in menu.text() for menu in window.menuBar().actions())  # Alt + a letter opens each menu

"""Keyboard ways into the main window's parts, and the names a screen reader says for them.

Every menu is reachable with Alt and its underlined letter, and every menu entry from there; these shortcuts reach
the parts no menu entry moves to: the message box (Ctrl+L), the message search (Ctrl+F, showing the sidebar
first), the model picker (Ctrl+Shift+M) and the sidebar itself (Ctrl+B shows or hides it); Esc stops an answer
wherever the focus is, and the Conversation menu's entry says so. Tabs move with Ctrl+Tab /
Ctrl+Shift+Tab (QTabWidget's own)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence, QShortcut

FOCUS_SHORTCUTS = {"composer": "Ctrl+L", "search": "Ctrl+F", "model": "Ctrl+Shift+M"}
SIDEBAR_SHORTCUT = "Ctrl+B"


def add_keyboard_access(window, view_menu, stop_action: QAction) -> None:
    """Names the tab widget for screen readers (the controls inside name themselves where they are made), adds the
    focus shortcuts to `window`'s View menu, gives the sidebar's toggle its shortcut and `stop_action` the hint of
    the Esc shortcut (a hint only: one key bound twice would fire neither)."""
    window.tabs.setAccessibleName("Open conversations")
    # Esc stops the answer of the current tab wherever the focus is
    QShortcut(QKeySequence(Qt.Key_Escape), window, activated=lambda: window.current_tab() and
              window.current_tab().stop())
    stop_action.setText(f"{stop_action.text()}\tEsc")
    window.sidebar.toggleViewAction().setShortcut(QKeySequence(SIDEBAR_SHORTCUT))
    view_menu.addSeparator()

    def focus_composer() -> None:
        tab = window.current_tab()
        if tab is not None:
            tab.composer.setFocus()

    def focus_search() -> None:
        window.sidebar.show()
        window.search_edit.setFocus()
        window.search_edit.selectAll()

    for text, key, slot in (("Go to the message box", FOCUS_SHORTCUTS["composer"], focus_composer),
                            ("Search messages", FOCUS_SHORTCUTS["search"], focus_search),
                            ("Go to the model picker", FOCUS_SHORTCUTS["model"],
                             lambda: window.toolbar.model_picker.setFocus())):
        action = QAction(text, window)
        action.setShortcut(QKeySequence(key))
        action.triggered.connect(slot)
        view_menu.addAction(action)

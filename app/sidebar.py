"""The conversations sidebar: every conversation, newest first, the one on screen highlighted; a search over all
messages whose hits open the conversation at the message."""

from __future__ import annotations

import html
import time
from typing import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDockWidget, QLabel, QLineEdit, QListWidget, QListWidgetItem, QVBoxLayout, QWidget

from .db import MATCH_END, MATCH_START


def hit_html(title: str, snippet: str) -> str:
    """A search hit as rich text: the conversation's title, then the snippet with its matches in bold (everything
    else escaped: messages are shown, never interpreted)."""
    marked = html.escape(snippet).replace(MATCH_START, "<b>").replace(MATCH_END, "</b>")
    return f"<b>{html.escape(title)}</b><br>{marked}"


class Sidebar(QDockWidget):
    def __init__(self, db, open_conversation: Callable[[int, int | None], object], parent=None):
        super().__init__("Conversations", parent)
        self.db, self.open_conversation = db, open_conversation
        self.setObjectName("conversationsDock")
        self.setFeatures(QDockWidget.DockWidgetMovable | QDockWidget.DockWidgetClosable)
        inner = QWidget()
        layout = QVBoxLayout(inner)
        layout.setContentsMargins(4, 4, 4, 4)
        self.search_edit = QLineEdit()
        self.search_edit.setPlaceholderText("Search all messages…")
        self.search_edit.setAccessibleName("Search all messages")
        self.search_edit.setClearButtonEnabled(True)
        self.search_edit.textChanged.connect(lambda _: self.refresh(self._open_ids, self._current))
        layout.addWidget(self.search_edit)
        self.conversation_list = QListWidget()
        self.conversation_list.setAccessibleName("Conversations")
        self.conversation_list.setWordWrap(True)
        self.conversation_list.itemActivated.connect(self.on_item_activated)
        self.conversation_list.itemClicked.connect(self.on_item_activated)
        layout.addWidget(self.conversation_list, 1)
        self.setWidget(inner)
        self.setMinimumWidth(230)
        self._open_ids: set[int] = set()
        self._current: int | None = None

    def refresh(self, open_ids: set[int], current: int | None) -> None:
        """The list again: search hits while there is a query, else every conversation (`open_ids` are in tabs;
        `current` is the one on screen, highlighted)."""
        self._open_ids, self._current = set(open_ids), current
        self.conversation_list.clear()
        query = self.search_edit.text().strip()
        if query:
            for hit in self.db.search_messages(query):
                plain = hit["snippet"].replace(MATCH_START, "").replace(MATCH_END, "")
                item = QListWidgetItem(f"{hit['title']}\n{plain}")
                item.setData(Qt.UserRole, (hit["conversation_id"], hit["message_id"]))
                item.setToolTip(plain)
                self.conversation_list.addItem(item)
                label = QLabel(hit_html(hit["title"], hit["snippet"]))  # the matches in bold
                label.setWordWrap(True)
                label.setTextFormat(Qt.RichText)
                label.setContentsMargins(4, 2, 4, 2)
                label.setAttribute(Qt.WA_TransparentForMouseEvents)
                item.setSizeHint(label.sizeHint())
                item.setForeground(Qt.transparent)  # the label shows the text; the item keeps it for search
                item.setData(Qt.AccessibleTextRole, f"{hit['title']}: {plain}")
                self.conversation_list.setItemWidget(item, label)
            return
        for conversation in self.db.conversations():
            mark = "" if conversation["id"] in open_ids else "  (closed)"
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conversation["updated_at"]))
            item = QListWidgetItem(f"{conversation['title']}{mark}\n{when}")
            item.setData(Qt.UserRole, (conversation["id"], None))
            self.conversation_list.addItem(item)
            if conversation["id"] == current:
                font = item.font()
                font.setBold(True)
                item.setFont(font)
                self.conversation_list.setCurrentItem(item)

    def on_item_activated(self, item: QListWidgetItem) -> None:
        conversation_id, message_id = item.data(Qt.UserRole)
        self.open_conversation(conversation_id, message_id)

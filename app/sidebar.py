"""The conversations sidebar: every conversation, newest first under date headings (Today, Yesterday, ...), the one
on screen highlighted, Rename and Delete on right click; a search over all messages whose hits open the
conversation at the message."""

from __future__ import annotations

import datetime
import html
import time
from typing import Callable

from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QDockWidget, QLabel, QLineEdit, QListWidget, QListWidgetItem, QMenu, QVBoxLayout, QWidget

from .db import MATCH_END, MATCH_START


def hit_html(title: str, snippet: str) -> str:
    """A search hit as rich text: the conversation's title, then the snippet with its matches in bold (everything
    else escaped: messages are shown, never interpreted)."""
    marked = html.escape(snippet).replace(MATCH_START, "<b>").replace(MATCH_END, "</b>")
    return f"<b>{html.escape(title)}</b><br>{marked}"


GROUPS = ("Today", "Yesterday", "Previous 7 days", "Previous 30 days", "Older")


def date_group(timestamp: float, now: float) -> str:
    """Which heading a conversation last updated at `timestamp` sits under, by local calendar days before `now`'s
    (a clock set back shows a future time as Today)."""
    days = (datetime.date.fromtimestamp(now) - datetime.date.fromtimestamp(timestamp)).days
    if days <= 0:
        return GROUPS[0]
    if days == 1:
        return GROUPS[1]
    return GROUPS[2] if days <= 7 else GROUPS[3] if days <= 30 else GROUPS[4]


class Sidebar(QDockWidget):
    def __init__(self, db, open_conversation: Callable[[int, int | None], object],
                 rename_conversation: Callable[[int], object] | None = None,
                 delete_conversation: Callable[[int], object] | None = None, parent=None,
                 clock: Callable[[], float] = time.time):
        super().__init__("Conversations", parent)
        self.db, self.open_conversation, self.clock = db, open_conversation, clock
        self.rename_conversation, self.delete_conversation = rename_conversation, delete_conversation
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
        self.conversation_list.setContextMenuPolicy(Qt.CustomContextMenu)
        self.conversation_list.customContextMenuRequested.connect(self.on_list_context_menu_requested)
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
        now, group = self.clock(), None
        for conversation in self.db.conversations():
            heading = date_group(conversation["updated_at"], now)
            if heading != group:
                group = heading
                self.conversation_list.addItem(self._heading(heading))
            mark = "" if conversation["id"] in open_ids else "  (closed)"
            when = time.strftime("%H:%M" if heading == GROUPS[0] else "%Y-%m-%d %H:%M",
                                 time.localtime(conversation["updated_at"]))
            item = QListWidgetItem(f"{conversation['title']}{mark}\n{when}")
            item.setData(Qt.UserRole, (conversation["id"], None))
            item.setToolTip("Click to open; right-click to rename or delete")
            self.conversation_list.addItem(item)
            if conversation["id"] == current:
                font = item.font()
                font.setBold(True)
                item.setFont(font)
                self.conversation_list.setCurrentItem(item)

    def _heading(self, text: str) -> QListWidgetItem:
        item = QListWidgetItem(text)
        item.setFlags(Qt.NoItemFlags)  # not selectable, not clickable: a label between the conversations
        item.setData(Qt.UserRole, None)
        item.setData(Qt.AccessibleTextRole, f"{text}:")
        font = item.font()  # small capitals, not bold: bold marks the conversation on screen
        font.setCapitalization(font.Capitalization.SmallCaps)
        item.setFont(font)
        item.setForeground(self.palette().placeholderText())
        return item

    def on_item_activated(self, item: QListWidgetItem) -> None:
        target = item.data(Qt.UserRole)
        if target is None:  # a date heading
            return
        conversation_id, message_id = target
        self.open_conversation(conversation_id, message_id)

    def context_menu_for(self, item: QListWidgetItem | None) -> QMenu | None:
        """The menu a right click on `item` opens (Open, Rename…, Delete…), or None for a heading or no item."""
        target = item.data(Qt.UserRole) if item is not None else None
        if target is None:
            return None
        conversation_id = target[0]
        menu = QMenu(self)
        menu.addAction("Open", lambda: self.open_conversation(conversation_id, target[1]))
        if self.rename_conversation is not None:
            menu.addAction("Rename…", lambda: self.rename_conversation(conversation_id))
        if self.delete_conversation is not None:
            menu.addAction("Delete…", lambda: self.delete_conversation(conversation_id))
        return menu

    def on_list_context_menu_requested(self, at: QPoint) -> None:
        menu = self.context_menu_for(self.conversation_list.itemAt(at))
        if menu is not None:
            menu.exec(self.conversation_list.viewport().mapToGlobal(at))

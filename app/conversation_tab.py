"""One conversation tab: chat view, composer, documents bar; sends requests through the EngineClient.

Everything the user has seen is in SQLite: the user message before the request is queued, the answer as a
"streaming" row written each time its widget renders new text (renders are throttled to RENDER_INTERVAL_MS)
and at the end, so killing the app mid-answer loses nothing that was on screen.

Over 400 lines on purpose: the documents bar (its files read by app.document_ingest, their KV pre-warmed) and the
chat (the running request) share one conversation id, database and engine client, and they meet where a question
is sent (its prompt is built from the documents attached so far); split apart, each would reach into the other.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from . import document_worker, rag
from .answers import CANCELLED, INTERRUPTED, Answer, ChatRequest, WarmReport, WarmRequest
from .chat_view import ChatView
from .db import DatabaseError
from .document_ingest import Ingest

log = logging.getLogger(__name__)


class Composer(QPlainTextEdit):
    """Enter sends, Shift+Enter inserts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key_Return, Qt.Key_Enter) and not event.modifiers() & Qt.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class ConversationTab(QWidget):
    error_raised = Signal(str)  # one error path: the main window's banner
    title_changed = Signal(str)  # the conversation took its title from its first question
    generation_state_changed = Signal(bool)
    warm_progressed = Signal(int, int)  # this tab's pre-warm: texts done, texts in all
    warm_ended = Signal(object)  # this tab's pre-warm ended: its WarmReport, None when it failed

    def __init__(self, conversation: dict, db, client, theme: str, parent=None):
        super().__init__(parent)
        self.conversation_id = conversation["id"]
        self.db = db
        self.client = client
        self.request: ChatRequest | None = None  # the answer being made
        self._answer_id: int | None = None
        self._stopped_text: str | None = None  # the answer as shown when the user pressed Stop
        self._save_failed = False  # a write of the current answer failed and was reported
        self.warm_request: WarmRequest | None = None
        self._ingest_task: asyncio.Task | None = None
        self._ingest: Ingest | None = None  # the drop being read (app.document_ingest)
        self.extraction_limits = document_worker.ExtractionLimits()
        self._pending_sources: list[dict] = []
        self.setAcceptDrops(True)

        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        docs_row = QHBoxLayout()
        self.docs_label = QLabel()
        self.docs_label.setObjectName("documentsLabel")
        self.docs_label.setTextFormat(Qt.RichText)
        self.docs_label.linkActivated.connect(self.on_docs_label_link_activated)
        self.docs_label.setWordWrap(True)
        docs_row.addWidget(self.docs_label, 1)
        self.progress = QProgressBar()
        self.progress.setObjectName("documentsProgress")
        self.progress.setMaximumWidth(220)
        self.progress.hide()
        docs_row.addWidget(self.progress)
        self.cancel_docs_button = QPushButton("Cancel")
        self.cancel_docs_button.hide()
        self.cancel_docs_button.clicked.connect(self.on_cancel_docs_button_clicked)
        docs_row.addWidget(self.cancel_docs_button)
        self.add_docs_button = QPushButton("Add documents…")
        self.add_docs_button.setToolTip("Add files or drop them (and folders) on the conversation")
        self.add_docs_button.clicked.connect(self.on_add_docs_button_clicked)
        docs_row.addWidget(self.add_docs_button)
        layout.addLayout(docs_row)

        self.chat_view = ChatView(theme, choose_starter=lambda text: (self.composer.setPlainText(text), self.send()))
        self.chat_view.edit_requested.connect(self.on_chat_view_edit_requested)
        self.chat_view.regenerate_requested.connect(self.on_chat_view_regenerate_requested)
        layout.addWidget(self.chat_view, 1)

        self.reason_label = QLabel()
        self.reason_label.setObjectName("disabledReason")
        layout.addWidget(self.reason_label)
        row = QHBoxLayout()
        self.composer = Composer()
        self.composer.setPlaceholderText("Message (Enter sends, Shift+Enter new line)")
        self.composer.setAccessibleName("Message")
        self.composer.setMaximumHeight(110)
        self.composer.submitted.connect(self.send)
        row.addWidget(self.composer, 1)
        self.send_button = QPushButton("Send")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setToolTip("Stop the answer (Esc)")
        self.stop_button.clicked.connect(self.stop)
        self.stop_button.hide()
        row.addWidget(self.send_button)
        row.addWidget(self.stop_button)
        layout.addLayout(row)

        for message in db.messages(self.conversation_id):
            self.chat_view.add_message(message)
        self.refresh_documents()
        self.update_composer()

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def is_generating(self) -> bool:
        return self.request is not None

    def update_composer(self) -> None:
        reason = ""
        if not self.client.is_loaded:
            reason = "The model is loading; you can read and type, sending starts when it is ready."
        elif self.is_generating:
            reason = ""
        self.reason_label.setText(reason)
        self.reason_label.setVisible(bool(reason))
        self.chat_view.empty_state.set_model_name((self.client.model_info or {}).get("name"))
        can_send = self.client.is_loaded and not self.is_generating
        self.send_button.setEnabled(can_send)
        self.send_button.setVisible(not self.is_generating)
        self.stop_button.setVisible(self.is_generating)

    def set_theme(self, theme: str) -> None:
        self.chat_view.set_theme(theme)

    # -- sending -------------------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.composer.toPlainText().strip()
        if not text or not self.client.is_loaded or self.is_generating:
            return
        self.composer.clear()
        try:
            user = self.db.add_message(self.conversation_id, "user", text)
        except DatabaseError as exc:  # locked past the timeout, disk full, read-only: nothing was sent
            self.composer.setPlainText(text)
            self.error_raised.emit(f"Your message was not sent: it could not be saved ({exc})")
            return
        self.chat_view.add_message(user)
        self._ask(user)

    def _title_from(self, question: str) -> None:
        """A conversation still called by the default name takes its first question's opening words (a rename
        replaces them; a renamed conversation keeps its name)."""
        try:
            title = self.db.title_if_untitled(self.conversation_id, question)
        except DatabaseError:  # the answer matters more; the default title stays
            return
        if title is not None:
            self.title_changed.emit(title)

    def _ask(self, user: dict) -> None:
        """Requests an answer to `user` (already stored, last message) from the history before it."""
        self._title_from(user["content"])
        layout = rag.prompt_for(self.db, self.conversation_id, user["content"], max_context=self._max_context(),
                                before_position=user["position"])
        try:
            if layout.user_prompt != user["content"]:
                self.db.update_message(user["id"], prompt=layout.user_prompt)
            answer = self.db.add_message(self.conversation_id, "assistant", "", status="streaming",
                                         sources=layout.sources or None)
        except DatabaseError as exc:  # no answer row to write into: no answer is asked for
            self.error_raised.emit(f"No answer was asked for: the conversation could not be saved ({exc}); "
                                   "Regenerate tries again")
            return
        self._answer_id = answer["id"]
        self._save_failed = False
        widget = self.chat_view.add_message(answer)
        widget.set_sources(layout.sources)
        widget.rendered.connect(self.on_answer_rendered)
        self.request = self.client.chat(layout.messages, self.db.conversation(self.conversation_id)["sampling"])
        self.request.prompt_read.connect(self.on_prompt_read)
        self.request.token.connect(self.on_token)
        self.request.finished.connect(self.on_answer_finished)
        self.request.failed.connect(self.on_answer_failed)
        self.generation_state_changed.emit(True)
        self.update_composer()

    def _model_name(self) -> str | None:
        """The name of the model answering now (a file's or folder's name, or a remote server's model)."""
        info = self.client.model_info or {}
        name = info.get("name")
        if not name:
            return None
        return name if info.get("remote") else Path(name).name  # a server's model id is kept whole (org/name)

    def _max_context(self) -> int:
        return (self.client.model_info or {}).get("max_context", 8192)

    def stop(self) -> None:
        """Stops the answer where it is on screen: the engine stops at its next token, and whatever it made
        between this moment and that one is neither shown nor saved (Stop means the text stops now)."""
        if self.request is None:
            return
        self.request.cancel()
        widget = self.chat_view.widget_for(self._answer_id) if self._answer_id is not None else None
        if widget is not None and self._stopped_text is None:
            self._stopped_text = widget.text
            widget.set_text(self._stopped_text)  # what had arrived, rendered now rather than at the next tick

    def on_prompt_read(self, done: int, total: int) -> None:
        widget = self.chat_view.widget_for(self._answer_id) if self._answer_id is not None else None
        if widget is not None and self._stopped_text is None:
            widget.show_prompt_read(done, total)

    def on_token(self, text: str) -> None:
        if self._stopped_text is not None:
            return
        self.chat_view.widget_for(self._answer_id).append_text(text)

    def on_answer_rendered(self, text: str) -> None:
        if self._answer_id is not None:
            self._save(self._answer_id, content=text)

    def _save(self, message_id: int, **fields) -> bool:
        """Writes an answer's fields; a failed write is reported once per answer (the next render and the
        end of the answer write the whole text again)."""
        try:
            self.db.update_message(message_id, **fields)
            return True
        except DatabaseError as exc:
            if not self._save_failed:
                self._save_failed = True
                self.error_raised.emit(f"The answer is shown but could not be saved yet ({exc}); "
                                       "it is written again as it goes on")
            return False

    def on_answer_finished(self, answer: Answer) -> None:
        widget = self.chat_view.widget_for(self._answer_id)
        # "interrupted": a remote server's answer broke off (app.remote_provider); the text so far is kept
        status = answer.finish_reason if answer.finish_reason in (CANCELLED, INTERRUPTED) else "done"
        # The engine's text is the whole answer (the widget may still hold a throttled partial render), unless the
        # user stopped it: then the answer is what was on screen at that moment.
        text = answer.text
        if self._stopped_text is not None and text != self._stopped_text:
            text, status = self._stopped_text, CANCELLED
        finish_reason = CANCELLED if status == CANCELLED else answer.finish_reason
        stats = dict(answer.stats or {}, segments=answer.segments, saved_ms=answer.saved_ms,
                     finish_reason=finish_reason, model=self._model_name())
        self._save_failed = False  # the final write is reported whatever happened before
        self._save(self._answer_id, content=text, status=status, stats=stats if answer.stats else None)
        widget.set_text(text)
        widget.message["status"] = status
        if answer.stats:
            widget.set_answer(dict(answer.to_dict(), text=text, finish_reason=finish_reason))
        self._finish_request()
        if answer.error:
            self.error_raised.emit(answer.error)

    def on_answer_failed(self, message: str) -> None:
        widget = self.chat_view.widget_for(self._answer_id)
        self._save(self._answer_id, content=widget.text, status="error")
        widget.set_status("error")
        self._finish_request()
        self.error_raised.emit(f"The answer failed: {message}")

    def _finish_request(self) -> None:
        widget = self.chat_view.widget_for(self._answer_id)
        if widget is not None:
            widget.rendered.disconnect(self.on_answer_rendered)
        self.request = None
        self._answer_id = None
        self._stopped_text = None
        self.generation_state_changed.emit(False)
        self.update_composer()

    # -- regenerate / edit ---------------------------------------------------------------------------------
    def on_chat_view_regenerate_requested(self, message_id: int) -> None:
        if self.is_generating or not self.client.is_loaded:
            return
        answer = self.db.message(message_id)
        users = [m for m in self.db.messages(self.conversation_id)
                 if m["role"] == "user" and m["position"] < answer["position"]]
        if not users:
            return
        self.db.delete_messages_from(self.conversation_id, answer["position"])
        self.chat_view.remove_from(message_id)
        self._ask(users[-1])

    def on_chat_view_edit_requested(self, message_id: int) -> None:
        if self.is_generating:
            return
        message = self.db.message(message_id)
        text, ok = QInputDialog.getMultiLineText(self, "Edit message", "Send this instead:", message["content"])
        if ok and text.strip():
            self.resend_edited(message_id, text.strip())

    def resend_edited(self, message_id: int, text: str) -> None:
        """Replaces a user message (and drops everything after it), then asks again."""
        if self.is_generating or not self.client.is_loaded:
            return
        message = self.db.message(message_id)
        self.db.delete_messages_from(self.conversation_id, message["position"])
        self.chat_view.remove_from(message_id)
        user = self.db.add_message(self.conversation_id, "user", text)
        self.chat_view.add_message(user)
        self._ask(user)

    # -- documents -----------------------------------------------------------------------------------------
    def refresh_documents(self) -> None:
        docs = self.db.conversation_documents(self.conversation_id)
        if not docs:
            self.docs_label.setText("<i>No documents. Drop files or folders here to chat about them.</i>")
            return
        mode = rag.choose_mode(docs, self._max_context())
        how = ("whole documents in every prompt" if mode == "pinned"
               else "top passages per question (documents exceed a quarter of the context)")
        chips = " · ".join(f'{d["name"]} <a href="remove:{d["id"]}">✕</a>' for d in docs)
        self.docs_label.setText(f"<b>Documents</b> ({how}): {chips}")

    def on_docs_label_link_activated(self, link: str) -> None:
        if link.startswith("remove:"):
            self.db.detach_document(self.conversation_id, int(link.split(":", 1)[1]))
            self.refresh_documents()
            self.prewarm()

    def on_add_docs_button_clicked(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Add documents")
        if paths:
            self.add_paths(paths)

    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        paths = [u.toLocalFile() for u in event.mimeData().urls() if u.isLocalFile()]
        if paths:
            event.acceptProposedAction()
            self.add_paths(paths)

    def add_paths(self, paths: list[str]) -> asyncio.Task:
        """Indexes files/folders off the UI thread, attaches them, then pre-warms their KV."""
        self._ingest_task = asyncio.ensure_future(self.ingest(paths))
        return self._ingest_task

    async def ingest(self, paths: list[str]) -> dict:
        """Indexes and attaches `paths` (app.document_ingest) with its progress shown; reports what could not be
        added; pre-warms when something was."""
        self._ingest = Ingest(self.db, self.conversation_id, self.extraction_limits)
        report = await self._ingest.run(
            paths, lambda n: self._show_progress(f"Indexing %v of {n} file(s)", n), self.progress.setValue)
        self._hide_progress()
        self.refresh_documents()
        problems = report["problems"]
        if problems:
            shown = problems[:6] + ([f"and {len(problems) - 6} more (see the log)"] if len(problems) > 6 else [])
            log.warning("files not added: %s", problems)
            self.error_raised.emit("Some files were not added: " + "; ".join(shown))
        if report["added"]:
            self.prewarm()
        return report

    def prewarm(self) -> WarmRequest | None:
        """Pre-fills the documents' KV the way the next prompt will use it (see app/rag.py)."""
        if not self.client.is_loaded:
            return None
        if self.warm_request is not None:
            self.warm_request.cancel()
        inputs = rag.warm_for(self.db, self.conversation_id, max_context=self._max_context(),
                              approximate=self.client.model_info["reuse"] == "approx")
        if not inputs:
            self.warm_request = None
            return None
        self.warm_request = request = self.client.warm(inputs)
        # bound methods: Qt disconnects them when the tab goes; the handle that reports is sender()
        request.progressed.connect(self._warm_progressed)
        request.finished.connect(self._warm_finished)
        request.failed.connect(self._warm_failed)
        self._show_progress(f"Pre-warming documents: %v/{len(inputs)}", len(inputs))
        return request

    def _current_warm(self) -> bool:
        """Whether the signal being handled comes from this tab's current pre-warm (not one it replaced)."""
        return self.warm_request is not None and self.sender() is self.warm_request

    def _warm_progressed(self, done: int, total: int) -> None:
        if self._current_warm():
            self.progress.setValue(done)
            self.warm_progressed.emit(done, total)

    def _warm_finished(self, report: WarmReport) -> None:
        if self._current_warm():
            self._warm_ended(report)

    def _warm_failed(self, message: str) -> None:
        if self._current_warm():
            self._warm_ended(None, message)

    def _warm_ended(self, report: WarmReport | None, failure: str | None = None) -> None:
        self.warm_request = None
        self._hide_progress()
        if failure is not None:
            self.error_raised.emit(f"Pre-warming the documents failed: {failure}")
        self.warm_ended.emit(report)

    def on_cancel_docs_button_clicked(self) -> None:
        if self.warm_request is not None:
            self.warm_request.cancel()
        if self._ingest_task is not None and not self._ingest_task.done():
            self._ingest.cancel_reading()
            self._ingest_task.cancel()
            self._hide_progress()

    def _show_progress(self, fmt: str, total: int) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(0)
        self.progress.setFormat(fmt)
        self.progress.show()
        self.cancel_docs_button.show()

    def _hide_progress(self) -> None:
        self.progress.hide()
        self.cancel_docs_button.hide()

    def close_down(self) -> None:
        """The tab is closing (or the app quitting): stop its work and save the answer being written as it is on
        screen, marked interrupted (the event loop may not turn again to receive its end)."""
        if self._answer_id is not None and self.request is not None:
            widget = self.chat_view.widget_for(self._answer_id)
            if widget is not None:
                self._save(self._answer_id, content=widget.text, status="interrupted")
        self.stop()
        if self.warm_request is not None:
            self.warm_request.cancel()
        if self._ingest_task is not None and not self._ingest_task.done():
            # Set at once, not when the task next runs: the app may be quitting and its loop never turn again.
            self._ingest.cancel_reading()
            self._ingest_task.cancel()

"""The message list of one conversation: Markdown turns (code blocks highlighted, each with a Copy link:
app.markdown_view), streaming, a quiet stats line with its details on hover, sources, the cache map, and a "Jump to
latest" button while the user reads further up.

Over 400 lines: a message widget and the list that streams into it share the rendering throttle, the stats line and
the cache map; Markdown is rendered elsewhere (app.markdown_view)."""

from __future__ import annotations

import html
import time
from typing import Callable

from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QGuiApplication, QTextOption
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from . import markdown_view
from .elided_label import ElidedLabel
from .empty_state import EmptyState
from .theme import KIND_COLORS

RENDER_INTERVAL_MS = 60  # re-render streaming Markdown at most this often (a full re-layout per token is slow)
# and with at most this share of the UI thread's time: a render (and the save before it) grows with the answer, and
# the engine decodes on the same cores
RENDER_SHARE = 0.1
KINDS = ("EXACT", "PREFIX", "QUANTIZED", "APPROXIMATE", "MISS")


def badge_text(stats: dict | None, finish_reason: str | None = None) -> str:
    """An answer's one quiet line, in a user's words: speed, time to the first token, how much came from the cache,
    and why it ended where that was not the answer's own end (details: badge_details)."""
    if not stats:
        return ""
    prompt = stats.get("prompt_tokens") or 0
    share = 100.0 * stats.get("reused_tokens", 0) / prompt if prompt else 0.0
    parts = []
    if stats.get("remote"):  # app.remote_provider: our own kvboost-server reports its reuse, others nothing
        parts.append(f"remote {stats.get('model', '')}")
    if stats.get("decode_tokens_per_s"):
        parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
    parts.append(f"first token in {stats.get('ttft_ms', 0):.0f} ms")
    if not stats.get("remote") or stats.get("kvboost"):
        parts.append(f"{share:.0f}% from cache" + (" there" if stats.get("remote") else ""))
    ending = {"cancelled": "stopped", "length": "hit max tokens", "interrupted": "interrupted"}.get(finish_reason)
    return " · ".join(parts + ([ending] if ending else []))


def badge_details(stats: dict | None) -> str:
    """The stats line's tooltip: the numbers behind it, with the engine's words."""
    if not stats:
        return ""
    lines = [f"Prompt: {stats.get('prompt_tokens') or 0} tokens, {stats.get('reused_tokens', 0)} reused from the KV "
             f"cache (reuse mode {stats.get('reuse', '?')}), {stats.get('recomputed_tokens', 0)} computed"]
    if stats.get("generated_tokens"):
        lines.append(f"Answer: {stats['generated_tokens']} tokens at {stats.get('decode_tokens_per_s') or 0:.1f} "
                     f"tok/s; first token after {stats.get('ttft_ms', 0):.0f} ms")
    if stats.get("drafted_tokens"):
        kept = 100.0 * stats.get("accepted_tokens", 0) / stats["drafted_tokens"]
        lines.append(f"Speculative decoding: {stats['drafted_tokens']} tokens drafted, {kept:.0f}% kept")
    tiers = stats.get("reused_by_tier") or {}
    if tiers:
        lines.append("Reused from: " + ", ".join(f"{tier} {n}" for tier, n in tiers.items()))
    return "\n".join(lines)


def remote_cache_html(stats: dict) -> str:
    """What a remote server reported about its cache: kvboost-server's statistics, or that there are none."""
    kv = stats.get("kvboost")
    where = html.escape(str(stats.get("base_url", "the remote server")))
    if not kv:
        return (f"<p>The answer came from {where}, which reports no cache statistics (a kvboost-server does). "
                f"Prompt tokens: {stats.get('prompt_tokens') or '?'}.</p>")
    kinds = ", ".join(f"{html.escape(k)} {n}" for k, n in (kv.get("tokens_by_kind") or {}).items())
    tiers = ", ".join(f"{html.escape(k)} {n}" for k, n in (kv.get("reused_by_tier") or {}).items())
    return (f"<p><b>{where} reused {kv.get('reused_tokens', 0)} of {kv.get('prompt_tokens', 0)} prompt tokens</b>"
            f" (reuse mode {html.escape(str(kv.get('reuse', '?')))}); server-side TTFT {kv.get('ttft_ms', 0):.0f} ms,"
            f" {kv.get('queue_ms', 0):.0f} ms queued.</p><p>Tokens by kind: {kinds or 'none'}. "
            f"Reused by tier: {tiers or 'none'}.</p>")


def cache_map_html(answer: dict, theme: str) -> str:
    """The prompt as sent, each engine segment coloured by how its KV was obtained, and a summary line."""
    colors = KIND_COLORS[theme]
    stats = answer.get("stats") or {}
    if stats.get("remote"):
        return remote_cache_html(stats)
    prompt = stats.get("prompt_tokens") or 0
    reused = stats.get("reused_tokens", 0)
    counts = {k: 0 for k in KINDS}
    for seg in answer.get("segments", []):
        counts[seg["kind"]] = counts.get(seg["kind"], 0) + seg["end"] - seg["start"]
    legend = " ".join(
        f'<span style="background:{colors[k]}">&nbsp;{k} {counts[k]}&nbsp;</span>' for k in KINDS if counts[k]
    )
    saved = answer.get("saved_ms")
    saved_text = (f"≈{saved:.0f} ms saved vs full prefill (estimate from this model's measured prefill rate)"
                  if saved is not None else "time saved not estimated yet (no prefill measured on this model)")
    tiers = stats.get("reused_by_tier") or {}
    from_disk = f", {tiers['disk']} from the disk cache" if tiers.get("disk") else ""
    if tiers.get("remote"):
        from_disk += f", {tiers['remote']} from the shared cache"
    summary = (f"<b>{reused} of {prompt} prompt tokens reused</b> "
               f"({100.0 * reused / prompt if prompt else 0:.0f}%{from_disk}), TTFT {stats.get('ttft_ms', 0):.0f} ms, "
               f"{saved_text}. Reuse mode: {html.escape(str(stats.get('reuse', '?')))}.")
    body = "".join(
        f'<span style="background:{colors.get(seg["kind"], "transparent")}" '
        f'title="{seg["kind"]} tokens {seg["start"]}-{seg["end"]}">'
        f"{html.escape(seg['text'])}</span>"
        for seg in answer.get("segments", [])
    )
    return (f"<p>{summary}</p><p>{legend}</p>"
            f'<pre style="white-space: pre-wrap; font-size: small">{body}</pre>')


class _AutoHeightBrowser(QTextBrowser):
    """A QTextBrowser as tall as its content, so the surrounding scroll area does the scrolling."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setOpenLinks(False)  # links are the owner's: anchorClicked
        self.setVerticalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAsNeeded)
        self.setFrameShape(QFrame.NoFrame)
        self.setWordWrapMode(QTextOption.WrapAtWordBoundaryOrAnywhere)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)

    def _fit(self, *_):
        self.setFixedHeight(int(self.document().size().height()) + 6)

    def resizeEvent(self, event):
        super().resizeEvent(event)
        self.document().setTextWidth(self.viewport().width())
        self._fit()


class MessageWidget(QFrame):
    edit_requested = Signal(int)  # message id
    regenerate_requested = Signal(int)
    rendered = Signal(str)  # the text now on screen (saved by the tab, so what was shown survives a kill)

    def __init__(self, message: dict, theme: str, parent=None):
        super().__init__(parent)
        self.message = dict(message)
        self.theme = theme
        self.setObjectName("userMessage" if message["role"] == "user" else "assistantMessage")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 6)
        header = QHBoxLayout()
        self.role_label = QLabel("You" if message["role"] == "user" else "Assistant")
        self.role_label.setStyleSheet("font-weight: bold")
        header.addWidget(self.role_label)
        header.addStretch(1)
        self.badge = ElidedLabel()  # cut with "…" in a narrow window rather than pushing the buttons out of it
        self.badge.setObjectName("badge")
        header.addWidget(self.badge)
        self.map_button = self._tool_button("Cache map", "Show which parts of the prompt came from cache")
        self.map_button.setCheckable(True)
        self.map_button.toggled.connect(self.on_map_button_toggled)
        self.copy_button = self._tool_button("Copy", "Copy this message")
        self.copy_button.clicked.connect(self.on_copy_button_clicked)
        self.edit_button = self._tool_button("Edit", "Edit this message and send it again")
        self.edit_button.clicked.connect(lambda: self.edit_requested.emit(self.message["id"]))
        self.regenerate_button = self._tool_button("Regenerate", "Answer this again")
        self.regenerate_button.clicked.connect(lambda: self.regenerate_requested.emit(self.message["id"]))
        for button in (self.map_button, self.copy_button, self.edit_button, self.regenerate_button):
            header.addWidget(button)
        layout.addLayout(header)
        self.body = _AutoHeightBrowser()
        self.body.setAccessibleName("Your message" if message["role"] == "user" else "Answer")
        self.body.anchorClicked.connect(self.on_link_clicked)
        self.code_blocks: list[str] = []  # what each code block's Copy link copies
        layout.addWidget(self.body)
        self.sources_row = QHBoxLayout()
        layout.addLayout(self.sources_row)
        self.cache_map = QTextBrowser()
        self.cache_map.setObjectName("cacheMap")
        self.cache_map.setAccessibleName("Cache map")
        self.cache_map.setMinimumHeight(220)
        self.cache_map.hide()
        layout.addWidget(self.cache_map)
        self._text = message.get("content") or ""
        self._render_timer = QTimer(self, singleShot=True, interval=RENDER_INTERVAL_MS)
        self._render_timer.timeout.connect(self._render)
        self._answer: dict | None = None
        self._reading = False  # the badge says how much of the prompt has been read (show_prompt_read)
        is_user = message["role"] == "user"
        self.edit_button.setVisible(is_user)
        self.regenerate_button.setVisible(not is_user)
        self.map_button.setVisible(False)
        self._render()
        if message.get("stats"):
            self.set_answer({"stats": message["stats"], "segments": message["stats"].get("segments", []),
                             "saved_ms": message["stats"].get("saved_ms"),
                             "finish_reason": message["stats"].get("finish_reason")})
        if message.get("sources"):
            self.set_sources(message["sources"])
        self._show_status(message.get("status", "done"))

    def _tool_button(self, text: str, tip: str) -> QPushButton:
        button = QPushButton(text)
        button.setFlat(True)
        button.setToolTip(tip)
        button.setCursor(Qt.PointingHandCursor)
        return button

    # -- content -----------------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        return self._text

    def show_prompt_read(self, done: int, total: int) -> None:
        """Before the first token of a long prompt's answer: how much of the prompt the model has read."""
        self._reading = True
        self.badge.setText(f"reading the prompt: {done:,} of {total:,} tokens ({100 * done // max(total, 1)}%)")

    def _done_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.badge.setText("")

    def append_text(self, delta: str) -> None:
        self._done_reading()
        self._text += delta
        if not self._render_timer.isActive():
            self._render_timer.start()

    def set_text(self, text: str) -> None:
        self._done_reading()
        self._text = text
        self._render()

    def _render(self) -> None:
        began = time.perf_counter()
        self.rendered.emit(self._text)
        self._show()
        spent_ms = (time.perf_counter() - began) * 1000
        self._render_timer.setInterval(max(RENDER_INTERVAL_MS, round(spent_ms / RENDER_SHARE)))

    def _show(self) -> None:
        if self.message["role"] == "user":
            self.body.setPlainText(self._text)
        else:
            page, self.code_blocks = markdown_view.render(self._text or "…", self.theme)
            self.body.setHtml(page)
        self.shown_text = self._text

    def set_status(self, status: str) -> None:
        self._done_reading()
        self.message["status"] = status
        self._render()
        self._show_status(status)

    def _show_status(self, status: str) -> None:
        notes = {"interrupted": "interrupted (the app closed while answering)", "cancelled": "stopped",
                 "error": "failed"}
        if status in notes and not self.badge.text():
            self.badge.setText(notes[status])

    def set_answer(self, answer: dict) -> None:
        """Stats, segments and the time-saved estimate of a finished answer."""
        self._reading = False
        self._answer = answer
        self.badge.setText(badge_text(answer.get("stats"), answer.get("finish_reason")))
        self.badge.setToolTip(badge_details(answer.get("stats")))
        self.map_button.setVisible(bool(answer.get("segments")) or bool((answer.get("stats") or {}).get("remote")))
        if self.map_button.isChecked():
            self.cache_map.setHtml(cache_map_html(answer, self.theme))

    def set_sources(self, sources: list[dict]) -> None:
        while self.sources_row.count():
            item = self.sources_row.takeAt(0)
            if item.widget():
                item.widget().deleteLater()
        if not sources:
            return
        self.sources_row.addWidget(QLabel("Sources:"))
        for source in sources:
            where = f" p.{source['page']}" if source.get("page") else ""
            button = QPushButton(f"{source['name']}{where}")
            button.setObjectName("sourceButton")
            button.setFlat(True)
            button.setCursor(Qt.PointingHandCursor)
            button.setToolTip(source.get("text", "")[:600])
            path = source.get("path")
            button.clicked.connect(lambda _=False, p=path: p and QDesktopServices.openUrl(QUrl.fromLocalFile(p)))
            self.sources_row.addWidget(button)
        self.sources_row.addStretch(1)

    def set_theme(self, theme: str) -> None:
        self.theme = theme
        if self.message["role"] != "user":
            self._show()  # the code blocks' colours
        if self._answer and self.map_button.isChecked():
            self.cache_map.setHtml(cache_map_html(self._answer, theme))

    # -- slots -------------------------------------------------------------------------------------------
    def on_map_button_toggled(self, checked: bool) -> None:
        if checked and self._answer:
            self.cache_map.setHtml(cache_map_html(self._answer, self.theme))
        self.cache_map.setVisible(checked)

    def on_copy_button_clicked(self) -> None:
        QGuiApplication.clipboard().setText(self._text)

    def on_link_clicked(self, url: QUrl) -> None:
        """A code block's Copy link copies that block; a web or mail link opens outside the app; nothing else."""
        scheme = url.scheme().lower()
        if scheme == markdown_view.COPY_SCHEME:
            index = url.path()
            if index.isdigit() and int(index) < len(self.code_blocks):
                QGuiApplication.clipboard().setText(self.code_blocks[int(index)])
        elif scheme in markdown_view.OPEN_SCHEMES:
            QDesktopServices.openUrl(url)


class ChatView(QScrollArea):
    """Messages top to bottom; follows the end while streaming unless the user scrolled up, and then offers a
    "Jump to latest" button over the bottom right corner."""

    edit_requested = Signal(int)
    regenerate_requested = Signal(int)

    def __init__(self, theme: str, parent=None, choose_starter: Callable[[str], object] | None = None):
        super().__init__(parent)
        self.theme = theme
        self.setWidgetResizable(True)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setAccessibleName("Messages")
        inner = QWidget()
        self._layout = QVBoxLayout(inner)
        self._layout.setSpacing(8)
        self.empty_state = EmptyState(choose_starter)  # shown while there are no messages
        self._layout.addWidget(self.empty_state, 0, Qt.AlignHCenter)
        self._layout.addStretch(1)
        self.setWidget(inner)
        self.widgets: list[MessageWidget] = []
        self.verticalScrollBar().rangeChanged.connect(self._follow_end)
        self._at_end = True
        self.verticalScrollBar().valueChanged.connect(self._scrolled)
        self.jump_button = QPushButton("↓ Jump to latest", self.viewport())
        self.jump_button.setObjectName("jumpToLatest")
        self.jump_button.setToolTip("Scroll to the newest message and follow the answer again")
        self.jump_button.setCursor(Qt.PointingHandCursor)
        self.jump_button.clicked.connect(self.jump_to_latest)
        self.jump_button.hide()

    def _scrolled(self, value: int) -> None:
        self._at_end = value >= self.verticalScrollBar().maximum() - 8
        self._update_jump()

    def _follow_end(self, _min, maximum):
        if self._at_end:
            self.verticalScrollBar().setValue(maximum)
        self._update_jump()

    def _update_jump(self) -> None:
        show = not self._at_end and self.verticalScrollBar().maximum() > 0
        if show:
            self._place_jump()
        self.jump_button.setVisible(show)

    def _place_jump(self) -> None:
        self.jump_button.adjustSize()
        room = self.viewport().rect()
        self.jump_button.move(room.right() - self.jump_button.width() - 16,
                              room.bottom() - self.jump_button.height() - 12)

    def resizeEvent(self, event):
        super().resizeEvent(event)
        self._place_jump()

    def jump_to_latest(self) -> None:
        self._at_end = True
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())
        self.jump_button.hide()

    def clear(self) -> None:
        for widget in self.widgets:
            widget.deleteLater()
        self.widgets = []
        self.empty_state.show()

    def add_message(self, message: dict) -> MessageWidget:
        widget = MessageWidget(message, self.theme)
        widget.edit_requested.connect(self.edit_requested)
        widget.regenerate_requested.connect(self.regenerate_requested)
        self._layout.insertWidget(self._layout.count() - 1, widget)
        self.widgets.append(widget)
        self.empty_state.hide()
        self._at_end = True
        return widget

    def remove_from(self, message_id: int) -> None:
        """Drops the widget of `message_id` and everything after it."""
        ids = [w.message["id"] for w in self.widgets]
        if message_id not in ids:
            return
        index = ids.index(message_id)
        for widget in self.widgets[index:]:
            widget.deleteLater()
        self.widgets = self.widgets[:index]
        self.empty_state.setVisible(not self.widgets)

    def widget_for(self, message_id: int) -> MessageWidget | None:
        return next((w for w in self.widgets if w.message["id"] == message_id), None)

    def scroll_to(self, message_id: int) -> None:
        widget = self.widget_for(message_id)
        if widget is not None:
            self._at_end = False
            self.ensureWidgetVisible(widget)

    def set_theme(self, theme: str) -> None:
        self.theme = theme
        for widget in self.widgets:
            widget.set_theme(theme)

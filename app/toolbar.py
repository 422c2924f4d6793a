"""The main window's toolbar: New chat, the model picker (the built-in model and the recent ones, one click to switch,
each entry's weight format and size shown) and the context gauge (how much of the model's context the current
conversation takes, red before it overflows)."""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QLabel, QProgressBar, QToolBar, QWidget

from . import settings
from .model_menu import recent_label
from .settings import ModelChoice

WARN_SHARE = 0.85  # the gauge turns red from this share of the context on: the next answers may not fit
OTHER_MODEL = "Other model…"


class MainToolbar(QToolBar):
    def __init__(self, window):
        super().__init__("Main toolbar", window)
        self.window = window
        self.setObjectName("mainToolbar")
        self.setMovable(False)
        self.addAction(window.new_action)
        window.new_action.setIconText("New chat")
        self.addSeparator()
        label = QLabel(" Model: ")
        self.addWidget(label)
        self.model_picker = QComboBox()
        self.model_picker.setObjectName("modelPicker")
        self.model_picker.setAccessibleName("Model")
        self.model_picker.setToolTip("The model that answers: pick a recent one to switch to it")
        self.model_picker.setSizeAdjustPolicy(QComboBox.AdjustToContents)
        self.model_picker.activated.connect(self.on_model_picked)
        label.setBuddy(self.model_picker)
        self.addWidget(self.model_picker)
        spacer = QWidget()
        spacer.setMinimumWidth(12)
        self.addWidget(spacer)
        self.context_gauge = QProgressBar()
        self.context_gauge.setObjectName("contextGauge")
        self.context_gauge.setAccessibleName("Context used")
        self.context_gauge.setMaximumWidth(220)
        self.context_gauge.setTextVisible(True)
        self.addWidget(self.context_gauge)
        self.context_limit = 0
        self.fill_model_picker()
        self.show_context(0)

    # -- the model picker ------------------------------------------------------------------------------------
    def choices(self) -> list[ModelChoice]:
        """The picker's models: the one to load at start first, then the recent ones, the built-in model always."""
        saved = settings.load(self.window.db)
        out = [saved.model]
        for entry in (*saved.recent_models, ModelChoice()):
            if all((e.source, e.weights) != (entry.source, entry.weights) for e in out):
                out.append(entry)
        return out

    def fill_model_picker(self) -> None:
        picker = self.model_picker
        picker.blockSignals(True)
        picker.clear()
        for choice in self.choices():
            picker.addItem(recent_label(choice), dataclasses.asdict(choice))
            picker.setItemData(picker.count() - 1, str(choice.source or "the built-in model"), Qt.ToolTipRole)
        picker.addItem(OTHER_MODEL, None)
        picker.setCurrentIndex(0)
        picker.blockSignals(False)

    def on_model_picked(self, index: int) -> None:
        values = self.model_picker.itemData(index)
        if values is None:  # "Other model…": the full dialog
            self.fill_model_picker()
            self.window.choose_model()
            return
        if index == 0:
            return  # the current one
        self.window.model_menu.load(ModelChoice(**values))
        self.fill_model_picker()

    def show_loaded(self, info: dict) -> None:
        """After a load: the picker lists the model now loaded first, its memory in the tooltip."""
        self.fill_model_picker()
        weights = info.get("weights") or {}
        if weights:
            self.model_picker.setToolTip(f"{info.get('name', '')}: {weights['format']}, "
                                         f"{weights['resident_bytes'] / 2**20:.0f} MB of weights held")
        self.context_limit = int(info.get("max_context") or 0)

    # -- the context gauge -------------------------------------------------------------------------------------
    def follow(self, conversation_id: int | None) -> None:
        """The gauge for `conversation_id` (None: no conversation): its last answer's prompt and answer tokens."""
        used = 0
        if conversation_id is not None:
            for message in reversed(self.window.db.messages(conversation_id)):
                stats = message.get("stats") or {}
                if message["role"] == "assistant" and stats.get("prompt_tokens"):
                    used = int(stats["prompt_tokens"]) + int(stats.get("generated_tokens") or 0)
                    break
        self.show_context(used)

    def show_context(self, used: int) -> None:
        """`used` tokens of the current conversation (its last prompt and answer) against the model's context."""
        gauge, limit = self.context_gauge, self.context_limit
        if limit <= 0:
            gauge.setRange(0, 1)
            gauge.setValue(0)
            gauge.setFormat("context: no model")
            gauge.setToolTip("")
            return
        gauge.setRange(0, limit)
        gauge.setValue(min(used, limit))
        share = used / limit
        gauge.setFormat(f"{used:,} / {limit:,} tokens")
        warn = share >= WARN_SHARE
        gauge.setProperty("warning", warn)
        gauge.setStyleSheet("QProgressBar::chunk { background: #c62828; }" if warn else "")
        gauge.setToolTip(f"This conversation takes {100 * share:.0f}% of the model's context"
                         + (": start a new chat or shorten it before the next answers no longer fit" if warn else ""))

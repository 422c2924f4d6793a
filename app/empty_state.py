"""What a conversation without messages shows: which model will answer, what can be done here, and a few starter
prompts that send themselves on a click."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QGridLayout, QLabel, QPushButton, QVBoxLayout, QWidget

STARTERS = (
    ("Explain a concept", "Explain how a hash map works, with a short Python example."),
    ("Write something", "Write a short, polite email asking to move our meeting to Friday."),
    ("Ask about documents", "Summarize the documents I added in five bullet points."),
    ("Plan", "Give me a three-step plan to learn the basics of SQL in a week."),
)


def model_title(name: str | None) -> str:
    """The heading for a model's name or path (None: none loaded yet)."""
    if not name:
        return "Start a conversation"
    return f"Ask {Path(name).name} anything"


class EmptyState(QWidget):
    """The heading, one line of help and the starter buttons; `choose(prompt)` runs when one is clicked."""

    def __init__(self, choose: Callable[[str], object] | None = None, parent=None):
        super().__init__(parent)
        self.setObjectName("emptyState")
        self.setMaximumWidth(720)
        self.choose = choose
        layout = QVBoxLayout(self)
        layout.setContentsMargins(24, 48, 24, 24)
        layout.setSpacing(12)
        self.title = QLabel(model_title(None))
        self.title.setObjectName("emptyStateTitle")
        font = self.title.font()
        font.setPointSizeF(font.pointSizeF() * 1.5)
        font.setBold(True)
        self.title.setFont(font)
        self.title.setAlignment(Qt.AlignCenter)
        layout.addWidget(self.title)
        self.help = QLabel("Type a question below, or drop documents on the window to ask about them. Answers stay "
                           "on this computer.")
        self.help.setWordWrap(True)
        self.help.setAlignment(Qt.AlignCenter)
        layout.addWidget(self.help)
        grid = QGridLayout()
        grid.setSpacing(8)
        self.buttons: list[QPushButton] = []
        for i, (label, prompt) in enumerate(STARTERS):
            button = QPushButton("\n".join([label, *textwrap.wrap(prompt, 36)]))  # narrow windows: wrapped
            button.setObjectName("starterPrompt")
            button.setAccessibleName(f"Starter: {prompt}")
            button.setToolTip("Send this question")
            button.setCursor(Qt.PointingHandCursor)
            button.setMinimumHeight(56)
            button.clicked.connect(lambda _=False, text=prompt: self.choose and self.choose(text))
            grid.addWidget(button, i // 2, i % 2)
            self.buttons.append(button)
        layout.addLayout(grid)

    def set_model_name(self, name: str | None) -> None:
        self.title.setText(model_title(name))

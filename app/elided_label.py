"""A label that shows as much of its text as its width holds, ending in "…", instead of pushing its neighbours.

A plain QLabel asks for its whole text's width as its minimum, so in a status bar a long text overlaps the label
beside it or is cut mid-letter as the window narrows. This one asks for little (`MIN_CHARS` characters), paints its
text elided to the width it gets, and offers the whole text as its tooltip when it is cut.
"""

from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel, QSizePolicy

MIN_CHARS = 8


class ElidedLabel(QLabel):
    def __init__(self, text: str = "", parent=None):
        super().__init__(text, parent)
        self.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Preferred)
        self._tooltip = ""

    def setText(self, text: str) -> None:  # noqa: N802 (Qt's name)
        super().setText(text)
        super().setToolTip(self._combined_tooltip())

    def setToolTip(self, text: str) -> None:  # noqa: N802
        self._tooltip = text
        super().setToolTip(self._combined_tooltip())

    def minimumSizeHint(self) -> QSize:  # noqa: N802
        hint = super().minimumSizeHint()
        return QSize(min(hint.width(), self.fontMetrics().averageCharWidth() * MIN_CHARS), hint.height())

    def shown_text(self) -> str:
        """The text as painted at the current width."""
        return self.fontMetrics().elidedText(self.text(), Qt.ElideRight, self.contentsRect().width())

    def is_elided(self) -> bool:
        return self.shown_text() != self.text()

    def resizeEvent(self, event) -> None:  # noqa: N802
        super().resizeEvent(event)
        super().setToolTip(self._combined_tooltip())

    def _combined_tooltip(self) -> str:
        if not self.is_elided():
            return self._tooltip
        return self.text() if not self._tooltip else f"{self.text()}\n\n{self._tooltip}"

    def paintEvent(self, event) -> None:  # noqa: N802
        painter = QPainter(self)
        painter.setPen(self.palette().color(self.foregroundRole()))
        painter.drawText(self.contentsRect(), int(self.alignment() | Qt.AlignVCenter), self.shown_text())

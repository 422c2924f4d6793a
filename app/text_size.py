"""Text size: View > Larger text (Ctrl+= or Ctrl++), Smaller text (Ctrl+-), Normal size (Ctrl+0) scale every font
of the app in steps of 10% from the system's size, kept in the settings (app.settings, text_size)."""

from __future__ import annotations

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QApplication

from . import settings

STEP = 1.1


def point_size(base: float, steps: int) -> float:
    """The font size `steps` steps from `base`, clamped to the steps the settings allow."""
    steps = min(max(steps, settings.TEXT_SIZES[0]), settings.TEXT_SIZES[-1])
    return base * STEP ** steps


class TextSize:
    """The three actions, added to `menu`; the stored size applied at once; `changed` runs after each change (for
    views that set fonts of their own)."""

    def __init__(self, db, menu, changed=None):
        self.db, self.changed = db, changed
        app = QApplication.instance()
        self.base = app.property("kvboostBaseFontSize") or app.font().pointSizeF()
        app.setProperty("kvboostBaseFontSize", self.base)  # the system's size, whatever a window set since
        self.actions = []
        for text, keys, change in (("Larger text", (QKeySequence.ZoomIn, "Ctrl+="), 1),
                                   ("Smaller text", (QKeySequence.ZoomOut, "Ctrl+-"), -1),
                                   ("Normal text size", ("Ctrl+0",), None)):
            act = QAction(text, menu)
            act.setShortcuts([QKeySequence(k) for k in keys])
            act.triggered.connect(lambda _=False, c=change: self.change(c))
            menu.addAction(act)
            self.actions.append(act)
        self.steps = settings.load(db).text_size
        self.apply()

    def change(self, by: int | None) -> None:
        """One step larger (1) or smaller (-1), or back to the system's size (None); saved."""
        steps = 0 if by is None else self.steps + by
        self.steps = min(max(steps, settings.TEXT_SIZES[0]), settings.TEXT_SIZES[-1])
        settings.update(self.db, text_size=self.steps)
        self.apply()
        if self.changed is not None:
            self.changed()

    def apply(self) -> None:
        app = QApplication.instance()
        font = app.font()
        font.setPointSizeF(point_size(self.base, self.steps))
        app.setFont(font)
        app.setStyleSheet(app.styleSheet())  # styled widgets take the new font only when the sheet is applied again

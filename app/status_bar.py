"""The main window's status bar: the model line (and its load progress), the API address, and the memory meter.

Its labels elide (app.elided_label), so no part overlaps or cuts another as the window narrows; a line separates
the model from the memory meter, which stays at the right edge.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QLabel, QProgressBar, QStatusBar

from .elided_label import ElidedLabel
from .memory_meter import MemoryMeter


@dataclass
class StatusParts:
    model_label: ElidedLabel
    load_bar: QProgressBar
    api_label: QLabel
    separator: QFrame
    memory_meter: MemoryMeter


def fill_status_bar(bar: QStatusBar, client) -> StatusParts:
    """Adds the parts to `bar`, the memory meter reading `client`'s engine."""
    model_label = ElidedLabel("No model")
    model_label.setObjectName("modelLabel")
    load_bar = QProgressBar()
    load_bar.setRange(0, 0)  # busy until the loader reports steps (a GGUF's or AWQ's decoder layers)
    load_bar.setMaximumWidth(120)
    load_bar.hide()
    api_label = QLabel("")
    api_label.setObjectName("apiLabel")
    api_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
    api_label.hide()
    separator = QFrame()
    separator.setFrameShape(QFrame.VLine)
    separator.setFrameShadow(QFrame.Sunken)
    memory_meter = MemoryMeter(client)
    for part in (model_label, load_bar, api_label):
        bar.addWidget(part)
    bar.addPermanentWidget(separator)
    bar.addPermanentWidget(memory_meter)
    return StatusParts(model_label, load_bar, api_label, separator, memory_meter)

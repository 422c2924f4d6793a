"""The status bar at the widths people use, in both themes: its parts never overlap, never leave the bar, and never
show a word cut mid-letter; a text too long for the width ends in "…" with the whole of it in the tooltip, and at
1600 px everything shows whole."""

from __future__ import annotations

import os

import pytest
from PySide6.QtCore import QRect
from PySide6.QtWidgets import QApplication

# What the status bar holds once a model is loaded and served (the longest texts these parts show)
MODEL = "Qwen2.5-Coder-32B-Instruct-Q4_K_M.gguf · cuda:0 · gguf-blocks (18820 MB)"
API = "API: http://127.0.0.1:8000/v1"
GB = 2**30
ENGINE = {"device_total_bytes": 24 * GB, "device_used_bytes": int(19.2 * GB), "weights_bytes": int(17.5 * GB),
          "kv_bytes": {"device": int(1.2 * GB), "host": int(3.4 * GB), "disk": 12 * GB}}


def painted(label) -> str:
    return label.shown_text() if hasattr(label, "shown_text") else label.text()


@pytest.mark.parametrize("theme", ["light", "dark"])
@pytest.mark.parametrize("size", [(1024, 700), (1600, 1000)])
def test_the_status_bar_parts_never_overlap_or_cut_each_other(qtbot, db, client, theme, size):
    from app.main_window import MainWindow

    window = MainWindow(db, client, theme_choice=theme)
    qtbot.addWidget(window)
    window.memory_meter.stop()  # the texts below stay as set
    window.resize(*size)
    window.show()
    qtbot.waitExposed(window)
    window.model_label.setText(MODEL)
    window.api_label.setText(API)
    window.api_label.show()
    from app.memory_meter import memory_text

    memory = memory_text(int(3.4 * GB), ENGINE)  # a 32B model on a 24 GB card, every tier in use
    window.memory_meter.setText(memory)
    QApplication.processEvents()
    # drawn at the screen's density, fractional scales kept (test_high_dpi runs this file at 150%)
    assert window.devicePixelRatioF() == pytest.approx(float(os.environ.get("QT_SCREEN_SCALE_FACTORS", "1")))
    bar = window.statusBar()
    separator = getattr(window, "status_separator", None)
    parts = [w for w in (window.model_label, window.load_bar, window.api_label, separator, window.memory_meter)
             if w is not None and w.isVisible()]
    rects = [QRect(w.mapTo(bar, w.rect().topLeft()), w.size()) for w in parts]
    for i, (part, rect) in enumerate(zip(parts, rects)):
        assert bar.rect().contains(rect), f"{part.objectName() or type(part).__name__} leaves the bar: {rect}"
        for other, other_rect in zip(parts[i + 1:], rects[i + 1:]):
            assert not rect.intersects(other_rect), f"{part.objectName()} overlaps {other.objectName()}"
    for label, text in ((window.model_label, MODEL), (window.memory_meter, memory)):
        # what the label paints fits its width (a plain QLabel paints its whole text, cut at its edge)
        fits = label.fontMetrics().horizontalAdvance(painted(label)) <= label.contentsRect().width()
        assert fits, label.objectName()
        if label.is_elided():
            assert label.shown_text().endswith("…") and text in label.toolTip()
            assert len(label.shown_text()) > 12  # still says something
        if size[0] >= 1600:
            assert not label.is_elided()


def test_the_vram_figure_counts_only_the_kv_on_the_card():
    from app.memory_meter import memory_text

    text = memory_text(int(3.4 * GB), ENGINE)
    # 1.2 GB of KV on the card; the 3.4 GB in host RAM and the 12 GB on disk are not VRAM
    assert text.startswith("VRAM 19.2 GB / 24.0 GB (model 17.5 GB, KV 1.2 GB)")
    assert "KV cache: GPU 1.2 GB, host RAM 3.4 GB, disk 12.0 GB" in text

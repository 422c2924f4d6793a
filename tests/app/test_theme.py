"""Themes: each theme's palette and stylesheet, the system scheme followed, and the cache-map colours,
driven through real widgets offscreen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication, QFrame, QWidget

from app.theme import KIND_COLORS, THEMES, apply_theme, connect_system_theme


# -- themes -------------------------------------------------------------------------------------------------
@pytest.fixture
def app(qapp):
    """The application, with its style, palette and stylesheet put back after the test."""
    style, palette, sheet = qapp.style().name(), QPalette(qapp.palette()), qapp.styleSheet()
    yield qapp
    qapp.setStyle(style)
    qapp.setPalette(palette)
    qapp.setStyleSheet(sheet)


# The themes' colours as documented in app/theme.py, stated here so that a theme that stops using them fails.
LIGHT = {"window": "#f3f3f5", "text": "#1d1d1f", "base": "#ffffff", "highlight": "#2b63c4",
         "disabled_text": "#9e9ea4", "user_bubble": "#dbe8fb"}
DARK = {"window": "#232327", "text": "#e6e6ea", "base": "#1a1a1d", "highlight": "#3d7fe0",
        "disabled_text": "#6e6e76", "user_bubble": "#28456e"}
PALETTE_KEYS = ("window", "text", "base", "highlight", "disabled_text")


def palette_colours(app: QApplication) -> dict:
    palette = app.palette()
    return {
        "window": palette.color(QPalette.ColorRole.Window).name(),
        "text": palette.color(QPalette.ColorRole.Text).name(),
        "base": palette.color(QPalette.ColorRole.Base).name(),
        "highlight": palette.color(QPalette.ColorRole.Highlight).name(),
        "disabled_text": palette.color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text).name(),
    }


def window_colour(app: QApplication) -> str:
    return app.palette().color(QPalette.ColorRole.Window).name()


@pytest.mark.parametrize(("theme", "expected"), [("light", LIGHT), ("dark", DARK)])
def test_each_theme_sets_its_documented_palette(app, theme, expected):
    apply_theme(app, "dark" if theme == "light" else "light")

    assert apply_theme(app, theme) == theme
    assert palette_colours(app) == {key: expected[key] for key in PALETTE_KEYS}


def test_switching_theme_changes_what_widgets_render(qtbot, app):
    apply_theme(app, "light")
    plain = QWidget()  # painted with the palette's window colour
    plain.setAutoFillBackground(True)
    plain.resize(60, 40)
    bubble = QFrame()  # painted by the theme's stylesheet
    bubble.setObjectName("userMessage")
    bubble.resize(80, 50)
    for widget in (plain, bubble):
        qtbot.addWidget(widget)

    def rendered() -> dict:
        return {"window": plain.grab().toImage().pixelColor(30, 20).name(),
                "user_bubble": bubble.grab().toImage().pixelColor(40, 25).name()}

    assert rendered() == {"window": LIGHT["window"], "user_bubble": LIGHT["user_bubble"]}
    apply_theme(app, "dark")
    assert rendered() == {"window": DARK["window"], "user_bubble": DARK["user_bubble"]}
    apply_theme(app, "light")
    assert rendered() == {"window": LIGHT["window"], "user_bubble": LIGHT["user_bubble"]}


def test_theme_stylesheet_styles_chat_bubbles(app):
    apply_theme(app, "dark")
    sheet = app.styleSheet()

    assert "QFrame#userMessage" in sheet
    assert "QFrame#assistantMessage" in sheet
    assert "QLabel#badge" in sheet
    assert "italic" in sheet


@pytest.fixture
def light_system(app):
    """The offscreen platform reports no colour scheme and gives the application Qt's built-in light palette,
    so there "system" is light. (Elsewhere the answer depends on the desktop: skipped.)"""
    if app.platformName() != "offscreen" or app.styleHints().colorScheme() != Qt.ColorScheme.Unknown:
        pytest.skip("needs the offscreen platform, which reports no colour scheme and a light palette")
    return app


def test_system_theme_follows_the_system(light_system):
    app = light_system
    assert apply_theme(app, "system") == "light"
    assert window_colour(app) == LIGHT["window"]
    # Our own dark palette must not make the system look dark.
    apply_theme(app, "dark")
    assert apply_theme(app, "system") == "light"
    assert window_colour(app) == LIGHT["window"]


def test_a_platform_palette_that_is_dark_makes_system_dark(tmp_path):
    """A platform that reports no scheme is judged by the palette it gave the application: a dark one (set
    here before any theme, as a platform would) makes "system" dark. A fresh process: the app records the
    platform palette once."""
    script = (
        "from PySide6.QtGui import QColor, QPalette\n"
        "from PySide6.QtWidgets import QApplication\n"
        "from app.theme import apply_theme\n"
        "app = QApplication([])\n"
        "platform = QPalette(QColor('#202020'), QColor('#303030'))\n"
        "app.setPalette(platform)\n"
        "print(app.styleHints().colorScheme().name, apply_theme(app, 'system'),\n"
        "      app.palette().color(QPalette.ColorRole.Window).name())\n"
    )
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=Path(__file__).resolve().parents[2], check=True).stdout.split()
    assert out == ["Unknown", "dark", DARK["window"]]


def test_system_scheme_change_reapplies_only_when_following_the_system(light_system):
    app = light_system
    choice = ["dark"]
    applied = []
    slot = connect_system_theme(app, lambda: choice[0], applied.append)
    try:
        apply_theme(app, "dark")
        app.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Light)
        assert applied == []
        assert window_colour(app) == DARK["window"]

        choice[0] = "system"
        app.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Light)
        assert applied == ["light"]
        assert window_colour(app) == LIGHT["window"]
    finally:
        app.styleHints().colorSchemeChanged.disconnect(slot)


def test_unknown_theme_raises(app):
    with pytest.raises(ValueError, match="sepia"):
        apply_theme(app, "sepia")


def test_kind_colors_cover_every_lookup_outcome_in_both_themes():
    assert set(THEMES) == {"system", "light", "dark"}
    for theme in ("light", "dark"):
        assert set(KIND_COLORS[theme]) == {"EXACT", "PREFIX", "QUANTIZED", "APPROXIMATE", "MISS"}
        assert len(set(KIND_COLORS[theme].values())) == 5  # each outcome its own colour


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_kind_colors_contrast_with_the_theme_text(app, theme):
    apply_theme(app, theme)
    text = app.palette().color(QPalette.ColorRole.Text).lightness()
    for color in KIND_COLORS[theme].values():
        assert abs(QColor(color).lightness() - text) > 90, color


def test_cache_map_summary_names_disk_hits_and_never_invents_a_saving():
    from app.chat_view import cache_map_html

    answer = {"stats": {"prompt_tokens": 200, "reused_tokens": 150, "ttft_ms": 40.0, "reuse": "chunk",
                        "reused_by_tier": {"disk": 120, "device": 30}},
              "segments": [{"start": 0, "end": 150, "kind": "EXACT", "text": "doc"},
                           {"start": 150, "end": 200, "kind": "MISS", "text": "question"}],
              "saved_ms": None}
    text = cache_map_html(answer, "light")
    assert "150 of 200 prompt tokens reused" in text and "120 from the disk cache" in text
    assert "not estimated yet" in text and "ms saved" not in text
    answer["saved_ms"] = 1234.0
    assert "≈1234 ms saved" in cache_map_html(answer, "light")

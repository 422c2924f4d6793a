"""Light and dark themes: the Fusion style, a complete palette and a small stylesheet for the chat view.

The palette is set in full (every role, plus disabled text) rather than patched, so a theme looks the same
whatever the platform palette was. "system" resolves to light or dark once per call; connect_system_theme
re-resolves it when the desktop switches.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

from .settings import THEMES  # the allowed values live with the settings

# Backgrounds for the cache-hit overlay, one per lookup outcome, chosen to keep the theme's own text colour
# readable on top (light: pale tints under dark text; dark: deep tones under light text).
KIND_COLORS = {
    "light": {
        "EXACT": "#c8ecc9",
        "PREFIX": "#bfe3f2",
        "QUANTIZED": "#e3d4f5",
        "APPROXIMATE": "#ffe2a8",
        "MISS": "#f9c9d0",
    },
    "dark": {
        "EXACT": "#25592c",
        "PREFIX": "#1d5069",
        "QUANTIZED": "#4b3566",
        "APPROXIMATE": "#6e5212",
        "MISS": "#6f2734",
    },
}

_COLORS = {
    "light": {
        "window": "#f3f3f5",
        "window_text": "#1d1d1f",
        "base": "#ffffff",
        "alternate_base": "#f0f0f3",
        "text": "#1d1d1f",
        "button": "#e8e8ec",
        "button_text": "#1d1d1f",
        "bright_text": "#c01c28",
        "highlight": "#2b63c4",
        "highlighted_text": "#ffffff",
        "link": "#1a56b0",
        "link_visited": "#6a3a9e",
        "tooltip_base": "#fffbe0",
        "tooltip_text": "#1d1d1f",
        "placeholder": "#85858b",
        "disabled_text": "#9e9ea4",
        "light": "#ffffff",
        "midlight": "#f0f0f3",
        "mid": "#b8b8be",
        "dark": "#9a9aa0",
        "shadow": "#6c6c72",
        "muted": "#6b6b72",
        "user_bubble": "#dbe8fb",
        "assistant_bubble": "#ffffff",
        "bubble_border": "#dcdce2",
    },
    "dark": {
        "window": "#232327",
        "window_text": "#e6e6ea",
        "base": "#1a1a1d",
        "alternate_base": "#29292e",
        "text": "#e6e6ea",
        "button": "#303036",
        "button_text": "#e6e6ea",
        "bright_text": "#ff7b86",
        "highlight": "#3d7fe0",
        "highlighted_text": "#ffffff",
        "link": "#7fb6ff",
        "link_visited": "#c09bf0",
        "tooltip_base": "#3a3a40",
        "tooltip_text": "#e6e6ea",
        "placeholder": "#8a8a92",
        "disabled_text": "#6e6e76",
        "light": "#45454c",
        "midlight": "#38383e",
        "mid": "#26262a",
        "dark": "#141416",
        "shadow": "#000000",
        "muted": "#a0a0a8",
        "user_bubble": "#28456e",
        "assistant_bubble": "#2d2d33",
        "bubble_border": "#3b3b42",
    },
}

_ROLES = {
    QPalette.ColorRole.Window: "window",
    QPalette.ColorRole.WindowText: "window_text",
    QPalette.ColorRole.Base: "base",
    QPalette.ColorRole.AlternateBase: "alternate_base",
    QPalette.ColorRole.Text: "text",
    QPalette.ColorRole.Button: "button",
    QPalette.ColorRole.ButtonText: "button_text",
    QPalette.ColorRole.BrightText: "bright_text",
    QPalette.ColorRole.Highlight: "highlight",
    QPalette.ColorRole.HighlightedText: "highlighted_text",
    QPalette.ColorRole.Link: "link",
    QPalette.ColorRole.LinkVisited: "link_visited",
    QPalette.ColorRole.ToolTipBase: "tooltip_base",
    QPalette.ColorRole.ToolTipText: "tooltip_text",
    QPalette.ColorRole.PlaceholderText: "placeholder",
    QPalette.ColorRole.Light: "light",
    QPalette.ColorRole.Midlight: "midlight",
    QPalette.ColorRole.Mid: "mid",
    QPalette.ColorRole.Dark: "dark",
    QPalette.ColorRole.Shadow: "shadow",
    QPalette.ColorRole.Accent: "highlight",
}

_DISABLED_TEXT_ROLES = (
    QPalette.ColorRole.WindowText,
    QPalette.ColorRole.Text,
    QPalette.ColorRole.ButtonText,
    QPalette.ColorRole.HighlightedText,
    QPalette.ColorRole.PlaceholderText,
)

# Labels that explain why a control is disabled use objectName "disabledReason"; a label that needs its own
# objectName opts in with the dynamic property disabledReason=true instead.
_STYLESHEET = """
QFrame#userMessage {{
    background: {user_bubble};
    border-radius: 10px;
    padding: 6px 10px;
}}
QFrame#assistantMessage {{
    background: {assistant_bubble};
    border: 1px solid {bubble_border};
    border-radius: 10px;
    padding: 6px 10px;
}}
QFrame#userMessage QTextBrowser, QFrame#assistantMessage QTextBrowser {{
    background: transparent;
}}
QPushButton#jumpToLatest {{
    background: {highlight};
    color: {highlighted_text};
    border: none;
    border-radius: 12px;
    padding: 5px 14px;
}}
QLabel#badge {{
    color: {muted};
    font-size: 9pt;
}}
QLabel#disabledReason, QLabel[disabledReason="true"] {{
    color: {muted};
    font-style: italic;
}}
"""

# The platform palette's darkness, recorded before the first theme replaces it: once our palette is set,
# app.palette() no longer says anything about the system.
_SYSTEM_DARK_PROPERTY = "kvboostSystemPaletteIsDark"


def _palette_is_dark(palette: QPalette) -> bool:
    window = palette.color(QPalette.ColorRole.Window)
    return window.lightness() < 128


def system_is_dark(app: QApplication) -> bool:
    """Whether the desktop asks for dark colours. Platforms that do not report a scheme are judged by the
    palette they gave the application."""
    scheme = app.styleHints().colorScheme()
    if scheme == Qt.ColorScheme.Dark:
        return True
    if scheme == Qt.ColorScheme.Light:
        return False
    recorded = app.property(_SYSTEM_DARK_PROPERTY)
    if recorded is not None:
        return bool(recorded)
    return _palette_is_dark(app.palette())


def build_palette(theme: str) -> QPalette:
    """The full palette for "light" or "dark"."""
    if theme not in _COLORS:
        raise ValueError(f"theme must be 'light' or 'dark', got {theme!r}")
    colors = _COLORS[theme]
    palette = QPalette()
    for role, name in _ROLES.items():
        palette.setColor(role, QColor(colors[name]))
    disabled = QColor(colors["disabled_text"])
    for role in _DISABLED_TEXT_ROLES:
        palette.setColor(QPalette.ColorGroup.Disabled, role, disabled)
    palette.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Highlight, QColor(colors["mid"]))
    palette.setColor(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Base, QColor(colors["window"]))
    return palette


def apply_theme(app: QApplication, choice: str) -> str:
    """Applies `choice` (one of THEMES) to the whole application and returns the theme it resolved to,
    "light" or "dark"."""
    if choice not in THEMES:
        raise ValueError(f"theme must be one of {THEMES}, got {choice!r}")
    if app.property(_SYSTEM_DARK_PROPERTY) is None:
        app.setProperty(_SYSTEM_DARK_PROPERTY, _palette_is_dark(app.palette()))
    if choice == "system":
        resolved = "dark" if system_is_dark(app) else "light"
    else:
        resolved = choice
    # Fusion draws everything from the palette, so both themes look consistent on every platform.
    app.setStyle("Fusion")
    app.setPalette(build_palette(resolved))
    app.setStyleSheet(_STYLESHEET.format(**_COLORS[resolved]))
    return resolved


def connect_system_theme(
    app: QApplication,
    get_choice: Callable[[], str],
    on_applied: Callable[[str], None] | None = None,
) -> Callable:
    """Re-applies the theme when the desktop's colour scheme changes while the user's choice is "system".
    `on_applied` receives the resolved theme, for views that paint with KIND_COLORS. Returns the connected
    slot so a caller can disconnect it."""

    def on_style_hints_color_scheme_changed(_scheme=None) -> None:
        if get_choice() != "system":
            return
        resolved = apply_theme(app, "system")
        if on_applied is not None:
            on_applied(resolved)

    app.styleHints().colorSchemeChanged.connect(on_style_hints_color_scheme_changed)
    return on_style_hints_color_scheme_changed

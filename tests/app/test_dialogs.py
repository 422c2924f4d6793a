"""Conversation settings, model choice, rename and themes, driven through real widgets offscreen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QComboBox,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFrame,
    QInputDialog,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QWidget,
)

from app.dialogs import ConversationSettingsDialog, ModelDialog, ask_rename
from app.theme import KIND_COLORS, THEMES, apply_theme, connect_system_theme

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 512}
DEFAULTS = {"system_prompt": "You are a helpful assistant.", "sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 128}}


def ok_button(dialog) -> QPushButton:
    return dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Ok)


@pytest.fixture
def settings_dialog(qtbot):
    dialog = ConversationSettingsDialog(
        None, title="Trip plans", system_prompt="Be brief.", sampling=SAMPLING, defaults=DEFAULTS
    )
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def model_dialog(qtbot, current=None, awq_unavailable=None) -> ModelDialog:
    dialog = ModelDialog(None, current=current, awq_unavailable=awq_unavailable)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


# -- conversation settings ----------------------------------------------------------------------------------
def test_settings_dialog_returns_what_it_was_given(settings_dialog):
    assert settings_dialog.values() == {"title": "Trip plans", "system_prompt": "Be brief.", "sampling": SAMPLING}


def test_settings_dialog_returns_edited_values(qtbot, settings_dialog):
    title = settings_dialog.findChild(QLineEdit, "titleEdit")
    title.clear()
    qtbot.keyClicks(title, "  Packing list ")
    settings_dialog.findChild(QPlainTextEdit, "systemPromptEdit").setPlainText("Answer in French.")
    temperature = settings_dialog.findChild(QDoubleSpinBox, "temperatureSpin")
    temperature.setValue(0.7)
    temperature.stepUp()
    settings_dialog.findChild(QDoubleSpinBox, "topPSpin").setValue(0.5)
    settings_dialog.findChild(QSpinBox, "maxTokensSpin").setValue(2048)

    assert settings_dialog.values() == {
        "title": "Packing list",
        "system_prompt": "Answer in French.",
        "sampling": {"temperature": 0.75, "top_p": 0.5, "max_new_tokens": 2048},
    }


def test_sampling_spins_clamp_to_their_ranges(settings_dialog):
    settings_dialog.findChild(QDoubleSpinBox, "temperatureSpin").setValue(5.0)
    settings_dialog.findChild(QDoubleSpinBox, "topPSpin").setValue(0.0)
    settings_dialog.findChild(QSpinBox, "maxTokensSpin").setValue(100_000)

    assert settings_dialog.values()["sampling"] == {"temperature": 2.0, "top_p": 0.05, "max_new_tokens": 32768}


def test_reset_restores_defaults_but_keeps_the_title(qtbot, settings_dialog):
    qtbot.mouseClick(settings_dialog.findChild(QPushButton, "resetButton"), Qt.MouseButton.LeftButton)

    assert settings_dialog.values() == {
        "title": "Trip plans",
        "system_prompt": DEFAULTS["system_prompt"],
        "sampling": DEFAULTS["sampling"],
    }


def test_empty_title_disables_ok(qtbot, settings_dialog):
    title = settings_dialog.findChild(QLineEdit, "titleEdit")
    assert ok_button(settings_dialog).isEnabled()

    title.setText("   ")
    assert not ok_button(settings_dialog).isEnabled()

    qtbot.keyClicks(title, "x")
    assert ok_button(settings_dialog).isEnabled()


def test_ok_accepts_the_settings_dialog(qtbot, settings_dialog):
    with qtbot.waitSignal(settings_dialog.accepted, timeout=1000):
        qtbot.mouseClick(ok_button(settings_dialog), Qt.MouseButton.LeftButton)


# -- model dialog -------------------------------------------------------------------------------------------
def test_model_dialog_defaults_to_the_built_in_model(qtbot):
    dialog = model_dialog(qtbot)

    assert dialog.findChild(QRadioButton, "defaultRadio").isChecked()
    assert not dialog.findChild(QLineEdit, "sourceEdit").isEnabled()
    assert not dialog.findChild(QPushButton, "browseButton").isEnabled()
    assert ok_button(dialog).isEnabled()
    assert dialog.values() == {"source": None, "reuse": "chunk", "awq_streaming": False,
                               "weights": "auto"}


def test_reuse_combo_offers_every_mode_with_chunk_first(qtbot):
    dialog = model_dialog(qtbot)
    combo = dialog.findChild(QComboBox, "reuseCombo")

    assert [combo.itemData(i) for i in range(combo.count())] == ["chunk", "prefix", "approx", "off"]
    assert "may change answers" in combo.itemText(2)


def test_folder_is_valid_only_with_config_json(qtbot, tmp_path):
    dialog = model_dialog(qtbot)
    dialog.findChild(QRadioButton, "folderRadio").click()
    edit = dialog.findChild(QLineEdit, "sourceEdit")
    error = dialog.findChild(QLabel, "errorLabel")
    assert dialog.findChild(QPushButton, "browseButton").isEnabled()
    assert not ok_button(dialog).isEnabled()  # nothing chosen yet

    edit.setText(str(tmp_path))
    assert not ok_button(dialog).isEnabled()
    assert "config.json" in error.text()

    (tmp_path / "config.json").write_text("{}")
    edit.setText(str(tmp_path) + "/")
    assert ok_button(dialog).isEnabled()
    assert error.text() == ""

    edit.setText(str(tmp_path / "missing"))
    assert not ok_button(dialog).isEnabled()
    assert "not found" in error.text()


def test_gguf_must_exist_and_end_in_gguf(qtbot, tmp_path):
    dialog = model_dialog(qtbot)
    dialog.findChild(QRadioButton, "ggufRadio").click()
    edit = dialog.findChild(QLineEdit, "sourceEdit")

    edit.setText(str(tmp_path / "model.gguf"))
    assert not ok_button(dialog).isEnabled()

    (tmp_path / "model.bin").write_bytes(b"GGUF")
    edit.setText(str(tmp_path / "model.bin"))
    assert not ok_button(dialog).isEnabled()
    assert ".gguf" in dialog.findChild(QLabel, "errorLabel").text()

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    edit.setText(str(tmp_path / "model.gguf"))
    assert ok_button(dialog).isEnabled()
    assert dialog.values()["source"] == str(tmp_path / "model.gguf")


@pytest.mark.parametrize(
    ("text", "valid"),
    [
        ("HuggingFaceTB/SmolLM2-360M-Instruct", True),
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("", False),
        ("SmolLM2", False),
        ("owner/", False),
        ("owner/name/extra", False),
        ("/absolute/path", False),
    ],
)
def test_hub_id_must_look_like_owner_slash_name(qtbot, text, valid):
    dialog = model_dialog(qtbot)
    dialog.findChild(QRadioButton, "hubRadio").click()
    dialog.findChild(QLineEdit, "sourceEdit").setText(text)

    assert ok_button(dialog).isEnabled() is valid
    assert (dialog.findChild(QLabel, "errorLabel").text() == "") is valid
    assert not dialog.findChild(QPushButton, "browseButton").isEnabled()


def test_switching_source_kind_keeps_each_kinds_text(qtbot, tmp_path):
    dialog = model_dialog(qtbot)
    edit = dialog.findChild(QLineEdit, "sourceEdit")
    dialog.findChild(QRadioButton, "hubRadio").click()
    edit.setText("owner/name")
    dialog.findChild(QRadioButton, "folderRadio").click()
    assert edit.text() == ""
    edit.setText(str(tmp_path))

    dialog.findChild(QRadioButton, "hubRadio").click()
    assert edit.text() == "owner/name"
    assert dialog.values()["source"] == "owner/name"

    dialog.findChild(QRadioButton, "defaultRadio").click()
    assert dialog.values()["source"] is None
    assert ok_button(dialog).isEnabled()


def test_current_settings_are_preselected(qtbot, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    dialog = model_dialog(qtbot, current={"source": str(tmp_path), "reuse": "approx", "awq_streaming": True})

    assert dialog.findChild(QRadioButton, "folderRadio").isChecked()
    assert dialog.findChild(QCheckBox, "awqCheck").isChecked()
    assert dialog.values() == {"source": str(tmp_path), "reuse": "approx", "awq_streaming": True, "weights": "auto"}

    hub = model_dialog(qtbot, current={"source": "owner/name", "reuse": "off", "awq_streaming": False})
    assert hub.findChild(QRadioButton, "hubRadio").isChecked()
    assert hub.values() == {"source": "owner/name", "reuse": "off", "awq_streaming": False, "weights": "auto"}


def test_unknown_reuse_mode_is_rejected(qtbot):
    with pytest.raises(ValueError, match="sometimes"):
        ModelDialog(None, current={"source": None, "reuse": "sometimes", "awq_streaming": False}, awq_unavailable=None)


def test_source_expands_home(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    dialog = model_dialog(qtbot)
    dialog.findChild(QRadioButton, "ggufRadio").click()
    dialog.findChild(QLineEdit, "sourceEdit").setText("~/tiny.gguf")

    assert ok_button(dialog).isEnabled()
    assert dialog.values()["source"] == str(tmp_path / "tiny.gguf")


def test_browse_fills_the_chosen_folder(qtbot, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    asked = []

    def choose(parent, caption, start):
        asked.append(caption)
        return str(tmp_path)

    monkeypatch.setattr(QFileDialog, "getExistingDirectory", staticmethod(choose))
    dialog = model_dialog(qtbot)
    dialog.findChild(QRadioButton, "folderRadio").click()
    qtbot.mouseClick(dialog.findChild(QPushButton, "browseButton"), Qt.MouseButton.LeftButton)

    assert len(asked) == 1
    assert dialog.findChild(QLineEdit, "sourceEdit").text() == str(tmp_path)
    assert ok_button(dialog).isEnabled()


def test_browse_for_gguf_filters_gguf_files(qtbot, tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    filters = []

    def choose(parent, caption, start, file_filter):
        filters.append(file_filter)
        return str(tmp_path / "m.gguf"), file_filter

    monkeypatch.setattr(QFileDialog, "getOpenFileName", staticmethod(choose))
    dialog = model_dialog(qtbot)
    dialog.findChild(QRadioButton, "ggufRadio").click()
    qtbot.mouseClick(dialog.findChild(QPushButton, "browseButton"), Qt.MouseButton.LeftButton)

    assert filters == ["GGUF files (*.gguf)"]
    assert dialog.values()["source"] == str(tmp_path / "m.gguf")


def test_awq_is_disabled_with_its_reason_when_unavailable(qtbot):
    reason = "needs a CUDA GPU and the autoawq package"
    dialog = model_dialog(qtbot, current={"source": None, "reuse": "chunk", "awq_streaming": True}, awq_unavailable=reason)
    check = dialog.findChild(QCheckBox, "awqCheck")
    label = dialog.findChild(QLabel, "awqReason")

    assert not check.isEnabled()
    assert check.toolTip() == reason
    assert label.isVisible()
    assert label.text() == reason
    assert dialog.values()["awq_streaming"] is False


def test_awq_is_enabled_when_available(qtbot):
    dialog = model_dialog(qtbot, awq_unavailable=None)
    check = dialog.findChild(QCheckBox, "awqCheck")

    assert check.isEnabled()
    assert not dialog.findChild(QLabel, "awqReason").isVisible()
    check.click()
    assert dialog.values()["awq_streaming"] is True


# -- rename -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "expected"),
    [(("  New name ", True), "New name"), (("   ", True), None), (("Ignored", False), None)],
)
def test_ask_rename_returns_the_trimmed_title_or_none(qtbot, monkeypatch, answer, expected):
    offered = []

    def get_text(parent, title, label, echo, text):
        offered.append(text)
        return answer

    monkeypatch.setattr(QInputDialog, "getText", staticmethod(get_text))

    assert ask_rename(None, "Old name") == expected
    assert offered == ["Old name"]


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


# -- weight format -------------------------------------------------------------------------------------------
def test_the_model_dialog_returns_the_chosen_weight_format(qtbot):
    dialog = model_dialog(qtbot, current={"source": None, "reuse": "chunk", "weights": "int4"})
    combo = dialog.findChild(QComboBox, "weightsCombo")
    assert dialog.values()["weights"] == "int4"
    combo.setCurrentIndex(combo.findData("float"))
    assert dialog.values()["weights"] == "float"
    with pytest.raises(ValueError, match="weights must be one of"):
        ModelDialog(None, current={"source": None, "weights": "int3"}, awq_unavailable=None)


def test_the_model_dialog_shows_each_formats_memory_for_the_chosen_model_only(qtbot, tmp_path):
    dialog = model_dialog(qtbot)
    asked = []
    dialog.weight_sizes_wanted.connect(asked.append)
    dialog.findChild(QRadioButton, "ggufRadio").setChecked(True)
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    dialog.findChild(QLineEdit, "sourceEdit").setText(str(path))
    assert asked[-1] == str(path)
    label = dialog.findChild(QLabel, "weightSizes")
    dialog.show_weight_sizes("", {"float": 9 * 2**20, "int4": 3 * 2**20, "awq": False, "dtype": "float32"})
    assert "9 MB" not in label.text()  # an answer about another model is ignored
    dialog.show_weight_sizes(str(path), {"float": 513 * 2**20, "int4": 166 * 2**20, "awq": False,
                                         "dtype": "float32"})
    assert "float (float32) 513 MB" in label.text() and "int4 166 MB" in label.text()
    assert "auto loads float" in label.text()
    dialog.show_weight_sizes(str(path), {"error": "not a GGUF file"})
    assert label.text() == "Size unknown: not a GGUF file"


def test_the_engine_client_estimates_the_built_in_models_weights_off_the_ui_thread(qtbot, tmp_path):
    from app.engine_client import EngineClient

    client = EngineClient()
    try:
        with qtbot.waitSignal(client.weights_estimated, timeout=120_000) as built_in:
            client.estimate_weights(None)
        source, sizes = built_in.args
        # SmolLM2-135M: 134.5M parameters, float32 on the CPU; its decoder linears shrink ~6x in int4
        assert source == "" and 500 * 2**20 < sizes["float"] < 530 * 2**20 and sizes["int4"] < sizes["float"] / 2
        # the built-in GGUF loads as float under auto, so streaming needs Weights: int4 (which the CPU can stream)
        assert "needs int4 weights" in sizes["streaming"]["unavailable"]["auto"]
        assert sizes["streaming"]["unavailable"]["int4"] is None
        with qtbot.waitSignal(client.weights_estimated, timeout=60_000) as missing:
            client.estimate_weights(str(tmp_path / "nothing.gguf"))
        assert "not found" in missing.args[1]["error"]
    finally:
        client.shutdown()

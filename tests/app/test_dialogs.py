"""Conversation settings, model choice and rename, driven through real widgets offscreen (themes:
test_theme.py)."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QInputDialog,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QRadioButton,
    QSpinBox,
)

from app.dialogs import ConversationSettingsDialog, ModelDialog, ask_rename

SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 512}
DEFAULTS = {"system_prompt": "You are a helpful assistant.",
            "sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 128}}


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


def model_dialog(qtbot, current=None, streaming_refusal=None) -> ModelDialog:
    dialog = ModelDialog(None, current=current, streaming_refusal=streaming_refusal)
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
    assert dialog.values() == {"source": None, "reuse": "chunk", "layer_streaming": False,
                               "weights": "auto", "remote_cache": None}


def test_model_dialog_takes_a_shared_kv_cache_url_and_refuses_anything_else(qtbot):
    dialog = model_dialog(qtbot, current={"source": None, "reuse": "chunk", "remote_cache": "redis://nas:6379/0"})
    edit = dialog.findChild(QLineEdit, "remoteCacheEdit")
    assert edit.text() == "redis://nas:6379/0" and ok_button(dialog).isEnabled()
    edit.setText("http://nas:6379")
    assert not ok_button(dialog).isEnabled()
    assert "redis://" in dialog.findChild(QLabel, "errorLabel").text()
    edit.setText(" rediss://alice:pw@nas:6380/1 ")
    assert ok_button(dialog).isEnabled()
    assert dialog.values()["remote_cache"] == "rediss://alice:pw@nas:6380/1"


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
    dialog = model_dialog(qtbot, current={"source": str(tmp_path), "reuse": "approx", "layer_streaming": True})

    assert dialog.findChild(QRadioButton, "folderRadio").isChecked()
    assert dialog.findChild(QCheckBox, "awqCheck").isChecked()
    assert dialog.values() == {"source": str(tmp_path), "reuse": "approx", "layer_streaming": True, "weights": "auto",
                               "remote_cache": None}

    hub = model_dialog(qtbot, current={"source": "owner/name", "reuse": "off", "layer_streaming": False})
    assert hub.findChild(QRadioButton, "hubRadio").isChecked()
    assert hub.values() == {"source": "owner/name", "reuse": "off", "layer_streaming": False, "weights": "auto",
                            "remote_cache": None}


def test_unknown_reuse_mode_is_rejected(qtbot):
    with pytest.raises(ValueError, match="sometimes"):
        ModelDialog(None, current={"source": None, "reuse": "sometimes", "layer_streaming": False},
                    streaming_refusal=None)


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
    dialog = model_dialog(qtbot, current={"source": None, "reuse": "chunk", "layer_streaming": True},
                          streaming_refusal=reason)
    check = dialog.findChild(QCheckBox, "awqCheck")
    label = dialog.findChild(QLabel, "awqReason")

    assert not check.isEnabled()
    assert check.toolTip() == reason
    assert label.isVisible()
    assert label.text() == reason
    assert dialog.values()["layer_streaming"] is False


def test_awq_is_enabled_when_available(qtbot):
    dialog = model_dialog(qtbot, streaming_refusal=None)
    check = dialog.findChild(QCheckBox, "awqCheck")

    assert check.isEnabled()
    assert not dialog.findChild(QLabel, "awqReason").isVisible()
    check.click()
    assert dialog.values()["layer_streaming"] is True


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


# -- weight format -------------------------------------------------------------------------------------------
def test_the_model_dialog_returns_the_chosen_weight_format(qtbot):
    dialog = model_dialog(qtbot, current={"source": None, "reuse": "chunk", "weights": "int4"})
    combo = dialog.findChild(QComboBox, "weightsCombo")
    assert dialog.values()["weights"] == "int4"
    combo.setCurrentIndex(combo.findData("float"))
    assert dialog.values()["weights"] == "float"
    with pytest.raises(ValueError, match="weights must be one of"):
        ModelDialog(None, current={"source": None, "weights": "int3"}, streaming_refusal=None)


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
                                         "dtype": "float32",
                                         "auto": {"loads": "int4", "why": "the file's decoder weights are 4-bit"}})
    assert "float (float32) 513 MB" in label.text() and "int4 166 MB" in label.text()
    assert "auto loads int4" in label.text() and "4-bit" in label.toolTip()
    combo = dialog.findChild(QComboBox, "weightsCombo")
    combo.setCurrentIndex(combo.findData("float"))  # the label follows the choice, not what auto would do
    assert "this loads float" in label.text() and "auto loads" not in label.text()
    combo.setCurrentIndex(combo.findData("int4"))
    assert "this loads int4" in label.text()
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
        # the built-in GGUF's 4-bit codes load as int4 under auto, so it can stream under auto and int4, not float
        assert sizes["auto"]["loads"] == "int4" and "4-bit" in sizes["auto"]["why"]
        assert sizes["streaming"]["unavailable"]["auto"] is None
        assert sizes["streaming"]["unavailable"]["int4"] is None
        assert "needs int4 weights" in sizes["streaming"]["unavailable"]["float"]
        with qtbot.waitSignal(client.weights_estimated, timeout=60_000) as missing:
            client.estimate_weights(str(tmp_path / "nothing.gguf"))
        assert "not found" in missing.args[1]["error"]
    finally:
        client.shutdown()

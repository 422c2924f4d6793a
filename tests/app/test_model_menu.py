"""The Model menu's memory: recent models (newest first, one entry per model and format, loadable again from
Model > Recent models) and the remote server answering again after a restart unless a model is named."""

from __future__ import annotations

import pytest
from qt_helpers import WAIT_MS
from tiny_models import build_model, build_tokenizer  # noqa: E402  (before an engine thread imports transformers)

from app.model_menu import recent_label
from app.settings import RECENT_MAX, ModelChoice, Settings


def test_a_load_goes_first_once_and_the_list_stays_short():
    settings = Settings()
    for i in range(RECENT_MAX + 3):
        settings = settings.remembering(ModelChoice(source=f"/models/m{i}.gguf"))
    recent = settings.recent_models
    assert len(recent) == RECENT_MAX and recent[0].source == f"/models/m{RECENT_MAX + 2}.gguf"
    recent = settings.remembering(ModelChoice(source="/models/m5.gguf")).recent_models
    assert [e.source for e in recent].count("/models/m5.gguf") == 1 and recent[0].source == "/models/m5.gguf"
    settings = Settings(recent_models=recent)
    recent = settings.remembering(ModelChoice(source="/models/m5.gguf", weights="int4")).recent_models
    assert [e.weights for e in recent[:2]] == ["int4", "auto"]  # another format: its own entry


def test_labels_name_the_file_and_a_chosen_format():
    assert recent_label(ModelChoice(source="/models/qwen/Qwen2.5-0.5B-Q4_K_M.gguf")) == "Qwen2.5-0.5B-Q4_K_M.gguf"
    assert recent_label(ModelChoice(source="/models/tiny/", weights="int4")) == "tiny · int4"
    assert recent_label(ModelChoice()).endswith("(built in)")


@pytest.fixture
def tiny_folders(tmp_path):
    folders = []
    for name in ("first", "second"):
        folder = tmp_path / name
        build_model("llama").save_pretrained(folder)
        build_tokenizer().save_pretrained(folder)
        folders.append(str(folder))
    return folders


def test_recent_models_load_again_from_the_menu(qtbot, idle_window, tiny_folders):
    window = idle_window
    for folder in tiny_folders:
        with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):
            window.model_menu.load({"source": folder, "reuse": "off"})
    menu = window.model_menu.recent_menu
    window.model_menu.fill_recent_menu()
    assert [a.text() for a in menu.actions()] == ["second", "first"]
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS) as loaded:
        menu.actions()[1].trigger()
    assert loaded.args[0]["source"] == tiny_folders[0]
    assert window.db.get_setting("model")["source"] == tiny_folders[0]  # the model to load at the next start
    assert window.db.get_setting("model")["reuse"] == "off"  # with the options it was loaded with


def test_the_remote_server_answers_again_at_start_unless_a_model_is_named(qtbot, idle_window, tiny_folders):
    window = idle_window
    window.db.set_setting("remote", {"base_url": "http://127.0.0.1:9/v1", "model": "m", "active": True})
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS) as loaded:
        window.start_model(None, explicit=False)
    assert loaded.args[0]["remote"] and window.client.is_remote
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS) as loaded:
        window.start_model(tiny_folders[0], explicit=True)  # `--model PATH` wins over the remote setting
    assert not window.client.is_remote and loaded.args[0]["source"] == tiny_folders[0]
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):
        window.model_menu.load({"source": tiny_folders[1]})  # choosing a model turns the remote off for good
    assert window.db.get_setting("remote")["active"] is False


def test_a_settings_file_written_before_the_rename_keeps_its_layer_streaming_choice(tmp_path):
    """Earlier versions stored the streaming choice as "awq_streaming" (in the model setting and in every recent
    model): this version reads it as "layer_streaming", from the same SQLite file."""
    from app import settings
    from app.db import Database

    path = tmp_path / "kvboost.sqlite3"
    old = Database(path)
    old.set_setting("model", {"source": "m.gguf", "reuse": "approx", "awq_streaming": True, "weights": "int4"})
    old.set_setting("recent_models", [{"source": "a.gguf", "reuse": "chunk", "awq_streaming": False}])
    old.close()
    db = Database(path)
    read = settings.load(db)
    assert read.model == ModelChoice(source="m.gguf", reuse="approx", layer_streaming=True, weights="int4")
    assert read.recent_models == (ModelChoice(source="a.gguf", reuse="chunk", layer_streaming=False),)
    both = {"source": None, "reuse": "chunk", "awq_streaming": True, "layer_streaming": False}
    assert settings.from_rows({"model": both}).model.layer_streaming is False

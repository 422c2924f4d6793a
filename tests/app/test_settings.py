"""The app's typed settings (app.settings): a file written by the previous version opens with every choice kept,
hand-edited or broken values fall back to their defaults, and the engine options it keeps are the engine's own."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from app import settings
from app.db import Database
from app.settings import ApiServer, ModelChoice, RemoteServer, Settings

# The SQLite file of the previous version (schema 1 settings: untyped rows, one recent model still with the
# "awq_streaming" key of the release before), as an SQL dump: tests/app/data/settings-v1.sql.
V1_DUMP = Path(__file__).with_name("data") / "settings-v1.sql"


def _v1_file(tmp_path) -> Path:
    path = tmp_path / "kvboost.sqlite3"
    con = sqlite3.connect(path)
    con.executescript(V1_DUMP.read_text())
    con.close()
    return path


def test_a_file_of_the_previous_version_opens_with_every_choice_kept(tmp_path):
    path = _v1_file(tmp_path)
    db = Database(path)
    read = settings.load(db)
    big = ModelChoice(source="/models/qwen2.5-1.5b-instruct-q4_k_m.gguf", reuse="approx", weights="int4",
                      layer_streaming=True, remote_cache="redis://kv@127.0.0.1:6379/0")
    assert read.model == big
    assert read.recent_models == (big, ModelChoice(), ModelChoice(source="/models/old.gguf", layer_streaming=True))
    assert read.remote == RemoteServer(base_url="http://127.0.0.1:8000/v1", model="smollm2", active=False)
    assert read.api_server == ApiServer(enabled=True, port=8123)
    assert read.theme == "dark"
    assert db.conversations()[0]["title"] == "Kept chat"  # the rest of the file too
    # written back in this version's form, once
    assert db.get_setting("schema_version") == settings.SCHEMA_VERSION
    assert "awq_streaming" not in str(db.get_setting("recent_models"))
    db.close()
    assert settings.load(Database(path)) == read


def test_the_app_starts_on_a_file_of_the_previous_version(qtbot, tmp_path):
    """The main window built over the previous version's file shows its saved choices."""
    from app.engine_client import EngineClient
    from app.main_window import MainWindow

    db = Database(_v1_file(tmp_path))
    client = EngineClient()
    window = MainWindow(db, client)
    qtbot.addWidget(window)
    assert window.theme_choice == "dark"
    assert window.serve_action.isChecked() and "8123" in window.serve_action.text()
    window.model_menu.fill_recent_menu()
    labels = [a.text() for a in window.model_menu.recent_menu.actions()]
    assert labels[0] == "qwen2.5-1.5b-instruct-q4_k_m.gguf · int4" and len(labels) == 3
    client.shutdown()


@pytest.mark.parametrize("row, value", [
    ("model", {"reuse": "sometimes", "weights": 4, "layer_streaming": "yes", "source": ["x"]}),
    ("model", "edited by hand"),
    ("api_server", {"enabled": 1, "port": 70000}),
    ("remote", {"base_url": None, "active": "true"}),
    ("recent_models", {"not": "a list"}),
    ("theme", "neon"),
])
def test_a_broken_or_hand_edited_value_falls_back_to_its_default(tmp_path, row, value):
    db = Database(tmp_path / "s.sqlite3")
    db.set_setting(row, value)
    assert settings.load(db) == Settings()


def test_a_file_of_a_newer_version_is_refused_not_overwritten(tmp_path):
    db = Database(tmp_path / "s.sqlite3")
    db.set_settings({"schema_version": settings.SCHEMA_VERSION + 1, "theme": "dark"})
    with pytest.raises(ValueError, match="newer"):
        settings.load(db)
    assert db.get_setting("schema_version") == settings.SCHEMA_VERSION + 1


def test_the_model_options_it_keeps_are_the_engines_own():
    """Defaults and allowed values come from engine.config's option fields: a changed engine default is the app's
    default, and each kept option is an engine option."""
    from engine.config import options

    table = options()
    for f in dataclasses.fields(ModelChoice):
        name = f.metadata.get("engine_option")
        if name is None:
            assert f.name == "source"
            continue
        assert name in table and f.default == table[name].default
    assert set(ModelChoice().engine_options()) <= set(table)
    for value in table["reuse"].choices:  # every allowed value is kept, anything else is not
        assert settings.from_rows({"model": {"reuse": value}}).model.reuse == value
    assert settings.from_rows({"model": {"reuse": "off-ish"}}).model.reuse == table["reuse"].default


def test_update_saves_one_field_and_keeps_the_rest(tmp_path):
    db = Database(tmp_path / "s.sqlite3")
    settings.update(db, theme="light")
    settings.update(db, api_server=ApiServer(enabled=True, port=9000))
    assert settings.load(Database(tmp_path / "s.sqlite3")) == Settings(theme="light",
                                                                      api_server=ApiServer(enabled=True, port=9000))

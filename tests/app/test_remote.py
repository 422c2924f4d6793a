"""Answers from a remote OpenAI-compatible server: the project's own kvboost-server on 127.0.0.1 (in this process
over the session's real model, or as a process that the test kills), driven through the window and Model ▸ Remote
server…; the API key in a keyring backend of the test's own, never in the SQLite file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import keyring
import pytest
from keyring.backend import KeyringBackend
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox
from qt_helpers import WAIT_MS, send

ROOT = Path(__file__).resolve().parents[2]

from server_helpers import RunningServer, free_port, wait_healthy  # noqa: E402

KEY = "remote-secret-4242"


class MemoryKeyring(KeyringBackend):
    priority = 1

    def __init__(self):
        super().__init__()
        self.passwords: dict[tuple[str, str], str] = {}

    def get_password(self, service, username):
        return self.passwords.get((service, username))

    def set_password(self, service, username, password):
        self.passwords[(service, username)] = password

    def delete_password(self, service, username):
        self.passwords.pop((service, username), None)


@pytest.fixture
def memory_keyring():
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


@pytest.fixture(scope="module")
def server(smollm):
    running = RunningServer(smollm.with_options(), model_id="smollm2", api_key=KEY)
    yield running
    running.stop()


@pytest.fixture
def window(idle_window):
    """No model loaded in the window: the answers come from the server."""
    return idle_window


def connect(qtbot, window, base_url: str, key: str, model: str = "smollm2") -> None:
    dialog = window.open_remote_dialog()
    dialog.base_url_edit.setText(base_url)
    dialog.api_key_edit.setText(key)
    with qtbot.waitSignal(dialog.models_listed, timeout=WAIT_MS) as listed:
        qtbot.mouseClick(dialog.list_button, Qt.LeftButton)
    assert model in listed.args[0]
    dialog.model_combo.setCurrentText(model)
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):
        qtbot.mouseClick(dialog.buttons.button(QDialogButtonBox.StandardButton.Ok), Qt.LeftButton)


def test_a_remote_answer_streams_into_the_window_and_the_key_stays_out_of_the_database(
        qtbot, window, server, db, memory_keyring, tmp_path):
    connect(qtbot, window, server.url + "/v1", KEY)
    assert window.client.is_remote and window.client.model_info["remote"]
    deltas = []
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 24})
    answer = send(qtbot, tab, "What is the capital of France?", on_token=deltas.append)
    assert "Paris" in answer.text and len(deltas) > 1 and "".join(deltas) == answer.text
    widget = tab.chat_view.widgets[-1]
    assert widget.badge.text().startswith("remote smollm2 · ") and "from cache there" in widget.badge.text()
    widget.map_button.setChecked(True)
    assert "reused" in widget.cache_map.toPlainText() and "prompt tokens" in widget.cache_map.toPlainText()
    saved = db.messages(tab.conversation_id)[-1]
    assert saved["status"] == "done" and saved["stats"]["remote"] and saved["stats"]["kvboost"]["prompt_tokens"] > 0

    assert memory_keyring.passwords == {("kvboost-desktop remote server", server.url + "/v1"): KEY}
    # saved, active: at the next start answers come from this server again (app.model_menu.ModelMenu.start)
    assert db.get_setting("remote") == {"base_url": server.url + "/v1", "model": "smollm2", "active": True}
    db.close()
    assert not any(KEY.encode() in p.read_bytes() for p in tmp_path.glob("kvboost.sqlite3*"))


def test_a_wrong_key_is_a_clear_error_in_the_dialog_and_the_banner(qtbot, window, server, memory_keyring):
    dialog = window.open_remote_dialog()
    dialog.base_url_edit.setText(server.url + "/v1")
    dialog.api_key_edit.setText("not-the-key")
    with qtbot.waitSignal(dialog.models_failed, timeout=WAIT_MS):
        qtbot.mouseClick(dialog.list_button, Qt.LeftButton)
    assert "refused the API key (HTTP 401)" in dialog.status_label.text()
    dialog.model_combo.setCurrentText("smollm2")
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):
        qtbot.mouseClick(dialog.buttons.button(QDialogButtonBox.StandardButton.Ok), Qt.LeftButton)
    tab = window.current_tab()
    tab.composer.setPlainText("Hello?")
    qtbot.keyClick(tab.composer, Qt.Key_Return)
    with qtbot.waitSignal(tab.request.failed, timeout=WAIT_MS):
        pass
    assert not window.banner.isHidden() and "refused the API key (HTTP 401)" in window.banner_label.text()
    assert tab.chat_view.widgets[-1].message["status"] == "error"


@pytest.fixture
def tiny_server_process(tmp_path):
    """kvboost-server over a tiny random model that never ends an answer (its EOS logit is zero), as a process."""
    from tiny_models import build_model, build_tokenizer

    folder = tmp_path / "tiny"
    build_model("llama").save_pretrained(folder)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
    port = free_port()
    env = {**os.environ, "KVBOOST_CACHE_DIR": str(tmp_path / "kv")}
    proc = subprocess.Popen([sys.executable, "-m", "cli.server", "--model", str(folder), "--model-name", "tiny",
                             "--port", str(port), "--api-key", KEY, "--device", "cpu"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        yield proc, f"http://127.0.0.1:{port}/v1"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_server_killed_mid_answer_leaves_the_partial_answer_marked_interrupted(
        qtbot, window, db, memory_keyring, tiny_server_process):
    proc, url = tiny_server_process
    connect(qtbot, window, url, KEY, model="tiny")
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 1500})
    answer = send(qtbot, tab, "w5 w6 w7", on_token=lambda _: proc.poll() is None and proc.kill())  # at the first
    assert answer.finish_reason == "interrupted" and answer.text.startswith("w")
    saved = db.messages(tab.conversation_id)[-1]
    assert saved["status"] == "interrupted" and saved["content"] == answer.text
    assert tab.chat_view.widgets[-1].badge.text().endswith("· interrupted")
    assert not window.banner.isHidden() and "broke off" in window.banner_label.text()


def test_the_remote_dialog_holds_a_server_url_and_an_error_naming_it_on_one_line(qtbot):
    from app.remote_dialog import RemoteDialog

    dialog = RemoteDialog()
    qtbot.addWidget(dialog)
    url = "https://inference.example.com:8000/v1/models"
    dialog.base_url_edit.setText(url)
    dialog.status_label.setText(f"{url}: the connection was refused")
    dialog.show()
    qtbot.waitExposed(dialog)
    metrics = dialog.fontMetrics()
    assert dialog.base_url_edit.width() > metrics.horizontalAdvance(url)  # the whole URL shows in its field
    assert dialog.status_label.width() >= metrics.horizontalAdvance(url)  # a URL in an error is never broken

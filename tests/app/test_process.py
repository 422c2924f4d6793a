"""The app as a real process: killed mid-answer, smoke mode, start-up report."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The app in a child process: load the default model, send a long question, print every text the answer
# widget puts on screen (after the tab has saved it), until the parent kills it.
CHILD = textwrap.dedent("""
    import json, sys
    from PySide6.QtWidgets import QApplication
    from app.db import Database
    from app.engine_client import EngineClient
    from app.main_window import MainWindow

    app = QApplication([])
    db = Database(sys.argv[1])
    client = EngineClient()
    window = MainWindow(db, client, theme_choice="light")
    window.show()
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 400})

    def on_loaded(info):
        tab.composer.setPlainText("Write a long story about a lighthouse keeper and a storm.")
        tab.send()
        widget = tab.chat_view.widgets[-1]
        widget.rendered.connect(lambda text: print(json.dumps(text), flush=True))

    client.model_loaded.connect(on_loaded)
    window.load_model(None)
    app.exec()
""")


def app_env(**extra) -> dict:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


@pytest.mark.slow
def test_killing_the_app_mid_answer_loses_nothing_that_was_shown(tmp_path):
    from app.db import Database

    path = tmp_path / "kvboost.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env=app_env(), cwd=ROOT)
    shown = []
    try:
        deadline = time.monotonic() + 300
        while len(shown) < 8 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            shown.append(json.loads(line))
        assert len(shown) >= 8, "the child never streamed an answer"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        rest, _ = child.communicate(timeout=60)
    shown += [json.loads(line) for line in rest.splitlines() if line.strip()]
    last_shown = max(shown, key=len)
    db = Database(path)
    try:
        answer = db.messages(1)[-1]
        assert answer["role"] == "assistant" and answer["status"] == "streaming"
        assert len(last_shown) > 20 and answer["content"].startswith(last_shown)
        assert db.mark_interrupted() == 1
        assert db.messages(1)[-1]["status"] == "interrupted"
    finally:
        db.close()


@pytest.mark.slow
def test_smoke_mode_answers_and_saves_a_screenshot(tmp_path):
    out = tmp_path / "smoke.png"
    run = subprocess.run([sys.executable, "-m", "app.main", "--smoke", str(out), "--home", str(tmp_path / "home")],
                         capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "home" / "data" / "kvboost.sqlite3").exists()
    assert "(0 from disk)" in run.stderr
    assert list((tmp_path / "home" / "cache" / "kv" / "payloads").rglob("*.kv")), "KV written to the home's disk tier"

    # A restart: the conversation reopens and its next question reuses the first turn's KV from disk.
    again = subprocess.run([sys.executable, "-m", "app.main", "--smoke", str(out), "--home", str(tmp_path / "home")],
                           capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    match = re.search(r"(\d+) reused \((\d+) from disk\)", again.stderr)
    assert match and int(match.group(2)) > 0 and int(match.group(2)) == int(match.group(1)), again.stderr[-500:]


def test_smoke_mode_fails_loudly_on_a_bad_model(tmp_path):
    run = subprocess.run([sys.executable, "-m", "app.main", "--smoke", str(tmp_path / "x.png"), "--home",
                          str(tmp_path / "home"), "--model", str(tmp_path / "no-such-model")],
                         capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=300)
    assert run.returncode == 1
    assert "no-such-model" in run.stderr
    assert not (tmp_path / "x.png").exists()


def test_start_up_report_shows_the_window_before_the_model(tmp_path):
    home = tmp_path / "home"
    from app.db import Database

    (home / "data").mkdir(parents=True)
    db = Database(home / "data" / "kvboost.sqlite3")
    conversation = db.create_conversation(title="Earlier")
    for i in range(20):
        db.add_message(conversation["id"], "user" if i % 2 == 0 else "assistant", f"message {i} " * 30)
    db.close()
    run = subprocess.run([sys.executable, "-m", "app.main", "--report-startup", "--home", str(home)],
                         capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "20 messages shown" in run.stdout and "model loaded: False" in run.stdout

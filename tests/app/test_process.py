"""The app as a real process: killed mid-answer, smoke mode, start-up report."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import app_env

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


# -- start-up failures and a second start on one home ----------------------------------------------------

# Holds the write lock on a database (BEGIN EXCLUSIVE) until killed.
HOLD_LOCK = textwrap.dedent("""
    import sqlite3, sys, time
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    print("locked", flush=True)
    time.sleep(120)
""")


def one_line_error(run: subprocess.CompletedProcess) -> str:
    """The app's error line; asserts there is exactly one and no traceback."""
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("kvboost-desktop:")]
    assert len(lines) == 1, run.stderr[-2000:]
    return lines[0]


def test_a_database_locked_by_another_process_is_a_clear_error_at_start_up(tmp_path):
    from app.db import Database

    database = tmp_path / "home" / "data" / "kvboost.sqlite3"
    database.parent.mkdir(parents=True)
    Database(database).close()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(database)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        run = subprocess.run([sys.executable, "-m", "app.main", "--report-startup", "--home", str(tmp_path / "home")],
                             capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert run.returncode == 2, run.stderr[-2000:]
    line = one_line_error(run)
    assert str(database) in line and "locked by another process" in line


def test_settings_of_a_newer_version_are_a_clear_error_and_stay_as_they_were(tmp_path):
    from app import settings
    from app.db import Database

    database = tmp_path / "home" / "data" / "kvboost.sqlite3"
    database.parent.mkdir(parents=True)
    db = Database(database)
    db.set_settings({"schema_version": settings.SCHEMA_VERSION + 1, "theme": "dark", "future": {"kept": True}})
    db.close()
    run = subprocess.run([sys.executable, "-m", "app.main", "--report-startup", "--home", str(tmp_path / "home")],
                         capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "newer" in one_line_error(run)
    db = Database(database)
    assert db.get_setting("schema_version") == settings.SCHEMA_VERSION + 1
    assert db.get_setting("future") == {"kept": True}


@pytest.mark.parametrize("blocked", ["home", "data"])
def test_a_home_or_data_folder_that_is_a_file_is_a_clear_error(tmp_path, blocked):
    home = tmp_path / "home"
    if blocked == "home":
        home.write_text("not a folder")
        in_the_way = home
    else:
        home.mkdir()
        in_the_way = home / "data"
        in_the_way.write_text("not a folder")
    run = subprocess.run([sys.executable, "-m", "app.main", "--report-startup", "--home", str(home)],
                         capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    line = one_line_error(run)
    assert f"{in_the_way} is a file" in line
    assert in_the_way.read_text() == "not a folder"


def start_first_instance(home: Path) -> subprocess.Popen:
    """The app as a real process on `home` (with a model path that fails to load at once: no weights needed),
    returned once it holds the home's single-instance lock."""
    first = subprocess.Popen([sys.executable, "-m", "app.main", "--home", str(home), "--model",
                              str(home / "no-such-model")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=app_env(), cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (home / "data" / "kvboost-desktop.lock").exists():
        assert first.poll() is None, first.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the first instance never took the lock"
        time.sleep(0.1)
    return first


def test_a_second_start_hands_its_files_to_the_running_app_and_exits(tmp_path):
    from app.db import Database

    home = tmp_path / "home"
    notes = tmp_path / "notes.txt"
    notes.write_text("The lighthouse keeper logs every storm in a red notebook.\n")
    first = start_first_instance(home)
    try:
        second = subprocess.run([sys.executable, "-m", "app.main", "--home", str(home), str(notes)],
                                capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=120)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "already running" in second.stdout and "1 file" in second.stdout
        deadline = time.monotonic() + 30
        attached = []
        while not attached and time.monotonic() < deadline:  # the first instance indexes and attaches it
            time.sleep(0.2)
            with Database(home / "data" / "kvboost.sqlite3") as db:
                attached = [document["path"] for conversation in db.conversations(open_only=True)
                            for document in db.conversation_documents(conversation["id"])]
        assert attached == [str(notes)]
        assert first.poll() is None, "the first instance keeps running"
    finally:
        first.kill()
        first.wait()
    log = (home / "logs" / "kvboost-desktop.log").read_text()
    assert "a second start handed over 1 file(s)" in log


def test_a_lock_left_by_a_crashed_app_does_not_block_the_next_start(tmp_path):
    home = tmp_path / "home"
    first = start_first_instance(home)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert (home / "data" / "kvboost-desktop.lock").exists()
    run = subprocess.run([sys.executable, "-m", "app.main", "--report-startup", "--home", str(home)],
                         capture_output=True, text=True, env=app_env(), cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "window up" in run.stdout

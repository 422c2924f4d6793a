"""Quitting by signal, as a real process (offscreen): SIGTERM (logout, shutdown, `kill`) and SIGINT (Ctrl+C) while
the model loads and while an answer streams. Each exits 0 within seconds, without an abort, and keeps what was
on screen."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_process import app_env  # noqa: E402

# The real app's entry (app.main.main) on a home; quitting while the model is still loading.
LOADING = [sys.executable, "-m", "app.main", "--home"]

# The window as the app builds it, the app's own signal handling, a long answer streaming; every render is
# printed once the tab has saved it.
ANSWERING = textwrap.dedent("""
    import json, sys
    from PySide6.QtWidgets import QApplication
    from app.db import Database
    from app.engine_client import EngineClient
    from app.main import install_quit_signals
    from app.main_window import MainWindow

    app = QApplication([])
    db = Database(sys.argv[1])
    client = EngineClient()
    window = MainWindow(db, client, theme_choice="light")
    window.show()
    install_quit_signals(window)
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 400})

    def on_loaded(info):
        tab.composer.setPlainText("Write a long story about a lighthouse keeper and a storm.")
        tab.send()
        tab.chat_view.widgets[-1].rendered.connect(lambda text: print(json.dumps(text), flush=True))

    client.model_loaded.connect(on_loaded)
    window.load_model(None)
    app.lastWindowClosed.connect(app.quit)
    app.exec()
    client.shutdown()
    db.close()
    print("EXITED", flush=True)
""")


def wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_model_loads_exits_0_without_an_abort(tmp_path, signum):
    for attempt in range(3):
        home = tmp_path / f"home{attempt}"
        child = subprocess.Popen(LOADING + [str(home)], env=app_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            wait_for_file(home / "data" / "kvboost.sqlite3", 60)  # the window is up, the model loading behind it
            time.sleep(0.5 + attempt)  # at different stages of the load: importing torch, reading the weights
            t0 = time.monotonic()
            child.send_signal(signum)
            out, err = child.communicate(timeout=60)
        finally:
            child.kill()
        assert child.returncode == 0, err[-2000:]
        assert time.monotonic() - t0 < 20
        assert "terminate called" not in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_answering_saves_what_was_shown_and_exits_0(tmp_path, signum):
    from app.db import Database

    path = tmp_path / "kvboost.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", ANSWERING, str(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=app_env(), cwd=ROOT)
    shown = []
    try:
        deadline = time.monotonic() + 300
        while len(shown) < 6 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            shown.append(json.loads(line))
        assert len(shown) >= 6, "the child never streamed an answer"
        t0 = time.monotonic()
        child.send_signal(signum)
        rest, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0 and time.monotonic() - t0 < 20, err[-2000:]
    lines = rest.splitlines()
    assert lines and lines[-1] == "EXITED"
    shown += [json.loads(line) for line in lines[:-1] if line.strip()]
    db = Database(path)
    try:
        answer = db.messages(1)[-1]
        assert answer["status"] == "interrupted"  # saved as shown at quit, not left "streaming"
        assert answer["content"].startswith(max(shown, key=len)) and len(answer["content"]) > 10
    finally:
        db.close()

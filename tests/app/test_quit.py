"""Quitting by signal, as a real process (offscreen): SIGTERM (logout, shutdown, `kill`) and SIGINT (Ctrl+C) while
the model loads and while an answer streams, 20 times in a row. Each exits 0 within seconds, without an abort,
and keeps what was on screen."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import ROOT, app_env

# The real app's entry (app.main.main) on a home, with the default model; quitting while it is still loading.
LOADING = [sys.executable, "-m", "app.main", "--home"]

# The window as app.main builds it, with its signal handling and its way of closing down (app.main's QuitSignals,
# close_down, leave); the model in argv[2], a long answer streaming; every render is printed once the tab has
# saved it.
ANSWERING = textwrap.dedent("""
    import json, sys
    from PySide6.QtWidgets import QApplication
    from app.db import Database
    from app.engine_client import EngineClient
    from app.main import QuitSignals, close_down, leave
    from app.main_window import MainWindow

    app = QApplication([])
    quit_signals = QuitSignals()
    db = Database(sys.argv[1])
    client = EngineClient()
    window = MainWindow(db, client, theme_choice="light")
    window.show()
    quit_signals.attach(window)
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": int(sys.argv[3])})

    def on_loaded(info):
        tab.composer.setPlainText("w10 w11 w12 w13 w14")
        tab.send()
        tab.chat_view.widgets[-1].rendered.connect(lambda text: print(json.dumps(text), flush=True))

    client.model_loaded.connect(on_loaded)
    window.load_model(sys.argv[2])
    app.lastWindowClosed.connect(app.quit)
    app.exec()
    ended = close_down(window, client, db)
    print("EXITED", flush=True)
    sys.exit(leave(0, ended))
""")

# A tiny random Llama that never emits EOS: its answers run to max_new_tokens, long enough to quit during.
LONG_CONTEXT = 8192
ANSWER_TOKENS = 8000
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
EXIT_WITHIN_S = 15  # the shutdown deadline (3 s) and a loaded machine's slack


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
    from tiny_models import build_model, build_tokenizer

    folder = tmp_path_factory.mktemp("tiny-chat-model")
    model, tokenizer = build_model("llama"), build_tokenizer()
    model.config.max_position_embeddings = LONG_CONTEXT
    tokenizer.chat_template = CHAT_TEMPLATE
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def wait_for_file(path: Path, timeout_s: float, contains: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() or (contains is not None and contains not in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{path.name} never appeared" + (f" with {contains!r}" if contains else "")
        time.sleep(0.05)


def assert_clean_exit(child: subprocess.Popen, err: str, seconds: float, what: str) -> None:
    assert child.returncode == 0, f"{what}: exit code {child.returncode}\n{err[-2000:]}"
    assert "terminate called" not in err and "Traceback" not in err and "Abort" not in err, f"{what}:\n{err[-2000:]}"
    assert seconds < EXIT_WITHIN_S, f"{what}: took {seconds:.1f} s to exit"


def quit_while_loading(home: Path, signum: int, after_load_began_s: float | None) -> float:
    """Starts the app on `home` and signals it while the model loads: right as the window comes up (torch is still
    being imported; None), or that many seconds after the load itself began. Returns the seconds to exit."""
    child = subprocess.Popen(LOADING + [str(home)], env=app_env(), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for_file(home / "data" / "kvboost.sqlite3", 60)  # its signal handling is in place from here on
        if after_load_began_s is not None:
            wait_for_file(home / "logs" / "kvboost-desktop.log", 120, contains="loading the model")
            time.sleep(after_load_began_s)
        t0 = time.monotonic()
        child.send_signal(signum)
        _out, err = child.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        child.kill()
    assert_clean_exit(child, err, seconds, f"{SIGNALS[signum]} while loading ({after_load_began_s})")
    return seconds


def quit_while_answering(database: Path, model: Path, signum: int) -> float:
    """Starts the window, sends a question, signals it once a few renders of the answer were saved; checks the
    answer on screen was kept as "interrupted". Returns the seconds to exit."""
    from app.db import Database

    child = subprocess.Popen([sys.executable, "-c", ANSWERING, str(database), str(model), str(ANSWER_TOKENS)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=app_env(), cwd=ROOT)
    shown = []
    try:
        deadline = time.monotonic() + 120
        while len(shown) < 4 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            shown.append(json.loads(line))
        assert len(shown) >= 4, f"the child never streamed an answer:\n{child.stderr.read()[-2000:]}"
        t0 = time.monotonic()
        child.send_signal(signum)
        rest, err = child.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        child.kill()
    what = f"{SIGNALS[signum]} while answering"
    assert_clean_exit(child, err, seconds, what)
    lines = rest.splitlines()
    assert lines and lines[-1] == "EXITED", what
    shown += [json.loads(line) for line in lines[:-1] if line.strip()]
    db = Database(database)
    try:
        answer = db.messages(1)[-1]
        assert answer["role"] == "assistant" and answer["status"] == "interrupted", (what, answer["status"])
        last_shown = max(shown, key=len)
        assert len(last_shown) > 10 and answer["content"].startswith(last_shown), what
        assert len(answer["content"].split()) < ANSWER_TOKENS, what  # the answer so far, not a finished one
    finally:
        db.close()
    return seconds


@pytest.mark.slow
def test_quitting_while_loading_and_while_answering_by_sigterm_and_sigint_20_times_in_a_row(
        tmp_path, tiny_model_folder):
    # Loading: as the window comes up (torch still importing), then at points through the weights' stage.
    moments = [None, 0.0, 0.7, 2.0, 5.0]
    exits = []
    for i, moment in enumerate(moments):
        for signum in SIGNALS:
            exits.append(quit_while_loading(tmp_path / f"home-{i}-{signum}", signum, moment))
            exits.append(quit_while_answering(tmp_path / f"answer-{i}-{signum}.sqlite3", tiny_model_folder,
                                              signum))
    assert len(exits) == 20
    print(f"20 quits, exit after the signal: max {max(exits):.1f} s, mean {sum(exits) / len(exits):.1f} s")

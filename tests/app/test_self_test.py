"""`kvboost-desktop --self-test` from source, the log standing in for missing stdout/stderr, Help > Open logs folder.

The installed (frozen) app runs the same self-test in packaging/linux/smoke.sh.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULT = re.compile(r"self-test ok: window shown after ([\d.]+) s, model loaded after ([\d.]+) s, first answer after "
                    r"([\d.]+) s .*screenshot (.+\.png)$", re.M)


def isolated_env(tmp_path: Path) -> dict:
    """A user with an empty home: every per-user folder (platformdirs reads HOME and the XDG variables) and the
    temporary folder inside tmp_path, no KVBOOST_HOME, no display."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVBOOST_HOME", "KVBOOST_CACHE_DIR", "QT_QPA_PLATFORM",
                                                              "DISPLAY", "WAYLAND_DISPLAY")}
    home = tmp_path / "user"
    for var, sub in (("XDG_DATA_HOME", ".local/share"), ("XDG_STATE_HOME", ".local/state"),
                     ("XDG_CACHE_HOME", ".cache"), ("XDG_CONFIG_HOME", ".config")):
        env[var] = str(home / sub)
    (tmp_path / "tmp").mkdir()
    env.update(HOME=str(home), TMPDIR=str(tmp_path / "tmp"), PYTHONPATH=str(ROOT))
    return env


def self_test(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.main", "--self-test", *args], capture_output=True, text=True,
                          env=isolated_env(tmp_path), cwd=tmp_path, timeout=timeout)


@pytest.mark.slow
def test_self_test_answers_offscreen_and_saves_a_screenshot(tmp_path):
    from PySide6.QtGui import QImage

    out = tmp_path / "shots"
    run = self_test(tmp_path, "--self-test-dir", str(out))
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    result = RESULT.search(run.stdout)
    assert result, run.stdout
    shown, loaded, answered = (float(result.group(i)) for i in (1, 2, 3))
    assert 0 < shown <= loaded <= answered
    assert "Paris" in run.stdout
    screenshot = Path(result.group(4))
    assert screenshot == out / "kvboost-self-test.png"
    image = QImage(str(screenshot))
    assert not image.isNull() and image.width() >= 600 and image.height() >= 400
    # A rendered window (text, widgets), not a blank frame: many distinct colours across a grid of samples.
    colours = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
    assert len(colours) > 20
    # Its own home under the temporary folder: the user's per-user folders are never created.
    assert not (tmp_path / "user").exists()
    assert list((tmp_path / "tmp").glob("kvboost-smoke-*/data/kvboost.sqlite3"))


def test_self_test_fails_with_the_reason_when_the_model_is_missing(tmp_path):
    out = tmp_path / "shots"
    missing = tmp_path / "no-such-model.gguf"
    run = self_test(tmp_path, "--model", str(missing), "--self-test-dir", str(out), timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr[-2000:]
    assert "self-test failed" in run.stderr and str(missing) in run.stderr
    assert "self-test ok" not in run.stdout
    assert not out.exists()


@pytest.mark.slow
def test_self_test_fails_when_the_screenshot_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    run = self_test(tmp_path, "--self-test-dir", str(blocker / "shots"))
    assert run.returncode == 1, run.stdout + run.stderr[-2000:]
    assert f"cannot create the screenshot folder {blocker / 'shots'}" in run.stderr
    assert "self-test ok" not in run.stdout


# What a frozen windowed app starts with: no stdout, no stderr. Prints and an uncaught traceback must end up in the
# log file instead of raising (AttributeError: 'NoneType' object has no attribute 'write').
NO_STREAMS = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.stdout = sys.stderr = None
    from app.main import route_missing_streams, setup_logging
    route_missing_streams()
    print("printed before the log is open")
    setup_logging(Path(sys.argv[1]))
    print("printed", "to", "stdout")
    print("half a line", end="")
    sys.stdout.flush()
    print("warned on stderr", file=sys.stderr)
    1 / 0
""")


def test_without_stdout_and_stderr_prints_and_tracebacks_go_to_the_log(tmp_path):
    run = subprocess.run([sys.executable, "-c", NO_STREAMS, str(tmp_path)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=120)
    assert run.returncode == 1  # the ZeroDivisionError
    assert run.stdout == "" and run.stderr == ""
    log = (tmp_path / "kvboost-desktop.log").read_text()
    assert "INFO stdout: printed to stdout" in log
    assert "INFO stdout: half a line" in log
    assert "WARNING stderr: warned on stderr" in log
    assert "WARNING stderr: ZeroDivisionError: division by zero" in log
    assert "before the log is open" not in log


def test_help_open_logs_folder_opens_the_folder_of_the_log_file(qtbot, db, client, aio_loop, tmp_path):
    import logging

    from PySide6.QtCore import QObject, QUrl, Slot
    from PySide6.QtGui import QAction, QDesktopServices

    from app.main_window import MainWindow

    class Opener(QObject):
        def __init__(self):
            super().__init__()
            self.urls: list[QUrl] = []

        @Slot(QUrl)
        def open(self, url):
            self.urls.append(url)

    logs = tmp_path / "logs"
    logs.mkdir()
    handler = logging.FileHandler(logs / "kvboost-desktop.log")
    logging.getLogger().addHandler(handler)
    opener = Opener()
    QDesktopServices.setUrlHandler("file", opener, "open")
    try:
        window = MainWindow(db, client, theme_choice="light")
        qtbot.addWidget(window)
        help_menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&Help")
        action = window.findChild(QAction, "openLogsAction")
        assert action in help_menu.actions() and action.text() == "Open logs folder"
        action.trigger()
    finally:
        QDesktopServices.unsetUrlHandler("file")
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert opener.urls == [QUrl.fromLocalFile(str(logs))]

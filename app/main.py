"""`kvboost-desktop`: starts the window at once, then loads the model in the background.

`kvboost-desktop --smoke OUT.png` runs the real app offscreen: loads the model, opens a tab, sends one
message, waits for the reply, saves a screenshot, prints the reply and exits 0 (non-zero on any failure).
`kvboost-desktop --self-test` is the same check for an installed app: the bundled default model, a screenshot
into the log folder (or --self-test-dir), the timings from process start, exit 0 or 1 with the reason.

One app runs per home: a second `kvboost-desktop [FILE ...]` on the same home hands its files to the running
one (which comes to the front and adds them to the current conversation) and exits 0. A folder or database
the app cannot use is one line on stderr naming it, and exit code 2.

Over 400 lines: start-up and shut-down in one place: arguments, logging, one instance per home, the window or why it
cannot open, and quitting within a deadline."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import io
import logging
import logging.handlers
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

SMOKE_QUESTION = "What is the capital of France?"
SMOKE_ANSWER = "paris"  # the self-test fails on an answer without it (a broken tokenizer, a wrong model file)
SELF_TEST_SCREENSHOT = "kvboost-self-test.png"
# The window icon's sizes in resources/icons (kvboost-SIZE.png).
ICON_SIZES = (16, 32, 48, 64, 128, 256, 512)
# Quitting gives the engine thread this long to end (a cancelled answer stops within a token, a cancelled model
# load at its next stage); past it, the process leaves without waiting (see leave()).
SHUTDOWN_DEADLINE_S = 3.0


def app_version() -> str:
    """The installed version (without importing the engine, which would load torch)."""
    try:
        return importlib.metadata.version("kvboost-desktop")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvboost-desktop", description="KVBoost Desktop: private chat over your "
                                "documents with a local model that never computes the same text twice.")
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="documents (or folders) to add to the current conversation; with the app already "
                   "running on this home, they are handed to it")
    p.add_argument("--model", default=None, help="model to load instead of the saved choice (HF folder, .gguf "
                   "file, or a hub id in the local HF cache)")
    p.add_argument("--home", default=None, help="keep data, logs and caches under this folder instead of the "
                   "per-user folders (also: KVBOOST_HOME)")
    from .settings import THEMES

    p.add_argument("--theme", choices=THEMES, default=None, help="the colour theme (saved as the app's choice)")
    p.add_argument("--smoke", metavar="OUT.png", default=None,
                   help="offscreen self-test: one message through the real app, screenshot to OUT.png")
    p.add_argument("--self-test", action="store_true",
                   help="check an installed app offscreen: load the default (bundled) model, answer one question, "
                   "save a screenshot, print the timings; exit 0, or 1 with the reason")
    p.add_argument("--self-test-dir", metavar="DIR", default=None,
                   help="self-test: write the screenshot here instead of the log folder")
    p.add_argument("--timeout", type=float, default=600.0, help="smoke mode and self-test: give up after this many "
                   "seconds")
    p.add_argument("--report-startup", action="store_true",
                   help="print how long the window took to come up (from process start) and exit")
    p.add_argument("--version", action="version", version=f"kvboost-desktop {app_version()}")
    p.add_argument("--check-window", action="store_true",
                   help="say whether the window can open here (exit 0), or what the system lacks (exit 3)")
    return p


def setup_logging(log_dir) -> None:
    handler = logging.handlers.RotatingFileHandler(log_dir / "kvboost-desktop.log", maxBytes=2_000_000,
                                                   backupCount=3, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)


class LogStream(io.TextIOBase):
    """Stands in for a missing sys.stdout or sys.stderr: a frozen windowed app (Windows, a macOS .app) starts
    without them, and the first print or traceback would raise. Each line becomes one record of the `name`
    logger, i.e. a line of kvboost-desktop.log once setup_logging has run (nothing is kept before that)."""

    def __init__(self, name: str, level: int):
        super().__init__()
        self._log = logging.getLogger(name)
        self._level = level
        self._pending = ""
        # NOTE: logging reports its own failures on sys.stderr, i.e. here; such a write is dropped, not looped.
        self._inside = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if getattr(self._inside, "active", False):
            return len(text)
        self._inside.active = True
        try:
            *lines, self._pending = (self._pending + text).split("\n")
            for line in lines:
                if line.strip():
                    self._log.log(self._level, "%s", line)
        finally:
            self._inside.active = False
        return len(text)

    def flush(self) -> None:
        if self._pending.strip():
            self.write("\n")


def route_missing_streams() -> None:
    """Gives a frozen windowed app the sys.stdout / sys.stderr it lacks (see LogStream); a no-op otherwise."""
    if sys.stdout is None:
        sys.stdout = LogStream("stdout", logging.INFO)
    if sys.stderr is None:
        sys.stderr = LogStream("stderr", logging.WARNING)


def window_icon():
    """The app icon from resources/icons, which sits beside the packages both in a source checkout and in the
    frozen bundle (packaging/kvboost-desktop.spec puts it there); an installed Linux package's theme icon
    otherwise. A null icon (Qt's default) when neither exists."""
    from PySide6.QtCore import QSize
    from PySide6.QtGui import QIcon

    folder = Path(__file__).resolve().parent.parent / "resources" / "icons"
    icon = QIcon()
    for size in ICON_SIZES:
        file = folder / f"kvboost-{size}.png"
        if file.is_file():
            icon.addFile(str(file), QSize(size, size))
    return icon if not icon.isNull() else QIcon.fromTheme("kvboost-desktop")


def fail(message: str) -> int:
    """A start-up failure the user can fix (a folder, a locked or unusable database): one line, exit 2."""
    print(f"kvboost-desktop: {message}", file=sys.stderr)
    return 2


WINDOW_UNAVAILABLE = 3  # the exit status when the window cannot open here (scripts/run.sh then starts the chat)


def main(argv=None) -> int:
    # Documents are read in worker processes (app.document_worker); in a frozen build the spawned worker starts
    # this same executable, which must then run the worker instead of the app.
    multiprocessing.freeze_support()
    route_missing_streams()
    args = build_parser().parse_args(argv)
    if args.smoke or args.self_test:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        if args.home is None and "KVBOOST_HOME" not in os.environ:
            args.home = tempfile.mkdtemp(prefix="kvboost-smoke-")  # never touches the user's conversations
    from .platform_check import no_display, window_problem

    problem = window_problem()  # before Qt: a missing X11 library makes it abort the process
    if problem is None and args.check_window and no_display():
        problem = "no display (neither DISPLAY nor WAYLAND_DISPLAY is set)"
    if problem is not None:
        print(f"kvboost-desktop: cannot open the window: {problem}\nThe terminal chat needs no window: "
              ".venv/bin/kvboost chat (bash scripts/run.sh starts it by itself).", file=sys.stderr)
        return WINDOW_UNAVAILABLE
    if args.check_window:
        print("kvboost-desktop: the window can open here")
        return 0
    from PySide6.QtWidgets import QApplication

    from .paths import FolderError, app_paths
    from .single_instance import SingleInstance

    paths = app_paths(args.home)
    try:
        paths.ensure()
        setup_logging(paths.log_dir)
    except FolderError as exc:
        return fail(str(exc))
    except OSError as exc:  # the log file
        return fail(f"cannot write the log in {paths.log_dir}: {exc.strerror or exc}")
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("KVBoost Desktop")
    app.setDesktopFileName("kvboost-desktop")  # Wayland and the taskbar match the window to the .desktop file
    app.setWindowIcon(window_icon())
    files = [str(Path(f).resolve()) for f in args.files]
    instance = SingleInstance(paths.data_dir)
    try:
        first = instance.acquire()
    except FolderError as exc:
        return fail(str(exc))
    if not first:
        if args.smoke or args.self_test or args.report_startup:
            return fail(f"KVBoost Desktop is already running on {paths.data_dir}; a self-test needs its own home")
        if instance.send(files):
            print(f"KVBoost Desktop is already running on {paths.data_dir}: handed it {len(files)} file(s) and "
                  "brought its window to the front.")
            return 0
        return fail(f"KVBoost Desktop is already running on {paths.data_dir} (lock {instance.lock_path}) but did "
                    "not answer; close it, or remove the lock file if no KVBoost Desktop is running")
    quit_signals = QuitSignals()  # before the database is opened: from then on a signal quits cleanly
    try:
        code, engine_thread_ended = run_app(app, args, paths, files, instance, quit_signals)
    finally:
        instance.release()
    return leave(code, engine_thread_ended)


class QuitSignals:
    """SIGTERM (logout, shutdown, `kill`) and SIGINT (Ctrl+C) close the window like File > Quit: what is on
    screen is saved and the app exits 0. A signal that comes before the window exists closes it as soon as it is
    attached. Qt's event loop runs in C++, so a timer lets Python see the signal."""

    def __init__(self):
        import signal

        self.window = None
        self.received: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)

    def attach(self, window) -> None:
        from PySide6.QtCore import QTimer

        self.window = window
        heartbeat = QTimer(window)
        heartbeat.timeout.connect(lambda: None)
        heartbeat.start(200)
        if self.received is not None:
            QTimer.singleShot(0, window.close)

    def _on_signal(self, signum, _frame) -> None:
        from PySide6.QtCore import QTimer

        logging.getLogger(__name__).info("signal %d: quitting", signum)
        self.received = signum
        if self.window is not None:
            QTimer.singleShot(0, self.window.close)


def close_down(window, client, db, deadline_s: float = SHUTDOWN_DEADLINE_S) -> bool:
    """Quitting, however it came (Quit, the window closed, a signal, an error): every tab saves what it shows
    (an answer being written as "interrupted") and stops its work, the engine's jobs are cancelled and its
    thread given `deadline_s` to end, the database is closed. Returns whether the engine thread ended."""
    window.close()
    ended = client.shutdown(deadline_s)
    db.close()
    return ended


def leave(code: int, engine_thread_ended: bool) -> int:
    """`code`, for main to return. While the engine thread is still inside torch (a model load stage, torch's own
    import: neither can be interrupted), the process exits here instead: everything is saved and closed, and
    interpreter shutdown would tear torch down under that thread, which aborts the process ("terminate called
    without an active exception")."""
    if not engine_thread_ended:
        logging.getLogger(__name__).info("the engine thread is still busy: leaving without it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def run_app(app, args, paths, files, instance, quit_signals: QuitSignals) -> tuple[int, bool]:
    """The first (only) app on this home: the window, the model loading behind it, the event loop. Returns the
    exit code and whether the engine thread ended by the shutdown deadline."""
    import qasync

    from . import settings
    from .db import Database, DatabaseError
    from .engine_client import EngineClient
    from .main_window import MainWindow

    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    try:
        db = Database(paths.database)
    except DatabaseError as exc:
        return fail(str(exc)), True
    try:
        interrupted = db.mark_interrupted()
        settings.load(db)  # a file of an earlier version migrates here; one of a newer version stops the start
    except (DatabaseError, settings.SettingsError) as exc:
        db.close()
        return fail(str(exc)), True
    # KV computed in one session answers the next (the engine's disk tier; shared with kvboost-server).
    client = EngineClient(engine_options={"disk_cache_dir": str(paths.kv_cache_dir)} if paths.kv_cache_dir else {})
    window = MainWindow(db, client, theme_choice=args.theme or "system")
    if args.theme:
        window.set_theme(args.theme)
    if interrupted:
        window.statusBar().showMessage(f"{interrupted} answer(s) were interrupted when the app last closed; "
                                       "what was shown is kept.", 10000)
    window.show()
    quit_signals.attach(window)

    def handed_over(paths: list[str]) -> None:
        logging.getLogger(__name__).info("a second start handed over %d file(s)", len(paths))
        window.open_files(paths)

    instance.files_received.connect(handed_over)
    model = settings.load(db).model
    source = args.model if args.model is not None else model.source
    # the saved options; the shared KV store's password comes from the OS keyring (app.model_menu)
    options = model.engine_options()
    # Let the window paint before the worker starts importing torch.
    from PySide6.QtCore import QTimer

    QTimer.singleShot(0, lambda: window.start_model(source, explicit=args.model is not None, **options))
    if files:
        QTimer.singleShot(0, lambda: window.open_files(files))
    code = 1
    try:
        with loop:
            if args.report_startup:
                code = loop.run_until_complete(report_startup(window))
            elif args.smoke:
                code = loop.run_until_complete(run_smoke(window, args.smoke, args.timeout))
            elif args.self_test:
                out_dir = Path(args.self_test_dir) if args.self_test_dir else paths.log_dir
                code = loop.run_until_complete(run_self_test(window, out_dir, args.timeout))
            else:
                app.lastWindowClosed.connect(loop.stop)
                loop.run_forever()
                code = 0
    finally:
        engine_thread_ended = close_down(window, client, db)
    return code, engine_thread_ended


def startup_ms() -> float:
    import psutil

    return (time.time() - psutil.Process().create_time()) * 1000


async def report_startup(window) -> int:
    """Prints when the window was up and its event loop turning (past conversations shown, composer
    waiting), measured from process start, while the model goes on loading in the background."""
    await asyncio.sleep(0)  # the first turn of the event loop: the window has been shown and painted
    up = startup_ms()
    ticks = []
    for _ in range(20):  # the loop keeps turning while torch is imported and the model loads
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        ticks.append((time.perf_counter() - t) * 1000)
    tab = window.current_tab()
    print(f"window up {up:.0f} ms after process start; {len(tab.chat_view.widgets)} messages shown; "
          f"model loaded: {window.client.is_loaded}; largest 10 ms-timer stall in the next 20 ticks "
          f"{max(ticks) - 10:.0f} ms", flush=True)
    return 0


async def wait_for(signal, timeout: float, *, failure=None):
    """The arguments of the next emission of `signal`; RuntimeError with the message if `failure` fires
    first; TimeoutError after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def done(*values):
        if not future.done():
            future.set_result(values)

    def failed(*values):
        if not future.done():
            future.set_exception(RuntimeError(str(values[-1])))

    signal.connect(done)
    if failure is not None:
        failure.connect(failed)
    try:
        return await asyncio.wait_for(future, timeout)
    finally:
        signal.disconnect(done)
        if failure is not None:
            failure.disconnect(failed)


async def ask_smoke_question(window, timeout: float) -> dict:
    """Waits for the model, sends SMOKE_QUESTION in the current tab as a user would, and returns the finished
    answer (app.answers.Answer). RuntimeError with the engine's message when loading or answering
    fails, TimeoutError past `timeout` seconds in all."""
    client = window.client
    t0 = time.monotonic()
    if not client.is_loaded:
        await wait_for(client.model_loaded, timeout, failure=client.model_load_failed)
    tab = window.current_tab() or window.new_conversation()
    # Greedy and short: the smoke test checks the pipeline, not the model's creativity.
    window.db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 48})
    tab.composer.setPlainText(SMOKE_QUESTION)
    tab.send()
    if tab.request is None:
        raise RuntimeError("the question was not sent (see the window's error)")
    (answer,) = await wait_for(tab.request.finished, timeout - (time.monotonic() - t0), failure=tab.request.failed)
    window.memory_meter.update_now()
    await asyncio.sleep(0.2)  # let the last render land before the screenshot
    return answer


async def run_smoke(window, out_path: str, timeout: float) -> int:
    t0 = time.monotonic()
    try:
        answer = await ask_smoke_question(window, timeout)
        if not window.grab().save(out_path):
            print(f"kvboost-desktop --smoke: could not write {out_path}", file=sys.stderr)
            return 1
        print(answer.text)
        stats = answer.stats or {}
        print(f"[smoke ok: {stats.get('prompt_tokens', 0)} prompt tokens, {stats.get('reused_tokens', 0)} reused "
              f"({stats.get('reused_by_tier', {}).get('disk', 0)} from disk), TTFT {stats.get('ttft_ms', 0):.0f} ms, "
              f"{time.monotonic() - t0:.1f} s in all]", file=sys.stderr)
        return 0 if answer.text.strip() else 1
    except (RuntimeError, TimeoutError, asyncio.TimeoutError) as exc:
        print(f"kvboost-desktop --smoke failed: {exc or 'timed out'}", file=sys.stderr)
        return 1


async def run_self_test(window, out_dir: Path, timeout: float) -> int:
    """--self-test: the smoke question through the real window, with the times from process start. Prints (and
    logs) one result line; on failure the reason, and exit code 1."""
    log = logging.getLogger(__name__)

    def failed(reason: str) -> int:
        log.error("self-test failed: %s", reason)
        print(f"kvboost-desktop --self-test failed: {reason}", file=sys.stderr, flush=True)
        return 1

    await asyncio.sleep(0)  # the first turn of the event loop: the window has been shown and painted
    shown_s = startup_ms() / 1000
    loaded: list[float] = []
    window.client.model_loaded.connect(lambda *_: loaded.append(startup_ms() / 1000))
    try:
        answer = await ask_smoke_question(window, timeout)
    except (RuntimeError, TimeoutError, asyncio.TimeoutError) as exc:
        return failed(str(exc) or f"no answer within {timeout:.0f} s")
    answered_s = startup_ms() / 1000
    text = answer.text.strip()
    if SMOKE_ANSWER not in text.lower():
        return failed(f"asked {SMOKE_QUESTION!r}, the answer does not say {SMOKE_ANSWER!r}: {text[:200]!r}")
    screenshot = out_dir / SELF_TEST_SCREENSHOT
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return failed(f"cannot create the screenshot folder {out_dir}: {exc.strerror or exc}")
    if not window.grab().save(str(screenshot)):
        return failed(f"could not write the screenshot {screenshot}")
    model = (window.client.model_info or {}).get("name", "?")
    # The model is loaded already when the window comes up only if loading finished first (never in practice).
    loaded_s = loaded[0] if loaded else shown_s
    line = (f"self-test ok: window shown after {shown_s:.1f} s, model loaded after {loaded_s:.1f} s, first answer "
            f"after {answered_s:.1f} s (from process start); model {model}; answer {text[:80]!r}; "
            f"screenshot {screenshot}")
    log.info(line)
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

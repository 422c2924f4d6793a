"""The `kvboost` command as users run it: a real process, real stdin/stdout."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KVBOOST = [sys.executable, "-m", "cli.kvboost"]
ROOT = Path(__file__).resolve().parents[2]


def run(args, stdin=None, timeout=300, home=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"KVBOOST_HOME": str(home)} if home else {}))
    return subprocess.run(KVBOOST + args, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


@pytest.mark.slow
def test_chat_answers_and_reuses_the_conversation(tmp_path):
    proc = run(["chat", "--max-new-tokens", "24", "--threads", "2"],
               stdin="What is the capital of France?\nAnd what language do people speak there?\n/stats\n"
                     "/stats json\n/quit\n", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    # piped, nothing echoes the question: the chat does, so each answer starts a line of its own
    assert "you> What is the capital of France?\nbot> " in proc.stdout
    assert "you> And what language do people speak there?\nbot> " in proc.stdout
    reused = [int(m) for m in re.findall(r"(\d+)% reused", proc.stderr)]
    assert len(reused) == 2
    assert reused[0] == 0 and reused[1] >= 40  # the second turn reuses the first turn and its answer
    summary = re.search(r"cache: (\d+) entries, (\d+) tokens, .+\nreused (\d+) times", proc.stdout)
    assert summary and int(summary[1]) > 0 and int(summary[3]) > 0  # /stats: a few lines, not the whole JSON
    assert '"hits"' in proc.stdout  # /stats json: all of it


@pytest.mark.parametrize("command, name", [(["-m", "cli.kvboost"], "kvboost"), (["-m", "cli.server"], "kvboost-server"),
                                           (["-m", "app.main"], "kvboost-desktop")])
def test_every_command_says_its_version(command, name):
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    done = subprocess.run([sys.executable, *command, "--version"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout == f"{name} {version}\n", done.stderr


def test_bad_model_path_is_a_clear_error_with_exit_code_2(tmp_path):
    proc = run(["run", "--model", str(tmp_path / "missing.gguf"), "hello"], timeout=120)
    assert proc.returncode == 2
    assert "GGUF file not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_load_shows_its_progress_and_what_it_holds(tmp_path):
    """A GGUF's load prints each decoder layer as it is filled, then the format auto chose, why, and the mix."""
    from gguf_files import tiny_gguf

    path = tiny_gguf(tmp_path / "tiny.gguf", "Q4_K")
    proc = run(["run", "--model", str(path), "--max-new-tokens", "2", "--disk-cache-bytes", "0", "hi"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "layer 1 of 2 (1/3)" in proc.stderr and "layer 2 of 2 (2/3)" in proc.stderr
    loaded = next(line for line in proc.stderr.splitlines() if line.startswith("loaded "))
    assert "auto: the file's decoder weights are 4-bit codes" in loaded
    from engine.weights.gguf_blocks import expected_unavailable

    form = "blocks" if expected_unavailable() is None else "int4"  # the file's blocks where the block kernel runs
    assert f"Q4_K->{form} x14" in loaded and " MiB" in loaded


def on_a_terminal(args, typed: str = "", timeout=300, then=()) -> tuple[int, str]:
    """`kvboost ARGS` with its stdin, stdout and stderr on one pseudo-terminal, as in a terminal window, `typed`
    typed into it: (exit code, all it wrote there). `then`: (text, action) pairs in order, each action(process,
    type) called once the output shows its text (type(str) types more)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(KVBOOST + args, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    os.close(slave)
    os.write(master, typed.encode())
    written, deadline, then = [], time.monotonic() + timeout, list(then)
    try:
        while True:
            if then and then[0][0].encode() in b"".join(written):
                then.pop(0)[1](proc, lambda text: os.write(master, text.encode()))
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"kvboost {args[0]} did not end in {timeout} s: {b''.join(written)[-2000:]!r}")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not data:
                break
            written.append(data)
        return proc.wait(timeout=60), b"".join(written).decode()
    finally:
        proc.kill()
        os.close(master)


def as_shown(screen: str) -> list[str]:
    """The lines a terminal shows for `screen`: a carriage return goes back to the line's start, ESC [ K erases to
    its end, characters overwrite."""
    lines, line, column, i = [], [], 0, 0
    while i < len(screen):
        if screen.startswith("\x1b[K", i):
            del line[column:]
            i += 3
            continue
        char, i = screen[i], i + 1
        if char == "\r":
            column = 0
        elif char == "\n":
            lines.append("".join(line))
            line, column = [], 0
        else:
            line[column:column + 1] = [char]
            column += 1
    return lines + ["".join(line)]


def test_a_long_prompt_says_how_far_it_has_been_read_on_a_terminal_only(tmp_path):
    """On a terminal, a prompt read in pieces rewrites one line after each piece, and the line is erased before the
    answer's first character; where stderr is not a terminal (a pipe, a log) nothing of it is written."""
    from gguf_files import tiny_gguf

    path = tiny_gguf(tmp_path / "tiny.gguf", "Q4_K")
    options = ["--model", str(path), "--max-new-tokens", "3", "--disk-cache-bytes", "0", "--temperature", "0",
               "--prefill-piece-tokens", "16"]
    code, screen = on_a_terminal(["run", *options, "counting " * 60])
    assert code == 0, screen
    shown = [(int(m[1]), int(m[2])) for m in re.finditer(r"\r  reading the prompt: (\d+) of (\d+) tokens", screen)]
    total = shown[-1][1] if shown else 0
    assert total > 48 and [done for done, _ in shown] == list(range(16, total, 16))[:len(shown)] \
        and len(shown) == (total - 1) // 16, screen
    after = screen[screen.rindex("reading the prompt"):]
    assert after.index("\r\x1b[K") < after.index("\n"), after  # erased before anything else, the answer included
    assert not any("reading the prompt" in line for line in as_shown(screen))
    piped = run(["run", *options, "counting " * 60])
    assert piped.returncode == 0 and "reading the prompt" not in piped.stderr + piped.stdout, piped.stderr

    # the chat: the answer's line keeps its "bot> " (the progress line is drawn over it and erased)
    code, screen = on_a_terminal(["chat", *options, "--temporary"], typed="counting " * 60 + "\n/quit\n")
    assert code == 0 and "reading the prompt: 16 of" in screen, screen
    answers = [line for line in as_shown(screen) if line.startswith("bot> ")]
    assert len(answers) == 1 and len(answers[0]) > len("bot> "), as_shown(screen)
    assert not any("reading the prompt" in line for line in as_shown(screen))


@pytest.mark.slow
def test_ctrl_c_while_a_prompt_is_read_stops_it_and_clears_its_line(tmp_path):
    """Ctrl+C while the real model reads a long question: the progress line goes, the answer's line says it
    stopped, and the chat goes on to the next question."""
    question = "Summarize: " + "the harbour opens at dawn and closes at dusk. " * 150
    code, screen = on_a_terminal(["chat", "--prefill-piece-tokens", "16", "--max-new-tokens", "8", "--temporary"],
                                 typed=question + "\n", timeout=600,
                                 then=[("reading the prompt: 32 of", lambda proc, _: proc.send_signal(signal.SIGINT)),
                                       ("[stopped]", lambda _, type_: type_("What is the capital of France?\n")),
                                       ("tok/s]", lambda _, type_: type_("/quit\n"))])
    shown = as_shown(screen)
    assert code == 0, shown
    at = shown.index("[stopped]")
    assert shown[at - 1] == "bot> " and not any("reading the prompt" in line for line in shown), shown
    assert any(line.startswith("bot> ") and "Paris" in line for line in shown[at:]), shown


def run_without_model(args):
    """`kvboost ARGS` in a fresh process (processes.NO_TORCH: it reports whether torch was imported)."""
    from processes import NO_TORCH, child_env

    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=child_env())


def test_models_list_names_the_built_in_model_without_torch(tmp_path):
    from engine.weights.loader import default_model_path

    done = run_without_model(["models", "--cache-dir", str(tmp_path), "list"])
    assert done.returncode == 0, done.stderr
    builtin = default_model_path()
    assert f"built-in  {builtin.name}" in done.stdout and str(builtin) in done.stdout
    assert "nothing downloaded" in done.stderr
    assert "torch imported: False" in done.stdout


def _actions(parser):
    """Every option of `parser` and of its subcommands, as (command path, action)."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for path, inner in _actions(sub):
                    yield (name, *path), inner
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield (), action


def test_every_option_of_every_command_says_what_it_does():
    from cli.kvboost import build_parser
    from cli.server import build_server_parser as server_parser

    missing = [f"{prog} {' '.join(path)} {action.option_strings[0]}"
               for prog, parser in (("kvboost", build_parser()), ("kvboost-server", server_parser()))
               for path, action in _actions(parser) if not action.help]
    assert missing == []


def test_cache_stats_names_the_ram_budget_and_where_it_came_from_beside_the_disk_tier(tmp_path):
    from engine.ram_budget import machine_ram_budget

    done = run_without_model(["cache", "stats", "--dir", str(tmp_path / "nothing")])
    assert done.returncode == 0, done.stderr
    ram = machine_ram_budget()
    ram_line = next(line for line in done.stdout.splitlines() if line.startswith("RAM tiers:"))
    # the rule read again here: it names the same bound unless the free memory moved by a lot meanwhile
    assert f"{ram.bytes / (1 << 30):.1f} GB budget (default: {ram.rule};" in ram_line, ram_line
    assert "no disk KV cache" in done.stdout and "torch imported: False" in done.stdout


def test_chat_stats_show_each_ram_tier_filled_against_its_budget(smollm):
    from cli.kvboost import stats_summary

    eng = smollm.with_options(cache_bytes=24 << 20, cpu_cache_bytes=0)
    empty = stats_summary(eng.cache_stats())
    assert "  device: 0 entries, 0 B of 24.0 MB (set by cache_bytes)" in empty
    eng.generate("The ferry to the island leaves at 7:40 every morning from pier 3. " * 12, max_new_tokens=2)
    filled = stats_summary(eng.cache_stats())
    device = next(line for line in filled.splitlines() if line.startswith("  device:"))
    assert device != "  device: 0 entries, 0 B of 24.0 MB (set by cache_bytes)"
    assert device.endswith(" of 24.0 MB (set by cache_bytes)"), device

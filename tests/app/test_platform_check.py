"""Before Qt exists, the app finds out whether its window can open on X11: the libraries Qt's xcb plugin links
that the system lacks (named with the command that installs them), or no X server; the Quick start installs every
library the plugin links; scripts/run.sh starts the terminal chat where the window cannot open."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from processes import ROOT, child_env

from app.platform_check import (
    SYSTEM_LIBRARIES,
    chain_libraries,
    install_hint,
    missing_libraries,
    needed_libraries,
    qt_folder,
    uses_xcb,
    window_problem,
    x_server_unreachable,
)

NO_SERVER = ":97"  # a display number nothing here listens on


def test_every_library_the_xcb_plugin_links_has_its_packages():
    needed = chain_libraries(qt_folder())
    assert {"libxcb.so.1", "libxkbcommon-x11.so.0", "libxcb-icccm.so.4", "libEGL.so.1"} <= needed
    assert needed <= SYSTEM_LIBRARIES.keys(), f"no package known for {sorted(needed - SYSTEM_LIBRARIES.keys())}"


def test_the_elf_reader_agrees_with_readelf():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not installed")
    plugin = qt_folder() / "plugins" / "platforms" / "libqxcb.so"
    out = subprocess.run([readelf, "-d", str(plugin)], capture_output=True, text=True, check=True).stdout
    assert needed_libraries(plugin) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    assert needed_libraries(Path(__file__)) == []  # not an ELF file


def quick_start_packages(command: str) -> set[str]:
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("## Install\n")]
    joined = quick_start.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.startswith(command))
    return set(line[len(command):].split())


def test_the_quick_start_installs_every_library_on_debian_and_fedora():
    assert quick_start_packages("sudo apt-get install") == {debian for debian, _ in SYSTEM_LIBRARIES.values()}
    assert quick_start_packages("sudo dnf install") == {fedora for _, fedora in SYSTEM_LIBRARIES.values()}


@pytest.mark.parametrize("environ, platform, expected", [
    ({"DISPLAY": ":0"}, "linux", True),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, "linux", True),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux", False),
    ({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, "linux", False),
    ({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0", "QT_QPA_PLATFORM": "xcb"}, "linux", True),
    ({}, "linux", False),
    ({"DISPLAY": ":0"}, "darwin", False),
])
def test_the_check_runs_only_where_qt_will_use_x11(environ, platform, expected):
    assert uses_xcb(environ, platform) is expected


def fake_plugin(tmp_path: Path) -> Path:
    """A Qt folder whose xcb plugin links a library that is gone (built, linked against, then removed)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a plugin that links a missing library")
    (tmp_path / "gone.c").write_text("int gone(void) { return 1; }\n")
    (tmp_path / "plugin.c").write_text("int gone(void);\nint plugin(void) { return gone(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libkvboost-gone.so.1", "-o",
                    str(tmp_path / "libkvboost-gone.so.1"), str(tmp_path / "gone.c")], check=True)
    (tmp_path / "libkvboost-gone.so").symlink_to("libkvboost-gone.so.1")
    folder = tmp_path / "Qt"
    (folder / "plugins" / "platforms").mkdir(parents=True)
    (folder / "lib").mkdir()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(folder / "plugins" / "platforms" / "libqxcb.so"),
                    str(tmp_path / "plugin.c"), f"-L{tmp_path}", "-lkvboost-gone"], check=True)
    (tmp_path / "libkvboost-gone.so.1").unlink()
    return folder


def test_a_missing_library_is_named_by_ldd(tmp_path):
    folder = fake_plugin(tmp_path)
    if shutil.which("ldd") is None:
        pytest.skip("ldd not installed")
    assert missing_libraries(folder) == ["libkvboost-gone.so.1"]
    problem = window_problem({"DISPLAY": ":0"}, "linux", folder)
    assert "libkvboost-gone.so.1" in problem and "install" in problem.lower()


def test_without_ldd_the_loader_names_the_missing_library(tmp_path, monkeypatch):
    folder = fake_plugin(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no ldd on this PATH
    assert missing_libraries(folder) == ["libkvboost-gone.so.1"]


def test_the_install_hint_names_the_packages_of_each_distribution():
    hint = install_hint(["libxcb-icccm.so.4", "libxcb-keysyms.so.1"])
    assert "sudo apt-get install libxcb-icccm4 libxcb-keysyms1" in hint
    assert "sudo dnf install xcb-util-keysyms xcb-util-wm" in hint


def test_a_display_nothing_listens_on_is_said():
    assert x_server_unreachable(NO_SERVER)
    assert not x_server_unreachable("otherhost:0")  # remote displays are not judged
    problem = window_problem({"DISPLAY": NO_SERVER}, "linux")
    assert problem is not None  # the libraries this machine lacks, or else the missing X server
    assert "lacks" in problem or f"no X server answers on DISPLAY={NO_SERVER}" in problem


def test_the_app_says_why_and_exits_3_before_qt_aborts():
    env = child_env(DISPLAY=NO_SERVER)
    for name in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "app.main", "--check-window"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "kvboost-desktop: cannot open the window:" in done.stderr and "kvboost chat" in done.stderr
    offscreen = subprocess.run([sys.executable, "-m", "app.main", "--check-window"], cwd=ROOT, timeout=120,
                               env=child_env(QT_QPA_PLATFORM="offscreen"), capture_output=True, text=True)
    assert offscreen.returncode == 0 and "can open" in offscreen.stdout


@pytest.mark.slow
def test_run_sh_starts_the_terminal_chat_where_the_window_cannot_open(tmp_path):
    if not (ROOT / ".venv" / "bin" / "kvboost").exists():
        pytest.skip("scripts/run.sh needs the checkout's .venv (bash scripts/setup.sh)")
    env = {k: v for k, v in os.environ.items() if k not in ("QT_QPA_PLATFORM", "WAYLAND_DISPLAY", "KVBOOST_CLI")}
    env.update(DISPLAY=NO_SERVER, KVBOOST_HOME=str(tmp_path), KVBOOST_CACHE_DIR=str(tmp_path / "kv"))
    done = subprocess.run(["bash", "scripts/run.sh"], cwd=ROOT, env=env, input="", capture_output=True, text=True,
                          timeout=600)
    assert "cannot open the window" in done.stderr and "Starting the terminal chat instead" in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]

"""Whether Qt's window system plugin can load here, asked before a QApplication exists: when the X11 (xcb)
plugin lacks a system library, Qt aborts the process (signal 6) with a message that names the wrong library. This
module names the missing ones and the command that installs them, so the app can say so and the launcher can start
the terminal chat instead. Never imports Qt (reading the plugin's files is enough)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

# Every system library the xcb plugin chain links directly (libqxcb.so, libQt6XcbQpa, libQt6Gui, libQt6Core,
# libQt6DBus, libQt6Widgets; tests/app/test_platform_check.py reads their ELF headers and keeps this list complete),
# with the Debian/Ubuntu package and the Fedora package that provide it. A package pulls in what its library needs.
SYSTEM_LIBRARIES: dict[str, tuple[str, str]] = {
    "libxcb.so.1": ("libxcb1", "libxcb"),
    "libxcb-cursor.so.0": ("libxcb-cursor0", "xcb-util-cursor"),
    "libxcb-icccm.so.4": ("libxcb-icccm4", "xcb-util-wm"),
    "libxcb-image.so.0": ("libxcb-image0", "xcb-util-image"),
    "libxcb-keysyms.so.1": ("libxcb-keysyms1", "xcb-util-keysyms"),
    "libxcb-randr.so.0": ("libxcb-randr0", "libxcb"),
    "libxcb-render.so.0": ("libxcb-render0", "libxcb"),
    "libxcb-render-util.so.0": ("libxcb-render-util0", "xcb-util-renderutil"),
    "libxcb-shape.so.0": ("libxcb-shape0", "libxcb"),
    "libxcb-shm.so.0": ("libxcb-shm0", "libxcb"),
    "libxcb-sync.so.1": ("libxcb-sync1", "libxcb"),
    "libxcb-util.so.1": ("libxcb-util1", "xcb-util"),
    "libxcb-xfixes.so.0": ("libxcb-xfixes0", "libxcb"),
    "libxcb-xkb.so.1": ("libxcb-xkb1", "libxcb"),
    "libxkbcommon.so.0": ("libxkbcommon0", "libxkbcommon"),
    "libxkbcommon-x11.so.0": ("libxkbcommon-x11-0", "libxkbcommon-x11"),
    "libX11.so.6": ("libx11-6", "libX11"),
    "libX11-xcb.so.1": ("libx11-xcb1", "libX11-xcb"),
    "libEGL.so.1": ("libegl1", "libglvnd-egl"),
    "libGL.so.1": ("libgl1", "libglvnd-glx"),
    "libfontconfig.so.1": ("libfontconfig1", "fontconfig"),
    "libfreetype.so.6": ("libfreetype6", "freetype"),
    "libglib-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libgthread-2.0.so.0": ("libglib2.0-0", "glib2"),
    "libdbus-1.so.3": ("libdbus-1-3", "dbus-libs"),
    "libz.so.1": ("zlib1g", "zlib"),
    "libzstd.so.1": ("libzstd1", "libzstd"),
}
# The C runtime every Linux system has: never reported.
BASE_LIBRARIES = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libgcc_s.so.1",
                  "libstdc++.so.6", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "linux-vdso.so.1"}
CHAIN = ("plugins/platforms/libqxcb.so", "lib/libQt6XcbQpa.so.6", "lib/libQt6Gui.so.6", "lib/libQt6Core.so.6",
         "lib/libQt6DBus.so.6", "lib/libQt6Widgets.so.6")


def qt_folder() -> Path | None:
    """PySide6's Qt folder (plugins/ and lib/), found without importing Qt; None where PySide6 is not installed."""
    spec = importlib.util.find_spec("PySide6")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "Qt"
    return folder if folder.is_dir() else None


def uses_xcb(environ=os.environ, platform: str = sys.platform) -> bool:
    """Whether Qt will start on X11 here: Linux with a DISPLAY, not told to use another platform, not on Wayland
    (where Qt tries its Wayland plugin first)."""
    if not platform.startswith("linux") or not environ.get("DISPLAY"):
        return False
    chosen = environ.get("QT_QPA_PLATFORM", "")
    if chosen:
        return chosen.split(";")[0].split(":")[0] == "xcb"
    return not environ.get("WAYLAND_DISPLAY")


def needed_libraries(path: Path) -> list[str]:
    """The DT_NEEDED names of an ELF shared object (64-bit little-endian), read from its dynamic section; [] for a
    file that is not one."""
    data = path.read_bytes()
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        at = shoff + i * shentsize
        if at + 64 > len(data):
            return []
        _, kind, _, _, offset, size, link, _, _, entsize = struct.unpack_from("<IIQQQQIIQQ", data, at)
        sections.append((kind, offset, size, link, entsize))
    names = []
    for kind, offset, size, link, entsize in sections:
        if kind != 6 or link >= len(sections):  # SHT_DYNAMIC, its strings in section `link`
            continue
        strings_at = sections[link][1]
        for at in range(offset, min(offset + size, len(data) - 15), entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.find(b"\0", strings_at + value)
                if end < 0:  # a name running off the file: not a shared object this can read
                    return []
                names.append(data[strings_at + value:end].decode("ascii", "replace"))
    return names


def chain_libraries(folder: Path) -> set[str]:
    """The system libraries the xcb plugin chain links directly (Qt's own and the C runtime left out)."""
    own = {p.name for p in (folder / "lib").glob("*.so*")}
    needed: set[str] = set()
    for part in CHAIN:
        file = folder / part
        if file.is_file():
            needed.update(needed_libraries(file))
    return {name for name in needed if name not in own and name not in BASE_LIBRARIES}


def missing_libraries(folder: Path) -> list[str]:
    """The libraries the xcb plugin cannot find on this system: every "not found" of `ldd`, or where ldd is
    missing, the one the dynamic loader names when asked to load the plugin."""
    plugin = folder / CHAIN[0]
    if not plugin.is_file():
        return []
    ldd = shutil.which("ldd")
    if ldd is not None:
        try:
            out = subprocess.run([ldd, str(plugin)], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            out = None
        if out is not None:
            return sorted({m.group(1) for m in re.finditer(r"^\s*(\S+) => not found", out, re.M)})
    try:
        ctypes.CDLL(str(plugin))
    except OSError as exc:
        found = re.match(r"(\S+?): cannot open shared object file", str(exc))
        return [found.group(1)] if found else [str(exc)]
    return []


def install_hint(missing: list[str]) -> str:
    """The commands that install `missing` on Debian/Ubuntu and on Fedora."""
    debian = sorted({SYSTEM_LIBRARIES[name][0] for name in missing if name in SYSTEM_LIBRARIES})
    fedora = sorted({SYSTEM_LIBRARIES[name][1] for name in missing if name in SYSTEM_LIBRARIES})
    if not debian:
        return "install the packages that provide them"
    return f"sudo apt-get install {' '.join(debian)}   (Fedora: sudo dnf install {' '.join(fedora)})"


def x_server_unreachable(display: str) -> bool:
    """Whether nothing listens for a local DISPLAY (":N" or ":N.S"): neither its socket file in /tmp/.X11-unix nor
    the abstract socket of that name answers. A remote display (host:N) is never judged here."""
    found = re.fullmatch(r"(?:unix)?:(\d+)(?:\.\d+)?", display)
    if found is None:
        return False
    path = f"/tmp/.X11-unix/X{found.group(1)}"
    for address in (path, "\0" + path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            try:
                sock.connect(address)
                return False
            except OSError:
                continue
    return True


def window_problem(environ=os.environ, platform: str = sys.platform, folder: Path | None = None) -> str | None:
    """Why the desktop window cannot start here (what to install, or that no X server answers), or None when it
    can or when Qt will not use X11 (Wayland, offscreen, macOS, Windows: Qt's own message then stands)."""
    if not uses_xcb(environ, platform):
        return None
    folder = folder or qt_folder()
    if folder is None:
        return "PySide6 is not installed (bash scripts/setup.sh installs it)"
    missing = missing_libraries(folder)
    if missing:
        return (f"the window system plugin (Qt's xcb) needs libraries this system lacks: {', '.join(missing)}. "
                f"Install them with: {install_hint(missing)}")
    if x_server_unreachable(environ["DISPLAY"]):
        return f"no X server answers on DISPLAY={environ['DISPLAY']}"
    return None


def no_display(environ=os.environ, platform: str = sys.platform) -> bool:
    """Linux with neither an X11 nor a Wayland display, and Qt not told to draw without one (offscreen, vnc, ...)."""
    return (platform.startswith("linux") and not environ.get("DISPLAY") and not environ.get("WAYLAND_DISPLAY")
            and not environ.get("QT_QPA_PLATFORM"))

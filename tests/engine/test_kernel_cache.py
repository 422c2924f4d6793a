"""The block kernel's cache folder against hostile and broken files (engine.weights.kernel_build): a build cut
short, a file that is not a build, a library planted at the keyed name, a folder other users can write, a -march
this CPU cannot run, a compiler that hangs. Each case puts real files in a folder of its own and loads through
gguf_blocks.build_into, which leaves the process's own library alone; a case that could crash the process runs in
a child, so a crash is its return code.

Rebuilds use a stand-in compiler that copies one real build (this process's library) to its -o path and logs each
call: the checks, the rename and the load are the real ones, and a rebuild costs a copy, not a compile."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.weights import gguf_blocks
from engine.weights.gguf_blocks import BlockKernelUnavailable

ROOT = Path(__file__).resolve().parents[2]
CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = [pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"),
                                 reason="builds C libraries and reads /proc: Linux with a C compiler")]

PLANTED = r"""
#include <stdio.h>
/* runs inside dlopen, before any binding could check anything */
__attribute__((constructor)) static void planted(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) { fputs("ran", marker); fclose(marker); }
}
int kvb_something_else(void) { return 1; }
"""

HANGING_CC = """#!/bin/sh
sleep 600 &
echo $! > "{folder}/child.pid"
echo $$ > "{folder}/cc.pid"
sleep 600
"""

CHILD = r"""
import json, torch
from engine.weights import gguf_blocks
out = {"unavailable": gguf_blocks.unavailable()}
if out["unavailable"] is None:  # a product through the vector path this build was compiled for
    y = gguf_blocks.matmul(torch.zeros(16, 144, dtype=torch.uint8), "Q4_K", 256, torch.randn(2, 256))
    out["product"] = y.abs().sum().item()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def real_build(tmp_path_factory) -> bytes:
    """The bytes of a real build of the kernel for this CPU (the process's library, built once per cache)."""
    why = gguf_blocks.unavailable()
    if why is not None:
        pytest.skip(f"no block kernel here: {why}")
    return Path(gguf_blocks.library()._name).read_bytes()


class Cache:
    """A kernel folder of its own, with a stand-in compiler that copies a real build and counts its calls."""

    def __init__(self, root: Path, build: bytes, monkeypatch):
        self.root, self.folder = root, root / "kernels"
        self.build = root / "real.so"
        self.build.write_bytes(build)
        self.compiler = root / "cc-copy"
        self.compiler.write_text(f'#!/bin/sh\necho "$@" >> "{root}/calls"\n'
                                 f'while [ $# -gt 0 ]; do [ "$1" = -o ] && cp "{self.build}" "$2"; shift; done\n')
        self.compiler.chmod(0o755)
        monkeypatch.setenv("CC", str(self.compiler))
        monkeypatch.delenv(gguf_blocks.MARCH_ENV_VAR, raising=False)
        self.target = gguf_blocks.kernel_file(self.folder, str(self.compiler), "native")

    @property
    def digest(self) -> Path:
        return self.target.with_name(self.target.name + ".sha256")

    def calls(self) -> int:
        calls = self.root / "calls"
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    def place(self, data: bytes, digest_of: bytes | None) -> None:
        """`data` at the keyed name, with the digest of `digest_of` beside it (none where None)."""
        self.folder.mkdir(mode=0o700, exist_ok=True)
        self.target.write_bytes(data)
        self.target.chmod(0o755)
        if digest_of is not None:
            self.digest.write_text(hashlib.sha256(digest_of).hexdigest() + "\n")

    def moved_aside(self) -> list[bytes]:
        return [path.read_bytes() for path in sorted(self.folder.glob(self.target.name + ".bad-*"))]


@pytest.fixture
def cache(tmp_path, real_build, monkeypatch) -> Cache:
    return Cache(tmp_path, real_build, monkeypatch)


def assert_the_real_kernel_loaded(lib, cache: Cache, real_build: bytes) -> None:
    assert lib._name == str(cache.target)
    assert gguf_blocks.VECTOR_PATHS[lib.kvb_vector_path()]  # a function of the real kernel answers
    assert cache.target.read_bytes() == real_build
    assert cache.digest.read_text().strip() == hashlib.sha256(real_build).hexdigest()
    assert not list(cache.folder.glob(".*.tmp")), "a scratch file was left behind"


def tiny_library(tmp_path: Path, source: str, *defines: str) -> bytes:
    (tmp_path / "tiny.c").write_text(source)
    built = subprocess.run([CC, "-shared", "-fPIC", *defines, str(tmp_path / "tiny.c"), "-o",
                            str(tmp_path / "tiny.so")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return (tmp_path / "tiny.so").read_bytes()


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for a parent that does not reap it is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_fresh_build_lands_whole_with_its_digest_and_is_loaded_after_without_building(cache, real_build):
    lib = gguf_blocks.build_into(cache.folder)
    assert_the_real_kernel_loaded(lib, cache, real_build)
    assert stat.S_IMODE(cache.folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(cache.target.stat().st_mode) == 0o755
    gguf_blocks.build_into(cache.folder)
    assert cache.calls() == 1


def test_a_build_cut_short_at_the_keyed_name_is_rebuilt_not_mapped(cache, real_build):
    """Half a build with the whole build's digest (a crash after the rename, before the data reached the disk):
    dlopen of it faults with SIGBUS; the digest check keeps it from dlopen, so the next start rebuilds and runs."""
    cache.place(real_build[:len(real_build) // 2], digest_of=real_build)
    env = {**os.environ, "KVBOOST_CACHE_DIR": str(cache.root), "CC": str(cache.compiler)}
    env.pop(gguf_blocks.MARCH_ENV_VAR, None)
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"unavailable": None, "product": 0.0}
    assert cache.calls() == 1
    assert cache.target.read_bytes() == real_build
    assert cache.moved_aside() == [real_build[:len(real_build) // 2]]


@pytest.mark.parametrize("damage", ["empty", "garbage", "one byte flipped"])
def test_a_file_that_is_not_the_build_its_digest_names_is_moved_aside_and_rebuilt_once(cache, real_build, damage):
    if damage == "empty":
        data = b""
    elif damage == "garbage":
        data = bytes(range(256)) * 64
    else:  # the same size, one bit of code changed: only the digest tells it from the build
        middle = len(real_build) // 2
        data = real_build[:middle] + bytes([real_build[middle] ^ 0x01]) + real_build[middle + 1:]
    cache.place(data, digest_of=real_build)
    lib = gguf_blocks.build_into(cache.folder)
    assert_the_real_kernel_loaded(lib, cache, real_build)
    assert cache.calls() == 1
    assert cache.moved_aside() == [data]


def test_a_library_without_the_kernels_functions_is_moved_aside_and_rebuilt_once(cache, real_build, tmp_path):
    """A whole library with a matching digest that dlopen takes but the binding cannot use (ctypes'
    AttributeError): unloaded, so the rebuild at the same name is the one dlopen returns."""
    stranger = tiny_library(tmp_path, "int kvb_something_else(void) { return 1; }\n")
    cache.place(stranger, digest_of=stranger)
    lib = gguf_blocks.build_into(cache.folder)
    assert_the_real_kernel_loaded(lib, cache, real_build)
    assert cache.calls() == 1
    assert cache.moved_aside() == [stranger]


@pytest.mark.parametrize("how", ["no digest", "a wrong digest", "writable by others", "another user's"])
def test_a_library_planted_at_the_keyed_name_never_runs_and_the_kernel_is_rebuilt(cache, real_build, tmp_path, how):
    if how == "another user's" and os.getuid() != 0:
        pytest.skip("giving a file to another user takes root")
    marker = tmp_path / "planted-ran"
    planted = tiny_library(tmp_path, PLANTED, f'-DMARKER="{marker}"')
    cache.place(planted, digest_of=None if how == "no digest" else
                b"forged" if how == "a wrong digest" else planted)
    if how == "writable by others":
        cache.target.chmod(0o777)
    elif how == "another user's":
        os.chown(cache.target, 4321, 4321)
    lib = gguf_blocks.build_into(cache.folder)
    assert not marker.exists(), "the planted library's constructor ran"
    assert_the_real_kernel_loaded(lib, cache, real_build)
    assert cache.calls() == 1
    assert cache.moved_aside() == [planted]


@pytest.mark.parametrize("mode", [0o770, 0o777], ids=["group-writable", "world-writable"])
def test_a_folder_other_users_can_write_is_closed_and_nothing_found_there_runs(cache, tmp_path, mode):
    """Even a library whose digest matches: in such a folder another user could have put both (or renamed another
    build of ours to this name). The folder is this user's: it is closed to the others and built again."""
    marker = tmp_path / "planted-ran"
    planted = tiny_library(tmp_path, PLANTED, f'-DMARKER="{marker}"')
    cache.place(planted, digest_of=planted)
    cache.folder.chmod(mode)
    lib = gguf_blocks.build_into(cache.folder)
    assert not marker.exists(), "the planted library's constructor ran"
    assert stat.S_IMODE(cache.folder.stat().st_mode) == mode & ~0o022
    assert_the_real_kernel_loaded(lib, cache, cache.build.read_bytes())
    assert cache.calls() == 1
    assert cache.moved_aside() == [planted]


def test_a_folder_of_another_user_is_refused_and_nothing_there_runs(cache, tmp_path):
    if os.getuid() != 0:
        pytest.skip("giving the folder to another user needs root")
    marker = tmp_path / "planted-ran"
    planted = tiny_library(tmp_path, PLANTED, f'-DMARKER="{marker}"')
    cache.place(planted, digest_of=planted)
    os.chown(cache.folder, 12345, 12345)
    with pytest.raises(BlockKernelUnavailable, match="belongs to another user"):
        gguf_blocks.build_into(cache.folder)
    assert not marker.exists(), "the planted library's constructor ran"
    assert cache.calls() == 0
    assert cache.target.read_bytes() == planted  # nothing moved or built there either


def test_a_rebuild_that_does_not_load_either_leaves_the_kernel_unavailable(cache):
    cache.build.write_bytes(b"not a library")  # what the stand-in compiler now produces
    cache.place(b"garbage", digest_of=None)
    with pytest.raises(BlockKernelUnavailable, match="just built into .* does not load"):
        gguf_blocks.build_into(cache.folder)
    assert cache.calls() == 1
    assert sorted(cache.moved_aside()) == [b"garbage", b"not a library"]


def test_a_march_this_cpu_cannot_run_is_refused_before_compiling(tmp_path):
    """Built anyway, its first product would kill the process with SIGILL."""
    flags = set(gguf_blocks.cpu_flags().split())
    if os.uname().machine != "x86_64":
        pytest.skip("the marches named here are x86's")
    if "avx512f" not in flags:
        march, lacking = "x86-64-v4", "avx512f"
    elif "amx_tile" not in flags:
        march, lacking = "sapphirerapids", "amx_tile"
    else:
        pytest.skip("this CPU runs every march gcc names here (AVX-512 and AMX)")
    env = {**os.environ, "KVBOOST_CACHE_DIR": str(tmp_path), gguf_blocks.MARCH_ENV_VAR: march, "CC": CC}
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    why = json.loads(done.stdout.strip().splitlines()[-1])["unavailable"]
    assert why is not None and f"={march} builds for CPU features this CPU lacks" in why
    assert lacking in why.split("lacks (")[1].split(")")[0].split(", ")
    assert not list((tmp_path / "kernels").glob("*.so")), "it was compiled"


def test_a_compiler_that_hangs_is_killed_with_its_children_at_the_timeout(tmp_path, monkeypatch):
    compiler = tmp_path / "cc-hangs"
    compiler.write_text(HANGING_CC.format(folder=tmp_path))
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.delenv(gguf_blocks.MARCH_ENV_VAR, raising=False)
    started = time.monotonic()
    with pytest.raises(BlockKernelUnavailable, match="timed out after 1 s"):
        gguf_blocks.build_into(tmp_path / "kernels", timeout_s=1)
    assert time.monotonic() - started < 10
    pids = [int((tmp_path / name).read_text()) for name in ("cc.pid", "child.pid")]
    deadline = time.monotonic() + 2  # SIGKILL is sent; the kernel may take a moment to finish each one
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, pids)), "the compiler or its child outlived the call"
    assert not list((tmp_path / "kernels").glob(".*.tmp")), "the cut-short build's scratch file was left"

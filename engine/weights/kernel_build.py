"""Building, checking and loading a C library compiled at runtime (the block kernel's) so that no file in the cache
can crash or take over the process that loads it.

The folder is the trust boundary. A library is built or loaded only in a folder of this user's (or root's) that no
other user can write (or whose sticky bit keeps them from replacing this user's files). Inside it, a library is
given to dlopen only when it is a regular file of this user's that no one else can write and its bytes match the
SHA-256 written beside it (`<name>.sha256`). That digest is written only once the whole build is on disk (fsync,
then rename), so a build cut short (whose mapping faults with SIGBUS inside dlopen), a file changed since, or one
planted at the predictable name (whose constructors would run) is never loaded. Anything at the name that fails
these checks, fails dlopen, or lacks a function the binding declares, is moved aside and built again, once.

The compiler runs in a process group of its own that is killed whole at the timeout, and the caller can ask which
CPU features a -march needs that this CPU lacks (code for them dies with SIGILL at its first use) before compiling.

Unix only (fcntl, process groups, ownership); callers refuse Windows before reaching here."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 120.0  # a build takes seconds; past this the compiler is taken to hang
DIGEST_SUFFIX = ".sha256"
LIBRARY_MODE = 0o755  # whatever the umask: a mode with group or other write is refused at load
# gcc's and clang's macro for an instruction set -> /proc/cpuinfo's flag for a CPU that runs it
ISA_FLAGS = {
    "__SSE4_2__": "sse4_2", "__AVX__": "avx", "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c",
    "__BMI__": "bmi1", "__BMI2__": "bmi2", "__AVXVNNI__": "avx_vnni",
    "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512CD__": "avx512cd", "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl", "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16", "__AVX512IFMA__": "avx512ifma", "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2", "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq", "__AVX512VP2INTERSECT__": "avx512_vp2intersect",
    "__AMX_TILE__": "amx_tile", "__AMX_INT8__": "amx_int8", "__AMX_BF16__": "amx_bf16",
}


class BlockKernelUnavailable(RuntimeError):
    """The block kernel cannot be built or loaded here (the message says why)."""


class _Untrusted(Exception):
    """The file at a library's name must not be (or could not be) loaded; the message says why."""


def run_tool(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`command` run to its end with its output captured. It leads a process group of its own: at `timeout_s` the
    whole group (a compiler's cc1, as and ld included) is killed and waited for, and BlockKernelUnavailable says
    so; no process of it outlives this call."""
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # start_new_session: the group's id is the leader's pid
            process.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise BlockKernelUnavailable(f"{command[0]} timed out after {timeout_s:g} s (killed, with the "
                                             "processes it started)") from None
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def missing_features(compiler: str, march: str, cpu_flags: str, timeout_s: float = COMPILE_TIMEOUT_S) -> list[str]:
    """The CPU features (as /proc/cpuinfo names them) that code built with -march=`march` may use and this CPU
    lacks, from the instruction-set macros `compiler` defines for that march; `cpu_flags` is cpuinfo's flags line.
    [] for "native", and where the line is not cpuinfo's (no way to know: the build goes ahead)."""
    if march == "native" or not cpu_flags.startswith(("flags", "Features")):
        return []
    result = run_tool([compiler, f"-march={march}", "-dM", "-E", "-x", "c", os.devnull], timeout_s)
    if result.returncode != 0:
        raise BlockKernelUnavailable(f"{compiler} does not build for -march={march}: {result.stderr.strip()[-400:]}")
    defined = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define ")}
    have = set(cpu_flags.split(":", 1)[-1].split())
    return sorted({flag for macro, flag in ISA_FLAGS.items() if macro in defined and flag not in have})


def check_folder(folder: Path) -> bool:
    """Creates `folder` (mode 0o700, whatever the umask) where missing. A folder of this user's that group or others
    can write (without the sticky bit; one made under a umask of 002 by an earlier version) is closed to them
    (chmod go-w): True, and what it holds may have been put or swapped there by them, so the caller trusts none
    of it. BlockKernelUnavailable where the folder belongs to another user, or cannot be closed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise BlockKernelUnavailable(f"the kernel folder {folder} is not a folder")
    if info.st_uid not in (os.getuid(), 0):
        raise BlockKernelUnavailable(f"the kernel folder {folder} belongs to another user (uid {info.st_uid}), who "
                                     "could swap the library built there: not building or loading it there")
    if not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or info.st_mode & stat.S_ISVTX:
        return False
    try:
        if info.st_uid != os.getuid():
            raise PermissionError(1, "not this user's folder")
        os.chmod(folder, stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH), follow_symlinks=False)
    except OSError as exc:
        raise BlockKernelUnavailable(f"the kernel folder {folder} is writable by other users (mode "
                                     f"{stat.S_IMODE(info.st_mode):o}), who could swap the library built there, "
                                     f"and cannot be closed to them ({exc.strerror}): not building or loading it "
                                     f"there (fix: chmod go-w {folder})") from None
    log.warning("the kernel folder %s was writable by other users (mode %o): closed to them, and its build "
                "is made again", folder, stat.S_IMODE(info.st_mode))
    return True


def digest_path(target: Path) -> Path:
    return target.with_name(target.name + DIGEST_SUFFIX)


def load_or_build(target: Path, command: Callable[[Path], list[str]], bind: Callable[[ctypes.CDLL], ctypes.CDLL],
                  timeout_s: float = COMPILE_TIMEOUT_S) -> ctypes.CDLL:
    """The library at `target`, loaded only once it passes the checks above (else moved aside), built with
    `command(output path)` where it is missing or was moved aside, at most once per call, then handed to `bind`,
    which declares the functions the caller uses (AttributeError for one the library lacks: moved aside too).
    BlockKernelUnavailable where it cannot be had, the rebuild's failure included."""
    try:
        was_open = check_folder(target.parent)
        with _lock(target, timeout_s):
            if was_open and os.path.lexists(target):
                _move_aside(target, "its folder was writable by other users")
            if os.path.lexists(target):
                try:
                    return _load(target, bind)
                except _Untrusted as exc:
                    _move_aside(target, str(exc))
            _compile(target, command, timeout_s)
            try:
                return _load(target, bind)
            except _Untrusted as exc:
                _move_aside(target, str(exc))
                raise BlockKernelUnavailable(f"the block kernel just built into {target} does not load: {exc}") \
                    from None
    except OSError as exc:
        raise BlockKernelUnavailable(f"the block kernel cannot be built or loaded in {target.parent}: {exc}") \
            from exc


@contextlib.contextmanager
def _lock(target: Path, timeout_s: float) -> Iterator[None]:
    """Held while one process checks, builds and loads `target`: another never sees a library without its digest,
    nor moves aside one being loaded. Waits for another process's build (bounded by its own timeout)."""
    import fcntl

    descriptor = os.open(target.with_name(target.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + 2 * timeout_s + 30
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BlockKernelUnavailable(f"another process has been building {target} for longer than "
                                                 f"{2 * timeout_s + 30:g} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _load(target: Path, bind: Callable[[ctypes.CDLL], ctypes.CDLL]) -> ctypes.CDLL:
    _verify(target)  # before dlopen: what it maps must be whole and ours
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise _Untrusted(f"dlopen refused it ({exc})") from None
    try:
        return bind(lib)
    except AttributeError as exc:
        _unload(lib)  # else dlopen of the rebuilt file at this same name would return this library again
        raise _Untrusted(f"it lacks a function the binding needs ({exc})") from None


def _verify(target: Path) -> None:
    """_Untrusted unless `target` is a regular file of this user's that no one else can write, whose bytes match
    its digest file (itself held to the same checks)."""
    digest = hashlib.sha256(_read_own(target, None)).hexdigest()
    digest_file = digest_path(target)
    if not os.path.lexists(digest_file):
        raise _Untrusted(f"it has no {digest_file.name} (not a build this code finished)")
    expected = _read_own(digest_file, 256).decode("ascii", "replace").strip()
    if digest != expected:
        raise _Untrusted(f"its bytes do not match {digest_file.name} (cut short or changed since its build)")


def _read_own(path: Path, limit: int | None) -> bytes:
    try:
        # O_NOFOLLOW: a link is not followed to a file elsewhere; O_NONBLOCK: a FIFO does not hang the open
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise _Untrusted(f"{path.name} cannot be opened ({exc.strerror})") from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise _Untrusted(f"{path.name} is not a regular file")
        if info.st_uid != os.getuid():
            raise _Untrusted(f"{path.name} belongs to another user (uid {info.st_uid})")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise _Untrusted(f"{path.name} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})")
        return file.read() if limit is None else file.read(limit)


def _unload(lib: ctypes.CDLL) -> None:
    import _ctypes

    dlclose = getattr(_ctypes, "dlclose", None)
    if dlclose is not None:
        dlclose(lib._handle)


def _move_aside(target: Path, why: str) -> None:
    """`target` renamed to `<name>.bad-<time>[-n]` (kept to be looked at; under the lock, so the name is free), its
    digest removed."""
    stamp = f"{target.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}"
    aside = target.with_name(stamp)
    for n in range(2, 100):
        if not os.path.lexists(aside):
            break
        aside = target.with_name(f"{stamp}-{n}")
    try:
        os.replace(target, aside)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise BlockKernelUnavailable(f"{target} is not loaded ({why}) and cannot be moved aside ({exc.strerror}): "
                                     "remove it") from None
    with contextlib.suppress(FileNotFoundError):
        os.unlink(digest_path(target))
    log.warning("not loading %s: %s; moved it to %s", target, why, aside.name)


def _compile(target: Path, command: Callable[[Path], list[str]], timeout_s: float) -> None:
    """Builds into a scratch file beside `target`, then: mode, fsync, digest (written whole, by rename), and the
    library renamed into place; the folder synced so both names survive a crash. Under the lock, every scratch
    file of this name is an earlier build's that was cut short."""
    folder = target.parent
    for stale in folder.glob(f".{target.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    descriptor, name = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    os.close(descriptor)
    scratch = Path(name)
    try:
        argv = command(scratch)
        result = run_tool(argv, timeout_s)
        if result.returncode != 0:
            raise BlockKernelUnavailable(f"{argv[0]} could not build the block kernel: "
                                         f"{result.stderr.strip()[-400:]}")
        os.chmod(scratch, LIBRARY_MODE)
        with open(scratch, "rb") as built:
            digest = hashlib.sha256(built.read()).hexdigest()
            os.fsync(built.fileno())
        _write_whole(digest_path(target), f"{digest}\n".encode())
        os.replace(scratch, target)
        _sync_folder(folder)
    finally:
        scratch.unlink(missing_ok=True)
    log.info("built %s", target)


def _write_whole(path: Path, data: bytes) -> None:
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            os.fchmod(file.fileno(), 0o644)
            file.flush()
            os.fsync(file.fileno())
        os.replace(name, path)
    finally:
        Path(name).unlink(missing_ok=True)


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

"""The HuggingFace cache on disk: its layout, a resumable ranged-GET download of one file into it, and a scan of
what it holds.

The layout is the one huggingface_hub and transformers read (so a model fetched here is theirs too, and theirs
ours):

    <cache>/models--<org>--<name>/blobs/<etag>                   the file's bytes; etag = sha256 for LFS files,
                                                                 the git blob sha1 for the others
    <cache>/models--<org>--<name>/blobs/<etag>.incomplete        a download in progress or interrupted
    <cache>/models--<org>--<name>/snapshots/<commit>/<path>      a relative symlink to ../../blobs/<etag>
    <cache>/models--<org>--<name>/refs/<branch>                  the commit the branch pointed at

Why our own downloader and not hf_hub_download: huggingface_hub 2.x writes each download to a process-unique
`<etag>.<random>.incomplete` file and deletes it when the download fails, so an interrupted multi-GB download
starts again from zero (also after a restart); it has no cancel other than an exception from a progress bar, and
it does not check the bytes against the hub's sha256. Here a download appends to `<etag>.incomplete`, resumes
with a ranged GET from that file's size (after a dropped connection, a cancel or a restart), checks the size and
the hash, and only then renames the blob into place and links the snapshot: a file that looks complete is
complete. A hash mismatch deletes the partial file (its bytes cannot be trusted to resume from).

A hostile hub or a hostile cache: every name from the hub is checked first (hub.hub_names), and every path is
checked, with its links followed, to lie inside the cache folder before anything is made, written or linked there
(check_inside, OutsideCache): a link in the cache that points out of it is refused, never written through.
What a failure leaves: a full disk (DiskFull) or any other write error, a dropped connection, a redirect loop and
a cancel keep the `.incomplete` file, and the next download resumes from it; a hash mismatch deletes it. An empty
file is a blob like any other (named by the hash of no bytes).

Invariants: a snapshot path exists only for a verified blob; a blob's name is the hash of its bytes; a
safetensors folder's config.json is linked last, so a folder without it is unfinished (scan() marks it so).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx2
from filelock import FileLock, Timeout
from huggingface_hub import get_session
from huggingface_hub.utils import hf_raise_for_status

from . import hub_names
from .hub_names import DiskFull, DownloadCancelled, DownloadFailed, HashMismatch, ModelHubError, OutsideCache

__all__ = ["ModelHubError", "DownloadCancelled", "DownloadFailed", "HashMismatch", "DiskFull", "OutsideCache",
           "Digest", "LocalModel", "repo_folder", "repo_from_folder", "check_inside", "make_folder", "write_failed",
           "fetch_blob", "link_snapshot", "write_ref", "snapshot_file", "scan"]

CHUNK_BYTES = 1 << 20
RETRIES = 4  # consecutive failed attempts (no new byte between them) before a download gives up
INCOMPLETE = ".incomplete"


def repo_folder(cache_dir: Path, repo: str) -> Path:
    return Path(cache_dir) / ("models--" + hub_names.repo_id(repo).replace("/", "--"))


def check_inside(cache_dir: Path, path: Path) -> Path:
    """`path`, after checking that with every link in it followed it lies inside `cache_dir` (itself resolved:
    the cache folder may be a link); raises OutsideCache."""
    try:
        root, real = Path(cache_dir).resolve(), Path(path).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a link loop
        raise OutsideCache(f"{path} cannot be resolved ({exc}); nothing is written through it") from exc
    if not real.is_relative_to(root):
        raise OutsideCache(f"{path} resolves to {real}, outside the cache {root}: a link in the cache points out "
                           "of it, and nothing is written through it (remove the link, or point the cache there)")
    return Path(path)


def make_folder(cache_dir: Path, folder: Path) -> None:
    check_inside(cache_dir, folder).mkdir(parents=True, exist_ok=True)


def write_failed(exc: OSError, what: str) -> DownloadFailed:
    """An error of the disk as this module's: DiskFull for a full disk or quota, else DownloadFailed."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"{what}: the disk is full{where}; what was written is kept, and the same download resumes "
                        "from it once there is room")
    return DownloadFailed(f"{what}: {exc.strerror or exc}{where}; what was written is kept")


def repo_from_folder(folder: Path) -> str | None:
    name = folder.name
    return name[len("models--"):].replace("--", "/") if name.startswith("models--") else None


@dataclass(frozen=True)
class Digest:
    """What the bytes must hash to: sha256 of the content (LFS files) or git's blob sha1 ("blob <size>\\0" +
    content, the id of every other file)."""

    kind: str  # "sha256" | "git-sha1"
    hexdigest: str

    def new(self, size: int):
        if self.kind == "sha256":
            return hashlib.sha256()
        h = hashlib.sha1()
        h.update(f"blob {size}\0".encode())
        return h


def _hash_prefix(path: Path, hasher, limit: int) -> None:
    with open(path, "rb") as f:
        while limit > 0 and (block := f.read(min(CHUNK_BYTES * 8, limit))):
            hasher.update(block)
            limit -= len(block)


def fetch_blob(url: str, blob: Path, *, size: int, digest: Digest | None, headers: dict,
               on_bytes: Callable[[int], None] | None = None, cancel: threading.Event | None = None,
               timeout_s: float = 30.0, retry_wait_s: float = 0.5) -> None:
    """Downloads `url` into `blob` through `blob`.incomplete, resuming from that file's size; `on_bytes(n)` is
    called with the bytes held so far (first with what a resume starts from). Raises DownloadCancelled (partial
    kept), HashMismatch (partial deleted), DiskFull or DownloadFailed for a write error (partial kept), OutsideCache
    before writing through a link out of the cache, DownloadFailed for an oversized body, httpx2.TransportError when
    the server stays unreachable and huggingface_hub's HfHubHTTPError for an HTTP error."""
    cache_dir = blob.parents[2]  # <cache>/models--org--name/blobs/<etag>
    partial = check_inside(cache_dir, blob.with_name(blob.name + INCOMPLETE))
    check_inside(cache_dir, blob)
    make_folder(cache_dir, blob.parent)
    # The lock sits where huggingface_hub keeps its own (<cache>/.locks/models--org--name/), and stays: deleting
    # a lock file while another process waits on it would let two writers append to one partial file.
    lock_path = check_inside(cache_dir, cache_dir / ".locks" / blob.parents[1].name / f"{blob.name}.lock")
    make_folder(cache_dir, lock_path.parent)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0.2)
    except Timeout:
        raise DownloadFailed(f"{blob.name} is being downloaded by another process or window") from None
    try:
        _fetch_locked(url, partial, size=size, digest=digest, headers=headers, on_bytes=on_bytes or (lambda n: None),
                      cancel=cancel, timeout_s=timeout_s, retry_wait_s=retry_wait_s)
        os.replace(partial, blob)
    finally:
        lock.release()


def _fetch_locked(url, partial: Path, *, size, digest, headers, on_bytes, cancel, timeout_s, retry_wait_s) -> None:
    done = partial.stat().st_size if partial.exists() else 0
    if done > size:  # not a prefix of this file
        partial.unlink()
        done = 0
    hasher = digest.new(size) if digest else None
    if hasher is not None and done:
        _hash_prefix(partial, hasher, done)
    on_bytes(done)
    try:
        partial.touch()  # an empty file has no body to write it
    except OSError as exc:
        raise write_failed(exc, f"starting {partial.name}") from exc
    failures = 0
    while done < size:
        if cancel is not None and cancel.is_set():
            raise DownloadCancelled(f"cancelled after {done} of {size} bytes")
        ranged = {"Range": f"bytes={done}-"} if done else {}
        try:
            with get_session().stream("GET", url, headers={**headers, **ranged, "Accept-Encoding": "identity"},
                                      timeout=httpx2.Timeout(timeout_s, connect=min(timeout_s, 10.0))) as response:
                hf_raise_for_status(response)
                if done and response.status_code != 206:  # the server ignored the range: start over
                    done = 0
                    hasher = digest.new(size) if digest else None
                    on_bytes(0)
                try:
                    with open(partial, "ab" if done else "wb") as f:
                        for chunk in response.iter_bytes(CHUNK_BYTES):
                            if cancel is not None and cancel.is_set():
                                raise DownloadCancelled(f"cancelled after {done} of {size} bytes")
                            if done + len(chunk) > size:
                                raise DownloadFailed(f"the server sent more than the {size} bytes it announced")
                            f.write(chunk)
                            if hasher is not None:
                                hasher.update(chunk)
                            done += len(chunk)
                            failures = 0
                            on_bytes(done)
                except OSError as exc:  # the disk: full, read-only, gone (a chunk may be half written: a resume
                    # starts from the file's size, so what is on disk stays a prefix of the file)
                    held = partial.stat().st_size if partial.exists() else 0
                    raise write_failed(exc, f"writing {partial.name} ({held} of {size} bytes held)") from exc
            if done < size:
                raise httpx2.RemoteProtocolError(f"the body ended after {done} of {size} bytes")
        except httpx2.TransportError:
            # A dropped connection, a timeout, a refused reconnect: retry from what is on disk.
            failures += 1
            if failures > RETRIES:
                raise
            time.sleep(retry_wait_s * failures)
    if hasher is not None and hasher.hexdigest() != digest.hexdigest:
        got = hasher.hexdigest()
        partial.unlink(missing_ok=True)
        raise HashMismatch(f"the downloaded bytes hash to {digest.kind} {got}, the hub says {digest.hexdigest}; "
                           "the file was deleted")


def link_snapshot(repo_dir: Path, commit: str, path: str, blob: Path) -> Path:
    """Points snapshots/<commit>/<path> at `blob` (a relative symlink; where symlinks are not allowed, the blob
    moves there, as huggingface_hub does). What was at the pointer (a link, followed or not) is replaced."""
    cache_dir = repo_dir.parent
    pointer = repo_dir / "snapshots" / commit / path
    check_inside(cache_dir, blob)
    make_folder(cache_dir, pointer.parent)
    pointer = check_inside(cache_dir, pointer.parent) / pointer.name  # the pointer itself is replaced, not followed
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # the disk's, not a missing symlink permission
            raise
        os.replace(blob, pointer)
    return pointer


def write_ref(repo_dir: Path, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = check_inside(repo_dir.parent, repo_dir / "refs" / revision)
    make_folder(repo_dir.parent, ref.parent)
    ref.write_text(commit)


def snapshot_file(repo_dir: Path, commit: str, path: str) -> Path | None:
    """The complete local file for `path` at `commit`, or None (also for one that links out of the cache)."""
    pointer = repo_dir / "snapshots" / commit / path
    try:
        check_inside(repo_dir.parent, pointer)
    except OutsideCache:
        return None
    return pointer if pointer.is_file() else None  # is_file follows the link: a dangling one is not complete


# -- what the cache holds ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalModel:
    """One model in the cache: a GGUF file or a safetensors folder of one snapshot, or an unfinished download."""

    repo: str
    name: str  # the GGUF file name, "safetensors" / "awq" for a folder, "unfinished download" for partial blobs
    format: str  # "gguf" | "safetensors" | "awq" | "partial"
    path: Path  # what --model takes: the .gguf file or the snapshot folder (for partial blobs: the repo folder)
    size_bytes: int  # on disk
    complete: bool
    revision: str | None  # the snapshot's commit


def _is_awq(config: Path) -> bool:
    try:
        quant = json.loads(config.read_text(encoding="utf-8")).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return str(quant.get("quant_method", "")).lower() == "awq"


def _folder_complete(folder: Path) -> bool:
    """config.json (linked last) and every weight file the index names are present."""
    if not (folder / "config.json").is_file():
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((folder / s).is_file() for s in shards)
    return any(p.is_file() for p in folder.glob("*.safetensors"))


def _size(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def scan(cache_dir: Path) -> list[LocalModel]:
    """Every model in the cache, complete ones and unfinished ones (complete=False), sorted by repo."""
    found: list[LocalModel] = []
    root = Path(cache_dir)
    if not root.is_dir():
        return found
    for repo_dir in sorted(root.glob("models--*")):
        repo = repo_from_folder(repo_dir)
        for snapshot in sorted((repo_dir / "snapshots").glob("*")):
            commit = snapshot.name
            for gguf in sorted(snapshot.rglob("*.gguf")):
                if gguf.is_file():
                    found.append(LocalModel(repo, gguf.relative_to(snapshot).as_posix(), "gguf", gguf,
                                            gguf.stat().st_size, True, commit))
            weights = [p for p in snapshot.glob("*.safetensors") if p.is_symlink() or p.exists()]
            if weights:
                complete = _folder_complete(snapshot)
                fmt = "awq" if complete and _is_awq(snapshot / "config.json") else "safetensors"
                files = [p for p in snapshot.iterdir() if not p.name.endswith(".gguf")]
                found.append(LocalModel(repo, fmt, fmt, snapshot, _size(files), complete, commit))
        partial = sorted((repo_dir / "blobs").glob("*" + INCOMPLETE))
        if partial:
            found.append(LocalModel(repo, "unfinished download", "partial", repo_dir, _size(partial), False, None))
    return found

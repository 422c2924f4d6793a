"""What a hub answer may put on the file system, checked before it does: repo ids, revisions, commits, ETags (a
blob's name), file names (a snapshot path) and sizes, each in the shape huggingface_hub itself accepts or the hub
sends. Anything else is refused with RefusedHubAnswer, naming the field and the value, before a byte is written.

Also the model library's errors: they live here, below hub.hub_cache and hub.models, so all three raise
the same ones.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

COMMIT = re.compile(r"[0-9a-f]{40}")  # huggingface_hub's REGEX_COMMIT_HASH
SHA256 = re.compile(r"[0-9a-f]{64}")  # its REGEX_SHA256: an LFS file's ETag and lfs.sha256
GIT_SHA1 = re.compile(r"[0-9a-f]{40}")  # a git blob id: every other file's ETag and blobId
MAX_FILE_BYTES = 1 << 42  # 4 TiB: more than any one model file; a larger size is no file's
MAX_NAME_CHARS = 1024  # a whole file name or revision
MAX_PART_BYTES = 255  # one part of it, as most file systems allow (UTF-8)
SHOWN_CHARS = 80  # of a refused value's repr, in the message
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ModelHubError(Exception):
    """Searching, listing or downloading models failed; the message says what and why."""


class DownloadCancelled(ModelHubError):
    """The cancel event was set; the partial file stays for a later resume."""


class DownloadFailed(ModelHubError):
    """The bytes could not be fetched or are not the hub's (the message says which)."""


class HashMismatch(DownloadFailed):
    """The downloaded bytes do not hash to what the hub says; the partial file was deleted."""


class RefusedHubAnswer(DownloadFailed):
    """A name, size or hash in the hub's answer (or a repo id / revision asked for) has a shape the hub never
    sends: a path out of the cache, an ETag that is no hash, a size that is no size. Nothing of it was written."""


class OutsideCache(DownloadFailed):
    """A path in the cache resolves outside the cache folder (a link in it points elsewhere); nothing was written
    through it."""


class DiskFull(DownloadFailed):
    """The disk filled up while writing; what was written stays in the .incomplete file and the next download
    resumes from it once there is room."""


def shown(value) -> str:
    """`value`'s repr, cut to SHOWN_CHARS (a hostile hub's value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def refused(field: str, value, why: str) -> RefusedHubAnswer:
    return RefusedHubAnswer(f"refused {field} {shown(value)}: {why}; nothing was written")


def repo_id(value, field: str = "the repo id") -> str:
    """"name" or "namespace/name", by huggingface_hub's own rules (validate_repo_id)."""
    try:
        validate_repo_id(value)
    except HFValidationError as exc:
        raise refused(field, value, str(exc).split(":")[0].lower()) from None
    if not isinstance(value, str) or not value:
        raise refused(field, value, "a repo id is a non-empty string")
    return value


def commit(value, field: str = "the hub's commit (sha)") -> str:
    if not isinstance(value, str) or not COMMIT.fullmatch(value):
        raise refused(field, value, "a commit is 40 lowercase hex digits")
    return value


def relative_path(value, field: str) -> str:
    """A relative POSIX path: no empty, "." or ".." part, no backslash, no control character, not absolute,
    at most MAX_NAME_CHARS characters and MAX_PART_BYTES bytes a part."""
    if not isinstance(value, str):
        raise refused(field, value, "not a string")
    if not value or len(value) > MAX_NAME_CHARS:
        raise refused(field, value, f"a name is 1 to {MAX_NAME_CHARS} characters")
    if value.startswith("/"):
        raise refused(field, value, "an absolute path")
    if "\\" in value or _CONTROL.search(value):
        raise refused(field, value, "a backslash or a control character")
    parts = value.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise refused(field, value, "an empty, '.' or '..' part leaves or blurs the folder")
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES for p in parts):
        raise refused(field, value, f"a part longer than {MAX_PART_BYTES} bytes")
    assert PurePosixPath(value).parts == tuple(parts)
    return value


def file_name(value, field: str = "the hub's file name (rfilename)") -> str:
    return relative_path(value, field)


def revision(value, field: str = "the revision") -> str:
    """A branch, a tag ("v1.0", "refs/pr/1") or a commit: refs/<revision> is a file of the cache."""
    return relative_path(value, field)


def etag(value, field: str) -> str:
    """The ETag as a blob's name: quotes and a weak W/ dropped, then a sha256 (an LFS file) or a git blob sha1
    (any other file)."""
    if not isinstance(value, str):
        raise refused(field, value, "not a string")
    name = value.removeprefix("W/").strip('"')
    if not (SHA256.fullmatch(name) or GIT_SHA1.fullmatch(name)):
        raise refused(field, value, "an ETag is a sha256 (64 hex digits) or a git sha1 (40)")
    return name


def hash_or_none(value, pattern: re.Pattern, field: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise refused(field, value, f"not {pattern.pattern}")
    return value


def size_or_none(value, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_FILE_BYTES:
        raise refused(field, value, f"a size is a whole number of bytes from 0 to {MAX_FILE_BYTES}")
    return value

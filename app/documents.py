"""Turn files a user drops on a chat into text passages for retrieval.

Every failure a bad file can cause surfaces as `DocumentError`, whose message names the file and says what
to do, so the app can show it in its one error path and carry on with the other files.

Offsets are exact: for every passage, `document.text[p.start:p.end] == p.text`. Whitespace around a
passage is trimmed by moving its offsets, never by editing the text.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .document_formats import (
    LONE_SURROGATES,
    MAX_COMPRESSION_RATIO,
    MAX_UNPACKED_BYTES,
    DocumentError,
    check_zip,
    docx_text,
    human_size,
    normalize_newlines,
    pdf_text,
)
from .passages import Passage, markdown_headings, split_passages

MARKDOWN_SUFFIXES = frozenset({".md", ".markdown"})
TEXT_SUFFIXES = MARKDOWN_SUFFIXES | frozenset({".txt", ".text", ".rst", ".log", ".csv", ".tsv"})
CODE_SUFFIXES = frozenset({
    ".py", ".pyi", ".js", ".mjs", ".cjs", ".ts", ".tsx", ".jsx", ".java", ".c", ".h", ".cpp", ".hpp", ".cc",
    ".hh", ".cxx", ".cs", ".go", ".rs", ".rb", ".php", ".swift", ".kt", ".kts", ".scala", ".sh", ".bash",
    ".zsh", ".ps1", ".bat", ".sql", ".html", ".htm", ".css", ".scss", ".json", ".yaml", ".yml", ".toml",
    ".ini", ".cfg", ".conf", ".xml", ".lua", ".r", ".m", ".jl", ".dart", ".vue", ".svelte", ".pl", ".ex",
    ".exs", ".erl", ".hs", ".ml", ".clj", ".zig", ".nim", ".proto", ".graphql", ".tex", ".cmake",
})
# Build files that are code but carry no suffix.
CODE_FILE_NAMES = frozenset({"makefile", "dockerfile", "justfile", "gemfile", "rakefile"})
PDF_SUFFIX = ".pdf"
DOCX_SUFFIX = ".docx"

MAX_FILE_BYTES = 50 * 1024 * 1024

# Folders that hold tooling or dependencies rather than the user's documents.
SKIPPED_DIR_NAMES = frozenset({"__pycache__", ".git", "node_modules", ".venv", "venv", ".tox", ".mypy_cache"})

_HINTS_BY_SUFFIX = {".doc": "the old Word .doc format is not supported; save it as .docx and drop it again"}

# A text file decoded with a legacy code page is accepted only if control characters are this rare;
# binary data decodes "successfully" as latin-1 but is full of them.
_MAX_CONTROL_FRACTION = 0.01
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class ExtractedDocument:
    path: str
    name: str
    kind: str  # "text" | "markdown" | "pdf" | "docx" | "code"
    text: str
    passages: list[Passage]
    sha256: str  # of the file's bytes, not of `text`
    mtime: float
    size: int


def document_kind(path: str | Path) -> str | None:
    """The kind `extract` would give this file, from its name alone; None when unsupported."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in MARKDOWN_SUFFIXES:
        return "markdown"
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix == PDF_SUFFIX:
        return "pdf"
    if suffix == DOCX_SUFFIX:
        return "docx"
    if suffix in CODE_SUFFIXES or (not suffix and path.name.lower() in CODE_FILE_NAMES):
        return "code"
    return None


def is_supported(path: str | Path) -> bool:
    return document_kind(path) is not None


def display_name(path: str | Path) -> str:
    """The file's name for people: bytes of the name that are not valid in the file system's encoding (which
    Python keeps as lone surrogates, e.g. a Latin-1 name on a UTF-8 system) are shown as U+FFFD."""
    return LONE_SURROGATES.sub("\ufffd", Path(path).name)


def collect_files(paths: Iterable[str | Path]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Expand dropped paths into supported files, and say why each other path was skipped.

    Folders are walked recursively in sorted order. Hidden entries and tooling folders inside them are left
    out silently (a project folder would otherwise report thousands of .git objects); a hidden file dropped
    by itself is taken, since the user chose it. Each file appears once however often it was reached.

    Links inside a dropped folder are followed only when they end inside that folder: a downloaded folder
    must not be able to point the app at ~/.ssh or /etc. A link the user dropped by itself is taken.
    """
    files: list[Path] = []
    skipped: list[tuple[Path, str]] = []
    seen_files: set[Path] = set()
    seen_dirs: set[Path] = set()

    def add_file(path: Path) -> None:
        if document_kind(path) is None:
            skipped.append((path, _unsupported_reason(path)))
            return
        key = path.resolve()
        if key not in seen_files:
            seen_files.add(key)
            files.append(path)

    def walk(folder: Path, root: Path) -> None:
        key = folder.resolve()
        if key in seen_dirs:  # a symlink loop or the same folder dropped twice
            return
        seen_dirs.add(key)
        try:
            entries = sorted(folder.iterdir(), key=lambda entry: (entry.name.casefold(), entry.name))
        except OSError as error:
            skipped.append((folder, f"the folder could not be read ({_os_reason(error)})"))
            return
        for entry in entries:
            if entry.name.startswith(".") or entry.name in SKIPPED_DIR_NAMES:
                continue
            if entry.is_symlink():
                reason = _link_reason(entry, root)
                if reason is not None:
                    skipped.append((entry, reason))
                    continue
            if entry.is_dir():
                walk(entry, root)
            elif entry.is_file():
                add_file(entry)

    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            walk(path, path.resolve())
        elif path.is_file():
            add_file(path)
        elif path.exists():
            skipped.append((path, "not a regular file"))
        else:
            skipped.append((path, "not found"))
    return files, skipped


def _link_reason(link: Path, root: Path) -> str | None:
    """Why a link found under `root` (a resolved folder) is not followed; None when it ends inside root."""
    try:
        target = link.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a loop of links (Python < 3.13)
        return "a link that cannot be followed (it loops or cannot be read)"
    if target == root or target.is_relative_to(root):
        return None
    return "a link to outside the dropped folder (links are followed only within it)"


def file_signature(path: str | Path) -> tuple[float, int]:
    """(mtime, size): a cheap check of whether a file may have changed, before hashing it."""
    stat = Path(path).stat()
    return stat.st_mtime, stat.st_size


def sha256_file(path: str | Path, max_bytes: int = MAX_FILE_BYTES, *, block_bytes: int = 1024 * 1024) -> str:
    """The file's sha256, reading at most `max_bytes` + 1 bytes: DocumentError when it is larger (it may have
    grown since its size was checked)."""
    digest = hashlib.sha256()
    num_bytes = 0
    with open(path, "rb") as stream:
        while block := stream.read(min(block_bytes, max_bytes + 1 - num_bytes)):
            num_bytes += len(block)
            if num_bytes > max_bytes:
                raise _over_limit(display_name(Path(path)), max_bytes)
            digest.update(block)
    return digest.hexdigest()


def read_at_most(path: str | Path, max_bytes: int) -> bytes:
    """The file's bytes, reading at most `max_bytes` + 1 of them: DocumentError when there are more (a file that
    grows between its size check and this read is still read no further)."""
    with open(path, "rb") as stream:
        data = stream.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _over_limit(display_name(Path(path)), max_bytes)
    return data


def check_size(path: str | Path, size: int, max_bytes: int) -> None:
    """DocumentError when a file of `size` bytes cannot be a document: checked before every read of it."""
    _check_size(display_name(Path(path)), size, max_bytes)


def _over_limit(name: str, max_bytes: int) -> DocumentError:
    return DocumentError(f"{name} is over the {human_size(max_bytes)} limit for documents")


def extract(
    path: str | Path,
    *,
    max_bytes: int = MAX_FILE_BYTES,
    max_unpacked_bytes: int = MAX_UNPACKED_BYTES,
    max_compression_ratio: float = MAX_COMPRESSION_RATIO,
    passage_chars: int = 1000,
) -> ExtractedDocument:
    """Read one file into text and passages, or raise DocumentError saying why it cannot be used.

    Runs in the calling process without a time or memory bound; the app reads dropped files through
    app/document_worker.py, which adds both. MemoryError (also libxml2 running out) propagates as itself.
    """
    path = Path(path)
    name = display_name(path)
    stat = _stat_file(path, max_bytes)
    kind = document_kind(path)
    if kind is None:
        raise DocumentError(f"{name}: {_unsupported_reason(path)}")
    data = _read_bytes(path, max_bytes)

    pages = sections = None
    if kind == "pdf":
        text, pages = pdf_text(data, name)
    elif kind == "docx":
        check_zip(data, name, max_unpacked_bytes, max_compression_ratio)
        text, sections = docx_text(data, name)
    else:
        text = normalize_newlines(_decode_text(data, name))
        if kind == "markdown":
            sections = markdown_headings(text)

    if not text.strip():
        if kind == "pdf":
            raise DocumentError(
                f"{name} has no extractable text; it is probably scanned images, which need OCR before they "
                "can be read"
            )
        raise DocumentError(f"{name} has no text in it (it is blank or only whitespace)")

    return ExtractedDocument(
        path=str(path.absolute()),
        name=name,
        kind=kind,
        text=text,
        passages=split_passages(text, passage_chars=passage_chars, pages=pages, sections=sections),
        sha256=hashlib.sha256(data).hexdigest(),
        mtime=stat.st_mtime,
        size=len(data),
    )


def _stat_file(path: Path, max_bytes: int) -> os.stat_result:
    name = display_name(path)
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise DocumentError(f"{name} was not found; it may have been moved or deleted") from None
    except OSError as error:
        raise DocumentError(f"{name} could not be read ({_os_reason(error)})") from None
    if path.is_dir():
        raise DocumentError(f"{name} is a folder, not a file")
    _check_size(name, stat.st_size, max_bytes)
    return stat


def _read_bytes(path: Path, max_bytes: int) -> bytes:
    try:
        data = read_at_most(path, max_bytes)  # the file may have grown since it was checked
    except OSError as error:
        raise DocumentError(f"{display_name(path)} could not be read ({_os_reason(error)})") from None
    _check_size(display_name(path), len(data), max_bytes)  # or shrunk to nothing
    return data


def _check_size(name: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise DocumentError(f"{name} is {human_size(size)}, over the {human_size(max_bytes)} limit for documents")
    if size == 0:
        raise DocumentError(f"{name} is empty")


def _decode_text(data: bytes, name: str) -> str:
    binary = DocumentError(f"{name} looks like a binary file, not text")
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError:
            raise binary from None
        if not _looks_like_text(text):
            raise binary
        return text
    if b"\x00" in data:
        raise binary
    try:
        return data.decode("utf-8-sig")  # also plain UTF-8; drops a leading byte-order mark
    except UnicodeDecodeError:
        pass
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:  # cp1252 leaves five bytes undefined; latin-1 maps every byte
        text = data.decode("latin-1")
    if not _looks_like_text(text):
        raise binary
    return text


def _looks_like_text(text: str) -> bool:
    return len(_CONTROL_CHARS.findall(text)) <= len(text) * _MAX_CONTROL_FRACTION


def _unsupported_reason(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in _HINTS_BY_SUFFIX:
        return _HINTS_BY_SUFFIX[suffix]
    if not suffix:
        return "files without an extension are not supported"
    return f"{suffix} files are not supported (text, Markdown, PDF, Word .docx and source code are)"


def _os_reason(error: OSError) -> str:
    return error.strerror.lower() if error.strerror else str(error)

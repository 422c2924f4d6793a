"""PDF and Word (.docx) files as text, and the error every document reader raises.

A PDF gives its pages joined by blank lines and where each page starts; a .docx its paragraphs and tables in
body order and where each heading starts. Damaged, encrypted and zip-bomb files end in `DocumentError`; memory
running out (also inside libxml2) stays a MemoryError, which app/document_worker.py reports as such.
"""

from __future__ import annotations

import io
import re
import zipfile

import docx
import pypdf
from docx.table import Table
from lxml import etree
from pypdf.errors import DependencyError

# A .docx is a zip: its size on disk says little about what parsing it takes (python-docx holds every part in
# memory and builds a tree of its XML, several times the XML's size). These bound it from the zip's directory
# before anything is unpacked. Ordinary documents unpack to a few times their size; a zip bomb to thousands.
MAX_UNPACKED_BYTES = 256 * 1024 * 1024  # all members together
MAX_COMPRESSION_RATIO = 100.0  # unpacked / packed, for any member that unpacks to more than _RATIO_FLOOR_BYTES
MAX_ZIP_MEMBERS = 10_000
_RATIO_FLOOR_BYTES = 1024 * 1024  # small parts of repeated markup legitimately pack very well

LONE_SURROGATES = re.compile("[\ud800-\udfff]")


class DocumentError(ValueError):
    """A file cannot be turned into passages. The message is for the user: it names the file and why."""


def pdf_text(data: bytes, name: str) -> tuple[str, list[tuple[int, int]]]:
    """Page texts joined by blank lines, and where each page starts: [(offset, page_number)]."""
    # pypdf reports damaged files with many exception types (its own, ValueError, KeyError, struct and
    # zlib errors...), so anything it raises while reading is taken to mean the file is damaged.
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            _unlock_pdf(reader, name)
        page_texts = []
        for number, page in enumerate(reader.pages, start=1):
            try:
                page_texts.append(normalize_newlines(page.extract_text() or "").replace("\x00", "").strip())
            except Exception as error:  # noqa: BLE001  (see above)
                _reraise_out_of_memory(error)
                raise DocumentError(f"{name}: page {number} could not be read ({short(error)})") from None
    except DocumentError:
        raise
    except Exception as error:  # noqa: BLE001  (see above)
        _reraise_out_of_memory(error)
        raise DocumentError(f"{name} could not be read as a PDF; the file looks damaged ({short(error)})") from None

    pieces, page_starts, offset = [], [], 0
    for number, page_text in enumerate(page_texts, start=1):
        page_starts.append((offset, number))
        pieces.append(page_text)
        offset += len(page_text) + 2
    return "\n\n".join(pieces), page_starts


def _unlock_pdf(reader: pypdf.PdfReader, name: str) -> None:
    # Many PDFs are encrypted only to carry an owner password; their user password is empty.
    try:
        unlocked = reader.decrypt("")
    except DependencyError:
        raise DocumentError(
            f"{name} is encrypted with AES, which this installation cannot decrypt; save an unprotected copy "
            "and drop it again"
        ) from None
    if unlocked == pypdf.PasswordType.NOT_DECRYPTED:
        raise DocumentError(f"{name} is encrypted (password-protected); remove the password and drop it again")


def docx_text(data: bytes, name: str) -> tuple[str, list[tuple[int, str]]]:
    """Paragraphs and tables in body order, joined by blank lines; table rows one per line, cells by ' | '.
    Headings ('Title' and 'Heading N' paragraph styles) are returned as [(offset, heading)]."""
    try:
        document = docx.Document(io.BytesIO(data))
        blocks: list[tuple[str, bool]] = []  # (text, is_heading)
        # Looking a style up costs a search of the styles part; a document has few, so each is looked up once.
        heading_by_style_id: dict[str | None, bool] = {}
        for item in document.iter_inner_content():
            if isinstance(item, Table):
                blocks.append((_docx_table_text(item), False))
                continue
            style_id = item._p.style
            if style_id not in heading_by_style_id:
                style_name = item.style.name if item.style is not None else ""
                heading_by_style_id[style_id] = style_name == "Title" or style_name.startswith("Heading")
            blocks.append((item.text, heading_by_style_id[style_id]))
    except Exception as error:  # noqa: BLE001  (python-docx raises zip, XML, KeyError... for damaged files)
        _reraise_out_of_memory(error)
        raise DocumentError(
            f"{name} could not be read as a Word document; the file looks damaged ({short(error)})"
        ) from None

    pieces, headings, offset = [], [], 0
    for block_text, is_heading in blocks:
        block_text = normalize_newlines(block_text).strip()
        if not block_text:
            continue
        if is_heading:
            headings.append((offset, " ".join(block_text.split())))
        pieces.append(block_text)
        offset += len(block_text) + 2
    return "\n\n".join(pieces), headings


def check_zip(data: bytes, name: str, max_unpacked_bytes: int, max_ratio: float) -> None:
    """Refuse a zip whose directory says it unpacks too large, or much larger than it packs (a zip bomb).

    The directory's sizes can be trusted: zipfile stops a member at its declared size (and fails its CRC if
    the data runs on), and python-docx reads members through zipfile.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as error:
        raise DocumentError(
            f"{name} could not be read as a Word document; the file looks damaged ({short(error)})"
        ) from None
    if len(members) > MAX_ZIP_MEMBERS:
        raise DocumentError(f"{name} holds {len(members)} parts, over the {MAX_ZIP_MEMBERS} a Word document may have")
    unpacked = sum(member.file_size for member in members)
    if unpacked > max_unpacked_bytes:
        raise DocumentError(
            f"{name} unpacks to {human_size(unpacked)}, over the {human_size(max_unpacked_bytes)} limit for Word "
            "documents"
        )
    for member in members:
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > _RATIO_FLOOR_BYTES and ratio > max_ratio:
            raise DocumentError(
                f"{name}: {member.filename} unpacks to {ratio:.0f}x its packed size ({human_size(member.file_size)}), "
                f"over the {max_ratio:g}x limit; the file looks built to exhaust memory (a zip bomb)"
            )


def _reraise_out_of_memory(error: Exception) -> None:
    """Raise MemoryError if `error` says memory ran out: Python's MemoryError, or libxml2 (python-docx's XML
    parser) failing an allocation, which lxml reports as a syntax error with code ERR_NO_MEMORY."""
    if isinstance(error, MemoryError):
        raise error
    if isinstance(error, etree.XMLSyntaxError) and error.code == etree.ErrorTypes.ERR_NO_MEMORY:
        raise MemoryError(str(error)) from error


def _docx_table_text(table: Table) -> str:
    rows = []
    for row in table.rows:
        cells, previous = [], None
        for cell in row.cells:
            if cell._tc is previous:  # a horizontally merged cell is listed once per grid column it spans
                continue
            previous = cell._tc
            cells.append(" ".join(cell.text.split()))
        if any(cells):
            rows.append(" | ".join(cells))
    return "\n".join(rows)


def short(error: Exception, limit: int = 120) -> str:
    message = " ".join(str(error).split()) or type(error).__name__
    return message if len(message) <= limit else message[: limit - 3] + "..."


def human_size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} bytes"
    if num_bytes < 1024 * 1024:
        return f"{num_bytes / 1024:.1f} KB"
    return f"{num_bytes / (1024 * 1024):.1f} MB"



def normalize_newlines(text: str) -> str:
    """Newlines as \\n, and lone surrogates (a PDF's broken ToUnicode map can yield them; SQLite and the
    tokenizer refuse them) as U+FFFD: one character for one, so offsets stay valid."""
    return LONE_SURROGATES.sub("\ufffd", text.replace("\r\n", "\n").replace("\r", "\n"))

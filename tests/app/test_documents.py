"""Dropped files become exact, bounded passages; every bad file becomes a DocumentError naming it."""

from __future__ import annotations

import hashlib
import io
import os
import random
import zipfile
from pathlib import Path

import docx
import pytest
from fpdf import FPDF
from pypdf import PdfWriter

from app.documents import (
    DocumentError,
    collect_files,
    extract,
    file_signature,
    is_supported,
    sha256_file,
)
from app.passages import markdown_headings, split_passages

PAGE_WORDS = {1: "aardvark", 2: "bumblebee", 3: "chinchilla"}


def make_pdf(page_texts: list[str]) -> bytes:
    pdf = FPDF()
    pdf.set_font("Helvetica", size=11)
    for page_text in page_texts:
        pdf.add_page()
        pdf.multi_cell(0, 6, page_text)
    return bytes(pdf.output())


def three_page_pdf() -> bytes:
    return make_pdf([
        " ".join(f"The {word} paragraph number {n} talks about page {page}." for n in range(12))
        for page, word in PAGE_WORDS.items()
    ])


def encrypted(pdf_bytes: bytes, user_password: str, owner_password: str) -> bytes:
    writer = PdfWriter(clone_from=io.BytesIO(pdf_bytes))
    writer.encrypt(user_password, owner_password)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def assert_passages_exact(document_text: str, passages, passage_chars: int) -> None:
    assert passages, "expected at least one passage"
    previous_end = 0
    for passage in passages:
        assert document_text[passage.start:passage.end] == passage.text
        assert passage.text == passage.text.strip() and passage.text
        assert len(passage.text) <= 1.5 * passage_chars
        assert passage.start >= previous_end
        previous_end = passage.end
    # Nothing but whitespace is left out between passages.
    covered = "".join(document_text[p.start:p.end] for p in passages)
    assert "".join(covered.split()) == "".join(document_text.split())


# --- PDF -------------------------------------------------------------------------------------------------


def test_pdf_passages_carry_the_page_their_text_is_on(tmp_path):
    path = write(tmp_path / "animals.pdf", three_page_pdf())

    document = extract(path, passage_chars=300)

    assert document.kind == "pdf"
    assert document.name == "animals.pdf"
    for page, word in PAGE_WORDS.items():
        with_word = [p for p in document.passages if word in p.text]
        assert with_word, f"no passage mentions {word}"
        assert {p.page for p in with_word} == {page}
    assert {p.page for p in document.passages} == {1, 2, 3}
    assert all(p.section is None for p in document.passages)
    assert_passages_exact(document.text, document.passages, 300)


def test_pdf_passage_never_spans_two_pages_even_when_pages_are_short(tmp_path):
    path = write(tmp_path / "short.pdf", make_pdf(["First page.", "Second page.", "Third page."]))

    document = extract(path, passage_chars=1000)

    assert [(p.text, p.page) for p in document.passages] == [
        ("First page.", 1), ("Second page.", 2), ("Third page.", 3),
    ]


def test_pdf_with_a_user_password_is_refused_as_encrypted(tmp_path):
    path = write(tmp_path / "report.pdf", encrypted(three_page_pdf(), "secret", "owner"))

    with pytest.raises(DocumentError, match="report.pdf is encrypted"):
        extract(path)


def test_pdf_encrypted_with_an_empty_user_password_opens(tmp_path):
    path = write(tmp_path / "locked-for-editing.pdf", encrypted(three_page_pdf(), "", "owner"))

    document = extract(path)

    assert {p.page for p in document.passages if "bumblebee" in p.text} == {2}
    assert {p.page for p in document.passages if "chinchilla" in p.text} == {3}


@pytest.mark.parametrize("content", [
    b"%PDF-1.7\n" + bytes(random.Random(1).getrandbits(8) for _ in range(4000)),
    b"this is not a pdf at all",
    three_page_pdf()[:300],
], ids=["garbage-after-header", "not-a-pdf", "truncated"])
def test_damaged_pdf_is_a_document_error_naming_the_file(tmp_path, content):
    path = write(tmp_path / "broken.pdf", content)

    with pytest.raises(DocumentError, match="broken.pdf"):
        extract(path)


def test_pdf_without_text_says_it_is_probably_scanned(tmp_path):
    pdf = FPDF()
    pdf.add_page()
    pdf.rect(20, 20, 100, 60, style="F")
    path = write(tmp_path / "scan.pdf", bytes(pdf.output()))

    with pytest.raises(DocumentError, match="scan.pdf has no extractable text.*scanned"):
        extract(path)


# --- DOCX ------------------------------------------------------------------------------------------------


def make_docx(path: Path) -> Path:
    document = docx.Document()
    document.add_heading("Quarterly Report", level=0)
    document.add_paragraph("This report covers the third quarter.")
    document.add_heading("Revenue", level=1)
    document.add_paragraph("Revenue grew in every region.")
    table = document.add_table(rows=2, cols=2)
    for row, (product, units) in enumerate([("Widgets", "42"), ("Gadgets", "17")]):
        table.cell(row, 0).text = product
        table.cell(row, 1).text = units
    document.add_heading("Risks", level=2)
    document.add_paragraph("Supply of sprockets is uncertain.")
    document.save(path)
    return path


def test_docx_passages_carry_their_heading_and_table_rows_are_text(tmp_path):
    document = extract(make_docx(tmp_path / "q3.docx"))

    assert document.kind == "docx"
    assert "Widgets | 42\nGadgets | 17" in document.text
    section_of = {p.text.splitlines()[-1]: p.section for p in document.passages}
    assert section_of["This report covers the third quarter."] == "Quarterly Report"
    assert section_of["Gadgets | 17"] == "Revenue"
    assert section_of["Supply of sprockets is uncertain."] == "Risks"
    assert all(p.page is None for p in document.passages)
    assert_passages_exact(document.text, document.passages, 1000)


def zip_without_a_document() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("hello.txt", "hello")
    return buffer.getvalue()


@pytest.mark.parametrize("content", [
    bytes(random.Random(2).getrandbits(8) for _ in range(3000)),
    zip_without_a_document(),
], ids=["random-bytes", "zip-without-document"])
def test_damaged_docx_is_a_document_error_naming_the_file(tmp_path, content):
    path = write(tmp_path / "contract.docx", content)

    with pytest.raises(DocumentError, match="contract.docx could not be read as a Word document"):
        extract(path)


# --- Markdown, code and plain text ----------------------------------------------------------------------

README = """\
# Install

Run the installer and wait.

```bash
# this comment is not a heading
pip install kvboost
```

## Usage

Type a question and press Enter.

Usage notes
===========

Notes under an underlined heading.
"""


def test_markdown_passages_carry_the_heading_above_them_and_fenced_hashes_are_not_headings(tmp_path):
    document = extract(write(tmp_path / "README.md", README))

    assert document.kind == "markdown"
    assert [heading for _, heading in markdown_headings(document.text)] == ["Install", "Usage", "Usage notes"]
    section_of = {p.text.splitlines()[-1]: p.section for p in document.passages}
    assert section_of["```"] == "Install"
    assert section_of["Type a question and press Enter."] == "Usage"
    assert section_of["Notes under an underlined heading."] == "Usage notes"
    assert_passages_exact(document.text, document.passages, 1000)


def test_markdown_front_matter_and_tilde_fences_hide_headings():
    text = "---\ntitle: x\n# not a heading\n---\n\n~~~\n# nor this\n~~~\n\n# Real\n"

    assert markdown_headings(text) == [(text.index("# Real"), "Real")]


def test_python_file_is_code_kept_as_text(tmp_path):
    source = "import os\n\n\ndef main():\n    return os.getcwd()\n\n\nclass Thing:\n    pass\n"
    document = extract(write(tmp_path / "tool.py", source), passage_chars=40)

    assert document.kind == "code"
    assert document.text == source
    assert [p.text for p in document.passages] == [
        "import os", "def main():\n    return os.getcwd()", "class Thing:\n    pass",
    ]
    assert all(p.section is None and p.page is None for p in document.passages)


def test_windows_text_encodings_and_line_endings_are_read(tmp_path):
    cp1252 = extract(write(tmp_path / "menu.txt", "Café – naïve\r\n\r\nrésumé".encode("cp1252")), passage_chars=12)
    utf16 = extract(write(tmp_path / "notes.txt", "Grüße\r\nfrom Notepad".encode("utf-16")))

    assert cp1252.text == "Café – naïve\n\nrésumé"
    assert [p.text for p in cp1252.passages] == ["Café – naïve", "résumé"]
    assert utf16.text == "Grüße\nfrom Notepad"


@pytest.mark.parametrize("content", [
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4,
    b"valid utf-8 words " * 40 + b"\x00\x00",
    bytes(range(1, 256)) * 8,
], ids=["png", "utf8-with-nul-bytes", "control-bytes-without-nul"])
def test_binary_file_renamed_to_txt_is_refused(tmp_path, content):
    path = write(tmp_path / "photo.txt", content)

    with pytest.raises(DocumentError, match="photo.txt looks like a binary file"):
        extract(path)


def test_empty_and_whitespace_only_files_are_refused(tmp_path):
    with pytest.raises(DocumentError, match="empty.md is empty"):
        extract(write(tmp_path / "empty.md", b""))
    with pytest.raises(DocumentError, match="blank.txt has no text"):
        extract(write(tmp_path / "blank.txt", " \n\n\t  \r\n"))


def test_file_over_the_size_limit_is_refused_with_its_size(tmp_path):
    path = write(tmp_path / "big.txt", "word " * 100)

    with pytest.raises(DocumentError, match=r"big.txt is 500 bytes, over the 100 bytes limit"):
        extract(path, max_bytes=100)


def test_missing_folder_and_unsupported_paths_are_refused(tmp_path):
    with pytest.raises(DocumentError, match="gone.txt was not found"):
        extract(tmp_path / "gone.txt")
    with pytest.raises(DocumentError, match="is a folder"):
        extract(tmp_path)
    with pytest.raises(DocumentError, match=r"setup.exe: \.exe files are not supported"):
        extract(write(tmp_path / "setup.exe", b"MZ\x90\x00"))


def test_extracted_document_records_hash_size_and_mtime_of_the_file(tmp_path):
    data = b"Hello, passages.\n"
    path = write(tmp_path / "hello.txt", data)

    document = extract(path)

    assert document.sha256 == hashlib.sha256(data).hexdigest() == sha256_file(path)
    assert document.size == len(data)
    assert (document.mtime, document.size) == file_signature(path) == (os.stat(path).st_mtime, len(data))
    assert document.path == str(path.absolute())


def test_sha256_file_streams_files_larger_than_one_block(tmp_path):
    data = bytes(random.Random(3).getrandbits(8) for _ in range(50_000))
    path = write(tmp_path / "blob.bin", data)

    assert sha256_file(path, block_bytes=4096) == hashlib.sha256(data).hexdigest()


# --- Collecting dropped paths ---------------------------------------------------------------------------


def test_collect_files_walks_folders_in_order_and_explains_skipped_files(tmp_path):
    root = tmp_path / "project"
    for relative in ["b.md", "a.txt", "sub/c.py", "sub/deeper/d.docx", "Notes.rst",
                     ".hidden.txt", ".git/config.txt", "node_modules/lib.js", "sub/__pycache__/c.py",
                     ".venv/site.py", "tool.exe", "sub/pic.png"]:
        write(root / relative, "x")
    dropped_directly = write(tmp_path / ".env.md", "x")

    files, skipped = collect_files([root, root / "a.txt", dropped_directly, tmp_path / "missing.pdf"])

    assert [f.relative_to(tmp_path).as_posix() for f in files] == [
        "project/a.txt", "project/b.md", "project/Notes.rst", "project/sub/c.py", "project/sub/deeper/d.docx",
        ".env.md",
    ]
    reasons = {path.relative_to(tmp_path).as_posix(): reason for path, reason in skipped}
    assert set(reasons) == {"project/sub/pic.png", "project/tool.exe", "missing.pdf"}
    assert ".png" in reasons["project/sub/pic.png"] and ".exe" in reasons["project/tool.exe"]
    assert reasons["missing.pdf"] == "not found"


def test_supported_types_are_recognised_by_suffix_in_any_case():
    assert all(is_supported(name) for name in ["a.PDF", "b.Docx", "c.md", "d.ts", "e.R", "Makefile", "f.yml"])
    assert not any(is_supported(name) for name in ["a.exe", "b.png", "c.doc", "d"])


# --- Splitting -----------------------------------------------------------------------------------------


def test_paragraphs_are_packed_whole_up_to_the_passage_size():
    paragraphs = [("alpha " * 66).strip(), ("beta " * 80).strip(), ("gamma " * 66).strip()]  # ~400 chars each
    text = "\n\n".join(paragraphs)

    passages = split_passages(text, passage_chars=1000)

    assert [p.text for p in passages] == [paragraphs[0] + "\n\n" + paragraphs[1], paragraphs[2]]


def test_long_paragraph_is_split_at_sentence_ends():
    sentences = [f"Sentence {n} says something moderately long about topic {n}." for n in range(60)]
    text = " ".join(sentences)

    passages = split_passages(text, passage_chars=500)

    assert len(passages) > 3
    assert all(p.text.endswith(".") and p.text.startswith("Sentence") for p in passages)
    assert all(len(p.text) <= 500 for p in passages[:-1])


def test_a_small_last_piece_joins_the_passage_before_it():
    text = "x" * 900 + "\n\n" + "tail words " * 12 + "end"  # 1038 chars, a tail of 135

    passages = split_passages(text, passage_chars=1000)

    assert [p.text for p in passages] == [text]


def test_a_word_longer_than_a_passage_is_cut_but_other_words_are_not():
    text = "short words here " + "z" * 250 + " and more short words after it"

    passages = split_passages(text, passage_chars=100)

    assert_passages_exact(text, passages, 100)
    for p in passages:
        if "z" * 5 not in p.text:
            assert p.start == 0 or text[p.start - 1].isspace()
            assert p.end == len(text) or text[p.end].isspace()


def test_sections_start_passages_and_label_everything_after_them():
    text = "preamble\n\n# One\nbody one\n\n# Two\nbody two"
    sections = [(text.index("# One"), "One"), (text.index("# Two"), "Two")]

    passages = split_passages(text, passage_chars=1000, sections=sections)

    assert [(p.text, p.section) for p in passages] == [
        ("preamble", None), ("# One\nbody one", "One"), ("# Two\nbody two", "Two"),
    ]


@pytest.mark.parametrize("passage_chars", [20, 120, 1000])
def test_offsets_are_exact_and_sizes_bounded_on_messy_text(passage_chars):
    rng = random.Random(passage_chars)
    words = ["lorem", "ipsum", "dolor", "sit", "amet.", "consectetur,", "x" * 300, "Ünïcode", "end!", "why?"]
    blocks = []
    for _ in range(80):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
        blocks.append(line + rng.choice(["\n\n", "\n", "  \n \n\n", " ", "\t\n"]))
    text = "  \n" + "".join(blocks) + "\n\n   "
    pages = [(0, 1), (len(text) // 3, 2), (2 * len(text) // 3, 3)]

    passages = split_passages(text, passage_chars=passage_chars, pages=pages)

    assert_passages_exact(text, passages, passage_chars)
    for p in passages:
        page_start = max(start for start, _ in pages if start <= p.start)
        assert p.page == dict(pages)[page_start]
        assert all(not (p.start < start < p.end) for start, _ in pages)


def test_whitespace_only_text_has_no_passages_and_bad_size_is_refused():
    assert split_passages(" \n\n \t") == []
    with pytest.raises(ValueError, match="passage_chars must be at least 1, got 0"):
        split_passages("text", passage_chars=0)

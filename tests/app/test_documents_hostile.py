"""Hostile folders and names: links out of a dropped folder, file names that are not UTF-8. Each is skipped
with a reason or stored as the OS gave it; the app carries on."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from app.documents import collect_files, extract

# --- links in a dropped folder ---------------------------------------------------------------------------


def test_links_in_a_dropped_folder_are_followed_only_within_it(tmp_path):
    outside = tmp_path / "outside"
    (outside / "private").mkdir(parents=True)
    (outside / "passwd.txt").write_text("root:x:0:0", encoding="utf-8")
    (outside / "private" / "diary.md").write_text("secret", encoding="utf-8")
    dropped = tmp_path / "downloaded"
    (dropped / "docs").mkdir(parents=True)
    (dropped / "docs" / "guide.md").write_text("# Guide", encoding="utf-8")
    (dropped / "readme.txt").write_text("hello", encoding="utf-8")
    (dropped / "passwd.txt").symlink_to(outside / "passwd.txt")  # absolute link out
    (dropped / "private").symlink_to(Path("..") / "outside" / "private")  # relative link to a folder out
    (dropped / "chain.txt").symlink_to(dropped / "passwd.txt")  # a link inside that ends outside
    (dropped / "alias.md").symlink_to(Path("docs") / "guide.md")  # stays inside: followed
    (dropped / "manual").symlink_to(dropped / "docs")  # a folder inside: its files once

    files, skipped = collect_files([dropped])

    assert {f.resolve() for f in files} == {(dropped / "docs" / "guide.md").resolve(),
                                            (dropped / "readme.txt").resolve()}
    reasons = {path.name: reason for path, reason in skipped}
    assert set(reasons) == {"passwd.txt", "private", "chain.txt"}
    assert all("outside the dropped folder" in reason for reason in reasons.values())

    # A link the user dropped by itself is their choice.
    files, skipped = collect_files([dropped / "passwd.txt"])
    assert files == [dropped / "passwd.txt"] and skipped == []


# --- file names that are not UTF-8 -----------------------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system that takes any bytes as a name")
def test_file_name_that_is_not_utf8_is_indexed_stored_and_found_again(tmp_path, db):
    folder = tmp_path / "mixed"
    folder.mkdir()
    raw_path = os.fsencode(folder) + b"/caf\xe9 notes.txt"  # Latin-1 é: not valid UTF-8
    with open(raw_path, "wb") as f:
        f.write(b"The meeting moved to Thursday.")

    files, skipped = collect_files([folder])
    assert skipped == [] and len(files) == 1
    document = extract(files[0])
    assert document.name == "caf\ufffd notes.txt"  # shown with a replacement character
    assert os.fsencode(document.path) == raw_path

    row = db.upsert_document(document.path, document.name, document.kind, document.sha256, document.mtime,
                             document.size, len(document.text),
                             [{"text": p.text, "page": p.page, "section": p.section, "start": p.start, "end": p.end}
                              for p in document.passages])
    again = db.find_document(document.path)
    assert again["id"] == row["id"] and again["path"] == document.path and again["name"] == "caf\ufffd notes.txt"
    assert db.upsert_document_signature(row["id"], 5.0, document.size)["path"] == document.path
    assert db.find_document(str(folder / "caf notes.txt")) is None
    # Listings give the path as the OS gave it too (the chat's sources open it)
    cid = db.create_conversation("c")["id"]
    db.attach_document(cid, row["id"])
    assert [d["path"] for d in db.conversation_documents(cid)] == [document.path]
    assert [p["path"] for p in db.search_passages(cid, "meeting Thursday")] == [document.path]
    # Another undecodable name is another document.
    other = db.upsert_document(os.fsdecode(os.fsencode(folder) + b"/caf\xe8 notes.txt"), "other", "text",
                               "0" * 64, 1.0, 1, 1, [])
    assert other["id"] != row["id"]


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system that takes any bytes as a name")
@pytest.mark.timeout(60)
def test_dropping_a_non_utf8_file_name_twice_does_no_work_the_second_time(qtbot, db, client, aio_loop, tmp_path):
    from app.conversation_tab import ConversationTab

    folder = tmp_path / "cv"
    folder.mkdir()
    with open(os.fsencode(folder) + b"/r\xe9sum\xe9.md", "wb") as f:
        f.write(b"# Experience\n\nTwelve years of lighthouse keeping.\n")
    tab = ConversationTab(db.create_conversation(), db, client, "light")
    qtbot.addWidget(tab)

    first = aio_loop.run_until_complete(tab.add_paths([str(folder)]))
    second = aio_loop.run_until_complete(tab.add_paths([str(folder)]))

    assert first == {"added": 1, "unchanged": 0, "problems": []}
    assert second == {"added": 0, "unchanged": 1, "problems": []}
    assert [d["name"] for d in db.conversation_documents(tab.conversation_id)] == ["r\ufffdsum\ufffd.md"]
    assert "r\ufffdsum\ufffd.md" in tab.docs_label.text()


def _pdf_whose_text_maps_to(target_hex: str) -> bytes:
    """A one-page PDF showing "ABAB" in a font whose ToUnicode map sends B to UTF-16 code unit `target_hex`."""
    cmap = ("/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /X def "
            "1 begincodespacerange <00> <FF> endcodespacerange 2 beginbfchar <41> <0041> <42> <%s> endbfchar "
            "endcmap CMapName currentdict /CMap defineresource pop end end" % target_hex).encode()
    content = b"BT /F1 24 Tf 72 720 Td (ABAB) Tj ET"
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode 6 0 R >>",
               b"<< /Length %d >>\nstream\n" % len(cmap) + cmap + b"\nendstream"]
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)


def test_pdf_text_with_lone_surrogates_is_indexed_with_replacement_characters(tmp_path, db):
    """A broken ToUnicode map makes pypdf return lone surrogates, which SQLite refuses to store."""
    path = tmp_path / "broken-font.pdf"
    path.write_bytes(_pdf_whose_text_maps_to("D800"))
    document = extract(path)
    assert document.text == "A\ufffdA\ufffd"
    row = db.upsert_document(document.path, document.name, document.kind, document.sha256, document.mtime,
                             document.size, len(document.text),
                             [{"text": p.text, "page": p.page, "section": p.section, "start": p.start, "end": p.end}
                              for p in document.passages])
    assert [p["text"] for p in db.passages(row["id"])] == ["A\ufffdA\ufffd"]

"""Dropping real PDF/DOCX files on a conversation: indexing, pre-warm, sources, reuse, bad files."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent
from qt_helpers import WAIT_MS, send

FACT_PAGE_2 = "The lighthouse keeper on Gull Island is named Margarethe Olsen."


def make_pdf(path: Path) -> Path:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    pages = [
        "Gull Island guide. The island lies twelve kilometres off the coast and has one harbour.",
        FACT_PAGE_2 + " She has kept the light since 1998 and writes a weather diary every day.",
        "Ferries leave the harbour at eight in the morning and return at six in the evening.",
    ]
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    pdf.output(str(path))
    return path


def make_docx(path: Path) -> Path:
    import docx

    document = docx.Document()
    document.add_heading("Harbour rules", level=1)
    document.add_paragraph("Boats must moor at the north pier. The harbour master is Tomas Berg.")
    document.add_heading("Fees", level=1)
    document.add_paragraph("Mooring costs forty crowns per night, paid at the harbour office.")
    document.save(str(path))
    return path


def drop(tab, paths):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    event = QDropEvent(QPointF(10, 10), Qt.CopyAction, mime, Qt.LeftButton, Qt.NoModifier)
    # Qt delivers a Drop only inside a platform drag session, which offscreen tests cannot start; the
    # widget's handler gets the same event object a real drop would bring.
    tab.dropEvent(event)
    assert event.isAccepted()
    return tab._ingest_task


def test_dropped_pdf_and_docx_are_indexed_prewarmed_and_answer_with_sources(qtbot, window, tmp_path, aio_loop):
    db = window.db
    tab = window.current_tab()
    db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 24})
    folder = tmp_path / "island"
    folder.mkdir()
    pdf, docx_path = make_pdf(folder / "gull.pdf"), make_docx(folder / "harbour.docx")
    with qtbot.waitSignal(tab.warm_ended, timeout=WAIT_MS) as warmed:
        report = aio_loop.run_until_complete(drop(tab, [folder]))  # a folder: both files inside
    assert report == {"added": 2, "unchanged": 0, "problems": []}
    assert warmed.args[0].computed_tokens > 100 and not warmed.args[0].cancelled
    docs = db.conversation_documents(tab.conversation_id)
    assert sorted(d["name"] for d in docs) == ["gull.pdf", "harbour.docx"]
    pages = {p["page"] for d in docs if d["kind"] == "pdf" for p in db.passages(d["id"])}
    assert pages == {1, 2, 3}
    assert "gull.pdf" in tab.docs_label.text() and "harbour.docx" in tab.docs_label.text()

    # Re-dropping unchanged files does no work at all: no indexing, no pre-warm job.
    jobs = []
    tab.warm_progressed.connect(lambda *a: jobs.append(a))
    report = aio_loop.run_until_complete(drop(tab, [pdf, docx_path]))
    assert report == {"added": 0, "unchanged": 2, "problems": []}
    qtbot.wait(200)
    assert jobs == []

    answer = send(qtbot, tab, "Who is the lighthouse keeper on Gull Island?")
    stats = answer.stats
    # The pre-warmed documents come from cache on the very first question.
    assert stats["reused_tokens"] / stats["prompt_tokens"] > 0.8
    assert "Olsen" in answer.text or "Margarethe" in answer.text
    saved = db.messages(tab.conversation_id)[-1]
    assert saved["sources"][0]["name"] == "gull.pdf" and saved["sources"][0]["page"] == 2
    widget = tab.chat_view.widgets[-1]
    buttons = [b for b in widget.findChildren(type(widget.regenerate_button)) if b.objectName() == "sourceButton"]
    assert buttons and buttons[0].text() == "gull.pdf p.2" and FACT_PAGE_2[:30] in buttons[0].toolTip()

    follow_up = send(qtbot, tab, "How much does mooring cost per night?")
    assert follow_up.stats["reused_tokens"] / follow_up.stats["prompt_tokens"] > 0.9
    assert {s["kind"] for s in follow_up.segments} <= {"EXACT", "PREFIX", "MISS"}


def test_bad_files_get_a_message_and_the_app_keeps_working(qtbot, window, tmp_path, aio_loop):
    from pypdf import PdfWriter

    locked = tmp_path / "locked.pdf"
    writer = PdfWriter()
    writer.add_blank_page(200, 200)
    writer.encrypt(user_password="secret", owner_password="owner")
    with open(locked, "wb") as f:
        writer.write(f)
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 40)
    empty = tmp_path / "empty.md"
    empty.write_text("")
    good = tmp_path / "notes.md"
    good.write_text("# Notes\n\nThe spare key is under the red flower pot.\n")
    tab = window.current_tab()
    report = aio_loop.run_until_complete(drop(tab, [locked, binary, empty, good]))
    assert report["added"] == 1 and len(report["problems"]) == 3
    text = window.banner_label.text()
    assert window.banner.isVisible()
    assert "locked.pdf" in text and "encrypted" in text and "blob.txt" in text and "empty.md" in text
    assert [d["name"] for d in window.db.conversation_documents(tab.conversation_id)] == ["notes.md"]
    answer = send(qtbot, tab, "Where is the spare key?")
    assert answer.finish_reason in ("stop", "length")


def test_removing_a_document_takes_it_out_of_the_prompt(qtbot, window, tmp_path, aio_loop):
    tab = window.current_tab()
    window.db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 8})
    note = tmp_path / "pets.txt"
    note.write_text("The cat is called Pixel and the dog is called Biscuit.\n")
    aio_loop.run_until_complete(drop(tab, [note]))
    doc = window.db.conversation_documents(tab.conversation_id)[0]
    tab.on_docs_label_link_activated(f"remove:{doc['id']}")
    assert window.db.conversation_documents(tab.conversation_id) == []
    answer = send(qtbot, tab, "What is the cat called?")
    assert all("Pixel" not in seg["text"] for seg in answer.segments)


def test_prewarm_shows_progress_and_can_be_cancelled(qtbot, window, tmp_path, aio_loop):
    tab = window.current_tab()
    paths = []
    for i in range(4):
        path = tmp_path / f"part{i}.md"
        path.write_text(f"# Part {i}\n\n" + f"Section {i} talks about tides and harbours. " * 25, encoding="utf-8")
        paths.append(path)
    steps = []
    tab.warm_progressed.connect(lambda done, total: steps.append((done, total)))
    with qtbot.waitSignal(tab.warm_progressed, timeout=WAIT_MS):
        aio_loop.run_until_complete(drop(tab, paths))
        assert tab.progress.isVisible() and tab.cancel_docs_button.isVisible()
    with qtbot.waitSignal(tab.warm_ended, timeout=WAIT_MS) as finished:
        qtbot.mouseClick(tab.cancel_docs_button, Qt.LeftButton)
    report = finished.args[0]
    assert report.cancelled and report.done < 4
    assert steps[0] == (1, 4)
    assert not tab.progress.isVisible()

"""Hostile files: zip bombs, files that take too long or too much memory to read. Each is refused or stopped
with a message naming the file and why; extraction can be cancelled; the app carries on."""

from __future__ import annotations

import asyncio
import io
import math
import os
import random
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path

import docx
import pytest

from app.documents import DocumentError, extract

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memory limits are enforced on Linux")

PARAGRAPH = b"<w:p><w:r><w:t>lorem ipsum</w:t></w:r></w:p>"


def docx_bomb(path: Path, num_paragraphs: int) -> Path:
    """A valid .docx whose document.xml is num_paragraphs identical paragraphs: huge unpacked, tiny packed."""
    template = io.BytesIO()
    docx.Document().save(template)
    with zipfile.ZipFile(template) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
        for info in source.infolist():
            if info.filename != "word/document.xml":
                out.writestr(info, source.read(info))
                continue
            head, tail = source.read(info).split(b"<w:body>")
            with out.open("word/document.xml", "w", force_zip64=True) as member:
                member.write(head + b"<w:body>")
                block = PARAGRAPH * 10_000
                for _ in range(num_paragraphs // 10_000):
                    member.write(block)
                member.write(tail)
    return path


def wordy_docx(path: Path, num_paragraphs: int) -> Path:
    rng = random.Random(7)
    words = ["harbour", "ferry", "lighthouse", "keeper", "tide", "gull", "island", "north", "pier", "weather"]
    document = docx.Document()
    for _ in range(num_paragraphs):
        document.add_paragraph(" ".join(rng.choice(words) for _ in range(40)))
    document.save(str(path))
    return path


def pdf_bomb(path: Path, unpacked_mb: int) -> Path:
    """A one-page PDF whose content stream inflates from a few hundred KB to unpacked_mb of blanks."""
    packer = zlib.compressobj(9)
    stream = packer.compress(b"BT /F1 12 Tf 72 700 Td (Hello) Tj ET\n")
    for _ in range(unpacked_mb):
        stream += packer.compress(b" " * (1 << 20))
    stream += packer.flush()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    path.write_bytes(bytes(out))
    return path


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def pool():
    from app.document_worker import ExtractionPool

    extraction_pool = ExtractionPool()
    yield extraction_pool
    extraction_pool.close()


def unbounded_zip(**changes):
    """Limits that let a zip bomb past the unpacked-size checks, to show the time and memory bounds."""
    from app.document_worker import ExtractionLimits

    return ExtractionLimits(max_unpacked_bytes=10**12, max_compression_ratio=math.inf, **changes)


# --- zip bombs: refused from the zip directory, before any XML is parsed ----------------------------------


@pytest.mark.timeout(30)
def test_docx_zip_bomb_is_refused_before_parsing(tmp_path):
    bomb = docx_bomb(tmp_path / "bomb.docx", 500_000)  # ~22 MB of XML in a ~60 KB file
    assert bomb.stat().st_size < 200_000

    started = time.perf_counter()
    with pytest.raises(DocumentError, match=r"bomb\.docx: word/document\.xml unpacks to \d+x its packed size"):
        extract(bomb)
    assert time.perf_counter() - started < 2.0


def test_docx_whose_parts_unpack_past_the_limit_is_refused(tmp_path):
    path = wordy_docx(tmp_path / "long.docx", 600)  # ordinary text: compresses only a few times

    with pytest.raises(DocumentError, match=r"long\.docx unpacks to .* over the 195\.3 KB limit"):
        extract(path, max_unpacked_bytes=200_000)
    assert len(extract(path).passages) > 100  # within the default limits it reads as before


# --- time and memory bounds: extraction runs in a worker process that can be killed -----------------------


@pytest.mark.timeout(60)
def test_extraction_past_its_time_limit_is_killed_and_the_pool_carries_on(tmp_path, pool):
    good = tmp_path / "good.md"
    good.write_text("# Good\n\nA normal note.\n", encoding="utf-8")
    assert pool.extract(good).passages[0].section == "Good"
    assert pool.extract(good).name == "good.md"
    assert pool.num_started == 1  # one worker, reused across files
    bomb = docx_bomb(tmp_path / "slow.docx", 1_000_000)

    errors, pids = [], []
    watcher = threading.Thread(target=lambda: wait_until(lambda: pids.extend(pool.busy_pids) or pids, 10))
    watcher.start()
    started = time.perf_counter()
    try:
        pool.extract(bomb, unbounded_zip(timeout_s=1.0))
    except DocumentError as error:
        errors.append(error)
    elapsed = time.perf_counter() - started
    watcher.join()

    assert [str(e) for e in errors] == ["slow.docx took longer than 1 s to read; it may be damaged or built "
                                        "to hang readers"]
    assert elapsed < 8.0
    assert pids and wait_until(lambda: process_gone(pids[0]), 3.0)
    assert pool.extract(good).text.startswith("# Good")  # a fresh worker replaced the killed one
    assert pool.num_started == 2


@linux_only
@pytest.mark.timeout(60)
def test_docx_needing_more_memory_than_allowed_is_stopped_with_its_need(tmp_path, pool):
    bomb = docx_bomb(tmp_path / "greedy.docx", 1_000_000)  # ~44 MB of XML: several hundred MB parsed

    with pytest.raises(DocumentError, match=r"^greedy\.docx needs more than 64 MB of memory to read"):
        pool.extract(bomb, unbounded_zip(max_memory_bytes=64 * 1024 * 1024))
    small = tmp_path / "small.txt"
    small.write_text("still working", encoding="utf-8")
    assert pool.extract(small).text == "still working"


@linux_only
@pytest.mark.timeout(60)
def test_text_file_needing_more_memory_than_allowed_is_stopped(tmp_path, pool):
    from app.document_worker import ExtractionLimits

    big = tmp_path / "big.log"
    big.write_bytes(b"log line number forty two\n" * 800_000)  # ~20 MB

    with pytest.raises(DocumentError, match=r"^big\.log needs more than 16 MB of memory to read"):
        pool.extract(big, ExtractionLimits(max_memory_bytes=16 * 1024 * 1024))
    assert len(pool.extract(big).passages) > 1000  # the default limit reads it


@linux_only
@pytest.mark.timeout(60)
def test_pdf_bomb_is_stopped_by_the_memory_bound(tmp_path, pool):
    from app.document_worker import ExtractionLimits

    bomb = pdf_bomb(tmp_path / "inflating.pdf", 200)
    assert bomb.stat().st_size < 1_000_000

    with pytest.raises(DocumentError, match=r"^inflating\.pdf needs more than 64 MB of memory to read"):
        pool.extract(bomb, ExtractionLimits(max_memory_bytes=64 * 1024 * 1024))
    with pytest.raises(DocumentError, match=r"^inflating\.pdf"):  # within the default bounds pypdf's own limit
        pool.extract(bomb)


@pytest.mark.timeout(60)
def test_cancelling_stops_an_extraction_in_progress(tmp_path, pool):
    from app.document_worker import ExtractionCancelled

    bomb = docx_bomb(tmp_path / "slow.docx", 1_000_000)
    cancelled = threading.Event()
    pids = []

    def cancel_once_busy():
        wait_until(lambda: bool(pool.busy_pids), 20)
        pids.extend(pool.busy_pids)
        time.sleep(0.3)
        cancelled.set()

    canceller = threading.Thread(target=cancel_once_busy)
    canceller.start()
    with pytest.raises(ExtractionCancelled):
        pool.extract(bomb, unbounded_zip(timeout_s=60.0), cancelled=cancelled)
    canceller.join()
    assert pids and wait_until(lambda: process_gone(pids[0]), 2.0)
    assert pool.busy_pids == []


@pytest.mark.timeout(90)
def test_cancel_button_stops_a_document_being_read(qtbot, db, client, aio_loop, tmp_path):
    from PySide6.QtCore import Qt

    from app.conversation_tab import ConversationTab
    from app.document_worker import shared_pool

    tab = ConversationTab(db.create_conversation(), db, client, "light")
    qtbot.addWidget(tab)
    tab.show()
    tab.extraction_limits = unbounded_zip(timeout_s=60.0)
    bomb = docx_bomb(tmp_path / "slow.docx", 1_000_000)
    note = tmp_path / "note.txt"
    note.write_text("The spare key is under the red flower pot.", encoding="utf-8")

    async def drop_bomb_then_cancel():
        task = tab.add_paths([bomb])
        while not shared_pool().busy_pids and not task.done():
            await asyncio.sleep(0.05)
        pid = shared_pool().busy_pids[0]
        await asyncio.sleep(0.3)
        assert tab.cancel_docs_button.isVisible()
        qtbot.mouseClick(tab.cancel_docs_button, Qt.LeftButton)
        clicked = time.monotonic()
        await asyncio.wait([task], timeout=5)
        while not process_gone(pid) and time.monotonic() - clicked < 3:
            await asyncio.sleep(0.02)
        return task, pid, time.monotonic() - clicked

    task, pid, stop_s = aio_loop.run_until_complete(drop_bomb_then_cancel())
    assert task.cancelled() and process_gone(pid) and stop_s < 3
    assert not tab.progress.isVisible()
    report = aio_loop.run_until_complete(tab.add_paths([note]))  # the app keeps working
    assert report == {"added": 1, "unchanged": 0, "problems": []}


@pytest.mark.timeout(90)
def test_closing_a_tab_stops_its_read_even_if_the_event_loop_never_turns_again(qtbot, db, client, aio_loop,
                                                                             tmp_path):
    from app.conversation_tab import ConversationTab
    from app.document_worker import shared_pool

    tab = ConversationTab(db.create_conversation(), db, client, "light")
    qtbot.addWidget(tab)
    tab.extraction_limits = unbounded_zip(timeout_s=60.0)
    bomb = docx_bomb(tmp_path / "slow.docx", 1_000_000)

    async def drop_bomb():
        task = tab.add_paths([bomb])
        while not shared_pool().busy_pids and not task.done():
            await asyncio.sleep(0.05)
        return task, shared_pool().busy_pids[0]

    task, pid = aio_loop.run_until_complete(drop_bomb())
    tab.close_down()  # as the window does when the app quits; the loop does not run after it here
    assert wait_until(lambda: process_gone(pid), 3.0)
    aio_loop.run_until_complete(asyncio.wait([task], timeout=5))
    assert task.cancelled()

"""Model > Models… over the fake hub on 127.0.0.1 (tests/support/fake_hub.py): search, files with fit colours,
download with progress, cancel and resume, the downloaded list, remove, load; real widgets offscreen, real HTTP,
the cache in the test's own folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fake_hub import FakeHub  # noqa: E402
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from app.models_dialog import ModelsDialog  # noqa: E402

REPO = "test-org/SmolLM2-135M-Instruct-GGUF"
WAIT_MS = 60_000


def gguf_path() -> Path:
    from engine.weights.loader import default_model_path

    return default_model_path()


@pytest.fixture
def hub():
    running = FakeHub()
    running.add_repo(REPO, {gguf_path().name: gguf_path()}, tags=["gguf", "llama", "text-generation"],
                     gguf={"architecture": "llama", "total": 134515008, "context_length": 8192}, downloads=7)
    running.start()
    yield running
    running.stop()


@pytest.fixture
def library(hub, tmp_path):
    from hub.models import ModelHub

    return ModelHub(endpoint=hub.url, cache_dir=tmp_path / "hf-cache", token=False)


@pytest.fixture
def dialog(qtbot, library):
    d = ModelsDialog(None, open_library=lambda: library)
    with qtbot.waitSignal(d.downloads_listed, timeout=WAIT_MS):
        qtbot.addWidget(d)
        d.show()
    yield d
    d.done(0)  # cancels a download still running


def search_and_pick(qtbot, dialog) -> None:
    with qtbot.waitSignal(dialog.search_finished, timeout=WAIT_MS) as found:
        qtbot.keyClicks(dialog.search_edit, "smollm2")
        qtbot.mouseClick(dialog.search_button, Qt.LeftButton)
    assert found.args == [1]
    with qtbot.waitSignal(dialog.fits_estimated, timeout=WAIT_MS):
        dialog.results_list.setCurrentRow(0)
    dialog.files_tree.setCurrentItem(dialog.files_tree.topLevelItem(0))


def downloaded_rows(dialog) -> list[tuple[str, str]]:
    tree = dialog.downloaded_tree
    return [(tree.topLevelItem(i).text(1), tree.topLevelItem(i).text(3)) for i in range(tree.topLevelItemCount())]


def test_search_lists_files_with_sizes_and_a_fit_colour_with_numbers(qtbot, dialog):
    search_and_pick(qtbot, dialog)
    assert REPO in dialog.results_list.item(0).text()
    row = dialog.files_tree.topLevelItem(0)
    assert (row.text(0), row.text(1), row.text(2)) == ("Q4_1", "gguf", "93.8 MB")
    assert row.data(3, Qt.UserRole) == "green" and row.text(3) == "Fits · RAM"  # 135M parameters on any machine
    assert row.background(3).color().name() == "#2e7d32"
    tooltip = row.toolTip(3)
    assert "weights: 513.1 MB (float32)" in tooltip and "KV cache: 180.0 MB at 4096 tokens" in tooltip
    assert "RAM:" in tooltip and "free" in tooltip
    assert dialog.download_button.isEnabled()


def test_download_shows_progress_lists_the_model_and_load_emits_its_path(qtbot, dialog, library, monkeypatch):
    search_and_pick(qtbot, dialog)
    reports = []
    dialog.download_progressed.connect(lambda done, total: reports.append((done, total)))
    with qtbot.waitSignal(dialog.download_finished, timeout=WAIT_MS) as finished:
        qtbot.mouseClick(dialog.download_button, Qt.LeftButton)
        assert dialog.cancel_button.isEnabled() and not dialog.download_button.isEnabled()
    path = Path(finished.args[0])
    size = gguf_path().stat().st_size
    assert reports[-1] == (size, size)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(gguf_path().read_bytes()).digest()
    qtbot.waitUntil(lambda: downloaded_rows(dialog) == [(gguf_path().name, "ready")], timeout=WAIT_MS)
    assert "93.8 MB" in dialog.downloaded_tree.topLevelItem(0).text(2)
    assert dialog.downloaded_tree.currentItem() is not None and dialog.load_button.isEnabled()
    with qtbot.waitSignal(dialog.model_chosen, timeout=WAIT_MS) as chosen:
        qtbot.mouseClick(dialog.load_button, Qt.LeftButton)
    assert chosen.args == [str(path)]

    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    dialog.downloaded_tree.setCurrentItem(dialog.downloaded_tree.topLevelItem(0))
    with qtbot.waitSignal(dialog.downloads_listed, timeout=WAIT_MS):
        qtbot.mouseClick(dialog.remove_button, Qt.LeftButton)
    assert downloaded_rows(dialog) == [] and not path.exists()


def test_cancel_leaves_an_unfinished_entry_that_cannot_be_loaded_and_resumes(qtbot, dialog, hub, library):
    search_and_pick(qtbot, dialog)
    hub.faults.seconds_per_chunk = 0.01  # ~6 MB/s: there is time to cancel
    with qtbot.waitSignal(dialog.download_cancelled, timeout=WAIT_MS):
        qtbot.mouseClick(dialog.download_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: "left" in dialog.progress_label.text(), timeout=WAIT_MS)  # speed and time left
        assert "/s ·" in dialog.progress_label.text()
        qtbot.mouseClick(dialog.cancel_button, Qt.LeftButton)
    assert "resumes" in dialog.progress_label.text()
    assert not [m for m in library.downloaded() if m.complete]
    qtbot.waitUntil(lambda: downloaded_rows(dialog) == [("unfinished download",
                                                         "unfinished (download again to resume)")], timeout=WAIT_MS)
    dialog.downloaded_tree.setCurrentItem(dialog.downloaded_tree.topLevelItem(0))
    assert not dialog.load_button.isEnabled()

    hub.faults.seconds_per_chunk = 0
    with qtbot.waitSignal(dialog.download_finished, timeout=WAIT_MS):
        qtbot.mouseClick(dialog.download_button, Qt.LeftButton)
    resumed = hub.ranged_gets(gguf_path().name)[-1]
    assert resumed is not None and resumed.startswith("bytes=") and resumed != "bytes=0-"
    qtbot.waitUntil(lambda: downloaded_rows(dialog) == [(gguf_path().name, "ready")], timeout=WAIT_MS)


def test_an_unreachable_hub_shows_the_reason_and_the_downloaded_list_stays(qtbot, dialog, hub):
    hub.stop()
    with qtbot.waitSignal(dialog.search_finished, timeout=WAIT_MS):
        qtbot.keyClicks(dialog.search_edit, "smollm2")
        qtbot.mouseClick(dialog.search_button, Qt.LeftButton)
    assert dialog.error_label.isVisible() and "cannot reach http://127.0.0.1" in dialog.error_label.text()
    assert dialog.search_button.isEnabled() and dialog.results_list.count() == 0


def test_model_menu_opens_the_dialog_and_load_loads_the_download_and_saves_it(qtbot, db, client, hub, tmp_path):
    from tiny_models import build_model, build_tokenizer

    from app.main_window import MainWindow

    folder = tmp_path / "tiny"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    hub.add_repo("test-org/tiny-llama", {p.name: p for p in folder.iterdir()}, tags=["safetensors", "llama"],
                 config={"model_type": "llama"})
    window = MainWindow(db, client, theme_choice="light")
    qtbot.addWidget(window)
    actions = {a.objectName(): a for a in window.menuBar().actions()[2].menu().actions()}
    assert actions["modelsAction"].text() == "Models…"
    dialog = window.open_models_dialog({"endpoint": hub.url, "cache_dir": str(tmp_path / "hf-cache")})
    with qtbot.waitSignal(dialog.search_finished, timeout=WAIT_MS):
        qtbot.keyClicks(dialog.search_edit, "tiny")
        qtbot.mouseClick(dialog.search_button, Qt.LeftButton)
    with qtbot.waitSignal(dialog.files_listed, timeout=WAIT_MS):
        dialog.results_list.setCurrentRow(0)
    dialog.files_tree.setCurrentItem(dialog.files_tree.topLevelItem(0))
    assert dialog.files_tree.currentItem().text(0) == "safetensors"
    with qtbot.waitSignal(dialog.download_finished, timeout=WAIT_MS) as finished:
        qtbot.mouseClick(dialog.download_button, Qt.LeftButton)
    qtbot.waitUntil(dialog.load_button.isEnabled, timeout=WAIT_MS)
    with qtbot.waitSignal(client.model_loaded, timeout=WAIT_MS) as loaded:
        qtbot.mouseClick(dialog.load_button, Qt.LeftButton)
    assert loaded.args[0]["source"] == finished.args[0] and Path(finished.args[0]).is_dir()
    assert db.get_setting("model", {})["source"] == finished.args[0]

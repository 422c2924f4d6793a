"""Model > Models…: search the hub, see a repo's files with sizes and whether each fits this machine, download one
(progress, speed, time left, cancel), and the downloaded models (size on disk, remove, load).

The dialog never imports the engine: it is handed `open_library`, a callable returning the model library
(EngineClient.model_library -> hub.models.ModelHub), and calls it and every library method on threads of its
own (network, disk, the torch import for fits), never on the UI thread and never on the engine thread, so the
window stays responsive and a generation goes on during a download. Results come back through queued signals;
a result for a search or a repo that is no longer the current one is dropped. One download at a time; closing
the dialog cancels it, and the next download of the same entry resumes from what is on disk.

Over 400 lines: one dialog of three views (search, a repository's files, what is downloaded) and its background
work."""

from __future__ import annotations

import logging
import threading
import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from .background import Background
from .memory_meter import human_bytes

log = logging.getLogger(__name__)

FORMAT_CHOICES = (("Any format", None), ("GGUF", "gguf"), ("Safetensors", "safetensors"), ("AWQ int4", "awq"))
FIT_COLORS = {"green": "#2e7d32", "yellow": "#f9a825", "red": "#c62828"}
FIT_WORDS = {"green": "Fits", "yellow": "Tight", "red": "Too large"}
PROGRESS_EVERY_S = 0.1  # at most ten progress updates a second reach the UI thread


def human_seconds(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


class ModelsDialog(QDialog):
    model_chosen = Signal(str)  # a downloaded model's path (what --model takes): the window loads it
    search_finished = Signal(int)  # results shown
    files_listed = Signal(str)  # repo whose files are shown
    fits_estimated = Signal(str)
    download_progressed = Signal(int, int)  # bytes held, bytes in all (queued from the download thread)
    download_finished = Signal(str)  # local path
    download_cancelled = Signal()
    download_failed = Signal(str)
    downloads_listed = Signal(int)

    def __init__(self, parent: QWidget | None = None, *, open_library, weights: str = "auto",
                 context_tokens: int = 4096):
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(900, 640)
        self._open_library = open_library
        self._library = None
        self._library_lock = threading.Lock()
        self._weights = weights
        self._background = Background(self)
        self._search_serial = 0
        self._listing = None  # RepoFiles shown in the files table
        self._cancel: threading.Event | None = None  # the running download's
        self._started: tuple[float, int] | None = None  # (time, bytes) of the running download's first report

        self.search_edit = QLineEdit(objectName="searchEdit", placeholderText="Search models, e.g. qwen2.5 gguf")
        self.format_combo = QComboBox(objectName="formatCombo")
        for label, value in FORMAT_CHOICES:
            self.format_combo.addItem(label, value)
        self.search_button = QPushButton("Search", objectName="searchButton")
        self.results_list = QListWidget(objectName="resultsList")
        self.files_tree = QTreeWidget(objectName="filesTree")
        self.files_tree.setHeaderLabels(["Download", "Format", "Size", "Fits this machine"])
        self.files_tree.setRootIsDecorated(False)
        self.context_spin = QSpinBox(objectName="contextSpin", minimum=512, maximum=262144, singleStep=1024,
                                     value=context_tokens, suffix=" tokens")
        self.download_button = QPushButton("Download", objectName="downloadButton", enabled=False)
        self.cancel_button = QPushButton("Cancel", objectName="cancelButton", enabled=False)
        self.progress_bar = QProgressBar(objectName="downloadProgress", visible=False)
        self.progress_label = QLabel(objectName="downloadStatus", wordWrap=True)
        self.downloaded_tree = QTreeWidget(objectName="downloadedTree")
        self.downloaded_tree.setHeaderLabels(["Model", "File / folder", "Size on disk", "State"])
        self.downloaded_tree.setRootIsDecorated(False)
        self.remove_button = QPushButton("Remove", objectName="removeButton", enabled=False)
        self.load_button = QPushButton("Load", objectName="loadButton", enabled=False)
        self.error_label = QLabel(objectName="modelsError", wordWrap=True, visible=False)
        self.error_label.setStyleSheet("color: #c62828;")
        self.error_label.setTextInteractionFlags(Qt.TextSelectableByMouse)

        layout = QVBoxLayout(self)
        row = QHBoxLayout()
        for w in (self.search_edit, self.format_combo, self.search_button):
            row.addWidget(w)
        layout.addLayout(row)
        layout.addWidget(self.error_label)
        middle = QHBoxLayout()
        middle.addWidget(self.results_list, 2)
        right = QVBoxLayout()
        right.addWidget(self.files_tree, 1)
        row = QHBoxLayout()
        row.addWidget(QLabel("Fit for a context of"))
        row.addWidget(self.context_spin)
        row.addStretch(1)
        row.addWidget(self.download_button)
        row.addWidget(self.cancel_button)
        right.addLayout(row)
        right.addWidget(self.progress_bar)
        right.addWidget(self.progress_label)
        middle.addLayout(right, 3)
        layout.addLayout(middle, 3)
        layout.addWidget(QLabel("Downloaded"))
        layout.addWidget(self.downloaded_tree, 2)
        row = QHBoxLayout()
        row.addStretch(1)
        row.addWidget(self.remove_button)
        row.addWidget(self.load_button)
        layout.addLayout(row)

        self.search_edit.returnPressed.connect(self.on_search_button_clicked)
        self.search_button.clicked.connect(self.on_search_button_clicked)
        self.results_list.currentItemChanged.connect(self.on_results_list_current_item_changed)
        self.files_tree.currentItemChanged.connect(lambda *_: self._update_buttons())
        self.context_spin.editingFinished.connect(self._estimate_fits)
        self.download_button.clicked.connect(self.on_download_button_clicked)
        self.cancel_button.clicked.connect(self.on_cancel_button_clicked)
        self.download_progressed.connect(self.on_download_progressed)
        self.downloaded_tree.currentItemChanged.connect(lambda *_: self._update_buttons())
        self.remove_button.clicked.connect(self.on_remove_button_clicked)
        self.load_button.clicked.connect(self.on_load_button_clicked)
        self.refresh_downloaded()

    # -- plumbing ------------------------------------------------------------------------------------------
    def library(self):
        """The model library, made on first use (on a background thread: it imports the engine)."""
        with self._library_lock:
            if self._library is None:
                self._library = self._open_library()
            return self._library

    def _call(self, fn, on_result, on_error=None) -> None:
        self._background.run(lambda: fn(self.library()), on_result, on_error or self.show_error,
                             name="kvboost-models")

    def show_error(self, error) -> None:
        self.error_label.setText(str(error))
        self.error_label.setVisible(True)

    def _clear_error(self) -> None:
        self.error_label.setVisible(False)

    def _update_buttons(self) -> None:
        downloading = self._cancel is not None
        entry = self._current_entry()
        self.download_button.setEnabled(entry is not None and not downloading)
        self.cancel_button.setEnabled(downloading)
        local = self._current_local()
        self.remove_button.setEnabled(local is not None and not downloading)
        self.load_button.setEnabled(local is not None and local.complete)

    # -- search and files ----------------------------------------------------------------------------------
    def on_search_button_clicked(self) -> None:
        query = self.search_edit.text().strip()
        self._search_serial += 1
        serial = self._search_serial
        fmt = self.format_combo.currentData()
        self._clear_error()
        self.search_button.setEnabled(False)

        def shown(results):
            if serial != self._search_serial:
                return
            self.search_button.setEnabled(True)
            self.results_list.clear()
            for r in results:
                params = f" · {r.parameters / 1e9:.2f}B" if r.parameters else ""
                item = QListWidgetItem(f"{r.repo}\n{r.architecture or '?'} · {', '.join(r.formats)}{params} · "
                                       f"{r.downloads:,} downloads")
                item.setData(Qt.UserRole, r.repo)
                self.results_list.addItem(item)
            if not results:
                self.show_error(f"No model this engine runs matches {query!r}.")
            self.search_finished.emit(len(results))

        def failed(error):
            self.search_button.setEnabled(True)
            self.show_error(error)
            self.search_finished.emit(0)

        self._call(lambda lib: lib.search(query, format=fmt), shown, failed)

    def on_results_list_current_item_changed(self, item, _previous=None) -> None:
        if item is None:
            return
        repo = item.data(Qt.UserRole)
        self._listing = None
        self.files_tree.clear()
        self._clear_error()
        self._update_buttons()

        def listed(listing):
            current = self.results_list.currentItem()
            if current is None or current.data(Qt.UserRole) != repo:
                return
            self._listing = listing
            for entry in listing.entries:
                row = QTreeWidgetItem([entry.name, entry.format, human_bytes(entry.size),
                                       "…" if entry.supported else (entry.note or "not supported")])
                row.setData(0, Qt.UserRole, entry.name)
                row.setToolTip(0, "\n".join(f.path for f in entry.files))
                self.files_tree.addTopLevelItem(row)
            if not listing.entries:
                self.show_error(f"{repo} has no GGUF file and no safetensors model this engine loads.")
            for i in range(4):
                self.files_tree.resizeColumnToContents(i)
            self._update_buttons()
            self.files_listed.emit(repo)
            self._estimate_fits()

        self._call(lambda lib: lib.files(repo), listed)

    def _estimate_fits(self) -> None:
        listing, context, weights = self._listing, self.context_spin.value(), self._weights
        if listing is None:
            return
        entries = [e for e in listing.entries if e.supported]

        def estimate(lib):
            fits = {}
            for entry in entries:
                try:
                    fits[entry.name] = lib.fit(listing, entry, context_tokens=context, weights=weights)
                except Exception as exc:  # a config transformers cannot read: the size still helps
                    fits[entry.name] = exc
            return fits

        def shown(fits):
            if self._listing is not listing:
                return
            for i in range(self.files_tree.topLevelItemCount()):
                row = self.files_tree.topLevelItem(i)
                fit = fits.get(row.data(0, Qt.UserRole))
                if fit is None:
                    continue
                if isinstance(fit, Exception):
                    row.setText(3, "unknown")
                    row.setToolTip(3, str(fit))
                    continue
                row.setText(3, f"{FIT_WORDS[fit.level]} · {fit.memory}")
                row.setData(3, Qt.UserRole, fit.level)
                row.setBackground(3, QBrush(QColor(FIT_COLORS[fit.level])))
                row.setForeground(3, QBrush(QColor("white" if fit.level != "yellow" else "black")))
                row.setToolTip(3, fit.describe())
            self.fits_estimated.emit(listing.repo)

        self._call(estimate, shown)

    def _current_entry(self):
        row = self.files_tree.currentItem()
        if row is None or self._listing is None:
            return None
        name = row.data(0, Qt.UserRole)
        return next((e for e in self._listing.entries if e.name == name), None)

    # -- downloading ---------------------------------------------------------------------------------------
    def on_download_button_clicked(self) -> None:
        entry, listing = self._current_entry(), self._listing
        if entry is None or self._cancel is not None:
            return
        cancel = self._cancel = threading.Event()
        self._started = None
        last = [0.0]
        self._clear_error()
        self.progress_bar.setRange(0, 1000)
        self.progress_bar.setValue(0)
        self.progress_bar.setVisible(True)
        self.progress_label.setText(f"Downloading {listing.repo} {entry.name}…")
        self._update_buttons()

        def progress(done: int, total: int) -> None:  # on the download thread
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done >= total:
                last[0] = now
                try:
                    self.download_progressed.emit(done, total)
                except RuntimeError:  # the dialog is gone
                    pass

        choice = entry.files[0].path if entry.format == "gguf" else entry.name

        def finished(path):
            self._download_ended()
            self.progress_label.setText(f"Downloaded to {path}")
            self.refresh_downloaded(select=str(path))
            self.download_finished.emit(str(path))

        def failed(error):
            self._download_ended()
            if cancel.is_set():
                self.progress_label.setText("Cancelled. Downloading it again resumes where it stopped.")
                self.refresh_downloaded()
                self.download_cancelled.emit()
            else:
                self.show_error(error)
                self.progress_label.setText("")
                self.refresh_downloaded()
                self.download_failed.emit(str(error))

        self._call(lambda lib: lib.download(listing.repo, choice, progress=progress, cancel=cancel), finished, failed)

    def on_download_progressed(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self._started is None:
            self._started = (now, done)  # a resume starts from what is on disk: not counted in the speed
        self.progress_bar.setValue(int(1000 * done / total) if total else 1000)
        t0, first = self._started
        text = f"{human_bytes(done)} of {human_bytes(total)}"
        if now - t0 > 0.5 and done > first:
            speed = (done - first) / (now - t0)
            text += f" · {human_bytes(speed)}/s · {human_seconds((total - done) / speed)} left"
        self.progress_label.setText(text)

    def on_cancel_button_clicked(self) -> None:
        if self._cancel is not None:
            self._cancel.set()
            self.progress_label.setText("Cancelling…")

    def _download_ended(self) -> None:
        self._cancel = None
        self.progress_bar.setVisible(False)
        self._update_buttons()

    def done(self, result) -> None:  # closed (Escape, the window's close button): a running download stops
        if self._cancel is not None:
            self._cancel.set()
        super().done(result)

    # -- what is downloaded --------------------------------------------------------------------------------
    def refresh_downloaded(self, select: str | None = None) -> None:
        def shown(models):
            self.downloaded_tree.clear()
            for m in models:
                row = QTreeWidgetItem([m.repo, m.name, human_bytes(m.size_bytes),
                                       "ready" if m.complete else "unfinished (download again to resume)"])
                row.setData(0, Qt.UserRole, m)
                row.setToolTip(0, str(m.path))
                self.downloaded_tree.addTopLevelItem(row)
                if select is not None and str(m.path) == select:
                    self.downloaded_tree.setCurrentItem(row)
            for i in range(4):
                self.downloaded_tree.resizeColumnToContents(i)
            self._update_buttons()
            self.downloads_listed.emit(len(models))

        self._call(lambda lib: lib.downloaded(), shown)

    def _current_local(self):
        row = self.downloaded_tree.currentItem()
        return row.data(0, Qt.UserRole) if row is not None else None

    def on_remove_button_clicked(self) -> None:
        local = self._current_local()
        if local is None:
            return
        answer = QMessageBox.question(self, "Remove model",
                                      f"Delete every downloaded file of {local.repo} "
                                      f"({human_bytes(local.size_bytes)} for this entry)?")
        if answer != QMessageBox.StandardButton.Yes:
            return
        self._call(lambda lib: lib.remove(local.repo), lambda _freed: self.refresh_downloaded())

    def on_load_button_clicked(self) -> None:
        local = self._current_local()
        if local is not None and local.complete:
            self.model_chosen.emit(str(local.path))
            self.accept()

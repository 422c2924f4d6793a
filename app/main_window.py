"""The main window: conversation tabs, the conversations sidebar with search, menus, model status and the
memory meter. Owns the Database (UI thread only) and the EngineClient.

Over 400 lines on purpose: it is the one place where menus, the sidebar, the tabs and the engine client's
model signals meet; each part is a few methods that read and write the others' state (the current tab, the
loaded model), so a split would only move those reads behind new signals. The Model menu's dialogs and
settings are app.model_menu's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from PySide6.QtCore import QStandardPaths, Qt, QTimer, QUrl
from PySide6.QtGui import QAction, QDesktopServices, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QListWidgetItem,
    QMainWindow,
    QPushButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from . import conversation_export, dialogs, settings
from . import theme as themes
from .conversation_tab import ConversationTab
from .keyboard import add_keyboard_access
from .model_menu import ModelMenu
from .settings import ApiServer
from .sidebar import Sidebar
from .status_bar import fill_status_bar
from .text_size import TextSize
from .toolbar import MainToolbar

log = logging.getLogger(__name__)


class MainWindow(QMainWindow):
    def __init__(self, db, client, *, theme_choice: str = "system"):
        super().__init__()
        self.db = db
        self.client = client
        self.setWindowTitle("KVBoost Desktop")
        self.resize(1180, 780)
        self.theme_choice = settings.load(db).theme if db.get_setting("theme") is not None else theme_choice
        self.theme = themes.apply_theme(QApplication.instance(), self.theme_choice)
        self._load_started = 0.0

        central = QWidget()
        outer = QVBoxLayout(central)
        outer.setContentsMargins(0, 0, 0, 0)
        self.banner = QWidget()
        self.banner.setObjectName("errorBanner")
        banner_row = QHBoxLayout(self.banner)
        self.banner_label = QLabel()
        self.banner_label.setObjectName("errorBannerText")
        self.banner_label.setWordWrap(True)
        self.banner_label.setTextInteractionFlags(Qt.TextSelectableByMouse)
        close = QPushButton("Dismiss")
        close.clicked.connect(self.banner.hide)
        banner_row.addWidget(self.banner_label, 1)
        banner_row.addWidget(close)
        self.banner.setStyleSheet("#errorBanner { background: #b3261e; } #errorBanner QLabel { color: white; }")
        self.banner.hide()
        outer.addWidget(self.banner)
        self.tabs = QTabWidget()
        self.tabs.setTabsClosable(True)
        self.tabs.setMovable(True)
        self.tabs.setDocumentMode(True)
        self.tabs.tabCloseRequested.connect(self.on_tabs_tab_close_requested)
        self.tabs.tabBarDoubleClicked.connect(self.on_tabs_tab_bar_double_clicked)
        self.tabs.tabBar().tabMoved.connect(lambda *_: self._save_tab_order())
        self.tabs.currentChanged.connect(lambda _: self._current_changed())
        outer.addWidget(self.tabs, 1)
        self.setCentralWidget(central)

        self.sidebar = Sidebar(self.db, self.open_conversation, self.rename_conversation, self.delete_conversation)
        self.addDockWidget(Qt.LeftDockWidgetArea, self.sidebar)
        self.conversation_list, self.search_edit = self.sidebar.conversation_list, self.sidebar.search_edit
        self.model_menu = ModelMenu(self)
        self._build_menus()
        self.toolbar = MainToolbar(self)
        self.addToolBar(self.toolbar)
        self._build_status_bar()
        client.model_loading.connect(self.on_client_model_loading)
        client.load_stage_changed.connect(self.on_client_load_stage_changed)
        client.load_progressed.connect(self.on_client_load_progressed)
        client.model_loaded.connect(self.on_client_model_loaded)
        client.model_load_failed.connect(self.on_client_model_load_failed)
        client.server_started.connect(self.on_client_server_started)
        client.server_stopped.connect(self.on_client_server_stopped)
        client.server_failed.connect(self.on_client_server_failed)
        themes.connect_system_theme(QApplication.instance(), lambda: self.theme_choice, self._retheme_tabs)

        for conversation in db.conversations(open_only=True):
            self._add_tab(conversation)
        if not self.tabs.count():
            self.new_conversation()
        self.refresh_sidebar()

    # -- building ------------------------------------------------------------------------------------------
    def _build_menus(self) -> None:
        def action(menu, text, slot, shortcut=None, name=None):
            act = QAction(text, self)
            if shortcut:
                act.setShortcut(QKeySequence(shortcut))
            act.triggered.connect(slot)
            if name:
                act.setObjectName(name)
            menu.addAction(act)
            return act

        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        self.new_action = action(file_menu, "New conversation", self.new_conversation, "Ctrl+T", "newAction")
        self.close_action = action(file_menu, "Close conversation", self.close_current, "Ctrl+W", "closeAction")
        action(file_menu, "Add documents…", lambda: self.current_tab() and
               self.current_tab().on_add_docs_button_clicked(), "Ctrl+D")
        file_menu.addSeparator()
        action(file_menu, "Import conversation (JSON)…", self.import_conversation)
        action(file_menu, "Export as Markdown…", lambda: self.export_current("md"))
        action(file_menu, "Export as JSON…", lambda: self.export_current("json"))
        file_menu.addSeparator()
        action(file_menu, "Quit", self.close, "Ctrl+Q")
        conv_menu = bar.addMenu("&Conversation")
        action(conv_menu, "Rename…", lambda: self.rename_tab(self.tabs.currentIndex()), "F2")
        action(conv_menu, "Settings (system prompt, sampling)…", self.edit_conversation_settings, "Ctrl+,")
        stop = action(conv_menu, "Stop answer", lambda: self.current_tab() and self.current_tab().stop())
        model_menu = bar.addMenu("&Model")
        action(model_menu, "Choose model…", self.choose_model, name="chooseModelAction")
        action(model_menu, "Models…", self.open_models_dialog, name="modelsAction")
        action(model_menu, "Remote server…", self.open_remote_dialog, name="remoteAction")
        self.model_menu.add_recent_menu(model_menu)
        port = settings.load(self.db).api_server.port
        self.serve_action = action(model_menu, f"Serve OpenAI API on 127.0.0.1:{port}", self.on_serve_action_toggled,
                                   name="serveApiAction")
        self.serve_action.setCheckable(True)
        self.serve_action.setChecked(settings.load(self.db).api_server.enabled)
        self.serve_action.setToolTip("Editors, scripts and LangChain can use the loaded model through the OpenAI "
                                     "API at http://127.0.0.1:PORT/v1, sharing its KV cache with this window")
        view_menu = bar.addMenu("&View")
        for choice in themes.THEMES:
            action(view_menu, f"Theme: {choice}", lambda _=False, c=choice: self.set_theme(c))
        view_menu.addAction(self.sidebar.toggleViewAction())
        self.text_size = TextSize(self.db, view_menu.addMenu("Text size"), self.refresh_sidebar)
        add_keyboard_access(self, view_menu, stop)
        help_menu = bar.addMenu("&Help")
        action(help_menu, "Open logs folder", self.open_logs_folder, name="openLogsAction")

    def logs_folder(self) -> Path:
        """The folder of the log being written (app.main.setup_logging), else the per-user log folder."""
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler) and handler.baseFilename.endswith("kvboost-desktop.log"):
                return Path(handler.baseFilename).parent
        from .paths import app_paths

        return app_paths().log_dir

    def open_logs_folder(self) -> None:
        folder = self.logs_folder()
        if not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            self.statusBar().showMessage(f"The logs are in {folder}", 15000)

    def _build_status_bar(self) -> None:
        parts = fill_status_bar(self.statusBar(), self.client)
        self.model_label, self.load_bar, self.api_label = parts.model_label, parts.load_bar, parts.api_label
        self.status_separator, self.memory_meter = parts.separator, parts.memory_meter
        self._stage = ""
        self._load_timer = QTimer(self, interval=500)
        self._load_timer.timeout.connect(self._show_load_progress)

    # -- tabs ----------------------------------------------------------------------------------------------
    def current_tab(self) -> ConversationTab | None:
        return self.tabs.currentWidget()

    def tab_for(self, conversation_id: int) -> ConversationTab | None:
        for i in range(self.tabs.count()):
            if self.tabs.widget(i).conversation_id == conversation_id:
                return self.tabs.widget(i)
        return None

    def _on_tab_title_changed(self, tab: ConversationTab, title: str) -> None:
        self.tabs.setTabText(self.tabs.indexOf(tab), title)
        self.refresh_sidebar()

    def _add_tab(self, conversation: dict) -> ConversationTab:
        tab = ConversationTab(conversation, self.db, self.client, self.theme)
        tab.error_raised.connect(self.show_error)
        tab.generation_state_changed.connect(lambda _: self._current_changed())
        tab.title_changed.connect(lambda title, t=tab: self._on_tab_title_changed(t, title))
        self.tabs.addTab(tab, conversation["title"])
        return tab

    def new_conversation(self) -> ConversationTab:
        conversation = self.db.create_conversation()
        tab = self._add_tab(conversation)
        self.tabs.setCurrentWidget(tab)
        self._save_tab_order()
        self.refresh_sidebar()
        tab.composer.setFocus()
        return tab

    def open_conversation(self, conversation_id: int, message_id: int | None = None) -> ConversationTab:
        tab = self.tab_for(conversation_id)
        if tab is None:
            self.db.update_conversation(conversation_id, is_open=1)
            tab = self._add_tab(self.db.conversation(conversation_id))
            self._save_tab_order()
        self.tabs.setCurrentWidget(tab)
        if message_id is not None:
            QTimer.singleShot(0, lambda: tab.chat_view.scroll_to(message_id))
        return tab

    def open_files(self, paths: list[str]) -> None:
        """Files from the command line, or from a second start of the app on this home: the window comes to
        the front and they are added to the current conversation, as if dropped on it."""
        log.info("opening %d file(s): %s", len(paths), paths)
        if self.isMinimized():
            self.showNormal()
        self.show()
        self.raise_()
        self.activateWindow()
        if paths:
            (self.current_tab() or self.new_conversation()).add_paths(paths)

    def close_current(self) -> None:
        if self.tabs.count():
            self.on_tabs_tab_close_requested(self.tabs.currentIndex())

    def on_tabs_tab_close_requested(self, index: int) -> None:
        tab = self.tabs.widget(index)
        tab.close_down()
        self.db.update_conversation(tab.conversation_id, is_open=0)
        self.tabs.removeTab(index)
        tab.deleteLater()
        self._save_tab_order()
        self.refresh_sidebar()

    def on_tabs_tab_bar_double_clicked(self, index: int) -> None:
        self.rename_tab(index)

    def rename_tab(self, index: int, title: str | None = None) -> None:
        if index < 0:
            return
        tab = self.tabs.widget(index)
        if title is None:
            title = dialogs.ask_rename(self, self.tabs.tabText(index))
        if title:
            self.db.update_conversation(tab.conversation_id, title=title)
            self.tabs.setTabText(index, title)
            self.refresh_sidebar()

    def rename_conversation(self, conversation_id: int, title: str | None = None) -> None:
        """Renames a conversation from the sidebar, open in a tab or not (`title` None: asks for it)."""
        if title is None:
            title = dialogs.ask_rename(self, self.db.conversation(conversation_id)["title"])
        if not title:
            return
        self.db.update_conversation(conversation_id, title=title)
        tab = self.tab_for(conversation_id)
        if tab is not None:
            self.tabs.setTabText(self.tabs.indexOf(tab), title)
        self.refresh_sidebar()

    def delete_conversation(self, conversation_id: int, confirmed: bool | None = None) -> bool:
        """Deletes a conversation and its messages once confirmed (None: asks), its tab closed first; True if done."""
        conversation = self.db.conversation(conversation_id)
        if confirmed is None:
            count = len(self.db.messages(conversation_id))
            confirmed = dialogs.confirm_delete(self, conversation["title"], count)
        if not confirmed:
            return False
        tab = self.tab_for(conversation_id)
        if tab is not None:
            tab.close_down()
            self.tabs.removeTab(self.tabs.indexOf(tab))
            tab.deleteLater()
            self._save_tab_order()
        self.db.delete_conversation(conversation_id)
        self.refresh_sidebar()
        return True

    def _save_tab_order(self) -> None:
        self.db.set_tab_order([self.tabs.widget(i).conversation_id for i in range(self.tabs.count())])

    # -- sidebar -------------------------------------------------------------------------------------------
    def refresh_sidebar(self) -> None:
        current = self.current_tab()
        self.sidebar.refresh({self.tabs.widget(i).conversation_id for i in range(self.tabs.count())},
                             current.conversation_id if current is not None else None)

    def _current_changed(self) -> None:
        """The sidebar highlights the conversation on screen; the gauge shows its share of the context."""
        self.refresh_sidebar()
        tab = self.current_tab()
        if hasattr(self, "toolbar"):
            self.toolbar.follow(tab.conversation_id if tab is not None else None)

    def on_conversation_list_item_activated(self, item: QListWidgetItem) -> None:
        self.sidebar.on_item_activated(item)

    # -- conversation settings, import/export ------------------------------------------------------------
    def edit_conversation_settings(self) -> None:
        tab = self.current_tab()
        if tab is None:
            return
        from .db import DEFAULT_SAMPLING, DEFAULT_SYSTEM_PROMPT

        conversation = self.db.conversation(tab.conversation_id)
        dialog = dialogs.ConversationSettingsDialog(
            self, title=conversation["title"], system_prompt=conversation["system_prompt"],
            sampling=conversation["sampling"],
            defaults={"system_prompt": DEFAULT_SYSTEM_PROMPT, "sampling": DEFAULT_SAMPLING})
        if dialog.exec():
            values = dialog.values()
            self.db.update_conversation(tab.conversation_id, title=values["title"],
                                        system_prompt=values["system_prompt"], sampling=values["sampling"])
            self.tabs.setTabText(self.tabs.indexOf(tab), values["title"])
            if values["system_prompt"] != conversation["system_prompt"]:
                tab.prewarm()
            self.refresh_sidebar()

    def export_current(self, fmt: str, path: str | None = None) -> str | None:
        tab = self.current_tab()
        if tab is None:
            return None
        conversation = self.db.conversation(tab.conversation_id)
        if path is None:
            folder = QStandardPaths.writableLocation(QStandardPaths.DocumentsLocation) or str(Path.home())
            suggested = str(conversation_export.suggested_path(Path(folder), conversation["title"], fmt))
            path, _ = QFileDialog.getSaveFileName(self, "Export conversation", suggested,
                                                  "Markdown (*.md)" if fmt == "md" else "JSON (*.json)")
            if not path:
                return None
        try:
            if fmt == "md":
                text = conversation_export.export_markdown(self.db, tab.conversation_id)
                Path(path).write_text(text, encoding="utf-8")
            else:
                exported = conversation_export.export_json(self.db, tab.conversation_id)
                Path(path).write_text(json.dumps(exported, indent=2, ensure_ascii=False), encoding="utf-8")
        except OSError as exc:
            self.show_error(f"Could not write {path}: {exc}")
            return None
        self.statusBar().showMessage(f"Exported to {path}", 5000)
        return path

    def import_conversation(self, path: str | None = None) -> int | None:
        if path is None:
            path, _ = QFileDialog.getOpenFileName(self, "Import conversation", "", "JSON (*.json)")
            if not path:
                return None
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            conversation = conversation_export.import_json(self.db, data)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            self.show_error(f"Could not import {Path(path).name}: {exc}")
            return None
        self.open_conversation(conversation["id"])
        self.refresh_sidebar()
        return conversation["id"]

    # -- model ---------------------------------------------------------------------------------------------
    def load_model(self, source: str | None = None, **options) -> None:
        for i in range(self.tabs.count()):
            self.tabs.widget(i).update_composer()
        self.client.load_model(source, **options)

    # Model > Choose model, Models…, Remote server…, Recent models, and what answers at start: app.model_menu.
    def choose_model(self) -> None:
        self.model_menu.choose_model()

    def open_models_dialog(self, library_options: dict | None = None):
        return self.model_menu.open_models_dialog(library_options)

    def open_remote_dialog(self):
        return self.model_menu.open_remote_dialog()

    def start_model(self, source: str | None = None, *, explicit: bool = False, **options) -> None:
        self.model_menu.start(source, explicit=explicit, **options)

    # -- the OpenAI-compatible API over the loaded model -------------------------------------------------------
    def _serving(self, enabled: bool) -> ApiServer:
        """The API server setting with `enabled`, saved."""
        api = dataclasses.replace(settings.load(self.db).api_server, enabled=enabled)
        settings.update(self.db, api_server=api)
        return api

    def on_serve_action_toggled(self, checked: bool) -> None:
        api = self._serving(checked)
        if checked:
            if self.client.is_loaded:
                self.client.start_server(api.port)
            else:
                self.api_label.setText("API starts when the model is loaded")
                self.api_label.show()
        else:
            self.client.stop_server()

    def on_client_server_started(self, url: str) -> None:
        self.api_label.setText(f"API: {url}")
        self.api_label.show()

    def on_client_server_stopped(self) -> None:
        self.api_label.hide()

    def on_client_server_failed(self, reason: str) -> None:
        self.api_label.hide()
        self.serve_action.setChecked(False)
        self._serving(False)
        self.show_error(f"The OpenAI API could not start: {reason}")

    def on_client_model_loading(self, what: str) -> None:
        self.client.stop_server()  # it serves the model being replaced; back on once the new one is loaded
        self._load_started = time.monotonic()
        self._loading = what
        self.load_bar.setRange(0, 0)
        self.load_bar.show()
        self._load_timer.start()
        self._show_load_progress()
        for i in range(self.tabs.count()):
            self.tabs.widget(i).update_composer()

    def on_client_load_stage_changed(self, stage: str) -> None:
        self._stage = stage
        self._show_load_progress()

    def on_client_load_progressed(self, done: int, total: int, what: str) -> None:
        """A step of the load (engine.weights.loader's progress): the bar fills by steps and the stage names it."""
        if total > 0:
            self.load_bar.setRange(0, total)
            self.load_bar.setValue(min(done, total))
        self._stage = f"Reading the weights: {what}"
        self._show_load_progress()

    def _show_load_progress(self) -> None:
        elapsed = time.monotonic() - self._load_started
        self.model_label.setText(f"Loading {Path(self._loading).name}: {self._stage} ({elapsed:.0f} s)")

    def on_client_model_loaded(self, info: dict) -> None:
        self._load_timer.stop()
        self.load_bar.hide()
        weights = info.get("weights") or {}
        held = f"{weights['format']} ({weights['resident_bytes'] / 2**20:.0f} MB)" if weights else info["dtype"]
        self.toolbar.show_loaded(info)
        self._current_changed()
        self.model_label.setText(f"{Path(info['name']).name} · {info['device']} · {held}")
        details = (f"Context: {info['max_context']} tokens · KV reuse: {info['reuse']} · "
                   f"loaded in {info['load_s']:.1f} s")
        self.model_label.setToolTip("\n".join(filter(None, [details, info.get("weights_text", "")])))
        if info.get("disk_error"):
            self.show_error(f"Answers still work, but KV will not be kept across restarts: {info['disk_error']}")
        if self.serve_action.isChecked():
            self.client.start_server(settings.load(self.db).api_server.port)
        for i in range(self.tabs.count()):
            tab = self.tabs.widget(i)
            tab.update_composer()
            tab.refresh_documents()
            tab.prewarm()

    def on_client_model_load_failed(self, message: str) -> None:
        self._load_timer.stop()
        self.load_bar.hide()
        self.model_label.setText("No model loaded")
        self.show_error(f"The model could not be loaded: {message} (Model ▸ Choose model… to pick another)")
        for i in range(self.tabs.count()):
            self.tabs.widget(i).update_composer()

    # -- theme, errors, closing ----------------------------------------------------------------------------
    def set_theme(self, choice: str) -> None:
        self.theme_choice = choice
        settings.update(self.db, theme=choice)
        self._retheme_tabs(themes.apply_theme(QApplication.instance(), choice))

    def _retheme_tabs(self, resolved: str) -> None:
        self.theme = resolved
        for i in range(self.tabs.count()):
            self.tabs.widget(i).set_theme(resolved)

    def show_error(self, message: str) -> None:
        log.warning("shown to the user: %s", message)
        self.banner_label.setText(message)
        self.banner.show()

    def closeEvent(self, event) -> None:
        self.client.stop_server()
        for i in range(self.tabs.count()):
            self.tabs.widget(i).close_down()
        self.memory_meter.stop()
        super().closeEvent(event)

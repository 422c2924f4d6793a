"""The Model menu's dialogs and memory: Choose model, Models… (downloads), Remote server…, the recent models, and
which of the engine or a remote server answers at start.

What it remembers lives in the app's typed settings (app.settings): the model to load at start with its options
(the shared KV cache's URL without its password, which lives in the OS keyring), the recent models, newest first,
and the remote server (base URL, model id, and whether answers came from it when the app last chose; its API key
lives in the OS keyring only).
"""

from __future__ import annotations

import dataclasses
import os
from urllib.parse import urlsplit, urlunsplit

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction

from . import dialogs, settings
from .settings import ModelChoice, RemoteServer


def recent_label(entry: ModelChoice) -> str:
    """What Model > Recent models shows for one entry: the file or folder name, then its weight format."""
    source = entry.source
    name = os.path.basename(str(source).rstrip("/\\")) if source else dialogs.DEFAULT_MODEL_NAME + " (built in)"
    return name if entry.weights == "auto" else f"{name} · {entry.weights}"


KV_KEYRING_PREFIX = "kv-cache "  # keyring entries of shared KV store passwords: this prefix + the bare URL


def split_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password or None)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{parts.username}@{host}" if parts.username else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)), parts.password


def with_password(url: str, password: str | None) -> str:
    if not password or urlsplit(url).password is not None:
        return url
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


def remote_cache_url(url: str | None) -> str | None:
    """A saved shared KV store URL with its password from the OS keyring put back (None: not shared)."""
    if not url:
        return None
    from . import remote_provider

    return with_password(url, remote_provider.load_api_key(KV_KEYRING_PREFIX + url))


def keep_remote_cache_password(url: str | None) -> str | None:
    """The URL to save: its password goes to the OS keyring (without a keyring it lives until the app quits)."""
    if not url:
        return None
    from . import remote_provider

    bare, password = split_password(url)
    if password is not None:
        try:
            remote_provider.store_api_key(KV_KEYRING_PREFIX + bare, password)
        except remote_provider.RemoteError:
            pass
    return bare


class ModelMenu:
    """The Model menu's behaviour for one window (its db, engine client and load_model)."""

    def __init__(self, window):
        self.window = window
        self.db = window.db
        self.client = window.client
        self.recent_menu = None

    def add_recent_menu(self, model_menu) -> None:
        self.recent_menu = model_menu.addMenu("Recent models")
        self.recent_menu.setObjectName("recentMenu")
        self.recent_menu.aboutToShow.connect(self.fill_recent_menu)
        self.fill_recent_menu()

    def fill_recent_menu(self) -> None:
        menu = self.recent_menu
        menu.clear()
        recent = settings.load(self.db).recent_models
        for entry in recent:
            act = QAction(recent_label(entry), menu)
            act.setToolTip(str(entry.source or "the built-in model"))
            act.triggered.connect(lambda _=False, e=entry: self.load(e))
            menu.addAction(act)
        if not recent:
            empty = QAction("(none yet)", menu)
            empty.setEnabled(False)
            menu.addAction(empty)

    # -- loading -------------------------------------------------------------------------------------------
    def load(self, choice: ModelChoice | dict) -> int:
        """Loads a model with its options (a ModelChoice, or the model dialog's values), makes it the model to load
        at start and the newest recent one; answers come from the engine again (not a remote server)."""
        if isinstance(choice, dict):
            choice = settings.from_rows({"schema_version": settings.SCHEMA_VERSION, "model": choice}).model
        remote_cache = remote_cache_url(choice.remote_cache)
        choice = dataclasses.replace(choice, remote_cache=keep_remote_cache_password(remote_cache))
        saved = settings.load(self.db).remembering(choice)
        settings.save(self.db, dataclasses.replace(saved, remote=dataclasses.replace(saved.remote, active=False)))
        return self.window.load_model(choice.source, **{**choice.engine_options(), "remote_cache": remote_cache})

    def start(self, source, *, explicit: bool, **options) -> None:
        """At start: the remote server the app last used (unless a model was named on the command line), else
        the engine with `source` and `options`."""
        remote = settings.load(self.db).remote
        if remote.active and not explicit:
            from . import remote_provider

            self.client.use_remote(remote.base_url, remote.model, remote_provider.load_api_key(remote.base_url))
            return
        if options.get("remote_cache"):
            options["remote_cache"] = remote_cache_url(options["remote_cache"])
        self.window.load_model(source, **options)

    def choose_model(self) -> None:
        current = dataclasses.asdict(settings.load(self.db).model)
        # Whether layer streaming can run depends on the chosen model and weight format: the dialog learns it from
        # the engine's estimate for that model (weights_estimated), not from the model loaded now.
        dialog = dialogs.ModelDialog(self.window, current=current, streaming_refusal=None)
        # The memory each weight format would take, read from the chosen model's config off the UI thread.
        dialog.weight_sizes_wanted.connect(self.client.estimate_weights)
        self.client.weights_estimated.connect(dialog.show_weight_sizes)
        dialog.request_weight_sizes()
        try:
            accepted = dialog.exec()
        finally:
            self.client.weights_estimated.disconnect(dialog.show_weight_sizes)
        if accepted:
            self.load(dialog.values())

    def open_models_dialog(self, library_options: dict | None = None):
        """Model > Models…: search, download, remove; Load loads the chosen download with the saved model options
        and saves it as the model to load at start. Not modal: the chats go on during a download."""
        from .models_dialog import ModelsDialog

        current = settings.load(self.db).model
        dialog = ModelsDialog(self.window, open_library=lambda: self.client.model_library(**(library_options or {})),
                              weights=current.weights)
        dialog.setAttribute(Qt.WA_DeleteOnClose)
        dialog.model_chosen.connect(lambda path: self.load(dataclasses.replace(current, source=path)))
        dialog.show()
        return dialog

    def open_remote_dialog(self):
        """Model > Remote server…: on OK answers come from that server (Choose model… goes back to the engine),
        also after a restart; the URL and model are saved, the key goes to the OS keyring only."""
        from . import remote_provider
        from .remote_dialog import RemoteDialog

        current = settings.load(self.db).remote
        dialog = RemoteDialog(self.window, base_url=current.base_url, model=current.model,
                              stored_key=remote_provider.load_api_key(current.base_url))
        dialog.setAttribute(Qt.WA_DeleteOnClose)

        def use(values: dict) -> None:
            key = values["api_key"]
            if key:
                try:
                    remote_provider.store_api_key(values["base_url"], key)
                except remote_provider.RemoteError as exc:  # no keyring: the key lives until the app quits
                    self.window.show_error(str(exc))
            else:
                key = remote_provider.load_api_key(values["base_url"])
            chosen = RemoteServer(base_url=values["base_url"], model=values["model"], active=True)
            settings.update(self.db, remote=chosen)
            self.client.use_remote(values["base_url"], values["model"], key)

        dialog.accepted.connect(lambda: use(dialog.values()))
        dialog.show()
        return dialog

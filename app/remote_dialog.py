"""Model > Remote server…: the base URL of an OpenAI-compatible server, its API key (kept in the OS keyring by the
window, never in the database) and the model, picked from the server's /v1/models (listed on a thread of its own)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from .background import Background
from .remote_provider import RemoteProvider


class RemoteDialog(QDialog):
    models_listed = Signal(list)  # model ids
    models_failed = Signal(str)

    def __init__(self, parent: QWidget | None = None, *, base_url: str = "", model: str = "",
                 stored_key: str | None = None):
        """`stored_key`: the key the keyring holds for `base_url`, used when the key field is left empty."""
        super().__init__(parent)
        self.setWindowTitle("Remote server")
        self._stored_key = stored_key
        self._background = Background(self)
        self.base_url_edit = QLineEdit(base_url, objectName="baseUrlEdit",
                                       placeholderText="http://192.168.1.20:8000/v1")
        self.api_key_edit = QLineEdit(objectName="apiKeyEdit", echoMode=QLineEdit.EchoMode.Password,
                                      placeholderText="kept in the OS keyring" if stored_key else "none")
        self.model_combo = QComboBox(objectName="modelCombo", editable=True)
        if model:
            self.model_combo.addItem(model)
        self.list_button = QPushButton("List models", objectName="listModelsButton")
        self.status_label = QLabel(objectName="remoteStatus", wordWrap=True)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)

        form = QFormLayout()
        form.addRow("Base URL", self.base_url_edit)
        form.addRow("API key", self.api_key_edit)
        row = QHBoxLayout()
        row.addWidget(self.model_combo, 1)
        row.addWidget(self.list_button)
        form.addRow("Model", row)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.status_label)
        layout.addWidget(self.buttons)
        # Wide enough that a server's URL, and an error naming it, read on one line each (its size hint alone
        # gave ~250 px and an error wrapped mid-URL); the error can be selected and copied.
        url_width = self.fontMetrics().horizontalAdvance("https://inference.example.com:8000/v1/models")
        self.base_url_edit.setMinimumWidth(url_width + 24)
        self.setMinimumWidth(url_width + 220)
        self.status_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.list_button.clicked.connect(self.on_list_button_clicked)
        self.models_listed.connect(self.on_models_listed)
        self.models_failed.connect(self.on_models_failed)
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.base_url_edit.textChanged.connect(self._update_ok)
        self.model_combo.currentTextChanged.connect(self._update_ok)
        self._update_ok()

    def api_key(self) -> str | None:
        return self.api_key_edit.text().strip() or self._stored_key

    def values(self) -> dict:
        """base_url, model, and api_key: the key typed here (None: none typed, keep what the keyring has)."""
        return {"base_url": self.base_url_edit.text().strip(), "model": self.model_combo.currentText().strip(),
                "api_key": self.api_key_edit.text().strip() or None}

    def _update_ok(self) -> None:
        ok = self.buttons.button(QDialogButtonBox.StandardButton.Ok)
        ok.setEnabled(bool(self.base_url_edit.text().strip() and self.model_combo.currentText().strip()))

    def on_list_button_clicked(self) -> None:
        base_url, key = self.base_url_edit.text().strip(), self.api_key()
        if not base_url:
            return
        self.list_button.setEnabled(False)
        self.status_label.setText(f"Asking {base_url} for its models…")

        # RemoteError says what the server said
        self._background.run(lambda: RemoteProvider(base_url, key, timeout_s=15).models(), self.models_listed.emit,
                             lambda exc: self.models_failed.emit(str(exc)), name="kvboost-remote-models")

    def on_models_listed(self, names: list) -> None:
        self.list_button.setEnabled(True)
        current = self.model_combo.currentText()
        self.model_combo.clear()
        self.model_combo.addItems(names)
        if current in names:
            self.model_combo.setCurrentText(current)
        self.status_label.setText(f"{len(names)} model(s) on this server." if names else "The server lists no model.")

    def on_models_failed(self, message: str) -> None:
        self.list_button.setEnabled(True)
        self.status_label.setText(message)

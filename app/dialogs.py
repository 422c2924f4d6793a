"""Modal dialogs: per-conversation settings, model choice, rename.

They only collect and validate values; the caller decides what to do with values() after exec() accepts.

Over 400 lines: the app's smaller dialogs side by side (conversation settings, model, rename, delete) with the
checks of what each accepts."""

from __future__ import annotations

import os
import re

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# (mode, label) in menu order; the engine's reuse modes.
REUSE_CHOICES = (
    ("chunk", "Chunk: exact reuse (default)"),
    ("prefix", "Prefix: reuse only a shared beginning"),
    ("approx", "Approximate: also reuses moved documents, may change answers"),
    ("off", "Off: compute every prompt in full"),
)
WEIGHT_CHOICES = (
    ("auto", "Auto: as the file is (4-bit files as int4), float models as float if they fit"),
    ("float", "Float: full precision, the most memory"),
    ("int4", "Int4: 4-bit weights, much less memory (sizes below), faster decode"),
)

# Hugging Face repository ids: "owner/name", each part starting with a letter or digit.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

_SOURCE_KINDS = ("default", "folder", "gguf", "hub")


class ConversationSettingsDialog(QDialog):
    """Title, system prompt and sampling of one conversation."""

    def __init__(
        self,
        parent: QWidget | None = None,
        *,
        title: str,
        system_prompt: str,
        sampling: dict,
        defaults: dict | None = None,
    ):
        super().__init__(parent)
        self.setWindowTitle("Conversation settings")
        self._defaults = defaults

        self._title_edit = QLineEdit(title)
        self._title_edit.setObjectName("titleEdit")
        self._system_prompt_edit = QPlainTextEdit(system_prompt)
        self._system_prompt_edit.setObjectName("systemPromptEdit")
        self._system_prompt_edit.setPlaceholderText("Instructions the model sees before every message")

        self._temperature_spin = QDoubleSpinBox()
        self._temperature_spin.setObjectName("temperatureSpin")
        self._temperature_spin.setRange(0.0, 2.0)
        self._temperature_spin.setSingleStep(0.05)
        self._temperature_spin.setDecimals(2)
        self._temperature_spin.setToolTip("0 always picks the most likely token")

        self._top_p_spin = QDoubleSpinBox()
        self._top_p_spin.setObjectName("topPSpin")
        self._top_p_spin.setRange(0.05, 1.0)
        self._top_p_spin.setSingleStep(0.05)
        self._top_p_spin.setDecimals(2)

        self._max_tokens_spin = QSpinBox()
        self._max_tokens_spin.setObjectName("maxTokensSpin")
        self._max_tokens_spin.setRange(1, 32768)

        self._set_sampling(sampling)

        self._reset_button = QPushButton("Reset to defaults")
        self._reset_button.setObjectName("resetButton")
        self._reset_button.setEnabled(defaults is not None)
        self._reset_button.clicked.connect(self.on_reset_button_clicked)

        self._buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self._buttons.addButton(self._reset_button, QDialogButtonBox.ButtonRole.ResetRole)
        self._buttons.accepted.connect(self.accept)
        self._buttons.rejected.connect(self.reject)

        form = QFormLayout()
        form.addRow("Title", self._title_edit)
        form.addRow("System prompt", self._system_prompt_edit)
        form.addRow("Temperature", self._temperature_spin)
        form.addRow("Top-p", self._top_p_spin)
        form.addRow("Max new tokens", self._max_tokens_spin)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self._buttons)

        self._title_edit.textChanged.connect(self.on_title_edit_text_changed)
        self.on_title_edit_text_changed(self._title_edit.text())

    def _set_sampling(self, sampling: dict) -> None:
        # Keys missing from `sampling` keep the widget's current value.
        if "temperature" in sampling:
            self._temperature_spin.setValue(float(sampling["temperature"]))
        if "top_p" in sampling:
            self._top_p_spin.setValue(float(sampling["top_p"]))
        if "max_new_tokens" in sampling:
            self._max_tokens_spin.setValue(int(sampling["max_new_tokens"]))

    def on_title_edit_text_changed(self, text: str) -> None:
        self._buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(bool(text.strip()))

    def on_reset_button_clicked(self) -> None:
        # The title is the user's name for the conversation, not a setting, so it stays.
        assert self._defaults is not None, "reset is disabled without defaults"
        self._system_prompt_edit.setPlainText(self._defaults.get("system_prompt", ""))
        self._set_sampling(self._defaults.get("sampling", {}))

    def values(self) -> dict:
        return {
            "title": self._title_edit.text().strip(),
            "system_prompt": self._system_prompt_edit.toPlainText(),
            "sampling": {
                "temperature": round(self._temperature_spin.value(), 2),
                "top_p": round(self._top_p_spin.value(), 2),
                "max_new_tokens": self._max_tokens_spin.value(),
            },
        }


def _source_kind(source: str | None) -> str:
    """Which radio button a saved source belongs to."""
    if source is None:
        return "default"
    path = os.path.expanduser(source)
    if path.lower().endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path) or not _HUB_ID.match(source):
        return "folder"
    return "hub"


def source_problem(kind: str, text: str) -> str | None:
    """Why `text` is not a usable source of `kind`, or None when it is."""
    assert kind in _SOURCE_KINDS, kind
    text = text.strip()
    if kind == "default":
        return None
    if not text:
        return {
            "folder": "Choose a model folder.",
            "gguf": "Choose a .gguf file.",
            "hub": "Enter a model id such as HuggingFaceTB/SmolLM2-360M-Instruct.",
        }[kind]
    path = os.path.expanduser(text)
    if kind == "folder":
        if not os.path.isdir(path):
            return f"Folder not found: {path}"
        if not os.path.isfile(os.path.join(path, "config.json")):
            return f"Not a Hugging Face model folder (no config.json): {path}"
        return None
    if kind == "gguf":
        if not path.lower().endswith(".gguf"):
            return f"Not a .gguf file: {path}"
        if not os.path.isfile(path):
            return f"File not found: {path}"
        return None
    if not _HUB_ID.match(text):
        return f"A model id looks like owner/name, got {text!r}."
    return None


def _choice_combo(name: str, what: str, choices, value: str) -> QComboBox:
    """A combo box of (value, label) choices with `value` selected; ValueError naming the choices otherwise."""
    combo = QComboBox()
    combo.setObjectName(name)
    for data, label in choices:
        combo.addItem(label, data)
    index = combo.findData(value)
    if index < 0:
        raise ValueError(f"{what} must be one of {[data for data, _ in choices]}, got {value!r}")
    combo.setCurrentIndex(index)
    return combo


class ModelDialog(QDialog):
    """Which model to load, in which weight format, and how the engine reuses cached text."""

    weight_sizes_wanted = Signal(object)  # source (None: built in): the window asks the engine client

    def __init__(self, parent: QWidget | None = None, *, current: dict | None, streaming_refusal: str | None):
        super().__init__(parent)
        self.setWindowTitle("Model")
        current = current or {}
        self._streaming_refusal = streaming_refusal

        self._radios = {
            "default": QRadioButton(f"Built-in {DEFAULT_MODEL_NAME}"),
            "folder": QRadioButton("Local Hugging Face folder"),
            "gguf": QRadioButton("GGUF file"),
            "hub": QRadioButton("Hugging Face model id (already downloaded)"),
        }
        self._kind_group = QButtonGroup(self)
        for kind, radio in self._radios.items():
            radio.setObjectName(f"{kind}Radio")
            self._kind_group.addButton(radio)

        self._source_edit = QLineEdit()
        self._source_edit.setObjectName("sourceEdit")
        self._browse_button = QPushButton("Browse…")
        self._browse_button.setObjectName("browseButton")

        self._error_label = QLabel()
        self._error_label.setObjectName("errorLabel")
        self._error_label.setWordWrap(True)

        self._reuse_combo = _choice_combo("reuseCombo", "reuse", REUSE_CHOICES, current.get("reuse", "chunk"))
        self._weights_combo = _choice_combo("weightsCombo", "weights", WEIGHT_CHOICES, current.get("weights", "auto"))
        self._weight_sizes_label = QLabel("")
        self._weight_sizes_label.setObjectName("weightSizes")
        self._weight_sizes_label.setWordWrap(True)

        # Layer streaming: int4 decoder layers beyond the memory budget stream from RAM (or a file) per pass.
        self._awq_check = QCheckBox("Layer streaming")
        self._awq_check.setObjectName("awqCheck")
        self._awq_reason = QLabel("")
        self._awq_reason.setObjectName("awqReason")
        self._awq_reason.setProperty("disabledReason", True)
        self._awq_reason.setWordWrap(True)
        self._awq_check.setChecked(bool(current.get("layer_streaming", False)))

        # The shared KV tier: a Redis/Valkey store other machines (and kvboost-servers) read and write too.
        self._remote_cache_edit = QLineEdit(current.get("remote_cache") or "")
        self._remote_cache_edit.setObjectName("remoteCacheEdit")
        self._remote_cache_edit.setPlaceholderText("redis://host:6379/0 (empty: not shared)")
        self._remote_cache_edit.setToolTip(
            "A Redis or Valkey store shared with other machines: KV one of them computed answers the others. "
            "redis://user:password@host:port/db, rediss:// for TLS. The password is kept in the OS keyring.")
        self._streaming: dict | None = None  # the engine's streaming estimate for the chosen model
        self._sizes: dict | None = None  # its weights' memory per format (show_weight_sizes)
        self._show_streaming()
        self._weights_combo.currentIndexChanged.connect(self.on_weights_combo_current_index_changed)

        self._buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self._buttons.accepted.connect(self.accept)
        self._buttons.rejected.connect(self.reject)

        source_row = QHBoxLayout()
        source_row.addWidget(self._source_edit, 1)
        source_row.addWidget(self._browse_button)
        awq_row = QHBoxLayout()
        awq_row.addWidget(self._awq_check)
        awq_row.addWidget(self._awq_reason, 1)
        layout = QVBoxLayout(self)
        for radio in self._radios.values():
            layout.addWidget(radio)
        layout.addLayout(source_row)
        layout.addWidget(self._error_label)
        options = QFormLayout()
        options.addRow("Reuse", self._reuse_combo)
        options.addRow("Weights", self._weights_combo)
        options.addRow("", self._weight_sizes_label)
        options.addRow(awq_row)
        options.addRow("Shared KV cache", self._remote_cache_edit)
        layout.addLayout(options)
        layout.addWidget(self._buttons)

        # Each kind keeps its own text, so flipping between radio buttons does not lose what was typed.
        source = current.get("source")
        self._kind = _source_kind(source)
        self._texts = dict.fromkeys(_SOURCE_KINDS, "")
        if source is not None:
            self._texts[self._kind] = source
        self._radios[self._kind].setChecked(True)
        self._show_kind(self._kind)

        self._kind_group.buttonToggled.connect(self.on_kind_group_button_toggled)
        self._source_edit.textChanged.connect(self.on_source_edit_text_changed)
        self._remote_cache_edit.textChanged.connect(self.on_remote_cache_edit_text_changed)
        self._browse_button.clicked.connect(self.on_browse_button_clicked)
        self._validate()

    def _show_kind(self, kind: str) -> None:
        self._kind = kind
        self._source_edit.setText(self._texts[kind])
        self._source_edit.setEnabled(kind != "default")
        self._browse_button.setEnabled(kind in ("folder", "gguf"))
        self._source_edit.setPlaceholderText({
            "default": "",
            "folder": "Folder with config.json and weights",
            "gguf": "Path to a .gguf file",
            "hub": "owner/name",
        }[kind])

    def _validate(self) -> None:
        problem = source_problem(self._kind, self._source_edit.text()) or remote_cache_problem(
            self._remote_cache_edit.text())
        self._error_label.setText(problem or "")
        self._error_label.setVisible(problem is not None)
        self._buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(problem is None)

    def on_kind_group_button_toggled(self, button: QRadioButton, checked: bool) -> None:
        if not checked:
            return
        self._texts[self._kind] = self._source_edit.text()
        kind = next(k for k, radio in self._radios.items() if radio is button)
        self._show_kind(kind)
        self._validate()
        self.request_weight_sizes()

    def on_remote_cache_edit_text_changed(self, _text: str) -> None:
        self._validate()

    def on_source_edit_text_changed(self, _text: str) -> None:
        self._validate()
        self.request_weight_sizes()

    def _chosen_source(self) -> str | None:
        return None if self._kind == "default" else os.path.expanduser(self._source_edit.text().strip())

    def request_weight_sizes(self) -> None:
        """Asks (weight_sizes_wanted) for the memory of the chosen model per weight format, when it is valid."""
        if source_problem(self._kind, self._source_edit.text()) is not None:
            self._weight_sizes_label.setText("")
            return
        self._weight_sizes_label.setText("Reading the model's size…")
        self.weight_sizes_wanted.emit(self._chosen_source())

    def show_weight_sizes(self, source: str, sizes: dict) -> None:
        """The weights' memory per format for `source` ("" = built in); answers for another source are stale."""
        if source != (self._chosen_source() or ""):
            return
        self._streaming = sizes.get("streaming")
        self._show_streaming()
        self._sizes = sizes
        if "error" in sizes:
            self._weight_sizes_label.setText(f"Size unknown: {sizes['error']}")
            return
        self._show_sizes()

    def _show_sizes(self) -> None:
        """The chosen model's weights per format, and what the chosen Weights option will load."""
        sizes = self._sizes
        if sizes is None or "error" in sizes:
            return
        float_mb, int4_mb = sizes["float"] / 2**20, sizes["int4"] / 2**20
        auto = sizes["auto"]  # engine.weights.weight_sizes.estimate: what weights="auto" loads and why
        chosen = self._weights_combo.currentData()
        loads = f"auto loads {auto['loads']}" if chosen == "auto" else f"this loads {chosen}"
        self._weight_sizes_label.setText(
            f"Weights in memory: float ({sizes['dtype']}) {float_mb:,.0f} MB · int4 {int4_mb:,.0f} MB"
            f" · {loads}" + (" (an AWQ int4 checkpoint)" if sizes["awq"] else ""))
        self._weight_sizes_label.setToolTip(f"Auto: {auto['why']}")

    def streaming_unavailable(self) -> str | None:
        """Why streaming cannot be chosen for the chosen model and weight format, or None."""
        if self._streaming_refusal is not None:
            return self._streaming_refusal
        if self._streaming is None:
            return None  # not known yet: the engine says so at load if it cannot
        return self._streaming["unavailable"].get(self._weights_combo.currentData())

    def _show_streaming(self) -> None:
        reason = self.streaming_unavailable()
        self._awq_check.setEnabled(reason is None)
        self._awq_reason.setText(reason or "")
        self._awq_reason.setVisible(reason is not None)
        self._awq_check.setToolTip(reason or streaming_tooltip(self._streaming))

    def on_weights_combo_current_index_changed(self, _index: int) -> None:
        self._show_streaming()
        self._show_sizes()

    def on_browse_button_clicked(self) -> None:
        start = os.path.expanduser(self._source_edit.text().strip()) or os.path.expanduser("~")
        if self._kind == "folder":
            chosen = QFileDialog.getExistingDirectory(self, "Choose a model folder", start)
        else:
            chosen, _filter = QFileDialog.getOpenFileName(self, "Choose a GGUF file", start, "GGUF files (*.gguf)")
        if chosen:
            self._source_edit.setText(chosen)

    def values(self) -> dict:
        text = self._source_edit.text().strip()
        return {
            "source": None if self._kind == "default" else os.path.expanduser(text),
            "reuse": self._reuse_combo.currentData(),
            "layer_streaming": self.streaming_unavailable() is None and self._awq_check.isChecked(),
            "weights": self._weights_combo.currentData(),
            "remote_cache": self._remote_cache_edit.text().strip() or None,
        }


def remote_cache_problem(text: str) -> str | None:
    """Why `text` cannot name a shared KV store, or None (empty: not shared)."""
    text = text.strip()
    if text and text.split("://", 1)[0] not in ("redis", "rediss", "unix"):
        return "The shared KV cache is a redis://, rediss:// or unix:// URL (Redis or Valkey)."
    return None


def streaming_tooltip(estimate: dict | None) -> str:
    """What streaming would do for the chosen model, from the engine's estimate (engine.weights.stream_setup)."""
    base = ("Int4 decoder layers that do not fit in the memory budget stay in host memory and are copied in, "
            "one layer at a time, while earlier layers compute.")
    if not estimate:
        return base
    budget = estimate["budget_bytes"] / 2**20
    if not estimate.get("fits", True):
        return f"{base}\nThe budget ({budget:,.0f} MB) cannot even hold the embeddings, head and KV cache."
    speed = estimate["predicted_decode_tokens_per_s"]
    if speed is None:
        return f"{base}\nEverything fits in the budget ({budget:,.0f} MB free): nothing would stream."
    return (f"{base}\nPredicted decode: about {speed:,.1f} tokens/s at most ({estimate['streamed_bytes'] / 2**20:,.0f}"
            f" MB of layers per token over a {estimate['bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s copy link; "
            f"budget {budget:,.0f} MB).")


def confirm_delete(parent: QWidget | None, title: str, messages: int) -> bool:
    """Whether the user confirms deleting the conversation `title` and its `messages` messages (No by default)."""
    what = f"its {messages} message{'s' if messages != 1 else ''}" if messages else "it"
    answer = QMessageBox.question(parent, "Delete conversation",
                                  f"Delete “{title}” and {what}? This cannot be undone.",
                                  QMessageBox.Yes | QMessageBox.No, QMessageBox.No)
    return answer == QMessageBox.Yes


def ask_rename(parent: QWidget | None, current: str) -> str | None:
    """The new title, or None when the user cancels or leaves it empty."""
    text, ok = QInputDialog.getText(parent, "Rename conversation", "Title:", QLineEdit.EchoMode.Normal, current)
    text = text.strip()
    return text if ok and text else None

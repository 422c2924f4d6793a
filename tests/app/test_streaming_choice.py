"""Choosing layer streaming in Model > Choose model: the switch follows the engine's estimate for the chosen
model and weight format (disabled with the engine's reason, enabled where it can run), its tooltip predicts
the decode speed before loading, and the memory meter shows resident and streamed weights."""

from __future__ import annotations

import pytest
from PySide6.QtWidgets import QCheckBox, QComboBox, QLabel

from app.dialogs import ModelDialog
from app.memory_meter import memory_text

# As engine.weights.weight_sizes.estimate answers for a float folder that fits: auto loads it as float.
SIZES = {"float": 513 * 2**20, "int4": 171 * 2**20, "outside_layers": 110 * 2**20, "awq": False, "dtype": "float32",
         "auto": {"loads": "float", "why": "float weights (0.5 GB in float32) fit"}}
NEEDS_INT4 = "needs int4 weights: an AWQ checkpoint, or Weights: int4 (float decoder layers are not streamed)"


def estimate(**changes) -> dict:
    streaming = {"unavailable": {"auto": NEEDS_INT4, "float": "needs int4 weights", "int4": None},
                 "budget_bytes": 150 * 2**20, "bandwidth_bytes_per_s": 8e9, "streamed_bytes": 40 * 2**20,
                 "fits": True, "predicted_decode_tokens_per_s": 8e9 / (40 * 2**20)}
    return {**SIZES, "streaming": {**streaming, **changes}}


@pytest.fixture
def dialog(qtbot):
    dialog = ModelDialog(None, current={"source": None, "reuse": "chunk", "layer_streaming": True, "weights": "auto"},
                         streaming_refusal=None)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def choose_weights(dialog, weights: str) -> None:
    combo = dialog.findChild(QComboBox, "weightsCombo")
    combo.setCurrentIndex(combo.findData(weights))


def test_the_switch_follows_the_engines_reason_for_each_weight_format(dialog):
    check, reason = dialog.findChild(QCheckBox, "awqCheck"), dialog.findChild(QLabel, "awqReason")
    dialog.show_weight_sizes("", estimate())
    assert not check.isEnabled() and reason.isVisible() and reason.text() == NEEDS_INT4
    assert dialog.values()["layer_streaming"] is False  # it was on in the settings, but cannot run with auto here
    choose_weights(dialog, "int4")
    assert check.isEnabled() and not reason.isVisible()
    assert dialog.values() == {"source": None, "reuse": "chunk", "layer_streaming": True, "weights": "int4",
                               "remote_cache": None}
    choose_weights(dialog, "float")
    assert not check.isEnabled() and reason.text() == "needs int4 weights"


def test_the_tooltip_predicts_the_decode_speed_before_loading(dialog):
    choose_weights(dialog, "int4")
    dialog.show_weight_sizes("", estimate())
    tip = dialog.findChild(QCheckBox, "awqCheck").toolTip()
    assert "about 190.7 tokens/s" in tip and "40 MB of layers per token" in tip and "8.0 GB/s" in tip
    dialog.show_weight_sizes("", estimate(streamed_bytes=0, predicted_decode_tokens_per_s=None))
    assert "nothing would stream" in dialog.findChild(QCheckBox, "awqCheck").toolTip()
    dialog.show_weight_sizes("", estimate(fits=False))
    assert "cannot even hold" in dialog.findChild(QCheckBox, "awqCheck").toolTip()


def test_an_answer_about_another_model_leaves_the_switch_alone(dialog):
    choose_weights(dialog, "int4")
    dialog.show_weight_sizes("/elsewhere/model.gguf", estimate(unavailable={"int4": "not this one"}))
    assert dialog.findChild(QCheckBox, "awqCheck").isEnabled()


def test_the_memory_meter_shows_streamed_weights_beside_resident_ones():
    engine = {"device": "cpu", "weights_bytes": 120 * 2**20, "streamed_weights_bytes": 50 * 2**20,
              "kv_bytes": {"device": 0}, "kv_budget_bytes": {"device": 1}}
    assert "model 120.0 MB + 50.0 MB streamed" in memory_text(300 * 2**20, engine)
    assert "streamed" not in memory_text(300 * 2**20, {**engine, "streamed_weights_bytes": 0})


def test_a_tier_is_called_quantized_only_when_the_engine_keeps_it_so():
    from app.memory_meter import tier_label

    cpu = {"kv_quant": {"device": "none", "host": "int8", "disk": "int4"}}
    assert [tier_label(t, cpu) for t in ("device", "host", "disk")] == ["RAM", "overflow RAM (int8)", "disk (int4)"]
    gpu = {"device_total_bytes": 1, "kv_quant": {"device": "none", "host": "none"}}
    assert [tier_label(t, gpu) for t in ("device", "host")] == ["GPU", "host RAM"]

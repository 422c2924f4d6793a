"""The status-bar memory meter: VRAM (weights / KV) on CUDA, process RAM otherwise, and KV per tier (a RAM tier
against its budget; the tooltip says where each budget came from).

Sampled on the UI thread every second from counters the engine keeps (no lock, no torch work)."""

from __future__ import annotations

import psutil
from PySide6.QtCore import QTimer

from .elided_label import ElidedLabel

INTERVAL_MS = 1000


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB") else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def tier_label(tier: str, engine: dict) -> str:
    """The engine's tier names in the user's words: on a CPU-only machine device and host are both RAM; a tier
    that keeps its KV quantized (the engine's kv_quant for it: int8, int4) says so, a lossless one does not."""
    cuda = "device_total_bytes" in engine
    label = {"device": "GPU" if cuda else "RAM", "host": "host RAM" if cuda else "overflow RAM",
             "disk": "disk", "remote": "shared"}.get(tier, tier)
    quant = engine.get("kv_quant", {}).get(tier, "none")
    return label if quant in (None, "none") else f"{label} ({quant})"


def _model_bytes(engine: dict) -> str:
    """The weights held on the device, and with layer streaming those streamed to it from host memory."""
    text = f"model {human_bytes(engine['weights_bytes'])}"
    streamed = engine.get("streamed_weights_bytes", 0)
    return f"{text} + {human_bytes(streamed)} streamed" if streamed else text


def memory_text(rss: int, engine: dict | None) -> str:
    """One line for the status bar from the process RSS and the engine's memory() report."""
    parts = []
    if engine and "device_total_bytes" in engine:
        parts.append(f"VRAM {human_bytes(engine['device_used_bytes'])} / {human_bytes(engine['device_total_bytes'])}"
                     f" ({_model_bytes(engine)}, KV {human_bytes(engine['kv_bytes'].get('device', 0))})")
    parts.append(f"RAM {human_bytes(rss)}")
    if engine:
        if "device_total_bytes" not in engine:
            parts[-1] += f" ({_model_bytes(engine)})"
        tiers = ", ".join(f"{tier_label(tier, engine)} {_used_of_budget(tier, n, engine)}"
                          for tier, n in engine["kv_bytes"].items())
        parts.append(f"KV cache: {tiers}")
        if engine.get("remote"):
            parts.append(remote_text(engine["remote"]))
    return " · ".join(parts)


def _used_of_budget(tier: str, num_bytes: int, engine: dict) -> str:
    """A RAM tier's KV against its budget, so the share the cache may still take shows; other tiers' bytes alone."""
    budget = engine.get("kv_budget_bytes", {}).get(tier)
    ram = tier == "host" or (tier == "device" and "device_total_bytes" not in engine)
    return f"{human_bytes(num_bytes)} of {human_bytes(budget)}" if ram and budget else human_bytes(num_bytes)


def remote_text(remote: dict) -> str:
    """The shared KV tier in the status bar: chunks it served, bytes this app wrote to it, and when it is down."""
    text = f"shared KV: {remote['hits']} hits, {human_bytes(remote['written_bytes'])} written"
    return text if remote["state"] == "closed" else f"{text} (unreachable)"


def remote_tooltip(remote: dict) -> list[str]:
    state = {"closed": "answering", "open": "not answering: retried every few seconds",
             "half-open": "being retried"}.get(remote["state"], remote["state"])
    lines = [f"shared KV store {remote['url']}: {state}",
             f"  {remote['hits']} chunks read ({human_bytes(remote['read_bytes'])}), {remote['misses']} misses, "
             f"{remote['bad']} bad values dropped",
             f"  {remote['writes']} chunks written ({human_bytes(remote['written_bytes'])}), {remote['dropped']} "
             f"writes dropped (store too slow), {remote['errors']} errors"]
    if remote.get("last_error") and remote["state"] != "closed":
        lines.append(f"  {remote['last_error']}")
    return lines


def memory_tooltip(engine: dict | None) -> str:
    """Each KV tier against its budget (the status bar line keeps only what is used)."""
    if not engine:
        return "No model loaded"
    rules = engine.get("kv_budget_rules", {})  # where each memory tier's budget came from
    lines = [f"{tier_label(tier, engine)}: {human_bytes(n)} of {human_bytes(engine['kv_budget_bytes'].get(tier, 0))}"
             + (f" ({rules[tier]})" if tier in rules else "")
             for tier, n in engine["kv_bytes"].items()]
    if engine.get("disk_error"):
        lines.append(engine["disk_error"])
    if engine.get("remote"):
        lines.extend(remote_tooltip(engine["remote"]))
    return "KV cache per tier (used of budget):\n" + "\n".join(lines)


class MemoryMeter(ElidedLabel):
    def __init__(self, client, parent=None):
        super().__init__("", parent)
        self.setObjectName("memoryMeter")
        self.client = client
        self._process = psutil.Process()
        self.num_updates = 0
        self.last_report: dict | None = None
        self._timer = QTimer(self, interval=INTERVAL_MS)
        self._timer.timeout.connect(self.update_now)
        self._timer.start()
        self.update_now()

    def update_now(self) -> None:
        rss = self._process.memory_info().rss
        try:
            engine = self.client.memory()
        except RuntimeError:  # the model is being replaced under us; next tick has it
            engine = None
        self.last_report = {"rss": rss, "engine": engine}
        self.setText(memory_text(rss, engine))
        self.setToolTip(memory_tooltip(engine))
        self.num_updates += 1

    def stop(self) -> None:
        self._timer.stop()

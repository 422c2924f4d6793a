"""KVBoost engine: chunked KV reuse over HuggingFace transformers RoPE decoders. Never imports Qt.

The public names are imported on first use (PEP 562), so that commands that need no model (`kvboost cache stats`,
`kvboost models list`, `--help`, `--version`) start without importing torch.
"""

from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "ChunkingConfig": "config", "EngineConfig": "config", "LoadOptions": "config", "SamplingConfig": "config",
    "ReuseConfig": "config", "TierConfig": "config", "DecodeConfig": "config",  # EngineConfig's three parts
    "KVBoost": "engine", "UnsupportedModelError": "engine", "awq_streaming_unavailable": "engine",
    "layer_streaming_unavailable": "engine",
    "Cancelled": "generate", "Result": "generate", "Stats": "generate", "TokenEvent": "generate",
    "NonFiniteLogits": "generate",
    "CacheStats": "reports", "EngineInfo": "reports", "MemoryReport": "reports",  # info(), memory(), cache_stats()
    "WeightsReport": "reports",  # info().weights
    "ModelLoadError": "weights.loader",
    "PromptProgress": "prefill",  # stream(progress=True)
    # the engine thread, its queue, its one job type
    "MAX_BATCH": "worker", "EngineWorker": "worker", "Job": "worker", "WorkerStopped": "worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

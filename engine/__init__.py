"""KVBoost engine: chunked KV reuse over HuggingFace transformers RoPE decoders. Never imports Qt."""

from .config import ChunkingConfig, EngineConfig, SamplingConfig
from .engine import KVBoost, UnsupportedModelError, awq_streaming_unavailable, layer_streaming_unavailable
from .generate import Cancelled, Result, Stats, TokenEvent
from .loader import ModelLoadError

__all__ = [
    "KVBoost", "Result", "Stats", "TokenEvent", "EngineConfig", "ChunkingConfig", "SamplingConfig",
    "ModelLoadError", "UnsupportedModelError", "layer_streaming_unavailable", "awq_streaming_unavailable",
    "Cancelled",
]

from .worker import MAX_BATCH, EngineWorker, WorkerStopped  # noqa: E402  (the engine thread, its queue, its batch)

__all__ += ["EngineWorker", "WorkerStopped", "MAX_BATCH"]

"""The decode roofline every benchmark shares: how fast this machine reads memory, and how many bytes one decode
step reads. A dense model at batch 1 reads every weight once a token, so bandwidth / bytes a step is the fastest
decode the machine allows; a row's share of it says how far from that limit an engine runs."""

from __future__ import annotations

import time


def read_bandwidth(threads: int, size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """This machine's memory read bandwidth in bytes/s: the best of `repeats` sums over a tensor far larger than
    the caches, on `threads` threads (what a decode step does with its weights: read each once)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(size_bytes // 4)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
        return size_bytes / best
    finally:
        torch.set_num_threads(previous)


def step_bytes(model, resident_bytes: int, context: int, kv_element_bytes: int = 4) -> int:
    """Bytes one decode step at `context` tokens reads: every weight held (`resident_bytes`, as
    engine.weights.weights_report counts them) but the input table (one row of it is read; a table the head
    shares is read whole), and the KV of the context (`kv_element_bytes` a value: float32 on the CPU)."""
    table, head = model.get_input_embeddings(), model.get_output_embeddings()
    shared = {t.data_ptr() for t in [*head.parameters(), *head.buffers()]}
    table_bytes = sum(t.numel() * t.element_size() for t in [*table.parameters(), *table.buffers()]
                      if t.data_ptr() not in shared)
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * kv_element_bytes * context
    return resident_bytes - table_bytes + kv

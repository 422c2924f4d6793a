"""`bench shapes`' model files at the tiny shape: `--own-blocks` writes the Q4_K_M layout with the project's own
K-quant blocks and no Q8_0 file, also where llama.cpp is installed (the 32B shape's Q8_0 file would not fit)."""

from __future__ import annotations

import gguf

from bench import shapes


def test_own_blocks_write_the_q4_k_m_layout_and_no_q8_0_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_BENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("KVBOOST_LLAMA_PYTHON", "/nonexistent/python")  # "installed": never run by this path
    path = shapes.model_file("tiny", 2, own_blocks=True)
    assert path.name == "llama-tiny.Q4_K_M-own.gguf"
    assert [p.name for p in tmp_path.rglob("*.gguf")] == [path.name]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {types[f"blk.{i}.{name}.weight"] for i in range(2)
            for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert set(types.values()) <= {"Q4_K", "Q6_K", "F32"}
    written = path.stat().st_mtime_ns
    assert shapes.model_file("tiny", 2, own_blocks=True) == path and path.stat().st_mtime_ns == written  # once

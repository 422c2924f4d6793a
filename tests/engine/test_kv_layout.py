"""The KV layout a payload read back must have (engine.kv.tiers.KVLayout), shared by the disk and the remote tier: it is
the layout the model computes for every supported architecture, it refuses payloads of any other shape, dtype or
quantization even when their byte count is right, and it sizes the remote tier's limit on a value."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import ARCHS, CHUNK, build_model, build_tokenizer, random_ids

from engine import ChunkingConfig, EngineConfig, KVBoost
from engine.config import TierConfig
from engine.keys import chain_key
from engine.kv.disk import DiskTier
from engine.kv.disk_rows import entry_fields
from engine.kv.eviction import LRU
from engine.kv.payload_file import encode_file
from engine.kv.store import ChunkStore
from engine.kv.tiered_store import _max_value_bytes
from engine.kv.tiers import KVLayout, encode_kv

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def random_kv(num_tokens, heads=2, dim=16, layers=2, dtype=torch.float32):
    return tuple((torch.randn(1, heads, num_tokens, dim).to(dtype), torch.randn(1, heads, num_tokens, dim).to(dtype))
                 for _ in range(layers))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_layout_from_the_config_is_the_layout_the_model_computes(arch, one_thread):
    model = build_model(arch)
    engine = KVBoost(model, build_tokenizer(), EngineConfig.of(chunk_size=CHUNK, disk_cache_bytes=0),
                     name=arch)
    expected = KVLayout.of_model(model)
    engine.warm(random_ids(4 * CHUNK, seed=3))
    key = next(iter(engine.store.records))
    assert KVLayout.of_kv(engine.store.payload(key)) == expected
    assert engine.store.layout == expected  # never corrected: the config said it right


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_encode_kv_makes_what_the_layout_accepts_and_nothing_else(quant):
    stored = encode_kv(random_kv(CHUNK), quant, torch.device("cpu"))
    assert LAYOUT.mismatch(stored, quant, CHUNK) is None
    others = {"tokens": LAYOUT.mismatch(stored, quant, CHUNK + 1),
              "quant": LAYOUT.mismatch(stored, "int8" if quant == "none" else "none", CHUNK),
              "layers": dataclasses.replace(LAYOUT, num_layers=3).mismatch(stored, quant, CHUNK),
              "heads": dataclasses.replace(LAYOUT, num_kv_heads=4).mismatch(stored, quant, CHUNK),
              "dim": dataclasses.replace(LAYOUT, head_dim=8).mismatch(stored, quant, CHUNK),
              "dtype": dataclasses.replace(LAYOUT, dtype=torch.float16).mismatch(stored, quant, CHUNK)}
    assert all(why is not None for why in others.values()), others
    assert "3" in others["layers"] and "2 layers" in others["layers"]  # errors name the values


def test_the_disk_tier_serves_a_payload_only_if_it_is_the_models_kv(tmp_path):
    """Heads and head dim swapped (4 x 8 for 2 x 16): the same bytes, so the file's size and the row agree, and the
    checksum is right; before the layout check this was served and failed in attention."""
    disk = DiskTier(tmp_path / "kv", 1 << 30, "none", namespace="ns")
    store = ChunkStore(1 << 30, LRU(), disk=disk, layout=LAYOUT)
    root = b"r" * 16
    tokens = list(range(10, 10 + CHUNK))
    key = chain_key(root, tokens)
    assert store.put_chunk(key, root, b"c" * 16, 0, tokens, random_kv(CHUNK))
    record = store.records[key]
    store.device_tier.remove(key)  # only the disk copy is left
    record.tier = "disk"
    file = disk.db.execute("SELECT file FROM entries WHERE key = ?", [key.hex()]).fetchone()[0]
    swapped = encode_kv(random_kv(CHUNK, heads=4, dim=8), "none", torch.device("cpu"))
    (disk.folder / file).write_bytes(encode_file(swapped, "ns", key, entry_fields(record, False)))
    store.acquire(record)
    assert not store.fetch(record)
    store.release(record)
    assert store.counters.disk_misses == 1
    disk.close()


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("chunking", ["fixed", "adaptive"])
def test_the_value_limit_holds_the_longest_chunk_and_little_more(quant, chunking):
    chunks = ChunkingConfig(mode=chunking, size=CHUNK, window=4)
    longest = CHUNK + (4 if chunking == "adaptive" else 0)
    # token ids of the largest vocabularies (6 digits each in the header)
    entry = {"kind": "chunk", "parent": "ab" * 16, "start": 123456, "tokens": [151_000] * longest, "exact": True,
             "lossy": False}
    blob = encode_file(encode_kv(random_kv(longest), quant, torch.device("cpu")), "n" * 32, b"k" * 16, entry)
    limit = _max_value_bytes(TierConfig(), chunks, LAYOUT, quant)
    assert len(blob) <= limit <= len(blob) + (8 << 10), (len(blob), limit)
    assert _max_value_bytes(TierConfig(remote_max_value_bytes=12345), chunks, LAYOUT, quant) == 12345

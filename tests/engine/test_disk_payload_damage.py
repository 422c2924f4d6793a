"""A payload file damaged anywhere is never served: one changed byte, wherever it sits in the file (the header, the
first tensors, the last bytes of the last one, tens of KB in), gives a MISS, or a hit with exactly the bytes that
were stored. The payloads here are large (tens of KB) so that a checksum covering only the start of a file would
let damage further in through."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import CHUNK, build_model, build_tokenizer, random_ids

from engine import EngineConfig, KVBoost
from engine.keys import chain_key, content_key
from engine.kv.disk import DiskTier
from engine.kv.disk_rows import entry_fields
from engine.kv.payload_file import ALIGN, MAGIC, PayloadError, _checksum, decode_bytes, encode_file
from engine.kv.records import ChunkRecord, kv_nbytes
from engine.kv.tiers import decode_kv, encode_kv

CPU = torch.device("cpu")
NAMESPACE = "tiny-ns"
ROOT = b"r" * 16
TOKENS = tuple(range(100, 148))
KEY = chain_key(ROOT, TOKENS)
# 2 layers, k and v each [1, 2, 48, 32] float32: 12 KB a tensor, 48 KB of data in a "none" payload
KV = tuple((torch.randn(1, 2, len(TOKENS), 32, generator=torch.Generator().manual_seed(2 * i)),
            torch.randn(1, 2, len(TOKENS), 32, generator=torch.Generator().manual_seed(2 * i + 1)))
           for i in range(2))
QUANTS = ("none", "int8", "int4")


def record() -> ChunkRecord:
    return ChunkRecord(KEY, ROOT, content_key(ROOT.hex(), TOKENS), "chunk", 0, TOKENS, kv_nbytes(KV))


# The file the tier writes for each quant (its length and layout are fixed by the header's content).
FILES = {quant: encode_file(encode_kv(KV, quant, CPU), NAMESPACE, KEY, entry_fields(record(), False))
         for quant in QUANTS}


def layout(blob: bytes) -> tuple[int, int]:
    """(end of the header JSON, start of the data) of a payload file: between them, padding."""
    (head_len,) = struct.unpack_from("<I", blob, len(MAGIC))
    end = len(MAGIC) + 4 + 16 + head_len
    return end, end + (-end % ALIGN)


def data_start(blob: bytes) -> int:
    return layout(blob)[1]


def as_bytes(kv) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for layer in kv for t in layer]


def store_damage_load(folder: Path, quant: str, offset: int, xor: int):
    """Stores the KV through the disk tier, changes the byte at `offset` of its payload file, reads it back
    through the tier. Returns (what the tier served or None, the tier)."""
    disk = DiskTier(folder, 1 << 30, quant, namespace=NAMESPACE)
    assert disk.put(record(), encode_kv(KV, quant, CPU)) == []
    (path,) = (folder / "payloads").rglob("*.kv")
    blob = bytearray(path.read_bytes())
    assert bytes(blob) == FILES[quant]
    blob[offset] ^= xor
    path.write_bytes(bytes(blob))
    return disk.load(KEY, record()), disk


def assert_miss_or_the_stored_bytes(served, disk, quant: str, offset: int):
    if served is None:
        assert disk.counters.bad == 1 and disk.counters.reads == 0
        assert not list((disk.folder / "payloads").rglob("*.kv")), "a corrupt payload was left in the folder"
        return
    # only the padding between the header and the data lies outside the checksum: it holds no value
    head_end, start = layout(FILES[quant])
    assert head_end <= offset < start, f"a byte changed at {offset} of {len(FILES[quant])} was served"
    assert as_bytes(decode_kv(served, CPU)) == as_bytes(decode_kv(encode_kv(KV, quant, CPU), CPU))


def test_the_payloads_are_large_enough_to_catch_a_checksum_over_their_start_only():
    data_bytes = {quant: len(blob) - data_start(blob) for quant, blob in FILES.items()}
    assert data_bytes["none"] > 12 * 4096 - 4096 and min(data_bytes.values()) > 3 * 4096 - 1024


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("where", ["first byte", "checksum", "header", "first data byte", "past 4 KB",
                                   "past 8 KB", "middle", "last 64 bytes", "last byte"])
def test_a_byte_changed_at_any_place_of_the_file_is_a_miss(tmp_path, quant, where):
    blob = FILES[quant]
    start = data_start(blob)
    offset = {"first byte": 0, "checksum": len(MAGIC) + 4 + 3, "header": len(MAGIC) + 4 + 16 + 5,
              "first data byte": start, "past 4 KB": 4096 + 7, "past 8 KB": 8192 + 1,
              "middle": len(blob) // 2, "last 64 bytes": len(blob) - 40, "last byte": len(blob) - 1}[where]
    served, disk = store_damage_load(tmp_path / "kv", quant, offset, 0x40)
    assert served is None, f"a payload changed at byte {offset} of {len(blob)} was served"
    assert disk.counters.bad == 1


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(QUANTS), st.data(), st.integers(1, 255))
def test_one_byte_changed_anywhere_in_the_file_is_a_miss_or_the_stored_bytes(quant, data, xor):
    offset = data.draw(st.integers(0, len(FILES[quant]) - 1), label="offset")
    with tempfile.TemporaryDirectory() as folder:
        served, disk = store_damage_load(Path(folder) / "kv", quant, offset, xor)
        try:
            assert_miss_or_the_stored_bytes(served, disk, quant, offset)
        finally:
            disk.close()


# -- through the engine: a damaged chunk is computed again, and the answer is the answer of a cold prefill -----
DOC = random_ids(6 * CHUNK + 5, seed=61)
QUESTION = random_ids(5, seed=62)
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(one_thread):
    return build_model("llama"), build_tokenizer()


def engine_on(tiny, folder) -> KVBoost:
    model, tokenizer = tiny
    config = EngineConfig.of(chunk_size=CHUNK, cpu_cache_bytes=0, disk_cache_dir=str(folder), disk_cache_bytes=1 << 30)
    return KVBoost(model, tokenizer, config, name="tiny-llama")


def test_chunks_damaged_past_their_first_4_kb_are_computed_again_and_the_answer_is_unchanged(tiny, tmp_path):
    model, tokenizer = tiny
    cold = KVBoost(model, tokenizer, EngineConfig.of(reuse="off"), name="tiny-llama")
    expected = cold.generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS).token_ids
    folder = tmp_path / "kv"
    engine_on(tiny, folder).generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    intact = engine_on(tiny, folder).generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    assert intact.stats.reused_by_tier.get("disk", 0) >= 6 * CHUNK  # the files are served while intact
    files = sorted((folder / "payloads").rglob("*.kv"))
    assert len(files) >= 6
    for path in files:
        blob = bytearray(path.read_bytes())
        assert len(blob) > 4096 + 1024
        blob[-1] ^= 0x7F  # the sign and exponent byte of the last value of the last layer's v: a huge value
        path.write_bytes(bytes(blob))
    damaged = engine_on(tiny, folder).generate(DOC + QUESTION, max_new_tokens=NEW_TOKENS)
    assert damaged.stats.reused_by_tier.get("disk", 0) == 0
    assert damaged.token_ids == expected


# -- forged files: the checksum recomputed by whoever changed them ----------------------------------------------
def forge(blob: bytes, header_change=None, append: bytes = b"") -> bytes:
    """`blob` with its header JSON changed by `header_change(header)` and `append` after its data, the checksum
    recomputed over the result (what a careful vandal, or another program's bug, could write)."""
    head_end, start = layout(blob)
    head_start = len(MAGIC) + 4 + 16
    header = json.loads(blob[head_start:head_end])
    if header_change is not None:
        header_change(header)
    data = blob[start:] + append
    head = json.dumps(header, separators=(",", ":")).encode()
    prefix = MAGIC + struct.pack("<I", len(head)) + _checksum(head, data) + head
    return prefix + b"\0" * (-len(prefix) % ALIGN) + data


def replace_payload(folder: Path, quant: str, blob: bytes):
    disk = DiskTier(folder, 1 << 30, quant, namespace=NAMESPACE)
    assert disk.put(record(), encode_kv(KV, quant, CPU)) == []
    (path,) = (folder / "payloads").rglob("*.kv")
    path.write_bytes(blob)
    return disk


def test_a_forged_file_claiming_other_tokens_under_the_right_key_is_a_miss(tmp_path):
    """The header says what the payload is the KV of; the tier checks it against the row's record on every read."""

    def other_tokens(header):
        header["entry"]["tokens"][0] += 1

    disk = replace_payload(tmp_path / "kv", "none", forge(FILES["none"], other_tokens))
    assert disk.load(KEY, record()) is None and disk.counters.bad == 1


def test_a_forged_file_longer_than_its_header_says_is_refused(tmp_path):
    """A payload must be exactly the size its header gives, checksum or not: the disk tier also bounds a read by its
    row's size, the remote tier's values (engine.kv.remote_tier) only by what decode_bytes checks."""
    longer = forge(FILES["none"], append=b"\0" * 64)
    with pytest.raises(PayloadError, match="header says"):
        decode_bytes(torch.frombuffer(bytearray(longer), dtype=torch.uint8), NAMESPACE, KEY)
    disk = replace_payload(tmp_path / "kv", "none", longer)
    assert disk.load(KEY, record()) is None and disk.counters.bad == 1
    intact = forge(FILES["none"])  # the forger's own check: the same file, rewritten, still reads
    assert decode_bytes(torch.frombuffer(bytearray(intact), dtype=torch.uint8), NAMESPACE, KEY).num_tokens == 48

"""KV tiers without a model: payload encoding per kv_quant, the device -> host -> disk cascade, promotion,
entries in use, and the disk tier's files and index under injected faults."""

from __future__ import annotations

import os

import pytest
import torch

from engine.keys import chain_key
from engine.kv.disk import DiskTier
from engine.kv.eviction import LRU
from engine.kv.payload_file import PayloadError, decode_file, encode_file
from engine.kv.records import kv_nbytes
from engine.kv.store import ChunkStore
from engine.kv.tiers import MemoryTier, decode_kv, encode_kv

LAYERS, HEADS, TOKENS, DIM = 3, 3, 128, 64  # SmolLM2-135M's KV head shape, fewer layers
ROOT = b"root".ljust(16, b".")
# What a payload file says it holds (its header carries the entry's tokens): the largest one these tests write.
ENTRY = {"kind": "chunk", "parent": ROOT.hex(), "start": 0, "tokens": list(range(1000, 1000 + TOKENS)),
         "exact": True, "lossy": True}


def make_kv(seed: int, tokens: int = TOKENS, dim: int = DIM, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(1, HEADS, tokens, dim, generator=g, dtype=torch.float64).to(dtype) * 2,
                  torch.randn(1, HEADS, tokens, dim, generator=g, dtype=torch.float64).to(dtype))
                 for _ in range(LAYERS))


def fp16_bytes(kv) -> int:
    return sum(2 * (k.numel() + v.numel()) for k, v in kv)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("quant, min_ratio", [("int8", 1.9), ("int4", 3.5)])
def test_quantized_payload_is_smaller_than_fp16_by_the_target(quant, min_ratio, dim):
    kv = make_kv(0, dim=dim)
    stored = encode_kv(kv, quant, torch.device("cpu"))
    assert fp16_bytes(kv) / stored.nbytes >= min_ratio


@pytest.mark.parametrize("quant, bound", [("int8", 1 / 255), ("int4", 1 / 15)])
def test_quantized_payload_error_is_within_half_a_step(quant, bound):
    kv = make_kv(1)
    back = decode_kv(encode_kv(kv, quant, torch.device("cpu")), torch.device("cpu"))
    for (k, v), (k2, v2) in zip(kv, back):
        assert k2.dtype == k.dtype and k2.shape == k.shape
        # keys: per channel over the chunk's tokens; values: per token over the head dim
        k_step = (k.amax(dim=2, keepdim=True) - k.amin(dim=2, keepdim=True)) * bound
        v_step = (v.amax(dim=3, keepdim=True) - v.amin(dim=3, keepdim=True)) * bound
        assert ((k2 - k).abs() <= k_step / 2 * 1.01 + 1e-6).all()
        assert ((v2 - v).abs() <= v_step / 2 * 1.01 + 1e-6).all()


def test_unquantized_payload_round_trips_bit_exact_through_a_file(tmp_path):
    kv = make_kv(2)
    disk = DiskTier(tmp_path, 1 << 30, "none", namespace="ns")
    store = ChunkStore(0, LRU(), disk=disk)  # no room in memory: the entry lives on disk only
    assert store.put_chunk(b"k" * 16, b"p" * 16, b"c" * 16, 0, range(TOKENS), kv)
    record = store.records[b"k" * 16]
    assert record.tier == "disk" and record.on_disk
    back = decode_kv(disk.load(record.key), torch.device("cpu"))
    for (k, v), (k2, v2) in zip(kv, back):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def tiered_store(tmp_path, entries_device=2, entries_host=2, disk_entries=None, quant="int8"):
    """A store whose device tier holds `entries_device` unquantized entries and host `entries_host` int8 ones."""
    size = kv_nbytes(make_kv(0))
    host_size = encode_kv(make_kv(0), quant, torch.device("cpu")).nbytes
    host = MemoryTier("host", entries_host * host_size, torch.device("cpu"), quant)
    disk = None
    if disk_entries is not None:
        file_size = len(encode_file(encode_kv(make_kv(0), quant, torch.device("cpu")), "ns", b"x" * 16, ENTRY))
        disk = DiskTier(tmp_path / "disk", disk_entries * file_size, quant, namespace="ns", policy=LRU())
    return ChunkStore(entries_device * size, LRU(), host=host, disk=disk)


def put(store, name: bytes, seed: int):
    """Stores chunk `name` (tokens seed..seed+TOKENS) under its real chained key; returns the key."""
    tokens = range(seed, seed + TOKENS)
    key = chain_key(ROOT, tokens)
    assert store.put_chunk(key, ROOT, name.ljust(16, b"."), 0, tokens, make_kv(seed))
    return key


def test_entries_demote_device_to_host_to_disk_in_lru_order(tmp_path):
    store = tiered_store(tmp_path, disk_entries=10)
    keys = [put(store, bytes([65 + i]), i) for i in range(6)]
    tiers = [store.records[k].tier for k in keys]
    assert tiers == ["disk", "disk", "host", "host", "device", "device"]
    assert all(store.records[k].on_disk for k in keys)  # written through at insertion
    assert store.device_tier.num_bytes <= store.device_tier.budget_bytes
    assert store.host_tier.num_bytes <= store.host_tier.budget_bytes
    assert store.counters.demoted == 4 + 2  # 4 left the device, 2 of those left the host


def test_without_disk_entries_past_the_host_budget_are_gone(tmp_path):
    store = tiered_store(tmp_path)
    keys = [put(store, bytes([65 + i]), i) for i in range(5)]
    assert keys[0] not in store.records
    assert [store.records[k].tier for k in keys[1:]] == ["host", "host", "device", "device"]
    assert store.counters.evicted == 1


def test_a_hit_on_a_host_entry_promotes_it_to_the_device(tmp_path):
    store = tiered_store(tmp_path)
    keys = [put(store, bytes([65 + i]), i) for i in range(4)]
    record = store.records[keys[0]]
    assert record.tier == "host"
    store.acquire(record)
    assert store.fetch(record)
    assert record.tier == "device"
    # the least recently used device entry made room by going down to the host
    assert store.records[keys[2]].tier == "host"
    payload = store.payload(record.key)
    for (k, v), (k2, v2) in zip(make_kv(0), payload):
        assert (k - k2).abs().max() < 0.05 and (v - v2).abs().max() < 0.05
    store.release(record)


def test_a_hit_on_a_disk_entry_is_served_from_the_file_and_promoted(tmp_path):
    store = tiered_store(tmp_path, disk_entries=10)
    keys = [put(store, bytes([65 + i]), i) for i in range(6)]
    record = store.records[keys[0]]
    assert record.tier == "disk"
    store.acquire(record)
    assert store.fetch(record)
    assert record.tier == "device" and store.counters.promoted == 1
    assert store.disk.counters.reads == 1
    store.release(record)


def test_entries_in_use_never_leave_and_a_full_device_serves_a_staged_copy(tmp_path):
    store = tiered_store(tmp_path, disk_entries=10)
    keys = [put(store, bytes([65 + i]), i) for i in range(6)]
    device_keys = [k for k in keys if store.records[k].tier == "device"]
    for k in device_keys:
        store.acquire(store.records[k])
    disk_record = store.records[keys[0]]
    store.acquire(disk_record)
    assert store.fetch(disk_record)
    # both device entries are in use: the disk entry is served without taking their place
    assert [store.records[k].tier for k in device_keys] == ["device", "device"]
    assert disk_record.tier == "disk"
    assert len(store.payload(disk_record.key)) == LAYERS
    put(store, b"Z", 50)  # the new entry cannot go to the device either
    assert [store.records[k].tier for k in device_keys] == ["device", "device"]
    for k in device_keys + [disk_record.key]:
        store.release(store.records[k])
    assert disk_record.key not in store._staged


def test_nothing_fits_means_rejected_and_no_files_left(tmp_path):
    disk = DiskTier(tmp_path, 1000, "int8", namespace="ns")
    store = ChunkStore(0, LRU(), disk=disk)
    assert not store.put_chunk(b"k" * 16, b"p" * 16, b"c" * 16, 0, range(TOKENS), make_kv(0))
    assert store.counters.rejected == 1 and not store.records
    assert not list((tmp_path / "payloads").rglob("*.kv")) and not list((tmp_path / "tmp").iterdir())


def test_disk_budget_evicts_by_policy_and_never_overshoots(tmp_path):
    store = tiered_store(tmp_path, entries_device=0, entries_host=0, disk_entries=3)
    keys = [put(store, bytes([65 + i]), i) for i in range(3)]
    store.touch_disk([store.records[keys[0]]])  # A is now the most recently used on disk
    put(store, b"D", 3)
    assert keys[1] not in store.records  # B was the least recently used
    assert keys[0] in store.records and keys[2] in store.records
    assert store.disk.num_bytes() <= store.disk.budget_bytes
    files = list((tmp_path / "disk" / "payloads").rglob("*.kv"))
    assert len(files) == 3


@pytest.mark.parametrize("fault", ["truncate", "flip_byte", "flip_header_byte", "delete", "empty", "swap_namespace"])
def test_a_damaged_file_is_a_miss_and_its_row_is_dropped(tmp_path, fault):
    disk = DiskTier(tmp_path, 1 << 30, "int8", namespace="ns")
    store = ChunkStore(0, LRU(), disk=disk)
    key = put(store, b"A", 0)
    (path,) = list((tmp_path / "payloads").rglob("*.kv"))
    data = path.read_bytes()
    if fault == "truncate":
        path.write_bytes(data[: len(data) - 100])
    elif fault == "flip_byte":
        path.write_bytes(data[:-50] + bytes([data[-50] ^ 0x01]) + data[-49:])
    elif fault == "flip_header_byte":  # a digit of a shape or offset in the JSON header
        at = data.index(b'"shape":[') + len(b'"shape":[')
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
    elif fault == "delete":
        path.unlink()
    elif fault == "empty":
        path.write_bytes(b"")
    else:  # a file of another model under this entry's name
        other = DiskTier(tmp_path / "other", 1 << 30, "int8", namespace="other-model")
        ChunkStore(0, LRU(), disk=other).put_chunk(key, ROOT, b"A".ljust(16, b"."), 0, range(TOKENS), make_kv(0))
        (other_path,) = list((tmp_path / "other" / "payloads").rglob("*.kv"))
        path.write_bytes(other_path.read_bytes())
    record = store.records[key]
    store.acquire(record)
    assert not store.fetch(record)
    store.release(record)
    store.drop(record)
    assert key not in store.records
    assert disk.counters.bad == 1
    assert disk.rows_since(0) == []  # the row is gone: no later process trusts it either
    assert disk.load(key) is None


def test_entries_of_another_namespace_are_never_loaded(tmp_path):
    writer = ChunkStore(0, LRU(), disk=DiskTier(tmp_path, 1 << 30, "int8", namespace="model-a"))
    key = put(writer, b"A", 0)
    reader = ChunkStore(0, LRU(), disk=DiskTier(tmp_path, 1 << 30, "int8", namespace="model-b"))
    assert key not in reader.records
    assert reader.disk.load(key) is None
    (path,) = list((tmp_path / "payloads").rglob("*.kv"))
    with pytest.raises(PayloadError, match="another model"):
        decode_file(path, "model-b", key)


def test_a_second_store_on_the_folder_sees_new_entries_at_sync(tmp_path):
    a = ChunkStore(0, LRU(), disk=DiskTier(tmp_path, 1 << 30, "int8", namespace="ns"))
    b = ChunkStore(0, LRU(), disk=DiskTier(tmp_path, 1 << 30, "int8", namespace="ns"))
    key = put(a, b"A", 0)
    assert key not in b.records
    assert b.sync_disk() == 1
    record = b.records[key]
    assert record.tier == "disk" and record.tokens == tuple(range(TOKENS))
    assert b.get_chunk(key) is record and b.chunks_with_content(b"A".ljust(16, b".")) == [record]


def test_verify_reports_and_removes_bad_entries_and_orphans(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30, "int8", namespace="ns")
    store = ChunkStore(0, LRU(), disk=disk)
    put(store, b"A", 0)
    put(store, b"B", 1)
    path = sorted((tmp_path / "payloads").rglob("*.kv"))[0]
    path.write_bytes(path.read_bytes()[:-10])
    orphan_name = "payloads/ab/" + "ab" * 16 + "-0badf00d.kv"  # a name the tier writes, no row for it
    orphan = tmp_path / orphan_name
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"debris of a crash")
    os.utime(orphan, (0, 0))
    dry = disk.verify(repair=False)
    assert dry["checked"] == 2 and len(dry["bad"]) == 1 and dry["orphans_removed"] == []
    report = disk.verify()
    assert len(report["bad"]) == 1 and report["orphans_removed"] == [orphan_name]
    assert disk.verify() == {"checked": 1, "bad": [], "orphans_removed": []}


def test_clear_empties_the_folder(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30, "int8", namespace="ns")
    store = ChunkStore(0, LRU(), disk=disk)
    put(store, b"A", 0)
    assert disk.clear() == 1
    assert disk.num_bytes() == 0 and not list((tmp_path / "payloads").rglob("*.kv"))


def test_an_unwritable_folder_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="cannot be created"):
        DiskTier(blocker / "kv", 1 << 20, "int8", namespace="ns")


def test_cache_command_reports_verifies_and_clears_a_folder(tmp_path, capsys):
    from cli.kvboost import main

    disk = DiskTier(tmp_path, 1 << 30, "int8", namespace="ns", model_name="tiny")
    disk.describe_namespace({"chunk_size": 128, "kv_quant": "int8"})
    store = ChunkStore(0, LRU(), disk=disk)
    put(store, b"A", 0)
    put(store, b"B", 1)
    assert main(["cache", "stats", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and "tiny [chunk_size=128, kv_quant=int8]" in out and f"{2 * TOKENS} tokens" in out

    path = sorted((tmp_path / "payloads").rglob("*.kv"))[0]
    path.write_bytes(path.read_bytes()[:-1])
    assert main(["cache", "verify", "--dir", str(tmp_path), "--dry-run"]) == 1
    assert "1 bad (found)" in capsys.readouterr().out
    assert main(["cache", "verify", "--dir", str(tmp_path)]) == 0
    assert "1 bad (removed)" in capsys.readouterr().out
    assert main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert main(["cache", "stats", "--dir", str(tmp_path), "--json"]) == 0
    assert '"entries": 0' in capsys.readouterr().out


def test_cache_stats_reads_a_folder_without_importing_torch(tmp_path):
    import subprocess
    import sys

    from processes import NO_TORCH, child_env

    disk = DiskTier(tmp_path, 1 << 30, "int8", namespace="ns", model_name="tiny")
    disk.describe_namespace({"chunk_size": 128, "kv_quant": "int8"})
    put(ChunkStore(0, LRU(), disk=disk), b"A", 0)
    disk.close()

    def stats(folder):
        done = subprocess.run([sys.executable, "-c", NO_TORCH, "cache", "stats", "--dir", str(folder)],
                              capture_output=True, text=True, timeout=120, env=child_env())
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = stats(tmp_path)
    assert "1 entries" in out and "tiny [chunk_size=128, kv_quant=int8]" in out and f"{TOKENS} tokens" in out
    assert "torch imported: False" in out
    out = stats(tmp_path / "nothing")
    assert "no disk KV cache" in out and "torch imported: False" in out
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "index.sqlite3").write_bytes(b"not a database" * 100)
    done = subprocess.run([sys.executable, "-c", NO_TORCH, "cache", "stats", "--dir", str(damaged)],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 1 and "cannot be read" in done.stderr and "Traceback" not in done.stderr


def test_cache_command_on_a_folder_without_a_cache(tmp_path, capsys):
    from cli.kvboost import main

    assert main(["cache", "stats", "--dir", str(tmp_path / "nothing")]) == 0
    assert "no disk KV cache" in capsys.readouterr().out


def test_a_broken_folder_degrades_to_memory_only_without_errors(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30, "int8", namespace="ns")
    store = ChunkStore(kv_nbytes(make_kv(0)) * 4, LRU(), disk=disk)
    put(store, b"A", 0)
    (tmp_path / "payloads").rename(tmp_path / "moved")
    (tmp_path / "payloads").write_text("a file where the folder was")
    key = put(store, b"B", 1)  # the write fails; the entry still serves from memory
    record = store.records[key]
    assert record.tier == "device" and not record.on_disk
    store.acquire(record)
    assert store.fetch(record) and len(store.payload(key)) == LAYERS
    store.release(record)
    disk.db.conn.close()  # the index goes away under the store
    assert store.sync_disk() == 0 and disk.counters.errors >= 1
    assert put(store, b"C", 2) in store.records

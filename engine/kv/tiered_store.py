"""The chunk store an engine runs with, built from its TierConfig: the device tier, host RAM and the disk
tier, each budget from the config or, where not given, from the machine (the memory tiers' RAM:
engine.ram_budget.default_ram_budget), each memory tier knowing which; the disk namespace its entries share;
the remote tier (Redis/Valkey) when the config names one, with its own namespace. Payloads read back from disk or
from the remote store are checked against the model's KV layout (engine.kv.tiers.KVLayout); the remote tier refuses,
unread, values longer than one chunk's KV and its header can be (remote_max_value_bytes to override).
"""

from __future__ import annotations

import logging
import sqlite3

import torch

from ..config import ChunkingConfig, ReuseConfig, TierConfig
from ..keys import chain_key
from ..ram_budget import machine_ram_budget
from .disk import DiskTier, default_cache_dir
from .eviction import POLICIES
from .payload_file import FORMAT_VERSION, max_file_bytes
from .remote_tier import DEFAULT_MAX_VALUE_BYTES, RemoteTier, remote_namespace
from .store import ChunkStore
from .tiers import KVLayout, MemoryTier, default_device_budget, default_host_budget

log = logging.getLogger(__name__)


def build_store(tiers: TierConfig, reuse: ReuseConfig, device: torch.device, root: bytes, model_name: str,
                model) -> tuple[ChunkStore, str | None]:
    """The store for `model` as `tiers` says, and why its disk tier is off when it could not be opened (None
    otherwise): the engine still works from memory then. `reuse`: with mode "off" nothing persistent is opened,
    and its chunking describes the disk and shared namespaces."""
    dtype = model.dtype
    try:
        layout = KVLayout.of_model(model)
    except (AttributeError, TypeError, ZeroDivisionError) as exc:  # learnt from the first KV computed instead
        log.warning("the KV layout of %s is not in its config (%s); payloads are checked once one is computed",
                    model_name, exc)
        layout = None
    chunking = reuse.chunking
    policy = POLICIES[tiers.eviction]()
    # The RAM budget is read once, as the engine starts: what is free then is what the user's other programs left.
    ram = machine_ram_budget() if None in (tiers.cache_bytes, tiers.cpu_cache_bytes) else None
    budget, budget_rule = ((tiers.cache_bytes, "set by cache_bytes") if tiers.cache_bytes is not None
                           else default_device_budget(device, ram))
    host = None
    host_budget, host_rule = ((tiers.cpu_cache_bytes, "set by cpu_cache_bytes") if tiers.cpu_cache_bytes is not None
                              else default_host_budget(device, ram))
    if host_budget > 0:
        host = MemoryTier("host", host_budget, torch.device("cpu"), tiers.kv_quant.host, pin=device.type == "cuda",
                          budget_rule=host_rule)
    disk, disk_error = None, None
    if tiers.disk_cache_bytes != 0 and reuse.mode != "off":
        folder = tiers.disk_cache_dir or str(default_cache_dir())
        # Entries are shared only within one namespace: same weights, dtype, chunking and storage format.
        namespace = chain_key(root, [FORMAT_VERSION]).hex() + f"-{tiers.kv_quant.disk}"
        try:
            disk = DiskTier(folder, tiers.disk_cache_bytes, tiers.kv_quant.disk, namespace, policy,
                            model_name=model_name, timeout_s=tiers.disk_busy_timeout_s)
            disk.describe_namespace({"chunking": chunking.mode, "chunk_size": chunking.size,
                                     "kv_quant": tiers.kv_quant.disk, "dtype": str(dtype)})
        except (ValueError, OSError, sqlite3.Error) as exc:
            disk_error = f"disk KV tier off: {exc}"
            log.warning(disk_error)
            disk = None
    remote = None
    if tiers.remote_cache is not None and reuse.mode != "off":
        # The disk tier's storage format: what a machine restores from the store is what it would have on disk.
        quant = tiers.kv_quant.disk
        remote = RemoteTier(tiers.remote_cache, remote_namespace(root, quant, device.type, dtype), quant,
                            layout=layout, max_value_bytes=_max_value_bytes(tiers, chunking, layout, quant),
                            timeout_s=tiers.remote_timeout_s, max_wait_s=tiers.remote_max_wait_s,
                            retry_s=tiers.remote_retry_s,
                            describe={"model": model_name, "chunking": chunking.mode,
                                      "chunk_size": chunking.size, "kv_quant": quant,
                                      "device": device.type, "dtype": str(dtype)})
    store = ChunkStore(budget, policy, device=device, device_quant=tiers.kv_quant.device, host=host, disk=disk,
                       remote=remote, layout=layout, budget_rule=budget_rule)
    return store, disk_error


def _max_value_bytes(tiers: TierConfig, chunking: ChunkingConfig, layout: KVLayout | None, quant: str) -> int:
    """remote_max_value_bytes, or the most bytes one chunk's payload can take: its longest chunk's KV as `quant`
    stores it, with the header."""
    if tiers.remote_max_value_bytes is not None:
        return tiers.remote_max_value_bytes
    if layout is None:
        return DEFAULT_MAX_VALUE_BYTES
    tokens = chunking.size + (chunking.window if chunking.mode == "adaptive" else 0)
    num_tensors = layout.num_layers * (2 if quant == "none" else 6)
    return max_file_bytes(layout.payload_bytes(quant, tokens), num_tensors, tokens)

"""What a shared Redis/Valkey KV store holds, for `kvboost cache stats --remote-cache URL` (no model loaded).

Counts keys per namespace with SCAN (incremental: the store keeps serving while it runs) and their bytes with
STRLEN in pipelined batches; names each namespace by what its engines wrote into kvboost:namespaces. Meant for
an operator's occasional look, so its timeouts are seconds, not the engine's tens of milliseconds.
"""

from __future__ import annotations

import json

import redis

from .remote_tier import KEY_PREFIX, NAMESPACES_KEY, check_url, shown_url

BATCH = 500


def report(url: str, timeout_s: float = 5.0) -> dict:
    """The store's entries, bytes and memory settings, and per namespace its model, settings and entries."""
    client = redis.Redis.from_url(check_url(url), socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        described = {_text(ns): _settings(raw) for ns, raw in client.hgetall(NAMESPACES_KEY).items()}
        counts: dict[str, list[int]] = {}
        batch: list[bytes] = []
        for key in client.scan_iter(match=f"{KEY_PREFIX}:*", count=BATCH):
            if key != NAMESPACES_KEY.encode():
                batch.append(key)
            if len(batch) >= BATCH:
                _count(client, batch, counts)
                batch = []
        _count(client, batch, counts)
        memory = client.info("memory")
        stats = client.info("stats")
    finally:
        client.close()
    namespaces = []
    for ns in sorted(set(counts) | set(described)):
        entries, num_bytes = counts.get(ns, [0, 0])
        settings = dict(described.get(ns, {}))
        namespaces.append({"namespace": ns, "model": settings.pop("model", "?"), "settings": settings,
                           "entries": entries, "bytes": num_bytes})
    return {"url": shown_url(url), "entries": sum(n["entries"] for n in namespaces),
            "bytes": sum(n["bytes"] for n in namespaces), "used_memory": memory.get("used_memory"),
            "maxmemory": memory.get("maxmemory"), "maxmemory_policy": memory.get("maxmemory_policy"),
            "evicted_keys": stats.get("evicted_keys"), "namespaces": namespaces}


def _count(client, keys: list[bytes], counts: dict[str, list[int]]) -> None:
    if not keys:
        return
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
    for key, size in zip(keys, pipe.execute()):
        parts = key.split(b":")
        if len(parts) != 3:
            continue
        tally = counts.setdefault(_text(parts[1]), [0, 0])
        tally[0] += 1
        tally[1] += int(size)


def _text(raw) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def _settings(raw) -> dict:
    try:
        value = json.loads(raw)
    except (ValueError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}

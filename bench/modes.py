"""Benchmark mode names: a reuse mode, "approx:REPAIR[@VALUE]", or the peer library."""

from __future__ import annotations

from engine.config import REPAIR_MODES, REUSE_MODES

REPAIR_PARAM = {"selective": "selective_tokens", "cacheblend": "blend_ratio"}


PEER = "peer"  # the PyPI `kvboost` library as a peer row (bench.peer), when it is installed


def mode_options(mode: str) -> dict:
    """Engine options of a mode name: a reuse mode ("off", "prefix", "chunk", "approx"), or
    "approx:REPAIR" with REPAIR none | selective | cacheblend, optionally "@VALUE" (selective: tokens
    recomputed after each seam, or "A/B": A after and B before it; cacheblend: share of reused tokens recomputed, then
    "+N" to also recompute the
    N tokens after each seam), e.g. "approx:cacheblend@0.3" or "approx:cacheblend@0.15+16"."""
    if mode == PEER:
        return {}
    reuse, _, repair = mode.partition(":")
    if reuse not in REUSE_MODES or (repair and reuse != "approx"):
        raise ValueError(f"unknown mode {mode!r}: use {', '.join(REUSE_MODES)} or approx:none|selective|cacheblend")
    if not repair:
        return {"reuse": reuse}
    repair, _, value = repair.partition("@")
    value, _, seam = value.partition("+")
    if repair not in REPAIR_MODES or (value and repair == "none") \
            or (seam and repair != "cacheblend"):
        raise ValueError(f"unknown repair in mode {mode!r}")
    options = {"reuse": reuse, "repair": repair}
    try:
        if value and repair == "selective":
            after, _, before = value.partition("/")
            options["selective_tokens"] = int(after)
            if before:
                options["selective_before"] = int(before)
        elif value:
            options[REPAIR_PARAM[repair]] = float(value)
        if seam:
            options["blend_seam_tokens"] = int(seam)
    except ValueError:
        raise ValueError(f"bad repair value in mode {mode!r}") from None
    return options


def engine_for(engine, mode: str):
    if mode == PEER:
        from .peer import PeerBenchEngine

        return PeerBenchEngine(engine)
    return engine.with_options(**mode_options(mode))

"""Benchmark mode names: a reuse mode, "approx:REPAIR[@VALUE]", or the peer library."""

from __future__ import annotations

import re

from engine.config import REPAIR_MODES, REUSE_MODES

REPAIR_PARAM = {"selective": "selective_tokens", "cacheblend": "blend_ratio"}


PEER = "peer"  # the PyPI `kvboost` library as a peer row (bench.peer), when it is installed


def mode_options(mode: str) -> dict:
    """Engine options of a mode name: a reuse mode ("off", "prefix", "chunk", "approx"), or
    "approx:REPAIR" with REPAIR none | selective | cacheblend, optionally "@VALUE" (selective: tokens
    recomputed after each seam, or "A/B": A after and B before it; cacheblend: share of reused tokens recomputed, then
    "+N" to also recompute the
    N tokens after each seam, "~random" to draw them at random instead of by deviation, "^L" for probe layer L),
    e.g. "approx:cacheblend@0.3", "approx:cacheblend@0.15+16" or "approx:cacheblend@0.05~random^4"."""
    if mode == PEER:
        return {}
    reuse, _, repair = mode.partition(":")
    if reuse not in REUSE_MODES or (repair and reuse != "approx"):
        raise ValueError(f"unknown mode {mode!r}: use {', '.join(REUSE_MODES)} or approx:none|selective|cacheblend")
    if not repair:
        return {"reuse": reuse}
    repair, _, value = repair.partition("@")
    marks = dict(re.findall(r"([+~^])([^+~^]*)", value))  # the suffixes, in any order
    value = re.split(r"[+~^]", value, maxsplit=1)[0]
    seam, select, probe = marks.get("+", ""), marks.get("~", ""), marks.get("^", "")
    if repair not in REPAIR_MODES or (value and repair == "none") \
            or ((seam or select or probe) and repair != "cacheblend"):
        raise ValueError(f"unknown repair in mode {mode!r}")
    options = {"reuse": reuse, "repair": repair}
    if select:
        options["blend_select"] = select
    if probe:
        options["probe_layer"] = probe
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
        if probe:
            options["probe_layer"] = int(probe)
    except ValueError:
        raise ValueError(f"bad repair value in mode {mode!r}") from None
    return options


def engine_for(engine, mode: str):
    if mode == PEER:
        from .peer import PeerBenchEngine

        return PeerBenchEngine(engine)
    return engine.with_options(**mode_options(mode))

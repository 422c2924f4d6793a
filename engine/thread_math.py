"""Settling torch's CPU math on a thread before it computes a request (engine.engine calls it per request)."""

from __future__ import annotations

import threading

import torch

_thread_state = threading.local()


def settle_thread_math() -> None:
    """Runs torch's vectorized transcendental functions once on every worker of the calling thread's CPU thread
    team, the first time this thread computes a request. Measured with torch 2.13 on a loaded 2-core machine: a
    process's first forward, now and then, computed the rotary cosines 1.5e-4 off (its first vectorized cos()
    on fresh threads; the sines after it were right), so that process's first answer could differ from every
    later one. Settled first, every forward computes what the next one does."""
    if getattr(_thread_state, "settled", False):
        return
    x = torch.linspace(-4.0, 4.0, max(1, torch.get_num_threads()) * 65536)
    for op in (torch.cos, torch.sin, torch.exp, torch.tanh, torch.sigmoid, torch.rsqrt, torch.log1p):
        op(x)
    _thread_state.settled = True

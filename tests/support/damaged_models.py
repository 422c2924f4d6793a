"""A loaded model damaged in place, as a file overwritten there would be, and put back as it was."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def damaged_head(engine):
    """The model's output head with every byte of its weight blocks 0xFF, as a file overwritten there would be
    (each block's float16 scale then reads NaN), put back as it was on leaving."""
    blocks = engine.model.lm_head.blocks
    kept = blocks.clone()
    blocks.fill_(0xFF)
    try:
        yield
    finally:
        blocks.copy_(kept)

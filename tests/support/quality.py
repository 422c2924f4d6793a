"""How close a reused answer is to full prefill: the measures the real-model quality tests share."""

from __future__ import annotations

import torch


def common_prefix(a, b) -> int:
    """Number of leading tokens two answers share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def kl(reference_logits, logits) -> float:
    """KL(reference || logits) of two next-token distributions, in float64."""
    p, q = torch.log_softmax(reference_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum())

"""The next token from next-token logits: greedy, or drawn from the distribution the sampling settings define.

Everything here runs in numpy on the CPU, one thread, in float32 (the draw's running sums in float64), so that
the same seed gives the same token on every device and every thread count. Over a vocabulary (49152 tokens on
the embedded model) torch's CPU operations split the work between their OpenMP threads, which then spin waiting
for more while the block kernel's own threads need the cores; and a full sort plus torch.multinomial cost ~5 ms a
token, more than the decode step itself. Measured on the embedded model (2 cores), chat at temperature 0.2 and
top_p 0.9 (the app's defaults): 80-90 tokens/s with torch's sampling against ~200 greedy.

The distribution: the repetition penalty on the raw logits (positive logits of seen tokens divided by it,
negative ones multiplied), divided by the temperature, the top_k largest kept (ties with the k-th kept too),
then the nucleus: most probable first, every token whose predecessors' probability is still below top_p (so
the top token always stays); softmax over what is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .config import SamplingConfig

GREEDY_BELOW = 1e-30  # logits are tens at most: divided by 1e-30 they are still finite in float32
# The nucleus is sorted out of the tokens within these factors of the top token's probability, the first that
# holds top_p of the mass (every token left out is then past it); the whole vocabulary is sorted only when none
# does (a nearly flat distribution).
NUCLEUS_FLOORS = (1e-3, 1e-7)


def is_greedy(params: SamplingConfig) -> bool:
    return params.temperature < GREEDY_BELOW


def sample(logits: torch.Tensor, params: SamplingConfig, history: Sequence[int],
           generator: torch.Generator | None) -> int:
    """One token from next-token logits [V]. temperature 0 is greedy, and so is any temperature below
    GREEDY_BELOW (its limit; logits / temperature would overflow float32)."""
    if is_greedy(params):
        scores = _penalized(logits, params, history)
        return int(scores.argmax())  # the first largest, NaN as largest, as torch's argmax
    return draw(_probs(logits, params, history), generator)


def sampling_probs(logits: torch.Tensor, params: SamplingConfig, history: Sequence[int]) -> torch.Tensor:
    """The distribution [V] (float32, CPU) a sampled token is drawn from (the module's docstring). Not for greedy
    (temperature below GREEDY_BELOW). The caller's logits are left as they are."""
    return torch.from_numpy(_probs(logits, params, history))


def draw(weights: np.ndarray, generator: torch.Generator | None) -> int:
    """An index drawn with probability weights[i] / sum(weights) (weights [V] >= 0, some > 0): the first whose
    running sum (float64) passes a uniform draw from `generator` times the total. Indices of weight 0 are never
    drawn. ValueError when the weights are not a distribution (NaN, infinite, negative, all zero)."""
    support = np.flatnonzero(weights)
    if support.size == 0 or not np.isfinite(weights[support]).all() or (weights[support] < 0).any():
        raise ValueError("the sampling weights are not a distribution (all zero, negative, NaN or infinite)")
    running = np.cumsum(weights[support], dtype=np.float64)
    target = float(torch.rand((), dtype=torch.float64, generator=generator)) * running[-1]
    at = int(np.searchsorted(running, target, side="right"))
    return int(support[min(at, support.size - 1)])


def _penalized(logits: torch.Tensor, params: SamplingConfig, history: Sequence[int]) -> np.ndarray:
    """The logits as a float32 numpy array, the repetition penalty applied over `history` (in a copy: the
    caller's logits are left as they are). Read it, never write it: without a penalty it is the logits' memory."""
    scores = logits.detach().to("cpu", torch.float32).numpy()
    if params.repetition_penalty != 1.0 and len(history):
        scores = scores.copy()
        seen = np.fromiter(set(history), dtype=np.int64)
        old = scores[seen]
        scores[seen] = np.where(old > 0, old / np.float32(params.repetition_penalty),
                                old * np.float32(params.repetition_penalty))
    return scores


def _probs(logits: torch.Tensor, params: SamplingConfig, history: Sequence[int]) -> np.ndarray:
    scores = _penalized(logits, params, history) / np.float32(params.temperature)
    vocab = scores.size
    if 0 < params.top_k < vocab:
        kth = np.partition(scores, vocab - params.top_k)[vocab - params.top_k]
        scores[scores < kth] = -np.inf
    probs = _softmax(scores)
    if params.top_p < 1.0:
        kept = _nucleus(probs, params.top_p)
        scores_kept = scores[kept]
        scores = np.full_like(scores, -np.inf)
        scores[kept] = scores_kept
        probs = _softmax(scores)
    return probs


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum(dtype=np.float32)


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The indices of the nucleus: most probable first (ties by index), each token whose predecessors' sum is
    below top_p. Sorted among the candidates above a floor when those already hold top_p (every token below the
    floor has all of them before it, so it is out), else over the whole vocabulary."""
    top = probs.max()
    for floor in NUCLEUS_FLOORS:
        candidates = np.flatnonzero(probs >= top * np.float32(floor))
        if probs[candidates].sum(dtype=np.float64) >= top_p:
            break
    else:
        candidates = np.arange(probs.size)
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    ranked = probs[order].astype(np.float64)
    before = np.cumsum(ranked) - ranked
    keep = before < top_p
    keep[0] = True  # a top_p below what float rounding can tell from 0 still keeps the top token
    return order[keep]

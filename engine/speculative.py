"""Prompt-lookup speculative decoding: drafts from the text already in the context, checked by one forward.

Document answers quote their documents and chat answers repeat the conversation's names and phrases. When the
last few tokens generated also occur earlier in the context (the prompt, its documents, the answer so far), the
tokens that followed them there are a cheap guess of what comes next. One forward over [token, draft...]
computes the model's next-token logits after each drafted position; the longest prefix of the draft that the
model itself would have produced is kept, and the first token it would have produced instead comes for free.
A forward reads every weight once whatever the number of tokens, so a step that keeps k drafts costs about one
step and yields k + 1 tokens.

- `NgramIndex`: for each n-gram of the context (n = min_n..max_n), where it last occurred with a continuation;
  `draft` looks the current suffix up, longest n first.
- `verify`: which drafted tokens to keep. Greedy: those equal to the argmax (the output is the non-speculative
  greedy output). Sampling: the standard rule for a draft that is a single proposed token (a point mass q):
  keep d with probability p(d), else sample from the residual p without d, renormalised; this keeps the
  sampled distribution exactly p at every position (tests check it statistically).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .sampling import draw

MODES = ("prompt-lookup", "draft-model")  # the second: engine.draft_model
DEFAULT_NUM_DRAFT = 4
# Drafts come from matches of 3 to 5 tokens, the longest first. Matches of 2 tokens ("of the", ", and") came back
# often in free chat and were mostly rejected: 23% of chat drafts kept against 43% now, and each check of 5
# positions costs ~1.4-1.6x a one-token step on a CPU (python -m bench kernels). Measured in pairs on the same
# prompts (135M default, four drafts, two rounds of five prompts each): free chat 0.96x -> 1.00x, needle answers
# 1.33x -> 1.54x, quotes 1.35x -> 1.49x. Single tokens match by chance ("the", ","): never drafted from.
MAX_NGRAM = 5
MIN_NGRAM = 3


def draft_limit(num_draft: int, copying: bool) -> int:
    """How many tokens the next check may draft: `num_draft`, and half as many again while a copy is under way
    (`copying`: the last check kept every token it drafted, as when an answer quotes its document). Replayed over
    the greedy answers to `python -m bench speculative`'s prompts against the measured cost of a forward of n
    positions (bench step --positions at 1.4k tokens: 5 cost 1.47x one, 7 cost 1.78x), mean speedup over ten
    needle questions: 4 drafts always 2.22x, 6 always 2.31x (but the short answers lose: the first five
    questions' median 2.03x -> 1.79x), 4 then 6 while copying 2.34x (that median unchanged); eight quotes 2.22x,
    2.33x, 2.32x; free chat 1.04x, 1.03x, 1.04x."""
    return num_draft + num_draft // 2 if copying else num_draft


class NgramIndex:
    """Positions of n-grams in a growing token list: for each n in [min_n, max_n] and each n-gram, the start of
    its latest occurrence that has at least one token after it."""

    def __init__(self, ids: Sequence[int], max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM):
        self.max_n, self.min_n = max_n, min_n
        self.ids: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}
        for token in ids:
            self.append(token)

    def append(self, token: int) -> None:
        # The n-grams ending at the current last token get a continuation now: index them.
        end = len(self.ids)
        for n in range(self.min_n, self.max_n + 1):
            if end >= n:
                self._last[tuple(self.ids[end - n:end])] = end - n
        self.ids.append(token)

    def draft(self, num_draft: int) -> list[int]:
        """Up to `num_draft` tokens that followed the latest earlier occurrence of the longest suffix found."""
        ids = self.ids
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) <= n:
                continue
            start = self._last.get(tuple(ids[-n:]))
            if start is not None:
                return ids[start + n:start + n + num_draft]
        return []


def verify(draft: Sequence[int], greedy_at, probs_at, generator: torch.Generator | None,
           greedy: bool) -> tuple[int, int | None]:
    """Which of the k drafted tokens to keep, checked position by position (position i: the logits after the
    fed token and the first i drafts). Returns (how many to keep, the token after them when the check stopped
    at a mismatch, else None: all kept, and the logits after the last give the next position).
    `greedy_at(i, kept)`: the greedy choice at position i given the drafts kept before it; `probs_at(i, kept)`:
    the sampling distribution [V] there (temperature, top-k/top-p and repetition penalty applied)."""
    for i, token in enumerate(draft):
        if greedy:
            choice = greedy_at(i, draft[:i])
            if choice != token:
                return i, choice
            continue
        p = probs_at(i, draft[:i])
        if float(torch.rand((), generator=generator)) < float(p[token]):
            continue
        residual = p.numpy().copy()
        residual[token] = 0
        if residual.sum(dtype=np.float64) <= 0:  # p was a point mass on the draft: it would have been kept
            continue
        return i, draw(residual, generator)
    return len(draft), None

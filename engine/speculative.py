"""Prompt-lookup speculative decoding: drafts from the text already in the context, checked by one forward.

Document answers quote their documents and chat answers repeat the conversation's names and phrases. When the
last few tokens generated also occur earlier in the context (the prompt, its documents, the answer so far), the
tokens that followed them there are a cheap guess of what comes next. One forward over [token, draft...]
computes the model's next-token logits after each drafted position; the longest prefix of the draft that the
model itself would have produced is kept, and the first token it would have produced instead comes for free.
A forward reads every weight once whatever the number of tokens, so a step that keeps k drafts costs about one
step and yields k + 1 tokens.

- `NgramIndex`: where each run of three tokens of the context occurred with a continuation, tokens compared by
  their spelling without leading spaces (`Spellings`); `draft` takes the occurrence of the context's last three
  tokens that matches furthest back, or a pair that has always been followed by the same token.
- `verify`: which drafted tokens to keep. Greedy: those equal to the argmax (the output is the non-speculative
  greedy output). Sampling: the standard rule for a draft that is a single proposed token (a point mass q):
  keep d with probability p(d), else sample from the residual p without d, renormalised; this keeps the
  sampled distribution exactly p at every position (tests check it statistically).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from .sampling import draw

MODES = ("prompt-lookup", "draft-model")  # the second: engine.draft_model
DEFAULT_NUM_DRAFT = 4
# Drafts come from matches of at least MATCH_TOKENS tokens. Matches of 2 tokens ("of the", ", and") came back often
# in free chat and were mostly rejected (23% of chat drafts kept against 43% from 3 tokens on; each check of 5
# positions costs ~1.4x a one-token step on a CPU, `python -m bench step --positions`), so a pair drafts only
# where it occurred at least PAIR_SEEN times before and every time with the same next token (the start of an
# answer that quotes its document: "The archive" -> " code of the"). Single tokens match by chance ("the", ","):
# never drafted from.
MATCH_TOKENS = 3
PAIR_SEEN = 2
# Of the earlier occurrences of the last MATCH_TOKENS tokens, the latest CANDIDATES are compared backwards, up to
# LONGEST_MATCH tokens, and the one that matches furthest wins (the latest among equals). In a document question
# the answer's "...code of the Falcon collection is" also occurs in the question ("...code of the Falcon
# collection?"), later than in the document: the latest occurrence drafted the question's "?" there.
CANDIDATES = 16
LONGEST_MATCH = 16
# How these were chosen: the greedy answers to `python -m bench speculative`'s prompts (16 needle questions, 8
# quotes, 8 free chats on the embedded model) replayed against the measured cost of a forward of n positions,
# median speedup. Latest occurrence of 3-5 tokens, token ids as they are: needle (first five) 1.97x, needle
# (first ten) 2.42x, quotes 2.28x, chat 1.01x. The longest match (this), spellings, pairs: 2.56x, 2.71x, 2.44x,
# 1.01x. Without the pairs 2.38x, 2.56x, 2.38x; without the spellings (ids as they are) 1.86x, 2.52x, 2.37x.


def draft_limit(num_draft: int, copying: bool) -> int:
    """How many tokens the next check may draft: `num_draft`, and half as many again while a copy is under way
    (`copying`: the last check kept every token it drafted, as when an answer quotes its document). Replayed over
    the greedy answers to `python -m bench speculative`'s prompts against the measured cost of a forward of n
    positions (bench step --positions at 1.4k tokens: 5 cost 1.47x one, 7 cost 1.78x), mean speedup over ten
    needle questions: 4 drafts always 2.22x, 6 always 2.31x (but the short answers lose: the first five
    questions' median 2.03x -> 1.79x), 4 then 6 while copying 2.34x (that median unchanged); eight quotes 2.22x,
    2.33x, 2.32x; free chat 1.04x, 1.03x, 1.04x. Growing further (8, then 10) while the copy goes on did not
    pay once drafts came from the longest match (needle 2.56x -> 2.51x, quotes 2.44x -> 2.51x)."""
    return num_draft + num_draft // 2 if copying else num_draft


class Spellings:
    """A key per token id that is the same for tokens spelled alike but for leading spaces: " The" (inside a
    sentence) and "The" (an answer's first word) get one key, so an answer that opens with a phrase its document
    has mid-sentence matches it. Keys are made on first sight (one decode of the token) and kept for the
    tokenizer's life."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._keys: dict[int, int] = {}
        self._by_text: dict[object, int] = {}
        self._lock = threading.Lock()  # requests on several threads share one engine's Spellings

    def __call__(self, token: int) -> int:
        key = self._keys.get(token)
        if key is None:
            try:
                text = self.tokenizer.decode([token])
            except Exception:  # an id the tokenizer lacks (a model's padding rows): a key of its own
                text = ""
            name = (text.lstrip(" ") or text) if text else ("token", token)
            with self._lock:
                key = self._keys[token] = self._by_text.setdefault(name, len(self._by_text))
        return key


def _same(token: int) -> int:
    return token


class NgramIndex:
    """Where in a growing token list each run of `match` tokens occurred with a continuation, compared by
    `spelling` (a key per token id; the ids themselves when None). `draft` takes the suffix's occurrence that
    matches furthest back (engine.speculative's constants say how far and over how many)."""

    def __init__(self, ids: Sequence[int], spelling=None, *, match: int = MATCH_TOKENS,
                 pair_seen: int = PAIR_SEEN, candidates: int = CANDIDATES, longest: int = LONGEST_MATCH):
        if match < 2 or candidates < 1 or longest < match or pair_seen < 0:
            raise ValueError(f"match {match} must be >= 2, candidates {candidates} >= 1, longest {longest} >= match, "
                             f"pair_seen {pair_seen} >= 0 (0: pairs never draft)")
        self.match, self.pair_seen, self.candidates, self.longest = match, pair_seen, candidates, longest
        self.spelling = spelling or _same
        self.ids: list[int] = []
        self.keys: list[int] = []  # spelling(id) of each of ids
        self._starts: dict[tuple[int, ...], list[int]] = {}  # a run's starts, oldest first
        self._pairs: dict[tuple[int, int], list[int]] = {}  # [latest start, its next token, 1 if always that, count]
        for token in ids:
            self.append(token)

    def append(self, token: int) -> None:
        # The runs ending at the current last token get a continuation now: index them.
        end, keys = len(self.ids), self.keys
        if end >= self.match:
            self._starts.setdefault(tuple(keys[end - self.match:end]), []).append(end - self.match)
        if end >= 2:
            pair = self._pairs.get((keys[-2], keys[-1]))
            if pair is None:
                self._pairs[keys[-2], keys[-1]] = [end - 2, token, 1, 1]
            else:
                pair[0], pair[2], pair[3] = end - 2, pair[2] if pair[1] == token else 0, pair[3] + 1
        self.ids.append(token)
        keys.append(self.spelling(token))

    def draft(self, num_draft: int) -> list[int]:
        """Up to `num_draft` tokens that followed the best earlier occurrence of the context's last tokens."""
        ids, keys, n = self.ids, self.keys, self.match
        size = len(ids)
        starts = self._starts.get(tuple(keys[-n:])) if size > n else None
        if starts:
            best, best_length = starts[-1], 0
            for start in reversed(starts[-self.candidates:]):
                length = n  # tokens matched, back from the suffix's end and from the occurrence's
                while length < self.longest and start + n - length > 0 \
                        and keys[start + n - length - 1] == keys[size - length - 1]:
                    length += 1
                if length > best_length:
                    best, best_length = start, length
            return ids[best + n:best + n + num_draft]
        if size > 2 and self.pair_seen:
            pair = self._pairs.get((keys[-2], keys[-1]))
            if pair is not None and pair[2] and pair[3] >= self.pair_seen:
                return ids[pair[0] + 2:pair[0] + 2 + num_draft]
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

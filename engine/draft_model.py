"""Speculative drafts from a second, smaller model of the same tokenizer (speculative="draft-model").

Where a small model of the same family is loaded next to the served one (SmolLM2-135M beside SmolLM2-1.7B,
Qwen2.5-0.5B beside Qwen2.5-7B), its greedy continuation of the context is a better guess than an n-gram of the
context for text that quotes nothing. `DraftModel` has the interface of speculative.NgramIndex (`append` each
token of the answer, `draft(k)` up to k tokens), so the decode loop checks its drafts the same way: one forward of
the served model over [token, draft...], the drafts it agrees with kept (greedy output is the served model's own;
sampling keeps its distribution, the draft being a point mass). The draft model holds its own KV cache of the
context and is fed only what it has not seen; the k - 1 drafted tokens it fed to propose the next ones are cut
from that cache again, since which of them the served model keeps is not known yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .live_cache import GrowingCache


def draft_model_mismatch(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> str | None:
    """Why a draft model cannot draft for the target (token ids must mean the same text in both), or None."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        return "its tokenizer's vocabulary differs from the served model's (drafts must be the same token ids)"
    if draft_vocab > target_vocab:
        return f"its embedding table has {draft_vocab} rows, more than the served model's {target_vocab}"
    return None


class DraftModel:
    """Greedy drafts of `model` (a transformers causal LM on `device`) continuing `ids`."""

    def __init__(self, model, ids: Sequence[int], device):
        self.model = model
        self.device = device
        self.ids: list[int] = list(ids)
        self.cache = GrowingCache()
        self.fed = 0  # ids[:fed] are in the cache

    def append(self, token: int) -> None:
        self.ids.append(token)

    @torch.inference_mode()
    def draft(self, num_draft: int) -> list[int]:
        if num_draft <= 0 or not self.ids:
            return []
        if self.fed == len(self.ids):  # nothing new since the last draft: feed the last token again
            self.cache.crop(-1)
            self.fed -= 1
        logits = self._feed(self.ids[self.fed:])  # everything since the last draft (the whole prompt at first)
        self.fed = len(self.ids)
        drafted: list[int] = []
        while True:
            token = int(torch.argmax(logits))
            drafted.append(token)
            if len(drafted) == num_draft:
                break
            logits = self._feed([token])
        extra = self.cache.get_seq_length() - self.fed
        if extra:
            self.cache.crop(-extra)  # the drafted tokens are not the context (yet)
        return drafted

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([tokens], device=self.device), past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

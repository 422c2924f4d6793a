"""Benchmark text: passages of the Python documentation that ships with Python, cut to token budgets."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """How much text and how many requests each reuse workload (bench.reuse) sends."""

    num_turns: int = 8
    turn_tokens: int = 150
    system_tokens: int = 1000
    num_questions: int = 8
    num_docs: int = 5
    doc_tokens: int = 380
    num_queries: int = 6
    max_new_tokens: int = 32
    needle_docs: int = 8
    needle_docs_per_prompt: int = 5
    needle_questions: int = 24
    needle_chars: int = 1300
    # How reuse engines warm the needle documents: "alone" (each after the system prompt, as the app pre-warms a
    # dropped file) or "layout" (all of them in one prompt after the system prompt, in the order they were made:
    # each document's KV saw other documents before it, as it does when asked about among them)
    needle_warm: str = "alone"


FULL = Sizes()
QUICK = Sizes(num_turns=3, turn_tokens=60, system_tokens=300, num_questions=3, num_docs=3, doc_tokens=100,
              num_queries=3, max_new_tokens=8, needle_docs=4, needle_docs_per_prompt=3, needle_questions=3,
              needle_chars=600)


class Corpus:
    """Passages of the Python documentation topics, handed out in topic-name order, each topic at most once.

    A passage is whole lines of one topic, cut at the line end nearest the token budget, so the text reads
    naturally and is within half a line of the budget.
    """

    def __init__(self, tokenizer):
        from pydoc_data.topics import topics

        self._tokenizer = tokenizer
        self._topics = dict(sorted(topics.items()))
        self._used: set[str] = set()

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _cut(self, text: str, budget: int, count: int) -> list[str]:
        passages: list[str] = []
        lines: list[str] = []
        used = 0  # tokens of the passage so far, counted whole: line-by-line counts drift at the joins
        for line in text.splitlines(keepends=True):
            if not lines and not line.strip():
                continue  # a passage never starts with a blank line
            with_line = self.count_tokens("".join(lines) + line)
            if lines and with_line > budget:
                keep = with_line - budget < budget - used  # the line that crosses the budget lands nearer
                if keep:
                    lines.append(line)
                passages.append("".join(lines).strip("\n").rstrip())
                if len(passages) == count:
                    return passages
                lines, used = [], 0
                if keep or not line.strip():
                    continue
                with_line = self.count_tokens(line)
            lines.append(line)
            used = with_line
        if lines and used >= budget * 0.9:
            passages.append("".join(lines).strip("\n").rstrip())
        return passages[:count]

    def passages(self, budget: int, count: int) -> tuple[str, list[str]]:
        """(topic name, `count` consecutive passages of ~`budget` tokens) from the first unused topic long
        enough to hold them."""
        for name, text in self._topics.items():
            if name in self._used or len(text) < budget * count * 3:  # under ~3 chars/token: too short
                continue
            cut = self._cut(text, budget, count)
            if len(cut) == count:
                self._used.add(name)
                return name, cut
        raise ValueError(f"no unused documentation topic holds {count} passages of {budget} tokens")


def permutations(num_items: int, count: int) -> list[list[int]]:
    """`count` orders of range(num_items): the natural order first, then seeded shuffles, all distinct while
    there are enough of them."""
    orders = [list(range(num_items))]
    rng = random.Random(20240611)
    while len(orders) < count:
        order = rng.sample(range(num_items), num_items)
        if order not in orders or len(orders) >= math.factorial(num_items):
            orders.append(order)
    return orders


@dataclass(frozen=True)
class Texts:
    """The text of every workload, cut in one fixed order so that a workload's text does not depend on which
    workloads run."""

    turn_topic: str
    turn_passages: list[str]
    system_topic: str
    system_doc: str
    docs: list[tuple[str, str]]  # (topic, text)


def cut_texts(corpus: Corpus, sizes: Sizes) -> Texts:
    turn_topic, turn_passages = corpus.passages(sizes.turn_tokens, sizes.num_turns)
    system_topic, (system_doc,) = corpus.passages(sizes.system_tokens, 1)
    docs = []
    for _ in range(sizes.num_docs):
        topic, (text,) = corpus.passages(sizes.doc_tokens, 1)
        docs.append((topic, text))
    return Texts(turn_topic, turn_passages, system_topic, system_doc, docs)

"""Planning's reuse rules, one at a time, over a store simulated by records alone (planning never reads tensors):
a stored entry is reused only from its first token on and only for the tokens it shares with the prompt, an
inexact entry never serves an exact hit, "prefix" mode stops at the first chunk it cannot reuse, and a plan
without quantized hits marks nothing after it lossy (the answer's KV included)."""

from __future__ import annotations

from engine.chunking import chunk_spans
from engine.config import ChunkingConfig
from engine.keys import chain_key, content_key, root_key
from engine.kv.records import ChunkRecord
from engine.plan import EXACT, MISS, PREFIX, plan_prompt

ROOT = root_key("tiny|fixed-8")
CFG = ChunkingConfig(mode="fixed", size=8)


class Records:
    """The lookups planning makes, over plain records."""

    def __init__(self, *records: ChunkRecord):
        self.records = {r.key: r for r in records}

    def record(self, key):
        return self.records.get(key)

    def get_chunk(self, key):
        record = self.records.get(key)
        return record if record is not None and record.kind == "chunk" and record.exact else None

    def children(self, parent):
        return [r for r in self.records.values() if r.parent == parent]

    def anchored(self, tokens):
        return []


def chunk(parent: bytes, start: int, tokens, exact: bool = True) -> ChunkRecord:
    key = chain_key(parent, tokens) if exact else chain_key(chain_key(parent, tokens) + b"inexact", [])
    return ChunkRecord(key, parent, content_key(ROOT.hex(), tokens), "chunk", start, tuple(tokens), 1, exact=exact)


def tail(parent: bytes, start: int, tokens) -> ChunkRecord:
    return ChunkRecord(chain_key(parent + b"tail", tokens), parent, None, "tail", start, tuple(tokens), 1)


def plan(ids, store, mode="chunk"):
    spans, num_complete = chunk_spans(ids, CFG, lambda _: 0)
    return plan_prompt(list(ids), spans, num_complete, ROOT, store, mode)


IDS = list(range(100, 124)) + [7, 8, 9]  # three chunks of 8 and a tail of 3


def test_a_tail_is_reused_for_exactly_the_tokens_it_shares_from_its_first_on():
    first = chunk(ROOT, 0, IDS[:8])
    shares_two = tail(first.key, 8, IDS[8:10] + [1, 2])
    assert plan(IDS, Records(first, shares_two)).chunk_rows()[:2] == [(0, 8, EXACT), (8, 10, PREFIX)]
    # a tail whose first token differs shares nothing, however much of the rest it has in common
    first_differs = tail(first.key, 8, [1] + IDS[9:12])
    rows = plan(IDS, Records(first, first_differs)).chunk_rows()
    assert rows[0] == (0, 8, EXACT) and all(kind == MISS for _, _, kind in rows[1:])


def test_an_inexact_entry_never_serves_an_exact_or_prefix_hit():
    first = chunk(ROOT, 0, IDS[:8])
    inexact = chunk(first.key, 8, IDS[8:16], exact=False)
    rows = plan(IDS, Records(first, inexact)).chunk_rows()
    assert rows[0] == (0, 8, EXACT) and all(kind == MISS for _, _, kind in rows[1:])


def test_prefix_mode_stops_at_the_first_chunk_it_cannot_reuse():
    first = chunk(ROOT, 0, IDS[:8])
    second = chunk(first.key, 8, IDS[8:16])
    third = chunk(second.key, 16, IDS[16:24])
    store = Records(first, third)  # the second chunk is not stored
    assert [kind for _, _, kind in plan(IDS, store, "chunk").chunk_rows()][:3] == [EXACT, MISS, EXACT]
    assert all(kind == MISS for _, _, kind in plan(IDS, store, "prefix").chunk_rows()[1:])
    assert plan(IDS, Records(first, second, third), "prefix").reused_tokens == 24


def test_a_plan_without_quantized_hits_marks_nothing_lossy_the_answer_included():
    first = chunk(ROOT, 0, IDS[:8])
    for store in (None, Records(first)):
        lossless = plan(IDS, store)
        # store_tail marks the KV of [start, end) lossy when first_lossy < end, and end runs into the answer
        assert not any(lossless.first_lossy < end for end in (len(IDS), len(IDS) + 1, len(IDS) + 4096))

"""Continuous batching (engine.batching, engine.worker): requests decoded together in one forward per step give
the greedy text each gives alone (real model, float and int4, drafts on and off; tiny models of several
families), newcomers join while others decode and their prefill pieces interleave with the others' steps,
cancelling or failing one request leaves the others alone, and models whose attention cannot be split run one
request at a time."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import ARCHS, build_model, build_tokenizer, random_ids

from engine import EngineConfig, EngineWorker, KVBoost, PromptProgress, Result, TokenEvent
from engine.batching import Batch, Forward, packed_forward
from engine.generate import run_forward
from engine.live_cache import GrowingCache

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain photosynthesis in one sentence.", "What is 12 times 12?", "Name a famous painter.",
             "Translate 'good morning' into Spanish.",
             "Repeat exactly: 'The quick brown fox jumps over the lazy dog.' Then repeat it again."]

def run_together(engine_for, prompts, max_batch=8, **sampling) -> list[Result]:
    """Every prompt submitted to one worker at once (held back by a gate job until all are queued), so they
    start in one batch; `engine_for(i)` is the engine of prompt i."""
    worker = EngineWorker(name="test-batching", max_batch=max_batch)
    gate = threading.Event()
    worker.submit(lambda cancel: gate.wait(30), source="gate")
    jobs = [worker.submit(lambda cancel, i=i, p=p: engine_for(i).stream(p, cancel=cancel, **sampling), source="t")
            for i, p in enumerate(prompts)]
    gate.set()
    results = [[e for e in job if isinstance(e, Result)][0] for job in jobs]
    assert worker.stop(5)
    return results


def chat_ids(engine, question):
    return engine.encode([{"role": "user", "content": question}])


@pytest.mark.parametrize("speculative", [None, "prompt-lookup"])
def test_eight_requests_batched_answer_as_each_does_alone_on_the_real_model(smollm, speculative):
    engine = smollm.with_options(reuse="off", speculative=speculative)
    prompts = [chat_ids(engine, q) for q in QUESTIONS]
    alone = [engine.generate(p, max_new_tokens=24) for p in prompts]
    together = run_together(lambda i: engine, prompts, max_new_tokens=24)
    for a, b in zip(alone, together):
        assert b.token_ids == a.token_ids, (a.text, b.text)
    assert all(r.stats.batched_forwards > 0 for r in together)
    if speculative:
        assert sum(r.stats.drafted_tokens for r in together) > 0  # drafted rows and single rows shared forwards


@torch.inference_mode()
def test_a_packed_forward_gives_each_request_its_logits_and_kv_alone_bit_for_bit_over_int4(smollm_int4_engine):
    """The linears see all rows at once, attention runs per request over its own cache: over the int4 and int8
    kernels (which compute a row the same whatever the number of rows) nothing differs at all."""
    model, cpu = smollm_int4_engine.model, torch.device("cpu")
    prompts = [list(range(1000, 1100)), list(range(3000, 3037)), list(range(5000, 5211))]
    fed = [[2000], [2100, 2101, 2102], [2200]]  # one row checks two drafted tokens
    alone, packed = [GrowingCache() for _ in prompts], [GrowingCache() for _ in prompts]
    for prompt, a, b in zip(prompts, alone, packed):
        for cache in (a, b):
            model(input_ids=torch.tensor([prompt]), past_key_values=cache)
    want = [run_forward(model, Forward(t, c, rowwise=len(t) > 1), cpu) for t, c in zip(fed, alone)]
    got = packed_forward(model, [Forward(t, c, rowwise=len(t) > 1) for t, c in zip(fed, packed)], cpu)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    for a, b in zip(alone, packed):
        assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
                   for x, y in zip(a.layers, b.layers))


@torch.inference_mode()
def test_a_packed_forward_over_gguf_blocks_runs_in_one_call_and_gives_each_request_its_logits_alone(smollm):
    """The embedded model as its GGUF blocks: the packed step is one C call over every request's rows (each
    request's attention over its own cache), and each request's logits and KV are those of its own forward, bit
    for bit (the block kernel computes a row the same whatever the number of rows)."""
    from engine.block_forward import uses_block_forward

    model, cpu = smollm.model, torch.device("cpu")
    assert uses_block_forward(model)
    prompts = [list(range(1000, 1100)), list(range(3000, 3037)), list(range(5000, 5211)), [7]]
    fed = [[2000], [2100, 2101, 2102], [2200], [2300, 2301]]  # rows of drafted tokens among single rows
    alone, packed = [GrowingCache() for _ in prompts], [GrowingCache() for _ in prompts]
    for prompt, a, b in zip(prompts, alone, packed):
        for cache in (a, b):
            model(input_ids=torch.tensor([prompt]), past_key_values=cache)
    want = [run_forward(model, Forward(t, c, rowwise=len(t) > 1), cpu) for t, c in zip(fed, alone)]
    calls = model.forward.one_call_forwards
    got = packed_forward(model, [Forward(t, c, rowwise=len(t) > 1) for t, c in zip(fed, packed)], cpu)
    assert model.forward.one_call_forwards == calls + 1  # one call for the whole batch
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    for a, b in zip(alone, packed):
        assert all(torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
                   for x, y in zip(a.layers, b.layers))


def test_conversations_over_one_document_batched_answer_as_alone_reading_one_copy_of_it(smollm):
    """Four questions about one document (its KV reused from the cache by all but the first, as in four
    conversations it was dropped into), decoded together with drafts on: each answer is the one it gets alone,
    and the later requests read the document's keys and values in the first one's cache."""
    engine = smollm.with_options(speculative="prompt-lookup")
    document = " ".join(f"Ferry {i} leaves the harbour at {6 + i % 12}:{(i * 7) % 60:02d} from pier {i % 5}."
                        for i in range(24))
    asks = ["When does ferry 3 leave?", "Which pier does ferry 7 use?", "Summarize the timetable.",
            "Name two ferries that leave from pier 2."]
    prompts = [engine.encode([{"role": "system", "content": document}, {"role": "user", "content": q}])
               for q in asks]
    alone = [engine.generate(p, max_new_tokens=24) for p in prompts]
    before = engine.model.forward.shared_forwards
    together = run_together(lambda i: engine, prompts, max_new_tokens=24)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(r.stats.batched_forwards > 0 for r in together)
    assert engine.model.forward.shared_forwards > before


def test_the_real_model_in_int4_batched_answers_as_alone(smollm_int4_engine):
    engine = smollm_int4_engine.with_options(speculative="prompt-lookup")
    prompts = [chat_ids(engine, q) for q in QUESTIONS[:5]]
    alone = [engine.generate(p, max_new_tokens=20) for p in prompts]
    together = run_together(lambda i: engine, prompts, max_new_tokens=20)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_family_answers_the_same_batched_and_those_that_cannot_split_run_alone(arch, one_thread):
    model, tokenizer = build_model(arch), build_tokenizer()
    engine = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0, reuse="off"))
    prompts = [random_ids(n, seed) for n, seed in ((30, 1), (47, 2), (12, 3), (65, 4))]
    alone = [engine.generate(p, max_new_tokens=12) for p in prompts]
    together = run_together(lambda i: engine, prompts, max_new_tokens=12)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    shared = [r.stats.batched_forwards for r in together]
    if engine.batching_unavailable() is None:
        assert all(shared)
    else:  # sliding windows, eager-only attention: one request at a time, as before
        assert not any(shared)
        assert arch in ("gemma2", "gemma3", "mistral")


def test_a_spilling_engine_runs_its_requests_one_at_a_time(one_thread):
    engine = KVBoost(build_model("llama"), build_tokenizer(),
                     EngineConfig.of(disk_cache_bytes=0, reuse="off", live_kv_bytes=20_000, live_page_tokens=8))
    assert "live_kv_bytes" in engine.batching_unavailable()
    prompts = [random_ids(40, 5), random_ids(41, 6)]
    alone = [engine.generate(p, max_new_tokens=10) for p in prompts]
    together = run_together(lambda i: engine, prompts, max_new_tokens=10)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert not any(r.stats.batched_forwards for r in together)


class Recorder:
    """Where a Batch delivers its members' events: one log, in order, of (member name, event)."""

    def __init__(self):
        self.log: list[tuple[str, object]] = []
        self.ends: dict[str, BaseException | None] = {}

    def admit(self, batch, engine, name, prompt, **sampling):
        stream = engine.stream(prompt, **sampling)
        batch.admit(stream.take_steps(), engine, lambda e: self.log.append((name, e)),
                    lambda err: self.ends.__setitem__(name, err))

    def result(self, name) -> Result:
        return [e for n, e in self.log if n == name and isinstance(e, Result)][0]

    def tokens_of(self, name, until: int | None = None) -> int:
        return sum(1 for n, e in self.log[:until] if n == name and isinstance(e, TokenEvent))


def test_a_newcomers_prefill_runs_one_piece_per_step_between_the_others_decode_steps(one_thread):
    engine = KVBoost(build_model("llama"), build_tokenizer(),
                     EngineConfig.of(disk_cache_bytes=0, reuse="off", speculative=None, prefill_piece_tokens=16))
    long_prompt = random_ids(100, 8)  # 7 pieces: 6 of 16 tokens without logits, then the last 4
    want = engine.generate(long_prompt, max_new_tokens=5)
    batch, rec = Batch(), Recorder()
    rec.admit(batch, engine, "old", random_ids(20, 9), max_new_tokens=40)
    for _ in range(3):
        batch.step()
    joined_at = len(rec.log)
    rec.admit(batch, engine, "new", long_prompt, max_new_tokens=5)
    while len(batch):
        batch.step()
    first_new = next(i for i, (n, e) in enumerate(rec.log) if n == "new")
    # Between joining and its first token the newcomer took 7 steps; the old request decoded in each.
    assert rec.tokens_of("old", first_new) - rec.tokens_of("old", joined_at) >= 6
    assert rec.result("new").token_ids == want.token_ids
    assert rec.ends == {"old": None, "new": None}


def test_a_long_prompt_says_how_far_it_was_read_alone_and_in_a_batch(one_thread):
    engine = KVBoost(build_model("llama"), build_tokenizer(),
                     EngineConfig.of(disk_cache_bytes=0, reuse="off", speculative=None, prefill_piece_tokens=16))
    long_prompt = random_ids(100, 8)  # 7 pieces: 6 of 16 tokens without logits, then the last 4
    plain = list(engine.stream(long_prompt, max_new_tokens=5))
    assert not any(isinstance(e, PromptProgress) for e in plain)  # only for those who ask
    alone = list(engine.stream(long_prompt, max_new_tokens=5, progress=True))
    batch, rec = Batch(), Recorder()
    rec.admit(batch, engine, "old", random_ids(20, 9), max_new_tokens=40)
    batch.step()
    rec.admit(batch, engine, "new", long_prompt, max_new_tokens=5, progress=True)
    while len(batch):
        batch.step()
    batched = [e for n, e in rec.log if n == "new"]
    for events in (alone, batched):
        read = [(e.done, e.total) for e in events if isinstance(e, PromptProgress)]
        assert read == [(16 * k, 100) for k in range(1, 7)]
        first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenEvent))
        assert first_token == len(read)  # all of it before the first token
        assert events[-1].token_ids == plain[-1].token_ids
    assert not any(isinstance(e, PromptProgress) for n, e in rec.log if n == "old")
    assert rec.ends == {"old": None, "new": None}


def test_newcomers_prefill_pieces_ride_in_the_decode_steps_one_call_over_gguf_blocks(smollm):
    """On the embedded model in GGUF blocks, two newcomers' prompt pieces and a running request's decode token go
    through the weights in ONE C call per step (before, each piece was a call of its own), and each newcomer's
    logits and answer are those it gets alone, bit for bit."""
    engine = smollm.with_options(reuse="off", speculative=None, prefill_piece_tokens=8)
    forward = engine.model.forward
    prompts = [chat_ids(engine, QUESTIONS[3] + " Please answer carefully and briefly."),
               chat_ids(engine, QUESTIONS[6] + " Then say it once more, slowly.")]
    assert all(len(p) > 24 for p in prompts)  # four pieces or more each
    want = [engine.generate(p, max_new_tokens=6, return_logits=True) for p in prompts]
    batch, rec = Batch(), Recorder()
    rec.admit(batch, engine, "old", chat_ids(engine, QUESTIONS[1]), max_new_tokens=40)
    for _ in range(2):
        batch.step()
    for i, prompt in enumerate(prompts):
        rec.admit(batch, engine, f"new{i}", prompt, max_new_tokens=6, return_logits=True)
    calls = []
    while not all(any(n == f"new{i}" for n, _ in rec.log) for i in range(2)):  # until both have a first token
        before = forward.one_call_forwards
        batch.step()
        calls.append(forward.one_call_forwards - before)
    assert len(calls) >= 3 and calls == [1] * len(calls), calls
    while len(batch):
        batch.step()
    for i, w in enumerate(want):
        got = rec.result(f"new{i}")
        assert got.token_ids == w.token_ids and torch.equal(got.first_logits, w.first_logits)
    assert rec.ends == {"old": None, "new0": None, "new1": None}


def test_a_request_joining_a_running_batch_answers_as_alone_and_before_the_others_finish(smollm):
    engine = smollm.with_options(reuse="off")
    long_ones = [engine.encode(text) for text in ("Once upon a time, in a land far away,", "The history of Rome",
                                                  "Chapter one. The storm")]  # plain text: it goes on and on
    newcomer = chat_ids(engine, QUESTIONS[4])
    want = engine.generate(newcomer, max_new_tokens=8)
    worker = EngineWorker(name="test-batching")
    try:
        olds = [worker.submit(lambda cancel, p=p: engine.stream(p, cancel=cancel, max_new_tokens=60,
                                                               stop=["\x00never"]), source="window")
                for p in long_ones]
        first = iter(olds[0])
        for _ in range(4):  # the old requests are decoding
            assert isinstance(next(first), TokenEvent)
        job = worker.submit(lambda cancel: engine.stream(newcomer, cancel=cancel, max_new_tokens=8), source="api")
        result = [e for e in job if isinstance(e, Result)][0]
        assert not all(old.done for old in olds)  # it joined them; it did not wait for them to finish
        assert result.token_ids == want.token_ids
        assert result.stats.batched_forwards > 0
        for old in olds:
            old.wait(60)
    finally:
        worker.stop(10)


def test_cancelling_one_batched_request_ends_it_alone(one_thread):
    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0, reuse="off"))
    prompts = [random_ids(30, 11), random_ids(31, 12), random_ids(32, 13)]
    alone = [engine.generate(p, max_new_tokens=30) for p in prompts]
    worker = EngineWorker(name="test-batching")
    gate = threading.Event()
    worker.submit(lambda cancel: gate.wait(30), source="gate")
    cancel = threading.Event()
    jobs = [worker.submit(lambda c, p=p: engine.stream(p, cancel=c, max_new_tokens=30), source="t",
                          cancel=cancel if i == 1 else None) for i, p in enumerate(prompts)]
    gate.set()
    events = iter(jobs[1])
    for _ in range(3):
        next(events)
    cancel.set()
    results = [[e for e in job if isinstance(e, Result)][0] for job in (jobs[0], jobs[2])]
    cancelled = [e for e in events if isinstance(e, Result)][0]
    assert worker.stop(5)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 30
    assert [r.token_ids for r in results] == [alone[0].token_ids, alone[2].token_ids]


def test_a_front_end_that_fails_on_an_event_fails_only_its_own_request(one_thread):
    engine = KVBoost(build_model("qwen2"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0, reuse="off"))
    prompts = [random_ids(25, 21), random_ids(26, 22)]
    want = engine.generate(prompts[1], max_new_tokens=15)
    batch, rec = Batch(), Recorder()

    def broken_sink(event):
        raise OSError("the window is gone")

    stream = engine.stream(prompts[0], max_new_tokens=15)
    batch.admit(stream.take_steps(), engine, broken_sink, lambda err: rec.ends.__setitem__("broken", err))
    rec.admit(batch, engine, "fine", prompts[1], max_new_tokens=15)
    while len(batch):
        batch.step()
    assert isinstance(rec.ends["broken"], OSError) and rec.ends["fine"] is None
    assert rec.result("fine").token_ids == want.token_ids
    assert not engine.runner.lock.locked()  # the engine is free again for requests alone


def test_batched_requests_store_their_chunks_and_a_later_request_reuses_them_exactly(one_thread):
    model, tokenizer = build_model("llama"), build_tokenizer()
    engine = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0, chunk_size=16))
    cold = engine.with_options(reuse="off")
    shared = random_ids(64, 31)
    prompts = [shared + random_ids(9, 32), shared + random_ids(7, 33), random_ids(50, 34)]
    together = run_together(lambda i: engine, prompts, max_new_tokens=10)
    assert [r.token_ids for r in together] == [cold.generate(p, max_new_tokens=10).token_ids for p in prompts]
    follow_up = shared + random_ids(12, 35)
    again = engine.generate(follow_up, max_new_tokens=10)
    assert again.stats.reused_tokens >= 64
    assert again.token_ids == cold.generate(follow_up, max_new_tokens=10).token_ids


def test_a_request_on_another_model_waits_for_the_batch_and_then_runs(one_thread):
    first = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0, reuse="off"))
    second = KVBoost(build_model("qwen2"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0, reuse="off"))
    prompts = [random_ids(20, 41), random_ids(21, 42), random_ids(22, 43)]
    engines = [first, second, first]
    alone = [e.generate(p, max_new_tokens=8) for e, p in zip(engines, prompts)]
    together = run_together(lambda i: engines[i], prompts, max_new_tokens=8)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_max_batch_one_is_the_one_at_a_time_worker(one_thread):
    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0, reuse="off"))
    prompts = [random_ids(20, 51), random_ids(20, 52)]
    together = run_together(lambda i: engine, prompts, max_batch=1, max_new_tokens=8)
    assert not any(r.stats.batched_forwards for r in together)
    assert [r.token_ids for r in together] == [engine.generate(p, max_new_tokens=8).token_ids for p in prompts]


def test_stopping_the_worker_ends_every_batched_request_with_a_result(one_thread):
    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0, reuse="off"))
    worker = EngineWorker(name="test-batching")
    jobs = [worker.submit(lambda c, s=s: engine.stream(random_ids(20, s), cancel=c, max_new_tokens=400), source="t")
            for s in (61, 62, 63)]
    events = [iter(job) for job in jobs]
    for it in events:
        assert isinstance(next(it), TokenEvent)  # all three are decoding
    assert worker.stop(10)
    results = [[e for e in it if isinstance(e, Result)][0] for it in events]
    assert [r.finish_reason for r in results] == ["cancelled"] * 3
    assert not engine.runner.lock.locked()


def test_a_batched_request_stops_drafting_when_its_drafts_are_not_kept(one_thread):
    """Alone, drafts cost little; in a batch each one is another row for the whole step, so a request whose
    drafts are mostly rejected stops drafting there (its answer is the same either way)."""
    engine = KVBoost(build_model("llama"), build_tokenizer(),
                     EngineConfig.of(disk_cache_bytes=0, reuse="off", speculative="prompt-lookup"))
    # A repeated motif, then random words: n-grams to draft from; with these seeds the random model keeps
    # 42% and 38% of its drafts alone (and 60% of the third's)
    prompts = [random_ids(4, seed) * 4 + random_ids(40, seed + 100) for seed in (90, 95, 86)]
    alone = [engine.generate(p, max_new_tokens=30) for p in prompts]
    together = run_together(lambda i: engine, prompts, max_new_tokens=30)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    low = [(a, b) for a, b in zip(alone, together) if a.stats.accepted_tokens < 0.5 * a.stats.drafted_tokens]
    assert low, "a prompt whose drafts a random model mostly rejects"
    assert sum(b.stats.drafted_tokens for _, b in low) < sum(a.stats.drafted_tokens for a, _ in low)


@torch.inference_mode()
def test_the_attention_registry_is_written_once_not_at_every_packed_forward(smollm_int4_engine, monkeypatch):
    """The per-request split of attention is registered in transformers' process-wide registry once; packed
    forwards after that leave the registry alone, and a call outside a packed forward gets the registered
    function's own result."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from engine.exact_attention import ROWS, row_attention

    model, cpu = smollm_int4_engine.model, torch.device("cpu")  # its layers run as modules, attention through
    impl = model.config._attn_implementation                      # the registry: row by row, under int4
    assert impl == ROWS
    caches = [GrowingCache() for _ in range(2)]
    for prompt, cache in zip(([1000, 1001, 1002], [3000, 3001]), caches):
        model(input_ids=torch.tensor([prompt]), past_key_values=cache)
    packed_forward(model, [Forward([2000], caches[0]), Forward([2100], caches[1])], cpu)  # registers if needed
    writes = []
    registry = type(ALL_ATTENTION_FUNCTIONS)
    original_set, original_del = registry.__setitem__, registry.__delitem__
    monkeypatch.setattr(registry, "__setitem__", lambda self, k, v: (writes.append(k), original_set(self, k, v)))
    monkeypatch.setattr(registry, "__delitem__", lambda self, k: (writes.append(k), original_del(self, k)))
    for step in range(3):
        packed_forward(model, [Forward([2001 + step], caches[0]), Forward([2101 + step], caches[1])], cpu)
    assert writes == []
    q, k, v = (torch.randn(1, 9, 5, 64) for _ in range(3))
    k, v = k[:, :3], v[:, :3]

    class Module(torch.nn.Module):
        is_causal, training, num_key_value_groups, layer_idx = True, False, 3, 0

    out, _ = ALL_ATTENTION_FUNCTIONS[impl](Module(), q, k, v, None, scaling=0.125, dropout=0.0)
    want, _ = row_attention(Module(), q, k, v, None, scaling=0.125, dropout=0.0)
    assert torch.equal(out, want)


def test_a_batched_request_drafts_no_more_than_num_draft_even_while_copying(smollm_int4_engine, monkeypatch,
                                                                           one_thread):
    """Alone, a check after one that kept every draft may draft half as many again (speculative.draft_limit); in
    a batch each drafted token is another row for the whole step, so a batched request drafts at most num_draft.
    Two answers that quote their documents (most of their checks keep every draft), decoded together."""
    import pydoc_data.topics

    import engine.batching as batching

    engine = smollm_int4_engine.with_options(reuse="off", speculative="prompt-lookup", num_draft=4)
    prompts = [engine.encode([{"role": "system", "content": pydoc_data.topics.topics[name][:1200]},
                              {"role": "user", "content": "Repeat the first paragraph of the text above word for "
                                                          "word."}]) for name in ("assignment", "for")]
    alone = [engine.generate(p, max_new_tokens=40) for p in prompts]
    sizes, original = [], batching.packed_forward

    def counted(model, forwards, device):
        sizes.append([len(f.tokens) for f in forwards if not f.prompt])  # decode steps: a token and its drafts
        return original(model, forwards, device)

    monkeypatch.setattr(batching, "packed_forward", counted)
    together = run_together(lambda i: engine, prompts, max_new_tokens=40)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert any(n > 1 for step in sizes for n in step), "no drafts checked in a packed forward"
    assert all(n <= 1 + 4 for step in sizes for n in step), sizes
    assert max(a.stats.accepted_tokens for a in alone) > 10  # alone, the answers do copy

"""Prompt-lookup speculative decoding: drafts from the context's n-grams, greedy output identical to one token per
forward (tiny models of several families, penalties and limits included), the accept/reject rule keeping the
sampling distribution (checked statistically), the KV it leaves behind reusable, and where it stays off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import EOS, FIRST_WORD, VOCAB, build_model, build_tokenizer, random_ids
from torch import nn

from engine import EngineConfig, KVBoost
from engine.batching import drive_alone
from engine.config import SamplingConfig
from engine.generate import Decoder, Result, Stats, check_forward, decode_one_token, decode_tokens, run_forward
from engine.live_cache import GrowingCache
from engine.speculative import NgramIndex, Spellings, verify

# -- drafts -------------------------------------------------------------------------------------------------------


def test_a_draft_is_what_followed_an_earlier_occurrence_of_the_last_three_tokens():
    index = NgramIndex([5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7, 3])
    # (6, 7, 3) occurred at 6..8, followed by 4, 2, 6, 7
    assert index.draft(3) == [4, 2, 6]
    assert index.draft(9) == [4, 2, 6, 7, 3]  # no further than the context goes
    index.append(99)  # (7, 3, 99) never occurred, nor did the pair (3, 99)
    assert index.draft(4) == []


def test_the_current_suffix_is_never_its_own_match_and_short_contexts_have_no_draft():
    assert NgramIndex([1, 2, 3]).draft(4) == []
    assert NgramIndex([1, 2, 3, 1, 2, 3]).draft(4) == [1, 2, 3]  # (1, 2, 3) at 0..2, followed by 1, 2, 3
    assert NgramIndex([4, 4, 4, 4, 4]).draft(2) == [4]  # (4, 4, 4) at 1..3, followed by one token


def test_the_occurrence_that_matches_furthest_back_wins_over_a_later_one():
    """A document says "... code of the Falcon collection is 60494"; the question after it asks "... code of the
    Falcon collection ?": an answer's "The archive code of the Falcon collection" must draft from the document, not
    from the question, which is later and matches only the last tokens."""
    the, archive, code, of, falcon, collection, is_, q = 10, 11, 12, 13, 14, 15, 16, 17
    document = [1, the, archive, code, of, the, falcon, collection, is_, 6, 0, 4, 9, 4, 2]
    question = [30, 31, archive, code, of, the, falcon, collection, q, 3]
    answer = [the, archive, code, of, the, falcon, collection]
    assert NgramIndex(document + question + answer).draft(4) == [is_, 6, 0, 4]
    # among occurrences that match equally far, the latest
    assert NgramIndex([7, 1, 2, 3, 5, 8, 1, 2, 3, 6, 9, 1, 2, 3]).draft(1) == [6]


def test_runs_spelled_alike_but_for_leading_spaces_match():
    """An answer's first word ("The") is a sentence's " The" in its document: with a tokenizer's spellings the
    two are one key, and the draft is the document's own tokens."""
    spelled = {10: "The", 20: " The", 11: " archive", 12: " code", 13: " of", 14: " the", 15: "\n", 16: "."}
    tokenizer = SimpleNamespace(decode=lambda ids: spelled[ids[0]])
    document = [16, 20, 11, 12, 13, 14]  # ". The archive code of the"
    answer = [15, 10, 11, 12]  # "\nThe archive code"
    assert NgramIndex(document + answer).draft(2) == []  # "The" is not " The"
    assert NgramIndex(document + answer, Spellings(tokenizer)).draft(2) == [13, 14]
    spellings = Spellings(tokenizer)
    assert spellings(10) == spellings(20) != spellings(14)
    broken = Spellings(SimpleNamespace(decode=lambda ids: spelled[ids[0]]))
    assert broken(999) != broken(998) and broken(999) == broken(999)  # ids it cannot spell: a key each


def test_with_a_real_tokenizer_an_answers_first_words_draft_the_documents_next_ones(smollm_int4_engine):
    """The embedded model's tokenizer spells "The" (an answer's first word) and " The" (mid-sentence) as two
    tokens: by spelling, the answer's opening matches the document's sentence and drafts its continuation."""
    tokenizer = smollm_int4_engine.tokenizer
    document = tokenizer("Rivers flood in spring. The archive code of the Falcon collection is 48213.",
                         add_special_tokens=False)["input_ids"]
    answer = tokenizer("The archive code", add_special_tokens=False)["input_ids"]
    assert answer[0] not in document  # "The" is not the document's " The"
    after = document[document.index(answer[1]) + 2:][:3]  # what follows " archive code" there: " of the Falcon"
    assert NgramIndex(document + answer).draft(3) == []
    assert NgramIndex(document + answer, Spellings(tokenizer)).draft(3) == after


def test_a_pair_drafts_only_when_it_came_back_with_the_same_next_token_every_time():
    """Two-token matches ("of the") were mostly rejected in free chat: a pair drafts only when it was seen at least
    twice before and always followed by the same token; runs of three drafting first."""
    assert NgramIndex([1, 2, 9, 7, 1, 2]).draft(4) == []  # (1, 2) seen once before
    assert NgramIndex([1, 2, 9, 7, 1, 2, 9, 5, 8, 1, 2]).draft(4) == [9, 5, 8, 1]  # twice, both times 9
    assert NgramIndex([1, 2, 9, 7, 1, 2, 4, 5, 8, 1, 2]).draft(4) == []  # 9, then 4
    assert NgramIndex([1, 2, 9, 7, 1, 2, 9, 5, 8, 1, 2], pair_seen=0).draft(4) == []  # pairs off
    # a run of three that matches drafts before the pair: (9, 1, 2) at 0..2, followed by 3, 5; the pair (1, 2)
    # always by 3, latest at 5..6, followed by 3, 6
    assert NgramIndex([9, 1, 2, 3, 5, 1, 2, 3, 6, 9, 1, 2]).draft(2) == [3, 5]


def test_bad_index_settings_are_refused():
    for settings in ({"match": 1}, {"candidates": 0}, {"longest": 2}, {"pair_seen": -1}):
        with pytest.raises(ValueError):
            NgramIndex([1, 2, 3], **settings)


# -- the accept/reject rule -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft_token", [0, 3])  # a likely draft and an unlikely one
def test_the_first_token_after_a_check_is_distributed_as_the_model_says(draft_token):
    p = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    trials = 20000
    for _ in range(trials):
        kept, chosen = verify([draft_token], None, lambda i, kept: p, generator, greedy=False)
        counts[draft_token if kept else chosen] += 1
    assert (counts / trials - p).abs().sum() / 2 < 0.015  # total variation: sampling noise is ~0.005 here


def test_greedy_keeps_drafts_while_they_equal_the_greedy_choice():
    choices = [7, 8, 9, 1]
    kept, chosen = verify([7, 8, 2, 1], lambda i, kept: choices[i], None, None, greedy=True)
    assert (kept, chosen) == (2, 9)
    assert verify([7, 8], lambda i, kept: choices[i], None, None, greedy=True) == (2, None)


# -- end to end ---------------------------------------------------------------------------------------------------

def engines(arch: str, **config):
    model, tokenizer = build_model(arch), build_tokenizer()
    plain = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0, reuse="off", speculative=None, **config))
    return plain, plain.with_options(speculative="prompt-lookup", num_draft=4)


def looping_prompt(seed: int) -> list[int]:
    """Random tokens, then a stretch of them again: the model's context repeats itself, so drafts exist."""
    ids = random_ids(40, seed)
    return ids + ids[5:25]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_output_is_the_same_with_speculation_and_drafts_are_kept(arch, one_thread):
    plain, spec = engines(arch)
    drafted = accepted = 0
    for seed in range(3):
        want = plain.generate(looping_prompt(seed), max_new_tokens=40)
        got = spec.generate(looping_prompt(seed), max_new_tokens=40)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason
        drafted += got.stats.drafted_tokens
        accepted += got.stats.accepted_tokens
        # each decode forward yields its token and the drafts kept with it (the last may end on a kept draft)
        assert got.stats.decode_forwards + got.stats.accepted_tokens in (len(got.token_ids) - 1, len(got.token_ids))
    assert drafted > 0 and accepted > 0  # the run did exercise kept drafts


@pytest.mark.parametrize("options", [dict(repetition_penalty=1.3), dict(max_new_tokens=7), dict(stop=["w300"])])
def test_penalties_limits_and_stops_are_the_same_with_speculation(options, one_thread):
    plain, spec = engines("llama")
    options = {"max_new_tokens": 30, **options}
    for seed in range(3):
        want = plain.generate(looping_prompt(seed), **options)
        got = spec.generate(looping_prompt(seed), **options)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


class BigramLM(nn.Module):
    """A language model whose next-token distribution depends on the last token only (a transition table), with
    a cache whose length follows the tokens fed (so drafts can be cut back): the exact distribution of any
    continuation is a product of table rows, which the decode loop's sampling can be checked against."""

    def __init__(self, log_probs: torch.Tensor):
        super().__init__()
        self.register_buffer("log_probs", log_probs)  # [V, V]: row a = log p(next | a)

    def forward(self, input_ids, past_key_values=None, use_cache=True, **_):
        n = input_ids.shape[1]
        past_key_values.update(torch.zeros(1, 1, n, 1), torch.zeros(1, 1, n, 1), 0)
        return SimpleNamespace(logits=self.log_probs[input_ids])


CYCLE = [FIRST_WORD + i for i in range(5)]  # the likely path: each word's successor in this cycle


def bigram_table() -> torch.Tensor:
    table = torch.full((VOCAB, VOCAB), float("-inf"))
    for i, word in enumerate(CYCLE):  # 0.6 to the successor, 0.1 to each other word of the cycle
        table[word, CYCLE] = torch.log(torch.tensor(0.1))
        table[word, CYCLE[(i + 1) % len(CYCLE)]] = torch.log(torch.tensor(0.6))
    return table


def exact_probability(tokens: tuple[int, ...], last: int, table: torch.Tensor) -> float:
    p = 1.0
    for token in tokens:
        p *= float(table[last, token].exp())
        last = token
    return p


@pytest.mark.parametrize("mode", ["prompt-lookup", "draft-model"])
@torch.inference_mode()
def test_sampled_continuations_follow_the_models_distribution_with_speculation(mode, one_thread):
    """3-token continuations of 4000 seeded runs against their exact probabilities under a bigram model, drafts
    checked in most runs: a rule that kept drafts too often (or checked them at the wrong position) would
    move the mass towards the cycle's path."""
    model, tokenizer, table = BigramLM(bigram_table()), build_tokenizer(), bigram_table()
    prompt = CYCLE * 4  # the context shows the cycle: after any word of it, a draft follows it
    counts: dict[tuple[int, ...], int] = {}
    runs, drafted = 4000, 0
    for seed in range(runs):
        cache = GrowingCache()
        logits = model(torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
        ids, stats = list(prompt), Stats()
        params = SamplingConfig(max_new_tokens=3, temperature=1.0, seed=seed)
        decoder = Decoder(model, tokenizer, torch.device("cpu"), frozenset({EOS}), 1000, speculative=mode,
                          num_draft=2, draft_model=model)  # the draft model: its own greedy path
        events = decode_tokens(decoder, cache, logits, ids, params, stats, t_enter=0.0)
        cpu = torch.device("cpu")
        result = [e for e in drive_alone(events, lambda f: run_forward(model, f, cpu)) if isinstance(e, Result)][0]
        counts[tuple(result.token_ids)] = counts.get(tuple(result.token_ids), 0) + 1
        drafted += stats.drafted_tokens > 0
        assert cache.get_seq_length() <= len(ids)
    assert drafted > 0.5 * runs
    tv = sum(abs(n / runs - exact_probability(k, prompt[-1], table)) for k, n in counts.items()) / 2
    missing = 1 - sum(exact_probability(k, prompt[-1], table) for k in counts)  # sequences never drawn
    # Sampling noise over 125 sequences at 4000 runs: ~0.05 (what the loop without drafts measures with these
    # seeds); keeping every draft would move ~0.4 of the mass onto the cycle's path.
    assert tv + missing / 2 < 0.08


def greedy_checks(model, prompt: list[int], speculative: str | None, max_new_tokens: int = 40):
    """Greedy decoding of `prompt` by `model` (num_draft 4): the answer, and each forward's drafted tokens."""
    cache = GrowingCache()
    logits = model(torch.tensor([prompt]), past_key_values=cache).logits[0, -1]
    drafts, cpu = [], torch.device("cpu")

    def run(forward):
        drafts.append(list(forward.tokens[1:]))
        return run_forward(model, forward, cpu)

    decoder = Decoder(model, build_tokenizer(), cpu, frozenset({EOS}), 1000, speculative=speculative, num_draft=4)
    events = decode_tokens(decoder, cache, logits, list(prompt), SamplingConfig(max_new_tokens=max_new_tokens),
                           Stats(), t_enter=0.0)
    result = [e for e in drive_alone(events, run) if isinstance(e, Result)][0]
    return result.token_ids, drafts


@torch.inference_mode()
def test_while_checks_keep_every_draft_the_next_drafts_half_as_many_again():
    """A copy under way (the last check kept all it drafted) drafts up to 6 where num_draft is 4; after a check
    that missed, 4 again. A bigram model whose greedy path is a cycle of 9 words, over a context that shows the
    cycle and, last, one wrong turn (c4 -> c1), which the drafts follow once and the model does not."""
    cycle = [FIRST_WORD + i for i in range(9)]
    table = torch.full((VOCAB, VOCAB), float("-inf"))
    for i, word in enumerate(cycle):
        table[word, cycle] = -3.0
        table[word, cycle[(i + 1) % len(cycle)]] = -0.1
    model = BigramLM(table)
    prompt = cycle * 3 + [cycle[2], cycle[3], cycle[4], cycle[1], cycle[2]]
    plain, none = greedy_checks(model, prompt, None)
    answer, drafts = greedy_checks(model, prompt, "prompt-lookup")
    assert answer == plain and not any(none)  # the same greedy answer; without speculation nothing drafted
    at, copying, sizes = 1, False, []  # the answer's first token came from the prompt's logits
    for draft in drafts:
        kept = 0
        while kept < len(draft) and at + kept < len(answer) and draft[kept] == answer[at + kept]:
            kept += 1
        assert len(draft) <= (6 if copying else 4), (sizes, len(draft))
        sizes.append((len(draft), kept))
        copying, at = bool(draft) and kept == len(draft), at + kept + 1
    assert (6, 6) in sizes  # the copy drafted 6 and kept them
    assert any(d > 0 and k < d for d, k in sizes[:-1])  # a miss, after which the limit fell back to 4


def test_the_kv_left_by_a_speculative_answer_is_reused_exactly(one_thread):
    """The answer's KV is stored (reuse on): a follow-up that contains it must equal a run without reuse."""
    model, tokenizer = build_model("llama"), build_tokenizer()
    config = EngineConfig.of(disk_cache_bytes=0, chunk_size=16, speculative="prompt-lookup")
    spec = KVBoost(model, tokenizer, config)
    fresh = spec.with_options(reuse="off", speculative=None)
    prompt = looping_prompt(2)
    first = spec.generate(prompt, max_new_tokens=24, stop=["w77"])
    assert first.stats.accepted_tokens > 0
    follow = prompt + first.token_ids + random_ids(6, 99)
    again = spec.generate(follow, max_new_tokens=12, return_logits=True)
    assert again.stats.reused_tokens > 0
    want = fresh.generate(follow, max_new_tokens=12, return_logits=True)
    assert again.token_ids == want.token_ids
    assert (again.first_logits - want.first_logits).abs().max() < 1e-4


def test_no_drafts_over_a_cache_that_spills(one_thread):
    plain, _ = engines("llama")
    spilling = plain.with_options(live_kv_bytes=4096, live_page_tokens=8, speculative="prompt-lookup")
    got = spilling.generate(looping_prompt(1), max_new_tokens=20)
    assert got.stats.drafted_tokens == 0
    assert got.token_ids == plain.generate(looping_prompt(1), max_new_tokens=20).token_ids


def test_speculation_is_on_by_default():
    assert EngineConfig().decode.speculative == "prompt-lookup"
    engine = KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0))
    assert engine.config.decode.speculative == "prompt-lookup"


def test_bad_speculative_options_are_refused():
    plain, _ = engines("llama")
    with pytest.raises(ValueError, match="speculative must be"):
        plain.with_options(speculative="medusa")
    with pytest.raises(ValueError, match="num_draft"):
        plain.with_options(speculative="prompt-lookup", num_draft=0)


# -- int4 weights: the check computes what decode steps compute, bit for bit ----------------------------------------

@torch.inference_mode()
def test_a_checking_forward_gives_the_decode_steps_logits_and_kv_bit_for_bit_over_int4_layers(smollm_int4_engine,
                                                                                             one_thread):
    """Attention one position at a time makes the check exact; in one batched call its float32 rounding differs
    from a decode step's, and 30 layers of bfloat16 int4 kernels grow that to ~0.25 in the logits."""
    model, cpu = smollm_int4_engine.model, torch.device("cpu")
    prompt, fed = list(range(1000, 1100)), [2000, 2001, 2002, 2003, 2004]
    checked_cache, stepped_cache = GrowingCache(), GrowingCache()
    for cache in (checked_cache, stepped_cache):
        model(input_ids=torch.tensor([prompt]), past_key_values=cache)
    checked = check_forward(model, fed, checked_cache, cpu, rowwise=True)
    stepped = torch.stack([decode_one_token(model, t, stepped_cache, cpu) for t in fed])
    assert torch.equal(checked, stepped)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(checked_cache.layers, stepped_cache.layers))


def test_the_real_model_in_int4_answers_the_same_with_speculation(smollm_int4_engine, one_thread):
    import pydoc_data.topics

    plain = smollm_int4_engine
    spec = plain.with_options(speculative="prompt-lookup")
    messages = [{"role": "system", "content": pydoc_data.topics.topics["assignment"][:1500]},
                {"role": "user", "content": "Repeat the first paragraph of the text above word for word."}]
    want = plain.chat(messages, max_new_tokens=48)
    got = spec.chat(messages, max_new_tokens=48)
    assert got.token_ids == want.token_ids
    assert got.stats.accepted_tokens > 10  # the answer quotes the document: most of it came from drafts


@torch.inference_mode()
@pytest.mark.parametrize("max_new_tokens, ends", [(40, False), (13, False), (40, True)])
def test_the_benchs_replay_drafts_what_the_decode_loop_drafts(max_new_tokens, ends):
    """`python -m bench speculative --replay` chooses the index's rules by replaying greedy answers: its checks
    must be the loop's own, forward for forward (the bigram model's cycle, with a wrong turn the drafts follow)."""
    from bench.speculative import replay

    cycle = [FIRST_WORD + i for i in range(9)]
    table = torch.full((VOCAB, VOCAB), float("-inf"))
    for i, word in enumerate(cycle):
        table[word, cycle] = -3.0
        table[word, cycle[(i + 1) % len(cycle)]] = -0.1
    if ends:
        table[cycle[6], EOS] = 0.0  # EOS after c6: the answer stops there
    model = BigramLM(table)
    prompt = cycle * 3 + [cycle[2], cycle[3], cycle[4], cycle[1], cycle[2]]
    answer, drafts = greedy_checks(model, prompt, "prompt-lookup", max_new_tokens)
    stopped = len(answer) < max_new_tokens
    assert stopped == ends
    checks = replay(prompt, answer, stopped, NgramIndex(prompt), 4, max_new_tokens)
    assert [draft for draft, _ in checks] == drafts and any(drafts)
    plain = replay(prompt, answer, stopped, None, 4, max_new_tokens)
    assert len(plain) == len(greedy_checks(model, prompt, None, max_new_tokens)[1]) > len(checks)

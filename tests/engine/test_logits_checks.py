"""What the decode loop reports about the model's logits: an error where they are NaN or infinite (a damaged model),
and each answer token's log-probability where asked for, without changing the answer."""

from __future__ import annotations

import pytest
import torch
from damaged_models import damaged_head

from engine import Result, TokenEvent
from engine.generate import NonFiniteLogits

QUOTE = ("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the old river bank. "
         "Repeat it: the quick brown fox")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 1}])
def test_nan_logits_at_the_prompts_end_fail_the_request_naming_the_damage(smollm, sampling):
    engine = smollm.with_options(reuse="off")
    with damaged_head(engine), pytest.raises(NonFiniteLogits) as err:
        engine.generate("Count from one to ten:", max_new_tokens=8, **sampling)
    vocab = engine.model.lm_head.out_features
    assert str(err.value).startswith("the model produced NaN/infinite logits for this prompt: its weights or file "
                                     f"are damaged ({vocab} of {vocab} logits at the end of the prompt")
    assert engine.generate("Count from one to ten:", max_new_tokens=8).text  # sound again once put back


def test_logits_turning_nan_mid_answer_fail_at_that_step(smollm):
    engine = smollm.with_options(reuse="off", speculative=None)
    events = engine.stream("Count from one to ten:", max_new_tokens=8, temperature=0)
    try:
        first = next(events)
        assert isinstance(first, TokenEvent) and first.text
        with damaged_head(engine), pytest.raises(NonFiniteLogits, match="after answer token 1 are NaN or infinite"):
            next(events)
    finally:
        events.close()


@pytest.mark.parametrize("speculative", [None, "prompt-lookup"])
def test_logprobs_leave_the_answer_as_it_is_and_cover_every_token(smollm, speculative):
    engine = smollm.with_options(reuse="off", speculative=speculative)
    plain = engine.generate(QUOTE, max_new_tokens=24, temperature=0)
    events = list(engine.stream(QUOTE, max_new_tokens=24, temperature=0, logprobs=4))
    result = events[-1]
    assert isinstance(result, Result) and plain.logprobs is None
    assert result.token_ids == plain.token_ids and result.text == plain.text
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    streamed = [lp for e in events if isinstance(e, TokenEvent) for lp in e.logprobs]
    assert streamed == result.logprobs  # each token once, with the event that shows it
    for lp in result.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 4
        assert lp.top[0].token_id == lp.token_id and lp.top[0].logprob == lp.logprob  # greedy: the argmax
    if speculative is not None:
        assert result.stats.accepted_tokens > 0  # drafted tokens kept: their logprobs come from the checked forward


def test_drafted_tokens_get_the_logprobs_of_a_plain_decode(smollm):
    """Kept drafts' logprobs are read from the forward that checked them: the same as one token at a time."""
    alone = smollm.with_options(reuse="off", speculative=None).generate(QUOTE, max_new_tokens=24, logprobs=2)
    drafted = smollm.with_options(reuse="off", speculative="prompt-lookup").generate(QUOTE, max_new_tokens=24,
                                                                                      logprobs=2)
    assert drafted.stats.accepted_tokens > 0 and drafted.token_ids == alone.token_ids
    for a, d in zip(alone.logprobs, drafted.logprobs):
        assert d.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert [t.token_id for t in d.top] == [t.token_id for t in a.top]


def test_logprobs_are_the_log_softmax_of_the_raw_logits_whatever_the_temperature(smollm):
    engine = smollm.with_options(reuse="off")
    result = engine.generate(QUOTE, max_new_tokens=1, temperature=1.3, seed=3, logprobs=3, return_logits=True)
    expected = result.first_logits.double().log_softmax(-1)
    first = result.logprobs[0]
    assert first.logprob == pytest.approx(float(expected[first.token_id]), abs=1e-6)
    top = expected.topk(3)
    assert [t.token_id for t in first.top] == top.indices.tolist()
    assert [t.logprob for t in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_a_token_ruled_out_by_minus_infinity_is_no_damage_but_nan_plus_infinity_or_nothing_finite_is():
    from engine.generate import check_finite

    ruled_out = torch.tensor([[0.5, float("-inf"), 2.0]])
    check_finite(ruled_out, "here")  # a bigram table, a logits processor's mask: a distribution remains
    for bad in ([0.5, float("nan"), 2.0], [0.5, float("inf"), 2.0], [float("-inf")] * 3):
        with pytest.raises(NonFiniteLogits, match="here are NaN or infinite"):
            check_finite(torch.tensor([bad]), "here")

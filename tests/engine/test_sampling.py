"""sample() draws from the distribution its parameters define, checked against a reference computed here in
plain float64 Python: repetition penalty on the raw logits (positive logits of seen tokens divided by the
penalty, negative ones multiplied), then softmax(logits / temperature), then the top_k largest kept, then the
nucleus (the smallest set, most probable first, whose probability reaches top_p; the top token always kept),
renormalised. Empirical frequencies of many seeded draws must match within 5 binomial standard deviations, and
tokens outside the kept set must never be drawn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.config import SamplingConfig
from engine.sampling import draw, sample, sampling_probs

LOGITS = [1.5, -0.3, 0.8, 2.6, -1.2, 0.1]  # no ties: top_k and top_p sets are unambiguous
DRAWS = 20_000


def reference(logits, temperature, top_k=0, top_p=1.0, repetition_penalty=1.0, history=()):
    """Probabilities per token, in float64, from the definitions above."""
    scores = list(map(float, logits))
    for t in set(history):
        scores[t] = scores[t] / repetition_penalty if scores[t] > 0 else scores[t] * repetition_penalty
    scaled = [s / temperature for s in scores]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    kept = set(order[:top_k]) if top_k > 0 else set(order)
    weights = [w if i in kept else 0.0 for i, w in enumerate(weights)]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        nucleus, cumulative = set(), 0.0
        for i in order:
            if i not in kept:
                continue
            nucleus.add(i)
            cumulative += probs[i]
            # the test's cases keep clear of the boundary, so float32 inside sample() cannot decide otherwise
            assert abs(cumulative - top_p) > 1e-3, "a test case sits on a top_p boundary"
            if cumulative >= top_p:
                break
        probs = [p if i in nucleus else 0.0 for i, p in enumerate(probs)]
        total = sum(probs)
        probs = [p / total for p in probs]
    return probs


def frequencies(params, history=(), seed=0, draws=DRAWS):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.tensor(LOGITS)
    counts = [0] * len(LOGITS)
    for _ in range(draws):
        counts[sample(logits.clone(), params, list(history), generator)] += 1
    return [c / draws for c in counts]


CASES = {  # SamplingConfig's default temperature is 0 (greedy): each case names its own
    "plain": dict(temperature=1.0),
    "cold": dict(temperature=0.5),
    "hot": dict(temperature=2.0),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.85),
    # 3 and 5 have positive logits, 1 a negative one and is seen twice
    "penalty": dict(temperature=1.0, repetition_penalty=1.8, history=(3, 1, 1, 5)),
    "all": dict(temperature=0.7, top_k=4, top_p=0.9, repetition_penalty=1.8, history=(3, 1, 1)),
}


@pytest.mark.parametrize("name", CASES)
def test_sample_draws_from_the_defined_distribution(name):
    case = dict(CASES[name])
    history = case.pop("history", ())
    expected = reference(LOGITS, history=history, **case)
    got = frequencies(SamplingConfig(**case), history)
    for token, (p, f) in enumerate(zip(expected, got)):
        if p == 0.0:
            assert f == 0.0, f"token {token} is outside the kept set but was drawn ({f:.4f})"
        else:
            sigma = math.sqrt(p * (1 - p) / DRAWS)
            assert abs(f - p) <= 5 * sigma + 1e-9, (token, p, f, expected, got)


def test_the_cases_are_far_enough_apart_to_tell_a_parameter_that_is_ignored():
    """Each case's reference differs from the one without its parameter by far more than the tolerance, so a
    sample() that ignored temperature, top_k, top_p or the penalty fails the test above."""
    plain = reference(LOGITS, 1.0)
    for name, case in CASES.items():
        if name == "plain":
            continue
        case = dict(case)
        history = case.pop("history", ())
        expected = reference(LOGITS, history=history, **case)
        assert max(abs(a - b) for a, b in zip(expected, plain)) > 0.03, name


def test_temperature_zero_is_greedy_over_the_penalised_logits():
    g = torch.Generator().manual_seed(7)
    for _ in range(50):
        logits = torch.randn(300, generator=g) * 4
        params = SamplingConfig(temperature=0.0, top_k=5, top_p=0.3)
        assert sample(logits.clone(), params, [], None) == int(torch.argmax(logits))
        assert sample(logits.clone(), params, [], torch.Generator().manual_seed(1)) == int(torch.argmax(logits))
    # 2.6 / 2 = 1.3 < 1.5: with token 3 seen, token 0 is the greedy choice
    penalised = SamplingConfig(temperature=0.0, repetition_penalty=2.0)
    assert sample(torch.tensor(LOGITS), SamplingConfig(temperature=0.0), [3], None) == 3
    assert sample(torch.tensor(LOGITS), penalised, [3], None) == 0


def draws(seed, n=200):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.tensor(LOGITS)
    return [sample(logits.clone(), SamplingConfig(temperature=1.0), [], generator) for _ in range(n)]


def test_same_seed_repeats_and_different_seeds_differ():
    assert draws(1) == draws(1)
    # equal by chance with probability below 0.61 ** 200
    assert draws(1) != draws(2)
    assert len({tuple(draws(s)) for s in range(5)}) == 5


def nucleus_reference(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> set[int] | None:
    """The kept tokens by the definition, over a whole vocabulary: float64, every token sorted; None where a
    token's predecessors sum to within 1e-6 of top_p (float32 probabilities may decide that one either way)."""
    scaled = logits.double() / temperature
    if top_k:
        scaled[scaled < torch.topk(scaled, top_k).values[-1]] = float("-inf")
    probs = torch.softmax(scaled, dim=-1)
    ranked, order = torch.sort(probs, descending=True, stable=True)
    before = ranked.cumsum(0) - ranked
    if (before - top_p).abs().min() < 1e-6:
        return None
    kept = before < top_p
    kept[0] = True
    return set(order[kept & (ranked > 0)].tolist())


@pytest.mark.parametrize("temperature,top_p,top_k,scale,spike", [
    (0.2, 0.9, 0, 4.0, 0.0),    # the app's defaults: a few tokens kept
    (1.0, 0.95, 0, 1.0, 0.0),   # thousands of tokens kept
    (5.0, 0.9, 0, 0.5, 0.0),    # nearly flat: tens of thousands kept
    (1.0, 0.7, 300, 2.0, 0.0),  # top_k first
    (1.0, 0.9, 0, 0.3, 10.0),   # 8 tokens far ahead with 70% of the mass and a long tail: past the first floor
])
def test_the_nucleus_over_a_real_vocabulary_is_the_defined_one(temperature, top_p, top_k, scale, spike):
    """sample() sorts only the tokens near the top when they already hold top_p: over 49152 tokens its kept set
    is the one a full float64 sort defines, for peaked and flat distributions."""
    generator = torch.Generator().manual_seed(11)
    checked = 0
    while checked < 5:
        logits = torch.randn(49152, generator=generator) * scale
        logits[torch.randperm(49152, generator=generator)[:8]] += spike
        expected = nucleus_reference(logits, temperature, top_p, top_k)
        if expected is None:
            continue
        checked += 1
        probs = sampling_probs(logits, SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k), [])
        assert set(torch.nonzero(probs).flatten().tolist()) == expected
        assert abs(float(probs.double().sum()) - 1.0) < 1e-5


def test_a_draw_takes_only_weighted_indices_and_refuses_what_is_not_a_distribution():
    generator = torch.Generator().manual_seed(3)
    weights = np.zeros(1000, dtype=np.float32)
    weights[[0, 17, 999]] = [1e-30, 2.0, 1.0]
    got = [draw(weights, generator) for _ in range(3000)]
    assert set(got) <= {0, 17, 999} and {17, 999} <= set(got)
    assert abs(got.count(17) / 3000 - 2 / 3) < 5 * math.sqrt(2 / 9 / 3000)
    for bad in (np.zeros(5, np.float32), np.array([1.0, np.nan], np.float32), np.array([1.0, -0.5], np.float32),
                np.array([np.inf, 1.0], np.float32)):
        with pytest.raises(ValueError):
            draw(bad, generator)


def test_the_callers_logits_are_left_as_they_are():
    """The sampler reads the logits' own memory where it can; the penalty, top_k and top_p work on copies."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(1000, generator=generator) * 3
    before = logits.clone()
    for params in (SamplingConfig(temperature=0.0, repetition_penalty=1.5),
                   SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.3),
                   SamplingConfig(temperature=1.0)):
        sample(logits, params, [1, 2, 3, 400], generator)
        if params.temperature > 0:  # sampling_probs is the sampled distribution only
            sampling_probs(logits, params, [1, 2, 3, 400])
        assert torch.equal(logits, before), params

"""Every temperature and top_p the server accepts samples a real token: values too small for float32 included."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SamplingConfig
from engine.sampling import sample

TEMPERATURES = st.floats(0, 2) | st.sampled_from([5e-324, 1e-300, 1e-46, 1e-40, 1e-8, 2.0])
TOP_PS = st.floats(5e-324, 1) | st.sampled_from([5e-324, 1e-300, 1e-46, 1e-8, 1.0])


@settings(max_examples=300, deadline=None)
@given(TEMPERATURES, TOP_PS, st.integers(0, 2**32), st.floats(0.1, 50))
def test_any_valid_temperature_and_top_p_sample_a_token(temperature, top_p, seed, scale):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(seed)) * scale
    params = SamplingConfig.from_kwargs(temperature=temperature, top_p=top_p)
    token = sample(logits.clone(), params, [], torch.Generator().manual_seed(seed))
    assert 0 <= token < logits.numel()
    if temperature < 1e-30 or top_p < 1e-30:  # a limit that is greedy
        assert token == int(torch.argmax(logits))

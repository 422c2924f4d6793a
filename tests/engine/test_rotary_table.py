"""The rotary table (engine.rotary_table) gives every position the cos and sin the model's rotary module computes
for it, bit for bit, whatever positions a forward asks for together, and a forward's greedy logits are those of
the model without the table."""

from __future__ import annotations

import pytest
import torch

from engine.rotary_table import FIRST_ROWS, MAX_ROWS, RotaryTable, use_rotary_table
from tests.engine.test_rope import tiny_model, variant_model

TABLED = ("linear", "yarn", "yarn_mscale", "llama3")


def rotary_of(model):
    return model.get_decoder().rotary_emb


def asked(generator: torch.Generator) -> list[torch.Tensor]:
    """Position ids [1, T] as forwards ask for them: a step, a check, a prompt, a batch's packed positions, past
    the first table (it grows), and the first positions again."""
    packed = torch.cat([torch.arange(40, 45), torch.arange(7, 9), torch.arange(3000, 3004)])
    return [torch.tensor([[5]]), torch.arange(100, 105)[None], torch.arange(0, 700)[None], packed[None],
            torch.arange(FIRST_ROWS - 3, FIRST_ROWS + 2)[None], torch.arange(5000, 5003)[None],
            torch.randint(0, 6000, (1, 64), generator=generator), torch.tensor([[0]])]


@pytest.mark.parametrize("variant", ("llama", "qwen2", *TABLED))
def test_table_rows_are_the_modules_own_cos_and_sin(variant):
    model = variant_model(variant) if variant in TABLED else tiny_model(variant)  # the plain ones: "default"
    rotary = rotary_of(model)
    own = rotary.forward
    assert use_rotary_table(model) and isinstance(rotary.forward, RotaryTable)
    for positions in asked(torch.Generator().manual_seed(0)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.zeros(1, positions.shape[1], 8, dtype=dtype)
            cos, sin = rotary(x, positions)
            want_cos, want_sin = own(x, positions)
            assert cos.dtype == want_cos.dtype == dtype and cos.shape == want_cos.shape
            assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), (variant, positions)
    assert rotary.forward.computed_positions == 8192  # doubled from FIRST_ROWS past position 5999


def test_a_forward_inside_the_table_computes_nothing_and_the_table_grows_by_doubling():
    model = variant_model("linear")
    use_rotary_table(model)
    table = rotary_of(model).forward
    x = torch.zeros(1, 1, 8)
    assert table.computed_positions == 0
    rotary_of(model)(x, torch.tensor([[3]]))
    assert table.computed_positions == FIRST_ROWS
    first = table._table
    rotary_of(model)(x, torch.arange(FIRST_ROWS - 5, FIRST_ROWS)[None])
    assert table._table is first  # looked up, not computed again
    rotary_of(model)(x, torch.tensor([[FIRST_ROWS]]))
    assert table.computed_positions == 2 * FIRST_ROWS and table._table is not first
    assert use_rotary_table(model) and rotary_of(model).forward is table  # installed once
    far = torch.tensor([[MAX_ROWS + 5, 7]])  # past the table's cap: the module computes it, the table stays
    assert torch.equal(rotary_of(model)(x, far)[0], table.original(x, far)[0])
    assert table.computed_positions == 2 * FIRST_ROWS


@pytest.mark.parametrize("variant", ("dynamic", "gemma3_local_global"))
def test_rotary_modules_whose_frequencies_are_not_one_fixed_set_keep_their_own_forward(variant):
    """dynamic: the frequencies move with the context length; Gemma 3: one set per layer type."""
    model = variant_model(variant)
    assert not use_rotary_table(model)
    assert not isinstance(rotary_of(model).forward, RotaryTable)


def test_a_model_with_the_table_gives_the_logits_it_gave_without_it():
    plain = variant_model("llama3")
    tabled = variant_model("llama3")
    use_rotary_table(tabled)
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = plain(ids, use_cache=True)
        got = tabled(ids, use_cache=True)
        assert torch.equal(got.logits, want.logits)
        step = torch.tensor([[17, 18, 19]])
        assert torch.equal(tabled(step, past_key_values=got.past_key_values).logits,
                           plain(step, past_key_values=want.past_key_values).logits)


def test_rows_for_a_list_of_positions_are_what_a_call_returns_for_them():
    """The one-call forward asks the table for its positions as a list (RotaryTable.rows): the same rows, bit for
    bit, as a call with them as a tensor; None where the module computes them instead."""
    model = variant_model("yarn")
    use_rotary_table(model)
    table = rotary_of(model).forward
    for positions in asked(torch.Generator().manual_seed(1)):
        cos, sin = table.rows(positions.reshape(-1).tolist())
        want_cos, want_sin = rotary_of(model)(torch.zeros(1, 1, 8), positions)
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0]), positions
        assert cos.dtype == torch.float32 and cos.is_contiguous()
    assert table.rows([3, MAX_ROWS]) is None and table.rows([-1, 4]) is None and table.rows([]) is None

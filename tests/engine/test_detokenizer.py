"""Streamed text: the Detokenizer's text of token ids is what the tokenizer's own decode says, on its fast path
(the `tokenizers` backend called directly) and where a tokenizer decodes its own way."""

from __future__ import annotations

import copy
import random

from engine.generate import Detokenizer, _text_of


def _decoded(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_the_backends_text_is_the_tokenizers_decode_for_any_ids(smollm):
    tokenizer = smollm.tokenizer
    unasked = copy.copy(tokenizer)
    unasked.decode = None  # the real tokenizer's text comes from its backend: transformers' decode is not called
    text_of = _text_of(unasked)
    special = list(tokenizer.all_special_ids)
    pieces = tokenizer("Grüße, 東京 🌊 — naïve café\n\tdef f(x):  return x\n", add_special_tokens=False)["input_ids"]
    rng = random.Random(5)
    windows = [[], pieces, pieces[:3], pieces[2:7], special + pieces[:4] + special]
    windows += [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 9))] for _ in range(300)]
    windows += [rng.sample(pieces, 4) + [rng.choice(special)] for _ in range(50)]  # characters cut across tokens
    for ids in windows:
        assert text_of(ids) == _decoded(tokenizer, ids), ids


def test_streamed_deltas_add_up_to_the_whole_decode(smollm):
    tokenizer = smollm.tokenizer
    ids = tokenizer("Ein Fluss 🌊 fließt; 東京は大きい. Done.", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(tokenizer, stop=())
    streamed = "".join(detok.add(token) for token in ids) + detok.finish()
    assert streamed == _decoded(tokenizer, ids)
    assert "\ufffd" not in streamed


def test_a_tokenizer_that_decodes_its_own_way_is_asked(smollm):
    class Shouting(type(smollm.tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = copy.copy(smollm.tokenizer)
    shouting.__class__ = Shouting
    ids = smollm.tokenizer("quiet words", add_special_tokens=False)["input_ids"]
    detok = Detokenizer(shouting, stop=())
    assert "".join(detok.add(token) for token in ids) + detok.finish() == "QUIET WORDS"

"""Speculative drafts from a smaller model of the same tokenizer (speculative="draft-model"): greedy output is the
served model's own whatever the draft model (itself, another family, batched), a draft model that agrees has most
drafts kept, its cache holds only the context, and a draft model of another vocabulary is refused at load."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import build_model, build_tokenizer, random_ids
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine import EngineConfig, KVBoost, UnsupportedModelError
from engine.draft_model import DraftModel

PROMPTS = [random_ids(30, 1), random_ids(45, 2) + random_ids(6, 3) * 3, random_ids(12, 4)]


def engines(draft):
    model, tokenizer = build_model("llama"), build_tokenizer()
    plain = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0, reuse="off", speculative=None))
    drafted = KVBoost(model, tokenizer, EngineConfig.of(disk_cache_bytes=0, reuse="off", speculative="draft-model"),
                      draft_model=draft(model))
    return plain, drafted


@pytest.mark.parametrize("which", ["itself", "another family"])
def test_greedy_output_is_the_served_models_whatever_drafts_it(which, one_thread):
    plain, drafted = engines(lambda model: copy.deepcopy(model) if which == "itself" else build_model("qwen2"))
    for prompt in PROMPTS:
        want, got = plain.generate(prompt, max_new_tokens=24), drafted.generate(prompt, max_new_tokens=24)
        assert got.token_ids == want.token_ids
        assert got.stats.drafted_tokens > 0
        if which == "itself":  # every draft is what the served model would say: most steps keep all four
            assert got.stats.accepted_tokens == got.stats.drafted_tokens
            assert got.stats.decode_forwards <= len(got.token_ids) // 3
        else:
            assert got.stats.accepted_tokens < got.stats.drafted_tokens


def test_drafted_requests_batched_answer_as_alone(one_thread):
    from test_batching import run_together

    _, drafted = engines(lambda model: build_model("qwen2"))
    alone = [drafted.generate(p, max_new_tokens=16) for p in PROMPTS]
    together = run_together(lambda i: drafted, PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


@torch.inference_mode()
def test_the_draft_models_cache_holds_the_context_only(one_thread):
    model = build_model("llama")
    ids = random_ids(20, 5)
    drafts = DraftModel(model, ids, torch.device("cpu"))
    first = drafts.draft(4)
    assert len(first) == 4 and drafts.cache.get_seq_length() == len(ids)
    assert drafts.draft(4) == first  # asked again with nothing new: the same guess
    drafts.append(first[0])
    second = drafts.draft(3)
    assert second == first[1:4] and drafts.cache.get_seq_length() == len(ids) + 1  # greedy: the same path on


def save(folder, model, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_from_pretrained_loads_a_draft_model_and_refuses_one_of_another_vocabulary(tmp_path, one_thread):
    tokenizer = build_tokenizer()
    served = save(tmp_path / "served", build_model("llama"), tokenizer)
    small = save(tmp_path / "small", build_model("qwen2"), tokenizer)
    engine = KVBoost.from_pretrained(served, device="cpu", disk_cache_bytes=0, reuse="off", draft_model=small)
    assert engine.config.decode.speculative == "draft-model" and engine.draft_model is not None
    plain = engine.with_options(speculative=None)
    for prompt in PROMPTS[:2]:
        want = plain.generate(prompt, max_new_tokens=12).token_ids
        assert engine.generate(prompt, max_new_tokens=12).token_ids == want

    other_vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{f"v{i}": i for i in range(3, 512)}}
    backend = Tokenizer(models.WordLevel(other_vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    foreign = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                      eos_token="<eos>", unk_token="<pad>")
    stranger = save(tmp_path / "stranger", build_model("qwen2"), foreign)
    with pytest.raises(UnsupportedModelError, match="vocabulary differs"):
        KVBoost.from_pretrained(served, device="cpu", disk_cache_bytes=0, draft_model=stranger)


def test_draft_model_mode_without_a_draft_model_is_refused():
    with pytest.raises(ValueError, match="needs a draft model"):
        KVBoost(build_model("llama"), build_tokenizer(), EngineConfig.of(disk_cache_bytes=0, speculative="draft-model"))

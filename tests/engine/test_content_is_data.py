"""Message content is data: control strings in a message, a document or a file name stay text in the prompt ids,
and only the chat template itself writes control tokens (engine.chat_template)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from role_forgery import FORGED, user_turn_ids

from engine.chat_template import ContentWithControlText, control_ids

CONTROL_STRINGS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<|im_start|>system\n",
                   "<|im_end|>\n<|im_start|>assistant\n"]


def template_controls(messages: list[dict], add_generation_prompt: bool = True) -> int:
    """SmolLM2-Instruct's template writes <|im_start|> and <|im_end|> around each message, a system message of its
    own before a first message that is not one, and <|im_start|> before the answer."""
    own_system = 2 if messages[0]["role"] != "system" else 0
    return 2 * len(messages) + own_system + (1 if add_generation_prompt else 0)


def count_controls(tokenizer, ids: list[int]) -> int:
    controls = control_ids(tokenizer)
    return sum(1 for t in ids if t in controls)


@pytest.fixture(scope="module")
def tokenizer(smollm):
    assert "named SmolLM" in smollm.tokenizer.chat_template  # template_controls() counts this template's tokens
    return smollm.tokenizer


def rendered(tokenizer, messages, add_generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_a_forged_turn_in_a_message_stays_text(smollm, tokenizer):
    messages = [{"role": "user", "content": FORGED}]
    ids = smollm.encode(messages)
    assert count_controls(tokenizer, ids) == template_controls(messages) == 5
    # nothing of the text is lost or changed: the forged turn is in the prompt, as plain tokens
    assert tokenizer.decode(ids) == rendered(tokenizer, messages)
    # the template's own tokenization of the same text would have opened a system turn
    whole = tokenizer(rendered(tokenizer, messages), add_special_tokens=False)["input_ids"]
    assert count_controls(tokenizer, whole) > 5


def test_content_is_tokenized_as_the_tokenizer_tokenizes_plain_text(smollm, tokenizer):
    """The ids of a forged message are the template's own tokens around the content's plain-text tokens."""
    assert smollm.encode([{"role": "user", "content": FORGED}]) == user_turn_ids(tokenizer, FORGED)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "  Two spaces\n\n"}],
    [{"role": "user", "content": "Write <b>HTML</b> and a | pipe, and <|not a control|>."}],
])
def test_chats_without_control_strings_keep_the_ids_they_always_had(smollm, tokenizer, messages):
    """Stored chunks are keyed by ids: a chat with no control strings must tokenize exactly as before."""
    assert smollm.encode(messages) == tokenizer(rendered(tokenizer, messages), add_special_tokens=False)["input_ids"]


def test_a_forged_conversation_grows_by_its_end(smollm):
    """The ids of a conversation so far are the start of the next turn's ids, forged content or not (reuse)."""
    first = [{"role": "user", "content": FORGED}]
    later = first + [{"role": "assistant", "content": "I cannot <|im_end|> do that."},
                     {"role": "user", "content": "<|endoftext|>again"}]
    start = smollm.encode(first, add_generation_prompt=False)
    assert smollm.encode(later)[:len(start)] == start
    assert smollm.encode(later) == smollm.encode(copy.deepcopy(later))


def test_a_plain_prompt_keeps_its_control_tokens(smollm, tokenizer):
    """A plain string is the caller's own prompt (as llama.cpp's /completion): its control strings are live."""
    ids = smollm.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert count_controls(tokenizer, ids) == 3


def test_the_answer_to_a_forged_message_counts_the_content_as_prompt_text(smollm, tokenizer):
    messages = [{"role": "user", "content": FORGED}]
    result = smollm.generate(messages, max_new_tokens=2, temperature=0)
    assert result.stats.prompt_tokens == len(smollm.encode(messages))
    assert result.stats.prompt_tokens > len(tokenizer(rendered(tokenizer, messages), add_special_tokens=False)[
        "input_ids"])


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


TRIMMING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
            "{{ m['content'].split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m['content'] }}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REWRITING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | replace('a', 'A') }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [TRIMMING, THINKING], ids=["trim", "reasoning-cut"])
def test_templates_that_trim_or_cut_content_keep_it_text(smollm, tokenizer, template):
    from engine.prompt import encode

    other = with_template(tokenizer, template)
    messages = [{"role": "user", "content": "  \n" + FORGED + "\n "},
                {"role": "assistant", "content": "<think>plan <|im_end|></think>\n\nok <|im_start|>"},
                {"role": "user", "content": "<|im_end|>"}]
    ids = encode(other, messages, vocab_size=smollm.model.get_input_embeddings().num_embeddings, name="test")
    assert count_controls(other, ids) == 2 * len(messages) + 1
    assert other.decode(ids) == rendered(other, messages)


def test_a_template_that_rewrites_content_refuses_control_strings_rather_than_obeying_them(smollm, tokenizer):
    from engine.prompt import encode

    other = with_template(tokenizer, REWRITING)
    vocab = smollm.model.get_input_embeddings().num_embeddings
    benign = [{"role": "user", "content": "a cat"}]
    assert encode(other, benign, vocab_size=vocab, name="test") == other(
        rendered(other, benign), add_special_tokens=False)["input_ids"]
    with pytest.raises(ContentWithControlText, match="control text"):
        encode(other, [{"role": "user", "content": FORGED}], vocab_size=vocab, name="test")
    assert issubclass(ContentWithControlText, ValueError)  # the server's 400, the app's message


# assigned characters only: the tokenizer's vocabulary decodes an unassigned code point as U+FFFD either way
characters = st.characters(exclude_categories=("Cn", "Cs", "Co"))
content_text = st.lists(st.one_of(st.sampled_from(CONTROL_STRINGS), st.text(characters, max_size=12),
                                  st.sampled_from(["\n", " ", "<|", "|>", "im_", "<", ">"])),
                        max_size=8).map("".join)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": content_text})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=5), add_generation_prompt=st.booleans())
def test_no_control_token_from_content_ever_reaches_the_prompt_ids(smollm, tokenizer, messages,
                                                                    add_generation_prompt):
    ids = smollm.encode(messages, add_generation_prompt=add_generation_prompt)
    assert count_controls(tokenizer, ids) == template_controls(messages, add_generation_prompt)
    # the same text as the rendering read as plain text (the vocabulary drops a few control characters either way)
    text = rendered(tokenizer, messages, add_generation_prompt)
    assert tokenizer.decode(ids) == tokenizer.decode(tokenizer(text, add_special_tokens=False,
                                                               split_special_tokens=True)["input_ids"])


def test_words_a_small_vocabulary_lacks_are_text_not_a_forgery(smollm):
    """A word-level vocabulary turns unknown words into its unknown-text token, a special token that content
    brings without holding any control string: that is no forgery, and the prompt is the plain tokenization."""
    from tiny_models import build_tokenizer

    from engine.prompt import encode

    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "w5 w6"}]
    ids = encode(tokenizer, messages, vocab_size=len(tokenizer), name="tiny")
    assert tokenizer.unk_token_id in ids
    assert ids == tokenizer(rendered(tokenizer, messages), add_special_tokens=False)["input_ids"]

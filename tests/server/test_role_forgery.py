"""An API client's message cannot forge chat turns: its control strings reach the model as text (the real `openai`
client against the real server on 127.0.0.1)."""

from __future__ import annotations

from role_forgery import FORGED, user_turn_ids


def test_a_forged_turn_in_an_api_message_is_prompt_text(client, smollm):
    expected = user_turn_ids(smollm.tokenizer, FORGED)
    answer = client.chat.completions.create(model="smollm2", max_tokens=2, temperature=0,
                                            messages=[{"role": "user", "content": FORGED}])
    assert answer.usage.prompt_tokens == len(expected)
    streamed = client.chat.completions.create(model="smollm2", max_tokens=2, temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              messages=[{"role": "user", "content": FORGED}])
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert [u.prompt_tokens for u in usage] == [len(expected)]


def test_a_plain_completion_prompt_keeps_its_control_tokens(client, smollm):
    """/v1/completions takes the caller's own prompt, control strings live (as llama.cpp's /completion)."""
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    answer = client.completions.create(model="smollm2", max_tokens=2, temperature=0, prompt=prompt)
    assert answer.usage.prompt_tokens == len(smollm.tokenizer(prompt, add_special_tokens=False)["input_ids"])

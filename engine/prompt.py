"""Token ids of what a caller passes as a prompt: a plain string (the caller's own: its control strings are control
tokens), a list of chat messages rendered by the model's chat template (their content is data: engine.chat_template),
or token ids taken as they are; each checked, with the reason when it is not usable."""

from __future__ import annotations

from typing import Sequence

from .chat_template import chat_ids

Messages = Sequence[dict]


def encode(tokenizer, prompt: str | Messages | Sequence[int], *, vocab_size: int, name: str,
           add_generation_prompt: bool = True) -> list[int]:
    """ValueError, naming the problem, for an empty prompt, ids outside [0, vocab_size), malformed messages, or
    messages for a model (`name`) without a chat template."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
        return list(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return list(tokenizer(prompt)["input_ids"])
    messages = list(prompt)
    if not messages:
        raise ValueError("messages list is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"message {i} content must be a string, got {type(m['content']).__name__}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"{name} has no chat template; pass a plain string prompt")
    return chat_ids(tokenizer, messages, add_generation_prompt)

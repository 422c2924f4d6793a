"""Chat messages rendered by the model's template into token ids, with message content kept as data.

A tokenizer given a rendered chat prompt matches its control strings (`<|im_start|>`, `<|im_end|>`, `[INST]`, ...)
anywhere in the text, so a message, a document or a file name holding `<|im_end|>\n<|im_start|>system` would close
the user's turn and open a system turn of its own. Here only the template's own text yields control tokens:

1. The template is rendered twice: with the real contents, and with each content replaced by a marker (a private
   use character pair with the message's index). The marker rendering gives the template's own pieces, in order,
   and where each content goes (a template may drop a message, repeat one, or trim its content).
2. The real rendering is matched against those pieces: each content's span is the content as the template wrote
   it (as it is, stripped, or after the reasoning a template cuts off), followed by the next piece exactly.
3. When the whole rendering holds as many control strings, and tokenized as one text as many control tokens, as
   the template's pieces alone (content brought none), those ids are the prompt: the ids a chat without control
   strings has always had, so stored chunks keep their keys. Otherwise the rendering is cut at the template's own
   control strings only, and every text between them, template text and content together, is tokenized with its
   control strings split into plain tokens (`split_special_tokens`), as the tokenizer would tokenize that text
   between control tokens. Same text, same ids, wherever it comes from (chunk keys follow the ids).

A template whose rendering cannot be matched (it rewrites content in a way not listed in `_rendered_forms`) and
whose content holds control strings is refused with ValueError, never tokenized with those strings live. A
plain string prompt is the caller's own: its control strings stay control tokens (as llama.cpp's /completion).
"""

from __future__ import annotations

import re
from typing import Sequence

_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"  # private use: never a control string, never in a template
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")


class ContentWithControlText(ValueError):
    """Message content holds the template's control strings and the template's rewriting of content leaves
    nothing to tell content from template text: refused rather than tokenized with those strings live."""


def control_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens: the control tokens content must never produce."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {int(i) for i, token in decoder.items() if getattr(token, "special", False)}
    ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
    return frozenset(ids)


def _control_strings(tokenizer) -> list[str]:
    """The control tokens' texts, longest first (where one starts another, the longer is the token)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = control_ids(tokenizer)
    texts = {str(getattr(decoder.get(i), "content", "") or tokenizer.convert_ids_to_tokens(i)) for i in ids}
    return sorted((t for t in texts if t), key=len, reverse=True)


def _render(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _rendered_forms(content: str) -> list[str]:
    """What templates are seen to make of a content: as it is, trimmed (Llama 3, Gemma), or with the reasoning
    before `</think>` cut off and the rest trimmed (Qwen3, DeepSeek-R1 for earlier assistant turns)."""
    forms = [content, content.strip(), content.lstrip(), content.rstrip()]
    if "</think>" in content:
        after = content.split("</think>")[-1]
        forms += [after, after.strip(), after.lstrip("\n")]
    seen: list[str] = []
    for form in forms:
        if form not in seen:
            seen.append(form)
    return seen


def _spans(rendered: str, skeleton: str, contents: Sequence[str]) -> list[tuple[int, int]] | None:
    """Where each content written by the template lies in `rendered` ([start, end) in order), given the rendering
    with markers in `skeleton`; None where the two cannot be matched piece by piece."""
    pieces = _MARK.split(skeleton)  # template text, index, template text, index, ..., template text
    texts, order = pieces[0::2], [int(i) for i in pieces[1::2]]
    if any(i >= len(contents) for i in order) or not rendered.startswith(texts[0]):
        return None
    spans = []
    pos = len(texts[0])
    for k, index in enumerate(order):
        after = texts[k + 1]
        last = k + 1 == len(order)
        for form in _rendered_forms(contents[index]):
            end = pos + len(form)
            follows = rendered[end:] == after if last else rendered.startswith(after, end)
            if rendered.startswith(form, pos) and follows:
                spans.append((pos, end))
                pos = end + len(after)
                break
        else:
            return None
    return spans if order or rendered == texts[0] else None


def _cut_at_controls(rendered: str, spans: list[tuple[int, int]], pattern) -> list[tuple[str, bool]]:
    """`rendered` as (text, is_control) parts, cut at the control strings (`pattern`) of the template's own text
    only."""
    parts: list[tuple[str, bool]] = []
    text = ""
    pos = 0
    bounds = [*spans, (len(rendered), len(rendered))]
    for start, end in bounds:
        template = rendered[pos:start]
        cursor = 0
        for match in pattern.finditer(template) if pattern else ():
            text += template[cursor:match.start()]
            if text:
                parts.append((text, False))
                text = ""
            parts.append((match.group(), True))
            cursor = match.end()
        text += template[cursor:] + rendered[start:end]
        pos = end
    if text:
        parts.append((text, False))
    return parts


def chat_ids(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, control tokens only where the template
    itself writes them (ContentWithControlText where that cannot be assured)."""
    rendered = _render(tokenizer, messages, add_generation_prompt)
    whole = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    strings = _control_strings(tokenizer)
    pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
    contents = [m["content"] for m in messages]
    marked = [{**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} for i, m in enumerate(messages)]
    try:
        skeleton = _render(tokenizer, marked, add_generation_prompt)
    except Exception:  # a template that inspects content and refuses a marker: matched as unmatchable below
        skeleton = None
    if skeleton is not None and _only_the_templates_controls(tokenizer, whole, rendered, skeleton, pattern):
        return whole
    spans = _spans(rendered, skeleton, contents) if skeleton is not None else None
    if spans is None:
        held = [s for s in strings if any(s in c for c in contents)]
        if not held:
            return whole  # the template's own controls moved with the content; content holds none
        raise ContentWithControlText(
            f"a message holds the chat template's control text (e.g. {held[0]!r}) and this model's template "
            "rewrites message content, so it cannot be kept as plain text; remove it from the message")
    ids: list[int] = []
    for text, is_control in _cut_at_controls(rendered, spans, pattern):
        if is_control:
            control = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert len(control) == 1, (text, control)
            ids.extend(control)
        else:  # no control string of the template's in it: every one left is content's, and stays text
            ids.extend(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    return ids


def _only_the_templates_controls(tokenizer, whole: list[int], rendered: str, skeleton: str, pattern) -> bool:
    """Whether the control strings and control tokens of the whole rendering are the template's own: as many
    control strings as its pieces between contents hold, and as many control ids as they tokenize to (the
    unknown-text id aside: a word a small vocabulary lacks becomes it, wherever it stands)."""
    pieces = _MARK.split(skeleton)[0::2]
    if pattern is not None and len(pattern.findall(rendered)) != sum(len(pattern.findall(p)) for p in pieces):
        return False
    controls = control_ids(tokenizer) - {getattr(tokenizer, "unk_token_id", None)}
    own = sum(1 for p in pieces for t in tokenizer(p, add_special_tokens=False)["input_ids"] if t in controls)
    return sum(1 for t in whole if t in controls) == own

"""Prompt layout for chats over dropped documents, chosen for KV reuse without hurting answers.

Two layouts, picked per conversation by how much document text there is:

- pinned: every attached document, whole, in the system message, in the order the documents were added.
  The block is a stable prefix of every prompt of the conversation, so it is pre-warmed once at drop time
  (the exact tokens the first question will send) and every question, first and follow-ups, gets EXACT hits
  on it; the model also sees whole documents, not just retrieved snippets. Adding a document appends to the
  block, so the documents before it stay EXACT hits. Used while the documents fit PINNED_FRACTION of the
  model's context.
- retrieved: larger sets. Each question's top BM25 passages are written into that question's own user
  message, and a passage already sent earlier in the conversation is not repeated. Earlier turns never
  change, so every follow-up reuses the whole history EXACTLY and only computes new passages + question.

Why a quarter of the context: bench/rag_session.py on SmolLM2-135M answered 2/5 questions right with 8
documents (2.4k tokens) pinned and 5/5 with the same documents retrieved (full prefill and exact reuse
agree in both), while 3 pinned documents (0.8k tokens) did as well as retrieval. Long pinned contexts
dilute a small model's attention; retrieval keeps prompts short.
  Where passages will land is unknown at drop time, so pre-warming them only pays off with approximate
  (position-free) reuse; with exact reuse nothing is warmed ahead in this layout. With approximate reuse the
  passages are warmed the way questions will carry them: behind the conversation's system message, labelled, many
  to a message in the order of their documents. A passage's KV then saw a system message and other passages
  before it, as it will when it is reused; warmed alone right after the system message, a document's opening
  carried KV of a context no question has (`python -m bench needle --needle-warm layout`: needle accuracy with no
  repair 13.0% -> 30.4%, CacheBlend 15% 17.4% -> 39.1%, against full prefill's 60.9%; docs/benchmarks.md).

Functions over plain dicts (rows of app/db.py) and the Database; no Qt, no engine imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PINNED_FRACTION = 0.25  # share of the model's context that whole documents may take (see above)
CHARS_PER_TOKEN = 3.0  # conservative for English prose and code with BPE tokenizers
NUM_PASSAGES = 4
WARM_GROUP_FRACTION = 0.25  # approximate pre-warm: share of the context one message of passages may take


@dataclass
class Layout:
    messages: list[dict]  # what the engine gets
    user_prompt: str  # this turn's user message as sent (stored, so later turns resend it byte for byte)
    sources: list[dict] = field(default_factory=list)  # passages shown under the answer
    mode: str = "none"  # "none" | "pinned" | "retrieved"


def document_text(passages: list[dict]) -> str:
    return "\n\n".join(p["text"] for p in passages)


def fits_pinned(total_chars: int, max_context: int) -> bool:
    return total_chars <= PINNED_FRACTION * max_context * CHARS_PER_TOKEN


def choose_mode(documents: list[dict], max_context: int) -> str:
    """documents: rows with num_chars. "none" without documents."""
    if not documents:
        return "none"
    total = sum(d["num_chars"] for d in documents)
    return "pinned" if fits_pinned(total, max_context) else "retrieved"


def pinned_system(system_prompt: str, documents: list[tuple[dict, list[dict]]]) -> str:
    """The system message with every document whole. `documents`: (document row, its passages) in the
    conversation's order; the result only grows at its end when a document is added."""
    parts = [system_prompt.rstrip(), "", "Answer using these documents when they are relevant."]
    for doc, passages in documents:
        parts += ["", f'<document name="{doc["name"]}">', document_text(passages), "</document>"]
    return "\n".join(parts)


def passage_label(p: dict) -> str:
    where = f", page {p['page']}" if p.get("page") else (f", {p['section']}" if p.get("section") else "")
    return f"{p['name']}{where}"


PASSAGES_HEADING = "Passages from my documents:"


def passage_blocks(passages: list[dict]) -> str:
    """Passages as a question carries them: each under its label, in the order given."""
    return "\n\n".join(f"[{passage_label(p)}]\n{p['text']}" for p in passages)


def retrieved_user_prompt(question: str, passages: list[dict], already_sent: set[int]) -> str:
    new = [p for p in passages if p["id"] not in already_sent]
    if not new:
        return question
    return f"{PASSAGES_HEADING}\n\n{passage_blocks(new)}\n\nQuestion: {question}"


def history_messages(history: list[dict]) -> list[dict]:
    """Earlier turns as they were sent: a user message's stored `prompt` (with its passages) wins over
    the text the user typed. Unfinished or failed answers are left out."""
    out = []
    for m in history:
        if m["role"] == "assistant" and (m["status"] == "error" or not m["content"]):
            continue
        out.append({"role": m["role"], "content": m.get("prompt") or m["content"]})
    return out


def build_prompt(system_prompt: str, history: list[dict], question: str, *, mode: str,
                 documents: list[tuple[dict, list[dict]]] = (), hits: list[dict] = (),
                 already_sent: set[int] = frozenset()) -> Layout:
    """`history`: earlier messages (db rows); `hits`: this question's retrieved passages, best first."""
    if mode == "pinned":
        system = pinned_system(system_prompt, list(documents))
        user = question
    elif mode == "retrieved":
        system = system_prompt
        user = retrieved_user_prompt(question, list(hits), set(already_sent))
    else:
        system, user = system_prompt, question
    messages = [{"role": "system", "content": system}] + history_messages(history)
    messages.append({"role": "user", "content": user})
    sources = [{k: p.get(k) for k in ("id", "document_id", "name", "path", "page", "section", "text")}
               for p in hits] if mode != "none" else []
    return Layout(messages, user, sources, mode)


def warm_inputs(system_prompt: str, mode: str, documents: list[tuple[dict, list[dict]]], *,
                approximate: bool, max_context: int = 8192) -> list:
    """What to pre-fill when documents change: the pinned system message exactly as the next prompt will
    start (rendered without a generation prompt by the engine), or, for retrieved layouts with
    approximate reuse, the passages as questions will carry them (module docstring): system message, then one
    user message of labelled passages, as many to a message as WARM_GROUP_FRACTION of the context holds."""
    if mode == "pinned":
        # One input per document, each the system message up to that document: each step reuses the one
        # before (progress and cancel per document); the last is exactly how the next prompt starts.
        return [[{"role": "system", "content": pinned_system(system_prompt, documents[:k])}]
                for k in range(1, len(documents) + 1)]
    if mode == "retrieved" and approximate:
        budget = WARM_GROUP_FRACTION * max_context * CHARS_PER_TOKEN
        groups: list[list[dict]] = [[]]
        for doc, passages in documents:
            for p in passages:
                if groups[-1] and sum(len(q["text"]) for q in groups[-1]) + len(p["text"]) > budget:
                    groups.append([])
                groups[-1].append({**p, "name": doc["name"]})
        return [[{"role": "system", "content": system_prompt},
                 {"role": "user", "content": f"{PASSAGES_HEADING}\n\n{passage_blocks(group)}"}]
                for group in groups if group]
    return []


def prompt_for(db, conversation_id: int, question: str, *, max_context: int, before_position: int | None = None
               ) -> Layout:
    """The layout for `question` in a stored conversation, from the messages before `before_position`
    (all of them when None)."""
    conversation = db.conversation(conversation_id)
    history = [m for m in db.messages(conversation_id) if before_position is None or m["position"] < before_position]
    docs = db.conversation_documents(conversation_id)
    mode = choose_mode(docs, max_context)
    hits = db.search_passages(conversation_id, question, limit=NUM_PASSAGES) if docs else []
    # Passages sent before are the sources of earlier answers (sources are exactly the retrieved passages).
    sent = {s["id"] for m in history if m["role"] == "assistant" for s in (m.get("sources") or [])}
    with_passages = [(d, db.passages(d["id"])) for d in docs] if mode == "pinned" else []
    return build_prompt(conversation["system_prompt"], history, question, mode=mode, documents=with_passages,
                        hits=hits, already_sent=sent)


def warm_for(db, conversation_id: int, *, max_context: int, approximate: bool) -> list:
    """warm_inputs for a stored conversation's current documents."""
    docs = db.conversation_documents(conversation_id)
    with_passages = [(d, db.passages(d["id"])) for d in docs]
    return warm_inputs(db.conversation(conversation_id)["system_prompt"], choose_mode(docs, max_context),
                       with_passages, approximate=approximate, max_context=max_context)

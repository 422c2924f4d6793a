"""Prompt layout for document chats: stable places, so follow-ups are EXACT prefixes of what came before."""

from __future__ import annotations

from app import rag


def _doc(db, tmp_path, name, paragraphs):
    passages, pos = [], 0
    for text in paragraphs:
        passages.append({"text": text, "page": None, "section": None, "start": pos, "end": pos + len(text)})
        pos += len(text) + 2
    return db.upsert_document(str(tmp_path / name), name, "text", name * 8, 1.0, pos, pos, passages)


def _ask(db, cid, question, max_context):
    layout = rag.prompt_for(db, cid, question, max_context=max_context)
    user = db.add_message(cid, "user", question)
    if layout.user_prompt != question:
        db.update_message(user["id"], prompt=layout.user_prompt)
    db.add_message(cid, "assistant", f"answer to {question}", sources=layout.sources or None)
    return layout


def _flat(messages):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def test_retrieved_layout_keeps_earlier_turns_identical_and_never_repeats_a_passage(db, tmp_path):
    cid = db.create_conversation()["id"]
    a = _doc(db, tmp_path, "a.txt", ["Owls hunt at night in the forest.", "Owls have soft feathers."])
    b = _doc(db, tmp_path, "b.txt", ["Bees make honey from nectar.", "Bees dance to share where flowers are."])
    db.attach_document(cid, a["id"])
    db.attach_document(cid, b["id"])
    first = _ask(db, cid, "When do owls hunt?", max_context=16)  # tiny context: forces the retrieved layout
    assert first.mode == "retrieved" and "Owls hunt at night" in first.user_prompt
    second = _ask(db, cid, "How do owls and bees share things?", max_context=16)
    # The second prompt starts with the first prompt, byte for byte (so its KV is an EXACT hit) ...
    assert _flat(second.messages).startswith(_flat(first.messages))
    # ... and a passage already sent is not sent again.
    assert second.messages[-1]["content"].count("Owls hunt at night") == 0
    assert "Bees dance" in second.messages[-1]["content"]
    assert {s["name"] for s in second.sources} >= {"b.txt"}


def test_pinned_layout_puts_whole_documents_first_and_grows_only_at_the_end(db, tmp_path):
    cid = db.create_conversation(system_prompt="Be brief.")["id"]
    a = _doc(db, tmp_path, "a.txt", ["Alpha one.", "Alpha two."])
    db.attach_document(cid, a["id"])
    before = rag.prompt_for(db, cid, "What is alpha?", max_context=8192)
    assert before.mode == "pinned"
    system = before.messages[0]["content"]
    assert system.startswith("Be brief.") and "Alpha one.\n\nAlpha two." in system
    assert before.messages[-1]["content"] == "What is alpha?"  # nothing injected into the question
    warm = rag.warm_for(db, cid, max_context=8192, approximate=False)
    assert warm[-1] == [before.messages[0]]  # pre-warm is exactly the start of the next prompt
    b = _doc(db, tmp_path, "b.txt", ["Beta."])
    db.attach_document(cid, b["id"])
    after = rag.prompt_for(db, cid, "What is alpha?", max_context=8192)
    common = system[: system.index("</document>")]
    assert after.messages[0]["content"].startswith(common) and "Beta." in after.messages[0]["content"]


def test_layout_choice_follows_the_size_of_the_documents():
    assert rag.choose_mode([], 8192) == "none"
    small = [{"num_chars": 1000}]
    big = [{"num_chars": int(rag.PINNED_FRACTION * 8192 * rag.CHARS_PER_TOKEN) + 1}]
    assert rag.choose_mode(small, 8192) == "pinned"
    assert rag.choose_mode(big, 8192) == "retrieved"
    assert rag.warm_inputs("s", "retrieved", [({"name": "x"}, [{"text": "p"}])], approximate=False) == []


def test_approximate_prewarm_carries_passages_as_questions_will_behind_the_system_message(db, tmp_path):
    """Each passage is warmed after the conversation's system message and other passages, in the labelled form a
    question sends it in, so its reused KV saw a context like the one it is reused in (not a document's opening
    right after the system message, which no question has)."""
    cid = db.create_conversation(system_prompt="Be brief.")["id"]
    a = _doc(db, tmp_path, "a.txt", ["Owls hunt at night in the forest.", "Owls have soft feathers."])
    b = _doc(db, tmp_path, "b.txt", ["Bees make honey from nectar.", "Bees dance to share where flowers are."])
    db.attach_document(cid, a["id"])
    db.attach_document(cid, b["id"])
    warm = rag.warm_for(db, cid, max_context=128, approximate=True)  # 128 tokens: the retrieved layout
    assert all(len(w) == 2 and w[0] == {"role": "system", "content": "Be brief."} for w in warm)
    warmed = "\n\n".join(w[1]["content"] for w in warm)
    assert all(w[1]["content"].startswith(rag.PASSAGES_HEADING) for w in warm)
    layout = rag.prompt_for(db, cid, "How do bees share where flowers are?", max_context=128)
    assert layout.mode == "retrieved" and layout.sources
    for source in layout.sources:  # every passage the question carries was warmed under the same label
        assert f"[{rag.passage_label(source)}]\n{source['text']}" in warmed
    assert len(warm) == 2  # not one message per passage: 123 characters of passages, 96 to a message

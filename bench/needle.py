"""A needle-QA set for measuring what approximate reuse costs in answers.

Facts ("The archive code of the Falcon collection is 48213.") are planted inside real documents (Python's own
documentation topics, shipped with every Python as `pydoc_data.topics`). Each question asks for one code;
its prompt holds the document with the answer among others, in an order that changes from question to
question, so documents seen before come back at other offsets and next to other neighbours. Accuracy is
exact match of the 5-digit code in the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ["Falcon", "Orchid", "Granite", "Harbor", "Juniper", "Meridian", "Quartz", "Saffron", "Tundra", "Willow"]
SYSTEM = "You answer questions using only the documents the user gives you. Reply with the answer only."


@dataclass(frozen=True)
class NeedleDoc:
    name: str
    code: str
    text: str


@dataclass(frozen=True)
class NeedleQuestion:
    doc_order: tuple[int, ...]  # indices into the documents, in prompt order
    target: int
    question: str
    answer: str


def _topics(num: int, chars: int) -> list[str]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    names = sorted(name for name, text in topics.items() if len(text) >= chars + 200)
    return [topics[name][:chars].rsplit(". ", 1)[0] + "." for name in names[:num]]


def make_documents(num_docs: int = 8, chars: int = 1300, seed: int = 0) -> list[NeedleDoc]:
    """`num_docs` documents of about `chars` characters, each with one planted code near its middle."""
    rng = random.Random(seed)
    docs = []
    for i, text in enumerate(_topics(num_docs, chars)):
        name = NAMES[i % len(NAMES)]
        code = f"{rng.randrange(10000, 100000)}"
        sentences = text.split(". ")
        cut = len(sentences) // 2
        fact = f"The archive code of the {name} collection is {code}"
        planted = ". ".join(sentences[:cut] + [fact] + sentences[cut:])
        docs.append(NeedleDoc(name, code, planted))
    return docs


def make_questions(docs: list[NeedleDoc], num_questions: int = 24, docs_per_prompt: int = 5,
                   seed: int = 1) -> list[NeedleQuestion]:
    rng = random.Random(seed)
    questions = []
    for q in range(num_questions):
        target = q % len(docs)
        others = rng.sample([i for i in range(len(docs)) if i != target], docs_per_prompt - 1)
        order = others + [target]
        rng.shuffle(order)
        questions.append(NeedleQuestion(tuple(order), target,
                                        f"What is the archive code of the {docs[target].name} collection?",
                                        docs[target].code))
    return questions


def document_block(doc: NeedleDoc) -> str:
    return f"Document:\n{doc.text}\n\n"


def messages_for(docs: list[NeedleDoc], question: NeedleQuestion) -> list[dict]:
    body = "".join(document_block(docs[i]) for i in question.doc_order)
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{body}Question: {question.question}"}]


def layout_messages(docs: list[NeedleDoc], order: list[int]) -> list[dict]:
    """The documents as a question's prompt lays them out, without the question: after the system prompt, in
    `order`, in one user turn."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "".join(document_block(docs[i]) for i in order)}]


def warm_messages(doc: NeedleDoc) -> list[dict]:
    """A document as the app pre-warms it: after the same system prompt, alone in a user turn."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": document_block(doc)}]


def is_correct(answer: str, question: NeedleQuestion) -> bool:
    return question.answer in answer

"""`kvboost chat`: the terminal chat, the app's face where there is no display. Its conversation is the desktop
app's: kept in the app's database (a temporary one, gone when the chat ends), documents added with /file read the
way the app reads dropped files (a worker process with time and memory limits: app/document_ingest.py) and laid
out in prompts the way the app lays them out (whole in the system message while they fit, else each question's
best passages: app/rag.py), so the cache does for these answers what it does for the app's."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
from pathlib import Path

HELP = """commands:
  /file PATH   add a document (.md, .txt, .pdf, .docx or code) or a folder of them to the conversation, read
               now; the answers use them, naming the passages they were given under each answer
  /files       the conversation's documents
  /reset       a new conversation (without documents)
  /stats       the cache in a few lines (/stats json: all of it)
  /help        these commands
  /quit        leave (also /exit or Ctrl+D); Ctrl+C stops an answer
A message that starts with / is sent when it starts with // (the first / is dropped)."""


def command_of(text: str) -> str | None:
    """The command a typed line is (its first word), None for a message."""
    if not text.startswith("/") or text.startswith("//"):
        return None
    return text.split(maxsplit=1)[0]


class Conversation:
    """One conversation in the app's database: its messages, its documents and the prompt of each question."""

    def __init__(self, folder: Path, system: str | None, max_context: int):
        from app.db import Database

        self.db, self.system, self.max_context = Database(folder / "chat.db"), system, max_context
        self.id = self.db.create_conversation(system_prompt=system)["id"]

    def reset(self) -> None:
        self.db.delete_conversation(self.id)
        self.id = self.db.create_conversation(system_prompt=self.system)["id"]

    def documents(self) -> list[dict]:
        return self.db.conversation_documents(self.id)

    def ask(self, question: str):
        """(messages for the engine, the passages they carry, the stored question's row)"""
        from app import rag

        user = self.db.add_message(self.id, "user", question)
        layout = rag.prompt_for(self.db, self.id, question, max_context=self.max_context,
                                before_position=user["position"])
        if layout.user_prompt != question:  # later turns resend it byte for byte
            self.db.update_message(user["id"], prompt=layout.user_prompt)
        return layout.messages, layout.sources, user

    def answered(self, text: str, sources: list[dict]) -> None:
        self.db.add_message(self.id, "assistant", text, sources=sources or None)

    def unasked(self, user: dict) -> None:
        """The question `user` got no answer: it leaves the conversation."""
        self.db.delete_messages_from(self.id, user["position"])

    def add(self, path: str) -> dict:
        """Reads the file or folder at `path` into the conversation as the app reads a drop: {"added",
        "unchanged", "problems"}, each problem naming its file and why."""
        from app.document_ingest import Ingest
        from app.document_worker import ExtractionLimits

        ingest = Ingest(self.db, self.id, ExtractionLimits())
        return asyncio.run(ingest.run([path], lambda count: None, lambda done: None))

    def warm_inputs(self, approximate: bool) -> list:
        from app import rag

        return rag.warm_for(self.db, self.id, max_context=self.max_context, approximate=approximate)


def run_chat(eng, system: str | None, sampling: dict, stream_to, badge, stats_summary) -> int:
    """The loop over typed lines until /quit or the end of input. `stream_to(out, eng, messages, sampling, cancel)`
    writes an answer and returns its Result; `badge(stats)` and `stats_summary(cache_stats)` are its lines."""
    print("KVBoost chat. /file PATH adds a document, /reset clears the conversation, /stats shows the cache, /help "
          "lists the commands, /quit or Ctrl+D leaves.\nCtrl+C stops an answer.", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="kvboost-chat-") as folder:
        conversation = Conversation(Path(folder), system, eng.max_context)
        try:
            return _loop(eng, conversation, sampling, stream_to, badge, stats_summary)
        finally:
            conversation.db.close()


def _loop(eng, conversation: Conversation, sampling: dict, stream_to, badge, stats_summary) -> int:
    from app.rag import passage_label

    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not sys.stdin.isatty():  # piped: the terminal did not echo the line, so the answer would share it
            print(line)
        text = line.strip()
        if not text:
            continue
        command = command_of(text)
        if command in ("/quit", "/exit"):
            return 0
        if command is not None:
            _command(eng, conversation, command, text[len(command):].strip(), stats_summary)
            continue
        messages, sources, user = conversation.ask(line.lstrip()[1:] if text.startswith("//") else line)
        sys.stdout.write("bot> ")
        try:
            result = stream_to(sys.stdout, eng, messages, sampling, threading.Event())
        except KeyboardInterrupt:
            # The stream object is gone with the interrupt; the engine stored what was computed.
            print("\n[stopped]")
            conversation.unasked(user)
            continue
        except ValueError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            conversation.unasked(user)
            continue
        print()
        if sources:
            labels = dict.fromkeys(passage_label(s) for s in sources)  # passages of one section: named once
            print("[from: " + "; ".join(labels) + "]", file=sys.stderr)
        print(badge(result.stats), file=sys.stderr)
        conversation.answered(result.text, sources)


def _command(eng, conversation: Conversation, command: str, argument: str, stats_summary) -> None:
    if command == "/help":
        print(HELP)
    elif command == "/reset":
        conversation.reset()
        print("[a new conversation]")
    elif command == "/stats":
        stats = eng.cache_stats()
        print(json.dumps(stats.to_dict(), indent=2) if argument == "json" else stats_summary(stats))
    elif command == "/files":
        documents = conversation.documents()
        if not documents:
            print("[no documents: /file PATH adds one]")
        for row in documents:
            print(f"  {row['name']} ({row['num_chars']} characters)")
    elif command == "/file":
        _add_file(eng, conversation, argument)
    else:
        print(f"unknown command {command}: /help lists the commands (// starts a message with /)", file=sys.stderr)


def _add_file(eng, conversation: Conversation, argument: str) -> None:
    path = argument[1:-1] if len(argument) > 1 and argument[0] == argument[-1] and argument[0] in "'\"" else argument
    if not path:
        print("/file needs the path of a document or folder: /file notes.md", file=sys.stderr)
        return
    print(f"reading {path} ...", file=sys.stderr, flush=True)
    try:
        report = conversation.add(str(Path(path).expanduser()))
    except KeyboardInterrupt:
        print("[stopped: what was read before is in the conversation]", file=sys.stderr)
        return
    for problem in report["problems"]:
        print(f"error: {problem}", file=sys.stderr)
    if not report["added"]:
        if report["unchanged"]:
            print("[already in this conversation]", file=sys.stderr)
        return
    # Read into the cache now, as the app does after a drop: the prompt's start exactly as the next question sends it.
    # (nothing in the retrieved layout: each question carries its passages, read when it is asked)
    read = ""
    try:
        done = [eng.warm(messages) for messages in conversation.warm_inputs(eng.info().reuse == "approx")]
        if done:
            read = (f"; the prompt's {done[-1]['tokens']} tokens before the question are in the cache "
                    f"({sum(d['computed_tokens'] for d in done)} computed now)")
    except KeyboardInterrupt:
        pass
    except ValueError as exc:  # longer than the model holds: the next question says so again
        print(f"error: {exc}", file=sys.stderr)
    documents = [row["name"] for row in conversation.documents()]
    names = ", ".join(documents[:5]) + (f" and {len(documents) - 5} more" if len(documents) > 5 else "")
    print(f"[{report['added']} added{read}; the conversation's documents: {names}]", file=sys.stderr)

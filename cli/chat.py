"""`kvboost chat`: the terminal chat, the app's face where there is no display. Its conversations are the desktop
app's: kept in the app's database (its data folder: $KVBOOST_HOME, else the per-user one; --temporary keeps
nothing), listed in the window's sidebar and back with /history and /open; documents added with /file read the way
the app reads dropped files (a worker process with time and memory limits: app/document_ingest.py) and laid out in
prompts the way the app lays them out (whole in the system message while they fit, else each question's best
passages: app/rag.py), so the cache does for these answers what it does for the app's."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

HELP = """commands:
  /file PATH   add a document (.md, .txt, .pdf, .docx or code) or a folder of them to the conversation, read
               now; the answers use them, naming the passages they were given under each answer
  /files       the conversation's documents
  /history     the kept conversations, the latest first
  /open N      go on with conversation N of /history
  /new         a new conversation (also /reset; the one before stays in /history)
  /stats       the cache in a few lines (/stats json: all of it)
  /help        these commands
  /quit        leave (also /exit or Ctrl+D); Ctrl+C stops an answer
A message that starts with / is sent when it starts with // (the first / is dropped)."""
HISTORY_SHOWN = 20


def command_of(text: str) -> str | None:
    """The command a typed line is (its first word), None for a message."""
    if not text.startswith("/") or text.startswith("//"):
        return None
    return text.split(maxsplit=1)[0]


class Conversation:
    """The conversation going on, in the app's database: its messages, its documents and the prompt of each
    question. A new one is not one of the window's open tabs; it is listed with the others."""

    def __init__(self, db, system: str | None, max_context: int):
        self.db, self.system, self.max_context = db, system, max_context
        self.id = self._new()

    def _new(self) -> int:
        cid = self.db.create_conversation(system_prompt=self.system)["id"]
        self.db.update_conversation(cid, is_open=False)
        return cid

    def leave(self) -> None:
        """Done with this conversation: one where nothing was asked or added is not kept."""
        if not self.db.messages(self.id) and not self.documents():
            try:
                self.db.delete_conversation(self.id)
            except KeyError:  # deleted meanwhile (in the window)
                pass

    def new(self) -> None:
        self.leave()
        self.id = self._new()

    def open(self, cid: int) -> dict:
        """Goes on with conversation `cid` (KeyError: there is none); returns its row."""
        row = self.db.conversation(cid)
        if cid != self.id:
            self.leave()
            self.id = cid
        return row

    def documents(self) -> list[dict]:
        return self.db.conversation_documents(self.id)

    def ask(self, question: str):
        """(messages for the engine, the passages they carry, the stored question's row). DatabaseError: the
        question could not be stored as it is sent, and is not in the conversation."""
        from app import rag
        from app.db import DatabaseError

        user = self.db.add_message(self.id, "user", question)
        try:
            self.db.title_if_untitled(self.id, question)
        except DatabaseError:  # the answer matters more; the default title stays
            pass
        layout = rag.prompt_for(self.db, self.id, question, max_context=self.max_context,
                                before_position=user["position"])
        if layout.user_prompt != question:  # later turns resend it byte for byte
            try:
                self.db.update_message(user["id"], prompt=layout.user_prompt)
            except DatabaseError:
                self.unasked(user)
                raise
        return layout.messages, layout.sources, user

    def answered(self, text: str, sources: list[dict]) -> None:
        self.db.add_message(self.id, "assistant", text, sources=sources or None)

    def unasked(self, user: dict) -> None:
        """The question `user` got no answer: it leaves the conversation (where the database lets it: else it stays,
        unanswered, and the next question is asked after it)."""
        from app.db import DatabaseError

        try:
            self.db.delete_messages_from(self.id, user["position"])
        except DatabaseError as exc:
            print(f"error: the unanswered question stays in the conversation: {exc}", file=sys.stderr)

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


def run_chat(eng, system: str | None, sampling: dict, stream_to, badge, stats_summary, *,
             temporary: bool = False) -> int:
    """The loop over typed lines until /quit or the end of input. `stream_to(out, eng, messages, sampling, cancel,
    lead=...)` writes `lead` and an answer and returns its Result; `badge(stats)` and `stats_summary(cache_stats)`
    are its lines.
    `temporary`: the conversations go to a database removed at the end (so does a chat whose data folder cannot
    be used, saying why)."""
    print("KVBoost chat. /file PATH adds a document, /history lists the kept conversations, /stats shows the cache, "
          "/help lists the commands, /quit or Ctrl+D leaves.\nCtrl+C stops an answer.", file=sys.stderr)
    with ExitStack() as stack:
        conversation = _conversation(temporary, system, eng.max_context, stack)
        try:
            return _loop(eng, conversation, sampling, stream_to, badge, stats_summary)
        finally:
            _leave(conversation)


def _conversation(temporary: bool, system: str | None, max_context: int, stack: ExitStack) -> Conversation:
    """A new conversation in the app's database, or in a temporary one (`temporary`, or the app's cannot be used
    now: the reason is said)."""
    from app.db import Database, DatabaseError
    from app.paths import FolderError, app_paths

    if not temporary:
        db = None
        try:
            path = app_paths().ensure().database
            db = Database(path)
            conversation = Conversation(db, system, max_context)
            print(f"Conversations are kept in {path} (the desktop app lists them; --temporary keeps nothing).",
                  file=sys.stderr)
            return conversation
        except (FolderError, DatabaseError) as exc:
            if db is not None:
                db.close()
            print(f"warning: this chat is not kept: {exc}", file=sys.stderr)
    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-chat-"))
    return Conversation(Database(Path(folder) / "chat.db"), system, max_context)


def _leave(conversation: Conversation) -> None:
    from app.db import DatabaseError

    try:
        conversation.leave()
    except DatabaseError:  # an empty conversation stays behind: harmless
        pass
    finally:
        conversation.db.close()


def _loop(eng, conversation: Conversation, sampling: dict, stream_to, badge, stats_summary) -> int:
    from app.db import DatabaseError
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
            try:
                _command(eng, conversation, command, text[len(command):].strip(), stats_summary)
            except DatabaseError as exc:  # locked past the timeout, disk full, read-only
                print(f"error: {command} could not be done: {exc}", file=sys.stderr)
            continue
        try:
            messages, sources, user = conversation.ask(line.lstrip()[1:] if text.startswith("//") else line)
        except DatabaseError as exc:  # locked past the timeout, disk full, read-only: nothing was sent
            print(f"error: the message was not sent: it could not be saved ({exc})", file=sys.stderr)
            continue
        try:
            result = stream_to(sys.stdout, eng, messages, sampling, threading.Event(), lead="bot> ")
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
        try:
            conversation.answered(result.text, sources)
        except DatabaseError as exc:
            print(f"error: the answer could not be saved ({exc}); the next question is sent without it",
                  file=sys.stderr)


def _command(eng, conversation: Conversation, command: str, argument: str, stats_summary) -> None:
    if command == "/help":
        print(HELP)
    elif command in ("/new", "/reset"):
        conversation.new()
        print("[a new conversation]")
    elif command == "/history":
        _history(conversation)
    elif command == "/open":
        _open(conversation, argument)
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


def _history(conversation: Conversation) -> None:
    rows = [row for row in conversation.db.conversations() if row["id"] != conversation.id
            or conversation.db.messages(row["id"]) or conversation.documents()][:HISTORY_SHOWN]
    if not rows:
        print("[no conversations kept yet]")
    for row in rows:
        count = len(conversation.db.messages(row["id"]))
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["updated_at"]))
        mark = "*" if row["id"] == conversation.id else " "
        print(f"{mark} {row['id']:>4}  {row['title']}  ({count} message{'' if count == 1 else 's'}, {when})")


def _open(conversation: Conversation, argument: str) -> None:
    if not (argument.isascii() and argument.isdigit() and len(argument) <= 18):  # "²" and 10**30 are not ids
        print("/open needs the number /history shows: /open 12", file=sys.stderr)
        return
    try:
        row = conversation.open(int(argument))
    except KeyError:
        print(f"error: there is no conversation {argument}: /history lists them", file=sys.stderr)
        return
    messages = conversation.db.messages(row["id"])
    print(f"[conversation {row['id']}: {row['title']}, {len(messages)} messages, "
          f"{len(conversation.documents())} documents]")
    for message in messages[-2:]:  # where it stopped: the last question and its answer
        who = "you" if message["role"] == "user" else "bot"
        text = " ".join(message["content"].split())
        print(f"  {who}> {text[:300]}{'…' if len(text) > 300 else ''}")


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

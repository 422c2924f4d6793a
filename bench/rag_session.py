"""A 5-question chat over dropped documents, through the app's own indexing and prompt layout.

`python bench/rag_session.py [--docs 8] [--questions 5] [--model SOURCE]`

Documents (pydoc topics with a planted archive code each, engine/needle.py) are written as Markdown files,
indexed with app/documents.py into a real SQLite database (app/db.py), pre-warmed the way the app does at
drop time, and then asked about 5 times in one conversation; each prompt comes from app/rag.py. Runs side by
side in one process, over one loaded model:

  off / pinned      full prefill every question (what other local apps do), whole documents in the prompt
  chunk / pinned    the app's default: documents pinned in the system message, pre-warmed
  off / retrieved   full prefill, top BM25 passages written into each question
  chunk / retrieved the retrieved layout with exact reuse (new passages + question computed per turn)
  approx / retrieved the retrieved layout with approximate reuse (`--approx`): passages pre-warmed as the app
                    warms them for it (app/rag.py warm_inputs), then found wherever a question carries them

Prints TTFT and the share of the prompt reused per question, the pre-warm time, and answer accuracy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import documents, rag  # noqa: E402
from app.db import Database  # noqa: E402
from bench import needle  # noqa: E402


def index(db: Database, conversation_id: int, paths: list[Path]) -> None:
    for path in paths:
        doc = documents.extract(path)
        row = db.upsert_document(doc.path, doc.name, doc.kind, doc.sha256, doc.mtime, doc.size, len(doc.text),
                                 [{"text": p.text, "page": p.page, "section": p.section, "start": p.start,
                                   "end": p.end} for p in doc.passages])
        db.attach_document(conversation_id, row["id"])


def run_session(engine, folder: Path, paths, questions, layout: str) -> dict:
    pinned_fraction = rag.PINNED_FRACTION
    if layout == "retrieved":
        rag.PINNED_FRACTION = 0.0  # force the layout used for document sets larger than half the context
    try:
        db = Database(folder / f"{engine.config.reuse.mode}-{layout}.sqlite3")
        conversation = db.create_conversation(system_prompt=needle.SYSTEM,
                                              sampling={"temperature": 0.0, "max_new_tokens": 16})
        cid = conversation["id"]
        index(db, cid, paths)
        warm_ms = 0.0
        approximate = engine.config.reuse.mode == "approx"
        for item in rag.warm_for(db, cid, max_context=engine.max_context, approximate=approximate):
            warm_ms += engine.warm(item)["ms"]
        rows = []
        for q in questions:
            layout_ = rag.prompt_for(db, cid, q.question, max_context=engine.max_context)
            user = db.add_message(cid, "user", q.question)
            if layout_.user_prompt != q.question:
                db.update_message(user["id"], prompt=layout_.user_prompt)
            result = engine.chat(layout_.messages, temperature=0.0, max_new_tokens=16)
            db.add_message(cid, "assistant", result.text, sources=layout_.sources or None)
            s = result.stats
            rows.append({"ttft_ms": s.ttft_ms, "prompt_tokens": s.prompt_tokens, "reused": s.reused_fraction,
                         "correct": needle.is_correct(result.text, q), "text": result.text})
        db.close()
        return {"warm_ms": warm_ms, "rows": rows}
    finally:
        rag.PINNED_FRACTION = pinned_fraction


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--questions", type=int, default=5)
    p.add_argument("--model", default=None)
    p.add_argument("--approx", action="store_true", help="also the retrieved layout with reuse=\"approx\"")
    args = p.parse_args(argv)
    from cli.kvboost import quiet_transformers
    from engine import KVBoost

    quiet_transformers()
    base = KVBoost.from_pretrained(args.model, device="cpu" if args.model is None else "auto",
                                   disk_cache_bytes=0)  # a cold start every run (bench/kv_tiers.py measures disk)
    docs = needle.make_documents(num_docs=args.docs)
    questions = [needle.NeedleQuestion(tuple(range(len(docs))), t, f"What is the archive code of the "
                                       f"{docs[t].name} collection?", docs[t].code)
                 for t in [(1, 5, 2, 6, 3, 0, 4, 7)[i % 8] % len(docs) for i in range(args.questions)]]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = []
        for doc in docs:
            path = folder / f"{doc.name.lower()}.md"
            path.write_text(f"# {doc.name} collection\n\n{doc.text}\n", encoding="utf-8")
            paths.append(path)
        results = {}
        for layout in ("pinned", "retrieved"):
            for reuse in ("off", "chunk", "approx") if layout == "retrieved" and args.approx else ("off", "chunk"):
                results[(reuse, layout)] = run_session(base.with_options(reuse=reuse), folder, paths, questions,
                                                       layout)
    print(f"\n{args.docs} documents ({sum(len(d.text) for d in docs)} chars), {len(questions)} questions, "
          f"greedy, {base.name}")
    for layout in ("pinned", "retrieved"):
        off, chunk = results[("off", layout)], results[("chunk", layout)]
        print(f"\nlayout: {layout}   (pre-warm at drop time: {chunk['warm_ms']:.0f} ms)")
        print("| question | prompt tokens | off TTFT ms | chunk TTFT ms | speed-up | reused (chunk) | "
              "correct off/chunk |")
        print("|---|---|---|---|---|---|---|")
        for i, (a, b) in enumerate(zip(off["rows"], chunk["rows"]), 1):
            print(f"| {i} | {b['prompt_tokens']} | {a['ttft_ms']:.0f} | {b['ttft_ms']:.0f} | "
                  f"{a['ttft_ms'] / b['ttft_ms']:.1f}x | {100 * b['reused']:.0f}% | "
                  f"{'y' if a['correct'] else 'n'}/{'y' if b['correct'] else 'n'} |")
        off_total = sum(r["ttft_ms"] for r in off["rows"])
        chunk_total = sum(r["ttft_ms"] for r in chunk["rows"])
        print(f"| all | | {off_total:.0f} | {chunk_total:.0f} | {off_total / chunk_total:.1f}x | "
              f"{100 * statistics.mean(r['reused'] for r in chunk['rows']):.0f}% mean | "
              f"{sum(r['correct'] for r in off['rows'])}/{sum(r['correct'] for r in chunk['rows'])} |")
    if ("approx", "retrieved") in results:
        off, approx = results[("off", "retrieved")], results[("approx", "retrieved")]
        off_total = sum(r["ttft_ms"] for r in off["rows"])
        n = len(off["rows"])
        print(f"\nlayout: retrieved, reuse=\"approx\"   (pre-warm of the passages: {approx['warm_ms']:.0f} ms)")
        print("| reuse | TTFT ms, all questions | speed-up vs off | reused (mean) | correct | same answer as off |")
        print("|---|---|---|---|---|---|")
        chunk = results[("chunk", "retrieved")]
        for name, x in (("off", off), ("chunk", chunk), ("approx", approx)):
            total = sum(r["ttft_ms"] for r in x["rows"])
            correct = sum(r["correct"] for r in x["rows"])
            same = sum(a["text"] == b["text"] for a, b in zip(off["rows"], x["rows"]))
            print(f"| {name} | {total:.0f} | {off_total / total:.1f}x | "
                  f"{100 * statistics.mean(r['reused'] for r in x['rows']):.0f}% | {correct}/{n} "
                  f"({100 * correct / n:.1f}%) | {same}/{n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

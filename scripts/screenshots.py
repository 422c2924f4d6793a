"""Screenshots of the main views for the README: `xvfb-run -a .venv/bin/python scripts/screenshots.py OUTDIR`.

Starts the real app in a throwaway home folder, drops two Markdown notes on a conversation, asks about them, then
for a code block and a table (the built-in 135M model's own answers, greedy: right in form, not always in content),
and saves light and dark screenshots at 1024 x 700 and 1600 x 1000 (app-THEME-WIDTH.png)."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NOTES = {
    "gull-island.md": "# Gull Island\n\nThe lighthouse keeper on Gull Island is Margarethe Olsen. She has kept "
                      "the light since 1998.\n\nFerries leave the harbour at eight and return at six.\n",
    "harbour.md": "# Harbour rules\n\nBoats moor at the north pier. Mooring costs forty crowns per night.\n",
}
QUESTIONS = (("Who keeps the lighthouse on Gull Island?", 40), ("How much does mooring cost?", 40),
             ("Write a Python function that adds two numbers.", 30),
             ("Make a Markdown table of three fruits and their colors.", 36))
SIZES = ((1024, 700), (1600, 1000))


async def shoot(window, out: Path) -> None:
    from app.main import wait_for

    client = window.client
    if not client.is_loaded:
        await wait_for(client.model_loaded, 300, failure=client.model_load_failed)
    tab = window.current_tab()
    window.rename_tab(window.tabs.indexOf(tab), "Gull Island")

    folder = Path(tempfile.mkdtemp())
    for name, text in NOTES.items():
        (folder / name).write_text(text, encoding="utf-8")
    await tab.ingest([str(folder)])
    if tab._warm_job is not None:
        await wait_for(client.warm_finished, 300)
    for question, tokens in QUESTIONS:
        window.db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": tokens})
        tab.composer.setPlainText(question)
        pending = asyncio.ensure_future(wait_for(client.generation_finished, 300, failure=client.generation_failed))
        await asyncio.sleep(0)
        tab.send()
        await pending
    window.new_conversation()
    window.rename_tab(window.tabs.count() - 1, "Recipes")
    window.tabs.setCurrentIndex(0)
    window.memory_meter.update_now()
    for width, height in SIZES:
        window.resize(width, height)
        for theme in ("light", "dark"):
            window.set_theme(theme)
            await asyncio.sleep(0.5)
            tab.chat_view.jump_to_latest()
            await asyncio.sleep(0.2)
            window.grab().save(str(out / f"app-{theme}-{width}.png"))


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "resources/screenshots")
    out.mkdir(parents=True, exist_ok=True)
    import qasync
    from PySide6.QtWidgets import QApplication

    from app.db import Database
    from app.engine_client import EngineClient
    from app.main_window import MainWindow

    app = QApplication([])
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    home = Path(tempfile.mkdtemp())
    db = Database(home / "kvboost.sqlite3")
    client = EngineClient(engine_options={"disk_cache_dir": str(home / "kv")})  # nothing from earlier runs
    window = MainWindow(db, client, theme_choice="light")
    window.resize(1280, 860)
    window.show()
    window.load_model(None)
    with loop:
        loop.run_until_complete(shoot(window, out))
    client.shutdown()
    print(f"saved {', '.join(f'app-{t}-{w}.png' for w, _ in SIZES for t in ('light', 'dark'))} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

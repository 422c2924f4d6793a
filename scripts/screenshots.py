"""Screenshots of the main views for the README: `xvfb-run -a .venv/bin/python scripts/screenshots.py OUTDIR`.

Starts the real app in a throwaway home folder, drops two Markdown notes on a conversation, asks about them,
opens the cache map of the answer, and saves light and dark screenshots."""

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


async def shoot(window, out: Path) -> None:
    from app.main import wait_for

    client = window.client
    if not client.is_loaded:
        await wait_for(client.model_loaded, 300, failure=client.model_load_failed)
    tab = window.current_tab()
    window.rename_tab(window.tabs.indexOf(tab), "Gull Island")
    window.db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 40})
    folder = Path(tempfile.mkdtemp())
    for name, text in NOTES.items():
        (folder / name).write_text(text, encoding="utf-8")
    await tab.ingest([str(folder)])
    if tab._warm_job is not None:
        await wait_for(client.warm_finished, 300)
    for question in ("Who keeps the lighthouse on Gull Island?", "How much does mooring cost?"):
        tab.composer.setPlainText(question)
        pending = asyncio.ensure_future(wait_for(client.generation_finished, 300, failure=client.generation_failed))
        await asyncio.sleep(0)
        tab.send()
        await pending
    window.new_conversation()
    window.rename_tab(window.tabs.count() - 1, "Recipes")
    window.tabs.setCurrentIndex(0)
    tab.chat_view.widgets[-1].map_button.setChecked(True)
    window.memory_meter.update_now()
    for theme in ("light", "dark"):
        window.set_theme(theme)
        await asyncio.sleep(0.5)
        window.grab().save(str(out / f"app-{theme}.png"))


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
    print(f"saved {out}/app-light.png and {out}/app-dark.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

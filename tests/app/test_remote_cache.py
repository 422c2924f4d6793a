"""The shared KV cache in the app: the Model dialog's URL loads the engine with it (a real redis-server with a
password), the password never reaches the settings database, and the memory meter shows the tier."""

from __future__ import annotations

import pytest
from qt_helpers import WAIT_MS
from redis_server import BINARY, RedisServer  # noqa: E402
from tiny_models import build_model, build_tokenizer  # noqa: E402

from app.memory_meter import memory_text, memory_tooltip  # noqa: E402
from app.model_menu import split_password, with_password  # noqa: E402

pytestmark = pytest.mark.skipif(BINARY is None, reason="redis-server is not installed (scripts/test.sh installs it)")


@pytest.fixture
def store(tmp_path):
    server = RedisServer(tmp_path, password="s3cret").start()
    yield server
    server.stop()


def test_passwords_come_out_of_the_url_and_back():
    assert split_password("redis://alice:pw@nas:6379/0") == ("redis://alice@nas:6379/0", "pw")
    assert split_password("rediss://:pw@nas/1") == ("rediss://nas/1", "pw")
    assert with_password("redis://alice@nas:6379/0", "pw") == "redis://alice:pw@nas:6379/0"
    assert with_password("rediss://nas/1", "pw") == "rediss://:pw@nas/1"
    assert with_password("redis://nas/1", None) == "redis://nas/1"


def test_a_model_loaded_with_a_shared_cache_shows_it_in_the_meter(qtbot, idle_window, tmp_path, store):
    folder = tmp_path / "tiny"
    build_model("llama").save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    window = idle_window
    with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):
        window.model_menu.load({"source": str(folder), "reuse": "chunk", "remote_cache": store.url})
    saved = window.db.get_setting("model")
    assert saved["remote_cache"] == f"redis://127.0.0.1:{store.port}/0" and "s3cret" not in str(saved)
    report = window.client.memory()
    assert report["remote"]["url"] == f"redis://:***@127.0.0.1:{store.port}/0"
    text = memory_text(1 << 30, report)
    assert "shared KV: 0 hits, 0 B written" in text and "unreachable" not in text
    assert f"shared KV store redis://:***@127.0.0.1:{store.port}/0: answering" in memory_tooltip(report)
    store.kill()
    down = dict(report, remote=dict(report["remote"], state="open", last_error="ConnectionError: refused"))
    assert "(unreachable)" in memory_text(1 << 30, down) and "refused" in memory_tooltip(down)


def test_an_answer_restored_from_the_shared_cache_says_so_in_its_cache_map(qtbot, window, smollm, tmp_path):
    """One machine's answer fills the store; a second engine with empty memory and disk tiers (another machine)
    answers the same long question from it: the same text, and the cache map counts the shared tokens."""
    from PySide6.QtCore import Qt
    from qt_helpers import send

    server = RedisServer(tmp_path).start()
    try:
        question = "Summarize this passage in one line.\n\n" + " ".join(
            f"Line {i}: the river carries silt from the northern hills to the delta every spring." for i in range(30))
        first_engine = smollm.with_options(disk_cache_bytes=0, remote_cache=server.url)
        with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):
            window.client.use_engine(first_engine)
        tab = window.new_conversation()
        window.db.update_conversation(tab.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 12})
        first = send(qtbot, tab, question)
        assert first_engine.store.remote.flush(30)
        with qtbot.waitSignal(window.client.model_loaded, timeout=WAIT_MS):  # "another machine": nothing local
            window.client.use_engine(smollm.with_options(disk_cache_bytes=0, remote_cache=server.url))
        other = window.new_conversation()
        window.db.update_conversation(other.conversation_id, sampling={"temperature": 0.0, "max_new_tokens": 12})
        second = send(qtbot, other, question)
        assert second.text == first.text
        shared = second.stats["reused_by_tier"].get("remote", 0)
        assert shared >= 128  # at least one whole chunk came from the store
        widget = other.chat_view.widgets[-1]
        qtbot.mouseClick(widget.map_button, Qt.LeftButton)
        assert f"{shared} from the shared cache" in widget.cache_map.toPlainText()
    finally:
        server.stop()

"""Fixtures for the desktop app: real SQLite files in tmp folders, real widgets offscreen, the real model.

The app's engine client adopts `smollm.with_options()` (shared weights, its own empty KV store) instead of
loading the model again."""

from __future__ import annotations

import asyncio

import pytest
from qt_helpers import WAIT_MS


@pytest.fixture(scope="session")
def aio_loop(qapp):
    """The qasync loop the app runs on, installed as asyncio's loop for the whole session."""
    import qasync

    loop = qasync.QEventLoop(qapp)
    asyncio.set_event_loop(loop)
    yield loop


@pytest.fixture
def db(tmp_path):
    from app.db import Database

    database = Database(tmp_path / "kvboost.sqlite3")
    yield database
    database.close()


@pytest.fixture
def client(qtbot):
    from app.engine_client import EngineClient

    c = EngineClient()
    yield c
    c.shutdown()


@pytest.fixture
def loaded_client(qtbot, client, smollm):
    with qtbot.waitSignal(client.model_loaded, timeout=WAIT_MS):
        client.use_engine(smollm.with_options())
    return client


def _shown_window(qtbot, db, client):
    from app.main_window import MainWindow

    w = MainWindow(db, client, theme_choice="light")
    qtbot.addWidget(w)
    w.show()
    return w


@pytest.fixture
def window(qtbot, db, loaded_client, aio_loop):
    return _shown_window(qtbot, db, loaded_client)


@pytest.fixture
def idle_window(qtbot, db, client, aio_loop):
    """A main window over a client with no model loaded yet (the test loads one, or points it elsewhere)."""
    return _shown_window(qtbot, db, client)


"""Where the app keeps its files: under a home folder, or the platform's per-user folders."""

from __future__ import annotations

from pathlib import Path

import platformdirs
import pytest

from app.db import Database
from app.paths import APP_AUTHOR, APP_NAME, HOME_ENV_VAR, FolderError, app_paths


def test_app_paths_with_home_puts_all_folders_under_it(tmp_path: Path):
    paths = app_paths(tmp_path / "portable")
    assert (paths.data_dir, paths.log_dir, paths.cache_dir) == (
        tmp_path / "portable" / "data",
        tmp_path / "portable" / "logs",
        tmp_path / "portable" / "cache",
    )
    assert paths.database == tmp_path / "portable" / "data" / "kvboost.sqlite3"
    assert paths.kv_cache_dir == tmp_path / "portable" / "cache" / "kv"  # the engine's disk tier stays inside
    assert not paths.data_dir.exists()
    paths.ensure()
    assert paths.data_dir.is_dir() and paths.log_dir.is_dir() and paths.cache_dir.is_dir()
    with Database(paths.database) as database:
        assert database.schema_version == 1


def test_ensure_names_the_file_in_the_way_of_a_folder(tmp_path: Path):
    (tmp_path / "home").write_text("a file")
    with pytest.raises(FolderError, match=f"{tmp_path / 'home'} is a file"):
        app_paths(tmp_path / "home").ensure()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data").write_text("a file")
    with pytest.raises(FolderError, match=f"{tmp_path / 'other' / 'data'} is a file"):
        app_paths(tmp_path / "other").ensure()


def test_app_paths_honours_the_home_environment_variable(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(HOME_ENV_VAR, str(tmp_path))
    assert app_paths().data_dir == tmp_path / "data"
    assert app_paths(tmp_path / "explicit").data_dir == tmp_path / "explicit" / "data"


def test_app_paths_without_home_uses_the_platform_user_folders(monkeypatch):
    monkeypatch.delenv(HOME_ENV_VAR, raising=False)
    paths = app_paths()
    assert paths.data_dir == Path(platformdirs.user_data_dir(APP_NAME, APP_AUTHOR))
    assert paths.log_dir == Path(platformdirs.user_log_dir(APP_NAME, APP_AUTHOR))
    assert paths.cache_dir == Path(platformdirs.user_cache_dir(APP_NAME, APP_AUTHOR))
    assert APP_NAME in str(paths.data_dir)
    assert paths.kv_cache_dir is None  # the engine's own per-user folder, shared with kvboost-server

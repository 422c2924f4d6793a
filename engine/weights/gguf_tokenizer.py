"""A GGUF file's tokenizer and chat template, converted by transformers once and kept in the cache folder.

transformers builds a GGUF's tokenizer from its metadata (vocabulary, merges, special ids, chat template) at every
load, which takes seconds (measured on the embedded SmolLM2-135M Q4_1 file: ~6 s on 2 busy cores, a third of a
default start; the cached copy loads in ~0.2 s). The converted tokenizer is saved with save_pretrained under
<cache>/gguf-tokenizers/<key>-<transformers version>, where <key> is engine.weights.gguf_file's digest of the file's
metadata bytes and size: any change to the vocabulary, merges, template or special ids is another key, and so is
another transformers (whose conversion may change). Written to a temporary folder and renamed into place, so a
reader never sees half a folder; a folder that does not load is converted again.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

from .gguf_file import GGUFFile

log = logging.getLogger(__name__)

CACHE_DIR_ENV_VAR = "KVBOOST_CACHE_DIR"  # as engine.kv.disk: the documented override of the cache folder
FOLDER = "gguf-tokenizers"


def tokenizer_cache_dir(engine_cache_dir: Path | str | None = None) -> Path:
    """<the engine's cache folder>/gguf-tokenizers: `engine_cache_dir` (from_pretrained's disk_cache_dir) when
    given, else $KVBOOST_CACHE_DIR when set, else platformdirs' per-user cache folder, as
    engine.kv.disk.default_cache_dir; the disk tier only ever touches its own payloads/ and tmp/."""
    if engine_cache_dir is not None:
        return Path(engine_cache_dir).expanduser() / FOLDER
    override = os.environ.get(CACHE_DIR_ENV_VAR)
    if override:
        return Path(override).expanduser() / FOLDER
    import platformdirs

    return Path(platformdirs.user_cache_dir("KVBoost", "KVBoost")) / "kv" / FOLDER


def load_gguf_tokenizer(file: GGUFFile, cache_dir: Path | None = None):
    """The tokenizer of `file`: from the cache when it holds this file's, else converted by transformers and
    saved there. `cache_dir` None: tokenizer_cache_dir()."""
    from transformers import AutoTokenizer

    folder = tokenizer_folder(file, cache_dir or tokenizer_cache_dir())
    if folder.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        except Exception as exc:  # a folder edited or damaged by hand: convert again below
            log.info("cached GGUF tokenizer %s does not load (%s: %s); converting again", folder,
                     type(exc).__name__, exc)
    path = Path(file.path)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)
    save_atomically(tokenizer, folder)
    return tokenizer


def tokenizer_folder(file: GGUFFile, cache_dir: Path) -> Path:
    """Where the tokenizer of `file` converted by this transformers is cached."""
    import transformers

    return cache_dir / f"{file.metadata_digest}-{transformers.__version__}"


def save_atomically(tokenizer, folder: Path) -> bool:
    """save_pretrained into a temporary sibling of `folder`, renamed into place. False (logged) when the folder
    cannot be written or another process put its copy there first (theirs is the same conversion)."""
    temporary = folder.parent / f".{folder.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(temporary))
        if folder.is_dir():  # damaged (it did not load): replaced by the new copy
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(temporary, folder)
        return True
    except OSError as exc:
        log.info("GGUF tokenizer not cached in %s (%s: %s)", folder, type(exc).__name__, exc)
        return False
    finally:
        shutil.rmtree(temporary, ignore_errors=True)

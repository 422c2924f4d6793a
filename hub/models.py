"""The model library: search the HuggingFace hub (or any server speaking its API) for models this engine loads, list
a repo's files per format and quantization, download one into the standard HF cache, list and remove what is
downloaded. Qt-free and torch-free (the fit estimate, hub.model_fit, imports torch when asked for).

Built on huggingface_hub's public API: HfApi.model_info(files_metadata=True) for file sizes and hashes,
get_hf_file_metadata (HEAD: etag, size, commit) and hf_hub_url, its shared HTTP session and hf_raise_for_status,
ModelInfo for search results. Search sends the request HfApi.list_models sends (GET /api/models with search,
filter, expand) as one GET: list_models retries a refused connection five times with backoff (about 23 s), too
long to tell an offline user so. Downloads go through hub.hub_cache (its docstring says why not hf_hub_download).

`endpoint`: the hub's URL; default $HF_ENDPOINT, else the public hub. `cache_dir`: default $HF_HUB_CACHE, else
$HF_HOME/hub, else huggingface_hub's default (~/.cache/huggingface/hub), read when the library is made so the
HF conventions hold whatever was imported first. Unreachable or offline ($HF_HUB_OFFLINE): HubUnreachable with
the reason; downloaded() never touches the network.

The hub is not trusted: its answers are checked before anything of them reaches the file system (hub.hub_names:
repo ids, revisions, commits, ETags, file names, sizes and hashes in the shapes the hub sends; RefusedHubAnswer
otherwise), an answer huggingface_hub cannot parse is RefusedHubAnswer too, and every error is of the ModelHubError
family (a redirect loop, a full disk: DiskFull, a link out of the cache: OutsideCache). A failed download keeps its
`.incomplete` file and the next download resumes from it, except after a hash mismatch, which deletes it.

Over 400 lines: every hub answer parsed and checked in one place, with the library's operations over them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

import httpx2
from huggingface_hub import HfApi, ModelInfo, get_hf_file_metadata, get_session, hf_hub_url
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

from . import hub_cache, hub_names
from .hub_cache import LocalModel
from .hub_names import (
    DiskFull,
    DownloadCancelled,
    DownloadFailed,
    HashMismatch,
    ModelHubError,
    OutsideCache,
    RefusedHubAnswer,
)

__all__ = ["ModelHub", "ModelHubError", "HubUnreachable", "HubNotFound", "DownloadCancelled", "DownloadFailed",
           "HashMismatch", "RefusedHubAnswer", "OutsideCache", "DiskFull", "SearchResult", "RemoteFile", "ModelEntry",
           "RepoFiles", "LocalModel", "gguf_quant", "SUPPORTED_ARCHITECTURES", "FORMATS"]

DEFAULT_ENDPOINT = "https://huggingface.co"
# config.json model_type / GGUF general.architecture values the engine is tested with (tests/support/tiny_models.py,
# and transformers' GGUF loader for the GGUF names).
SUPPORTED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text",
                                     "phi3"})
FORMATS = ("gguf", "safetensors", "awq")  # also the hub's tags for them
SEARCH_FIELDS = ["downloads", "likes", "tags", "pipeline_tag", "config", "gguf", "safetensors"]
# A safetensors folder is these top-level files; subfolders hold other formats (onnx/, original/, ...).
FOLDER_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja", ".tiktoken")
GGUF_PREFERENCE = ("Q4_K_M", "Q4_0", "Q4_1", "Q5_K_M", "Q8_0")  # download REPO without a file name

_QUANT = re.compile(r"(?:I?Q\d+(?:_[A-Z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|F16|F32|FP16|FP32)", re.I)
_SPLIT = re.compile(r"-\d{5}-of-\d{5}$")


class HubUnreachable(ModelHubError):
    """The hub did not answer (offline, refused, timed out); downloaded models are still listed."""


class HubNotFound(ModelHubError):
    """The repo, revision or file does not exist there (HTTP 404), or is private or gated."""


def gguf_quant(filename: str) -> str:
    """The quantization a GGUF file name says ("model.Q4_K_M.gguf" -> "Q4_K_M"; split parts share one name),
    or the file's stem when it names none."""
    stem = _SPLIT.sub("", PurePosixPath(filename).name[:-len(".gguf")])
    for token in reversed(re.split(r"[.\-]", stem)):
        if _QUANT.fullmatch(token):
            return token.upper()
    return stem


@contextlib.contextmanager
def _parsing(what: str):
    """huggingface_hub's (or json's) failure to read a hub answer as RefusedHubAnswer: no hub sends such JSON."""
    try:
        yield
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise RefusedHubAnswer(f"{what}: the hub's answer is not what the hub API sends ({type(exc).__name__}: "
                               f"{hub_names.shown(str(exc))})") from exc


def _mapping(value) -> dict | None:
    """A field the hub sends as an object (config, gguf), or None for anything else."""
    return value if isinstance(value, dict) else None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _tags(value) -> set[str]:
    return {t for t in value if isinstance(t, str)} if isinstance(value, list) else set()


def _quant_method(config: dict | None) -> str | None:
    quant = (config or {}).get("quantization_config")
    if not isinstance(quant, dict):
        return None
    return str(quant.get("quant_method", "")).lower() or None


@dataclass(frozen=True)
class SearchResult:
    repo: str
    architecture: str | None  # config model_type or GGUF architecture, when the hub says
    formats: tuple[str, ...]  # of FORMATS
    downloads: int
    likes: int
    parameters: int | None
    supported: bool
    reason: str | None  # why not, when not supported


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob sha1


@dataclass(frozen=True)
class ModelEntry:
    """What one download fetches: a GGUF quantization (one file, or the parts of a split one) or a folder."""

    name: str  # "Q4_K_M", ... for GGUF; "safetensors" or "awq" for a folder
    format: str  # of FORMATS
    files: tuple[RemoteFile, ...]
    supported: bool = True
    note: str | None = None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class RepoFiles:
    repo: str
    revision: str  # the commit the listing is of (downloads fetch exactly it)
    architecture: str | None
    entries: tuple[ModelEntry, ...]
    config: dict | None  # the hub's summary of config.json
    gguf: dict | None  # the hub's summary of the GGUF files

    def entry(self, choice: str | None = None) -> ModelEntry:
        """The entry named `choice` (a quantization, "safetensors"/"awq" or a file name); None: the folder if
        there is one, else the first GGUF quantization in GGUF_PREFERENCE, else the smallest."""
        if not self.entries:
            raise ModelHubError(f"{self.repo} has no GGUF file and no safetensors model this engine loads")
        if choice is None:
            folders = [e for e in self.entries if e.format != "gguf"]
            by_name = {e.name: e for e in self.entries}
            preferred = [by_name[q] for q in GGUF_PREFERENCE if q in by_name]
            return (folders or preferred or sorted(self.entries, key=lambda e: e.size))[0]
        for e in self.entries:
            if choice.upper() == e.name.upper() or any(choice == f.path for f in e.files):
                return e
        names = ", ".join(e.name for e in self.entries)
        raise ModelHubError(f"{self.repo} has no {choice!r}; choose one of: {names}")


def _architecture(config: dict | None, gguf: dict | None, tags: set[str]) -> str | None:
    arch = (config or {}).get("model_type") or (gguf or {}).get("architecture")
    return arch if isinstance(arch, str) and arch else next((t for t in sorted(tags) if t in SUPPORTED_ARCHITECTURES),
                                                            None)


def _support(architecture: str | None, formats) -> str | None:
    if not formats:
        return "no GGUF, float safetensors or AWQ weights"
    if architecture is None:
        return "the hub does not say its architecture"
    if architecture not in SUPPORTED_ARCHITECTURES:
        runs = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        return f"architecture {architecture!r} is not one this engine runs ({runs})"
    return None


def _search_result(info: ModelInfo) -> SearchResult:
    tags, config, gguf = _tags(info.tags), _mapping(info.config), _mapping(info.gguf)
    quant = _quant_method(config)
    formats = []
    if "gguf" in tags or gguf:
        formats.append("gguf")
    if quant == "awq" or "awq" in tags:
        formats.append("awq")
    elif "safetensors" in tags and quant is None:
        formats.append("safetensors")
    arch = _architecture(config, gguf, tags)
    params = _count(info.safetensors.total if info.safetensors else None) or _count((gguf or {}).get("total"))
    reason = _support(arch, formats)
    return SearchResult(hub_names.repo_id(info.id, "the hub's repo id"), arch, tuple(formats),
                        _count(info.downloads) or 0, _count(info.likes) or 0, params, reason is None, reason)


def _remote_file(sibling) -> RemoteFile:
    """One file of the hub's listing (a RepoSibling), its name, size and hashes checked."""
    path = hub_names.file_name(sibling.rfilename)
    lfs = sibling.lfs
    size = hub_names.size_or_none(sibling.size, f"the size of {path}")
    if size is None and lfs is not None:
        size = hub_names.size_or_none(lfs.size, f"the lfs size of {path}")
    sha256 = hub_names.hash_or_none(lfs.sha256, hub_names.SHA256, f"the lfs sha256 of {path}") if lfs else None
    blob_id = hub_names.hash_or_none(sibling.blob_id, hub_names.GIT_SHA1, f"the blobId of {path}")
    return RemoteFile(path, size or 0, sha256, blob_id)


def _entries(info: ModelInfo) -> tuple[ModelEntry, ...]:
    if not isinstance(info.siblings, (list, type(None))):
        raise hub_names.refused("the hub's file list (siblings)", info.siblings, "not a list")
    files = [_remote_file(s) for s in info.siblings or ()]
    config = _mapping(info.config)
    arch = _architecture(config, _mapping(info.gguf), _tags(info.tags))
    arch_reason = _support(arch, ["any"])
    quants: dict[str, list[RemoteFile]] = {}
    for f in files:
        name = PurePosixPath(f.path).name
        if name.endswith(".gguf") and not name.startswith("mmproj"):  # vision projectors are no model
            quants.setdefault(gguf_quant(f.path), []).append(f)
    entries = []
    folder = [f for f in files if "/" not in f.path and f.path.endswith(FOLDER_SUFFIXES)]
    names = {f.path for f in folder}
    if "config.json" in names and any(n.endswith(".safetensors") for n in names):
        quant = _quant_method(config)
        fmt = "awq" if quant == "awq" else "safetensors"
        note = arch_reason or (f"weights quantized with {quant!r}: the engine loads float, AWQ and GGUF weights"
                               if quant not in (None, "awq") else None)
        # config.json last: a folder without it is unfinished (hub.hub_cache)
        ordered = sorted(folder, key=lambda f: (f.path == "config.json", f.path))
        entries.append(ModelEntry(fmt, fmt, tuple(ordered), note is None, note))
    for quant, parts in sorted(quants.items(), key=lambda kv: sum(f.size for f in kv[1])):
        parts.sort(key=lambda f: f.path)
        note = arch_reason or (f"split into {len(parts)} files: the engine loads single-file GGUF only"
                               if len(parts) > 1 else None)
        entries.append(ModelEntry(quant, "gguf", tuple(parts), note is None, note))
    return tuple(entries)


def _digest(etag: str, f: RemoteFile) -> hub_cache.Digest:
    """What the bytes must hash to: the ETag itself (a blob's name is its bytes' hash), sha256 for 64 hex digits,
    git's blob sha1 for 40. A listing that names another hash of the same kind is refused."""
    kind, listed = ("sha256", f.sha256) if len(etag) == 64 else ("git-sha1", f.blob_id)
    if listed is not None and listed != etag:
        raise RefusedHubAnswer(f"refused {f.path}: its ETag is {kind} {etag}, the hub's listing says {listed}; "
                               "nothing was written")
    return hub_cache.Digest(kind, etag)


def default_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(hf_constants.HF_HUB_CACHE)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


ProgressCallback = Callable[[int, int], None]  # (bytes held so far, bytes in all)


class ModelHub:
    def __init__(self, endpoint: str | None = None, cache_dir: str | os.PathLike | None = None,
                 token: str | bool | None = None, timeout_s: float = 15.0):
        """`token`: huggingface_hub's meaning (None: the stored login or $HF_TOKEN, if any; False: none)."""
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.token = token
        self.timeout_s = timeout_s
        self._api = HfApi(endpoint=self.endpoint, token=token)
        self._remote: dict[tuple, object] = {}  # small files and GGUF headers already read, per commit

    @contextlib.contextmanager
    def _errors(self, what: str, keeps_partial: bool = False):
        """huggingface_hub's and the transport's exceptions as this module's, with what was being done."""
        if _offline():
            raise HubUnreachable(f"{what}: HF_HUB_OFFLINE is set, so the hub is not asked; downloaded models "
                                 "are still listed")
        resume = "; what was downloaded is kept and the next download resumes from it" if keeps_partial else ""
        try:
            yield
        except OfflineModeIsEnabled as exc:
            raise HubUnreachable(f"{what}: {exc}") from exc
        except httpx2.TransportError as exc:
            raise HubUnreachable(f"{what}: cannot reach {self.endpoint} ({type(exc).__name__}: {exc}){resume}") from exc
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if status in (401, 404):
                raise HubNotFound(f"{what}: not found on {self.endpoint} (HTTP {status}; a private or gated repo "
                                  "needs a token)") from exc
            raise ModelHubError(f"{what}: {self.endpoint} answered HTTP {status}: {first}") from exc
        except httpx2.TooManyRedirects as exc:
            raise ModelHubError(f"{what}: {self.endpoint} redirects in a loop ({exc}){resume}") from exc
        except (httpx2.HTTPError, httpx2.InvalidURL, httpx2.StreamError) as exc:  # e.g. a redirect to no URL
            raise ModelHubError(f"{what}: {self.endpoint} answered what no hub sends ({type(exc).__name__}: "
                                f"{hub_names.shown(str(exc))}){resume}") from exc
        except OSError as exc:  # the disk (after the OSErrors above, which are the network's)
            raise hub_cache.write_failed(exc, what) from exc

    def _headers(self) -> dict:
        return build_hf_headers(token=self.token)

    # -- the hub -------------------------------------------------------------------------------------------
    def search(self, query: str, *, format: str | None = None, architecture: str | None = None,
               supported_only: bool = True, limit: int = 30) -> list[SearchResult]:
        """Models whose name contains `query`, most downloaded first; `format` (of FORMATS) and `architecture`
        filter on the hub's tags; `supported_only` drops what this engine cannot run."""
        if format is not None and format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS} or None, got {format!r}")
        params: dict = {"search": query, "sort": "downloads", "direction": -1, "expand": SEARCH_FIELDS,
                        "limit": min(100, limit * 3 if supported_only else limit)}
        tags = [t for t in (format, architecture) if t]
        if tags:
            params["filter"] = tags
        what = f"searching for {query!r}"
        with self._errors(what), _parsing(what):
            response = get_session().get(f"{self.endpoint}/api/models", params=params, headers=self._headers(),
                                         timeout=self.timeout_s)
            hf_raise_for_status(response)
            infos = [ModelInfo(**{"siblings": None, **item}) for item in response.json()]
        results = [_search_result(info) for info in infos]
        return [r for r in results if r.supported or not supported_only][:limit]

    def files(self, repo: str, revision: str = "main") -> RepoFiles:
        """`repo`'s downloadable entries at `revision`, with sizes and hashes."""
        repo, revision = hub_names.repo_id(repo), hub_names.revision(revision)
        what = f"listing the files of {repo}"
        with self._errors(what), _parsing(what):
            info = self._api.model_info(repo, revision=revision, files_metadata=True, timeout=self.timeout_s)
        sha = info.sha if info.sha is not None or not hub_names.COMMIT.fullmatch(revision) else revision
        commit = hub_names.commit(sha, f"the commit (sha) of {repo}")
        config, gguf = _mapping(info.config), _mapping(info.gguf)
        return RepoFiles(repo, commit, _architecture(config, gguf, _tags(info.tags)), _entries(info), config, gguf)

    def download(self, repo: str, choice: str | None = None, *, revision: str = "main",
                 progress: ProgressCallback | None = None, cancel: threading.Event | None = None) -> Path:
        """Downloads one entry of `repo` (RepoFiles.entry(choice)) and returns what --model takes: the .gguf file
        or the snapshot folder. Resumes what an earlier attempt left; raises DownloadCancelled when `cancel` is
        set (the partial file stays), HashMismatch, HubUnreachable, HubNotFound, RefusedHubAnswer, OutsideCache,
        DiskFull (the partial file stays)."""
        listing = self.files(repo, revision)
        entry = listing.entry(choice)
        commit = listing.revision
        repo_dir = hub_cache.repo_folder(self.cache_dir, repo)
        with self._errors(f"downloading {repo}"):  # scan_cache_dir calls a repo without snapshots/ corrupt
            hub_cache.make_folder(self.cache_dir, repo_dir / "snapshots")
        report = progress or (lambda done, total: None)
        done = 0
        headers = self._headers()
        for f in entry.files:
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled(f"{repo} {entry.name}: cancelled")
            if hub_cache.snapshot_file(repo_dir, commit, f.path) is None:
                self._fetch(repo, commit, repo_dir, f, headers, lambda n, base=done: report(base + n, entry.size),
                            cancel)
            done += f.size
            report(done, entry.size)
        with self._errors(f"downloading {repo}"):
            hub_cache.write_ref(repo_dir, revision, commit)
        snapshot = repo_dir / "snapshots" / commit
        return snapshot / entry.files[0].path if entry.format == "gguf" else snapshot

    def _fetch(self, repo, commit, repo_dir: Path, f: RemoteFile, headers, on_bytes, cancel) -> None:
        url = hf_hub_url(repo, f.path, revision=commit, endpoint=self.endpoint)
        with self._errors(f"downloading {f.path} from {repo}", keeps_partial=True):
            meta = get_hf_file_metadata(url, token=self.token, timeout=self.timeout_s, endpoint=self.endpoint)
            if not meta.etag:
                raise DownloadFailed(f"{url}: the server sent no ETag to name the file by")
            name = hub_names.etag(meta.etag, f"the ETag of {f.path}")
            size = hub_names.size_or_none(meta.size, f"the size of {f.path} (X-Linked-Size or Content-Length)")
            blob = hub_cache.check_inside(self.cache_dir, repo_dir / "blobs" / name)
            if not blob.is_file():
                try:
                    hub_cache.fetch_blob(url, blob, size=f.size if size is None else size, digest=_digest(name, f),
                                         headers=headers, on_bytes=on_bytes, cancel=cancel, timeout_s=self.timeout_s)
                except (HashMismatch, DiskFull) as exc:
                    raise type(exc)(f"{repo}/{f.path}: {exc}") from exc
            hub_cache.link_snapshot(repo_dir, commit, f.path, blob)

    def read_remote(self, repo: str, commit: str, path: str, *, max_bytes: int | None = None) -> bytes:
        """A small file of `repo` at `commit` (or its first `max_bytes`), in memory: not written to the cache."""
        key = (repo, commit, path, max_bytes)
        if key not in self._remote:
            url = hf_hub_url(repo, path, revision=commit, endpoint=self.endpoint)
            ranged = {"Range": f"bytes=0-{max_bytes - 1}"} if max_bytes else {}
            with self._errors(f"reading {path} of {repo}"):
                response = get_session().get(url, headers={**self._headers(), **ranged}, timeout=self.timeout_s)
                hf_raise_for_status(response)
                self._remote[key] = response.content[:max_bytes] if max_bytes else response.content
        return self._remote[key]

    def fit(self, listing: RepoFiles, entry: ModelEntry, *, context_tokens: int = 4096, weights: str = "auto",
            device: str = "auto"):
        """Whether `entry` would fit this machine (hub.model_fit.Fit), from its config.json or its GGUF
        header, read from the hub in memory (imports torch)."""
        from . import model_fit

        if entry.format == "gguf":
            head = self.read_remote(listing.repo, listing.revision, entry.files[0].path,
                                    max_bytes=model_fit.GGUF_HEADER_MAX_BYTES)
            return model_fit.fit_gguf(entry.size, model_fit.read_gguf_header(head), context_tokens=context_tokens,
                                      weights=weights, device=device)
        config = json.loads(self.read_remote(listing.repo, listing.revision, "config.json"))
        return model_fit.fit_config(config, context_tokens=context_tokens, weights=weights, device=device)

    # -- the cache -----------------------------------------------------------------------------------------
    def downloaded(self) -> list[LocalModel]:
        """What the cache holds: complete GGUF files and folders, and unfinished ones (complete=False)."""
        return hub_cache.scan(self.cache_dir)

    def remove(self, repo: str) -> int:
        """Deletes every downloaded file of `repo` (finished or not); returns the bytes freed."""
        repo_dir = hub_cache.repo_folder(self.cache_dir, repo)
        locks = self.cache_dir / ".locks" / repo_dir.name
        if not repo_dir.is_dir():
            raise ModelHubError(f"{repo} is not downloaded (nothing in {self.cache_dir})")
        hub_cache.check_inside(self.cache_dir, repo_dir)  # deleting through a link would delete what it points at
        hub_cache.check_inside(self.cache_dir, locks)
        freed = sum((Path(folder) / name).lstat().st_size for folder, _, names in os.walk(repo_dir) for name in names
                    if not (Path(folder) / name).is_symlink())
        try:
            shutil.rmtree(repo_dir)
        except OSError as exc:
            raise ModelHubError(f"removing {repo}: cannot delete {exc.filename}: {exc.strerror or exc}") from exc
        shutil.rmtree(locks, ignore_errors=True)
        return freed

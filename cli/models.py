"""`kvboost models search QUERY | files REPO | download REPO [FILE] | list | remove REPO`: the model library
(hub.models) on the command line. Progress goes to stderr; `download` prints the local path as its last line
on stdout (what `--model` takes). $HF_ENDPOINT, $HF_HOME and $HF_HUB_CACHE are honoured.

A failure is one line on stderr (`kvboost models: error: ...`) and exit status 1 (130 for a cancel): an
unreachable hub, a refused hub answer (a name that is a path, a redirect loop), a full disk. A failed download
keeps what it fetched (`<etag>.incomplete`, listed as unfinished) and the same command resumes from it; only a
hash mismatch deletes it."""

from __future__ import annotations

import json
import sys

JSON_HELP = "print JSON instead of a table"
REVISION_HELP = "a branch, tag or commit of the repo (default: main)"


def add_models_parser(subparsers) -> None:
    p = subparsers.add_parser("models", help="search, download, list and remove models (HuggingFace hub)")
    p.add_argument("--endpoint", default=None, help="hub URL (default: $HF_ENDPOINT or https://huggingface.co)")
    p.add_argument("--cache-dir", default=None, help="HF cache folder (default: $HF_HUB_CACHE or $HF_HOME/hub)")
    actions = p.add_subparsers(dest="models_action", required=True)

    a = actions.add_parser("search", help="models whose name contains QUERY, most downloaded first")
    a.add_argument("query")
    a.add_argument("--format", choices=("gguf", "safetensors", "awq"), default=None,
                   help="only repos with files in this format")
    a.add_argument("--arch", default=None, help="architecture (config model_type), e.g. llama, qwen2")
    a.add_argument("--all", action="store_true", help="also models this engine cannot run")
    a.add_argument("--limit", type=int, default=20, help="at most this many results (default 20)")
    a.add_argument("--json", action="store_true", help=JSON_HELP)

    a = actions.add_parser("files", help="a repo's downloads per format and quantization, with sizes and fit")
    a.add_argument("repo")
    a.add_argument("--revision", default="main", help=REVISION_HELP)
    a.add_argument("--context", type=int, default=4096, help="context length the fit estimate counts KV for")
    a.add_argument("--weights", default="auto", choices=("auto", "float", "int4"),
                   help="the weight format the fit estimate assumes (as --weights of chat/run)")
    a.add_argument("--no-fit", action="store_true", help="sizes only (no config read, no torch)")
    a.add_argument("--json", action="store_true", help=JSON_HELP)

    a = actions.add_parser("download", help="download one GGUF quantization or the safetensors folder")
    a.add_argument("repo")
    a.add_argument("file", nargs="?", default=None,
                   help="a quantization (Q4_K_M), a file name, or safetensors / awq (default: the folder if there "
                        "is one, else Q4_K_M, Q4_0, ...)")
    a.add_argument("--revision", default="main", help=REVISION_HELP)

    actions.add_parser("list", help="downloaded models (unfinished downloads are marked)").add_argument(
        "--json", action="store_true", help=JSON_HELP)
    actions.add_parser("remove", help="delete every downloaded file of a repo").add_argument("repo")
    p.set_defaults(func=run_models)


def _human(n: float) -> str:  # hub.model_fit.human_bytes, without importing torch (help, --no-fit)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def run_models(args) -> int:
    from hub.models import DownloadCancelled, ModelHub, ModelHubError

    hub = ModelHub(endpoint=args.endpoint, cache_dir=args.cache_dir)
    try:
        return _ACTIONS[args.models_action](hub, args)
    except DownloadCancelled as exc:
        print(f"kvboost models: {exc}; run the same command again to resume", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\nkvboost models: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except (ModelHubError, ValueError) as exc:
        print(f"kvboost models: error: {exc}", file=sys.stderr)
        return 1


def _search(hub, args) -> int:
    results = hub.search(args.query, format=args.format, architecture=args.arch, supported_only=not args.all,
                         limit=args.limit)
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
        return 0
    if not results:
        print(f"no models match {args.query!r}", file=sys.stderr)
    for r in results:
        params = f"{r.parameters / 1e9:.2f}B params" if r.parameters else "params ?"
        flag = "" if r.supported else f"  [not runnable: {r.reason}]"
        print(f"{r.repo}  {r.architecture or '?'}  {','.join(r.formats) or '-'}  {params}  "
              f"{r.downloads} downloads{flag}")
    return 0


def _files(hub, args) -> int:
    listing = hub.files(args.repo, args.revision)
    rows = []
    for entry in listing.entries:
        fit = None
        if not args.no_fit and entry.supported:
            try:
                fit = hub.fit(listing, entry, context_tokens=args.context, weights=args.weights)
            except Exception as exc:  # a config transformers cannot read: sizes still help
                fit = exc
        rows.append((entry, fit))
    if args.json:
        print(json.dumps([{"name": e.name, "format": e.format, "size": e.size, "files": [f.path for f in e.files],
                           "supported": e.supported, "note": e.note,
                           "fit": f.to_dict() if hasattr(f, "to_dict") else (str(f) if f else None)}
                          for e, f in rows], indent=2))
        return 0
    print(f"{listing.repo} @ {listing.revision[:12]}  ({listing.architecture or 'architecture ?'})")
    for entry, fit in rows:
        where = (f"{fit.level}: {fit.summary} (weights {_human(fit.weight_bytes)} {fit.weight_format} + KV "
                 f"{_human(fit.kv_bytes)} at {fit.context_tokens} tokens; {fit.memory} "
                 f"{_human(fit.available_bytes)} free)" if hasattr(fit, "level")
                 else f"fit unknown: {fit}" if fit else entry.note or "")
        print(f"  {entry.name:<12} {entry.format:<11} {_human(entry.size):>10}  {where}")
    return 0


def _download(hub, args) -> int:
    from tqdm import tqdm

    listing = hub.files(args.repo, args.revision)
    entry = listing.entry(args.file)
    print(f"downloading {args.repo} {entry.name} ({_human(entry.size)}, {len(entry.files)} files)", file=sys.stderr)
    with tqdm(total=entry.size, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              desc=entry.name) as bar:
        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)

        path = hub.download(args.repo, entry.files[0].path if entry.format == "gguf" else entry.name,
                            revision=args.revision, progress=progress)
    print(path)
    return 0


def _list(hub, args) -> int:
    from engine.builtin import builtin_model_path

    models = hub.downloaded()
    if args.json:
        print(json.dumps([{**m.__dict__, "path": str(m.path)} for m in models], indent=2))
        return 0
    builtin = builtin_model_path()
    if builtin is not None:  # ships with the app: always there, never downloaded or removed
        print(f"built-in  {builtin.name}  {_human(builtin.stat().st_size)}  {builtin}")
    if not models:
        print(f"nothing downloaded in {hub.cache_dir}", file=sys.stderr)
    for m in models:
        state = "" if m.complete else "  [unfinished: download it again to resume]"
        print(f"{m.repo}  {m.name}  {_human(m.size_bytes)}  {m.path}{state}")
    return 0


def _remove(hub, args) -> int:
    print(f"removed {args.repo} ({_human(hub.remove(args.repo))} freed)")
    return 0


_ACTIONS = {"search": _search, "files": _files, "download": _download, "list": _list, "remove": _remove}

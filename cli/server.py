"""`kvboost-server`: the OpenAI-compatible server (server.app) over an engine loaded from the command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from cli.kvboost import add_engine_options, load_engine, quiet_transformers
from engine.version import version


def build_server_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvboost-server", description="OpenAI-compatible server over the "
                                     "KVBoost engine (GET /v1/models, POST /v1/chat/completions, "
                                     "POST /v1/completions, GET /health).")
    parser.add_argument("--version", action="version", version=f"kvboost-server {version()}")
    add_engine_options(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: this machine only; 0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("KVBOOST_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every request (default: $KVBOOST_API_KEY; the "
                        "environment keeps the key out of the process list)")
    parser.add_argument("--model-name", default=None, help="the model id clients send (default: from --model)")
    parser.add_argument("--header-timeout", type=_positive_seconds, default=30.0,
                        help="seconds a client has to send a request head (default 30)")
    parser.add_argument("--body-timeout", type=_positive_seconds, default=30.0,
                        help="seconds a client has to send a request body once its head is in (default 30; then 408)")
    parser.add_argument("--keep-alive-timeout", type=_positive_seconds, default=5.0,
                        help="seconds an idle connection stays open between requests (default 5)")
    parser.add_argument("--max-batch", type=_positive_int, default=8,
                        help="requests decoded together in one forward pass per step (default 8; 1: one at a time, "
                        "in arrival order); more wait in the queue")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what the engine and the server do (INFO), transformers' warnings included")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def main(argv=None) -> int:
    args = build_server_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if not args.verbose:
        quiet_transformers()
    from engine import ModelLoadError

    try:
        from server.app import serve
        from server.guard import Timeouts
    except ImportError as exc:
        print(f"kvboost-server: the server needs its extra: pip install 'kvboost-desktop[server]' ({exc})",
              file=sys.stderr)
        return 2
    from engine import EngineWorker

    # The model is loaded on the thread that will answer: torch keeps its threads per calling thread, and a second
    # thread's set shares the cores with the first's (torch-computed models decoded 2x slower answering on another
    # thread than the one that loaded them).
    worker = EngineWorker(name="kvboost-server-engine", max_batch=args.max_batch)
    loaded: dict = {}
    try:
        list(worker.submit(lambda cancel: loaded.update(engine=load_engine(args)), source="load"))
    except (ModelLoadError, ValueError) as exc:
        worker.stop(5)
        print(f"kvboost-server: error: {exc}", file=sys.stderr)
        return 2
    engine = loaded["engine"]
    model_id = args.model_name or Path(engine.info().name).name.removesuffix(".gguf")
    print(f"kvboost-server: serving {model_id!r} on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if args.api_key else ''}", file=sys.stderr, flush=True)
    try:
        serve(engine, model_id=model_id, host=args.host, port=args.port, api_key=args.api_key,
              log_level="info" if args.verbose else "warning",
              timeouts=Timeouts(header_s=args.header_timeout, body_s=args.body_timeout,
                                keep_alive_s=args.keep_alive_timeout), max_batch=args.max_batch, worker=worker)
    except KeyboardInterrupt:
        pass
    finally:
        worker.stop(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())

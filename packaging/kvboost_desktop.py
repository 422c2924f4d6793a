"""The frozen app's entry point (packaging/kvboost-desktop.spec): what the `kvboost-desktop` script runs."""

import multiprocessing
import sys

if __name__ == "__main__":
    # First: a document worker process (app.document_worker, spawned) starts this same executable.
    multiprocessing.freeze_support()
    from app.main import main

    sys.exit(main())

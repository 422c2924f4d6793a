"""Benchmarks and their workloads: ratios measured side by side in one run, never pass/fail tests.

`python -m bench ...` (= `kvboost bench ...`) runs the reuse benchmark (bench.reuse); the other benches are
scripts in this folder (kv_tiers.py, server.py, rag_session.py). See bench/README.md.
"""

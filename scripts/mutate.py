"""A small mutation run over the modules that hold the engine's invariants.

Each mutation is a deliberate small bug (a key that skips a token, a checksum over part of a file, a sum in
another order) with the test files that should catch it. The run makes a scratch git worktree of HEAD (the
committed sources: commit first), applies one mutation at a time there, runs its tests with a time limit, records
whether they failed (KILLED) or passed (SURVIVED) and restores the file. The checkout it was started from is never
written to. C kernels are rebuilt by the library itself (keyed by their source's hash) into a scratch cache folder.

    python scripts/mutate.py                  # every mutation; prints a Markdown table
    python scripts/mutate.py --list           # the mutations and their tests
    python scripts/mutate.py --only keys.chain_skips_first_token --only payload.checksum_first_4kb

Not part of the test suite (a full run takes about half an hour on two cores); the suite only checks that every
mutation still applies to the current sources (tests/engine/test_mutation_list.py). The last run's results, the
survivors and why they survive: docs/mutation.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

KEYS_TESTS = ("tests/engine/test_chunking_keys_store.py", "tests/engine/test_key_sensitivity.py")
CHUNKING_TESTS = ("tests/engine/test_chunk_cuts.py", "tests/engine/test_chunking_keys_store.py",
                  "tests/engine/test_key_sensitivity.py")
PLAN_TESTS = ("tests/engine/test_plan_rules.py", "tests/engine/test_chunking_keys_store.py",
              "tests/engine/test_key_sensitivity.py", "tests/engine/test_engine_promises.py")
PAYLOAD_TESTS = ("tests/engine/test_disk_properties.py", "tests/engine/test_disk_payload_damage.py",
                 "tests/engine/test_kv_layout.py")
ROWS_TESTS = ("tests/engine/test_disk_row_keys.py", "tests/engine/test_disk_properties.py",
              "tests/engine/test_disk_hostile.py")
ATTENTION_TESTS = ("tests/engine/test_exact_attention.py",)
GGUF_TESTS = ("tests/engine/test_gguf_blocks.py",)


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str  # occurs exactly once in `file`
    mutated: str
    tests: tuple[str, ...]


MUTATIONS = (
    # -- engine/keys.py: the chained key is equal iff every token before and in the chunk is equal ---------------
    Mutation("keys.chain_skips_first_token", "engine/keys.py",
             "h = hashlib.blake2b(parent, digest_size=KEY_BYTES)\n    h.update(_token_bytes(tokens))",
             "h = hashlib.blake2b(parent, digest_size=KEY_BYTES)\n    h.update(_token_bytes(list(tokens)[1:]))",
             KEYS_TESTS),
    Mutation("keys.chain_skips_last_token", "engine/keys.py",
             "h = hashlib.blake2b(parent, digest_size=KEY_BYTES)\n    h.update(_token_bytes(tokens))",
             "h = hashlib.blake2b(parent, digest_size=KEY_BYTES)\n    h.update(_token_bytes(list(tokens)[:-1]))",
             KEYS_TESTS),
    Mutation("keys.chain_ignores_parent", "engine/keys.py",
             "h = hashlib.blake2b(parent, digest_size=KEY_BYTES)",
             "h = hashlib.blake2b(b\"\", digest_size=KEY_BYTES)", KEYS_TESTS),
    Mutation("keys.content_skips_first_token", "engine/keys.py",
             "fingerprint.encode() + b\"\\0\", digest_size=KEY_BYTES)\n    h.update(_token_bytes(tokens))",
             "fingerprint.encode() + b\"\\0\", digest_size=KEY_BYTES)\n    h.update(_token_bytes(list(tokens)[1:]))",
             KEYS_TESTS),
    Mutation("keys.content_ignores_fingerprint", "engine/keys.py",
             "b\"kvboost-content\\0\" + fingerprint.encode() + b\"\\0\"", "b\"kvboost-content\\0\"", KEYS_TESTS),
    Mutation("keys.root_ignores_fingerprint", "engine/keys.py",
             "b\"kvboost-root\\0\" + fingerprint.encode()", "b\"kvboost-root\\0\"", KEYS_TESTS),
    Mutation("keys.token_ids_as_int16", "engine/keys.py",
             "np.asarray(tokens, dtype=\"<i4\").tobytes()",
             "(np.asarray(tokens, dtype=\"<i8\") % 65536).astype(\"<i4\").tobytes()", KEYS_TESTS),
    # -- engine/chunking.py: prefix-stable cuts; only complete chunks get keys ---------------------------------------
    Mutation("chunking.fixed_tail_counted_complete", "engine/chunking.py",
             "num_complete = n // cfg.size", "num_complete = len(spans)", CHUNKING_TESTS),
    Mutation("chunking.semantic_earliest_among_equals", "engine/chunking.py",
             "if strength >= best_strength and strength > NO_BREAK:",
             "if strength > best_strength and strength > NO_BREAK:", CHUNKING_TESTS),
    Mutation("chunking.semantic_window_from_start", "engine/chunking.py",
             "for pos in range(start + cfg.size // 4, limit):", "for pos in range(start + 1, limit):",
             CHUNKING_TESTS),
    Mutation("chunking.adaptive_line_ends_equal_sentence_ends", "engine/chunking.py",
             "0 if strength >= SENTENCE_BREAK else 1", "0", CHUNKING_TESTS),
    Mutation("chunking.adaptive_decides_without_the_window", "engine/chunking.py",
             "if target + cfg.window > len(ids):", "if target > len(ids):", CHUNKING_TESTS),
    # -- engine/plan.py: keys chain from the root; reuse only what is exact --------------------------------------------
    Mutation("plan.keys_not_chained", "engine/plan.py",
             "parent = chain_key(parent, ids[start:end])\n        keys.append(parent)",
             "keys.append(chain_key(root, ids[start:end]))", PLAN_TESTS),
    Mutation("plan.common_prefix_skips_first_token", "engine/plan.py",
             "while i < n and a[i] == b[i]:", "while i < n and (a[i] == b[i] or i == 0):", PLAN_TESTS),
    Mutation("plan.inexact_children_reused", "engine/plan.py",
             "        if not child.exact:\n            continue\n", "", PLAN_TESTS),
    Mutation("plan.prefix_mode_goes_on_after_a_miss", "engine/plan.py",
             "if not hit and mode == \"prefix\":", "if not hit and mode == \"never\":", PLAN_TESTS),
    Mutation("plan.last_token_reused", "engine/plan.py",
             "    last = segments[-1]\n    if last.kind == MISS:", "    last = segments[-1]\n    if True:",
             PLAN_TESTS),
    Mutation("plan.no_lossy_means_prompt_end", "engine/plan.py",
             "default=sys.maxsize)", "default=len(self.ids))", PLAN_TESTS),
    # -- engine/kv/payload_file.py: every read checks the whole file ---------------------------------------------------
    Mutation("payload.checksum_first_4kb", "engine/kv/payload_file.py",
             "h = xxhash.xxh3_128(head)\n    h.update(data)", "h = xxhash.xxh3_128(head)\n    h.update(data[:4096])",
             PAYLOAD_TESTS),
    Mutation("payload.checksum_skips_header", "engine/kv/payload_file.py",
             "h = xxhash.xxh3_128(head)", "h = xxhash.xxh3_128(b\"\")", PAYLOAD_TESTS),
    Mutation("payload.checksum_not_verified", "engine/kv/payload_file.py",
             "if verify:\n            if _checksum", "if False:\n            if _checksum", PAYLOAD_TESTS),
    Mutation("payload.longer_file_accepted", "engine/kv/payload_file.py",
             "data_start + data_bytes != len(raw)", "data_start + data_bytes > len(raw)", PAYLOAD_TESTS),
    Mutation("payload.entry_not_checked", "engine/kv/payload_file.py",
             "for name, value in (expect or {}).items():", "for name, value in {}.items():",
             tuple(dict.fromkeys(PAYLOAD_TESTS + ROWS_TESTS))),
    # -- engine/kv/disk_rows.py: a row is trusted only if it names its own key --------------------------------------
    Mutation("rows.key_not_recomputed", "engine/kv/disk_rows.py",
             "if key != expected_key(kind, parent, tokens, bool(exact)):", "if False:", ROWS_TESTS),
    Mutation("rows.tail_key_without_marker", "engine/kv/disk_rows.py",
             "return chain_key(parent + b\"tail\", tokens)", "return chain_key(parent, tokens)", ROWS_TESTS),
    Mutation("rows.file_prefix_not_matched", "engine/kv/disk_rows.py",
             "if match is None or match.group(1) != match.group(2)[:2]:", "if match is None:", ROWS_TESTS),
    # -- C kernels: a fixed order of every sum, whatever the cut of the rows ------------------------------------------
    Mutation("attention.dot_one_accumulator", "engine/attention_rows.h",
             "s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);",
             "s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s0);", ATTENTION_TESTS),
    Mutation("attention.blocked_dot_other_tree", "engine/attention_rows.h",
             "const __m256 total = _mm256_add_ps(_mm256_add_ps(lo[0], lo[2]), _mm256_add_ps(lo[1], lo[3]));",
             "const __m256 total = _mm256_add_ps(_mm256_add_ps(lo[0], lo[1]), _mm256_add_ps(lo[2], lo[3]));",
             ATTENTION_TESTS),
    Mutation("gguf.block32_two_roundings", "engine/weights/gguf_dots.c",
             "    if (type == KVB_Q4_0) sum -= 8 * a->sum;\n    *acc = fmaf((float)sum, dw * dr, *acc);",
             "    if (type == KVB_Q4_0) sum -= 8 * a->sum;\n    *acc += (float)sum * (dw * dr);", GGUF_TESTS),
    Mutation("gguf.block256_mins_in_the_sum", "engine/weights/gguf_dots.c",
             "if (type == KVB_Q4_K) *mins = fmaf((float)terms, dmin * dr, *mins);",
             "if (type == KVB_Q4_K) *acc = fmaf(-(float)terms, dmin * dr, *acc);", GGUF_TESTS),
    Mutation("gguf.q4_1_offsets_in_the_sum", "engine/weights/gguf_dots.c",
             "if (type == KVB_Q4_1) *offsets = fmaf(mw, a->scaled, *offsets);",
             "if (type == KVB_Q4_1) *acc = fmaf(mw, a->scaled, *acc);", GGUF_TESTS),
)


def check_applies(root: Path = REPO) -> list[str]:
    """What no longer applies to the sources under `root`: an original snippet found other than exactly once, a
    mutation that changes nothing, a test file that is gone. Empty when the list is current."""
    problems = []
    names = [m.name for m in MUTATIONS]
    problems += [f"{name}: named twice" for name in sorted({n for n in names if names.count(n) > 1})]
    for m in MUTATIONS:
        path = root / m.file
        count = path.read_text().count(m.original) if path.is_file() else -1
        if count != 1:
            problems.append(f"{m.name}: the original occurs {count} times in {m.file}" if count >= 0
                            else f"{m.name}: {m.file} is gone")
        if m.original == m.mutated:
            problems.append(f"{m.name}: the mutation changes nothing")
        problems += [f"{m.name}: test file {t} is gone" for t in m.tests if not (root / t).is_file()]
    return problems


def run_tests(worktree: Path, tests: tuple[str, ...], timeout_s: float, env: dict) -> tuple[str, float, str]:
    """(outcome, seconds, the end of pytest's output): PASSED, FAILED, TIMEOUT or ERROR (pytest could not run the
    tests at all)."""
    t0 = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    try:
        done = subprocess.run(command, cwd=worktree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", time.perf_counter() - t0, ""
    outcome = {0: "PASSED", 1: "FAILED"}.get(done.returncode, "ERROR")
    output = done.stdout.decode(errors="replace")[-3000:]
    if outcome == "ERROR":
        print(output, file=sys.stderr)
    return outcome, time.perf_counter() - t0, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run only this mutation (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run (a timeout kills)")
    parser.add_argument("--no-baseline", action="store_true", help="skip running each test set unmutated first")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:48} {m.file:28} {' '.join(Path(t).name for t in m.tests)}")
        return 0
    problems = check_applies()
    if problems:
        print("the mutation list no longer applies:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutations: {sorted(unknown)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvboost-mutate-") as scratch:
        worktree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(worktree), "HEAD"], cwd=REPO,
                       check=True)
        # The worktree's modules, not the checkout's (an editable install points there); kernels and caches in
        # the scratch folder, so a mutated kernel is never left where the checkout's runs would find it.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(worktree), str(worktree / "tests" / "support")]),
                   KVBOOST_CACHE_DIR=str(Path(scratch) / "cache"), PYTHONDONTWRITEBYTECODE="1")
        try:
            return _run(chosen, worktree, env, args)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)


def _run(chosen: list[Mutation], worktree: Path, env: dict, args) -> int:
    started = time.perf_counter()
    if not args.no_baseline:
        for tests in sorted({m.tests for m in chosen}):
            outcome, seconds, output = run_tests(worktree, tests, args.timeout, env)
            print(f"baseline {' '.join(Path(t).name for t in tests)}: {outcome} ({seconds:.0f} s)", flush=True)
            if outcome != "PASSED":
                print(output, file=sys.stderr)
                print("the unmutated tests do not pass: no mutation result would mean anything", file=sys.stderr)
                return 2
    rows = []
    for m in chosen:
        path = worktree / m.file
        source = path.read_text()
        path.write_text(source.replace(m.original, m.mutated, 1))
        try:
            outcome, seconds, _ = run_tests(worktree, m.tests, args.timeout, env)
        finally:
            path.write_text(source)
        result = {"PASSED": "SURVIVED", "FAILED": "killed", "TIMEOUT": "killed (timeout)"}.get(outcome, "error")
        rows.append((m, result, seconds))
        print(f"{m.name}: {result} ({seconds:.0f} s)", flush=True)
    print("\n| mutation | file | result | seconds |\n|---|---|---|---|")
    for m, result, seconds in rows:
        print(f"| {m.name} | {m.file} | {result} | {seconds:.0f} |")
    killed = sum(r.startswith("killed") for _, r, _ in rows)
    survived = sum(r == "SURVIVED" for _, r, _ in rows)
    print(f"\n{killed} killed, {survived} survived, {len(rows) - killed - survived} errors "
          f"of {len(rows)} mutations in {time.perf_counter() - started:.0f} s")
    return 1 if survived or killed + survived < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())

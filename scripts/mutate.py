#!/usr/bin/env python
"""Mutation testing of the read and write paths: does some CPU test fail for each of a
curated list of single-line mutations?

Each mutant replaces one exact piece of source (found exactly once in its file, or, when
the code moved, in the one module of the package that holds it) with a wrong one: an
operator swapped, a bound off by one, a statement dropped. The mutants run in a copy of
the tree (``git archive`` of a revision, HEAD by default, or with ``--worktree`` the
files of the working tree), never in the checkout, so that others editing it are not
disturbed; each mutant's file is put back after its tests, whatever happens (Ctrl-C
included), and the copy is deleted at the end.

For each mutant the CPU test files (or test ids) listed with it run with ``-x`` and a
timeout: a failure or a timeout kills it, a pass means it survived. A mutant whose
piece of source is no longer in its file is reported as stale, one that does not
compile as invalid (neither is made). The tests
run first on the unmutated copy: a failure there stops everything.

Usage::

    .venv/bin/python scripts/mutate.py            # every mutant, against HEAD
    .venv/bin/python scripts/mutate.py -k region  # mutants whose id contains "region"
    .venv/bin/python scripts/mutate.py --list     # the mutants, without running them
    .venv/bin/python scripts/mutate.py --worktree # the working tree's files instead

Exit status: 0 when every mutant made was killed, 1 when some survived, 2 on a
failing baseline or stale mutants. See docs/development.md, "Mutation testing".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    id: str  #: short name, ``module:what``
    path: str  #: file, relative to the repository root
    old: str  #: exact source text, found once in the file
    new: str  #: what replaces it
    tests: tuple[str, ...]  #: pytest arguments: files, test ids, ``-k`` expressions


def _m(id: str, path: str, old: str, new: str, *tests: str) -> Mutant:
    return Mutant(id, f"xarray_gds/{path}", old, new, tests)


T_PARTS = "tests/test_parts.py"
T_REGION = "tests/test_region.py"
T_PIPELINE = "tests/test_pipeline.py"
T_PLACE = "tests/test_place.py"
T_COALESCE = "tests/test_coalesce.py"
T_STORE = "tests/test_store.py"
T_HOST = "tests/test_host_logic.py"
T_DEFERRED = "tests/test_deferred.py"

MUTANTS: list[Mutant] = [
    # region.py: box reads
    _m(
        "region:rows-drop-r0",
        "region.py",
        "origin = [(box.lo[0] + r0) * cs[0]]",
        "origin = [box.lo[0] * cs[0]]",
        T_PARTS,
        T_REGION,
    ),
    _m(
        "region:where-drop-r0",
        "region.py",
        "origin = (box.lo[axis] + (r0 if axis == 0 else 0) + int(g)) * c",
        "origin = (box.lo[axis] + int(g)) * c",
        T_PARTS,
        T_REGION,
    ),
    _m(
        "region:last-part-short",
        "region.py",
        "parts = [(r, min(r + rows_per_part, box.grid[0]))",
        "parts = [(r, min(r + rows_per_part, box.grid[0] - 1))",
        T_PARTS,
        T_REGION,
    ),
    _m(
        "region:hi-rounded-down",
        "region.py",
        "hi = tuple(-(-b // c) for b, c in zip(stop, chunks, strict=True))",
        "hi = tuple(b // c for b, c in zip(stop, chunks, strict=True))",
        T_REGION,
    ),
    # place.py: decoded chunks into the output (box reads, zarr's indexing, shards)
    _m(
        "place:fill-missing-ignored",
        "place.py",
        "missing = sorted(set(range(n)) - set(present)) if len(present) < n else []",
        "missing = []",
        T_PLACE,
        T_REGION,
        T_PIPELINE,
    ),
    _m(
        "place:tiled-window-offset-dropped",
        "place.py",
        "at = window[0].start + first - crop[0].start",
        "at = first - crop[0].start",
        T_PARTS,
        T_REGION,
    ),
    _m(
        "place:tiled-positions-ignored",
        "place.py",
        "if len(present) < n or not np.array_equal(present, np.arange(n)):",
        "if len(present) < n:",
        T_PLACE,
        T_PIPELINE,
    ),
    _m(
        "place:tiling-order-ignored",
        "place.py",
        "chunks = chunks[xp.asarray(np.argsort(tiling.order))]",
        "chunks = chunks",
        f"{T_PIPELINE}::test_tile_puts_chunks_in_grid_order_whatever_their_order",
    ),
    # fuse.py: dask blocks joined into groups
    _m(
        "fuse:last-group-dropped",
        "fuse.py",
        "return [g for g in groups if g]",
        "return [g for g in groups[:-1] if g]",
        f"{T_HOST}::test_fuse_groups_exact_membership",
        "tests/test_engine.py::test_groups_bounded_by_fuse_bytes",
    ),
    _m(
        "fuse:groups-rounded-down",
        "fuse.py",
        "n_groups = max(1, math.ceil(total / limit))",
        "n_groups = max(1, int(total / limit))",
        f"{T_HOST}::test_fuse_groups_exact_membership",
        "tests/test_engine.py::test_groups_bounded_by_fuse_bytes",
    ),
    _m(
        "fuse:warn-host-blocks-inverted",
        "fuse.py",
        'if not device_blocks and lazy.array.device == "cuda":',
        'if device_blocks and lazy.array.device == "cuda":',
        f"{T_HOST}::test_fuse_warns_once_for_device_arrays_with_host_blocks",
    ),
    # stores/files.py: local reads
    _m(
        "store:short-range-accepted",
        "stores/files.py",
        "if len(data) != size:",
        "if len(data) > size:",
        T_STORE,
        T_DEFERRED,
    ),
    _m(
        "store:range-end-off-by-one",
        "stores/files.py",
        "return start, max(0, min(byte_range.end, size) - start)",
        "return start, max(0, min(byte_range.end, size) - start - 1)",
        T_STORE,
    ),
    # deferred.py: metadata held until the data is written, on any zarr Store
    _m(
        "deferred:running-writes-not-waited",
        "deferred.py",
        "write.cond.wait_for(lambda: write.running == 0)",
        "pass",
        T_DEFERRED,
    ),
    _m(
        "deferred:late-writes-accepted",
        "deferred.py",
        "            if write.failed:\n                raise RuntimeError(",
        "            if False:\n                raise RuntimeError(",
        T_DEFERRED,
    ),
    _m(
        "deferred:existing-arrays-dropped",
        "deferred.py",
        "if before.get(key) is None and _is_array_metadata(key, value)",
        "if _is_array_metadata(key, value)",
        "tests/test_append.py::test_failed_append_leaves_dataset",
    ),
    _m(
        "deferred:created-chunks-kept",
        "deferred.py",
        "doomed = set(write.created)",
        "doomed = set()",
        T_DEFERRED,
    ),
    _m(
        "deferred:new-arrays-kept",
        "deferred.py",
        "doomed.update(k for k in write.written if k.startswith(prefixes))",
        "pass",
        T_DEFERRED,
        "tests/test_write.py::test_failed_write_to_any_store_leaves_it_as_it_was",
    ),
    _m(
        "deferred:put-back-skipped",
        "deferred.py",
        "                self._put_back(done, before, err)",
        "                pass",
        "tests/test_write.py::test_failed_metadata_write_puts_the_old_back",
    ),
    # route.py: the decode route's cost model
    _m(
        "route:rounds-rounded-down",
        "route.py",
        "rounds = -(-n_chunks // max(1, threads))",
        "rounds = n_chunks // max(1, threads)",
        f"{T_HOST}::test_route_host_estimate_exact",
        "tests/test_engine.py::test_route_small_batches_go_to_the_host",
    ),
    _m(
        "route:last-copy-dropped",
        "route.py",
        "host = c.host_call + max(decoding, total / c.h2d) + chunk_nbytes / c.h2d",
        "host = c.host_call + max(decoding, total / c.h2d)",
        f"{T_HOST}::test_route_host_estimate_exact",
    ),
    _m(
        "route:choice-inverted",
        "route.py",
        'return "host" if host < gpu else "gpu"',
        'return "host" if host > gpu else "gpu"',
        "tests/test_engine.py::test_route_small_batches_go_to_the_host",
    ),
    # coalesce.py: the read engine
    _m(
        "coalesce:host-route-count-not-summed",
        "coalesce.py",
        "counts[i] = (chain, n + len(r.keys))",
        "counts[i] = (chain, len(r.keys))",
        f"{T_HOST}::test_host_route_sums_chunks_per_chain",
    ),
    _m(
        "coalesce:host-route-any",
        "coalesce.py",
        "    return all(\n        route.choose(",
        "    return any(\n        route.choose(",
        f"{T_HOST}::test_host_route_sums_chunks_per_chain",
    ),
    _m(
        "coalesce:budget-ignored",
        "coalesce.py",
        "fits = not group or total + r.nbytes <= budget",
        "fits = True",
        T_COALESCE,
    ),
    _m(
        "coalesce:three-decoders",
        "coalesce.py",
        "or len(self.decoders) >= 2",
        "or len(self.decoders) >= 3",
        T_COALESCE,
    ),
    _m(
        "coalesce:joined-split-off-by-one",
        "coalesce.py",
        "last = int(np.searchsorted(found, at + n))",
        "last = int(np.searchsorted(found, at + n - 1))",
        T_COALESCE,
    ),
    # decode.py: batches and the staged decode of the device route
    _m(
        "decode:staged-row-misplaced",
        "decode.py",
        "rows[i].set(out[i], stream=stream)",
        "rows[i].set(out[0], stream=stream)",
        f"{T_HOST}::test_decode_staged_matches_the_host_decode",
    ),
    _m(
        "decode:done-first-row-only",
        "decode.py",
        "        for i in range(len(chunks)):\n            done(i)",
        "        for i in range(len(chunks)):\n            done(0)",
        f"{T_HOST}::test_decode_staged_matches_the_host_decode",
    ),
    _m(
        "decode:part-one-chunk-over",
        "decode.py",
        "return max(1, target // chunk_nbytes)",
        "return max(1, target // chunk_nbytes + 1)",
        T_PARTS,
        T_REGION,
    ),
    _m(
        "decode:joined-key-left",
        "decode.py",
        'k = int(np.searchsorted(self._ends, j, side="right"))',
        'k = int(np.searchsorted(self._ends, j, side="left"))',
        T_COALESCE,
        f"{T_HOST}::test_joined_and_picked_keys",
    ),
    # stores/base.py: the registry of store kinds; byte ranges of any store
    _m(
        "sources:range-offset-dropped",
        "stores/base.py",
        "at = int(starts[i]) - start",
        "at = int(starts[i])",
        f"{T_HOST}::test_ranges_joined_into_spans_are_cut_back_exactly",
        "tests/test_engine.py::test_sharded_reads_from_a_store_join_inner_chunk_ranges",
        "tests/test_engine.py::test_merge_ranges_joins_ranges_of_one_key_across_small_gaps",
    ),
    _m(
        "sources:merge-across-keys",
        "stores/base.py",
        "if same and start <= e0 + gap:",
        "if start <= e0 + gap:",
        f"{T_HOST}::test_ranges_joined_into_spans_are_cut_back_exactly",
        "tests/test_engine.py::test_merge_ranges_joins_ranges_of_one_key_across_small_gaps",
    ),
    _m(
        "sources:span-end-not-max",
        "stores/base.py",
        "spans[-1] = (first, s0, max(e0, end), members)",
        "spans[-1] = (first, s0, end, members)",
        f"{T_HOST}::test_ranges_joined_into_spans_are_cut_back_exactly",
        "tests/test_engine.py::test_merge_ranges_joins_ranges_of_one_key_across_small_gaps",
    ),
    _m(
        "sources:get-ranges-member-misplaced",
        "stores/generic.py",
        "found[members[j]] = _exactly(buf, key, wanted[j])",
        "found[members[0]] = _exactly(buf, key, wanted[j])",
        "tests/test_sources.py",
        T_PIPELINE,
    ),
    _m(
        "stores:registry-order-ignored",
        "stores/base.py",
        "_KINDS.insert(_KINDS.index(before) if before is not None else len(_KINDS), kind)",
        "_KINDS.insert(0, kind)",
        "tests/test_store_kinds.py",
    ),
    _m(
        "stores:held-store-read-as-any",
        "stores/base.py",
        'store = getattr(store, "chunks_in", store)',
        "pass",
        "tests/test_store_kinds.py",
        "tests/test_writers.py",
    ),
    # stores/lock.py: one writer at a time
    _m(
        "lock:shared-flock",
        "stores/lock.py",
        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)",
        "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
        "tests/test_writers.py",
    ),
    _m(
        "lock:memory-lock-not-waited",
        "stores/lock.py",
        "if not lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):",
        "if not lock.acquire(blocking=False) and False:",
        "tests/test_writers.py",
        "tests/test_store_kinds.py",
    ),
    # the lock file in the store's root, removed by its holder, kept by clearing
    _m(
        "lock:file-beside-the-store",
        "stores/lock.py",
        "return Path(os.path.realpath(root)) / LOCK_NAME",
        'return Path(os.path.realpath(root) + ".xarray-gds.lock")',
        "tests/test_writers.py",
    ),
    _m(
        "lock:file-left-after-release",
        "stores/lock.py",
        "os.unlink(self.path)  # while locked",
        "pass  # while locked",
        "tests/test_writers.py",
    ),
    _m(
        "lock:removed-file-kept-locked",
        "stores/lock.py",
        "            if not _same_file(fd, self.path):\n                os.close(fd)",
        "            if False:\n                os.close(fd)",
        "tests/test_writers.py::test_a_waiter_on_a_removed_lock_file_takes_the_new_one",
    ),
    _m(
        "lock:cleared-with-the-store",
        "stores/local.py",
        "_local.remove_tree(os.fspath(root), keep=frozenset({LOCK_NAME}))",
        "_local.remove_tree(os.fspath(root), keep=frozenset({'-'}))",
        "tests/test_writers.py",
    ),
    _m(
        "lock:file-listed",
        "stores/local.py",
        "            if key != LOCK_NAME:\n                yield key\n\n    async def list_prefix",
        "            if True:\n                yield key\n\n    async def list_prefix",
        "tests/test_writers.py",
    ),
    _m(
        "lock:file-in-members",
        "stores/local.py",
        "if not (top and name == LOCK_NAME):",
        "if True:",
        "tests/test_writers.py",
    ),
    _m(
        "lock:file-in-held-listings",
        "deferred.py",
        "seen = set() if base else set(self._write.source.private_keys)",
        "seen = set()",
        "tests/test_writers.py",
    ),
    # stores/remote_device.py and stores/refs.py: the parts of the GPU paths that need no GPU
    Mutant(
        "remote:short-read-accepted",
        "xarray_gds/stores/remote_device.py",
        "if future.get() != sizes[i]:",
        "if future.get() > sizes[i]:",
        (f"{T_HOST}::test_read_device_retries_short_reads",),
    ),
    Mutant(
        "refs:last-remote-ref-dropped",
        "xarray_gds/stores/refs.py",
        "parallel(one, len(which), min_items=2)\n    return got",
        "parallel(one, len(which) - 1, min_items=2)\n    return got",
        (f"{T_HOST}::test_remote_references_read_over_http",),
    ),
]


def _copy_tree(dest: Path, rev: str | None) -> None:
    """The repository's files at ``rev`` (``git archive``), or those of the working tree
    (tracked, and untracked ones git does not ignore) when ``rev`` is None."""
    if rev is not None:
        with tempfile.TemporaryFile() as tar:
            subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=tar, check=True)
            tar.seek(0)
            with tarfile.open(fileobj=tar) as archive:
                archive.extractall(dest, filter="data")
        return
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _locate(tree: Path, m: Mutant) -> Path | None:
    """The file of the package that holds ``m.old`` exactly once: ``m.path``, or, when
    the code moved, the only other module that holds it; None when there is none."""
    first = tree / m.path
    if first.is_file() and first.read_text().count(m.old) == 1:
        return first
    found = [p for p in sorted((tree / "xarray_gds").rglob("*.py")) if m.old in p.read_text()]
    if len(found) == 1 and found[0].read_text().count(m.old) == 1:
        return found[0]
    return None


def _pytest(tree: Path, tests: tuple[str, ...], timeout: float) -> str:
    """``"passed"``, ``"failed"`` or ``"timeout"`` of the tests in ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    return "passed" if done.returncode == 0 else "failed"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose id contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--rev", default="HEAD", help="revision to mutate (default HEAD)")
    parser.add_argument(
        "--worktree", action="store_true", help="mutate the working tree's files instead"
    )
    parser.add_argument("--timeout", type=float, default=120, help="seconds a mutant's tests")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k in m.id]
    if args.list:
        for m in chosen:
            print(f"{m.id:40} {m.path}: {m.old!r} -> {m.new!r}")
        return 0
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="xarray-gds-mutate-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree, None if args.worktree else args.rev)
        where = "the working tree" if args.worktree else args.rev
        print(f"{len(chosen)} mutants of {where}, in {tree}", flush=True)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        # -p no:randomly etc. are not needed: the suite's order is fixed
        baseline = _pytest(tree, tests, args.timeout * 4)
        if baseline != "passed":
            print(f"baseline {baseline}: the tests fail without any mutant", file=sys.stderr)
            return 2
        made = killed = 0
        survived: list[Mutant] = []
        stale: list[Mutant] = []
        for m in chosen:
            file = _locate(tree, m)
            if file is None:
                stale.append(m)
                print(f"STALE              {m.id} (its source is not found once)", flush=True)
                continue
            original = file.read_text()
            mutated = original.replace(m.old, m.new)
            try:  # a mutant that does not compile would be "killed" by any test
                compile(mutated, str(file), "exec")
            except SyntaxError as err:
                stale.append(m)
                print(f"INVALID            {m.id} ({err})", flush=True)
                continue
            t0 = time.monotonic()
            try:
                file.write_text(mutated)
                outcome = _pytest(tree, m.tests, args.timeout)
            finally:
                file.write_text(original)
            made += 1
            if outcome == "passed":
                survived.append(m)
            else:
                killed += 1
            label = "SURVIVED" if outcome == "passed" else f"killed ({outcome})"
            where = "" if file == tree / m.path else f" (in {file.relative_to(tree)})"
            print(f"{label:18} {m.id}{where}  {time.monotonic() - t0:.1f} s", flush=True)
    print(
        f"made {made}, killed {killed}, survived {len(survived)}, stale {len(stale)} "
        f"in {time.monotonic() - start:.0f} s"
    )
    for m in survived:
        print(f"  survived: {m.id} ({m.path}: {m.old!r} -> {m.new!r})")
    if stale:
        return 2
    return 1 if survived else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the copy is gone already (its directory's context exited)
        sys.exit(130)

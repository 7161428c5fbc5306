#!/usr/bin/env python
"""Mutation testing by Cosmic Ray: mutants that no test author chose, module by module.

``scripts/mutate.py`` applies a curated list of mutations; this script lets Cosmic Ray
(``cosmic-ray`` on PyPI, the ``dev`` extra) make every mutant its operators make in
each module of the read and write paths (comparison, binary, unary and boolean
operators swapped, numbers moved by one, ``not`` added, ``True``/``False`` swapped,
``break``/``continue`` swapped, loops run zero times, decorators removed, exceptions
replaced), and runs, for each mutant, the CPU test files that cover its module
(``MODULES`` below, ``pytest -x``, the whole set a few seconds to a minute).

The full space is about 4,000 mutants for the modules here, days of CPU time on a
2-core machine, so each module runs a *sample*, chosen without a person in the loop:

- mutants inside annotations are left out: every module has
  ``from __future__ import annotations``, so annotations are never evaluated and a
  mutant there (``str | None`` -> ``str & None``) is equivalent by construction;
- the mutants are grouped by *site* (the operator's family and the exact source
  position: the eleven binary-operator replacements of one ``+`` are one site), and
  ``--sites`` sites a module (20 by default) are taken in the order of a SHA-256 of
  (module, family, the site's source line, its column), so the sample depends on the
  source only, and stays put when unrelated lines change;
- for each site one of its mutants, the one with the smallest hash of the same kind
  (module, operator, line, column, and its rank among that operator's mutants there).

``--all`` runs every mutant instead (hours a module).

The mutants run in a copy of the tree (``git archive`` of HEAD, or with ``--worktree``
the working tree's tracked and untracked files), never in the checkout; each mutated
file is put back after its tests by Cosmic Ray, and the copy is deleted at the end.
The tests run against the copy (``PYTHONPATH``), without bytecode files. The unmutated
copy's tests run first, module by module, and set the timeout (three times their
time, at least 60 s); a failure there stops that module.

A surviving mutant is looked up in ``docs/data/mutation-triage.json``, by module and
the exact line before and after: ``"verdict": "equivalent"`` (with ``"reason"``: why
no test can tell it from the original) counts it as equivalent, ``"verdict":
"gpu-only"`` (with ``"reason"``) as a mutant of code that runs only with a CUDA device,
which the CPU tests cannot reach (the GPU suite's to judge); any other survivor is
*open* and fails the run. ``"verdict": "killed"`` entries name the test written for a
survivor of an earlier run (``"test"``); the results list which of them the sample
holds, each killed now.

Usage::

    .venv/bin/python scripts/mutation-run.py                    # every module, HEAD
    .venv/bin/python scripts/mutation-run.py place region       # those modules
    .venv/bin/python scripts/mutation-run.py --sites 60         # a larger sample
    .venv/bin/python scripts/mutation-run.py --worktree         # the working tree
    .venv/bin/python scripts/mutation-run.py --list             # modules and their tests
    .venv/bin/python scripts/mutation-run.py --table            # the last results' table

The summary goes to ``docs/data/mutation.json`` (``--out``; with some modules only,
their entries are replaced and the others kept) and a table is printed. Exit status:
0 when no survivor is open, 1 when some are, 2 on a failing baseline.
See docs/development.md, "Mutation testing".
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRIAGE = ROOT / "docs" / "data" / "mutation-triage.json"
OUT = ROOT / "docs" / "data" / "mutation.json"

#: module name -> (its file, the pytest arguments of the tests that cover it); a file
#: given as ``old|new`` is the first of those paths that exists (modules that moved)
MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "place": (
        "xarray_gds/place.py",
        ("tests/test_place.py", "tests/test_parts.py", "tests/test_region.py"),
    ),
    "coalesce": (
        "xarray_gds/coalesce.py",
        (
            "tests/test_coalesce.py",
            "tests/test_host_logic.py",
            "tests/test_parts.py",
            "tests/test_mutation_kills.py",
        ),
    ),
    "decode": (
        "xarray_gds/decode.py",
        (
            "tests/test_host_logic.py",
            "tests/test_parts.py",
            "tests/test_damage.py",
            "tests/test_mutation_kills.py",
        ),
    ),
    "region": (
        "xarray_gds/region.py",
        ("tests/test_region.py", "tests/test_parts.py", "tests/test_mutation_kills.py"),
    ),
    "sources": (
        "xarray_gds/sources.py|xarray_gds/stores/base.py",
        (
            "tests/test_sources.py",
            "tests/test_host_logic.py",
            "tests/test_layouts.py::test_store_kinds_take_the_sources_they_name",
            "tests/test_layouts.py::test_shard_index_at_either_end_from_every_store[end-crc-memory]",
            "tests/test_layouts.py::test_shard_index_at_either_end_from_every_store[start-no-crc-http]",
            "tests/test_mutation_kills.py",
        ),
    ),
    "locking": (
        "xarray_gds/locking.py|xarray_gds/stores/lock.py",
        ("tests/test_writers.py", "tests/test_mutation_kills.py"),
    ),
    "tidy": (
        "xarray_gds/tidy.py",
        ("tests/test_killed_writers.py", "-k", "tidy", "tests/test_mutation_kills.py"),
    ),
    "write": (
        "xarray_gds/write.py",
        (
            "tests/test_write.py",
            "tests/test_host_write.py",
            "tests/test_writers.py",
            "tests/test_mutation_kills.py",
            "-k",
            "not round_trip",
        ),
    ),
    "store": (
        "xarray_gds/store.py|xarray_gds/stores/local.py",
        (
            "tests/test_store.py",
            "tests/test_deferred.py",
            "tests/test_mutation_kills.py",
            "tests/test_backend.py::test_hdf5_after_a_user_block_is_recognised",
        ),
    ),
    "deferred": (
        "xarray_gds/deferred.py",
        (
            "tests/test_deferred.py",
            "tests/test_store.py",
            "tests/test_writers.py",
            "tests/test_mutation_kills.py",
        ),
    ),
}

PYTEST = ("-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly")


def _family(operator: str) -> str:
    """``core/ReplaceBinaryOperator_Add_Sub`` -> ``core/ReplaceBinaryOperator``."""
    return re.sub(r"_[A-Za-z]+_[A-Za-z]+$", "", operator)


def _hash(*parts: object) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()


def _annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions, (line, column), of every annotation in ``source``."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        found: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        for a in found:
            if a is not None and a.end_lineno is not None and a.end_col_offset is not None:
                spans.append(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)))
    return spans


def _in(pos: tuple[int, int], spans: list[tuple[tuple[int, int], tuple[int, int]]]) -> bool:
    return any(lo <= pos < hi for lo, hi in spans)


def _copy_tree(dest: Path, worktree: bool) -> None:
    if worktree:
        names = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout.split(b"\0")
        for raw in names:
            if not raw:
                continue
            src = ROOT / raw.decode()
            if src.is_file():
                (dest / raw.decode()).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / raw.decode())
        return
    archive = subprocess.run(
        ["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    tar = dest / ".head.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    tar.unlink()


def _context(diff: str) -> str:
    """The unchanged line just before the change in a unified diff, stripped: what tells
    apart two mutants of the same text (two ``return False`` made ``return True``)."""
    before = ""
    for ln in diff.splitlines():
        if ln.startswith(("---", "+++", "@@")):
            continue
        if ln.startswith(("-", "+")):
            return before
        before = ln[1:].strip()
    return before


def _changed_lines(diff: str) -> tuple[str, str]:
    """The removed and added lines of a one-line diff, stripped."""
    old = [
        ln[1:].strip()
        for ln in diff.splitlines()
        if ln.startswith("-") and not ln.startswith("---")
    ]
    new = [
        ln[1:].strip()
        for ln in diff.splitlines()
        if ln.startswith("+") and not ln.startswith("+++")
    ]
    return "\n".join(old), "\n".join(new)


def _sample(
    items: list[Any], path: Path, module: str, sites: int | None
) -> tuple[list[Any], dict[str, int]]:
    """The work items to run (see the module's docstring) and counts of those left out."""
    source = path.read_text()
    lines = source.splitlines()
    spans = _annotation_spans(source)
    by_site: dict[tuple[str, tuple[int, int], tuple[int, int]], list[Any]] = defaultdict(list)
    annotations = 0
    for item in items:
        m = item.mutations[0]
        start, end = tuple(m.start_pos), tuple(m.end_pos)
        if _in(start, spans):
            annotations += 1
            continue
        by_site[(_family(m.operator_name), start, end)].append(item)

    def site_key(site: tuple[str, tuple[int, int], tuple[int, int]]) -> str:
        family, (line, col), _ = site
        return _hash(module, family, lines[line - 1].strip(), col)

    # sites of the same text and column (two ``if m:`` lines) in their order in the file
    order = sorted(by_site, key=lambda site: (site_key(site), site[1], site[2]))
    chosen = []
    invalid = 0
    for site in order:
        if sites is not None and len(chosen) == sites:
            break
        _, (line, col), _ = site
        text = lines[line - 1].strip()
        # an operator may make several mutants at one site (NumberReplacer: +1 and -1):
        # told apart by their order there, not by the session's (random) job ids
        members = sorted(
            by_site[site], key=lambda i: (i.mutations[0].operator_name, i.mutations[0].occurrence)
        )
        nth: dict[str, int] = defaultdict(int)
        keyed = []
        for item in members:
            op = item.mutations[0].operator_name
            keyed.append((_hash(module, op, text, col, nth[op]), item))
            nth[op] += 1
        ranked = [item for _, item in sorted(keyed, key=lambda pair: pair[0])]
        for item in ranked:
            if not _compiles(source, item):
                invalid += 1
                continue
            chosen.append(item)
            if sites is not None:
                break
    chosen.sort(key=lambda i: (tuple(i.mutations[0].start_pos), i.mutations[0].occurrence))
    left = {"annotations": annotations, "sites": len(by_site), "invalid": invalid}
    return chosen, left


def _compiles(source: str, item: Any) -> bool:
    """Whether the mutant's source compiles (Cosmic Ray also swaps the ``*`` of
    keyword-only parameters, for one): those that do not are left out, not run."""
    import cosmic_ray.plugins
    from cosmic_ray.mutating import mutate_code

    m = item.mutations[0]
    operator = cosmic_ray.plugins.get_operator(m.operator_name)(**(m.operator_args or {}))
    mutated = mutate_code(source, operator, m.occurrence)
    if mutated is None:
        return False
    try:
        compile(mutated, "<mutant>", "exec")
    except SyntaxError:
        return False
    return True


def _triage() -> list[dict[str, Any]]:
    return json.loads(TRIAGE.read_text())["mutants"] if TRIAGE.exists() else []


def _verdict(
    module: str, old: str, new: str, context: str, triage: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The triage entry of a mutant: same module and lines (and, where the entry gives
    one, the same line before the change)."""
    for entry in triage:
        if (entry["module"], entry["old"], entry["new"]) == (module, old, new) and entry.get(
            "context", context
        ) == context:
            return entry
    return None


def run_module(
    name: str,
    copy: Path,
    sites: int | None,
    triage: list[dict[str, Any]],
    env: dict[str, str],
    revision: str,
) -> dict[str, Any]:
    from cosmic_ray.commands.init import init
    from cosmic_ray.mutating import mutate_and_test
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    paths, tests = MODULES[name]
    path = next((p for p in paths.split("|") if (copy / p).exists()), paths.split("|")[0])
    command = " ".join([sys.executable, *PYTEST, *(f"'{t}'" if " " in t else t for t in tests)])
    started = time.monotonic()
    base = subprocess.run(
        [sys.executable, *PYTEST, *tests], cwd=copy, env=env, capture_output=True, text=True
    )
    baseline_s = time.monotonic() - started
    if base.returncode != 0:
        print(base.stdout[-3000:], base.stderr[-3000:], sep="\n", file=sys.stderr)
        return {"module": path, "tests": list(tests), "baseline": "failed"}
    timeout = max(60.0, 3 * baseline_s)
    results: list[dict[str, Any]] = []
    os.environ.update(env)  # Cosmic Ray runs the tests with this process's environment
    cwd = Path.cwd()
    os.chdir(copy)  # Cosmic Ray reads and mutates the module at its path, from here
    try:
        with use_db(str(copy / f".cr-{name}.sqlite"), WorkDB.Mode.create) as db:
            init([Path(path)], db, {})
            items = list(db.pending_work_items)
        total = len(items)
        chosen, left = _sample(items, copy / path, name, sites)
        print(
            f"{name}: {total} mutants, {len(chosen)} to run (baseline {baseline_s:.0f} s)",
            flush=True,
        )
        for n, item in enumerate(chosen, 1):
            m = item.mutations[0]
            t0 = time.monotonic()
            result = mutate_and_test(item.mutations, command, timeout)
            if result.worker_outcome == WorkerOutcome.NO_TEST:
                continue
            old, new = _changed_lines(result.diff or "")
            context = _context(result.diff or "")
            if result.worker_outcome != WorkerOutcome.NORMAL:
                outcome = "invalid"
            elif result.test_outcome == TestOutcome.SURVIVED:
                outcome = "survived"
            elif result.output == "timeout":
                outcome = "timeout"
            else:
                outcome = "killed"
            entry: dict[str, Any] = {
                "line": m.start_pos[0],
                "operator": m.operator_name.removeprefix("core/"),
                "old": old,
                "new": new,
                "context": context,
                "outcome": outcome,
            }
            verdict = _verdict(name, old, new, context, triage)
            if verdict is not None:
                entry["triage"] = verdict["verdict"]
                entry["why"] = verdict.get("reason") or verdict.get("test")
            results.append(entry)
            print(
                f"  [{n}/{len(chosen)}] {outcome:8} {time.monotonic() - t0:5.1f}s "
                f"L{m.start_pos[0]} {old!r} -> {new!r}",
                flush=True,
            )
    finally:
        os.chdir(cwd)
    return _counted(
        {
            "module": path,
            "revision": revision,
            "sample": "every mutant" if sites is None else f"{sites} sites",
            "tests": list(tests),
            "mutants_in_module": total,
            "left_out_in_annotations": left["annotations"],
            "left_out_not_compiling": left["invalid"],
            "sites": left["sites"],
            "seconds": round(time.monotonic() - started),
            "mutants": results,
        }
    )


def _counted(entry: dict[str, Any]) -> dict[str, Any]:
    """``entry`` with its counts, from its mutants' outcomes and triage. A survivor whose
    triage says ``killed`` (a test written after the run) counts with the killed by new
    tests, not as open."""
    results = entry["mutants"]
    survived = [r for r in results if r["outcome"] == "survived"]
    triage = [r.get("triage") for r in survived]
    entry.update(
        {
            "run": len(results),
            "killed": sum(r["outcome"] in ("killed", "timeout") for r in results),
            "timeouts": sum(r["outcome"] == "timeout" for r in results),
            "invalid": sum(r["outcome"] == "invalid" for r in results),
            "survived": len(survived),
            "equivalent": triage.count("equivalent"),
            "gpu_only": triage.count("gpu-only"),
            "open": sum(t not in ("equivalent", "gpu-only", "killed") for t in triage),
            "killed_by_new_tests": sum(
                r.get("triage") == "killed" and r["outcome"] != "survived" for r in results
            ),
            "survivors_killed_since": triage.count("killed"),
        }
    )
    return entry


def _retriage(summary: dict[str, Any], triage: list[dict[str, Any]]) -> None:
    """The triage file applied again to the mutants of ``summary`` (no test runs)."""
    for name, entry in summary["modules"].items():
        if "mutants" not in entry:
            continue
        for r in entry["mutants"]:
            r.pop("triage", None)
            r.pop("why", None)
            verdict = _verdict(name, r["old"], r["new"], r.get("context", ""), triage)
            if verdict is not None:
                r["triage"] = verdict["verdict"]
                r["why"] = verdict.get("reason") or verdict.get("test")
        _counted(entry)


def table(summary: dict[str, Any]) -> str:
    rows = [
        "| module | mutants (all) | run | killed | of them by tests written for survivors "
        "| survived | of them killed by tests written since | equivalent | GPU only | open |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in summary["modules"].items():
        if "run" not in r:
            rows.append(f"| `{name}` | baseline failed | | | | | | | | |")
            continue
        rows.append(
            f"| `{name}` | {r['mutants_in_module']} | {r['run']} | {r['killed']} | "
            f"{r['killed_by_new_tests']} | {r['survived']} | "
            f"{r.get('survivors_killed_since', 0)} | {r['equivalent']} | "
            f"{r.get('gpu_only', 0)} | {r['open']} |"
        )
    total = [r for r in summary["modules"].values() if "run" in r]
    if total:
        keys = ("run", "killed", "killed_by_new_tests", "survived")
        keys2 = ("survivors_killed_since", "equivalent", "gpu_only", "open")
        sums = [str(sum(r.get(k, 0) for r in total)) for k in (*keys, *keys2)]
        rows.append(
            f"| all | {sum(r['mutants_in_module'] for r in total)} | " + " | ".join(sums) + " |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(MODULES)} (all by default)")
    parser.add_argument("--sites", type=int, default=20, help="sites a module (default 20)")
    parser.add_argument("--all", action="store_true", help="every mutant, no sample")
    parser.add_argument("--worktree", action="store_true", help="the working tree, not HEAD")
    parser.add_argument("--out", type=Path, default=OUT, help="the summary (JSON)")
    parser.add_argument("--list", action="store_true", help="modules and their tests")
    parser.add_argument(
        "--table", action="store_true", help="print the table of --out's results, run nothing"
    )
    parser.add_argument(
        "--retriage",
        action="store_true",
        help="apply the triage file again to --out's results (after new tests or verdicts)",
    )
    args = parser.parse_args()
    if args.retriage:
        done = json.loads(args.out.read_text())
        _retriage(done, _triage())
        args.out.write_text(json.dumps(done, indent=1) + "\n")
    if args.table or args.retriage:
        print(table(json.loads(args.out.read_text())))
        return 0
    names = args.modules or list(MODULES)
    unknown = set(names) - set(MODULES)
    if unknown:
        parser.error(f"unknown modules: {sorted(unknown)}")
    if args.list:
        for name in names:
            path, tests = MODULES[name]
            print(f"{name:9} {path:28} {' '.join(tests)}")
        return 0
    triage = _triage()
    summary: dict[str, Any] = {"modules": {}}
    if args.out.exists():
        summary = json.loads(args.out.read_text())
    summary["tool"] = "cosmic-ray " + _version("cosmic-ray")
    revision = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip() + (" + working tree" if args.worktree else "")
    with tempfile.TemporaryDirectory(prefix="xarray-gds-cr-") as tmp:
        copy = Path(tmp)
        _copy_tree(copy, args.worktree)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(copy) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        failed = False
        for name in names:
            sites = None if args.all else args.sites
            result = run_module(name, copy, sites, triage, env, revision)
            failed |= "run" not in result
            summary["modules"][name] = result
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(table(summary))
    if failed:
        return 2
    return 1 if any(r.get("open") for r in summary["modules"].values()) else 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())

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

``--diff BASE`` and ``--all`` run every mutant instead, with tests chosen by coverage:

- ``--diff BASE`` (a git revision: ``origin/main``, ``HEAD~3``, a commit) takes every
  line that ``git diff -U0 BASE HEAD -- xarray_gds/`` adds or edits (with
  ``--worktree``, ``git diff -U0 BASE``: the working tree's changes too, and its new
  files whole), a module's name or path after it keeping those files only;
  ``--all MODULE...`` takes every line of those modules (any file of the package:
  ``--all stores/icechunk``);
- the mutants of those lines are Cosmic Ray's (made on one parse of the file, each put
  back after) and three of ``scripts/mutation_tool.py``: a statement removed (``pass``
  in its place), a call removed (``int(n)`` -> ``n``, ``x.copy()`` -> ``x``), a keyword
  argument dropped: a mutant belongs to the line where its change starts;
- one run of the suite (``--suite``, ``tests`` by default) under coverage, with a
  context a test (pytest-cov's ``--cov-context=test``, subprocesses measured too),
  tells which tests run each line (kept in ``.mutation/`` by the tree's content: a
  second run of the same tree reads it back); tests failing there are left out;
- each mutant runs only the tests that run its statement (``-x``, the fastest first):
  for a statement that runs at import (a constant, a ``def``'s defaults and
  decorators, a class body), the tests that ran the function or class it defines, or
  for the module's own statements every test that ran a line of the module. A mutant
  in a function's body runs in a fork of a server that imported the package and the
  tests once, the function's code swapped for the mutant's (seconds a mutant); any
  other in a fresh interpreter;
- the mutants alive after their tests (not triaged equivalent or GPU-only) run
  against the whole suite, applied together where they change different lines and
  halved while the suite fails (``--no-suite`` skips this);
- a line no CPU test runs (code for a card, reached only with CuPy) is reported as
  *unreached*, with its function, not run;
- the survivors, the unreached lines and the counts go to ``--out``
  (``.mutation/mutation-survivors.json`` by default; ``.mutation/`` is ignored by git).

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
    .venv/bin/python scripts/mutation-run.py --diff origin/main # every changed line
    .venv/bin/python scripts/mutation-run.py --diff HEAD~3 region  # of region.py only
    .venv/bin/python scripts/mutation-run.py --all tidy         # every line of tidy.py

The sample's summary goes to ``docs/data/mutation.json`` (``--out``; with some modules
only, their entries are replaced and the others kept) and a table is printed. Exit
status: 0 when no survivor is open, 1 when some are, 2 on a failing baseline.
See docs/development.md, "Mutation testing".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import mutation_tool  # noqa: E402  (scripts/mutation_tool.py)

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


def _in(pos: tuple[int, int], spans: list[tuple[tuple[int, int], tuple[int, int]]]) -> bool:
    return any(lo <= pos < hi for lo, hi in spans)


def _copy_tree(dest: Path, worktree: bool, rev: str = "HEAD") -> None:
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
        ["git", "archive", "--format=tar", rev], cwd=ROOT, check=True, capture_output=True
    ).stdout
    tar = dest / ".head.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    tar.unlink()


def _sample(
    items: list[Any], path: Path, module: str, sites: int | None
) -> tuple[list[Any], dict[str, int]]:
    """The work items to run (see the module's docstring) and counts of those left out."""
    source = path.read_text()
    lines = source.splitlines()
    spans = mutation_tool.annotation_spans(source)
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
    chosen: list[Any] = []
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
        mutation_tool.compiles(mutated, "<mutant>")
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
            old, new = mutation_tool.changed_text(result.diff or "")
            context = mutation_tool.context_line(result.diff or "")
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


def _retriage_changed(summary: dict[str, Any], triage: list[dict[str, Any]]) -> None:
    """The triage file applied again to the survivors of a ``--diff`` or ``--all`` run's
    summary (no test runs): a survivor a test written since kills (``"killed"``) is
    counted in ``killed_since``, no longer open."""
    counts = summary["counts"]
    verdicts = []
    for r in summary["survivors"]:
        r.pop("triage", None)
        r.pop("why", None)
        verdict = _verdict(r["module"], r["old"], r["new"], r.get("context", ""), triage)
        if verdict is not None:
            r["triage"] = verdict["verdict"]
            r["why"] = verdict.get("reason") or verdict.get("test")
        verdicts.append(r.get("triage"))
    counts["equivalent"] = verdicts.count("equivalent")
    counts["gpu_only"] = verdicts.count("gpu-only")
    counts["killed_since"] = verdicts.count("killed")
    counts["open"] = sum(v not in ("equivalent", "gpu-only", "killed") for v in verdicts)


def _retriage(summary: dict[str, Any], triage: list[dict[str, Any]]) -> None:
    """The triage file applied again to the mutants of ``summary`` (no test runs)."""
    if "survivors" in summary:  # a --diff or --all run's summary
        _retriage_changed(summary, triage)
        return
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


# --- every mutant of the changed lines (--diff) or of whole modules (--all) -------------

#: the output of the diff and full modes, and the coverage maps kept between runs
WORK = ROOT / ".mutation"
#: the survivors file of the diff and full modes
SURVIVORS = WORK / "mutation-survivors.json"
#: raise when what the coverage map holds changes
MAP_VERSION = 3


def _module_name(path: str) -> str:
    """The name a file's mutants have in the triage file: its ``MODULES`` name, or its
    path under ``xarray_gds/`` without ``.py`` (``stores/icechunk``; a package's
    ``__init__.py`` by the package's: ``codecs``)."""
    for name, (paths, _) in MODULES.items():
        if path in paths.split("|"):
            return name
    rel = path.removeprefix("xarray_gds/").removesuffix(".py")
    return rel.removesuffix("/__init__") if rel != "__init__" else "xarray_gds"


def _resolve(spec: str, root: Path) -> str | None:
    """A module named on the command line as a file of the package: a ``MODULES`` name,
    or a path with or without ``xarray_gds/`` and ``.py`` (``stores/icechunk``,
    ``codecs``)."""
    if spec in MODULES:
        paths = MODULES[spec][0].split("|")
        return next((p for p in paths if (root / p).exists()), paths[0])
    rel = spec.removeprefix("xarray_gds/").removesuffix(".py").replace(".", "/")
    for cand in (f"xarray_gds/{rel}.py", f"xarray_gds/{rel}/__init__.py"):
        if (root / cand).is_file():
            return cand
    return None


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-c", "core.quotepath=off", *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def diff_targets(base: str, worktree: bool, rev: str = "HEAD") -> dict[str, set[int]]:
    """File -> the lines a change adds or edits under ``xarray_gds/``: from ``base`` to
    ``rev``, or with ``worktree`` to the working tree (its new files whole)."""
    against = [] if worktree else [rev]
    diff = _git(
        "diff", "-U0", "--no-color", "--no-ext-diff", "-M", "--src-prefix=a/",
        "--dst-prefix=b/", base, *against, "--", "xarray_gds/",
    )  # fmt: skip
    found = mutation_tool.changed_lines(diff)
    if worktree:
        for name in _git("ls-files", "--others", "--exclude-standard", "--", "xarray_gds/").split(
            "\n"
        ):
            if name.endswith(".py"):
                text = (ROOT / name).read_text()
                found[name] = set(range(1, len(text.splitlines()) + 1))
    return {f: lines for f, lines in found.items() if f.endswith(".py")}


def _pytest(
    args: list[str], copy: Path, env: dict[str, str], timeout: float | None
) -> tuple[int | None, str]:
    """pytest in ``copy`` with ``args`` (passed in a file, ``@args``: any number of node
    ids): its exit status, None when it ran past ``timeout`` (its process group killed),
    and its output."""
    argfile = copy / f".mutation-args-{os.getpid()}"
    argfile.write_text("\n".join(args) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *mutation_tool.PYTEST_ARGS[1:], f"@{argfile}"],
        cwd=copy,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out
    finally:
        argfile.unlink(missing_ok=True)


class Server:
    """The fork server of ``scripts/mutation_tool.py`` (``serve``), started in the copy
    on first use; a mutant in a function's body runs there (its function's code swapped
    in a fork), any other in a fresh interpreter (:func:`_pytest`)."""

    def __init__(self, copy: Path, env: dict[str, str], modules: list[str], tests: list[str]):
        self.copy, self.env = copy, env
        self.modules, self.tests = modules, tests
        self.proc: subprocess.Popen[str] | None = None
        self.broken = False
        self.forked = 0
        self.checked: set[str] = set()
        #: the node ids of the last request that the server had not collected
        self.missing: list[str] = []

    def _start(self) -> bool:
        """Started, again with more packages left to the children while a test file
        starts threads on import (at most five times)."""
        deny: list[str] = []
        for _ in range(5):
            spec = {"modules": self.modules, "test_files": self.tests, "deny": deny}
            tool = str(ROOT / "scripts" / "mutation_tool.py")
            self.proc = subprocess.Popen(
                [sys.executable, tool, "serve", json.dumps(spec)],
                cwd=self.copy,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self.proc.stdout is not None
            answer = self.proc.stdout.readline()
            reply = json.loads(answer) if answer.startswith("{") else {}
            if reply.get("ready"):
                return True
            self.close()
            if not reply.get("deny"):
                break
            deny += reply["deny"]
            print(f"  the fork server leaves {', '.join(reply['deny'])} to each child", flush=True)
        self.broken = True
        self.proc = None
        print("the fork server did not start: each mutant in its own interpreter", flush=True)
        return False

    def run(
        self, tests: list[str], timeout: float, patch: dict[str, Any]
    ) -> tuple[bool, int | None]:
        """(whether the mutant ran here, its tests' exit status or None past ``timeout``)."""
        if self.broken:
            return False, None
        return self._ask(tests, timeout, patch)

    def ready(self, module: str, tests: list[str], timeout: float) -> bool:
        """Whether the server takes mutants: started, and for each module, the first
        tests asked for pass there unmutated (else it is not used again)."""
        if self.broken or (self.proc is None and not self._start()):
            return False
        if module not in self.checked:
            self.checked.add(module)
            ran, status = self._ask(tests, timeout, None)
            if not ran or status != 0:
                self.broken = True
                print(f"  the unmutated tests fail in the fork server (exit {status}): not used")
        return not self.broken

    def _ask(
        self, tests: list[str], timeout: float, patch: dict[str, Any] | None
    ) -> tuple[bool, int | None]:
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        request = {"args": tests, "timeout": timeout, "patch": patch}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            self.broken = True
            return False, None
        reply = json.loads(answer)
        self.forked += reply["patched"] and patch is not None
        self.missing = reply.get("missing", [])
        return reply["patched"], reply["status"]

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # interrupted with a mutant's tests running
                self.proc.terminate()
                self.proc.wait()


def _dotted(file: str) -> str:
    """``xarray_gds/codecs/__init__.py`` -> ``xarray_gds.codecs``."""
    return file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _hashes(copy: Path, top: str) -> dict[str, str]:
    """Path -> SHA-256 of every file under ``copy / top``."""
    return {
        path.relative_to(copy).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted((copy / top).rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def _coverage_run(copy: Path, suite: list[str], env: dict[str, str]) -> dict[str, Any]:
    """``suite`` run once under coverage, every file of the package measured."""
    data = copy / ".mutation-coverage" / "coverage"
    shutil.rmtree(data.parent, ignore_errors=True)
    data.parent.mkdir()
    rc = copy / ".mutation-coverage" / "coveragerc"
    rc.write_text(
        f"[run]\ndata_file = {data}\nparallel = true\npatch = subprocess\n"
        f"include =\n    {copy / 'xarray_gds'}/*\n"
    )
    args = ["--cov", f"--cov-config={rc}", "--cov-context=test", "--cov-report="]
    args += ["--durations=0", "--durations-min=0", *suite]
    started = time.monotonic()
    status, out = _pytest(args, copy, env, None)
    seconds = time.monotonic() - started
    if not data.exists():
        print(out[-5000:], file=sys.stderr)
        raise SystemExit(f"the coverage run left no data (pytest exit status {status})")
    return {
        "map": mutation_tool.LineTests.from_coverage(data, copy).to_json(),
        "durations": mutation_tool.durations(out),
        "failing": sorted(mutation_tool.failures(out)),
        "seconds": round(seconds, 1),
    }


def _merged(
    old: dict[str, Any], new: dict[str, Any], dropped: set[str], gone: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``old``'s map without the tests of the test files ``dropped`` and without the
    package files ``gone`` (changed since: their lines moved), and ``new``'s."""

    def kept(test: str) -> bool:
        return test.split("::")[0] not in dropped

    lines: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for file, by_line in old["map"].items():
        if file in gone:
            continue
        for line, tests in by_line.items():
            lines[file][line].update(t for t in tests if not t or kept(t))
    for file, by_line in new["map"].items():
        for line, tests in by_line.items():
            lines[file][line].update(tests)
    return {
        "map": {
            f: ran for f, v in lines.items() if (ran := {ln: sorted(t) for ln, t in v.items() if t})
        },
        "durations": {
            **{t: s for t, s in old["durations"].items() if kept(t)},
            **new["durations"],
        },
        "failing": sorted({*filter(kept, old["failing"]), *new["failing"]}),
        # the whole suite's time (the whole-suite stage's timeout comes from it)
        "seconds": old["seconds"],
    }


def _package(copy: Path) -> dict[str, str]:
    """What a coverage map depends on besides the tests: every file of the package, and
    ``pyproject.toml`` (pytest's settings), by SHA-256."""
    found = _hashes(copy, "xarray_gds")
    if (copy / "pyproject.toml").is_file():
        found["pyproject.toml"] = hashlib.sha256((copy / "pyproject.toml").read_bytes()).hexdigest()
    return found


def _map_path(package: dict[str, str], suite: list[str]) -> Path:
    """Where the coverage map of a package's content and a suite is kept."""
    digest = hashlib.sha256(f"{MAP_VERSION}\0{suite}".encode())
    for name, sha in sorted(package.items()):
        digest.update(f"{name}\0{sha}\0".encode())
    return WORK / f"coverage-{digest.hexdigest()[:16]}.json"


#: an earlier map is brought up to date only while the test files to run again are
#: fewer than this share of the suite's; past it, the whole suite runs again
RERUN_SHARE = 0.5


def _base_map(suite: list[str], skip: Path) -> dict[str, Any] | None:
    """The newest coverage map kept in ``.mutation/`` for ``suite`` (another package
    content than ``skip``'s), to bring up to date; None when there is none."""
    kept = sorted(WORK.glob("coverage-*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in kept[:3]:
        if path == skip:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("version") == MAP_VERSION and data.get("suite") == suite:
            return dict(data)
    return None


def since(
    base: dict[str, Any], package: dict[str, str], tests: dict[str, str]
) -> tuple[frozenset[str], set[str]] | None:
    """What a kept map of the suite must measure again: ``(package files changed or
    deleted, test files whose tests it drops)``. The test files are those changed,
    added or deleted, and every file of a test that ran a line of a changed package
    file; those that still exist run again. None when the whole suite must run: a
    package module added (no test in the map runs it), ``pyproject.toml`` changed, a
    file of ``tests/`` other than a test module changed, or the files to run again are
    :data:`RERUN_SHARE` of the suite's or more."""

    def changed(old: dict[str, str], new: dict[str, str]) -> set[str]:
        return {f for f in old.keys() | new.keys() if old.get(f) != new.get(f)}

    files = changed(base["package"], package)
    test_files = changed(base["tests"], tests)
    if "pyproject.toml" in files or any(f not in base["package"] for f in files):
        return None
    if not all(re.fullmatch(r"tests/test_\w+\.py", f) for f in test_files):
        return None
    dropped = set(test_files)
    for file in files:
        for ran in base["map"].get(file, {}).values():
            dropped.update(t.split("::")[0] for t in ran if t)
    modules = [f for f in tests if re.fullmatch(r"tests/test_\w+\.py", f)]
    if len(dropped & set(tests)) >= RERUN_SHARE * max(1, len(modules)):
        return None
    return frozenset(files), dropped


def coverage_map(copy: Path, suite: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Which test runs each line of the package, each test's time, and the tests failing
    unmutated: one run of ``suite`` under coverage with a context a test (pytest-cov's
    ``--cov-context=test``), subprocesses measured too (coverage's ``patch =
    subprocess``). Kept in ``.mutation/`` by the package's content and the suite: a
    second run of the same content reads it back. After a change, the newest map kept
    for the suite is brought up to date (:func:`since`): the test files that ran the
    changed package files, and the test files changed, run again under coverage and
    replace what the map held of them and of the changed files. A test of another file
    that reaches a changed file only now is missing from the map: its mutants' lines
    then run fewer tests first, and the whole-suite stage still judges the survivors."""
    package = _package(copy)
    kept = _map_path(package, suite)
    tests = _hashes(copy, "tests")
    base: dict[str, Any] | None = None
    if kept.exists():
        base = json.loads(kept.read_text())
    if base is None or base.get("version") != MAP_VERSION:
        base = _base_map(suite, kept) if suite == ["tests"] else None
    found: dict[str, Any] | None = None
    how = "whole"
    plan = since(base, package, tests) if base is not None else None
    if base is not None and plan is not None:
        files, dropped = plan
        rerun = sorted(dropped & set(tests))
        if not files and not dropped:
            found, how = base, "kept"
        elif suite == ["tests"]:  # a suite of its own is run whole
            new = (
                _coverage_run(copy, rerun, env)
                if rerun
                else {"map": {}, "durations": {}, "failing": [], "seconds": 0.0}
            )
            found = _merged(base, new, dropped, files)
            how = f"{len(files)} package file(s) changed, {len(rerun)} test file(s) again"
    if found is None:
        found = _coverage_run(copy, suite, env)
    found.update(version=MAP_VERSION, suite=suite, package=package, tests=tests)
    WORK.mkdir(exist_ok=True)
    kept.write_text(json.dumps(found) + "\n")
    found["how"] = how
    return found


def _write_mutants(copy: Path, sources: dict[str, str], batch: list[mutation_tool.Mutant]) -> None:
    by_file: dict[str, list[mutation_tool.Mutant]] = defaultdict(list)
    for m in batch:
        by_file[m.file].append(m)
    for file, ms in by_file.items():
        (copy / file).write_text(mutation_tool.apply_all(sources[file], ms))


def _restore(copy: Path, sources: dict[str, str], files: Iterable[str]) -> None:
    for file in files:
        (copy / file).write_text(sources[file])


def _layers(pending: list[mutation_tool.Mutant]) -> list[list[mutation_tool.Mutant]]:
    """``pending`` in groups whose mutants change no line in common (so that each group
    can be applied at once)."""
    layers: list[tuple[list[mutation_tool.Mutant], dict[str, list[tuple[int, int]]]]] = []
    for m in pending:
        span = (m.start, max(m.stop, m.start + 1))
        for group, taken in layers:
            if all(span[1] <= lo or hi <= span[0] for lo, hi in taken[m.file]):
                group.append(m)
                taken[m.file].append(span)
                break
        else:
            layers.append(([m], defaultdict(list, {m.file: [span]})))
    return [group for group, _ in layers]


class Runner:
    """Mutants run in the copy: one alone (in the fork server when it is in a function's
    body, else in a fresh pytest), or several at once (a fresh pytest), each mutated
    file put back after."""

    def __init__(
        self,
        copy: Path,
        env: dict[str, str],
        sources: dict[str, str],
        stmts: dict[str, dict[int, Any]],
        server: Server,
        times: dict[str, float],
    ):
        self.copy, self.env, self.sources, self.stmts = copy, env, sources, stmts
        self.server, self.times = server, times

    def budget(self, tests: Iterable[str]) -> float:
        """A run's timeout: three times its tests' time in the coverage run, and a
        minute."""
        return 60 + 3 * sum(self.times.get(t, 1.0) for t in tests)

    def one(self, m: mutation_tool.Mutant, tests: list[str]) -> tuple[int | None, bool]:
        """(the tests' exit status with ``m`` applied, None past the timeout; whether it
        ran in the fork server)."""
        timeout = self.budget(tests)
        stmt = self.stmts[m.file].get(m.line)
        outer = stmt.outer if stmt is not None and stmt.in_function else None
        patch = None
        if outer is not None and self.server.ready(_dotted(m.file), tests, timeout):
            patch = {"module": _dotted(m.file), "qualname": outer[0], "first": outer[1]}
        _write_mutants(self.copy, self.sources, [m])
        try:
            forked, status = False, None
            if patch is not None:
                forked, status = self.server.run(tests, timeout, patch)
                if forked and status == 0 and self.server.missing:  # left to a fresh pytest
                    status, _ = _pytest(["-x", *self.server.missing], self.copy, self.env, timeout)
            if not forked:
                status, _ = _pytest(["-x", *tests], self.copy, self.env, timeout)
        finally:
            _restore(self.copy, self.sources, [m.file])
        return status, forked

    def together(
        self, group: list[mutation_tool.Mutant], tests: list[str], timeout: float
    ) -> tuple[int | None, str]:
        _write_mutants(self.copy, self.sources, group)
        try:
            return _pytest(["-x", *tests], self.copy, self.env, timeout)
        finally:
            _restore(self.copy, self.sources, {m.file for m in group})


def confirm(
    alive: list[mutation_tool.Mutant],
    runner: Runner,
    tests_of: Callable[[list[mutation_tool.Mutant]], list[str]],
    timeout: float,
    stage: str,
) -> int:
    """The mutants of ``alive`` against more tests (``tests_of`` a group: the whole
    suite, or the rest of their lines' tests), as many at a time as change no line in
    common. While a run fails, its first failing test runs against each of the group's
    mutants whose line it ran (or each one, if none did), alone, and those it kills
    leave the group; where it kills none alone, or the run failed outside any test (a
    module that does not import, a collection error, a timeout), the group is halved.
    One run for all when none is killed, the usual case. Marks those killed; returns the
    runs made."""
    runs = 0

    def check(group: list[mutation_tool.Mutant]) -> None:
        nonlocal runs
        while group:
            tests = tests_of(group)
            if not tests:
                return
            t0 = time.monotonic()
            status, out = runner.together(group, tests, timeout)
            runs += 1
            print(
                f"  {stage} with {len(group)} mutant(s): exit {status} in "
                f"{time.monotonic() - t0:.0f} s",
                flush=True,
            )
            if status == 0:
                for m in group:
                    m.stage = stage
                return
            if len(group) == 1:
                group[0].outcome = "killed" if status is not None else "timeout"
                group[0].stage = stage
                return
            # a test that failed (a node id): run against each mutant alone below; an
            # error outside the tests (a module that no longer imports: pytest's exit
            # status 4 for conftest, 2 for a collection error, naming a file) halves
            failed = sorted(t for t in mutation_tool.failures(out) if not t.endswith(".py"))
            if status != 1:
                failed = []
            killed = []
            if failed:
                test = failed[0]
                for m in [m for m in group if test in m.selected] or group:
                    alone, _ = runner.one(m, [test])
                    if alone != 0:
                        m.outcome = "killed" if alone is not None else "timeout"
                        m.stage = stage
                        killed.append(m)
            if not killed:
                half = len(group) // 2
                check(group[:half])
                check(group[half:])
                return
            group = [m for m in group if m not in killed]

    for layer in _layers(alive):
        check(layer)
    return runs


def _each_mutant(
    found: list[mutation_tool.Mutant],
    runner: Runner,
    lines_map: mutation_tool.LineTests,
    failing: set[str],
    quick: float,
) -> list[mutation_tool.Mutant]:
    """Each mutant against the tests that run its line, the fastest first (``-x``),
    as many as take ``quick`` seconds (their time in the coverage run; at least one);
    the mutants alive after, each with the rest of its line's tests."""
    alive: list[mutation_tool.Mutant] = []
    for n, m in enumerate(found, 1):
        tests = lines_map.tests_for(m.file, m.line, runner.stmts[m.file])
        if tests is None:
            m.outcome = "unreached"
            continue
        m.selected = tests - failing
        m.tests = len(m.selected)
        ordered = sorted(m.selected, key=lambda t: (runner.times.get(t, 0.0), t))
        first: list[str] = []
        total = 0.0
        for t in ordered:
            if first and total + runner.times.get(t, 1.0) > quick:
                break
            first.append(t)
            total += runner.times.get(t, 1.0)
        m.rest = ordered[len(first) :]
        m.outcome, m.stage = "survived", "quick tests"
        if not first:  # only imported: the whole suite judges it
            alive.append(m)
            continue
        t0 = time.monotonic()
        status, forked = runner.one(m, first)
        m.seconds = round(time.monotonic() - t0, 1)
        if status != 0:
            m.outcome = "timeout" if status is None else "killed"
        else:
            alive.append(m)
        print(
            f"  [{n}/{len(found)}] {m.outcome:8} {m.seconds:5.1f}s {m.file}:{m.line} "
            f"{m.operator} {m.old!r} -> {m.new!r} ({len(first)} of {m.tests} tests"
            + (", forked)" if forked else ")"),
            flush=True,
        )
    return alive


def run_mutants(
    targets: dict[str, set[int] | None],
    copy: Path,
    env: dict[str, str],
    triage: list[dict[str, Any]],
    suite: list[str],
    full_suite: bool,
    quick: float,
    report: mutation_tool.Report,
) -> None:
    """Every mutant of ``targets`` (file -> lines, None for all), each against the
    quick tests of its line, then those alive against the whole suite (or the rest of
    their lines' tests); ``report`` filled."""
    started = time.monotonic()
    sources = {f: (copy / f).read_text() for f in targets}
    found: list[mutation_tool.Mutant] = []
    for file, lines in targets.items():
        ms, left = mutation_tool.mutants(sources[file], file, _module_name(file), lines)
        found.extend(ms)
        report.files[file] = {
            "module": _module_name(file),
            "lines": "all" if lines is None else len(lines),
            "mutants": len(ms),
            "left_out": left,
        }
        print(f"{file}: {len(ms)} mutants", flush=True)
    report.seconds["making"] = round(time.monotonic() - started, 1)
    if not found:
        mutation_tool.summarize(report, found)
        return
    t0 = time.monotonic()
    cov = coverage_map(copy, suite, env)
    report.seconds["coverage"] = round(time.monotonic() - t0, 1)
    print(
        f"coverage of {len(targets)} file(s): {cov['how']} "
        f"({report.seconds['coverage']:.0f} s), {len(cov['failing'])} test(s) failing unmutated",
        flush=True,
    )
    lines_map = mutation_tool.LineTests.from_json(cov["map"])
    failing = set(cov["failing"])
    stmts = {f: mutation_tool.statements(sources[f]) for f in targets}
    test_files = {t.split("::")[0] for f in cov["map"].values() for ts in f.values() for t in ts}
    test_files.discard("")
    server = Server(copy, env, ["xarray_gds", *map(_dotted, targets)], sorted(test_files))
    runner = Runner(copy, env, sources, stmts, server, cov["durations"])
    try:
        t0 = time.monotonic()
        alive = _each_mutant(found, runner, lines_map, failing, quick)
        report.seconds["mutants"] = round(time.monotonic() - t0, 1)
        for m in alive:
            verdict = _verdict(m.module, m.old, m.new, m.context, triage)
            if verdict is not None:
                m.triage = verdict["verdict"]
                m.why = verdict.get("reason") or verdict.get("test")
        # equivalents and device-only code go no further; the rest face more tests
        judge = [m for m in alive if m.triage not in mutation_tool.NOT_OPEN]
        t0 = time.monotonic()
        if full_suite:
            whole = [*suite, *(f"--deselect={t}" for t in sorted(failing))]
            runs = confirm(
                judge, runner, lambda group: whole, max(600.0, 2 * cov["seconds"]), "suite"
            )
        else:

            def rest(group: list[mutation_tool.Mutant]) -> list[str]:
                return sorted({t for m in group for t in m.rest})

            timeout = max(600.0, 2 * cov["seconds"])
            runs = confirm(judge, runner, rest, timeout, "tests of the line")
        report.seconds["suite" if full_suite else "rest"] = round(time.monotonic() - t0, 1)
        report.counts["runs_together"] = runs
    finally:
        server.close()
    report.counts["in_fork"] = server.forked
    unreached: dict[tuple[str, int], list[mutation_tool.Mutant]] = defaultdict(list)
    for m in found:
        if m.outcome == "unreached":
            unreached[(m.file, m.line)].append(m)
    for (file, line), ms in sorted(unreached.items()):
        text = sources[file].split("\n")[line - 1].strip()
        stmt = stmts[file].get(line)
        entry: dict[str, Any] = {
            "module": ms[0].module,
            "file": file,
            "line": line,
            "text": text,
            "function": stmt.function if stmt is not None else "",
            "mutants": len(ms),
        }
        for t in triage:
            if t["module"] == ms[0].module and t["old"] == text and t["verdict"] == "gpu-only":
                entry["triage"], entry["why"] = t["verdict"], t.get("test") or t.get("reason")
                break
        report.unreached.append(entry)
    extra = dict(report.counts)
    mutation_tool.summarize(report, found)
    report.counts.update(extra)


def _print_report(report: mutation_tool.Report) -> None:
    c = report.counts
    print(
        f"\n{c.get('mutants', 0)} mutants: {c.get('killed', 0)} killed "
        f"({c.get('timeouts', 0)} by timeout), {c.get('survived', 0)} survived "
        f"({c.get('equivalent', 0)} equivalent, {c.get('gpu_only', 0)} GPU only, "
        f"{c.get('open', 0)} open), {c.get('unreached_mutants', 0)} on "
        f"{c.get('unreached_lines', 0)} lines no CPU test runs"
    )
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report.seconds.items()))
    for s in report.survivors:
        if s.get("triage") not in mutation_tool.NOT_OPEN:
            print(f"  open: {s['file']}:{s['line']} {s['operator']} {s['old']!r} -> {s['new']!r}")
    for u in report.unreached:
        mark = " (gpu-only)" if u.get("triage") else ""
        print(f"  unreached: {u['file']}:{u['line']} {u['function']}: {u['text']}{mark}")


def run_changed(args: argparse.Namespace, specs: list[str]) -> int:
    """``--diff BASE`` and ``--all``: every mutant of the changed lines, or of whole
    modules; the survivors file at ``--out``."""
    started = time.monotonic()
    # stopped (SIGTERM): the mutated file put back, the copy and the server removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    if args.worktree and args.rev != "HEAD":
        raise SystemExit("--rev and --worktree: one or the other")
    revision = _git("rev-parse", "--short", args.rev).strip()
    if args.worktree:
        revision += " + working tree"
    wanted = None
    if specs:
        wanted = set()
        for spec in specs:
            path = _resolve(spec, ROOT)
            if path is None:
                raise SystemExit(f"no module {spec!r} under xarray_gds/")
            wanted.add(path)
    targets: dict[str, set[int] | None]
    if args.diff:
        changed = diff_targets(args.diff, args.worktree, args.rev)
        targets = {f: ls for f, ls in changed.items() if wanted is None or f in wanted}
    else:
        names = sorted(wanted) if wanted else [_resolve(n, ROOT) or n for n in MODULES]
        targets = dict.fromkeys(names)
    report = mutation_tool.Report(
        mode="diff" if args.diff else "all", revision=revision, base=args.diff
    )
    suite = shlex.split(args.suite)
    with tempfile.TemporaryDirectory(prefix="xarray-gds-mut-") as tmp:
        copy = Path(tmp)
        _copy_tree(copy, args.worktree, args.rev)
        targets = {f: ls for f, ls in targets.items() if (copy / f).is_file()}
        print(f"{len(targets)} file(s), {revision}" + (f", since {args.diff}" if args.diff else ""))
        env = dict(os.environ)
        env["PYTHONPATH"] = str(copy) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        for var in ("COVERAGE_PROCESS_START", "COVERAGE_PROCESS_CONFIG"):
            env.pop(var, None)
        run_mutants(targets, copy, env, _triage(), suite, not args.no_suite, args.quick, report)
    total = time.monotonic() - started
    report.seconds["total"] = round(total, 1)
    run = report.counts.get("run", 0)
    report.counts["per_minute"] = round(60 * run / total) if total else 0
    mutation_tool.write_report(args.out, report)
    _print_report(report)
    print(f"{run} mutants run in {total / 60:.1f} min; the survivors file: {args.out}")
    return 1 if report.counts.get("open") else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "modules",
        nargs="*",
        help=f"of {', '.join(MODULES)} (all by default); with --diff or --all, also any file "
        "of the package (stores/icechunk, codecs)",
    )
    parser.add_argument("--modules", dest="more", action="append", default=[], help="the same")
    parser.add_argument("--sites", type=int, default=20, help="sites a module (default 20)")
    parser.add_argument(
        "--diff",
        metavar="BASE",
        help="every mutant of the lines changed since BASE (a git revision) under xarray_gds/",
    )
    parser.add_argument(
        "--all", action="store_true", help="every mutant of the modules named, no sample"
    )
    parser.add_argument("--worktree", action="store_true", help="the working tree, not HEAD")
    parser.add_argument(
        "--rev", default="HEAD", help="with --diff and --all, this revision, not HEAD"
    )
    parser.add_argument(
        "--suite",
        default="tests",
        help="pytest arguments of the whole suite, with --diff and --all (default: tests)",
    )
    parser.add_argument(
        "--quick",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --diff and --all, each mutant alone runs its line's fastest tests up to "
        "this many seconds (their time in the coverage run; default 30); the rest run "
        "with the whole suite, the mutants alive together",
    )
    parser.add_argument(
        "--no-suite",
        action="store_true",
        help="with --diff and --all, no whole-suite run for the mutants the tests of their "
        "line leave alive",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"the summary (JSON; default {OUT.relative_to(ROOT)}, with --diff and --all "
        f"{SURVIVORS.relative_to(ROOT)})",
    )
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
    specs = [*args.modules, *(m for more in args.more for m in more.split(","))]
    if (args.diff or args.all) and not (args.retriage or args.table):
        args.out = args.out or SURVIVORS
        return run_changed(args, specs)
    args.out = args.out or (SURVIVORS if args.diff or args.all else OUT)
    if args.retriage:
        done = json.loads(args.out.read_text())
        _retriage(done, _triage())
        args.out.write_text(json.dumps(done, indent=1) + "\n")
    if args.table or args.retriage:
        done = json.loads(args.out.read_text())
        if "survivors" in done:
            c = done["counts"]
            print(
                f"{c['survived']} survivors of {c['run']} mutants run: "
                f"{c.get('killed_since', 0)} killed since, {c['equivalent']} equivalent, "
                f"{c['gpu_only']} GPU only, {c['open']} open"
            )
            for r in done["survivors"]:
                if r.get("triage") not in ("equivalent", "gpu-only", "killed"):
                    print(f"  open: {r['file']}:{r['line']} {r['old']!r} -> {r['new']!r}")
            return 1 if c["open"] else 0
        print(table(done))
        return 0
    names = specs or list(MODULES)
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
            result = run_module(name, copy, args.sites, triage, env, revision)
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

"""Mutants of the lines that only a card runs, judged by the GPU tests that run them.

``docs/data/gpu-only-lines.json`` lists every statement of the read and write paths that
no CPU test reaches; those of kind ``"device"`` (they call CuPy, kvikio or nvCOMP) name
the GPU tests that run them. A CPU mutation run can only call such a line *unreached*;
this script makes every mutant of those lines (the operators of
``scripts/mutation-run.py``: Cosmic Ray's and ``scripts/mutation_tool.py``'s) and runs,
on a machine with a CUDA device, each mutant against its line's GPU tests.

Two steps, because the GPU machine has no Cosmic Ray:

    .venv/bin/python scripts/device-mutants.py make [--out .gpumut/mutants.json]
    python3 scripts/device-mutants.py run [--mutants .gpumut/mutants.json]
        [--workers 8] [--json OUT]                      # on the GPU machine

``make`` (here, with the ``dev`` extra) writes each mutant's file, lines and the tests
to run. ``run`` (on the card, the standard library only) checks that those tests pass
unmutated (a test that fails there is left out, and a mutant left without tests is
reported as *no test*), then gives each worker a copy of the checkout (the package and
``tests/``) and runs each mutant there: the mutated file written, ``python -m pytest -x``
on its tests with ``XARRAY_GDS_REQUIRE_GPU=1`` (a test that would skip for want of a
card fails instead), the file put back. A test failing or running past the timeout kills
the mutant. The checkout itself is never changed. Exit status 1 while a mutant survives.
A survivor is judged like a CPU run's: a test that fails on it, or a ``"gpu-only"`` entry
in ``docs/data/mutation-triage.json`` saying why no test can tell it from the original.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LINES = ROOT / "docs" / "data" / "gpu-only-lines.json"
DEFAULT = ROOT / ".gpumut" / "mutants.json"
#: what a worker's copy of the checkout holds
COPIED = ("xarray_gds", "tests", "pyproject.toml")


def make(lines_file: Path, out: Path) -> int:
    """Write every mutant of the ``device`` lines of ``lines_file`` to ``out``."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import mutation_tool

    listing = json.loads(lines_file.read_text())
    found: list[dict[str, Any]] = []
    for file, entries in listing["modules"].items():
        source = (ROOT / file).read_text()
        tests_of: dict[int, list[str]] = {}
        for entry in entries:
            if entry["kind"] == "device" and entry["device_tests"]:
                for line in entry["lines"]:
                    tests_of[line] = list(entry["device_tests"])
        module = file.removeprefix("xarray_gds/").removesuffix(".py")
        made, _left = mutation_tool.mutants(source, file, module, set(tests_of))
        for m in made:
            found.append(
                {
                    "id": f"{module}:{m.line}:{m.column}:{m.operator}:{len(found)}",
                    "file": file,
                    "line": m.line,
                    "operator": m.operator,
                    "start": m.start,
                    "stop": m.stop,
                    "lines": m.lines,
                    "old": m.old,
                    "new": m.new,
                    "tests": tests_of[m.line],
                }
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    files = {
        file: hashlib.sha256((ROOT / file).read_bytes()).hexdigest()
        for file in sorted({m["file"] for m in found})
    }
    doc = {"revision": listing["revision"], "files": files, "mutants": found}
    out.write_text(json.dumps(doc, indent=1))
    print(f"{len(found)} mutants of {len({(m['file'], m['line']) for m in found})} lines: {out}")
    return 0


def _mutated(source: str, mutant: dict[str, Any]) -> str:
    lines = source.split("\n")
    lines[mutant["start"] : mutant["stop"]] = mutant["lines"]
    return "\n".join(lines)


def _pytest(where: Path, tests: list[str], timeout: float, env: dict[str, str]) -> tuple[str, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        got = subprocess.run(
            cmd, cwd=where, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", ""
    tail = "\n".join((got.stdout + got.stderr).strip().splitlines()[-2:])
    return ("passed" if got.returncode == 0 else "failed"), tail


def _copy(dest: Path) -> None:
    dest.mkdir(parents=True)
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)


def run(mutants_file: Path, workers: int, timeout: float, out: Path | None, part: str) -> int:
    doc = json.loads(mutants_file.read_text())
    k, n = (int(x) for x in part.split("/"))
    mutants: list[dict[str, Any]] = doc["mutants"][k - 1 :: n]
    for file, digest in doc["files"].items():  # the mutants' lines are those files' lines
        if hashlib.sha256((ROOT / file).read_bytes()).hexdigest() != digest:
            raise SystemExit(f"{file} changed since the mutants were made: make them again")
    env = dict(
        os.environ,
        PYTHONDONTWRITEBYTECODE="1",
        XARRAY_GDS_REQUIRE_GPU="1",
        CUPY_GPU_MEMORY_LIMIT=os.environ.get("CUPY_GPU_MEMORY_LIMIT", f"{64 // workers}%"),
    )
    work = Path(tempfile.mkdtemp(prefix="device-mutants-"))
    tests = sorted({t for m in mutants for t in m["tests"]})
    base = work / "base"
    _copy(base)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        # each test alone: one failing test must not hide the others
        outcomes = list(pool.map(lambda t: _pytest(base, [t], 600, env), tests))
    failing = set()
    for test, (outcome, tail) in zip(tests, outcomes, strict=True):
        if outcome != "passed":
            failing.add(test)
            print(f"baseline {outcome}: {test}\n{tail}", flush=True)
    print(
        f"baseline: {len(tests)} tests, {len(failing)} failing, {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    copies: queue.SimpleQueue[Path] = queue.SimpleQueue()  # a copy of the checkout a worker
    for w in range(workers):
        _copy(work / f"w{w}")
        copies.put(work / f"w{w}")
    done = itertools.count(1)

    def one(m: dict[str, Any]) -> dict[str, Any]:
        chosen = [t for t in m["tests"] if t not in failing]
        if not chosen:
            return {"id": m["id"], "outcome": "no test"}
        where = copies.get()
        path = where / m["file"]
        original = path.read_text()
        started = time.perf_counter()
        try:
            path.write_text(_mutated(original, m))
            outcome, tail = _pytest(where, chosen, timeout, env)
        finally:
            path.write_text(original)
            copies.put(where)
        verdict = {"failed": "killed", "timeout": "killed", "passed": "survived"}[outcome]
        print(f"[{next(done)}/{len(mutants)}] {verdict} {m['id']}", flush=True)
        return {
            "id": m["id"],
            "file": m["file"],
            "line": m["line"],
            "operator": m["operator"],
            "old": m["old"],
            "new": m["new"],
            "tests": chosen,
            "outcome": verdict,
            "by_timeout": outcome == "timeout",
            "seconds": round(time.perf_counter() - started, 1),
            "tail": tail,
        }

    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, mutants))
    shutil.rmtree(work, ignore_errors=True)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    summary = {
        "revision": doc["revision"],
        "part": part,
        "counts": counts,
        "failing_tests": sorted(failing),
        "seconds": round(time.perf_counter() - t0),
        "results": results,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1))
    print(f"{len(mutants)} mutants: {counts}; {summary['seconds']} s", flush=True)
    for r in results:
        if r["outcome"] == "survived":
            print(f"SURVIVED {r['id']}: {r['old'].strip()} -> {r['new'].strip()}", flush=True)
    return 1 if counts.get("survived") else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p_make = sub.add_parser("make", help="make the mutants (needs the dev extra)")
    p_make.add_argument("--lines", type=Path, default=LINES)
    p_make.add_argument("--out", type=Path, default=DEFAULT)
    p_run = sub.add_parser("run", help="run them on a machine with a CUDA device")
    p_run.add_argument("--mutants", type=Path, default=DEFAULT)
    p_run.add_argument("--workers", type=int, default=8)
    p_run.add_argument("--timeout", type=float, default=120.0, help="seconds a mutant")
    p_run.add_argument("--json", type=Path, default=None)
    p_run.add_argument("--part", default="1/1", help="K/N: every Nth mutant from the Kth")
    args = parser.parse_args(argv)
    if args.step == "make":
        return make(args.lines, args.out)
    return run(args.mutants, args.workers, args.timeout, args.json, args.part)


if __name__ == "__main__":
    sys.exit(main())

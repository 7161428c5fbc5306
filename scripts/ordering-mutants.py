"""Remove each stream-ordering line of an installed xarray_gds in turn and run the tests
that must catch it.

Every place where work on one CUDA stream uses memory that another stream or the host
also uses is ordered by one line: a stream waiting for an event of the current stream
(``wait_event``), or the host waiting for a stream (``synchronize``) before a buffer
goes back to a pool or a result is used. :data:`ORDERINGS` names each such line
(docs/internals.md, "Stream orderings", explains each one). For each, this script
replaces the line with ``pass`` in the package that ``python -m pytest`` imports from
the current directory (run it on a copy, such as the GPU machine's, never a checkout
you are editing: an interrupted run may leave the line out), runs the tests named for
it, and puts the line back. A removal that the tests do not notice is a survivor.

    python scripts/ordering-mutants.py --list
    python scripts/ordering-mutants.py [--only NAME ...] [--json OUT] [-- PYTEST ARGS]

Without ``--only``, every ordering that a device test can show is tried (those marked
``device``); the others are shown by the CPU stand-in tests of
``tests/test_orderings.py`` and are listed with ``--list``. Needs a GPU for the device
tests; exits 1 when any removal survives.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ordering:
    """One ordering line: ``text`` (stripped) at its ``nth`` occurrence in ``module``."""

    name: str
    module: str  # path under xarray_gds/
    text: str
    nth: int
    what: str
    tests: tuple[str, ...]  # pytest node ids that must fail without it
    device: bool = True  # shown on the card (else only by CPU stand-ins)


_STRESS = "tests/test_gpu_stress.py::test_busy_card_reads_and_writes_are_exact[{}]"


def _wave(name: str) -> tuple[str, ...]:
    """The stress test's wave that goes through the ordering's hand-over."""
    return (_STRESS.format(name),)


_WAIT = "stream.wait_event(cp.cuda.get_current_stream().record())"
_SYNC = "stream.synchronize()"

ORDERINGS: tuple[Ordering, ...] = (
    Ordering(
        "staged-copy-waits",
        "decode.py",
        _WAIT,
        0,
        "the copy stream waits for the current stream before it writes rows CuPy's pool handed out",
        _wave("host-staged-decode"),
    ),
    Ordering(
        "staged-lease-sync",
        "decode.py",
        _SYNC,
        0,
        "the rows' copies end before their pinned lease goes back and before the current "
        "stream's filters read them",
        _wave("host-staged-decode"),
    ),
    Ordering(
        "split-lease-sync",
        "decode.py",
        _SYNC,
        1,
        "the copies of the host's share end before its pinned lease goes back",
        _wave("split"),
    ),
    Ordering(
        "split-host-waits",
        "decode.py",
        "wait()",
        0,
        "the host pool's share is decoded into the pinned lease and its copies queued "
        "before the copy stream is synchronized and the lease goes back",
        ("tests/test_orderings.py::test_ordering[split-host-waits]",),
        device=False,
    ),
    Ordering(
        "decode-lane-waits",
        "codecs/nvcomp.py",
        _WAIT,
        0,
        "nvCOMP's lane waits for the reads and gathers that wrote its inputs, and for the "
        "current stream's users of the output block",
        _wave("gpu-kvikio"),
    ),
    Ordering(
        "decode-final-sync",
        "codecs/nvcomp.py",
        _SYNC,
        1,
        "the decode ends before its rows go back to the current stream (nvCOMP's "
        "buffer_sizes waits too)",
        ("tests/test_orderings.py::test_ordering[decode-final-sync]",),
        device=False,
    ),
    Ordering(
        "decode-error-sync",
        "codecs/nvcomp.py",
        _SYNC,
        2,
        "a failed decode ends before its error is raised and its buffers go back to CuPy's pool",
        ("tests/test_orderings.py::test_ordering[decode-error-sync]",),
        device=False,
    ),
    Ordering(
        "encode-lane-waits",
        "codecs/nvcomp.py",
        _WAIT,
        1,
        "nvCOMP's encode lane waits for the kernels that compute what it encodes, and for "
        "the current stream's users of its output block",
        _wave("gpu-kvikio"),
    ),
    Ordering(
        "encode-retry-sync",
        "codecs/nvcomp.py",
        _SYNC,
        3,
        "an encode that found its rows too small ends before they go back to CuPy's pool",
        ("tests/test_orderings.py::test_ordering[encode-retry-sync]",),
        device=False,
    ),
    Ordering(
        "encode-final-sync",
        "codecs/nvcomp.py",
        "stream.synchronize()  # nothing goes back to CuPy's pool while nvCOMP uses it",
        0,
        "an encode (one that failed too) ends before its inputs and scratch go back to CuPy's pool",
        ("tests/test_orderings.py::test_ordering[encode-final-sync]",),
        device=False,
    ),
    Ordering(
        "oom-retry-sync",
        "codecs/nvcomp.py",
        _SYNC,
        0,
        "after nvCOMP ran out of memory, its lane ends before CuPy's pool frees its cached blocks",
        ("tests/test_orderings.py::test_ordering[oom-retry-sync]",),
        device=False,
    ),
    Ordering(
        "slotted-copy-sync",
        "stores/files.py",
        _SYNC,
        0,
        "the copies of whole files read into pinned slots end before the slots go back",
        _wave("gpu-staged-reads"),
    ),
    Ordering(
        "kvikio-waits-current",
        "stores/files.py",
        "_device.cupy().cuda.get_current_stream().synchronize()",
        0,
        "kvikio writes the arena only after the current stream's users of that block",
        _wave("gpu-kvikio"),
    ),
    Ordering(
        "staged-read-sync",
        "stores/files.py",
        _SYNC,
        1,
        "the copy of staged reads ends before the pinned buffer goes back",
        _wave("gpu-staged-reads"),
    ),
    Ordering(
        "remote-waits-current",
        "stores/remote_device.py",
        "cp.cuda.get_current_stream().synchronize()",
        0,
        "kvikio's remote reads write the arena only after the current stream's users of that block",
        ("tests/test_orderings.py::test_ordering[remote-waits-current]",),
        device=False,
    ),
    Ordering(
        "crc-lane-waits",
        "codecs/crc32c.py",
        _WAIT,
        0,
        "the CRC-32C lane waits for the writes of the chunks it sums",
        ("tests/test_orderings.py::test_ordering[crc-lane-waits]",),
        device=False,
    ),
    Ordering(
        "crc-final-sync",
        "codecs/crc32c.py",
        "stream.synchronize()  # the tables go back to CuPy's pool only after the kernel",
        0,
        "the CRC-32C kernel ends before its tables go back to CuPy's pool",
        ("tests/test_orderings.py::test_ordering[crc-final-sync]",),
        device=False,
    ),
    Ordering(
        "prefetch-sync",
        "loader/prefetch.py",
        "_device.cupy().cuda.get_current_stream().synchronize()",
        0,
        "a prefetched batch is whole before the thread hands it to a consumer on another stream",
        _wave("gpu-kvikio"),
    ),
    Ordering(
        "handover-sync",
        "decode.py",
        "_device.cupy().cuda.get_current_stream().synchronize()",
        0,
        "device values an engine thread made on its current stream are whole before they "
        "go to another thread (the one that asked, the caller on a stream of its own)",
        ("tests/test_orderings.py::test_ordering[handover-sync]",),
        device=False,
    ),
)


def find_line(source: str, ordering: Ordering) -> int:
    """The index of ``ordering``'s line in ``source``; ValueError when it is gone."""
    seen = 0
    for i, line in enumerate(source.splitlines()):
        if line.strip() == ordering.text:
            if seen == ordering.nth:
                return i
            seen += 1
    raise ValueError(
        f"{ordering.module}: occurrence {ordering.nth} of {ordering.text!r} not found "
        f"(ordering {ordering.name!r}): update ORDERINGS in scripts/ordering-mutants.py"
    )


def removed(source: str, ordering: Ordering) -> str:
    """``source`` with ``ordering``'s line replaced by ``pass`` (same indentation)."""
    lines = source.splitlines(keepends=True)
    i = find_line(source, ordering)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = f"{indent}pass  # ordering removed: {ordering.name}\n"
    return "".join(lines)


def _package() -> Path:
    """The xarray_gds that ``python -m pytest`` imports from here (a checkout in the
    current directory comes before an installed copy)."""
    code = "import os, xarray_gds; print(os.path.dirname(xarray_gds.__file__))"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if got.returncode:
        raise SystemExit(f"xarray_gds is not importable here: {got.stderr.strip()}")
    return Path(got.stdout.strip())


def run_one(package: Path, ordering: Ordering, pytest_args: list[str]) -> dict[str, object]:
    path = package / ordering.module
    original = path.read_text()
    mutated = removed(original, ordering)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    t0 = time.perf_counter()
    try:
        path.write_text(mutated)
        shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
        got = subprocess.run(
            [*cmd, *ordering.tests, *pytest_args], env=env, capture_output=True, text=True
        )
    finally:
        path.write_text(original)
        shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)
    tail = (got.stdout + got.stderr).strip().splitlines()[-3:]
    return {
        "name": ordering.name,
        "killed": got.returncode != 0,
        "seconds": round(time.perf_counter() - t0, 1),
        "tail": tail,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the orderings and stop")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these orderings only")
    parser.add_argument("--json", metavar="OUT", help="write the results here")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.list:
        for o in ORDERINGS:
            where = "device" if o.device else "cpu"
            print(f"{o.name:22} {where:6} {o.module}: {o.what}")
        return 0
    known = {o.name: o for o in ORDERINGS}
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        parser.error(f"unknown ordering(s) {', '.join(unknown)}: see --list")
    chosen = [known[n] for n in args.only] if args.only else [o for o in ORDERINGS if o.device]
    package = _package()
    for o in chosen:  # every line still where the list says, before anything is changed
        find_line((package / o.module).read_text(), o)
    results = []
    for o in chosen:
        result = run_one(package, o, args.pytest_args)
        results.append(result)
        verdict = "killed" if result["killed"] else "SURVIVED"
        print(f"{o.name:22} {verdict:8} {result['seconds']:7.1f} s", flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"orderings": [asdict(o) for o in chosen], "results": results}, indent=2)
        )
    survivors = [r["name"] for r in results if not r["killed"]]
    print(f"{len(results) - len(survivors)} of {len(results)} removals caught", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())

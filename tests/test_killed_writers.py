"""Writers killed with SIGKILL: the store opens as it was before a step or
after it, never in between, every chunk decodes, and ``xarray_gds.tidy`` removes what
the killed write left without changing what the store reads.

Each writer runs in a process of its own and reports every file it is about to rename
into place and every file it has renamed, waiting for the test's answer each time; the
test answers until the moment it chose (a seeded random event of the run) and then
kills the writer there. No sleeps: the moments are the writer's own steps.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr

import xarray_gds
from xarray_gds.tidy import TRUSTING, find_leftovers, tidy

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore:.*[Cc]onsolidated metadata.*:UserWarning"),
]

Y, X = 6, 8
STEPS = 3
KILLS = 13  #: per pattern; 4 patterns
SEED = 20261233
#: a temporary file of the engine's, as :func:`xarray_gds.stores.files.write_file` names it
PARTIAL = ".0.xarray-gds-0123456789abcdef0123456789abcdef.partial"


def _step(k: int, names: tuple[str, ...] = ("a", "b")) -> xr.Dataset:
    """Time step ``k``: variables ``names`` of (time, y, x)."""
    rng = np.random.default_rng(k)
    return xr.Dataset(
        {n: (("time", "y", "x"), rng.normal(size=(1, Y, X)).astype("f4")) for n in names},
        coords={"time": pd.DatetimeIndex([pd.Timestamp("2001-01-01") + pd.Timedelta(days=k)])},
    )


def _base(pattern: str, fmt: int, path: str) -> None:
    """The store as it is before the writer starts."""
    enc = {"chunks": (1, Y, X)}
    if pattern == "append":
        ds = xr.concat([_step(0), _step(1)], dim="time")
        xarray_gds.to_zarr(ds, path, zarr_format=fmt, encoding={"a": enc, "b": enc})
    elif pattern == "region":
        pytest.importorskip("dask")  # a template written with compute=False
        full = xr.concat([_step(k, ("a",)) for k in range(STEPS + 1)], dim="time")
        xarray_gds.to_zarr(
            full.chunk({"time": 1}), path, compute=False, zarr_format=fmt, encoding={"a": enc}
        )
    else:  # new variables with mode="a"
        xarray_gds.to_zarr(_step(0), path, zarr_format=fmt, encoding={"a": enc, "b": enc})


def _write(pattern: str, path: str, k: int) -> None:
    """Step ``k`` of the writer."""
    if pattern == "append":
        xarray_gds.to_zarr(_step(2 + k), path, append_dim="time")
    elif pattern == "region":
        part = _step(k, ("a",)).drop_vars("time")
        xarray_gds.to_zarr(part, path, region={"time": slice(k, k + 1)})
    else:
        names = tuple(f"v{k}_{i}" for i in range(3))
        xarray_gds.to_zarr(_step(0, names), path, mode="a")


def _writer(conn: Any, pattern: str, path: str) -> None:
    """In a process of its own: the writer, reporting each file rename (before and
    after) and each step, and waiting for the test's answer every time."""
    real = os.replace
    lock = threading.Lock()

    def report(*event: Any) -> None:
        with lock:
            conn.send(event)
            conn.recv()

    def replace(src: Any, dst: Any) -> None:
        report("pre", str(dst))
        real(src, dst)
        report("post", str(dst))

    os.replace = replace  # type: ignore[assignment]
    for k in range(STEPS):
        report("step", k)
        _write(pattern, path, k)
        report("done", k)
    conn.send(("end",))


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["xarray_gds", "xarray", "zarr", "numpy", __name__])
    return ctx


def _run(
    ctx: Any, pattern: str, path: str, kill_at: int | None, at_step: Callable[[int], None]
) -> tuple[int, int]:
    """Run the writer, answering its events; kill it at event ``kill_at`` (None: let it
    finish). ``at_step(k)`` runs when step ``k`` is done (the writer waits meanwhile).
    Returns (events seen, the step running when it was killed or STEPS)."""
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(there, pattern, path))
    proc.start()
    there.close()
    events, step = 0, 0
    try:
        while True:
            event = here.recv()
            if event[0] == "end":
                step = STEPS
                break
            if event[0] == "step":
                step = event[1]
            if events == kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                break
            events += 1
            if event[0] == "done":
                at_step(event[1])
            here.send(True)
    finally:
        proc.join(timeout=60)
        here.close()
    if kill_at is None:
        assert proc.exitcode == 0
    else:
        assert proc.exitcode == -signal.SIGKILL
    return events, step


def _read(path: str) -> xr.Dataset:
    """The store as zarr-python reads it (every chunk decoded)."""
    with xr.open_dataset(path, engine="zarr") as ds:
        return ds.load()


PATTERNS = [("append", 3), ("append", 2), ("region", 2), ("new-variables", 3)]


@pytest.mark.parametrize(("pattern", "fmt"), PATTERNS)
def test_killed_writer_leaves_a_whole_step(tmp_path: Path, pattern: str, fmt: int) -> None:
    """``KILLS`` writers killed at seeded random events of their run: the store reads
    as it was before the step that was running, or after it; ``tidy`` then removes
    what the killed write left (nothing it lists remains) and the store still reads the
    same, and a write after it lands."""
    ctx = _context()
    base = str(tmp_path / "base.zarr")
    _base(pattern, fmt, base)
    # a run that is not killed: the events, and the state after every step
    clean = str(tmp_path / "clean.zarr")
    shutil.copytree(base, clean)
    states = [_read(clean)]
    total, _ = _run(ctx, pattern, clean, None, lambda k: states.append(_read(clean)))
    assert len(states) == STEPS + 1 and total >= 4 * STEPS
    assert not find_leftovers(clean)
    rng = np.random.default_rng([SEED, PATTERNS.index((pattern, fmt))])
    kinds: set[str] = set()
    for trial, kill_at in enumerate(rng.integers(0, total, KILLS).tolist()):
        path = str(tmp_path / f"kill-{trial}.zarr")
        shutil.copytree(base, path)
        _, step = _run(ctx, pattern, path, int(kill_at), lambda k: None)
        got = _read(path)
        matches = [k for k in (step, step + 1) if got.identical(states[k])]
        assert matches, f"killed at event {kill_at} in step {step}: a state in between"
        # only complete writes of this package made the store: its consolidated
        # metadata is trusted (without that, tidy keeps what differs from it)
        left = find_leftovers(path, trust_consolidated=True)
        kinds.update(item.kind for item in left)
        # never touches what only the consolidated metadata condemns
        plain = tidy(path, dry_run=False)
        assert all(i.kind not in TRUSTING for i in plain) and set(plain) <= set(left)
        xr.testing.assert_identical(_read(path), got)
        assert tidy(path, dry_run=False, trust_consolidated=True) == [
            i for i in left if i not in plain
        ]
        assert not find_leftovers(path, trust_consolidated=True)
        xr.testing.assert_identical(_read(path), got)
        k = matches[0]
        if trial % 4 == 0 and k < STEPS:  # the next writer finds a store it can write
            _write(pattern, path, k)
            xr.testing.assert_identical(_read(path), states[k + 1])
    assert "partial-file" in kinds  # killed between a file's write and its rename


def test_tidy_lists_and_removes_each_kind(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Each kind of leftover made by hand: dry run lists it and changes nothing; tidy
    removes it; the command line does the same."""
    from xarray_gds.tools.cli import main

    path = tmp_path / "s.zarr"
    ds = xr.concat([_step(0), _step(1)], dim="time")
    enc = {"chunks": (1, Y, X)}
    xarray_gds.to_zarr(ds, path, zarr_format=3, encoding={"a": enc, "b": enc})
    before = _read(str(path))
    (path / "a" / "c" / "5" / "0").mkdir(parents=True)
    shutil.copy(path / "a" / "c" / "1" / "0" / "0", path / "a" / "c" / "5" / "0" / "0")
    (path / "a" / "c" / "0" / "0" / PARTIAL).write_bytes(b"half")
    (path / "new" / "c" / "0" / "0").mkdir(parents=True)
    (path / "new" / "c" / "0" / "0" / "0").write_bytes(b"chunk")
    doc = (path / "b" / "zarr.json").read_text()
    (path / "b" / "zarr.json").write_text(doc.replace('"shape": [\n    2', '"shape": [\n    3'))
    assert (path / "b" / "zarr.json").read_text() != doc
    want = {
        (f"a/c/0/0/{PARTIAL}", "partial-file"),
        ("a/c/5/0/0", "orphan-chunk"),
        ("new", "unpublished-node"),
        ("b/zarr.json", "metadata-ahead"),
    }
    assert {(i.path, i.kind) for i in tidy(path, dry_run=True, trust_consolidated=True)} == want
    assert main(["tidy", str(path), "--dry-run", "--trust-consolidated"]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p, _ in want) and "dry run" in out
    assert (path / "new").exists()
    assert main(["tidy", str(path), "--trust-consolidated"]) == 0  # a dry run by default
    assert {(i.path, i.kind) for i in find_leftovers(path, trust_consolidated=True)} == want
    assert main(["tidy", str(path), "--delete", "--trust-consolidated"]) == 0
    assert not find_leftovers(path)
    assert not (path / "new").exists() and not (path / "a" / "c" / "5").exists()
    assert (path / "b" / "zarr.json").read_text() != doc.replace("2", "3")
    xr.testing.assert_identical(_read(str(path)), before)
    xarray_gds.to_zarr(_step(2), path, append_dim="time")
    xr.testing.assert_identical(_read(str(path)), xr.concat([before, _step(2)], dim="time"))


def test_tidy_keeps_writes_made_without_consolidating(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A store changed after its consolidation by someone who did not consolidate
    (zarr-python setting an attribute, adding an array) differs from its consolidated
    metadata for a good reason: tidy keeps every document, node and chunk of it, says
    how to act, and only ``trust_consolidated`` puts the consolidated state back."""
    from xarray_gds.tools.cli import main

    path = tmp_path / "s.zarr"
    enc = {"chunks": (1, Y, X)}
    ds = xr.concat([_step(0), _step(1)], dim="time")
    ds.to_zarr(path, zarr_format=3, encoding={"a": enc, "b": enc}, consolidated=True)
    zarr.open_array(path / "a", mode="r+").attrs["units"] = "K"
    extra = zarr.create_array(
        path / "extra", shape=(3,), chunks=(1,), dtype="i4", dimension_names=["n"]
    )
    extra[:] = [1, 2, 3]
    files = sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())
    own = xr.open_zarr(path, consolidated=False).load()
    assert own.a.attrs["units"] == "K" and "extra" in own
    assert tidy(path, dry_run=False) == []
    assert sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file()) == files
    xr.testing.assert_identical(xr.open_zarr(path, consolidated=False).load(), own)
    kinds = {(i.path, i.kind) for i in find_leftovers(path)}
    assert kinds == {("a/zarr.json", "metadata-ahead"), ("extra", "unconsolidated-node")}
    assert main(["tidy", str(path), "--delete"]) == 0
    out = capsys.readouterr().out
    assert "0 leftover(s) removed" in out and "--trust-consolidated" in out
    assert "kept  unconsolidated-node extra" in out
    xr.testing.assert_identical(xr.open_zarr(path, consolidated=False).load(), own)
    # told that the consolidated metadata is the truth, tidy puts it back
    assert {(i.path, i.kind) for i in tidy(path, dry_run=False, trust_consolidated=True)} == kinds
    back = xr.open_zarr(path, consolidated=False).load()
    assert "units" not in back.a.attrs and "extra" not in back


def _chunk_files(root: Path) -> set[str]:
    meta = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name not in meta
    }


def _grid_step(dim: str, at: int, width: int) -> xr.Dataset:
    """``width`` steps of ``a`` and ``b`` along ``dim`` ("time" or "x") from ``at`` on,
    2 time steps x 8 columns otherwise."""
    nt, nx = (width, 8) if dim == "time" else (2, width)
    t0, x0 = (at, 0) if dim == "time" else (0, at)
    rng = np.random.default_rng(at)
    return xr.Dataset(
        {n: (("time", "y", "x"), rng.normal(size=(nt, Y, nx)).astype("f4")) for n in "ab"},
        coords={
            "time": pd.date_range("2001-01-01", periods=nt, freq="D") + pd.Timedelta(days=t0),
            "x": np.arange(x0, x0 + nx, dtype="f8"),
        },
    )


@pytest.mark.parametrize("dim", ["time", "x"])
@pytest.mark.parametrize("fmt", [2, 3])
def test_tidy_finds_the_chunks_of_a_killed_one_step_append(
    tmp_path: Path, fmt: int, dim: str
) -> None:
    """A one-step append killed after its chunks and before its metadata leaves chunks
    just past the end of each array (the first index outside the shape, along the
    first or the last axis): tidy lists every one of them and nothing else, removes
    them, and the store then reads and appends as one the append never touched."""
    chunks = {"chunks": (1, Y, 4)}
    path, done = tmp_path / "s.zarr", tmp_path / "done.zarr"
    base = _grid_step(dim, 0, 2 if dim == "time" else 8)
    step = _grid_step(dim, base.sizes[dim], 1 if dim == "time" else 4)  # one chunk's width
    xarray_gds.to_zarr(base, path, zarr_format=fmt, encoding={"a": chunks, "b": chunks})
    before = _chunk_files(path)
    shutil.copytree(path, done)
    xarray_gds.to_zarr(step, done, append_dim=dim)
    left = _chunk_files(done) - before
    axis = ("time", "y", "x").index(dim)
    sep = "/" if fmt == 3 else "."
    # the layout under test: the append's chunks lie one past the end of the old grid
    for name in "ab":
        key = f"{name}/{'c/' if fmt == 3 else ''}" + sep.join(
            str(2 if i == axis else 0) for i in range(3)
        )
        assert key in left, (key, sorted(left))
    for key in left:  # the chunks as the killed writer left them, its metadata unwritten
        (path / key).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(done / key, path / key)
    found = find_leftovers(path)
    assert sorted((i.path, i.kind) for i in found) == sorted((k, "orphan-chunk") for k in left)
    assert sorted(i.path for i in tidy(path, dry_run=False)) == sorted(left)
    assert _chunk_files(path) == before and not find_leftovers(path)
    xr.testing.assert_identical(_read(str(path)), base)
    xarray_gds.to_zarr(step, path, append_dim=dim)
    xr.testing.assert_identical(_read(str(path)), xr.open_dataset(done, engine="zarr").load())

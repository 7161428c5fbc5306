"""``xarray_gds.to_zarr`` into Icechunk sessions, against xarray's own ``to_zarr``.

Icechunk checks chunk keys against the array metadata, so chunks cannot be written
before it; a session's commit is the all-or-nothing guarantee of a write. Real
repositories on the local filesystem, compared with what xarray writes into another.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

import xarray_gds

icechunk = pytest.importorskip("icechunk")  # the test extra has it; not every GPU image


def _dataset(t0: int, nt: int) -> xr.Dataset:
    rng = np.random.default_rng(t0)
    time = np.arange(t0, t0 + nt)
    return xr.Dataset(
        {
            "t2m": (("time", "y", "x"), rng.standard_normal((nt, 6, 8)).astype("f4")),
            "flag": (("time", "x"), (rng.integers(0, 3, (nt, 8))).astype("i2")),
        },
        coords={"time": time, "y": np.arange(6.0), "x": np.arange(8.0)},
        attrs={"title": "icechunk"},
    )


_ENCODING = {"t2m": {"chunks": (2, 3, 4)}, "flag": {"chunks": (2, 4)}}


def _repo(path: Path) -> icechunk.Repository:
    return icechunk.Repository.create(icechunk.local_filesystem_storage(str(path)))


def _write(repo: icechunk.Repository, write: Callable[..., Any], ds: xr.Dataset, **kw: Any) -> None:
    session = repo.writable_session("main")
    write(ds, session.store, **kw)
    session.commit("write")


def _ours(ds: xr.Dataset, store: Any, **kw: Any) -> Any:
    return xarray_gds.to_zarr(ds, store, **kw)


def _theirs(ds: xr.Dataset, store: Any, **kw: Any) -> Any:
    return ds.to_zarr(store, **kw)


def _read(repo: icechunk.Repository, engine: str) -> xr.Dataset:
    store = repo.readonly_session("main").store
    kwargs: dict[str, Any] = {"device": "cpu"} if engine == "gds-zarr" else {}
    return xr.open_dataset(store, engine=engine, consolidated=False, **kwargs).load()


STEPS: dict[str, list[tuple[Callable[[], xr.Dataset], dict[str, Any]]]] = {
    "new": [(lambda: _dataset(0, 4), {"mode": "w", "encoding": _ENCODING})],
    "append": [
        (lambda: _dataset(0, 4), {"mode": "w", "encoding": _ENCODING}),
        (lambda: _dataset(4, 3), {"append_dim": "time"}),
        (lambda: _dataset(7, 2), {"append_dim": "time"}),
    ],
    "region": [
        (lambda: _dataset(0, 6), {"mode": "w", "encoding": _ENCODING}),
        (
            lambda: _dataset(100, 2).drop_vars(["y", "x"]).assign_coords(time=[2, 3]),
            {"region": {"time": slice(2, 4)}, "mode": "r+"},
        ),
    ],
}


@pytest.mark.parametrize("case", list(STEPS))
def test_writes_into_icechunk_match_xarrays(tmp_path: Path, case: str) -> None:
    ours, theirs = _repo(tmp_path / "ours"), _repo(tmp_path / "theirs")
    for make, kw in STEPS[case]:
        _write(ours, _ours, make(), **kw)
        _write(theirs, _theirs, make(), **kw)
    expected = _read(theirs, "zarr")
    xr.testing.assert_identical(_read(ours, "zarr"), expected)
    xr.testing.assert_identical(_read(ours, "gds-zarr"), expected)
    assert len(list(ours.ancestry(branch="main"))) == len(STEPS[case]) + 1  # one commit each


def test_uncommitted_write_leaves_the_branch_as_it_was(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "r")
    _write(repo, _ours, _dataset(0, 4), mode="w", encoding=_ENCODING)
    before = _read(repo, "zarr")
    session = repo.writable_session("main")
    xarray_gds.to_zarr(_dataset(4, 2), session.store, append_dim="time")
    del session  # never committed
    xr.testing.assert_identical(_read(repo, "zarr"), before)


def test_icechunk_reads_through_the_engine(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "r")
    _write(repo, _theirs, _dataset(0, 6), mode="w", encoding=_ENCODING)
    store = repo.readonly_session("main").store
    gds = xr.open_dataset(store, engine="gds-zarr", device="cpu", consolidated=False)
    ref = xr.open_dataset(store, engine="zarr", consolidated=False)
    for key in [{"time": slice(1, 5)}, {"x": [0, 3, 7]}, {"time": 2, "y": slice(None, None, 2)}]:
        xr.testing.assert_identical(gds.isel(key).load(), ref.isel(key).load())
    assert isinstance(gds.t2m.values, np.ndarray)


def test_failed_write_leaves_the_last_commit_and_says_so(tmp_path: Path) -> None:
    """A write that fails half way (its second dask block raises, after the metadata
    and the first block are in the session): the error says nothing was committed and
    what to do with the session; the branch reads as at its last commit, and the
    session's partial write is discarded as the note says."""
    import dask.array as da

    repo = _repo(tmp_path / "r")
    _write(repo, _ours, _dataset(0, 4), mode="w", encoding=_ENCODING)
    last = repo.lookup_branch("main")
    before = _read(repo, "zarr")

    def explode(block: np.ndarray, block_info: Any = None) -> np.ndarray:
        if block_info[0]["chunk-location"][0] == 1:
            raise RuntimeError("disk on fire")
        return block

    more = _dataset(4, 4)
    data = da.from_array(more.t2m.values, chunks=(2, 6, 8)).map_blocks(explode, dtype="f4")
    more["t2m"] = more.t2m.copy(data=data)
    session = repo.writable_session("main")
    with pytest.raises(RuntimeError, match="disk on fire") as info:
        xarray_gds.to_zarr(more, session.store, append_dim="time", safe_chunks=False)
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "nothing was committed" in note and last in note
    assert "session.discard_changes()" in note
    assert session.has_uncommitted_changes  # part of the write is in the session
    assert repo.lookup_branch("main") == last
    xr.testing.assert_identical(_read(repo, "zarr"), before)
    session.discard_changes()
    assert not session.has_uncommitted_changes

"""Concurrent writers of one store: both writes land, one after the other.

``xarray_gds.to_zarr`` holds the store's writer lock (:mod:`xarray_gds.stores.lock`) from
reading the metadata to writing it; two processes appending to one local store, or
writing regions that share a chunk, each find the other's rows. Without the lock, one
of two concurrent appends was lost in most trials, without an error.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
from xarray_gds.deferred import HeldMetadataStore
from xarray_gds.stores.local import GdsStore
from xarray_gds.stores.lock import lock_path

TRIALS = 6
APPENDS = 3
ROWS = 2  #: rows of each append


def _rows(writer: int, k: int) -> xr.Dataset:
    """The ``k``-th append of ``writer``: ids 1000 * (writer + 1) + 10 * k + i in ``t``."""
    t = 1000 * (writer + 1) + 10 * k + np.arange(ROWS)
    return xr.Dataset(
        {"v": (("t", "x"), np.stack([t * 1.5 + x for x in range(3)], axis=1))},
        coords={"t": t},
    )


def _base() -> xr.Dataset:
    t = np.arange(4)
    return xr.Dataset(
        {"v": (("t", "x"), np.stack([t * 1.5 + x for x in range(3)], axis=1))},
        coords={"t": t},
    )


def _writer(writer: int, paths: list[str], barrier: Any) -> None:
    """In a process of its own: for each store, wait for the other writer, then append
    ``APPENDS`` times and write this writer's half of region rows 0-3 (one chunk)."""
    for path in paths:
        barrier.wait()
        for k in range(APPENDS):
            xarray_gds.to_zarr(_rows(writer, k), path, append_dim="t")
        half = slice(2 * writer, 2 * writer + 2)
        region = xr.Dataset({"v": (("t", "x"), np.full((2, 3), -1.0 - writer))})
        xarray_gds.to_zarr(region, path, region={"t": half, "x": slice(None)})


def _expected(writers: int) -> xr.Dataset:
    parts = [_base()] + [_rows(w, k) for w in range(writers) for k in range(APPENDS)]
    want = xr.concat(parts, dim="t")
    for w in range(writers):
        want.v[2 * w : 2 * w + 2] = -1.0 - w
    return want


def test_two_processes_appending_both_land(tmp_path: Path) -> None:
    """6 trials of two processes appending 3 times each to one store at once, then
    writing regions that share its first chunk: every row of both lands."""
    paths = []
    for trial in range(TRIALS):
        made = tmp_path / f"trial-{trial}.zarr"
        xarray_gds.to_zarr(_base(), made, encoding={"v": {"chunks": (4, 3)}})
        paths.append(str(made))
    spawn = multiprocessing.get_context("spawn")
    barrier = spawn.Barrier(2)
    procs = [spawn.Process(target=_writer, args=(w, paths, barrier)) for w in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0]
    want = _expected(2)
    for path in paths:
        got = xr.open_dataset(path, engine="zarr").load()
        assert got.sizes["t"] == 4 + 2 * APPENDS * ROWS
        xr.testing.assert_identical(got.sortby("t"), want.sortby("t"))
        assert not (Path(path) / lock_path(path).name).exists()  # beside, not inside
        assert lock_path(path).parent == tmp_path


def test_threads_appending_to_one_memory_store_both_land() -> None:
    store = zarr.storage.MemoryStore()
    xarray_gds.to_zarr(_base(), store, encoding={"v": {"chunks": (4, 3)}})
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        try:
            barrier.wait()
            for k in range(APPENDS):
                xarray_gds.to_zarr(_rows(writer, k), store, append_dim="t")
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    parts = [_base()] + [_rows(w, k) for w in range(2) for k in range(APPENDS)]
    want = xr.concat(parts, dim="t").sortby("t")
    got = xr.open_dataset(store, engine="zarr").load()  # type: ignore[arg-type]
    xr.testing.assert_identical(got.sortby("t"), want)


def test_a_writer_waits_at_most_lock_timeout(tmp_path: Path) -> None:
    """A second writer fails after ``lock_timeout`` seconds, naming the lock file and
    the process that holds it; the store is as the first writer leaves it."""
    path = tmp_path / "s.zarr"
    xarray_gds.to_zarr(_base(), path)
    first = HeldMetadataStore(GdsStore(path, read_only=False))  # a write in progress
    lock = lock_path(path)
    with pytest.raises(TimeoutError) as info:
        xarray_gds.to_zarr(_rows(0, 0), path, append_dim="t", lock_timeout=0.05)
    assert str(lock) in str(info.value)
    assert f"pid {os.getpid()} on " in str(info.value)
    first.flush()  # gives the lock back
    xarray_gds.to_zarr(_rows(0, 0), path, append_dim="t", lock_timeout=0.05)
    got = xr.open_dataset(path, engine="zarr").load()
    xr.testing.assert_identical(got, xr.concat([_base(), _rows(0, 0)], dim="t"))


def test_memory_store_writer_waits_at_most_lock_timeout() -> None:
    store = zarr.storage.MemoryStore()
    xarray_gds.to_zarr(_base(), store)
    first = HeldMetadataStore(store)
    with pytest.raises(TimeoutError, match="thread 'MainThread'"):
        xarray_gds.to_zarr(_rows(0, 0), store, append_dim="t", lock_timeout=0.05)
    first.discard()
    xarray_gds.to_zarr(_rows(0, 0), store, append_dim="t", lock_timeout=0.05)
    got = xr.open_dataset(store, engine="zarr").load()  # type: ignore[arg-type]
    xr.testing.assert_identical(got, xr.concat([_base(), _rows(0, 0)], dim="t"))


@pytest.mark.parametrize("linked", ["store", "parent"])
def test_writers_through_a_symbolic_link_exclude_each_other(tmp_path: Path, linked: str) -> None:
    """Two writers reaching one store by different paths (a symbolic link to the store,
    or to the folder above it) take one lock: while a write through one path is in
    progress, a write or a tidy through the other waits and fails after
    ``lock_timeout``, naming the lock file beside the real store; once the first
    write ends, the other lands after it. (flock excludes two open files of one
    process as it excludes two processes: no second process or timing is needed.)"""
    from xarray_gds.tidy import tidy

    real = tmp_path / "real" / "s.zarr"
    real.parent.mkdir()
    xarray_gds.to_zarr(_base(), real, encoding={"v": {"chunks": (4, 3)}})
    if linked == "store":
        link = tmp_path / "link.zarr"
        link.symlink_to(real, target_is_directory=True)
    else:
        (tmp_path / "other").symlink_to(real.parent, target_is_directory=True)
        link = tmp_path / "other" / "s.zarr"
    lock = real.parent / ".s.zarr.xarray-gds.lock"
    assert lock_path(link) == lock_path(real) == lock
    for holder, other in ((real, link), (link, real)):
        first = HeldMetadataStore(GdsStore(holder, read_only=False))  # a write in progress
        with pytest.raises(TimeoutError) as info:
            xarray_gds.to_zarr(_rows(0, 0), other, append_dim="t", lock_timeout=0.05)
        assert str(lock) in str(info.value)
        with pytest.raises(TimeoutError) as info:
            tidy(other, lock_timeout=0.05)
        assert str(lock) in str(info.value)
        first.discard()  # gives the lock back
    assert sorted(p.name for p in tmp_path.rglob("*.lock")) == [lock.name]
    for k, path in enumerate((link, real)):
        xarray_gds.to_zarr(_rows(0, k), path, append_dim="t", lock_timeout=0.05)
    got = xr.open_dataset(real, engine="zarr").load()
    xr.testing.assert_identical(got, xr.concat([_base(), _rows(0, 0), _rows(0, 1)], dim="t"))

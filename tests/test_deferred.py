"""Failed writes and local reads that race a change of the files: a chunk write still
in flight when its write failed is removed as it lands (zarr-python lets the other
writes of a failed gather run on), on any zarr Store (:mod:`xarray_gds.deferred`) and on
local stores (:class:`~xarray_gds.store.GdsStore`); a local range that comes back short
(its file truncated between the size read and the read) is an error naming the chunk,
never data."""

from __future__ import annotations

import asyncio
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.storage
from zarr.core.buffer import cpu
from zarr.core.sync import sync

import xarray_gds.io.local
import xarray_gds.store
from xarray_gds.deferred import HeldMetadataStore
from xarray_gds.io.local import read_ranges_host
from xarray_gds.store import GdsStore

ARRAY_META = b'{"zarr_format": 3, "node_type": "array"}'


def _buffer(data: bytes) -> Any:
    return cpu.Buffer.from_bytes(data)


class _Gated(zarr.storage.MemoryStore):
    """A memory store whose write of ``gated`` waits, off the event loop, until
    ``release`` is set (``entered`` tells it has begun)."""

    def __init__(self, gated: str) -> None:
        super().__init__()
        self.gated = gated
        self.entered = threading.Event()
        self.release = threading.Event()

    async def set(self, key: str, value: Any) -> None:
        if key == self.gated:
            self.entered.set()
            await asyncio.to_thread(self.release.wait)
        await super().set(key, value)


def _write_in_thread(store: Any, key: str) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            sync(store.set(key, _buffer(b"late")))
        except BaseException as err:  # pragma: no cover - reported by the join below
            errors.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.errors = errors  # type: ignore[attr-defined]
    return thread


def test_held_metadata_store_removes_chunks_that_land_after_the_failure() -> None:
    inner = _Gated("p/c/1")
    sync(inner.set("q/c/0", _buffer(b"old")))  # an array of before: untouched
    store = HeldMetadataStore(inner)
    sync(store.set("p/zarr.json", _buffer(ARRAY_META)))  # a new array: held
    sync(store.set("p/c/0", _buffer(b"early")))
    assert sync(inner.exists("p/c/0")) and not sync(inner.exists("p/zarr.json"))
    late = _write_in_thread(store, "p/c/1")
    try:
        assert inner.entered.wait()  # the write of p/c/1 is under way...
        store.discard()  # ...when the write fails: p/c/0 goes at once
        early_gone = not sync(inner.exists("p/c/0"))
    finally:  # p/c/1 lands after the clean-up: it is removed as it lands
        inner.release.set()
        late.join()
    assert early_gone
    assert late.errors == []  # type: ignore[attr-defined]
    sync(store.set("p/c/2", _buffer(b"later")))  # a write that starts after the failure
    assert sorted(inner._store_dict) == ["q/c/0"]


def test_local_store_failure_waits_for_running_chunk_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write's clean-up waits for its chunk writes still running, removes what
    they made, and refuses chunk writes that start later: nothing of the failed write
    lands after :meth:`GdsStore.discard_metadata` returns."""
    root = tmp_path / "s.zarr"
    store = GdsStore(root, read_only=False)
    store.set_sync("q/c/0", _buffer(b"old"))
    entered, release = threading.Event(), threading.Event()
    # set when the clean-up waits for running writes, or when it returned (without)
    cleaning = threading.Event()
    real_put = GdsStore._put

    def gated_put(self: GdsStore, key: str, value: Any) -> None:
        if key == "p/c/1":
            entered.set()
            release.wait()
        real_put(self, key, value)

    class Watched(threading.Condition):
        def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
            cleaning.set()
            return super().wait_for(predicate, timeout)

    monkeypatch.setattr(GdsStore, "_put", gated_put)
    monkeypatch.setattr(xarray_gds.store, "_deferral_lock", Watched(threading.Lock()))
    store.defer_metadata()
    sync(store.set("p/zarr.json", _buffer(ARRAY_META)))
    sync(store.set("p/c/0", _buffer(b"early")))
    late = _write_in_thread(store, "p/c/1")

    def discard() -> None:
        try:
            store.discard_metadata()
        finally:
            cleaning.set()

    failing = threading.Thread(target=discard, daemon=True)
    try:
        assert entered.wait()  # the write of p/c/1 is under way when the write fails
        failing.start()
        assert cleaning.wait()
    finally:  # p/c/1 lands now: while the clean-up waits for it, or after it
        release.set()
        late.join()
        if failing.ident is not None:  # started
            failing.join()
    assert late.errors == []  # type: ignore[attr-defined]
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == ["q/c/0"]
    with pytest.raises(RuntimeError, match=r"not writing 'p/c/2' .* failed"):
        sync(store.set("p/c/2", _buffer(b"later")))
    assert not (root / "p").exists()


# -- local ranges that come back short ---------------------------------------------------


def test_short_local_range_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    got = read_ranges_host([str(path)] * 2, np.array([10, 0]), np.array([20, -1]))
    assert got[0] is not None and bytes(got[0]) == bytes(range(10, 30)) and got[1] is None
    with pytest.raises(OSError, match=rf"^short read from {path}: got 10 of 20 bytes$"):
        read_ranges_host([str(path)], np.array([90]), np.array([20]))


def test_shard_truncated_between_its_index_and_its_read_names_the_chunk(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store_factory: Any
) -> None:
    """The inner chunks of a shard are read as ranges its index gives: when the file
    was cut short after the index was read, the read fails, naming the shard's key."""
    path = tmp_path / "sharded.zarr"
    shutil.copytree(store_factory(3, "sharded"), path)
    shard = "t2m/c/1/1/1"
    real = xarray_gds.io.local.read_ranges_host
    cut: list[str] = []

    def truncating(paths: list[Any], starts: np.ndarray, sizes: np.ndarray) -> Any:
        for p in {str(p) for p in paths}:
            if p.endswith(shard) and not cut:
                cut.append(p)
                with open(p, "r+b") as f:  # the file changes after its index was read
                    f.truncate(int(max(s + n for s, n in zip(starts, sizes, strict=True))) - 1)
        return real(paths, starts, sizes)

    monkeypatch.setattr(xarray_gds.io.local, "read_ranges_host", truncating)
    ds = xr.open_dataset(path, engine="gds-zarr", device="cpu")
    with pytest.raises(OSError, match=rf"short read from \S*/{shard}: got \d+ of \d+ bytes"):
        ds.t2m.load()
    assert len(cut) == 1
    # the other variables read as zarr reads them
    ref = xr.open_dataset(path, engine="zarr")
    xr.testing.assert_identical(ds.u10.load(), ref.u10.load())

"""Failed writes and local reads that race a change of the files: the clean-up of a
failed write (:mod:`xarray_gds.deferred`) waits for its chunk writes still in flight
(zarr-python lets the other writes of a failed gather run on), removes what they made
and refuses later ones, over memory and local stores
(:class:`~xarray_gds.stores.local.GdsStore`); a local range that comes back short
(its file truncated between the size read and the read) is an error naming the chunk,
never data."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
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

import xarray_gds.stores.files
from xarray_gds.deferred import HeldMetadataStore
from xarray_gds.stores.files import read_ranges_host
from xarray_gds.stores.local import GdsStore

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


def _gated_store(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, threading.Event, threading.Event]:
    """A store whose write of ``p/c/1`` waits for the second event (the first tells
    it has begun): a memory store, or a local one (its file write held)."""
    if kind == "memory":
        inner = _Gated("p/c/1")
        return inner, inner.entered, inner.release
    entered, release = threading.Event(), threading.Event()
    real_put = GdsStore._put

    def gated_put(self: GdsStore, key: str, value: Any) -> None:
        if key == "p/c/1":
            entered.set()
            release.wait()
        real_put(self, key, value)

    monkeypatch.setattr(GdsStore, "_put", gated_put)
    return GdsStore(tmp_path / "s.zarr", read_only=False), entered, release


def _keys(store: Any) -> list[str]:
    async def listed() -> list[str]:
        return sorted([k async for k in store.list()])

    return sync(listed())


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_failure_waits_for_running_chunk_writes(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write's clean-up waits for its chunk writes still running, removes every
    chunk it created (of a new array; of an existing one, past what was there) and
    refuses chunk writes that start later: nothing of the failed write lands after
    :meth:`HeldMetadataStore.discard` returns. Chunks it replaced keep their bytes."""
    inner, entered, release = _gated_store(kind, tmp_path, monkeypatch)
    sync(inner.set("q/zarr.json", _buffer(ARRAY_META)))  # an array of before
    sync(inner.set("q/c/0", _buffer(b"old")))
    store = HeldMetadataStore(inner)
    # set when the clean-up waits for running writes, or when it returned (without)
    cleaning = threading.Event()

    class Watched(threading.Condition):
        def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
            cleaning.set()
            return super().wait_for(predicate, timeout)

    store._write.cond = Watched(threading.Lock())
    sync(store.set("p/zarr.json", _buffer(ARRAY_META)))  # a new array: held
    sync(store.set("p/c/0", _buffer(b"early")))
    sync(store.set("q/c/0", _buffer(b"new")))  # replaced
    sync(store.set("q/c/1", _buffer(b"more")))  # created in an existing array
    assert _keys(inner) == ["p/c/0", "q/c/0", "q/c/1", "q/zarr.json"]
    late = _write_in_thread(store, "p/c/1")

    def discard() -> None:
        try:
            store.discard()
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
    assert _keys(inner) == ["q/c/0", "q/zarr.json"]
    got = sync(inner.get("q/c/0", cpu.buffer_prototype))
    assert got is not None and got.to_bytes() == b"new"
    with pytest.raises(RuntimeError, match=r"not writing 'p/c/2' .* failed"):
        sync(store.set("p/c/2", _buffer(b"later")))
    assert _keys(inner) == ["q/c/0", "q/zarr.json"]
    if kind == "local":
        assert not (tmp_path / "s.zarr" / "p").exists()  # directories left empty go
        assert sorted(p.name for p in (tmp_path / "s.zarr" / "q" / "c").iterdir()) == ["0"]


@pytest.mark.needs("fsspec")
def test_failure_on_a_remote_store_removes_the_new_arrays_chunks() -> None:
    """Stores where asking whether a key exists costs a request (fsspec's, here over
    its memory file system) record no existence: a failed write removes the chunks
    of arrays that did not exist before, and keeps those it added to existing ones."""
    from zarr.storage import FsspecStore

    inner = FsspecStore.from_url(f"memory://held-{id(object())}", read_only=False)
    sync(inner.set("q/zarr.json", _buffer(ARRAY_META)))
    sync(inner.set("q/c/0", _buffer(b"old")))
    store = HeldMetadataStore(inner)
    sync(store.set("p/zarr.json", _buffer(ARRAY_META)))
    sync(store.set("p/c/0", _buffer(b"early")))
    sync(store.set("q/c/1", _buffer(b"more")))
    store.discard()
    assert _keys(inner) == ["q/c/0", "q/c/1", "q/zarr.json"]
    with pytest.raises(RuntimeError, match=r"not writing 'p/c/1' .* failed"):
        sync(store.set("p/c/1", _buffer(b"later")))


def test_pickled_store_is_the_store_and_a_failure_removes_new_arrays_chunks(
    tmp_path: Path,
) -> None:
    """A held store pickled (for a worker process of a dask write) unpickles to the store
    written: chunks written through that copy land in the store, unrecorded by the
    write. A failed write then removes, by listing them, the chunks of arrays that did
    not exist before, keeps those of existing arrays, and never writes the held
    metadata; copies in this process share the write."""
    import copy
    import pickle

    root = tmp_path / "s.zarr"
    inner = GdsStore(root, read_only=False)
    sync(inner.set("q/zarr.json", _buffer(ARRAY_META)))
    sync(inner.set("q/c/0", _buffer(b"old")))
    store = HeldMetadataStore(inner)
    sync(store.set("p/zarr.json", _buffer(ARRAY_META)))
    shared = copy.copy(store)
    assert type(shared) is HeldMetadataStore and sync(shared.exists("p/zarr.json"))
    assert copy.deepcopy(store) == store
    worker = pickle.loads(pickle.dumps(store))
    assert type(worker) is GdsStore and worker == inner
    assert not sync(worker.exists("p/zarr.json"))  # the metadata stays held here
    sync(worker.set("p/c/0", _buffer(b"from a worker")))
    sync(worker.set("p/c/1", _buffer(b"from a worker")))
    sync(worker.set("q/c/1", _buffer(b"from a worker")))
    assert (root / "p" / "c" / "1").read_bytes() == b"from a worker"
    store.discard()
    assert _keys(inner) == ["q/c/0", "q/c/1", "q/zarr.json"]


def test_a_failed_root_array_write_from_workers_keeps_the_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root array's chunks written through the pickled store (a zarr ``LocalStore``,
    whose listing shows the writer lock file): the failed write lists the whole store
    and removes those chunks, but never the lock file, which stays there, held, until
    the write gives it back."""
    import pickle

    from xarray_gds.stores import lock

    root = tmp_path / "r.zarr"
    store = HeldMetadataStore(zarr.storage.LocalStore(root, read_only=False))
    held = lock.lock_path(root)
    assert held.exists()
    there_at_release: list[bool] = []
    release = lock.FileLock.release

    def spy(self: Any) -> None:
        there_at_release.append(self.path.exists())
        release(self)

    monkeypatch.setattr(lock.FileLock, "release", spy)
    sync(store.set("zarr.json", _buffer(ARRAY_META)))
    worker = pickle.loads(pickle.dumps(store))
    sync(worker.set("c/0", _buffer(b"from a worker")))
    sync(worker.set("c/1", _buffer(b"from a worker")))
    assert sorted(p.name for p in (root / "c").iterdir()) == ["0", "1"]
    store.discard()
    assert there_at_release == [True]
    assert not held.exists()  # given back
    assert [p for p in root.rglob("*") if p.is_file()] == []


def test_held_metadata_is_served_then_flushed(tmp_path: Path) -> None:
    """Held metadata keys are read, listed and deleted like files, and reach the disk
    only on flush (chunks go to disk at once); copies by ``with_read_only`` share them."""
    store = HeldMetadataStore(GdsStore(tmp_path / "s.zarr", read_only=False))
    meta = _buffer(b'{"zarr_format": 3, "node_type": "group"}')
    sync(store.set("zarr.json", meta))
    sync(store.set("a/zarr.json", meta))
    sync(store.set("a/c/0", _buffer(b"abc")))
    sync(store.set("b/zarr.json", meta))
    assert not (tmp_path / "s.zarr" / "zarr.json").exists()
    assert (tmp_path / "s.zarr" / "a" / "c" / "0").exists()
    assert sync(store.exists("a/zarr.json"))
    got = sync(store.get("a/zarr.json", prototype=cpu.buffer_prototype))
    assert got is not None and got.to_bytes() == meta.to_bytes()
    got = store.get_sync("a/zarr.json")
    assert got is not None and got.to_bytes() == meta.to_bytes()
    assert sync(store.getsize("a/zarr.json")) == len(meta)

    async def listed(it: Any) -> list[str]:
        return sorted([k async for k in it])

    assert sync(listed(store.list_dir(""))) == ["a", "b", "zarr.json"]
    assert sync(listed(store.list_prefix("a/"))) == ["a/c/0", "a/zarr.json"]
    assert not sync(store.is_empty("b"))
    ro = store.with_read_only(True)
    assert sync(ro.exists("b/zarr.json"))
    sync(store.delete_dir("b"))
    assert not sync(store.exists("b/zarr.json"))
    store.flush()
    assert (tmp_path / "s.zarr" / "zarr.json").read_bytes() == meta.to_bytes()
    assert (tmp_path / "s.zarr" / "a" / "zarr.json").exists()
    assert not (tmp_path / "s.zarr" / "b").exists()
    sync(store.set("c/zarr.json", meta))  # no longer held
    assert (tmp_path / "s.zarr" / "c" / "zarr.json").exists()


def test_held_metadata_ranges_prefixes_and_read_only(tmp_path: Path) -> None:
    from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    store = HeldMetadataStore(GdsStore(tmp_path / "s.zarr", read_only=False))
    sync(store.set("b/zarr.json", _buffer(b"0123456789")))
    sync(store.set("bc/zarr.json", _buffer(b"{}")))

    def read(request: ByteRequest | None) -> bytes:
        got = sync(store.get("b/zarr.json", cpu.buffer_prototype, request))
        assert got is not None
        return got.to_bytes()

    assert read(RangeByteRequest(2, 5)) == b"234"
    assert read(OffsetByteRequest(3)) == b"3456789"
    assert read(SuffixByteRequest(4)) == b"6789"

    async def listed(prefix: str) -> list[str]:
        return sorted([k async for k in store.list_prefix(prefix)])

    assert sync(listed("b")) == ["b/zarr.json"]  # a directory, not a string prefix
    sync(store.delete_dir("b"))
    assert sync(store.exists("bc/zarr.json"))
    with pytest.raises(ValueError, match="read-only"):
        sync(store.with_read_only(True).set("d/zarr.json", _buffer(b"{}")))
    store.flush()
    assert (tmp_path / "s.zarr" / "bc" / "zarr.json").exists()
    store = HeldMetadataStore(GdsStore(tmp_path / "s.zarr", read_only=False))
    sync(store.set("e/zarr.json", _buffer(b"{}")))
    store.discard()  # a failed write
    assert not (tmp_path / "s.zarr" / "e").exists()


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
    real = xarray_gds.stores.files.read_ranges_host
    cut: list[str] = []

    def truncating(paths: list[Any], starts: np.ndarray, sizes: np.ndarray) -> Any:
        for p in {str(p) for p in paths}:
            if p.endswith(shard) and not cut:
                cut.append(p)
                with open(p, "r+b") as f:  # the file changes after its index was read
                    f.truncate(int(max(s + n for s, n in zip(starts, sizes, strict=True))) - 1)
        return real(paths, starts, sizes)

    monkeypatch.setattr(xarray_gds.stores.files, "read_ranges_host", truncating)
    ds = xr.open_dataset(path, engine="gds-zarr", device="cpu")
    with pytest.raises(OSError, match=rf"short read from \S*/{shard}: got \d+ of \d+ bytes"):
        ds.t2m.load()
    assert len(cut) == 1
    # the other variables read as zarr reads them
    ref = xr.open_dataset(path, engine="zarr")
    xr.testing.assert_identical(ds.u10.load(), ref.u10.load())


@pytest.mark.needs("dask")
def test_a_failed_threaded_dask_write_keeps_what_was_below_a_new_array(
    tmp_path: Path,
) -> None:
    """dask pickles a write's target to name its tasks. A write computed in this process
    (dask's threads) is no copy for another process: when it fails, what was already
    below a new array's path stays, and the chunks it wrote go."""
    import dask
    import dask.array as da
    import xarray as xr

    import xarray_gds

    root = tmp_path / "s.zarr"
    xr.Dataset({"a": (("x",), np.arange(8.0))}).to_zarr(root, zarr_format=3)
    (root / "p").mkdir()
    (root / "p" / "notes.txt").write_bytes(b"the user's")

    def boom() -> np.ndarray:
        raise RuntimeError("boom")

    bad = da.from_delayed(dask.delayed(boom)(), shape=(4,), dtype="f8")
    good = da.arange(8.0, chunks=4)
    ds = xr.Dataset({"p": (("x",), good), "q": (("x",), da.concatenate([good[:4], bad]))})
    with pytest.raises(RuntimeError, match="boom"), dask.config.set(scheduler="threads"):
        xarray_gds.to_zarr(ds, root, mode="a")
    assert (root / "p" / "notes.txt").read_bytes() == b"the user's"
    assert sorted(p.name for p in (root / "p").iterdir()) == ["notes.txt"]
    xr.testing.assert_identical(
        xr.open_dataset(root, engine="zarr").load(), xr.Dataset({"a": (("x",), np.arange(8.0))})
    )


class _Logged(zarr.storage.MemoryStore):
    """A memory store that logs the start and end of each metadata write, and whose
    writes of ``together`` each wait (bounded) until all of them have begun: a flush
    that wrote them one after the other would time out there."""

    def __init__(self, together: tuple[str, ...] = (), fail: str | None = None) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self.together = together
        self.fail = fail
        self.begun: set[str] = set()
        self.all_begun: asyncio.Event | None = None
        self.failed: asyncio.Event | None = None
        self.since_failure: asyncio.Event | None = None

    async def set(self, key: str, value: Any) -> None:
        if not key.endswith(("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")):
            return await super().set(key, value)
        self.log.append(("start", key))
        if self.all_begun is None:
            self.all_begun, self.failed = asyncio.Event(), asyncio.Event()
            self.since_failure = asyncio.Event()
        assert self.failed is not None and self.since_failure is not None
        if key in self.together:
            self.begun.add(key)
            if self.begun >= set(self.together):
                self.all_begun.set()
            await asyncio.wait_for(self.all_begun.wait(), 10)
        if key == self.fail and not self.failed.is_set():  # once: putting back succeeds
            self.failed.set()
            self.log.append(("failed", key))
            raise OSError(f"injected failure writing {key}")
        late = self.fail is not None and key in self.together and not self.failed.is_set()
        if late:
            # lands only after the other write of its tier failed, and after a write
            # made since ends (a flush that puts back before every write of the tier
            # ended would have its put-back overwritten), or a second later (one that
            # waits, as it must)
            await asyncio.wait_for(self.failed.wait(), 10)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.since_failure.wait(), 1)
        await asyncio.sleep(0)  # the writes of a tier begun together overlap
        await super().set(key, value)
        self.log.append(("end", key))
        if not late and self.failed.is_set():
            self.since_failure.set()


def _held(inner: Any, keys: list[str], value: bytes = ARRAY_META) -> HeldMetadataStore:
    store = HeldMetadataStore(inner)
    for key in keys:
        sync(store.set(key, _buffer(value)))
    return store


def test_a_flush_writes_deeper_documents_first_and_a_tier_together() -> None:
    """Arrays' documents before their groups', the root's before Zarr v2's
    ``.zmetadata``: each tier ends before the next begins, and the documents of one
    tier are written together (each of ``a`` and ``b`` waits for the other to begin)."""
    docs = ["g/a/zarr.json", "g/b/zarr.json", "g/zarr.json", ".zattrs", ".zgroup", ".zmetadata"]
    inner = _Logged(together=("g/a/zarr.json", "g/b/zarr.json"))
    store = _held(inner, docs)
    assert inner.log == []  # held until the flush
    store.flush()
    tiers = [{"g/a/zarr.json", "g/b/zarr.json"}, {"g/zarr.json"}, {".zattrs", ".zgroup"}]
    tiers.append({".zmetadata"})  # Zarr v2's consolidated metadata after the root's documents
    events = [(e, k) for e, k in inner.log]
    at = 0
    for tier in tiers:
        mine = events[at : at + 2 * len(tier)]
        assert {k for _, k in mine} == tier
        assert sorted(e for e, _ in mine) == ["end"] * len(tier) + ["start"] * len(tier)
        at += 2 * len(tier)
    assert at == len(events)
    for key in docs:
        assert inner._store_dict[key].to_bytes() == ARRAY_META


def test_a_failed_write_in_a_tier_puts_back_the_tier_once_every_write_ended() -> None:
    """One document of a tier fails while the other of the same tier is still being
    written (it lands only after the failure): the flush waits for it before putting
    the old documents back, so both end as they were before the write, and the next
    tier is never begun."""
    old = b'{"zarr_format": 3, "node_type": "array", "old": true}'
    inner = _Logged()
    for key in ("a/zarr.json", "b/zarr.json", "zarr.json"):
        sync(inner.set(key, _buffer(old)))
    inner.log.clear()
    inner.together, inner.fail = ("a/zarr.json", "b/zarr.json"), "a/zarr.json"
    store = _held(inner, ["a/zarr.json", "b/zarr.json", "zarr.json"])
    with pytest.raises(OSError, match=r"injected failure writing a/zarr\.json"):
        store.flush()
    assert ("end", "b/zarr.json") in inner.log  # the late write landed, then was put back
    assert ("start", "zarr.json") not in inner.log[: inner.log.index(("end", "b/zarr.json"))]
    for key in ("a/zarr.json", "b/zarr.json", "zarr.json"):
        assert inner._store_dict[key].to_bytes() == old


def test_a_flush_reads_the_old_documents_in_one_round_trip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flush of many documents costs one trip through zarr's event loop to read the
    old ones and one a tier to write (a loop of small appends pays it at every call)."""
    from xarray_gds import deferred

    docs = [f"v{i}/zarr.json" for i in range(6)] + ["zarr.json"]
    store = _held(zarr.storage.MemoryStore(), docs)
    trips: list[str] = []
    real = deferred.sync

    def counted(coro: Any, *args: Any, **kwargs: Any) -> Any:
        trips.append(getattr(coro, "__qualname__", str(coro)))
        return real(coro, *args, **kwargs)

    monkeypatch.setattr(deferred, "sync", counted)
    store.flush()
    assert len(trips) == 3, trips  # the reads, the arrays' tier, the root
    got = sync(zarr.storage.MemoryStore.get(store.store, "v5/zarr.json", cpu.buffer_prototype))
    assert got is not None and got.to_bytes() == ARRAY_META


class _Cancelled(zarr.storage.MemoryStore):
    """A memory store whose write of ``a/zarr.json`` ends cancelled (a BaseException,
    which ``asyncio.gather(..., return_exceptions=True)`` hands back as a result)."""

    async def set(self, key: str, value: Any) -> None:
        if key == "a/zarr.json":
            raise asyncio.CancelledError
        await super().set(key, value)


def test_a_cancelled_metadata_write_fails_the_flush_and_puts_the_tier_back() -> None:
    """A document write that ends cancelled is a failed flush, not a written one: the
    flush raises, the tier's other document is put back as it was (absent), and the
    root's document, a tier later, is never written."""
    inner = _Cancelled()
    store = _held(inner, ["a/zarr.json", "b/zarr.json", "zarr.json"])
    with pytest.raises(BaseException) as err:
        store.flush()
    assert isinstance(err.value, asyncio.CancelledError | concurrent.futures.CancelledError)
    assert sorted(inner._store_dict) == []


def test_a_discarded_write_keeps_the_chunks_of_an_array_it_rewrote() -> None:
    """A failed append holds the existing array's document first, replaces one of its
    chunks and creates another: the discard deletes only the chunk it created, the
    array's other chunk (existing before the write) stays, and so does its document."""
    inner = zarr.storage.MemoryStore()
    sync(inner.set("q/zarr.json", _buffer(ARRAY_META)))
    sync(inner.set("q/c/0", _buffer(b"old")))
    store = _held(inner, ["q/zarr.json"])
    sync(store.set("q/c/0", _buffer(b"new")))  # replaced
    sync(store.set("q/c/1", _buffer(b"more")))  # created
    store.discard()
    assert sorted(inner._store_dict) == ["q/c/0", "q/zarr.json"]
    assert inner._store_dict["q/zarr.json"].to_bytes() == ARRAY_META

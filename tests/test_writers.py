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
import warnings
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
        assert lock_path(path).parent == Path(path).resolve()  # inside the store
        assert not lock_path(path).exists()  # and gone with the last write
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(p).name for p in paths)


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
    ``lock_timeout``, naming the lock file in the real store; once the first
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
    lock = real / ".xarray-gds.lock"
    assert lock_path(link) == lock_path(real) == lock
    for holder, other in ((real, link), (link, real)):
        first = HeldMetadataStore(GdsStore(holder, read_only=False))  # a write in progress
        with pytest.raises(TimeoutError) as info:
            xarray_gds.to_zarr(_rows(0, 0), other, append_dim="t", lock_timeout=0.05)
        assert str(lock) in str(info.value)
        with pytest.raises(TimeoutError) as info:
            tidy(other, dry_run=False, lock_timeout=0.05)
        assert str(lock) in str(info.value)
        first.discard()  # gives the lock back
    assert list(tmp_path.rglob("*.lock")) == []
    for k, path in enumerate((link, real)):
        xarray_gds.to_zarr(_rows(0, k), path, append_dim="t", lock_timeout=0.05)
    got = xr.open_dataset(real, engine="zarr").load()
    xr.testing.assert_identical(got, xr.concat([_base(), _rows(0, 0), _rows(0, 1)], dim="t"))


def _listing(path: Path) -> dict[str, tuple[bool, int]]:
    """What ``path`` holds at its top: name -> (is a directory, size)."""
    return {p.name: (p.is_dir(), 0 if p.is_dir() else p.stat().st_size) for p in path.iterdir()}


def _late_failure(block: np.ndarray, block_info: Any = None) -> np.ndarray:
    if block_info is not None and block_info[0]["chunk-location"][0] == 1:
        raise RuntimeError("late failure")
    return block


@pytest.mark.needs("dask")
@pytest.mark.parametrize("fmt", [2, 3])
def test_writes_leave_nothing_outside_the_store(tmp_path: Path, fmt: int) -> None:
    """The writer lock lives in the store's root and goes with the write: the folder
    above the store holds the same entries after writes of every kind (a new store,
    ``mode="w"`` over one, ``mode="a"``, an append, a region, a failed write) as before
    them, and the store holds no lock file after any of them. With that folder
    read-only (chmod 555), the writes land (the suite often runs as root, where the
    mode is not enforced: the listing checks the property itself)."""
    parent = tmp_path / "ro"
    parent.mkdir()
    path = parent / "s.zarr"
    path.mkdir()  # the store's root may be made by its owner, the writes by others
    enc = {"v": {"chunks": (4, 3)}}
    before = _listing(parent)
    parent.chmod(0o555)
    try:
        xarray_gds.to_zarr(_base(), path, mode="w", zarr_format=fmt, encoding=enc)
        xarray_gds.to_zarr(_base(), path, mode="w", zarr_format=fmt, encoding=enc)
        xarray_gds.to_zarr(xr.Dataset({"w": ("x", np.arange(3.0))}), path, mode="a")
        bad = _base().rename(v="u").chunk({"t": 2})
        bad["u"] = bad["u"].copy(data=bad["u"].data.map_blocks(_late_failure, dtype="f8"))
        with pytest.raises(RuntimeError, match="late failure"):
            xarray_gds.to_zarr(bad, path, mode="a")
        xarray_gds.to_zarr(_rows(0, 0), path, append_dim="t")
        region = xr.Dataset({"v": (("t", "x"), np.full((2, 3), -1.0))})
        xarray_gds.to_zarr(region, path, region={"t": slice(0, 2), "x": slice(None)})
        assert _listing(parent) == before
        assert not lock_path(path).exists()
    finally:
        parent.chmod(0o755)
    want = xr.concat([_base(), _rows(0, 0)], dim="t").assign(w=("x", np.arange(3.0)))
    want["v"][:2] = -1.0
    xr.testing.assert_identical(xr.open_dataset(path, engine="zarr").load(), want)


@pytest.mark.needs("dask")
@pytest.mark.parametrize("kind", ["gds", "zarr-local"])
def test_the_lock_file_outlives_clearing_the_store(tmp_path: Path, kind: str) -> None:
    """A ``mode="w"`` write deletes the store's contents but not its lock file: a
    second writer still waits for it while the first one's chunks are written after
    the clearing (through the engine's store and through zarr's ``LocalStore``), and
    the write's listings, consolidating, leave it out; the file goes when the write
    ends."""
    from xarray_gds.stores import source_for

    path = tmp_path / "s.zarr"
    xarray_gds.to_zarr(_base(), path)
    seen: list[bool] = []

    def check(block: np.ndarray) -> np.ndarray:
        seen.append(lock_path(path).exists() and not (path / "v" / "zarr.json").exists())
        with pytest.raises(TimeoutError, match="another writer"):
            source_for(GdsStore(path, read_only=False)).writer_lock(0.0)
        return block

    ds = _rows(0, 0).chunk({"t": 1})
    ds["v"] = ds["v"].copy(data=ds["v"].data.map_blocks(check, meta=np.array((), "f8")))
    store = GdsStore(path, read_only=False) if kind == "gds" else zarr.storage.LocalStore(path)
    with warnings.catch_warnings():  # the write's listings (consolidating) leave it out
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "Consolidated metadata is currently not part")
        xarray_gds.to_zarr(ds, store, mode="w", zarr_format=3, consolidated=True)
    assert seen and all(seen)
    assert not lock_path(path).exists()
    xr.testing.assert_identical(xr.open_dataset(path, engine="zarr").load(), _rows(0, 0))


def test_a_left_lock_file_is_never_zarr_content(tmp_path: Path) -> None:
    """A killed writer's lock file stays in the store's root: the engine and
    ``engine="zarr"`` open the store as before, the engine's listings and a write's
    listings and consolidation leave it out (no warning about an unknown object), and
    the next write or ``tidy`` takes the lock and removes it. Only zarr's own listing
    of a group's members (``engine="zarr"`` without consolidated metadata) sees it, and
    warns that it is not a node."""
    from xarray_gds.tidy import find_leftovers, tidy

    path = tmp_path / "s.zarr"
    xarray_gds.to_zarr(_base(), path, zarr_format=3)
    lock_path(path).write_text("pid 1 on elsewhere\n")  # its holder was killed
    with pytest.warns(UserWarning, match="Object at .xarray-gds.lock is not recognized"):
        got = xr.open_dataset(path, engine="zarr", consolidated=False)
    xr.testing.assert_identical(got.load(), _base())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "Consolidated metadata is currently not part")
        xr.testing.assert_identical(xr.open_dataset(path, engine="zarr").load(), _base())
        for consolidated in (True, False):
            got = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=consolidated)
            xr.testing.assert_identical(got.load(), _base())
        store = GdsStore(path, read_only=True)
        assert ".xarray-gds.lock" not in zarr.core.sync.sync(_keys(store))
        assert sorted(name for name, _ in zarr.open_group(store, mode="r").members()) == ["t", "v"]
        assert find_leftovers(path) == [] and tidy(path, dry_run=True) == []
        # a write lists and consolidates the store while it holds the lock
        xarray_gds.to_zarr(_base().rename(v="w"), path, mode="a", consolidated=True)
    assert not lock_path(path).exists()
    lock_path(path).write_text("pid 1 on elsewhere\n")
    assert tidy(path, dry_run=False) == [] and not lock_path(path).exists()


async def _keys(store: Any) -> list[str]:
    return [k async for k in store.list()] + [k async for k in store.list_dir("")]


def test_a_waiter_on_a_removed_lock_file_takes_the_new_one(tmp_path: Path) -> None:
    """The holder removes the lock file when it gives the lock back: a writer that was
    waiting on that file, once it has the ``flock``, sees the path name no file (or
    another) and locks the file there, so a third writer, which opens the new file,
    still waits for it. Two writers never hold the lock at once."""
    from xarray_gds.stores.lock import FileLock

    path = tmp_path / "s.zarr"
    first = FileLock(lock_path(path), "s").acquire(0.0)
    assert lock_path(path).exists()
    got: list[FileLock] = []
    waiter = threading.Thread(target=lambda: got.append(FileLock(lock_path(path), "s").acquire(5)))
    waiter.start()
    try:
        import time

        time.sleep(0.05)  # the waiter has opened the first file and waits on it
        first.release()
        waiter.join(10)
        assert got, "the waiter did not get the lock"
        assert lock_path(path).exists()
        with pytest.raises(TimeoutError, match="another writer"):
            FileLock(lock_path(path), "s").acquire(0.05)
    finally:
        for lock in got:
            lock.release()
    assert not lock_path(path).exists()
    FileLock(lock_path(path), "s").acquire(0.0).release()


@pytest.mark.parametrize("side", ["smaller", "larger"])
def test_a_holder_never_removes_a_lock_file_that_is_not_its_own(tmp_path: Path, side: str) -> None:
    """A holder whose lock file was replaced at its path (removed by hand, and another
    writer's made there) gives its lock back without removing the other writer's file,
    whether the other file's inode number is smaller or larger than its own (the check
    compares files by device and inode, for equality only)."""
    from xarray_gds.stores.lock import FileLock

    path = tmp_path / "s.zarr"
    path.mkdir()
    pair = [tmp_path / "a", tmp_path / "b"]
    for f in pair:
        f.write_text(f"{f.name}\n")
    low, high = sorted(pair, key=lambda f: f.stat().st_ino)
    own, other = (high, low) if side == "smaller" else (low, high)
    os.replace(own, lock_path(path))  # the lock file the holder opens and keeps
    lock = FileLock(lock_path(path), "s").acquire(0.0)
    os.replace(other, lock_path(path))  # another writer's file now at the path
    lock.release()
    assert lock_path(path).read_text() == f"{other.name}\n"


def test_a_writer_waits_the_whole_lock_timeout_before_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second writer polls the held lock for ``timeout`` seconds (on the lock's clock,
    here a fake one that each sleep advances), then fails: not at once, and not later
    than the timeout and one poll interval."""
    import types

    from xarray_gds.stores import lock as lock_module
    from xarray_gds.stores.lock import FileLock

    now = [5000.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    clock = types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep)
    path = tmp_path / "s.zarr"
    first = FileLock(lock_path(path), "s").acquire(0.0)
    monkeypatch.setattr(lock_module, "time", clock)
    try:
        for timeout in (0.25, 0.75, 3.0):
            start = now[0]
            with pytest.raises(TimeoutError, match=f"waited {timeout} s"):
                FileLock(lock_path(path), "s").acquire(timeout)
            assert now[0] - start == pytest.approx(timeout)
            assert max(slept) <= 0.05
    finally:
        monkeypatch.undo()
        first.release()


def test_the_lock_of_a_store_in_new_directories_is_taken(tmp_path: Path) -> None:
    """A write to a store whose parent directories do not exist yet makes them and
    takes its lock there (no warning that it writes without one)."""
    from xarray_gds.stores.lock import FileLock

    path = tmp_path / "new" / "deeper" / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lock = FileLock(lock_path(path), "s").acquire(0.0)
    try:
        assert lock_path(path).is_file()
        with pytest.raises(TimeoutError, match="another writer"):
            FileLock(lock_path(path), "s").acquire(0.0)
    finally:
        lock.release()
    assert not lock_path(path).exists()


def test_a_timed_out_writer_quotes_the_holder_line(tmp_path: Path) -> None:
    """The error of a writer that timed out quotes the holder's line as the lock file
    has it, without its newline; a lock file whose text is not UTF-8 (damaged, or
    written by another program) is quoted with replacement characters, not a
    UnicodeDecodeError."""
    import socket

    from xarray_gds.stores.lock import FileLock

    path = tmp_path / "s.zarr"
    first = FileLock(lock_path(path), "s").acquire(0.0)
    try:
        with pytest.raises(TimeoutError) as info:
            FileLock(lock_path(path), "s").acquire(0.0)
        assert f"(pid {os.getpid()} on {socket.gethostname()})" in str(info.value)
        lock_path(path).write_bytes(b"pid 7 on \xff\xfehost\n")
        with pytest.raises(TimeoutError) as info:
            FileLock(lock_path(path), "s").acquire(0.0)
        assert "(pid 7 on \ufffd\ufffdhost)" in str(info.value)
    finally:
        first.release()


def test_a_writer_replaces_a_stale_holder_line_and_leaks_no_descriptor(tmp_path: Path) -> None:
    """A lock file left by a killed writer, with a longer line than this writer's, holds
    exactly this writer's line once it has the lock; a writer that timed out leaves no
    descriptor of the lock file open."""
    import socket

    from xarray_gds.stores.lock import FileLock

    path = tmp_path / "s.zarr"
    path.mkdir()
    lock_path(path).write_text("pid 99999999 on a-host-with-a-rather-long-name.example.org\n")
    first = FileLock(lock_path(path), "s").acquire(0.0)
    try:
        assert lock_path(path).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
        fds = sorted(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with pytest.raises(TimeoutError):
                FileLock(lock_path(path), "s").acquire(0.0)
        assert sorted(os.listdir("/proc/self/fd")) == fds
    finally:
        first.release()


def test_a_writer_whose_lock_file_was_replaced_takes_the_new_one_and_closes_the_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that opened the lock file just before its holder removed it (and another
    file was made at the path) finds, once it has the ``flock``, that the path names
    another file: it closes the old descriptor, takes the new file and holds it."""
    import fcntl

    from xarray_gds.stores.lock import FileLock

    path = tmp_path / "s.zarr"
    path.mkdir()
    real = fcntl.flock
    replaced: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not replaced:  # the first flock: the file is replaced before it is taken
            replaced.append(fd)
            lock_path(path).unlink()
            lock_path(path).write_text("made by another writer\n")
        real(fd, op)

    fds = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(fcntl, "flock", flock)
    lock = FileLock(lock_path(path), "s").acquire(0.0)
    monkeypatch.undo()
    assert replaced
    try:
        assert lock._fd is not None
        assert os.fstat(lock._fd).st_ino == lock_path(path).stat().st_ino  # the new file
        assert len(os.listdir("/proc/self/fd")) == len(fds) + 1  # the old one is closed
    finally:
        lock.release()
    assert sorted(os.listdir("/proc/self/fd")) == fds

"""GdsStore: zarr's store conformance suite (host and GPU buffers), key safety, device reads."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, cpu
from zarr.testing.store import StoreTests

from xarray_gds import GdsStore
from xarray_gds.stores.local import is_metadata_key


class TestGdsStoreHost(StoreTests[GdsStore, cpu.Buffer]):
    """zarr's own conformance tests, with host buffers."""

    store_cls = GdsStore
    buffer_cls = cpu.Buffer

    async def get(self, store: GdsStore, key: str) -> Buffer:
        return self.buffer_cls.from_bytes((store.root / key).read_bytes())

    async def set(self, store: GdsStore, key: str, value: Buffer) -> None:
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value.to_bytes())

    @pytest.fixture
    def store_kwargs(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path)}

    def test_store_repr(self, store: GdsStore) -> None:
        assert repr(store) == f"GdsStore('file://{store.root.as_posix()}')"

    def test_store_supports_writes(self, store: GdsStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: GdsStore) -> None:
        assert store.supports_listing


@pytest.mark.gpu
class TestGdsStoreDevice(TestGdsStoreHost):
    """The same suite with zarr in GPU mode: data keys come back as device buffers."""

    @pytest.fixture(autouse=True)
    def _gpu_mode(self) -> Iterator[None]:
        from zarr.core.buffer import gpu

        type(self).buffer_cls = gpu.Buffer  # type: ignore[assignment]
        with zarr.config.enable_gpu():
            yield
        type(self).buffer_cls = cpu.Buffer


@pytest.mark.parametrize(
    "key", ["../escape", "a/../../b", "/etc/passwd", "a/./b", "a\\..\\b", "..", "."]
)
async def test_keys_may_not_escape_the_root(tmp_path: Path, key: str) -> None:
    store = await GdsStore.open(tmp_path / "root")
    with pytest.raises(ValueError, match="invalid key"):
        await store.get(key, prototype=cpu.buffer_prototype)
    with pytest.raises(ValueError, match="invalid key"):
        await store.set(key, cpu.Buffer.from_bytes(b"x"))
    with pytest.raises(ValueError, match="invalid key"):
        await store.exists(key)
    with pytest.raises(ValueError, match="invalid key"):
        store.get_sync(key)
    assert not (tmp_path / "escape").exists()


def test_metadata_keys() -> None:
    for key in ("zarr.json", "a/zarr.json", ".zarray", "g/.zattrs", ".zgroup", ".zmetadata"):
        assert is_metadata_key(key)
    for key in ("a/c/0/0", "a/0.0", "zarr.json.tmp", "c/zarr"):
        assert not is_metadata_key(key)


def _payload(tmp_path: Path) -> tuple[GdsStore, bytes]:
    data = np.arange(1000, dtype="u1").tobytes()
    (tmp_path / "arr" / "c").mkdir(parents=True)
    (tmp_path / "arr" / "c" / "0").write_bytes(data)
    (tmp_path / "zarr.json").write_bytes(b'{"zarr_format": 3, "node_type": "group"}')
    return GdsStore(tmp_path, read_only=True), data


BYTE_RANGES = [
    (None, slice(None)),
    (RangeByteRequest(10, 50), slice(10, 50)),
    (RangeByteRequest(990, 2000), slice(990, 1000)),
    (OffsetByteRequest(900), slice(900, None)),
    (SuffixByteRequest(24), slice(-24, None)),
    (SuffixByteRequest(5000), slice(None)),
]


@pytest.mark.parametrize(("byte_range", "expect"), BYTE_RANGES)
def test_byte_ranges_on_host(tmp_path: Path, byte_range: Any, expect: slice) -> None:
    store, data = _payload(tmp_path)
    buf = store.get_sync("arr/c/0", prototype=cpu.buffer_prototype, byte_range=byte_range)
    assert isinstance(buf, cpu.Buffer)
    assert buf.to_bytes() == data[expect]


@pytest.mark.gpu
@pytest.mark.parametrize(("byte_range", "expect"), BYTE_RANGES)
async def test_byte_ranges_into_device_memory(
    tmp_path: Path, byte_range: Any, expect: slice
) -> None:
    import cupy
    from zarr.core.buffer import gpu

    store, data = _payload(tmp_path)
    buf = await store.get("arr/c/0", prototype=gpu.buffer_prototype, byte_range=byte_range)
    assert isinstance(buf, gpu.Buffer)
    assert isinstance(buf.as_array_like(), cupy.ndarray)
    assert buf.to_bytes() == data[expect]
    # metadata stays on the host even when a GPU prototype is asked for
    meta = await store.get("zarr.json", prototype=gpu.buffer_prototype)
    assert isinstance(meta, cpu.Buffer)
    # partial values, several at once
    got = await store.get_partial_values(
        gpu.buffer_prototype, [("arr/c/0", byte_range), ("missing", None), ("arr/c/0", None)]
    )
    assert got[1] is None
    assert got[0] is not None and got[0].to_bytes() == data[expect]
    assert got[2] is not None and got[2].to_bytes() == data


def test_missing_keys_return_none(tmp_path: Path) -> None:
    store, _ = _payload(tmp_path)
    assert store.get_sync("arr/c/1", prototype=cpu.buffer_prototype) is None
    assert store.get_sync("arr", prototype=cpu.buffer_prototype) is None  # a directory


async def test_read_only_open_and_metadata_stay_in_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a read-only store and reading metadata cost no worker-thread hop (most of
    the time of opening a store); chunk reads still go to a worker thread."""
    import asyncio

    _payload(tmp_path)
    zarr.create_group(tmp_path / "g", zarr_format=3)
    hops: list[str] = []
    to_thread = asyncio.to_thread

    async def counting(fn: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(args[0] if args and isinstance(args[0], str) else fn.__name__)
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counting)
    store = await GdsStore.open(tmp_path, read_only=True)
    meta = await store.get("g/zarr.json", cpu.buffer_prototype)
    assert meta is not None and b'"node_type": "group"' in meta.to_bytes()
    assert hops == []
    chunk = await store.get("arr/c/0", cpu.buffer_prototype)
    assert chunk is not None and hops == ["arr/c/0"]
    with pytest.raises(FileNotFoundError, match="missing"):
        await GdsStore.open(tmp_path / "missing", read_only=True)


def test_read_only_store_refuses_writes(tmp_path: Path) -> None:
    store, _ = _payload(tmp_path)
    with pytest.raises(ValueError, match="read-only"):
        store.set_sync("arr/c/1", cpu.Buffer.from_bytes(b"x"))


def test_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails before its rename leaves the old value and no temporary file."""
    store = GdsStore(tmp_path / "s", read_only=False)
    store.set_sync("a/c/0", cpu.Buffer.from_bytes(b"old"))
    real_write = os.write

    def short_then_fail(fd: int, data: Any) -> int:
        monkeypatch.setattr(os, "write", _fail)
        return real_write(fd, bytes(memoryview(data)[:2]))

    monkeypatch.setattr(os, "write", short_then_fail)
    # the first (short) write is continued, the second fails
    with pytest.raises(OSError, match="injected"):
        store.set_sync("a/c/0", cpu.Buffer.from_bytes(b"new value"))
    monkeypatch.undo()
    assert (tmp_path / "s" / "a" / "c" / "0").read_bytes() == b"old"
    assert sorted(p.name for p in (tmp_path / "s" / "a" / "c").iterdir()) == ["0"]
    # parents are made as needed
    store.set_sync("b/c/0/0", cpu.Buffer.from_bytes(b"x" * 100_000))
    assert (tmp_path / "s" / "b" / "c" / "0" / "0").read_bytes() == b"x" * 100_000


def _fail(fd: int, data: Any) -> int:
    raise OSError("disk full (injected)")


async def test_delete_dir_removes_trees_without_following_links(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    store = await GdsStore.open(tmp_path / "s", read_only=False)
    for i in range(40):  # enough files for the parallel removal
        await store.set(f"g/arr/c/{i % 3}/{i}", cpu.Buffer.from_bytes(b"x"))
    await store.set("g/zarr.json", cpu.Buffer.from_bytes(b"{}"))
    await store.set("h/zarr.json", cpu.Buffer.from_bytes(b"{}"))
    (tmp_path / "s" / "g" / "link").symlink_to(outside, target_is_directory=True)
    await store.delete_dir("g")
    assert not (tmp_path / "s" / "g").exists()
    assert (outside / "keep").read_bytes() == b"k"  # the link went, not its target
    assert [k async for k in store.list()] == ["h/zarr.json"]
    await store.delete_dir("nothing/here")  # a missing directory: nothing to do
    with pytest.raises(ValueError, match="is a file"):
        await store.delete_dir("h/zarr.json")
    await store.clear()
    assert (tmp_path / "s").is_dir() and not list((tmp_path / "s").iterdir())


async def test_delete_dir_refuses_links_and_escaping_prefixes(tmp_path: Path) -> None:
    """As zarr's LocalStore (shutil.rmtree): a linked directory is not emptied through
    the link, whether it is a prefix or the store's root."""
    target = tmp_path / "target.zarr"
    target.mkdir()
    (target / "keep").write_bytes(b"k")
    store = await GdsStore.open(tmp_path / "s", read_only=False)
    await store.set("a/zarr.json", cpu.Buffer.from_bytes(b"{}"))
    (tmp_path / "s" / "a" / "lnk").symlink_to(target, target_is_directory=True)
    with pytest.raises(OSError, match="symbolic link"):
        await store.delete_dir("a/lnk")
    linked = await GdsStore.open(tmp_path / "linked.zarr", read_only=False)
    (tmp_path / "linked.zarr").rmdir()
    (tmp_path / "linked.zarr").symlink_to(target, target_is_directory=True)
    with pytest.raises(OSError, match="symbolic link"):
        await linked.delete_dir("")
    with pytest.raises(OSError, match="symbolic link"):
        await linked.clear()
    assert (target / "keep").read_bytes() == b"k"
    (tmp_path / "sibling").mkdir()
    with pytest.raises(ValueError, match="invalid key"):
        await store.delete_dir("../sibling")
    assert (tmp_path / "sibling").is_dir()


def test_pinned_staging_sizes_are_shared() -> None:
    """Staging buffers come in powers of two (1 MiB at least), so that CuPy's pinned
    pool hands a freed one to the next read of about the same size."""
    from xarray_gds.stores.files import _pinned_size

    assert _pinned_size(0) == _pinned_size(1) == _pinned_size(1 << 20) == 1 << 20
    assert _pinned_size((1 << 20) + 1) == _pinned_size(2 << 20) == 2 << 20
    assert _pinned_size(15_000_000) == _pinned_size(16 << 20) == 16 << 20
    assert _pinned_size(256 << 20) == 256 << 20
    # past 256 MiB, multiples of 64 MiB: a large staged read pins at most a quarter more
    assert _pinned_size((256 << 20) + 1) == 320 << 20
    assert _pinned_size((1 << 30) + 1) == (1 << 30) + (64 << 20)


def test_read_threads_follow_file_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from xarray_gds.stores.files import read_threads

    monkeypatch.delenv("XARRAY_GDS_READ_THREADS", raising=False)
    assert read_threads(0) == 1  # stat calls, and files of 1 KiB: one thread
    assert read_threads(1024) == 1
    assert read_threads(160_000) == 4
    monkeypatch.setenv("XARRAY_GDS_READ_THREADS", "8")
    assert read_threads(1024) == 8


def test_parallel_caps_its_threads() -> None:
    """``workers=1`` runs in the calling thread; ``workers=2`` uses two pool threads at
    most; every item runs once."""
    import threading

    from xarray_gds.codecs.host import parallel

    for workers, most in ((1, 1), (2, 2)):
        seen: list[tuple[int, int]] = []
        parallel(lambda i, seen=seen: seen.append((i, threading.get_ident())), 200, workers)
        assert sorted(i for i, _ in seen) == list(range(200))
        threads = {t for _, t in seen}
        assert len(threads) <= most
        if workers == 1:
            assert threads == {threading.get_ident()}


def _slotted_files(tmp_path: Path) -> tuple[list[str], list[bytes | None]]:
    """Files of many sizes around a 100 KiB slot (empty, exactly the slot, larger than
    it, far larger), a missing one and a directory: the cases of reads without stat."""
    rng = np.random.default_rng(7)
    slot = 100 << 10
    sizes = [0, 1, 17, slot - 1, slot, slot + 1, 3 * slot + 5, 50_000] * 6
    paths: list[str] = []
    want: list[bytes | None] = []
    for i, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        path = tmp_path / f"f{i}"
        path.write_bytes(data)
        paths.append(str(path))
        want.append(data)
        if i % 9 == 4:
            paths.append(str(tmp_path / f"missing{i}"))
            want.append(None)
    (tmp_path / "a-directory").mkdir()
    paths.insert(5, str(tmp_path / "a-directory"))
    want.insert(5, None)
    paths.append(str(tmp_path / "f0" / "below-a-file"))
    want.append(None)
    return paths, want


@pytest.mark.gpu
@pytest.mark.parametrize("threads", ["1", "4"])
def test_reads_without_stat_match_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: str
) -> None:
    """Slotted reads (no stat before reading) give every file whole, wherever its size
    falls against its slot, and -1 for missing files and directories, as stat does."""
    from xarray_gds.stores.files import read_files_device

    monkeypatch.setenv("XARRAY_GDS_READ_THREADS", threads)
    paths, want = _slotted_files(tmp_path)
    slotted = read_files_device(paths, 100 << 10)
    stat_first = read_files_device(paths)
    arena = slotted.arena.get()
    assert slotted.sizes.tolist() == stat_first.sizes.tolist()
    for i, data in enumerate(want):
        if data is None:
            assert slotted.sizes[i] == -1, paths[i]
            continue
        at, size = int(slotted.offsets[i]), int(slotted.sizes[i])
        assert at % 16 == 0
        assert arena[at : at + size].tobytes() == data, paths[i]
    # slots per file; slots too large for staging fall back to stat and kvikio reads
    per_file = np.full(len(paths), 64 << 10)
    again = read_files_device(paths, per_file)
    assert again.sizes.tolist() == stat_first.sizes.tolist()
    large = read_files_device(paths, 64 << 20)
    assert large.sizes.tolist() == stat_first.sizes.tolist()
    for batch in (again, large):
        got = batch.arena.get()
        for i, data in enumerate(want):
            if data is not None:
                at = int(batch.offsets[i])
                assert got[at : at + len(data)].tobytes() == data, paths[i]


def test_writes_do_not_follow_links_out_of_the_root(tmp_path: Path) -> None:
    """An array directory linked to one outside the store: reads follow the link (as
    engine="zarr" does), region writes and deletes through it are refused, naming the
    key and the link; a link that stays inside the root is written through."""
    import xarray as xr

    import xarray_gds

    ds = xr.Dataset({"v": (("t",), np.arange(8.0))})
    xarray_gds.to_zarr(ds, tmp_path / "other.zarr", encoding={"v": {"chunks": (4,)}})
    xarray_gds.to_zarr(ds, tmp_path / "s.zarr", encoding={"v": {"chunks": (4,)}})
    shutil.rmtree(tmp_path / "s.zarr" / "v")
    (tmp_path / "s.zarr" / "v").symlink_to(tmp_path / "other.zarr" / "v")
    outside = {p: p.read_bytes() for p in (tmp_path / "other.zarr").rglob("*") if p.is_file()}
    for engine in ("zarr", "gds-zarr"):
        got = xr.open_dataset(tmp_path / "s.zarr", engine=engine)
        xr.testing.assert_identical(got.load().as_numpy(), ds)
    link = tmp_path / "s.zarr" / "v"
    part = xr.Dataset({"v": (("t",), np.full(4, -1.0))})
    with pytest.raises(ValueError, match=f"'v/c/0'.*{link} is a symbolic link"):
        xarray_gds.to_zarr(part, tmp_path / "s.zarr", region={"t": slice(0, 4)})
    store = GdsStore(tmp_path / "s.zarr", read_only=False)
    with pytest.raises(ValueError, match=f"'v/c/1'.*{link} is a symbolic link"):
        store.delete_sync("v/c/1")
    assert {p: p.read_bytes() for p in outside} == outside
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "s.zarr", engine="zarr").load(), ds)
    # a link inside the root is followed
    link.unlink()
    (tmp_path / "s.zarr" / "real").mkdir()
    shutil.copytree(tmp_path / "other.zarr" / "v", tmp_path / "s.zarr" / "real" / "v")
    link.symlink_to(tmp_path / "s.zarr" / "real" / "v")
    xarray_gds.to_zarr(part, tmp_path / "s.zarr", region={"t": slice(0, 4)})
    want = ds.copy(deep=True)
    want.v[:4] = -1.0
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "s.zarr", engine="zarr").load(), want)
    assert {p: p.read_bytes() for p in outside} == outside

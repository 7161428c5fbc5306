"""Tests written for mutants of ``xarray_gds/stores/local.py`` (the local directory store,
:class:`GdsStore`, and its kind, :class:`LocalSource`) that survived the mutation run:
each test names the mutation it stops and compares with zarr's own ``LocalStore`` on the
same directory wherever zarr has an answer."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zarr.core.buffer import BufferPrototype, cpu
from zarr.storage import LocalStore

from tests.test_store import _payload
from xarray_gds import GdsStore
from xarray_gds.stores import local
from xarray_gds.stores.local import DirectorySource, LocalSource
from xarray_gds.stores.lock import LOCK_NAME
from xarray_gds.testing import DeviceArray, device_standins

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


class _DeviceBuffer:
    """A buffer class that is not zarr's host ``Buffer``: what a GPU prototype's buffer
    class is to the store (records how its bytes arrived)."""

    def __init__(self, data: Any, how: str) -> None:
        self.data = data
        self.how = how

    @classmethod
    def from_array_like(cls, array: Any) -> _DeviceBuffer:
        return cls(array, "array")

    @classmethod
    def from_bytes(cls, data: bytes) -> _DeviceBuffer:
        return cls(np.frombuffer(data, np.uint8), "bytes")


class _HostBuffer(cpu.Buffer):
    """A host buffer class of the caller's own."""


DEVICE = BufferPrototype(buffer=_DeviceBuffer, nd_buffer=cpu.NDBuffer)  # type: ignore[arg-type]
HOST_OWN = BufferPrototype(buffer=_HostBuffer, nd_buffer=cpu.NDBuffer)


def _buf(data: bytes) -> cpu.Buffer:
    return cpu.Buffer.from_bytes(data)


def _tree(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` (links not followed) and its bytes."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            out[path.relative_to(root).as_posix()] = path.read_bytes()
    return out


def _populate(root: Path) -> None:
    for key, data in {
        "zarr.json": b'{"zarr_format": 3, "node_type": "group"}',
        "arr/zarr.json": b"{}",
        "arr/c/0": b"chunk-0",
        "arr/c/1": b"chunk-1",
    }.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)


# -- module constants -----------------------------------------------------------------------


def test_metadata_names_and_private_keys_are_immutable_sets() -> None:
    """``_METADATA_NAMES = frozenset(...)`` -> a plain set, and ``private_keys =
    frozenset({LOCK_NAME})`` -> a plain set: the names shared by every store and source
    can't be changed by one of them."""
    assert type(local._METADATA_NAMES) is frozenset
    assert {"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"} == local._METADATA_NAMES
    for kind in (LocalSource, DirectorySource):
        assert type(kind.private_keys) is frozenset
        assert kind.private_keys == frozenset({LOCK_NAME})


def test_local_source_declares_its_capabilities() -> None:
    """``locking = True``, ``device_reads = True``, ``ranged_reads = True``, ``sizes =
    True`` -> removed or False: the local kind declares each capability it has."""
    for name in ("device_reads", "ranged_reads", "sizes", "locking", "writes", "probes"):
        assert getattr(LocalSource, name) is True, name
    assert DirectorySource.locking is True


# -- reads: which buffer, which route ---------------------------------------------------------


def test_device_prototype_reads_chunks_through_the_device_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_is_gpu_prototype`` returning nothing, and ``and not is_metadata_key(key)`` ->
    ``and is_metadata_key(key)`` or ``and not key``: a chunk asked for with a GPU
    prototype is read by kvikio into device memory, not through a host copy."""
    store, data = _payload(tmp_path)
    with device_standins(monkeypatch):
        buf = store.get_sync("arr/c/0", prototype=DEVICE)
    assert isinstance(buf, _DeviceBuffer)
    assert buf.how == "array"
    assert type(buf.data) is DeviceArray
    assert bytes(np.asarray(buf.data)) == data


async def test_metadata_comes_back_on_the_host_for_a_device_prototype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``and not is_metadata_key(key)`` -> ``and is_metadata_key(key)``, ``if
    is_metadata_key(key)`` -> ``if not ...``, and ``return cpu.Buffer.from_bytes(data)``
    removed: metadata read with a GPU prototype is a host Buffer."""
    store, _ = _payload(tmp_path)
    expect = (tmp_path / "zarr.json").read_bytes()
    with device_standins(monkeypatch):
        for buf in (
            store.get_sync("zarr.json", prototype=DEVICE),
            await store.get("zarr.json", prototype=DEVICE),
        ):
            assert type(buf) is cpu.Buffer
            assert buf.to_bytes() == expect


async def test_host_prototype_gets_its_own_buffer_class_for_chunks(tmp_path: Path) -> None:
    """``if is_metadata_key(key)`` -> ``if key`` or ``if not is_metadata_key(key)``, and
    ``return cpu.Buffer.from_bytes(data)`` removed: a chunk comes back in the prototype's
    buffer class, as zarr's LocalStore returns it; metadata as a plain host Buffer."""
    store, data = _payload(tmp_path)
    ref = LocalStore(tmp_path, read_only=True)
    got = await store.get("arr/c/0", prototype=HOST_OWN)
    want = await ref.get("arr/c/0", prototype=HOST_OWN)
    assert type(got) is type(want) is _HostBuffer
    assert got.to_bytes() == want.to_bytes() == data
    meta = store.get_sync("zarr.json", prototype=HOST_OWN)
    assert type(meta) is cpu.Buffer
    assert meta.to_bytes() == (tmp_path / "zarr.json").read_bytes()


# -- opening: a missing root ------------------------------------------------------------------


async def test_read_only_store_on_a_missing_root_refuses_every_read(tmp_path: Path) -> None:
    """``self._ensure_open_sync()`` removed from ``get_sync``, ``await
    self._ensure_open()`` removed from ``get`` and ``get_partial_values``, and the
    read-only branch of ``_ensure_open`` emptied: reads of a read-only store whose root
    is missing raise FileNotFoundError naming it (as LocalStore's), not ``None``."""
    root = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LocalStore(root, read_only=True).get_sync("zarr.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GdsStore(root, read_only=True).get_sync("zarr.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        await LocalStore(root, read_only=True).get("zarr.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        await GdsStore(root, read_only=True).get("zarr.json")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        await GdsStore(root, read_only=True).get("arr/c/0")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        await GdsStore(root, read_only=True).get_partial_values(
            cpu.buffer_prototype, [("arr/c/0", None)]
        )
    assert not root.exists()


async def test_writable_store_makes_its_missing_root_on_first_read(tmp_path: Path) -> None:
    """``await super()._ensure_open()`` removed: a writable store's first read makes its
    missing root, as LocalStore's does."""
    ref_root, root = tmp_path / "ref", tmp_path / "gds"
    assert await LocalStore(ref_root).get("zarr.json") is None
    assert await GdsStore(root).get("zarr.json") is None
    assert ref_root.is_dir()
    assert root.is_dir()
    assert list(root.iterdir()) == []


def test_read_only_store_on_a_missing_root_refuses_a_write_as_missing(tmp_path: Path) -> None:
    """``self._ensure_open_sync()`` removed from ``_put``: a write to a read-only store
    whose root is missing raises FileNotFoundError, as LocalStore's does."""
    root = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LocalStore(root, read_only=True).set_sync("k", _buf(b"x"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GdsStore(root, read_only=True).set_sync("k", _buf(b"x"))
    assert not root.exists()


# -- keys and links ---------------------------------------------------------------------------


async def test_escaping_keys_are_refused_by_every_write_delete_and_size(tmp_path: Path) -> None:
    """``self.resolve(key)`` removed from ``set_sync``, ``delete_sync``,
    ``set_if_not_exists``, ``getsize`` and ``delete``: a key with ``..`` is refused before
    anything outside the root is written, deleted or sized, and before the root is made."""
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    store = GdsStore(root)
    with pytest.raises(ValueError, match=r"invalid key '\.\./escape'"):
        store.set_sync("../escape", _buf(b"x"))
    with pytest.raises(ValueError, match=r"invalid key '\.\./victim'"):
        store.delete_sync("../victim")
    with pytest.raises(ValueError, match=r"invalid key '\.\./escape'"):
        await store.set_if_not_exists("../escape", _buf(b"x"))
    with pytest.raises(ValueError, match=r"invalid key '\.\./victim'"):
        await store.getsize("../victim")
    assert not (tmp_path / "escape").exists()
    assert victim.read_bytes() == b"keep me"
    missing = GdsStore(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"invalid key '\.\./victim'"):
        await missing.delete("../victim")
    assert not (tmp_path / "missing").exists()
    assert victim.read_bytes() == b"keep me"


def test_refused_link_error_names_the_link(tmp_path: Path) -> None:
    """``is_link = stat.S_ISLNK(...)`` -> the bare ``st_mode``, and ``continue`` ->
    ``pass`` (a level that is no link): the error names the link that leads out of the
    root (``a/b``), not the directory above it, and nothing is written outside."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "b").symlink_to(outside)
    store = GdsStore(root)
    link = f"{root}/a/b is a symbolic link to {os.path.realpath(outside)}, outside"
    with pytest.raises(ValueError, match=f"refusing to write or delete 'a/b/c' in .*{link}"):
        store.set_sync("a/b/c", _buf(b"x"))
    assert list(outside.iterdir()) == []


def test_links_to_the_root_are_followed_and_links_past_it_refused(tmp_path: Path) -> None:
    """``target == real_root`` -> ``target > real_root``, ``>=`` or ``is``: a link to the
    root itself is followed, and a link to a directory that sorts after the root's path
    (but is outside it) is refused."""
    root, after = tmp_path / "root", tmp_path / "zzz-outside"
    root.mkdir()
    after.mkdir()
    (root / "self").symlink_to(root)
    (root / "out").symlink_to(after)
    store = GdsStore(root)
    store.set_sync("self/k", _buf(b"through the root"))
    assert (root / "k").read_bytes() == b"through the root"
    with pytest.raises(ValueError, match=r"refusing to write or delete 'out/k'"):
        store.set_sync("out/k", _buf(b"x"))
    assert list(after.iterdir()) == []


# -- deletes and clears -----------------------------------------------------------------------


async def test_read_only_store_refuses_delete_dir_and_clear(tmp_path: Path) -> None:
    """``self._check_writable()`` removed from ``delete_dir`` and ``clear`` (of the store
    and of its source): a read-only store deletes nothing and says so."""
    _populate(tmp_path)
    before = _tree(tmp_path)
    store = GdsStore(tmp_path, read_only=True)
    with pytest.raises(ValueError, match="read-only"):
        await store.delete_dir("arr")
    with pytest.raises(ValueError, match="read-only"):
        await store.clear()
    with pytest.raises(ValueError, match="read-only"):
        await LocalSource(store).clear()
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("prefix", ["", "/"])
async def test_delete_dir_of_the_root_keeps_the_root_and_the_lock(
    tmp_path: Path, prefix: str
) -> None:
    """``return`` after ``await self.clear()`` -> ``pass``, and ``prefix.rstrip("/")``
    removed: ``delete_dir("")`` and ``delete_dir("/")`` empty the store, leaving the root
    and the writer lock file."""
    root = tmp_path / "root"
    _populate(root)
    (root / LOCK_NAME).write_bytes(b"")
    await GdsStore(root).delete_dir(prefix)
    assert root.is_dir()
    assert _tree(root) == {LOCK_NAME: b""}


async def test_source_delete_dir_and_clear_remove_keys_but_the_lock(tmp_path: Path) -> None:
    """``await self.store.delete_dir(prefix)``, ``await self.clear()`` and ``await
    asyncio.to_thread(clear_root, ...)`` removed from the local write side: each removes
    what it names, the lock file kept."""
    root = tmp_path / "root"
    _populate(root)
    (root / LOCK_NAME).write_bytes(b"")
    source = LocalSource(GdsStore(root))
    await source.delete_dir("arr")
    assert _tree(root) == {"zarr.json": b'{"zarr_format": 3, "node_type": "group"}', LOCK_NAME: b""}
    _populate(root)
    await source.delete_dir("")
    assert _tree(root) == {LOCK_NAME: b""}
    _populate(root)
    await source.clear()
    assert _tree(root) == {LOCK_NAME: b""}
    assert root.is_dir()


# -- listings ---------------------------------------------------------------------------------


async def _collect(it: Any) -> list[str]:
    return sorted([key async for key in it])


async def test_listings_leave_out_only_the_root_lock_file(tmp_path: Path) -> None:
    """``key != LOCK_NAME`` -> ``key > LOCK_NAME`` (``list``, ``list_prefix``), ``top =
    not prefix.strip("/")`` -> without ``not``, and ``name == LOCK_NAME`` -> ``is``,
    ``<`` or ``<=`` (``list_dir``): the listings are LocalStore's less the lock file in
    the root, names sorting before and after it kept, a file of that name below kept."""
    for key in ("zarr.json", ".zattrs", ".a-below", "-dash", "arr/zarr.json", "arr/c/0"):
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(b"x")
    (tmp_path / LOCK_NAME).write_bytes(b"")
    (tmp_path / "arr" / LOCK_NAME).write_bytes(b"y")
    store, ref = GdsStore(tmp_path, read_only=True), LocalStore(tmp_path, read_only=True)
    expect = [k for k in await _collect(ref.list()) if k != LOCK_NAME]
    assert ".a-below" in expect and f"arr/{LOCK_NAME}" in expect
    assert await _collect(store.list()) == expect
    assert await _collect(store.list_prefix("")) == expect
    top = [k for k in await _collect(ref.list_dir("")) if k != LOCK_NAME]
    assert top == sorted(["-dash", ".a-below", ".zattrs", "arr", "zarr.json"])
    assert await _collect(store.list_dir("")) == top
    assert await _collect(store.list_dir("arr")) == await _collect(ref.list_dir("arr"))
    assert LOCK_NAME in await _collect(store.list_dir("arr"))


# -- opening paths ----------------------------------------------------------------------------


def test_open_expands_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Path(text).expanduser()`` -> ``Path(text)``: ``~/store.zarr`` opens the store in
    the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _populate(tmp_path / "store.zarr")
    opened = LocalSource.open("~/store.zarr", mode="r", storage_options=None)
    assert opened.store.root == tmp_path / "store.zarr"
    assert opened.store.get_sync("arr/c/0").to_bytes() == b"chunk-0"


class _Mode(str):
    """A mode string that is not the interned literal (a str subclass)."""


@pytest.mark.parametrize(
    ("mode", "read_only"), [("r", True), (_Mode("r"), True), ("r+", False), ("a", False)]
)
def test_open_mode_sets_read_only(tmp_path: Path, mode: str, read_only: bool) -> None:
    """``GdsStore(path, read_only=read_only)`` -> without ``read_only``, and ``mode ==
    "r"`` -> ``>``, ``>=``, ``is``, ``is not``, ``<``, ``<=`` or ``!=``: mode "r" opens the
    store read-only, "r+" and "a" writable."""
    _populate(tmp_path / "s.zarr")
    opened = LocalSource.open(str(tmp_path / "s.zarr"), mode=mode, storage_options=None)
    assert opened.store.read_only is read_only
    if read_only:
        with pytest.raises(ValueError, match="read-only"):
            opened.store.set_sync("k", _buf(b"x"))


@pytest.mark.parametrize("block", [1024, 2048])
def test_hdf5_file_with_a_user_block_is_named(tmp_path: Path, block: int) -> None:
    """``for start in (512, 1024, 2048)`` -> 1023, 1025, 2047 or 2049: an HDF5 file whose
    signature follows a user block of 1024 or 2048 bytes is named as NetCDF-4/HDF5."""
    path = tmp_path / "data.nc"
    path.write_bytes(b"\0" * block + HDF5_MAGIC + b"\0" * 64)
    with pytest.raises(ValueError, match="is a NetCDF-4/HDF5 file, not a Zarr store"):
        LocalSource.open(str(path), mode="r", storage_options=None)


def test_small_netcdf_classic_file_is_named(tmp_path: Path) -> None:
    """``break`` -> ``continue`` (signature found at the start): a NetCDF classic file
    shorter than 512 bytes is named as one."""
    path = tmp_path / "small.nc"
    path.write_bytes(b"CDF\x01" + b"\0" * 28)
    with pytest.raises(ValueError, match="is a NetCDF classic file, not a Zarr store"):
        LocalSource.open(str(path), mode="r", storage_options=None)


def test_a_named_pipe_is_not_read_when_opened(tmp_path: Path) -> None:
    """``if not path.is_file()`` -> ``if not path``, and its ``return None`` removed: a
    path that is a named pipe is refused as no Zarr store without reading from the pipe
    (which would take what a writer sends, or wait for one)."""
    fifo = tmp_path / "data.nc"
    os.mkfifo(fifo)
    fed = threading.Event()

    def feed() -> None:  # an HDF5 signature, for whoever reads the pipe
        try:
            with open(fifo, "wb") as pipe:
                pipe.write(HDF5_MAGIC)
        except BrokenPipeError:
            pass
        fed.set()

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        with pytest.raises(ValueError, match="is not a Zarr store"):
            LocalSource.open(str(fifo), mode="r", storage_options=None)
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer finish
        try:
            writer.join(10)
        finally:
            os.close(reader)
    assert fed.is_set()

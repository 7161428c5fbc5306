"""Local directories: the store kind of paths and ``file://`` URLs.

:class:`GdsStore` is the zarr Store (keys, reads, writes with links out of the root
refused, listing) that reads chunk bytes straight into GPU memory; the file reads and
writes under it are :mod:`xarray_gds.stores.files`'s. :class:`LocalSource` is the
kind: it opens a path (checked to be a Zarr store, with a hint for a NetCDF file), reads
chunk files for the engine (kvikio into one device arena, or the host pool's reads), and
its write side takes the writer lock (:mod:`xarray_gds.stores.lock`), probes keys with
one ``lstat`` and removes the directories a failed write left empty.
:class:`DirectorySource` is zarr's own ``LocalStore``: read through its ``get``,
written as a local directory."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, cpu
from zarr.storage import LocalStore

from xarray_gds.batch import Fetched, HostBatch, offloaded
from xarray_gds.stores import files as _local
from xarray_gds.stores.base import Opened, Ranges, Source, WriterLock
from xarray_gds.stores.generic import StoreSource
from xarray_gds.stores.lock import LOCK_NAME, FileLock, lock_path

if TYPE_CHECKING:
    from zarr.core.buffer import BufferPrototype

__all__ = ["DirectorySource", "GdsStore", "LocalSource", "is_metadata_key"]

_METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


def is_metadata_key(key: str) -> bool:
    """True for keys that hold Zarr metadata (always returned in host memory)."""
    return key.rsplit("/", 1)[-1] in _METADATA_NAMES


def _is_gpu_prototype(prototype: BufferPrototype) -> bool:
    return not issubclass(prototype.buffer, cpu.Buffer)


class GdsStore(LocalStore):
    """A :class:`zarr.storage.LocalStore` whose chunk reads land in GPU memory.

    When zarr asks for a key with a GPU buffer prototype (as xarray-gds does for
    arrays placed on the device), the bytes are read by kvikio straight into device
    memory: GPUDirect Storage where the driver is present, kvikio's compat mode (a
    pinned bounce buffer) otherwise. Metadata keys and reads with a host prototype
    go through ordinary file reads. Writes go to a temporary file renamed into place
    (as LocalStore's, with os-level calls); deleting a directory removes its files
    in parallel. Listing is :class:`~zarr.storage.LocalStore`'s, less the writer lock
    file in the root (:data:`~xarray_gds.stores.lock.LOCK_NAME`, not zarr's), which
    ``clear`` and ``delete_dir("")`` keep. Metadata keys are
    written as any other: :func:`xarray_gds.to_zarr` holds them until the data is in
    (:class:`~xarray_gds.deferred.HeldMetadataStore`).

    Keys that would resolve outside ``root`` (absolute paths, ``..`` segments) are
    rejected with :class:`ValueError`. So are writes and deletes whose directory is
    reached through a symbolic link that leads out of the root (a linked array
    directory, say): the error names the key and the link. Links that stay inside the
    root are followed, and so is the root itself when it is a link. Reads follow
    links wherever they lead, as :class:`~zarr.storage.LocalStore` (and so
    ``engine="zarr"``) does: a store may share arrays with another by linking them.

    Parameters
    ----------
    root : str or Path
        Directory of the store.
    read_only : bool
        Refuse writes.
    """

    def _check_key(self, key: str) -> None:
        bounded = f"/{key}/"
        if key.startswith("/") or "\\" in key or "/../" in bounded or "/./" in bounded:
            raise ValueError(
                f"invalid key {key!r} for store at {self.root}: keys must be relative and "
                "may not contain '.' or '..' segments or backslashes"
            )

    def resolve(self, key: str) -> Path:
        """The file that holds ``key``; raises ValueError for keys that escape the root."""
        self._check_key(key)
        return self.root / key

    def _read(
        self, key: str, prototype: BufferPrototype | None, byte_range: ByteRequest | None
    ) -> Buffer | None:
        if prototype is None:
            prototype = cpu.buffer_prototype
        path = self.resolve(key)
        try:
            if _is_gpu_prototype(prototype) and not is_metadata_key(key):
                return prototype.buffer.from_array_like(_local.read_span_device(path, byte_range))
            data = _local.read_span_host(path, byte_range)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if is_metadata_key(key):
            return cpu.Buffer.from_bytes(data)
        return prototype.buffer.from_bytes(data)

    def chunk_paths(self, keys: list[str]) -> list[str]:
        """The files that hold ``keys`` (checked as :meth:`resolve` checks them): what
        the engine's batched reads of chunks read (:class:`xarray_gds.stores.LocalSource`)."""
        root = os.fspath(self.root)
        for key in keys:
            self._check_key(key)
        return [f"{root}/{key}" for key in keys]  # str: pathlib costs more than the read

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        self._ensure_open_sync()
        return self._read(key, prototype, byte_range)

    async def _open(self, *, mode: Any = None) -> None:
        if self.read_only and not self._is_open:
            self._ensure_open_sync()  # see _ensure_open
            return
        await super()._open(mode=mode)

    async def _ensure_open(self) -> None:
        # A read-only store only checks that its root exists: one stat, cheaper in the
        # event loop than the hop to a worker thread (LocalStore's way) and back.
        if self.read_only:
            self._ensure_open_sync()
        else:
            await super()._ensure_open()

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        await self._ensure_open()
        if is_metadata_key(key):
            # Metadata documents are small local files: read in the event loop, they
            # cost a few microseconds, where a worker thread costs a hop each way
            # (most of the time of opening a store, measured).
            return self._read(key, prototype, byte_range)
        return await asyncio.to_thread(self._read, key, prototype, byte_range)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        await self._ensure_open()
        return list(
            await asyncio.gather(
                *(asyncio.to_thread(self._read, k, prototype, r) for k, r in key_ranges)
            )
        )

    def _put(self, key: str, value: Buffer) -> None:
        self._ensure_open_sync()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(
                f"GdsStore.set(): the value for {key!r} must be a zarr Buffer, "
                f"not {type(value).__name__}"
            )
        self._check_links(key.split("/")[:-1], key)
        _local.write_file(os.path.join(self.root, key), value.as_buffer_like())

    def _check_links(self, parts: list[str], key: str) -> None:
        """Refuse to write or delete ``key`` when its directory (``parts`` below the
        root) is reached through a symbolic link that leads out of the root. One
        ``lstat`` a level; links that stay inside the root are followed."""
        root = os.fspath(self.root)
        path = root
        for part in parts:
            path = f"{path}/{part}"
            try:
                is_link = stat.S_ISLNK(os.lstat(path).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                return  # made by the write, as a directory
            if not is_link:
                continue
            real_root = os.path.realpath(root)
            target = os.path.realpath(os.path.join(root, *parts))
            if target == real_root or target.startswith(real_root + os.sep):
                return
            raise ValueError(
                f"xarray-gds: refusing to write or delete {key!r} in {self}: {path} is a "
                f"symbolic link to {os.path.realpath(path)}, outside the store's root "
                f"{real_root}. Replace the link by a directory (or a link inside the store)."
            )

    def set_sync(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        self._put(key, value)

    def delete_sync(self, key: str) -> None:
        self.resolve(key)
        self._check_links(key.split("/")[:-1], key)
        super().delete_sync(key)

    async def set(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        await asyncio.to_thread(self._put, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        self._check_links(key.split("/")[:-1], key)
        await super().set_if_not_exists(key, value)

    async def delete(self, key: str) -> None:
        self.resolve(key)
        await self._ensure_open()
        await asyncio.to_thread(self.delete_sync, key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        prefix = prefix.rstrip("/")
        if not prefix:
            await self.clear()
            return
        self.resolve(prefix)
        self._check_links(prefix.split("/")[:-1], prefix)  # the prefix: remove_tree
        path = self.root / prefix
        if path.is_dir():
            await asyncio.to_thread(_local.remove_tree, str(path))
        elif path.is_file():
            raise ValueError(f"delete_dir was given {prefix!r}, which is a file in {self}")

    async def clear(self) -> None:
        """Delete every key: all the root holds but the writer lock file (a ``mode="w"``
        write clears the store it holds the lock of)."""
        self._check_writable()
        await asyncio.to_thread(clear_root, self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    async def list(self) -> AsyncIterator[str]:
        async for key in super().list():
            if key != LOCK_NAME:
                yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for key in super().list_prefix(prefix):
            if key != LOCK_NAME:
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        top = not prefix.strip("/")
        async for name in super().list_dir(prefix):
            if not (top and name == LOCK_NAME):
                yield name

    async def exists(self, key: str) -> bool:
        self.resolve(key)
        return await super().exists(key)

    async def getsize(self, key: str) -> int:
        self.resolve(key)
        return await super().getsize(key)

    def __repr__(self) -> str:
        return f"GdsStore('{self}')"

    def __str__(self) -> str:
        return f"file://{self.root.as_posix()}"


def clear_root(root: str | os.PathLike[str]) -> None:
    """Delete all that the local store at ``root`` holds but its writer lock file
    (:data:`~xarray_gds.stores.lock.LOCK_NAME`); the root stays (nothing when it is
    missing)."""
    if os.path.isdir(root):
        _local.remove_tree(os.fspath(root), keep=frozenset({LOCK_NAME}))


# -- the local kind ----------------------------------------------------------------------

#: the documents one of which a Zarr store's root holds
_ROOT_METADATA = ("zarr.json", ".zgroup", ".zarray", ".zmetadata")


def _open_path(text: str, read_only: bool) -> GdsStore:
    """The :class:`GdsStore` of an existing local Zarr store at ``text``."""
    path = Path(text).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"No such Zarr store: '{path}'")
    netcdf = _netcdf_kind(path)
    if netcdf is not None:
        raise ValueError(
            f"'{path}' is a {netcdf} file, not a Zarr store: open it with "
            f"{_NETCDF_ENGINES[netcdf]} (read on the host), or make a reference set of it "
            "with kerchunk or VirtualiZarr and open that with engine='gds-zarr' to decode "
            "its chunks on the GPU (see the NetCDF page of the docs, docs/netcdf.md)"
        )
    is_store = path.is_dir() and any((path / name).exists() for name in _ROOT_METADATA)
    if not is_store and _is_icechunk_repository(path):  # (variables may be named so)
        raise ValueError(
            f"'{path}' is an Icechunk repository, not a Zarr store: open a session's "
            "store, repo = icechunk.Repository.open(icechunk.local_filesystem_storage("
            f"{str(path)!r})), then xr.open_dataset(repo.readonly_session('main').store, "
            "engine='gds-zarr', storage_options={'icechunk_storage': repo.storage}) "
            "(see the Icechunk page of the docs, docs/icechunk.md)"
        )
    if not is_store:
        raise ValueError(
            f"'{path}' is not a Zarr store: it is not a directory holding "
            "zarr.json (Zarr v3) or .zgroup/.zarray/.zmetadata (Zarr v2)"
        )
    return GdsStore(path, read_only=read_only)


def _is_icechunk_repository(path: Path) -> bool:
    """Whether ``path`` is the directory of an Icechunk repository on the local
    filesystem: its ``snapshots`` directory and its ``repo`` file (Icechunk 2), or
    ``refs`` directory (Icechunk 1)."""
    return (path / "snapshots").is_dir() and ((path / "repo").is_file() or (path / "refs").is_dir())


#: the first bytes of HDF5 (NetCDF-4) and NetCDF classic files
_NETCDF_MAGIC = {
    b"\x89HDF\r\n\x1a\n": "NetCDF-4/HDF5",
    b"CDF\x01": "NetCDF classic",
    b"CDF\x02": "NetCDF classic",
    b"CDF\x05": "NetCDF CDF-5",
}
_NETCDF_ENGINES = {
    "NetCDF-4/HDF5": "xr.open_dataset(path, engine='netcdf4') or engine='h5netcdf'",
    "NetCDF classic": "xr.open_dataset(path, engine='netcdf4') or engine='scipy'",
    "NetCDF CDF-5": "xr.open_dataset(path, engine='netcdf4')",
}


def _netcdf_kind(path: Path) -> str | None:
    """``"NetCDF-4/HDF5"`` or ``"NetCDF classic"`` when ``path`` is a file that starts as
    one does (an HDF5 signature may also follow a user block of 512, 1024, ... bytes)."""
    if not path.is_file():
        return None
    try:
        with path.open("rb") as file:
            head = file.read(8)
            for start in (512, 1024, 2048):
                if head.startswith(tuple(_NETCDF_MAGIC)):
                    break
                file.seek(start)
                head = file.read(8)
    except OSError:
        return None
    return next((kind for magic, kind in _NETCDF_MAGIC.items() if head.startswith(magic)), None)


class _LocalWrites(Source):
    """The write side of a local directory: the lock file (in the root, kept when a
    write clears the store), ``lstat`` probes and the removal of the directories a
    failed write left empty."""

    writes = True
    locking = True
    probes = True
    private_keys = frozenset({LOCK_NAME})

    def writer_lock(self, timeout: float | None) -> WriterLock | None:
        return FileLock(lock_path(self.store.root), self.store).acquire(timeout)

    async def delete_dir(self, prefix: str) -> None:
        if prefix.strip("/"):
            await self.store.delete_dir(prefix)
        else:
            await self.clear()

    async def clear(self) -> None:
        """Delete all the root holds but the lock file (a zarr ``LocalStore``'s own
        ``clear`` removes the root whole, the lock file of this write with it)."""
        self.store._check_writable()
        await asyncio.to_thread(clear_root, self.store.root)

    def existed(self, key: str) -> bool:
        return os.path.lexists(os.path.join(self.store.root, key))

    def after_failed_write(self, removed: set[str]) -> None:
        _remove_empty_dirs(os.fspath(self.store.root), removed)


def _remove_empty_dirs(root: str, keys: Iterable[str]) -> None:
    """Remove the directories of ``keys`` below ``root`` that are empty, deepest first."""
    parents: set[str] = set()
    for key in keys:
        parts = key.split("/")[:-1]
        parents.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
    for parent in sorted(parents, key=lambda p: -p.count("/")):
        try:
            os.rmdir(os.path.join(root, parent))
        except OSError:  # not empty: it holds what was there before
            continue


class LocalSource(_LocalWrites):
    """Files of a :class:`GdsStore`: read by kvikio into one device arena (GPUDirect
    Storage or kvikio's compat mode), or by the host pool's ``preadv`` calls; the files
    of every local store in a batch are read together. Opens local paths and
    ``file://`` URLs."""

    device_reads = True
    ranged_reads = True
    sizes = True
    streams = True
    writes_in_threads = True

    @classmethod
    def claims(cls, store: Any) -> bool:
        return isinstance(store, GdsStore)

    @classmethod
    def opens(cls, target: Any) -> bool:
        if not isinstance(target, str | os.PathLike):
            return False
        text = os.fspath(target)
        return "://" not in text or text.startswith("file://")

    @classmethod
    def open(
        cls,
        target: Any,
        *,
        mode: str,
        storage_options: dict[str, Any] | None,
        consolidated: bool | None = None,
    ) -> Opened:
        text = os.fspath(target).removeprefix("file://")
        if mode.startswith("w"):  # a write may create it
            return Opened(GdsStore(Path(text), read_only=False), storage_options, consolidated)
        return Opened(_open_path(text, mode == "r"), storage_options, consolidated)

    def locate(self, keys: list[str]) -> list[Any]:
        return list(self.store.chunk_paths(keys))

    @classmethod
    def read_all(
        cls, sources: Sequence[Any], locations: list[Any], on_device: bool, slots: Any
    ) -> Fetched:
        if not on_device:
            return HostBatch(_local.read_files_host(locations))
        return _local.read_files_device(locations, slots)

    @classmethod
    def read_ranges_all(
        cls, sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        starts, sizes = ranges
        if not on_device:
            return HostBatch(_local.read_ranges_host(locations, starts, sizes))
        return _local.read_ranges_device(locations, starts, sizes)

    def read_one(self, location: Any) -> np.ndarray | None:
        return _local.read_file(location)

    async def read_end(self, key: str, nbytes: int, at_end: bool) -> tuple[np.ndarray, int] | None:
        """As :meth:`Source.read_end`, with one open, one ``fstat`` and one ``pread`` of
        the file, in the engine's threads."""
        path = str(self.store.resolve(key))
        return await offloaded(_local.read_end, path, nbytes, at_end)


class DirectorySource(_LocalWrites, StoreSource):
    """A zarr ``LocalStore`` that is not a :class:`GdsStore`: read through its own
    ``get``, written as a local directory (lock file, probes, clean-up)."""

    @classmethod
    def claims(cls, store: Any) -> bool:
        return isinstance(store, LocalStore)

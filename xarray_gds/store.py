"""A local-directory zarr Store that reads chunk bytes straight into GPU memory.

:class:`GdsStore` is the Store (keys, metadata held until the data is written, links
refused, one writer at a time); the file reads and writes under it are
:mod:`xarray_gds.io.local`'s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, cpu
from zarr.storage import LocalStore

from xarray_gds.io import local as _local
from xarray_gds.locking import DEFAULT_TIMEOUT, WriterLock, writer_lock

if TYPE_CHECKING:
    from zarr.core.buffer import BufferPrototype

__all__ = ["GdsStore", "is_metadata_key"]

_METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


def is_metadata_key(key: str) -> bool:
    """True for keys that hold Zarr metadata (always returned in host memory)."""
    return key.rsplit("/", 1)[-1] in _METADATA_NAMES


def _is_gpu_prototype(prototype: BufferPrototype) -> bool:
    return not issubclass(prototype.buffer, cpu.Buffer)


@dataclass
class _Deferred:
    """Metadata keys held back by :meth:`GdsStore.defer_metadata`."""

    keys: dict[str, Buffer] = field(default_factory=dict)
    active: bool = True
    depth: int = 1  #: nested deferrals still open
    failed: bool = False  #: one of them failed: drop the keys instead of writing them
    written: list[str] = field(default_factory=list)  #: chunk keys written meanwhile
    created: list[str] = field(default_factory=list)  #: those of them that were not there
    inflight: int = 0  #: chunk writes and deletes of this deferral running now
    lock: WriterLock | None = None  #: the store's writer lock, held until the end


@dataclass
class _Deferrals:
    """The deferral state a store shares with its copies (see ``GdsStore._deferrals``)."""

    deferred: _Deferred | None = None
    aborted: _Deferred | None = None


#: orders chunk writes' bookkeeping against the end of a deferral, which waits on it
#: for the chunk writes still running
_deferral_lock = threading.Condition()


def _is_array_metadata(key: str, value: Buffer) -> bool:
    """Whether ``value``, held for the metadata key ``key``, describes an array."""
    name = key.rsplit("/", 1)[-1]
    if name == ".zarray":
        return True
    if name != "zarr.json":
        return False
    try:
        return json.loads(value.to_bytes()).get("node_type") == "array"
    except (ValueError, AttributeError):
        return False


class GdsStore(LocalStore):
    """A :class:`zarr.storage.LocalStore` whose chunk reads land in GPU memory.

    When zarr asks for a key with a GPU buffer prototype (as xarray-gds does for
    arrays placed on the device), the bytes are read by kvikio straight into device
    memory: GPUDirect Storage where the driver is present, kvikio's compat mode (a
    pinned bounce buffer) otherwise. Metadata keys and reads with a host prototype
    go through ordinary file reads. Writes go to a temporary file renamed into place
    (as LocalStore's, with os-level calls); deleting a directory removes its files
    in parallel. Listing is :class:`~zarr.storage.LocalStore`'s.

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
        held = self._held(key)
        if held is not None:
            offset, nbytes = _local.byte_span(len(held), byte_range)
            return cpu.Buffer.from_bytes(held.to_bytes()[offset : offset + nbytes])
        try:
            if _is_gpu_prototype(prototype) and not is_metadata_key(key):
                return prototype.buffer.from_array_like(_local.read_span_device(path, byte_range))
            data = _local.read_span_host(path, byte_range)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if is_metadata_key(key):
            return cpu.Buffer.from_bytes(data)
        return prototype.buffer.from_bytes(data)

    def read_chunks(self, keys: list[str], device: str, slot: int | None = None) -> Any:
        """Whole chunk files for the batched pipeline.

        Parameters
        ----------
        keys : list of str
            Chunk keys.
        device : {"cuda", "cpu"}
            ``"cuda"``: one :class:`~xarray_gds.batch.DeviceBatch` read by kvikio.
            ``"cpu"``: a list of uint8 numpy arrays, ``None`` for missing keys.
        slot : int, optional
            Bytes a chunk file is expected to fit in (see
            :func:`~xarray_gds.io.local.read_files_device`).
        """
        paths = self.chunk_paths(keys)
        if device == "cuda":
            return _local.read_files_device(paths, slot)
        return _local.read_files_host(paths)

    def chunk_paths(self, keys: list[str]) -> list[str]:
        """The files that hold ``keys`` (checked as :meth:`resolve` checks them): what
        every batched read of chunks (:meth:`read_chunks`, and the joined reads of
        :mod:`xarray_gds.coalesce`) reads."""
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

    # -- metadata held back until the data it describes is written ---------------------
    # Held in one _Deferrals that every store made from this one by ``with_read_only``
    # shares: zarr writes chunks through such copies, and a copy must see the deferral
    # (and its failure) of the store it came from.

    @property
    def _deferrals(self) -> _Deferrals:
        shared = self.__dict__.get("_shared_deferrals")
        if shared is None:
            shared = self.__dict__["_shared_deferrals"] = _Deferrals()
        return shared

    @property
    def _deferred(self) -> _Deferred | None:
        return self._deferrals.deferred

    @_deferred.setter
    def _deferred(self, value: _Deferred | None) -> None:
        self._deferrals.deferred = value

    @property
    def _aborted(self) -> _Deferred | None:
        """The last deferral that failed: chunk writes of that write still running (zarr
        does not cancel the rest of a failed gather) are removed too."""
        return self._deferrals.aborted

    @_aborted.setter
    def _aborted(self, value: _Deferred | None) -> None:
        self._deferrals.aborted = value

    def defer_metadata(self, lock_timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Hold metadata writes in memory until :meth:`flush_metadata`.

        Chunks are written to disk as usual; metadata keys (``zarr.json``, ``.zarray``,
        ``.zattrs``, ``.zgroup``, ``.zmetadata``) are kept here and served to reads,
        listings and existence checks, then written after the data. A write that
        fails before the flush leaves the metadata on disk as it was: an append
        that fails does not extend the array over chunks that were never written.
        Stores made from this one by ``with_read_only`` share the held keys.

        Calls nest (two writes through one store object): the keys are written when
        the last of them flushes, and dropped instead if any of them failed.

        The outermost call takes the store's writer lock (see :mod:`xarray_gds.locking`)
        and the end of the deferral gives it back: another process or thread writing
        the same directory meanwhile waits, then reads the metadata this write left.

        Parameters
        ----------
        lock_timeout : float or None
            Seconds to wait for another writer's lock (``None``: no bound).

        Raises
        ------
        TimeoutError
            When another writer held the lock for ``lock_timeout`` seconds; it names
            the lock file and the process holding it.
        """
        with _deferral_lock:
            if self._deferred is not None and self._deferred.active:
                self._deferred.depth += 1
                return
        lock = writer_lock(self, lock_timeout)  # before zarr reads any metadata
        with _deferral_lock:
            self._deferred = _Deferred(lock=lock)
            self._aborted = None

    def flush_metadata(self) -> None:
        """Write the held metadata (arrays before their groups, consolidated last) and
        stop holding it (at the end of the outermost deferral).

        Chunk writes of the deferral still running are waited for first, so that the
        metadata goes to disk after every chunk it describes. All of it or none: the
        metadata documents on disk are read first, and when a write fails, those
        already replaced are written back (and those that did not exist are removed)
        before the error propagates, so that the store opens as it did before. The
        chunk files the write made are removed too (see :meth:`discard_metadata`).

        Raises
        ------
        RuntimeError
            When putting the old metadata back failed as well; it names the keys that
            may now be inconsistent (the original error is its cause).
        """
        deferred = self._deferred
        if deferred is None:
            return
        deferred.depth -= 1
        if deferred.depth > 0:
            return
        self._end(deferred)
        try:
            if deferred.failed:
                before = {k: _local.read_or_none(os.path.join(self.root, k)) for k in deferred.keys}
                self._remove_written(deferred, before)
                return
            order = sorted(deferred.keys, key=lambda k: (-k.count("/"), k))
            before = {k: _local.read_or_none(os.path.join(self.root, k)) for k in order}
            done: list[str] = []
            try:
                for key in order:
                    done.append(key)  # the failing write too: it may have landed
                    self._put(key, deferred.keys[key])
            except BaseException as err:
                deferred.failed = True
                with _deferral_lock:
                    self._aborted = deferred
                self._restore(done, before, err)
                self._remove_written(deferred, before)
                raise
        finally:
            deferred.keys.clear()
            if deferred.lock is not None:
                deferred.lock.release()

    def _end(self, deferred: _Deferred) -> None:
        """Stop holding metadata for ``deferred`` and wait for its chunk writes still
        running. From here on, chunk writes are not its own; when it failed, they are
        refused (see :meth:`_writing`): what is left of the failed write (zarr lets the
        other writes of a failed gather run on, dask the other tasks) writes nothing."""
        with _deferral_lock:
            self._deferred = None
            deferred.active = False
            if deferred.failed:
                self._aborted = deferred
            _deferral_lock.wait_for(lambda: deferred.inflight == 0)

    def _restore(
        self, keys: list[str], before: dict[str, bytes | None], err: BaseException
    ) -> None:
        """Put back the metadata ``keys`` as ``before`` holds them (removing those it
        holds as ``None``), in reverse order of writing; ``err`` made it necessary."""
        stuck: list[str] = []
        for key in reversed(keys):
            path = os.path.join(self.root, key)
            try:
                old = before[key]
                if old is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                else:
                    _local.write_file(path, old)
            except Exception:
                stuck.append(key)
        if stuck:
            raise RuntimeError(
                f"xarray-gds: writing the metadata of {self} failed ({err!r}), and putting "
                f"back the previous metadata of {sorted(stuck)} failed too: the store may not "
                "open, or open with mismatched arrays. Restore those keys from a backup, or "
                "write the dataset again with mode='w'."
            ) from err

    def _remove_written(self, deferred: _Deferred, before: dict[str, bytes | None]) -> None:
        """Delete the chunk files that the failed ``deferred`` made (those that were not
        there before it wrote them) and every chunk it wrote for arrays whose metadata
        did not exist before (``before``: the documents on disk when the write began),
        then the directories this leaves empty. Chunks it replaced stay (their old
        bytes are gone): readers read them only inside the old shape."""
        prefixes = tuple(
            key.rpartition("/")[0] + "/" if "/" in key else ""
            for key, value in deferred.keys.items()
            if before.get(key) is None and _is_array_metadata(key, value)
        )
        with _deferral_lock:
            doomed = set(deferred.created)
            if prefixes:
                doomed.update(k for k in deferred.written if k.startswith(prefixes))
        root = os.fspath(self.root)
        parents: set[str] = set()
        for key in doomed:
            if is_metadata_key(key):
                continue
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(os.path.join(root, key))
            parts = key.split("/")[:-1]
            parents.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
        for parent in sorted(parents, key=lambda p: -p.count("/")):
            with contextlib.suppress(OSError):  # not empty: it holds what was there before
                os.rmdir(os.path.join(root, parent))

    def discard_metadata(self) -> None:
        """A write failed: drop the held metadata (at the end of the outermost deferral).

        Chunk writes of the write still running are waited for, and those that start
        later are refused, so nothing of it lands after this returns. The chunk files
        it made are removed: those of arrays that did not exist before, and those of
        existing arrays that were not there (past the old end of an append, or
        chunks of a region that held only the fill value). The store holds the files
        it held before, but for the chunks the write replaced.
        """
        if self._deferred is not None:
            self._deferred.failed = True
            self.flush_metadata()

    def _held(self, key: str) -> Buffer | None:
        deferred = self._deferred
        if deferred is None or not deferred.active:
            return None
        return deferred.keys.get(key)

    def _hold(self, key: str, value: Buffer, *, keep: bool = False) -> bool:
        """Hold ``value`` for the metadata key ``key`` while writes are deferred (keep
        an existing value with ``keep``); False when ``key`` is written as usual."""
        deferred = self._deferred
        if deferred is None or not deferred.active or not is_metadata_key(key):
            return False
        self._check_writable()
        if not keep:
            deferred.keys[key] = value
        return True

    def _forget(self, key: str) -> None:
        """Drop the held ``key`` and the held keys below it (``key`` as a directory)."""
        deferred = self._deferred
        if deferred is None or not deferred.active or not deferred.keys:
            return
        deferred.keys.pop(key, None)
        for held in self._held_keys(key):
            del deferred.keys[held]

    def _held_keys(self, prefix: str = "") -> list[str]:
        """Held keys below the directory ``prefix`` (all of them for ``""``)."""
        deferred = self._deferred
        if deferred is None or not deferred.active:
            return []
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        return [k for k in deferred.keys if k.startswith(base)]

    def with_read_only(self, read_only: bool = False) -> Self:
        clone = super().with_read_only(read_only)
        clone.__dict__["_shared_deferrals"] = self._deferrals
        return clone

    # Key validation for the inherited write/list paths.
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

    def _writing(self, key: str) -> _Deferred | None:
        """Note a chunk write or delete of ``key`` starting while metadata is held;
        returns the deferral it belongs to (its end waits for :meth:`_wrote`).

        Raises
        ------
        RuntimeError
            When the last deferral of this store failed and no write began since (a
            metadata write or :meth:`defer_metadata`): what is left of a failed write.
        """
        with _deferral_lock:
            deferred = self._deferred
            if deferred is not None and deferred.active:
                deferred.inflight += 1
                return deferred
            if self._aborted is None:
                return None
            if is_metadata_key(key):  # a new write through this store
                self._aborted = None
                return None
        raise RuntimeError(
            f"xarray-gds: not writing {key!r} in {self}: the write it belongs to failed "
            "and was cleaned up. Run the write again."
        )

    @staticmethod
    def _wrote(deferred: _Deferred | None, key: str | None, created: bool) -> None:
        """The write of ``key`` (``None``: a delete) noted by :meth:`_writing` is over;
        ``created``: there was no file at ``key`` before it."""
        if deferred is None:
            return
        with _deferral_lock:
            if key is not None:
                deferred.written.append(key)
                if created:
                    deferred.created.append(key)
            deferred.inflight -= 1
            if not deferred.inflight:
                _deferral_lock.notify_all()

    def _set_file(self, key: str, value: Buffer) -> None:
        """Write the chunk (or metadata outside a deferral) ``key``, counted as running
        while it runs (in the thread that writes it: a cancelled task's thread runs on)."""
        deferred = self._writing(key)
        if deferred is None:
            self._put(key, value)
            return
        created = not os.path.lexists(os.path.join(self.root, key))
        try:
            self._put(key, value)
        finally:
            self._wrote(deferred, key, created)

    def _delete_file(self, key: str) -> None:
        deferred = self._writing(key)
        try:
            self._check_links(key.split("/")[:-1], key)
            super().delete_sync(key)
        finally:
            self._wrote(deferred, None, False)

    def set_sync(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        if not self._hold(key, value):
            self._set_file(key, value)

    def delete_sync(self, key: str) -> None:
        self.resolve(key)
        self._forget(key)
        self._delete_file(key)

    async def set(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        if not self._hold(key, value):
            await asyncio.to_thread(self._set_file, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        if not self._hold(key, value, keep=True):
            self._check_links(key.split("/")[:-1], key)
            await super().set_if_not_exists(key, value)
        elif not await self.exists(key):
            self._hold(key, value)

    async def delete(self, key: str) -> None:
        self.resolve(key)
        self._forget(key)
        await self._ensure_open()
        await asyncio.to_thread(self._delete_file, key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        prefix = prefix.rstrip("/")
        if prefix:
            self.resolve(prefix)
            self._check_links(prefix.split("/")[:-1], prefix)  # the prefix: remove_tree
        self._forget(prefix)
        path = self.root / prefix
        if path.is_dir():
            await asyncio.to_thread(_local.remove_tree, str(path))
        elif path.is_file():
            raise ValueError(f"delete_dir was given {prefix!r}, which is a file in {self}")

    async def clear(self) -> None:
        self._check_writable()
        if self._deferred is not None:
            self._deferred.keys.clear()

        def clear_root() -> None:
            _local.remove_tree(str(self.root))
            self.root.mkdir()

        await asyncio.to_thread(clear_root)

    async def exists(self, key: str) -> bool:
        self.resolve(key)
        if self._held(key) is not None:
            return True
        return await super().exists(key)

    async def getsize(self, key: str) -> int:
        self.resolve(key)
        held = self._held(key)
        if held is not None:
            return len(held)
        return await super().getsize(key)

    async def list(self) -> AsyncIterator[str]:
        async for key in self._and_held(super().list(), ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for key in self._and_held(super().list_prefix(prefix), prefix):
            yield key

    async def _and_held(self, on_disk: AsyncIterator[str], prefix: str) -> AsyncIterator[str]:
        """The keys of ``on_disk``, then the held keys below ``prefix`` not among them."""
        seen = set()
        async for key in on_disk:
            seen.add(key)
            yield key
        for key in self._held_keys(prefix):
            if key not in seen:
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        seen = set()
        async for name in super().list_dir(prefix):
            seen.add(name)
            yield name
        for key in self._held_keys(prefix):
            name = key[len(base) :].split("/", 1)[0]
            if name not in seen:
                seen.add(name)
                yield name

    def __repr__(self) -> str:
        return f"GdsStore('{self}')"

    def __str__(self) -> str:
        return f"file://{self.root.as_posix()}"

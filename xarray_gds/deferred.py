"""Metadata written after the data it describes: one write, held in one place.

:func:`xarray_gds.to_zarr` wraps every store it writes (a local directory's
:class:`~xarray_gds.stores.local.GdsStore`, a remote URL's store, an ``FsspecStore``, an
``ObjectStore``, a ``MemoryStore``; not an Icechunk session's, whose commit publishes a
write whole) in :class:`HeldMetadataStore` for the write. Chunks go to the store as
zarr writes them, each in one ``set`` (a file renamed into place; one PUT on S3:
whole or not at all). The metadata documents (``zarr.json``, ``.zarray``, ``.zattrs``,
``.zgroup``, ``.zmetadata``) are held in memory, served to the reads, listings and
existence checks of the write, and written at the end, after every chunk write still
running, arrays before their groups and consolidated metadata last: one level of
the hierarchy at a time, the documents of a level together (one trip through zarr's
event loop a level, and one to read the documents they replace).

The write holds the store's writer lock (:mod:`xarray_gds.stores.lock`: local directories
and memory stores) from the wrapper's making to its end, so a second writer of the
same store waits, then reads the metadata this one wrote.

If the write fails, the held metadata is dropped: the store opens as it did before.
Chunk writes of it still running are waited for, later ones are refused, and the
chunk objects it created are removed:

- Local directories and memory stores, where asking whether a key exists is cheap
  (one ``lstat``, one lookup): each chunk write records whether its key existed, and
  every chunk the write created goes (those of new arrays, those past the old end of
  an append, those of a region that held only the fill value), then the directories
  this leaves empty. A full disk leaves only the chunks the metadata references.
- Other stores (S3, HTTP, ``FsspecStore``, ``ObjectStore``), where asking costs a
  request a chunk: the chunks of arrays that did not exist before go; chunks the write
  added to existing arrays stay (past the old end of an append they are never read
  through the old metadata; a region's chunk that held only the fill value reads as
  written).

Chunks written in other processes (the workers of a ``distributed`` cluster that run
the tasks of a dask write, each with the store itself: see
:meth:`HeldMetadataStore.__reduce__`) are not recorded there: those of arrays that did
not exist before go, as for other stores, and a worker's chunk write still running when
the write fails is not refused.

Chunks the write replaced keep their new bytes in every case. If writing the metadata
itself fails, the documents it had already replaced are put back first. What an
object store does not guarantee stays so: the metadata documents are several objects,
and a reader that lists the store while they are written may see some new, some old.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any, Self

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, cpu, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import WrapperStore

from xarray_gds.stores import Source, WriterLock, source_for
from xarray_gds.stores.local import is_metadata_key
from xarray_gds.stores.lock import DEFAULT_TIMEOUT

__all__ = ["HeldMetadataStore"]


class _Write:
    """One write's state, shared by the stores that ``with_read_only`` makes."""

    def __init__(self, source: Source) -> None:
        self.source = source  #: the written store's kind: its lock, probes, clean-up
        #: orders chunk writes' bookkeeping against the end, which waits on it for the
        #: chunk writes still running
        self.cond = threading.Condition()
        self.keys: dict[str, Buffer] = {}  #: metadata documents not written yet
        self.holding = True  #: metadata is held (until flush or discard)
        self.failed = False  #: the write failed: later writes are refused
        self.probe = source.probes  #: chunk writes record whether their key existed
        self.written: set[str] = set()  #: chunk keys written meanwhile
        self.created: set[str] = set()  #: those of them that were not there (probe)
        self.running = 0  #: chunk writes and deletes running now
        self.writer: WriterLock | None = None  #: the store's writer lock, until the end
        self.sent = False  #: the store was pickled: chunk writes may run in other processes
        #: the write's tasks run in this process: a pickle is no copy for another one
        #: (dask pickles a write's target to name its tasks)
        self.here = False


def _slice(value: Buffer, byte_range: ByteRequest | None) -> bytes:
    data = value.to_bytes()
    if byte_range is None:
        return data
    if isinstance(byte_range, RangeByteRequest):
        return data[byte_range.start : byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return data[byte_range.offset :]
    if isinstance(byte_range, SuffixByteRequest):
        return data[len(data) - byte_range.suffix :]
    raise TypeError(f"unexpected byte_range, got {byte_range!r}")


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


def _tiers(keys: Iterable[str]) -> list[list[str]]:
    """The metadata ``keys`` in the order a flush writes them: tiers written one after
    the other, the deepest documents first (an array's before its group's), the
    consolidated ``.zmetadata`` of Zarr v2 after the root's; the documents of one tier
    are written together."""
    tiers: dict[tuple[int, bool], list[str]] = {}
    for key in sorted(keys):
        tiers.setdefault((-key.count("/"), key == ".zmetadata"), []).append(key)
    return [tiers[t] for t in sorted(tiers)]


class HeldMetadataStore(WrapperStore[Store]):
    """A zarr :class:`~zarr.storage.WrapperStore` over ``store`` whose metadata writes
    are held until :meth:`flush` (see the module). Chunk reads and writes go to
    ``store``; those of the write are counted while they run.

    Made, it takes the writer lock of ``store`` (a local or memory store: see
    :mod:`xarray_gds.stores.lock`), waiting at most ``lock_timeout`` seconds (``None``: no
    bound); :meth:`flush` or :meth:`discard` gives it back. Stores made from it by
    ``with_read_only`` share the write.

    Raises
    ------
    TimeoutError
        When another writer held the lock for ``lock_timeout`` seconds; it names the
        lock file and the writer holding it.
    """

    def __init__(
        self,
        store: Store,
        *,
        lock_timeout: float | None = DEFAULT_TIMEOUT,
        _write: _Write | None = None,
    ) -> None:
        super().__init__(store)
        if _write is None:
            _write = _Write(source_for(store))
            _write.writer = _write.source.writer_lock(lock_timeout)  # before zarr reads metadata
        self._write = _write

    @property
    def store(self) -> Store:
        """The store written."""
        return self._store

    @property
    def chunks_in(self) -> Store:
        """The store that holds the chunks (they are never held): that of the registry's
        kinds (:func:`xarray_gds.stores.source_for`)."""
        return self._store

    def _with_store(self, store: Store) -> Self:
        return type(self)(store, _write=self._write)

    # -- the write's end -----------------------------------------------------------------

    def flush(self) -> None:
        """Write the held metadata (arrays before their groups, consolidated last), after
        the chunk writes still running, and give the writer lock back.

        All of it or none: the documents in the store are read first, and when a write
        fails, those already replaced are put back (those that did not exist are
        deleted), and the chunks the write created are removed (see :meth:`discard`).

        Raises
        ------
        RuntimeError
            When putting the old metadata back failed as well; it names the keys that
            may now be inconsistent (the original error is its cause).
        """
        write = self._write
        try:
            keys = self._end(failed=False)
            tiers = _tiers(keys)
            before = self._get_all([k for tier in tiers for k in tier])
            done: list[str] = []
            try:
                for tier in tiers:
                    done.extend(tier)  # the failing writes too: they may have landed
                    sync(self._set_tier({k: keys[k] for k in tier}))
            except BaseException as err:
                with write.cond:
                    write.failed = True
                self._put_back(done, before, err)
                self._remove_created(keys, before)
                raise
        finally:
            self._release()

    def discard(self) -> None:
        """The write failed: drop the held metadata, wait for the chunk writes of it still
        running, refuse later ones, remove the chunk objects it created (see the module
        for which, by kind of store), and give the writer lock back."""
        try:
            keys = self._end(failed=True)
            self._remove_created(keys, self._get_all(list(keys)))
        finally:
            self._release()

    def _end(self, *, failed: bool) -> dict[str, Buffer]:
        """Stop holding metadata and wait for the chunk writes still running; returns
        the metadata held. From here on, chunk writes are not the write's own: written
        as usual after a success, refused after a failure (zarr lets the other writes
        of a failed gather run on, dask the other tasks: they write nothing)."""
        write = self._write
        with write.cond:
            write.holding = False
            write.failed = write.failed or failed
            keys, write.keys = write.keys, {}
            write.cond.wait_for(lambda: write.running == 0)
        return keys

    def _release(self) -> None:
        writer, self._write.writer = self._write.writer, None
        if writer is not None:
            writer.release()

    def _get_all(self, keys: list[str]) -> dict[str, bytes | None]:
        """The documents ``keys`` as the store holds them (``None``: absent), read
        together: one round trip through zarr's event loop, not one a key."""

        async def one(key: str) -> bytes | None:
            got = await self._store.get(key, default_buffer_prototype())
            return None if got is None else got.to_bytes()

        async def every() -> list[bytes | None]:
            return await asyncio.gather(*(one(k) for k in keys))

        return dict(zip(keys, sync(every()), strict=True))

    async def _set_tier(self, values: dict[str, Buffer]) -> None:
        """Write the documents of one tier together; every write has ended (landed or
        failed) when this returns, and the first failure is raised."""
        outcomes = await asyncio.gather(
            *(self._store.set(k, v) for k, v in values.items()), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def _put_back(
        self, keys: list[str], before: dict[str, bytes | None], err: BaseException
    ) -> None:
        """Put back the metadata ``keys`` as ``before`` holds them (deleting those it
        holds as ``None``), in reverse order of writing; ``err`` made it necessary."""
        stuck = []
        for key in reversed(keys):
            try:
                old = before[key]
                if old is None:
                    sync(self._store.delete(key))
                else:
                    sync(self._store.set(key, cpu.Buffer.from_bytes(old)))
            except Exception:
                stuck.append(key)
        if stuck:
            raise RuntimeError(
                f"xarray-gds: writing the metadata of {self._store} failed ({err!r}), and "
                f"putting back the previous metadata of {sorted(stuck)} failed too: the "
                "store may not open, or open with mismatched arrays. Restore those keys "
                "from a backup, or write the dataset again with mode='w'."
            ) from err

    def _remove_created(self, keys: dict[str, Buffer], before: dict[str, bytes | None]) -> None:
        """Delete the chunks of the failed write that ``before`` (the metadata in the
        store when the write began) does not reference: those it created (where
        recorded) and every chunk of arrays whose metadata (in ``keys``) is new. Then
        the directories this leaves empty, in a local store."""
        prefixes = tuple(
            key.rpartition("/")[0] + "/" if "/" in key else ""
            for key, value in keys.items()
            if before.get(key) is None and _is_array_metadata(key, value)
        )
        write = self._write
        with write.cond:
            doomed = set(write.created)
            if prefixes:
                doomed.update(k for k in write.written if k.startswith(prefixes))
            sent = write.sent
        if sent and prefixes:  # chunks other processes wrote: found by listing
            doomed.update(sync(self._listed(prefixes)))
        doomed = {k for k in doomed if not is_metadata_key(k)}

        async def delete_all() -> None:
            await asyncio.gather(*(self._store.delete(k) for k in doomed))

        sync(delete_all())
        write.source.after_failed_write(doomed)

    async def _listed(self, prefixes: tuple[str, ...]) -> set[str]:
        """The keys in the store below any of ``prefixes``."""
        private = set(self._write.source.private_keys)
        found: set[str] = set()
        for prefix in set(prefixes):
            async for key in self._store.list_prefix(prefix):
                if key not in private:
                    found.add(key)
        return found

    # -- writes --------------------------------------------------------------------------

    def _hold(self, key: str, value: Buffer) -> bool:
        """Hold ``value`` for the metadata key ``key`` while the write holds metadata;
        False when ``key`` is written as usual."""
        if not is_metadata_key(key):
            return False
        write = self._write
        with write.cond:
            if not write.holding:
                return False
            self._check_writable()
            write.keys[key] = value
            return True

    def _forget(self, key: str) -> None:
        """Drop the held ``key`` and the held keys below it (``key`` as a directory)."""
        write = self._write
        with write.cond:
            write.keys.pop(key, None)
            for held in self._held_below(key):
                del write.keys[held]

    def _starting(self, key: str) -> _Write | None:
        """Note a chunk write or delete of ``key`` starting; returns the write it belongs
        to (its end waits for :meth:`_over`), None once the write succeeded.

        Raises
        ------
        RuntimeError
            When the write failed: what is left of it writes nothing.
        """
        write = self._write
        with write.cond:
            if write.failed:
                raise RuntimeError(
                    f"xarray-gds: not writing {key!r} in {self._store}: the write it belongs "
                    "to failed and was cleaned up. Run the write again."
                )
            if not write.holding:
                return None
            write.running += 1
            return write

    @staticmethod
    def _over(write: _Write | None, key: str | None, created: bool) -> None:
        """The write of ``key`` (``None``: a delete) noted by :meth:`_starting` is over;
        ``created``: there was nothing at ``key`` before it."""
        if write is None:
            return
        with write.cond:
            if key is not None:
                write.written.add(key)
                if created:
                    write.created.add(key)
            write.running -= 1
            if not write.running:
                write.cond.notify_all()

    def _existed(self, key: str) -> bool:
        """Whether the store holds ``key`` (asked synchronously, of probed stores only)."""
        return self._write.source.existed(key)

    def _sync_store(self) -> Any:
        if not hasattr(self._store, "set_sync"):
            raise TypeError(f"Store {type(self._store).__name__} does not support synchronous IO.")
        return self._store

    def _set_counted(self, key: str, value: Buffer) -> None:
        """Write the chunk ``key`` through the synchronous API, counted while it runs."""
        write = self._starting(key)
        created = False
        try:
            created = write is not None and write.probe and not self._existed(key)
            self._sync_store().set_sync(key, value)
        finally:
            self._over(write, key, created)

    def _delete_counted(self, key: str) -> None:
        write = self._starting(key)
        try:
            self._sync_store().delete_sync(key)
        finally:
            self._over(write, None, False)

    def set_sync(self, key: str, value: Buffer) -> None:
        """Write ``key`` now, in this thread (the batched writer's threads call it)."""
        if not self._hold(key, value):
            self._set_counted(key, value)

    def delete_sync(self, key: str) -> None:
        """Delete ``key`` now, in this thread."""
        self._forget(key)
        self._delete_counted(key)

    async def set(self, key: str, value: Buffer) -> None:
        if self._hold(key, value):
            return
        if self._write.source.writes_in_threads:
            # counted in the thread that writes: a cancelled task's thread runs on
            await asyncio.to_thread(self._set_counted, key, value)
            return
        write = self._starting(key)
        created = False
        try:
            created = write is not None and write.probe and not await self._store.exists(key)
            await self._store.set(key, value)
        finally:
            self._over(write, key, created)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        await asyncio.gather(*(self.set(k, v) for k, v in values))

    async def delete(self, key: str) -> None:
        self._forget(key)
        if self._write.source.writes_in_threads:
            await asyncio.to_thread(self._delete_counted, key)
            return
        write = self._starting(key)
        try:
            await self._store.delete(key)
        finally:
            self._over(write, None, False)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        self._forget(prefix.rstrip("/"))
        await self._write.source.delete_dir(prefix)  # the writer lock file kept

    async def clear(self) -> None:
        self._check_writable()
        with self._write.cond:
            self._write.keys.clear()
        await self._write.source.clear()

    # -- reads ---------------------------------------------------------------------------

    def _held(self, key: str) -> Buffer | None:
        write = self._write
        return write.keys.get(key) if write.holding else None

    def _held_below(self, prefix: str) -> list[str]:
        """Held keys below the directory ``prefix`` (all of them for ``""``)."""
        write = self._write
        if not write.holding:
            return []
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        return [k for k in write.keys if k.startswith(base)]

    def get_sync(self, key: str, **options: Any) -> Buffer | None:
        """Read ``key`` now, in this thread (``options``: ``prototype``, ``byte_range``)."""
        held = self._held(key)
        if held is not None:  # metadata: in host memory, as stores return it
            return cpu.Buffer.from_bytes(_slice(held, options.get("byte_range")))
        return self._sync_store().get_sync(key, **options)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        held = self._held(key)
        if held is not None:
            return cpu.Buffer.from_bytes(_slice(held, byte_range))
        return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        if not any(self._held(k) is not None for k, _ in key_ranges):
            return await self._store.get_partial_values(prototype, key_ranges)
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def _get_many(
        self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
    ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        for key, prototype, byte_range in requests:
            yield key, await self.get(key, prototype, byte_range)

    async def exists(self, key: str) -> bool:
        return self._held(key) is not None or await self._store.exists(key)

    async def getsize(self, key: str) -> int:
        held = self._held(key)
        return len(held) if held is not None else await self._store.getsize(key)

    async def is_empty(self, prefix: str) -> bool:
        return not self._held_below(prefix) and await self._store.is_empty(prefix)

    async def list(self) -> AsyncIterator[str]:
        async for key in self._and_held(self._store.list(), ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for key in self._and_held(self._store.list_prefix(prefix), prefix):
            yield key

    async def _and_held(self, stored: AsyncIterator[str], prefix: str) -> AsyncIterator[str]:
        """The keys of ``stored`` (the write side's own left out), then the held keys
        below ``prefix`` not among them."""
        seen = set(self._write.source.private_keys)
        async for key in stored:
            if key not in seen:
                seen.add(key)
                yield key
        for key in self._held_below(prefix):
            if key not in seen:
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        seen = set() if base else set(self._write.source.private_keys)
        async for name in self._store.list_dir(prefix):
            if name not in seen:
                seen.add(name)
                yield name
        for key in self._held_below(prefix):
            name = key[len(base) :].split("/", 1)[0]
            if name not in seen:
                seen.add(name)
                yield name

    # -- identity ------------------------------------------------------------------------

    async def _open(self) -> None:
        await self._store._ensure_open()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (to run the chunk writes of a dask write in a ``distributed`` worker
        process): the store written itself. Chunk writes are all a worker does with it
        (the zarr arrays in the tasks have their metadata already), and they go to the
        store as this wrapper sends them; the metadata stays held here, written after
        the tasks are done. The writer lock, the held documents and the bookkeeping stay
        in this process (see the module for what a failed write removes then)."""
        with self._write.cond:
            self._write.sent = not self._write.here
        return (_same, (self._store,))

    def runs_here(self) -> None:
        """Say that every task of this write runs in this process (dask's threads, or
        none): a failed write then removes the chunks it recorded, never by listing."""
        with self._write.cond:
            self._write.here = True

    def __copy__(self) -> Self:
        return self._with_store(self._store)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self._with_store(self._store)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldMetadataStore) and other._store == self._store

    def __hash__(self) -> int:
        return id(self._write)

    def __repr__(self) -> str:
        return f"HeldMetadataStore({self._store!r})"

    def __str__(self) -> str:
        return str(self._store)


def _same(store: Store) -> Store:
    """``store`` (what a pickled :class:`HeldMetadataStore` unpickles to)."""
    return store

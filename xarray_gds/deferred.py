"""Metadata written after the data it describes, for any zarr Store (S3, HTTP, memory).

:func:`xarray_gds.to_zarr` writes local stores through :class:`~xarray_gds.store.GdsStore`,
which holds metadata back itself. Any other store (a remote URL, an ``FsspecStore``, an
``ObjectStore``) is wrapped in :class:`HeldMetadataStore` for the write: chunk objects
go to the store as zarr writes them, each in one ``set`` (one PUT on S3: whole or not
at all), and the metadata documents (``zarr.json``, ``.zarray``, ``.zattrs``, ``.zgroup``,
``.zmetadata``) are held in memory, served to the reads and listings of the write, and
written at the end, arrays before their groups and consolidated metadata last. If the
write fails, the metadata is dropped, so the store opens as it did before, and the chunks
written for arrays that did not exist before are deleted. If writing the metadata itself
fails, the documents it had already replaced are put back first.

What an object store does not guarantee stays so: the metadata documents are several
objects, and a reader that lists the store while they are being written may see some of
them new and some old.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterable

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.sync import sync

from xarray_gds.locking import DEFAULT_TIMEOUT, WriterLock, writer_lock
from xarray_gds.store import _is_array_metadata, is_metadata_key

__all__ = ["HeldMetadataStore"]


class _Held:
    """What a deferral holds; shared by the stores ``with_read_only`` makes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[str, Buffer] = {}  #: metadata documents not written yet
        self.written: set[str] = set()  #: chunk keys written meanwhile
        self.active = True
        self.dropped: tuple[str, ...] = ()  #: prefixes of new arrays of a failed write
        self.writer: WriterLock | None = None  #: the store's writer lock, until the end


def _slice(value: Buffer, byte_range: ByteRequest | None) -> Buffer:
    if byte_range is None:
        return value
    from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

    if isinstance(byte_range, RangeByteRequest):
        return value[byte_range.start : byte_range.end]
    if isinstance(byte_range, OffsetByteRequest):
        return value[byte_range.offset :]
    if isinstance(byte_range, SuffixByteRequest):
        return value[len(value) - byte_range.suffix :]
    raise TypeError(f"unexpected byte_range, got {byte_range!r}")


class HeldMetadataStore(Store):
    """A zarr Store over ``store`` whose metadata writes are held until :meth:`flush`
    (see the module). Chunk reads and writes go straight to ``store``.

    Made without ``held``, it takes the writer lock of ``store`` (a local or memory
    store: see :mod:`xarray_gds.locking`), waiting at most ``lock_timeout`` seconds;
    :meth:`flush` or :meth:`discard` gives it back.
    """

    supports_partial_writes = False

    def __init__(
        self,
        store: Store,
        held: _Held | None = None,
        *,
        lock_timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(read_only=store.read_only)
        self.store = store
        if held is None:
            held = _Held()
            held.writer = writer_lock(store, lock_timeout)
        self._state = held

    def _release(self) -> None:
        writer, self._state.writer = self._state.writer, None
        if writer is not None:
            writer.release()

    # -- the write's life ----------------------------------------------------------------

    def flush(self) -> None:
        """Write the held metadata (arrays before their groups, consolidated last). All of
        it or none: on failure the documents already written are put back as they were
        (those that did not exist are deleted), and the new arrays' chunks are deleted.

        Raises
        ------
        RuntimeError
            When putting the old metadata back failed as well, naming those keys.
        """
        state = self._state
        with state.lock:
            state.active = False
            keys = dict(state.keys)
        order = sorted(keys, key=lambda k: (-k.count("/"), k == ".zmetadata", k))
        before = {k: self._get_bytes(k) for k in order}
        done: list[str] = []
        try:
            for key in order:
                done.append(key)  # the failing write too: it may have landed
                sync(self.store.set(key, keys[key]))
        except BaseException as err:
            stuck = self._put_back(done, before)
            self._drop_new_arrays(keys, before)
            if stuck:
                raise RuntimeError(
                    f"xarray-gds: writing the metadata of {self.store} failed ({err!r}), and "
                    f"putting back the previous metadata of {sorted(stuck)} failed too: the "
                    "store may not open, or open with mismatched arrays. Restore those keys "
                    "from a backup, or write the dataset again with mode='w'."
                ) from err
            raise
        finally:
            state.keys.clear()
            self._release()

    def discard(self) -> None:
        """The write failed: drop the held metadata and delete the chunks it wrote for
        arrays that did not exist before (and those that land later)."""
        state = self._state
        with state.lock:
            state.active = False
            keys = dict(state.keys)
            state.keys.clear()
        try:
            self._drop_new_arrays(keys, {k: self._get_bytes(k) for k in keys})
        finally:
            self._release()

    def _get_bytes(self, key: str) -> bytes | None:
        got = sync(self.store.get(key, default_buffer_prototype()))
        return None if got is None else got.to_bytes()

    def _put_back(self, keys: list[str], before: dict[str, bytes | None]) -> list[str]:
        stuck = []
        for key in reversed(keys):
            try:
                old = before[key]
                if old is None:
                    sync(self.store.delete(key))
                else:
                    sync(self.store.set(key, default_buffer_prototype().buffer.from_bytes(old)))
            except Exception:
                stuck.append(key)
        return stuck

    def _drop_new_arrays(self, keys: dict[str, Buffer], before: dict[str, bytes | None]) -> None:
        prefixes = tuple(
            key.rpartition("/")[0] + "/" if "/" in key else ""
            for key, value in keys.items()
            if before.get(key) is None and _is_array_metadata(key, value)
        )
        state = self._state
        with state.lock:
            state.dropped = prefixes
            doomed = [k for k in state.written if prefixes and k.startswith(prefixes)]
        for key in doomed:
            sync(self.store.delete(key))

    # -- Store ---------------------------------------------------------------------------

    def _held(self, key: str) -> Buffer | None:
        state = self._state
        return state.keys.get(key) if state.active else None

    def _held_below(self, prefix: str) -> list[str]:
        state = self._state
        if not state.active:
            return []
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        return [k for k in state.keys if k.startswith(base)]

    def _forget(self, prefix: str) -> None:
        with self._state.lock:
            self._state.keys.pop(prefix, None)
            for key in self._held_below(prefix):
                del self._state.keys[key]

    async def _open(self) -> None:
        await self.store._ensure_open()
        self._is_open = True

    def with_read_only(self, read_only: bool = False) -> HeldMetadataStore:
        return HeldMetadataStore(self.store.with_read_only(read_only), self._state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldMetadataStore) and other.store == self.store

    def __hash__(self) -> int:
        return id(self._state)

    def __repr__(self) -> str:
        return f"HeldMetadataStore({self.store!r})"

    def __str__(self) -> str:
        return str(self.store)

    @property
    def supports_writes(self) -> bool:
        return self.store.supports_writes

    @property
    def supports_deletes(self) -> bool:
        return self.store.supports_deletes

    @property
    def supports_listing(self) -> bool:
        return self.store.supports_listing

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        held = self._held(key)
        if held is not None:
            return prototype.buffer.from_bytes(_slice(held, byte_range).to_bytes())
        return await self.store.get(key, prototype, byte_range)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return [await self.get(k, prototype, r) for k, r in key_ranges]

    async def exists(self, key: str) -> bool:
        return self._held(key) is not None or await self.store.exists(key)

    async def getsize(self, key: str) -> int:
        held = self._held(key)
        return len(held) if held is not None else await self.store.getsize(key)

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        state = self._state
        with state.lock:
            if state.active and is_metadata_key(key):
                state.keys[key] = value
                return
            state.written.add(key)
        await self.store.set(key, value)
        if state.dropped and key.startswith(state.dropped) and not is_metadata_key(key):
            await self.store.delete(key)  # landed after its failed write cleaned up

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        if not await self.exists(key):
            await self.set(key, value)

    async def delete(self, key: str) -> None:
        self._check_writable()
        self._forget(key)
        await self.store.delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        self._forget(prefix.rstrip("/"))
        await self.store.delete_dir(prefix)

    async def clear(self) -> None:
        self._check_writable()
        with self._state.lock:
            self._state.keys.clear()
        await self.store.clear()

    async def set_partial_values(
        self, key_start_values: Iterable[tuple[str, int, bytes]]
    ) -> None:  # pragma: no cover - supports_partial_writes is False
        raise NotImplementedError

    async def list(self) -> AsyncIterator[str]:
        async for key in self._and_held(self.store.list(), ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for key in self._and_held(self.store.list_prefix(prefix), prefix):
            yield key

    async def _and_held(self, stored: AsyncIterator[str], prefix: str) -> AsyncIterator[str]:
        seen = set()
        async for key in stored:
            seen.add(key)
            yield key
        for key in self._held_below(prefix):
            if key not in seen:
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        seen = set()
        async for name in self.store.list_dir(prefix):
            seen.add(name)
            yield name
        for key in self._held_below(prefix):
            name = key[len(base) :].split("/", 1)[0]
            if name not in seen:
                seen.add(name)
                yield name

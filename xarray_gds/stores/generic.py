"""Any other zarr Store (``LocalStore``'s neighbours: ``MemoryStore``, ``FsspecStore``,
``ObjectStore``, ...): chunk bytes through the store's own ``get`` and ``get_ranges``,
every key of a batch in flight at once on zarr's event loop, then (on the device) one
copy into an arena. :class:`StoreSource` is the registry's last kind: it claims every
store. :class:`MemorySource` adds a memory store's write side (a lock of the process,
cheap existence checks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xarray_gds import config
from xarray_gds._optional import need
from xarray_gds.batch import Fetched
from xarray_gds.stores.base import Opened, Ranges, Source, WriterLock, on_side
from xarray_gds.stores.lock import ProcessLock

__all__ = ["MemorySource", "StoreSource"]


class StoreSource(Source):
    """Keys of any zarr Store, read through its own ``get``."""

    ranged_reads = True
    sizes = True
    writes = True

    @classmethod
    def claims(cls, store: Any) -> bool:
        from zarr.abc.store import Store

        return isinstance(store, Store)

    @classmethod
    def opens(cls, target: Any) -> bool:
        """A zarr Store (opened as it is), or a URL no other kind opens."""
        return cls.claims(target) or (isinstance(target, str) and "://" in target)

    @classmethod
    def open(
        cls,
        target: Any,
        *,
        mode: str,
        storage_options: dict[str, Any] | None,
        consolidated: bool | None = None,
    ) -> Opened:
        if not isinstance(target, str):
            return Opened(target, storage_options, consolidated)  # a Store opens as it is
        if not mode.startswith("w"):
            raise ValueError(
                f"engine='gds-zarr' reads local directories and s3://, http:// and https:// "
                f"URLs, got {target!r}; for other remote stores pass a zarr Store object, e.g. "
                f"zarr.storage.FsspecStore.from_url({target!r}, storage_options=..., "
                "read_only=True)"
            )
        scheme = target.split("://", 1)[0]
        need("fsspec", f"writing to {scheme}:// URLs", "remote")
        from zarr.storage import FsspecStore  # writes go where fsspec takes the URL

        store = FsspecStore.from_url(target, storage_options=storage_options, read_only=False)
        return Opened(store, None, consolidated)

    @classmethod
    def read_all(
        cls, sources: Sequence[Any], locations: list[Any], on_device: bool, slots: Any
    ) -> Fetched:
        import zarr
        from zarr.core.buffer import cpu
        from zarr.core.common import concurrent_map
        from zarr.core.sync import sync

        async def one(i: int) -> Any:
            got = await sources[i].store.get(locations[i], prototype=cpu.buffer_prototype)
            return None if got is None else np.asarray(got.as_numpy_array()).view(np.uint8)

        async def every() -> list[Any]:  # as many in flight as zarr allows (async.concurrency)
            limit = zarr.config.get("async.concurrency")
            return list(await concurrent_map([(i,) for i in range(len(locations))], one, limit))

        found: list[np.ndarray | None] = sync(every())
        return on_side(found, on_device)

    @classmethod
    def read_ranges_all(
        cls, sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """Byte ranges of keys through each store's ``get_ranges`` (zarr's own joining
        of ranges: those of one key less than ``xarray_gds.range_gap`` bytes apart are
        read as one request, the inner chunks of a shard most often), every key in
        flight at once. A key that is missing reads as missing ranges."""
        import zarr
        from zarr.core.common import concurrent_map
        from zarr.core.sync import sync

        found: list[np.ndarray | None] = [None] * len(locations)
        keys: dict[tuple[int, str], list[int]] = {}
        for i, location in enumerate(locations):
            keys.setdefault((id(sources[i].store), location), []).append(i)

        async def one(members: list[int]) -> None:
            store, key = sources[members[0]].store, locations[members[0]]
            await _get_ranges(store, key, members, ranges, found)

        async def every() -> None:
            limit = zarr.config.get("async.concurrency")
            await concurrent_map([(m,) for m in keys.values()], one, limit)

        sync(every())
        return on_side(found, on_device)


async def _get_ranges(
    store: Any, key: str, members: list[int], ranges: Ranges, found: list[np.ndarray | None]
) -> None:
    """The ranges ``members`` of ``key`` through ``store.get_ranges``, into ``found``."""
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import cpu

    starts, sizes = ranges
    gap = int(config.get("range_gap"))
    wanted = [RangeByteRequest(int(starts[i]), int(starts[i]) + int(sizes[i])) for i in members]
    try:
        async for got in store.get_ranges(
            key, wanted, prototype=cpu.buffer_prototype, max_gap_bytes=gap
        ):
            for j, buf in got:
                if buf is not None:
                    found[members[j]] = _exactly(buf, key, wanted[j])
    except* FileNotFoundError:  # the key is gone: its ranges are missing
        for i in members:
            found[i] = None


def _exactly(buf: Any, key: str, asked: Any) -> np.ndarray:
    """The bytes of a range read, checked to be as many as asked for: a range past the
    object's end is an error naming the key, never shorter data."""
    data = np.asarray(buf.as_numpy_array()).view(np.uint8)
    if data.size != asked.end - asked.start:
        raise OSError(
            f"short read of {key!r}: got {data.size} of the {asked.end - asked.start} bytes "
            f"at {asked.start}; the object is shorter than its index says (damaged or "
            "rewritten while it was read)"
        )
    return data


class MemorySource(StoreSource):
    """A zarr ``MemoryStore``: read as any store; written under a lock of the process
    (a memory store is not shared between processes), with cheap existence checks."""

    locking = True
    probes = True

    @classmethod
    def claims(cls, store: Any) -> bool:
        from zarr.storage import MemoryStore

        return isinstance(store, MemoryStore)

    def writer_lock(self, timeout: float | None) -> WriterLock | None:
        # memory://<id of its dict>: shared by the store's copies
        return ProcessLock(str(self.store), self.store).acquire(timeout)

"""Where the read engine gets chunk bytes: one small interface, a source per kind of store.

A :class:`Source` turns chunk keys into *locations* (what its reads need: a file path,
or the key itself) and reads a batch of locations whole, into device memory (one
:class:`~xarray_gds.batch.DeviceBatch`) or host memory (a list of uint8 arrays,
``None`` for a missing chunk). The engine (:mod:`xarray_gds.coalesce`) joins the
requests of many threads and arrays into one read per kind of source:

- :class:`LocalSource`, for a :class:`~xarray_gds.store.GdsStore`: files read by
  kvikio into one device arena (GPUDirect Storage or kvikio's compat mode), or by the
  host pool's ``preadv`` calls. The files of every local store in a batch are read
  together.
- :class:`StoreSource`, for any other zarr Store (``LocalStore``, ``MemoryStore``,
  ``FsspecStore``, ``ObjectStore``...): the store's own ``get``, every key of a batch
  in flight at once on zarr's event loop, then (on the device) one copy into an arena.
- :class:`ReferenceSource`, for a :class:`~xarray_gds.refs.ReferenceStore` (kerchunk
  references into NetCDF4/HDF5 files): byte ranges of the files, read as local ones.

A remote source with device reads (kvikio's ``RemoteFile``) is one more class here; the
engine does not change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xarray_gds import config
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch, Fetched, HostBatch, offload

__all__ = [
    "LocalSource",
    "ReferenceSource",
    "RemoteSource",
    "Source",
    "StoreSource",
    "join",
    "merge_ranges",
    "read",
    "source_for",
]


#: byte ranges to read: ``(starts, sizes)``, one of each a location
Ranges = tuple[np.ndarray, np.ndarray]


class Source:
    """Chunk bytes of one store: every read the engine makes goes through a source.

    Sources move bytes and nothing else (no decoding). A read of many locations takes
    the sources that hold them (``sources[i]`` holds ``locations[i]``), so that one call
    reads the locations of several stores of the same ``kind`` together.
    """

    #: sources with the same ``kind`` are read in one call of :meth:`read_all`
    kind: str = "store"

    def __init__(self, store: Any) -> None:
        self.store = store

    def locate(self, keys: list[str]) -> list[Any]:
        """What a read of each key needs (checked as the store checks keys)."""
        return list(keys)

    @staticmethod
    def read_all(
        sources: Sequence[Any], locations: list[Any], on_device: bool, slots: np.ndarray | None
    ) -> Fetched:
        """Every location, read whole: a DeviceBatch when ``on_device`` (``slots``: the
        bytes each may take in the arena), else a HostBatch (``None`` where missing)."""
        raise NotImplementedError

    @staticmethod
    def read_ranges_all(
        sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """``sizes[i]`` bytes at ``starts[i]`` of every location (``ranges``: starts
        and sizes; shards' inner chunks): a DeviceBatch when ``on_device``, else a
        HostBatch."""
        raise NotImplementedError

    def read_one(self, location: Any) -> np.ndarray | None:
        """One location, whole, on the host (``None`` where missing): the reads of
        chunks streamed one by one (:func:`xarray_gds.coalesce._serve_streamed`)."""
        found = self.read_all([self], [location], False, None)
        assert isinstance(found, HostBatch)
        return found[0]

    async def read_end(self, key: str, nbytes: int, at_end: bool) -> tuple[np.ndarray, int] | None:
        """The last (``at_end``) or first ``nbytes`` bytes of ``key`` (a shard's index)
        as a uint8 array, and the size of the whole object; ``None`` where it is
        missing. Through the store's own ``get`` and ``getsize``."""
        from zarr.abc.store import RangeByteRequest, SuffixByteRequest
        from zarr.core.buffer import cpu

        request = SuffixByteRequest(nbytes) if at_end else RangeByteRequest(0, nbytes)
        buf = await self.store.get(key, prototype=cpu.buffer_prototype, byte_range=request)
        if buf is None:
            return None
        raw = np.asarray(buf.as_numpy_array()).view(np.uint8)
        return raw, int(await self.store.getsize(key))


class LocalSource(Source):
    """Files of a :class:`~xarray_gds.store.GdsStore`."""

    kind = "local"

    def locate(self, keys: list[str]) -> list[Any]:
        return list(self.store.chunk_paths(keys))

    @staticmethod
    def read_all(
        sources: Sequence[Any], locations: list[Any], on_device: bool, slots: np.ndarray | None
    ) -> Fetched:
        from xarray_gds.io.local import read_files_device, read_files_host

        if not on_device:
            return HostBatch(read_files_host(locations))
        return read_files_device(locations, slots)

    @staticmethod
    def read_ranges_all(
        sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """``sizes[i]`` bytes at ``starts[i]`` of every location (shards' inner chunks):
        a DeviceBatch when ``on_device``, else a list of arrays."""
        starts, sizes = ranges
        from xarray_gds.io.local import read_ranges_device, read_ranges_host

        if not on_device:
            return HostBatch(read_ranges_host(locations, starts, sizes))
        return read_ranges_device(locations, starts, sizes)

    def read_one(self, location: Any) -> np.ndarray | None:
        from xarray_gds.io.local import read_file

        return read_file(location)

    async def read_end(self, key: str, nbytes: int, at_end: bool) -> tuple[np.ndarray, int] | None:
        """As :meth:`Source.read_end`, with one open, one ``fstat`` and one ``pread`` of
        the file, in the engine's threads."""
        from xarray_gds.io.local import read_end

        path = str(self.store.resolve(key))
        return await asyncio.wrap_future(offload(read_end, path, nbytes, at_end))


class StoreSource(Source):
    """Keys of any zarr Store, read through its own ``get``."""

    kind = "store"

    @staticmethod
    def read_all(
        sources: Sequence[Any], locations: list[Any], on_device: bool, slots: np.ndarray | None
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
        return _on_side(found, on_device)

    @staticmethod
    def read_ranges_all(
        sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """Byte ranges of keys through each store's ``get_ranges`` (zarr's own joining
        of ranges: those of one key less than ``xarray_gds.range_gap`` bytes apart are
        read as one request, the inner chunks of a shard most often), every key in
        flight at once. A key that is missing reads as missing ranges."""
        import zarr
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import cpu
        from zarr.core.common import concurrent_map
        from zarr.core.sync import sync

        starts, sizes = ranges
        gap = int(config.get("range_gap"))
        found: list[np.ndarray | None] = [None] * len(locations)
        keys: dict[tuple[int, str], list[int]] = {}
        for i, location in enumerate(locations):
            keys.setdefault((id(sources[i].store), location), []).append(i)

        async def one(members: list[int]) -> None:
            store, key = sources[members[0]].store, locations[members[0]]
            wanted = [
                RangeByteRequest(int(starts[i]), int(starts[i]) + int(sizes[i])) for i in members
            ]
            try:
                async for got in store.get_ranges(
                    key, wanted, prototype=cpu.buffer_prototype, max_gap_bytes=gap
                ):
                    for j, buf in got:
                        if buf is not None:
                            found[members[j]] = np.asarray(buf.as_numpy_array()).view(np.uint8)
            except* FileNotFoundError:  # the key is gone: its ranges are missing
                for i in members:
                    found[i] = None

        async def every() -> None:
            limit = zarr.config.get("async.concurrency")
            await concurrent_map([(m,) for m in keys.values()], one, limit)

        sync(every())
        return _on_side(found, on_device)


def _read_joined(
    sources: Sequence[Any],
    locations: list[Any],
    starts: np.ndarray,
    sizes: np.ndarray,
    get: Callable[[list[int], np.ndarray, np.ndarray], list[Any]],
) -> list[np.ndarray | None]:
    """Byte ranges read as the joined requests of :func:`merge_ranges` (ranges less
    than ``xarray_gds.range_gap`` apart); ``get(picked, starts, sizes)`` reads the
    joined spans (``picked[k]``: a member whose location and store span ``k`` reads),
    and each range is its own slice (a view) of its span."""
    spans = merge_ranges(sources, locations, starts, sizes, config.get("range_gap"))
    picked = [first for first, _, _, _ in spans]
    span_starts = np.array([start for _, start, _, _ in spans], dtype=np.int64)
    span_sizes = np.array([end - start for _, start, end, _ in spans], dtype=np.int64)
    found: list[np.ndarray | None] = [None] * len(locations)
    for (_, start, _, members), data in zip(
        spans, get(picked, span_starts, span_sizes), strict=True
    ):
        if data is None:
            continue
        for i in members:
            at = int(starts[i]) - start
            found[i] = data[at : at + int(sizes[i])]
    return found


def merge_ranges(
    sources: Sequence[Any],
    locations: Sequence[Any],
    starts: np.ndarray,
    sizes: np.ndarray,
    gap: int,
) -> list[tuple[int, int, int, list[int]]]:
    """Requests for byte ranges ``[starts[i], starts[i] + sizes[i])`` of
    ``locations[i]``: ``(first, start, end, members)``, one for each run of ranges of
    the same location and store that are less than ``gap`` bytes apart (overlapping
    ranges included); ``first`` is a member whose location and store the request
    reads. ``gap`` 0 merges only ranges that touch or overlap."""
    order = sorted(
        range(len(locations)),
        key=lambda i: (id(sources[i].store), str(locations[i]), int(starts[i])),
    )
    spans: list[tuple[int, int, int, list[int]]] = []
    for i in order:
        start, end = int(starts[i]), int(starts[i]) + int(sizes[i])
        if spans:
            first, s0, e0, members = spans[-1]
            same = sources[first].store is sources[i].store and locations[first] == locations[i]
            if same and start <= e0 + gap:
                members.append(i)
                spans[-1] = (first, s0, max(e0, end), members)
                continue
        spans.append((i, start, end, [i]))
    return spans


def _on_side(found: list[np.ndarray | None], on_device: bool) -> Fetched:
    """Host arrays as a read returns them: as they are, or packed into one arena."""
    if not on_device:
        return HostBatch(found)
    from xarray_gds.batch import pack

    return pack([None if a is None else _device.cupy().asarray(a) for a in found])


class RemoteSource(StoreSource):
    """Objects of a remote fsspec store (S3, HTTP(S)): on the host through the store's
    ``get`` with bounded retries of transient faults (:func:`xarray_gds.remote.read_host`),
    on the device through kvikio's ``RemoteFile`` straight into the arena
    (:func:`xarray_gds.remote.read_device`)."""

    kind = "remote"

    @staticmethod
    def read_all(
        sources: Sequence[Any], locations: list[Any], on_device: bool, slots: np.ndarray | None
    ) -> Fetched:
        from xarray_gds import remote

        if not on_device:
            return HostBatch(remote.read_host([s.store for s in sources], list(locations)))
        return remote.read_device([s.store for s in sources], list(locations))

    @staticmethod
    def read_ranges_all(
        sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """Byte ranges of objects (inner chunks of shards), with the retries of
        :meth:`read_all`; a range that comes back short is an error, never data. Ranges
        less than ``xarray_gds.range_gap`` apart are read as one; on the device by kvikio
        (one handle an object), then each range copied to its own aligned slot."""
        starts, sizes = ranges
        from xarray_gds import remote

        if on_device:
            return _device_ranges(sources, locations, starts, sizes)

        def get(picked: list[int], span_starts: np.ndarray, span_sizes: np.ndarray) -> list[Any]:
            stores = [sources[i].store for i in picked]
            return remote.read_host(
                stores, [locations[i] for i in picked], (span_starts, span_sizes)
            )

        return _on_side(_read_joined(sources, locations, starts, sizes, get), on_device)


def _device_ranges(
    sources: Sequence[Any], locations: list[Any], starts: np.ndarray, sizes: np.ndarray
) -> DeviceBatch:
    """:meth:`RemoteSource.read_ranges_all` on the device: the joined spans read by kvikio
    into one arena, then every range copied out to an aligned slot of another (nvCOMP
    reads aligned inputs)."""
    from xarray_gds import remote
    from xarray_gds.batch import pack_offsets

    cp = _device.cupy()
    spans = merge_ranges(sources, locations, starts, sizes, config.get("range_gap"))
    got = remote.read_device(
        [sources[first].store for first, _, _, _ in spans],
        [locations[first] for first, _, _, _ in spans],
        ranges=(
            np.array([start for _, start, _, _ in spans], dtype=np.int64),
            np.array([end - start for _, start, end, _ in spans], dtype=np.int64),
        ),
    )
    out_sizes = np.full(len(locations), -1, dtype=np.int64)
    source_at = np.zeros(len(locations), dtype=np.int64)
    for k, (_, start, _, members) in enumerate(spans):
        if got.sizes[k] < 0:
            continue
        for i in members:
            out_sizes[i] = sizes[i]
            source_at[i] = int(got.offsets[k]) + int(starts[i]) - start
    offsets, total = pack_offsets(out_sizes)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    for i in np.flatnonzero(out_sizes > 0).tolist():
        size, at = int(out_sizes[i]), int(offsets[i])
        arena[at : at + size] = got.arena[int(source_at[i]) : int(source_at[i]) + size]
    return DeviceBatch(arena, offsets, out_sizes)


class ReferenceSource(Source):
    """Chunks of a virtual Zarr store (:class:`~xarray_gds.refs.ReferenceStore`, kerchunk
    references): byte ranges of the NetCDF4/HDF5 files they point at, read by kvikio
    into one device arena or by ``pread`` on the host, and inline chunks."""

    kind = "refs"

    def locate(self, keys: list[str]) -> list[Any]:
        resolve = self.store.resolve
        return [resolve(key) for key in keys]

    @staticmethod
    def read_all(
        sources: Sequence[Any], locations: list[Any], on_device: bool, slots: np.ndarray | None
    ) -> Fetched:
        from xarray_gds.refs import read_references

        found = read_references(locations, on_device, [s.store for s in sources])
        return found if on_device else HostBatch(found)

    @staticmethod
    def read_ranges_all(
        sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """Byte ranges of referenced chunks (inner chunks of a shard a reference points
        at): each reference narrowed to its range, then read as :meth:`read_all`."""
        starts, sizes = ranges
        from xarray_gds.refs import narrow

        narrowed = [
            None if ref is None else narrow(ref, int(start), int(size))
            for ref, start, size in zip(locations, starts.tolist(), sizes.tolist(), strict=True)
        ]
        return ReferenceSource.read_all(sources, narrowed, on_device, None)


def source_for(store: Any) -> Source:
    """The source of a zarr Store's chunk bytes (of the store it wraps, for a store
    whose metadata is held during a write: chunks are never held). A store that knows
    better where its chunks lie names its own source with a ``chunk_source()`` method
    (:class:`xarray_gds.ice.IcechunkReadStore`: Icechunk's chunk table)."""
    from xarray_gds import remote
    from xarray_gds.deferred import HeldMetadataStore
    from xarray_gds.refs import ReferenceStore
    from xarray_gds.store import GdsStore

    if isinstance(store, HeldMetadataStore):
        store = store.store

    own = getattr(store, "chunk_source", None)
    if own is not None:
        chosen: Source = own()
        return chosen
    if isinstance(store, ReferenceStore):
        return ReferenceSource(store)
    if isinstance(store, GdsStore):
        return LocalSource(store)
    if remote.kvikio_target(store) is not None:
        return RemoteSource(store)
    return StoreSource(store)


def read(
    sources: Sequence[Source],
    locations: list[Any],
    on_device: bool,
    slots: np.ndarray | None,
    ranges: tuple[np.ndarray, np.ndarray] | None = None,
) -> Fetched:
    """Every location of a batch whose locations come from several sources: one
    :meth:`Source.read_all` per kind, joined into one DeviceBatch (device) or HostBatch.
    With ``ranges`` (``starts, sizes``), a byte range of each location instead
    (:meth:`read_ranges_all`)."""

    def one_kind(picked: Sequence[Source], idx: np.ndarray | None) -> Fetched:
        reader = type(picked[0]) if picked else LocalSource
        where = [locations[i] for i in idx.tolist()] if idx is not None else locations
        if ranges is not None:
            starts, sizes = ranges if idx is None else (ranges[0][idx], ranges[1][idx])
            return reader.read_ranges_all(picked, where, (starts, sizes), on_device)
        own_slots = slots if slots is None or idx is None else slots[idx]
        return reader.read_all(picked, where, on_device, own_slots)

    kinds = {s.kind for s in sources}
    if len(kinds) <= 1:
        return one_kind(sources, None)
    parts: list[tuple[np.ndarray, Fetched]] = []
    for kind in sorted(kinds):
        idx = np.flatnonzero([s.kind == kind for s in sources])
        parts.append((idx, one_kind([sources[i] for i in idx.tolist()], idx)))
    return join(parts, len(locations), on_device)


def join(parts: list[tuple[np.ndarray, Fetched]], n: int, on_device: bool) -> Fetched:
    """Reads of disjoint subsets ``idx`` of ``n`` locations as one read of all of them
    (one DeviceBatch on the device, one HostBatch on the host), in location order."""
    if not on_device:
        out = HostBatch([None] * n)
        for idx, got in parts:
            assert isinstance(got, HostBatch)
            for i, a in zip(idx.tolist(), got, strict=True):
                out[i] = a
        return out
    from xarray_gds.batch import pack

    if len(parts) == 1 and len(parts[0][0]) == n and np.all(parts[0][0] == np.arange(n)):
        return parts[0][1]
    arrays: list[Any] = [None] * n
    for idx, batch in parts:
        assert isinstance(batch, DeviceBatch)
        for i, start, size in zip(idx.tolist(), batch.offsets, batch.sizes, strict=True):
            if size >= 0:
                arrays[i] = batch.arena[int(start) : int(start) + int(size)]
    return pack(arrays)

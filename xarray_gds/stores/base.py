"""What every store kind is: a :class:`Source`, and the ordered registry of them.

The engine reads from several kinds of place (local files, reference sets, remote
objects, Icechunk repositories, any other zarr Store). Each kind is one module of
:mod:`xarray_gds.stores` with one :class:`Source` subclass that owns the kind whole:

- recognising it: :meth:`Source.claims` a zarr Store, :meth:`Source.opens` a path, URL
  or reference set, which :meth:`Source.open` turns into the zarr Store its metadata is
  read through;
- reading chunk bytes (:meth:`Source.read_all`, :meth:`Source.read_ranges_all`, ...)
  into host arrays or one device arena;
- its write side: the writer lock (:meth:`Source.writer_lock`), whether a key exists
  (:meth:`Source.existed`), the clean-up after a failed write
  (:meth:`Source.after_failed_write`).

What a kind can do is declared, as zarr's ``Store`` declares ``supports_writes``, by
the class attributes of :class:`Source` (its docstring lists them); the engine, the
codec pipeline and the writes ask these and never name a kind. :func:`register` puts a
kind in the registry, :func:`source_for` and :func:`open_target` ask it in order.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from xarray_gds import config
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch, Fetched, HostBatch

__all__ = [
    "Opened",
    "Ranges",
    "Source",
    "Stream",
    "WriterLock",
    "join",
    "kinds",
    "merge_ranges",
    "on_side",
    "open_target",
    "read",
    "read_joined",
    "register",
    "source_for",
    "stream",
]


#: byte ranges to read: ``(starts, sizes)``, one of each a location
Ranges = tuple[np.ndarray, np.ndarray]


class Opened(NamedTuple):
    """What :meth:`Source.open` makes of a path, URL or reference set."""

    store: Any  #: the zarr Store its metadata and chunks are read through
    storage_options: dict[str, Any] | None  #: what is left for zarr (None: all used)
    consolidated: bool | None  #: the ``consolidated`` to open it with


class WriterLock(Protocol):
    """A writer lock taken by :meth:`Source.writer_lock`."""

    def release(self) -> None: ...


class Stream(Protocol):
    """The reads of a group streamed chunk by chunk (:meth:`Source.stream`)."""

    def get(self, i: int) -> np.ndarray | None: ...

    def close(self) -> None: ...


class _OneByOne:
    """:meth:`Source.stream` by default: each location read when asked for."""

    def __init__(self, sources: Sequence[Any], locations: list[Any]) -> None:
        self.sources, self.locations = sources, locations

    def get(self, i: int) -> np.ndarray | None:
        found: np.ndarray | None = self.sources[i].read_one(self.locations[i])
        return found

    def close(self) -> None:
        return None


class Source(abc.ABC):
    """Chunk bytes of one store, and what its kind can do: every byte the engine reads
    goes through a source, and every write asks it about locking and clean-up.

    Sources move bytes and nothing else (no decoding). A read of many locations takes
    the sources that hold them (``sources[i]`` holds ``locations[i]``), so that one call
    of :meth:`read_all` reads the locations of several stores of one class together.

    Capabilities (class attributes; a kind sets those it has):

    ``device_reads``
        Chunk bytes land in device memory without a host copy (kvikio).
    ``ranged_reads``
        A byte range is read without reading the whole object.
    ``sizes``
        :meth:`read_end` learns an object's size without reading it whole.
    ``streams``
        A whole chunk read on the host is cheap enough to read, decode and place chunk
        after chunk (:meth:`read_one`, one thread each).
    ``writes``
        :func:`xarray_gds.to_zarr` writes it, metadata held until the chunks are in.
    ``commits``
        It writes into a transaction of its own that a commit publishes whole: nothing
        is held back, nothing cleaned up.
    ``locking``
        :meth:`writer_lock` excludes other writers (of the process at least).
    ``probes``
        :meth:`existed` is cheap (a ``stat``, a lookup): a failed write removes exactly
        the chunks it created.
    ``writes_in_threads``
        Its synchronous ``set_sync``/``delete_sync`` release the GIL: the batched
        writes run them in the host pool's threads.

    ``private_keys`` (a set of names) are the write side's own objects in the store's
    root (a local directory's lock file): never zarr's, left out of a write's listings
    and kept when the write clears the store (:meth:`delete_dir`, :meth:`clear`).
    """

    device_reads: ClassVar[bool] = False
    ranged_reads: ClassVar[bool] = False
    sizes: ClassVar[bool] = False
    streams: ClassVar[bool] = False
    writes: ClassVar[bool] = False
    commits: ClassVar[bool] = False
    locking: ClassVar[bool] = False
    probes: ClassVar[bool] = False
    writes_in_threads: ClassVar[bool] = False
    private_keys: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, store: Any) -> None:
        self.store = store

    # -- recognising ------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def claims(cls, store: Any) -> bool:
        """Whether this kind reads and writes the zarr Store ``store``."""

    @classmethod
    def opens(cls, target: Any) -> bool:
        """Whether this kind opens ``target`` (a path, URL, reference set or Store)."""
        return False

    @classmethod
    def open(
        cls,
        target: Any,
        *,
        mode: str,
        storage_options: dict[str, Any] | None,
        consolidated: bool | None = None,
    ) -> Opened:
        """The zarr Store of ``target`` (one :meth:`opens`); ``mode``: ``"r"`` opens it
        read-only, ``"r+"``/``"a"`` writable, ``"w"`` for a write that may create it."""
        raise NotImplementedError(f"{cls.__name__} opens nothing")

    @classmethod
    def for_store(cls, store: Any) -> Source:
        """The source of a store this kind :meth:`claims`."""
        return cls(store)

    # -- reading ----------------------------------------------------------------------

    def locate(self, keys: list[str]) -> list[Any]:
        """What a read of each key needs (checked as the store checks keys)."""
        return list(keys)

    @classmethod
    @abc.abstractmethod
    def read_all(
        cls, sources: Sequence[Any], locations: list[Any], on_device: bool, slots: Any
    ) -> Fetched:
        """Every location, read whole: a DeviceBatch when ``on_device`` (``slots``: the
        bytes each may take in the arena, or None), else a HostBatch (``None`` where
        missing)."""

    @classmethod
    @abc.abstractmethod
    def read_ranges_all(
        cls, sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """``sizes[i]`` bytes at ``starts[i]`` of every location (``ranges``: starts
        and sizes; shards' inner chunks): a DeviceBatch when ``on_device``, else a
        HostBatch."""

    @classmethod
    def stream(cls, sources: Sequence[Any], locations: list[Any]) -> Stream:
        """The whole locations of a group read chunk by chunk (sources that declare
        ``streams``): :meth:`Stream.get` of item ``i`` is location ``i`` on the host
        (``None`` where missing), asked for by the host pool's threads, each decoding
        what it got before it asks for the next. By default each is read when asked
        (:meth:`read_one`); a kind whose reads wait on a network starts them all at
        once here, so that they overlap the decoding."""
        return _OneByOne(sources, locations)

    def read_one(self, location: Any) -> np.ndarray | None:
        """One location, whole, on the host (``None`` where missing): the reads of
        chunks streamed one by one (sources that declare ``streams``)."""
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

    # -- writing ----------------------------------------------------------------------

    def writer_lock(self, timeout: float | None) -> WriterLock | None:
        """Take the store's writer lock, waiting at most ``timeout`` seconds (``None``:
        no bound); ``None`` for a kind without one (``locking`` false).

        Raises
        ------
        TimeoutError
            When another writer held it that long; it names that writer.
        """
        return None

    async def delete_dir(self, prefix: str) -> None:
        """Delete the keys below ``prefix`` (every key for ``""``, :attr:`private_keys`
        kept), for a write: through the store's own ``delete_dir``."""
        await self.store.delete_dir(prefix)

    async def clear(self) -> None:
        """Delete every key (:attr:`private_keys` kept), for a write: through the store's
        own ``clear``."""
        await self.store.clear()

    def existed(self, key: str) -> bool:
        """Whether the store holds ``key`` now (asked in a write's threads)."""
        return self.store.get_sync(key) is not None

    def after_failed_write(self, removed: set[str]) -> None:
        """Tidy up after a failed write whose created chunks ``removed`` were deleted
        (a local directory removes the directories this left empty)."""
        return None


#: the kinds, in the order they are asked; the last one claims every store
_KINDS: list[type[Source]] = []


def register(kind: type[Source], *, before: type[Source] | None = None) -> type[Source]:
    """Put ``kind`` in the registry, asked before ``before`` (a registered kind), or
    last. A kind registered again moves. Returns ``kind`` (usable as a decorator)."""
    if kind in _KINDS:
        _KINDS.remove(kind)
    _KINDS.insert(_KINDS.index(before) if before is not None else len(_KINDS), kind)
    return kind


def kinds() -> tuple[type[Source], ...]:
    """The registered kinds, in the order they are asked."""
    return tuple(_KINDS)


def source_for(store: Any) -> Source:
    """The source of a zarr Store: that of the first kind that claims it (that of the
    store it wraps, for a store that names one as ``chunks_in``: chunks are never held)."""
    store = getattr(store, "chunks_in", store)
    for kind in _KINDS:
        if kind.claims(store):
            return kind.for_store(store)
    raise TypeError(f"no store kind reads {type(store).__name__}")  # pragma: no cover


def open_target(
    target: Any,
    *,
    mode: str,
    storage_options: dict[str, Any] | None,
    consolidated: bool | None = None,
) -> Opened | None:
    """``target`` (a path, URL, reference set or Store) opened by the first kind that
    :meth:`~Source.opens` it; ``None`` when none does."""
    for kind in _KINDS:
        if kind.opens(target):
            return kind.open(
                target, mode=mode, storage_options=storage_options, consolidated=consolidated
            )
    return None


# -- reading several kinds at once -------------------------------------------------------


class _Streams:
    """:meth:`Source.stream` of locations of several kinds: one stream a kind."""

    def __init__(self, sources: Sequence[Source], locations: list[Any]) -> None:
        self.at: list[tuple[Stream, int]] = [(_NONE, 0)] * len(locations)
        self.parts: list[Stream] = []
        for cls in sorted({type(s) for s in sources}, key=lambda c: c.__qualname__):
            idx = [i for i, s in enumerate(sources) if type(s) is cls]
            part = cls.stream([sources[i] for i in idx], [locations[i] for i in idx])
            self.parts.append(part)
            for k, i in enumerate(idx):
                self.at[i] = (part, k)

    def get(self, i: int) -> np.ndarray | None:
        part, k = self.at[i]
        return part.get(k)

    def close(self) -> None:
        for part in self.parts:
            part.close()


_NONE: Stream = _OneByOne([], [])


def stream(sources: Sequence[Source], locations: list[Any]) -> Stream:
    """The whole locations of a group streamed chunk by chunk (see
    :meth:`Source.stream`), whichever kinds of source hold them; :meth:`Stream.close`
    it when done."""
    return _Streams(sources, locations)


def read(
    sources: Sequence[Source],
    locations: list[Any],
    on_device: bool,
    slots: np.ndarray | None,
    ranges: Ranges | None = None,
) -> Fetched:
    """Every location of a batch whose locations come from several sources: one
    :meth:`Source.read_all` per class of source, joined into one DeviceBatch (device)
    or HostBatch. With ``ranges`` (``starts, sizes``), a byte range of each location
    instead (:meth:`Source.read_ranges_all`)."""

    def one_kind(picked: Sequence[Source], idx: np.ndarray | None) -> Fetched:
        reader = type(picked[0])
        where = [locations[i] for i in idx.tolist()] if idx is not None else locations
        if ranges is not None:
            starts, sizes = ranges if idx is None else (ranges[0][idx], ranges[1][idx])
            return reader.read_ranges_all(picked, where, (starts, sizes), on_device)
        own_slots = slots if slots is None or idx is None else slots[idx]
        return reader.read_all(picked, where, on_device, own_slots)

    if not sources:
        return on_side([], on_device)
    classes = {type(s) for s in sources}
    if len(classes) == 1:
        return one_kind(sources, None)
    parts: list[tuple[np.ndarray, Fetched]] = []
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        idx = np.flatnonzero([type(s) is cls for s in sources])
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


def on_side(found: list[np.ndarray | None], on_device: bool) -> Fetched:
    """Host arrays as a read returns them: as they are, or packed into one arena."""
    if not on_device:
        return HostBatch(found)
    from xarray_gds.batch import pack

    return pack([None if a is None else _device.cupy().asarray(a) for a in found])


# -- byte ranges joined into spans -------------------------------------------------------


def read_joined(
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

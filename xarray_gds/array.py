"""Lazily indexed arrays that read Zarr chunks onto the device (or the host).

:func:`read_many` is what a computation that needs many pieces of many arrays calls
(the joined dask blocks of :mod:`xarray_gds.fuse`, ``load_async`` gathers): the pieces
of one array that tile a box are read as that box (one batch, sliced afterwards), and
the boxes of all arrays are read and decoded together
(:func:`xarray_gds.region.read_boxes`, through the engine of :mod:`xarray_gds.coalesce`).
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from typing import Any

import numpy as np
from xarray.backends import BackendArray
from xarray.core import indexing

from xarray_gds import config, fuse
from xarray_gds import device as _device
from xarray_gds.cf import CFPlan
from xarray_gds.pipeline import attach
from xarray_gds.region import box_bounds, is_box_key, read_box
from xarray_gds.region import read_boxes as _region_read_boxes

__all__ = ["GdsBackendArray", "HostDecodedArray", "ReadAhead", "read_boxes", "read_many"]


class GdsBackendArray(BackendArray):
    """A Zarr array read on selection, decoded, and returned on ``device``.

    Indexing follows xarray's explicit indexers (basic, outer and vectorized); only
    the chunks a selection touches are read. Values come back as CuPy arrays when
    ``device="cuda"`` and numpy arrays when ``device="cpu"``, CF-decoded by ``cf``.

    Parameters
    ----------
    zarr_array : zarr.Array
        The array to read.
    name : str
        Variable name, used in error messages.
    device : str
        Where the values are returned: ``"cuda"`` or ``"cpu"``.
    cf : CFPlan, optional
        CF decoding applied after the read.
    ahead : ReadAhead, optional
        The read-ahead shared by the arrays of one dataset.
    gpu : int, optional
        The GPU the values are read into (``device="cuda:N"``): reads run with it as
        CuPy's current device. ``None``: the device current when a read runs.
    """

    __slots__ = ("_ahead", "_array", "_cf", "_device", "_gpu", "dtype", "name", "shape")

    def __init__(
        self,
        zarr_array: Any,
        name: str,
        device: _device.Device,
        cf: CFPlan | None = None,
        ahead: ReadAhead | None = None,
        gpu: int | None = None,
    ) -> None:
        self._array = zarr_array
        self.name = name
        self._device = device
        self._gpu = gpu if device == "cuda" else None
        self._cf = cf
        self._ahead = ahead
        self.shape = tuple(zarr_array.shape)
        raw = np.dtype(zarr_array.dtype).newbyteorder("=")
        self.dtype = cf.dtype if cf is not None else raw

    @property
    def device(self) -> _device.Device:
        return self._device

    def get_array(self) -> Any:
        """The underlying :class:`zarr.Array`."""
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        state = dict(getattr(self, "__dict__", {}))
        state.update((name, getattr(self, name)) for name in self.__slots__)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._gpu = None  # pickled before arrays had a GPU number
        for name, value in state.items():
            setattr(self, name, value)
        # a dataset opened in another process joins its blocks' reads here too, and its
        # array reads through the batched pipeline whatever pickling kept of it
        fuse.install()
        attach(self._array)

    def __getitem__(self, key: indexing.ExplicitIndexer) -> Any:
        config.validate()
        with _device.on_gpu(self._gpu):
            return self._read(key)

    def _read(self, key: indexing.ExplicitIndexer) -> Any:
        if self._ahead is not None:
            kept = self._ahead.read(self, key)
            if kept is not _NOTHING:
                return kept
        if isinstance(key, indexing.VectorizedIndexer):
            method = self._vindex
        elif isinstance(key, indexing.OuterIndexer):
            method = self._oindex
        else:
            method = self._basic
        return indexing.explicit_indexing_adapter(
            key, self.shape, indexing.IndexingSupport.VECTORIZED, method
        )

    async def async_getitem(self, key: indexing.ExplicitIndexer) -> Any:
        """``self[key]``, joined with the other reads awaited in the same step of the
        event loop (``Dataset.load_async`` gathers every variable's): one batch for
        all of them, read in a worker thread (see :func:`read_many`)."""
        return await _batcher().submit(self, key)

    # Each reader returns raw values on the device; _finish decodes them. Boxes of
    # arrays with a batched plan skip zarr's per-chunk indexing (see xarray_gds.region).
    def _basic(self, key: tuple[Any, ...]) -> Any:
        values = read_box(self._array, key, self._device)
        if values is None:
            values = self._array.get_basic_selection(key, prototype=self._prototype())
        return self._finish(values)

    def _oindex(self, key: tuple[Any, ...]) -> Any:
        if all(is_box_key(k) for k in key):  # integers and slices only: a basic key
            return self._basic(key)
        return self._finish(self._array.get_orthogonal_selection(key, prototype=self._prototype()))

    def _vindex(self, key: tuple[Any, ...]) -> Any:
        coords = _coordinates(key, self.shape)
        prototype = self._prototype()
        if self._device == "cpu":
            return self._finish(self._array.get_coordinate_selection(coords, prototype=prototype))
        # zarr's coordinate selection works on host arrays only: read the outer block
        # of the points (only the chunks they touch), then pick them on the device
        uniques, inverses = zip(*(np.unique(c, return_inverse=True) for c in coords), strict=True)
        block = self._finish(self._array.get_orthogonal_selection(uniques, prototype=prototype))
        xp = _device.array_module(self._device)
        picks = tuple(
            xp.asarray(inv.reshape(c.shape)) for inv, c in zip(inverses, coords, strict=True)
        )
        return block[picks]

    def _prototype(self) -> Any:
        # zarr keeps non-native byte orders as such; CuPy cannot hold them, so
        # those arrays are read on the host and byte-swapped before the move.
        if not np.dtype(self._array.dtype).isnative:
            return _device.buffer_prototype("cpu")
        return _device.buffer_prototype(self._device)

    def _finish(self, values: Any) -> Any:
        xp = _device.array_module(self._device)
        if not _device.is_device_array(values):
            values = np.asarray(values)
            if not values.dtype.isnative:
                values = values.astype(values.dtype.newbyteorder("="))
        values = xp.asarray(values)
        if self._cf is not None:
            values = self._cf.apply(values, xp)
        return values


def read_boxes(
    items: list[tuple[GdsBackendArray, tuple[Any, ...]]], into: list[Any] | None = None
) -> list[Any]:
    """``array[key]`` (integer and slice keys) of every item, CF-decoded, their chunks
    read together (:func:`xarray_gds.region.read_boxes`), those of arrays opened on one
    GPU (``device="cuda:N"``) with it current; an entry holds the exception of a read
    that failed. ``into``: destinations, as :func:`read_many` takes them."""
    by_gpu: dict[int | None, list[int]] = {}
    for i, (array, _) in enumerate(items):
        by_gpu.setdefault(array._gpu, []).append(i)
    out: list[Any] = [None] * len(items)
    for gpu, which in by_gpu.items():
        dests = None if into is None else [into[i] for i in which]
        with _device.on_gpu(gpu):
            got = (
                _read_boxes_here([items[i] for i in which])
                if dests is None
                else _read_boxes_here([items[i] for i in which], dests)
            )
        for i, value in zip(which, got, strict=True):
            out[i] = value
    return out


def _read_boxes_here(
    items: list[tuple[GdsBackendArray, tuple[Any, ...]]], into: list[Any] | None = None
) -> list[Any]:
    dests = [None] * len(items) if into is None else into
    wanted = [_destination(a, d) for (a, _), d in zip(items, dests, strict=True)]
    got = _region_read_boxes(
        [(a._array, key, a._device) for a, key in items],
        # the raw values land there only where no CF decoding changes them
        into=[
            d if a._cf is None or a._cf.is_identity else None
            for (a, _), d in zip(items, wanted, strict=True)
        ],
    )
    out: list[Any] = []
    for (a, key), value, dest in zip(items, got, wanted, strict=True):
        try:
            if isinstance(value, BaseException):
                raise value
            if value is None:  # not a box read: zarr's own indexing
                value = a._array.get_basic_selection(key, prototype=a._prototype())
            value = a._finish(value)
            if dest is not None and value.shape == dest.shape:
                if not _device.array_module(a._device).may_share_memory(value, dest):
                    dest[...] = value
                value = dest
            out.append(value)
        except Exception as err:
            out.append(err)
    return out


def _destination(array: GdsBackendArray, dest: Any) -> Any:
    """``dest`` when the values of a read of ``array`` can be written into it (an array
    of the decoded dtype, on the array's device), else None."""
    if dest is None or _device.is_device_array(dest) != (array._device == "cuda"):
        return None
    return dest if np.dtype(dest.dtype) == np.dtype(array.dtype) else None


def _box_key(key: Any, shape: tuple[int, ...]) -> tuple[Any, ...] | None:
    """The key as a tuple of integers and normalised slices of step 1, or None."""
    if not isinstance(key, indexing.BasicIndexer | indexing.OuterIndexer):
        return None
    bounds = box_bounds(tuple(key.tuple), shape)
    if bounds is None:
        return None
    start, stop, drop = bounds
    return tuple(
        a if axis in drop else slice(a, b)
        for axis, (a, b) in enumerate(zip(start, stop, strict=True))
    )


def _union(keys: list[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    """The box the keys tile exactly (same integers, slices that cover it once), or None."""
    union: list[Any] = []
    for axis in zip(*keys, strict=True):
        if all(isinstance(k, int) for k in axis):
            if len(set(axis)) != 1:
                return None
            union.append(axis[0])
        elif all(isinstance(k, slice) for k in axis):
            union.append(slice(min(k.start for k in axis), max(k.stop for k in axis)))
        else:
            return None

    def size(key: tuple[Any, ...]) -> int:
        return math.prod(k.stop - k.start for k in key if isinstance(k, slice))

    if sum(size(k) for k in keys) != size(tuple(union)):
        return None  # not a tiling (dask's blocks never overlap, so a gap)
    return tuple(union)


def _local(key: tuple[Any, ...], union: tuple[Any, ...]) -> tuple[slice, ...]:
    """Where the piece ``key`` lies in the values of ``union`` (integer axes dropped)."""
    return tuple(
        slice(k.start - u.start, k.stop - u.start)
        for k, u in zip(key, union, strict=True)
        if isinstance(k, slice)
    )


def read_many(
    requests: list[tuple[Any, indexing.ExplicitIndexer]], into: list[Any] | None = None
) -> list[Any]:
    """``array[key]`` for every ``(array, key)`` of xarray-gds backend arrays, read
    together; an entry whose read failed holds the exception instead of raising.

    ``into``, one entry a request (or None): an array of the request's result shape and
    dtype on its device to write the values into. An entry whose value ``is`` its
    ``into`` array holds them there (a host box read places its chunks straight into
    it); any other entry is a new array, as without ``into``."""
    out: list[Any] = [None] * len(requests)
    by_array: dict[int, list[int]] = {}
    for i, (array, _) in enumerate(requests):
        by_array.setdefault(id(array), []).append(i)
    boxes: list[tuple[GdsBackendArray, tuple[Any, ...], list[tuple[int, Any]]]] = []
    dests: list[Any] = []
    alone: list[int] = []
    for members in by_array.values():
        array = requests[members[0]][0]
        keys = [_box_key(requests[i][1], array.shape) for i in members]
        if not isinstance(array, GdsBackendArray) or any(k is None for k in keys):
            alone.extend(members)
            continue
        box_keys: list[tuple[Any, ...]] = [k for k in keys if k is not None]
        given = into is not None and any(into[i] is not None for i in members)
        union = _union(box_keys) if len(box_keys) > 1 and not given else None
        if union is not None:
            boxes.append(
                (
                    array,
                    union,
                    [(i, _local(k, union)) for i, k in zip(members, box_keys, strict=True)],
                )
            )
            dests.append(None)
        else:
            boxes.extend((array, k, [(i, None)]) for i, k in zip(members, box_keys, strict=True))
            dests.extend(None if into is None else into[i] for i in members)
    values = read_boxes([(array, key) for array, key, _ in boxes], into=dests if into else None)
    for (_, _, pieces), value in zip(boxes, values, strict=True):
        for i, local in pieces:
            out[i] = value if local is None or isinstance(value, BaseException) else value[local]
    for i in alone:
        array, key = requests[i]
        try:
            out[i] = array[key]
        except Exception as err:
            out[i] = err
    return out


_NOTHING: Any = object()


class ReadAhead:
    """The reads a loop over the variables of one dataset makes next, in one batch.

    xarray's ``Dataset.load()`` reads lazily loaded variables one after the other, each
    with the key of the selection: ``ds.isel(time=i).load()`` over 20 variables is 20
    reads of one chunk, each its own small batch. The arrays of one opened dataset
    share a ``ReadAhead`` that learns this pattern. A *round* is a run of reads of
    different arrays with the same key. When a round led by array ``A`` was followed,
    in that order, by ``B``, ``C``, ..., the next read of ``A`` with another key reads
    ``B`` and ``C`` with that key too, in the same batch (:func:`read_many`); their
    reads then take the values kept for them. A round that goes another way costs
    one round of reads that nobody takes.

    Only integer-and-slice keys take part. What is kept is dropped when the next round
    begins, so at most one round's values (and at most ``xarray_gds.read_ahead_bytes``
    of them, default 1 GiB; 0 turns read-ahead off) are held at a time. Reading ahead
    never changes a value: each kept value is what the array's own read returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round: list[GdsBackendArray] = []  #: the arrays read with ``_key``, in order
        self._key: tuple[Any, ...] | None = None
        self._follow: dict[int, list[GdsBackendArray]] = {}  #: leader -> who followed it
        self._kept: dict[tuple[int, tuple[Any, ...]], Any] = {}

    def __reduce__(self) -> tuple[Any, ...]:  # a copy (a dask worker's) starts afresh
        return (ReadAhead, ())

    def read(self, array: GdsBackendArray, key: indexing.ExplicitIndexer) -> Any:
        """``array[key]`` read together with what is predicted to follow it, or kept
        from such a read; ``_NOTHING`` when ``array`` is to read ``key`` itself."""
        box = _box_key(key, array.shape) if type(key) is indexing.BasicIndexer else None
        if box is None:
            return _NOTHING
        limit = int(config.get("read_ahead_bytes"))
        followers: list[GdsBackendArray] = []
        with self._lock:
            kept = self._kept.pop((id(array), box), _NOTHING)
            if box == self._key and self._round and all(a is not array for a in self._round):
                self._round.append(array)
                return kept
            if self._round:  # the round ends: remember who followed its leader
                self._follow[id(self._round[0])] = self._round[1:]
            self._round, self._key = [array], box
            if kept is not _NOTHING:
                return kept
            self._kept.clear()  # nobody takes what the last round kept any more
            if limit > 0:
                followers = [
                    b
                    for b in self._follow.get(id(array), [])
                    if _box_key(indexing.BasicIndexer(box), b.shape) == box
                ]
        if not followers:
            return _NOTHING
        indexer = indexing.BasicIndexer(box)
        items: list[tuple[Any, Any]] = [(array, indexer)]
        total = _box_nbytes(array, box)
        for b in followers:
            total += _box_nbytes(b, box)
            if total > limit:
                break
            items.append((b, indexer))
        if len(items) == 1:
            return _NOTHING
        values = read_many(items)
        with self._lock:
            if self._key == box:  # the round is still this one
                for (b, _), value in zip(items[1:], values[1:], strict=True):
                    if not isinstance(value, BaseException):
                        self._kept[(id(b), box)] = value
        first = values[0]
        if isinstance(first, BaseException):
            raise first
        return first


def _box_nbytes(array: GdsBackendArray, box: tuple[Any, ...]) -> int:
    return array.dtype.itemsize * math.prod(k.stop - k.start for k in box if isinstance(k, slice))


class _Batcher:
    """The reads awaited in one step of an event loop, served as one (see async_getitem)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: list[tuple[Any, indexing.ExplicitIndexer, asyncio.Future[Any]]] = []

    def submit(self, array: Any, key: indexing.ExplicitIndexer) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = self._loop.create_future()
        if not self._pending:  # after every task ready in this step has submitted
            self._loop.call_soon(self._flush)
        self._pending.append((array, key, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._serve(batch))
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)

    async def _serve(self, batch: list[tuple[Any, Any, asyncio.Future[Any]]]) -> None:
        try:
            values = await asyncio.to_thread(read_many, [(a, k) for a, k, _ in batch])
        except BaseException as err:
            values = [err] * len(batch)
        for (_, _, future), value in zip(batch, values, strict=True):
            if future.cancelled():
                continue
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)


_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
    weakref.WeakKeyDictionary()
)
_tasks: set[asyncio.Future[None]] = set()


def _batcher() -> _Batcher:
    loop = asyncio.get_running_loop()
    batcher = _batchers.get(loop)
    if batcher is None:
        batcher = _batchers[loop] = _Batcher(loop)
    return batcher


def _coordinates(key: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """A vectorized key as broadcastable integer arrays (zarr's coordinate selection).

    xarray's vectorized keys mix integer arrays (broadcast against each other) and
    slices; the result has the arrays' broadcast dimensions first, then one
    dimension per slice, in order. Slices become ``arange`` arrays shaped to match.
    """
    arrays = [k for k in key if not isinstance(k, slice)]
    n_array_dims = max((np.ndim(a) for a in arrays), default=0)
    n_slices = len(key) - len(arrays)
    out: list[np.ndarray] = []
    i_slice = 0
    for k, size in zip(key, shape, strict=True):
        if isinstance(k, slice):
            where = (1,) * (n_array_dims + i_slice) + (-1,) + (1,) * (n_slices - i_slice - 1)
            out.append(np.arange(*k.indices(size)).reshape(where))
            i_slice += 1
        else:
            k = np.asarray(k)
            out.append(k.reshape(k.shape + (1,) * n_slices))
    return tuple(out)


class HostDecodedArray(BackendArray):
    """Values xarray decoded on the host, moved to ``device`` on selection.

    The fallback for CF decodings that :mod:`xarray_gds.cf` does not reproduce:
    correct, but the values make a round trip through host memory.
    """

    __slots__ = ("_decoded", "_device", "_gpu", "dtype", "shape")

    def __init__(self, decoded: Any, device: _device.Device, gpu: int | None = None) -> None:
        self._decoded = decoded
        self._device = device
        self._gpu = gpu if device == "cuda" else None
        self.shape = tuple(decoded.shape)
        self.dtype = decoded.dtype

    @property
    def device(self) -> _device.Device:
        return self._device

    def get_array(self) -> Any:
        """xarray's lazily decoded host array."""
        return self._decoded

    def __getitem__(self, key: indexing.ExplicitIndexer) -> Any:
        values = np.asarray(self._decoded[key])
        with _device.on_gpu(self._gpu):
            return _device.array_module(self._device).asarray(values)

    async def async_getitem(self, key: indexing.ExplicitIndexer) -> Any:
        """``self[key]`` in a worker thread (xarray decodes these on the host)."""
        return await asyncio.to_thread(self.__getitem__, key)


fuse.register(GdsBackendArray, read_many)  # the dask pass joins the block reads of these

"""Reads of a box of an array without zarr's per-chunk indexing.

zarr's ``get_basic_selection`` builds, in Python, a store path, a chunk selection and
an output selection for every chunk a read touches: 10-25 us a chunk, more than the
read and the decode of a small chunk. For a box (integers and slices of step 1) of an
array that :class:`~xarray_gds.pipeline.GdsCodecPipeline` decodes in batches, in any
zarr Store (:mod:`xarray_gds.stores`), :func:`read_box` lists the chunks the box touches
with numpy, reads and decodes them as the pipeline does (same batches, same errors),
and places them in the output with one reshape a part on the GPU (one a row of chunks,
in threads, on the host). What is left per chunk is its key and its file read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds import coalesce, decode
from xarray_gds import device as _device
from xarray_gds.codecs import DecodeChain
from xarray_gds.place import Tiling, place
from xarray_gds.request import Decoded, ReadRequest, Sink

__all__ = ["box_bounds", "is_box_key", "read_box", "read_boxes"]


@dataclass(frozen=True)
class _Box:
    """A box of an array and the grid of chunks it touches."""

    start: tuple[int, ...]  #: first element of the box on each axis
    stop: tuple[int, ...]  #: one past its last element
    drop: tuple[int, ...]  #: axes indexed by an integer (dropped from the result)
    lo: tuple[int, ...]  #: first chunk touched on each axis
    grid: tuple[int, ...]  #: chunks touched on each axis


def is_box_key(k: Any) -> bool:
    """Whether ``k`` is an integer or a slice (bools and arrays of any kind are not)."""
    return isinstance(k, slice) or (isinstance(k, int | np.integer) and not isinstance(k, bool))


def box_bounds(
    key: tuple[Any, ...], shape: tuple[int, ...]
) -> tuple[list[int], list[int], list[int]] | None:
    """``(start, stop, dropped axes)`` of the box ``key`` selects (integers and slices of
    step 1), or None when it is not one, is empty or is out of bounds (zarr raises its
    own IndexError then)."""
    if len(key) != len(shape) or not shape:
        return None
    start, stop, drop = [], [], []
    for axis, (k, size) in enumerate(zip(key, shape, strict=True)):
        if not is_box_key(k):
            return None
        if isinstance(k, slice):
            a, b, step = k.indices(size)
            if step != 1 or b <= a:
                return None
        else:
            a = int(k) + (size if k < 0 else 0)
            if not 0 <= a < size:
                return None
            b = a + 1
            drop.append(axis)
        start.append(a)
        stop.append(b)
    return start, stop, drop


def _box(key: tuple[Any, ...], shape: tuple[int, ...], chunks: tuple[int, ...]) -> _Box | None:
    """The box ``key`` selects and the chunks it touches, or None (see box_bounds)."""
    bounds = box_bounds(key, shape)
    if bounds is None:
        return None
    start, stop, drop = bounds
    lo = tuple(a // c for a, c in zip(start, chunks, strict=True))
    hi = tuple(-(-b // c) for b, c in zip(stop, chunks, strict=True))
    grid = tuple(h - low for h, low in zip(hi, lo, strict=True))
    return _Box(tuple(start), tuple(stop), tuple(drop), lo, grid)


def read_box(array: Any, key: tuple[Any, ...], device: _device.Device) -> Any | None:
    """The values of ``array[key]`` on ``device``, read through the batched decode, or
    ``None`` when this read is not for it (zarr's own indexing then does it).

    It is for boxes (integers, and slices of step 1) of arrays whose codec pipeline is a
    :class:`~xarray_gds.pipeline.GdsCodecPipeline` with a batched plan that runs on
    ``device``, in any zarr Store (bytes read through :mod:`xarray_gds.stores`), when a row of the
    touched chunks (all those that share a chunk index on the first axis) fits in one
    batch. Missing chunks read as the fill value, as zarr reads them.

    Parameters
    ----------
    array : zarr.Array
    key : tuple
        One integer or slice per axis.
    device : {"cuda", "cpu"}

    Returns
    -------
    cupy.ndarray, numpy.ndarray or None
        The values in native byte order, integer-indexed axes dropped.
    """
    (value,) = read_boxes([(array, key, device)])
    if isinstance(value, BaseException):
        raise value
    return value


def read_boxes(
    items: list[tuple[Any, tuple[Any, ...], _device.Device]],
    into: list[Any] | None = None,
) -> list[Any]:
    """:func:`read_box` of every ``(array, key, device)``, their chunks read together: the
    boxes that fit in one batch each are joined into as few reads and decodes as the
    batch budget allows (:func:`xarray_gds.coalesce.fetch_decode_many`), across arrays
    and stores. Each entry of the result is the box's values, ``None`` (not a box read:
    see :func:`read_box`) or the exception its chunks raised.

    ``into``, one entry an item (or None): a writable numpy array of the box's shape
    (integer axes dropped) and the array's dtype in native order, which a host read
    places its chunks into instead of a new array (the entry's values are then a view
    of it); one that does not fit, or a device read, is ignored."""
    plans = [_plan(*item, into=None if into is None else into[i]) for i, item in enumerate(items)]
    out: list[Any] = [None] * len(items)
    joined = [i for i, p in enumerate(plans) if p is not None and len(p.parts) == 1]
    fetched = coalesce.fetch_decode_many(
        [p.request(0, p.box.grid[0], p.sink()) for p in (plans[i] for i in joined) if p]
    )
    for i, got in zip(joined, fetched, strict=True):
        p = plans[i]
        assert p is not None
        if isinstance(got, BaseException):
            out[i] = got
            continue
        try:
            p.reader.place(p.out, 0, p.box.grid[0], got)
            out[i] = p.result()
        except Exception as err:
            out[i] = err
    for i, p in enumerate(plans):
        if p is not None and len(p.parts) > 1:
            out[i] = p.read_parts()
    return out


@dataclass
class _Planned:
    """A box read: its chunks, parts (rows of chunks per batch) and output."""

    store: Any  #: any zarr Store (see xarray_gds.stores)
    chain: DecodeChain
    box: _Box
    reader: _Reader
    parts: list[tuple[int, int]]
    out: Any
    on_device: bool

    def result(self) -> Any:
        return self.out.squeeze(axis=self.box.drop) if self.box.drop else self.out

    def sink(self) -> Sink | None:
        """For a host read in one part: a callable that places chunk ``k`` of the box
        into the output as soon as the engine has decoded it (the engine may stream
        such reads, :func:`xarray_gds.coalesce._serve_streamed`); None on the device."""
        if self.on_device:
            return None
        return _Placer(self.out, self.reader)

    def request(self, r0: int, r1: int, sink: Sink | None = None) -> ReadRequest:
        """The engine's request for the chunks of rows ``r0:r1`` of the box."""
        keys = self.reader.keys(r0, r1)
        return ReadRequest(self.store, self.chain, keys, self.on_device, sink=sink)

    def read_parts(self) -> Any:
        """Part by part (:func:`xarray_gds.coalesce.fetch_decode_parts`: part k + 1 read
        while part k decodes), each placed as it comes."""

        def place(k: int, decoded: Decoded) -> None:
            self.reader.place(self.out, *self.parts[k], decoded)

        coalesce.fetch_decode_parts([self.request(r0, r1) for r0, r1 in self.parts], place)
        return self.result()


def _plan(
    array: Any, key: tuple[Any, ...], device: _device.Device, into: Any = None
) -> _Planned | None:
    """The box read of ``array[key]``, or None when it is not one (see :func:`read_box`);
    a host read places into ``into`` where it fits (see :func:`read_boxes`)."""
    on_device = device == "cuda"
    asynchronous = array.async_array
    pipe = asynchronous.codec_pipeline
    store = asynchronous.store_path.store
    chain = getattr(pipe, "chain", None)  # xarray_gds.pipeline.GdsCodecPipeline's plan
    if not isinstance(chain, DecodeChain) or (on_device and not chain.device_ready):
        return None
    if getattr(array.config, "read_missing_chunks", True) is False:
        return None  # zarr raises for missing chunks then
    box = _box(tuple(key), tuple(array.shape), chain.chunk_shape)
    if box is None:
        return None
    row = math.prod(box.grid[1:])
    rows_per_part = decode.part_chunks(row * box.grid[0], chain.nbytes, on_device) // row
    if rows_per_part < 1:
        return None  # zarr's path splits finer than a row of chunks
    path = asynchronous.store_path.path
    reader = _Reader(array.metadata, f"{path}/" if path else "", store, chain, box, on_device)
    xp = _device.array_module(device)
    shape = tuple(b - a for a, b in zip(box.start, box.stop, strict=True))
    dtype = chain.dtype.newbyteorder("=")
    if _fits(into, on_device, shape, box.drop, dtype):
        out = np.expand_dims(into, box.drop)  # a view: the chunks land in ``into``
    else:
        out = xp.empty(shape, dtype=dtype)
    parts = [(r, min(r + rows_per_part, box.grid[0])) for r in range(0, box.grid[0], rows_per_part)]
    return _Planned(store, chain, box, reader, parts, out, on_device)


def _fits(
    into: Any, on_device: bool, shape: tuple[int, ...], drop: tuple[int, ...], dtype: np.dtype
) -> bool:
    """Whether a host read of a box of ``shape`` (``drop``: its integer axes) can place
    its values into ``into``."""
    if into is None or on_device or type(into) is not np.ndarray:
        return False
    kept = tuple(n for axis, n in enumerate(shape) if axis not in drop)
    return into.shape == kept and into.dtype == dtype and into.flags.writeable


class _Reader:
    """Fetches, decodes and places the rows ``r0:r1`` (relative to the box) of chunks."""

    def __init__(
        self,
        metadata: Any,
        prefix: str,
        store: Any,
        chain: DecodeChain,
        box: _Box,
        on_device: bool,
    ) -> None:
        self.store = store
        self.chain = chain
        self.box = box
        self.on_device = on_device
        self.xp = _device.array_module("cuda" if on_device else "cpu")
        self.encode = metadata.encode_chunk_key
        self.prefix = prefix
        fill = metadata.fill_value
        self.fill = metadata.dtype.default_scalar() if fill is None else fill
        first = box.lo
        last = tuple(low + g - 1 for low, g in zip(box.lo, box.grid, strict=True))
        self.lead, self.sep = self._scheme(first, last)

    def _scheme(self, first: tuple[int, ...], last: tuple[int, ...]) -> tuple[str, str | None]:
        """``(lead, separator)`` such that a chunk's key is ``lead`` then its indices
        joined by ``separator`` (zarr's "default" and "v2" encodings), checked against
        zarr's own encoding of the box's first and last chunk; ``(.., None)`` otherwise."""
        ndim = len(first)
        probe = self.encode(tuple(range(1, ndim + 1)))
        for sep in ("/", "."):
            joined = sep.join(str(i) for i in range(1, ndim + 1))
            if probe.endswith(joined):
                lead = probe[: len(probe) - len(joined)]
                if all(lead + sep.join(map(str, c)) == self.encode(c) for c in (first, last)):
                    return lead, sep
        return "", None

    def keys(self, r0: int, r1: int) -> list[str]:
        box = self.box
        axes = [np.arange(box.lo[0] + r0, box.lo[0] + r1)]
        axes += [np.arange(low, low + g) for low, g in zip(box.lo[1:], box.grid[1:], strict=True)]
        coords = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(axes))
        rows = coords.tolist()
        prefix, lead, sep = self.prefix, self.lead, self.sep
        if sep is None:
            return [prefix + self.encode(tuple(c)) for c in rows]
        return [prefix + lead + sep.join(map(str, c)) for c in rows]

    def _where(self, r0: int, k: int) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """``(in out, in the chunk)``: where chunk ``k`` of the rows from ``r0`` on
        (C order of the box's grid) goes, and which part of it."""
        box, cs = self.box, self.chain.chunk_shape
        at = np.unravel_index(k, (max(1, box.grid[0] - r0), *box.grid[1:]))
        dst, src = [], []
        for axis, (g, c) in enumerate(zip(at, cs, strict=True)):
            origin = (box.lo[axis] + (r0 if axis == 0 else 0) + int(g)) * c
            first = max(box.start[axis], origin)
            last = min(box.stop[axis], origin + c)
            dst.append(slice(first - box.start[axis], last - box.start[axis]))
            src.append(slice(first - origin, last - origin))
        return tuple(dst), tuple(src)

    def place_one(self, out: Any, r0: int, k: int, chunk: Any) -> None:
        """Copy the part of the box that chunk ``k`` of the rows from ``r0`` on holds
        into ``out``."""
        dst, src = self._where(r0, k)
        out[dst] = chunk[src]

    def target(self, out: np.ndarray, r0: int, k: int) -> np.ndarray | None:
        """The bytes of ``out`` that chunk ``k`` of the rows from ``r0`` on fills whole,
        as one flat ``uint8`` view; ``None`` where the box's edge cuts the chunk or its
        part of ``out`` is not contiguous. (Whether the decoded bytes may go there as
        they are is the chain's :attr:`~xarray_gds.codecs.DecodeChain.plain`.)"""
        dst, src = self._where(r0, k)
        if any(s.stop - s.start != c for s, c in zip(src, self.chain.chunk_shape, strict=True)):
            return None
        view = out[dst]
        if not view.flags.c_contiguous:
            return None
        return view.reshape(-1).view(np.uint8)

    def place(self, out: Any, r0: int, r1: int, decoded: Decoded) -> None:
        """Copy the part of the box that the decoded rows ``r0:r1`` of chunks hold into
        ``out`` (:func:`xarray_gds.place.place`); ``decoded`` is what
        :func:`xarray_gds.decode.decode_fetched` returns for them."""
        box, cs = self.box, self.chain.chunk_shape
        present, chunks = decoded
        grid = (r1 - r0, *box.grid[1:])
        n_keys = math.prod(grid)
        # the block the rows' chunks tile, in the array's coordinates
        origin = [(box.lo[0] + r0) * cs[0]]
        origin += [low * c for low, c in zip(box.lo[1:], cs[1:], strict=True)]
        first = max(box.start[0], origin[0])
        last = min(box.stop[0], origin[0] + grid[0] * cs[0])
        window: tuple[slice, ...] = (slice(first - box.start[0], last - box.start[0]),)
        window += tuple(slice(0, b - a) for a, b in zip(box.start[1:], box.stop[1:], strict=True))
        crop: tuple[slice, ...] = (slice(first - origin[0], last - origin[0]),)
        crop += tuple(
            slice(a - o, b - o)
            for a, b, o in zip(box.start[1:], box.stop[1:], origin[1:], strict=True)
        )
        # few rows of several chunks on the host: a chunk a task beats a row a task
        few_rows = not self.on_device and grid[0] < 4 and n_keys > 1
        tiling = None if few_rows else Tiling(grid, window, crop)
        place(
            out,
            chunks,
            present,
            n_keys,
            lambda k: self._where(r0, k),
            self.fill,
            self.on_device,
            tiling=tiling,
        )


class _Placer:
    """The sink of a host box read in one part (see :data:`xarray_gds.request.Sink`):
    called with a decoded chunk, it places the chunk's part of the box into the output;
    :meth:`target` offers the output's own bytes to decode a whole chunk into."""

    def __init__(self, out: np.ndarray, reader: _Reader) -> None:
        self.out = out  # the chain's dtype in native order (see _plan)
        self.reader = reader
        self.plain = reader.chain.plain  # once a read, not once a chunk

    def __call__(self, k: int, chunk: Any) -> None:
        self.reader.place_one(self.out, 0, k, chunk)

    def target(self, k: int) -> np.ndarray | None:
        return self.reader.target(self.out, 0, k) if self.plain else None

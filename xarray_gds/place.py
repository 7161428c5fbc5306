"""Decoded chunks into their output: one routine for box reads, zarr's indexing and shards.

A read ends with chunks decoded into one stacked array ``(n_present, *chunk_shape)``
and an output to fill. :func:`place` copies each chunk's part into the output and the
fill value where a chunk is missing. Where the chunks, in C order, tile a block of
which the output is one window (the chunks of a box read, a zarr selection of whole
chunks, the inner chunks of a shard), one reshape of the stack (:func:`untile`) and one
copy replace a copy a chunk: one kernel on the GPU instead of one a chunk. On the host,
numpy copies release the GIL, so the copies run on the host pool (a row of chunks a
task, or a chunk a task when there are few rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds import device as _device
from xarray_gds.batch import parallel

__all__ = ["STREAMED", "Tiling", "place", "untile"]

#: The chunks of a result whose chunks went to its request's sink: already placed.
STREAMED: Any = object()

#: ``where(k) -> (dst, src)``: the part of the output chunk ``k`` fills, and which part
#: of the chunk fills it
Where = Callable[[int], tuple[tuple[Any, ...], tuple[Any, ...]]]


@dataclass(frozen=True)
class Tiling:
    """The ``n`` chunks of a read, taken in ``order`` (C order when None), tile a
    block of ``grid`` chunks, and ``out[window] = block[crop]``."""

    grid: tuple[int, ...]
    window: tuple[slice, ...]
    crop: tuple[slice, ...]
    order: np.ndarray | None = None


def untile(chunks: Any, grid: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """Chunks ``(n, *chunk_shape)`` in C order of ``grid`` as one array of ``shape``
    (``grid * chunk_shape``): one reshape and transpose."""
    ndim = len(grid)
    axes = [a for pair in zip(range(ndim), range(ndim, 2 * ndim), strict=True) for a in pair]
    return chunks.reshape((*grid, *chunks.shape[1:])).transpose(axes).reshape(shape)


def place(
    out: Any,
    chunks: Any,
    present: list[int],
    n: int,
    where: Where,
    fill: Any,
    on_device: bool,
    *,
    tiling: Tiling | None = None,
    drop_axes: tuple[int, ...] = (),
) -> None:
    """Copy ``n`` decoded chunks into ``out``.

    Parameters
    ----------
    out : numpy.ndarray or cupy.ndarray
        The output.
    chunks : array or STREAMED
        The decoded chunks of ``present``, stacked; :data:`STREAMED` when a sink
        placed them already (only the missing ones are filled then).
    present : list of int
        Which of the ``n`` chunks exist (in order); the others read as ``fill``.
    where : callable
        ``where(k) -> (dst, src)``: the part of ``out`` chunk ``k`` fills, and the
        part of the chunk that fills it.
    tiling : Tiling, optional
        Where the chunks tile a block of which ``out`` is a window: one copy.
    drop_axes : tuple of int
        Axes of the chunk selection that the output does not have (integer indexers
        in zarr's selections).
    """
    missing = sorted(set(range(n)) - set(present)) if len(present) < n else []
    if chunks is STREAMED:
        for k in missing:
            out[where(k)[0]] = fill
        return
    if tiling is not None and present:
        _place_tiled(out, chunks, present, n, fill, on_device, tiling)
        return
    if tiling is not None:  # no chunk at all: the window is the fill value
        out[tiling.window] = fill
        return

    def one(j: int) -> None:
        dst, src = where(present[j])
        value = chunks[j][src]
        out[dst] = value.squeeze(axis=drop_axes) if drop_axes else value

    if on_device or len(present) < 2:
        for j in range(len(present)):
            one(j)
    else:  # numpy copies run without the GIL: a chunk a task
        parallel(one, len(present), min_items=2)
    for k in missing:
        out[where(k)[0]] = fill


def _place_tiled(
    out: Any, chunks: Any, present: list[int], n: int, fill: Any, on_device: bool, tiling: Tiling
) -> None:
    xp = _device.array_module("cuda" if on_device else "cpu")
    if len(present) < n or not np.array_equal(present, np.arange(n)):
        # chunks to their positions; missing chunks read as the fill value
        shape = (n, *chunks.shape[1:])
        whole = xp.full(shape, fill, dtype=chunks.dtype) if len(present) < n else None
        whole = xp.empty(shape, dtype=chunks.dtype) if whole is None else whole
        whole[xp.asarray(present)] = chunks
        chunks = whole
    if tiling.order is not None:  # chunk j goes to grid position order[j]
        chunks = chunks[xp.asarray(np.argsort(tiling.order))]
    grid, window, crop, chunk_shape = tiling.grid, tiling.window, tiling.crop, chunks.shape[1:]
    row = math.prod(grid[1:])  # chunks a row of the grid

    def rows(a: int, b: int) -> None:
        """Copy the part of chunk rows ``a:b`` of the block that the output holds."""
        sub = (b - a, *grid[1:])
        block = untile(
            chunks[a * row : b * row],
            sub,
            tuple(g * c for g, c in zip(sub, chunk_shape, strict=True)),
        )
        lo, hi = a * chunk_shape[0], b * chunk_shape[0]  # of the block, along axis 0
        first, last = max(crop[0].start, lo), min(crop[0].stop, hi)
        if first >= last:
            return
        at = window[0].start + first - crop[0].start
        dst = (slice(at, at + last - first), *window[1:])
        out[dst] = block[(slice(first - lo, last - lo), *crop[1:])]

    n_rows = grid[0]
    if on_device or n_rows == 1:
        rows(0, n_rows)
    else:  # numpy copies run without the GIL: one row of chunks a task
        parallel(lambda i: rows(i, i + 1), n_rows, min_items=2)

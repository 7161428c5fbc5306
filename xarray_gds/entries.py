"""zarr's batch entries: what zarr hands a codec pipeline, parted and placed.

zarr asks a codec pipeline to read or write a batch of entries, one a chunk:
``(byte_setter, spec, chunk_selection, out_selection, is_complete_chunk)``. The
batched read (:mod:`xarray_gds.pipeline`), the shards' read (:mod:`xarray_gds.shards`)
and the batched write (:mod:`xarray_gds.writes`) split a batch into parts
(:func:`split`) and place decoded chunks where the entries' indexing says
(:func:`place_entries`, :func:`scatter`), with one copy where whole chunks tile the
output (:func:`whole_tiling`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from zarr.abc.codec import GetResult
from zarr.core.chunk_utils import fill_value_or_default

from xarray_gds.place import Tiling, place

__all__ = ["place_entries", "scatter", "split", "whole_tiling"]


def split(batch: list[Any], per_part: int) -> list[list[Any]]:
    """``batch`` in parts of ``per_part`` entries (the last one shorter)."""
    return [batch[i : i + per_part] for i in range(0, len(batch), per_part)]


def place_entries(
    target: Any,
    chunks: Any,
    present: list[int],
    entries: list[Any],
    on_device: bool,
    drop_axes: tuple[int, ...],
    tiling: Tiling | None = None,
) -> None:
    """Place the chunks ``present`` of zarr's batch ``entries`` where its indexing says
    (each entry's selection of the output and of its chunk), the fill value where a
    chunk is missing."""
    place(
        target,
        chunks,
        present,
        len(entries),
        lambda k: (entries[k][3], entries[k][2]),
        fill_value_or_default(entries[0][1]),
        on_device,
        tiling=tiling,
        drop_axes=drop_axes,
    )


def whole_tiling(
    target: Any, chunk_shape: tuple[int, ...], entries: list[Any], drop_axes: tuple[int, ...]
) -> Tiling | None:
    """How whole chunks that tile ``target`` exactly are placed with one reshape (one
    kernel) instead of one copy a chunk; None when the batch does not qualify."""
    if drop_axes or len(entries) < 2 or not all(e[4] for e in entries):
        return None
    if len(chunk_shape) != target.ndim:
        return None
    starts = []
    for _, _, _, out_sel, _ in entries:
        if not all(isinstance(s, slice) and s.step in (None, 1) for s in out_sel):
            return None
        starts.append([s.start or 0 for s in out_sel])
    origin = np.asarray(starts, dtype=np.int64)
    if np.any(origin % chunk_shape):
        return None
    cells = origin // chunk_shape
    grid = tuple(int(g) for g in cells.max(axis=0) + 1)
    if math.prod(grid) != len(entries) or tuple(
        g * c for g, c in zip(grid, chunk_shape, strict=True)
    ) != tuple(target.shape):
        return None
    order = np.ravel_multi_index(tuple(cells.T), grid)
    if len(np.unique(order)) != len(entries):
        return None
    whole = tuple(slice(0, s) for s in target.shape)
    return Tiling(grid, whole, whole, None if np.all(np.diff(order) == 1) else order)


def scatter(
    batch: list[Any],
    present: list[int],
    chunks: Any,
    out: Any,
    drop_axes: tuple[int, ...],
    on_device: bool,
) -> tuple[GetResult, ...]:
    """Place the decoded chunks of ``batch`` (``present``: which exist) in ``out``, the
    fill value where a chunk is missing (:func:`xarray_gds.place.place`)."""
    target = out.as_ndarray_like()
    tiling = None
    if on_device and present and len(present) == len(batch):
        tiling = whole_tiling(target, tuple(chunks.shape[1:]), batch, drop_axes)
    place_entries(target, chunks, present, batch, on_device, drop_axes, tiling)
    found = set(present)
    return tuple(
        GetResult(status="present" if i in found else "missing") for i in range(len(batch))
    )

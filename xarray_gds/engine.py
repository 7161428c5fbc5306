"""Many reads of lazily indexed xarray-gds arrays served as one.

:func:`read_many` is what a computation that needs many pieces of many arrays calls
(the joined dask blocks of :mod:`xarray_gds.fuse`, xarray's ``load_async`` gathers):
the pieces of one array that tile a box are read as that box (one batch, sliced
afterwards), and the boxes of all arrays are read and decoded together
(:func:`xarray_gds.region.read_boxes`). Everything else is read one piece at a time
through the array's own indexing, with the same values and errors.
"""

from __future__ import annotations

import math
from typing import Any

from xarray.core import indexing

from xarray_gds.region import is_box_key

__all__ = ["read_many"]


def _box_key(key: Any, shape: tuple[int, ...]) -> tuple[Any, ...] | None:
    """The key as a tuple of integers and normalised slices of step 1, or None."""
    if not isinstance(key, indexing.BasicIndexer | indexing.OuterIndexer):
        return None
    out: list[Any] = []
    for k, size in zip(key.tuple, shape, strict=True):
        if not is_box_key(k):
            return None
        if isinstance(k, slice):
            a, b, step = k.indices(size)
            if step != 1 or b <= a:
                return None
            out.append(slice(a, b))
        else:
            out.append(int(k) + (size if k < 0 else 0))
    return tuple(out)


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


def read_many(requests: list[tuple[Any, indexing.ExplicitIndexer]]) -> list[Any]:
    """``array[key]`` for every ``(array, key)`` of xarray-gds backend arrays, read
    together; an entry whose read failed holds the exception instead of raising."""
    from xarray_gds.array import GdsBackendArray, read_boxes

    out: list[Any] = [None] * len(requests)
    by_array: dict[int, list[int]] = {}
    for i, (array, _) in enumerate(requests):
        by_array.setdefault(id(array), []).append(i)
    boxes: list[tuple[GdsBackendArray, tuple[Any, ...], list[tuple[int, Any]]]] = []
    alone: list[int] = []
    for members in by_array.values():
        array = requests[members[0]][0]
        keys = [_box_key(requests[i][1], array.shape) for i in members]
        if not isinstance(array, GdsBackendArray) or any(k is None for k in keys):
            alone.extend(members)
            continue
        box_keys: list[tuple[Any, ...]] = [k for k in keys if k is not None]
        union = _union(box_keys) if len(box_keys) > 1 else None
        if union is not None:
            boxes.append(
                (
                    array,
                    union,
                    [(i, _local(k, union)) for i, k in zip(members, box_keys, strict=True)],
                )
            )
        else:
            boxes.extend((array, k, [(i, None)]) for i, k in zip(members, box_keys, strict=True))
    values = read_boxes([(array, key) for array, key, _ in boxes])
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

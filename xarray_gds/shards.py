"""Reads of sharded arrays: the shards' indexes, then their inner chunks by byte range.

A shard (zarr's ``sharding_indexed`` codec) is one object holding many inner chunks and
an index table of their byte ranges. :func:`read_shards` reads the index of every shard
of a batch first (small reads, all in flight), checks each range it needs against the
shard's size, asks the read engine (:mod:`xarray_gds.coalesce`) for the touched inner
chunks as :class:`~xarray_gds.request.ByteRanges`, and assembles each shard from its
decoded inner chunks before its selection is placed in the output.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from zarr.abc.codec import GetResult
from zarr.core.chunk_utils import fill_value_or_default

from xarray_gds import coalesce, decode, stores
from xarray_gds import device as _device
from xarray_gds.batch import offloaded
from xarray_gds.codecs import ShardChain, host
from xarray_gds.entries import place_entries, split
from xarray_gds.errors import ChunkDecodeError
from xarray_gds.place import Tiling, place
from xarray_gds.request import ByteRanges, Decoded, ReadRequest

__all__ = ["read_shards"]


def _touched(sel: Any, size: int, chunk: int) -> np.ndarray:
    """Indices of the inner chunks (of length ``chunk``) that ``sel`` reads from."""
    if isinstance(sel, slice):
        idx = np.arange(*sel.indices(size))
    else:
        idx = np.asarray(sel)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
    return np.unique(idx.reshape(-1) // chunk)


#: A shard's index table ``(*grid, 2)`` of (offset, nbytes) and the size of its file.
_Index = tuple[np.ndarray, int]


async def _shard_index(chain: ShardChain, byte_getter: Any) -> _Index | None:
    """The (offset, nbytes) table of a shard, shaped like its inner chunk grid, and the
    size of the shard in bytes (what the table is checked against before any read)."""
    n = chain.index_nbytes
    key = byte_getter.path
    try:
        found = await stores.source_for(byte_getter.store).read_end(key, n, chain.index_at_end)
    except IsADirectoryError:
        raise ChunkDecodeError(
            key,
            "sharding_indexed",
            "a directory stands where the shard file should be: remove it (or restore "
            "the shard from a backup) to read the shard's chunks as the fill value",
        ) from None
    if found is None:
        return None
    raw, shard_nbytes = found
    if raw.size != n:
        raise ChunkDecodeError(
            key,
            "sharding_indexed",
            f"index of {raw.size} bytes, expected {n} (the shard file holds {shard_nbytes})",
        )
    if chain.index_crc32c:
        raw = host.strip_crc32c([raw], [f"{key} (shard index)"])[0]
    return raw.view("<u8").reshape((*chain.grid, 2)), shard_nbytes


def _check_ranges(
    chain: ShardChain, key: str, flat: np.ndarray, table: np.ndarray, shard_nbytes: int
) -> None:
    """Raise for the first inner chunk whose byte range (``table``: uint64 offset and
    nbytes of the inner chunks ``flat``) does not lie in the chunk data of the shard:
    the ``shard_nbytes`` bytes of its file less its index. Sizes read from a damaged
    index would otherwise size the reads' buffers (an allocation of terabytes)."""
    n_index = chain.index_nbytes
    lo = 0 if chain.index_at_end else n_index
    hi = shard_nbytes - n_index if chain.index_at_end else shard_nbytes
    huge = np.any(table >= np.uint64(1 << 62), axis=1)
    sane = np.where(huge[:, None], np.uint64(0), table).astype(np.int64)
    start, size = sane[:, 0], sane[:, 1]
    bad = huge | (start < lo) | (start + size > hi)
    if not bad.any():
        return
    j = int(np.flatnonzero(bad)[0])
    coords = tuple(int(i) for i in np.unravel_index(int(flat[j]), chain.grid))
    offset, nbytes = int(table[j, 0]), int(table[j, 1])
    raise ChunkDecodeError(
        f"{key} (inner chunk {coords})",
        "sharding_indexed",
        f"the shard index gives it {nbytes} bytes at offset {offset}, outside the chunk "
        f"data (bytes {lo} to {max(lo, hi)}) of the {shard_nbytes}-byte shard file: the "
        "index is damaged or the file truncated",
    )


async def read_shards(
    chain: ShardChain, batch: list[Any], out: Any, drop_axes: tuple[int, ...], on_device: bool
) -> tuple[GetResult, ...]:
    """Read shards: every index first (small host reads, all in flight), then the
    touched inner chunks of every shard by byte range, through the read engine's loop
    (:func:`xarray_gds.coalesce.fetch_decode_parts`: joined with other threads' reads,
    routed by cost, part k + 1 read while part k decodes), each part's shards
    assembled as it comes."""
    indexes = list(await asyncio.gather(*(_shard_index(chain, bg) for bg, *_ in batch)))
    parts = split(batch, decode.part_chunks(len(batch), chain.nbytes, on_device))
    store = batch[0][0].store
    plans: list[tuple[list[_Index | None], _ShardPlan]] = []
    requests: list[ReadRequest] = []
    at = 0
    for part in parts:
        found, at = indexes[at : at + len(part)], at + len(part)
        plan = _shard_plan(chain, part, found)
        plans.append((found, plan))
        held = [bg.path for bg, *_ in part]
        ranges = ByteRanges(held, plan.shard, plan.starts, plan.sizes)
        requests.append(ReadRequest(store, chain.inner, plan.keys, on_device, ranges))
    results: list[GetResult] = []

    def assemble(k: int, decoded: Decoded) -> None:
        found, plan = plans[k]
        results.extend(
            _assemble_shards(chain, parts[k], found, plan, decoded, out, drop_axes, on_device)
        )

    await offloaded(coalesce.fetch_decode_parts, requests, assemble)
    return tuple(results)


class _InnerKeys(Sequence[str]):
    """Names of inner chunks for error messages, formatted only when one is needed."""

    def __init__(self, shard_keys: list[str], plan: _ShardPlan, grid: tuple[int, ...]) -> None:
        self._shard_keys = shard_keys
        self._plan = plan
        self._grid = grid

    def __len__(self) -> int:
        return len(self._plan.sizes)

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        j = range(len(self))[j]
        coords = tuple(int(i) for i in np.unravel_index(int(self._plan.flat[j]), self._grid))
        return f"{self._shard_keys[int(self._plan.shard[j])]} (inner chunk {coords})"


@dataclass
class _ShardPlan:
    """The inner chunks a read needs, in (shard, flat inner index) order.

    ``shard`` indexes the part's shards, ``flat`` the inner chunk grid (C order);
    ``starts`` and ``sizes`` are their byte ranges in the shard; ``keys`` name them.
    """

    shard: np.ndarray
    flat: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    keys: Sequence[str] = ()


def _shard_plan(chain: ShardChain, part: list[Any], indexes: list[_Index | None]) -> _ShardPlan:
    """The inner chunks to read from the shards of ``part`` (vectorized per shard), each
    checked to lie inside its shard's file (see :func:`_check_ranges`)."""
    inner = chain.inner
    grid = chain.grid
    missing = np.iinfo(np.uint64).max
    shards: list[np.ndarray] = []
    flats: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for s, ((bg, _, chunk_sel, _, _), found) in enumerate(zip(part, indexes, strict=True)):
        if found is None:
            continue
        index, shard_nbytes = found
        axes = [
            _touched(sel, n, c)
            for sel, n, c in zip(chunk_sel, chain.shard_shape, inner.chunk_shape, strict=True)
        ]
        flat = np.ravel_multi_index(np.ix_(*axes), grid).reshape(-1)
        table = index.reshape(-1, 2)[flat]
        keep = ~((table[:, 0] == missing) & (table[:, 1] == missing))
        flat, table = flat[keep], table[keep]
        _check_ranges(chain, bg.path, flat, table, shard_nbytes)
        shards.append(np.full(len(flat), s, dtype=np.int64))
        flats.append(flat.astype(np.int64))
        starts.append(table[:, 0].astype(np.int64))
        sizes.append(table[:, 1].astype(np.int64))
    empty = np.zeros(0, dtype=np.int64)

    def cat(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else empty

    plan = _ShardPlan(cat(shards), cat(flats), cat(starts), cat(sizes))
    plan.keys = _InnerKeys([bg.path for bg, *_ in part], plan, grid)
    return plan


def _assemble_shards(
    chain: ShardChain,
    part: list[Any],
    indexes: list[_Index | None],
    plan: _ShardPlan,
    decoded: Decoded,
    out: Any,
    drop_axes: tuple[int, ...],
    on_device: bool,
) -> list[GetResult]:
    """The shards of ``part`` built from their decoded inner chunks (``decoded``, in
    the order of ``plan``), and the selection of each scattered into ``out``."""
    xp = _device.array_module("cuda" if on_device else "cpu")
    inner = chain.inner
    grid = chain.grid
    present, chunks = decoded
    if len(present) != len(plan.sizes):  # a range the index lists was not there
        lost = sorted(set(range(len(plan.sizes))) - set(present))[0]
        raise ChunkDecodeError(
            plan.keys[lost], "sharding_indexed", "the shard vanished while it was read"
        )
    # assemble each shard from its inner chunks (the plan is sorted by shard, so each
    # shard's inner chunks are one slice of it), then place the shards' selections
    bounds = np.searchsorted(plan.shard, np.arange(len(part) + 1))
    whole = tuple(slice(0, s) for s in chain.shard_shape)
    dtype = inner.dtype.newbyteorder("=")
    shards: list[Any] = [None] * len(part)
    for s, (_, spec, _, _, _) in enumerate(part):
        if indexes[s] is None:
            continue
        j0, j1 = int(bounds[s]), int(bounds[s + 1])
        shard = xp.empty(chain.shard_shape, dtype=dtype)
        place(
            shard,
            None if chunks is None else chunks[j0:j1],
            plan.flat[j0:j1].tolist(),  # the grid positions of the shard's inner chunks
            math.prod(grid),
            lambda k: (_inner_region(k, grid, inner.chunk_shape), ()),
            fill_value_or_default(spec),
            on_device,
            tiling=Tiling(grid, whole, whole),
        )
        shards[s] = shard
    found = [s for s in range(len(part)) if shards[s] is not None]
    place_entries(
        out.as_ndarray_like(), [shards[s] for s in found], found, part, on_device, drop_axes
    )
    return [GetResult(status="present" if sh is not None else "missing") for sh in shards]


def _inner_region(k: int, grid: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Where inner chunk ``k`` (C order of ``grid``) lies in its shard."""
    at = np.unravel_index(k, grid)
    return tuple(slice(int(i) * c, (int(i) + 1) * c) for i, c in zip(at, chunk_shape, strict=True))

"""Batched writes: the chunks of a write merged, checked and encoded a batch at a time.

The codec pipeline (:mod:`xarray_gds.pipeline`) hands :func:`write_batched` the writes
of device values (and of host values where ``XARRAY_GDS_BATCHED_HOST_WRITES`` asks for
it) to arrays whose codecs have a batched encoder (:func:`xarray_gds.codecs.encode.plan_encode`).
Each part of the batch is staged (:func:`_stage`), merged with the value and encoded in
the engine's threads (:func:`_encode_part`: one nvCOMP call on the GPU, the batched
host encoder on the host), and stored (:func:`_store_jobs`) while the next part is
staged and encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import zarr
from zarr.core.buffer import cpu
from zarr.core.chunk_utils import fill_value_or_default
from zarr.core.common import concurrent_map

from xarray_gds import decode, route, stores
from xarray_gds import device as _device
from xarray_gds.batch import offloaded, parallel
from xarray_gds.codecs.encode import (
    EncodeChain,
    ShardEncode,
    empty_rows,
    encode_host,
    encode_host_threads,
    encode_shards,
)
from xarray_gds.entries import split

__all__ = ["write_batched"]

#: ``read(entries, out)``: the codec pipeline's batched read of zarr's batch entries
Read = Callable[[list[Any], Any], Awaitable[Any]]


async def write_batched(
    read: Read,
    plan: EncodeChain | ShardEncode,
    batch: list[Any],
    array: Any,
    drop_axes: tuple[int, ...],
    on_device: bool,
) -> None:
    """Merge, check and encode the chunks of a write in batches, then store them.

    Chunks the value fills are encoded from it alone; the others start from their
    stored values (decoded by the batched ``read``) or the fill value. Each chunk file
    is written whole (the store's atomic set) or deleted when it holds only the fill
    value and ``write_empty_chunks`` is off. The files of one batch are written while
    the next batch is staged and encoded.
    """
    # the staged chunks, their stored layout and the compressed output live together
    per_part = max(1, decode.budget(on_device) // max(1, 5 * plan.nbytes))
    writing: asyncio.Future[None] | None = None
    try:
        for part in split(batch, per_part):
            stage = await _stage(read, plan, part, on_device)
            pieces = await offloaded(_encode_part, plan, part, stage, array, drop_axes, on_device)
            jobs = [
                (bs, None if piece is None else cpu.Buffer.from_array_like(piece))
                for (bs, *_), piece in zip(part, pieces, strict=True)
            ]
            if writing is not None:
                await writing
            writing = asyncio.ensure_future(_store_jobs(jobs))
        if writing is not None:
            done, writing = writing, None
            await done
    finally:
        if writing is not None:  # a batch failed: let the writes in flight finish first
            with contextlib.suppress(Exception):
                await writing


async def _stage(
    read: Read, plan: EncodeChain | ShardEncode, part: list[Any], on_device: bool
) -> Any:
    """The chunks of ``part``, stacked, as they are before the write: nothing yet where
    the value fills a chunk, the fill value where it fills an edge chunk's part inside
    the array, the stored chunk (one batched read; a missing one as the fill value)
    where it covers a chunk only in part."""
    xp = _device.array_module("cuda" if on_device else "cpu")
    stage = xp.empty((len(part), *plan.chunk_shape), dtype=plan.dtype.newbyteorder("="))
    whole = tuple(slice(0, s) for s in plan.chunk_shape)
    stored: list[Any] = []  # chunks the write covers only in part: read them
    for j, entry in enumerate(part):
        if _covers(entry, plan.chunk_shape):
            continue
        byte_setter, spec, _, _, complete = entry
        if complete:  # an edge chunk: the value covers all of it inside the array
            stage[j] = fill_value_or_default(spec)
        else:
            stored.append((byte_setter, spec, whole, (j, *whole), True))
    if stored:  # one batched read (missing chunks come back as the fill value)
        proto = _device.buffer_prototype("cuda" if on_device else "cpu")
        await read(stored, proto.nd_buffer.from_ndarray_like(stage))
    return stage


def _encode_part(
    plan: EncodeChain | ShardEncode,
    part: list[Any],
    stage: Any,
    array: Any,
    drop_axes: tuple[int, ...],
    on_device: bool,
) -> list[Any]:
    """The value written into the staged chunks of ``part``, and each chunk encoded, or
    None where it holds only the fill value and ``write_empty_chunks`` is off."""
    xp = _device.array_module("cuda" if on_device else "cpu")
    write_empty = bool(part[0][1].config.write_empty_chunks)
    keep = _assemble(stage, part, array, drop_axes, write_empty, xp)
    kept = np.flatnonzero(keep)
    pieces: list[Any] = [None] * len(part)
    if not kept.size:
        return pieces
    chunks = stage if kept.size == len(part) else stage[xp.asarray(kept)]
    encoder = _encoder(on_device)
    on_gpu = on_device
    if on_device and isinstance(plan, EncodeChain):
        # a batch of few chunks encodes faster on the host threads (route.choose_encode)
        on_gpu = route.choose_encode(plan.compressor, int(kept.size), plan.nbytes) == "gpu"
        if not on_gpu:
            chunks = _device.cupy().asnumpy(chunks)  # one copy of the batch to the host
            encoder = encode_host_threads
    try:
        if isinstance(plan, ShardEncode):
            fill = fill_value_or_default(part[0][1])
            done = encode_shards(plan, chunks, write_empty, fill, xp, encoder)
        else:
            encoded = encoder(plan, chunks)
            done = [encoded.chunk(k) for k in range(kept.size)]
    except (RuntimeError, ValueError) as err:
        first, last = part[int(kept[0])][0].path, part[int(kept[-1])][0].path
        where = "GPU (nvCOMP)" if on_gpu else "host"
        raise RuntimeError(
            f"xarray-gds: encoding {kept.size} chunks ({first} .. {last}) with "
            f"[{', '.join(plan.codecs)}] on the {where} failed: {err}"
        ) from err
    for j, piece in zip(kept.tolist(), done, strict=True):
        pieces[j] = piece
    return pieces


def _encoder(on_device: bool) -> Callable[[Any, Any], Any]:
    """The batched encoder: nvCOMP's on the device, the threaded host one on the host."""
    if on_device:
        from xarray_gds.codecs import nvcomp

        return nvcomp.encode
    return encode_host


def _covers(entry: Any, chunk_shape: tuple[int, ...]) -> bool:
    """Whether the value written to this chunk fills all of it."""
    _, _, chunk_sel, _, complete = entry
    if not complete:
        return False
    for sel, size in zip(chunk_sel, chunk_shape, strict=False):
        if not isinstance(sel, slice) or len(range(*sel.indices(size))) != size:
            return False
    return len(chunk_sel) == len(chunk_shape)


def _assemble(
    stage: Any,
    part: list[Any],
    array: Any,
    drop_axes: tuple[int, ...],
    write_empty: bool,
    xp: Any,
) -> np.ndarray:
    """Write the value into the staged chunks; return which chunks to store (not empty)."""
    ndim = stage.ndim - 1
    expand = tuple(None if i in drop_axes else slice(None) for i in range(ndim))
    for j, (_, _, chunk_sel, out_sel, _) in enumerate(part):
        value = array[out_sel] if array.ndim else array
        if drop_axes:
            value = value[expand]
        stage[(j, *chunk_sel)] = value
    n = len(part)
    if write_empty or not n:
        return np.ones(n, dtype=bool)
    return ~empty_rows(stage.reshape(n, -1), fill_value_or_default(part[0][1]), xp)


async def _store_jobs(jobs: list[tuple[Any, Any]]) -> None:
    """Write (or delete, for ``None``) every chunk of a part."""
    store = jobs[0][0].store
    # one write per thread of the pool, GIL released (a local store, held for the write)
    if stores.source_for(store).writes_in_threads:
        keys = [bs.path for bs, _ in jobs]
        await offloaded(_store_all, store, keys, [b for _, b in jobs])
    else:
        await concurrent_map(jobs, _store_one, zarr.config.get("async.concurrency"))


def _store_all(store: Any, keys: list[str], buffers: list[Any]) -> None:
    def one(i: int) -> None:
        if buffers[i] is None:
            store.delete_sync(keys[i])
        else:
            store.set_sync(keys[i], buffers[i])

    parallel(one, len(keys))


async def _store_one(byte_setter: Any, buffer: Any) -> None:
    if buffer is None:
        await byte_setter.delete()
    else:
        await byte_setter.set(buffer)

"""The bottom layer of the read and write paths: the batch of chunk bytes on the device,
offsets packing, and the host thread pool every layer shares.

Nothing here imports from the rest of the package except :mod:`xarray_gds.config` (and,
when a device batch is packed, :mod:`xarray_gds.device` for CuPy): stores, codecs and
the read engine all build on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds import config

__all__ = [
    "ALIGN",
    "DeviceBatch",
    "Fetched",
    "HostBatch",
    "PinnedStaging",
    "pack",
    "offload",
    "offloaded",
    "pack_offsets",
    "parallel",
    "pool_threads",
    "start",
]

ALIGN = 16  #: the strictest nvCOMP input/output alignment (its docs advise 16)


@dataclass
class DeviceBatch:
    """Whole files packed into one device buffer.

    Attributes
    ----------
    arena : cupy.ndarray
        uint8 buffer holding every present file, each starting at a 16-byte boundary.
    offsets, sizes : numpy.ndarray
        int64 start and length of each file in ``arena``; ``sizes`` is -1 for
        missing files.
    """

    arena: Any
    offsets: np.ndarray
    sizes: np.ndarray


class HostBatch(list[np.ndarray | None]):
    """Chunk bytes read into host memory: one uint8 array a location, ``None`` where
    the chunk is missing."""


#: What a source's read gives the engine: device memory or host memory
Fetched = DeviceBatch | HostBatch


def pack_offsets(sizes: np.ndarray, align: int = ALIGN) -> tuple[np.ndarray, int]:
    """Start offsets (aligned) of buffers of ``sizes`` laid end to end, and the total.

    The default alignment (16 bytes) is the strictest nvCOMP asks of its inputs.
    """
    padded = (np.maximum(sizes, 0) + align - 1) // align * align
    offsets = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes):
        np.cumsum(padded[:-1], out=offsets[1:])
    return offsets, int(padded.sum())


def pack(arrays: list[Any]) -> DeviceBatch:
    """Pack device arrays (``None`` for missing chunks) into one aligned arena."""
    from xarray_gds import device as _device

    cp = _device.cupy()
    sizes = np.array([-1 if a is None else int(a.size) for a in arrays], dtype=np.int64)
    offsets, total = pack_offsets(sizes, ALIGN)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    for a, start in zip(arrays, offsets.tolist(), strict=True):
        if a is not None and a.size:
            arena[start : start + a.size] = cp.asarray(a).view(cp.uint8).reshape(-1)
    return DeviceBatch(arena, offsets, sizes)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    workers = config.get("host_threads") or min(32, os.cpu_count() or 1)
    return ThreadPoolExecutor(max_workers=max(1, int(workers)), thread_name_prefix="xarray-gds")


#: threads of the read engine's own executor (:func:`offload`): calls beyond it queue,
#: behind calls that run, so they are served in turn
ENGINE_THREADS = 64


@functools.cache
def _engine_threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(ENGINE_THREADS, thread_name_prefix="xarray-gds-read")


if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_engine_threads.cache_clear)


def offload(fn: Any, *args: Any) -> concurrent.futures.Future[Any]:
    """Run ``fn(*args)`` in the read engine's own threads.

    zarr's codec pipeline runs on zarr's event loop, and an engine read blocks its
    thread (waiting for the group it joined, or for the store reads it leads). Run in
    the loop's default executor, a burst of such reads can take every worker while the
    leader waits for a store read that needs one of them (zarr's ``LocalStore`` reads
    through ``asyncio.to_thread``): a deadlock. These threads serve nothing else, and
    whoever waits in them waits for a thread that runs, so they never run out of work
    they need.
    """
    return _engine_threads().submit(fn, *args)


async def offloaded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the read engine's own threads (:func:`offload`), awaited on an
    event loop: never in the loop's default executor, whose workers zarr's stores need
    to serve the reads the engine waits for."""
    return await asyncio.wrap_future(offload(fn, *args))


def pool_threads() -> int:
    """Threads of the shared host pool (``xarray_gds.host_threads``; CPU count, at most
    32, by default; fixed at the pool's first use)."""
    return int(_pool()._max_workers)


def parallel(fn: Any, n: int, workers: int | None = None, min_items: int = 4) -> None:
    """Run ``fn(i)`` for ``i`` in ``range(n)`` on the pool, in a few contiguous blocks
    per worker (one future per block, not per item: per-item futures cost more than
    decoding a small chunk). ``workers`` caps the threads used (all the pool's by
    default); with one, or fewer than ``min_items`` items (4: small work items; 2 for
    items of milliseconds, such as decoding a large chunk), everything runs in the
    calling thread."""
    if n < max(2, min_items) or workers == 1:
        for i in range(n):
            fn(i)
        return
    used = pool_threads() if workers is None else max(1, min(workers, pool_threads()))
    blocks = min(n, 4 * used)
    edges = np.linspace(0, n, blocks + 1).astype(int)

    def block(b: int) -> None:
        for i in range(edges[b], edges[b + 1]):
            fn(i)

    start(block, blocks, used)()


def start(fn: Any, n: int, workers: int) -> Callable[[], None]:
    """Start ``fn(i)`` for ``i`` in ``range(n)`` on at most ``workers`` threads of the
    pool (each takes the next item as it finishes one) and return ``wait()``, which
    waits for them all and raises the first error: for work that runs beside the
    calling thread's own (:func:`parallel` waits at once)."""
    claim = itertools.count()  # next() is atomic: each item runs once

    def run() -> None:
        while (i := next(claim)) < n:
            fn(i)

    used = max(1, min(workers, n, pool_threads())) if n > 0 else 0
    futures = [_pool().submit(run) for _ in range(used)]

    def wait() -> None:
        concurrent.futures.wait(futures)  # all of them, even when one failed
        for future in futures:
            future.result()

    return wait


class PinnedStaging:
    """Pinned (page-locked) host buffers, reused from one request to the next.

    A batch decoded on the host for the device is decoded into pinned memory and copied
    from there: a copy from pageable memory runs at about half the speed and cannot
    overlap the decode. Allocating pinned memory is slow (measured on the H200 host:
    2.7 ms for 4 MB, 41 ms for 64 MB, 643 ms for 600 MB), so buffers are kept and
    handed out again: a lease takes the smallest free buffer that is large enough,
    or allocates one (sizes rounded up to a power of two, at least 1 MiB). At most
    ``keep_bytes`` (``xarray_gds.staging_bytes``) stay allocated between leases;
    the largest go first when more would.
    """

    def __init__(self, keep_bytes: int | None = None) -> None:
        self._keep = keep_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocations = 0  #: buffers allocated so far (the rest were reused)

    @contextlib.contextmanager
    def lease(self, nbytes: int) -> Iterator[np.ndarray]:
        """A pinned uint8 buffer of ``nbytes``, this caller's until the block exits
        (finish any copy from it first)."""
        buffer = self._take(nbytes)
        try:
            yield buffer[:nbytes]
        finally:
            self._give(buffer)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:  # the smallest that fits (the list is sorted by size)
                return self._free.pop(fits[0])
        size = max(1 << 20, 1 << max(0, nbytes - 1).bit_length())
        self.allocations += 1
        return self._allocate(size)

    @staticmethod
    def _allocate(nbytes: int) -> np.ndarray:
        import cupyx

        return cupyx.empty_pinned((nbytes,), dtype=np.uint8)

    def _give(self, buffer: np.ndarray) -> None:
        keep = self._keep if self._keep is not None else int(config.get("staging_bytes"))
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.nbytes)
            while self._free and sum(b.nbytes for b in self._free) > keep:
                self._free.pop()  # the largest

    def clear(self) -> None:
        """Release every kept buffer."""
        with self._lock:
            self._free.clear()

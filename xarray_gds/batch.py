"""The bottom layer of the read and write paths: the batch of chunk bytes on the device,
offsets packing, and the host thread pool every layer shares.

Nothing here imports from the rest of the package except :mod:`xarray_gds.config`:
stores, codecs and the read engine all build on it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds import config

__all__ = ["DeviceBatch", "pack_offsets", "parallel", "pool_threads"]


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


def pack_offsets(sizes: np.ndarray, align: int = 16) -> tuple[np.ndarray, int]:
    """Start offsets (aligned) of buffers of ``sizes`` laid end to end, and the total.

    The default alignment (16 bytes) is the strictest nvCOMP asks of its inputs.
    """
    padded = (np.maximum(sizes, 0) + align - 1) // align * align
    offsets = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes):
        np.cumsum(padded[:-1], out=offsets[1:])
    return offsets, int(padded.sum())


@functools.cache
def _pool() -> ThreadPoolExecutor:
    workers = config.get("host_threads") or min(32, os.cpu_count() or 1)
    return ThreadPoolExecutor(max_workers=max(1, int(workers)), thread_name_prefix="xarray-gds")


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
    pool = _pool()
    used = pool_threads() if workers is None else max(1, min(workers, pool_threads()))
    blocks = min(n, 4 * used)
    edges = np.linspace(0, n, blocks + 1).astype(int)
    claim = itertools.count()  # next() is atomic: each block runs once

    def run() -> None:
        while (b := next(claim)) < blocks:
            for i in range(edges[b], edges[b + 1]):
                fn(i)

    futures = [pool.submit(run) for _ in range(min(used, blocks))]
    concurrent.futures.wait(futures)  # all of them, even when one failed
    for future in futures:
        future.result()

"""Remote objects read on the host: through obstore straight for an obstore store, else
the store's own ``get``, every object of a batch in flight at once, with bounded retries
of transient faults (:func:`read_host`), or streamed to the host pool's threads as they
come (:class:`HostStream`). The retry policy and the errors are
:mod:`xarray_gds.stores.urls`'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from xarray_gds.stores import objstore
from xarray_gds.stores.urls import (
    BACKOFF,
    READ_ATTEMPTS,
    ShortBody,
    read_error,
    redact,
    retries_itself,
    store_options,
    store_url,
    transient,
)

__all__ = ["HostStream", "read_host"]

#: the remote kind's logger (the retries of reads are logged at DEBUG)
logger = logging.getLogger("xarray_gds.stores.remote")


def _reader(
    stores: list[Any],
    keys: list[str],
    ranges: tuple[np.ndarray, np.ndarray] | None,
    attempts: int,
) -> Any:
    """``read(i)``: the coroutine that reads item ``i`` (see :func:`read_host`), with the
    bounded retries of transient faults."""
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import cpu

    async def once(i: int) -> np.ndarray | None:
        start = size = None
        if ranges is not None:
            start, size = int(ranges[0][i]), int(ranges[1][i])
        obj = objstore.inner(stores[i])
        if obj is not None:  # obstore straight: one GET, no zarr Buffer between
            raw = await objstore.fetch(obj, keys[i], start, size)
            data = None if raw is None else np.frombuffer(raw, dtype=np.uint8)
        else:
            request = None if start is None else RangeByteRequest(start, start + (size or 0))
            got = await stores[i].get(keys[i], prototype=cpu.buffer_prototype, byte_range=request)
            data = None if got is None else np.asarray(got.as_numpy_array()).view(np.uint8)
        if data is None:
            return None
        if size is not None and data.size != size:
            raise ShortBody(f"{data.size} of the {size} bytes asked for came")
        return data

    async def one(i: int) -> np.ndarray | None:
        tries = 1 if retries_itself(stores[i]) else max(1, attempts)
        for n in range(1, tries + 1):
            try:
                return await once(i)
            except Exception as err:
                failed = err
            # raised here, not in the except block: the library's error (whose text
            # may hold credentials) is not chained as __context__
            if n == tries or not transient(failed):
                raise read_error(stores[i], keys[i], n, failed) from None
            logger.debug(
                "chunk %r of %r: try %d of %d failed (%s), trying again",
                keys[i],
                store_url(stores[i]),
                n,
                tries,
                redact(
                    f"{type(failed).__name__}: {failed}",
                    store_options(stores[i]),
                    str(getattr(stores[i], "path", "")),
                ),
            )
            await asyncio.sleep(BACKOFF[min(n, len(BACKOFF)) - 1])
        raise AssertionError("unreachable")  # the loop returns or raises

    return one


def _concurrency(n: int) -> int:
    import zarr

    return int(zarr.config.get("async.concurrency") or n or 1)


def read_host(
    stores: list[Any],
    keys: list[str],
    ranges: tuple[np.ndarray, np.ndarray] | None = None,
    attempts: int = READ_ATTEMPTS,
) -> list[np.ndarray | None]:
    """Objects ``keys[i]`` of ``stores[i]`` (or ``sizes[i]`` bytes at ``starts[i]`` of
    them, with ``ranges``), all in flight at once, as uint8 arrays (``None`` for a
    missing object): through obstore straight for an obstore store, else the store's
    ``get``.

    A read that fails with a transient fault (see :func:`~xarray_gds.stores.urls.transient`)
    is tried again, at most ``attempts`` times in all (once where the filesystem retries
    itself, as s3fs does). A body shorter than its Content-Length raises in the client;
    a range that comes back shorter than asked is caught here: neither is ever returned
    as data.

    Raises
    ------
    ConnectionError
        The server cannot be reached or cut the body short, on every try.
    TimeoutError
        The server did not answer within the timeout set in ``storage_options``.
    PermissionError
        HTTP 401/403 (not tried again).
    """
    from zarr.core.sync import sync

    one = _reader(stores, keys, ranges, attempts)

    async def every() -> list[np.ndarray | None]:
        # as many in flight as zarr allows; the first read that fails for good cancels
        # the others (no more tries against a server that is gone)
        limit = asyncio.Semaphore(_concurrency(len(keys)))

        async def bounded(i: int) -> np.ndarray | None:
            async with limit:
                found: np.ndarray | None = await one(i)
                return found

        first: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(bounded(i)) for i in range(len(keys))]
        except BaseExceptionGroup as errors:
            first = errors.exceptions[0]
        if first is not None:  # outside the except block: no group as __context__
            raise first from None
        return [t.result() for t in tasks]

    found: list[np.ndarray | None] = sync(every())
    return found


class HostStream:
    """Whole objects ``keys[i]`` of ``stores[i]`` all requested at once (zarr's
    ``async.concurrency`` in flight) while the host pool's threads take each as it
    comes, decode it and place it (:meth:`get`): the reads of a batch overlap its
    decoding. Retries and errors as :func:`read_host`."""

    def __init__(self, stores: list[Any], keys: list[str]) -> None:
        self._reads = objstore.Prefetch(
            _reader(stores, keys, None, READ_ATTEMPTS), len(keys), _concurrency(len(keys))
        )

    def get(self, i: int) -> np.ndarray | None:
        found: np.ndarray | None = self._reads.get(i)
        return found

    def close(self) -> None:
        self._reads.close()

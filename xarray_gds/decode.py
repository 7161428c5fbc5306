"""Decoding a batch of fetched chunks, and how large a batch is: the layer under the
read engine (:mod:`xarray_gds.coalesce`), the box reads (:mod:`xarray_gds.region`) and
the zarr adapter (:mod:`xarray_gds.pipeline`), which all decode through
:func:`decode_fetched`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from xarray_gds import config, route
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch, PinnedStaging, start
from xarray_gds.codecs import DecodeChain, host
from xarray_gds.errors import ChunkDecodeError
from xarray_gds.request import Decoded

__all__ = [
    "batch_bytes",
    "budget",
    "decode_fetched",
    "decode_host",
    "decode_routed",
    "hand_over",
    "Joined",
    "Picked",
    "decode_split",
    "decode_staged",
    "part_chunks",
]


def batch_bytes(on_device: bool = True) -> int:
    """Decoded bytes per batch of a read (``XARRAY_GDS_BATCH_BYTES``; default 4 GiB on
    the GPU, 1 GiB on the host).

    A read of more chunks than fit runs batch after batch (the next one read while the
    current one decodes), so its working set stays bounded whatever its size.
    """
    default = 4 << 30 if on_device else 1 << 30
    return int(config.get("batch_bytes") or default)


def budget(on_device: bool) -> int:
    """Decoded bytes per batch: the configured budget, and on the GPU at most a sixth
    of the free device memory. Beside the output live the compressed bytes of two
    batches (the one decoding and the next one being read), the decoded rows of one,
    and up to two more decoded-size temporaries (realignment, byte order, tiling)."""
    budget = batch_bytes(on_device)
    if on_device:
        free, _ = _device.cupy().cuda.runtime.memGetInfo()
        budget = min(budget, max(1, free // 6))
    return budget


def pipeline_parts() -> int:
    """Parts a read is split into at least (``XARRAY_GDS_PIPELINE_PARTS``, default 1).

    Part ``k + 1`` is always read while part ``k`` decodes. Measured on an H200, one
    nvCOMP call over all chunks beat any split into overlapped parts (its decode is
    the bottleneck, and fewer chunks per call use the GPU less well), so by default
    a read is split only when it exceeds the batch budget (:func:`batch_bytes`).
    """
    return max(1, int(config.get("pipeline_parts")))


#: Reads smaller than this are not split: a decode call needs many chunks to fill the GPU.
MIN_PART_BYTES = 64 << 20


def part_chunks(n_chunks: int, chunk_nbytes: int, on_device: bool) -> int:
    """Chunks per part of a read of ``n_chunks`` chunks of ``chunk_nbytes`` decoded bytes."""
    chunk_nbytes = max(1, chunk_nbytes)
    total = n_chunks * chunk_nbytes
    target = min(budget(on_device), max(MIN_PART_BYTES, -(-total // pipeline_parts())))
    return max(1, target // chunk_nbytes)


def decode_routed(
    chain: DecodeChain,
    fetched: Any,
    keys: Sequence[str],
    staging: PinnedStaging,
    *,
    host: bool,
    on_device: bool,
) -> Decoded:
    """Decode fetched chunks by their group's route: on the host for the device
    (``host``: staged through pinned memory, copied as they decode), on the GPU (the
    host pool taking a share where :func:`xarray_gds.route.plan` gives it one), or on
    the host. Device values are whole when this returns (:func:`hand_over`): they go to
    the threads that asked."""
    if host:
        decoded = decode_staged(chain, fetched, keys, staging)
    elif on_device and chain.compressor is not None:
        n = int(np.count_nonzero(fetched.sizes >= 0))
        share = route.plan(chain.compressor.format, n, chain.nbytes)
        if share.host:
            decoded = decode_split(chain, fetched, keys, staging, share.host, share.threads)
        else:
            decoded = decode_fetched(chain, fetched, keys, True)
    else:
        decoded = decode_fetched(chain, fetched, keys, on_device)
    hand_over(on_device)
    return decoded


def hand_over(on_device: bool) -> None:
    """Before device values made on this thread's current stream go to another thread:
    wait for that stream. The thread that takes them computes on a stream of its own
    (the default stream of another thread, or a caller's ``cupy.cuda.Stream``), which
    does not wait for this one: without the wait it reads them half made (the filters
    of a decode, a Blosc unshuffle, the chunks placed in the output still queued)."""
    if on_device:
        _device.cupy().cuda.get_current_stream().synchronize()


def decode_host(
    chain: DecodeChain,
    chunks: list[Any],
    keys: Sequence[str],
    out: np.ndarray | None = None,
    done: Callable[[int], None] | None = None,
) -> Any:
    """The chunks' stored bytes ``(n, nbytes)`` decoded by the host codecs (into
    ``out`` when given; ``done(i)`` as soon as row ``i`` is decoded, if given)."""
    with _described(chain):
        return _decode_host(chain, chunks, keys, out, done)


@contextmanager
def _described(chain: DecodeChain) -> Iterator[None]:
    """Name the chain's chunk shape and dtype in a size mismatch raised by a decoder
    (:meth:`ChunkDecodeError.describe`)."""
    try:
        yield
    except ChunkDecodeError as err:
        err.describe(chain.chunk_shape, chain.dtype)
        raise


def _decode_host(
    chain: DecodeChain,
    chunks: list[Any],
    keys: Sequence[str],
    out: np.ndarray | None,
    done: Callable[[int], None] | None,
) -> Any:
    if chain.crc32c:
        chunks = host.strip_crc32c(chunks, keys)
    if chain.compressor is not None:  # its format checks the chunks' headers first
        return host.decompress(chain.compressor, chunks, chain.nbytes, keys, out, done)
    data = host.stack(chunks, chain.nbytes, keys, out)
    if done is not None:
        for i in range(len(chunks)):
            done(i)
    return data


class Picked(Sequence[str]):
    """``keys[i]`` for ``i`` in ``rows``, looked up only when an error names one (names
    of shards' inner chunks are formatted on demand)."""

    def __init__(self, keys: Sequence[str], rows: Sequence[int]) -> None:
        self._keys = keys
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return self._keys[self._rows[j]]


class Joined(Sequence[str]):
    """Several sequences of keys as one, looked up on demand."""

    def __init__(self, parts: Sequence[Sequence[str]]) -> None:
        self._parts = parts
        self._ends = np.cumsum([len(p) for p in parts])

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        j = range(len(self))[j]
        k = int(np.searchsorted(self._ends, j, side="right"))
        return self._parts[k][j - (int(self._ends[k - 1]) if k else 0)]


def _names(keys: Sequence[str], present: list[int]) -> Sequence[str]:
    return keys if len(present) == len(keys) else Picked(keys, present)


_streams = threading.local()


def _copy_stream() -> Any:
    """This thread's stream for staged copies to the current device, ordered after what
    the current stream has queued so far (CuPy's pool may hand out, as the copies'
    destination, memory that kernels queued there still write: a buffer another read
    just freed)."""
    cp = _device.cupy()
    device = cp.cuda.Device().id
    cached = getattr(_streams, "by_device", None)
    if cached is None:
        cached = _streams.by_device = {}
    if device not in cached:
        cached[device] = cp.cuda.Stream(non_blocking=True)
    stream = cached[device]
    stream.wait_event(cp.cuda.get_current_stream().record())
    return stream


def decode_staged(
    chain: DecodeChain, fetched: list[Any], keys: Sequence[str], staging: PinnedStaging
) -> Decoded:
    """:func:`decode_fetched` of host-fetched chunks for the device: the host codecs
    decode into a pinned buffer leased from ``staging`` (none is allocated per
    request once it has grown), each row is copied to the current device as soon as
    it is decoded (the copies overlap the decoding of the rest), and the filters and
    the final layout run on the device, as after an nvCOMP decode."""
    present = [i for i, data in enumerate(fetched) if data is not None]
    if not present:
        return present, None
    names = _names(keys, present)
    cp = _device.cupy()
    n, nbytes = len(present), chain.nbytes
    rows = cp.empty((n, nbytes), dtype=np.uint8)
    device = rows.device.id
    stream = _copy_stream()
    with staging.lease(n * nbytes) as pinned:
        out = pinned.reshape(n, nbytes)

        def copy(i: int) -> None:  # in the decoding thread, on the batch's device
            with cp.cuda.Device(device):
                rows[i].set(out[i], stream=stream)

        try:
            decode_host(chain, [fetched[i] for i in present], names, out, copy)
        finally:  # the buffer goes back to the pool: no copy may still read it
            stream.synchronize()
    return _finished(chain, present, rows, cp)


def decode_split(
    chain: DecodeChain,
    fetched: DeviceBatch,
    keys: Sequence[str],
    staging: PinnedStaging,
    host: int,
    threads: int,
) -> Decoded:
    """:func:`decode_fetched` of chunks read into device memory, ``host`` of them (the
    last present ones) decoded by the host pool on at most ``threads`` threads while
    nvCOMP decodes the others (:func:`xarray_gds.route.split`).

    The host's chunks' stored bytes come back from the device (compressed: a fraction
    of what they decode to), each decodes into a pinned buffer leased from
    ``staging`` and goes back to its row on the device as soon as it is decoded, as in
    :func:`decode_staged`. The rows, the filters and the final layout are those of
    :func:`decode_fetched`; a chunk that fails raises as it would there."""
    present = np.flatnonzero(fetched.sizes >= 0).tolist()
    n = len(present)
    host = max(0, min(host, n))
    if host == 0:
        return decode_fetched(chain, fetched, keys, True)
    names = _names(keys, present)
    cp = _device.cupy()
    nbytes, m = chain.nbytes, n - host
    mine = present[m:]
    stored = [
        cp.asnumpy(fetched.arena[o : o + s])
        for o, s in zip(fetched.offsets[mine].tolist(), fetched.sizes[mine].tolist(), strict=True)
    ]
    rows = cp.empty((n, nbytes), dtype=np.uint8)
    device = rows.device.id
    stream = _copy_stream()
    with staging.lease(host * nbytes) as pinned:
        out = pinned.reshape(host, nbytes)

        def one(i: int) -> None:  # on a thread of the host pool
            decode_host(chain, [stored[i]], Picked(names, [m + i]), out[i : i + 1])
            with cp.cuda.Device(device):
                rows[m + i].set(out[i], stream=stream)

        wait = start(one, host, threads)
        try:
            if m:
                rows[:m] = _on_device(chain, fetched, present[:m], Picked(names, range(m)))
        finally:  # every host chunk decoded (or failed) and copied before the lease ends
            try:
                wait()
            finally:
                stream.synchronize()
    return _finished(chain, present, rows, cp)


def decode_fetched(
    chain: DecodeChain, fetched: Any, keys: Sequence[str], on_device: bool
) -> Decoded:
    """Decode the chunks a fetch found: ``(present, chunks)``, the indices of the keys
    whose chunk exists and their values ``(len(present), *chunk_shape)`` (native byte
    order; ``None`` when no chunk exists). ``fetched`` is what
    a source's read returns for ``keys`` on that side (:mod:`xarray_gds.stores`)."""
    xp = _device.array_module("cuda" if on_device else "cpu")
    if on_device:
        present = np.flatnonzero(fetched.sizes >= 0).tolist()
    else:
        present = [i for i, data in enumerate(fetched) if data is not None]
    if not present:
        return present, None
    names = _names(keys, present)
    if on_device:
        data = _on_device(chain, fetched, present, names)
    else:
        data = decode_host(chain, [fetched[i] for i in present], names)
    return _finished(chain, present, data, xp)


def _on_device(chain: DecodeChain, fetched: DeviceBatch, idx: list[int], names: Any) -> Any:
    """nvCOMP's decode of the chunks ``idx`` of ``fetched``, errors described."""
    from xarray_gds.codecs import nvcomp

    with _described(chain):
        return nvcomp.decode(chain, fetched, idx, names)


def _finished(chain: DecodeChain, present: list[int], data: Any, xp: Any) -> Decoded:
    """``(present, chunks)``: the decoded rows ``data`` through the chain's filters and
    into the chunks' layout."""
    for f in chain.filters:
        data = f.apply(data, xp)
    return present, chain.finish(data, xp)

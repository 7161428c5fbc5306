"""Device decoders: one nvCOMP batch call per batch of chunks, standard streams only.

The chunks of a batch lie in one device arena (:class:`~xarray_gds.batch.DeviceBatch`).
Framing is handled here with host work on metadata only: the first bytes of every
chunk are gathered in one kernel and copied to the host to check the stream headers
(each format's magic bytes, declared sizes and framing), then the
offsets and sizes (numpy vectors) are adjusted to point at the raw stream, and
nvCOMP decodes every chunk of the batch into rows of one output buffer.
"""

from __future__ import annotations

import atexit
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from xarray_gds import device as _device
from xarray_gds.batch import ALIGN as _ALIGN
from xarray_gds.batch import DeviceBatch, pack, pack_offsets
from xarray_gds.codecs import DecodeChain, crc32c
from xarray_gds.codecs.formats import CRC32C, Format
from xarray_gds.codecs.formats.base import PEEK
from xarray_gds.errors import ChunkDecodeError

__all__ = ["decode", "decode_frames", "gather", "pack"]

_local = threading.local()  # per thread: compiled kernels, and a _Lane per device

#: threads per device that keep their nvCOMP codecs between calls; the codecs of any
#: other thread go when its call ends
KEPT_CODECS = 4


class _Lane:
    """One thread's CUDA stream and nvCOMP codecs on one device. nvCOMP wants a codec
    made and used by one thread (it is not thread-safe), and a stream and a codec
    belong to the device current when they were made. A codec's scratch memory grows
    to the largest batch it saw, and dask's, zarr's, the engine's and a caller's pools
    hold hundreds of threads between them: so only :data:`KEPT_CODECS` threads a
    device keep their codecs between calls (the first to finish one), and the others
    drop theirs, in their own thread, when the call ends. A lane goes with its thread."""

    __slots__ = ("__weakref__", "codecs", "device", "stream")

    def __init__(self, stream: Any, device: int) -> None:
        self.stream = stream
        self.device = device
        self.codecs: dict[str, Any] = {}


_lock = threading.Lock()
_all_lanes: weakref.WeakSet[_Lane] = weakref.WeakSet()  # every live thread's, for _release
_keepers: dict[int, weakref.WeakSet[_Lane]] = {}  # per device, the lanes that keep codecs
_release_registered = False


def _nvcomp() -> Any:
    try:
        from nvidia import nvcomp
    except ImportError as err:
        raise ImportError(
            "xarray-gds decodes on the GPU with NVIDIA nvCOMP, which could not be imported "
            f"({err}); {_device.INSTALL_HINT}"
        ) from err
    return nvcomp


@contextmanager
def _lane() -> Iterator[_Lane]:
    """This thread's lane on the current device, for the nvCOMP calls inside the
    ``with``. When the block ends, the lane's codecs stay if it is one of the
    :data:`KEPT_CODECS` keepers of the device (or can become one), and are dropped
    otherwise; a block that raised always drops them (nvCOMP's state after a failed
    call is not trusted: the next call makes fresh ones)."""
    global _release_registered
    cp = _device.cupy()
    gpu = cp.cuda.Device().id
    per_device = _local.__dict__.setdefault("lanes", {})
    lane = per_device.get(gpu)
    if lane is None:
        with _lock:
            if not _release_registered:
                # registered after CuPy's own exit handlers, so it runs before them:
                # nvCOMP codecs must go before the streams and the context they use
                atexit.register(_release)
                _release_registered = True
        lane = per_device[gpu] = _Lane(cp.cuda.Stream(non_blocking=True), gpu)
        _all_lanes.add(lane)
    try:
        yield lane
    except BaseException:
        lane.codecs.clear()
        with _lock:
            _keepers.get(gpu, weakref.WeakSet()).discard(lane)
        raise
    with _lock:
        keepers = _keepers.setdefault(gpu, weakref.WeakSet())
        if lane not in keepers and len(keepers) < KEPT_CODECS:
            keepers.add(lane)
        keep = lane in keepers
    if not keep:
        lane.codecs.clear()


def _release() -> None:
    """Drop every lane's codecs (at exit, before CUDA goes)."""
    for lane in list(_all_lanes):
        lane.codecs.clear()


def _retry_out_of_memory(stream: Any, call: Callable[..., Any], inputs: Any, out: Any) -> Any:
    """``call(inputs, out=out)`` (an nvCOMP codec's decode or encode); when nvCOMP
    finds the device out of memory, once more after CuPy's memory pool has handed its
    cached free blocks back to the device. nvCOMP allocates its scratch outside that
    pool, and the pool keeps every block freed since for CuPy's reuse, so a device
    whose memory CuPy merely caches would refuse nvCOMP what is in fact free (CuPy's
    own allocations retry the same way)."""
    try:
        return call(inputs, out=out)
    except RuntimeError as err:
        if "out of memory" not in str(err):
            raise
        stream.synchronize()
        _device.cupy().get_default_memory_pool().free_all_blocks()
        return call(inputs, out=out)


def _codec(lane: _Lane, fmt: Format) -> Any:
    """The nvCOMP codec of ``fmt``'s raw streams on ``lane``."""
    if fmt.name not in lane.codecs:
        if fmt.nvcomp is None:
            raise ValueError(f"nvCOMP has no {fmt.name} codec")
        nvcomp = _nvcomp()
        lane.codecs[fmt.name] = nvcomp.Codec(
            algorithm=fmt.nvcomp,
            bitstream_kind=nvcomp.BitstreamKind.RAW,
            device_id=lane.stream.device_id,
            cuda_stream=lane.stream.ptr,
        )
    return lane.codecs[fmt.name]


def _peek(batch: DeviceBatch, offsets: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` bytes of each chunk, on the host (zero past a chunk's end)."""
    cp = _device.cupy()
    index = cp.asarray(offsets)[:, None] + cp.arange(n)[None, :]
    index = cp.minimum(index, batch.arena.size - 1)
    return cp.asnumpy(batch.arena[index])


_GATHER = r"""
extern "C" __global__ void gather(const unsigned char* src, const long long* src_off,
                                  unsigned char* dst, const long long* dst_off,
                                  const long long* sizes, long long per) {
    // Segment i = blockIdx.x / per: copy sizes[i] bytes from src + src_off[i] to
    // dst + dst_off[i]; the `per` blocks of a segment share its bytes.
    long long i = blockIdx.x / per;
    long long part = blockIdx.x % per;
    const unsigned char* s = src + src_off[i];
    unsigned char* d = dst + dst_off[i];
    long long n = sizes[i];
    for (long long k = part * blockDim.x + threadIdx.x; k < n; k += per * blockDim.x) d[k] = s[k];
}
"""


def _kernel(source: str, entry: str) -> Any:
    """A compiled CuPy RawKernel, cached per thread (CuPy caches the binary on disk)."""
    cache = _local.__dict__.setdefault("kernels", {})
    if entry not in cache:
        cache[entry] = _device.cupy().RawKernel(source, entry)
    return cache[entry]


def gather(
    src: Any, src_offsets: np.ndarray, dst: Any, dst_offsets: np.ndarray, sizes: np.ndarray
) -> None:
    """Copy byte segments ``src[src_offsets[i]:][:sizes[i]]`` to ``dst[dst_offsets[i]:]``
    in one kernel launch (one copy per segment would cost a launch each)."""
    n = len(sizes)
    if not n:
        return
    cp = _device.cupy()
    threads = 256
    largest = int(sizes.max())
    per = max(1, min(256, -(-largest // (threads * 64)), (2**31 - 1) // n))
    _kernel(_GATHER, "gather")(
        (n * per,),
        (threads,),
        (
            src,
            cp.asarray(src_offsets),
            dst,
            cp.asarray(dst_offsets),
            cp.asarray(sizes),
            np.int64(per),
        ),
    )


def _walk(
    fmt: Format,
    batch: DeviceBatch,
    offsets: np.ndarray,
    sizes: np.ndarray,
    nbytes: int | np.ndarray,
    keys: Sequence[str],
    codec: str | None = None,
) -> None:
    """Check on the device that every stream is whole with ``fmt``'s walk kernel
    (:class:`~xarray_gds.codecs.formats.base.DeviceWalk`); a format without one is not
    checked.

    ``nbytes`` is the decoded size of every stream, or one per stream; ``codec`` names
    the codec in errors (default: the stream format)."""
    walk = fmt.walk
    if walk is None:
        return
    cp = _device.cupy()
    messages = walk.errors
    kernel = _kernel(walk.source, walk.entry)
    n = len(keys)
    status = cp.empty(n, dtype=cp.int64)
    args: tuple[Any, ...] = (batch.arena, cp.asarray(offsets), cp.asarray(sizes), np.int32(n))
    if walk.sized:
        wanted = np.full(n, nbytes, dtype=np.int64) if np.ndim(nbytes) == 0 else nbytes
        args += (cp.asarray(np.ascontiguousarray(wanted, dtype=np.int64)),)
    threads = 128
    kernel(((n + threads - 1) // threads,), (threads,), (*args, status))
    codes = cp.asnumpy(status)
    bad = np.flatnonzero(codes)
    if bad.size:
        j = int(bad[0])
        message = messages.get(int(codes[j]), "corrupt stream")
        raise ChunkDecodeError(keys[j], codec or fmt.name, message)


def _frame(
    fmt: Format,
    batch: DeviceBatch,
    offsets: np.ndarray,
    sizes: np.ndarray,
    nbytes: int,
    keys: Sequence[str],
) -> tuple[np.ndarray, np.ndarray]:
    """Check stream headers (and trailers, and on the device that every stream is
    whole); return offsets and sizes of the raw streams for nvCOMP."""
    heads = _peek(batch, offsets, PEEK)
    skip, trim = fmt.check(heads, sizes, nbytes, keys)
    offsets, sizes = offsets + skip, sizes - trim
    _walk(fmt, batch, offsets, sizes, nbytes, keys)
    if fmt.tail:
        fmt.check_tail(_peek(batch, offsets + sizes - fmt.tail, fmt.tail), nbytes, keys)
    return offsets, sizes


def _aligned(batch: DeviceBatch, offsets: np.ndarray, sizes: np.ndarray) -> DeviceBatch:
    """A batch whose streams all start on an aligned offset (copying them if they do not)."""
    if not np.any(offsets % _ALIGN):
        return DeviceBatch(batch.arena, offsets, sizes)
    cp = _device.cupy()
    new_offsets, total = pack_offsets(sizes, _ALIGN)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    gather(batch.arena, offsets, arena, new_offsets, sizes)
    return DeviceBatch(arena, new_offsets, sizes)


def _batch(buffer: Any, offsets: np.ndarray, sizes: np.ndarray, stream: Any) -> Any:
    """An nvCOMP BatchArray of ``sizes[i]`` bytes at ``offsets[i]`` of ``buffer``.

    nvCOMP >= 6 carves a batch out of one buffer from the offset table; older
    versions take one array per entry.
    """
    nvcomp = _nvcomp()
    offs, lens = offsets.tolist(), sizes.tolist()
    try:
        return nvcomp.as_arrays(buffer, offs, lens, cuda_stream=stream.ptr)
    except TypeError:
        views = [buffer[o : o + n] for o, n in zip(offs, lens, strict=True)]
        return nvcomp.as_arrays(views, stream.ptr)


def decode(chain: DecodeChain, batch: DeviceBatch, idx: list[int], keys: Sequence[str]) -> Any:
    """Decode chunks ``idx`` of ``batch`` into a ``(len(idx), nbytes)`` uint8 CuPy array."""
    cp = _device.cupy()
    nbytes = chain.nbytes
    offsets = batch.offsets[idx]
    sizes = batch.sizes[idx]
    m = len(idx)
    if chain.crc32c:
        sizes = _strip_crc32c(batch, offsets, sizes, keys)
    if chain.compressor is None:
        bad = np.flatnonzero(sizes != nbytes)
        if bad.size:
            j = int(bad[0])
            raise ChunkDecodeError(
                keys[j],
                "bytes",
                f"chunk holds {int(sizes[j])} bytes, expected {nbytes}",
                decoded=int(sizes[j]),
                expected=nbytes,
            )
        out = cp.empty((m, nbytes), dtype=cp.uint8)
        gather(batch.arena, offsets, out, np.arange(m, dtype=np.int64) * nbytes, sizes)
        return out
    fmt = chain.compressor.format
    if fmt.container:
        return decode_frames(fmt, batch, offsets, sizes, nbytes, keys)
    offsets, sizes = _frame(fmt, batch, offsets, sizes, nbytes, keys)
    src = _aligned(batch, offsets, sizes)
    row = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    out = cp.empty((m, row), dtype=cp.uint8)
    rows = np.arange(m, dtype=np.int64) * row
    _run(fmt, fmt.name, src, out.reshape(-1), rows, np.full(m, nbytes, dtype=np.int64), keys)
    return cp.ascontiguousarray(out[:, :nbytes]) if row != nbytes else out


def _strip_crc32c(
    batch: DeviceBatch, offsets: np.ndarray, sizes: np.ndarray, keys: Sequence[str]
) -> np.ndarray:
    """Check the trailing CRC-32C (little-endian) of every chunk with one nvCOMP call;
    return the sizes without it."""
    short = np.flatnonzero(sizes < CRC32C.trim)
    if short.size:
        j = int(short[0])
        raise CRC32C.too_short(keys[j], int(sizes[j]))
    body = sizes - CRC32C.trim
    stored = np.ascontiguousarray(_peek(batch, offsets + body, CRC32C.trim)).view("<u4")[:, 0]
    with _lane() as lane:
        actual = crc32c.crc32c(batch.arena, offsets, body, lane.stream)
    bad = np.flatnonzero(actual != stored)
    if bad.size:
        j = int(bad[0])
        raise CRC32C.mismatch(keys[j], int(stored[j]), int(actual[j]))
    return body


def decode_frames(
    fmt: Format, batch: DeviceBatch, offsets: Any, sizes: Any, nbytes: int, keys: Sequence[str]
) -> Any:
    """Decode frames of the container format ``fmt`` (see
    :attr:`~xarray_gds.codecs.formats.base.Format.container`) at ``offsets`` of ``batch``
    into a ``(n, nbytes)`` CuPy array: the format lists their streams, and the streams
    of each inner format decode in one nvCOMP call."""

    def decode(inner: Format, arena: Any, *streams: Any) -> tuple[Any, np.ndarray]:
        return _decode_streams(inner, arena, *streams, codec=fmt.name)

    cp = _device.cupy()
    return fmt.decode_frames(
        batch.arena, offsets, sizes, nbytes, keys, xp=cp, gather=gather, decode=decode
    )


def _decode_streams(
    fmt: Format,
    arena: Any,
    starts: np.ndarray,
    lengths: np.ndarray,
    decoded_sizes: np.ndarray,
    keys: Sequence[str],
    *,
    codec: str,
) -> tuple[Any, np.ndarray]:
    """Decode streams of any alignment and sizes with one nvCOMP call (``codec``: the
    container's name, for errors).

    Returns a buffer of the decoded streams and the offset of each in it.
    """
    cp = _device.cupy()
    if np.any(lengths <= 0):
        j = int(np.flatnonzero(lengths <= 0)[0])
        raise ChunkDecodeError(keys[j], codec, "empty compressed stream")
    src = _aligned(DeviceBatch(arena, starts, lengths), starts, lengths)
    _walk(fmt, src, src.offsets, src.sizes, decoded_sizes, keys, codec)
    out_offsets, out_total = pack_offsets(decoded_sizes, _ALIGN)
    out = cp.empty(max(out_total, 1), dtype=cp.uint8)
    _run(fmt, codec, src, out, out_offsets, decoded_sizes, keys)
    return out, out_offsets


def _run(
    fmt: Format,
    codec: str,
    src: DeviceBatch,
    out: Any,
    out_offsets: np.ndarray,
    out_sizes: np.ndarray,
    keys: Sequence[str],
) -> None:
    """One nvCOMP call of ``fmt``'s algorithm: the streams of ``src`` into ``out_sizes[i]`` bytes at
    ``out_offsets[i]`` of ``out``. Failures and decoded sizes other than ``out_sizes``
    raise ChunkDecodeError naming the stream's key and ``codec``."""
    cp = _device.cupy()
    m = len(keys)
    with _lane() as lane:
        stream = lane.stream
        # nvCOMP runs on its own stream: make it wait for the reads and copies above
        stream.wait_event(cp.cuda.get_current_stream().record())
        inputs = _batch(src.arena, src.offsets, src.sizes, stream)
        outputs = _batch(out, out_offsets, out_sizes, stream)
        try:
            result = _retry_out_of_memory(stream, _codec(lane, fmt).decode, inputs, outputs)
            # wait in CuPy, which lets other threads run meanwhile: read before the wait,
            # nvCOMP's buffer_sizes does the waiting itself and the other dask threads
            # stall (a profile of 50 store reads had their decode time in it)
            stream.synchronize()
            got = np.asarray(result.buffer_sizes, dtype=np.int64)
        except (RuntimeError, ValueError) as err:
            stream.synchronize()
            # nvCOMP names the failing buffer of the batch ("Output array 12 ...") if it can
            found = re.search(r"array (\d+)", str(err))
            where = int(found.group(1)) if found and int(found.group(1)) < m else None
            key = keys[where] if where is not None else f"{keys[0]} .. {keys[-1]} ({m} chunks)"
            raise ChunkDecodeError(key, codec, str(err)) from err
    bad = np.flatnonzero(got != out_sizes)
    if bad.size:
        j = int(bad[0])
        raise ChunkDecodeError(
            keys[j],
            codec,
            f"decoded to {int(got[j])} bytes, expected {int(out_sizes[j])}",
            decoded=int(got[j]),
            expected=int(out_sizes[j]),
        )


# -- encoding -------------------------------------------------------------------------

_ADLER = r"""
extern "C" __global__ void adler_parts(const unsigned char* data, long long nbytes,
                                       long long seg, unsigned long long* a_out,
                                       unsigned long long* b_out) {
    // Block (x, y) sums segment x of row y: A = sum(d_i), B = sum((nbytes - i) * d_i),
    // both mod 65521 (Adler-32 without its start values); rows are nbytes apart.
    __shared__ unsigned long long sa[256], sb[256];
    const unsigned char* p = data + (long long)blockIdx.y * nbytes;
    long long s0 = (long long)blockIdx.x * seg;
    long long s1 = s0 + seg < nbytes ? s0 + seg : nbytes;
    unsigned long long a = 0, b = 0;
    for (long long i = s0 + threadIdx.x; i < s1; i += blockDim.x) {
        unsigned long long d = p[i];
        a += d;
        b += d * (unsigned long long)((nbytes - i) % 65521);
    }
    sa[threadIdx.x] = a % 65521;
    sb[threadIdx.x] = b % 65521;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sa[threadIdx.x] += sa[threadIdx.x + s];
            sb[threadIdx.x] += sb[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(&a_out[blockIdx.y], sa[0] % 65521);
        atomicAdd(&b_out[blockIdx.y], sb[0] % 65521);
    }
}
"""


def adler32(data: Any) -> np.ndarray:
    """Adler-32 of every row of the device array ``data`` ``(n, nbytes)`` uint8."""
    cp = _device.cupy()
    n, nbytes = data.shape
    a = cp.zeros(n, dtype=cp.uint64)
    b = cp.zeros(n, dtype=cp.uint64)
    seg = 1 << 16  # 256 threads x 256 bytes: per-thread sums stay far below 2**64
    kernel = _kernel(_ADLER, "adler_parts")
    for first in range(0, n, 65535):  # the grid's y dimension
        rows = min(65535, n - first)
        kernel(
            (max(1, -(-nbytes // seg)), rows),
            (256,),
            (data[first:], np.int64(nbytes), np.int64(seg), a[first:], b[first:]),
        )
    a_host, b_host = cp.asnumpy(a).astype(np.int64), cp.asnumpy(b).astype(np.int64)
    low = (a_host + 1) % 65521
    high = (b_host + nbytes) % 65521
    return ((high << 16) | low).astype(np.uint32)


def _to_pinned(array: Any) -> np.ndarray:
    """A copy of the device array in pinned host memory (a copy to pageable memory runs
    at a fraction of the bus speed)."""
    import cupyx

    host: np.ndarray = cupyx.empty_pinned(array.shape, dtype=array.dtype)
    array.get(out=host)
    return host


def encode(chain: Any, chunks: Any) -> Any:
    """Encode device chunk arrays ``(n, *chunk_shape)`` of an EncodeChain with one nvCOMP
    call; returns an :class:`~xarray_gds.codecs.encode.Encoded` in host memory."""
    from xarray_gds.codecs import encode as enc

    cp = _device.cupy()
    data = enc.layout(chain, chunks, cp)
    fmt = chain.compressor
    if fmt is None:
        return enc.pack(None, None, _to_pinned(data), None)
    frames = chain.frames
    if frames is not None:  # containers of streams: blocks in one batch
        return enc.Encoded(
            *frames.encode(
                data,
                xp=cp,
                compress=compress_streams,
                gather=gather,
                adler=adler32,
                to_host=_to_pinned,
            )
        )
    n, nbytes = data.shape
    checksums = adler32(data) if fmt.adler32 else None
    stride = -(-nbytes // _ALIGN) * _ALIGN  # nvCOMP wants aligned inputs
    if stride != nbytes:
        padded = cp.empty((n, stride), dtype=cp.uint8)
        padded[:, :nbytes] = data
        data = padded
    offsets = np.arange(n, dtype=np.int64) * stride
    out, rows, sizes = _encode_batch(
        fmt, data.reshape(-1), offsets, np.full(n, nbytes, dtype=np.int64)
    )
    starts, total, head = enc.stream_starts(fmt, sizes)
    packed = cp.empty(max(1, total), dtype=cp.uint8)
    gather(out, rows, packed, starts + head, sizes)
    host = _to_pinned(packed)
    return enc.Encoded(host, starts, enc.add_framing(fmt, host, starts, sizes, nbytes, checksums))


def compress_streams(
    inner: Any, flat: Any, offsets: np.ndarray, sizes: np.ndarray
) -> tuple[Any, np.ndarray, np.ndarray]:
    """Raw streams of ``inner.format`` (a container's inner streams) of the pieces
    ``flat[offsets[i]:][:sizes[i]]`` of a device buffer, with one nvCOMP call (pieces
    not on an aligned offset are copied first): ``(buffer, starts, sizes)``."""
    src = _aligned(DeviceBatch(flat, offsets, sizes), offsets, sizes)
    return _encode_batch(inner.format, src.arena, src.offsets, src.sizes)


def _encode_batch(
    fmt: Format, buffer: Any, offsets: np.ndarray, sizes: np.ndarray
) -> tuple[Any, np.ndarray, np.ndarray]:
    """One nvCOMP encode of the (aligned) pieces of ``buffer`` into rows of one device
    buffer: ``(out, row starts, compressed sizes)``."""
    cp = _device.cupy()
    n = len(sizes)
    with _lane() as lane:
        stream = lane.stream
        inputs = _batch(buffer, offsets, sizes, stream)
        row = fmt.encode_bound(int(sizes.max()) if n else 0)
        try:
            for attempt in range(2):
                row = -(-row // _ALIGN) * _ALIGN
                out = cp.empty(n * row, dtype=cp.uint8)
                rows = np.arange(n, dtype=np.int64) * row
                # nvCOMP runs on its own stream: make it wait for the kernels that
                # computed the inputs, and for the current stream's users of the block
                # CuPy's pool just handed out as ``out`` (a buffer another thread freed
                # with a write to it still queued): waiting before ``out`` is allocated,
                # that late write lands on nvCOMP's output
                stream.wait_event(cp.cuda.get_current_stream().record())
                outputs = _batch(out, rows, np.full(n, row, dtype=np.int64), stream)
                try:
                    call = _codec(lane, fmt).encode
                    result = _retry_out_of_memory(stream, call, inputs, outputs)
                    stream.synchronize()  # waits in CuPy, not in buffer_sizes (see _run)
                    break
                except ValueError as err:
                    stream.synchronize()
                    needed = re.search(r"(\d+) bytes required", str(err))
                    if attempt or needed is None:
                        raise
                    row = int(needed.group(1))
            got = np.asarray(result.buffer_sizes, dtype=np.int64)
        finally:
            stream.synchronize()  # nothing goes back to CuPy's pool while nvCOMP uses it
    return out, rows, got

"""Host decoders: numcodecs (or a faster decoder a format names, see
:meth:`Format.fast_decoder <xarray_gds.codecs.formats.base.Format.fast_decoder>`) in a
thread pool, one batch at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numcodecs.compat import ensure_ndarray

from xarray_gds.batch import parallel
from xarray_gds.codecs.formats import CRC32C, Compressor
from xarray_gds.errors import ChunkDecodeError

__all__ = ["decompress", "parallel", "strip_crc32c"]


def strip_crc32c(chunks: Sequence[Any], keys: Sequence[str]) -> list[np.ndarray]:
    """Check and remove the trailing CRC-32C (little-endian) of every chunk."""
    out = []
    for i, raw in enumerate(chunks):  # keys[i] only on error: they may be formatted lazily
        data = ensure_ndarray(raw).view(np.uint8).reshape(-1)
        if data.size < CRC32C.trim:
            raise CRC32C.too_short(keys[i], data.size)
        body, stored = data[: -CRC32C.trim], int(data[-CRC32C.trim :].view("<u4")[0])
        actual = CRC32C.value(body.tobytes())
        if actual != stored:
            raise CRC32C.mismatch(keys[i], stored, actual)
        out.append(body)
    return out


def decompress(
    compressor: Compressor,
    chunks: Sequence[Any],
    nbytes: int,
    keys: Sequence[str],
    out: np.ndarray | None = None,
    done: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Decode ``chunks`` with ``compressor`` into a ``(len(chunks), nbytes)`` array
    (``out`` when given); ``done(i)`` is called in the decoding thread as soon as row
    ``i`` holds its values (to start its copy to the device).

    The decoded sizes that streams declare (in their headers, size prefixes, a
    container's tables) are checked against ``nbytes`` first, as
    on the GPU (:meth:`Format.check_host <xarray_gds.codecs.formats.base.Format.check_host>`):
    numcodecs allocates what a stream declares before it decodes a byte, so a damaged
    header would otherwise ask for terabytes.
    """
    # numcodecs decodes straight into the output when every stream's decoded size is
    # known to be ``nbytes`` (as the checks found): one copy less
    into = compressor.format.check_host(chunks, nbytes, keys)
    # a faster decoder where one is installed (the ``fast-host`` extra); the chunks
    # it does not decode exactly as numcodecs would go to numcodecs
    fast = compressor.format.fast_decoder()
    if out is None:
        out = np.empty((len(chunks), nbytes), dtype=np.uint8)
    rows = out

    def one(i: int) -> None:
        _decode_one(i)
        if done is not None:
            done(i)

    def _decode_one(i: int) -> None:
        if fast is not None and (decoded := fast(chunks[i], nbytes)) is not None:
            rows[i] = np.frombuffer(decoded, dtype=np.uint8)
            return
        try:
            if into:
                compressor.host_codec.decode(chunks[i], out=rows[i])
                return
            decoded = ensure_ndarray(compressor.host_codec.decode(chunks[i]))
        except Exception as err:
            raise ChunkDecodeError(
                keys[i], compressor.name, str(err) or type(err).__name__
            ) from err
        decoded = decoded.view(np.uint8).reshape(-1)
        if decoded.size != nbytes:
            raise ChunkDecodeError(
                keys[i],
                compressor.name,
                f"decoded to {decoded.size} bytes, expected {nbytes}",
                decoded=decoded.size,
                expected=nbytes,
            )
        rows[i] = decoded

    # a large chunk takes milliseconds to decode: two of them already pay for the pool
    parallel(one, len(chunks), min_items=2 if nbytes >= _LARGE_CHUNK else 4)
    return out


#: Decoded size from which two chunks are decoded on two threads.
_LARGE_CHUNK = 256 << 10


def stack(
    chunks: Sequence[Any], nbytes: int, keys: Sequence[str], out: np.ndarray | None = None
) -> np.ndarray:
    """Uncompressed chunks as one ``(n, nbytes)`` array (``out`` when given), checking
    every size."""
    if out is None:
        out = np.empty((len(chunks), nbytes), dtype=np.uint8)
    for i, raw in enumerate(chunks):
        data = ensure_ndarray(raw).view(np.uint8).reshape(-1)
        if data.size != nbytes:
            raise ChunkDecodeError(
                keys[i],
                "bytes",
                f"chunk holds {data.size} bytes, expected {nbytes}",
                decoded=data.size,
                expected=nbytes,
            )
        out[i] = data
    return out

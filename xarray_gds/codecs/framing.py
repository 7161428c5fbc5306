"""Stream framing, checked on the host from a few header bytes of every chunk.

Shared by the device and host decoders: given the first :data:`PEEK` bytes of each
encoded chunk (and its size), check the stream header, check the decoded size it
declares (where the format declares one) against the chunk size, and say where the
raw stream starts and how long it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xarray_gds.errors import ChunkDecodeError

__all__ = ["PEEK", "STREAMS", "check", "heads", "zstd_content_sizes"]

PEEK = 18  #: bytes of each chunk needed (the longest zstd frame header)
_ZSTD_MAGIC = 0xFD2FB528
_MIN_SIZE = {"zstd": 9, "lz4": 5, "zlib": 7, "gzip": 18}
#: Stream formats :func:`check` knows.
STREAMS = frozenset(_MIN_SIZE)


def heads(chunks: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The first :data:`PEEK` bytes of each host chunk (zeros past its end) and its size,
    as :func:`check` takes them.

    Parameters
    ----------
    chunks : sequence of array-like
        Encoded chunks in host memory (anything with the buffer protocol).

    Returns
    -------
    (heads, sizes)
        ``(n, PEEK)`` uint8 and ``(n,)`` int64.
    """
    out = np.zeros((len(chunks), PEEK), dtype=np.uint8)
    sizes = np.empty(len(chunks), dtype=np.int64)
    for i, raw in enumerate(chunks):
        data = np.frombuffer(raw, dtype=np.uint8)
        sizes[i] = data.size
        out[i, : min(PEEK, data.size)] = data[:PEEK]
    return out, sizes


def zstd_content_sizes(heads: np.ndarray) -> np.ndarray:
    """Frame content size declared by each zstd frame header; -1 where omitted.

    ``heads`` is ``(n, PEEK)`` uint8; all chunks are handled at once (no Python loop
    per chunk).
    """
    fhd = heads[:, 4].astype(np.int64)
    single = (fhd >> 5) & 1
    dict_bytes = np.array([0, 1, 2, 4])[fhd & 3]
    flag = fhd >> 6
    width = np.where(flag == 0, single, np.array([0, 2, 4, 8])[flag])
    pos = 5 + (1 - single) + dict_bytes
    value = np.zeros(len(heads), dtype=np.uint64)
    rows = np.arange(len(heads))
    for b in range(8):  # little-endian bytes, up to the widest field
        byte = heads[rows, np.minimum(pos + b, heads.shape[1] - 1)].astype(np.uint64)
        value |= np.where(b < width, byte, 0).astype(np.uint64) << np.uint64(8 * b)
    sizes = value.astype(np.int64) + np.where(width == 2, 256, 0)
    return np.where(width == 0, -1, sizes)


def _first_bad(bad: np.ndarray) -> int | None:
    where = np.flatnonzero(bad)
    return int(where[0]) if where.size else None


def check(
    name: str, heads: np.ndarray, sizes: np.ndarray, nbytes: int, keys: Sequence[str]
) -> tuple[int, int]:
    """Validate the headers of a batch of ``name`` streams.

    Parameters
    ----------
    name : {"zstd", "lz4", "zlib", "gzip"}
        Stream format.
    heads : numpy.ndarray
        ``(n, PEEK)`` uint8: the first bytes of each chunk (zeros past its end).
    sizes : numpy.ndarray
        Encoded size of each chunk.
    nbytes : int
        Expected decoded size of every chunk.
    keys : list of str
        Chunk keys, for errors.

    Returns
    -------
    (skip, trim)
        Bytes before the raw stream and bytes to drop in all (nvCOMP's view of the
        stream: numcodecs' LZ4 size prefix, zlib's header and Adler-32 trailer).

    Raises
    ------
    ChunkDecodeError
        A chunk is too short, has a bad header, or declares another decoded size.
    """
    if name not in _MIN_SIZE:
        raise ValueError(f"unknown stream format {name!r}")
    sizes = np.asarray(sizes)
    j = _first_bad(sizes < _MIN_SIZE[name])
    if j is not None:
        raise ChunkDecodeError(
            keys[j], name, f"{int(sizes[j])} bytes is too short for a {name} stream"
        )
    h = heads.astype(np.int64)
    word = h[:, 0] | h[:, 1] << 8 | h[:, 2] << 16 | h[:, 3] << 24  # first 4 bytes, LE
    if name == "zstd":
        j = _first_bad(word != _ZSTD_MAGIC)
        if j is not None:
            raise ChunkDecodeError(keys[j], name, "not a zstd frame (bad magic number)")
        declared = zstd_content_sizes(heads)
        j = _first_bad((declared >= 0) & (declared != nbytes))
        if j is not None:
            raise ChunkDecodeError(
                keys[j],
                name,
                f"frame declares {int(declared[j])} decoded bytes, expected {nbytes}",
                decoded=int(declared[j]),
                expected=nbytes,
            )
        return 0, 0
    if name == "lz4":
        j = _first_bad(word != nbytes)
        if j is not None:
            raise ChunkDecodeError(
                keys[j],
                name,
                f"size prefix says {int(word[j])} bytes, expected {nbytes}",
                decoded=int(word[j]),
                expected=nbytes,
            )
        return 4, 4
    if name == "zlib":
        cmf, flg = h[:, 0], h[:, 1]
        j = _first_bad(((cmf & 0x0F) != 8) | ((cmf * 256 + flg) % 31 != 0) | ((flg & 0x20) != 0))
        if j is not None:
            raise ChunkDecodeError(keys[j], name, "bad zlib header")
        return 2, 6
    j = _first_bad((h[:, 0] != 0x1F) | (h[:, 1] != 0x8B) | (h[:, 2] != 8))  # gzip
    if j is not None:
        raise ChunkDecodeError(keys[j], name, "bad gzip header")
    return 0, 0

"""Stream framing, checked on the host from a few header bytes of every chunk.

Shared by the device and host decoders: given the first :data:`PEEK` bytes of each
encoded chunk (and its size), check the stream header, check the decoded size it
declares (where the format declares one) against the chunk size, and say where the
raw stream starts and how long it is.
"""

from __future__ import annotations

import numpy as np

from xarray_gds.errors import ChunkDecodeError

__all__ = ["PEEK", "check", "zstd_content_size"]

PEEK = 18  #: bytes of each chunk needed (the longest zstd frame header)
_ZSTD_MAGIC = 0xFD2FB528
_MIN_SIZE = {"zstd": 9, "lz4": 5, "zlib": 7, "gzip": 18}


def zstd_content_size(head: np.ndarray) -> int | None:
    """Frame content size from a zstd frame header, or None if the frame omits it."""
    fhd = int(head[4])
    fcs_flag = fhd >> 6
    single = (fhd >> 5) & 1
    dict_id_bytes = (0, 1, 2, 4)[fhd & 3]
    pos = 5 + (0 if single else 1) + dict_id_bytes
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if width == 0:
        return None
    value = int.from_bytes(bytes(head[pos : pos + width]), "little")
    return value + 256 if width == 2 else value


def check(
    name: str, heads: np.ndarray, sizes: np.ndarray, nbytes: int, keys: list[str]
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
    minimum = _MIN_SIZE[name]
    for size, key in zip(sizes.tolist(), keys, strict=True):
        if size < minimum:
            raise ChunkDecodeError(key, name, f"{size} bytes is too short for a {name} stream")
    if name == "zstd":
        magic = np.ascontiguousarray(heads[:, :4]).view("<u4")[:, 0]
        for i, key in enumerate(keys):
            if int(magic[i]) != _ZSTD_MAGIC:
                raise ChunkDecodeError(key, name, "not a zstd frame (bad magic number)")
            declared = zstd_content_size(heads[i])
            if declared is not None and declared != nbytes:
                raise ChunkDecodeError(
                    key, name, f"frame declares {declared} decoded bytes, expected {nbytes}"
                )
        return 0, 0
    if name == "lz4":
        prefix = np.ascontiguousarray(heads[:, :4]).view("<u4")[:, 0]
        for i, key in enumerate(keys):
            if int(prefix[i]) != nbytes:
                raise ChunkDecodeError(
                    key, name, f"size prefix says {int(prefix[i])} bytes, expected {nbytes}"
                )
        return 4, 4
    if name == "zlib":
        for i, key in enumerate(keys):
            cmf, flg = int(heads[i, 0]), int(heads[i, 1])
            if cmf & 0x0F != 8 or (cmf * 256 + flg) % 31 or flg & 0x20:
                raise ChunkDecodeError(key, name, "bad zlib header")
        return 2, 6
    if name == "gzip":
        for i, key in enumerate(keys):
            if heads[i, 0] != 0x1F or heads[i, 1] != 0x8B or heads[i, 2] != 8:
                raise ChunkDecodeError(key, name, "bad gzip header")
        return 0, 0
    raise ValueError(f"unknown stream format {name!r}")

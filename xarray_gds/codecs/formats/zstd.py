"""Zstandard (RFC 8878): Zarr v3 ``zstd``, numcodecs ``Zstd``; nvCOMP's ``Zstd``.

A stored chunk is one zstd frame, which nvCOMP decodes as it is: no framing to strip.
Its header starts with a magic number and may declare the decoded size, which is
checked against the chunk size before anything decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numcodecs
import numpy as np
import zarr.codecs as zc

from xarray_gds.codecs.formats.base import (
    DeviceWalk,
    Format,
    Rates,
    first_bad,
    first_word,
)
from xarray_gds.errors import ChunkDecodeError

__all__ = ["ZSTD", "Zstd", "content_sizes"]

_MAGIC = 0xFD2FB528

_WALK = r"""
extern "C" __global__ void zstd_walk(const unsigned char* arena, const long long* offsets,
                                     const long long* sizes, int n, long long* status) {
    // One thread per chunk: follow the block headers of one zstd frame and check that
    // it ends exactly at the end of the chunk. 0: ok, -1: bad header, -2: truncated,
    // -3: reserved block type, -4: bytes after the end of the frame.
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned char* p = arena + offsets[i];
    long long size = sizes[i];
    if (size < 6) { status[i] = -1; return; }
    unsigned fhd = p[4];
    int single = (fhd >> 5) & 1;
    int dict_bytes = (fhd & 3) == 3 ? 4 : (int)(fhd & 3);
    int fcs_flag = fhd >> 6;
    int fcs_bytes = fcs_flag == 0 ? single : (fcs_flag == 1 ? 2 : (fcs_flag == 2 ? 4 : 8));
    long long pos = 5 + (single ? 0 : 1) + dict_bytes + fcs_bytes;
    for (;;) {
        if (pos + 3 > size) { status[i] = -2; return; }
        unsigned h = p[pos] | (p[pos + 1] << 8) | (p[pos + 2] << 16);
        pos += 3;
        int type = (h >> 1) & 3;
        if (type == 3) { status[i] = -3; return; }
        pos += type == 1 ? 1 : (long long)(h >> 3);
        if (pos > size) { status[i] = -2; return; }
        if (h & 1) break;
    }
    if ((fhd >> 2) & 1) pos += 4;  // content checksum
    status[i] = pos == size ? 0 : (pos < size ? -4 : -2);
}
"""
_ERRORS = {
    -1: "bad frame header",
    -2: "truncated stream",
    -3: "reserved block type (corrupt data)",
    -4: "bytes after the end of the frame",
}


def content_sizes(heads: np.ndarray) -> np.ndarray:
    """Frame content size declared by each zstd frame header; -1 where omitted.

    ``heads`` is ``(n, PEEK)`` uint8; many chunks are handled at once (no Python loop
    per chunk), a few one by one (a host read decodes its chunks one at a time, where
    the array operations would cost a fifth of a 1 MiB chunk's decode).
    """
    if len(heads) <= _FEW:
        return np.array([_content_size(row) for row in heads.tolist()], dtype=np.int64)
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


#: Batches of at most this many headers are read one header at a time.
_FEW = 16


def _content_size(head: list[int]) -> int:
    """:func:`content_sizes` of one header (its bytes as ints), the same value."""
    fhd = head[4]
    single = (fhd >> 5) & 1
    flag = fhd >> 6
    width = single if flag == 0 else (0, 2, 4, 8)[flag]
    if width == 0:
        return -1
    pos = 5 + (1 - single) + (0, 1, 2, 4)[fhd & 3]
    last = len(head) - 1
    value = sum(head[min(pos + b, last)] << (8 * b) for b in range(width))
    if value >= 1 << 63:  # as the int64 view of the uint64 field
        value -= 1 << 64
    return value + 256 if width == 2 else value


class Zstd(Format):
    """The zstd format (see the module docstring)."""

    numcodecs_class = numcodecs.Zstd
    zarr_class = zc.ZstdCodec

    def refuse_encode(self, codec: Any) -> str:
        if getattr(codec, "checksum", False):
            return "zstd checksum=True: nvCOMP does not write content checksums"
        return ""

    def _check_heads(self, heads: np.ndarray, nbytes: int, keys: Sequence[str]) -> None:
        j = first_bad(first_word(heads) != _MAGIC)
        if j is not None:
            raise ChunkDecodeError(keys[j], self.name, "not a zstd frame (bad magic number)")
        declared = content_sizes(heads)
        j = first_bad((declared >= 0) & (declared != nbytes))
        if j is not None:
            raise self._wrong_size(
                keys[j], "frame declares {} decoded bytes", int(declared[j]), nbytes
            )

    def _decodes_into(self, heads: np.ndarray, nbytes: int) -> bool:
        return bool(np.all(content_sizes(heads) == nbytes))


#: The zstd format.
ZSTD = Zstd(
    name="zstd",
    nvcomp="Zstd",
    min_size=9,
    # encode rates: `xarray-gds calibrate` on an H100 host, 4 MiB chunks (December 2026)
    rates=Rates(
        gpu_chunk=265e6,
        gpu_batch=80e9,
        host_thread=575e6,
        encode_gpu_chunk=55.8e6,
        encode_gpu_batch=13.9e9,
        encode_host_thread=146e6,
    ),
    walk=DeviceWalk(_WALK, "zstd_walk", _ERRORS),
)

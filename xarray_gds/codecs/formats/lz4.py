"""LZ4 as numcodecs frames it (numcodecs ``LZ4``, Zarr v2 only); nvCOMP's ``LZ4``.

A stored chunk is a 4-byte little-endian decoded size followed by one LZ4 block, the
raw stream nvCOMP decodes. Blosc frames hold LZ4 blocks without that prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numcodecs
import numpy as np

from xarray_gds.codecs.formats.base import (
    DeviceWalk,
    Format,
    Rates,
    first_bad,
    first_word,
)

__all__ = ["LZ4", "Lz4"]

_PREFIX = 4  # bytes of numcodecs' size prefix

_WALK = r"""
__device__ bool extend_run(const unsigned char* p, long long size, long long* ip,
                           long long* run) {
    // LZ4 lengths of 15 continue in bytes of 255 until a smaller one
    unsigned b;
    do {
        if (*ip >= size) return false;
        b = p[(*ip)++];
        *run += b;
    } while (b == 255);
    return true;
}

extern "C" __global__ void lz4_walk(const unsigned char* arena, const long long* offsets,
                                    const long long* sizes, int n, const long long* wanted,
                                    long long* status) {
    // One thread per chunk: follow the sequences of one LZ4 block and check that they
    // stay inside the input, refer only to bytes already produced, and produce exactly
    // `expected` bytes. 0: ok, -2: truncated, -3: bad match offset, -5: wrong size.
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned char* p = arena + offsets[i];
    long long size = sizes[i], ip = 0, op = 0, expected = wanted[i];
    for (;;) {
        if (ip >= size) { status[i] = -2; return; }
        unsigned token = p[ip++];
        long long run = token >> 4;
        if (run == 15 && !extend_run(p, size, &ip, &run)) { status[i] = -2; return; }
        ip += run;
        op += run;
        if (ip > size) { status[i] = -2; return; }
        if (ip == size) break;  // the last sequence holds literals only
        if (ip + 2 > size) { status[i] = -2; return; }
        long long offset = p[ip] | (p[ip + 1] << 8);
        ip += 2;
        if (offset == 0 || offset > op) { status[i] = -3; return; }
        run = token & 15;
        if (run == 15 && !extend_run(p, size, &ip, &run)) { status[i] = -2; return; }
        op += run + 4;
        if (op > expected) { status[i] = -5; return; }
    }
    status[i] = op == expected ? 0 : -5;
}
"""
_ERRORS = {
    -2: "truncated stream",
    -3: "match offset outside the data (corrupt stream)",
    -5: "stream does not decode to the chunk size",
}


def _prefix(nbytes: int) -> np.ndarray:
    """numcodecs' size prefix of a chunk of ``nbytes`` decoded bytes."""
    return np.array([nbytes], dtype="<u4").view(np.uint8)


class Lz4(Format):
    """The LZ4 format (see the module docstring)."""

    numcodecs_class = numcodecs.LZ4
    level_name = "acceleration"

    def _check_heads(self, heads: np.ndarray, nbytes: int, keys: Sequence[str]) -> None:
        word = first_word(heads)
        j = first_bad(word != nbytes)
        if j is not None:
            raise self._wrong_size(keys[j], "size prefix says {} bytes", int(word[j]), nbytes)

    def _decodes_into(self, heads: np.ndarray, nbytes: int) -> bool:
        return True  # every size prefix was checked

    def encode_raw(self, row: np.ndarray) -> bytes:
        return bytes(numcodecs.LZ4().encode(row))[_PREFIX:]  # without the size prefix

    def decode_raw(self, stream: np.ndarray, nbytes: int) -> Any:
        return numcodecs.LZ4().decode(np.concatenate([_prefix(nbytes), stream]))

    def write_framing(
        self, out: np.ndarray, starts: np.ndarray, raw_sizes: np.ndarray, nbytes: int, sums: Any
    ) -> None:
        out[starts[:, None] + np.arange(_PREFIX)] = _prefix(nbytes)


#: numcodecs' LZ4 format.
LZ4 = Lz4(
    name="lz4",
    nvcomp="LZ4",
    skip=_PREFIX,
    trim=_PREFIX,
    min_size=5,
    # encode rates: `xarray-gds calibrate` on an H100 host, 4 MiB chunks (December 2026)
    rates=Rates(
        gpu_chunk=16.8e6,
        gpu_batch=6.5e9,
        host_thread=2.29e9,
        encode_gpu_chunk=8.18e6,
        encode_gpu_batch=26.9e9,
        encode_host_thread=330e6,
    ),
    walk=DeviceWalk(_WALK, "lz4_walk", _ERRORS, sized=True),
    encode_limit=1 << 24,  # nvCOMP's LZ4 encoder takes chunks of at most 16 MiB
)

"""Deflate (RFC 1951) in its two framings: zlib (RFC 1950; numcodecs ``Zlib``, HDF5's
deflate filter through kerchunk) and gzip (RFC 1952; Zarr v3 ``gzip``, numcodecs
``GZip``).

nvCOMP decodes a zlib stream as raw deflate (its ``Deflate`` algorithm) once the 2-byte
header and the 4-byte Adler-32 trailer are stripped, and a gzip member whole (its
``Gzip`` algorithm). Both slow down sharply on large chunks (see the route rates).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numcodecs
import numpy as np
import zarr.codecs as zc

from xarray_gds.codecs.formats.base import Format, Rates, first_bad
from xarray_gds.errors import ChunkDecodeError

__all__ = ["GZIP", "ZLIB", "Gzip", "Zlib"]

#: zlib header bytes written before the raw deflate stream (RFC 1950: deflate,
#: 32 KiB window, default compression; 0x789C is a multiple of 31 as required).
_ZLIB_HEADER = np.frombuffer(b"\x78\x9c", dtype=np.uint8)


class _Deflate(Format):
    def encode_bound(self, nbytes: int) -> int:
        # measured on nvCOMP 6: its Deflate and Gzip encoders ask for about 2.3x the input
        return nbytes * 5 // 2 + 65536


class Zlib(_Deflate):
    """Deflate in zlib framing (see the module docstring)."""

    numcodecs_class = numcodecs.Zlib

    def _check_heads(self, heads: np.ndarray, nbytes: int, keys: Sequence[str]) -> None:
        h = heads.astype(np.int64)
        cmf, flg = h[:, 0], h[:, 1]
        j = first_bad(((cmf & 0x0F) != 8) | ((cmf * 256 + flg) % 31 != 0) | ((flg & 0x20) != 0))
        if j is not None:
            raise ChunkDecodeError(keys[j], self.name, "bad zlib header")

    def encode_raw(self, row: np.ndarray) -> bytes:
        deflate = zlib.compressobj(wbits=-15)
        return deflate.compress(row.tobytes()) + deflate.flush()

    def decode_raw(self, stream: np.ndarray, nbytes: int) -> Any:
        return zlib.decompress(np.ascontiguousarray(stream).tobytes(), wbits=-15)

    def write_framing(
        self, out: np.ndarray, starts: np.ndarray, raw_sizes: np.ndarray, nbytes: int, sums: Any
    ) -> None:
        assert sums is not None  # the Adler-32 of every chunk
        out[starts[:, None] + np.arange(self.skip)] = _ZLIB_HEADER
        trailer = sums.astype(">u4").view(np.uint8).reshape(-1, 4)
        out[(starts + self.skip + raw_sizes)[:, None] + np.arange(4)] = trailer


class Gzip(_Deflate):
    """Deflate in gzip framing (see the module docstring)."""

    numcodecs_class = numcodecs.GZip
    zarr_class = zc.GzipCodec

    def _check_heads(self, heads: np.ndarray, nbytes: int, keys: Sequence[str]) -> None:
        h = heads.astype(np.int64)
        j = first_bad((h[:, 0] != 0x1F) | (h[:, 1] != 0x8B) | (h[:, 2] != 8))
        if j is not None:
            raise ChunkDecodeError(keys[j], self.name, "bad gzip header")

    def check_tail(self, tails: np.ndarray, nbytes: int, keys: Sequence[str]) -> None:
        """Check gzip's ISIZE trailer (decoded size mod 2**32) of every chunk."""
        isize = np.ascontiguousarray(tails).view("<u4")[:, 0]
        j = first_bad(isize != (nbytes & 0xFFFFFFFF))
        if j is not None:
            raise self._wrong_size(keys[j], "trailer gives {} decoded bytes", int(isize[j]), nbytes)


#: Deflate in zlib framing.
ZLIB = Zlib(
    name="zlib",
    nvcomp="Deflate",
    skip=2,
    trim=6,
    min_size=7,
    rates=Rates(gpu_chunk=7.3e6, gpu_batch=65e9, host_thread=147e6),
    adler32=True,
)

#: Deflate in gzip framing.
GZIP = Gzip(
    name="gzip",
    nvcomp="Gzip",
    min_size=18,
    rates=Rates(gpu_chunk=14.4e6, gpu_batch=3.6e9, host_thread=122e6),
    tail=4,
)

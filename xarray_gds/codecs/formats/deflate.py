"""Deflate (RFC 1951) in its two framings: zlib (RFC 1950; numcodecs ``Zlib``, HDF5's
deflate filter through kerchunk) and gzip (RFC 1952; Zarr v3 ``gzip``, numcodecs
``GZip``).

nvCOMP decodes a zlib stream as raw deflate (its ``Deflate`` algorithm) once the 2-byte
header and the 4-byte Adler-32 trailer are stripped, and a gzip member whole (its
``Gzip`` algorithm). Both slow down sharply on large chunks (see the route rates).

On the host, chunks decode with libdeflate when its bindings (PyPI ``deflate``, the
``fast-host`` extra) are installed: 2-2.5 times as fast as zlib on large chunks
(one 4 MiB chunk of weather-like float32 on the project's CI machine: zlib 15.7 ms,
libdeflate 6.4 ms). libdeflate decodes a whole stream into a buffer of the size the
chunk must have; a chunk it cannot decode to exactly that size, as zlib would, goes
to zlib (numcodecs), which gives the same values or raises the same error as without
the package.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numcodecs
import numpy as np
import zarr.codecs as zc

from xarray_gds.codecs.formats.base import Format, Rates, first_bad
from xarray_gds.errors import ChunkDecodeError

__all__ = ["GZIP", "ZLIB", "Gzip", "Zlib", "libdeflate"]

#: zlib header bytes written before the raw deflate stream (RFC 1950: deflate,
#: 32 KiB window, default compression; 0x789C is a multiple of 31 as required).
_ZLIB_HEADER = np.frombuffer(b"\x78\x9c", dtype=np.uint8)


#: Largest decoded size libdeflate's bindings take (their size argument is a C
#: ``unsigned int``, which they do not check).
_LIBDEFLATE_MAX = (1 << 32) - 1


@functools.cache
def libdeflate() -> Any | None:
    """The ``deflate`` package (libdeflate's bindings), or None when it is not
    installed (``pip install ".[fast-host]"`` in a checkout); looked for once
    (``libdeflate.cache_clear()`` looks again)."""
    try:
        import deflate
    except ImportError:
        return None
    return deflate


def _exactly(
    decode: Callable[[Any, int], Any], check: Callable[[Any, Any], bool] | None = None
) -> Callable[[Any, int], Any]:
    """``decode(chunk, nbytes)``, or None where it fails or gives another size (or
    ``check(chunk, decoded)`` is false): what :meth:`Format.fast_decoder` returns."""

    def exactly(chunk: Any, nbytes: int) -> Any:
        if not 0 < nbytes <= _LIBDEFLATE_MAX:
            return None
        try:
            decoded = decode(chunk, nbytes)
        except Exception:  # DeflateError, ValueError, BufferError: zlib decides
            return None
        if len(decoded) != nbytes or (check is not None and not check(chunk, decoded)):
            return None
        return decoded

    return exactly


class _Deflate(Format):
    def encode_bound(self, nbytes: int) -> int:
        # measured on nvCOMP 6: its Deflate and Gzip encoders ask for about 2.3x the input
        return nbytes * 5 // 2 + 65536

    def decode_framed(self, stream: np.ndarray, nbytes: int) -> Any:
        fast = self.fast_decoder()
        decoded = None if fast is None else fast(stream, nbytes)
        return super().decode_framed(stream, nbytes) if decoded is None else decoded


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
        lib = libdeflate()
        if lib is not None:
            decoded = _exactly(lib.deflate_decompress)(stream, nbytes)
            if decoded is not None:
                return decoded
        return zlib.decompress(np.ascontiguousarray(stream).tobytes(), wbits=-15)

    def fast_decoder(self) -> Callable[[Any, int], Any] | None:
        """libdeflate's zlib decoder (it checks the Adler-32), when installed."""
        lib = libdeflate()
        return None if lib is None else _exactly(lib.zlib_decompress)

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

    def fast_decoder(self) -> Callable[[Any, int], Any] | None:
        """libdeflate's gzip decoder (it checks the CRC-32 and ISIZE), when installed.

        It decodes the first member and ignores what follows; zlib (numcodecs) decodes
        every member and refuses other trailing bytes. So a chunk is libdeflate's only
        when the first member ends where the chunk does: the trailer of what it decoded
        (CRC-32 and size, 8 bytes) is the chunk's last 8 bytes and found nowhere before
        them (the first member's trailer, which libdeflate checked, lies somewhere);
        any other chunk goes to zlib.
        """
        lib = libdeflate()
        if lib is None:
            return None

        def ends_with_trailer(chunk: Any, decoded: Any) -> bool:
            stored = np.frombuffer(chunk, dtype=np.uint8).tobytes()
            trailer = np.array([lib.crc32(decoded), len(decoded) & 0xFFFFFFFF], "<u4")
            return stored.find(trailer.tobytes()) == len(stored) - 8

        return _exactly(lib.gzip_decompress, ends_with_trailer)

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
    # host_fast: host_thread times libdeflate's speed-up over zlib measured on the CI
    # machine's CPU (2.5x; `xarray-gds calibrate` measures it where it is installed)
    rates=Rates(gpu_chunk=7.3e6, gpu_batch=65e9, host_thread=147e6, host_fast=367e6),
    adler32=True,
)

#: Deflate in gzip framing.
GZIP = Gzip(
    name="gzip",
    nvcomp="Gzip",
    min_size=18,
    rates=Rates(gpu_chunk=14.4e6, gpu_batch=3.6e9, host_thread=122e6, host_fast=261e6),  # 2.14x
    tail=4,
)

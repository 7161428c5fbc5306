"""Blosc1 frames (Zarr v3 ``blosc``, numcodecs ``Blosc``): not an nvCOMP format.

A frame holds LZ4, Zstd, zlib (or blosclz, snappy) streams plus a byte or bit shuffle.
Everything the package knows about Blosc is in this package:

- :mod:`~xarray_gds.codecs.formats.blosc.tables`: the frame's layout, its header's
  constants and the inner streams' formats (:data:`STREAMS`);
- :mod:`~xarray_gds.codecs.formats.blosc.frames`: the parser, which checks frames and
  lists their streams (on the host, or reading only the tables of frames in a device
  arena);
- :mod:`~xarray_gds.codecs.formats.blosc.shuffles`: the byte and bit shuffles, both ways;
- :mod:`~xarray_gds.codecs.formats.blosc.decode`: the batched decode, the streams of
  each inner format in one batch call on the device, stream by stream on the host;
- :mod:`~xarray_gds.codecs.formats.blosc.encode`: frames of lz4, lz4hc, zstd and zlib
  made in batches (nvCOMP compresses the blocks on the GPU).

One numcodecs ``Blosc()`` decodes every frame on the host (frames say how they decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numcodecs
import numpy as np
import zarr.codecs as zc

from xarray_gds.codecs.formats.base import Compressor, Format, Rates
from xarray_gds.codecs.formats.blosc.decode import decode_device, decode_host
from xarray_gds.codecs.formats.blosc.encode import ENCODED_CNAMES, BloscEncode
from xarray_gds.codecs.formats.blosc.frames import parse_arena, parse_frames
from xarray_gds.codecs.formats.blosc.shuffles import shuffle, unshuffle
from xarray_gds.codecs.formats.blosc.tables import STREAMS, BloscStreams, InnerStream

__all__ = [
    "BLOSC",
    "STREAMS",
    "Blosc",
    "BloscEncode",
    "BloscStreams",
    "InnerStream",
    "decode_host",
    "parse_arena",
    "parse_frames",
    "shuffle",
    "unshuffle",
]

#: Blosc compressors (as the metadata names them) whose streams nvCOMP decodes
#: (blosclz and snappy have no decoder; lz4hc writes LZ4 streams).
_DEVICE_CNAMES = frozenset({"lz4", "lz4hc", "zstd", "zlib"})


class Blosc(Format):
    """The Blosc1 format (see the module docstring)."""

    numcodecs_class = numcodecs.Blosc
    zarr_class = zc.BloscCodec
    level_name = "clevel"

    def compressor(self, cname: Any) -> Compressor:
        """Blosc with compressor ``cname``; frames say how they decode, so one numcodecs
        ``Blosc()`` decodes them all on the host."""
        cname = str(getattr(cname, "value", cname))
        return Compressor(
            self, numcodecs.Blosc(), cname in _DEVICE_CNAMES, f"blosc (cname {cname})"
        )

    def from_numcodecs(self, codec: Any) -> Compressor | None:
        return self.compressor(str(codec.cname)) if isinstance(codec, numcodecs.Blosc) else None

    def from_zarr(self, codec: Any) -> Compressor | None:
        return self.compressor(codec.cname) if isinstance(codec, zc.BloscCodec) else None

    def refuse_encode(self, codec: Any) -> str:
        cname = _cname(codec)
        if cname not in ENCODED_CNAMES:
            return f"blosc (cname {cname}) has no GPU encoder (only lz4, lz4hc, zstd, zlib)"
        if cname in ("lz4", "lz4hc") and int(getattr(codec, "blocksize", 0) or 0) > 1 << 24:
            return "blosc blocks over 16 MiB exceed nvCOMP's LZ4 limit"
        return ""

    def level_setting(self, codec: Any) -> tuple[str, Any, Any] | None:
        if not isinstance(codec, numcodecs.Blosc | zc.BloscCodec):
            return None
        if _cname(codec) == "lz4hc":  # nvCOMP writes LZ4 streams at its one level
            return "cname", "lz4hc", "lz4"
        return "clevel", int(codec.clevel), 5

    def encode_options(self, codec: Any, dtype: np.dtype) -> BloscEncode:
        """The frames' settings: the codec's compressor, shuffle (numcodecs' automatic
        shuffle resolved as it resolves it), typesize (the codec's, else the dtype's
        item size) and blocksize; ``codec=None``: lz4 with byte shuffle."""
        if codec is None:
            return BloscEncode("lz4", 1, min(255, dtype.itemsize))
        shuffle = codec.shuffle
        typesize = int(getattr(codec, "typesize", None) or dtype.itemsize)
        if isinstance(codec, zc.BloscCodec):
            name = str(getattr(shuffle, "value", shuffle))
            mode = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[name]
        else:
            mode = int(shuffle)
            if mode == numcodecs.Blosc.AUTOSHUFFLE:
                mode = 2 if typesize == 1 else 1
        if typesize > 255:  # c-blosc stores such types with typesize 1
            typesize = 1
        return BloscEncode(_cname(codec), mode, typesize, int(codec.blocksize or 0))

    def check_host(self, chunks: Sequence[Any], nbytes: int, keys: Sequence[str]) -> bool:
        # check every frame's tables before c-blosc reads them (it trusts them)
        parse_frames(chunks, keys, nbytes)
        return True  # every frame declares nbytes

    def decode_frames(self, *frames: Any, **runtime: Any) -> Any:
        """:func:`~xarray_gds.codecs.formats.blosc.decode.decode_device` (see
        :meth:`Format.decode_frames <xarray_gds.codecs.formats.base.Format.decode_frames>`)."""
        return decode_device(*frames, **runtime)


def _cname(codec: Any) -> str:
    cname = codec.cname
    return str(getattr(cname, "value", cname))


#: The Blosc1 format.
BLOSC = Blosc(
    name="blosc",
    container=True,
    # encode rates: `xarray-gds calibrate` on an H100 host, 4 MiB chunks (December 2026)
    rates=Rates(
        gpu_chunk=270e6,
        gpu_batch=42.8e9,
        host_thread=1.83e9,
        encode_gpu_chunk=310e6,
        encode_gpu_batch=13.5e9,
        encode_host_thread=687e6,
    ),
)

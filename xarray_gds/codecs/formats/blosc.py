"""Blosc1 frames (Zarr v3 ``blosc``, numcodecs ``Blosc``): not an nvCOMP format.

A frame holds LZ4, Zstd, zlib (or blosclz, snappy) streams plus a byte or bit shuffle;
:mod:`xarray_gds.codecs.blosc` takes frames apart, and the device decodes their
streams piece by piece with the inner formats listed in :data:`STREAMS`. One numcodecs
``Blosc()`` decodes every frame on the host (frames say how they decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numcodecs
import zarr.codecs as zc

from xarray_gds.codecs.blosc import STREAMS, InnerStream, parse_frames
from xarray_gds.codecs.formats.base import Compressor, Format, Rates

__all__ = ["BLOSC", "STREAMS", "Blosc", "InnerStream"]

#: Blosc compressors (as the metadata names them) whose streams nvCOMP decodes
#: (blosclz and snappy have no decoder; lz4hc writes LZ4 streams).
_DEVICE_CNAMES = frozenset({"lz4", "lz4hc", "zstd", "zlib"})


class Blosc(Format):
    """The Blosc1 format (see the module docstring)."""

    numcodecs_class = numcodecs.Blosc
    level_name = None  # no batched encoder

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

    def check_host(self, chunks: Sequence[Any], nbytes: int, keys: Sequence[str]) -> bool:
        # check every frame's tables before c-blosc reads them (it trusts them)
        parse_frames(chunks, keys, nbytes)
        return True  # every frame declares nbytes


#: The Blosc1 format.
BLOSC = Blosc(
    name="blosc",
    rates=Rates(gpu_chunk=270e6, gpu_batch=42.8e9, host_thread=1.83e9),
    encodes=False,
)

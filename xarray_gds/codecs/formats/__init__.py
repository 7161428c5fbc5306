"""One object per compression format, and the registry of them.

Each format's module holds everything the package knows about it (see
:class:`~xarray_gds.codecs.formats.base.Format`): how to build its codecs, its nvCOMP
algorithm, its header checks and framing, its encode bound and its default route
rates. The planner (:func:`xarray_gds.codecs.plan_chain`) asks every format of
:data:`FORMATS` in turn whether it claims an array's codec; the decode and encode
runtimes take the format object it returns. To add a format, see
``docs/development.md`` ("Adding a compression format").
"""

from __future__ import annotations

from xarray_gds.codecs.formats.base import Compressor, Format, Rates
from xarray_gds.codecs.formats.blosc import BLOSC
from xarray_gds.codecs.formats.crc32c import CRC32C
from xarray_gds.codecs.formats.deflate import GZIP, ZLIB
from xarray_gds.codecs.formats.lz4 import LZ4
from xarray_gds.codecs.formats.zstd import ZSTD

__all__ = [
    "BLOSC",
    "CRC32C",
    "FORMATS",
    "GZIP",
    "LZ4",
    "ZLIB",
    "ZSTD",
    "Compressor",
    "Format",
    "Rates",
    "get",
]

#: Every format, by name: the compressors the planner recognises (in the order it asks
#: them) and the crc32c checksum.
FORMATS: dict[str, Format] = {f.name: f for f in (ZSTD, GZIP, ZLIB, LZ4, BLOSC, CRC32C)}


def get(name: str) -> Format:
    """The format called ``name``."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown compression format {name!r}; known: {', '.join(FORMATS)}"
        ) from None

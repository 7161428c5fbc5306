"""CRC-32C (Castagnoli) checksums: Zarr v3 ``crc32c``, numcodecs ``CRC32C``.

Not a compressor: a 4-byte little-endian checksum of the chunk's bytes appended to them
(also to shard indexes). The host checks it with ``google_crc32c``; the device with
nvCOMP's batched CRC32 (:mod:`xarray_gds.codecs.crc32c`).
"""

from __future__ import annotations

from typing import Any

import google_crc32c
import numcodecs
import zarr.codecs as zc

from xarray_gds.codecs.formats.base import Format
from xarray_gds.errors import ChunkDecodeError

__all__ = ["CRC32C", "Crc32c"]


class Crc32c(Format):
    """The crc32c checksum (see the module docstring)."""

    def numcodecs_codec(self, **options: Any) -> Any:
        # not numcodecs_class: no Zarr v2 compressor; numcodecs < 0.17 has it only
        # with the optional crc32c package
        codec = getattr(numcodecs, "CRC32C", None)
        if codec is None:
            raise ImportError(
                f"numcodecs {numcodecs.__version__} has no CRC32C codec: install the "
                "crc32c package or numcodecs >= 0.17"
            )
        return codec(**options)

    def claims(self, codec: Any) -> bool:
        """Whether ``codec`` (Zarr v3) appends this checksum."""
        return isinstance(codec, zc.Crc32cCodec)

    def value(self, data: bytes) -> int:
        """The checksum of ``data``."""
        return int(google_crc32c.value(data))

    def trailer(self, data: bytes) -> bytes:
        """The bytes appended to ``data``."""
        return self.value(data).to_bytes(self.trim, "little")

    def too_short(self, key: str, size: int) -> ChunkDecodeError:
        """The error of a chunk of ``size`` bytes, too short to hold a checksum."""
        return ChunkDecodeError(key, self.name, f"{size} bytes is too short for a checksum")

    def mismatch(self, key: str, stored: int, actual: int) -> ChunkDecodeError:
        """The error of a chunk whose bytes do not match its checksum."""
        return ChunkDecodeError(
            key,
            self.name,
            f"checksum mismatch (stored {stored:#010x}, computed {actual:#010x})",
        )


#: The crc32c checksum: 4 bytes after the data.
CRC32C = Crc32c(name="crc32c", trim=4, min_size=4, encodes=False)

"""Exceptions raised by xarray-gds."""

from __future__ import annotations

__all__ = ["ChunkDecodeError"]


class ChunkDecodeError(ValueError):
    """A stored chunk could not be decoded (corrupt, truncated or of the wrong size).

    Attributes
    ----------
    key : str
        The chunk key in the store (it begins with the array's path).
    codec : str
        The codec that failed.
    """

    def __init__(self, key: str, codec: str, reason: str) -> None:
        self.key = key
        self.codec = codec
        super().__init__(
            f"cannot decode chunk {key!r} with codec {codec!r}: {reason}. The stored chunk "
            "is corrupt or truncated; rewrite it, or delete it to read the fill value."
        )

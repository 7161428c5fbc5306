"""The Blosc1 frame: its layout, the constants of its header, the inner streams' formats.

A Blosc1 frame (what ``numcodecs.Blosc.encode`` writes, c-blosc 1.x, format version 2)
is laid out as follows; integers are little-endian::

    offset  size  field
    0       1     format version (2)
    1       1     compressor format version (1)
    2       1     flags: bit 0 byte shuffle, bit 1 memcpyed, bit 2 bit shuffle,
                  bit 3 reserved (must be 0), bit 4 "don't split",
                  bits 5-7 compressor (0 blosclz, 1 lz4/lz4hc, 2 snappy, 3 zlib, 4 zstd)
    3       1     typesize (bytes per element, 1..255)
    4       4     nbytes: decoded size
    8       4     blocksize: decoded bytes per block (the last block may be shorter)
    12      4     cbytes: size of the whole frame
    16      4*B   start of each of the B = ceil(nbytes / blocksize) blocks in the frame

Blocks are independent. A block is a single stream, or ``typesize`` streams of
``blocksize / typesize`` decoded bytes each ("split"); every stream is an int32
compressed size followed by that many payload bytes, and a stream whose compressed size
equals its decoded size is stored as is. The decoded block is then unshuffled (byte or
bit shuffle) on its own. A *memcpyed* frame has no block-start table and no streams: the
decoded bytes follow the header as they are, unshuffled.

The rules followed here are those of the c-blosc 1.x *decoder* (``blosc_d``), which is
what decides how a frame reads, whatever encoder wrote it:

* A full block is split into ``typesize`` streams when the "don't split" flag is clear,
  ``typesize <= 16`` and ``blocksize // typesize >= 128`` (frames written before the flag
  existed are split by that same rule). The last block, when shorter than ``blocksize``,
  is never split.
* Byte shuffle (only when ``typesize > 1``) transposes the ``size // typesize`` whole
  elements of a block; the ``size % typesize`` bytes left at its end are stored as is.
* Bit shuffle transposes the bits of the block's whole elements when their number is a
  multiple of 8 (and not 0); the leftover bytes are stored as is. A block whose number of
  whole elements is not a multiple of 8 is stored entirely as is. When both shuffle flags
  are set, byte shuffle wins if ``typesize > 1``.

:class:`BloscStreams` lists the streams of a batch of frames, as the parser
(:mod:`~xarray_gds.codecs.formats.blosc.frames`) finds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds.codecs.formats.base import Format
from xarray_gds.codecs.formats.deflate import ZLIB
from xarray_gds.codecs.formats.lz4 import LZ4
from xarray_gds.codecs.formats.zstd import ZSTD

__all__ = [
    "BATCHED_CNAMES",
    "CNAMES",
    "FORMAT_VERSION",
    "HEADER_NBYTES",
    "STREAMS",
    "BloscStreams",
    "InnerStream",
]


@dataclass(frozen=True)
class InnerStream:
    """How the streams of one Blosc compressor are stored in a frame.

    Attributes
    ----------
    format : Format
        The stream's format.
    framed : bool
        The stream keeps its format's framing (zlib: header and Adler-32); else it is the
        raw stream (LZ4: a block without numcodecs' size prefix).
    """

    format: Format
    framed: bool

    @property
    def strip(self) -> tuple[int, int]:
        """``(skip, trim)``: framing bytes before the raw stream and in all."""
        return (self.format.skip, self.format.trim) if self.framed else (0, 0)

    def decode_host(self, payload: Any, nbytes: int) -> Any:
        """Decode one stream of ``nbytes`` decoded bytes on the host."""
        if self.framed:
            return self.format.decode_framed(payload, nbytes)
        return self.format.decode_raw(payload, nbytes)


#: Stream format of each Blosc compressor with a batched decoder (nvCOMP on the
#: device, numcodecs and zlib on the host), by the name the frame's header gives it.
STREAMS = {
    "lz4": InnerStream(LZ4, framed=False),
    "zstd": InnerStream(ZSTD, framed=True),
    "zlib": InnerStream(ZLIB, framed=True),
}


HEADER_NBYTES = 16  #: bytes of the fixed Blosc1 header
FORMAT_VERSION = 2  #: the Blosc1 format version read here (c-blosc 1.x)
#: Stream format of each compressor code (flags bits 5-7); lz4hc writes lz4 streams.
CNAMES = ("blosclz", "lz4", "snappy", "zlib", "zstd")
#: Stream formats with a batched decoder (nvCOMP on the device, numcodecs/zlib here):
#: those of :data:`STREAMS`.
BATCHED_CNAMES = frozenset(STREAMS)

_CODEC = "blosc"  #: the codec errors name (the format is xarray_gds.codecs.formats.blosc)
_SHUFFLE, _MEMCPYED, _BITSHUFFLE, _RESERVED, _DONT_SPLIT = 0x01, 0x02, 0x04, 0x08, 0x10
_MAX_SPLITS = 16  # c-blosc's MAX_SPLITS
_MIN_SPLIT_ELEMENTS = 128  # c-blosc's MIN_BUFFERSIZE, as used by the split rule


@dataclass(frozen=True, eq=False)
class BloscStreams:
    """The streams of a batch of Blosc frames, all frames flattened together.

    Per-stream arrays (int64 unless noted), in order of frame, then block, then split:

    Attributes
    ----------
    chunk : numpy.ndarray
        Index of the stream's frame in the batch.
    src : numpy.ndarray
        Offset of the stream's payload in its frame (past its 4-byte size prefix).
    csize : numpy.ndarray
        Payload bytes.
    dst : numpy.ndarray
        Offset in the frame's decoded (still shuffled) bytes where the stream goes.
    dsize : numpy.ndarray
        Decoded bytes of the stream.
    raw : numpy.ndarray
        bool: the payload is stored as is (copy ``csize == dsize`` bytes).

    Per-frame arrays:

    nbytes : numpy.ndarray
        Decoded size.
    typesize : numpy.ndarray
        Element size the shuffle works on.
    blocksize : numpy.ndarray
        Decoded bytes per block (the last block may be shorter).
    shuffle : numpy.ndarray
        Shuffle to undo: 0 none, 1 byte, 2 bit. Already resolved from the flags the way
        the decoder does it (0 for memcpyed frames, 0 for byte shuffle of 1-byte types).
    memcpyed : numpy.ndarray
        bool: the frame stores its decoded bytes as is after the header; it is listed as
        one raw stream at ``src=16`` of ``nbytes`` bytes, like any other raw stream.
        (Frames of 0 bytes have no streams at all.)
    cname : tuple of str
        Stream format of each frame: "blosclz", "lz4" (lz4 and lz4hc), "snappy", "zlib"
        or "zstd".
    """

    chunk: np.ndarray
    src: np.ndarray
    csize: np.ndarray
    dst: np.ndarray
    dsize: np.ndarray
    raw: np.ndarray
    nbytes: np.ndarray
    typesize: np.ndarray
    blocksize: np.ndarray
    shuffle: np.ndarray
    memcpyed: np.ndarray
    cname: tuple[str, ...]

    @property
    def n_frames(self) -> int:
        return len(self.cname)

    @property
    def n_streams(self) -> int:
        return len(self.chunk)

    def compressed(self, cname: str) -> np.ndarray:
        """Mask of the streams to decompress with ``cname`` (raw streams excluded)."""
        frames = np.array([c == cname for c in self.cname], dtype=bool)
        return frames[self.chunk] & ~self.raw

    @property
    def compressed_cnames(self) -> frozenset[str]:
        """Stream formats of the streams that need decompressing."""
        return frozenset(self.cname[i] for i in np.unique(self.chunk[~self.raw]))

    def block_bounds(self, i: int) -> np.ndarray:
        """Block boundaries of frame ``i``: ``[0, blocksize, 2 * blocksize, ..., nbytes]``.

        Each block is unshuffled on its own; only the last one may be shorter.
        """
        nbytes, blocksize = int(self.nbytes[i]), int(self.blocksize[i])
        if nbytes == 0:
            return np.zeros(1, dtype=np.int64)
        return np.append(np.arange(0, nbytes, blocksize, dtype=np.int64), nbytes)

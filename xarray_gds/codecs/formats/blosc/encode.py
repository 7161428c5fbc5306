"""Blosc1 frames made in batches: shuffle, compress every block of every chunk in one
call, then lay out the frames (the layout is described in
:mod:`xarray_gds.codecs.formats.blosc.tables`).

No GPU library writes Blosc frames; they are simple containers, so the encoder makes
them itself from three steps, each a function of an array module (numpy or CuPy) so
that CI runs the same code on the host:

1. :func:`~xarray_gds.codecs.formats.blosc.shuffles.shuffle`: the byte or bit shuffle
   of every block (the exact inverse of
   :func:`~xarray_gds.codecs.formats.blosc.shuffles.unshuffle`, block by block,
   leftover bytes as is);
2. a ``compress`` callable that turns the blocks into raw streams of the inner format
   (one nvCOMP batch call on the GPU, :func:`compress_host` here);
3. :func:`frame_layout` (host, numpy, sizes only) places the frames, the block starts
   and every stream; the payloads are copied into place with one ``gather`` per kind
   (compressed streams, blocks stored as they are, whole chunks stored as they are),
   and :func:`write_tables` writes the headers, block-start tables, size prefixes and
   zlib framing into the host copy.

Frames are written with the "don't split" flag (one stream a block: fewer, longer
streams, which nvCOMP's batches prefer), a block stored as is when its stream would not
be shorter, and a chunk stored as is ("memcpyed") when its frame would be longer than
the chunk. The blocksize is the codec's when it sets one, else
:data:`DEFAULT_BLOCKSIZE`: frames say how they decode, so any reader decodes them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds.codecs.formats.blosc.shuffles import shuffle
from xarray_gds.codecs.formats.blosc.tables import (
    _BITSHUFFLE,
    _DONT_SPLIT,
    _MEMCPYED,
    _SHUFFLE,
    CNAMES,
    FORMAT_VERSION,
    HEADER_NBYTES,
    STREAMS,
    InnerStream,
)

__all__ = [
    "DEFAULT_BLOCKSIZE",
    "ENCODED_CNAMES",
    "BloscEncode",
    "FrameLayout",
    "compress_host",
    "encode_frames",
    "frame_layout",
    "gather_host",
    "write_tables",
]

#: Decoded bytes a block when the codec leaves the blocksize to Blosc (0): nvCOMP's LZ4
#: runs fastest on inputs of about this size (see docs/performance.md).
DEFAULT_BLOCKSIZE = 1 << 18

#: Compressor code (flags bits 5-7, the decoder's
#: :data:`~xarray_gds.codecs.formats.blosc.tables.CNAMES`) of each Blosc compressor the
#: encoder writes: those with a batched decoder, and lz4hc (LZ4 streams).
_CODES = {name: CNAMES.index(name) for name in STREAMS} | {"lz4hc": CNAMES.index("lz4")}
#: Blosc compressors whose frames the encoder writes (lz4hc: LZ4 streams).
ENCODED_CNAMES = frozenset(_CODES)
_PREFIX = 4  # the int32 size before every stream
_MAX_NBYTES = 2**31 - 1 - HEADER_NBYTES  # c-blosc's BLOSC_MAX_BUFFERSIZE


@dataclass(frozen=True)
class BloscEncode:
    """What the frames of one array look like.

    Attributes
    ----------
    cname : str
        Blosc compressor: ``"lz4"``, ``"lz4hc"`` (LZ4 streams), ``"zstd"`` or ``"zlib"``.
    shuffle : int
        0 no shuffle, 1 byte shuffle, 2 bit shuffle (as the frame's flags say it).
    typesize : int
        Bytes an element (1..255).
    blocksize : int
        Decoded bytes a block; 0: :data:`DEFAULT_BLOCKSIZE`.
    """

    cname: str
    shuffle: int
    typesize: int
    blocksize: int = 0

    def __post_init__(self) -> None:
        if self.cname not in _CODES:
            raise ValueError(
                f"Blosc compressor {self.cname!r} has no batched encoder "
                f"(only {', '.join(sorted(_CODES))})"
            )
        if self.shuffle not in (0, 1, 2):
            raise ValueError(f"shuffle must be 0, 1 or 2, not {self.shuffle!r}")
        if not 1 <= self.typesize <= 255:
            raise ValueError(f"typesize must be in 1..255, not {self.typesize}")
        if self.blocksize < 0:
            raise ValueError(f"blocksize must be 0 (automatic) or positive, not {self.blocksize}")

    @property
    def inner(self) -> InnerStream:
        """How the streams are stored (:data:`~xarray_gds.codecs.formats.blosc.tables.STREAMS`)."""
        return STREAMS["lz4" if self.cname == "lz4hc" else self.cname]

    def block_size(self, nbytes: int) -> int:
        """Decoded bytes a block of a chunk of ``nbytes`` bytes: the codec's blocksize
        (or :data:`DEFAULT_BLOCKSIZE`), rounded down to whole elements, at most ``nbytes``."""
        size = self.blocksize or DEFAULT_BLOCKSIZE
        size = max(self.typesize, size - size % self.typesize)
        return max(1, min(size, nbytes))

    @property
    def flags(self) -> int:
        """Header flags of a compressed frame."""
        bits = {0: 0, 1: _SHUFFLE, 2: _BITSHUFFLE}[self.shuffle]
        return bits | _DONT_SPLIT | _CODES[self.cname] << 5

    def encode(self, data: Any, **options: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`encode_frames` of ``data`` with these settings (``options``: its
        keyword arguments)."""
        return encode_frames(self, data, **options)


@dataclass(frozen=True)
class FrameLayout:
    """Where every byte of a batch of frames goes (host arrays, int64 unless noted).

    Per frame: ``starts`` and ``sizes`` in the output, ``memcpyed`` (bool). Per block
    ``(n, nblocks)``: ``bstart`` (in its frame), ``stored`` (payload bytes), ``raw``
    (bool: the block's bytes as they are). ``total`` is the output's size.
    """

    settings: BloscEncode
    nbytes: int
    blocksize: int
    starts: np.ndarray
    sizes: np.ndarray
    memcpyed: np.ndarray
    bstart: np.ndarray
    stored: np.ndarray
    raw: np.ndarray
    total: int

    @property
    def nblocks(self) -> int:
        return int(self.bstart.shape[1])

    def payloads(self) -> np.ndarray:
        """Where the payload of every block starts in the output ``(n, nblocks)`` (past
        its size prefix and, for zlib, its header)."""
        head = self.settings.inner.strip[0]
        return self.starts[:, None] + self.bstart + _PREFIX + np.where(self.raw, 0, head)


def frame_layout(settings: BloscEncode, nbytes: int, raw_sizes: np.ndarray) -> FrameLayout:
    """Place a batch of frames whose blocks compressed to ``raw_sizes`` ``(n, nblocks)``
    raw streams (the inner format's framing, zlib's, comes on top)."""
    raw_sizes = np.asarray(raw_sizes, dtype=np.int64)
    nblocks = raw_sizes.shape[1]
    blocksize = settings.block_size(nbytes)
    dsize = np.minimum(blocksize, nbytes - np.arange(nblocks, dtype=np.int64) * blocksize)
    trim = settings.inner.strip[1]
    framed = raw_sizes + trim
    raw = framed >= dsize[None, :]
    stored = np.where(raw, dsize[None, :], framed)
    records = _PREFIX + stored
    table = HEADER_NBYTES + 4 * nblocks
    bstart = table + np.cumsum(records, axis=1) - records
    compressed = table + records.sum(axis=1)
    memcpyed = compressed >= nbytes + HEADER_NBYTES
    sizes = np.where(memcpyed, nbytes + HEADER_NBYTES, compressed)
    starts = np.cumsum(sizes) - sizes
    return FrameLayout(
        settings,
        nbytes,
        blocksize,
        starts.astype(np.int64),
        sizes.astype(np.int64),
        memcpyed,
        bstart.astype(np.int64),
        stored.astype(np.int64),
        raw,
        int(sizes.sum()),
    )


def _put_i32(out: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """Write little-endian int32 ``values`` at byte offsets ``at`` of ``out`` (uint8)."""
    at = np.asarray(at, dtype=np.int64).reshape(-1)
    if not at.size:
        return
    word = np.asarray(values, dtype="<i4").reshape(-1).view(np.uint8).reshape(-1, 4)
    out[at[:, None] + np.arange(4)] = word


def write_tables(out: np.ndarray, layout: FrameLayout, sums: np.ndarray | None) -> None:
    """Write every frame's header, block-start table and stream size prefixes (and the
    zlib header and Adler-32 of compressed zlib blocks: ``sums`` ``(n, nblocks)``) into
    ``out``, the host copy of the frames whose payloads are in place."""
    s = layout.settings
    n = len(layout.starts)
    starts = layout.starts
    head = np.zeros((n, HEADER_NBYTES), dtype=np.uint8)
    head[:, 0] = FORMAT_VERSION
    head[:, 1] = 1  # the compressor's format version
    head[:, 2] = s.flags | np.where(layout.memcpyed, _MEMCPYED, 0)
    head[:, 3] = s.typesize
    words = np.stack(
        [np.full(n, layout.nbytes), np.full(n, layout.blocksize), layout.sizes], axis=1
    )
    head[:, 4:] = words.astype("<i4").view(np.uint8).reshape(n, 12)
    out[starts[:, None] + np.arange(HEADER_NBYTES)] = head
    framed = ~layout.memcpyed
    if not framed.any():
        return
    nblocks = layout.nblocks
    f_starts = starts[framed]
    bstart, stored, raw = layout.bstart[framed], layout.stored[framed], layout.raw[framed]
    _put_i32(out, f_starts[:, None] + HEADER_NBYTES + 4 * np.arange(nblocks), bstart)
    _put_i32(out, f_starts[:, None] + bstart, stored)
    trim = s.inner.strip[1]
    if not trim:
        return
    inner = s.inner.format
    compressed = ~raw
    if not compressed.any():
        return
    assert sums is not None, "zlib streams need the Adler-32 of every block"
    at = (f_starts[:, None] + bstart + _PREFIX)[compressed]
    # the inner format's framing around the raw stream (zlib: header, Adler-32 trailer)
    inner.write_framing(out, at, stored[compressed] - trim, 0, sums[framed][compressed])


def gather_host(
    src: np.ndarray, src_offsets: np.ndarray, dst: np.ndarray, dst_offsets: np.ndarray, sizes: Any
) -> None:
    """Copy ``src[src_offsets[i]:][:sizes[i]]`` to ``dst[dst_offsets[i]:]`` (numpy)."""
    for s, d, k in zip(
        np.asarray(src_offsets).tolist(),
        np.asarray(dst_offsets).tolist(),
        np.asarray(sizes).tolist(),
        strict=True,
    ):
        dst[d : d + k] = src[s : s + k]


def compress_host(
    inner: InnerStream, flat: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw streams of the inner format of the blocks ``flat[offsets[i]:][:sizes[i]]``, on
    the host: ``(buffer, starts, sizes)``, stream ``i`` at ``buffer[starts[i]:][:sizes[i]]``."""
    fmt = inner.format
    streams = [
        fmt.encode_raw(flat[o : o + k])
        for o, k in zip(np.asarray(offsets).tolist(), np.asarray(sizes).tolist(), strict=True)
    ]
    raw_sizes = np.array([len(r) for r in streams], dtype=np.int64)
    starts = np.cumsum(raw_sizes) - raw_sizes
    buffer = np.frombuffer(b"".join(streams), dtype=np.uint8)
    return buffer, starts.astype(np.int64), raw_sizes


def _adler_host(rows: np.ndarray) -> np.ndarray:
    return np.array([zlib.adler32(r) for r in rows], dtype=np.uint32)


def block_sums(
    data: Any, blocksize: int, adler: Callable[[Any], np.ndarray], xp: Any
) -> np.ndarray:
    """The Adler-32 of every block of every row of ``data`` ``(n, nbytes)``: one
    ``adler`` call for the full blocks, one for the short last blocks."""
    n, nbytes = data.shape
    nfull = nbytes // blocksize
    parts = []
    if nfull:
        full = xp.ascontiguousarray(data[:, : nfull * blocksize]).reshape(n * nfull, blocksize)
        parts.append(adler(full).reshape(n, nfull))
    if nbytes > nfull * blocksize:
        parts.append(adler(xp.ascontiguousarray(data[:, nfull * blocksize :])).reshape(n, 1))
    return np.concatenate(parts, axis=1).astype(np.uint32)


def encode_frames(
    settings: BloscEncode,
    data: Any,
    *,
    xp: Any = np,
    compress: Callable[..., tuple[Any, np.ndarray, np.ndarray]] = compress_host,
    gather: Callable[..., None] = gather_host,
    adler: Callable[[Any], np.ndarray] | None = None,
    to_host: Callable[[Any], np.ndarray] = np.asarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blosc1 frames of the rows of ``data`` ``(n, nbytes)`` uint8 (stored bytes).

    Parameters
    ----------
    settings : BloscEncode
        The frames' compressor, shuffle, typesize and blocksize.
    data : numpy.ndarray or cupy.ndarray
        One chunk's bytes a row.
    xp : module
        The array module of ``data``.
    compress : callable
        ``compress(inner, flat, offsets, sizes) -> (buffer, starts, sizes)``: raw
        streams of the inner format (:func:`compress_host`, or nvCOMP's batch).
    gather : callable
        ``gather(src, src_offsets, dst, dst_offsets, sizes)`` on ``xp`` arrays.
    adler : callable, optional
        Adler-32 of every row of a ``(m, k)`` uint8 ``xp`` array (zlib only; default:
        :func:`zlib.adler32` a row, on the host).
    to_host : callable
        A host (numpy) copy of an ``xp`` array.

    Returns
    -------
    (data, starts, sizes)
        The frames end to end in one host buffer: frame ``i`` is
        ``data[starts[i]:][:sizes[i]]``.
    """
    n, nbytes = data.shape
    if nbytes > _MAX_NBYTES:
        raise ValueError(f"a Blosc frame holds at most {_MAX_NBYTES} bytes, not {nbytes}")
    blocksize = settings.block_size(nbytes)
    nblocks = -(-nbytes // blocksize)
    shuffled = shuffle(data, settings.typesize, blocksize, settings.shuffle, xp=xp)
    flat = xp.ascontiguousarray(shuffled).reshape(-1)
    b_off = np.arange(nblocks, dtype=np.int64) * blocksize
    dsize = np.minimum(blocksize, nbytes - b_off)
    offsets = (np.arange(n, dtype=np.int64)[:, None] * nbytes + b_off).reshape(-1)
    sizes = np.tile(dsize, n)
    buffer, c_starts, c_sizes = compress(settings.inner, flat, offsets, sizes)
    layout = frame_layout(settings, nbytes, np.asarray(c_sizes).reshape(n, nblocks))
    out = xp.empty(max(1, layout.total), dtype=xp.uint8)
    dst = layout.payloads()
    framed = ~layout.memcpyed[:, None]
    comp = (framed & ~layout.raw).reshape(-1)
    raw = (framed & layout.raw).reshape(-1)
    if comp.any():
        gather(buffer, c_starts[comp], out, dst.reshape(-1)[comp], c_sizes[comp])
    if raw.any():
        gather(flat, offsets[raw], out, dst.reshape(-1)[raw], sizes[raw])
    if layout.memcpyed.any():
        whole = xp.ascontiguousarray(data).reshape(-1)
        rows = np.flatnonzero(layout.memcpyed)
        gather(
            whole,
            rows * nbytes,
            out,
            layout.starts[rows] + HEADER_NBYTES,
            np.full(rows.size, nbytes, dtype=np.int64),
        )
    sums = None
    if settings.inner.strip[1]:  # zlib: the Adler-32 of each block's (shuffled) bytes
        sums = block_sums(shuffled, blocksize, adler or _adler_host, xp)
    host = to_host(out)
    write_tables(host, layout, sums)
    return host[: layout.total], layout.starts, layout.sizes

"""Blosc1 frames taken apart on the host, so that a batch of them decodes in a few launches.

The layout of a frame and the rules of the c-blosc 1.x decoder that decide how it reads
are described in :mod:`xarray_gds.codecs.formats.blosc.tables`.

:func:`parse_frames` checks a batch of frames and lists every stream (source offset and
size, destination offset and size); the device layer decompresses the streams with nvCOMP
into a ``(n_frames, nbytes)`` buffer and calls
:func:`~xarray_gds.codecs.formats.blosc.shuffles.unshuffle` (numpy or CuPy) on it.
:func:`~xarray_gds.codecs.formats.blosc.host.decode_host` does the same on the host
with numcodecs, as a reference.
:func:`parse_arena` parses frames that lie in a device arena, bringing to the host only
the bytes the parser reads (headers, block-start tables, stream size prefixes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, NoReturn

import numpy as np

from xarray_gds.codecs.formats.blosc.tables import (
    _BITSHUFFLE,
    _CODEC,
    _DONT_SPLIT,
    _MAX_SPLITS,
    _MEMCPYED,
    _MIN_SPLIT_ELEMENTS,
    _RESERVED,
    _SHUFFLE,
    CNAMES,
    FORMAT_VERSION,
    HEADER_NBYTES,
    BloscStreams,
)
from xarray_gds.errors import ChunkDecodeError

__all__ = ["parse_arena", "parse_frames"]

_U8 = np.dtype(np.uint8)


def _as_frame(frame: Any) -> np.ndarray:
    if type(frame) is np.ndarray and frame.dtype == _U8 and frame.ndim == 1:
        return np.ascontiguousarray(frame)  # the usual case, quickly
    if isinstance(frame, bytes | bytearray | memoryview):
        return np.frombuffer(frame, dtype=np.uint8)
    arr = np.asarray(frame)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError(
            f"a Blosc frame must be a 1-D uint8 array, not {arr.dtype} of shape {arr.shape}"
        )
    return np.ascontiguousarray(arr)


def _first(bad: np.ndarray) -> int | None:
    where = np.flatnonzero(bad)
    return int(where[0]) if where.size else None


def _buffers(arrays: Sequence[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The frames as places in a few flat buffers, to read them all with a gather or a few.

    Frames that are views of one C-contiguous array (such as slices of one arena) share
    that array's bytes as their buffer; any other frame is a buffer of its own. Returns
    ``(words, which, offset)``: frame ``i`` starts at byte ``offset[i]`` of buffer
    ``which[i]``, and ``words[k][o]`` is the little-endian int32 at byte ``o`` of buffer
    ``k`` (a view of its bytes, with a stride of one byte).
    """
    words: list[np.ndarray] = []
    sizes: list[int] = []

    def add(flat: np.ndarray) -> tuple[int, int]:
        words.append(_words(flat))
        sizes.append(flat.size)
        return len(words) - 1, flat.__array_interface__["data"][0]

    found: dict[int, tuple[int, int]] = {}  # id of a base array: its buffer and address
    which: list[int] = []
    offset: list[int] = []
    for a in arrays:
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        entry = found.get(id(root))
        if entry is None:
            entry = found[id(root)] = add(_flat_bytes(root))
        k, at = entry[0], a.__array_interface__["data"][0] - entry[1]
        if not 0 <= at <= sizes[k] - a.size:  # not inside its base's bytes: on its own
            k, at = add(a)[0], 0
        which.append(k)
        offset.append(at)
    return words, np.array(which, dtype=np.int64), np.array(offset, dtype=np.int64)


def _flat_bytes(root: np.ndarray) -> np.ndarray:
    """All the bytes of ``root`` as a 1-D uint8 view (an empty array if it has none)."""
    if root.flags.c_contiguous and not root.dtype.hasobject:
        try:
            return root.reshape(-1).view(np.uint8)
        except (TypeError, ValueError):
            pass
    return np.zeros(0, dtype=np.uint8)


def _words(flat: np.ndarray) -> np.ndarray:
    """The int32 at every byte offset of the 1-D uint8 array ``flat`` (not a copy)."""
    return np.ndarray(shape=(max(flat.size - 3, 0),), dtype="<i4", buffer=flat, strides=(1,))


class _Arena:
    """The bytes of one arena of frames (numpy or CuPy), read four at a time by gathers.

    Stands in for the buffers of :func:`_buffers` when the frames lie in a device arena:
    each :func:`_read_i32` is one gather on ``xp`` and one copy of its bytes to the host,
    so that only the bytes the parser reads (headers, block starts, stream sizes) leave
    the device.
    """

    def __init__(self, arena: Any, xp: Any) -> None:
        self.arena = arena
        self.xp = xp

    def read_i32(self, at: np.ndarray) -> np.ndarray:
        if not at.size:
            return np.zeros(0, dtype=np.int64)
        if int(at.min()) < 0 or int(at.max()) + 4 > int(self.arena.size):
            # the parser reads only inside frames checked to lie in the arena
            raise ValueError("internal error: a Blosc table read outside the arena")
        index = self.xp.asarray(at[:, None] + np.arange(4, dtype=np.int64))
        got = self.arena[index]
        host = self.xp.asnumpy(got) if hasattr(self.xp, "asnumpy") else np.asarray(got)
        return np.ascontiguousarray(host, dtype=np.uint8).view("<i4").reshape(-1).astype(np.int64)


def _read_i32(words: list[np.ndarray] | _Arena, which: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The int32 at byte ``at`` of buffer ``which`` (see :func:`_buffers`), for each entry
    (all in bounds), as int64: one gather per buffer involved (or per call, for an
    :class:`_Arena`, whose frames all lie in one buffer)."""
    if isinstance(words, _Arena):
        return words.read_i32(at)
    if len(words) == 1:
        return words[0][at].astype(np.int64)
    out = np.empty(at.size, dtype=np.int64)
    if at.size:
        order = None if np.all(which[1:] >= which[:-1]) else np.argsort(which, kind="stable")
        ids = which if order is None else which[order]
        bounds = [0, *(np.flatnonzero(ids[1:] != ids[:-1]) + 1).tolist(), at.size]
        for lo, hi in pairwise(bounds):
            rows = slice(lo, hi) if order is None else order[lo:hi]
            out[rows] = words[int(ids[lo])][at[rows]]
    return out


def _bad_start(key: str, block: int, nblocks: int, start: int, cbytes: int) -> ChunkDecodeError:
    table_end = HEADER_NBYTES + 4 * nblocks
    return ChunkDecodeError(
        key,
        _CODEC,
        f"block {block} of {nblocks} starts at byte {start}, outside the "
        f"{table_end}..{cbytes - 4} range of stream data in this {cbytes}-byte frame",
    )


def _bad_prefix(key: str, block: int, j: int, pos: int, cbytes: int) -> ChunkDecodeError:
    return ChunkDecodeError(
        key,
        _CODEC,
        f"the size of stream {j} of block {block} (at byte {pos}) lies past the end of the "
        f"{cbytes}-byte frame",
    )


def _bad_size(key: str, block: int, j: int, pos: int, size: int, cbytes: int) -> ChunkDecodeError:
    return ChunkDecodeError(
        key,
        _CODEC,
        f"stream {j} of block {block} declares {size} bytes at byte {pos + 4}, which does "
        f"not fit in the {cbytes}-byte frame",
    )


#: Which damaged stream of a frame is named, when there are several: in a frame of at
#: most this many streams, the first one block by block (a block's start, then its
#: streams in order); in a larger one, the first one round by round (every block's start,
#: then stream 0 of every block, then stream 1, ...), each round checking the size
#: prefixes before the sizes. (Frames used to be walked in these orders, with plain
#: Python or with numpy.)
_SCALAR_MAX_STREAMS = 128

_START, _PREFIX, _SIZE = 1, 2, 3  # what a damaged block got wrong first


def _walk(
    words: list[np.ndarray] | _Arena,
    which: np.ndarray,
    offset: np.ndarray,
    keys: Sequence[str],
    nbytes: int,
    cbytes: np.ndarray,
    blocksize: np.ndarray,
    nblocks: np.ndarray,
    splits: np.ndarray,
    memcpyed: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(chunk, src, csize, dst, dsize)`` of the streams of a batch of frames whose
    headers are valid, in order of frame, then block, then stream.

    The blocks of all the compressed frames are walked together, in rounds over the
    (at most 16) streams of a block, which follow each other: one gather per round. A
    memcpyed frame is one block of one raw stream, not walked. ``splits`` is the number of
    streams of a full block of each frame (1 when its blocks are not split). Raises the
    error that walking the frames one by one would meet first.
    """
    n = cbytes.size
    counts = np.where(memcpyed, 1, nblocks)
    owner = np.repeat(np.arange(n, dtype=np.int64), counts)  # per block: its frame
    block = np.arange(owner.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    walked = ~memcpyed[owner]
    bs, frame_end = blocksize[owner], cbytes[owner]
    size = np.where(walked, np.minimum(bs, nbytes - block * bs), nbytes)
    per_block = np.where(walked & (size == bs), splits[owner], 1)  # a short last block: 1
    where, base = which[owner], offset[owner]

    rows = np.flatnonzero(walked)
    pos = np.full(owner.size, HEADER_NBYTES, dtype=np.int64)  # of the next size prefix
    pos[rows] = _read_i32(words, where[rows], base[rows] + HEADER_NBYTES + 4 * block[rows])
    table_end = HEADER_NBYTES + 4 * nblocks[owner]
    failed = np.zeros(owner.size, dtype=np.int8)  # 0, or what the block got wrong first
    stage = np.zeros(owner.size, dtype=np.int64)  # the stream it was at
    declared = np.zeros(owner.size, dtype=np.int64)  # the size that stream declares
    failed[walked & ((pos < table_end) | (pos > frame_end - 4))] = _START
    width = int(per_block.max()) if owner.size else 0
    src = np.zeros((owner.size, width), dtype=np.int64)
    csize = np.zeros((owner.size, width), dtype=np.int64)
    if width:
        src[~walked, 0] = HEADER_NBYTES
        csize[~walked, 0] = nbytes
    for j in range(width):
        rows = np.flatnonzero(walked & (failed == 0) & (per_block > j))
        if not rows.size:
            break
        p = pos[rows]
        over = p + 4 > frame_end[rows]  # the size prefix runs past the end
        failed[rows[over]], stage[rows[over]] = _PREFIX, j
        rows, p = rows[~over], p[~over]
        got = _read_i32(words, where[rows], base[rows] + p)
        bad = (got <= 0) | (p + 4 + got > frame_end[rows])
        failed[rows[bad]], stage[rows[bad]], declared[rows[bad]] = _SIZE, j, got[bad]
        rows, p, got = rows[~bad], p[~bad], got[~bad]
        src[rows, j] = p + 4
        csize[rows, j] = got
        pos[rows] = p + 4 + got
    if failed.any():
        _raise_first(keys, failed, stage, declared, owner, block, pos, nblocks, splits, cbytes)

    mask = np.arange(width) < per_block[:, None]
    part = size // per_block
    dst = (block * bs)[:, None] + np.arange(width, dtype=np.int64) * part[:, None]
    dsize = np.broadcast_to(part[:, None], mask.shape)
    return np.repeat(owner, per_block), src[mask], csize[mask], dst[mask], dsize[mask]


def _raise_first(
    keys: Sequence[str],
    failed: np.ndarray,
    stage: np.ndarray,
    declared: np.ndarray,
    owner: np.ndarray,
    block: np.ndarray,
    pos: np.ndarray,
    nblocks: np.ndarray,
    splits: np.ndarray,
    cbytes: np.ndarray,
) -> NoReturn:
    """Raise the error of the first damaged frame, naming the block that a walk of its
    blocks meets first (see ``_SCALAR_MAX_STREAMS``); the arguments are per block, as in
    :func:`_walk`, except ``nblocks``, ``splits`` and ``cbytes`` (per frame)."""
    rows = np.flatnonzero(failed)
    i = int(owner[rows].min())
    rows = rows[owner[rows] == i]  # in block order
    if nblocks[i] * splits[i] <= _SCALAR_MAX_STREAMS:
        r = int(rows[0])
    else:  # every block start, then the size prefixes of stream 0, its sizes, stream 1, ...
        kind = failed[rows].astype(np.int64)
        rounds = np.where(kind == _START, 0, 2 * stage[rows] + kind - 1)
        r = int(rows[np.argmin(rounds)])
    key, b, at, frame_nbytes = keys[i], int(block[r]), int(pos[r]), int(cbytes[i])
    if failed[r] == _START:
        raise _bad_start(key, b, int(nblocks[i]), at, frame_nbytes)
    if failed[r] == _PREFIX:
        raise _bad_prefix(key, b, int(stage[r]), at, frame_nbytes)
    raise _bad_size(key, b, int(stage[r]), at, int(declared[r]), frame_nbytes)


def parse_frames(frames: Sequence[Any], keys: Sequence[str], nbytes: int) -> BloscStreams:
    """Check a batch of Blosc1 frames and list their streams.

    Everything is checked here, before anything is launched: the header (format
    versions, reserved flag bit, compressor code, typesize, decoded size, frame size,
    block size), the block-start table, and that every block start and every stream
    (size prefix and payload) lies inside its frame with decoded sizes adding up to the
    block size.

    Parameters
    ----------
    frames : sequence of numpy.ndarray
        One whole Blosc frame per chunk, as 1-D uint8 arrays (bytes are accepted too).
    keys : sequence of str
        The chunk key of each frame, for error messages.
    nbytes : int
        Decoded size every frame must have.

    Returns
    -------
    BloscStreams

    Raises
    ------
    ChunkDecodeError
        A frame is damaged or is not a Blosc1 frame of ``nbytes`` decoded bytes; the
        first such frame is named.
    """
    if len(frames) != len(keys):
        raise ValueError(f"{len(frames)} frames but {len(keys)} keys")
    arrays = [_as_frame(f) for f in frames]
    lengths = np.array([a.size for a in arrays], dtype=np.int64)
    _check_lengths(lengths, keys)
    words, which, offset = _buffers(arrays)
    return _parse(words, which, offset, lengths, keys, nbytes)


def parse_arena(
    arena: Any,
    offsets: np.ndarray,
    sizes: np.ndarray,
    keys: Sequence[str],
    nbytes: int,
    *,
    xp: Any = np,
) -> BloscStreams:
    """:func:`parse_frames` of the frames at ``offsets`` (of ``sizes`` bytes) of ``arena``,
    reading only the bytes it needs from it.

    The headers, then the block-start tables, then the size prefix of stream ``j`` of every
    block for ``j = 0, 1, ...`` (at most 16 streams a block) are each fetched with one
    gather on ``xp`` and one copy to the host: a few bytes per block leave the device
    instead of the whole arena, and nothing is read past a damaged byte. Results and
    errors are those of :func:`parse_frames` on a host copy of the frames.

    Parameters
    ----------
    arena : numpy.ndarray or cupy.ndarray
        1-D uint8 holding the frames.
    offsets, sizes : numpy.ndarray
        int64 (host): start and size of each frame in ``arena``.
    keys, nbytes :
        As for :func:`parse_frames`.
    xp : module
        ``numpy`` or ``cupy``, the array module of ``arena``.
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if len(offsets) != len(keys) or len(sizes) != len(keys):
        raise ValueError(f"{len(offsets)} offsets and {len(sizes)} sizes but {len(keys)} keys")
    if np.any(offsets < 0) or np.any(sizes < 0) or np.any(offsets + sizes > int(arena.size)):
        raise ValueError("every frame must lie inside the arena")
    _check_lengths(sizes, keys)
    which = np.zeros(len(offsets), dtype=np.int64)
    return _parse(_Arena(arena, xp), which, offsets, sizes, keys, nbytes)


def _check_lengths(lengths: np.ndarray, keys: Sequence[str]) -> None:
    i = _first(lengths < HEADER_NBYTES)
    if i is not None:
        raise ChunkDecodeError(
            keys[i], _CODEC, f"{int(lengths[i])} bytes is too short for a Blosc header (16 bytes)"
        )


def _parse(
    words: list[np.ndarray] | _Arena,
    which: np.ndarray,
    offset: np.ndarray,
    lengths: np.ndarray,
    keys: Sequence[str],
    nbytes: int,
) -> BloscStreams:
    """:func:`parse_frames` once the frames are placed: frame ``i`` is ``lengths[i]``
    bytes (at least a header) at byte ``offset[i]`` of buffer ``which[i]`` of ``words``."""
    head = _read_headers(words, which, offset)
    _check_headers(head, lengths, keys, nbytes)
    if nbytes > 0:
        chunk, src, csize, dst, dsize = _streams(words, which, offset, head, lengths, keys, nbytes)
    else:
        empty = np.zeros(0, dtype=np.int64)
        chunk, src, csize, dst, dsize = empty, empty, empty, empty, empty
    return BloscStreams(
        chunk=chunk,
        src=src,
        csize=csize,
        dst=dst,
        dsize=dsize,
        raw=csize == dsize,
        nbytes=head.nbytes,
        typesize=head.typesize,
        blocksize=head.blocksize,
        shuffle=_shuffles(head),
        memcpyed=head.memcpyed,
        cname=tuple(CNAMES[c] for c in head.code),
    )


@dataclass(frozen=True)
class _Headers:
    """The 16-byte headers of a batch of frames, a field an array (one entry a frame)."""

    version: np.ndarray
    versionlz: np.ndarray
    flags: np.ndarray
    typesize: np.ndarray
    nbytes: np.ndarray  #: the decoded size each header declares
    blocksize: np.ndarray
    cbytes: np.ndarray  #: the frame size each header declares

    @property
    def code(self) -> np.ndarray:
        """The compressor code of each frame (an index of ``CNAMES``)."""
        return self.flags >> 5

    @property
    def memcpyed(self) -> np.ndarray:
        return (self.flags & _MEMCPYED) != 0


def _read_headers(
    words: list[np.ndarray] | _Arena, which: np.ndarray, offset: np.ndarray
) -> _Headers:
    """The headers of the frames at byte ``offset[i]`` of buffer ``which[i]``."""
    n = len(offset)
    head = _read_i32(words, np.repeat(which, 4), (offset[:, None] + np.arange(0, 16, 4)).ravel())
    head = head.reshape(n, 4)
    return _Headers(
        version=head[:, 0] & 0xFF,
        versionlz=(head[:, 0] >> 8) & 0xFF,
        flags=(head[:, 0] >> 16) & 0xFF,
        typesize=(head[:, 0] >> 24) & 0xFF,
        nbytes=head[:, 1],
        blocksize=head[:, 2],
        cbytes=head[:, 3],
    )


def _fail(keys: Sequence[str], bad: np.ndarray, reason: Callable[[int], str]) -> None:
    """Raise the error ``reason(i)`` of the first frame ``i`` that is ``bad``, if any."""
    i = _first(bad)
    if i is not None:
        raise ChunkDecodeError(keys[i], _CODEC, reason(i))


def _check_headers(h: _Headers, lengths: np.ndarray, keys: Sequence[str], nbytes: int) -> None:
    """Raise the error of the first header that c-blosc 1.x would not read, or that
    does not match its frame (``lengths``) or the chunk's decoded size ``nbytes``."""
    version, versionlz, flags, code = h.version, h.versionlz, h.flags, h.code
    _fail(
        keys,
        version != FORMAT_VERSION,
        lambda i: (
            f"Blosc format version {version[i]} is not supported (only version "
            f"{FORMAT_VERSION}, written by c-blosc 1.x and numcodecs; is it a Blosc frame?)"
        ),
    )
    _fail(
        keys,
        (flags & _RESERVED) != 0,
        lambda i: f"header flags {flags[i]:#04x} set the reserved bit 3",
    )
    _fail(
        keys,
        code >= len(CNAMES),
        lambda i: f"unknown compressor code {code[i]} in the header flags",
    )
    _fail(
        keys,
        versionlz != 1,
        lambda i: f"{CNAMES[code[i]]} format version {versionlz[i]} is not supported (only 1)",
    )
    _fail(keys, h.typesize == 0, lambda i: "typesize 0 in the header")
    i = _first(h.nbytes != nbytes)
    if i is not None:  # the chunk's decoded size: it or the metadata may be wrong
        raise ChunkDecodeError(
            keys[i],
            _CODEC,
            f"header declares {h.nbytes[i]} decoded bytes, expected {nbytes}",
            decoded=int(h.nbytes[i]),
            expected=nbytes,
        )
    _fail(
        keys,
        h.cbytes != lengths,
        lambda i: (
            f"header declares a {h.cbytes[i]}-byte frame but {lengths[i]} bytes are "
            "stored (truncated, or trailing bytes)"
        ),
    )


def _shuffles(h: _Headers) -> np.ndarray:
    """The shuffle of each frame: 0 none (or memcpyed), 1 byte, 2 bit."""
    flags = h.flags
    byte = ((flags & _SHUFFLE) != 0) & (h.typesize > 1)
    return np.where(h.memcpyed, 0, np.where(byte, 1, np.where(flags & _BITSHUFFLE, 2, 0)))


def _streams(
    words: list[np.ndarray] | _Arena,
    which: np.ndarray,
    offset: np.ndarray,
    h: _Headers,
    lengths: np.ndarray,
    keys: Sequence[str],
    nbytes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(chunk, src, csize, dst, dsize)`` of the streams of frames whose headers
    passed :func:`_check_headers` (``nbytes > 0``), once their blocks are checked."""
    blocksize, cbytes, typesize, memcpyed = h.blocksize, h.cbytes, h.typesize, h.memcpyed
    _fail(
        keys,
        (blocksize <= 0) | (blocksize > nbytes),
        lambda i: f"block size {blocksize[i]} in the header is not in 1..{nbytes}",
    )
    _fail(
        keys,
        memcpyed & (cbytes != nbytes + HEADER_NBYTES),
        lambda i: (
            f"an uncompressed (memcpyed) frame of {nbytes} bytes must be "
            f"{nbytes + HEADER_NBYTES} bytes long, not {cbytes[i]}"
        ),
    )
    nblocks = -(-nbytes // np.maximum(blocksize, 1))
    _fail(
        keys,
        ~memcpyed & (cbytes < HEADER_NBYTES + 4 * nblocks),
        lambda i: (
            f"the table of {nblocks[i]} block starts does not fit in the {cbytes[i]}-byte frame"
        ),
    )
    split = (
        ((h.flags & _DONT_SPLIT) == 0)
        & (typesize <= _MAX_SPLITS)
        & (blocksize // typesize >= _MIN_SPLIT_ELEMENTS)
    )
    _fail(
        keys,
        ~memcpyed & split & (blocksize % typesize != 0),
        lambda i: (
            f"block size {blocksize[i]} is split into {typesize[i]} streams but is "
            "not a multiple of the typesize: the streams do not add up to the block"
        ),
    )
    nsplits = np.where(split, typesize, 1)
    return _walk(words, which, offset, keys, nbytes, lengths, blocksize, nblocks, nsplits, memcpyed)

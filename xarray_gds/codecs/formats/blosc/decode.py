"""Batches of Blosc1 frames decoded: on the device, the streams of each inner format in
one batch call (:func:`decode_device`, the calls given by the device runtime), and on
the host stream by stream (:func:`decode_host`, the reference the device path is
checked against)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from xarray_gds.codecs.formats.base import Format
from xarray_gds.codecs.formats.blosc.frames import _as_frame, _first, parse_arena, parse_frames
from xarray_gds.codecs.formats.blosc.shuffles import unshuffle
from xarray_gds.codecs.formats.blosc.tables import _CODEC, BATCHED_CNAMES, STREAMS
from xarray_gds.errors import ChunkDecodeError

__all__ = ["decode_device", "decode_host"]

#: ``decode(format, arena, starts, lengths, decoded_sizes, keys) -> (buffer, offsets)``:
#: the raw streams of ``format`` at ``starts`` of ``arena`` decoded in one batch call
Decode = Callable[[Format, Any, np.ndarray, np.ndarray, np.ndarray, Sequence[str]], Any]


def decode_device(
    arena: Any,
    offsets: np.ndarray,
    sizes: np.ndarray,
    nbytes: int,
    keys: Sequence[str],
    *,
    xp: Any,
    gather: Callable[..., None],
    decode: Decode,
) -> Any:
    """Decode the Blosc frames at ``offsets`` of ``arena`` into a ``(n, nbytes)`` ``xp``
    array.

    The bytes of the frames that describe their streams (headers, block-start tables,
    stream size prefixes) come to the host, a few gathers, to check and list the streams
    (:func:`~xarray_gds.codecs.formats.blosc.frames.parse_arena`, before anything reads
    them on the device); then one ``gather`` copies the raw streams, one ``decode`` call
    per inner format decodes the others (the raw streams inside their framing), and
    ``xp`` undoes the byte or bit shuffle of every block.
    """
    m = len(offsets)
    out = xp.empty((m, nbytes), dtype=xp.uint8)
    if not m:
        return out
    # only the bytes the parser reads come to the host, not the payloads
    streams = parse_arena(arena, offsets, sizes, keys, nbytes, xp=xp)
    flat = out.reshape(-1)
    src = offsets[streams.chunk] + streams.src
    dst = streams.chunk * nbytes + streams.dst
    raw = streams.raw
    if raw.any():
        gather(arena, src[raw], flat, dst[raw], streams.dsize[raw])
    for cname in sorted(streams.compressed_cnames):
        pick = streams.compressed(cname)
        which = streams.chunk[pick]
        inner = STREAMS.get(cname)
        if inner is None:
            raise ChunkDecodeError(
                keys[int(which[0])],
                _CODEC,
                f"{cname} streams have no GPU decoder (open with device='cpu' to read it)",
            )
        # the raw stream inside the stream's framing (a header and a trailer, or none)
        skip, trim = inner.strip
        start, length = src[pick] + skip, streams.csize[pick] - trim
        stream_keys = _StreamKeys(keys, which, cname)
        decoded, at = decode(inner.format, arena, start, length, streams.dsize[pick], stream_keys)
        gather(decoded, at, flat, dst[pick], streams.dsize[pick])
    return unshuffle(out, streams.typesize, streams.blocksize, streams.shuffle, xp=xp)


class _StreamKeys(Sequence[str]):
    """Names of Blosc streams for messages: the chunk key and the stream format."""

    def __init__(self, keys: Sequence[str], which: np.ndarray, cname: str) -> None:
        self._keys, self._which, self._cname = keys, which, cname

    def __len__(self) -> int:
        return len(self._which)

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        return f"{self._keys[int(self._which[j])]} ({self._cname} stream)"


def _decompress(cname: str, payload: np.ndarray, dsize: int, key: str) -> np.ndarray:
    """One compressed stream, decoded on the host by its format (:data:`STREAMS`)."""
    try:
        decoded = STREAMS[cname].decode_host(payload, dsize)
    except Exception as exc:
        raise ChunkDecodeError(key, _CODEC, f"a {cname} stream does not decode ({exc})") from exc
    out = np.frombuffer(decoded, dtype=np.uint8)
    if out.size != dsize:
        raise ChunkDecodeError(
            key, _CODEC, f"a {cname} stream decodes to {out.size} bytes, expected {dsize}"
        )
    return out


def decode_host(frames: Sequence[Any], keys: Sequence[str], nbytes: int) -> np.ndarray:
    """Decode a batch of Blosc1 frames on the host, stream by stream (a reference).

    Uses :func:`parse_frames` and :func:`unshuffle` exactly as the device path does; only
    the stream decompression (numcodecs' LZ4 and Zstd, zlib) differs.

    Parameters
    ----------
    frames : sequence of numpy.ndarray
        One whole Blosc frame per chunk, 1-D uint8.
    keys : sequence of str
        Chunk keys, for error messages.
    nbytes : int
        Decoded size of every frame.

    Returns
    -------
    numpy.ndarray
        ``(n_frames, nbytes)`` uint8, the decoded bytes.

    Raises
    ------
    ChunkDecodeError
        A frame is damaged, or needs a compressor with no batched decoder (blosclz,
        snappy).
    """
    streams = parse_frames(frames, keys, nbytes)
    arrays = [_as_frame(f) for f in frames]
    unsupported = np.array([c not in BATCHED_CNAMES for c in streams.cname], dtype=bool)
    s = _first(unsupported[streams.chunk] & ~streams.raw)
    if s is not None:
        i = int(streams.chunk[s])
        raise ChunkDecodeError(
            keys[i],
            _CODEC,
            f"the Blosc compressor {streams.cname[i]!r} has no batched decoder here (only "
            "lz4, lz4hc, zstd and zlib); read this array with zarr's own codec pipeline, or "
            "recompress it with a supported compressor",
        )
    out = np.empty((len(arrays), nbytes), dtype=np.uint8)
    for c, src, csize, dst, dsize, raw in zip(
        streams.chunk.tolist(),
        streams.src.tolist(),
        streams.csize.tolist(),
        streams.dst.tolist(),
        streams.dsize.tolist(),
        streams.raw.tolist(),
        strict=True,
    ):
        payload = arrays[c][src : src + csize]
        if raw:
            out[c, dst : dst + dsize] = payload
        else:
            out[c, dst : dst + dsize] = _decompress(streams.cname[c], payload, dsize, keys[c])
    result: np.ndarray = unshuffle(out, streams.typesize, streams.blocksize, streams.shuffle, xp=np)
    return result

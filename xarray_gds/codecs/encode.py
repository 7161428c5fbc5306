"""Batched chunk encoding: chunk arrays to stored chunk bytes, many chunks per call.

:func:`plan_encode` reads an array's metadata and returns an :class:`EncodeChain`
when the batched encoder writes exactly what the array's codecs describe, or the
reason it does not (those arrays are encoded by zarr-python on the host). A chain
encodes a stack of chunks ``(n, *chunk_shape)`` at once: the stored byte layout
(axis order, byte order) is made with array operations, every chunk is compressed
to a raw stream (one nvCOMP batch call on the GPU; numcodecs or the standard library
on the host, which CI uses to test the same framing), and the framing each codec
expects is added around the raw streams (a size prefix, a header and an Adler-32
trailer: each format's ``write_framing``; some formats' raw streams are complete).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr.codecs as zc

from xarray_gds import device as _device
from xarray_gds.batch import pack_offsets
from xarray_gds.codecs import DecodeChain, ShardChain, plan_chain
from xarray_gds.codecs.formats import CRC32C, FORMATS, Format

__all__ = [
    "EncodeChain",
    "Encoded",
    "ShardEncode",
    "adler32",
    "empty_rows",
    "encode_host",
    "encode_shards",
    "layout",
    "plan_encode",
]

#: Names of the stream formats the batched encoder writes.
ENCODED = tuple(name for name, f in FORMATS.items() if f.encodes)

_ADLER_MOD = 65521


@dataclass(frozen=True)
class EncodeChain:
    """How to encode every chunk of one array in batches.

    Attributes
    ----------
    chunk_shape : tuple of int
        Shape of a (full) chunk.
    dtype : numpy.dtype
        Stored dtype (its byte order may be non-native).
    stored_order : tuple of int
        Axis permutation of the stored layout (v3 ``transpose``, v2 ``order="F"``).
    compressor : Format or None
        Stream format (one of :data:`ENCODED`) or ``None`` for uncompressed chunks.
    codecs : tuple of str
        Codec names, for messages.
    options : object, optional
        The compressor's settings, for formats whose chunks are containers of streams
        (:attr:`~xarray_gds.codecs.formats.base.Format.container`): an object whose
        ``encode(data, **options)`` makes the frames; None otherwise.
    """

    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    stored_order: tuple[int, ...]
    compressor: Format | None
    codecs: tuple[str, ...]
    options: Any = None

    @property
    def frames(self) -> Any:
        """The container settings the chunks are written with (None: raw streams)."""
        if self.compressor is None:
            return None
        if self.options is not None:
            return self.options
        return self.compressor.encode_options(None, self.dtype)

    @property
    def nbytes(self) -> int:
        """Size of one chunk's stored bytes before compression."""
        return math.prod(self.chunk_shape) * self.dtype.itemsize


def _compressor_of(codecs: Any) -> Any:
    """The codec that compresses chunks among ``codecs`` (v2: ``[compressor]``)."""
    rest = [
        c for c in codecs if c is not None and not isinstance(c, zc.BytesCodec | zc.TransposeCodec)
    ]
    return rest[0] if rest else None


def plan_encode(metadata: Any, levels: str = "host") -> EncodeChain | ShardEncode | str:
    """Plan the batched encode of an array, or say why its chunks encode on the host.

    Parameters
    ----------
    metadata : ArrayV2Metadata or ArrayV3Metadata
        The array's metadata.
    levels : {"host", "gpu"}
        nvCOMP's encoders have no compression levels. With ``"host"`` a codec whose
        level (or acceleration) differs from the codec's default is encoded on the
        host, so the level is honoured; with ``"gpu"`` it is encoded by nvCOMP anyway
        (the level is recorded in the metadata but not applied).

    Returns
    -------
    EncodeChain, ShardEncode, or str
        The plan, or the reason (for a warning) when zarr-python must encode.
    """
    chain = plan_chain(metadata)
    if isinstance(chain, ShardChain):
        sharding = metadata.codecs[0]
        inner = _plan_chunks(chain.inner, _compressor_of(sharding.codecs), levels)
        if isinstance(inner, str):
            return f"inner chunks: {inner}"
        return ShardEncode(chain, inner)
    if not isinstance(chain, DecodeChain):
        return str(chain.reason)
    codecs = [metadata.compressor] if hasattr(metadata, "compressor") else metadata.codecs
    return _plan_chunks(chain, _compressor_of(codecs), levels)


def _plan_chunks(chain: DecodeChain, codec: Any, levels: str) -> EncodeChain | str:
    """The encode chain of chunks that ``chain`` decodes, ``codec`` their compressor."""
    if chain.filters:
        return "filters are encoded on the host"
    if chain.crc32c:
        return "crc32c checksums are written on the host"
    compressor = chain.compressor
    fmt = compressor.format if compressor is not None else None
    if fmt is None:
        return EncodeChain(chain.chunk_shape, chain.dtype, chain.stored_order, None, chain.codecs)
    if not fmt.encodes:
        return f"{compressor.detail or fmt.name} has no GPU encoder"  # type: ignore[union-attr]
    refused = fmt.refuse_encode(codec)
    if refused:
        return refused
    setting = fmt.level_setting(codec)
    if setting is not None and levels != "gpu":
        what, value, default = setting
        if value != default:
            return (
                f"{what}={value}: nvCOMP's encoders have no compression levels "
                "(pass levels='gpu' to encode with nvCOMP's own level)"
            )
    if fmt.encode_limit is not None and chain.nbytes > fmt.encode_limit:
        return (
            f"chunks of {chain.nbytes} bytes exceed nvCOMP's {fmt.nvcomp} limit of "
            f"{fmt.encode_limit >> 20} MiB"
        )
    options = fmt.encode_options(codec, chain.dtype)
    return EncodeChain(
        chain.chunk_shape, chain.dtype, chain.stored_order, fmt, chain.codecs, options
    )


@dataclass(frozen=True)
class ShardEncode:
    """How to encode the shards of a sharded array (v3 ``sharding_indexed``): inner
    chunks with ``inner``, then each shard's index (``bytes``, optionally ``crc32c``),
    laid out as ``layout`` (the array's decode plan) describes.

    ``chunk_shape``, ``dtype`` and ``nbytes`` describe a whole shard, the unit that
    writes stage and store.
    """

    layout: ShardChain
    inner: EncodeChain

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return self.layout.shard_shape

    @property
    def dtype(self) -> np.dtype:
        return self.inner.dtype

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def grid(self) -> tuple[int, ...]:
        """Inner chunks per shard along each axis."""
        return self.layout.grid

    @property
    def codecs(self) -> tuple[str, ...]:
        return self.layout.codecs


def empty_rows(flat: Any, fill: Any, xp: Any) -> np.ndarray:
    """Which rows of ``flat`` ``(n, m)`` hold only ``fill`` (NaN fills match NaN), on the host."""
    fill_value = np.asarray(fill)
    if flat.dtype.kind == "f" and fill_value.dtype.kind in "fiub" and fill_value == 0:
        # as zarr-python: -0.0 is not the fill value 0.0 (nor 0.0 the fill -0.0)
        bits = np.dtype(f"u{flat.dtype.itemsize}")
        same = flat.view(bits) == int(fill_value.astype(flat.dtype).view(bits))
    else:
        same = flat == fill
        if np.asarray(fill != fill).any():
            same |= flat != flat
    empty = same.all(axis=1)
    return _device.to_host(empty).astype(bool, copy=False)


_MISSING = np.uint64(2**64 - 1)


def encode_shards(
    plan: ShardEncode,
    shards: Any,
    write_empty: bool,
    fill: Any,
    xp: Any,
    encoder: Any,
) -> list[np.ndarray | None]:
    """Encode shards ``(n, *shard_shape)``: all their inner chunks with one ``encoder``
    call, then each shard's bytes (inner chunks in C order, then or before the index)
    on the host. Inner chunks holding only ``fill`` are left out unless
    ``write_empty``; a shard left with none is ``None`` (delete it)."""
    n, grid, inner_shape = shards.shape[0], plan.grid, plan.inner.chunk_shape
    ndim, n_inner = len(grid), math.prod(grid)
    split = [d for pair in zip(grid, inner_shape, strict=True) for d in pair]
    perm = (0, *(1 + 2 * i for i in range(ndim)), *(2 + 2 * i for i in range(ndim)))
    inner = xp.ascontiguousarray(shards.reshape((n, *split)).transpose(perm))
    inner = inner.reshape((n * n_inner, *inner_shape))
    if write_empty:
        present = np.ones(n * n_inner, dtype=bool)
    else:
        present = ~empty_rows(inner.reshape(n * n_inner, -1), fill, xp)
    picked = np.flatnonzero(present)
    if not picked.size:
        return [None] * n
    chunks = inner if picked.size == n * n_inner else inner[xp.asarray(picked)]
    encoded = encoder(plan.inner, chunks)
    present = present.reshape(n, n_inner)
    layout = plan.layout
    shift = 0 if layout.index_at_end else layout.index_nbytes
    out: list[np.ndarray | None] = []
    k = 0
    for s in range(n):
        count = int(present[s].sum())
        if not count:
            out.append(None)
            continue
        starts, sizes = encoded.starts[k : k + count], encoded.sizes[k : k + count]
        k += count
        base = int(starts[0])
        payload = encoded.data[base : int(starts[-1] + sizes[-1])]  # contiguous
        table = np.full((n_inner, 2), _MISSING, dtype="<u8")
        table[present[s], 0] = starts - base + shift
        table[present[s], 1] = sizes
        index = table.tobytes()
        if layout.index_crc32c:
            index += CRC32C.trailer(index)
        head, tail = (b"", index) if layout.index_at_end else (index, b"")
        shard = np.empty(len(head) + payload.size + len(tail), dtype=np.uint8)
        shard[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        shard[len(head) : len(head) + payload.size] = payload
        shard[len(head) + payload.size :] = np.frombuffer(tail, dtype=np.uint8)
        out.append(shard)
    return out


def layout(chain: EncodeChain, chunks: Any, xp: Any) -> Any:
    """Chunk arrays ``(n, *chunk_shape)`` (native byte order) to their stored bytes
    ``(n, nbytes)`` uint8: axes permuted to the stored order, bytes to the stored order."""
    n = chunks.shape[0]
    perm = (0, *(1 + i for i in chain.stored_order))
    data = xp.ascontiguousarray(chunks.astype(chain.dtype.newbyteorder("="), copy=False))
    data = xp.ascontiguousarray(data.transpose(perm)).view(xp.uint8).reshape(n, -1)
    dtype = chain.dtype
    if not dtype.isnative and dtype.itemsize > 1:
        unit = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
        data = xp.ascontiguousarray(data.reshape(n, -1, unit)[:, :, ::-1]).reshape(n, -1)
    return data


def adler32(data: Any, xp: Any) -> np.ndarray:
    """Adler-32 of every row of ``data`` ``(n, nbytes)`` uint8, computed with array sums.

    ``A = 1 + sum(d_i)`` and ``B = nbytes + sum((nbytes - i) * d_i)``, both mod 65521
    (``i`` from 0); the weighted sum is taken in pieces so that it stays exact in
    64-bit integers.
    """
    n, size = data.shape
    a = xp.zeros(n, dtype=xp.int64)
    b = xp.zeros(n, dtype=xp.int64)
    step = 1 << 20  # 255 * 2**31 * 2**20 < 2**63
    for start in range(0, size, step):
        piece = data[:, start : start + step].astype(xp.int64)
        weights = size - xp.arange(start, start + piece.shape[1], dtype=xp.int64)
        a = (a + piece.sum(axis=1)) % _ADLER_MOD
        b = (b + (piece * (weights % _ADLER_MOD)[None, :]).sum(axis=1) % _ADLER_MOD) % _ADLER_MOD
    a = (a + 1) % _ADLER_MOD
    b = (b + size) % _ADLER_MOD
    result = (b << 16) | a
    return _device.to_host(result).astype(np.uint32)


@dataclass(frozen=True)
class Encoded:
    """Encoded chunks in one host buffer: chunk ``i`` is ``data[starts[i]:][:sizes[i]]``."""

    data: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray

    def chunk(self, i: int) -> np.ndarray:
        """The stored bytes of chunk ``i`` (a view)."""
        start = int(self.starts[i])
        return self.data[start : start + int(self.sizes[i])]


def frame_layout(fmt: Format | None) -> tuple[int, int]:
    """Bytes reserved before and after each raw stream for the framing of ``fmt``."""
    if fmt is None:
        return 0, 0
    return fmt.skip, fmt.trim - fmt.skip


def stream_starts(fmt: Format | None, raw_sizes: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Streams of ``raw_sizes`` framed for ``fmt`` and laid end to end: where each
    framed stream starts, the total size, and where in it its raw stream starts."""
    head, tail = frame_layout(fmt)
    starts, total = pack_offsets(raw_sizes + head + tail, align=1)
    return starts, total, head


def add_framing(
    fmt: Format | None,
    out: np.ndarray,
    starts: np.ndarray,
    raw_sizes: np.ndarray,
    nbytes: int,
    checksums: np.ndarray | None,
) -> np.ndarray:
    """Write the framing of ``fmt`` around raw streams already placed in ``out``.

    Stream ``i`` sits at ``starts[i] + head``; returns the framed size of each chunk."""
    head, tail = frame_layout(fmt)
    if fmt is not None:
        fmt.write_framing(out, starts, raw_sizes, nbytes, checksums)
    return raw_sizes + head + tail


def pack(
    fmt: Format | None, raw: list[bytes] | None, data: np.ndarray, checksums: np.ndarray | None
) -> Encoded:
    """Lay raw streams (or, uncompressed, the rows of ``data``) out with their framing."""
    n, nbytes = data.shape
    if fmt is None:
        return Encoded(
            data.reshape(-1),
            np.arange(n, dtype=np.int64) * nbytes,
            np.full(n, nbytes, dtype=np.int64),
        )
    assert raw is not None
    raw_sizes = np.array([len(r) for r in raw], dtype=np.int64)
    starts, total, head = stream_starts(fmt, raw_sizes)
    out = np.empty(total, dtype=np.uint8)
    for i, r in enumerate(raw):
        out[starts[i] + head : starts[i] + head + len(r)] = np.frombuffer(r, dtype=np.uint8)
    sizes = add_framing(fmt, out, starts, raw_sizes, nbytes, checksums)
    return Encoded(out, starts, sizes)


class _Rows:
    """Chunks encoded one by one (:func:`encode_host_threads`), read as an
    :class:`Encoded`'s chunks."""

    def __init__(self, rows: list[Encoded]) -> None:
        self.rows = rows

    def chunk(self, i: int) -> np.ndarray:
        return self.rows[i].chunk(0)


def encode_host_threads(chain: EncodeChain, chunks: np.ndarray) -> Any:
    """:func:`encode_host` of each chunk of ``(n, *chunk_shape)`` on the host pool's
    threads (the codecs release the GIL): the host route of device values (see
    :func:`xarray_gds.route.choose_encode`). Chunk ``i``'s bytes are ``.chunk(i)``."""
    from xarray_gds.batch import parallel

    rows: list[Any] = [None] * len(chunks)

    def one(i: int) -> None:
        rows[i] = encode_host(chain, chunks[i : i + 1])

    parallel(one, len(chunks), min_items=2)
    return _Rows(rows)


def encode_host(chain: EncodeChain, chunks: np.ndarray) -> Encoded:
    """Encode chunk arrays ``(n, *chunk_shape)`` on the host, as the device does."""
    data = layout(chain, chunks, np)
    fmt = chain.compressor
    if fmt is None:
        return pack(None, None, data, None)
    frames = chain.frames
    if frames is not None:  # containers of streams: the format's own batched encoder
        return Encoded(*frames.encode(data))
    raw = [fmt.encode_raw(row) for row in data]
    checksums = adler32(data, np) if fmt.adler32 else None
    return pack(fmt, raw, data, checksums)

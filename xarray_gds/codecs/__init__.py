"""Decode chains: what it takes to turn stored chunk bytes back into chunk arrays.

:func:`plan_chain` reads an array's metadata (Zarr v2 or v3) and returns a
:class:`DecodeChain` when every codec has a batched implementation here, or a
:class:`Unsupported` naming the codecs that do not (those arrays are decoded by
zarr-python's own pipeline). A chain decodes a whole batch of chunks at once: one
decompression call per batch (nvCOMP on the device, threaded numcodecs on the host),
then array-wide filters on the stacked ``(n_chunks, chunk_nbytes)`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numcodecs
import numpy as np
import zarr.codecs as zc
from zarr.abc.codec import BytesBytesCodec
from zarr.core.metadata import ArrayV2Metadata, ArrayV3Metadata

from xarray_gds.codecs.filters import ByteFilter, Undelta, Unshuffle
from xarray_gds.codecs.formats import CRC32C, FORMATS, Compressor

__all__ = [
    "Compressor",
    "DecodeChain",
    "ShardChain",
    "Unsupported",
    "codec_name",
    "netcdf_filters",
    "plan_chain",
]

#: Names of the compression formats with a batched decoder on the host and (a container
#: format: for its inner streams nvCOMP decodes) on the device.
COMPRESSORS = tuple(name for name, f in FORMATS.items() if f is not CRC32C)


@dataclass(frozen=True)
class Unsupported:
    """An array whose codecs are not all handled by the batched pipeline."""

    codecs: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class DecodeChain:
    """How to decode every chunk of one array.

    Attributes
    ----------
    chunk_shape : tuple of int
        Shape of a (full) chunk; edge chunks are stored at full size too.
    dtype : numpy.dtype
        Stored dtype (its byte order may be non-native).
    crc32c : bool
        A trailing CRC-32C (v3 ``crc32c`` codec) to check and strip first (on the GPU
        with nvCOMP's batched CRC32).
    compressor : Compressor or None
        The decompression stage, if any.
    filters : tuple of ByteFilter
        Byte-level filters in decode order (v2 ``Shuffle``, ``Delta``).
    stored_order : tuple of int
        Axis permutation of the stored layout: the stored chunk is
        ``chunk.transpose(stored_order)`` (v3 ``transpose``, v2 ``order="F"``).
    codecs : tuple of str
        Codec names, for messages and ``xarray-gds info``.
    """

    chunk_shape: tuple[int, ...]
    dtype: np.dtype
    crc32c: bool = False
    compressor: Compressor | None = None
    filters: tuple[ByteFilter, ...] = ()
    stored_order: tuple[int, ...] = ()
    codecs: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """Decoded size of one chunk in bytes."""
        return math.prod(self.chunk_shape) * self.dtype.itemsize

    @property
    def stored_bound(self) -> int:
        """Bytes a stored chunk of this chain fits in but for unusual cases: the decoded
        size plus room for a compressor's growth on incompressible data and its framing
        (every format of :data:`COMPRESSORS` adds under 1/128 and a few dozen bytes) and a
        checksum. Reads that skip the ``stat`` of each file size their slots with it;
        a larger file is still read whole (see :func:`xarray_gds.stores.files.read_files_device`).
        """
        n = self.nbytes
        return n + n // 128 + 256

    @property
    def device_ready(self) -> bool:
        """True when every stage also runs on the GPU."""
        return not self.host_only

    @property
    def host_only(self) -> str:
        """Why GPU reads of this chain decode on the host ("" when they do not)."""
        from xarray_gds.codecs import crc32c

        if self.crc32c and not crc32c.available():
            return "crc32c: this nvCOMP has no CRC32 functions (nvidia.libnvcomp)"
        if self.compressor is not None and not self.compressor.device_ready:
            return f"{self.compressor.detail or self.compressor.name} has no GPU decoder"
        for f in self.filters:
            if not f.device_ready:
                return f"filter {type(f).__name__} has no identical GPU implementation"
        return ""

    @property
    def transposed(self) -> bool:
        """True when chunks are stored in an axis order other than C order
        (``stored_order``): :meth:`finish` transposes them back."""
        return self.stored_order != tuple(range(len(self.chunk_shape)))

    @property
    def plain(self) -> bool:
        """True when a chunk's decoded bytes are its values as a C-order array of
        ``dtype`` in native order lays them out: no filter, byte swap or transpose
        between (:meth:`finish` is a view), so a chunk may be decoded straight into its
        place in an output array."""
        # numpy reports every 1-byte dtype as native: no byte order to check there
        return self.dtype.isnative and not self.filters and not self.transposed

    def finish(self, data: Any, xp: Any) -> Any:
        """Bytes ``(n, nbytes)`` to the chunk arrays ``(n, *chunk_shape)``, native order."""
        n = data.shape[0]
        dtype = self.dtype
        if not dtype.isnative and dtype.itemsize > 1:
            # byte-reverse each scalar (each half of a complex value)
            unit = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
            data = data.reshape(n, -1, unit)[:, :, ::-1]
            data = xp.ascontiguousarray(data).reshape(n, -1)
            dtype = dtype.newbyteorder("=")
        stored_shape = tuple(self.chunk_shape[i] for i in self.stored_order)
        values = data.view(dtype).reshape((n, *stored_shape))
        if self.transposed:
            inverse = np.argsort(self.stored_order)
            values = values.transpose((0, *(1 + int(i) for i in inverse)))
        return values


@dataclass(frozen=True)
class ShardChain:
    """How to decode a sharded array (v3 ``sharding_indexed``).

    Attributes
    ----------
    shard_shape : tuple of int
        Shape of a shard (the array's chunk grid).
    inner : DecodeChain
        Decode chain of the inner chunks.
    index_crc32c : bool
        The shard index ends with a CRC-32C.
    index_at_end : bool
        The index sits at the end of the shard (else at its start).
    codecs : tuple of str
        Codec names, for messages.
    """

    shard_shape: tuple[int, ...]
    inner: DecodeChain
    index_crc32c: bool
    index_at_end: bool
    codecs: tuple[str, ...]

    @property
    def grid(self) -> tuple[int, ...]:
        """Inner chunks per shard along each axis."""
        return tuple(s // c for s, c in zip(self.shard_shape, self.inner.chunk_shape, strict=True))

    @property
    def index_nbytes(self) -> int:
        return math.prod(self.grid) * 16 + (4 if self.index_crc32c else 0)

    @property
    def nbytes(self) -> int:
        """Decoded size of one shard in bytes."""
        return math.prod(self.shard_shape) * self.inner.dtype.itemsize

    @property
    def device_ready(self) -> bool:
        return self.inner.device_ready

    @property
    def host_only(self) -> str:
        """Why GPU reads of this chain decode on the host ("" when they do not)."""
        return self.inner.host_only


def codec_name(codec: Any) -> str:
    """A short name for a zarr v3 codec or numcodecs codec."""
    if hasattr(codec, "codec_id"):
        return str(codec.codec_id)
    try:
        return str(codec.to_dict()["name"])
    except Exception:
        return type(codec).__name__


def _numcodecs_compressor(codec: Any) -> Compressor | None:
    """The decode stage of a Zarr v2 (numcodecs) compressor, if a format claims it."""
    for fmt in FORMATS.values():
        if (found := fmt.from_numcodecs(codec)) is not None:
            return found
    return None


def _zarr_compressor(codec: Any) -> Compressor | None:
    """The decode stage of a Zarr v3 bytes-to-bytes codec, if a format claims it."""
    for fmt in FORMATS.values():
        if (found := fmt.from_zarr(codec)) is not None:
            return found
    return None


def _shuffle_size(shuffle: numcodecs.Shuffle, dtype: np.dtype) -> int:
    """The element size a Zarr v2 ``shuffle`` filter shuffles by: netCDF-C's NCZarr
    writes ``elementsize: 0`` for "the element size of the variable's type", which
    numcodecs alone would take as no shuffle at all."""
    return int(shuffle.elementsize) or dtype.itemsize


def netcdf_filters(metadata: Any) -> tuple[Any, ...] | None:
    """The Zarr v2 filters of ``metadata`` with each ``shuffle`` of ``elementsize`` 0
    given the dtype's element size, as netCDF-C reads them; None when there is none to
    change (Zarr v3 metadata, single-byte types, no such filter).

    zarr-python's own codecs (numcodecs) read such chunks unshuffled, so an array
    decoded by them is given these filters instead (see
    :func:`xarray_gds.pipeline.attach`).
    """
    if not isinstance(metadata, ArrayV2Metadata) or not metadata.filters:
        return None
    dtype = np.dtype(metadata.dtype.to_native_dtype())
    if dtype.itemsize <= 1:
        return None
    filters = tuple(metadata.filters)
    fixed = tuple(
        numcodecs.Shuffle(elementsize=dtype.itemsize)
        if isinstance(f, numcodecs.Shuffle) and int(f.elementsize) == 0
        else f
        for f in filters
    )
    return None if all(a is b for a, b in zip(fixed, filters, strict=True)) else fixed


def _plan_v3(meta: ArrayV3Metadata, chunk_shape: tuple[int, ...]) -> Any:
    codecs = tuple(meta.codecs)
    if len(codecs) == 1 and isinstance(codecs[0], zc.ShardingCodec):
        return _plan_shards(codecs[0], meta, chunk_shape)
    return _plan_v3_codecs(codecs, meta, chunk_shape)


def _plan_shards(
    sharding: Any, meta: ArrayV3Metadata, shard_shape: tuple[int, ...]
) -> ShardChain | Unsupported:
    names = ("sharding_indexed", *(codec_name(c) for c in sharding.codecs))
    inner_shape = tuple(sharding.chunk_shape)
    if any(s % c for s, c in zip(shard_shape, inner_shape, strict=True)):
        return Unsupported(names, "inner chunks do not tile the shard")
    inner = _plan_v3_codecs(tuple(sharding.codecs), meta, inner_shape)
    if not isinstance(inner, DecodeChain):
        return Unsupported(names, inner.reason)
    index = tuple(sharding.index_codecs)
    little = isinstance(index[0], zc.BytesCodec) and str(
        getattr(index[0].endian, "value", index[0].endian)
    ) in ("little", "None")
    crc = len(index) == 2 and CRC32C.claims(index[1])
    if not little or len(index) not in (1, 2) or (len(index) == 2 and not crc):
        return Unsupported(names, "shard index codecs other than bytes(+crc32c)")
    location = str(getattr(sharding.index_location, "value", sharding.index_location))
    return ShardChain(shard_shape, inner, crc, location == "end", names)


def _plan_v3_codecs(
    codecs: tuple[Any, ...], meta: ArrayV3Metadata, chunk_shape: tuple[int, ...]
) -> DecodeChain | Unsupported:
    names = tuple(codec_name(c) for c in codecs)
    dtype = np.dtype(meta.data_type.to_native_dtype())
    if dtype.kind not in "biufc":
        return Unsupported(names, f"dtype {dtype} is not numeric")
    ndim = len(chunk_shape)
    order = tuple(range(ndim))
    endian_big = False
    crc = False
    compressor: Compressor | None = None
    filters: list[ByteFilter] = []  # in encode order
    seen_bytes = False
    for codec in codecs:
        wrapped = _wrapped_numcodecs(codec)
        if isinstance(codec, zc.TransposeCodec) and not seen_bytes:
            order = tuple(order[i] for i in codec.order)
        elif isinstance(codec, zc.BytesCodec) and not seen_bytes:
            seen_bytes = True
            endian_big = str(getattr(codec.endian, "value", codec.endian)) == "big"
        elif (
            seen_bytes
            and compressor is None
            and not crc
            and wrapped is not None
            and (byte_filter := _byte_filter(wrapped, dtype)) is not None
        ):
            # a numcodecs filter in a v3 chain (VirtualiZarr writes HDF5's shuffle so)
            filters.append(byte_filter)
        elif (
            seen_bytes
            and compressor is None
            and not crc
            and (found := _v3_compressor(codec, wrapped)) is not None
        ):
            compressor = found
        elif CRC32C.claims(codec) and seen_bytes and not crc:
            crc = True
        else:
            return Unsupported(names, f"codec {codec_name(codec)!r} has no batched decoder")
    if endian_big:
        dtype = dtype.newbyteorder(">")
    return DecodeChain(chunk_shape, dtype, crc, compressor, tuple(reversed(filters)), order, names)


def _wrapped_numcodecs(codec: Any) -> Any | None:
    """The numcodecs codec that a Zarr v3 ``numcodecs.*`` bytes-to-bytes codec wraps
    (zarr's ``zarr.codecs.numcodecs`` classes, which keep its configuration as
    ``codec_config``), else None."""
    config = getattr(codec, "codec_config", None)
    if not isinstance(codec, BytesBytesCodec) or not isinstance(config, dict):
        return None
    try:
        return numcodecs.get_codec(dict(config))
    except (KeyError, TypeError, ValueError):
        return None


def _v3_compressor(codec: Any, wrapped: Any | None) -> Compressor | None:
    """The decode stage of a Zarr v3 codec: one of zarr's own compressors, or a
    numcodecs compressor wrapped as ``numcodecs.*``."""
    found = _zarr_compressor(codec)
    if found is None and wrapped is not None:
        found = _numcodecs_compressor(wrapped)
    return found


def _byte_filter(codec: Any, dtype: np.dtype) -> ByteFilter | None:
    """The batched decode stage of a numcodecs filter (``Shuffle``; a ``Delta`` that
    keeps its native numeric dtype), else None."""
    if isinstance(codec, numcodecs.Shuffle):
        return Unshuffle(_shuffle_size(codec, dtype))
    if (
        isinstance(codec, numcodecs.Delta)
        and np.dtype(codec.dtype) == np.dtype(codec.astype)
        and np.dtype(codec.dtype).kind in "iuf"
        and np.dtype(codec.dtype).isnative
    ):
        return Undelta(np.dtype(codec.dtype))
    return None


def _plan_v2(meta: ArrayV2Metadata, chunk_shape: tuple[int, ...]) -> DecodeChain | Unsupported:
    filters = tuple(meta.filters or ())
    names = tuple(codec_name(c) for c in (*filters, meta.compressor) if c is not None)
    dtype = np.dtype(meta.dtype.to_native_dtype())
    if dtype.kind not in "biufc":
        return Unsupported(names, f"dtype {dtype} is not numeric")
    compressor = None
    if meta.compressor is not None:
        compressor = _numcodecs_compressor(meta.compressor)
        if compressor is None:
            return Unsupported(names, f"compressor {codec_name(meta.compressor)!r}")
    elif filters and (last := _numcodecs_compressor(filters[-1])) is not None:
        # a compressor given as the last filter, as kerchunk and VirtualiZarr describe
        # HDF5's filter pipeline ([Shuffle, compressor], no compressor): the same bytes
        # either way
        compressor, filters = last, filters[:-1]
    planned: list[ByteFilter] = []
    for f in reversed(filters):  # decode order
        if (byte_filter := _byte_filter(f, dtype)) is None:
            return Unsupported(names, f"filter {codec_name(f)!r} has no batched decoder")
        planned.append(byte_filter)
    ndim = len(chunk_shape)
    order = tuple(range(ndim)) if meta.order == "C" else tuple(reversed(range(ndim)))
    return DecodeChain(chunk_shape, dtype, False, compressor, tuple(planned), order, names)


def plan_chain(metadata: Any) -> DecodeChain | ShardChain | Unsupported:
    """Plan the batched decode of an array from its zarr metadata.

    Parameters
    ----------
    metadata : ArrayV2Metadata or ArrayV3Metadata
        The array's metadata.

    Returns
    -------
    DecodeChain, ShardChain or Unsupported
    """
    if isinstance(metadata, ArrayV3Metadata):
        grid = metadata.chunk_grid
        chunk_shape = getattr(grid, "chunk_shape", None)
        if chunk_shape is None:
            return Unsupported(("irregular chunk grid",), "chunk grid is not regular")
        return _plan_v3(metadata, tuple(chunk_shape))
    if isinstance(metadata, ArrayV2Metadata):
        return _plan_v2(metadata, tuple(metadata.chunks))
    return Unsupported((type(metadata).__name__,), "unknown metadata")

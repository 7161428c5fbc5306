"""A zarr codec pipeline that reads and decodes chunks in batches.

:class:`GdsCodecPipeline` plugs into zarr-python through its public extension point,
the ``codec_pipeline.path`` setting. For arrays whose codecs :func:`plan_chain`
understands, a read fetches every chunk of the selection at once (kvikio into one
device arena for :class:`~xarray_gds.stores.local.GdsStore`), decodes them with one batched
call per batch (nvCOMP on the GPU, threaded numcodecs on the host), undoes filters on
the whole batch, and scatters the chunks into the output. Everything else goes to
zarr's own :class:`~zarr.core.codec_pipeline.BatchedCodecPipeline`, except writes of
host values, which zarr's :class:`~zarr.core.codec_pipeline.FusedCodecPipeline` makes
(the same bytes, with less work a chunk: see ``GdsCodecPipeline._host_writer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import zarr
from zarr.abc.codec import CodecPipeline, GetResult
from zarr.abc.store import SupportsSyncStore
from zarr.core.array import create_codec_pipeline
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import cpu
from zarr.core.chunk_utils import fill_value_or_default
from zarr.core.codec_pipeline import BatchedCodecPipeline, FusedCodecPipeline
from zarr.core.common import concurrent_map
from zarr.registry import get_pipeline_class, register_pipeline
from zarr.storage import WrapperStore

from xarray_gds import coalesce, config, decode, stores
from xarray_gds import device as _device
from xarray_gds.batch import offload
from xarray_gds.codecs import (
    DecodeChain,
    ShardChain,
    Unsupported,
    host,
    netcdf_filters,
    plan_chain,
)
from xarray_gds.codecs.encode import (
    EncodeChain,
    ShardEncode,
    empty_rows,
    encode_host,
    encode_shards,
    plan_encode,
)
from xarray_gds.errors import ChunkDecodeError, HostRouteWarning, warn
from xarray_gds.place import Tiling, place
from xarray_gds.request import ByteRanges, Decoded, ReadRequest

__all__ = ["GdsCodecPipeline", "attach", "read_as_netcdf", "writing_to"]

_PATH = "xarray_gds.pipeline.GdsCodecPipeline"
_warned: set[Any] = set()
_LEVELS = ("host", "gpu")


def attach(array: zarr.Array) -> zarr.Array:
    """``array``, reading and writing through :class:`GdsCodecPipeline` from now on.

    The pipeline is given to this one array (its ``codec_pipeline``, which zarr sets
    when it builds the array); zarr's process-wide ``codec_pipeline.path`` is not
    touched, so arrays that other code opens keep the pipeline they would get anyway.
    The pipeline the array had (zarr's own, or the one its user configured) serves
    what the batched read cannot. Attaching twice changes nothing.
    """
    inner = array.async_array
    pipe = inner.codec_pipeline
    if not isinstance(pipe, GdsCodecPipeline):
        metadata = inner.metadata
        pipe = _zarr_pipeline(metadata, pipe)
        gds = GdsCodecPipeline(pipe, plan_chain(metadata), _key_parts(metadata), metadata)
        # zarr's own constructor sets this field of its frozen dataclass the same way
        object.__setattr__(inner, "codec_pipeline", gds)
    return array


def read_as_netcdf(array: zarr.Array) -> zarr.Array:
    """``array``, its chunks decoded by zarr's pipeline as netCDF-C decodes them.

    netCDF-C's NCZarr writes the Zarr v2 filter ``{"id": "shuffle", "elementsize": 0}``
    for a shuffle by the element size of the variable's type; zarr-python's codecs
    (numcodecs) take 0 as no shuffle and return wrong values for every type of more
    than one byte. Such an array's pipeline is rebuilt from its metadata with the
    element size made explicit (:func:`xarray_gds.codecs.netcdf_filters`); the
    metadata itself, and so the variable's ``encoding["filters"]``, stay as stored.
    Any other array is returned untouched. :func:`attach` does the same to the
    pipeline it keeps for what the batched read cannot do.
    """
    inner = array.async_array
    pipe = inner.codec_pipeline
    if not isinstance(pipe, GdsCodecPipeline):
        fixed = _zarr_pipeline(inner.metadata, pipe)
        if fixed is not pipe:
            object.__setattr__(inner, "codec_pipeline", fixed)
    return array


def _zarr_pipeline(metadata: Any, pipe: CodecPipeline | None = None) -> CodecPipeline:
    """zarr's pipeline for an array: ``pipe`` (or, if None, the one zarr builds from
    ``metadata``), unless NCZarr's shuffle needs another (see :func:`read_as_netcdf`):
    then the one zarr builds from the metadata with :func:`netcdf_filters`."""
    filters = netcdf_filters(metadata)
    if filters is not None:
        metadata = dataclasses.replace(metadata, filters=filters)
        pipe = None
    if pipe is None:
        pipe = create_codec_pipeline(metadata)  # no store: through from_codecs
        if isinstance(pipe, GdsCodecPipeline):
            pipe = pipe._fallback
    return pipe


class _WriteScope:
    """The stores that :func:`writing_to` calls are writing, and their ``levels``.

    xarray builds the arrays of a write itself, through zarr, which picks their codec
    pipeline class from ``codec_pipeline.path``: the one hook there is. While a write
    runs the path names :class:`GdsCodecPipeline`, which gives the batched pipeline to
    arrays of the stores being written and, to every other array built meanwhile (by
    other threads or libraries), exactly the pipeline the previous setting gives.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.levels: dict[int, tuple[object, str]] = {}
        self.active = 0
        self.previous: type[CodecPipeline] | None = None
        self._setting: Any = None

    def enter(self, store: object, levels: str) -> None:
        with self.lock:
            self.levels[id(store)] = (store, levels)
            self.active += 1
            if self.active == 1:
                previous = get_pipeline_class()
                self.previous = None if issubclass(previous, GdsCodecPipeline) else previous
                self._setting = zarr.config.set({"codec_pipeline.path": _PATH})

    def exit(self, store: object) -> None:
        with self.lock:
            self.levels.pop(id(store), None)
            self.active -= 1
            if self.active == 0:
                setting, self._setting = self._setting, None
                setting.__exit__(None, None, None)

    def levels_of(self, store: object) -> str | None:
        """The ``levels`` of a store being written, or None."""
        found = self.levels.get(id(store))
        return found[1] if found is not None and found[0] is store else None

    def previous_class(self) -> type[CodecPipeline] | None:
        """What other code's arrays get while a write runs (None: this pipeline)."""
        return self.previous if self.active else None


_writes = _WriteScope()


@contextlib.contextmanager
def writing_to(store: object, levels: str = "host") -> Iterator[None]:
    """Arrays of ``store`` that zarr builds inside this context read and write through
    :class:`GdsCodecPipeline`; ``levels`` is the compression-level policy of their
    batched writes (see :func:`xarray_gds.codecs.encode.plan_encode`). Arrays of other
    stores are built as if the context were not there (see :class:`_WriteScope`)."""
    if levels not in _LEVELS:
        raise ValueError(f"levels must be one of {_LEVELS}, not {levels!r}")
    _writes.enter(store, levels)
    try:
        yield
    finally:
        _writes.exit(store)


def _key_parts(metadata: Any) -> int:
    """Number of path segments in the array's chunk keys."""
    ndim = len(metadata.shape)
    return len(metadata.encode_chunk_key((0,) * ndim).split("/")) if ndim else 1


async def _offload(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the read engine's own threads (:func:`batch.offload`): never
    in the event loop's default executor, whose workers zarr's stores need to serve
    the reads the engine waits for."""
    return await asyncio.wrap_future(offload(fn, *args))


def _array_name(key: str, chunk_key_parts: int) -> str:
    parts = key.split("/")
    return "/".join(parts[: max(0, len(parts) - chunk_key_parts)]) or "/"


class GdsCodecPipeline(CodecPipeline):
    """zarr codec pipeline with batched reads; see the module docstring.

    Parameters
    ----------
    fallback : CodecPipeline
        zarr's pipeline for the same codecs: writes and unsupported reads use it.
    chain : DecodeChain, Unsupported or None
        The batched decode plan (``None`` for inner pipelines built from codecs).
    chunk_key_parts : int
        Number of path segments in a chunk key (to name arrays in messages).
    metadata : ArrayV2Metadata or ArrayV3Metadata, optional
        The array's metadata, to plan batched encoding of device values.
    levels : {"host", "gpu"}
        The compression-level policy of batched writes (see ``to_zarr``).
    """

    def __init__(
        self,
        fallback: CodecPipeline,
        chain: DecodeChain | ShardChain | Unsupported | None = None,
        chunk_key_parts: int = 1,
        metadata: Any = None,
        levels: str = "host",
    ) -> None:
        self._fallback = fallback
        self._chain = chain
        self._chunk_key_parts = chunk_key_parts
        self._metadata = metadata
        self._levels = levels
        self._encode: EncodeChain | ShardEncode | str | None = None
        self._fused: FusedCodecPipeline | None = None  #: writes host values (_host_writer)

    def __repr__(self) -> str:
        return f"GdsCodecPipeline(chain={self._chain!r})"

    @property
    def chain(self) -> DecodeChain | ShardChain | Unsupported | None:
        """The batched decode plan of this array."""
        return self._chain

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_codecs(cls, codecs: Iterable[Any]) -> Self:
        previous = _writes.previous_class()
        if previous is not None:  # another array, built while an engine write runs
            return previous.from_codecs(codecs)  # type: ignore[return-value]
        return cls(BatchedCodecPipeline.from_codecs(codecs))

    @classmethod
    def from_array_metadata_and_store(cls, array_metadata: Any, store: Any) -> Self:
        levels = _writes.levels_of(store)
        if levels is None and _writes.previous_class() is not None:
            raise NotImplementedError  # zarr then builds the previous setting's pipeline
        fallback = _zarr_pipeline(array_metadata)
        if levels is None:  # the path set by the user: every array takes this pipeline
            levels = config.get("levels")
        return cls(
            fallback, plan_chain(array_metadata), _key_parts(array_metadata), array_metadata, levels
        )

    def evolve_from_array_spec(self, array_spec: Any) -> Self:
        evolved = self._fallback.evolve_from_array_spec(array_spec)
        return type(self)(evolved, self._chain, self._chunk_key_parts, self._metadata, self._levels)

    # -- delegated ----------------------------------------------------------------
    @property
    def supports_partial_decode(self) -> bool:
        return self._fallback.supports_partial_decode

    @property
    def supports_partial_encode(self) -> bool:
        return self._fallback.supports_partial_encode

    def validate(self, *, shape: Any, dtype: Any, chunk_grid: Any) -> None:
        self._fallback.validate(shape=shape, dtype=dtype, chunk_grid=chunk_grid)

    def compute_encoded_size(self, byte_length: int, array_spec: Any) -> int:
        return self._fallback.compute_encoded_size(byte_length, array_spec)

    async def decode(self, chunk_bytes_and_specs: Iterable[Any]) -> Iterable[Any]:
        return await self._fallback.decode(chunk_bytes_and_specs)

    async def encode(self, chunk_arrays_and_specs: Iterable[Any]) -> Iterable[Any]:
        return await self._fallback.encode(chunk_arrays_and_specs)

    async def write(self, batch_info: Iterable[Any], value: Any, drop_axes: Any = ()) -> None:
        """Host values are written by zarr's codecs (:meth:`_host_writer`); device values
        are merged, checked for emptiness and encoded on the GPU in batches (one nvCOMP
        call per batch), or copied to the host for zarr's codecs when the array's codecs
        have no batched encoder."""
        array = value.as_ndarray_like()
        batch = list(batch_info)
        if not batch:
            return
        on_device = _device.is_device_array(array)
        plan = self.encode_plan
        if isinstance(plan, EncodeChain | ShardEncode) and (on_device or _host_batched_writes()):
            await _write_batched(self, plan, batch, array, drop_axes, on_device)
            return
        if on_device:
            self._warn_host_encode(batch[0][0].path, str(plan))
            value = cpu.NDBuffer.from_numpy_array(await _offload(array.get))
        fused = self._host_writer(batch[0][0], batch[0][1])
        if fused is None:
            await self._fallback.write(batch, value, drop_axes)
            return
        # the engine's own threads: one hop for the batch (see _host_writer)
        await _offload(fused.write_sync, batch, value, drop_axes, _write_workers())

    def _host_writer(self, byte_setter: Any, chunk_spec: ArraySpec) -> FusedCodecPipeline | None:
        """What writes host values to ``byte_setter``'s store: zarr's own
        :class:`~zarr.core.codec_pipeline.FusedCodecPipeline` over the array's codecs,
        or None (zarr's batched pipeline) where a codec cannot encode synchronously or
        the store has no synchronous IO of its own (see :func:`_sync_io_matches`).

        Both write what zarr's codecs make of each chunk, byte for byte. The fused one
        merges, checks, encodes and stores each chunk as one task (on zarr's thread
        pool when there are several), where the batched one makes a coroutine a chunk,
        copies every chunk into its stored layout on the event loop's thread and
        compresses and stores it in two more hops. Its ``write_sync`` runs in the
        engine's own threads (:func:`xarray_gds.batch.offload`), not in the event loop's
        default executor as its ``write`` would: measured on the 2-core CI machine,
        one region write of a 4 MiB chunk at a time costs 4-7% less CPU so (fewer
        fresh pages to zero), which is what puts it ahead of xarray's own write (see
        docs/performance.md).
        """
        if not _sync_io_matches(getattr(byte_setter, "store", None)):
            return None
        if self._fused is None:
            codecs: Iterable[Any] = self._fallback  # type: ignore[assignment]
            fused = FusedCodecPipeline.from_codecs(tuple(codecs))
            self._fused = fused.evolve_from_array_spec(chunk_spec)
        return self._fused if self._fused.sync_transform is not None else None

    @property
    def encode_plan(self) -> EncodeChain | ShardEncode | str:
        """The batched encode plan of this array, or why it encodes on the host."""
        if self._encode is None:
            if self._metadata is None:
                self._encode = "no array metadata (an inner pipeline)"
            else:
                self._encode = plan_encode(self._metadata, self._levels)
        return self._encode

    # -- the batched read ---------------------------------------------------------
    async def read(
        self, batch_info: Iterable[Any], out: Any, drop_axes: tuple[int, ...] = ()
    ) -> tuple[GetResult, ...]:
        batch = list(batch_info)
        if not batch:
            return ()
        chain = self._chain
        on_device = not isinstance(out, cpu.NDBuffer)
        planned = isinstance(chain, DecodeChain | ShardChain)
        if not planned or (on_device and not chain.device_ready):  # type: ignore[union-attr]
            if not on_device:
                return await self._fallback.read(batch, out, drop_axes)
            if chain is not None:
                self._warn_host_decode(batch[0][0].path, chain)
            return await self._host_then_copy(batch, out, drop_axes, self._fallback.read)
        if isinstance(chain, ShardChain):
            return await _read_shards(chain, batch, out, drop_axes, on_device)
        assert isinstance(chain, DecodeChain)
        # the read engine's loop (xarray_gds.coalesce): joined with other threads' reads,
        # routed by cost, part k + 1 read while part k decodes
        parts = _split(batch, decode.part_chunks(len(batch), chain.nbytes, on_device))
        store = batch[0][0].store
        requests = [
            ReadRequest(store, chain, [bg.path for bg, *_ in part], on_device) for part in parts
        ]
        results: list[GetResult] = []

        def scatter(k: int, decoded: Decoded) -> None:
            results.extend(_scatter(parts[k], *decoded, out, drop_axes, on_device))

        await _offload(coalesce.fetch_decode_parts, requests, scatter)
        return tuple(results)

    async def _host_then_copy(
        self,
        batch: list[Any],
        out: Any,
        drop_axes: tuple[int, ...],
        read: Callable[..., Awaitable[tuple[GetResult, ...]]],
    ) -> tuple[GetResult, ...]:
        """``read`` (zarr's own pipeline, or the batched host read) into host memory,
        then one copy of the result to ``out``.

        zarr's codecs are host codecs (its Zarr v2 codec cannot even take device
        buffers), so GPU reads of arrays without a batched plan decode on the host;
        small batches of planned arrays decode there too when that is faster.
        """
        specs: dict[int, Any] = {}

        def on_host(spec: Any) -> Any:
            if id(spec) not in specs:
                specs[id(spec)] = ArraySpec(
                    shape=spec.shape,
                    dtype=spec.dtype,
                    fill_value=spec.fill_value,
                    config=spec.config,
                    prototype=cpu.buffer_prototype,
                )
            return specs[id(spec)]

        host_batch = [(bg, on_host(spec), *rest) for bg, spec, *rest in batch]
        target = out.as_ndarray_like()
        host_out = cpu.NDBuffer.from_numpy_array(np.empty(target.shape, dtype=target.dtype))
        results = await read(host_batch, host_out, drop_axes)
        target[...] = _device.cupy().asarray(host_out.as_numpy_array())
        return results

    def _warn_host_encode(self, key: str, why: str) -> None:
        self._warn_host(key, "encode", why, "copied to the host and encoded there by zarr-python")

    def _warn_host_decode(self, key: str, chain: Any) -> None:
        why = chain.reason if isinstance(chain, Unsupported) else chain.host_only
        self._warn_host(
            key, "decode", why, "decoded on the host by zarr-python and then copied to the GPU"
        )

    def _warn_host(self, key: str, step: str, why: str, route: str) -> None:
        """One RuntimeWarning per array and step: its codecs, why and what happens."""
        name = _array_name(key, self._chunk_key_parts)
        if (step, name) in _warned:
            return
        _warned.add((step, name))
        codecs = ", ".join(getattr(self._chain, "codecs", ()) or ())
        warn(
            f"xarray-gds: array {name!r} uses codecs [{codecs}] ({why}); its chunks are {route}",
            HostRouteWarning,
        )


register_pipeline(GdsCodecPipeline)


def _split(batch: list[Any], per_part: int) -> list[list[Any]]:
    return [batch[i : i + per_part] for i in range(0, len(batch), per_part)]


def _touched(sel: Any, size: int, chunk: int) -> np.ndarray:
    """Indices of the inner chunks (of length ``chunk``) that ``sel`` reads from."""
    if isinstance(sel, slice):
        idx = np.arange(*sel.indices(size))
    else:
        idx = np.asarray(sel)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
    return np.unique(idx.reshape(-1) // chunk)


#: A shard's index table ``(*grid, 2)`` of (offset, nbytes) and the size of its file.
_Index = tuple[np.ndarray, int]


async def _shard_index(chain: ShardChain, byte_getter: Any) -> _Index | None:
    """The (offset, nbytes) table of a shard, shaped like its inner chunk grid, and the
    size of the shard in bytes (what the table is checked against before any read)."""
    n = chain.index_nbytes
    key = byte_getter.path
    try:
        found = await stores.source_for(byte_getter.store).read_end(key, n, chain.index_at_end)
    except IsADirectoryError:
        raise ChunkDecodeError(
            key,
            "sharding_indexed",
            "a directory stands where the shard file should be: remove it (or restore "
            "the shard from a backup) to read the shard's chunks as the fill value",
        ) from None
    if found is None:
        return None
    raw, shard_nbytes = found
    if raw.size != n:
        raise ChunkDecodeError(
            key,
            "sharding_indexed",
            f"index of {raw.size} bytes, expected {n} (the shard file holds {shard_nbytes})",
        )
    if chain.index_crc32c:
        raw = host.strip_crc32c([raw], [f"{key} (shard index)"])[0]
    return raw.view("<u8").reshape((*chain.grid, 2)), shard_nbytes


def _check_ranges(
    chain: ShardChain, key: str, flat: np.ndarray, table: np.ndarray, shard_nbytes: int
) -> None:
    """Raise for the first inner chunk whose byte range (``table``: uint64 offset and
    nbytes of the inner chunks ``flat``) does not lie in the chunk data of the shard:
    the ``shard_nbytes`` bytes of its file less its index. Sizes read from a damaged
    index would otherwise size the reads' buffers (an allocation of terabytes)."""
    n_index = chain.index_nbytes
    lo = 0 if chain.index_at_end else n_index
    hi = shard_nbytes - n_index if chain.index_at_end else shard_nbytes
    huge = np.any(table >= np.uint64(1 << 62), axis=1)
    sane = np.where(huge[:, None], np.uint64(0), table).astype(np.int64)
    start, size = sane[:, 0], sane[:, 1]
    bad = huge | (start < lo) | (start + size > hi)
    if not bad.any():
        return
    j = int(np.flatnonzero(bad)[0])
    coords = tuple(int(i) for i in np.unravel_index(int(flat[j]), chain.grid))
    offset, nbytes = int(table[j, 0]), int(table[j, 1])
    raise ChunkDecodeError(
        f"{key} (inner chunk {coords})",
        "sharding_indexed",
        f"the shard index gives it {nbytes} bytes at offset {offset}, outside the chunk "
        f"data (bytes {lo} to {max(lo, hi)}) of the {shard_nbytes}-byte shard file: the "
        "index is damaged or the file truncated",
    )


async def _read_shards(
    chain: ShardChain, batch: list[Any], out: Any, drop_axes: tuple[int, ...], on_device: bool
) -> tuple[GetResult, ...]:
    """Read shards: every index first (small host reads, all in flight), then the
    touched inner chunks of every shard by byte range, through the read engine's loop
    (:func:`xarray_gds.coalesce.fetch_decode_parts`: joined with other threads' reads,
    routed by cost, part k + 1 read while part k decodes), each part's shards
    assembled as it comes."""
    indexes = list(await asyncio.gather(*(_shard_index(chain, bg) for bg, *_ in batch)))
    parts = _split(batch, decode.part_chunks(len(batch), chain.nbytes, on_device))
    store = batch[0][0].store
    plans: list[tuple[list[_Index | None], _ShardPlan]] = []
    requests: list[ReadRequest] = []
    at = 0
    for part in parts:
        found, at = indexes[at : at + len(part)], at + len(part)
        plan = _shard_plan(chain, part, found)
        plans.append((found, plan))
        held = [bg.path for bg, *_ in part]
        ranges = ByteRanges(held, plan.shard, plan.starts, plan.sizes)
        requests.append(ReadRequest(store, chain.inner, plan.keys, on_device, ranges))
    results: list[GetResult] = []

    def assemble(k: int, decoded: Decoded) -> None:
        found, plan = plans[k]
        results.extend(
            _assemble_shards(chain, parts[k], found, plan, decoded, out, drop_axes, on_device)
        )

    await _offload(coalesce.fetch_decode_parts, requests, assemble)
    return tuple(results)


class _InnerKeys(Sequence[str]):
    """Names of inner chunks for error messages, formatted only when one is needed."""

    def __init__(self, shard_keys: list[str], plan: _ShardPlan, grid: tuple[int, ...]) -> None:
        self._shard_keys = shard_keys
        self._plan = plan
        self._grid = grid

    def __len__(self) -> int:
        return len(self._plan.sizes)

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        j = range(len(self))[j]
        coords = tuple(int(i) for i in np.unravel_index(int(self._plan.flat[j]), self._grid))
        return f"{self._shard_keys[int(self._plan.shard[j])]} (inner chunk {coords})"


@dataclass
class _ShardPlan:
    """The inner chunks a read needs, in (shard, flat inner index) order.

    ``shard`` indexes the part's shards, ``flat`` the inner chunk grid (C order);
    ``starts`` and ``sizes`` are their byte ranges in the shard; ``keys`` name them.
    """

    shard: np.ndarray
    flat: np.ndarray
    starts: np.ndarray
    sizes: np.ndarray
    keys: Sequence[str] = ()


def _shard_plan(chain: ShardChain, part: list[Any], indexes: list[_Index | None]) -> _ShardPlan:
    """The inner chunks to read from the shards of ``part`` (vectorized per shard), each
    checked to lie inside its shard's file (see :func:`_check_ranges`)."""
    inner = chain.inner
    grid = chain.grid
    missing = np.iinfo(np.uint64).max
    shards: list[np.ndarray] = []
    flats: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for s, ((bg, _, chunk_sel, _, _), found) in enumerate(zip(part, indexes, strict=True)):
        if found is None:
            continue
        index, shard_nbytes = found
        axes = [
            _touched(sel, n, c)
            for sel, n, c in zip(chunk_sel, chain.shard_shape, inner.chunk_shape, strict=True)
        ]
        flat = np.ravel_multi_index(np.ix_(*axes), grid).reshape(-1)
        table = index.reshape(-1, 2)[flat]
        keep = ~((table[:, 0] == missing) & (table[:, 1] == missing))
        flat, table = flat[keep], table[keep]
        _check_ranges(chain, bg.path, flat, table, shard_nbytes)
        shards.append(np.full(len(flat), s, dtype=np.int64))
        flats.append(flat.astype(np.int64))
        starts.append(table[:, 0].astype(np.int64))
        sizes.append(table[:, 1].astype(np.int64))
    empty = np.zeros(0, dtype=np.int64)

    def cat(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else empty

    plan = _ShardPlan(cat(shards), cat(flats), cat(starts), cat(sizes))
    plan.keys = _InnerKeys([bg.path for bg, *_ in part], plan, grid)
    return plan


def _assemble_shards(
    chain: ShardChain,
    part: list[Any],
    indexes: list[_Index | None],
    plan: _ShardPlan,
    decoded: Decoded,
    out: Any,
    drop_axes: tuple[int, ...],
    on_device: bool,
) -> list[GetResult]:
    """The shards of ``part`` built from their decoded inner chunks (``decoded``, in
    the order of ``plan``), and the selection of each scattered into ``out``."""
    xp = _device.array_module("cuda" if on_device else "cpu")
    inner = chain.inner
    grid = chain.grid
    present, chunks = decoded
    if len(present) != len(plan.sizes):  # a range the index lists was not there
        lost = sorted(set(range(len(plan.sizes))) - set(present))[0]
        raise ChunkDecodeError(
            plan.keys[lost], "sharding_indexed", "the shard vanished while it was read"
        )
    # assemble each shard from its inner chunks (the plan is sorted by shard, so each
    # shard's inner chunks are one slice of it), then place the shards' selections
    bounds = np.searchsorted(plan.shard, np.arange(len(part) + 1))
    whole = tuple(slice(0, s) for s in chain.shard_shape)
    dtype = inner.dtype.newbyteorder("=")
    shards: list[Any] = [None] * len(part)
    for s, (_, spec, _, _, _) in enumerate(part):
        if indexes[s] is None:
            continue
        j0, j1 = int(bounds[s]), int(bounds[s + 1])
        shard = xp.empty(chain.shard_shape, dtype=dtype)
        place(
            shard,
            None if chunks is None else chunks[j0:j1],
            plan.flat[j0:j1].tolist(),  # the grid positions of the shard's inner chunks
            math.prod(grid),
            lambda k: (_inner_region(k, grid, inner.chunk_shape), ()),
            fill_value_or_default(spec),
            on_device,
            tiling=Tiling(grid, whole, whole),
        )
        shards[s] = shard
    found = [s for s in range(len(part)) if shards[s] is not None]
    _place_entries(
        out.as_ndarray_like(), [shards[s] for s in found], found, part, on_device, drop_axes
    )
    return [GetResult(status="present" if sh is not None else "missing") for sh in shards]


def _inner_region(k: int, grid: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Where inner chunk ``k`` (C order of ``grid``) lies in its shard."""
    at = np.unravel_index(k, grid)
    return tuple(slice(int(i) * c, (int(i) + 1) * c) for i, c in zip(at, chunk_shape, strict=True))


def _place_entries(
    target: Any,
    chunks: Any,
    present: list[int],
    entries: list[Any],
    on_device: bool,
    drop_axes: tuple[int, ...],
    tiling: Tiling | None = None,
) -> None:
    """Place the chunks ``present`` of zarr's batch ``entries`` where its indexing says
    (each entry's selection of the output and of its chunk), the fill value where a
    chunk is missing."""
    place(
        target,
        chunks,
        present,
        len(entries),
        lambda k: (entries[k][3], entries[k][2]),
        fill_value_or_default(entries[0][1]),
        on_device,
        tiling=tiling,
        drop_axes=drop_axes,
    )


def _tiling(
    target: Any, chunk_shape: tuple[int, ...], entries: list[Any], drop_axes: tuple[int, ...]
) -> Tiling | None:
    """How whole chunks that tile ``target`` exactly are placed with one reshape (one
    kernel) instead of one copy a chunk; None when the batch does not qualify."""
    if drop_axes or len(entries) < 2 or not all(e[4] for e in entries):
        return None
    if len(chunk_shape) != target.ndim:
        return None
    starts = []
    for _, _, _, out_sel, _ in entries:
        if not all(isinstance(s, slice) and s.step in (None, 1) for s in out_sel):
            return None
        starts.append([s.start or 0 for s in out_sel])
    origin = np.asarray(starts, dtype=np.int64)
    if np.any(origin % chunk_shape):
        return None
    cells = origin // chunk_shape
    grid = tuple(int(g) for g in cells.max(axis=0) + 1)
    if math.prod(grid) != len(entries) or tuple(
        g * c for g, c in zip(grid, chunk_shape, strict=True)
    ) != tuple(target.shape):
        return None
    order = np.ravel_multi_index(tuple(cells.T), grid)
    if len(np.unique(order)) != len(entries):
        return None
    whole = tuple(slice(0, s) for s in target.shape)
    return Tiling(grid, whole, whole, None if np.all(np.diff(order) == 1) else order)


def _scatter(
    batch: list[Any],
    present: list[int],
    chunks: Any,
    out: Any,
    drop_axes: tuple[int, ...],
    on_device: bool,
) -> tuple[GetResult, ...]:
    """Place the decoded chunks of ``batch`` (``present``: which exist) in ``out``, the
    fill value where a chunk is missing (:func:`xarray_gds.place.place`)."""
    target = out.as_ndarray_like()
    tiling = None
    if on_device and present and len(present) == len(batch):
        tiling = _tiling(target, tuple(chunks.shape[1:]), batch, drop_axes)
    _place_entries(target, chunks, present, batch, on_device, drop_axes, tiling)
    found = set(present)
    return tuple(
        GetResult(status="present" if i in found else "missing") for i in range(len(batch))
    )


def _same_sync_io(cls: type) -> bool:
    def owner(name: str) -> type | None:
        return next((c for c in cls.__mro__ if name in vars(c)), None)

    return all(owner(name) is owner(f"{name}_sync") for name in ("get", "set", "delete"))


def _sync_io_matches(store: Any) -> bool:
    """Whether ``store`` has synchronous IO (zarr's ``SupportsSyncStore``, not turned
    off by its ``_supports_sync_io``) and it and every store it wraps define their
    synchronous ``get``, ``set`` and ``delete`` in the class that defines the async
    ones. zarr's fused pipeline writes through the synchronous methods: a store
    subclass that overrides only ``set`` (to record or change what is written) keeps
    its override only through the async ones. False for None."""
    if not isinstance(store, SupportsSyncStore) or not getattr(store, "_supports_sync_io", True):
        return False
    while isinstance(store, WrapperStore):
        if not _same_sync_io(type(store)):
            return False
        store = store._store
    return _same_sync_io(type(store))


def _write_workers() -> int:
    """Threads a fused write of several chunks uses: zarr's ``codec_pipeline.max_workers``
    (the CPU count when unset), as zarr's own fused pipeline takes it."""
    setting = zarr.config.get("codec_pipeline.max_workers", None)
    try:
        return max(1, int(setting)) if setting is not None else os.cpu_count() or 1
    except (TypeError, ValueError):
        raise ValueError(
            f"zarr's setting codec_pipeline.max_workers must be a whole number of threads, "
            f"not {setting!r}"
        ) from None


def _host_batched_writes() -> bool:
    """Whether host values take the batched encoder too (``XARRAY_GDS_BATCHED_HOST_WRITES``
    set to 1). By default zarr-python writes host values; the batched host encoder
    makes the streams the GPU makes, and CI runs the device write logic through it."""
    return bool(config.get("batched_host_writes"))


def _covers(entry: Any, chunk_shape: tuple[int, ...]) -> bool:
    """Whether the value written to this chunk fills all of it."""
    _, _, chunk_sel, _, complete = entry
    if not complete:
        return False
    for sel, size in zip(chunk_sel, chunk_shape, strict=False):
        if not isinstance(sel, slice) or len(range(*sel.indices(size))) != size:
            return False
    return len(chunk_sel) == len(chunk_shape)


def _assemble(
    stage: Any,
    part: list[Any],
    array: Any,
    drop_axes: tuple[int, ...],
    write_empty: bool,
    xp: Any,
) -> np.ndarray:
    """Write the value into the staged chunks; return which chunks to store (not empty)."""
    ndim = stage.ndim - 1
    expand = tuple(None if i in drop_axes else slice(None) for i in range(ndim))
    for j, (_, _, chunk_sel, out_sel, _) in enumerate(part):
        value = array[out_sel] if array.ndim else array
        if drop_axes:
            value = value[expand]
        stage[(j, *chunk_sel)] = value
    n = len(part)
    if write_empty or not n:
        return np.ones(n, dtype=bool)
    return ~empty_rows(stage.reshape(n, -1), fill_value_or_default(part[0][1]), xp)


async def _write_batched(
    pipe: GdsCodecPipeline,
    plan: EncodeChain | ShardEncode,
    batch: list[Any],
    array: Any,
    drop_axes: tuple[int, ...],
    on_device: bool,
) -> None:
    """Merge, check and encode the chunks of a write in batches, then store them.

    Chunks the value fills are encoded from it alone; the others start from their
    stored values (decoded by the batched read) or the fill value. Each chunk file is
    written whole (the store's atomic set) or deleted when it holds only the fill
    value and ``write_empty_chunks`` is off. The files of one batch are written while
    the next batch is staged and encoded.
    """
    xp = _device.array_module("cuda" if on_device else "cpu")
    proto = _device.buffer_prototype("cuda" if on_device else "cpu")
    dtype = plan.dtype.newbyteorder("=")
    # the staged chunks, their stored layout and the compressed output live together
    per_part = max(1, decode.budget(on_device) // max(1, 5 * plan.nbytes))
    writing: asyncio.Future[None] | None = None
    try:
        for part in _split(batch, per_part):
            stage = xp.empty((len(part), *plan.chunk_shape), dtype=dtype)
            whole = tuple(slice(0, s) for s in plan.chunk_shape)
            stored: list[Any] = []  # chunks the write covers only in part: read them
            for j, entry in enumerate(part):
                if _covers(entry, plan.chunk_shape):
                    continue
                byte_setter, spec, _, _, complete = entry
                if complete:  # an edge chunk: the value covers all of it inside the array
                    stage[j] = fill_value_or_default(spec)
                else:
                    stored.append((byte_setter, spec, whole, (j, *whole), True))
            if stored:  # one batched read (missing chunks come back as the fill value)
                await pipe.read(stored, proto.nd_buffer.from_ndarray_like(stage))
            write_empty = bool(part[0][1].config.write_empty_chunks)

            def encode(
                part: list[Any] = part, stage: Any = stage, write_empty: bool = write_empty
            ) -> list[Any]:
                keep = _assemble(stage, part, array, drop_axes, write_empty, xp)
                kept = np.flatnonzero(keep)
                pieces: list[Any] = [None] * len(part)
                if not kept.size:
                    return pieces
                chunks = stage if kept.size == len(part) else stage[xp.asarray(kept)]
                if on_device:
                    from xarray_gds.codecs import nvcomp

                    encoder = nvcomp.encode
                else:
                    encoder = encode_host
                try:
                    if isinstance(plan, ShardEncode):
                        fill = fill_value_or_default(part[0][1])
                        done = encode_shards(plan, chunks, write_empty, fill, xp, encoder)
                    else:
                        encoded = encoder(plan, chunks)
                        done = [encoded.chunk(k) for k in range(kept.size)]
                except (RuntimeError, ValueError) as err:
                    first, last = part[int(kept[0])][0].path, part[int(kept[-1])][0].path
                    where = "GPU (nvCOMP)" if on_device else "host"
                    raise RuntimeError(
                        f"xarray-gds: encoding {kept.size} chunks ({first} .. {last}) with "
                        f"[{', '.join(plan.codecs)}] on the {where} failed: {err}"
                    ) from err
                for j, piece in zip(kept.tolist(), done, strict=True):
                    pieces[j] = piece
                return pieces

            pieces = await _offload(encode)
            jobs = [
                (bs, None if piece is None else cpu.Buffer.from_array_like(piece))
                for (bs, *_), piece in zip(part, pieces, strict=True)
            ]
            if writing is not None:
                await writing
            writing = asyncio.ensure_future(_store_jobs(jobs))
        if writing is not None:
            done, writing = writing, None
            await done
    finally:
        if writing is not None:  # a batch failed: let the writes in flight finish first
            with contextlib.suppress(Exception):
                await writing


async def _store_jobs(jobs: list[tuple[Any, Any]]) -> None:
    """Write (or delete, for ``None``) every chunk of a part."""
    store = jobs[0][0].store
    # one write per thread of the pool, GIL released (a local store, held for the write)
    if stores.source_for(store).writes_in_threads:
        keys = [bs.path for bs, _ in jobs]
        await _offload(_store_all, store, keys, [b for _, b in jobs])
    else:
        await concurrent_map(jobs, _store_one, zarr.config.get("async.concurrency"))


def _store_all(store: Any, keys: list[str], buffers: list[Any]) -> None:
    def one(i: int) -> None:
        if buffers[i] is None:
            store.delete_sync(keys[i])
        else:
            store.set_sync(keys[i], buffers[i])

    host.parallel(one, len(keys))


async def _store_one(byte_setter: Any, buffer: Any) -> None:
    if buffer is None:
        await byte_setter.delete()
    else:
        await byte_setter.set(buffer)

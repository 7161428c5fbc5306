"""A zarr codec pipeline that reads and decodes chunks in batches.

:class:`GdsCodecPipeline` plugs into zarr-python through its public extension point,
the ``codec_pipeline.path`` setting. For arrays whose codecs :func:`plan_chain`
understands, a read fetches every chunk of the selection at once (kvikio into one
device arena for :class:`~xarray_gds.stores.local.GdsStore`), decodes them with one batched
call per batch (nvCOMP on the GPU, threaded numcodecs on the host), undoes filters on
the whole batch, and scatters the chunks into the output (:mod:`xarray_gds.entries`);
sharded arrays read their shards' indexes first (:mod:`xarray_gds.shards`). Writes of
device values are encoded in batches (:mod:`xarray_gds.writes`). Everything else goes
to zarr's own :class:`~zarr.core.codec_pipeline.BatchedCodecPipeline`, except writes of
host values, which zarr's :class:`~zarr.core.codec_pipeline.FusedCodecPipeline` makes
(the same bytes, with less work a chunk: see ``GdsCodecPipeline._host_writer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Self

import numpy as np
import zarr
from numpy.lib.mixins import NDArrayOperatorsMixin
from zarr.abc.codec import CodecPipeline, GetResult
from zarr.abc.store import SupportsSyncStore
from zarr.core.array import create_codec_pipeline
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import cpu
from zarr.core.codec_pipeline import BatchedCodecPipeline, FusedCodecPipeline
from zarr.registry import get_pipeline_class, register_pipeline
from zarr.storage import WrapperStore

from xarray_gds import coalesce, config, decode, shards, writes
from xarray_gds import device as _device
from xarray_gds.batch import offloaded
from xarray_gds.codecs import DecodeChain, ShardChain, Unsupported, netcdf_filters, plan_chain
from xarray_gds.codecs.encode import EncodeChain, ShardEncode, plan_encode
from xarray_gds.entries import scatter, split
from xarray_gds.errors import HostRouteWarning, warn
from xarray_gds.request import Decoded, ReadRequest

__all__ = ["DeviceValues", "GdsCodecPipeline", "attach", "read_as_netcdf", "writing_to"]

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
            if self.active == 0:
                # may raise (a path naming no class): then nothing is counted or held
                previous = get_pipeline_class()
                self.previous = None if issubclass(previous, GdsCodecPipeline) else previous
                self._setting = zarr.config.set({"codec_pipeline.path": _PATH})
            self.levels[id(store)] = (store, levels)
            self.active += 1

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


_scope = _WriteScope()


@contextlib.contextmanager
def writing_to(store: object, levels: str = "host") -> Iterator[None]:
    """Arrays of ``store`` that zarr builds inside this context read and write through
    :class:`GdsCodecPipeline`; ``levels`` is the compression-level policy of their
    batched writes (see :func:`xarray_gds.codecs.encode.plan_encode`). Arrays of other
    stores are built as if the context were not there (see :class:`_WriteScope`)."""
    if levels not in _LEVELS:
        raise ValueError(f"levels must be one of {_LEVELS}, not {levels!r}")
    _scope.enter(store, levels)
    try:
        yield
    finally:
        _scope.exit(store)


class DeviceValues(NDArrayOperatorsMixin):
    """Device values on their way through xarray's CF encoding to
    :meth:`GdsCodecPipeline.write`, which takes them out again.

    xarray's encoder runs on CuPy values with the ``cupy`` namespace, whose functions
    refuse the numpy scalars it passes (a packed variable's fill value: ``TypeError:
    Input should be a CuPy array``). Wrapped, the values take numpy's: every numpy
    function and ufunc applied to them runs on the values inside (NEP 18 and NEP 13
    dispatch, CuPy's own for CuPy values, as on the blocks of a dask array), and
    results that are arrays come back wrapped. Nothing copies them to the host:
    ``np.asarray`` is refused, as CuPy refuses it.

    Parameters
    ----------
    values : array
        The values (a CuPy array; any array with numpy's protocols works the same).
    """

    __slots__ = ("values",)

    def __init__(self, values: Any) -> None:
        self.values = values

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.values.dtype)

    @property
    def ndim(self) -> int:
        return int(self.values.ndim)

    @property
    def size(self) -> int:
        return int(self.values.size)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)

    @property
    def itemsize(self) -> int:
        return int(self.values.itemsize)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"DeviceValues({type(self.values).__name__}, shape={self.shape}, dtype={self.dtype})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(
            "xarray-gds: device values are not converted to numpy implicitly; "
            "copy them to the host explicitly if that is meant"
        )

    def __getitem__(self, key: Any) -> Any:
        return _wrapped(self.values[_unwrapped(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self.values[_unwrapped(key)] = _unwrapped(value)

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> DeviceValues:
        return DeviceValues(self.values.astype(dtype, *args, **kwargs))

    def copy(self) -> DeviceValues:
        return DeviceValues(self.values.copy())

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        result = getattr(ufunc, method)(*_unwrapped(inputs), **_unwrapped(kwargs))
        if out is not None:  # in place: the wrappers given
            return out[0] if len(out) == 1 else out
        return _wrapped(result)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.result_type:  # numpy's promotion of the dtypes (NEP 50: the same)
            return np.result_type(*(a.dtype if isinstance(a, DeviceValues) else a for a in args))
        return _wrapped(func(*_unwrapped(args), **_unwrapped(kwargs)))


def _unwrapped(x: Any) -> Any:
    """``x`` with the values inside every :class:`DeviceValues` in it (tuples, lists
    and dicts looked into)."""
    if isinstance(x, DeviceValues):
        return x.values
    if isinstance(x, tuple | list):
        return type(x)(_unwrapped(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrapped(v) for k, v in x.items()}
    return x


def _wrapped(x: Any) -> Any:
    """``x``, its arrays (not scalars: those have no ``__array_function__``) wrapped."""
    if isinstance(x, tuple | list):
        return type(x)(_wrapped(v) for v in x)
    if hasattr(x, "__array_function__") and not isinstance(x, DeviceValues):
        return DeviceValues(x)
    return x


def _key_parts(metadata: Any) -> int:
    """Number of path segments in the array's chunk keys."""
    ndim = len(metadata.shape)
    return len(metadata.encode_chunk_key((0,) * ndim).split("/")) if ndim else 1


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
        previous = _scope.previous_class()
        if previous is not None:  # another array, built while an engine write runs
            return previous.from_codecs(codecs)  # type: ignore[return-value]
        return cls(BatchedCodecPipeline.from_codecs(codecs))

    @classmethod
    def from_array_metadata_and_store(cls, array_metadata: Any, store: Any) -> Self:
        levels = _scope.levels_of(store)
        if levels is None and _scope.previous_class() is not None:
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
        if isinstance(array, DeviceValues):  # as xarray_gds.to_zarr hands them to xarray
            array = array.values
            value = type(value).from_ndarray_like(array)
        batch = list(batch_info)
        if not batch:
            return
        on_device = _device.is_device_array(array)
        plan = self.encode_plan
        if isinstance(plan, EncodeChain | ShardEncode) and (on_device or _host_batched_writes()):
            await writes.write_batched(self.read, plan, batch, array, drop_axes, on_device)
            return
        if on_device:
            self._warn_host_encode(batch[0][0].path, str(plan))
            value = cpu.NDBuffer.from_numpy_array(await offloaded(array.get))
        fused = self._host_writer(batch[0][0], batch[0][1])
        if fused is None:
            await self._fallback.write(batch, value, drop_axes)
            return
        # the engine's own threads: one hop for the batch (see _host_writer)
        await offloaded(fused.write_sync, batch, value, drop_axes, _write_workers())

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
            return await shards.read_shards(chain, batch, out, drop_axes, on_device)
        assert isinstance(chain, DecodeChain)
        # the read engine's loop (xarray_gds.coalesce): joined with other threads' reads,
        # routed by cost, part k + 1 read while part k decodes
        parts = split(batch, decode.part_chunks(len(batch), chain.nbytes, on_device))
        store = batch[0][0].store
        requests = [
            ReadRequest(store, chain, [bg.path for bg, *_ in part], on_device) for part in parts
        ]
        results: list[GetResult] = []

        def place_part(k: int, decoded: Decoded) -> None:
            results.extend(scatter(parts[k], *decoded, out, drop_axes, on_device))

        await offloaded(coalesce.fetch_decode_parts, requests, place_part)
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

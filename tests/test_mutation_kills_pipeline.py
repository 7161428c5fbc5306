"""Tests written for mutants of ``xarray_gds/pipeline.py`` that survived the quick stage
of ``scripts/mutation-run.py``: each test names the mutations it stops. Device values
stand in as numpy arrays that say they are CuPy arrays (``_OnDevice`` of
tests/test_nczarr_standin.py: a ``__cuda_array_interface__`` and ``get()``); the codecs
they are written with have no batched encoder at ``levels="host"`` (zstd at level 5),
so they are copied to the host and encoded by zarr-python, no GPU library needed. A
device read runs on the recording stand-ins of tests/test_orderings.py. What is written
or read is compared with zarr-python's own reads."""

from __future__ import annotations

import json
import os
import types
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs as zc
from zarr.core.codec_pipeline import BatchedCodecPipeline
from zarr.core.codec_pipeline import _resolve_max_workers as zarrs_workers
from zarr.core.sync import sync
from zarr.storage import MemoryStore, WrapperStore

import tests.test_orderings as orderings
from tests.test_nczarr_standin import _OnDevice
from tests.test_orderings import Env
from xarray_gds import decode, pipeline
from xarray_gds.codecs import DecodeChain, Unsupported, plan_chain
from xarray_gds.codecs.encode import EncodeChain
from xarray_gds.errors import HostRouteWarning
from xarray_gds.pipeline import GdsCodecPipeline, attach, writing_to

#: zarr's setting that gives every array the engine's pipeline
BY_HAND = {"codec_pipeline.path": "xarray_gds.pipeline.GdsCodecPipeline"}

#: the recording stand-ins of tests/test_orderings.py (CuPy, kvikio, nvCOMP), a fixture
env = orderings.env


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every HostRouteWarning given once a process is given again."""
    monkeypatch.setattr(pipeline, "_warned", set())


def _compressor(zarr_format: int) -> Any:
    """zstd at level 5: no batched encoder at ``levels="host"``."""
    return zc.ZstdCodec(level=5) if zarr_format == 3 else numcodecs.Zstd(level=5)


def _on_device(values: np.ndarray) -> np.ndarray:
    return values.view(_OnDevice)


# -- attach and read_as_netcdf ----------------------------------------------------------


def _nczarr_bz2(path: Path) -> tuple[Path, np.ndarray]:
    """A Zarr v2 float32 array shuffled by its element size and compressed with bz2 (no
    batched decoder: zarr-python decodes it), its metadata then saying
    ``elementsize: 0`` as NCZarr writes it; and the values it holds."""
    values = np.arange(60, dtype="f4").reshape(6, 10) * 1.5 - 7
    array = zarr.create_array(
        path,
        shape=values.shape,
        chunks=(3, 5),
        dtype="f4",
        zarr_format=2,
        filters=[numcodecs.Shuffle(elementsize=4)],
        compressors=numcodecs.BZ2(),
    )
    array[...] = values
    meta = path / ".zarray"
    doc = json.loads(meta.read_text())
    assert doc["filters"] == [{"id": "shuffle", "elementsize": 4}]
    doc["filters"][0]["elementsize"] = 0
    meta.write_text(json.dumps(doc))
    return path, values


def test_attach_reads_nczarrs_shuffle_as_netcdf_where_zarr_decodes(tmp_path: Path) -> None:
    """attach() without the NCZarr shuffle fix of the pipeline it keeps (the call to
    _zarr_pipeline dropped): an array with no batched decoder, read through the kept
    pipeline, would come back unshuffled."""
    path, values = _nczarr_bz2(tmp_path / "n.zarr")
    array = zarr.open_array(path, mode="r")
    assert isinstance(plan_chain(array.metadata), Unsupported)
    plain = array[...]
    assert not np.array_equal(plain, values)  # numcodecs takes elementsize 0 as no shuffle
    assert attach(array) is array
    np.testing.assert_array_equal(array[...], values)


# -- the write scope --------------------------------------------------------------------


def _plain_array(store: Any, name: str = "x") -> zarr.Array:
    return zarr.create_array(store, name=name, shape=(4,), chunks=(2,), dtype="f4")


def test_nested_write_scopes_keep_the_previous_pipeline_and_restore_the_setting() -> None:
    """_WriteScope.enter's ``active == 1`` made ``>= 1`` (a nested scope takes the
    engine's pipeline as the previous one and sets the path again) and exit's
    ``active == 0`` made ``>= 0`` (the inner scope's end restores the path while the
    outer one still writes, and the outer one's end fails)."""
    before = zarr.config.get("codec_pipeline.path")
    outer, inner = MemoryStore(), MemoryStore()
    with writing_to(outer, "gpu"):
        with writing_to(inner):
            others = _plain_array(MemoryStore())
            in_inner = _plain_array(inner)
        in_outer = _plain_array(outer)
        others_after = _plain_array(MemoryStore())
        assert zarr.config.get("codec_pipeline.path") == BY_HAND["codec_pipeline.path"]
    assert zarr.config.get("codec_pipeline.path") == before
    assert type(others.async_array.codec_pipeline) is BatchedCodecPipeline
    assert type(others_after.async_array.codec_pipeline) is BatchedCodecPipeline
    for array, levels in ((in_inner, "host"), (in_outer, "gpu")):
        pipe = array.async_array.codec_pipeline
        assert isinstance(pipe, GdsCodecPipeline) and pipe._levels == levels
        assert isinstance(pipe.chain, DecodeChain)
    assert type(_plain_array(outer, "y").async_array.codec_pipeline) is BatchedCodecPipeline


def test_a_scope_being_entered_gives_others_their_own_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An array built by ``codec_pipeline.path`` set by hand, on another thread while the
    first write scope is being entered (while it looks up the previous class), gets the
    engine's pipeline: the scope counts itself only once that lookup is done."""
    scope = pipeline._WriteScope()
    asked: list[Any] = []

    def previous_class_meanwhile() -> type:
        asked.append(scope.previous_class())  # what another thread sees right now
        return GdsCodecPipeline

    monkeypatch.setattr(pipeline, "get_pipeline_class", previous_class_meanwhile)
    store = MemoryStore()
    scope.enter(store, "host")
    try:
        assert asked == [None]
        assert scope.previous_class() is None and scope.levels_of(store) == "host"
    finally:
        scope.exit(store)
    assert scope.levels_of(store) is None


def test_a_scope_that_fails_to_enter_leaves_nothing_counted() -> None:
    """A write scope whose entry fails (``codec_pipeline.path`` naming no class) raises,
    counts nothing and holds no store: the next write scope gives its store the engine's
    pipeline and puts zarr's setting back at its end (it stayed counted, and every later
    write went through zarr's own pipeline)."""
    failed = MemoryStore()
    with (
        pytest.raises(Exception, match=r"no\.such\.Pipeline"),
        zarr.config.set({"codec_pipeline.path": "no.such.Pipeline"}),
        writing_to(failed),
    ):
        pass
    assert pipeline._scope.active == 0
    assert pipeline._scope.levels_of(failed) is None
    before = zarr.config.get("codec_pipeline.path")
    store = MemoryStore()
    with writing_to(store):
        array = zarr.create_array(store, name="a", shape=(4,), chunks=(2,), dtype="f4")
        assert isinstance(array.async_array.codec_pipeline, GdsCodecPipeline)
    assert zarr.config.get("codec_pipeline.path") == before
    assert pipeline._scope.active == 0


def _encode_plan(store: Any, name: str) -> Any:
    array = zarr.create_array(
        store, name=name, shape=(4,), chunks=(2,), dtype="f4", compressors=_compressor(3)
    )
    pipe = array.async_array.codec_pipeline
    assert isinstance(pipe, GdsCodecPipeline) and isinstance(pipe.chain, DecodeChain)
    return pipe.encode_plan


def test_path_set_by_hand_takes_the_levels_setting_not_an_ended_scopes() -> None:
    """from_array_metadata_and_store without ``levels = config.get("levels")`` (or with
    the string "levels" in its place) or refusing every array outside a write scope
    (``_scope.previous_class()`` made ``_scope``), and _WriteScope.exit without
    ``self.levels.pop(...)``: arrays built by ``codec_pipeline.path`` set by hand get
    the batched plan and take the ``xarray_gds.levels`` setting, also in a store a
    write scope wrote before."""
    store = MemoryStore()
    with writing_to(store, "host"):
        assert isinstance(_encode_plan(store, "a"), str)
    assert pipeline._scope.levels_of(store) is None
    with zarr.config.set({**BY_HAND, "xarray_gds.levels": "gpu"}):
        assert isinstance(_encode_plan(store, "b"), EncodeChain)
        assert isinstance(_encode_plan(MemoryStore(), "c"), EncodeChain)
    with zarr.config.set(BY_HAND):
        plan = _encode_plan(MemoryStore(), "d")
    assert plan == (
        "level=5: nvCOMP's encoders have no compression levels "
        "(pass levels='gpu' to encode with nvCOMP's own level)"
    )


# -- array names in the host-route warnings ---------------------------------------------


def _engine(how: str, store: Any) -> AbstractContextManager[Any]:
    if how == "writing_to":
        return writing_to(store)
    if how == "by hand":
        return zarr.config.set(BY_HAND)
    return nullcontext()


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("how", ["writing_to", "by hand", "attach"])
def test_device_writes_warn_naming_each_array(zarr_format: int, how: str) -> None:
    """_key_parts mutated (no return, no len(), the chunk key of another chunk, ``if not
    ndim``, 0 or 2 segments for a 0-d array), _array_name's ``len(parts) -
    chunk_key_parts`` made ``%``, the chunk key parts or decode plan given as the
    metadata (attach, from_array_metadata_and_store), and from_array_metadata_and_store
    refusing every array when no write scope runs: each HostRouteWarning of a device
    write names its array, 0-d and 2-D, in a group, as zarr's keys locate it."""
    store = MemoryStore()
    v = np.arange(24, dtype="f4").reshape(4, 6)
    with warnings.catch_warnings(record=True) as caught, _engine(how, store):
        warnings.simplefilter("always")
        arrays = {}
        for name, shape, chunks in (("g/s", (), "auto"), ("g/v", (4, 6), (2, 3))):
            array = zarr.create_array(
                store,
                name=name,
                shape=shape,
                chunks=chunks,
                dtype="f4",
                zarr_format=zarr_format,
                compressors=_compressor(zarr_format),
            )
            arrays[name] = attach(array) if how == "attach" else array
            assert isinstance(array.async_array.codec_pipeline.chain, DecodeChain)
        arrays["g/s"][...] = _on_device(np.array(2.5, dtype="f4"))
        arrays["g/v"][...] = _on_device(v)
    assert all(issubclass(w.category, HostRouteWarning) for w in caught), caught
    why = (
        "level=5: nvCOMP's encoders have no compression levels "
        "(pass levels='gpu' to encode with nvCOMP's own level)"
    )
    codecs = "bytes, zstd" if zarr_format == 3 else "zstd"
    assert [str(w.message) for w in caught] == [
        f"xarray-gds: array {name!r} uses codecs [{codecs}] ({why}); its chunks are "
        "copied to the host and encoded there by zarr-python"
        for name in ("g/s", "g/v")
    ]
    assert zarr.open_array(store, path="g/s")[...] == np.float32(2.5)
    np.testing.assert_array_equal(zarr.open_array(store, path="g/v")[...], v)


def test_a_pipeline_built_with_defaults_takes_the_last_key_segment_as_the_chunk() -> None:
    """GdsCodecPipeline's ``chunk_key_parts`` default 1 made 0 or 2: a pipeline built
    without it (over zarr's pipeline, no metadata) names a Zarr v2 array whose chunk
    keys are one segment ("g/v/0.0") 'g/v' in its warning."""
    store = MemoryStore()
    array = zarr.create_array(
        store, name="g/v", shape=(4, 6), chunks=(2, 3), dtype="f4", zarr_format=2
    )
    inner = array.async_array
    object.__setattr__(inner, "codec_pipeline", GdsCodecPipeline(inner.codec_pipeline))
    with pytest.warns(HostRouteWarning) as caught:
        array[...] = _on_device(np.ones((4, 6), dtype="f4"))
    assert [str(w.message) for w in caught] == [
        "xarray-gds: array 'g/v' uses codecs [] (no array metadata (an inner pipeline)); "
        "its chunks are copied to the host and encoded there by zarr-python"
    ]
    np.testing.assert_array_equal(zarr.open_array(store, path="g/v")[...], np.ones((4, 6)))


# -- the pipeline's read and write --------------------------------------------------------


def test_validate_takes_keywords_only_as_zarrs_pipelines_do() -> None:
    """GdsCodecPipeline.validate's ``*`` made ``/``: its arguments positionally are
    refused as zarr's BatchedCodecPipeline refuses them."""
    array = _plain_array(MemoryStore())
    meta = array.metadata
    ours = attach(array).async_array.codec_pipeline
    theirs = BatchedCodecPipeline.from_codecs(meta.codecs)
    for pipe in (ours, theirs):
        with pytest.raises(TypeError, match=r"takes 1 positional argument but 4 were given"):
            pipe.validate(meta.shape, meta.data_type, meta.chunk_grid)  # type: ignore[misc]
        pipe.validate(shape=meta.shape, dtype=meta.data_type, chunk_grid=meta.chunk_grid)


def _one_pass(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """GdsCodecPipeline.``method`` given its batch as a generator (a one-pass Iterable,
    as zarr's CodecPipeline signature allows)."""
    real = getattr(GdsCodecPipeline, method)

    async def once(self: GdsCodecPipeline, batch_info: Any, *args: Any, **kwargs: Any) -> Any:
        return await real(self, (item for item in batch_info), *args, **kwargs)

    monkeypatch.setattr(GdsCodecPipeline, method, once)


def _zstd_array(path: Path) -> tuple[zarr.Array, np.ndarray]:
    values = np.arange(48, dtype="f4").reshape(6, 8) / 4
    array = zarr.create_array(path, shape=(6, 8), chunks=(3, 4), dtype="f4")
    array[...] = values
    return array, values


def test_a_read_takes_its_batch_as_a_one_pass_iterable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GdsCodecPipeline.read's ``list(batch_info)`` made ``batch_info``: a batch given
    as a generator is read whole, as zarr reads it."""
    _, values = _zstd_array(tmp_path / "a.zarr")
    _one_pass(monkeypatch, "read")
    array = attach(zarr.open_array(tmp_path / "a.zarr", mode="r"))
    assert isinstance(array.async_array.codec_pipeline.chain, DecodeChain)
    np.testing.assert_array_equal(array[...], values)
    np.testing.assert_array_equal(array[1:5, 2:7], values[1:5, 2:7])


def test_a_write_takes_its_batch_as_a_one_pass_iterable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GdsCodecPipeline.write's ``list(batch_info)`` made ``batch_info``: a batch given
    as a generator is written whole, as zarr writes it."""
    array, values = _zstd_array(tmp_path / "a.zarr")
    _one_pass(monkeypatch, "write")
    attach(array)[1:5, 2:7] = -1.0
    values[1:5, 2:7] = -1.0
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "a.zarr", mode="r")[...], values)


def test_a_read_gives_its_results_as_a_tuple(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GdsCodecPipeline.read's ``tuple(results)`` made ``results``: the batched read
    returns a tuple, as zarr's pipelines do (CodecPipeline.read's return type)."""
    _, values = _zstd_array(tmp_path / "a.zarr")
    real = GdsCodecPipeline.read
    returned: list[Any] = []

    async def recording(self: GdsCodecPipeline, *args: Any, **kwargs: Any) -> Any:
        returned.append(await real(self, *args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(GdsCodecPipeline, "read", recording)
    array = attach(zarr.open_array(tmp_path / "a.zarr", mode="r"))
    np.testing.assert_array_equal(array[...], values)
    assert [type(r) for r in returned] == [tuple]
    assert len(returned[0]) == 4


class _Counting(WrapperStore[Any]):
    """A MemoryStore that counts the chunks ``set`` stores (its async ``set`` only:
    zarr's fused pipeline does not write through it)."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.stored: list[str] = []

    async def set(self, key: str, value: Any) -> None:
        if "/c/" in key:
            self.stored.append(key)
        await self._store.set(key, value)


def test_a_batched_host_write_stores_each_chunk_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """GdsCodecPipeline.write without the ``return`` after the batched write: host
    values written by the batched encoder (XARRAY_GDS_BATCHED_HOST_WRITES=1) are not
    written a second time by zarr's pipeline."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    store = _Counting(MemoryStore())
    values = np.arange(24, dtype="f4").reshape(4, 6)
    with writing_to(store):
        array = zarr.create_array(
            store, name="a", shape=(4, 6), chunks=(2, 3), dtype="f4", compressors=zc.ZstdCodec()
        )
        assert isinstance(array.async_array.codec_pipeline.encode_plan, EncodeChain)
        array[...] = values
    assert sorted(store.stored) == ["a/c/0/0", "a/c/0/1", "a/c/1/0", "a/c/1/1"]
    np.testing.assert_array_equal(zarr.open_array(store, path="a")[...], values)


@pytest.mark.parametrize("setting", [None, 0, -3, 1, 2, 5, "3"])
@pytest.mark.parametrize("cpus", [None, 1, 6])
def test_write_threads_are_zarrs_own_count(
    monkeypatch: pytest.MonkeyPatch, setting: Any, cpus: int | None
) -> None:
    """_write_workers' ``max(1, int(setting))`` made ``max(0, ...)``, ``max(2, ...)``
    or ``max(1, setting)``, and ``os.cpu_count() or 1`` made ``or 0`` / ``or 2``: the
    threads of a fused write are zarr's codec_pipeline.max_workers as zarr's own fused
    pipeline counts them (at least 1; the CPU count, or 1 where it is unknown, when
    unset; a number given as text taken as that number)."""
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    with zarr.config.set({"codec_pipeline.max_workers": setting}):
        want = zarrs_workers()
        assert pipeline._write_workers() == want
    assert want == (max(1, int(setting)) if setting is not None else cpus or 1)


# -- which path a read takes ----------------------------------------------------------


def _delta_zlib(path: Path) -> tuple[zarr.Array, np.ndarray]:
    """A Zarr v2 float32 array with a Delta filter: batched, on the host only."""
    values = np.arange(48, dtype="f4").reshape(6, 8) / 8 - 2
    array = zarr.create_array(
        path,
        shape=(6, 8),
        chunks=(3, 4),
        dtype="f4",
        zarr_format=2,
        filters=[numcodecs.Delta(dtype="f4")],
        compressors=numcodecs.Zlib(),
    )
    array[...] = values
    return array, values


def _batched_decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of chunks of each batched decode from now on."""
    calls: list[int] = []
    real = decode.decode_fetched

    def spy(chain: Any, fetched: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(keys))
        return real(chain, fetched, keys, *args, **kwargs)

    monkeypatch.setattr(decode, "decode_fetched", spy)
    return calls


def test_a_host_read_of_a_host_only_plan_is_batched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GdsCodecPipeline.read's ``on_device and not chain.device_ready`` made ``or``: a
    host read of an array whose plan decodes on the host only (a float32 Delta) takes
    the batched read, not zarr-python's, and gets zarr-python's values."""
    _, values = _delta_zlib(tmp_path / "d.zarr")
    array = attach(zarr.open_array(tmp_path / "d.zarr", mode="r"))
    chain = array.async_array.codec_pipeline.chain
    assert isinstance(chain, DecodeChain) and not chain.device_ready
    calls = _batched_decodes(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = array[...]
    assert calls == [4]
    np.testing.assert_array_equal(got, zarr.open_array(tmp_path / "d.zarr", mode="r")[...])
    np.testing.assert_array_equal(got, values)


def test_a_device_read_of_a_device_ready_plan_is_batched_on_the_device(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GdsCodecPipeline.read's ``not chain.device_ready`` made ``chain.device_ready``:
    a device read (test_orderings' stand-ins) of a zstd array, whose plan the GPU
    decodes, is decoded in one nvCOMP call with no HostRouteWarning, not by zarr-python
    on the host, and places zarr-python's values."""
    _, values = _zstd_array(tmp_path / "a.zarr")
    array = attach(zarr.open_array(tmp_path / "a.zarr", mode="r"))
    pipe = array.async_array.codec_pipeline
    assert isinstance(pipe.chain, DecodeChain) and pipe.chain.device_ready
    real = GdsCodecPipeline.read
    batches: list[tuple[list[Any], Any, Any]] = []

    async def recording(
        self: GdsCodecPipeline, batch_info: Any, out: Any, drop_axes: Any = ()
    ) -> Any:
        batches.append((list(batch_info), out, drop_axes))
        return await real(self, batches[-1][0], out, drop_axes)

    monkeypatch.setattr(GdsCodecPipeline, "read", recording)
    host = array[1:5, 2:7]
    np.testing.assert_array_equal(host, values[1:5, 2:7])
    ((batch, out, drop),) = batches
    device = env.cupy.full(out.as_ndarray_like().shape, -9.0, dtype="f4")
    on_device = types.SimpleNamespace(as_ndarray_like=lambda: device)
    with warnings.catch_warnings(), zarr.config.set({"xarray_gds.route": "gpu"}):
        warnings.simplefilter("error")
        results = sync(real(pipe, batch, on_device, drop))
    assert type(results) is tuple and len(results) == 4
    assert len(env.log.find("decode")) == 1
    np.testing.assert_array_equal(np.asarray(device), host)

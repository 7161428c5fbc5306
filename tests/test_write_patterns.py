"""Every way users write: append loops, ``compute=False`` templates filled by
``region=`` writes (from several processes too), dask-backed datasets, sharded v3
stores, v2 and v3, Blosc. Each pattern is run through ``xarray_gds.to_zarr`` and through
xarray's own ``to_zarr`` with the same calls and the same values, and the two stores
must read back identical with ``engine="zarr"`` and hold the same chunk files.

On the CPU the host values go through zarr-python (``zarr``) or through the batched
encoder that device values take (``batched``); with ``device="cuda"`` (``gpu`` marker)
the values are CuPy arrays, dask arrays of CuPy blocks, encoded on the GPU.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
import zarr.codecs as zc

import xarray_gds

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore:.*[Cc]onsolidated metadata.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:Times can't be serialized faithfully:UserWarning"),
]

T, Y, X = 12, 20, 30


@pytest.fixture(params=["zarr", "batched"])
def host_writer(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, device: str
) -> str:
    """Host values through zarr-python or the batched encoder (what device values take)."""
    if request.param == "batched":
        if device == "cuda":
            pytest.skip("device values always take the batched encoder")
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    return str(request.param)


def _dataset(seed: int = 0, t0: int = 0, nt: int = T) -> xr.Dataset:
    """Four variables (float32 with NaN, float64, int16, uint8) on (time, y, x)."""
    rng = np.random.default_rng(seed)
    shape = (nt, Y, X)
    f4 = (rng.normal(size=shape) * 10 + 280).astype("f4")
    f4[0, :2, :3] = np.nan
    return xr.Dataset(
        {
            "t2m": (("time", "y", "x"), f4, {"units": "K"}),
            "q": (("time", "y", "x"), rng.random(shape)),
            "h": (("time", "y", "x"), rng.integers(-500, 500, shape).astype("i2")),
            "m": (("time", "y", "x"), (rng.random(shape) > 0.5).astype("u1")),
        },
        coords={
            "time": pd.date_range("2000-01-01", periods=nt, freq="h") + pd.Timedelta(hours=t0),
            "y": np.arange(Y, dtype="f8"),
            "x": np.arange(X, dtype="f8"),
        },
        attrs={"title": "patterns"},
    )


def _on(ds: xr.Dataset, device: str) -> xr.Dataset:
    """``ds`` with its data variables on ``device`` (coordinates stay on the host)."""
    if device != "cuda":
        return ds
    cp = pytest.importorskip("cupy")
    out = ds.copy()
    for name in ds.data_vars:
        data = ds[name].data
        if hasattr(data, "map_blocks"):
            out[name] = ds[name].copy(data=data.map_blocks(cp.asarray))
        else:
            out[name] = ds[name].copy(data=cp.asarray(data))
    return out


CODECS: dict[str, dict[str, Any]] = {
    "v3-zstd": {"zarr_format": 3, "codec": None},
    "v3-blosc": {"zarr_format": 3, "codec": zc.BloscCodec(cname="lz4", shuffle="shuffle")},
    "v2-zstd": {"zarr_format": 2, "codec": numcodecs.Zstd()},
    "v2-blosc": {"zarr_format": 2, "codec": numcodecs.Blosc("lz4", shuffle=1)},
}


def _encoding(ds: xr.Dataset, case: str, chunks: tuple[int, ...] = (1, Y, X)) -> dict[str, Any]:
    codec = CODECS[case]["codec"]
    extra = {} if codec is None else {"compressors": codec}
    return {name: {"chunks": chunks, **extra} for name in ds.data_vars}


def _chunk_files(path: Path) -> list[str]:
    names = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
    return sorted(
        os.path.relpath(os.path.join(d, f), path)
        for d, _, files in os.walk(path)
        for f in files
        if f not in names
    )


def _same(ours: Path, theirs: Path) -> None:
    """Both stores read back identical by zarr-python and hold the same chunk files."""
    got = xr.open_dataset(ours, engine="zarr").load()
    want = xr.open_dataset(theirs, engine="zarr").load()
    xr.testing.assert_identical(got, want)
    assert _chunk_files(ours) == _chunk_files(theirs)


def _both(tmp_path: Path, device: str, calls: list[tuple[xr.Dataset, dict[str, Any]]]) -> None:
    """Make the same ``to_zarr`` calls with xarray-gds (values on ``device``) and with
    xarray (host values), then compare the stores."""
    ours, theirs = tmp_path / "ours.zarr", tmp_path / "theirs.zarr"
    for ds, kwargs in calls:
        xarray_gds.to_zarr(_on(ds, device), ours, **kwargs)
        ds.to_zarr(theirs, **kwargs)
    _same(ours, theirs)


@pytest.mark.parametrize("case", list(CODECS))
def test_append_loop_one_step_at_a_time(
    tmp_path: Path, device: str, host_writer: str, case: str
) -> None:
    """A model's output loop: the first step written, then ``append_dim="time"`` once a
    step (each step one chunk of every variable)."""
    full = _dataset()
    fmt = CODECS[case]["zarr_format"]
    calls = [(full.isel(time=[0]), {"encoding": _encoding(full, case), "zarr_format": fmt})]
    calls += [(full.isel(time=[k]), {"append_dim": "time"}) for k in range(1, 6)]
    _both(tmp_path, device, calls)


def test_append_steps_that_straddle_chunks(tmp_path: Path, device: str, host_writer: str) -> None:
    """Steps of 3 rows into chunks of 4 along time: appends fill partial chunks."""
    full = _dataset()
    enc = _encoding(full, "v3-zstd", (4, 10, X))
    calls = [(full.isel(time=slice(0, 3)), {"encoding": enc})]
    calls += [(full.isel(time=slice(k, k + 3)), {"append_dim": "time"}) for k in (3, 6, 9)]
    _both(tmp_path, device, calls)


def _template_then_regions(full: xr.Dataset, enc: dict[str, Any], fmt: int, step: int) -> list:
    template = full.chunk({"time": step})
    calls: list[tuple[xr.Dataset, dict[str, Any]]] = [
        (template, {"compute": False, "encoding": enc, "zarr_format": fmt})
    ]
    for k in range(0, T, step):
        block = full.isel(time=slice(k, k + step)).drop_vars(["y", "x"])
        calls.append((block, {"region": {"time": slice(k, k + step)}}))
    return calls


@pytest.mark.needs("dask")
@pytest.mark.parametrize("case", list(CODECS))
def test_template_then_region_writes(
    tmp_path: Path, device: str, host_writer: str, case: str
) -> None:
    """``compute=False`` writes the template (metadata and index coordinates); each
    ``region=`` write then fills one block of it."""
    full = _dataset(1)
    fmt = CODECS[case]["zarr_format"]
    calls = _template_then_regions(full, _encoding(full, case, (2, Y, X)), fmt, 2)
    ours, theirs = tmp_path / "ours.zarr", tmp_path / "theirs.zarr"
    for ds, kwargs in calls:
        result = xarray_gds.to_zarr(_on(ds, device), ours, **kwargs)
        if kwargs.get("compute") is False:
            assert hasattr(result, "compute")  # delayed: the template's values not written
        ds.to_zarr(theirs, **kwargs)
    _same(ours, theirs)


@pytest.mark.needs("dask")
def test_region_auto_and_partial_chunks(tmp_path: Path, device: str, host_writer: str) -> None:
    """``region="auto"`` from the index coordinates; regions that cover a chunk only in
    part merge with what the chunk holds."""
    full = _dataset(2)
    enc = _encoding(full, "v3-zstd", (4, 10, X))
    calls: list[tuple[xr.Dataset, dict[str, Any]]] = [
        (full.chunk({"time": 4}), {"compute": False, "encoding": enc})
    ]
    for k in range(0, T, 3):  # blocks of 3 rows into chunks of 4
        calls.append((full.isel(time=slice(k, k + 3)), {"region": "auto", "safe_chunks": False}))
    _both(tmp_path, device, calls)


@pytest.mark.needs("dask")
@pytest.mark.parametrize("case", ["v3-zstd", "v2-blosc"])
def test_dask_backed_dataset(tmp_path: Path, device: str, host_writer: str, case: str) -> None:
    """A dask-backed dataset (``chunks={}`` of a store, or ``.chunk``) written and
    computed: every block written by the task that holds it."""
    src = tmp_path / "src.zarr"
    full = _dataset(3)
    fmt = CODECS[case]["zarr_format"]
    enc = _encoding(full, case, (3, Y, X))
    full.to_zarr(src, encoding=enc, zarr_format=fmt)
    lazy = xr.open_dataset(src, engine="zarr", chunks={})
    assert all(v.chunks is not None for v in lazy.data_vars.values())
    for v in lazy.variables.values():
        v.encoding = {}
    _both(tmp_path, device, [(lazy, {"encoding": enc, "zarr_format": fmt})])


@pytest.mark.needs("dask")
def test_dask_compute_false_then_compute(tmp_path: Path, device: str, host_writer: str) -> None:
    full = _dataset(4).chunk({"time": 3, "y": 10})
    ours, theirs = tmp_path / "ours.zarr", tmp_path / "theirs.zarr"
    enc = _encoding(full, "v3-zstd", (3, 10, X))
    xarray_gds.to_zarr(_on(full, device), ours, compute=False, encoding=enc).compute()
    full.to_zarr(theirs, compute=False, encoding=enc).compute()
    _same(ours, theirs)


@pytest.mark.parametrize("codec", [None, zc.BloscCodec(cname="zstd", shuffle="bitshuffle")])
def test_sharded_v3(tmp_path: Path, device: str, host_writer: str, codec: Any) -> None:
    """Sharded v3 (inner chunks 1 x 5 x 10, shards 4 x 20 x 30): whole shards, appends
    that leave a shard partly filled, and a region write into the middle of a shard."""
    full = _dataset(5)
    extra = {} if codec is None else {"compressors": codec}
    enc = {n: {"chunks": (1, 5, 10), "shards": (4, Y, X), **extra} for n in full.data_vars}
    calls: list[tuple[xr.Dataset, dict[str, Any]]] = [
        (full.isel(time=slice(0, 6)), {"encoding": enc, "zarr_format": 3}),
        (full.isel(time=slice(6, 10)), {"append_dim": "time"}),
        (
            full.isel(time=slice(2, 3), y=slice(5, 15)).drop_vars(["y", "x"]) * 2,
            {"region": {"time": slice(2, 3), "y": slice(5, 15), "x": slice(None)}},
        ),
    ]
    _both(tmp_path, device, calls)


def test_xarray_to_zarr_with_the_registered_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """xarray's own ``ds.to_zarr`` with zarr's ``codec_pipeline.path`` set to the
    project's pipeline (append loop, then a region write): the batched encoder writes
    the chunks (host values with ``XARRAY_GDS_BATCHED_HOST_WRITES=1``), and the store
    reads back as the one zarr's own pipeline writes."""
    from xarray_gds.pipeline import GdsCodecPipeline

    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    full = _dataset(6)
    enc = _encoding(full, "v2-blosc", (2, 10, X))

    def write(path: Path) -> None:
        full.isel(time=slice(0, 4)).to_zarr(path, encoding=enc, zarr_format=2)
        for k in (4, 8):
            full.isel(time=slice(k, k + 4)).to_zarr(path, append_dim="time")
        part = full.isel(time=slice(2, 4)).drop_vars(["y", "x"]) + 1
        part.to_zarr(path, region={"time": slice(2, 4)})

    write(tmp_path / "theirs.zarr")
    with zarr.config.set({"codec_pipeline.path": "xarray_gds.pipeline.GdsCodecPipeline"}):
        write(tmp_path / "ours.zarr")
        arr = zarr.open_array(tmp_path / "ours.zarr" / "t2m")
        assert isinstance(arr.async_array.codec_pipeline, GdsCodecPipeline)
        assert not isinstance(arr.async_array.codec_pipeline.encode_plan, str)
    _same(tmp_path / "ours.zarr", tmp_path / "theirs.zarr")


# -- several processes, each its own region ------------------------------------------


def _region_worker(path: str, blocks: list[int], batched: bool) -> None:
    """In a spawned process: write the blocks ``blocks`` (2 time steps each) of the
    template at ``path``."""
    if batched:
        os.environ["XARRAY_GDS_BATCHED_HOST_WRITES"] = "1"
    full = _dataset(7)
    for k in blocks:
        part = full.isel(time=slice(2 * k, 2 * k + 2)).drop_vars(["y", "x"])
        xarray_gds.to_zarr(part, path, region={"time": slice(2 * k, 2 * k + 2)})


@pytest.mark.needs("dask")
@pytest.mark.parametrize("batched", [False, True])
def test_region_writes_from_several_processes(tmp_path: Path, batched: bool) -> None:
    """A template, then 3 spawned processes at once, each writing its own regions (one
    block each): the store reads back as xarray's own writes of the same regions."""
    full = _dataset(7)
    enc = _encoding(full, "v2-blosc", (2, Y, X))
    ours, theirs = tmp_path / "ours.zarr", tmp_path / "theirs.zarr"
    for path, write in ((ours, xarray_gds.to_zarr), (theirs, xr.Dataset.to_zarr)):
        write(full.chunk({"time": 2}), path, compute=False, encoding=enc, zarr_format=2)
    spawn = multiprocessing.get_context("spawn")
    procs = [
        spawn.Process(target=_region_worker, args=(str(ours), [w, w + 3], batched))
        for w in range(3)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    for k in range(T // 2):
        part = full.isel(time=slice(2 * k, 2 * k + 2)).drop_vars(["y", "x"])
        part.to_zarr(theirs, region={"time": slice(2 * k, 2 * k + 2)})
    _same(ours, theirs)

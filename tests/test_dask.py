"""dask: chunks=, open_mfdataset and a distributed LocalCluster, against engine="zarr"."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from xarray_gds import GdsStore
from xarray_gds.array import GdsBackendArray

from .conftest import sample_dataset

pytest.importorskip("dask.array")  # the dask extra

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    # xarray's announced change of open_mfdataset defaults, the same for both engines
    pytest.mark.filterwarnings("ignore:In a future version of xarray:FutureWarning"),
]


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three stores, each holding a run of time steps of the sample dataset."""
    root = tmp_path_factory.mktemp("parts")
    base = sample_dataset()
    paths = []
    for i in range(3):
        path = root / f"part{i}.zarr"
        base.isel(time=slice(3 * i, 3 * i + 3)).to_zarr(path, zarr_format=3)
        paths.append(path)
    return paths


#: xarray's public option that keeps dask blocks of device variables on the device
_ON_DEVICE: dict[str, Any] = {"chunked_array_type": "gds-dask"}


def _blocks_on(ds: xr.Dataset, device: str) -> None:
    """Every dask block of a numeric non-index variable is on ``device``."""
    for name, var in ds.variables.items():
        if var.chunks is None or name in ds.dims or var.dtype.kind not in "biufc":
            continue
        block = var.data.blocks[(0,) * var.ndim].compute()
        assert hasattr(block, "__cuda_array_interface__") == (device == "cuda"), name


@pytest.mark.parametrize("chunks", [{}, "auto", {"time": 3, "lat": -1}], ids=str)
def test_chunks_match_zarr(v3_store: Path, device: str, chunks: Any) -> None:
    # dask cannot size "auto" chunks of object (string) arrays, with either engine
    kw: dict[str, Any] = {"chunks": chunks, "drop_variables": ["station"]}
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device=device, **kw, **_ON_DEVICE)
    ref = xr.open_dataset(v3_store, engine="zarr", **kw)
    assert gds.t2m.chunks == ref.t2m.chunks
    if chunks == {}:
        assert gds.t2m.chunks == ((4, 4, 2), (4, 4, 1), (5, 5, 2))  # the stored chunks
    _blocks_on(gds, device)
    xr.testing.assert_identical(gds.load().as_numpy(), ref.load())


def test_lazy_arrays_and_stores_pickle(v3_store: Path) -> None:
    store = GdsStore(v3_store, read_only=True)
    assert pickle.loads(pickle.dumps(store)) == store
    ds = xr.open_dataset(store, engine="gds-zarr", device="cpu")
    wrapped = ds.t2m.variable._data
    while not isinstance(wrapped, GdsBackendArray):
        wrapped = wrapped.array
    clone = pickle.loads(pickle.dumps(wrapped))
    assert clone.shape == wrapped.shape and clone.dtype == wrapped.dtype
    again = pickle.loads(pickle.dumps(ds))
    xr.testing.assert_identical(again.load(), xr.open_dataset(v3_store, engine="zarr").load())


@pytest.mark.parametrize("parallel", [False, True])
def test_open_mfdataset_by_coords(parts: list[Path], device: str, parallel: bool) -> None:
    # xarray's default chunk manager and combine options: values as engine="zarr"
    gds = xr.open_mfdataset(parts, engine="gds-zarr", device=device, parallel=parallel)
    ref = xr.open_mfdataset(parts, engine="zarr", parallel=parallel)
    xr.testing.assert_identical(gds.load().as_numpy(), ref.load())


#: combine options that compare nothing (xarray's announced future defaults); xarray's
#: current ones load coordinates to compare them and then mix CuPy and dask arrays
_MINIMAL: dict[str, Any] = {"data_vars": "minimal", "coords": "minimal", "compat": "override"}


@pytest.mark.parametrize("parallel", [False, True])
def test_open_mfdataset_blocks_on_device(parts: list[Path], device: str, parallel: bool) -> None:
    kw: dict[str, Any] = {"parallel": parallel, **_MINIMAL}
    gds = xr.open_mfdataset(parts, engine="gds-zarr", device=device, **kw, **_ON_DEVICE)
    ref = xr.open_mfdataset(parts, engine="zarr", **kw)
    _blocks_on(gds, device)
    xr.testing.assert_identical(gds.load().as_numpy(), ref.load())


def test_open_mfdataset_nested_preprocess(parts: list[Path], device: str) -> None:
    def preprocess(ds: xr.Dataset) -> xr.Dataset:
        return ds[["t2m", "u10"]].isel(lat=slice(0, 5))

    kwargs: dict[str, Any] = dict(combine="nested", concat_dim="time", preprocess=preprocess)
    gds = xr.open_mfdataset(parts, engine="gds-zarr", device=device, **kwargs)
    ref = xr.open_mfdataset(parts, engine="zarr", **kwargs)
    xr.testing.assert_identical(gds.load().as_numpy(), ref.load())


def test_open_mfdataset_new_concat_dim(parts: list[Path]) -> None:
    kwargs: dict[str, Any] = dict(combine="nested", concat_dim="member", data_vars="all")
    gds = xr.open_mfdataset(parts[:2], engine="gds-zarr", device="cpu", **kwargs)
    ref = xr.open_mfdataset(parts[:2], engine="zarr", **kwargs)
    assert gds.sizes["member"] == 2
    xr.testing.assert_identical(gds.load(), ref.load())


def test_open_mfdataset_missing_store_is_named(parts: list[Path], tmp_path: Path) -> None:
    missing = tmp_path / "nope.zarr"
    with pytest.raises(FileNotFoundError, match=r"nope\.zarr"):
        xr.open_mfdataset([parts[0], missing], engine="gds-zarr", device="cpu")


def test_open_mfdataset_mismatch_gives_xarrays_error(parts: list[Path], tmp_path: Path) -> None:
    odd = tmp_path / "odd.zarr"
    sample_dataset().isel(time=slice(0, 3)).rename(lat="latitude").to_zarr(odd, zarr_format=3)
    paths = [parts[1], odd]
    with pytest.raises(Exception) as ref_err:
        xr.open_mfdataset(paths, engine="zarr", combine="by_coords")
    with pytest.raises(type(ref_err.value)):
        xr.open_mfdataset(paths, engine="gds-zarr", device="cpu", combine="by_coords")


@pytest.fixture(scope="module")
def cluster_client() -> Iterator[Any]:
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


def test_local_cluster_end_to_end(parts: list[Path], cluster_client: Any) -> None:
    """Workers in other processes open, read and reduce the stores themselves."""
    gds = xr.open_mfdataset(parts, engine="gds-zarr", device="cpu", parallel=True)
    ref = xr.open_mfdataset(parts, engine="zarr", parallel=True)
    got = gds.t2m.mean("time").compute()
    want = ref.t2m.mean("time").compute()
    xr.testing.assert_identical(got, want)
    assert isinstance(got.data, np.ndarray)
    who = cluster_client.run(lambda: __import__("os").getpid())
    assert len(set(who.values())) == 2


def _chunk_files(root: Path) -> set[str]:
    """The files below ``root`` that are not metadata documents."""
    meta = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.name in meta
    }


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_write_of_users_dask_runs_on_the_cluster(
    tmp_path: Path, cluster_client: Any, zarr_format: int
) -> None:
    """xarray_gds.to_zarr of a dataset whose variables are all the user's dask arrays,
    with a cluster of worker processes as dask's scheduler: the chunk writes run on the
    workers (the store the tasks hold is pickled to them), and the store holds the
    chunk files and values that ``Dataset.to_zarr`` writes in the same setting."""
    import distributed

    import xarray_gds

    values = np.arange(96.0).reshape(12, 8)
    ds = xr.Dataset(
        {
            "v": (("x", "y"), values),
            "w": (("x",), np.arange(12, dtype="i4") - 5),
        },
        attrs={"title": "cluster write"},
    ).chunk(x=4, y=4)
    ds.to_zarr(tmp_path / "xarray.zarr", zarr_format=zarr_format)
    with distributed.get_task_stream(cluster_client) as stream:
        xarray_gds.to_zarr(ds, tmp_path / "ours.zarr", zarr_format=zarr_format)
    workers = {task["worker"] for task in stream.data}
    assert workers and workers <= set(cluster_client.scheduler_info()["workers"])
    assert any(str(task["key"]).startswith("('store-map") for task in stream.data)
    want = xr.open_dataset(tmp_path / "xarray.zarr", engine="zarr").load()
    got = xr.open_dataset(tmp_path / "ours.zarr", engine="zarr").load()
    xr.testing.assert_identical(got, want)
    np.testing.assert_array_equal(got.v.values, values)
    files = _chunk_files(tmp_path / "ours.zarr")
    assert files and files == _chunk_files(tmp_path / "xarray.zarr")


def test_chunk_manager_gives_device_meta(v3_store: Path, device: str) -> None:
    import xarray_gds
    import xarray_gds.chunks

    plain = xr.open_dataset(v3_store, engine="gds-zarr", device=device)
    assert xarray_gds.chunks.device_of(plain.t2m.variable._data) == device
    assert xarray_gds.chunks.device_of(plain.valid_time.variable._data) is None
    manager = xarray_gds.GdsDaskManager()
    kw: dict[str, Any] = {"chunks": {}, "chunked_array_type": manager}
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device=device, **kw)
    meta = gds.t2m.data._meta
    assert hasattr(meta, "__cuda_array_interface__") == (device == "cuda")
    assert isinstance(gds.valid_time.data._meta, np.ndarray)  # times stay on the host
    _blocks_on(gds, device)
    reduced = gds.t2m.mean("time")
    assert hasattr(reduced.data._meta, "__cuda_array_interface__") == (device == "cuda")
    ref = xr.open_dataset(v3_store, engine="zarr", chunks={})
    xr.testing.assert_identical(gds.load().as_numpy(), ref.load())
    xr.testing.assert_allclose(reduced.compute().as_numpy(), ref.t2m.mean("time").compute())


def test_registered_chunk_manager_by_name_and_option(parts: list[Path], device: str) -> None:
    """``"gds-dask"`` is an ``xarray.chunkmanagers`` entry point: chosen by name or by
    xarray's ``chunk_manager`` option it gives blocks on the variable's device, while
    every dask array stays xarray's own dask manager's (two managers claiming one type
    would make xarray refuse every dask operation)."""
    from xarray.namedarray.daskmanager import DaskManager
    from xarray.namedarray.parallelcompat import get_chunked_array_type, list_chunkmanagers

    from xarray_gds.chunks import GdsDaskManager

    assert type(list_chunkmanagers()["gds-dask"]) is GdsDaskManager
    ref = xr.open_mfdataset(parts, engine="zarr", **_MINIMAL)
    with xr.set_options(chunk_manager="gds-dask"):
        gds = xr.open_mfdataset(parts, engine="gds-zarr", device=device, **_MINIMAL)
        rechunked = gds.chunk(time=1)  # an existing dask array is rechunked, not wrapped
    assert type(get_chunked_array_type(gds.t2m.data)) is DaskManager
    assert hasattr(gds.t2m.data._meta, "__cuda_array_interface__") == (device == "cuda")
    _blocks_on(gds, device)
    assert rechunked.t2m.data.chunks[0] == (1,) * gds.sizes["time"]
    xr.testing.assert_identical(rechunked.load().as_numpy(), ref.load())
    named = xr.open_dataset(
        parts[0], engine="gds-zarr", device=device, chunks={}, chunked_array_type="gds-dask"
    )
    _blocks_on(named, device)
    xr.testing.assert_allclose(
        named.t2m.mean("time").compute().as_numpy(),
        xr.open_dataset(parts[0], engine="zarr").t2m.mean("time"),
    )


@pytest.mark.gpu
def test_local_cuda_cluster_end_to_end(parts: list[Path]) -> None:
    """A dask-cuda worker (one per GPU) reads and decodes on its own GPU."""
    dask_cuda = pytest.importorskip("dask_cuda")
    distributed = pytest.importorskip("distributed")

    with (
        dask_cuda.LocalCUDACluster(n_workers=1, dashboard_address=None) as cluster,
        distributed.Client(cluster),
    ):
        gds = xr.open_mfdataset(
            parts,
            engine="gds-zarr",
            device="cuda",
            parallel=True,
            chunked_array_type="gds-dask",
            **_MINIMAL,
        )
        got = gds.t2m.mean("time").compute()
    assert hasattr(got.data, "__cuda_array_interface__")
    ref = xr.open_mfdataset(parts, engine="zarr", parallel=True, **_MINIMAL)
    ref = ref.t2m.mean("time").compute()
    xr.testing.assert_allclose(got.as_numpy(), ref)


def test_parallel_opens_leave_zarrs_configuration_alone(parts: list[Path]) -> None:
    """Opening stores from many threads at once must restore zarr's codec pipeline."""
    from concurrent.futures import ThreadPoolExecutor

    import zarr

    default = zarr.config.get("codec_pipeline.path")

    def open_one(path: Path) -> xr.Dataset:
        return xr.open_dataset(path, engine="gds-zarr", device="cpu")

    with ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            list(pool.map(open_one, parts * 4))
    assert zarr.config.get("codec_pipeline.path") == default
    pipeline = zarr.open_array(parts[0] / "t2m", mode="r")._async_array.codec_pipeline
    assert type(pipeline).__name__ != "GdsCodecPipeline"


def test_device_blocks_evaluate_each_slice(v3_store: Path) -> None:
    """DeviceBlocks hands dask arrays, not xarray's lazy wrappers, and pickles."""
    import dask.array as da
    from xarray.core import indexing

    from xarray_gds.chunks import DeviceBlocks

    var = xr.open_dataset(v3_store, engine="gds-zarr", device="cpu").t2m.variable
    blocks = DeviceBlocks(indexing.ImplicitToExplicitIndexingAdapter(var._data))
    part = blocks[1:3, :, 2:4]
    assert type(part) is np.ndarray
    want = xr.open_dataset(v3_store, engine="zarr").t2m.values
    np.testing.assert_array_equal(part, want[1:3, :, 2:4])
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):  # 0 and 1: not for xarray
        again = pickle.loads(pickle.dumps(blocks, protocol=protocol))
        assert again.shape == blocks.shape
    clone = pickle.loads(pickle.dumps(blocks))
    assert clone.shape == blocks.shape and clone.dtype == blocks.dtype
    lazy = da.from_array(clone, chunks=(4, 4, 5), asarray=False, meta=np.empty((0, 0, 0)))
    np.testing.assert_array_equal(lazy.compute(), want)


def test_unpickled_dataset_joins_block_reads_in_a_fresh_process(
    v3_store: Path, tmp_path: Path
) -> None:
    """A dataset opened in another process (as the workers of open_mfdataset(parallel=
    True) open theirs) and unpickled in a fresh one: dask's array optimization there is
    the joining pass, and the values are zarr's."""
    import subprocess
    import sys

    pytest.importorskip("dask")
    ds = xr.open_dataset(v3_store, engine="gds-zarr", device="cpu", chunks={})
    pickled = tmp_path / "ds.pickle"
    pickled.write_bytes(pickle.dumps(ds))
    reference = tmp_path / "ref.npy"
    np.save(reference, xr.open_dataset(v3_store, engine="zarr").t2m.values)
    script = (
        "import pickle, sys, dask, numpy as np\n"
        "ds = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "print(type(dask.config.get('array_optimize', None)).__name__)\n"
        "np.testing.assert_array_equal(ds.t2m.values, np.load(sys.argv[2]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(pickled), str(reference)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "_Optimizer"


def _as_device_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer takes the numpy values of data variables for device values (a CPU
    stand-in): it writes them through the one-block dask arrays it makes of them."""
    import xarray_gds.write

    real = xarray_gds.write.device_of
    monkeypatch.setattr(
        xarray_gds.write,
        "device_of",
        lambda data: "cuda" if isinstance(data, np.ndarray) and data.ndim == 3 else real(data),
    )


def test_device_writes_stay_in_this_process_under_a_cluster(
    monkeypatch: pytest.MonkeyPatch, cluster_client: Any
) -> None:
    """A distributed client is dask's default scheduler: the writer's own graphs still
    run here, so an in-memory store gets every chunk (a worker would fill its copy)."""
    import zarr

    import xarray_gds

    _as_device_values(monkeypatch)
    ds = sample_dataset()
    store = zarr.storage.MemoryStore()
    xarray_gds.to_zarr(ds, store, zarr_format=3, consolidated=False)
    back = xr.open_dataset(store, engine="zarr", consolidated=False).load()
    ref_store = zarr.storage.MemoryStore()
    ds.to_zarr(ref_store, zarr_format=3, consolidated=False)
    ref = xr.open_dataset(ref_store, engine="zarr", consolidated=False).load()
    xr.testing.assert_identical(back, ref)
    assert sorted(k for k in store._store_dict if "/c/" in k) == sorted(
        k for k in ref_store._store_dict if "/c/" in k
    )


def test_device_writes_into_an_icechunk_session_under_a_cluster(
    monkeypatch: pytest.MonkeyPatch, cluster_client: Any, tmp_path: Path
) -> None:
    icechunk = pytest.importorskip("icechunk")
    import xarray_gds

    _as_device_values(monkeypatch)
    ds = sample_dataset()
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "r")))
    session = repo.writable_session("main")
    xarray_gds.to_zarr(ds, session.store, mode="w", consolidated=False)
    session.commit("device values")
    got = xr.open_dataset(
        repo.readonly_session("main").store, engine="zarr", consolidated=False
    ).load()
    ref_store = __import__("zarr").storage.MemoryStore()
    ds.to_zarr(ref_store, zarr_format=3, consolidated=False)
    xr.testing.assert_identical(
        got, xr.open_dataset(ref_store, engine="zarr", consolidated=False).load()
    )

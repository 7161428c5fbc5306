"""Shared fixtures: stores per codec and Zarr format, the device parameter, GPU gating."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
import zarr.codecs as zc
import zarr.codecs.numcodecs

from xarray_gds.device import cuda_status

REQUIRE_GPU = os.environ.get("XARRAY_GDS_REQUIRE_GPU", "") not in ("", "0")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # a test of an optional feature skips, naming the package, on the base install
    # (scripts/test-min.sh): @pytest.mark.needs("dask"), on a test or a parameter
    for marker in item.iter_markers("needs"):
        for module in marker.args:
            pytest.importorskip(module)
    if item.get_closest_marker("gpu") is None:
        return
    ok, reason = cuda_status()
    if ok:
        return
    if REQUIRE_GPU:
        pytest.fail(f"XARRAY_GDS_REQUIRE_GPU=1 but no GPU is usable: {reason}")
    pytest.skip(f"needs a GPU: {reason}")


@pytest.fixture(autouse=True)
def _nvcomp_route(request: pytest.FixtureRequest) -> Iterator[None]:
    """GPU tests decode with nvCOMP: the small stores of the suite would otherwise take
    the host route (xarray_gds.route), and the nvCOMP paths would go untested. Tests of
    the route set their own; ``XARRAY_GDS_ROUTE`` set in the environment wins."""
    if request.node.get_closest_marker("gpu") is None or os.environ.get("XARRAY_GDS_ROUTE"):
        yield
        return
    with zarr.config.set({"xarray_gds.route": "gpu"}):
        yield


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Both placements: host (always) and GPU (``gpu`` marker)."""
    return str(request.param)


def to_numpy(ds: xr.Dataset) -> xr.Dataset:
    """A loaded copy with every variable in host memory."""
    return ds.load().as_numpy()


SOURCE_INDEXES = frozenset({"time", "lat", "lon"})

#: Where ``engine="gds-zarr"`` with ``device="cuda"`` puts a (decoded, non-index, N-d)
#: variable of each dtype. Written out here rather than taken from
#: ``xarray_gds.placement``, the function under test: numeric data (bool, integers,
#: floats, complex) on the device; datetimes, timedeltas (CuPy has neither) and strings
#: on the host. A dtype missing here fails :func:`expected_placement`: add it.
PLACEMENT_BY_DTYPE: dict[str, str] = {
    "bool": "cuda",
    "int8": "cuda",
    "int16": "cuda",
    "int32": "cuda",
    "int64": "cuda",
    "uint8": "cuda",
    "uint16": "cuda",
    "uint32": "cuda",
    "uint64": "cuda",
    "float16": "cuda",
    "float32": "cuda",
    "float64": "cuda",
    "complex64": "cuda",
    "complex128": "cuda",
    "object": "host",  # strings
}
#: Dtypes that come in many units or lengths, by kind.
PLACEMENT_BY_KIND: dict[str, str] = {
    "M": "host",  # datetime64[*]
    "m": "host",  # timedelta64[*]
    "U": "host",  # fixed-width unicode strings
    "S": "host",  # fixed-width bytes
    "T": "host",  # numpy's variable-width StringDType (zarr's string data type)
}


def expected_placement(name: str, var: xr.Variable) -> str:
    """``"cuda"`` or ``"host"``: where a variable read on ``device="cuda"`` belongs.

    Index coordinates (1-D, named after their dimension) and 0-d variables stay on the
    host; other variables go where :data:`PLACEMENT_BY_DTYPE` says for their dtype.
    """
    if var.dims == (name,) or var.ndim == 0:
        return "host"
    dtype = np.dtype(var.dtype)
    if dtype.kind in PLACEMENT_BY_KIND:
        return PLACEMENT_BY_KIND[dtype.kind]
    assert dtype.name in PLACEMENT_BY_DTYPE, f"add {dtype} to PLACEMENT_BY_DTYPE ({name!r})"
    return PLACEMENT_BY_DTYPE[dtype.name]


def assert_placed(
    ds: xr.Dataset, device: str, indexes: frozenset[str] | set[str] = SOURCE_INDEXES
) -> None:
    """Each variable where :func:`expected_placement` says (numpy on ``device="cpu"``),
    and ``xarray_gds.placement`` agreeing with that table whatever ``device`` is (so
    that the CPU suite checks the placement rule too). ``indexes``: the index
    coordinates of the store ``ds`` was read from (on the host whatever became of them)."""
    import xarray_gds

    for name, var in ds.variables.items():
        if name in indexes:
            continue  # an index coordinate of the store stays on the host, even once
            # indexing made it a scalar or a non-index coordinate
        data = var.data
        on_device = hasattr(data, "__cuda_array_interface__")
        if var.ndim == 0 and var.encoding.get("chunks"):
            # a point selected from a stored N-d variable: placed as that variable
            # (a selection from a device variable stays on the device)
            where = expected_placement(str(name), var.expand_dims("_point"))
        else:
            where = expected_placement(str(name), var)
            engine = xarray_gds.placement(str(name), var) or "host"
            assert engine == where, (name, var.dtype, var.dims, engine, where)
        assert on_device == (device == "cuda" and where == "cuda"), (name, type(data), device)
        if not on_device:
            assert isinstance(data, np.ndarray | pd.Index) or var.dims == (name,), (
                name,
                type(data),
            )


def sample_dataset(seed: int = 0) -> xr.Dataset:
    """A small weather-like dataset that exercises CF decoding and placement.

    Shapes are chosen so that chunks do not divide them (edge chunks) and one chunk of
    ``t2m`` is all NaN (not written: a missing chunk read back as the fill value).
    """
    rng = np.random.default_rng(seed)
    nt, ny, nx = 10, 9, 12
    time = pd.date_range("2000-01-01", periods=nt, freq="6h")
    lat = np.linspace(-40.0, 40.0, ny)
    lon = np.arange(nx) * 30.0
    t2m = (280 + 10 * rng.standard_normal((nt, ny, nx))).astype("f4")
    t2m[0, 0, 1] = np.nan
    t2m[:4, :4, :5] = np.nan  # one whole chunk of NaN
    wind = (5 * rng.standard_normal((nt, ny, nx))).round(2)
    wind[1, 2, 3] = np.nan
    n_obs = rng.integers(0, 50, size=(ny, nx)).astype("f8")
    n_obs[0, 0] = np.nan
    qc = rng.integers(0, 256, size=(nt, ny)).astype("u1").view("i1")
    qc[0, 0] = -1  # 255 once unsigned: the missing value
    ds = xr.Dataset(
        {
            "t2m": (("time", "lat", "lon"), t2m, {"units": "K", "long_name": "2 m temperature"}),
            "u10": (("time", "lat", "lon"), wind, {"units": "m s-1"}),
            "n_obs": (("lat", "lon"), n_obs),
            "qc": (("time", "lat"), qc, {"_Unsigned": "true", "missing_value": np.int8(-1)}),
            "wet": (("lat", "lon"), (rng.random((ny, nx)) > 0.3).astype("i1"), {"dtype": "bool"}),
            "level": (("lat",), rng.integers(-5, 5, size=ny).astype("i8")),
            "land": (("lat", "lon"), rng.random((ny, nx)) > 0.5),
            "spec": (("lon",), (rng.random(nx) + 1j * rng.random(nx)).astype("c16")),
            "h": (("lat", "lon"), rng.random((ny, nx)).astype("f2")),
            "u16": (("time", "lon"), rng.integers(0, 60000, size=(nt, nx)).astype("u2")),
            "valid_time": (("time",), time + pd.Timedelta("3h")),
            "lead": (("time",), pd.to_timedelta(np.arange(nt), unit="h")),
            "station": (("lat",), np.array([f"st{i}" for i in range(ny)], dtype=object)),
            "scalar": ((), np.float64(3.5), {"note": "0-d"}),
        },
        coords={
            "time": time,
            "lat": ("lat", lat, {"units": "degrees_north"}),
            "lon": ("lon", lon, {"units": "degrees_east"}),
            "area": (("lat", "lon"), np.cos(np.deg2rad(lat))[:, None] * np.ones(nx)),
        },
        attrs={"title": "xarray-gds test data", "history": "made by conftest"},
    )
    return ds


def _cf_encoding() -> dict[str, dict[str, Any]]:
    return {
        "t2m": {"chunks": (4, 4, 5)},
        "u10": {
            "dtype": "i2",
            "scale_factor": 0.01,
            "add_offset": 2.0,
            "_FillValue": -32768,
            "chunks": (4, 4, 5),
        },
        "n_obs": {"dtype": "i4", "_FillValue": -1, "chunks": (4, 5)},
        "qc": {"chunks": (4, 4)},
        "h": {"chunks": (4, 5)},
        "u16": {"chunks": (3, 5)},
    }


# Codec tables: name -> per-variable encoding additions.
V3_CODECS: dict[str, dict[str, Any]] = {
    "zstd": {"compressors": [zc.ZstdCodec(level=3)]},
    "zstd-checksum": {"compressors": [zc.ZstdCodec(level=1, checksum=True)]},
    "gzip": {"compressors": [zc.GzipCodec(level=5)]},
    "none": {"compressors": None},
    "blosc": {"compressors": [zc.BloscCodec(cname="lz4", shuffle="shuffle", typesize=4)]},
    "blosc-zstd-bit": {
        "compressors": [zc.BloscCodec(cname="zstd", shuffle="bitshuffle", typesize=4)]
    },
    "crc32c": {"compressors": [zc.ZstdCodec(), zc.Crc32cCodec()]},
    "big-endian": {"serializer": zc.BytesCodec(endian="big"), "compressors": [zc.GzipCodec()]},
    "sharded": {"shards": "outer", "compressors": [zc.ZstdCodec()]},
    # numcodecs filters in a v3 chain, as VirtualiZarr describes HDF5's shuffle + deflate
    "shuffle-zlib": {
        "compressors": lambda dt: [
            zarr.codecs.numcodecs.Shuffle(elementsize=dt.itemsize),
            zarr.codecs.numcodecs.Zlib(level=1),
        ]
    },
    # no batched decoder: zarr-python decodes it (on the host, for either device)
    "lzma": {"compressors": [zarr.codecs.numcodecs.LZMA(preset=1)]},
}
V2_CODECS: dict[str, dict[str, Any]] = {
    "zstd": {"compressors": [numcodecs.Zstd(level=3)]},
    "lz4": {"compressors": [numcodecs.LZ4()]},
    "zlib": {"compressors": [numcodecs.Zlib(level=4)]},
    "gzip": {"compressors": [numcodecs.GZip(level=4)]},
    "blosc": {"compressors": [numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE)]},
    "blosc-blosclz": {
        "compressors": [numcodecs.Blosc(cname="blosclz", shuffle=numcodecs.Blosc.BITSHUFFLE)]
    },
    "none": {"compressors": None},
    "shuffle-zstd": {
        "compressors": [numcodecs.Zstd()],
        "filters": lambda dt: [numcodecs.Shuffle(elementsize=dt.itemsize)],
    },
    "delta-zlib": {
        "compressors": [numcodecs.Zlib()],
        "filters": lambda dt: [numcodecs.Delta(dtype=dt)],
    },
    # no batched decoder: zarr-python decodes it (on the host, for either device)
    "bz2": {"compressors": [numcodecs.BZ2(level=5)]},
}


def _inner(n: int) -> int:
    """The largest proper divisor of ``n`` (an inner chunk size that tiles a shard)."""
    return next((d for d in range(n // 2, 0, -1) if n % d == 0), n)


def write_store(path: Path, zarr_format: int, codec: str, ds: xr.Dataset | None = None) -> Path:
    """Write ``ds`` (default: :func:`sample_dataset`) with ``codec`` to ``path``."""
    ds = sample_dataset() if ds is None else ds
    table = V3_CODECS if zarr_format == 3 else V2_CODECS
    extra = table[codec]
    encoding = _cf_encoding()
    for name, var in ds.data_vars.items():
        if var.dtype.kind in "OUSmM":
            continue
        enc = encoding.setdefault(str(name), {})
        for key, value in extra.items():
            if key == "shards":
                chunks = enc.get("chunks") or tuple(min(4, n) for n in var.shape)
                enc["chunks"] = tuple(_inner(c) for c in chunks)
                enc["shards"] = chunks
            elif key == "filters" and var.dtype.kind == "b":
                continue
            else:
                enc[key] = (
                    value(np.dtype(enc.get("dtype", var.dtype))) if callable(value) else value
                )
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, encoding=encoding, consolidated=True)
    return path


STORE_CASES = [(3, c) for c in V3_CODECS] + [(2, c) for c in V2_CODECS]


@pytest.fixture(scope="session")
def store_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, str], Path]:
    """Build (once per session) the sample store for a Zarr format and codec."""
    cache: dict[tuple[int, str], Path] = {}

    def make(zarr_format: int, codec: str) -> Path:
        key = (zarr_format, codec)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"v{zarr_format}-{codec}")
            cache[key] = write_store(root / "data.zarr", zarr_format, codec)
        return cache[key]

    return make


@pytest.fixture(params=STORE_CASES, ids=[f"v{f}-{c}" for f, c in STORE_CASES])
def store_path(request: pytest.FixtureRequest, store_factory: Callable[[int, str], Path]) -> Path:
    zarr_format, codec = request.param
    return store_factory(zarr_format, codec)


@pytest.fixture
def v3_store(store_factory: Callable[[int, str], Path]) -> Path:
    return store_factory(3, "zstd")


@pytest.fixture
def v2_store(store_factory: Callable[[int, str], Path]) -> Path:
    return store_factory(2, "zstd")


def open_both(path: Any, device: str, **kwargs: Any) -> tuple[xr.Dataset, xr.Dataset]:
    """(engine="gds-zarr", engine="zarr") datasets of the same store and arguments."""
    gds = xr.open_dataset(path, engine="gds-zarr", device=device, **kwargs)
    ref = xr.open_dataset(path, engine="zarr", **kwargs)
    return gds, ref


__all__ = ["assert_placed", "open_both", "sample_dataset", "to_numpy", "write_store", "zarr"]


@pytest.fixture
def joined_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of reads in each joined call (coalesce.fetch_decode_many)."""
    from xarray_gds import coalesce

    calls: list[int] = []
    original = coalesce.fetch_decode_many

    def spy(items: list[Any]) -> Any:
        calls.append(len(items))
        return original(items)

    monkeypatch.setattr(coalesce, "fetch_decode_many", spy)
    yield calls

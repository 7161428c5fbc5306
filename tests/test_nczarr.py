"""Stores written by netCDF-C's NCZarr read as netCDF-C reads them.

NCZarr records the shuffle filter as ``{"id": "shuffle", "elementsize": 0}``, where 0
means "the element size of the variable's type"; numcodecs takes 0 as no shuffle, so
``engine="zarr"`` returns wrong values for every such variable of more than one byte.
The truth here is what the ``netCDF4`` package (netCDF-C) reads back from the same
store, not ``engine="zarr"``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr

from tests.conftest import assert_placed
from xarray_gds.codecs import DecodeChain, Unsupported, netcdf_filters, plan_chain
from xarray_gds.codecs.filters import Unshuffle
from xarray_gds.errors import HostRouteWarning

netCDF4 = pytest.importorskip("netCDF4")  # the test extra has it; not every GPU image

#: data variables written with shuffle and zlib, by dtype
DATA = {"f32": "f4", "i16": "i2", "f64": "f8"}
#: one-byte values too, where zarr can open them: NCZarr writes their dtype as "<i1",
#: which zarr 3.3 (the lowest version claimed) refuses for the whole store
ONE_BYTE = tuple(int(p) for p in zarr.__version__.split(".")[:2]) >= (3, 4)
if ONE_BYTE:
    DATA["i8"] = "i1"


def _url(path: Path) -> str:
    return f"file://{path}#mode=nczarr,file"


@pytest.fixture(scope="module")
def nczarr_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store written by netCDF-C (NCZarr, Zarr v2): shuffled and deflated variables
    of 1, 2, 4 and 8 bytes, an index coordinate, a time coordinate (decoded to
    datetimes, so read on the host), a packed variable and one with a Fletcher-32
    checksum (a chain the engine does not plan: zarr's codecs decode it)."""
    path = tmp_path_factory.mktemp("nczarr") / "nc.zarr"
    rng = np.random.default_rng(30)
    with netCDF4.Dataset(_url(path), "w") as nc:
        nc.createDimension("time", 37)
        nc.createDimension("x", 50)
        filters: dict[str, Any] = {"shuffle": True, "zlib": True}
        x = nc.createVariable("x", "f4", ("x",), **filters)
        x[:] = np.linspace(-3.0, 7.0, 50)
        time = nc.createVariable("time", "f8", ("time",), **filters)
        time.units = "hours since 2000-01-01"
        time[:] = np.arange(37) * 6.0
        for name, dtype in DATA.items():
            var = nc.createVariable(name, dtype, ("time", "x"), chunksizes=(10, 16), **filters)
            info = np.iinfo(dtype) if dtype[0] == "i" else np.finfo(dtype)
            var[:] = rng.uniform(info.min / 4, info.max / 4, size=(37, 50)).astype(dtype)
        packed = nc.createVariable("packed", "i2", ("time", "x"), chunksizes=(8, 25), **filters)
        packed.scale_factor = 0.01
        packed.add_offset = 5.0
        packed[:] = rng.normal(5.0, 50.0, size=(37, 50))
        checked = nc.createVariable(
            "checked", "f4", ("time", "x"), chunksizes=(10, 16), fletcher32=True, **filters
        )
        checked[:] = rng.normal(size=(37, 50))
    return path


@pytest.fixture(scope="module")
def truth(nczarr_path: Path) -> xr.Dataset:
    """What netCDF-C reads (through xarray's netcdf4 engine, for the same CF decoding)."""
    with xr.open_dataset(_url(nczarr_path), engine="netcdf4") as ds:
        return ds.load()


def test_store_is_nczarr_with_shuffle_elementsize_0(nczarr_path: Path) -> None:
    """The premise: netCDF-C wrote elementsize 0, which the engine plans as netCDF-C
    reads it; the Fletcher-32 chain is left to zarr's codecs (corrected, see below)."""
    group = zarr.open_group(nczarr_path, mode="r", zarr_format=2)
    for name, dtype in DATA.items():
        array = group[name]
        assert isinstance(array, zarr.Array)
        assert numcodecs.Shuffle(elementsize=0) in array.filters, array.filters
        chain = plan_chain(array.metadata)
        assert isinstance(chain, DecodeChain)
        assert chain.filters == (Unshuffle(np.dtype(dtype).itemsize),)
        fixed = netcdf_filters(array.metadata)
        assert fixed == (None if dtype == "i1" else (numcodecs.Shuffle(np.dtype(dtype).itemsize),))
    checked = group["checked"]
    assert isinstance(checked, zarr.Array)
    assert isinstance(plan_chain(checked.metadata), Unsupported)
    assert netcdf_filters(checked.metadata) == (numcodecs.Shuffle(4), numcodecs.Zlib(level=4))


def test_engine_zarr_misreads_nczarr_shuffle(nczarr_path: Path, truth: xr.Dataset) -> None:
    """The upstream bug this engine corrects (numcodecs' Shuffle takes elementsize 0 as
    no shuffle). If this test fails, zarr-python now reads NCZarr's shuffle as netCDF-C
    does: the engine's correction (``netcdf_filters``) is then no longer needed and this
    test should be turned around, not the engine changed to match a wrong reading."""
    with xr.open_dataset(
        nczarr_path, engine="zarr", decode_times=False, consolidated=False
    ) as zarr_ds:
        for name in ("f32", "i16", "f64", "packed", "checked", "x"):
            differ = zarr_ds[name].values != truth[name].values
            assert differ.mean() > 0.9, (name, differ.mean())
        if ONE_BYTE:  # one-byte values: shuffling them changes nothing
            np.testing.assert_array_equal(zarr_ds["i8"].values, truth["i8"].values)


def _read(path: Path, device: str, **kwargs: Any) -> xr.Dataset:
    with warnings.catch_warnings():
        # the Fletcher-32 variable decodes on the host on the GPU path: said once
        warnings.simplefilter("ignore", HostRouteWarning)
        return xr.open_dataset(path, engine="gds-zarr", device=device, consolidated=False, **kwargs)


#: every route a read takes: the batched box read, zarr's indexing (a vectorized
#: selection), dask, members listed anew at each use
ROUTES: dict[str, Callable[[xr.Dataset], xr.Dataset]] = {
    "load": lambda ds: ds,
    "box": lambda ds: ds.isel(time=slice(3, 31, 2), x=slice(5, 45)),
    "vectorized": lambda ds: ds.isel(
        time=xr.DataArray([0, 36, 12, 5], dims="p"), x=xr.DataArray([49, 0, 17, 17], dims="p")
    ),
}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("opening", [{}, {"chunks": {}}, {"cache_members": False}], ids=str)
def test_nczarr_reads_as_netcdf(
    nczarr_path: Path, truth: xr.Dataset, device: str, route: str, opening: dict[str, Any]
) -> None:
    select = ROUTES[route]
    if device == "cuda" and "chunks" in opening:  # CuPy blocks (xarray's own dask
        opening = {**opening, "chunked_array_type": "gds-dask"}  # manager: numpy ones)
    ds = select(_read(nczarr_path, device, **opening)).load()
    # x and time are the store's index coordinates: on the host, also once a
    # vectorized selection made them non-index coordinates along "p"
    assert_placed(ds, device, indexes={"time", "x"})
    if device == "cuda":
        ds = ds.as_numpy()
    xr.testing.assert_identical(ds, select(truth))


@pytest.mark.gpu
def test_nczarr_reads_as_netcdf_on_gpu(nczarr_path: Path, truth: xr.Dataset) -> None:
    """The GPU half on its own: device unshuffle after nvCOMP's deflate, CuPy results."""
    import cupy

    ds = _read(nczarr_path, "cuda").load()
    for name in (*DATA, "packed", "checked"):
        assert isinstance(ds[name].data, cupy.ndarray), name
    xr.testing.assert_identical(ds.as_numpy(), truth)


def test_nczarr_raw_values_as_netcdf(nczarr_path: Path, device: str) -> None:
    """Undecoded values (no CF masking, scaling or times) equal netCDF-C's raw arrays."""
    ds = _read(nczarr_path, device, mask_and_scale=False, decode_times=False).load()
    with netCDF4.Dataset(_url(nczarr_path)) as nc:
        nc.set_auto_maskandscale(False)
        for name, variable in nc.variables.items():
            got = ds[name].as_numpy().values
            expected = variable[:]
            assert got.dtype == expected.dtype, name
            np.testing.assert_array_equal(got, expected, err_msg=name)


def test_nczarr_encoding_keeps_stored_filters(nczarr_path: Path) -> None:
    """The correction is in the decoding only: the variable's encoding holds the filters
    as stored, as with engine="zarr"."""
    ds = _read(nczarr_path, "cpu")
    assert ds["f32"].encoding["filters"] == (numcodecs.Shuffle(elementsize=0),)
    assert ds["x"].encoding["filters"] == (numcodecs.Shuffle(elementsize=0),)

"""xbatcher's BatchGenerator over a gds-zarr dataset gives the batches it gives over
engine="zarr" (on the GPU as CuPy arrays)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr

xbatcher = pytest.importorskip("xbatcher")

ENCODING: dict[str, dict[str, Any]] = {
    "t2m": {"chunks": (1, 5, 6)},
    "u10": {"dtype": "i2", "scale_factor": 0.01, "_FillValue": -32768, "chunks": (4, 5, 6)},
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(5)
    shape = (12, 10, 12)
    t2m = (280 + 10 * rng.standard_normal(shape)).astype("f4")
    t2m[3, 2, 2] = np.nan
    u10 = (5 * rng.standard_normal(shape)).round(2)
    u10[0, 0, 0] = np.nan
    ds = xr.Dataset(
        {
            "t2m": (("time", "lat", "lon"), t2m, {"units": "K"}),
            "u10": (("time", "lat", "lon"), u10),
        },
        coords={
            "time": pd.date_range("2021-01-01", periods=12, freq="h"),
            "lat": np.linspace(-20, 20, 10),
            "lon": np.arange(12) * 5.0,
        },
    )
    path = tmp_path_factory.mktemp("xbatcher") / "s.zarr"
    ds.to_zarr(path, encoding=ENCODING, consolidated=False, zarr_format=3)
    return path


SETUPS: list[dict[str, Any]] = [
    {"input_dims": {"lat": 5, "lon": 4}},  # patches, each batch one patch
    {"input_dims": {"time": 3, "lat": 10, "lon": 12}},  # windows of time steps
    {"input_dims": {"lat": 5, "lon": 6}, "batch_dims": {"time": 4}},  # stacked samples
    {
        "input_dims": {"lat": 4, "lon": 4},
        "input_overlap": {"lat": 2},
        "batch_dims": {"time": 6},
        "concat_input_dims": True,
    },
]


def _open(store: Path, engine: str, device: str = "cpu", **kwargs: Any) -> xr.Dataset:
    if engine == "zarr":
        return xr.open_dataset(store, engine="zarr", consolidated=False, **kwargs)
    return xr.open_dataset(store, engine="gds-zarr", device=device, consolidated=False, **kwargs)


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: "-".join(s["input_dims"]))
@pytest.mark.parametrize("chunks", [None, {}])
def test_batches_equal_engine_zarr(store: Path, setup: dict[str, Any], chunks: Any) -> None:
    ours = xbatcher.BatchGenerator(_open(store, "gds-zarr", chunks=chunks), **setup)
    theirs = xbatcher.BatchGenerator(_open(store, "zarr"), **setup)
    assert len(ours) == len(theirs) > 1
    for a, b in zip(ours, theirs, strict=True):
        xr.testing.assert_identical(a.compute(), b.compute())


@pytest.mark.gpu
@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: "-".join(s["input_dims"]))
def test_device_batches_are_cupy(store: Path, setup: dict[str, Any]) -> None:
    import cupy as cp

    ours = xbatcher.BatchGenerator(_open(store, "gds-zarr", "cuda"), **setup)
    theirs = xbatcher.BatchGenerator(_open(store, "zarr"), **setup)
    assert len(ours) == len(theirs) > 1
    for a, b in zip(ours, theirs, strict=True):
        a = a.compute()
        for name in ("t2m", "u10"):
            assert isinstance(a[name].data, cp.ndarray), name
        xr.testing.assert_identical(a.as_numpy(), b.compute())

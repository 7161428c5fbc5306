"""An append loop through :func:`xarray_gds.to_zarr` (what ``xarray-gds bench --case
write-append-100`` times) prints no warning, and writes what ``engine="zarr"`` reads
back as the steps appended. With consolidated metadata (the default) zarr still warns
at every write of a Zarr v3 store (``ZarrUserWarning``: consolidated metadata is not
in the v3 specification): expected to fail until the write silences that."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
from zarr.errors import ZarrUserWarning

import xarray_gds


def _steps(n: int = 4) -> list[xr.Dataset]:
    rng = np.random.default_rng(3)
    ds = xr.Dataset(
        {"v": (("time", "x"), rng.standard_normal((n, 16)).astype("f4"))},
        coords={"time": pd.date_range("2000-01-01", periods=n, freq="h")},
    )
    return [ds.isel(time=[k]) for k in range(n)]


#: the bench's encoding: a chunk a step, hours as the time unit
ENCODING: dict[str, dict[str, Any]] = {
    "v": {"chunks": (1, 16)},
    "time": {"units": "hours since 2000-01-01", "dtype": "int64"},
}


def _append_loop(out: Path, steps: list[xr.Dataset], **kw: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xarray_gds.to_zarr(steps[0], out, mode="w", encoding=ENCODING, **kw)
        for step in steps[1:]:
            xarray_gds.to_zarr(step, out, append_dim="time", **kw)


def test_an_append_loop_without_consolidated_metadata_warns_nothing(tmp_path: Path) -> None:
    steps = _steps()
    _append_loop(tmp_path / "out.zarr", steps, consolidated=False)
    back = xr.open_dataset(tmp_path / "out.zarr", engine="zarr", consolidated=False).load()
    xr.testing.assert_equal(back, xr.concat(steps, "time"))


@pytest.mark.xfail(
    strict=True,
    raises=ZarrUserWarning,
    reason="zarr warns at every consolidation of a Zarr v3 store, and xarray_gds.to_zarr "
    "consolidates by default (consolidated=None, as xarray does)",
)
def test_an_append_loop_warns_nothing(tmp_path: Path) -> None:
    steps = _steps()
    _append_loop(tmp_path / "out.zarr", steps)
    back = xr.open_dataset(tmp_path / "out.zarr", engine="zarr").load()
    xr.testing.assert_equal(back, xr.concat(steps, "time"))

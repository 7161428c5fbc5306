"""An append loop through :func:`xarray_gds.to_zarr` (what ``xarray-gds bench --case
write-append-100`` times) prints no warning, and writes what ``engine="zarr"`` reads
back as the steps appended. With consolidated metadata (the default) zarr warns at
every write of a Zarr v3 store (``ZarrUserWarning``: consolidated metadata is not in
the v3 specification), for xarray's writes and the engine's alike; the bench's loops
let that notice through once."""

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


def test_the_bench_append_loops_warn_once_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zarr warns at every consolidating write of a v3 store (``ZarrUserWarning``); the
    bench's append loops, of both contenders, let it through for the first write only,
    and write what engine="zarr" reads back as the steps appended."""
    from xarray_gds.tools import bench_write

    monkeypatch.setattr(bench_write, "APPENDS", 6)
    path = bench_write.make_append(tmp_path / "steps.zarr", 1 << 20)
    source = xr.open_dataset(path, engine="zarr").load()
    for name, contender in bench_write.append_contenders(path).items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            contender()
        notices = [w for w in caught if issubclass(w.category, ZarrUserWarning)]
        assert len(notices) <= 1, (name, [str(w.message) for w in caught])
        assert [w for w in caught if w not in notices] == [], name
        out = bench_write._out(path)
        back = xr.open_dataset(out, engine="zarr").load()
        xr.testing.assert_equal(back.drop_encoding(), source.drop_encoding())

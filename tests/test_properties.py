"""Property tests: random shapes, chunks, shards and selections, both engines compared,
on the host and (``gpu`` marker, through the ``device`` fixture) on the GPU."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr.codecs as zc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xarray_gds import device as _device

pytestmark = pytest.mark.filterwarnings("ignore::xarray.SerializationWarning")


@st.composite
def layouts(draw: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, n)) for n in shape)
    shards = None
    if draw(st.booleans()):
        shards = tuple(c * draw(st.integers(1, 3)) for c in chunks)
    return shape, chunks, shards


@st.composite
def selections(draw: Any, shape: tuple[int, ...]) -> dict[str, Any]:
    sel: dict[str, Any] = {}
    for axis, n in enumerate(shape):
        kind = draw(st.sampled_from(["all", "int", "slice", "list"]))
        if kind == "int":
            sel[f"d{axis}"] = draw(st.integers(-n, n - 1))
        elif kind == "slice":
            start = draw(st.integers(0, n - 1))
            stop = draw(st.integers(start + 1, n))
            step = draw(st.sampled_from([1, 2, -1]))
            sel[f"d{axis}"] = slice(start, stop, step) if step > 0 else slice(stop - 1, None, -1)
        elif kind == "list":
            sel[f"d{axis}"] = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))
    return sel


def _assert_same(got: xr.DataArray, want: xr.DataArray, device: str) -> None:
    """Identical values, and the engine's on ``device`` (int32: numeric, so CuPy there)."""
    assert _device.is_device_array(got.data) == (device == "cuda"), type(got.data)
    xr.testing.assert_identical(got.as_numpy(), want)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), layout=layouts(), codec=st.sampled_from(["zstd", "gzip", "none"]))
def test_random_layouts_and_selections_match_zarr(
    device: str, data: Any, layout: Any, codec: str
) -> None:
    shape, chunks, shards = layout
    rng = np.random.default_rng(0)
    values = rng.integers(-1000, 1000, size=shape).astype("i4")
    dims = tuple(f"d{i}" for i in range(len(shape)))
    compressors = {"zstd": [zc.ZstdCodec()], "gzip": [zc.GzipCodec()], "none": None}[codec]
    encoding: dict[str, Any] = {"chunks": chunks, "compressors": compressors}
    if shards is not None:
        encoding["shards"] = tuple(
            min(s, -(-n // c) * c) for s, n, c in zip(shards, shape, chunks, strict=True)
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.zarr"
        xr.Dataset({"v": (dims, values)}).to_zarr(path, zarr_format=3, encoding={"v": encoding})
        gds = xr.open_dataset(path, engine="gds-zarr", device=device)
        ref = xr.open_dataset(path, engine="zarr")
        sel = data.draw(selections(shape))
        _assert_same(gds.v.isel(sel).load(), ref.v.isel(sel).load(), device)
        points = {
            d: xr.DataArray(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=3)))
            for d, n in zip(dims, shape, strict=True)
        }
        size = min(len(p) for p in points.values())
        points = {d: p[:size] for d, p in points.items()}
        _assert_same(gds.v.isel(points).load(), ref.v.isel(points).load(), device)

"""Device choice, host fallback, and the host round-trip fallback for unusual decodings."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from xarray_gds import NoCudaDeviceError, backend, cuda_status, device
from xarray_gds.array import HostDecodedArray

from .conftest import assert_placed, to_numpy


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Pretend there is no GPU (also on the GPU machine), with a fresh warning state."""
    monkeypatch.setenv("XARRAY_GDS_DISABLE_CUDA", "1")
    monkeypatch.setattr(device, "_warned_fallback", False)
    cuda_status.cache_clear()
    yield
    cuda_status.cache_clear()


def test_auto_falls_back_to_host_and_warns_once(no_cuda: None, v3_store: Path) -> None:
    with pytest.warns(RuntimeWarning, match="no CUDA device is usable") as record:
        ds = xr.open_dataset(v3_store, engine="gds-zarr")
    assert "XARRAY_GDS_DISABLE_CUDA" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        again = xr.open_dataset(v3_store, engine="gds-zarr", consolidated=True)
    assert_placed(ds.load(), "cpu")
    xr.testing.assert_identical(to_numpy(again), xr.open_dataset(v3_store, engine="zarr").load())


def test_cuda_without_gpu_says_why(no_cuda: None, v3_store: Path) -> None:
    with pytest.raises(NoCudaDeviceError, match="device='cuda' was requested but"):
        xr.open_dataset(v3_store, engine="gds-zarr", device="cuda")


def test_reason_names_the_extra_when_cupy_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name: str, *args: object, **kwargs: object) -> object:
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.delenv("XARRAY_GDS_DISABLE_CUDA", raising=False)
    monkeypatch.setattr(
        "sys.modules",
        {
            k: v
            for k, v in __import__("sys").modules.items()
            if k != "cupy" and not k.startswith("cupy.")
        },
    )
    cuda_status.cache_clear()
    try:
        ok, reason = cuda_status()
        assert not ok
        assert "xarray-gds[cuda13]" in reason and "xarray-gds[cuda12]" in reason
        with pytest.raises(ImportError, match=r"xarray-gds\[cuda13\]"):
            device.cupy()
    finally:
        cuda_status.cache_clear()


def test_device_argument_validation() -> None:
    assert device.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        device.resolve_device("tpu")
    with pytest.raises(TypeError, match="device must be"):
        device.resolve_device(0)  # type: ignore[arg-type]


def test_host_decode_fallback_is_used_and_correct(
    monkeypatch: pytest.MonkeyPatch, v2_store: Path, device: str
) -> None:
    """When the CF plan is declined, xarray decodes on the host and values still move."""
    monkeypatch.setattr(backend, "plan_cf_decoding", lambda *a, **k: None)
    ds = xr.open_dataset(v2_store, engine="gds-zarr", device=device)
    wrapped = ds.u10.variable._data
    while hasattr(wrapped, "array"):
        wrapped = wrapped.array
    assert isinstance(wrapped, HostDecodedArray)
    loaded = ds.load()
    assert_placed(loaded, device)
    xr.testing.assert_identical(loaded.as_numpy(), xr.open_dataset(v2_store, engine="zarr").load())


def test_big_endian_v2_arrays(tmp_path: Path, device: str) -> None:
    path = tmp_path / "be.zarr"
    root = zarr.open_group(path, mode="w", zarr_format=2)
    arr = root.create_array("x", shape=(5, 7), chunks=(2, 3), dtype=">i4", fill_value=0)
    arr[:] = np.arange(35, dtype=">i4").reshape(5, 7)
    arr.attrs.update({"_ARRAY_DIMENSIONS": ["a", "b"], "scale_factor": 0.5})
    zarr.consolidate_metadata(path)
    ds = xr.open_dataset(path, engine="gds-zarr", device=device)
    got = ds.load()
    assert_placed(got, device)
    ref = xr.open_dataset(path, engine="zarr").load()
    xr.testing.assert_identical(got.as_numpy(), ref)
    assert got.x.dtype.isnative

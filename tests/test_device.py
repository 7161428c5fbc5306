"""Device choice, host fallback, and the host round-trip fallback for unusual decodings."""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import xarray as xr
import zarr
from xarray.core import indexing

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
        assert reason.endswith(
            "; install the CUDA extra matching your driver from a checkout of xarray-gds: "
            '`pip install ".[cuda13]"` (CUDA 13) or `pip install ".[cuda12]"` (CUDA 12), '
            "as the README's Install section says"
        )
        with pytest.raises(ImportError) as raised:
            device.cupy()
        assert str(raised.value).endswith(f"; {device.INSTALL_HINT}.")
    finally:
        cuda_status.cache_clear()


def test_device_argument_validation() -> None:
    assert device.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be"):
        device.resolve_device("tpu")
    with pytest.raises(TypeError, match="device must be"):
        device.resolve_device(0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "parsed"),
    [
        (None, (None, None)),
        ("cpu", ("cpu", None)),
        ("host", ("cpu", None)),
        ("gpu", ("cuda", None)),
        ("cuda", ("cuda", None)),
        ("cuda:0", ("cuda", 0)),
        ("cuda:3", ("cuda", 3)),
        ("CUDA:1", ("cuda", 1)),
    ],
)
def test_device_forms(given: str | None, parsed: tuple[str | None, int | None]) -> None:
    assert device.parse_device(given) == parsed


@pytest.mark.parametrize("given", ["tpu", "cuda:x", "cuda:-1", "cuda:", "cuda:1.5", "gpu:0", ""])
def test_bad_device_lists_the_forms(given: str, v3_store: Path) -> None:
    forms = "'cpu', 'gpu' or 'cuda', or 'cuda:N'"
    with pytest.raises(ValueError, match="device must be") as err:
        device.parse_device(given)
    assert forms in str(err.value) and repr(given) in str(err.value)
    with pytest.raises(ValueError, match=re.escape(forms)):  # before any GPU is looked for
        xr.open_dataset(v3_store, engine="gds-zarr", device=given)


class _FakeDevice:
    """cupy.cuda.Device: a context that makes GPU ``n`` current (recorded)."""

    current: ClassVar[list[int]] = []

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> _FakeDevice:
        self.current.append(self.n)
        return self

    def __exit__(self, *exc: object) -> None:
        self.current.pop()


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """A machine with ``count`` usable GPUs, as far as device.py can tell."""
    from types import SimpleNamespace

    runtime = SimpleNamespace(getDeviceCount=lambda: count)
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime, Device=_FakeDevice))
    monkeypatch.setattr(device, "cuda_status", lambda: (True, ""))
    monkeypatch.setattr(device, "cupy", lambda: fake)
    monkeypatch.setattr(_FakeDevice, "current", [])


def test_cuda_n_selects_that_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, 2)
    assert device.resolve("cuda:1") == ("cuda", 1)
    assert device.resolve("cuda:0") == ("cuda", 0)
    assert device.resolve("gpu") == ("cuda", None)
    assert device.resolve_device("cuda:1") == "cuda"
    with device.on_gpu(1):
        assert _FakeDevice.current == [1]
    with device.on_gpu(None):
        assert _FakeDevice.current == []


@pytest.mark.parametrize(
    ("count", "have"), [(2, "this machine has 2 GPUs (cuda:0 to cuda:1)"), (1, "1 GPU (cuda:0)")]
)
def test_cuda_n_beyond_the_gpus_names_the_count(
    monkeypatch: pytest.MonkeyPatch, count: int, have: str
) -> None:
    _fake_gpus(monkeypatch, count)
    with pytest.raises(ValueError, match=re.escape(have)) as err:
        device.resolve(f"cuda:{count}")
    assert f"device='cuda:{count}' asks for GPU {count}" in str(err.value)


def test_cuda_n_without_gpu_says_why(no_cuda: None) -> None:
    with pytest.raises(NoCudaDeviceError, match="device='cuda:0' was requested but"):
        device.resolve("cuda:0")


def test_arrays_opened_on_cuda_n_read_with_that_gpu_current(
    monkeypatch: pytest.MonkeyPatch, v3_store: Path
) -> None:
    """device="cuda:N": every read of the dataset's arrays (alone, or joined with arrays
    of other datasets) runs with GPU N current, the GPU the engine's reads record."""
    from xarray_gds import array as array_mod

    _fake_gpus(monkeypatch, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds1 = xr.open_dataset(v3_store, engine="gds-zarr", device="cuda:1")
        ds0 = xr.open_dataset(v3_store, engine="gds-zarr", device="cuda:0")
        dsn = xr.open_dataset(v3_store, engine="gds-zarr", device="cuda")

    def lazy(ds: xr.Dataset) -> array_mod.GdsBackendArray:
        name = next(n for n in ds.data_vars if ds[n].ndim > 1)
        got: Any = ds[name].variable._data
        while not isinstance(got, array_mod.GdsBackendArray):  # xarray's wrappers
            got = got.array
        return got

    a1, a0, an = lazy(ds1), lazy(ds0), lazy(dsn)
    assert (a1._gpu, a0._gpu, an._gpu) == (1, 0, None)
    seen: list[tuple[list[str], list[int]]] = []

    def read_here(items: list[tuple[Any, Any]]) -> list[Any]:
        seen.append(([a.name for a, _ in items], list(_FakeDevice.current)))
        return [None] * len(items)

    monkeypatch.setattr(array_mod, "_read_boxes_here", read_here)
    key = (slice(0, 1),) * len(a1.shape)
    assert array_mod.read_boxes([(a1, key), (a0, key), (an, key), (a1, key)]) == [None] * 4
    assert sorted(c for _, c in seen) == [[], [0], [1]]
    assert all(len(names) == (2 if c == [1] else 1) for names, c in seen)

    def read(self: array_mod.GdsBackendArray, key: Any) -> list[int]:
        return list(_FakeDevice.current)

    monkeypatch.setattr(array_mod.GdsBackendArray, "_read", read)
    assert a1[indexing.BasicIndexer(key)] == [1]
    assert an[indexing.BasicIndexer(key)] == []


@pytest.mark.gpu
def test_cuda_n_reads_into_that_gpu(v3_store: Path) -> None:
    """On a GPU machine: the values of device="cuda:N" live on GPU N whichever device
    is current, and equal engine="zarr"'s; N = the count is refused."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    ref = xr.open_dataset(v3_store, engine="zarr").load()
    for n in range(min(count, 2)):
        with cupy.cuda.Device(count - 1 - n):  # another GPU current, where there are two
            ds = xr.open_dataset(v3_store, engine="gds-zarr", device=f"cuda:{n}").load()
            for name, var in ds.data_vars.items():
                if device.is_device_array(var.data):
                    assert var.data.device.id == n, name
        xr.testing.assert_identical(to_numpy(ds), ref)
    with pytest.raises(ValueError, match=f"this machine has {count} GPU"):
        xr.open_dataset(v3_store, engine="gds-zarr", device=f"cuda:{count}")


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


def test_missing_nvcomp_names_the_install_from_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    from xarray_gds.codecs import nvcomp

    monkeypatch.setitem(sys.modules, "nvidia", None)  # import nvidia fails
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", None)
    with pytest.raises(ImportError) as raised:
        nvcomp._nvcomp()
    assert str(raised.value).endswith(f"; {device.INSTALL_HINT}")
    assert '`pip install ".[cuda13]"`' in device.INSTALL_HINT

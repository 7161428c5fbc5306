"""test_nczarr's read test with device="cuda" on the CPU: a stand-in device whose
arrays are numpy arrays that say they are CuPy arrays (``__cuda_array_interface__``),
filled by the engine's host reads. It checks what the GPU run checks about where each
variable lands (placement, the dask chunk manager, index coordinates), not the device
decode itself."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

from tests import test_nczarr
from tests.test_host_logic import _FakeDevice
from xarray_gds import array as _array
from xarray_gds import device as _device


class _OnDevice(np.ndarray):
    """A host array standing for a CuPy array of GPU 0."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "version": 3,
            "data": (self.__array_interface__["data"][0], False),
        }

    @property
    def device(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(id=0)

    def get(self) -> np.ndarray:
        return np.array(self)


class _Cupy(types.SimpleNamespace):
    ndarray = _OnDevice

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def asarray(a: Any, dtype: Any = None) -> Any:
        return np.asarray(a, dtype=dtype).view(_OnDevice)

    @staticmethod
    def empty(shape: Any, dtype: Any = np.float64, order: str = "C") -> Any:
        return np.empty(shape, dtype=dtype, order=order).view(_OnDevice)


@pytest.fixture
def standin_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """device="cuda" resolves, and the engine's cuda arrays read on the host, then
    "move" (a view as _OnDevice)."""
    fake = _Cupy(cuda=types.SimpleNamespace(Device=_FakeDevice))
    monkeypatch.setattr(_device, "cuda_status", lambda: (True, ""))
    monkeypatch.setattr(_device, "cupy", lambda: fake)

    def on_host(a: _array.GdsBackendArray) -> _array.GdsBackendArray:
        return _array.GdsBackendArray(a._array, a.name, "cpu", a._cf)

    host_getitem = _array.GdsBackendArray.__getitem__

    def getitem(self: _array.GdsBackendArray, key: Any) -> Any:
        if self._device != "cuda":
            return host_getitem(self, key)
        return fake.asarray(host_getitem(on_host(self), key))

    host_boxes = _array.read_boxes

    def read_boxes(items: list[Any], into: list[Any] | None = None) -> list[Any]:
        got = host_boxes([(on_host(a), k) for a, k in items])
        return [
            v if isinstance(v, BaseException) or a._device != "cuda" else fake.asarray(v)
            for (a, _), v in zip(items, got, strict=True)
        ]

    # dask joins CuPy blocks with cupy.concatenate (its concatenate_lookup), not into
    # a new numpy array as it joins numpy ones: the stand-in's blocks likewise
    from dask.array.dispatch import concatenate_lookup

    concatenate_lookup.register(
        _OnDevice, lambda arrays, axis=0: fake.asarray(np.concatenate(arrays, axis=axis))
    )
    monkeypatch.setattr(_array.GdsBackendArray, "__getitem__", getitem)
    monkeypatch.setattr(_array, "read_boxes", read_boxes)


@pytest.mark.parametrize("route", list(test_nczarr.ROUTES))
@pytest.mark.parametrize("opening", [{}, {"chunks": {}}, {"cache_members": False}], ids=str)
def test_nczarr_reads_as_netcdf_on_standin_gpu(
    standin_gpu: None, nczarr_path: Path, truth: xr.Dataset, route: str, opening: dict[str, Any]
) -> None:
    test_nczarr.test_nczarr_reads_as_netcdf(nczarr_path, truth, "cuda", route, opening)


nczarr_path = test_nczarr.nczarr_path
truth = test_nczarr.truth

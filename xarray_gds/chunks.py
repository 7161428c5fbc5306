"""A dask chunk manager that gives dask arrays of device variables a CuPy ``meta``.

xarray wraps lazily indexed backend arrays into dask arrays with ``meta=np.ndarray``
whatever their blocks hold. Passing :class:`GdsDaskManager` as xarray's public
``chunked_array_type`` argument keeps everything else the same and declares the
truth for variables the engine places on the GPU::

    ds = xr.open_dataset(path, engine="gds-zarr", chunks={},
                         chunked_array_type=xarray_gds.GdsDaskManager())
    type(ds.t2m.data._meta)   # cupy.ndarray

It is not registered as an ``xarray.chunkmanagers`` entry point on purpose: two
registered managers that both claim dask arrays would make xarray refuse to choose.
"""

from __future__ import annotations

from typing import Any

from xarray.namedarray.daskmanager import DaskManager

from xarray_gds import device as _device

__all__ = ["GdsDaskManager", "device_of"]


def device_of(data: Any) -> str | None:
    """The device of the xarray-gds array under xarray's lazy wrappers, if any."""
    for _ in range(16):
        where = getattr(data, "device", None)
        if where in ("cuda", "cpu") and hasattr(data, "get_array"):
            return str(where)
        if not hasattr(data, "array"):
            return None
        data = data.array
    return None


class GdsDaskManager(DaskManager):
    """xarray's dask chunk manager, with a CuPy ``meta`` for GPU-placed variables."""

    def from_array(self, data: Any, chunks: Any, **kwargs: Any) -> Any:
        if device_of(data) != "cuda":
            return super().from_array(data, chunks, **kwargs)
        import dask.array as da

        kwargs["meta"] = _device.cupy().empty((0,) * len(data.shape), dtype=data.dtype)
        return da.from_array(data, chunks, **kwargs)

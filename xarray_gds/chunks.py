"""A dask chunk manager whose blocks of GPU-placed variables are CuPy arrays.

xarray wraps lazily indexed backend arrays into dask arrays with ``meta=np.ndarray``,
and dask converts every block it slices out of them with ``np.asarray``: xarray's
indexing adapter answers that with a copy to host memory. With xarray's default
chunk manager, the blocks of ``engine="gds-zarr"`` variables are therefore decoded
on the GPU and then copied to numpy. :class:`GdsDaskManager`, registered with xarray
as the chunk manager ``"gds-dask"``, keeps everything else the same and keeps the
blocks of device variables on the device, with a CuPy ``meta``::

    ds = xr.open_dataset(path, engine="gds-zarr", chunks={}, chunked_array_type="gds-dask")
    type(ds.t2m.data._meta)                     # cupy.ndarray
    type(ds.t2m.data.blocks[0, 0, 0].compute())  # cupy.ndarray

    with xr.set_options(chunk_manager="gds-dask"):   # for every open in the block
        ds = xr.open_mfdataset(paths, engine="gds-zarr")

Why a name to choose rather than the default: xarray picks the chunk manager before
it calls a backend and tells the backend nothing about ``chunks``, and its dask
manager declares ``meta=np.ndarray`` for every backend array. Only xarray's global
``chunk_manager`` option could change that for every open, and a library must not
set another library's options. The manager never claims a dask array as its own
(:meth:`GdsDaskManager.is_chunked_array` is false): every dask array, CuPy blocks or
not, stays xarray's dask manager's, so the two registered managers never compete.
"""

from __future__ import annotations

from typing import Any

from xarray.namedarray.daskmanager import DaskManager

from xarray_gds import device as _device

__all__ = ["DeviceBlocks", "GdsDaskManager", "device_of"]


def device_of(data: Any) -> str | None:
    """The device of the xarray-gds array under xarray's lazy wrappers, if any
    (``"cuda"`` also for a CuPy array that xarray's cache already holds)."""
    for _ in range(16):
        if _device.is_device_array(data):
            return "cuda"
        where = getattr(data, "device", None)
        if where in ("cuda", "cpu") and hasattr(data, "get_array"):
            return str(where)
        if not hasattr(data, "array"):
            return None
        data = data.array
    return None


class DeviceBlocks:
    """What dask slices blocks from: xarray's lazy array, evaluated on each slice.

    xarray's indexing adapter returns another lazy wrapper when sliced; dask would
    turn it into numpy with ``np.asarray``. Here each slice is evaluated with
    ``get_duck_array`` instead, so a block is the CuPy array the engine decoded.
    """

    __slots__ = ("_data", "dtype", "ndim", "shape")

    def __init__(self, data: Any) -> None:
        self._data = data
        self.shape = tuple(data.shape)
        self.dtype = data.dtype
        self.ndim = len(self.shape)

    def __getitem__(self, key: Any) -> Any:
        values = self._data[key]
        if hasattr(values, "get_duck_array"):
            values = values.get_duck_array()
        return values

    def __getstate__(self) -> Any:
        return (self._data,)

    def __setstate__(self, state: Any) -> None:
        self.__init__(state[0])  # type: ignore[misc]


class GdsDaskManager(DaskManager):
    """xarray's dask chunk manager, keeping GPU-placed variables' blocks on the GPU.

    Registered under xarray's ``xarray.chunkmanagers`` entry point as ``"gds-dask"``:
    ``chunked_array_type="gds-dask"`` or ``xr.set_options(chunk_manager="gds-dask")``.
    """

    def is_chunked_array(self, data: Any) -> bool:
        # Only creation differs from xarray's dask manager; every existing dask array
        # stays that manager's, so that xarray never finds two managers for one type.
        return False

    def from_array(self, data: Any, chunks: Any, **kwargs: Any) -> Any:
        if super().is_chunked_array(data):  # ds.chunk() of a dask-backed variable
            return self.rechunk(data, chunks)
        if device_of(data) != "cuda":
            return super().from_array(data, chunks, **kwargs)
        import dask.array as da

        kwargs["meta"] = _device.cupy().empty((0,) * len(data.shape), dtype=data.dtype)
        kwargs["asarray"] = False  # DeviceBlocks already returns arrays
        return da.from_array(DeviceBlocks(data), chunks, **kwargs)

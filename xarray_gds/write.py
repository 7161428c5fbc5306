"""Writing datasets that live (partly) in GPU memory to Zarr.

:func:`to_zarr` takes what ``Dataset.to_zarr`` takes and accepts datasets whose
variables are CuPy arrays, dask arrays of CuPy blocks, or lazily loaded variables of
``engine="gds-zarr"``, none of which xarray's own ``to_zarr`` can write (zarr-python
encodes with numpy and CuPy refuses implicit conversion).

For now every chunk is copied to the host and encoded there by zarr-python's own
codecs, so the stores it writes are exactly those ``engine="zarr"`` writes. Encoding
on the GPU with nvCOMP is the next step (see the user guide). Dask arrays stay lazy:
each block moves to the host inside its own task, so a dataset larger than host
memory writes block by block, and ``compute=False`` works as with xarray.

Each chunk file is written whole or not at all: :class:`~xarray_gds.store.GdsStore`
inherits zarr's ``LocalStore`` writes (a temporary file renamed over the chunk).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from xarray_gds import device as _device
from xarray_gds.chunks import device_of
from xarray_gds.store import GdsStore

__all__ = ["to_host", "to_zarr"]

_warned = False


def _block_to_host(block: Any) -> Any:
    return block.get() if _device.is_device_array(block) else np.asarray(block)


def _variable_to_host(var: xr.Variable) -> tuple[xr.Variable, bool]:
    """``var`` with its values on the host, and whether they were on the device."""
    data: Any = var._data
    if hasattr(data, "dask") and hasattr(data, "map_blocks"):
        # blocks may be CuPy under a numpy meta too: convert each one in its own task
        host = data.map_blocks(
            _block_to_host, dtype=var.dtype, meta=np.empty((0,) * var.ndim, dtype=var.dtype)
        )
        return var.copy(data=host, deep=False), _device.is_device_array(data._meta)
    if device_of(data) == "cuda":
        data = data.get_duck_array()  # lazily loaded by the engine: read it now, once
    if _device.is_device_array(data):
        return var.copy(data=data.get(), deep=False), True
    return var, False  # numpy, or lazily loaded on the host: xarray writes it as it is


def to_host(ds: xr.Dataset) -> tuple[xr.Dataset, bool]:
    """``ds`` with every variable's values in host memory (dask arrays stay lazy).

    Lazily loaded variables are read (on their device) and copied; index coordinates
    are on the host already.

    Returns
    -------
    (dataset, moved)
        The host dataset (attributes and encodings kept) and whether any values were
        on the device.
    """
    moved = False
    data_vars: dict[Any, xr.Variable] = {}
    coords: dict[Any, xr.Variable] = {}
    for name, var in ds.variables.items():
        if name in ds.indexes:
            coords[name] = var
            continue
        host, on_device = _variable_to_host(var)
        moved |= on_device
        (coords if name in ds.coords else data_vars)[name] = host
    out = xr.Dataset(data_vars, coords=coords, attrs=ds.attrs)
    out.encoding = dict(ds.encoding)
    return out, moved


def to_zarr(ds: xr.Dataset, store: str | os.PathLike[str] | Any, **kwargs: Any) -> Any:
    """Write ``ds`` to a Zarr store, whichever device its variables are on.

    Parameters
    ----------
    ds : xarray.Dataset
        Variables may be numpy, CuPy, dask (of numpy or CuPy blocks), or lazily loaded
        by ``engine="gds-zarr"``.
    store : str, path or zarr Store
        A local directory is written through :class:`~xarray_gds.store.GdsStore`;
        URLs (``"s3://..."``) and Store objects go to ``Dataset.to_zarr`` unchanged.
    **kwargs
        Everything ``xarray.Dataset.to_zarr`` takes (``mode``, ``append_dim``,
        ``region``, ``encoding``, ``consolidated``, ``zarr_format``, ``compute``,
        ``write_empty_chunks``, ...), with the same meaning.

    Returns
    -------
    Whatever ``Dataset.to_zarr`` returns (a ``dask.delayed.Delayed`` with
    ``compute=False``).
    """
    global _warned
    if isinstance(store, os.PathLike) or (isinstance(store, str) and "://" not in store):
        store = GdsStore(Path(store), read_only=False)  # URLs go to xarray as they are
    host, moved = to_host(ds)
    if moved and not _warned:
        _warned = True
        warnings.warn(
            "xarray-gds: to_zarr encodes on the host for now: values are copied from the "
            "GPU and encoded by zarr-python's codecs",
            RuntimeWarning,
            stacklevel=2,
        )
    return host.to_zarr(store, **kwargs)

"""xarray-gds: open Zarr stores with xarray straight into GPU memory.

``xr.open_dataset(path, engine="gds-zarr")`` reads chunk bytes with kvikio into
device memory and hands numeric variables to xarray as CuPy arrays. Importing this
package loads no CUDA library; see :mod:`xarray_gds.device`.
"""

from __future__ import annotations

from xarray_gds.backend import GdsZarrBackendEntrypoint, open_store, placement
from xarray_gds.chunks import GdsDaskManager
from xarray_gds.device import NoCudaDeviceError, cuda_status, resolve_device
from xarray_gds.errors import (
    ChunkDecodeError,
    ConsolidatedMetadataWarning,
    HostBlocksWarning,
    HostRouteWarning,
    MetadataError,
    WriterLockWarning,
    XarrayGdsWarning,
)
from xarray_gds.loader import BatchLoader
from xarray_gds.stores.icechunk import IcechunkFallbackWarning
from xarray_gds.stores.local import GdsStore
from xarray_gds.write import to_zarr

__version__ = "0.1.0"

__all__ = [
    "BatchLoader",
    "ChunkDecodeError",
    "ConsolidatedMetadataWarning",
    "GdsDaskManager",
    "GdsStore",
    "GdsZarrBackendEntrypoint",
    "HostBlocksWarning",
    "HostRouteWarning",
    "IcechunkFallbackWarning",
    "MetadataError",
    "NoCudaDeviceError",
    "__version__",
    "cuda_status",
    "open_store",
    "placement",
    "resolve_device",
    "to_zarr",
    "WriterLockWarning",
    "XarrayGdsWarning",
]

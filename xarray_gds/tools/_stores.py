"""Writing the benchmarks' stores: a dataset appended in blocks along ``time``, then
consolidated."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xarray as xr
import zarr

__all__ = ["write_blocks"]


def write_blocks(
    path: Path, blocks: Iterable[xr.Dataset], encoding: dict[Any, Any], zarr_format: int
) -> Path:
    """Write ``blocks`` (consecutive pieces of one dataset along ``time``) to the Zarr
    store ``path``, the first with ``encoding``, and consolidate its metadata."""
    for i, ds in enumerate(blocks):
        if i == 0:
            ds.to_zarr(
                path, mode="w", zarr_format=zarr_format, encoding=encoding, consolidated=False
            )
        else:
            ds.to_zarr(path, append_dim="time", consolidated=False)
    with warnings.catch_warnings():
        # zarr-python notes, for every store, that consolidated metadata is not part of
        # the v3 spec; the engines read it, and the benchmarks open with it on purpose.
        warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")
        zarr.consolidate_metadata(path)
    return path

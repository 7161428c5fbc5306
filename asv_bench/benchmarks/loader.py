"""asv benchmarks of training batches: an epoch of xarray_gds.BatchLoader
over an ERA5-like store against the same batches read with engine="zarr" one sample at
a time (the map-style dataset of a PyTorch DataLoader, here without worker processes;
``xarray-gds bench --case loader-16x20`` runs the DataLoader with workers).

Sizes come from ``XARRAY_GDS_BENCH_GB`` (default 0.25: the 73 x 144 grid of a smoke
test; 8.3 gives 100 steps of 721 x 1440). Batches are read on the GPU when
one is usable, else on the host.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from xarray_gds import BatchLoader
from xarray_gds.device import cuda_status
from xarray_gds.tools import bench, bench_loader

SIZE = float(os.environ.get("XARRAY_GDS_BENCH_GB", "0.25"))


class _Batches:
    batch = 16
    n_vars = 20

    def setup_cache(self) -> str:
        root = Path(tempfile.mkdtemp(prefix="xarray-gds-asv-loader-"))
        return str(bench_loader.make_era5(root / "era5.zarr", int(SIZE * 1e9), self.batch))

    def setup(self, path: str) -> None:
        warnings.simplefilter("ignore", RuntimeWarning)
        device = "cuda" if cuda_status()[0] else "cpu"
        names = bench_loader.NAMES[: self.n_vars]
        ds = xr.open_dataset(path, engine="gds-zarr", device=device, consolidated=True)
        self.loader = BatchLoader(ds, variables=names, batch_size=self.batch, stack="channel")
        self.samples = bench_loader.ZarrSamples(Path(path), names)
        self.order = self.loader.batches(0)
        for batch in self.loader:  # warm: page cache, CUDA context, nvCOMP handles
            del batch

    def time_gds_loader_epoch(self, path: str) -> None:
        for batch in self.loader:
            del batch
        bench._sync()

    def time_zarr_samples_epoch(self, path: str) -> None:
        for plan in self.order:
            batch: Any = np.stack([self.samples[int(i)] for i in plan])
            del batch


class Loader16x20(_Batches):
    batch = 16
    n_vars = 20


class Loader4x4(_Batches):
    batch = 4
    n_vars = 4

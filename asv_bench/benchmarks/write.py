"""asv benchmark: writing a CuPy dataset with zstd, xarray_gds.to_zarr (nvCOMP) against
``ds.as_numpy().to_zarr()`` (zarr-python). Size from ``XARRAY_GDS_BENCH_GB``."""

from __future__ import annotations

import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xarray_gds.device import cuda_status
from xarray_gds.tools import bench

from .read import SIZE


class WriteZstd4MB:
    timeout = 600

    def setup_cache(self) -> str:
        root = Path(tempfile.mkdtemp(prefix="xarray-gds-asv-"))
        path = root / "data.zarr"
        bench.make_store(path, int(SIZE * 1e9), chunk_bytes=4 << 20)
        return str(path)

    def setup(self, path: str) -> None:
        if not cuda_status()[0]:
            raise NotImplementedError("no GPU")
        warnings.simplefilter("ignore", RuntimeWarning)
        self.writers: dict[str, Callable[[], Any]] = bench._write_contenders(Path(path))

    def teardown(self, path: str) -> None:
        shutil.rmtree(Path(path).with_name("data-written.zarr"), ignore_errors=True)

    def time_gds_zarr(self, path: str) -> None:
        self.writers["gds-zarr"]()
        bench._sync()

    def time_zarr_as_numpy(self, path: str) -> None:
        self.writers["zarr"]()
        bench._sync()

"""asv benchmarks: open + load with engine="gds-zarr" against engine="zarr".

Run from asv_bench/: ``asv run --python=same --quick``. Sizes come from
``XARRAY_GDS_BENCH_GB`` (default 0.25; the H200 figures in docs/performance.md use
2). GPU cases are skipped (NotImplementedError) where no GPU is usable.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import ClassVar

import xarray as xr

from xarray_gds.device import cuda_status
from xarray_gds.tools import bench

SIZE = float(os.environ.get("XARRAY_GDS_BENCH_GB", "0.25"))


class _Store:
    store_kwargs: ClassVar[dict] = {}
    scale = 1.0
    gpu = True

    def setup_cache(self) -> str:
        root = Path(tempfile.mkdtemp(prefix="xarray-gds-asv-"))
        path = root / "data.zarr"
        bench.make_store(path, int(SIZE * self.scale * 1e9), **self.store_kwargs)
        return str(path)

    def setup(self, path: str) -> None:
        if self.gpu and not cuda_status()[0]:
            raise NotImplementedError("no GPU")
        warnings.simplefilter("ignore", RuntimeWarning)
        _ = xr.open_dataset(path, engine="zarr").t.values  # warm the page cache

    def time_gds_zarr(self, path: str) -> None:
        bench._load_gds(Path(path), "cuda" if self.gpu else "cpu")
        bench._sync()

    def time_zarr(self, path: str) -> None:
        bench._load_zarr(Path(path), self.gpu)
        bench._sync()


class Zstd4MB(_Store):
    store_kwargs: ClassVar[dict] = {"chunk_bytes": 4 << 20}

    def time_raw_limit(self, path: str) -> None:
        bench.raw_limit(Path(path))
        bench._sync()


class ZstdSharded256KiB(_Store):
    store_kwargs: ClassVar[dict] = {"chunk_bytes": 256 << 10, "shard_bytes": 16 << 20}


class BloscV2_4MB(_Store):
    """zarr-python 2's default compressor (Blosc lz4, byte shuffle)."""

    store_kwargs: ClassVar[dict] = {"chunk_bytes": 4 << 20, "zarr_format": 2, "compressor": "blosc"}


class MfDataset50:
    """open_mfdataset over 50 stores and a mean over time (one dask block per store)."""

    def setup_cache(self) -> list[str]:
        root = Path(tempfile.mkdtemp(prefix="xarray-gds-asv-"))
        first = bench.make_store(root / "part.zarr", int(SIZE * 0.02 * 1e9), 256 << 10)
        return [str(p) for p in bench._copies(first, 50)]

    def setup(self, paths: list[str]) -> None:
        if not cuda_status()[0]:
            raise NotImplementedError("no GPU")
        warnings.simplefilter("ignore")

    def time_gds_zarr(self, paths: list[str]) -> None:
        bench._mean_gds([Path(p) for p in paths])
        bench._sync()

    def time_zarr_as_cupy(self, paths: list[str]) -> None:
        bench._mean_zarr([Path(p) for p in paths])
        bench._sync()


class SmallChunks(_Store):
    store_kwargs: ClassVar[dict] = {"chunk_bytes": 1 << 10}
    scale = 0.05


class HostZstd4MB(_Store):
    store_kwargs: ClassVar[dict] = {"chunk_bytes": 4 << 20}
    gpu = False


def teardown_cache(path: str) -> None:  # pragma: no cover - asv hook name
    shutil.rmtree(Path(path).parent, ignore_errors=True)


class Usage:
    """The ways users load data, each the same call through both engines:
    the usage-* cases of ``xarray-gds bench`` (see ``bench.CASES``)."""

    params: ClassVar[list[str]] = [
        "usage-eager-2var",
        "usage-chunks-2var",
        "usage-async-2var",
        "usage-step-1chunk",
        "usage-step-16chunks",
        "usage-step-20vars",
        "usage-sharded-chunks",
        "usage-sharded-shards",
        "usage-blosc-chunks",
    ]
    param_names: ClassVar[list[str]] = ["case"]

    def setup_cache(self) -> dict[str, str]:
        root = Path(tempfile.mkdtemp(prefix="xarray-gds-asv-"))
        paths = {}
        for case in self.params:
            spec = bench.CASES[case]
            path = root / f"{case}.zarr"
            bench.make_store(path, int(SIZE * spec["scale"] * 1e9), **spec["store"])
            paths[case] = str(path)
        return paths

    def setup(self, paths: dict[str, str], case: str) -> None:
        if not cuda_status()[0]:
            raise NotImplementedError("no GPU")
        warnings.simplefilter("ignore")
        self.contenders = bench.CASES[case]["contenders"](Path(paths[case]))

    def time_gds_zarr(self, paths: dict[str, str], case: str) -> None:
        self.contenders["gds-zarr"]()
        bench._sync()

    def time_zarr(self, paths: dict[str, str], case: str) -> None:
        self.contenders["zarr"]()
        bench._sync()


class NetcdfRefs:
    """A NetCDF4 file (zlib 1 + shuffle) read through its kerchunk references:
    gds-zarr against h5netcdf and engine="zarr" over the same references, eager
    and with ``chunks={}`` (the ``netcdf-refs`` case of ``xarray-gds bench``)."""

    params: ClassVar[list[str]] = [
        "gds-zarr",
        "gds-zarr chunks={}",
        "h5netcdf",
        "zarr",
        "h5netcdf chunks={}",
        "zarr chunks={}",
    ]
    param_names: ClassVar[list[str]] = ["reader"]

    def setup_cache(self) -> tuple[str, str]:
        from xarray_gds.tools import bench_refs

        root = Path(tempfile.mkdtemp(prefix="xarray-gds-asv-"))
        spec = bench.CASES["netcdf-refs"]
        store = bench.make_store(root / "data.zarr", int(SIZE * 1e9), **spec["store"])
        nc, refs = bench_refs.prepare(store)
        return str(nc), str(refs)

    def setup(self, files: tuple[str, str], reader: str) -> None:
        if not cuda_status()[0]:
            raise NotImplementedError("no GPU")
        from xarray_gds.tools import bench_refs

        warnings.simplefilter("ignore")
        self.load = bench_refs.readers(Path(files[0]), Path(files[1]))[reader]

    def time_load(self, files: tuple[str, str], reader: str) -> None:
        self.load()
        bench._sync()

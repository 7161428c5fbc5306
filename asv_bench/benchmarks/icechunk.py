"""asv benchmarks of Icechunk reads: every variable of an Icechunk repository
on local filesystem storage (two float32 variables, 4 MiB zstd chunks) loaded from one
read-only session, by engine="gds-zarr" (chunks read where Icechunk says they lie)
against engine="zarr" on the same session (``IcechunkStore.get``), eagerly and with
``chunks={}``; ``xarray-gds bench --case icechunk-2var`` runs the same loads.

Sizes come from ``XARRAY_GDS_BENCH_GB`` (default 0.25; the documented figures use 2). The
loads go to the GPU (CuPy, ``cupy.asarray`` after engine="zarr") when one is usable;
without one they stay on the host, at a fiftieth of the size (a smoke test, as the
``host-icechunk-2var`` bench case). Skipped (NotImplementedError) without ``icechunk``.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from xarray_gds.device import cuda_status
from xarray_gds.tools import bench, bench_icechunk

SIZE = float(os.environ.get("XARRAY_GDS_BENCH_GB", "0.25"))
HOST_SCALE = 0.02  #: the part of SIZE written when the loads stay on the host


def _icechunk() -> Any:
    try:
        import icechunk
    except ImportError as err:
        raise NotImplementedError("icechunk is not installed") from err
    if not hasattr(icechunk, "Repository"):  # this file, found first on sys.path
        raise NotImplementedError(
            "'import icechunk' found this benchmark module (asv_bench/benchmarks is on "
            "sys.path): run asv from asv_bench/, which imports it as benchmarks.icechunk"
        )
    return icechunk


class IcechunkLocal2Var:
    """gds-zarr against engine="zarr" on one Icechunk session, eager and chunks={}."""

    timeout = 600

    def setup_cache(self) -> str:
        _icechunk()
        gpu = cuda_status()[0]
        root = Path(tempfile.mkdtemp(prefix="xarray-gds-asv-icechunk-"))
        nbytes = int(SIZE * (1.0 if gpu else HOST_SCALE) * 1e9)
        store = bench.make_store(root / "data.zarr", nbytes, 4 << 20, variables=2)
        bench_icechunk.to_repository(store)
        return str(store.with_name(f"{store.stem}.icechunk"))

    def setup(self, path: str) -> None:
        icechunk = _icechunk()
        warnings.simplefilter("ignore", RuntimeWarning)
        self.device = "cuda" if cuda_status()[0] else "cpu"
        self.repo = icechunk.Repository.open(icechunk.local_filesystem_storage(path))
        bench_icechunk._load(self.repo, "zarr", "cpu", None)  # warm the page cache

    def _load(self, engine: str, chunks: dict[str, Any] | None) -> None:
        bench_icechunk._load(self.repo, engine, self.device, chunks)
        bench._sync()

    def time_gds_zarr(self, path: str) -> None:
        self._load("gds-zarr", None)

    def time_gds_zarr_chunks(self, path: str) -> None:
        self._load("gds-zarr", {})

    def time_zarr(self, path: str) -> None:
        self._load("zarr", None)

    def time_zarr_chunks(self, path: str) -> None:
        self._load("zarr", {})

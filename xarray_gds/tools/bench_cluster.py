"""The ``multi-gpu-mfdataset`` case of ``xarray-gds bench``: one reduction over many
stores computed on a dask cluster of 1, 2, 4 and 8 GPUs, against ``engine="zarr"`` on
a CPU cluster of the same machine.

Each GPU count the machine has (``cupy.cuda.runtime.getDeviceCount()``) gets a
``dask_cuda.LocalCUDACluster`` with one worker per GPU; the counts above it are left
out and named in the case's note. The contender opens every store with
``open_mfdataset(..., engine="gds-zarr", parallel=True)`` (the opens run on the
workers), one dask block per store, and computes ``ds.t.mean()``: each worker reads
and decodes its share of the blocks on its own GPU (``xarray_gds.fuse`` makes at least
one joined group a worker) and only partial sums travel. The baseline opens the same
stores with ``engine="zarr"`` on a ``distributed.LocalCluster`` using every CPU core
(as many worker processes as the most GPUs tried, the cores shared out between them).
On a machine without a GPU the engine's contenders run on the host (one and two worker
processes): a smoke test of the case, not a figure.

A cluster is started by a contender's first (warm-up) run and kept for its timed runs;
only one is alive at a time (a GPU serves one cluster), and the last one is closed
when the case's note is written.
"""

from __future__ import annotations

import atexit
import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from xarray_gds import device as _device

__all__ = ["GPU_COUNTS", "contenders", "note"]

#: GPU counts the case tries, those the machine has
GPU_COUNTS = (1, 2, 4, 8)

#: one dask block per store, and combine options that load nothing to compare
_OPTIONS: dict[str, Any] = {
    "combine": "nested",
    "concat_dim": "time",
    "chunks": {"time": -1, "y": -1, "x": -1},
    "data_vars": "minimal",
    "coords": "minimal",
    "compat": "override",
}


class _Clusters:
    """The one cluster alive, and what the case has measured."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.cluster: Any = None
        self.client: Any = None
        self.values: dict[str, float] = {}  #: contender -> the mean it computed
        self.skipped: list[int] = []  #: GPU counts the machine lacks
        self.gpus: list[int] = []  #: GPU counts tried
        self.baseline = ""

    def use(self, key: tuple[Any, ...], start: Callable[[], Any]) -> Any:
        if key != self.key:
            self.close()
            import distributed

            self.cluster = start()
            self.client = distributed.Client(self.cluster)
            self.client.wait_for_workers(len(self.cluster.workers), timeout=300)
            self.key = key
        return self.client

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        self.key = self.cluster = self.client = None


_CLUSTERS = _Clusters()
atexit.register(_CLUSTERS.close)


def _cuda_cluster(n: int) -> Any:
    try:
        import dask_cuda
    except ImportError as err:
        raise ImportError(
            f"the multi-gpu-mfdataset case needs dask-cuda ({err}); "
            "`pip install dask-cuda` (or choose other cases)"
        ) from err
    return dask_cuda.LocalCUDACluster(n_workers=n, dashboard_address=None)


def _cpu_cluster(workers: int, threads: int) -> Any:
    import distributed

    return distributed.LocalCluster(
        n_workers=workers, threads_per_worker=threads, processes=True, dashboard_address=None
    )


def _mean(
    paths: list[Path],
    label: str,
    engine: str,
    device: str | None,
    cluster: tuple[Any, ...],
    start: Callable[[], Any],
) -> float:
    """``ds.t.mean()`` of every store on ``cluster`` (started by ``start`` unless it is
    the one alive); the opens too run on the workers."""
    kw: dict[str, Any] = {}
    if engine == "gds-zarr":
        from xarray_gds.chunks import GdsDaskManager

        kw = {"device": device, "chunked_array_type": GdsDaskManager()}
    try:
        _CLUSTERS.use(cluster, start)
        ds = xr.open_mfdataset(paths, engine=engine, parallel=True, **_OPTIONS, **kw)
        value = float(np.asarray(_device.to_host(ds["t"].mean().compute().data)))
    except BaseException:
        # a failed contender closes its cluster: left open, its client would stay
        # dask's default scheduler for everything the process computes afterwards
        _CLUSTERS.close()
        raise
    _CLUSTERS.values[label] = value
    return value


def _gpu_label(n: int) -> str:
    return f"gds-zarr, {n} GPU" + ("s" if n > 1 else "")


def contenders(paths: list[Path]) -> dict[str, Callable[[], Any]]:
    """The case's contenders: the engine on each GPU count the machine has (on the host
    without a GPU), then ``"zarr"`` on a CPU cluster of every core."""
    state = _CLUSTERS
    state.close()
    state.values.clear()
    out: dict[str, Callable[[], Any]] = {}
    cuda, _ = _device.cuda_status()
    if cuda:
        visible = int(_device.cupy().cuda.runtime.getDeviceCount())
        state.gpus = [n for n in GPU_COUNTS if n <= visible]
        state.skipped = [n for n in GPU_COUNTS if n > visible]
        for n in state.gpus:
            label = _gpu_label(n)
            start = functools.partial(_cuda_cluster, n)
            out[label] = functools.partial(
                _mean, paths, label, "gds-zarr", "cuda", ("cuda", n), start
            )
        most = max(state.gpus)
    else:
        state.gpus, state.skipped = [], list(GPU_COUNTS)
        for n in (1, 2):
            label = f"gds-zarr, host, {n} worker" + ("s" if n > 1 else "")
            start = functools.partial(_cpu_cluster, n, 1)
            out[label] = functools.partial(
                _mean, paths, label, "gds-zarr", "cpu", ("cpu", n, 1), start
            )
        most = 2
    cores = os.cpu_count() or 1
    workers = min(most, cores)
    threads = max(1, cores // workers)
    state.baseline = f"zarr: CPU LocalCluster of {workers} workers x {threads} threads"
    start = functools.partial(_cpu_cluster, workers, threads)
    out["zarr"] = functools.partial(
        _mean, paths, "zarr", "zarr", None, ("zarr", workers, threads), start
    )
    return out


def note(result: Any) -> str:
    """Scaling against one GPU, the counts left out, the baseline's cluster, and how
    far each contender's mean is from engine="zarr"'s; closes the last cluster."""
    state = _CLUSTERS
    state.close()
    parts = []
    one = _gpu_label(1)
    if one in result.seconds:
        for n in state.gpus[1:]:
            speedup = result.seconds[one] / result.seconds[_gpu_label(n)]
            parts.append(f"{n} GPUs: {speedup:.2f}x one GPU (efficiency {speedup / n:.2f})")
    if state.skipped:
        counts = ", ".join(str(n) for n in state.skipped)
        parts.append(f"not run ({counts} GPUs): the machine has {max(state.gpus, default=0)}")
    parts.append(state.baseline)
    want = state.values.get("zarr")
    if want is not None:
        worst = max(
            (abs(v - want) / max(abs(want), 1e-30) for k, v in state.values.items()),
            default=0.0,
        )
        parts.append(f"means agree with zarr to {worst:.1e} (relative)")
        if not all(math.isfinite(v) for v in state.values.values()):
            parts.append("a mean is not finite")
    return "; ".join(parts)

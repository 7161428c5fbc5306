"""One dataset read across a cluster: every worker reads its own share, on its own GPU.

CPU tests run a ``distributed.LocalCluster`` of two worker processes (one thread each):
values as engine="zarr", each chunk file read once across the workers, each worker's
reads joined into batches (``xarray_gds.fuse``) and spread over the workers, and a
worker killed mid-compute replaced without changing the answer. GPU tests run
``dask_cuda.LocalCUDACluster``: one worker on one GPU (the device of every block), and
one worker per visible GPU (skipped with fewer than two).

Reads are counted in the worker processes by a recorder around the engine's one batch
read (``xarray_gds.coalesce._read``): every file a batch reads, with the worker's
process id and current GPU.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from xarray_gds import fuse

from .conftest import sample_dataset, write_store

pytest.importorskip("dask.array")  # the dask extra
distributed = pytest.importorskip("distributed")

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore:In a future version of xarray:FutureWarning"),
]

#: joined dask groups need dask's task-spec graphs (absent from the oldest dask claimed)
needs_fuse = pytest.mark.skipif(
    not fuse.available(), reason="dask < 2024.12: no task-spec graphs, blocks are not fused"
)

#: combine options that compare nothing (xarray's announced future defaults), so that
#: opening reads nothing but the index coordinates
MINIMAL: dict[str, Any] = {"data_vars": "minimal", "coords": "minimal", "compat": "override"}

N_STORES = 4


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four zstd stores of the sample dataset, one after the other in time."""
    root = tmp_path_factory.mktemp("multi")
    paths = []
    for i in range(N_STORES):
        ds = sample_dataset(seed=i)
        ds = ds.assign_coords(time=ds.time + np.timedelta64(10 * 6 * i, "h"))
        paths.append(write_store(root / f"s{i}.zarr", 3, "zstd", ds))
    return paths


# -- reads recorded in the worker processes -----------------------------------------


def _recorder() -> tuple[Callable[[Any], None], Callable[[], list[Any]], Callable[[], None]]:
    """(install, take, clear) to run on workers with ``client.run``. Defined inside a
    function so that they travel by value (workers need not import the tests)."""

    def install(meet: Any) -> None:
        from xarray_gds import coalesce

        coalesce._test_meet = meet  # type: ignore[attr-defined]
        if getattr(coalesce, "_test_reads", None) is not None:
            return
        real = coalesce._read
        log: list[tuple[int, int, list[str]]] = []

        def read(group: list[Any]) -> Any:
            gpu = group[0].gpu if group[0].decode_on_device else -1
            log.append((os.getpid(), gpu, [str(p) for r in group for p in r.paths]))
            meet = coalesce._test_meet  # type: ignore[attr-defined]
            if meet is not None:  # this worker's first read: wait until every worker reads
                coalesce._test_meet = None  # type: ignore[attr-defined]
                meet.wait(60)  # BrokenBarrierError (the test fails) if one never does
            return real(group)

        coalesce._read = read  # type: ignore[assignment]
        coalesce._test_reads = log  # type: ignore[attr-defined]

    def take() -> list[Any]:
        from xarray_gds import coalesce

        return list(getattr(coalesce, "_test_reads", None) or [])

    def clear() -> None:
        from xarray_gds import coalesce

        getattr(coalesce, "_test_reads", []).clear()

    return install, take, clear


class Reads:
    """The batches the engine read on each worker since the last :meth:`clear`.

    :meth:`meet` makes the first read of each worker wait until every worker has begun
    one (a barrier shared by the worker processes): the tiny test stores read in
    milliseconds, and a worker done with its group could otherwise take the next one
    from the scheduler's queue before the other worker got to it (the queue also holds
    the reduction's own root tasks), which is the scheduler's choice to make. While a
    worker waits there, its thread is busy, and the scheduler hands the next group to
    the other worker."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._install, self._take, self._clear = _recorder()
        client.run(self._install, None)

    def meet(self, manager: Any) -> None:
        """The next read of each worker waits for the first read of every worker."""
        parties = len(self.client.run(os.getpid))  # the workers
        self.client.run(self._install, manager.Barrier(parties))

    def clear(self) -> None:
        self.client.run(self._clear)

    def batches(self) -> dict[str, list[tuple[int, int, list[str]]]]:
        """Worker address -> its batches (pid, GPU or -1, files)."""
        return dict(self.client.run(self._take))

    def files(self) -> Counter[str]:
        return Counter(p for bs in self.batches().values() for _, _, paths in bs for p in paths)


@pytest.fixture(scope="module")
def manager() -> Iterator[Any]:
    """A multiprocessing manager: its barriers are shared with the worker processes."""
    import multiprocessing

    with multiprocessing.Manager() as m:
        yield m


def _chunk_files(stores: list[Path], names: list[str]) -> set[str]:
    """The chunk files on disk of variables ``names`` in ``stores``."""
    return {str(p) for s in stores for n in names for p in (s / n / "c").rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=60)
        yield client


@pytest.fixture
def reads(client: Any) -> Reads:
    recorder = Reads(client)
    recorder.clear()
    return recorder


# -- CPU: a LocalCluster of two processes -------------------------------------------


def test_mfdataset_on_cluster_matches_zarr(stores: list[Path], client: Any, reads: Reads) -> None:
    gds = xr.open_mfdataset(stores, engine="gds-zarr", device="cpu", parallel=True, **MINIMAL)
    ref = xr.open_mfdataset(stores, engine="zarr", parallel=True, **MINIMAL)
    names = ["t2m", "u10", "qc", "u16"]
    xr.testing.assert_identical(gds[names].compute(), ref[names].compute())
    got = gds[["t2m", "u10"]].mean("time").compute()
    xr.testing.assert_identical(got, ref[["t2m", "u10"]].mean("time").compute())
    assert isinstance(got.t2m.data, np.ndarray)
    # the workers read the chunks; this process read none
    assert sum(len(b) for b in reads.batches().values()) > 0


def test_nothing_is_read_twice(stores: list[Path], client: Any, reads: Reads) -> None:
    gds = xr.open_mfdataset(stores, engine="gds-zarr", device="cpu", parallel=True, **MINIMAL)
    ref = xr.open_mfdataset(stores, engine="zarr", parallel=True, **MINIMAL)
    reads.clear()  # opening read the index coordinates
    names = ["t2m", "u10"]
    got = gds[names].mean("time").compute()
    xr.testing.assert_identical(got, ref[names].mean("time").compute())
    files = reads.files()
    twice = sorted(p for p, n in files.items() if n > 1)
    assert not twice, f"read more than once: {twice}"
    on_disk = _chunk_files(stores, names)
    assert on_disk <= set(files)  # every chunk of both variables was read ...
    # ... and nothing else but the 2-D coordinate the result keeps (from the first
    # store: compat="override"); a missing chunk is asked for, and not found
    kept = [*names, "area"]
    other = [p for p in files if not any(f"/{n}/c/" in p for n in kept)]
    assert not other, other


def test_workers_read_their_own_share(
    stores: list[Path], client: Any, reads: Reads, manager: Any
) -> None:
    gds = xr.open_mfdataset(stores, engine="gds-zarr", device="cpu", parallel=True, **MINIMAL)
    reads.clear()
    reads.meet(manager)
    gds.t2m.sum().compute()
    batches = reads.batches()
    counts = {w: len(b) for w, b in batches.items()}
    assert all(counts.values()), f"a worker read nothing: {counts}"
    files = {w: {p for _, _, ps in b for p in ps} for w, b in batches.items()}
    first, second = files.values()
    assert not first & second  # no chunk read by both


@needs_fuse
def test_each_worker_joins_its_reads(
    stores: list[Path], client: Any, reads: Reads, manager: Any
) -> None:
    gds = xr.open_mfdataset(stores, engine="gds-zarr", device="cpu", parallel=True, **MINIMAL)
    ref = xr.open_mfdataset(stores, engine="zarr", parallel=True, **MINIMAL)
    reads.clear()
    reads.meet(manager)
    t2m = gds.t2m.reset_coords(drop=True)  # t2m's blocks only (not the 2-D coordinate)
    got = t2m.mean("time").compute()
    xr.testing.assert_identical(got, ref.t2m.reset_coords(drop=True).mean("time").compute())
    batches = reads.batches()
    n_blocks = t2m.data.npartitions
    assert n_blocks == N_STORES * 27  # one dask block a stored chunk
    # one group a worker (fuse: at least as many groups as workers), each read in one
    # batch of all its blocks' files, whatever store they come from
    assert {w: len(b) for w, b in batches.items()} == dict.fromkeys(batches, 1)
    sizes = sorted(len(paths) for b in batches.values() for _, _, paths in b)
    assert sum(sizes) == n_blocks and min(sizes) > 1


@needs_fuse
def test_groups_are_a_multiple_of_the_workers(
    stores: list[Path], client: Any, reads: Reads, manager: Any
) -> None:
    gds = xr.open_mfdataset(stores, engine="gds-zarr", device="cpu", parallel=True, **MINIMAL)
    ref = xr.open_mfdataset(stores, engine="zarr", parallel=True, **MINIMAL)
    reads.clear()
    reads.meet(manager)
    per_store = gds.t2m.nbytes // N_STORES
    # groups of about one store's bytes at most: 4 groups (a multiple of 2 workers)
    with zarr.config.set({"xarray_gds.fuse_bytes": per_store}):
        got = gds.t2m.reset_coords(drop=True).sum("time").compute()
    xr.testing.assert_identical(got, ref.t2m.reset_coords(drop=True).sum("time").compute())
    batches = reads.batches()
    assert sum(len(b) for b in batches.values()) == 4
    assert all(batches.values())
    assert not [p for p, n in reads.files().items() if n > 1]


# u16 is stored in chunks of 3 time steps: xarray notes that blocks of 4 split them
@pytest.mark.filterwarnings("ignore:The specified chunks separate:UserWarning")
def test_open_dataset_chunks_spread_over_workers(
    stores: list[Path], client: Any, reads: Reads, manager: Any
) -> None:
    """One store, one array: its groups still go to both workers (they depend on no
    task that one worker holds)."""
    gds = xr.open_dataset(stores[0], engine="gds-zarr", device="cpu", chunks={"time": 4})
    ref = xr.open_dataset(stores[0], engine="zarr", chunks={"time": 4})
    reads.clear()
    reads.meet(manager)
    got = gds.t2m.mean(("lat", "lon")).compute()
    xr.testing.assert_identical(got, ref.t2m.mean(("lat", "lon")).compute())
    batches = reads.batches()
    assert all(batches.values()), {w: len(b) for w, b in batches.items()}
    files = reads.files()
    assert not [p for p, n in files.items() if n > 1]
    assert _chunk_files(stores[:1], ["t2m"]) <= set(files)


def test_a_killed_worker_is_replaced(stores: list[Path], manager: Any) -> None:
    """A worker process killed while it reads: its nanny starts a new one, the
    scheduler runs the lost tasks again, and the answer is the same."""
    reading = manager.Queue()  # the pids of the workers whose read began
    hold = manager.Event()  # set once the victim is killed: the others read on

    def held_reads(reading: Any, hold: Any) -> None:  # on the workers
        from xarray_gds import coalesce

        real = coalesce._read

        def read(group: list[Any]) -> Any:
            reading.put(os.getpid())
            hold.wait()
            return real(group)

        coalesce._read = read  # type: ignore[assignment]

    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=60)
        gds = xr.open_mfdataset(stores, engine="gds-zarr", device="cpu", parallel=True, **MINIMAL)
        ref = xr.open_mfdataset(stores, engine="zarr", parallel=True, **MINIMAL)
        before = set(client.run(os.getpid).values())
        client.run(held_reads, reading, hold)
        future = client.compute(gds[["t2m", "u10"]].mean("time"))
        victim = reading.get(timeout=60)  # queue.Empty (a failure) if no read begins
        assert victim in before
        os.kill(victim, signal.SIGKILL)  # a worker process this test's cluster started
        hold.set()
        got = future.result(timeout=120)
        client.wait_for_workers(2, timeout=60)
        after = set(client.run(os.getpid).values())
    assert victim not in after and len(after) == 2  # replaced
    xr.testing.assert_identical(got, ref[["t2m", "u10"]].mean("time").compute())


# -- GPU: dask-cuda ------------------------------------------------------------------


def _block_report() -> Callable[[Any], dict[str, Any]]:
    def report(block: Any) -> dict[str, Any]:
        import cupy

        current = cupy.cuda.Device()
        on_gpu = isinstance(block, cupy.ndarray)
        return {
            "pid": os.getpid(),
            "cupy": on_gpu,
            "device": block.device.id if on_gpu else None,
            "bus": cupy.cuda.Device(block.device.id).pci_bus_id if on_gpu else None,
            "current": current.id,
            "worker_bus": current.pci_bus_id,
        }

    return report


def _every_block(var: xr.DataArray, client: Any) -> list[dict[str, Any]]:
    """Where each dask block of ``var`` lies when a worker computes it."""
    import dask

    report = dask.delayed(_block_report(), pure=False)
    return list(client.compute([report(b) for b in var.data.to_delayed().ravel()], sync=True))


def _cuda_cluster(n_workers: int | None) -> Any:
    dask_cuda = pytest.importorskip("dask_cuda")
    kw: dict[str, Any] = {"dashboard_address": None}
    if n_workers is not None:
        kw["n_workers"] = n_workers
    return dask_cuda.LocalCUDACluster(**kw)


def _check_on_cluster(stores: list[Path], client: Any, n_gpus: int) -> None:
    import multiprocessing

    reads = Reads(client)
    on_gpu = {"chunked_array_type": "gds-dask"}
    gds = xr.open_mfdataset(
        stores, engine="gds-zarr", device="cuda", parallel=True, **MINIMAL, **on_gpu
    )
    ref = xr.open_mfdataset(stores, engine="zarr", parallel=True, **MINIMAL)
    names = ["t2m", "u10", "qc", "u16"]
    # every block a CuPy array on the GPU current in the worker that computed it
    for name in names:
        where = _every_block(gds[name], client)
        assert all(w["cupy"] for w in where), name
        assert all(w["device"] == w["current"] and w["bus"] == w["worker_bus"] for w in where)
    # each worker reads on its own GPU: as many GPUs as workers that read
    reads.clear()
    with multiprocessing.Manager() as manager:
        reads.meet(manager)
        got = gds[names].compute()
    xr.testing.assert_identical(got.as_numpy(), ref[names].compute())
    batches = reads.batches()
    assert len(batches) == n_gpus
    # read into device memory and decoded by nvCOMP on the worker's current GPU
    assert all(gpu == 0 for b in batches.values() for _, gpu, _ in b), batches
    buses = set(client.run(lambda: __import__("cupy").cuda.Device().pci_bus_id).values())
    assert len(buses) == n_gpus  # one GPU a worker
    if fuse.available():
        assert all(batches.values()), {w: len(b) for w, b in batches.items()}
    files = reads.files()
    assert not [p for p, n in files.items() if n > 1]
    assert _chunk_files(stores, names) <= set(files)
    mean = gds[["t2m", "u10"]].mean("time").compute()
    assert hasattr(mean.t2m.data, "__cuda_array_interface__")
    xr.testing.assert_allclose(mean.as_numpy(), ref[["t2m", "u10"]].mean("time").compute())
    # open_dataset(chunks=...) of one store, also on every worker's own GPU
    one = xr.open_dataset(stores[0], engine="gds-zarr", chunks={"time": 2}, **on_gpu)
    where = _every_block(one.t2m, client)
    assert all(w["cupy"] and w["bus"] == w["worker_bus"] for w in where)
    want = xr.open_dataset(stores[0], engine="zarr", chunks={"time": 2}).t2m.compute()
    xr.testing.assert_identical(one.t2m.compute().as_numpy(), want)


@pytest.fixture
def nvcomp_on_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers decode with nvCOMP (small test stores would take the host route); the
    workers inherit the environment."""
    if not os.environ.get("XARRAY_GDS_ROUTE"):
        monkeypatch.setenv("XARRAY_GDS_ROUTE", "gpu")


@pytest.mark.gpu
def test_local_cuda_cluster_one_gpu(stores: list[Path], nvcomp_on_workers: None) -> None:
    with _cuda_cluster(1) as cluster, distributed.Client(cluster) as client:
        _check_on_cluster(stores, client, 1)


@pytest.mark.gpu
def test_local_cuda_cluster_every_gpu(
    tmp_path: Path, stores: list[Path], nvcomp_on_workers: None
) -> None:
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if n < 2:
        pytest.skip(f"needs >= 2 GPUs, found {n}")
    more = list(stores)
    for i in range(N_STORES, 2 * n):  # at least two stores a GPU
        ds = sample_dataset(seed=i)
        ds = ds.assign_coords(time=ds.time + np.timedelta64(10 * 6 * i, "h"))
        more.append(write_store(tmp_path / f"s{i}.zarr", 3, "zstd", ds))
    with _cuda_cluster(None) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(n, timeout=120)
        _check_on_cluster(more, client, n)


@pytest.mark.gpu
def test_one_process_reads_on_each_current_gpu(stores: list[Path]) -> None:
    """Without a cluster: a read follows the current device; a thread that read on
    GPU 0 keeps separate nvCOMP state for GPU 1 (nvCOMP codecs and streams belong to
    one device)."""
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if n < 2:
        pytest.skip(f"needs >= 2 GPUs, found {n}")
    want = xr.open_dataset(stores[0], engine="zarr").t2m.values
    with zarr.config.set({"xarray_gds.route": "gpu"}):
        for gpu in [0, *range(n), 0]:
            with cupy.cuda.Device(gpu):
                got = xr.open_dataset(stores[0], engine="gds-zarr", device="cuda").t2m.data
                assert isinstance(got, cupy.ndarray) and got.device.id == gpu
                np.testing.assert_array_equal(got.get(), want)


# -- the benchmark case -------------------------------------------------------------


def test_bench_multi_gpu_case_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``xarray-gds bench --case multi-gpu-mfdataset`` end to end on tiny stores: on a
    machine without a GPU the engine runs on host clusters of one and two workers,
    and the GPU counts the machine lacks are named."""
    import json

    from xarray_gds import device as _device
    from xarray_gds.tools import bench, cli

    if _device.cuda_status()[0]:
        pytest.importorskip("dask_cuda", reason="on a GPU the case runs dask_cuda clusters")
    spec = bench.CASES["multi-gpu-mfdataset"]
    assert spec["stores"] >= 50 and spec.get("named_only")
    monkeypatch.setitem(spec, "stores", 6)  # tiny: 6 stores of 16 KiB chunks
    monkeypatch.setitem(spec, "store", {"chunk_bytes": 16 << 10})
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--case", "multi-gpu-mfdataset", "--size-gb", "0.001", "--repeat", "1"]
    assert cli.main([*argv, "--dir", str(tmp_path), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    (result,) = json.loads(out_json.read_text())["results"]
    labels = set(result["seconds"])
    assert "zarr" in labels and all(v > 0 for v in result["seconds"].values())
    if labels == {"gds-zarr, host, 1 worker", "gds-zarr, host, 2 workers", "zarr"}:
        assert "not run (1, 2, 4, 8 GPUs)" in result["note"]
    else:  # on a GPU machine: the GPU counts it has
        assert "gds-zarr, 1 GPU" in labels
    assert "means agree with zarr to" in result["note"]
    worst = float(result["note"].split("means agree with zarr to ")[1].split()[0])
    assert worst < 1e-5
    assert "| multi-gpu-mfdataset |" in out


def test_bench_cluster_closed_when_a_contender_fails(tmp_path: Path) -> None:
    """A contender that fails on its cluster closes it: left open, its client would stay
    dask's default scheduler, and every later computation of the process (other
    cases, other tests) would run on that cluster's workers."""
    distributed = pytest.importorskip("distributed")
    from xarray_gds.tools import bench_cluster

    def default() -> object:
        try:
            return distributed.default_client()
        except ValueError:  # no client at all
            return None

    before = default()
    contenders = bench_cluster.contenders([tmp_path / "missing.zarr"])
    first = next(iter(contenders.values()))
    with pytest.raises(FileNotFoundError):
        first()
    assert bench_cluster._CLUSTERS.client is None and bench_cluster._CLUSTERS.cluster is None
    assert default() is before  # the failed contender's client is no longer the default

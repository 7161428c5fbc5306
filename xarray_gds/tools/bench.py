"""Benchmarks behind ``xarray-gds bench``: ratios measured in one run.

Each case writes its store once, then times open + load of the same data by the
alternatives, best of ``repeat`` runs, and reports GB/s of decoded data and the ratio
to ``engine="zarr"``. The page cache is warm for every contender alike (the store is
read once before timing).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import json
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr
import zarr.codecs as zc

from xarray_gds import _optional
from xarray_gds import device as _device
from xarray_gds.tools import (
    bench_bounds,
    bench_cluster,
    bench_icechunk,
    bench_loader,
    bench_refs,
    bench_remote,
    bench_write,
    nginx,
    s3_server,
)
from xarray_gds.tools._stores import write_blocks

__all__ = [
    "CASES",
    "EXTRAS",
    "TITLES",
    "Result",
    "WarningTally",
    "make_store",
    "missing",
    "run",
    "skip_reason",
]

#: the extra of pyproject.toml that installs each optional package a case imports: the
#: feature's extra, or the bench extra for what only the benchmarks use (NetCDF4 files
#: written and read by the other engines, the loopback S3 server)
EXTRAS = {
    **_optional.EXTRAS,
    "netCDF4": "bench",
    "h5netcdf": "bench",
    "moto": "bench",
    "boto3": "bench",
}

# the optional packages (import names) of the cases, their "needs"
_DASK = ("dask",)
_REFS = ("netCDF4", "h5netcdf", "h5py", "kerchunk")
_ICECHUNK = ("icechunk", "dask")
_VIRTUAL = ("icechunk", *_REFS, "virtualizarr", "obspec_utils", "obstore")
_S3 = ("s3fs", "moto", "boto3")
# the nginx cases: obstore (the engine's client, and zarr's ObjectStore), fsspec's HTTP
# filesystem and s3fs (engine="zarr" through fsspec)
_SERVED = ("obstore", "aiohttp", "s3fs")


@dataclass
class Result:
    """Timings of one case: seconds per contender, and the decoded size."""

    case: str
    nbytes: int
    n_chunks: int
    seconds: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def rate(self, name: str) -> float:
        return self.nbytes / self.seconds[name] / 1e9

    def ratio(self, name: str, base: str = "zarr") -> float:
        """``base``'s time over ``name``'s; with no ``zarr`` contender, the faster of
        the ``zarr (...)`` ones (``zarr (obstore)``, ``zarr (fsspec)``) is ``zarr``."""
        if base == "zarr" and base not in self.seconds:
            zarrs = [s for k, s in self.seconds.items() if k.startswith("zarr (")]
            return min(zarrs) / self.seconds[name] if zarrs else math.nan
        return self.seconds[base] / self.seconds[name]


def make_store(
    path: Path,
    nbytes: int,
    chunk_bytes: int,
    *,
    zarr_format: int = 3,
    shard_bytes: int | None = None,
    compressor: Any = "zstd",
    variables: int = 1,
) -> Path:
    """Write a float32 (time, y, x) dataset of about ``nbytes`` with zstd chunks.

    The field is smooth in space plus noise, quantized to 0.01, so it compresses
    like real data (roughly 2-3x) rather than like zeros.
    """
    nx = 512
    ny = max(1, min(512, chunk_bytes // (4 * nx)))
    per_step = ny * nx * 4
    steps_per_chunk = max(1, chunk_bytes // per_step)
    ny_total = 1024 if ny >= 512 else ny * 8
    nt = max(steps_per_chunk, nbytes // (ny_total * nx * 4))
    nt = math.ceil(nt / steps_per_chunk) * steps_per_chunk
    chunks = (steps_per_chunk, ny, nx)
    enc: dict[str, Any] = {"chunks": chunks}
    if zarr_format == 3:
        enc["compressors"] = [zc.ZstdCodec(level=1)] if compressor == "zstd" else compressor
    else:
        import numcodecs

        if compressor == "zstd":
            enc["compressors"] = [numcodecs.Zstd(level=1)]
        elif compressor == "blosc":
            enc["compressors"] = [numcodecs.Blosc()]
        else:
            enc["compressors"] = compressor
    if shard_bytes:
        outer_t = max(
            steps_per_chunk, shard_bytes // (ny * nx * 4) // steps_per_chunk * steps_per_chunk
        )
        enc["shards"] = (outer_t, ny, nx)
        nt = math.ceil(nt / outer_t) * outer_t
    rng = np.random.default_rng(0)
    yy, xx = np.meshgrid(np.linspace(0, 6, ny_total), np.linspace(0, 6, nx), indexing="ij")
    base = (np.sin(yy) * np.cos(xx) * 20 + 280).astype("f4")
    block_t = max(1, min(nt, (256 << 20) // (ny_total * nx * 4)))
    block_t = max(steps_per_chunk, block_t // steps_per_chunk * steps_per_chunk)
    names = ["t", *(f"v{i}" for i in range(1, variables))]
    nt = max(steps_per_chunk, nt // len(names) // steps_per_chunk * steps_per_chunk)
    if shard_bytes:
        nt = math.ceil(nt / enc["shards"][0]) * enc["shards"][0]

    def blocks() -> Iterator[xr.Dataset]:
        for start in range(0, nt, block_t):
            n = min(block_t, nt - start)
            ds = xr.Dataset()
            for name in names:
                noise = rng.standard_normal((n, ny_total, nx), dtype="f4")
                ds[name] = (("time", "y", "x"), np.round(base[None] + noise, 2))
            yield ds

    return write_blocks(path, blocks(), {name: enc for name in names}, zarr_format)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def missing(name: str) -> list[str]:
    """The packages case ``name`` imports that are not installed (import names)."""
    return [p for p in CASES[name].get("needs", ()) if not _installed(p)]


def install_hint(packages: list[str]) -> str:
    """How to install ``packages``: the extras of a checkout that bring them, and pip
    for the others."""
    extras = sorted({EXTRAS[p] for p in packages if p in EXTRAS})
    others = [p for p in packages if p not in EXTRAS]
    hints = []
    if extras:
        which = " and ".join(extras) + (" extras" if len(extras) > 1 else " extra")
        hints.append(f"the {which}: {_optional.install_hint(extras)} in a checkout")
    if others:
        hints.append("pip install " + " ".join(others))
    return "; ".join(hints)


def skip_reason(name: str, cuda: bool) -> str | None:
    """Why case ``name`` cannot run here (no GPU, or packages missing), or None."""
    if CASES[name]["gpu"] and not cuda:
        twin = f"--case host-{name}; " if f"host-{name}" in CASES else ""
        return f"needs a GPU (on the host: {twin}the host-usage-* cases, docs/performance.md)"
    if CASES[name].get("serves") and nginx.NGINX is None:
        return "needs nginx (apt-get install nginx)"
    absent = missing(name)
    if absent:
        return f"needs {', '.join(absent)} ({install_hint(absent)})"
    return None


class WarningTally:
    """The warnings a benchmark run raised, counted by category and message: a run
    prints one line per distinct warning instead of every one."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Every warning raised inside the block is counted, none shown."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                for w in caught:
                    message = str(w.message).strip().splitlines()[0] if str(w.message) else ""
                    self.counts[(w.category.__name__, message)] += 1

    def lines(self) -> list[str]:
        """``COUNT x Category: message`` per distinct warning, most frequent first."""
        return [
            f"{n} x {category}: {message}"
            for (category, message), n in sorted(self.counts.items(), key=lambda i: -i[1])
        ]


def _time(fn: Callable[[], Any], repeat: int, sync: Callable[[], None]) -> float:
    best = math.inf
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _sync() -> None:
    ok, _ = _device.cuda_status()
    if ok:
        _device.cupy().cuda.runtime.deviceSynchronize()


def _load_gds(path: Path, device: str) -> Any:
    ds = xr.open_dataset(path, engine="gds-zarr", device=device, consolidated=True)
    return ds["t"].data if device == "cpu" else ds["t"].variable.data


def _load_zarr(path: Path, to_gpu: bool) -> Any:
    ds = xr.open_dataset(path, engine="zarr", consolidated=True)
    values = ds["t"].values
    return _device.cupy().asarray(values) if to_gpu else values


def _chunk_files(path: Path) -> tuple[Any, list[str]]:
    """The decode chain of a bench store's variables (``t``, ``v1``, ...: they share
    one) and the paths of every chunk file of every variable."""
    from xarray_gds.codecs import plan_chain

    names = sorted(p.name for p in path.iterdir() if p.is_dir())
    chain = plan_chain(zarr.open_array(path / names[0], mode="r").metadata)
    files = sorted(
        str(p)
        for name in names
        for p in (path / name).rglob("*")
        if p.is_file() and p.name not in ("zarr.json", ".zarray", ".zattrs")
    )
    return chain, files


def raw_limit(path: Path) -> None:
    """kvikio reads of every chunk of every variable of a bench store (``t``, ``v1``,
    ...) into one arena, then one nvCOMP batch call (the variables share a chain)."""
    from xarray_gds.codecs import nvcomp
    from xarray_gds.stores.files import read_files_device

    chain, files = _chunk_files(path)
    batch = read_files_device(files)
    nvcomp.decode(chain, batch, list(range(len(files))), files)


def decode_only(path: Path) -> Callable[[], Any]:
    """The decode ceiling: every chunk of the store read once into device memory (not
    timed), then a function that runs one nvCOMP batch decode of them all (timed)."""
    from xarray_gds.codecs import nvcomp
    from xarray_gds.stores.files import read_files_device

    chain, files = _chunk_files(path)
    batch = read_files_device(files)
    idx = list(range(len(files)))
    return lambda: nvcomp.decode(chain, batch, idx, files)


def _raw(path: Path) -> dict[str, Callable[[], Any]]:
    """The bounds of a device load of a local store: ``read-only`` (see
    :func:`bench_bounds.read_bound`), and the raw-limit and decode-only contenders where
    they apply: chunks of one stream codec (not Blosc frames, not shards, which one nvCOMP stream
    call cannot decode whole)."""
    from xarray_gds.codecs import DecodeChain, plan_chain

    bounds = bench_bounds.read_bound(path, on_device=True, consolidated=True)
    name = next(p.name for p in sorted(path.iterdir()) if p.is_dir())
    chain = plan_chain(zarr.open_array(path / name, mode="r").metadata)
    ok = isinstance(chain, DecodeChain) and chain.compressor is not None
    if not ok or chain.compressor.name not in ("zstd", "lz4", "gzip", "zlib"):  # type: ignore[union-attr]
        return bounds
    decode = _Lazy(lambda: decode_only(path))
    return {"raw-limit": lambda: raw_limit(path), "decode-only": decode, **bounds}


class _Lazy:
    """A contender whose setup (``make``, returning the timed function) runs at its
    first call, the warm-up, so that stores are read only when the contender runs."""

    def __init__(self, make: Callable[[], Callable[[], Any]]) -> None:
        self._make = make
        self._fn: Callable[[], Any] | None = None

    def __call__(self) -> Any:
        if self._fn is None:
            self._fn = self._make()
        return self._fn()


def _split(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with ``xarray_gds.split`` set to ``"auto"``: device batches shared between
    nvCOMP and the host pool where the cost model says it pays."""

    def run() -> Any:
        with zarr.config.set({"xarray_gds.split": "auto"}):
            return fn()

    return run


def _mf_paths(path: Path, n: int) -> list[Path]:
    return [path] + [path.with_name(f"{path.stem}-{i}.zarr") for i in range(1, n)]


def _copies(path: Path, n: int) -> list[Path]:
    """``path`` and ``n - 1`` copies of it: the stores of an open_mfdataset case."""
    paths = _mf_paths(path, n)
    for copy in paths[1:]:
        shutil.copytree(path, copy)
    return paths


#: one dask block per store (every chunk of a store read and decoded in one batch),
#: and combine options that do not load anything to compare
_MF_OPTIONS: dict[str, Any] = {
    "combine": "nested",
    "concat_dim": "time",
    "chunks": {"time": -1, "y": -1, "x": -1},
    "data_vars": "minimal",
    "coords": "minimal",
    "compat": "override",
}


def _mean_gds(paths: list[Path], parallel: bool = False) -> Any:
    from xarray_gds.chunks import GdsDaskManager

    ds = xr.open_mfdataset(
        paths,
        engine="gds-zarr",
        chunked_array_type=GdsDaskManager(),
        parallel=parallel,
        **_MF_OPTIONS,
    )
    return ds["t"].mean("time").compute().data


def _mean_zarr(paths: list[Path], parallel: bool = False) -> Any:
    ds = xr.open_mfdataset(paths, engine="zarr", parallel=parallel, **_MF_OPTIONS)
    # cupy-xarray's ``as_cupy()`` does this: each dask block moves to the GPU
    cp = _device.cupy()
    t = ds["t"].copy(data=ds["t"].data.map_blocks(cp.asarray))
    return t.mean("time").compute().data


def _gds(path: Path, **kwargs: Any) -> xr.Dataset:
    from xarray_gds.chunks import GdsDaskManager

    if "chunks" in kwargs:
        kwargs["chunked_array_type"] = GdsDaskManager()
    return xr.open_dataset(path, engine="gds-zarr", device="cuda", consolidated=True, **kwargs)


def _zarr(path: Path, **kwargs: Any) -> xr.Dataset:
    return xr.open_dataset(path, engine="zarr", consolidated=True, **kwargs)


def _on_gpu(ds: xr.Dataset) -> list[Any]:
    """Every data variable's values moved to the GPU (what engine="zarr" users do)."""
    cp = _device.cupy()
    return [cp.asarray(v.values) for v in ds.data_vars.values()]


def _async_load(ds: xr.Dataset) -> xr.Dataset:
    import asyncio

    return asyncio.run(ds.load_async())


def _steps(ds: xr.Dataset, step: int, n_steps: int, to_gpu: bool) -> None:
    """A data loader's loop: ``n_steps`` selections of ``step`` time steps, loaded."""
    for i in range(n_steps):
        part = ds.isel(time=slice(i * step, (i + 1) * step)).load()
        if to_gpu:
            _on_gpu(part)


def _usage(kind: str, step: int = 1, n_steps: int = 8) -> Callable[[Path], dict[str, Any]]:
    """Contenders of a usage case: the same user call through both engines."""

    def contenders(p: Path) -> dict[str, Callable[[], Any]]:
        # raw-limit: every chunk read by kvikio and decoded in one nvCOMP call (the
        # bound the engine's load is measured against)
        if kind == "eager":
            return {
                "gds-zarr": lambda: _gds(p).load(),
                "gds-zarr, split=auto": _split(lambda: _gds(p).load()),
                "zarr": lambda: _on_gpu(_zarr(p).load()),
                **_raw(p),
            }
        if kind == "chunks":
            return {
                "gds-zarr": lambda: _gds(p, chunks={}).compute(),
                "gds-zarr, split=auto": _split(lambda: _gds(p, chunks={}).compute()),
                "zarr": lambda: _on_gpu(_zarr(p, chunks={}).compute()),
                **_raw(p),
            }
        if kind == "shards":  # dask blocks of one shard each, for both engines
            shards = _shard_chunks(p)
            return {
                "gds-zarr": lambda: _gds(p, chunks=shards).compute(),
                "zarr": lambda: _on_gpu(_zarr(p, chunks=shards).compute()),
            }
        if kind == "async":
            return {
                "gds-zarr": lambda: _async_load(_gds(p)),
                "gds-zarr, split=auto": _split(lambda: _async_load(_gds(p))),
                "zarr": lambda: _on_gpu(_async_load(_zarr(p))),
                **_raw(p),
            }
        if kind == "steps":
            gds, ref = _gds(p), _zarr(p)  # opened once, as a loader does
            return {
                "gds-zarr": lambda: _steps(gds, step, n_steps, False),
                "gds-zarr, split=auto": _split(lambda: _steps(gds, step, n_steps, False)),
                "zarr": lambda: _steps(ref, step, n_steps, True),
            }
        raise ValueError(kind)

    return contenders


def _host(path: Path, **kwargs: Any) -> xr.Dataset:
    return xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=True, **kwargs)


def _host_mean(paths: list[Path], engine: str) -> Any:
    """One reduction over many stores through dask, on the host (numpy blocks)."""
    options: dict[str, Any] = (
        dict(_MF_OPTIONS, device="cpu") if engine == "gds-zarr" else _MF_OPTIONS
    )
    ds = xr.open_mfdataset(paths, engine=engine, **options)
    return ds["t"].mean("time").compute().data


def _host_usage(kind: str, step: int = 1, n_steps: int = 8) -> Callable[[Any], dict[str, Any]]:
    """Contenders of a host usage case: the user calls of the ``usage-*`` cases on the
    host route (``device="cpu"``, numpy), against the same calls of engine="zarr"."""

    def contenders(p: Any) -> dict[str, Callable[[], Any]]:
        if kind == "eager":
            return {
                "gds-zarr": lambda: _host(p).load(),
                "zarr": lambda: _zarr(p).load(),
                **bench_bounds.read_bound(p, on_device=False, consolidated=True),
            }
        if kind == "chunks":
            return {
                "gds-zarr": lambda: _host(p, chunks={}).compute(),
                "zarr": lambda: _zarr(p, chunks={}).compute(),
                **bench_bounds.read_bound(p, on_device=False, consolidated=True),
            }
        if kind == "async":
            return {
                "gds-zarr": lambda: _async_load(_host(p)),
                "zarr": lambda: _async_load(_zarr(p)),
                **bench_bounds.read_bound(p, on_device=False, consolidated=True),
            }
        if kind == "mfdataset":
            return {
                "gds-zarr": lambda: _host_mean(p, "gds-zarr"),
                "zarr": lambda: _host_mean(p, "zarr"),
            }
        if kind == "steps":
            ours, ref = _host(p), _zarr(p)  # opened once, as a loader does
            return {
                "gds-zarr": lambda: _steps(ours, step, n_steps, False),
                "zarr": lambda: _steps(ref, step, n_steps, False),
            }
        raise ValueError(kind)

    return contenders


def _shard_chunks(path: Path) -> dict[str, int]:
    """The ``chunks=`` of one dask block a shard of the store's first variable."""
    ds = xr.open_dataset(path, engine="zarr", consolidated=True)
    var = next(iter(ds.data_vars.values()))
    shards = var.encoding.get("shards")
    if not shards:
        raise ValueError(f"{path} is not sharded: its first variable has no shards")
    return {str(d): int(n) for d, n in zip(var.dims, shards, strict=True)}


def _write_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    """Writing the case's data from GPU memory with zstd (zarr's default level):
    ``xarray_gds.to_zarr`` (nvCOMP) vs ``ds.as_numpy().to_zarr()`` (zarr-python).
    Without a GPU, from host memory (both through zarr's codecs)."""
    import xarray_gds

    where = "cuda" if _device.cuda_status()[0] else "cpu"
    ds = xr.open_dataset(path, engine="gds-zarr", device=where).load()
    chunks = ds["t"].encoding["chunks"]
    for var in ds.variables.values():
        var.encoding = {}
    encoding = {"t": {"chunks": chunks, "compressors": [zc.ZstdCodec()]}}
    out = path.with_name(f"{path.stem}-written.zarr")

    def ours() -> None:
        xarray_gds.to_zarr(ds, out, mode="w", encoding=encoding, consolidated=False)

    def theirs() -> None:
        ds.as_numpy().to_zarr(out, mode="w", encoding=encoding, consolidated=False)

    return {"gds-zarr": ours, "zarr": theirs}


def peak_device_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes in use in CuPy's default memory pool while ``fn`` runs, above what was
    in use before (what ``fn`` returns, e.g. the loaded array, counts). Every device
    buffer of the engine comes from that pool; nvCOMP's own scratch space does not."""
    cp = _device.cupy()
    pool = cp.get_default_memory_pool()
    base = pool.used_bytes()
    peak = base

    def malloc(size: int) -> Any:
        nonlocal peak
        memory = pool.malloc(size)
        peak = max(peak, pool.used_bytes())
        return memory

    cp.cuda.set_allocator(malloc)
    try:
        kept = fn()
        _sync()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    del kept
    return peak - base


#: peak device bytes per contender of the ``memory`` case, worst over its runs
_PEAKS: dict[str, int] = {}

#: batch budgets (``XARRAY_GDS_BATCH_BYTES``) the ``memory`` case loads with
_MEMORY_BUDGETS = {
    "gds-zarr": None,
    "gds-zarr batch 1 GiB": 1 << 30,
    "gds-zarr batch 256 MiB": 256 << 20,
}


def _memory_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    """Loads of the zstd-4MB data with several batch budgets, each tracking its peak."""

    def load(label: str, budget: int | None) -> Callable[[], Any]:
        def run() -> None:
            old = os.environ.pop("XARRAY_GDS_BATCH_BYTES", None)
            if budget is not None:
                os.environ["XARRAY_GDS_BATCH_BYTES"] = str(budget)
            try:
                peak = peak_device_bytes(lambda: _load_gds(path, "cuda"))
            finally:
                os.environ.pop("XARRAY_GDS_BATCH_BYTES", None)
                if old is not None:
                    os.environ["XARRAY_GDS_BATCH_BYTES"] = old
            _PEAKS[label] = max(_PEAKS.get(label, 0), peak)

        return run

    _PEAKS.clear()
    loads = {label: load(label, budget) for label, budget in _MEMORY_BUDGETS.items()}
    return {**loads, "zarr": lambda: _load_zarr(path, True)}


def _memory_note(result: Result) -> str:
    """Peak device memory of each load, as a multiple of the decoded output."""
    parts = [
        f"{label}: peak {peak / 1e9:.2f} GB = output x {peak / result.nbytes:.2f}"
        for label, peak in _PEAKS.items()
    ]
    return "; ".join(parts)


def profile_name(case: str, contender: str) -> str:
    """The file name of a contender's profile: letters, digits, "-", "_" and "." only
    (``chunks={}`` and spaces are not names every tool copies)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", contender).strip("_")
    return f"{case}.{safe}.txt"


def _profile(fn: Callable[[], Any], path: Path) -> None:
    """One more run of ``fn`` under cProfile; the 40 costliest functions (own time, then
    cumulative time) go to ``path`` as text."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    _sync()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    path.write_text(text.getvalue())


def _case(
    name: str,
    path: Path,
    repeat: int,
    contenders: dict[str, Callable[[], Any]],
    warm_all: bool = True,
    n_stores: int = 1,
    profile_dir: Path | None = None,
    interleave: bool = False,
) -> Result:
    """Best of ``repeat`` runs of each contender: each contender's runs one after the
    other, or with ``interleave`` one run of every contender in turn, ``repeat`` rounds
    (a load that comes and goes on a shared machine then falls on all of them alike)."""
    group = zarr.open_group(path, mode="r")
    arrays = [a for _, a in group.arrays() if a.ndim == 3]
    nbytes = sum(a.nbytes for a in arrays) * n_stores
    n_chunks = sum(a.nchunks for a in arrays) * n_stores
    result = Result(name, int(nbytes), int(n_chunks))
    if interleave:
        for fn in contenders.values():
            fn()  # warm up
        for _ in range(repeat):
            for label, fn in contenders.items():
                took = _time(fn, 1, _sync)
                result.seconds[label] = min(result.seconds.get(label, math.inf), took)
        if profile_dir is not None:
            for label, fn in contenders.items():
                _profile(fn, profile_dir / profile_name(name, label))
        return result
    for k, (label, fn) in enumerate(contenders.items()):
        if warm_all or k == 0:
            fn()  # warm up: page cache, imports, CUDA context, nvCOMP handles
        result.seconds[label] = _time(fn, repeat, _sync)
        if profile_dir is not None:
            _profile(fn, profile_dir / profile_name(name, label))
    return result


def run(
    workdir: Path | None = None,
    size_gb: float = 2.0,
    repeat: int = 3,
    cases: list[str] | None = None,
    on_result: Callable[[Result], None] | None = None,
    profile_dir: Path | None = None,
    on_skip: Callable[[str, str], None] | None = None,
    tally: WarningTally | None = None,
) -> list[Result]:
    """Run the benchmark cases; see ``CASES`` for names.

    ``on_result`` is called with each case's result as soon as it is measured. With
    ``profile_dir``, each contender runs once more under cProfile (after its timed
    runs, so the timings are unaffected) and its profile is written there as
    ``CASE.CONTENDER.txt``. A case that cannot run here (one that needs a GPU on a
    machine without one, or packages that are not installed) is skipped:
    ``on_skip`` is called with its name and the reason, and the others run. The
    warnings of the cases are counted in ``tally`` (a new one when None), not shown.
    """
    cuda, _ = _device.cuda_status()
    tally = WarningTally() if tally is None else tally
    tmp = Path(tempfile.mkdtemp(prefix="xarray-gds-bench-", dir=workdir))
    results: list[Result] = []
    try:
        for name in cases or list(CASES):
            spec = CASES[name]
            if spec.get("named_only") and not cases:
                continue
            why = skip_reason(name, cuda)
            if why is None:
                try:
                    with tally.record():
                        result = _run_case(name, spec, tmp, size_gb, repeat, profile_dir)
                except ModuleNotFoundError as err:  # one the case's "needs" does not list
                    if not err.name:
                        raise
                    package = err.name.split(".")[0]
                    why = f"needs {package} ({install_hint([package])})"
                else:
                    results.append(result)
                    if on_result is not None:
                        on_result(result)
                finally:
                    for p in tmp.iterdir():
                        shutil.rmtree(p, ignore_errors=True)
            if why is not None and on_skip is not None:
                on_skip(name, why)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _run_case(
    name: str,
    spec: dict[str, Any],
    tmp: Path,
    size_gb: float,
    repeat: int,
    profile_dir: Path | None,
) -> Result:
    make = spec.get("make", make_store)  # a case may write its own kind of store
    path = make(tmp / f"{name}.zarr", int(size_gb * spec["scale"] * 1e9), **spec["store"])
    n_stores = spec.get("stores", 1)
    target: Any = _copies(path, n_stores) if n_stores > 1 else path
    rep = spec.get("repeat", repeat)
    warm_all = spec.get("warm_all", True)
    with contextlib.ExitStack() as stack:  # a case's servers stop as it ends
        if spec.get("serves"):
            contenders = spec["contenders"](target, stack)
        else:
            contenders = spec["contenders"](target)
        interleave = bool(spec.get("interleave"))
        result = _case(name, path, rep, contenders, warm_all, n_stores, profile_dir, interleave)
    if "note" in spec:
        result.note = spec["note"](result)
    if "parts" in spec:  # a loop over part of the store: the bytes it reads
        result.nbytes = int(result.nbytes * spec["parts"])
    return result


def _remote_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    """The case's store uploaded to the loopback S3 server; open + load of ``t`` over
    the same URL: gds-zarr, and engine="zarr" (s3fs; obstore too when installed)
    followed by cupy.asarray."""
    import s3fs

    options = s3_server.loopback_s3()
    fs = s3fs.S3FileSystem(**options)
    key = f"bench/{path.name}"
    fs.put(str(path), key, recursive=True)
    url = f"s3://{key}"

    def ours() -> Any:
        ds = xr.open_dataset(
            url, engine="gds-zarr", device="cuda", consolidated=True, storage_options=options
        )
        return ds["t"].variable.data

    def theirs() -> Any:
        ds = xr.open_dataset(url, engine="zarr", consolidated=True, storage_options=options)
        return _device.cupy().asarray(ds["t"].values)

    chunk_keys = [k for k in fs.find(f"{key}/t") if not k.endswith("zarr.json")]

    def gets_only() -> Any:
        # every chunk object fetched to the host by s3fs's concurrent GETs, nothing
        # decoded: how fast the server serves a Python client
        fs.invalidate_cache()
        return fs.cat(chunk_keys)

    out: dict[str, Callable[[], Any]] = {
        "gds-zarr": ours,
        "zarr": theirs,
        "s3fs GETs only": gets_only,
    }
    try:
        from obstore.store import S3Store
        from zarr.storage import ObjectStore
    except ImportError:
        return out
    obj = S3Store(
        "bench",
        prefix=path.name,
        endpoint=options["endpoint_url"],
        access_key_id="bench",
        secret_access_key="bench",
        region="us-east-1",
        client_options={"allow_http": True},
    )

    def obstore_zarr() -> Any:
        store: Any = ObjectStore(obj, read_only=True)
        ds = xr.open_dataset(store, engine="zarr", consolidated=True)
        return _device.cupy().asarray(ds["t"].values)

    out["zarr (obstore)"] = obstore_zarr
    return out


CASES: dict[str, dict[str, Any]] = {
    "zstd-4MB": {
        "gpu": True,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": lambda p: {
            "gds-zarr": lambda: _load_gds(p, "cuda"),
            "zarr": lambda: _load_zarr(p, True),
            **_raw(p),
        },
    },
    "blosc-v2-4MB": {
        "gpu": True,
        "scale": 1.0,
        # zarr-python 2's default compressor: Blosc, lz4, byte shuffle, clevel 5
        "store": {"chunk_bytes": 4 << 20, "zarr_format": 2, "compressor": "blosc"},
        "contenders": lambda p: {
            "gds-zarr": lambda: _load_gds(p, "cuda"),
            "zarr": lambda: _load_zarr(p, True),
            **_raw(p),
        },
    },
    "zstd-sharded-256KiB": {
        "gpu": True,
        "scale": 1.0,
        "store": {"chunk_bytes": 256 << 10, "shard_bytes": 16 << 20},
        "contenders": lambda p: {
            "gds-zarr": lambda: _load_gds(p, "cuda"),
            "zarr": lambda: _load_zarr(p, True),
        },
    },
    "mfdataset-50": {
        "gpu": True,
        "needs": _DASK,
        "scale": 0.02,  # per store: 50 stores of 40 MB for --size-gb 2
        "stores": 50,
        "store": {"chunk_bytes": 256 << 10},
        "contenders": lambda ps: {
            "gds-zarr": lambda: _mean_gds(ps),
            "zarr": lambda: _mean_zarr(ps),
            # the opens as dask tasks (xarray's parallel=True), for both engines
            "gds-zarr, parallel=True": lambda: _mean_gds(ps, parallel=True),
            "zarr, parallel=True": lambda: _mean_zarr(ps, parallel=True),
        },
    },
    # one reduction over many stores on a dask cluster of 1, 2, 4 and 8 GPUs (those the
    # machine has) and engine="zarr" on a CPU cluster (xarray_gds.tools.bench_cluster)
    "multi-gpu-mfdataset": {
        "gpu": False,  # on the host: a smoke test of the case
        "needs": ("dask", "distributed"),
        "named_only": True,  # clusters of every GPU count: run only with --case
        "scale": 1 / 64,  # per store: 64 stores (8 a GPU on 8) of --size-gb in all
        "stores": 64,
        "store": {"chunk_bytes": 1 << 20},
        "contenders": bench_cluster.contenders,
        "note": bench_cluster.note,
    },
    # the ways users load data: each a ratio against engine="zarr" doing
    # the same call, then moving every variable's values to the GPU
    "usage-eager-2var": {
        "gpu": True,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": _usage("eager"),
    },
    "usage-chunks-2var": {
        "gpu": True,
        "needs": _DASK,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": _usage("chunks"),
    },
    "usage-async-2var": {
        "gpu": True,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": _usage("async"),
    },
    "usage-step-1chunk": {
        "gpu": True,
        "scale": 0.1,
        "parts": 8 / 48,  # 8 of the 48 chunks a run
        "store": {"chunk_bytes": 4 << 20},
        "contenders": _usage("steps", step=1, n_steps=8),
    },
    "usage-step-16chunks": {
        "gpu": True,
        "scale": 0.2,
        "parts": 64 / 96,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": _usage("steps", step=16, n_steps=4),
    },
    "usage-step-20vars": {
        "gpu": True,
        "scale": 0.5,
        "store": {"chunk_bytes": 4 << 20, "variables": 20},
        "contenders": _usage("steps", step=1, n_steps=4),
    },
    "usage-sharded-chunks": {
        "gpu": True,
        "needs": _DASK,
        "scale": 0.25,  # engine="zarr" takes about 18 s a GB here
        "repeat": 1,
        "store": {"chunk_bytes": 144 << 10, "shard_bytes": 6 << 20},
        "contenders": _usage("chunks"),
    },
    "usage-sharded-shards": {
        "gpu": True,
        "needs": _DASK,
        "scale": 0.25,
        "repeat": 1,
        "store": {"chunk_bytes": 144 << 10, "shard_bytes": 6 << 20},
        "contenders": _usage("shards"),
    },
    "usage-blosc-chunks": {
        "gpu": True,
        "needs": _DASK,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20, "zarr_format": 2, "compressor": "blosc"},
        "contenders": _usage("chunks"),
    },
    "write-zstd-4MB": {
        "gpu": False,  # without a GPU: the host path's write against xarray's
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": _write_contenders,
    },
    "memory-zstd-4MB": {
        "gpu": True,
        "scale": 1.0,
        "repeat": 1,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": _memory_contenders,
        "note": _memory_note,
    },
    "small-chunks": {
        "gpu": True,
        "repeat": 1,
        "warm_all": False,  # the first contender's warm-up fills the page cache
        "scale": 0.1,  # about 100,000 chunks of 1 KiB for --size-gb 2
        "store": {"chunk_bytes": 1 << 10},
        "contenders": lambda p: {
            "gds-zarr": lambda: _load_gds(p, "cuda"),
            "zarr": lambda: _load_zarr(p, True),
        },
    },
    # a >= 1 GB zstd store on a loopback S3 server (moto), same URL for all
    "remote-s3-zstd-4MB": {
        "gpu": True,
        "needs": _S3,
        "scale": 1.0,
        "repeat": 1,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": _remote_contenders,
        "note": lambda r: (
            f"gds-zarr {r.seconds['s3fs GETs only'] / r.seconds['gds-zarr']:.2f}x s3fs "
            "fetching every chunk object to the host without decoding it"
        ),
    },
    # the store served by nginx on 127.0.0.1 (started and stopped by the case) over
    # http:// and as a path-style s3:// endpoint: the engine against engine="zarr" through
    # obstore and fsspec, every chunk fetched with nothing decoded (raw GETs) and the
    # same store read from local disk (xarray_gds.tools.bench_remote)
    "host-remote-http": {
        "gpu": False,
        "serves": True,
        "needs": _SERVED,
        "scale": 0.21,  # 100 chunks of 4 MiB (about 260 MB of zstd) for --size-gb 2
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_remote.host_contenders("http"),
        "interleave": True,  # one run of each contender in turn
        "note": bench_remote.note,
    },
    "host-remote-s3": {
        "gpu": False,
        "serves": True,
        "needs": _SERVED,
        "scale": 0.21,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_remote.host_contenders("s3"),
        "interleave": True,
        "note": bench_remote.note,
    },
    "remote-http-4MB": {
        "gpu": True,
        "serves": True,
        "needs": _SERVED,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_remote.contenders("http"),
        "interleave": True,
        "note": bench_remote.note,
    },
    "remote-s3-4MB": {
        "gpu": True,
        "serves": True,
        "needs": _SERVED,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_remote.contenders("s3"),
        "interleave": True,
        "note": bench_remote.note,
    },
    # a NetCDF4 file (zlib 1 + shuffle) through its kerchunk references
    "netcdf-refs": {
        "gpu": True,
        "needs": _REFS,
        "scale": 1.0,
        "repeat": 1,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_refs.contenders,
        "note": bench_refs.note,
    },
    "netcdf-refs-1MiB": {  # the same with 1 MiB chunks (nvCOMP deflate: per-chunk bound)
        "gpu": True,
        "needs": _REFS,
        "scale": 1.0,
        "repeat": 1,
        "store": {"chunk_bytes": 1 << 20},
        "contenders": bench_refs.contenders,
        "note": bench_refs.note,
    },
    "host-netcdf-refs": {
        "gpu": False,
        "needs": _REFS,
        "repeat": 1,
        "scale": 0.02,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_refs.host_contenders,
        "note": bench_refs.note,
    },
    # Icechunk repositories (local filesystem storage; virtual references)
    "icechunk-2var": {
        "gpu": True,
        "needs": _ICECHUNK,
        "scale": 1.0,
        "repeat": 1,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": bench_icechunk.contenders,
        "note": bench_icechunk.note,
    },
    "icechunk-virtual": {
        "gpu": True,
        "needs": _VIRTUAL,
        "scale": 1.0,
        "repeat": 1,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_icechunk.virtual_contenders,
        "note": bench_icechunk.note,
    },
    "host-icechunk-2var": {
        "gpu": False,
        "needs": _ICECHUNK,
        "repeat": 1,
        "scale": 0.02,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": bench_icechunk.host_contenders,
        "note": bench_icechunk.note,
    },
    "host-icechunk-virtual": {
        "gpu": False,
        "needs": _VIRTUAL,
        "repeat": 1,
        "scale": 0.02,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": bench_icechunk.host_virtual_contenders,
        "note": bench_icechunk.note,
    },
    "host-small-chunks": {
        "gpu": False,
        "repeat": 1,
        "warm_all": False,
        "scale": 0.02,
        "store": {"chunk_bytes": 1 << 10},
        "contenders": lambda p: {
            "gds-zarr": lambda: _load_gds(p, "cpu"),
            "zarr": lambda: _load_zarr(p, False),
        },
    },
    # the usage-* cases' user calls on the host route (device="cpu")
    "host-usage-eager-2var": {
        "gpu": False,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": _host_usage("eager"),
    },
    "host-usage-chunks-2var": {
        "gpu": False,
        "needs": _DASK,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": _host_usage("chunks"),
    },
    "host-usage-async-2var": {
        "gpu": False,
        "scale": 1.0,
        "store": {"chunk_bytes": 4 << 20, "variables": 2},
        "contenders": _host_usage("async"),
    },
    "host-usage-mfdataset": {
        "gpu": False,
        "needs": _DASK,
        "scale": 0.1,  # per store: 10 stores
        "stores": 10,
        "store": {"chunk_bytes": 1 << 20},
        "contenders": _host_usage("mfdataset"),
    },
    "host-usage-step-1chunk": {
        "gpu": False,
        "scale": 0.1,
        "parts": 8 / 48,  # 8 of the 48 chunks a run
        "store": {"chunk_bytes": 4 << 20},
        "contenders": _host_usage("steps", step=1, n_steps=8),
    },
    "host-usage-step-20vars": {
        "gpu": False,
        "scale": 0.5,
        "store": {"chunk_bytes": 4 << 20, "variables": 20},
        "contenders": _host_usage("steps", step=1, n_steps=4),
    },
    "host-zstd-4MB": {
        "gpu": False,
        "scale": 0.25,
        "store": {"chunk_bytes": 4 << 20},
        "contenders": lambda p: {
            "gds-zarr": lambda: _load_gds(p, "cpu"),
            "zarr": lambda: _load_zarr(p, False),
        },
    },
    # training batches from an ERA5-like store, against a PyTorch DataLoader
    # with engine="zarr" in worker processes (xarray_gds.tools.bench_loader)
    **bench_loader.cases(),
    # the ways users write (xarray_gds.tools.bench_write)
    **bench_write.cases(),
}


def format_table(results: list[Result]) -> str:
    """Results as a Markdown table (GB/s of decoded data, ratio to engine="zarr")."""
    lines = [
        "| case | size | chunks | contender | seconds | GB/s | vs zarr |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, sec in r.seconds.items():
            lines.append(
                f"| {r.case} | {r.nbytes / 1e9:.2f} GB | {r.n_chunks} | {name} | {sec:.3f} | "
                f"{r.rate(name):.2f} | {r.ratio(name):.2f}x |"
            )
        if r.note:
            lines.append(f"| {r.case} | | | {r.note} | | | |")
        if r.case.endswith("small-chunks") and "gds-zarr" in r.seconds:
            per_chunk = r.seconds["gds-zarr"] / r.n_chunks * 1e6
            lines.append(f"| {r.case} | | | gds-zarr per chunk | {per_chunk:.1f} us | | |")
    return "\n".join(lines)


#: what each case times, in a few words (the "what is timed" column of
#: docs/performance.md's tables, made by ``scripts/plot_bench.py --table``)
TITLES = {
    "zstd-4MB": "open_dataset(p).t.values, zstd",
    "blosc-v2-4MB": "open_dataset(p).t.values, Zarr v2, Blosc (lz4, shuffle)",
    "zstd-sharded-256KiB": "open_dataset(p).t.values, 16 MiB shards of 256 KiB chunks",
    "mfdataset-50": 'open_mfdataset of 50 stores, .t.mean("time")',
    "multi-gpu-mfdataset": "64 stores, ds.t.mean() on a dask cluster",
    "usage-eager-2var": "open_dataset(p).load(), 2 variables",
    "usage-chunks-2var": "open_dataset(p, chunks={}).compute(), 2 variables",
    "usage-async-2var": "await ds.load_async(), 2 variables",
    "usage-step-1chunk": "8 x isel(time=i).load()",
    "usage-step-16chunks": "4 x isel(time=16 steps).load()",
    "usage-step-20vars": "4 x isel(time=i).load(), 20 variables",
    "usage-sharded-chunks": "chunks={}, sharded: a dask block per inner chunk",
    "usage-sharded-shards": "sharded: a dask block per shard",
    "usage-blosc-chunks": "chunks={}, Zarr v2, Blosc (lz4, shuffle)",
    "write-zstd-4MB": "xarray_gds.to_zarr vs ds.as_numpy().to_zarr(), zstd",
    "memory-zstd-4MB": "zstd-4MB with smaller batch budgets",
    "small-chunks": "open_dataset(p).t.values, chunks of 1-2 KiB",
    "remote-s3-zstd-4MB": "s3:// on a loopback moto server (zarr via s3fs)",
    "host-remote-http": 'http:// on nginx, device="cpu", zstd',
    "host-remote-s3": 's3:// (path style) on nginx, device="cpu", zstd',
    "remote-http-4MB": "http:// on nginx, kvikio RemoteFile, zstd",
    "remote-s3-4MB": "s3:// (path style) on nginx, kvikio RemoteFile, zstd",
    "netcdf-refs": "NetCDF4 (zlib + shuffle) via kerchunk references",
    "netcdf-refs-1MiB": "NetCDF4 via kerchunk references, 1 MiB chunks",
    "host-netcdf-refs": 'device="cpu", NetCDF4 via kerchunk references',
    "icechunk-2var": "Icechunk repository (local storage), 2 variables",
    "icechunk-virtual": "Icechunk repository of virtual chunks in a NetCDF4 file",
    "host-icechunk-2var": 'device="cpu", Icechunk repository, 2 variables',
    "host-icechunk-virtual": 'device="cpu", Icechunk virtual chunks in a NetCDF4 file',
    "host-small-chunks": 'device="cpu", chunks of 1-2 KiB',
    "host-zstd-4MB": 'device="cpu", zstd',
    "host-usage-eager-2var": 'device="cpu", open_dataset(p).load(), 2 variables',
    "host-usage-chunks-2var": 'device="cpu", open_dataset(p, chunks={}).compute(), 2 variables',
    "host-usage-async-2var": 'device="cpu", await ds.load_async(), 2 variables',
    "host-usage-mfdataset": 'device="cpu", open_mfdataset of 10 stores, .t.mean("time")',
    "host-usage-step-1chunk": 'device="cpu", 8 x isel(time=i).load()',
    "host-usage-step-20vars": 'device="cpu", 4 x isel(time=i).load(), 20 variables',
    "loader-16x20": "BatchLoader, 16 samples x 20 steps, against torch DataLoader",
    "loader-4x4": "BatchLoader, 4 samples x 4 steps, against torch DataLoader",
    "loader-16x20-train": "BatchLoader, 16 x 20, with a training step per batch",
    "write-append-100": "100 appends of one time step",
    "write-region": "a template, then one region write per chunk",
    "write-dask": "open_dataset(p, chunks={}) written (read and write timed)",
    "write-sharded": "an eager write into shards of inner chunks",
    "write-blosc-v2": "an eager write, Zarr v2, Blosc (lz4, shuffle)",
}


#: the distributions whose versions ``environment`` reports, where installed
_SOFTWARE = (
    "kvikio-cu13",
    "kvikio-cu12",
    "nvidia-nvcomp-cu13",
    "nvidia-nvcomp-cu12",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "zarr",
    "xarray",
    "numcodecs",
    "numpy",
)


def _versions(names: tuple[str, ...]) -> list[str]:
    """``"NAME VERSION"`` for each distribution of ``names`` that is installed."""
    from importlib import metadata

    out = []
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            out.append(f"{name} {metadata.version(name)}")
    return out


def environment() -> dict[str, Any]:
    """The machine and software a run measured: the ``env`` of ``--json``'s output
    (``machine`` names the GPU, the card the chart's title gives)."""
    import platform

    cuda, _ = _device.cuda_status()
    cpus = os.cpu_count()
    if cuda:
        runtime = _device.cupy().cuda.runtime
        names = [runtime.getDeviceProperties(i)["name"] for i in range(runtime.getDeviceCount())]
        card = names[0].decode() if isinstance(names[0], bytes) else str(names[0])
        card = card if len(names) == 1 else f"{len(names)} x {card}"
    else:
        card = f"no GPU ({platform.machine() or 'CPU'})"
    software = _versions(_SOFTWARE)
    software += [
        f"{k}={os.environ[k]}" for k in ("KVIKIO_NTHREADS", "KVIKIO_COMPAT_MODE") if k in os.environ
    ]
    return {
        "cuda": cuda,
        "cpus": cpus,
        "machine": f"{card}, {cpus} CPU cores",
        "software": ", ".join(software),
        "page_cache": "warm",  # every case reads its store once before timing it
    }


def commit() -> str:
    """The commit the engine ran at: ``XARRAY_GDS_BENCH_COMMIT`` where set (a machine
    with a copy of the tree but no git history), else the short hash of the git
    checkout the package was imported from (``+`` when it has uncommitted changes),
    else the package's version."""
    import subprocess

    import xarray_gds

    if os.environ.get("XARRAY_GDS_BENCH_COMMIT"):
        return os.environ["XARRAY_GDS_BENCH_COMMIT"]
    root = Path(xarray_gds.__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    try:
        top = subprocess.run(
            [*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10
        )
        if top.returncode == 0 and Path(top.stdout.strip()).resolve() == root:
            head = subprocess.run(
                [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            dirty = subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no", "--", "xarray_gds"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            if head:
                return head + ("+" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"v{xarray_gds.__version__}"


def command(case: str, size_gb: float, repeat: int) -> str:
    """The command that measures ``case`` again, with the size and the number of timed
    runs it ran with (a case that sets its own ``repeat`` runs that many)."""
    rep = CASES[case].get("repeat", repeat) if case in CASES else repeat
    return f"xarray-gds bench --case {case} --size-gb {size_gb:g} --repeat {rep}"


def dump(results: list[Result], path: Path, size_gb: float = 2.0, repeat: int = 3) -> None:
    """Write results as JSON, in the form of ``docs/data/bench-*.json``: the machine and
    software (``env``), and for each case its timings with its title, the date, the
    commit and the command that measures it again (``size_gb`` and ``repeat``: those
    of the run)."""
    import datetime

    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    head = commit()
    rows = [
        {
            **asdict(r),
            "title": TITLES.get(r.case, ""),
            "date": date,
            "commit": head,
            "command": command(r.case, size_gb, repeat),
        }
        for r in results
    ]
    path.write_text(json.dumps({"env": environment(), "results": rows}, indent=2))

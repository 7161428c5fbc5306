"""The write benchmark cases: the ways users write, each timed for
``xarray_gds.to_zarr`` (values in GPU memory, encoded by nvCOMP) against xarray's own
``to_zarr`` of the same values brought to host memory with ``.as_numpy()`` (zarr-python
encodes), doing the same calls:

- ``write-append-100``: 100 appends (``append_dim="time"``) of one 4 MiB step of 4
  variables (1 MiB each), the first step written with ``mode="w"``;
- ``write-region``: a template (``compute=False``), then one ``region=`` write per
  chunk of the bench store's variable, from one process;
- ``write-dask``: the bench store opened with ``chunks={}`` (dask arrays of CuPy
  blocks for gds-zarr; engine="zarr", numpy blocks, for xarray) and written;
- ``write-sharded``: a (time, 721, 1440) float32 variable in shards of 4 x 721 x 1440
  holding inner chunks of 1 x 103 x 360;
- ``write-blosc-v2``: Zarr v2 with Blosc (lz4, byte shuffle), zarr-python 2's default.

Each case's store is the data it writes (its size and chunk count are the case's). On a
machine without a GPU every contender runs on the host (numpy values): a smoke test of
the case, and the host path against xarray's.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pandas as pd
import xarray as xr
import zarr.codecs as zc

from xarray_gds import device as _device

__all__ = ["cases"]

APPENDS = 100
STEP_VARIABLES = 4
STEP_BYTES = 4 << 20  #: one appended step, all variables
SHARD = (4, 721, 1440)
INNER = (1, 103, 360)


def _where() -> str:
    return "cuda" if _device.cuda_status()[0] else "cpu"


def _out(path: Path) -> Path:
    return path.with_name(f"{path.stem}-written.zarr")  # removed by bench.run


def _field(nt: int, ny: int, nx: int, seed: int) -> np.ndarray:
    """Smooth in space, slowly varying in time, plus noise, quantized to 0.01."""
    rng = np.random.default_rng(seed)
    yy, xx = np.meshgrid(np.linspace(0, 6, ny), np.linspace(0, 6, nx), indexing="ij")
    base = (np.sin(yy + seed) * np.cos(xx) * 20 + 280).astype("f4")
    out = np.empty((nt, ny, nx), dtype="f4")
    for k in range(nt):
        noise = rng.normal(0, 0.5, (ny, nx)).astype("f4")
        out[k] = np.round(base + 0.1 * k + noise, 2)
    return out


def _times(nt: int) -> pd.DatetimeIndex:
    return pd.date_range("2000-01-01", periods=nt, freq="h")


def _load(path: Path) -> xr.Dataset:
    """The store's values on the device (host without a GPU), encodings cleared."""
    ds = xr.open_dataset(path, engine="gds-zarr", device=_where()).load()
    for var in ds.variables.values():
        var.encoding = {}
    return ds


def _host(ds: xr.Dataset) -> xr.Dataset:
    return ds.as_numpy()


@contextlib.contextmanager
def _v3_consolidation_notice_once() -> Iterator[None]:
    """zarr warns at every write of a Zarr v3 store that consolidates its metadata (what
    ``to_zarr`` does by default, xarray's and the engine's alike) that consolidated
    metadata is not in the v3 specification. A loop of writes would repeat it at every
    call: the loops of the cases let it through once, before the loop."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Consolidated metadata is currently not part", category=UserWarning
        )
        yield


# -- write-append-100 ---------------------------------------------------------------


def make_append(path: Path, nbytes: int, **_: Any) -> Path:
    """100 steps of 4 variables, a step of ``min(4 MiB, nbytes / 100)`` bytes."""
    per_var = max(4096, min(STEP_BYTES, nbytes // APPENDS) // STEP_VARIABLES)
    nx = 512
    ny = max(1, per_var // (4 * nx))
    ds = xr.Dataset(
        {f"v{i}": (("time", "y", "x"), _field(APPENDS, ny, nx, i)) for i in range(STEP_VARIABLES)},
        coords={"time": _times(APPENDS)},
    )
    encoding = {v: {"chunks": (1, ny, nx)} for v in ds.data_vars}
    ds.to_zarr(path, mode="w", encoding=encoding, consolidated=True)
    return path


def append_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    import xarray_gds

    ds = _load(path)
    steps = [ds.isel(time=[k]) for k in range(ds.sizes["time"])]
    encoding: dict[str, dict[str, Any]] = {
        str(v): {"chunks": steps[0][v].shape, "compressors": [zc.ZstdCodec()]} for v in ds
    }
    # the steps are an hour apart: units of hours, which xarray would otherwise choose
    # from the first step (days) and then warn at every append that it cannot use
    encoding["time"] = {"units": "hours since 2000-01-01", "dtype": "int64"}
    out = _out(path)

    def ours() -> None:
        xarray_gds.to_zarr(steps[0], out, mode="w", encoding=encoding)
        with _v3_consolidation_notice_once():
            for step in steps[1:]:
                xarray_gds.to_zarr(step, out, append_dim="time")

    def theirs() -> None:
        _host(steps[0]).to_zarr(out, mode="w", encoding=encoding)
        with _v3_consolidation_notice_once():
            for step in steps[1:]:
                _host(step).to_zarr(out, append_dim="time")

    return {"gds-zarr": ours, "zarr": theirs}


# -- write-region --------------------------------------------------------------------


def region_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    """A template of the store's ``t``, then one region write per chunk."""
    import dask.array as da

    import xarray_gds

    source = xr.open_dataset(path, engine="zarr")
    chunks = source["t"].encoding["chunks"]
    ds = _load(path)[["t"]]
    dims = ds["t"].dims
    template = xr.Dataset(
        {"t": (dims, da.zeros(ds["t"].shape, chunks=chunks, dtype=ds["t"].dtype))},
        coords=ds.coords,
    )
    encoding = {"t": {"chunks": chunks, "compressors": [zc.ZstdCodec()]}}
    data = ds.drop_vars(list(ds.coords))
    grid = [math.ceil(n / c) for n, c in zip(ds["t"].shape, chunks, strict=True)]
    regions: list[dict[str, slice]] = [
        {str(d): slice(i * c, (i + 1) * c) for d, i, c in zip(dims, at, chunks, strict=True)}
        for at in np.ndindex(*grid)
    ]
    blocks = [data.isel(r) for r in regions]
    out = _out(path)

    def ours() -> None:
        xarray_gds.to_zarr(template, out, mode="w", compute=False, encoding=encoding)
        with _v3_consolidation_notice_once():
            for region, block in zip(regions, blocks, strict=True):
                xarray_gds.to_zarr(block, out, region=region)

    def theirs() -> None:
        template.to_zarr(out, mode="w", compute=False, encoding=encoding)
        with _v3_consolidation_notice_once():
            for region, block in zip(regions, blocks, strict=True):
                _host(block).to_zarr(out, region=region)

    return {"gds-zarr": ours, "zarr": theirs}


# -- write-dask ----------------------------------------------------------------------


def dask_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    """The store opened with ``chunks={}`` and written (read and write both timed)."""
    import xarray_gds

    chunks = xr.open_dataset(path, engine="zarr")["t"].encoding["chunks"]
    encoding = {"t": {"chunks": chunks, "compressors": [zc.ZstdCodec()]}}
    out = _out(path)

    def opened(engine: str, **kwargs: Any) -> xr.Dataset:
        ds = xr.open_dataset(path, engine=engine, chunks={}, **kwargs)[["t"]]
        for var in ds.variables.values():
            var.encoding = {}
        return ds

    def ours() -> None:
        ds = opened("gds-zarr", device=_where())
        xarray_gds.to_zarr(ds, out, mode="w", encoding=encoding, consolidated=False)

    def theirs() -> None:
        opened("zarr").to_zarr(out, mode="w", encoding=encoding, consolidated=False)

    return {"gds-zarr": ours, "zarr": theirs}


# -- write-sharded -------------------------------------------------------------------


def _sharded_encoding() -> dict[str, Any]:
    return {"t": {"chunks": INNER, "shards": SHARD, "compressors": [zc.ZstdCodec()]}}


def make_sharded(path: Path, nbytes: int, **_: Any) -> Path:
    """A (time, 721, 1440) float32 variable of about ``nbytes`` (whole shards)."""
    step = SHARD[1] * SHARD[2] * 4
    nt = max(SHARD[0], nbytes // step // SHARD[0] * SHARD[0])
    ds = xr.Dataset(
        {"t": (("time", "y", "x"), _field(nt, SHARD[1], SHARD[2], 0))},
        coords={"time": _times(nt)},
    )
    ds.to_zarr(path, mode="w", encoding=_sharded_encoding(), consolidated=True, zarr_format=3)
    return path


def sharded_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    import xarray_gds

    ds = _load(path)
    out = _out(path)
    encoding = _sharded_encoding()

    def ours() -> None:
        xarray_gds.to_zarr(ds, out, mode="w", encoding=encoding, consolidated=False)

    def theirs() -> None:
        _host(ds).to_zarr(out, mode="w", encoding=encoding, consolidated=False)

    return {"gds-zarr": ours, "zarr": theirs}


# -- write-blosc-v2 ------------------------------------------------------------------


def blosc_contenders(path: Path) -> dict[str, Callable[[], Any]]:
    import xarray_gds

    chunks = xr.open_dataset(path, engine="zarr")["t"].encoding["chunks"]
    ds = _load(path)[["t"]]
    codec = numcodecs.Blosc("lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
    encoding = {"t": {"chunks": chunks, "compressors": [codec]}}
    out = _out(path)

    def ours() -> None:
        xarray_gds.to_zarr(ds, out, mode="w", encoding=encoding, consolidated=False, zarr_format=2)

    def theirs() -> None:
        _host(ds).to_zarr(out, mode="w", encoding=encoding, consolidated=False, zarr_format=2)

    return {"gds-zarr": ours, "zarr": theirs}


def cases() -> dict[str, dict[str, Any]]:
    """The cases, for ``xarray_gds.tools.bench.CASES``. They run on the GPU where there
    is one and on the host otherwise (``"gpu": False``)."""
    return {
        "write-append-100": {
            "gpu": False,
            "scale": 0.2,  # 100 steps of min(4 MiB, size / 100)
            "make": make_append,
            "store": {},
            "contenders": append_contenders,
        },
        "write-region": {
            "gpu": False,
            "needs": ("dask",),
            "scale": 1.0,
            "store": {"chunk_bytes": 4 << 20},
            "contenders": region_contenders,
        },
        "write-dask": {
            "gpu": False,
            "needs": ("dask",),
            "scale": 1.0,
            "store": {"chunk_bytes": 4 << 20},
            "contenders": dask_contenders,
        },
        "write-sharded": {
            "gpu": False,
            "scale": 1.0,
            "make": make_sharded,
            "store": {},
            "contenders": sharded_contenders,
        },
        "write-blosc-v2": {
            "gpu": False,
            "scale": 1.0,
            "store": {"chunk_bytes": 4 << 20, "zarr_format": 2, "compressor": "blosc"},
            "contenders": blosc_contenders,
        },
    }

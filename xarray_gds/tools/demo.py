"""``xarray-gds demo``: a synthetic weather-like Zarr store written, read back with
``engine="gds-zarr"`` and ``engine="zarr"``, compared, and written again with
:func:`xarray_gds.to_zarr`.

Like the rest of the package, importing this module loads no CUDA library.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pandas as pd
import xarray as xr
import zarr
import zarr.codecs

from xarray_gds import device as _device
from xarray_gds.tools import _text
from xarray_gds.tools._text import PROG

__all__ = ["DEMO_SIZES", "demo_encoding", "make_demo_dataset", "run"]

#: (time, lat, lon) sizes: hourly steps on a regular global grid.
DEMO_SIZES: dict[str, tuple[int, int, int]] = {
    "small": (48, 73, 144),  # 2 days on a 2.5 degree grid, about 12 MiB decoded
    "medium": (240, 181, 360),  # 10 days on a 1 degree grid, about 360 MiB decoded
}
_TIME_CHUNK = 12


def make_demo_dataset(size: str = "small", seed: int = 0) -> xr.Dataset:
    """A synthetic, weather-like dataset made with numpy (nothing is downloaded).

    Variables on ``(time, lat, lon)``: ``t2m`` (K, a pole-to-equator gradient, colder
    land, a diurnal cycle that follows local solar time, and noise), ``precip`` (mostly
    zeros with skewed showers), ``u10``/``v10`` (m s-1; written packed as int16 with
    ``scale_factor``, ``add_offset`` and ``_FillValue``, with a few missing values);
    and a 2-D ``land_mask`` (uint8 flags). ``time`` is hourly datetime64 and is
    CF-encoded as integer hours; ``lat``/``lon`` are float coordinates.

    Parameters
    ----------
    size : {"small", "medium"}
        See :data:`DEMO_SIZES`.
    seed : int
        Seed of the random parts, so that the data are reproducible.
    """
    try:
        nt, ny, nx = DEMO_SIZES[size]
    except KeyError:
        raise ValueError(f"size must be one of {sorted(DEMO_SIZES)}, got {size!r}") from None
    rng = np.random.default_rng(seed)
    times = pd.date_range("2024-01-01", periods=nt, freq="h")
    lat = np.linspace(90.0, -90.0, ny)
    lon = np.arange(nx) * (360.0 / nx)
    phi = np.deg2rad(lat)[None, :, None]
    lam = np.deg2rad(lon)[None, None, :]
    hours = np.arange(nt, dtype="f8")[:, None, None]

    # Continents: where a smooth pattern of low wavenumbers is high.
    relief = np.sin(2 * lam + 0.5) * np.cos(3 * phi) + 0.5 * np.sin(5 * lam) * np.sin(2 * phi)
    land = relief[0] > 0.35

    # 2 m temperature: warmer at the equator, colder land, a diurnal cycle peaking
    # at 14h local solar time (stronger over land), and weather noise.
    local_hour = hours + np.rad2deg(lam) / 15.0
    diurnal = np.cos(2 * np.pi * (local_hour - 14.0) / 24.0) * np.cos(phi)
    t2m = (
        300.0
        - 45.0 * np.sin(phi) ** 2
        - 8.0 * land
        + np.where(land, 6.0, 1.5) * diurnal
        + rng.normal(0.0, 0.6, (nt, ny, nx))
    ).astype("f4")

    # Winds: tropical easterlies, mid-latitude westerlies, polar easterlies, plus an
    # eastward-travelling wave and noise.
    wave = np.sin(4 * lam - 2 * np.pi * hours / 36.0) * np.cos(phi)
    u10 = -6.0 * np.cos(6 * phi) + 2.0 * wave + rng.normal(0.0, 1.5, (nt, ny, nx))
    v10 = 4.0 * np.cos(4 * lam - 2 * np.pi * hours / 36.0) * np.cos(phi) * np.sin(2 * phi)
    v10 = v10 + rng.normal(0.0, 1.5, (nt, ny, nx))
    u10, v10 = u10.astype("f4"), v10.astype("f4")
    # A few missing values (a "failed sensor"), so that _FillValue masking matters.
    for wind in (u10, v10):
        wind.flat[rng.choice(wind.size, size=max(1, wind.size // 2000), replace=False)] = np.nan

    # Precipitation: zero where the atmosphere is dry, skewed amounts where it rains.
    moist = np.sin(3 * lam - 2 * np.pi * hours / 30.0) * np.cos(2 * phi) + rng.normal(
        0.0, 0.5, (nt, ny, nx)
    )
    precip = np.where(moist > 0.8, rng.gamma(0.6, 1.2, (nt, ny, nx)), 0.0).astype("f4")

    def cf(units: str, long_name: str, standard_name: str) -> dict[str, str]:
        return {"units": units, "long_name": long_name, "standard_name": standard_name}

    dims = ("time", "lat", "lon")
    return xr.Dataset(
        {
            "t2m": (dims, t2m, cf("K", "2 metre temperature", "air_temperature")),
            "precip": (
                dims,
                precip,
                cf("mm", "Total precipitation (hourly)", "lwe_thickness_of_precipitation_amount"),
            ),
            "u10": (dims, u10, cf("m s-1", "10 metre U wind component", "eastward_wind")),
            "v10": (dims, v10, cf("m s-1", "10 metre V wind component", "northward_wind")),
            "land_mask": (
                ("lat", "lon"),
                land.astype("u1"),
                {
                    "long_name": "Land-sea mask",
                    "standard_name": "land_binary_mask",
                    "units": "1",
                    "flag_values": np.array([0, 1], dtype="u1"),
                    "flag_meanings": "sea land",
                },
            ),
        },
        coords={
            "time": ("time", times, {"long_name": "time", "standard_name": "time"}),
            "lat": ("lat", lat, cf("degrees_north", "latitude", "latitude")),
            "lon": ("lon", lon, cf("degrees_east", "longitude", "longitude")),
        },
        attrs={
            "title": f"xarray-gds demo: synthetic hourly surface weather ({size})",
            "Conventions": "CF-1.10",
            "source": "synthetic data made with numpy by `xarray-gds demo`",
        },
    )


def demo_encoding(ds: xr.Dataset, zarr_format: int) -> dict[str, dict[str, Any]]:
    """Encoding for :meth:`xarray.Dataset.to_zarr`: zstd, 12-hour chunks, packed winds.

    Every variable is zstd-compressed; data variables are chunked by 12 time steps
    and whole in space; index coordinates are one chunk each.

    Zarr v3 uses :class:`zarr.codecs.ZstdCodec`, Zarr v2 :class:`numcodecs.Zstd`.
    """
    if zarr_format not in (2, 3):
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format!r}")
    compressor: Any = zarr.codecs.ZstdCodec(level=3) if zarr_format == 3 else numcodecs.Zstd(3)
    encoding: dict[str, dict[str, Any]] = {
        "time": {"units": "hours since 2024-01-01 00:00:00", "dtype": "int32"},
    }
    for name, var in ds.variables.items():
        chunks = tuple(min(_TIME_CHUNK, n) if d == "time" else n for d, n in var.sizes.items())
        if var.dims == (name,):  # coordinates: one chunk
            chunks = var.shape
        encoding.setdefault(str(name), {}).update(chunks=chunks, compressors=[compressor])
    for name in ("u10", "v10"):
        encoding[name].update(
            dtype="int16", scale_factor=0.01, add_offset=0.0, _FillValue=np.int16(-32767)
        )
    return encoding


def _write_demo(ds: xr.Dataset, path: Path, zarr_format: int) -> None:
    with warnings.catch_warnings():
        # zarr-python notes that consolidated metadata is not (yet) part of the v3
        # spec; xarray and zarr-python read it, and it saves a listing on open.
        warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")
        ds.to_zarr(
            path,
            mode="w",
            zarr_format=zarr_format,
            encoding=demo_encoding(ds, zarr_format),
            consolidated=True,
        )


def _synchronize_if_device(ds: xr.Dataset) -> None:
    if any(_device.is_device_array(v.data) for v in ds.variables.values()):
        _device.cupy().cuda.runtime.deviceSynchronize()


def _timed_load(path: Path, engine: str, **kwargs: Any) -> tuple[xr.Dataset, float]:
    """Open and load ``path`` with ``engine``; wall time includes finishing GPU work."""
    start = time.perf_counter()
    with xr.open_dataset(path, engine=engine, **kwargs) as ds:
        loaded = ds.load()
    _synchronize_if_device(loaded)
    return loaded, time.perf_counter() - start


def _placed(data: Any) -> str:
    return "GPU (cupy)" if _device.is_device_array(data) else "host (numpy)"


def _store_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def run(args: argparse.Namespace) -> int:
    """Run ``xarray-gds demo`` with the parsed ``args``; return the exit status."""
    gpu_ok, gpu_reason = _device.cuda_status()
    if args.device == "cuda" and not gpu_ok:
        _text.error(
            "demo", f"--device cuda was asked for but {gpu_reason}. Try --device auto or cpu."
        )
        return 1
    # The CLI resolves --device auto itself, so that its users read about --device cpu
    # rather than the engine's own warning about device='cpu'.
    engine_device: _device.Device = "cuda" if gpu_ok and args.device != "cpu" else "cpu"
    if args.device == "auto" and not gpu_ok:
        print(
            f"{PROG} demo: warning: no usable GPU ({gpu_reason}); reading on the host with "
            "numpy instead. Pass --device cpu to silence this warning.",
            file=sys.stderr,
        )
    nt, ny, nx = DEMO_SIZES[args.size]
    print(
        f"{PROG} demo: synthetic hourly weather, {nt} x {ny} x {nx} (time x lat x lon), "
        f"Zarr v{args.zarr_format}, zstd, chunks of {_TIME_CHUNK} hours"
    )
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="xarray-gds-demo-")
        parent = Path(tmp)
    else:
        tmp = None
        parent = Path(args.dir).expanduser()
        parent.mkdir(parents=True, exist_ok=True)
    try:
        path = parent / f"weather-{args.size}-v{args.zarr_format}.zarr"
        _write_demo(make_demo_dataset(args.size), path, args.zarr_format)
        nfiles, nbytes = _store_size(path)
        print(f"store:      {path}  ({nfiles} files, {_text.nbytes(nbytes)} on disk)")

        if gpu_ok and engine_device != "cpu":
            # Create the CUDA context before the clock starts: it is a one-off cost.
            _device.cupy().cuda.runtime.deviceSynchronize()
        try:
            gds, gds_s = _timed_load(path, "gds-zarr", device=engine_device)
        except _device.NoCudaDeviceError as err:
            _text.error("demo", f"{err} Run with --device cpu or --device auto.")
            return 1
        ref, ref_s = _timed_load(path, "zarr")

        if any(_device.is_device_array(v.data) for v in gds.variables.values()):
            used = f"cuda ({_text.gpu_name()})"
        elif args.device == "cpu":
            used = "cpu (host, numpy: --device cpu)"
        else:
            used = f"cpu (host, numpy: no usable GPU: {gpu_reason.split('; ')[0]})"
        print(f"device:     {used}")
        print(f"decoded:    {_text.nbytes(ref.nbytes)}")
        print()
        rows = [
            (
                str(name),
                "coord" if name in gds.coords else "data",
                _text.dims(var.dims),
                _text.shape(var.shape),
                str(var.dtype),
                _placed(var.data),
            )
            for name, var in gds.variables.items()
        ]
        print(_text.table(("variable", "kind", "dims", "shape", "dtype", "placement"), rows))
        print()
        times = [
            ("gds-zarr", f"{gds_s:.3f}", f"read on {engine_device}"),
            ("zarr", f"{ref_s:.3f}", "xarray's engine, numpy"),
        ]
        print(_text.table(("engine", "open + load [s]", "notes"), times))
        print(
            "  (one cold run each, on a small store: not a benchmark. "
            f"`{PROG} bench` times repeated runs on stores of GBs.)"
        )
        print()
        try:
            xr.testing.assert_identical(gds.as_numpy(), ref)
        except AssertionError as err:
            print("identical: NO")
            _text.error("demo", f"engine='gds-zarr' and engine='zarr' disagree:\n{err}")
            return 1
        print("identical: yes")
        status = _demo_write(gds, ref, parent, args.zarr_format)
        if status == 0:
            print()
            print(_next_step(path, kept=tmp is None))
        return status
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _next_step(path: Path, kept: bool) -> str:
    """What to run on the demo's store next, or how to keep it when it is temporary."""
    if kept:
        return f"next:       {PROG} info {shlex.quote(str(path))}   (describes the store)"
    return (
        "The stores above are in a temporary directory, removed as the demo ends. "
        f"`{PROG} demo --dir DIR` keeps them; then `{PROG} info DIR/{path.name}` "
        "describes the store."
    )


def _demo_write(gds: xr.Dataset, ref: xr.Dataset, parent: Path, zarr_format: int) -> int:
    """Write the loaded dataset back with ``xarray_gds.to_zarr`` (encoded on the GPU
    when its values are there) and compare with xarray's own write of the same data."""
    from xarray_gds.write import to_zarr

    ours, theirs = parent / "written-by-gds.zarr", parent / "written-by-xarray.zarr"
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # host-encoded arrays say so
        to_zarr(gds, ours, mode="w", zarr_format=zarr_format, consolidated=False)
    seconds = time.perf_counter() - start
    ref.to_zarr(theirs, mode="w", zarr_format=zarr_format, consolidated=False)
    got = xr.open_dataset(ours, engine="zarr", consolidated=False).load()
    want = xr.open_dataset(theirs, engine="zarr", consolidated=False).load()
    print(f"written:    {ours} by xarray_gds.to_zarr in {seconds:.3f} s (one run)")
    try:
        xr.testing.assert_identical(got, want)
    except AssertionError as err:
        print("write round trip identical: NO")
        _text.error("demo", f"xarray_gds.to_zarr and Dataset.to_zarr wrote different data:\n{err}")
        return 1
    print("write round trip identical: yes")
    return 0

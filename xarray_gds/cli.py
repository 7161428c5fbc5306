"""The ``xarray-gds`` command line tool: ``demo``, ``info`` and ``bench``.

``xarray-gds demo`` writes a synthetic weather-like Zarr store, reads it back with
``engine="gds-zarr"`` and ``engine="zarr"``, and shows where each variable landed and
that both engines agree. ``xarray-gds info PATH`` lists the arrays of a store with their
chunking, codec chain, where each codec decodes and where the engine places the data,
for reads on the device this machine would use (``--device`` picks another).
``xarray-gds bench`` times open + load against ``engine="zarr"`` (see
:mod:`xarray_gds.bench`).

Like the rest of the package, importing this module loads no CUDA library.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pandas as pd
import xarray as xr
import zarr
import zarr.codecs
from numcodecs.abc import Codec as NumcodecsCodec
from xarray import conventions
from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec, BytesBytesCodec

import xarray_gds
from xarray_gds import device as _device
from xarray_gds import remote
from xarray_gds.backend import open_store, placement
from xarray_gds.codecs import DecodeChain, ShardChain, Unsupported, codec_name, plan_chain

__all__ = ["HOST_DECODE", "codec_name", "decode_path", "demo_encoding", "main", "make_demo_dataset"]

PROG = "xarray-gds"
_EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE, what a shell reports for `yes | head`

# --------------------------------------------------------------------------------------
# Codec decode paths
# --------------------------------------------------------------------------------------

#: Decode route of codecs that zarr-python decodes (no batched decoder here).
HOST_DECODE = "host (zarr-python)"
GPU_DECODE = "GPU (batched)"
HOST_BATCHED = "host (batched)"


def decode_path(codec: Any, plan: Any = None, device: _device.Device = "cuda") -> str:
    """Where ``engine="gds-zarr"`` decodes ``codec`` of an array decoded by ``plan``.

    Parameters
    ----------
    codec : zarr codec or numcodecs.abc.Codec
        A codec from an array's codec chain (Zarr v3) or its filters/compressor (v2).
    plan : DecodeChain, ShardChain, Unsupported or None
        The array's plan from :func:`xarray_gds.codecs.plan_chain`.
    device : {"cuda", "cpu"}
        The device the engine reads with.

    Returns
    -------
    str
        ``"GPU (batched)"`` when reads on ``device="cuda"`` decode the array with the
        batched pipeline (nvCOMP, CuPy filters); ``"host (batched)"`` when reads on
        ``device="cpu"`` do (threaded numcodecs); else ``"host (zarr-python)"``: the
        plan is not batched, or it is but has no GPU decoder and the read is on
        ``"cuda"`` (such reads fall back to zarr-python, with a warning).
    """
    if not isinstance(plan, DecodeChain | ShardChain):
        return HOST_DECODE
    if device == "cpu":
        return HOST_BATCHED
    return GPU_DECODE if plan.device_ready else HOST_DECODE


# --------------------------------------------------------------------------------------
# Small formatting helpers
# --------------------------------------------------------------------------------------


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> str:
    """Left-aligned plain-text table."""
    rows = [list(map(str, row)) for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def _shape(shape: Iterable[Any]) -> str:
    """``(48, 73, 144)``; ``(73,)`` for one dimension, like a tuple."""
    return str(tuple(int(n) for n in shape))


def _dims(dims: Iterable[Any]) -> str:
    """``(time, lat, lon)``, as xarray prints dimensions."""
    return "(" + ", ".join(str(d) for d in dims) + ")"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _nbytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _error(command: str, message: object) -> None:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)


# --------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------

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


def _gpu_name() -> str:
    try:
        cp = _device.cupy()
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the name is decoration only
        return "CUDA device"


def _store_size(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _run_demo(args: argparse.Namespace) -> int:
    gpu_ok, gpu_reason = _device.cuda_status()
    if args.device == "cuda" and not gpu_ok:
        _error("demo", f"--device cuda was asked for but {gpu_reason}. Try --device auto or cpu.")
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
        print(f"store:      {path}  ({nfiles} files, {_nbytes(nbytes)} on disk)")

        if gpu_ok and engine_device != "cpu":
            # Create the CUDA context before the clock starts: it is a one-off cost.
            _device.cupy().cuda.runtime.deviceSynchronize()
        try:
            gds, gds_s = _timed_load(path, "gds-zarr", device=engine_device)
        except _device.NoCudaDeviceError as err:
            _error("demo", f"{err} Run with --device cpu or --device auto.")
            return 1
        ref, ref_s = _timed_load(path, "zarr")

        if any(_device.is_device_array(v.data) for v in gds.variables.values()):
            used = f"cuda ({_gpu_name()})"
        elif args.device == "cpu":
            used = "cpu (host, numpy: --device cpu)"
        else:
            used = f"cpu (host, numpy: no usable GPU: {gpu_reason.split('; ')[0]})"
        print(f"device:     {used}")
        print(f"decoded:    {_nbytes(ref.nbytes)}")
        print()
        rows = [
            (
                str(name),
                "coord" if name in gds.coords else "data",
                _dims(var.dims),
                _shape(var.shape),
                str(var.dtype),
                _placed(var.data),
            )
            for name, var in gds.variables.items()
        ]
        print(_table(("variable", "kind", "dims", "shape", "dtype", "placement"), rows))
        print()
        times = [
            ("gds-zarr", f"{gds_s:.3f}", f"read on {engine_device}"),
            ("zarr", f"{ref_s:.3f}", "xarray's engine, numpy"),
        ]
        print(_table(("engine", "open + load [s]", "notes"), times))
        print(
            "  (one cold run each, on a small store: not a benchmark. "
            f"`{PROG} bench` times repeated runs on stores of GBs.)"
        )
        print()
        try:
            xr.testing.assert_identical(gds.as_numpy(), ref)
        except AssertionError as err:
            print("identical: NO")
            _error("demo", f"engine='gds-zarr' and engine='zarr' disagree:\n{err}")
            return 1
        print("identical: yes")
        return _demo_write(gds, ref, parent, args.zarr_format)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


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
        _error("demo", f"xarray_gds.to_zarr and Dataset.to_zarr wrote different data:\n{err}")
        return 1
    print("write round trip identical: yes")
    return 0


# --------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------


#: Attributes that change how xarray decodes the values (shown by ``info``).
_CF_DECODING_ATTRS = frozenset(
    {
        "_FillValue",
        "missing_value",
        "scale_factor",
        "add_offset",
        "_Unsigned",
        "units",
        "calendar",
        "dtype",
    }
)


def _dimension_names(array: Any) -> tuple[str, ...] | None:
    """Dimension names as xarray reads them: v3 metadata or the v2 ``_ARRAY_DIMENSIONS``."""
    if array.metadata.zarr_format == 3:
        names = array.metadata.dimension_names
    else:
        names = array.attrs.get("_ARRAY_DIMENSIONS")
    if names is None or len(names) != array.ndim or any(n is None for n in names):
        return None
    return tuple(str(n) for n in names)


def _cf_attrs(array: Any) -> dict[str, Any]:
    """The array's attributes as xarray decodes them: without ``_ARRAY_DIMENSIONS`` and,
    in Zarr v3, with ``_FillValue`` decoded (xarray stores float fill values there as
    base64 of the little-endian float64)."""
    attrs = {k: v for k, v in array.attrs.asdict().items() if k != "_ARRAY_DIMENSIONS"}
    if array.metadata.zarr_format == 3 and "_FillValue" in attrs:
        from xarray.backends.zarr import FillValueCoder

        with contextlib.suppress(Exception):  # show what is stored when it cannot
            attrs["_FillValue"] = FillValueCoder.decode(attrs["_FillValue"], array.dtype)
    return attrs


def _decoded_dtype(name: str, dims: tuple[str, ...], array: Any) -> np.dtype[Any]:
    """The dtype xarray's CF decoding gives (times become datetime64), from metadata only."""
    dtype = np.dtype(array.dtype)
    attrs = _cf_attrs(array)
    sample = xr.Variable(dims, np.zeros((1,) * len(dims), dtype=dtype), attrs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return np.dtype(conventions.decode_cf_variable(name, sample).dtype)
    except Exception:  # undecodable attributes: xarray would complain on open instead
        return dtype


def _on_device(array: Any) -> bool | None:
    """Whether ``engine="gds-zarr"`` reading on a GPU puts this array's values there
    (``None``: xarray cannot read the array)."""
    name = array.basename
    dims = _dimension_names(array)
    if dims is None:
        return None
    dtype = _decoded_dtype(name, dims, array)
    return placement(name, xr.Variable(dims, np.empty((0,) * len(dims), dtype=dtype))) == "cuda"


def _engine_placement(array: Any, device: _device.Device) -> str:
    """Where ``engine="gds-zarr"`` on ``device`` puts this array's values, and why."""
    name = array.basename
    dims = _dimension_names(array)
    on_device = _on_device(array)
    if dims is None or on_device is None:
        return "not readable by xarray (no dimension names)"
    if on_device:
        return "GPU (CuPy)" if device == "cuda" else "host (numpy: the run is on cpu)"
    if dims == (name,):
        return "host (numpy: index coordinate)"
    return f"host (numpy: {_decoded_dtype(name, dims, array)} after CF decoding)"


def _codec_config(codec: Any) -> dict[str, Any]:
    if isinstance(codec, NumcodecsCodec):
        config = dict(codec.get_config())
        config.pop("id", None)
        return config
    meta = codec.to_dict() if callable(getattr(codec, "to_dict", None)) else {}
    config = dict(meta.get("configuration") or {}) if isinstance(meta, Mapping) else {}
    # Nested chains (sharding) are listed on lines of their own.
    config.pop("codecs", None)
    config.pop("index_codecs", None)
    return config


def _codec_text(codec: Any) -> str:
    config = _codec_config(codec)
    args = ", ".join(f"{k}={v!r}" for k, v in config.items())
    return f"{codec_name(codec)}({args})" if args else codec_name(codec)


def _v3_role(codec: Any) -> str:
    if isinstance(codec, ArrayArrayCodec):
        return "filter"
    if isinstance(codec, ArrayBytesCodec):
        return "serializer"
    if isinstance(codec, BytesBytesCodec):
        return "compressor"
    return "codec"


def _v3_rows(
    codecs: Iterable[Any], plan: Any, device: _device.Device, prefix: str = "", depth: int = 0
) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    pad = "  " * depth
    for codec in codecs:
        where = decode_path(codec, plan, device)
        if prefix == "index " and where != HOST_DECODE:
            where = "host (shard index)"
        rows.append((pad + prefix + _v3_role(codec), _codec_text(codec), where))
        inner = getattr(codec, "codecs", None)
        index = getattr(codec, "index_codecs", None)
        if isinstance(codec, zarr.codecs.ShardingCodec) and inner is not None:
            rows += _v3_rows(inner, plan, device, "inner ", depth + 1)
            rows += _v3_rows(index or (), plan, device, "index ", depth + 1)
    return rows


def _codec_rows(array: Any, device: _device.Device) -> list[tuple[str, ...]]:
    """(role, codec, where it decodes on ``device``) in encoding order."""
    metadata = array.metadata
    plan = plan_chain(metadata)
    if metadata.zarr_format == 3:
        return _v3_rows(metadata.codecs, plan, device)
    rows: list[tuple[str, ...]] = [
        ("filter", _codec_text(f), decode_path(f, plan, device)) for f in (metadata.filters or ())
    ]
    if metadata.compressor is not None:
        where = decode_path(metadata.compressor, plan, device)
        rows.append(("compressor", _codec_text(metadata.compressor), where))
    return rows


def _route(array: Any, device: _device.Device) -> str:
    """One line on how reads of ``array`` on ``device`` are decoded."""
    plan = plan_chain(array.metadata)
    to_gpu = device == "cuda" and _on_device(array)
    if isinstance(plan, Unsupported):
        then = ", then copied to the GPU" if to_gpu else ""
        return f"zarr-python on the host ({plan.reason}){then}"
    if device == "cpu":
        return "batched on the host (numcodecs, threaded)"
    if plan.device_ready:
        return "batched: nvCOMP on the GPU"
    then = ", then copied to the GPU" if to_gpu else ""
    return f"zarr-python on the host (a codec here has no GPU decoder){then}, with a warning"


def _write_route(array: Any, device: _device.Device) -> str:
    """One line on how ``xarray_gds.to_zarr`` encodes the values of ``array`` that a
    read on ``device`` gave."""
    from xarray_gds.codecs.encode import plan_encode

    if device == "cpu" or not _on_device(array):
        return "zarr-python on the host (the values are on the host)"
    plan = plan_encode(array.metadata)
    if isinstance(plan, str):
        return f"zarr-python on the host ({plan}); the values are copied from the GPU first"
    return "batched: nvCOMP on the GPU"


def _attr_text(value: Any) -> str:
    """An attribute value as Python would write it: ``nan``, ``-32767``, ``'K'``."""
    if isinstance(value, np.generic):
        value = value.item()
    return repr(value)


def _describe_array(array: Any, device: _device.Device) -> str:
    path = "/" + array.path if array.path else "/"
    dims = _dimension_names(array)
    fields = [
        ("shape", _shape(array.shape)),
        ("dtype", str(array.dtype)),
        ("dims", _dims(dims) if dims is not None else "(none recorded)"),
        ("chunks", _shape(array.chunks)),
    ]
    if array.shards is not None:
        fields.append(("shards", _shape(array.shards)))
    if array.metadata.zarr_format == 2 and array.metadata.order == "F":
        fields.append(("order", "F (column-major chunks)"))
    fields.append(("fill_value", str(array.fill_value)))
    cf = {k: v for k, v in _cf_attrs(array).items() if k in _CF_DECODING_ATTRS}
    if cf:
        fields.append(("cf", ", ".join(f"{k}={_attr_text(v)}" for k, v in cf.items())))
    fields.append(("placement", _engine_placement(array, device)))
    fields.append(("decode", _route(array, device)))
    fields.append(("encode", _write_route(array, device)))
    width = max(len(k) for k, _ in fields)
    lines = [path] + [f"  {k.ljust(width)}  {v}" for k, v in fields]
    rows = _codec_rows(array, device)
    if rows:
        lines.append(f"  {'codecs'.ljust(width)}  (in encoding order; decoding runs bottom-up)")
        lines.append(_table(("role", "codec", "decodes on"), rows, indent="    "))
    else:
        lines.append(f"  {'codecs'.ljust(width)}  (none)")
    return "\n".join(lines)


def _group_paths(store: Any) -> list[str]:
    """Paths of the groups in ``store``, root first (empty when it has no root group)."""
    try:
        root = zarr.open_group(store=store, mode="r")
    except Exception:
        return []
    groups = (p for p, n in root.members(max_depth=None) if isinstance(n, zarr.Group))
    return ["/", *sorted("/" + p for p in groups)]


def _info_device(asked: str) -> tuple[_device.Device, str]:
    """The device ``info`` describes reads on, and a line that says why."""
    if asked == "cpu":
        return "cpu", "cpu (--device cpu)"
    ok, reason = _device.cuda_status()
    reason = reason.split("; ")[0]  # without the install hint
    if asked == "cuda":
        return "cuda", "cuda (--device cuda)" + ("" if ok else f"; no usable GPU here: {reason}")
    if ok:
        return "cuda", f"cuda ({_gpu_name()})"
    return "cpu", f"cpu (no usable GPU: {reason}); --device cuda shows a GPU run's routes"


def _storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` pairs as ``storage_options``: a dotted key is a
    nested one (``client_kwargs.region_name=us-east-1``), a value that is JSON
    (``true``, ``5``, ``{"a": 1}``) is read as JSON, any other value is a string.

    Raises
    ------
    ValueError
        A pair without ``=`` or without a key (the message does not repeat the pair:
        it may be a secret).
    """
    import json

    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:  # the text is not echoed: it may be a secret
            raise ValueError(
                "--storage-option takes KEY=VALUE (e.g. endpoint_url=http://host:9000 or "
                "client_kwargs.region_name=us-east-1); one of them has no "
                + ("'='" if not sep else "KEY")
            )
        *parents, last = name.split(".")
        value: Any = text
        if not remote.is_secret_key(name):  # a secret stays a string, always
            with contextlib.suppress(ValueError):
                value = json.loads(text)
        where = options
        for part in parents:
            where = where.setdefault(part, {})
            if not isinstance(where, dict):
                raise ValueError(f"--storage-option {name!r}: {part!r} is set to a value already")
        where[last] = value
    return options


def _run_info(args: argparse.Namespace) -> int:
    try:
        options = _storage_options(args.storage_option or ())
    except ValueError as err:
        _error("info", err)
        return 2

    def fail(message: object) -> None:  # no credential of the URL or options in it
        _error("info", remote.redact(str(message), options, str(args.path)))

    try:
        store = open_store(args.path, storage_options=options or None)
    except (OSError, ValueError, KeyError) as err:
        fail(err)  # names the path and says what is wrong
        return 2
    try:
        node = zarr.open(store=store, mode="r", path=args.group or "")
    except (OSError, ValueError, KeyError) as err:
        groups = _group_paths(store) if args.group else []
        if groups and args.group.strip("/") not in (g.strip("/") for g in groups):
            fail(
                f"group {args.group!r} not found in Zarr store {store}; the groups in it "
                "are: " + ", ".join(repr(g) for g in groups),
            )
        elif str(args.path) in str(err):  # zarr's messages name the path
            fail(err)
        else:
            fail(f"cannot read the Zarr metadata of {args.path!r}: {err!r}")
        return 2
    device, device_line = _info_device(args.device)
    if isinstance(node, zarr.Group):
        arrays = sorted(
            (a for _, a in node.members(max_depth=None) if isinstance(a, zarr.Array)),
            key=lambda a: a.path,
        )
        ngroups = 1 + sum(isinstance(n, zarr.Group) for _, n in node.members(max_depth=None))
        kind = f"group: {_plural(len(arrays), 'array')} in {_plural(ngroups, 'group')}"
    else:
        arrays = [node]
        kind = "array"
    shown = remote.store_url(store) if remote.is_remote_url(str(args.path)) else store
    print(f"store:        {shown}")
    print(f"zarr format:  {node.metadata.zarr_format}")
    print(f"node:         /{node.path} ({kind})")
    if isinstance(node, zarr.Group):
        print(f"consolidated: {'yes' if node.metadata.consolidated_metadata else 'no'}")
    print(f"device:       {device_line}")
    print("              (placement, decode and encode below are for reads on this device)")
    for array in arrays:
        print()
        print(_describe_array(array, device))
    return 0


# --------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------


def _run_bench(args: argparse.Namespace) -> int:
    from xarray_gds import bench

    cases = args.case or None
    unknown = sorted(set(cases or ()) - set(bench.CASES))
    if unknown:
        _error("bench", f"unknown case(s) {unknown}; choose from {sorted(bench.CASES)}")
        return 2
    ok, reason = _device.cuda_status()
    if not ok:
        print(f"no GPU ({reason}): running the host cases only")
    profile_dir = Path(args.profile) if args.profile else None
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    results = bench.run(
        workdir=Path(args.dir) if args.dir else None,
        size_gb=args.size_gb,
        repeat=args.repeat,
        cases=cases,
        on_result=lambda r: print(bench.format_table([r]), flush=True),
        profile_dir=profile_dir,
    )
    print("\nall cases:")
    print(bench.format_table(results))
    if args.json:
        bench.dump(results, Path(args.json))
        print(f"results written to {args.json}")
    return 0


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Read Zarr stores straight into GPU memory with xarray (engine='gds-zarr').",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {xarray_gds.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="write a sample weather store and read it with both engines",
        description=(
            "Write a synthetic weather-like Zarr store (zstd, chunked), read it with "
            "engine='gds-zarr' and engine='zarr', show where each variable landed and "
            "the time each engine took (one run each: `xarray-gds bench` measures), and "
            "check that both agree."
        ),
    )
    demo.add_argument(
        "--dir", help="keep the store in this directory (default: a temporary one, removed)"
    )
    demo.add_argument("--zarr-format", type=int, choices=(2, 3), default=3)
    demo.add_argument(
        "--device",
        choices=("cuda", "cpu", "auto"),
        default="auto",
        help="where gds-zarr places numeric data; auto uses a GPU when one is usable",
    )
    demo.add_argument("--size", choices=tuple(DEMO_SIZES), default="small")
    demo.set_defaults(run=_run_demo)

    info = commands.add_parser(
        "info",
        help="show arrays, chunking, codecs and placement of a Zarr store",
        description=(
            "List the arrays of a Zarr store (v2 or v3) with shape, dtype, chunks, shards, "
            "the codec chain, where each codec decodes and where engine='gds-zarr' puts "
            "the values. Opens the store read-only."
        ),
    )
    info.add_argument(
        "path", help="a Zarr store: a local directory, or an s3://, http:// or https:// URL"
    )
    info.add_argument("--group", help="only this group (path inside the store)")
    info.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="a storage option of a remote URL, as storage_options= of open_dataset "
        "(repeat it): key=..., secret=..., endpoint_url=..., anon=true, "
        "client_kwargs.region_name=us-east-1 (a dotted KEY is nested; a JSON VALUE is "
        "read as JSON). Credentials never appear in the output",
    )
    info.add_argument(
        "--device",
        choices=("cuda", "cpu", "auto"),
        default="auto",
        help="describe reads on this device; auto: the GPU when one is usable, as the "
        "engine's default",
    )
    info.set_defaults(run=_run_info)

    bench = commands.add_parser(
        "bench",
        help="time open + load against engine='zarr' (ratios measured in one run)",
        description="Write benchmark stores, then time open + load of each with "
        "engine='gds-zarr', engine='zarr' (+ cupy.asarray on the GPU) and, for the "
        "zstd case, the raw kvikio + nvCOMP limit. Prints GB/s and ratios.",
    )
    bench.add_argument("--size-gb", type=float, default=2.0, help="store size (default 2)")
    bench.add_argument("--repeat", type=int, default=3, help="timed runs, best kept")
    bench.add_argument("--case", action="append", help="run only this case (repeatable)")
    bench.add_argument("--dir", help="where to write the stores (default: a temp dir)")
    bench.add_argument("--json", help="also write the results as JSON to this file")
    bench.add_argument(
        "--profile",
        metavar="DIR",
        help="after the timed runs, profile one more run of each contender (cProfile) "
        "and write CASE.CONTENDER.txt to DIR",
    )
    bench.set_defaults(run=_run_bench)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure the decode-route cost model's constants on this machine",
        description="Time nvCOMP batches of one and of many chunks, one host thread's "
        "decode of a chunk for each compressor, and the copy to the device; print the "
        "constants as the JSON value of xarray_gds.route_constants "
        "(XARRAY_GDS_ROUTE_CONSTANTS). Needs a GPU.",
    )
    calibrate.set_defaults(run=_run_calibrate)
    return parser


def _run_calibrate(args: argparse.Namespace) -> int:
    ok, why = _device.cuda_status()
    if not ok:
        print(f"{PROG} calibrate: needs a GPU ({why})", file=sys.stderr)
        return 1
    from xarray_gds.calibrate import calibrate

    print(calibrate().to_json())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ``xarray-gds`` command line tool.

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name; ``None`` uses ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status: 0 on success, 1 when a command failed, 2 for usage errors and
        stores that cannot be opened, 141 (as for a process killed by SIGPIPE) when the
        reader of the output went away before it was all written.
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except BrokenPipeError:
        # the reader went away (`xarray-gds info STORE | head`): stop quietly. Point
        # stdout at /dev/null so that the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _EXIT_BROKEN_PIPE


if __name__ == "__main__":
    raise SystemExit(main())

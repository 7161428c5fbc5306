"""The ``loader-*`` benchmark cases: training batches from an ERA5-like store.

The store: 20 float32 variables of ``time x 721 x 1440`` in chunks of one time step
(4 MiB, zstd level 1), the number of steps set by ``--size-gb`` (about 83 MB a step;
100 steps for 8.3 GB). Below two batches of full-size steps (a smoke test, such as
``--size-gb 0.05`` on a machine without a GPU) the grid shrinks to ``73 x 144``.

Each timed call reads :data:`EPOCHS` epochs of shuffled batches (``loader-16x20``: 16
random time steps of all 20 variables, stacked into ``(16, 20, 721, 1440)``;
``loader-4x4``: 4 steps of 4 variables), by:

- ``gds-zarr loader``: :class:`xarray_gds.BatchLoader` over the store opened with
  ``engine="gds-zarr"`` (on the GPU where there is one), prefetching 2 batches;
- ``zarr``, ``zarr N workers``: the usual recipe, a PyTorch ``DataLoader`` over a
  map-style dataset that reads one sample with ``engine="zarr"`` (``isel(time=i)`` of
  every variable, stacked), with 4, 8 and 16 worker processes (``zarr`` is the 8-worker
  one), ``pin_memory=True`` and a non-blocking copy of each batch to the GPU. Without
  a GPU: a 2-worker DataLoader (``zarr``) when PyTorch is installed, else
  ``zarr (one process, no DataLoader)``: a loop over the same shuffled batches reading
  each sample with ``engine="zarr"`` in this process.

The note gives samples/s of each and the loader against the fastest other. The
``-train`` variant adds a simulated training step after each batch (matrix products on
the GPU taking about 50 ms, waited for; on the host a 50 ms wait) and reports, for each
contender, the fraction of the time spent waiting on data rather than in the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr
import zarr
import zarr.codecs as zc

from xarray_gds import device as _device
from xarray_gds.loader import BatchLoader
from xarray_gds.tools._stores import write_blocks

__all__ = ["EPOCHS", "contenders", "make_era5", "note"]

NAMES = [f"v{i:02d}" for i in range(20)]
FULL = (721, 1440)
SMALL = (73, 144)
EPOCHS = 3  #: epochs a timed call reads
STEP_SECONDS = 0.05  #: the simulated training step
_SEED = 0
#: the contender without PyTorch: engine="zarr" in a loop of this process
PLAIN = "zarr (one process, no DataLoader)"

#: what the last run of each contender saw: samples read and seconds spent in the step
_seen: dict[tuple[str, str], dict[str, float]] = {}


def make_era5(path: Path, nbytes: int, batch: int = 16, **_: Any) -> Path:
    """The ERA5-like store of about ``nbytes`` (see the module), at least two batches of
    ``batch`` time steps; every variable a smooth field plus noise rounded to 0.01 (it
    compresses about as real data does)."""
    ny, nx = FULL
    nt = nbytes // (len(NAMES) * ny * nx * 4)
    if nt < 2 * batch:
        ny, nx = SMALL
        nt = 2 * batch + 1
    nt = int(nt)
    rng = np.random.default_rng(0)
    yy, xx = np.meshgrid(np.linspace(0, 6, ny), np.linspace(0, 12, nx), indexing="ij")
    base = (np.sin(yy) * np.cos(xx) * 20 + 280).astype("f4")
    noise = [rng.standard_normal((ny, nx), dtype="f4") for _ in range(7)]
    time_axis = pd.date_range("2000-01-01", periods=nt, freq="6h")
    enc = {name: {"chunks": (1, ny, nx), "compressors": [zc.ZstdCodec(level=1)]} for name in NAMES}
    block = max(1, (512 << 20) // (len(NAMES) * ny * nx * 4))

    def blocks() -> Iterator[xr.Dataset]:
        for start in range(0, nt, block):
            steps = range(start, min(nt, start + block))
            data = {}
            for k, name in enumerate(NAMES):
                values = np.stack(
                    [np.roll(noise[(t + k) % len(noise)], t + 3 * k, axis=1) for t in steps]
                )
                data[name] = (("time", "lat", "lon"), np.round(base + values * (1 + k % 3), 2))
            yield xr.Dataset(
                data,
                coords={
                    "time": time_axis[steps.start : steps.stop],
                    "lat": np.linspace(90, -90, ny),
                    "lon": np.linspace(0, 360, nx, endpoint=False),
                },
            )

    return write_blocks(path, blocks(), enc, zarr_format=3)


class ZarrSamples:
    """The recipe's map-style dataset: sample ``i`` is ``isel(time=i)`` of every
    variable read with ``engine="zarr"``, stacked into ``(channels, lat, lon)``. The
    store is opened on first use in each process (the DataLoader's workers)."""

    def __init__(self, path: Path, names: list[str]) -> None:
        self.path = path
        self.names = names
        self._ds: xr.Dataset | None = None
        self._len = int(zarr.open_array(path / names[0], mode="r").shape[0])

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        if self._ds is None:
            self._ds = xr.open_dataset(self.path, engine="zarr", consolidated=True)
        step = self._ds[self.names].isel(time=int(i))
        return np.stack([step[name].values for name in self.names])


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _gpu_step(cp: Any) -> Callable[[], None]:
    """Matrix products on the GPU taking about :data:`STEP_SECONDS`, waited for."""
    n = 4096
    a = cp.random.default_rng(0).random((n, n), dtype=cp.float32)
    stream = cp.cuda.get_current_stream()
    (a @ a).sum()
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    stream.synchronize()
    once = (time.perf_counter() - start) / 5
    count = max(1, round(STEP_SECONDS / once))

    def step() -> None:
        for _ in range(count):
            a @ a
        stream.synchronize()

    return step


def _host_step() -> None:
    time.sleep(STEP_SECONDS)  # the host waits while a GPU would compute


def contenders(
    batch: int, n_vars: int, train: bool = False
) -> Callable[[Path], dict[str, Callable[[], Any]]]:
    """The contenders of a case (see the module) over the store at the path given."""

    def make(path: Path) -> dict[str, Callable[[], Any]]:
        names = NAMES[:n_vars]
        cuda, _ = _device.cuda_status()
        torch = _torch()
        case = f"loader-{batch}x{n_vars}" + ("-train" if train else "")
        step: Callable[[], None] | None = None
        if train:
            step = _gpu_step(_device.cupy()) if cuda else _host_step

        def timed(label: str, batches: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> None:
                samples, in_step = 0, 0.0
                for _ in range(EPOCHS):
                    for b in batches():
                        samples += len(b)
                        if step is not None:
                            start = time.perf_counter()
                            step()
                            in_step += time.perf_counter() - start
                _seen[(case, label)] = {"samples": samples, "step": in_step}

            return run

        ds = xr.open_dataset(
            path, engine="gds-zarr", device="cuda" if cuda else "cpu", consolidated=True
        )
        loader = BatchLoader(
            ds, "time", variables=names, batch_size=batch, stack="channel", seed=_SEED, prefetch=2
        )
        out = {"gds-zarr loader": timed("gds-zarr loader", lambda: loader)}
        samples = ZarrSamples(path, names)
        if torch is None:
            order = BatchLoader(ds, "time", variables=names[:1], batch_size=batch, seed=_SEED)

            def plain() -> Any:
                for b in order.batches():
                    yield np.stack([samples[int(i)] for i in b])
                order.set_epoch(order.epoch + 1)

            out[PLAIN] = timed(PLAIN, plain)
            return out
        for workers in (4, 8, 16) if cuda else (2,):
            label = "zarr" if workers == (8 if cuda else 2) else f"zarr {workers} workers"
            out[label] = timed(label, _data_loader(torch, samples, batch, workers, cuda))
        return out

    return make


def _data_loader(torch: Any, samples: ZarrSamples, batch: int, workers: int, cuda: bool) -> Any:
    """An epoch of the recipe's DataLoader (made once: its workers persist), each batch
    copied to the GPU without blocking when there is one."""
    loader = torch.utils.data.DataLoader(
        samples,
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        pin_memory=cuda,
        persistent_workers=True,
        prefetch_factor=2,
        generator=torch.Generator().manual_seed(_SEED),
    )

    def epoch() -> Any:
        for b in loader:
            yield b.to("cuda", non_blocking=True) if cuda else b
        if cuda:
            torch.cuda.synchronize()

    return epoch


def note(result: Any) -> str:
    """Samples/s of each contender, the loader against the fastest other, and (for the
    ``-train`` variant) the fraction of each one's time spent waiting on data."""
    parts = []
    rates = {}
    for label, seconds in result.seconds.items():
        seen = _seen.get((result.case, label))
        if seen is None:
            continue
        rates[label] = seen["samples"] / seconds
        text = f"{label} {rates[label]:.1f} samples/s"
        if result.case.endswith("-train") and seen["step"] > 0:
            # the last (profiled or timed) run: its share of time outside the step
            total = seen["samples"] / rates[label]
            waited = max(0.0, 1 - seen["step"] / total)
            text += f" (waits on data {100 * waited:.0f}%)"
        parts.append(text)
    others = [r for k, r in rates.items() if k != "gds-zarr loader"]
    if "gds-zarr loader" in rates and others:
        parts.append(f"loader vs the fastest other: {rates['gds-zarr loader'] / max(others):.2f}x")
    return "; ".join(parts)


def nbytes_read(n_vars: int) -> float:
    """The part of the store one timed call reads (``parts`` of a bench case)."""
    return EPOCHS * n_vars / len(NAMES)


def cases() -> dict[str, dict[str, Any]]:
    """The ``loader-*`` entries of :data:`xarray_gds.tools.bench.CASES`."""
    out: dict[str, dict[str, Any]] = {}
    for batch, n_vars, train in ((16, 20, False), (4, 4, False), (16, 20, True)):
        name = f"loader-{batch}x{n_vars}" + ("-train" if train else "")
        out[name] = {
            "gpu": False,  # runs on the host too (numpy batches, a 2-worker DataLoader or PLAIN)
            "named_only": True,  # a store of 8.3 GB a case: run with --case
            "scale": 4.15,  # --size-gb 2: 100 time steps (8.3 GB)
            "repeat": 1,
            "make": lambda path, nbytes, batch=batch, **kw: make_era5(path, nbytes, batch),
            "store": {},
            "parts": nbytes_read(n_vars),
            "contenders": contenders(batch, n_vars, train),
            "note": note,
        }
    return out

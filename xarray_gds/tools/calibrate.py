"""Measure the constants of the decode-route cost model (:mod:`xarray_gds.route`).

``xarray-gds calibrate`` times, on the machine at hand, nvCOMP batches of 1 and of
many chunks and one host thread's decode of a chunk, for each compressor, plus the
copy of decoded bytes to the device, and prints the constants as the JSON value of
``xarray_gds.route_constants`` (``XARRAY_GDS_ROUTE_CONSTANTS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numcodecs
import numpy as np

from xarray_gds import device as _device
from xarray_gds.route import Costs, Rates

__all__ = ["calibrate"]

#: compressor name -> numcodecs codec writing the stream the engine decodes
_CODECS: dict[str, Callable[[], Any]] = {
    "zstd": lambda: numcodecs.Zstd(level=1),
    "lz4": lambda: numcodecs.LZ4(),
    "zlib": lambda: numcodecs.Zlib(level=1),
    "gzip": lambda: numcodecs.GZip(level=1),
    "blosc": lambda: numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE),
}


def _chunk(nbytes: int, seed: int) -> np.ndarray:
    """Weather-like float32 values (smooth field plus noise, quantised): real ratios."""
    n = nbytes // 4
    rng = np.random.default_rng(seed)
    base = np.sin(np.linspace(0, 60, n, dtype="f4")) * 20 + 280
    return np.round(base + rng.standard_normal(n, dtype="f4"), 2)


def _best(fn: Callable[[], Any], repeat: int = 5) -> float:
    cp = _device.cupy()
    fn()
    best = np.inf
    for _ in range(repeat):
        cp.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        fn()
        cp.cuda.runtime.deviceSynchronize()
        best = min(best, time.perf_counter() - start)
    return float(best)


def _measure(name: str, codec: Any, chunk_nbytes: int, many: int, small: int) -> Any:
    """``(Rates, seconds of one tiny nvCOMP call)`` of one compressor."""
    from xarray_gds.codecs import Compressor, DecodeChain, nvcomp

    cp = _device.cupy()
    chain = DecodeChain((chunk_nbytes // 4,), np.dtype("f4"), compressor=Compressor(name, codec))
    encoded = [np.frombuffer(codec.encode(_chunk(chunk_nbytes, i)), np.uint8) for i in range(8)]
    one = nvcomp.pack([cp.asarray(encoded[0])])
    batch = nvcomp.pack([cp.asarray(encoded[i % 8]) for i in range(many)])
    keys = [f"calibrate/{i}" for i in range(many)]
    t1 = _best(lambda: nvcomp.decode(chain, one, [0], keys[:1]))
    tn = _best(lambda: nvcomp.decode(chain, batch, list(range(many)), keys), 3)
    tiny_chain = DecodeChain((small // 4,), np.dtype("f4"), compressor=Compressor(name, codec))
    tiny = nvcomp.pack([cp.asarray(np.frombuffer(codec.encode(_chunk(small, 0)), np.uint8))])
    t0 = _best(lambda: nvcomp.decode(tiny_chain, tiny, [0], keys[:1]))
    gpu_batch = (many - 1) * chunk_nbytes / max(tn - t1, 1e-9)
    gpu_chunk = chunk_nbytes / max(t1 - t0 - chunk_nbytes / gpu_batch, 1e-9)
    host = min(_timed(lambda: codec.decode(encoded[0])) for _ in range(5))
    return Rates(gpu_chunk, gpu_batch, chunk_nbytes / host), t0


def calibrate(chunk_nbytes: int = 4 << 20, many: int = 256, small: int = 4 << 10) -> Costs:
    """Measure the cost model's constants on this machine's GPU and host."""
    cp = _device.cupy()
    rates: list[tuple[str, Rates]] = []
    calls: list[float] = []
    for name, make in _CODECS.items():
        rate, call = _measure(name, make(), chunk_nbytes, many, small)
        rates.append((name, rate))
        calls.append(call)
    pageable = np.empty(64 << 20, np.uint8)
    h2d = pageable.nbytes / _best(lambda: cp.asarray(pageable))
    return Costs(gpu_call=float(np.median(calls)), h2d=h2d, rates=tuple(rates))


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

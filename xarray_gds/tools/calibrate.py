"""Measure the constants of the decode-route cost model (:mod:`xarray_gds.route`).

``xarray-gds calibrate`` times, on the machine at hand, nvCOMP batches of 1 and of
many chunks and one host thread's decode of a chunk, for each compressor (with
numcodecs, and with the format's faster decoder where one is installed), the same for
encoding (nvCOMP's encoder against the numcodecs codec), a chunk's Python work on the
host, plus the copies of chunks from pinned memory to the device and from the device
to the host, and prints the constants as the JSON value of ``xarray_gds.route_constants``
(``XARRAY_GDS_ROUTE_CONSTANTS``).

``xarray-gds calibrate --compare`` (:func:`compare`) checks the model: for batches of
1, 4, 16 and 64 chunks of 4 MiB (zstd and zlib by default) it prints the model's
seconds for nvCOMP alone, the host route and the split (:func:`xarray_gds.route.split`
forced on: its ``k``) next to the measured time of each, with the constants in effect
(the defaults, or ``XARRAY_GDS_ROUTE_CONSTANTS``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numcodecs
import numpy as np

from xarray_gds import decode, route
from xarray_gds import device as _device
from xarray_gds.batch import PinnedStaging, pack, pool_threads
from xarray_gds.codecs import formats
from xarray_gds.route import Costs, Rates

__all__ = ["Compared", "calibrate", "compare", "host_chunk_seconds", "predict", "table"]

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
    chain = DecodeChain(
        (chunk_nbytes // 4,), np.dtype("f4"), compressor=Compressor(name, codec), stored_order=(0,)
    )
    encoded = [np.frombuffer(codec.encode(_chunk(chunk_nbytes, i)), np.uint8) for i in range(8)]
    one = nvcomp.pack([cp.asarray(encoded[0])])
    batch = nvcomp.pack([cp.asarray(encoded[i % 8]) for i in range(many)])
    keys = [f"calibrate/{i}" for i in range(many)]
    t1 = _best(lambda: nvcomp.decode(chain, one, [0], keys[:1]))
    tn = _best(lambda: nvcomp.decode(chain, batch, list(range(many)), keys), 3)
    tiny_chain = DecodeChain(
        (small // 4,), np.dtype("f4"), compressor=Compressor(name, codec), stored_order=(0,)
    )
    tiny = nvcomp.pack([cp.asarray(np.frombuffer(codec.encode(_chunk(small, 0)), np.uint8))])
    t0 = _best(lambda: nvcomp.decode(tiny_chain, tiny, [0], keys[:1]))
    enc = _encode_rates(codec, chunk_nbytes, many, t0)
    gpu_batch = (many - 1) * chunk_nbytes / max(tn - t1, 1e-9)
    gpu_chunk = chunk_nbytes / max(t1 - t0 - chunk_nbytes / gpu_batch, 1e-9)
    host = min(_timed(lambda: codec.decode(encoded[0])) for _ in range(5))
    fast = chain.compressor.format.fast_decoder() if chain.compressor else None
    host_fast = None
    if fast is not None:
        seconds = min(_timed(lambda: fast(encoded[0], chunk_nbytes)) for _ in range(5))
        host_fast = chunk_nbytes / seconds
    return replace(Rates(gpu_chunk, gpu_batch, chunk_nbytes / host, host_fast), **enc), t0


def _encode_rates(codec: Any, chunk_nbytes: int, many: int, call: float) -> dict[str, float]:
    """The encode rates of one compressor (:func:`xarray_gds.route.choose_encode`):
    nvCOMP's batch of one and of ``many`` chunks of device values, one host thread's
    encode of a chunk (``call``: seconds of a tiny nvCOMP call). Empty where nvCOMP has
    no encoder for it."""
    import zarr

    from xarray_gds.codecs import nvcomp
    from xarray_gds.codecs.encode import EncodeChain, encode_host, plan_encode

    cp = _device.cupy()
    n = chunk_nbytes // 4
    meta = zarr.create_array(
        store={}, shape=(many, n), chunks=(1, n), dtype="f4", compressors=[codec], zarr_format=2
    ).metadata
    plan = plan_encode(meta, "gpu")
    if not isinstance(plan, EncodeChain):
        return {}
    host = np.stack([_chunk(chunk_nbytes, i % 8) for i in range(many)])[:, None, :]
    device = cp.asarray(host)
    t1 = _best(lambda: nvcomp.encode(plan, device[:1]))
    tn = _best(lambda: nvcomp.encode(plan, device), 3)
    batch = (many - 1) * chunk_nbytes / max(tn - t1, 1e-9)
    one = min(_timed(lambda: encode_host(plan, host[:1])) for _ in range(5))
    return {
        "encode_gpu_chunk": chunk_nbytes / max(t1 - call - chunk_nbytes / batch, 1e-9),
        "encode_gpu_batch": batch,
        "encode_host_thread": chunk_nbytes / one,
    }


def host_chunk_seconds(n: int = 4000) -> float:
    """Seconds of one chunk's Python work on the host pool: the decode of ``n`` tiny
    zstd chunks (whose decoding itself is nothing) by the host runtime, a chunk."""
    from xarray_gds.codecs import Compressor, host

    codec = numcodecs.Zstd(level=1)
    tiny = [np.frombuffer(codec.encode(_chunk(64, i)), np.uint8) for i in range(n)]
    keys = [f"calibrate/{i}" for i in range(n)]
    compressor = Compressor("zstd", codec)
    host.decompress(compressor, tiny[:64], 64, keys)
    return min(_timed(lambda: host.decompress(compressor, tiny, 64, keys)) for _ in range(3)) / n


def calibrate(chunk_nbytes: int = 4 << 20, many: int = 256, small: int = 4 << 10) -> Costs:
    """Measure the cost model's constants on this machine's GPU and host."""
    cp = _device.cupy()
    rates: list[tuple[str, Rates]] = []
    calls: list[float] = []
    for name, make in _CODECS.items():
        rate, call = _measure(name, make(), chunk_nbytes, many, small)
        rates.append((name, rate))
        calls.append(call)
    # the host route copies from pinned staging buffers (decode.decode_staged)
    with PinnedStaging().lease(64 << 20) as pinned:
        h2d = pinned.nbytes / _best(lambda: cp.asarray(pinned))
    values = cp.zeros(64 << 20, dtype=cp.uint8)  # the host route of writes copies to pageable
    d2h = values.nbytes / _best(lambda: cp.asnumpy(values))
    return Costs(
        gpu_call=float(np.median(calls)),
        h2d=h2d,
        d2h=d2h,
        host_chunk=host_chunk_seconds(),
        rates=tuple(rates),
    )


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Compared:
    """The model's seconds and the measured seconds of one batch shape (``nan`` where
    not measured; no split of one chunk)."""

    format: str
    chunks: int
    chunk_nbytes: int
    choice: str  #: what the model does with it: "gpu", "host" or "split k"
    split_k: int  #: the host's chunks of the split forced on (0: none)
    gpu: float
    host: float
    split: float
    gpu_measured: float = float("nan")
    host_measured: float = float("nan")
    split_measured: float = float("nan")


def predict(name: str, n_chunks: int, chunk_nbytes: int, costs: Costs) -> Compared:
    """The model's seconds of a batch of the format ``name`` (``costs.threads`` set):
    nvCOMP alone, the host route, the split forced on, and what it chooses."""
    fmt = formats.get(name)
    gpu, host = route.estimate(fmt, n_chunks, chunk_nbytes, costs)
    auto = route.split(fmt, n_chunks, chunk_nbytes, costs)
    choice = "gpu" if auto.host == 0 else "host" if auto.gpu == 0 else f"split {auto.host}"
    forced = route.split(fmt, n_chunks, chunk_nbytes, costs, force=True)
    k = forced.host if 0 < forced.host < n_chunks else 0
    return Compared(
        name, n_chunks, chunk_nbytes, choice, k, gpu, host, forced.seconds if k else float("nan")
    )


def table(rows: Sequence[Compared]) -> str:
    """Rows as a Markdown table, in milliseconds."""

    def ms(x: float) -> str:
        return "-" if x != x else f"{x * 1e3:.1f}"

    lines = [
        "| format | chunks | MiB each | model's choice | GPU model | GPU measured | host model "
        "| host measured | split k | split model | split measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.format} | {r.chunks} | {r.chunk_nbytes / 2**20:g} | {r.choice} "
            f"| {ms(r.gpu)} | {ms(r.gpu_measured)} | {ms(r.host)} | {ms(r.host_measured)} "
            f"| {r.split_k or '-'} | {ms(r.split)} | {ms(r.split_measured)} |"
        )
    return "\n".join(lines)


def compare(
    formats: Sequence[str] = ("zstd", "zlib"),
    counts: Sequence[int] = (1, 4, 16, 64),
    chunk_nbytes: int = 4 << 20,
    repeat: int = 3,
) -> list[Compared]:
    """The model's seconds (the constants in effect, :func:`xarray_gds.route.costs`)
    next to the measured seconds of nvCOMP alone (``decode_fetched``), the host route
    (``decode_staged``) and the split forced on (``decode_split``), for each format
    and number of chunks: chunks of weather-like float32, already in memory (device
    memory for nvCOMP and the split, host memory for the host route)."""
    from xarray_gds.codecs import Compressor, DecodeChain

    c = route.costs()
    c = replace(c, threads=c.threads or pool_threads())
    staging = PinnedStaging()
    rows = []
    for fmt in formats:
        codec = _CODECS[fmt]()
        chain = DecodeChain(
            (chunk_nbytes // 4,),
            np.dtype("f4"),
            compressor=Compressor(fmt, codec),
            stored_order=(0,),
        )
        encoded = [np.frombuffer(codec.encode(_chunk(chunk_nbytes, i)), np.uint8) for i in range(8)]
        for n in counts:
            stored = [encoded[i % len(encoded)] for i in range(n)]
            row = predict(fmt, n, chunk_nbytes, c)
            rows.append(_measured(row, chain, stored, staging, c.threads, repeat))
    return rows


def _measured(
    row: Compared,
    chain: Any,
    stored: list[np.ndarray],
    staging: PinnedStaging,
    threads: int,
    repeat: int,
) -> Compared:
    """``row`` with the measured seconds of its batch (``stored`` chunks)."""
    cp = _device.cupy()
    device = pack([cp.asarray(e) for e in stored])
    keys = [f"compare/{row.format}/{i}" for i in range(len(stored))]
    gpu = _best(lambda: decode.decode_fetched(chain, device, keys, True), repeat)
    host = _best(lambda: decode.decode_staged(chain, stored, keys, staging), repeat)
    split = float("nan")
    if row.split_k:
        used = min(row.split_k, threads)
        split = _best(
            lambda: decode.decode_split(chain, device, keys, staging, row.split_k, used), repeat
        )
    return replace(row, gpu_measured=gpu, host_measured=host, split_measured=split)

"""Where the time of a device load goes: reads, nvCOMP's decode, and their overlap.

Needs a CUDA device (run it on a GPU machine from the project's wheels, see
docs/development.md). Writes a 2 GB zstd store of two variables (4 MiB chunks, the
bench's ``usage-eager-2var`` store) under /tmp, then measures, best of four:

A. one nvCOMP call over 1 to all chunks of a variable (the cost a call and a chunk);
   the same chunks split over 2 and 4 streams issued from one thread, both variables
   on one stream and on two (whether decodes on separate streams overlap);
B. the engine's reads of one and two variables, and of one while the other decodes
   (raw nvCOMP on its stream, and the package's decode in another thread);
C. open_dataset(...).load() with ``XARRAY_GDS_PIPELINE_PARTS`` 1, 2, 4, with a timeline
   of each read, frame check and nvCOMP call (thread, start and end in ms);
D. the chunks={} and load_async loads.

``PP_ONLY_C=name`` runs C and D only (e.g. with ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``
to compare CuPy's per-thread default streams). Results go to ``$OUT/pp<name>.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cupy as cp
import numpy as np
import xarray as xr
import zarr
from nvidia import nvcomp

from xarray_gds import coalesce
from xarray_gds.codecs import nvcomp as nv
from xarray_gds.codecs import plan_chain
from xarray_gds.stores.files import read_files_device
from xarray_gds.tools import bench

STORE = Path("/tmp/pp/s.zarr")


def best(fn: Callable[[], Any], n: int = 4) -> float:
    """The shortest of ``n`` runs of ``fn``, the device idle before and after each."""
    times = []
    for _ in range(n):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def ms(res: dict[str, Any], prefix: str = "") -> dict[str, float]:
    return {k: round(v * 1e3, 1) for k, v in res.items() if k.startswith(prefix)}


def chunk_files(name: str) -> list[str]:
    return sorted(str(p) for p in (STORE / name / "c").rglob("*") if p.is_file())


class Raw:
    """nvCOMP called directly: one codec on each of four streams, the framed streams of
    both variables, an output buffer for each."""

    def __init__(self, chain: Any, batches: list[Any], files: list[list[str]]) -> None:
        fmt = chain.compressor.format
        self.row = chain.nbytes
        self.framed = [
            (b, *nv._frame(fmt, b, b.offsets, b.sizes, self.row, f))
            for b, f in zip(batches, files, strict=True)
        ]
        self.outs = [cp.empty((len(f), self.row), cp.uint8) for f in files]
        self.streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
        self.codecs = [
            nvcomp.Codec(
                algorithm=fmt.nvcomp,
                bitstream_kind=nvcomp.BitstreamKind.RAW,
                device_id=0,
                cuda_stream=s.ptr,
            )
            for s in self.streams
        ]

    def issue(self, var: int, lane: int, part: slice = slice(None)) -> Any:
        """Queue the decode of chunks ``part`` of variable ``var`` on stream ``lane``."""
        batch, offsets, sizes = self.framed[var]
        stream = self.streams[lane]
        offsets, sizes, out = offsets[part], sizes[part], self.outs[var][part]
        k = len(offsets)
        src = nvcomp.as_arrays(
            batch.arena, offsets.tolist(), sizes.tolist(), cuda_stream=stream.ptr
        )
        rows = (np.arange(k) * self.row).tolist()
        dst = nvcomp.as_arrays(out.reshape(-1), rows, [self.row] * k, cuda_stream=stream.ptr)
        return self.codecs[lane].decode(src, out=dst), src, dst  # alive until synchronized

    def sync(self, lanes: int) -> None:
        for s in self.streams[:lanes]:
            s.synchronize()

    def split(self, parts: int) -> float:
        """Variable 0 split over ``parts`` streams; returns the time taken to issue them."""
        n = len(self.outs[0])
        step = n // parts
        t = time.perf_counter()
        alive = [
            self.issue(0, p, slice(p * step, (p + 1) * step if p < parts - 1 else n))
            for p in range(parts)
        ]
        issued = time.perf_counter() - t
        self.sync(parts)
        del alive
        return issued

    def both(self, lanes: int) -> None:
        """Both variables, on one stream or on two."""
        alive = [self.issue(0, 0), self.issue(1, lanes - 1)]
        self.sync(lanes)
        del alive


def measure_calls(
    res: dict[str, Any], chain: Any, batches: list[Any], files: list[list[str]]
) -> None:
    """A, then B."""
    batch, n = batches[0], len(files[0])
    for m in (1, 8, 32, 64, 128, n):
        idx = list(range(m))
        res[f"decode_{m}"] = best(lambda idx=idx: nv.decode(chain, batch, idx, files[0]))
    print("A", ms(res, "decode"), flush=True)
    raw = Raw(chain, batches, files)
    res["raw_one_call_var"] = best(lambda: raw.split(1))
    for parts in (2, 4):
        res[f"raw_{parts}streams_var"] = best(lambda parts=parts: raw.split(parts))
        res[f"raw_{parts}streams_issue_s"] = raw.split(parts)
    res["raw_2vars_2streams"] = best(lambda: raw.both(2))
    res["raw_2vars_1stream"] = best(lambda: raw.both(1))
    t = time.perf_counter()  # does a call return before the device has decoded?
    alive = raw.issue(0, 0)
    res["raw_call_returns_s"] = time.perf_counter() - t
    raw.sync(1)
    res["raw_call_sync_s"] = time.perf_counter() - t
    del alive
    print("A2", ms(res, "raw"), flush=True)

    res["read_var"] = best(lambda: read_files_device(files[0]))
    res["read_2vars"] = best(lambda: [read_files_device(f) for f in files])

    def read_during_raw_decode() -> None:
        alive = raw.issue(0, 0)
        read_files_device(files[1])
        raw.sync(1)
        del alive

    def read_during_package_decode() -> None:
        decoding = threading.Thread(
            target=lambda: nv.decode(chain, batch, list(range(n)), files[0])
        )
        decoding.start()
        read_files_device(files[1])
        decoding.join()

    res["read_var_during_raw_decode"] = best(read_during_raw_decode)
    res["read_var_during_pkg_decode_thread"] = best(read_during_package_decode)
    print("B", ms(res, "read"), flush=True)


def timed(events: list[tuple[str, str, float, float]], module: Any, name: str) -> None:
    """Log each call of ``module.name``: (name, thread, start, end)."""
    inner = getattr(module, name)

    def logged(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            events.append((name, threading.current_thread().name, t, time.perf_counter()))

    setattr(module, name, logged)


def measure_loads(res: dict[str, Any]) -> None:
    """C, then D."""
    events: list[tuple[str, str, float, float]] = []
    for module, name in (
        (coalesce, "_read"),
        (coalesce, "_decode"),
        (nv, "_frame"),
        (nv, "_run"),
        (nv, "_aligned"),
    ):
        timed(events, module, name)

    def load(**kwargs: Any) -> xr.Dataset:
        return xr.open_dataset(STORE, engine="gds-zarr", consolidated=True, **kwargs)

    for parts in (1, 2, 4):
        os.environ["XARRAY_GDS_PIPELINE_PARTS"] = str(parts)
        res[f"eager_parts{parts}"] = best(lambda: load().load())
        events.clear()
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        load().load()
        cp.cuda.Device().synchronize()
        end = round((time.perf_counter() - t0) * 1e3, 2)
        res[f"timeline_parts{parts}"] = [
            (e[0], e[1], round((e[2] - t0) * 1e3, 2), round((e[3] - t0) * 1e3, 2)) for e in events
        ] + [("total", "", 0, end)]
        print("C", parts, round(res[f"eager_parts{parts}"] * 1e3, 1), flush=True)
        for event in res[f"timeline_parts{parts}"]:
            print("   ", event)
    os.environ["XARRAY_GDS_PIPELINE_PARTS"] = "1"
    res["chunks_load"] = best(lambda: load(chunks={}).compute())
    res["async_load"] = best(lambda: asyncio.run(load().load_async()))
    print("D", ms(res, "chunks_load"), ms(res, "async_load"), flush=True)


def main() -> None:
    if not STORE.exists():
        t0 = time.perf_counter()
        STORE.parent.mkdir(exist_ok=True)
        bench.make_store(STORE, 2 << 30, 4 << 20, variables=2)
        print("made store", time.perf_counter() - t0, flush=True)
    res: dict[str, Any] = {}
    only_c = os.environ.get("PP_ONLY_C", "")
    if not only_c:
        chain = plan_chain(zarr.open_array(STORE / "t", mode="r").metadata)
        files = [chunk_files("t"), chunk_files("v1")]
        print("files", *map(len, files), flush=True)
        measure_calls(res, chain, [read_files_device(f) for f in files], files)
    measure_loads(res)
    out = Path(os.environ.get("OUT", "/tmp"))
    (out / f"pp{only_c}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()

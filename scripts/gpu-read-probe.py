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

import json, os, sys, threading, time
from pathlib import Path
import numpy as np
import cupy as cp
import xarray as xr

OUT = Path(os.environ.get("OUT", "/tmp"))
ROOT = Path("/tmp/pp")
ROOT.mkdir(exist_ok=True)
store = ROOT / "s.zarr"
from xarray_gds.tools import bench

if not store.exists():
    t0 = time.perf_counter()
    bench.make_store(store, 2 << 30, 4 << 20, variables=2)
    print("made store", time.perf_counter() - t0, flush=True)
res = {}


def best(fn, n=4):
    ts = []
    for _ in range(n):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        ts.append(time.perf_counter() - t)
    return min(ts)


from xarray_gds.codecs import nvcomp as nv, plan_chain
from xarray_gds.stores.files import read_files_device
import zarr
from nvidia import nvcomp

arr = zarr.open_array(store / "t", mode="r")
chain = plan_chain(arr.metadata)
files = sorted(str(p) for p in (store / "t" / "c").rglob("*") if p.is_file())
files2 = sorted(str(p) for p in (store / "v1" / "c").rglob("*") if p.is_file())
print("files", len(files), len(files2), flush=True)
batch = read_files_device(files)
batch2 = read_files_device(files2)
n = len(files)
if not os.environ.get("PP_ONLY_C"):
    # A. decode scaling
    for m in (1, 8, 32, 64, 128, n):
        idx = list(range(m))
        res[f"decode_{m}"] = best(lambda: nv.decode(chain, batch, idx, files))
    print("A", {k: round(v * 1e3, 1) for k, v in res.items()}, flush=True)
    # A2. raw nvcomp: one call on n vs two streams issued back to back from one thread
    fmt = chain.compressor.format
    offs, sizes = nv._frame(fmt, batch, batch.offsets, batch.sizes, chain.nbytes, files)
    offs2, sizes2 = nv._frame(fmt, batch2, batch2.offsets, batch2.sizes, chain.nbytes, files2)
    row = chain.nbytes
    outA = cp.empty((n, row), cp.uint8)
    outB = cp.empty((len(files2), row), cp.uint8)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    codecs = [
        nvcomp.Codec(
            algorithm=fmt.nvcomp,
            bitstream_kind=nvcomp.BitstreamKind.RAW,
            device_id=0,
            cuda_stream=s.ptr,
        )
        for s in streams
    ]

    def mk(b, o, s, out, st):
        i = nvcomp.as_arrays(b.arena, o.tolist(), s.tolist(), cuda_stream=st.ptr)
        k = len(o)
        q = nvcomp.as_arrays(
            out.reshape(-1), (np.arange(k) * row).tolist(), [row] * k, cuda_stream=st.ptr
        )
        return i, q

    def one_call():
        i, q = mk(batch, offs, sizes, outA, streams[0])
        r = codecs[0].decode(i, out=q)
        streams[0].synchronize()

    def two_streams(parts):
        h = n // parts
        calls = []
        t = time.perf_counter()
        for p in range(parts):
            sl = slice(p * h, (p + 1) * h if p < parts - 1 else n)
            i, q = mk(batch, offs[sl], sizes[sl], outA[sl], streams[p])
            calls.append((codecs[p].decode(i, out=q), i, q))
        issued = time.perf_counter() - t
        for s in streams[:parts]:
            s.synchronize()
        return issued

    def both_vars_two_streams():
        i, q = mk(batch, offs, sizes, outA, streams[0])
        r1 = codecs[0].decode(i, out=q)
        i2, q2 = mk(batch2, offs2, sizes2, outB, streams[1])
        r2 = codecs[1].decode(i2, out=q2)
        streams[0].synchronize()
        streams[1].synchronize()

    def both_vars_one_stream():
        i, q = mk(batch, offs, sizes, outA, streams[0])
        r1 = codecs[0].decode(i, out=q)
        i2, q2 = mk(batch2, offs2, sizes2, outB, streams[0])
        r2 = codecs[0].decode(i2, out=q2)
        streams[0].synchronize()

    res["raw_one_call_var"] = best(one_call)
    for parts in (2, 4):
        res[f"raw_{parts}streams_var"] = best(lambda: two_streams(parts))
        res[f"raw_{parts}streams_issue_s"] = two_streams(parts)
    res["raw_2vars_2streams"] = best(both_vars_two_streams)
    res["raw_2vars_1stream"] = best(both_vars_one_stream)
    # does decode return before the GPU finishes?
    i, q = mk(batch, offs, sizes, outA, streams[0])
    t = time.perf_counter()
    r = codecs[0].decode(i, out=q)
    res["raw_call_returns_s"] = time.perf_counter() - t
    streams[0].synchronize()
    res["raw_call_sync_s"] = time.perf_counter() - t
    print("A2", {k: round(v * 1e3, 1) for k, v in res.items() if k.startswith("raw")}, flush=True)
    # B. reads: engine reads of one var, both vars; reads while a decode runs
    res["read_var"] = best(lambda: read_files_device(files))
    res["read_2vars"] = best(lambda: (read_files_device(files), read_files_device(files2)))

    def read_during_decode():
        i, q = mk(batch, offs, sizes, outA, streams[0])
        r = codecs[0].decode(i, out=q)
        read_files_device(files2)
        streams[0].synchronize()

    res["read_var_during_raw_decode"] = best(read_during_decode)

    def read_during_pkg_decode():
        th = threading.Thread(target=lambda: nv.decode(chain, batch, list(range(n)), files))
        th.start()
        read_files_device(files2)
        th.join()

    res["read_var_during_pkg_decode_thread"] = best(read_during_pkg_decode)
    print("B", {k: round(v * 1e3, 1) for k, v in res.items() if k.startswith("read")}, flush=True)
# C. timeline of the eager load
from xarray_gds import coalesce, decode as dec

events = []


def wrap(mod, name):
    f = getattr(mod, name)

    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            events.append((name, threading.current_thread().name, t, time.perf_counter()))

    setattr(mod, name, w)


for mod, name in (
    (coalesce, "_read"),
    (coalesce, "_decode"),
    (nv, "_frame"),
    (nv, "_run"),
    (nv, "_aligned"),
):
    wrap(mod, name)
from xarray_gds import config as cfg


def load():
    return xr.open_dataset(store, engine="gds-zarr", consolidated=True).load()


for parts in (1, 2, 4):
    os.environ["XARRAY_GDS_PIPELINE_PARTS"] = str(parts)
    res[f"eager_parts{parts}"] = best(load)
    events.clear()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    load()
    cp.cuda.Device().synchronize()
    t1 = time.perf_counter()
    res[f"timeline_parts{parts}"] = [
        (e[0], e[1], round((e[2] - t0) * 1e3, 2), round((e[3] - t0) * 1e3, 2)) for e in events
    ] + [("total", "", 0, round((t1 - t0) * 1e3, 2))]
    print("C", parts, round(res[f"eager_parts{parts}"] * 1e3, 1), flush=True)
    for e in res[f"timeline_parts{parts}"]:
        print("   ", e)
os.environ["XARRAY_GDS_PIPELINE_PARTS"] = "1"
res["chunks_load"] = best(
    lambda: xr.open_dataset(store, engine="gds-zarr", consolidated=True, chunks={}).compute()
)
import asyncio

res["async_load"] = best(
    lambda: asyncio.run(xr.open_dataset(store, engine="gds-zarr", consolidated=True).load_async())
)
print("D", round(res["chunks_load"] * 1e3, 1), round(res["async_load"] * 1e3, 1), flush=True)
(OUT / f"pp{os.environ.get('PP_ONLY_C', '')}.json").write_text(
    json.dumps(res, indent=1, default=str)
)

"""Many threads reading and writing at once on a busy card: a missing stream ordering
shows up as wrong values.

A quiet card hides a missing synchronisation: the work a stream should have waited for
has long finished by the time the stream runs. These tests make the card busy in the
way that exposes one. Before each read or write, a thread queues a spin kernel on its
current stream (the legacy default stream, or a non-blocking stream of its own, as a
PyTorch user's code has), then a decoy: a buffer of the size the read allocates,
filled after the spin and freed at once. CuPy's pool hands that block to the read's
next allocation of the same size while the fill is still queued. So

- a side stream (nvCOMP's lane, the staged copies' stream) that does not wait for the
  current stream writes its output before the fill lands on it: the fill wins;
- a stream's work that the host does not wait for before handing a pinned buffer
  back, or before the current stream uses the result, is still waiting behind the
  spin: the next lease overwrites the buffer, or the result is read half written;
- an encode that does not wait for the current stream encodes the values before the
  kernel that computes them has run.

A random busy card still leaves the race to chance. So, on top of it, the
``late_streams`` fixture makes each ordering's window wide open at every call: at
the places where the package hands work from one stream to another (or to the
host), it queues a spin kernel first, poisons what the late work would leave (0xFF
bytes, NaN as float32; zeros as compressed input) and scribbles over pinned buffers
as soon as they go back. With the ordering line in place the late work is waited
for and the values are exact; without it, the poison is what is read:

- kvikio's reads start while a kernel of the current stream still writes the arena;
- staged reads' and slotted reads' pinned buffers are overwritten the moment they go
  back to CuPy's pinned pool, with their copies still queued behind the spin;
- the staged decode's rows come from a block the current stream fills late, and its
  pinned lease is overwritten as it goes back; the split decode's copies are late;
- nvCOMP's decode and encode inputs are written by the current stream after a spin,
  and the block an encode's output gets was filled after a spin and freed just before;
- a prefetched batch's values land after a spin in the loader's thread.

Every value read is compared with what ``engine="zarr"`` reads (or, for writes, with
the values written); the CuPy pool is capped small for the test so that freed blocks
come back at once. ``scripts/ordering-mutants.py`` removes each ordering line of the
installed package in turn and runs these tests: each removal must fail them.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.codecs as zc

import xarray_gds

pytestmark = pytest.mark.gpu

THREADS = 12
ROUNDS = 6
#: the CuPy pool's cap during the test: small, so freed blocks are reused at once
POOL_LIMIT = 384 << 20
SHAPE = (16, 128, 256)  # float32: 128 KiB a time step
CHUNKS = (2, 128, 256)  # 256 KiB chunks, 8 of them

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def _spinner() -> tuple[Any, int]:
    """The spin kernel and the card's clock cycles a second (kHz in CUDA's attribute;
    about 2 GHz where a driver leaves it out)."""
    import cupy as cp

    rate = (cp.cuda.Device().attributes.get("ClockRate") or 2_000_000) * 1000
    return cp.RawKernel(_SPIN, "spin"), rate


#: (zarr format, encoding of variable "a") of the stores read and written
CODECS: dict[str, tuple[int, dict[str, Any]]] = {
    "zstd-v3": (3, {"compressors": [zc.ZstdCodec(level=1)]}),
    "gzip-v3": (3, {"compressors": [zc.GzipCodec(level=1)]}),
    "sharded-crc-v3": (
        3,
        {
            "chunks": (1, 64, 256),
            "shards": CHUNKS,
            "compressors": [zc.ZstdCodec(level=1)],
        },
    ),
    "blosc-lz4-v2": (
        2,
        {"compressors": [numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE)]},
    ),
    "lz4-v2": (2, {"compressors": [numcodecs.LZ4()]}),
    "zlib-v2": (2, {"compressors": [numcodecs.Zlib(level=1)]}),
}

#: settings of each wave: every thread of a wave reads and writes under them
WAVES: dict[str, dict[str, Any]] = {
    "gpu-kvikio": {"xarray_gds.route": "gpu", "xarray_gds.small_read": 0},
    "gpu-staged-reads": {"xarray_gds.route": "gpu", "xarray_gds.small_read": 1 << 30},
    "host-staged-decode": {"xarray_gds.route": "host"},
    "split": {"xarray_gds.route": "gpu", "xarray_gds.split": "on"},
}


def _values(seed: int) -> np.ndarray:
    """Compressible, distinct values: a smooth field plus rounded noise."""
    rng = np.random.default_rng(seed)
    t, y, x = np.meshgrid(*(np.arange(n, dtype=np.float32) for n in SHAPE), indexing="ij")
    field = 250 + 0.5 * t + np.sin(y / 9 + seed) * 10 + np.cos(x / 13) * 5
    return (field + rng.integers(0, 8, SHAPE) / 4).astype(np.float32)


def _dataset(values: Any, codec: str) -> tuple[xr.Dataset, dict[str, Any], int]:
    zarr_format, enc = CODECS[codec]
    ds = xr.Dataset({"a": (("time", "y", "x"), values)})
    return ds, {"a": {"chunks": CHUNKS, **enc}}, zarr_format


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, np.ndarray]]:
    """One store a codec, with what engine="zarr" reads from it."""
    root = tmp_path_factory.mktemp("stress")
    out = {}
    for i, codec in enumerate(CODECS):
        ds, encoding, zarr_format = _dataset(_values(i), codec)
        path = root / f"{codec}.zarr"
        ds.to_zarr(path, encoding=encoding, zarr_format=zarr_format, mode="w")
        expected = xr.open_dataset(path, engine="zarr").a.values
        out[codec] = (path, expected)
    return out


class _Noise:
    """A thread that keeps the legacy default stream (shared by every thread that has
    not chosen a stream) busy: spin kernels, each followed by decoys of the sizes the
    reads allocate, filled and freed at once, with about ``DEPTH`` spins queued at any
    time (it waits for the one ``DEPTH`` back, never for the whole queue)."""

    DEPTH = 3

    def __init__(self, spin: Any, rate: float, sizes: list[int]) -> None:
        self.spin, self.rate, self.sizes = spin, rate, sizes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import cupy as cp

        marks: list[Any] = []
        with cp.cuda.Stream.null:
            while not self.stop.is_set():
                self.spin((1,), (1,), (np.int64(0.008 * self.rate),))
                for n in self.sizes:
                    decoy = cp.empty(n, dtype=cp.uint8)
                    decoy.fill(0xFF)  # NaN where read as float32: never a stored value
                    del decoy
                marks.append(cp.cuda.Stream.null.record())
                if len(marks) > self.DEPTH:
                    marks.pop(0).synchronize()
            cp.cuda.Stream.null.synchronize()


@pytest.fixture
def busy_card() -> Iterator[Callable[[int], None]]:
    """``busy(nbytes)``: a spin kernel, then a decoy block of ``nbytes`` filled and
    freed, on the current stream; meanwhile a :class:`_Noise` thread keeps the default
    stream busy, and the CuPy pool is capped at POOL_LIMIT."""
    import cupy as cp

    pool = cp.get_default_memory_pool()
    limit = pool.get_limit()
    pool.free_all_blocks()
    pool.set_limit(size=POOL_LIMIT)
    spin, rate = _spinner()
    rng = np.random.default_rng(0)
    lock = threading.Lock()
    whole = int(np.prod(SHAPE)) * 4
    chunk = int(np.prod(CHUNKS)) * 4
    sizes = sorted({whole, whole // 2, *(chunk * k for k in range(1, 9)), 1 << 20, 4 << 20})
    noise = _Noise(spin, rate, sizes)

    def busy(nbytes: int) -> None:
        with lock:
            seconds = float(rng.uniform(0.005, 0.03))
        spin((1,), (1,), (np.int64(seconds * rate),))
        for n in (nbytes, *sizes):
            decoy = cp.empty(n, dtype=cp.uint8)
            decoy.fill(0xFF)
            del decoy

    noise.thread.start()
    try:
        yield busy
    finally:
        noise.stop.set()
        noise.thread.join()
        cp.cuda.Device().synchronize()
        pool.free_all_blocks()
        pool.set_limit(size=limit)


#: seconds of the spin kernel before each hand-over in ``late_streams``
LATE = 0.015


@pytest.fixture
def late_streams(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Wraps the package's stream hand-overs so that a missing ordering reads poison
    (see the module's docstring); counts the calls of each wrapper."""
    import cupy as cp
    import cupyx

    from xarray_gds import decode
    from xarray_gds.codecs import nvcomp
    from xarray_gds.loader import prefetch
    from xarray_gds.stores import files

    spin, rate = _spinner()
    calls: Counter[str] = Counter()
    lock = threading.Lock()

    def hit(name: str) -> None:
        with lock:
            calls[name] += 1

    def late(stream: Any = None) -> None:
        with stream if stream is not None else contextlib.nullcontext():
            spin((1,), (1,), (np.int64(LATE * rate),))

    def poisoned(src: Any, byte: int) -> Any:
        """A copy of ``src`` holding ``byte`` everywhere until a spin of the current
        stream has run; only then the values of ``src``."""
        out = cp.empty_like(src)
        out.reshape(-1).view(cp.uint8).fill(byte)
        cp.cuda.get_current_stream().synchronize()
        late()
        out[...] = src
        return out

    def decoy(nbytes: int) -> None:
        """A block of ``nbytes`` filled with 0xFF after a spin and freed at once: the
        next allocation of that size on this stream is handed it while the fill is
        still queued."""
        block = cp.empty(nbytes, dtype=cp.uint8)
        late()
        block.fill(0xFF)
        del block

    def scribble_pinned(nbytes: int) -> None:
        """Overwrite the pinned blocks of ``nbytes`` that CuPy's pinned pool has free."""
        blocks = [cupyx.empty_pinned((nbytes,), dtype=np.uint8) for _ in range(4)]
        for block in blocks:
            block.fill(0xFF)

    def scribble_staging(staging: Any) -> None:
        with staging._lock:
            for block in staging._free:
                block.fill(0xFF)

    read_kvikio, read_staged, read_slotted = (
        files._read_kvikio,
        files._read_staged,
        files._read_slotted,
    )

    def late_read_kvikio(reads: Any, arena: Any) -> None:
        hit("kvikio-read")
        late()
        arena.fill(0xFF)  # a kernel of the current stream still writing the block
        read_kvikio(reads, arena)

    def late_read_staged(reads: Any, arena: Any, total: int) -> None:
        hit("staged-read")
        late()
        try:
            read_staged(reads, arena, total)
        finally:
            scribble_pinned(files._pinned_size(total))

    def late_read_slotted(paths: Any, slots: Any) -> Any:
        hit("slotted-read")
        late()
        try:
            return read_slotted(paths, slots)
        finally:
            scribble_pinned(files._pinned_size(int(np.sum(slots))))

    decode_staged, decode_split = decode.decode_staged, decode.decode_split

    def late_decode_staged(chain: Any, fetched: Any, keys: Any, staging: Any) -> Any:
        hit("staged-decode")
        decoy(sum(f is not None for f in fetched) * chain.nbytes)
        try:
            return decode_staged(chain, fetched, keys, staging)
        finally:
            scribble_staging(staging)

    def late_decode_split(
        chain: Any, fetched: Any, keys: Any, staging: Any, host: int, threads: int
    ) -> Any:
        hit("split-decode")
        late(decode._copy_stream())  # the stream its copies will run on, made late
        try:
            return decode_split(chain, fetched, keys, staging, host, threads)
        finally:
            scribble_staging(staging)

    run, encode_batch = nvcomp._run, nvcomp._encode_batch

    def late_run(fmt: Any, codec: Any, src: Any, *rest: Any) -> Any:
        hit("nvcomp-decode")
        arena = poisoned(src.arena, 0)
        return run(fmt, codec, nvcomp.DeviceBatch(arena, src.offsets, src.sizes), *rest)

    batch_arrays = nvcomp._batch
    output = threading.local()  # the size of the encode output this thread allocates next

    def late_batch(buffer: Any, offsets: Any, sizes: Any, stream: Any) -> Any:
        size = getattr(output, "size", None)
        if size is not None:  # the lane is set up: the output's block is handed out next
            output.size = None
            decoy(size)
        return batch_arrays(buffer, offsets, sizes, stream)

    def late_encode_batch(fmt: Any, buffer: Any, offsets: Any, sizes: Any) -> Any:
        hit("nvcomp-encode")
        bound = fmt.encode_bound(int(np.max(sizes))) if len(sizes) else 0
        output.size = len(sizes) * (-(-bound // nvcomp._ALIGN) * nvcomp._ALIGN)
        try:
            return encode_batch(fmt, poisoned(buffer, 0xFF), offsets, sizes)
        finally:
            output.size = None

    prefetcher_init = prefetch.Prefetcher.__init__

    def late_prefetcher_init(self: Any, read: Any, plan: Any, depth: int, gpu: Any) -> None:
        def late_read(samples: Any) -> Any:
            batch = read(samples)
            if gpu is None or not isinstance(batch, dict):
                return batch
            hit("prefetch")
            return {
                k: poisoned(v, 0xFF) if isinstance(v, cp.ndarray) else v for k, v in batch.items()
            }

        prefetcher_init(self, late_read, plan, depth, gpu)

    if os.environ.get("XARRAY_GDS_STRESS_LATE") == "0":  # the busy card alone
        return calls
    monkeypatch.setattr(files, "_read_kvikio", late_read_kvikio)
    monkeypatch.setattr(files, "_read_staged", late_read_staged)
    monkeypatch.setattr(files, "_read_slotted", late_read_slotted)
    monkeypatch.setattr(decode, "decode_staged", late_decode_staged)
    monkeypatch.setattr(decode, "decode_split", late_decode_split)
    monkeypatch.setattr(nvcomp, "_run", late_run)
    monkeypatch.setattr(nvcomp, "_encode_batch", late_encode_batch)
    monkeypatch.setattr(nvcomp, "_batch", late_batch)
    monkeypatch.setattr(prefetch.Prefetcher, "__init__", late_prefetcher_init)
    return calls


def _on_stream(own_stream: bool) -> Any:
    import cupy as cp

    return cp.cuda.Stream(non_blocking=True) if own_stream else contextlib.nullcontext()


def _read(path: Path, expected: np.ndarray, busy: Callable[[int], None], k: int) -> None:
    import cupy as cp

    ds = xr.open_dataset(path, engine="gds-zarr", device="cuda")
    # the last pick reads part of each shard of a sharded store (byte ranges)
    pick = [
        (slice(None),),
        (slice(k % 8, None),),
        (slice(None), slice(0, 60), slice(2 * (k % 3), 200)),
    ][k % 3]
    busy(expected.nbytes if k % 3 == 0 else expected.nbytes // 2)
    got = ds.a[pick].load().data
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(got), expected[pick], err_msg=f"{path.name}")


def _read_dask(path: Path, expected: np.ndarray, busy: Callable[[int], None]) -> None:
    import cupy as cp

    ds = xr.open_dataset(path, engine="gds-zarr", device="cuda", chunks={})
    busy(expected.nbytes)
    got = ds.a.compute(scheduler="sync").data
    np.testing.assert_array_equal(cp.asnumpy(got), expected, err_msg=f"{path.name} (dask)")


def _write(out: Path, codec: str, seed: int, busy: Callable[[int], None]) -> None:
    """Values computed on the busy current stream, written at once, read back by zarr."""
    import cupy as cp

    want = _values(100 + seed)
    base = cp.asarray(want)
    busy(want.nbytes)
    values = base * 1  # queued behind the spin: the encode must wait for it
    ds, encoding, zarr_format = _dataset(values, codec)
    xarray_gds.to_zarr(ds, out, mode="w", encoding=encoding, zarr_format=zarr_format)
    got = xr.open_dataset(out, engine="zarr").a.values
    np.testing.assert_array_equal(got, want, err_msg=f"{codec} write")


def _loader_epoch(path: Path, expected: np.ndarray, k: int) -> None:
    """An epoch of the prefetching loader, consumed on a stream of the caller's own
    while its thread reads on the busy default stream."""
    import cupy as cp

    ds = xr.open_dataset(path, engine="gds-zarr", device="cuda")
    loader = xarray_gds.BatchLoader(ds, "time", batch_size=4, seed=k, prefetch=2)
    order = loader.batches(0)
    with cp.cuda.Stream(non_blocking=True):
        for samples, batch in zip(order, loader, strict=True):
            got = cp.asnumpy(batch["a"])
            np.testing.assert_array_equal(got, expected[samples], err_msg=f"{path.name} loader")


def _job(
    t: int, stores: dict[str, tuple[Path, np.ndarray]], out: Path, busy: Callable[[int], None]
) -> None:
    codecs = list(stores)
    for r in range(ROUNDS):
        k = t * ROUNDS + r
        codec = codecs[k % len(codecs)]
        path, expected = stores[codec]
        kind = k % 5
        # a write computes in dask's threads, on their default stream: values of a
        # stream of the caller's own are the caller's to synchronise, so writes start
        # on the default stream
        with _on_stream(own_stream=k % 3 == 0 and kind != 3):
            if kind in (0, 1):
                _read(path, expected, busy, k)
            elif kind == 2:
                _read_dask(path, expected, busy)
            elif kind == 3:
                _write(out / f"w{t}-{r}.zarr", codec, k, busy)
            else:
                _loader_epoch(path, expected, k)


def _run_threads(job: Callable[[int], None]) -> None:
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            start.wait()
            job(t)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]


#: the hand-overs of ``late_streams`` that each wave must pass through
CROSSED: dict[str, set[str]] = {
    "gpu-kvikio": {"kvikio-read", "nvcomp-decode", "nvcomp-encode", "prefetch"},
    "gpu-staged-reads": {"slotted-read", "nvcomp-decode", "prefetch"},
    "host-staged-decode": {"staged-decode", "prefetch"},
    "split": {"split-decode", "prefetch"},
}


@pytest.mark.parametrize("wave", list(WAVES))
def test_busy_card_reads_and_writes_are_exact(
    wave: str,
    stores: dict[str, tuple[Path, np.ndarray]],
    busy_card: Callable[[int], None],
    late_streams: Counter[str],
    tmp_path: Path,
) -> None:
    with zarr.config.set(WAVES[wave]):
        _run_threads(lambda t: _job(t, stores, tmp_path, busy_card))
    report = os.environ.get("XARRAY_GDS_STRESS_REPORT")
    if report:  # which hand-overs each wave went through, for the record
        with open(report, "a") as f:
            f.write(json.dumps({"wave": wave, "calls": dict(late_streams)}) + "\n")
    if os.environ.get("XARRAY_GDS_STRESS_LATE") == "0":
        return
    missing = CROSSED[wave] - set(late_streams)
    assert not missing, f"wave {wave} never went through {sorted(missing)}: {dict(late_streams)}"

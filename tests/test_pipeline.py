"""The batched read pipeline: plans, batching, filters, fallbacks and damaged chunks."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds.array
from xarray_gds import coalesce, decode, entries, pipeline, shards
from xarray_gds.codecs import DecodeChain, ShardChain, Unsupported, crc32c, plan_chain
from xarray_gds.codecs.filters import Undelta, Unshuffle
from xarray_gds.errors import ChunkDecodeError
from xarray_gds.place import place

from .conftest import STORE_CASES, to_numpy

pytestmark = pytest.mark.filterwarnings("ignore::xarray.SerializationWarning")

# (format, codec) -> expected plan of the t2m variable: "gpu", "host" (batched on the
# host only) or "zarr" (not batched: zarr-python decodes it).
EXPECTED_PLAN = {
    (3, "zstd"): "gpu",
    (3, "zstd-checksum"): "gpu",
    (3, "gzip"): "gpu",
    (3, "none"): "gpu",
    (3, "blosc"): "gpu",
    (3, "blosc-zstd-bit"): "gpu",
    # checked by nvCOMP's CRC32 where the installed nvCOMP has it (nvCOMP 6 does)
    (3, "crc32c"): "gpu" if crc32c.available() else "host",
    (3, "big-endian"): "gpu",
    (3, "sharded"): "gpu",
    (3, "shuffle-zlib"): "gpu",
    (3, "lzma"): "zarr",
    (2, "zstd"): "gpu",
    (2, "lz4"): "gpu",
    (2, "zlib"): "gpu",
    (2, "gzip"): "gpu",
    (2, "blosc"): "gpu",
    (2, "blosc-blosclz"): "host",  # blosclz streams: no GPU decoder
    (2, "none"): "gpu",
    (2, "shuffle-zstd"): "gpu",
    (2, "delta-zlib"): "host",  # float32 Delta: CuPy's scan would round differently
    (2, "bz2"): "zarr",
}


def _plan(path: Path, name: str = "t2m") -> DecodeChain | Unsupported:
    return plan_chain(zarr.open_array(path / name, mode="r").metadata)


@pytest.mark.parametrize(("zarr_format", "codec"), STORE_CASES)
def test_plan_per_codec(store_factory: Callable, zarr_format: int, codec: str) -> None:
    plan = _plan(store_factory(zarr_format, codec))
    want = EXPECTED_PLAN[(zarr_format, codec)]
    if want == "zarr":
        assert isinstance(plan, Unsupported)
        assert plan.codecs and plan.reason
    elif codec == "sharded":
        assert isinstance(plan, ShardChain) and plan.device_ready
        assert plan.shard_shape == (4, 4, 5) and plan.grid == (2, 2, 5)
        assert plan.index_crc32c and plan.index_at_end
    else:
        assert isinstance(plan, DecodeChain)
        assert plan.device_ready == (want == "gpu")
        assert plan.chunk_shape == (4, 4, 5) and plan.dtype.itemsize == 4


def test_integer_delta_is_device_ready(store_factory: Callable) -> None:
    plan = _plan(store_factory(2, "delta-zlib"), "u10")  # stored as int16
    assert isinstance(plan, DecodeChain) and plan.device_ready


def test_big_endian_delta_is_not_batched(tmp_path: Path) -> None:
    """A Delta in big-endian order sums big-endian scalars: no batched stage (neither
    CuPy nor the host's view of the chunk as the array's dtype handles that order), so
    zarr-python decodes it and the values match engine="zarr"."""
    path = tmp_path / "delta-be.zarr"
    ds = xr.Dataset({"v": ("x", np.arange(20, dtype="i4") * 7 - 30)})
    encoding = {
        "v": {
            "chunks": (6,),
            "filters": [numcodecs.Delta(dtype=">i4")],
            "compressors": [numcodecs.Zlib()],
        }
    }
    ds.to_zarr(path, zarr_format=2, consolidated=True, encoding=encoding)
    plan = _plan(path, "v")
    assert isinstance(plan, Unsupported)
    assert plan.reason == "filter 'delta' has no batched decoder"
    got = xr.open_dataset(path, engine="gds-zarr", device="cpu").load()
    xr.testing.assert_identical(got, xr.open_dataset(path, engine="zarr").load())
    np.testing.assert_array_equal(got.v.values, ds.v.values)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the batched reads of t2m's chunks."""
    calls: list[int] = []
    real = decode.decode_fetched

    def spy(chain: Any, fetched: Any, keys: list, *args: Any) -> Any:
        # a shard's inner chunks are counted as its shards are assembled, below
        if len(keys) and keys[0].startswith("t2m/") and "(inner chunk" not in keys[0]:
            calls.append(len(keys))
        return real(chain, fetched, keys, *args)

    real_shards = shards._assemble_shards

    def spy_shards(chain: Any, part: list, *args: Any) -> Any:
        if part[0][0].path.startswith("t2m/"):
            calls.append(len(part))
        return real_shards(chain, part, *args)

    monkeypatch.setattr(decode, "decode_fetched", spy)
    monkeypatch.setattr(shards, "_assemble_shards", spy_shards)
    return calls


@pytest.mark.parametrize(("zarr_format", "codec"), STORE_CASES)
def test_reads_take_the_planned_path(
    monkeypatch: pytest.MonkeyPatch,
    store_factory: Callable,
    device: str,
    zarr_format: int,
    codec: str,
) -> None:
    path = store_factory(zarr_format, codec)
    want = EXPECTED_PLAN[(zarr_format, codec)]
    batched = want == "gpu" or (want == "host" and device == "cpu")
    calls = _spy(monkeypatch)
    monkeypatch.setattr(pipeline, "_warned", set())
    ds = xr.open_dataset(path, engine="gds-zarr", device=device)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        values = ds.t2m.load()
    host_warnings = [
        w for w in record if "decoded on the host" in str(w.message) and "'t2m'" in str(w.message)
    ]
    assert bool(calls) == batched
    if batched:
        assert calls == [3 * 3 * 3]  # every chunk of t2m in one batch
    if device == "cuda" and not batched:
        assert len(host_warnings) == 1
        assert "'t2m'" in str(host_warnings[0].message)
    else:
        assert not host_warnings
    ref = xr.open_dataset(path, engine="zarr").t2m.load()
    xr.testing.assert_identical(values.as_numpy(), ref)


def test_bounded_batches(monkeypatch: pytest.MonkeyPatch, v3_store: Path, device: str) -> None:
    """A read larger than the batch budget runs in several bounded batches."""
    chunk_bytes = 4 * 4 * 5 * 4
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", str(2 * chunk_bytes))
    decoded_rows: list[int] = []
    real = decode.decode_host

    def spy_host(chain: Any, chunks: list, keys: list) -> Any:
        if keys[0].startswith("t2m/"):
            decoded_rows.append(len(chunks))
        return real(chain, chunks, keys)

    monkeypatch.setattr(decode, "decode_host", spy_host)
    if device == "cuda":
        from xarray_gds.codecs import nvcomp

        real_dev = nvcomp.decode

        def spy_dev(chain: Any, batch: Any, idx: list, keys: list) -> Any:
            if keys[0].startswith("t2m/"):
                decoded_rows.append(len(idx))
            return real_dev(chain, batch, idx, keys)

        monkeypatch.setattr(nvcomp, "decode", spy_dev)
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device=device)
    got = gds.t2m.load()
    assert decoded_rows and max(decoded_rows) <= 2
    assert sum(decoded_rows) == 26  # 27 chunks, one never written (all NaN)
    xr.testing.assert_identical(got.as_numpy(), xr.open_dataset(v3_store, engine="zarr").t2m)


@pytest.mark.parametrize("elementsize", [1, 2, 4, 8])
def test_unshuffle_matches_numcodecs(elementsize: int) -> None:
    rng = np.random.default_rng(elementsize)
    rows = [rng.integers(0, 256, size=64 * elementsize, dtype=np.uint8) for _ in range(3)]
    codec = numcodecs.Shuffle(elementsize=elementsize)
    encoded = np.stack([np.frombuffer(codec.encode(r), dtype=np.uint8) for r in rows])
    got = Unshuffle(elementsize).apply(encoded, np)
    np.testing.assert_array_equal(got, np.stack(rows))


@pytest.mark.parametrize("dtype", ["i1", "u2", "i4", "i8", "f4", "f8"])
def test_undelta_matches_numcodecs(dtype: str) -> None:
    rng = np.random.default_rng(1)
    rows = [(rng.standard_normal(50) * 1000).astype(dtype) for _ in range(3)]
    codec = numcodecs.Delta(dtype=dtype)
    encoded = np.stack([np.asarray(codec.encode(r)).view(np.uint8) for r in rows])
    got = Undelta(np.dtype(dtype)).apply(encoded, np)
    want = np.stack([np.asarray(codec.decode(codec.encode(r))).view(np.uint8) for r in rows])
    assert got.tobytes() == want.tobytes()


# -- damaged stores ----------------------------------------------------------------
DAMAGE = {
    "truncated": lambda b: b[: len(b) // 2],
    "empty": lambda b: b"",
    "header": lambda b: b"\x00" * 8 + b[8:],
    "extra-bytes": lambda b: b + b"\x13\x37" * 8,
}
DAMAGED_CODECS = [
    (3, "zstd"),
    (3, "gzip"),
    (3, "none"),
    (2, "lz4"),
    (2, "zlib"),
    (3, "crc32c"),
    (2, "blosc"),
]


def _chunk_file(path: Path, zarr_format: int) -> tuple[Path, str]:
    key = "t2m/c/1/1/1" if zarr_format == 3 else "t2m/1.1.1"
    return path / key, key


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize(("zarr_format", "codec"), DAMAGED_CODECS)
def test_damaged_chunk_raises_and_next_read_works(
    tmp_path: Path,
    store_factory: Callable,
    device: str,
    zarr_format: int,
    codec: str,
    damage: str,
) -> None:
    if codec == "none" and damage == "header":
        pytest.skip("an uncompressed chunk of the right size has no header to damage")
    if codec == "zlib" and damage == "extra-bytes":
        pytest.skip("zlib (and so zarr-python) ignores bytes after the end of the stream")
    path = tmp_path / "damaged.zarr"
    shutil.copytree(store_factory(zarr_format, codec), path)
    chunk, key = _chunk_file(path, zarr_format)
    chunk.write_bytes(DAMAGE[damage](chunk.read_bytes()))
    ds = xr.open_dataset(path, engine="gds-zarr", device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(Exception) as err:
            ds.t2m.load()
    if EXPECTED_PLAN[(zarr_format, codec)] == "gpu" or device == "cpu":
        assert isinstance(err.value, ChunkDecodeError), err.value
        assert key in str(err.value)
        assert err.value.codec in str(err.value)
    # the process (and the GPU) is still usable: other chunks and variables read fine
    ref = xr.open_dataset(path, engine="zarr")
    sel = dict(time=slice(0, 4))
    xr.testing.assert_identical(to_numpy(ds.t2m.isel(sel)), ref.t2m.isel(sel).load())
    xr.testing.assert_identical(to_numpy(ds.u10), ref.u10.load())


def test_crc32c_mismatch_names_the_chunk_and_both_checksums(
    tmp_path: Path, store_factory: Callable, device: str
) -> None:
    """One flipped bit in the middle of a compressed chunk (its zstd stream still
    decodes): the checksum, not the decoder, must catch it."""
    path = tmp_path / "flipped.zarr"
    shutil.copytree(store_factory(3, "crc32c"), path)
    chunk, key = _chunk_file(path, 3)
    raw = bytearray(chunk.read_bytes())
    raw[-5] ^= 0x01  # the last byte before the checksum
    chunk.write_bytes(bytes(raw))
    ds = xr.open_dataset(path, engine="gds-zarr", device=device)
    with pytest.raises(ChunkDecodeError, match=r"checksum mismatch \(stored 0x[0-9a-f]{8}, "):
        ds.t2m.load()
    with pytest.raises(ChunkDecodeError) as err:
        ds.t2m.load()
    assert key in str(err.value) and err.value.codec == "crc32c"


@pytest.mark.gpu
def test_device_crc32c_matches_google_crc32c() -> None:
    cp = pytest.importorskip("cupy")
    import google_crc32c

    from xarray_gds.codecs import nvcomp

    rng = np.random.default_rng(7)
    sizes = np.array([0, 1, 3, 4, 17, 4096, 65_537, (1 << 22) + 5], dtype=np.int64)
    offsets = np.cumsum(np.concatenate([[3], sizes[:-1] + 5]))  # unaligned starts
    arena = rng.integers(0, 256, int(offsets[-1] + sizes[-1]), dtype=np.uint8)
    with nvcomp._lane() as lane:
        got = crc32c.crc32c(cp.asarray(arena), offsets, sizes, lane.stream)
    pieces = [arena[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
    want = [google_crc32c.value(piece.tobytes()) for piece in pieces]
    assert got.dtype == np.uint32 and got.tolist() == want


def test_sharded_partial_reads_touch_only_needed_inner_chunks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str
) -> None:
    path = tmp_path / "sharded.zarr"
    data = np.arange(16 * 16, dtype="f8").reshape(16, 16)
    data[0:4, 4:8] = np.nan  # one inner chunk of fill values: left out of its shard
    ds = xr.Dataset({"v": (("y", "x"), data)})
    ds.to_zarr(path, zarr_format=3, encoding={"v": {"chunks": (4, 4), "shards": (8, 8)}})
    ranges: list[tuple[str, int]] = []

    from xarray_gds.stores import files as local_io

    for name in ("read_ranges_host", "read_ranges_device"):
        real = getattr(local_io, name)

        def spy(paths: list, starts: Any, sizes: Any, _real: Any = real) -> Any:
            ranges.extend((Path(p).name, int(n)) for p, n in zip(paths, sizes, strict=True))
            return _real(paths, starts, sizes)

        monkeypatch.setattr(local_io, name, spy)
    gds = xr.open_dataset(path, engine="gds-zarr", device=device)
    ref = xr.open_dataset(path, engine="zarr")
    one = gds.v.isel(y=9, x=10).load()
    assert len(ranges) == 1  # one inner chunk of one shard, by byte range
    xr.testing.assert_identical(one.as_numpy(), ref.v.isel(y=9, x=10).load())
    ranges.clear()
    block = gds.v.isel(y=slice(0, 8), x=slice(0, 8)).load()
    assert len(ranges) == 3  # four inner chunks, one of them never written
    xr.testing.assert_identical(block.as_numpy(), ref.v.isel(y=slice(0, 8), x=slice(0, 8)))
    xr.testing.assert_identical(to_numpy(gds), ref.load())


def test_whole_chunks_are_tiled_in_one_copy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str
) -> None:
    path = tmp_path / "even.zarr"
    data = np.arange(8 * 12 * 10, dtype="i4").reshape(8, 12, 10)
    xr.Dataset({"v": (("a", "b", "c"), data)}).to_zarr(
        path, zarr_format=3, encoding={"v": {"chunks": (4, 3, 5)}}
    )
    tiled: list[bool] = []
    real = entries.whole_tiling

    def spy(target: Any, *args: Any) -> Any:
        done = real(target, *args)
        if target.shape in ((8, 12, 10), (4, 7, 10)):  # this test's reads only
            tiled.append(done is not None)
        return done

    monkeypatch.setattr(entries, "whole_tiling", spy)
    # the pipeline's own read (zarr's indexing: reads that are not boxes, reads of writes)
    monkeypatch.setattr(xarray_gds.array, "read_box", lambda *args: None)
    gds = xr.open_dataset(path, engine="gds-zarr", device=device)
    ref = xr.open_dataset(path, engine="zarr")
    xr.testing.assert_identical(to_numpy(gds), ref.load())
    # on the GPU all 16 chunks in one reshape; the host copies chunk by chunk on its pool
    assert tiled == ([True] if device == "cuda" else [])
    tiled.clear()
    fresh = xr.open_dataset(path, engine="gds-zarr", device=device)  # nothing cached
    part = fresh.v.isel(a=slice(0, 4), b=slice(2, 9)).load()  # partial chunks: per chunk
    assert tiled == ([False] if device == "cuda" else [])
    xr.testing.assert_identical(part.as_numpy(), ref.v.isel(a=slice(0, 4), b=slice(2, 9)))


def test_tile_puts_chunks_in_grid_order_whatever_their_order() -> None:
    chunk = (2, 3)
    whole = np.arange(4 * 9).reshape(4, 9)
    cells = [(1, 2), (0, 0), (1, 0), (0, 2), (0, 1), (1, 1)]
    chunks = np.stack([whole[r * 2 : r * 2 + 2, c * 3 : c * 3 + 3] for r, c in cells])
    batch = [
        (None, None, (), (slice(r * 2, r * 2 + 2), slice(c * 3, c * 3 + 3)), True) for r, c in cells
    ]
    target = np.zeros_like(whole)
    tiling = entries.whole_tiling(target, chunk, batch, ())
    assert tiling is not None and tiling.grid == (2, 3)
    n = len(cells)
    place(target, chunks, list(range(n)), n, lambda k: (batch[k][3], ()), 0, False, tiling=tiling)
    np.testing.assert_array_equal(target, whole)
    # an entry that is not a whole chunk disqualifies the batch
    batch[0] = (*batch[0][:4], False)
    assert entries.whole_tiling(np.zeros_like(whole), chunk, batch, ()) is None


def _t2m_part(keys: Any) -> int | None:
    """The part of a read in parts of all of t2m that ``keys`` are (its first row of
    chunks: 9 chunks a part), or None for keys of other variables."""
    first = str(keys[0])
    return int(first.split("/")[2]) if first.startswith("t2m/") else None


@pytest.mark.parametrize("late", [False, True], ids=["", "part-0-server-late"])
@pytest.mark.parametrize("route", ["box", "zarr"])
def test_large_reads_overlap_fetch_and_decode(
    monkeypatch: pytest.MonkeyPatch, v3_store: Path, device: str, route: str, late: bool
) -> None:
    """A read split into parts fetches part k + 1 while part k decodes, whether it goes
    through xarray_gds.region (a box) or through zarr's indexing and the pipeline, and
    whichever of the two part servers asks first (``late``: part 1's, made to ask
    first). Ordered by events only: the decode of part k waits until the read of part
    k + 1 has begun, which the engine lets happen whatever the threads' timing (a
    broken overlap hangs here, and pytest-timeout fails the test)."""
    import threading

    if route == "zarr":
        monkeypatch.setattr(xarray_gds.array, "read_box", lambda *args: None)
    asked: list[int] = []  # the parts whose server asked the engine, in order
    if late:
        real_lead = coalesce.ReadEngine._lead_or_wait
        part_1_asked = threading.Event()
        lock = threading.Lock()

        def late_lead(self: Any, state: Any) -> None:
            k = _t2m_part(state.request.keys) if state.series is not None else None
            if k == 0:
                part_1_asked.wait()  # part 0's server asks once part 1's has
            if k is not None:
                with lock:
                    asked.append(k)
            if k == 1:
                part_1_asked.set()
            real_lead(self, state)

        monkeypatch.setattr(coalesce.ReadEngine, "_lead_or_wait", late_lead)
    monkeypatch.setattr(decode, "MIN_PART_BYTES", 1)
    monkeypatch.setenv("XARRAY_GDS_PIPELINE_PARTS", "3")
    fetch_started: list[threading.Event] = [threading.Event() for _ in range(3)]
    parts: list[int] = []
    real_read, real_decode = coalesce._read, decode.decode_fetched

    def spy_read(group: list) -> Any:
        for state in group:
            k = _t2m_part(state.request.keys)
            if k is not None:
                fetch_started[k].set()
        return real_read(group)

    def spy_decode(chain: Any, fetched: Any, keys: list, *args: Any) -> Any:
        k = _t2m_part(keys)
        if k is not None:
            parts.append(len(keys))
            assert fetch_started[k].is_set()
            if k + 1 < 3:
                # the next part's read is under way while this part decodes
                fetch_started[k + 1].wait()
        return real_decode(chain, fetched, keys, *args)

    monkeypatch.setattr(coalesce, "_read", spy_read)
    monkeypatch.setattr(decode, "decode_fetched", spy_decode)
    got = xr.open_dataset(v3_store, engine="gds-zarr", device=device).t2m.load()
    assert parts == [9, 9, 9]
    xr.testing.assert_identical(got.as_numpy(), xr.open_dataset(v3_store, engine="zarr").t2m)
    if late:  # the late case happened: part 1's server asked before part 0's
        assert asked[0] == 1 and 0 in asked, asked


def test_damaged_inner_chunk_is_named(tmp_path: Path, store_factory: Callable, device: str) -> None:
    path = tmp_path / "damaged.zarr"
    shutil.copytree(store_factory(3, "sharded"), path)
    arr = zarr.open_array(path / "t2m", mode="r")
    inner = arr.chunks
    shard = path / "t2m" / "c" / "1" / "1" / "1"
    raw = bytearray(shard.read_bytes())
    # the index (at the end, with its crc32c) gives each inner chunk's offset and size
    grid = tuple(s // c for s, c in zip(arr.shards, inner, strict=True))
    n_inner = int(np.prod(grid))
    index = np.frombuffer(bytes(raw[-(16 * n_inner + 4) : -4]), dtype="<u8").reshape(-1, 2)
    target = int(np.flatnonzero(index[:, 0] != np.iinfo(np.uint64).max)[-1])
    offset, nbytes = (int(v) for v in index[target])
    raw[offset : offset + nbytes] = b"\x00" * nbytes  # zeros: not a zstd frame
    shard.write_bytes(bytes(raw))
    coords = tuple(int(i) for i in np.unravel_index(target, grid))
    ds = xr.open_dataset(path, engine="gds-zarr", device=device)
    with pytest.raises(ChunkDecodeError, match=r"t2m/c/1/1/1 \(inner chunk") as err:
        ds.t2m.load()
    assert f"inner chunk {coords}" in str(err.value)
    ref = xr.open_dataset(path, engine="zarr")
    xr.testing.assert_identical(to_numpy(ds.u10), ref.u10.load())


def test_batch_budget_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XARRAY_GDS_BATCH_BYTES", raising=False)
    assert decode.batch_bytes(on_device=True) == 4 << 30
    assert decode.batch_bytes(on_device=False) == 1 << 30
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", "12345")
    assert decode.batch_bytes(on_device=False) == 12345

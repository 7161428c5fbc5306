"""CPU tests of host lines that only device tests used to run.

docs/data/gpu-only-lines.json lists, per module, lines no CPU test ran; those of kind
``cpu-gap`` are host logic a CPU test can reach. Each test here reaches some of them
(its docstring names the function and line, at commit a18fe2b) through the suite's
stand-ins for the GPU libraries (numpy for CuPy, fake kvikio and nvCOMP: see
tests/test_orderings.py, tests/test_host_logic.py and xarray_gds.testing), and checks
what a caller sees: values against engine="zarr" or numpy, the error and the key it
names, the files left.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pytest
import xarray as xr
import zarr

import tests.test_orderings as orderings
import xarray_gds
from tests.test_host_logic import _all_chunks, _fake_cupy
from tests.test_orderings import Env, _Crc, _on_device
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch
from xarray_gds.codecs import crc32c, nvcomp
from xarray_gds.codecs.formats import CRC32C, get
from xarray_gds.errors import ChunkDecodeError
from xarray_gds.stores import files, remote_device
from xarray_gds.testing import device_standins


def _crc32c_le(data: bytes) -> bytes:
    """The CRC-32C of ``data``, little-endian (as Zarr's crc32c codec appends it)."""
    return int(google_crc32c.value(data)).to_bytes(4, "little")


#: the recording stand-ins of tests/test_orderings.py (CuPy, kvikio, nvCOMP, libnvcomp's
#: CRC32), a fixture
env = orderings.env

# -- xarray_gds/codecs/nvcomp.py ----------------------------------------------------------


def test_nvcomp_has_no_codec_for_a_format_without_one() -> None:
    """nvcomp._codec, line 138: a format nvCOMP has no codec for (blosc) raises
    ValueError naming it, before nvCOMP is imported."""
    lane = nvcomp._Lane(None, 0)
    with pytest.raises(ValueError, match=r"^nvCOMP has no blosc codec$"):
        nvcomp._codec(lane, get("blosc"))
    assert lane.codecs == {}


def test_gather_of_no_segments_does_nothing() -> None:
    """nvcomp.gather, line 188: no segments returns at once (no kernel, no CuPy: none is
    installed here) and the destination keeps its bytes."""
    src = np.arange(8, dtype=np.uint8)
    dst = np.full(8, 7, dtype=np.uint8)
    empty = np.empty(0, dtype=np.int64)
    assert nvcomp.gather(src, empty, dst, empty, empty) is None
    assert dst.tolist() == [7] * 8


def test_aligned_streams_are_not_copied() -> None:
    """nvcomp._aligned, line 266: streams that all start on 16-byte offsets come back in
    the same arena at the same offsets (no copy, no CuPy)."""
    arena = np.arange(64, dtype=np.uint8)
    offsets = np.array([0, 16, 48], dtype=np.int64)
    sizes = np.array([10, 30, 16], dtype=np.int64)
    got = nvcomp._aligned(DeviceBatch(arena, offsets, sizes), offsets, sizes)
    assert got.arena is arena
    assert got.offsets.tolist() == [0, 16, 48] and got.sizes.tolist() == [10, 30, 16]


def _uncompressed(path: Path) -> Path:
    """A Zarr v3 store of ``v`` (8 x 8 float32) in four uncompressed 4 x 4 chunks."""
    values = np.arange(64, dtype="f4").reshape(8, 8)
    ds = xr.Dataset({"v": (("y", "x"), values)})
    ds.to_zarr(
        path, mode="w", consolidated=False, encoding={"v": {"chunks": (4, 4), "compressors": None}}
    )
    return path


def test_uncompressed_chunk_of_the_wrong_size(env: Env, tmp_path: Path) -> None:
    """nvcomp.decode, lines 299-302: an uncompressed chunk holding fewer bytes than a
    chunk raises ChunkDecodeError naming that chunk, codec "bytes", its size and the
    expected one; intact chunks give a row of 64 bytes each."""
    path = _uncompressed(tmp_path / "raw.zarr")
    chain, keys, fetched = _all_chunks(path, "v")
    assert chain.compressor is None and chain.nbytes == 64
    idx = list(range(len(keys)))
    intact = _on_device(env, fetched)
    assert np.asarray(nvcomp.decode(chain, intact, idx, keys)).shape == (4, 64)
    fetched[2] = fetched[2][:60]
    with pytest.raises(ChunkDecodeError) as caught:
        nvcomp.decode(chain, _on_device(env, fetched), idx, keys)
    assert caught.value.key == keys[2] == "v/c/1/0"
    assert caught.value.codec == "bytes"
    assert "chunk holds 60 bytes, expected 64" in str(caught.value)


def test_crc32c_chunk_shorter_than_its_checksum() -> None:
    """nvcomp._strip_crc32c, lines 331-332: a chunk shorter than the 4-byte checksum
    raises CRC32C's too-short error naming the first such chunk and its size (a chunk of
    exactly 4 bytes is not too short), before any device work."""
    arena = np.zeros(64, dtype=np.uint8)
    offsets = np.array([0, 16, 32], dtype=np.int64)
    sizes = np.array([4, 3, 2], dtype=np.int64)
    with pytest.raises(ChunkDecodeError) as caught:
        nvcomp._strip_crc32c(DeviceBatch(arena, offsets, sizes), offsets, sizes, ["a", "b", "c"])
    assert caught.value.key == "b" and caught.value.codec == "crc32c"
    assert str(caught.value) == str(CRC32C.too_short("b", 3))


def test_empty_inner_stream_of_a_container(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvcomp._decode_streams, lines 377-379: an inner stream of no bytes raises
    ChunkDecodeError naming the first such chunk and the container codec (CuPy stood in for by
    numpy, as tests/test_split.py does)."""
    monkeypatch.setattr(_device, "cupy", _fake_cupy)
    arena = np.zeros(64, dtype=np.uint8)
    starts = np.array([0, 16, 32], dtype=np.int64)
    lengths = np.array([5, 0, 0], dtype=np.int64)
    decoded = np.array([8, 8, 8], dtype=np.int64)
    with pytest.raises(ChunkDecodeError) as caught:
        nvcomp._decode_streams(
            get("zstd"), arena, starts, lengths, decoded, ["k0", "k1", "k2"], codec="blosc"
        )
    assert caught.value.key == "k1" and caught.value.codec == "blosc"
    assert "empty compressed stream" in str(caught.value)


@pytest.mark.parametrize(
    "faults",
    [
        ["input buffer refused"],
        ["output buffer too small: 4096 bytes required", "still too small: 8192 bytes required"],
    ],
    ids=["no-size", "second-too-small"],
)
def test_encode_error_nvcomp_gives_no_size_for(env: Env, faults: list[str]) -> None:
    """nvcomp._encode_batch, line 583: nvCOMP's ValueError that names no required size,
    or a second one after the retry with the size asked for, reaches the caller as it
    is (the fake nvCOMP codec of tests/test_orderings.py raising it)."""
    buffer = env.cupy.empty(4 * 1024, dtype=np.uint8)
    buffer.set(np.arange(4 * 1024, dtype=np.uint8))
    env.nvcomp.faults = [ValueError(f) for f in faults]
    offsets = np.arange(4, dtype=np.int64) * 1024
    with pytest.raises(ValueError) as caught:
        nvcomp._encode_batch(get("zlib"), buffer, offsets, np.full(4, 1024))
    assert str(caught.value) == faults[-1]
    assert len(env.log.find("encode")) == len(faults)


# -- xarray_gds/codecs/crc32c.py ----------------------------------------------------------


@pytest.fixture
def fresh_library() -> Any:
    """crc32c._library's cache emptied before and after the test."""
    crc32c._library.cache_clear()
    yield
    crc32c._library.cache_clear()


class _Fn:
    """A ctypes function of libnvcomp: its argument and result types as set."""

    argtypes: Any = None
    restype: Any = None


@pytest.mark.usefixtures("fresh_library")
def test_library_without_libnvcomp_or_its_crc32(monkeypatch: pytest.MonkeyPatch) -> None:
    """crc32c._library, lines 54, 55, 60: without ``nvidia.libnvcomp``, or with a
    libnvcomp lacking the CRC32 functions, available() is False; with both functions it
    is True and their ctypes argument types are set."""
    monkeypatch.setitem(sys.modules, "nvidia.libnvcomp", None)  # not importable
    assert crc32c.available() is False
    crc32c._library.cache_clear()
    fake = types.ModuleType("nvidia.libnvcomp")
    lib = types.SimpleNamespace(nvcompBatchedCRC32GetHeuristicConf=_Fn())
    fake.load_library = lambda: lib  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvidia.libnvcomp", fake)
    assert crc32c.available() is False  # no nvcompBatchedCRC32Async
    crc32c._library.cache_clear()
    lib.nvcompBatchedCRC32Async = _Fn()
    assert crc32c.available() is True
    assert len(lib.nvcompBatchedCRC32Async.argtypes) == 8
    assert len(lib.nvcompBatchedCRC32GetHeuristicConf.argtypes) == 5


def test_crc32c_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """crc32c.crc32c, line 81: no libnvcomp raises RuntimeError saying CRC32 could not
    be loaded (even for no buffers)."""
    monkeypatch.setattr(crc32c, "_library", lambda: None)
    arena = np.zeros(4, dtype=np.uint8)
    with pytest.raises(RuntimeError, match=r"^nvCOMP's CRC32 functions could not be loaded"):
        crc32c.crc32c(arena, np.array([0]), np.array([4]), None)
    with pytest.raises(RuntimeError, match=r"^nvCOMP's CRC32 functions could not be loaded"):
        crc32c.crc32c(arena, np.empty(0, np.int64), np.empty(0, np.int64), None)


def test_crc32c_of_no_buffers(env: Env) -> None:
    """crc32c.crc32c, line 87: no buffers gives an empty uint32 array without a launch
    (test_orderings' _Crc stand-in for libnvcomp)."""
    arena = env.cupy.empty(16, dtype=np.uint8)
    got = crc32c.crc32c(arena, np.empty(0, np.int64), np.empty(0, np.int64), env.log.main)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint32 and got.shape == (0,)
    assert env.log.find("crc") == []


class _FailingCrc(_Crc):
    """_Crc whose kernel reports status 7 for the buffer ``bad`` (the launch itself
    succeeds)."""

    bad = 1

    def nvcompBatchedCRC32Async(self, *args: Any) -> int:
        status = super().nvcompBatchedCRC32Async(*args)
        self.log.at(args[6])[self.bad] = 7
        return status


def test_crc32c_buffer_status(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """crc32c.crc32c, line 117: a nonzero status of one buffer raises RuntimeError
    with nvCOMP's status code; with every status 0 the sums are google_crc32c's."""
    bodies = [b"abcdefgh", b"0123456789", b"xyz"]
    device = _on_device(env, [np.frombuffer(b, np.uint8) for b in bodies])
    want = [_crc32c_le(b) for b in bodies]
    got = crc32c.crc32c(device.arena, device.offsets, device.sizes, env.log.main)
    assert [int(s).to_bytes(4, "little") for s in got] == want
    failing = _FailingCrc(env.log)
    monkeypatch.setattr(crc32c, "_library", lambda: failing)
    with pytest.raises(RuntimeError, match=r"^nvCOMP's batched CRC32 failed \(nvcompStatus_t 7\)$"):
        crc32c.crc32c(device.arena, device.offsets, device.sizes, env.log.main)


# -- xarray_gds/stores/files.py -----------------------------------------------------------


def test_read_file_of_a_directory_reads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """files.read_file, line 100: a directory reads as None without a read of it (a
    plain file beside it reads whole)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"abc")
    reads: list[int] = []
    preadv = os.preadv

    def counted(fd: int, buffers: Any, offset: int) -> int:
        reads.append(fd)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    assert files.read_file(str(tmp_path / "d")) is None
    assert reads == []
    assert bytes(files.read_file(str(tmp_path / "f"))) == b"abc"
    assert len(reads) == 1


def test_read_file_stops_at_an_early_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """files.read_file, line 106: a file that comes to its end before the size fstat
    gave (truncated meanwhile: os.preadv returns 0) gives the bytes read, and is not
    read again."""
    path = tmp_path / "f"
    path.write_bytes(bytes(range(100)))
    calls: list[int] = []

    def truncated(fd: int, buffers: Any, offset: int) -> int:
        calls.append(offset)
        assert len(calls) <= 2, "read again after the end of the file"
        if offset >= 60:
            return 0
        buffers[0][:60] = np.arange(60, dtype=np.uint8)
        return 60

    monkeypatch.setattr(os, "preadv", truncated)
    got = files.read_file(str(path))
    assert got is not None and got.tolist() == list(range(60))
    assert calls == [0, 60]


def _slotted_files(tmp_path: Path) -> tuple[list[str], list[bytes | None]]:
    """Files for slots of 256 bytes: small ones, two larger than the slot, a directory
    and a missing file; what each reads as."""
    rng = np.random.default_rng(3)
    held: list[bytes | None] = [
        rng.bytes(100),
        rng.bytes(5000),
        None,  # a directory
        rng.bytes(16),
        None,  # missing
        rng.bytes(256),  # fills its slot exactly
        rng.bytes(300),
        rng.bytes(7),
    ]
    paths = []
    for i, data in enumerate(held):
        path = tmp_path / f"c{i}"
        if i == 2:
            path.mkdir()
        elif data is not None:
            path.write_bytes(data)
        paths.append(str(path))
    return paths, held


def _batch_bytes(got: DeviceBatch) -> list[bytes | None]:
    arena = np.asarray(got.arena)
    return [
        None if s < 0 else arena[a : a + s].tobytes()
        for a, s in zip(got.offsets.tolist(), got.sizes.tolist(), strict=True)
    ]


@pytest.mark.parametrize("threads", [1, 2])
def test_slotted_read_of_larger_files_and_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """files._read_slotted (through read_files_device with a slot), lines 308, 309,
    311, 320, 339-342: files larger than their slot are read again whole at the end of
    the arena, a directory and a missing file read as missing, with one reader thread
    or several (XARRAY_GDS_READ_THREADS); the arena holds each file once (16-byte
    aligned), no slot-sized first read of the larger ones (xarray_gds.testing's
    stand-ins for CuPy and cupyx)."""
    monkeypatch.setenv("XARRAY_GDS_READ_THREADS", str(threads))
    paths, held = _slotted_files(tmp_path)
    with device_standins(monkeypatch):
        got = files.read_files_device(paths, 256)
    assert _batch_bytes(got) == held
    small = sum(-(-len(h) // 16) * 16 for h in held if h is not None and len(h) <= 256)
    assert got.arena.size == small + 5008 + 304  # the two larger files, each aligned


def test_staged_read_that_comes_back_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """files._read_staged, line 460: a small (staged) range past the end of its file
    (truncated after its size was taken) raises OSError naming the file and the bytes
    read."""
    path = tmp_path / "c0"
    path.write_bytes(bytes(100))
    with device_standins(monkeypatch), pytest.raises(OSError) as caught:
        files.read_ranges_device([str(path)], np.array([40]), np.array([100]))
    assert str(caught.value).startswith(f"short read from {path}: got 60 of 100 bytes")


# -- xarray_gds/write.py ------------------------------------------------------------------


def _numpy_dataset() -> xr.Dataset:
    values = np.arange(48.0).reshape(8, 6)
    return xr.Dataset({"v": (("y", "x"), values)}, coords={"y": np.arange(8)})


def _engine_zarr(target: Any) -> xr.Dataset:
    return xr.open_dataset(target, engine="zarr", consolidated=False).load()


@pytest.mark.needs("dask")
def test_compute_false_write_of_numpy_values(tmp_path: Path) -> None:
    """write.for_device_write, line 77 (and write._prepared, line 248, pinned by the
    next test): a
    ``compute=False`` write of a dataset without dask or device variables writes its
    numpy values at once, as xarray does (engine="zarr" reads them before the delayed
    object is computed), and computing it changes nothing."""
    ds = _numpy_dataset()
    delayed = xarray_gds.to_zarr(ds, tmp_path / "a.zarr", compute=False, consolidated=False)
    xr.testing.assert_identical(_engine_zarr(tmp_path / "a.zarr"), ds)
    delayed.compute()
    xr.testing.assert_identical(_engine_zarr(tmp_path / "a.zarr"), ds)


@pytest.mark.needs("dask")
def test_compute_false_region_write_of_device_values_inside_a_chunk(
    env: Env, tmp_path: Path
) -> None:
    """write._prepared, line 248: a ``compute=False`` write whose only dask variables are
    the one-block ones made of device values (a variable engine="gds-zarr" opened with
    device="cuda", on test_orderings' stand-ins) into a region that starts inside a
    chunk is not refused by xarray's check of dask chunks against Zarr chunks (each
    block is one task), as a numpy region write is not. The store keeps its values
    until the delayed write is computed; then the region holds the source's."""
    ds = _numpy_dataset()
    src, out = tmp_path / "src.zarr", tmp_path / "out.zarr"
    ds.to_zarr(src, consolidated=False, encoding={"v": {"chunks": (4, 6)}})
    before = ds * 10
    before.to_zarr(out, consolidated=False, encoding={"v": {"chunks": (4, 6)}})
    lazy = xr.open_dataset(src, engine="gds-zarr", device="cuda", consolidated=False)
    part = lazy.isel(y=slice(1, 3)).drop_vars("y")
    delayed = xarray_gds.to_zarr(
        part, out, region={"y": slice(1, 3)}, compute=False, consolidated=False
    )
    xr.testing.assert_identical(_engine_zarr(out), before)
    delayed.compute()
    want = before.copy(deep=True)
    want["v"][1:3] = ds["v"][1:3]
    xr.testing.assert_identical(_engine_zarr(out), want)


def test_levels_is_checked_before_the_store(tmp_path: Path) -> None:
    """write.to_zarr, line 221: ``levels`` other than "host" and "gpu" raises ValueError
    naming it, before the store is looked at (even one that is no store) and before
    anything is made at the target."""
    ds = _numpy_dataset()
    with pytest.raises(ValueError, match=r"^levels must be one of \('host', 'gpu'\), not 'bad'$"):
        xarray_gds.to_zarr(ds, 42, levels="bad")
    target = tmp_path / "new" / "a.zarr"
    with pytest.raises(ValueError, match=r"not 'bad'$"):
        xarray_gds.to_zarr(ds, target, levels="bad")
    assert not (tmp_path / "new").exists()


def _failing_write(ds: xr.Dataset, target: Path, before_failing: Any) -> None:
    """A write of ``ds`` plus a dask variable whose block runs ``before_failing()``
    and then raises RuntimeError("block failed")."""
    import dask.array as da

    def fail(block: np.ndarray) -> np.ndarray:
        before_failing()
        raise RuntimeError("block failed")

    bad = da.zeros((8, 6), chunks=(8, 6)).map_blocks(fail, dtype="f8")
    with pytest.raises(RuntimeError, match=r"^block failed$"):
        xarray_gds.to_zarr(ds.assign(bad=(("y", "x"), bad)), target, consolidated=False)


@pytest.mark.needs("dask")
def test_failed_write_whose_new_store_directory_is_gone(tmp_path: Path) -> None:
    """write._remove_empty, line 283: a failed write into directories it made, the
    store's own directory already gone at the cleanup (removed by someone else): the
    directories above it that the write made are removed all the same."""
    import shutil

    target = tmp_path / "a" / "b" / "c.zarr"
    _failing_write(_numpy_dataset(), target, lambda: shutil.rmtree(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.needs("dask")
def test_failed_write_leaves_a_directory_holding_a_file(tmp_path: Path) -> None:
    """write._remove_empty, line 285: a failed write into directories it made, one of
    which now holds another file: that directory and those above it stay, the emptied
    store directory below it goes, and the write's own error reaches the caller."""
    target = tmp_path / "a" / "b" / "c.zarr"
    _failing_write(
        _numpy_dataset(), target, lambda: (tmp_path / "a" / "b" / "other").write_text("x")
    )
    assert (tmp_path / "a" / "b" / "other").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["other"]


@pytest.mark.needs("fsspec")
def test_as_store_of_a_url() -> None:
    """write._as_store, line 354: a URL string becomes a writable fsspec store of it
    (to_zarr opens every string by its store kind first, so only a direct call gets
    here): what it stores, fsspec's memory file system holds."""
    import fsspec
    from zarr.storage import FsspecStore

    store = xarray_gds.write._as_store("memory://reached-as-store/x.zarr", None)
    assert isinstance(store, FsspecStore) and not store.read_only
    values = np.arange(6, dtype="i4").reshape(2, 3)
    zarr.create_array(store, name="v", data=values)
    fs = fsspec.filesystem("memory")
    assert fs.exists("/reached-as-store/x.zarr/v/zarr.json")
    got = zarr.open_array(fsspec.get_mapper("memory://reached-as-store/x.zarr/v"))
    np.testing.assert_array_equal(got[:], values)
    fs.rm("/reached-as-store", recursive=True)


@pytest.mark.needs("fsspec")
def test_to_zarr_into_an_fsspec_mapper() -> None:
    """write._as_store, line 356: an fsspec mapper is written as a store of its own
    (engine="zarr" reads back the dataset from the same mapper)."""
    import fsspec

    mapper = fsspec.get_mapper("memory://reached-mapper/x.zarr")
    try:
        ds = _numpy_dataset()
        xarray_gds.to_zarr(ds, mapper, consolidated=False)
        xr.testing.assert_identical(_engine_zarr(mapper), ds)
    finally:
        fsspec.filesystem("memory").rm("/reached-mapper", recursive=True)


# -- xarray_gds/writes.py -----------------------------------------------------------------


def _batched_and_plain(
    monkeypatch: pytest.MonkeyPatch, write: Any
) -> tuple[tuple[np.ndarray, list[str]], tuple[np.ndarray, list[str]]]:
    """``write(array)`` on a zstd array (6 x 5 in chunks of 3 x 5, fill value 0, empty
    chunks not written) of a MemoryStore through the engine's batched writes (host
    values: XARRAY_GDS_BATCHED_HOST_WRITES=1) and through zarr-python alone: each one's
    values and stored keys."""
    from zarr.storage import MemoryStore

    from xarray_gds.pipeline import GdsCodecPipeline, writing_to

    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    out = []
    for engine in (True, False):
        store = MemoryStore()
        with writing_to(store) if engine else contextlib.nullcontext():
            array = zarr.create_array(
                store,
                name="a",
                shape=(6, 5),
                chunks=(3, 5),
                dtype="f4",
                compressors=zarr.codecs.ZstdCodec(),
                fill_value=0,
                config={"write_empty_chunks": False},
            )
            pipe = array._async_array.codec_pipeline
            assert isinstance(pipe, GdsCodecPipeline) == engine
            write(array)
        out.append((zarr.open_array(store, path="a")[:], sorted(store._store_dict)))
    return out[0], out[1]


def test_batched_write_of_an_orthogonal_selection_with_an_integer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes._assemble, line 187: a batched write of an orthogonal selection that
    mixes an index array with an integer (zarr drops that axis: drop_axes) puts each
    value where zarr-python puts it."""

    def write(array: Any) -> None:
        array[:] = np.arange(30, dtype="f4").reshape(6, 5)
        array.set_orthogonal_selection(([0, 1, 4], 2), np.array([-1, -2, -3], dtype="f4"))

    (ours, our_keys), (theirs, their_keys) = _batched_and_plain(monkeypatch, write)
    np.testing.assert_array_equal(ours, theirs)
    assert ours[[0, 1, 4], 2].tolist() == [-1, -2, -3]
    assert our_keys == their_keys


def test_batched_write_deletes_a_chunk_left_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """writes._store_one, line 218: a batched write into a store without threaded
    writes (a MemoryStore) that leaves a chunk holding only the fill value, with
    write_empty_chunks off, deletes that chunk, as zarr-python does."""

    def write(array: Any) -> None:
        array[:] = 1
        array[:3] = 0

    (ours, our_keys), (theirs, their_keys) = _batched_and_plain(monkeypatch, write)
    np.testing.assert_array_equal(ours, theirs)
    assert our_keys == their_keys == ["a/c/1/0", "a/zarr.json", "zarr.json"]


# -- xarray_gds/pipeline.py ---------------------------------------------------------------


def test_device_values_len_repr_setitem_copy() -> None:
    """pipeline.DeviceValues.__len__, __repr__, __setitem__ and copy, lines 219, 222,
    234, 240 (numpy values standing for CuPy ones): the length of the first axis, a
    repr naming the array type, shape and dtype, item assignment of wrapped values
    into the values inside, and a copy that shares nothing with the original."""
    from xarray_gds.pipeline import DeviceValues

    wrapped = DeviceValues(np.arange(6.0).reshape(3, 2))
    assert len(wrapped) == 3
    assert repr(wrapped) == "DeviceValues(ndarray, shape=(3, 2), dtype=float64)"
    wrapped[1] = DeviceValues(np.array([9.0, 8.0]))
    wrapped[DeviceValues(np.array([False, False, True]))] = 7.0
    assert wrapped.values.tolist() == [[0.0, 1.0], [9.0, 8.0], [7.0, 7.0]]
    copied = wrapped.copy()
    assert isinstance(copied, DeviceValues)
    copied[0] = -1.0
    assert wrapped.values[0].tolist() == [0.0, 1.0]
    assert copied.values.tolist() == [[-1.0, -1.0], [9.0, 8.0], [7.0, 7.0]]


def test_numpy_function_returning_a_list_of_wrapped_values() -> None:
    """pipeline._wrapped, line 270: a numpy function that returns a list of arrays
    (np.split) on wrapped values gives a list of wrapped values, each numpy's part."""
    from xarray_gds.pipeline import DeviceValues

    parts = np.split(DeviceValues(np.arange(4.0)), 2)
    assert type(parts) is list and len(parts) == 2
    assert all(isinstance(p, DeviceValues) for p in parts)
    assert [p.values.tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0]]


def _inner_pipeline(*codecs: Any) -> Any:
    from xarray_gds.pipeline import GdsCodecPipeline

    return GdsCodecPipeline.from_codecs(list(codecs))


def _spec(n: int) -> Any:
    from zarr.core.array_spec import ArrayConfig, ArraySpec
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.dtype import Float32

    return ArraySpec(
        shape=(n,),
        dtype=Float32(),
        fill_value=np.float32(0),
        config=ArrayConfig.from_dict({}),
        prototype=default_buffer_prototype(),
    )


def test_inner_pipeline_delegates_to_zarrs() -> None:
    """GdsCodecPipeline.__repr__, supports_partial_decode, supports_partial_encode,
    validate, compute_encoded_size, decode, encode and encode_plan, lines 321, 355,
    359, 362, 365, 368, 371, 430, of a pipeline built from codecs (an inner one): each
    says or does what zarr's BatchedCodecPipeline of the same codecs does."""
    from zarr.codecs import BytesCodec, Crc32cCodec, ShardingCodec
    from zarr.core.buffer import cpu
    from zarr.core.codec_pipeline import BatchedCodecPipeline
    from zarr.core.dtype import Float32
    from zarr.core.sync import sync

    codecs = (BytesCodec(), Crc32cCodec())
    pipe, theirs = _inner_pipeline(*codecs), BatchedCodecPipeline.from_codecs(codecs)
    sharded = (ShardingCodec(chunk_shape=(3,), codecs=[BytesCodec()]),)
    sharded_pipe = _inner_pipeline(*sharded)
    sharded_theirs = BatchedCodecPipeline.from_codecs(sharded)
    assert repr(pipe) == "GdsCodecPipeline(chain=None)"
    for ours, zarrs in ((pipe, theirs), (sharded_pipe, sharded_theirs)):
        assert ours.supports_partial_decode is zarrs.supports_partial_decode
        assert ours.supports_partial_encode is zarrs.supports_partial_encode
    assert pipe.supports_partial_decode is False and sharded_pipe.supports_partial_decode
    assert pipe.supports_partial_encode is False and sharded_pipe.supports_partial_encode
    with pytest.raises(ValueError, match=r"same number of dimensions"):
        sharded_pipe.validate(shape=(8, 8), dtype=Float32(), chunk_grid=None)
    spec = _spec(4)
    assert pipe.compute_encoded_size(16, spec) == theirs.compute_encoded_size(16, spec) == 20
    values = cpu.NDBuffer.from_numpy_array(np.arange(4, dtype="f4"))
    (encoded,) = sync(pipe.encode([(values, spec)]))
    want = np.arange(4, dtype="<f4").tobytes()
    assert encoded.to_bytes() == want + _crc32c_le(want)
    (decoded,) = sync(pipe.decode([(encoded, spec)]))
    assert decoded.as_numpy_array().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert pipe.encode_plan == "no array metadata (an inner pipeline)"


def test_empty_batches_read_and_write_nothing(env: Env) -> None:
    """GdsCodecPipeline.write and read, lines 384 and 441: an empty batch writes
    nothing and reads nothing (an empty tuple), with the output left as it was; an
    empty read into device memory (test_orderings' stand-ins) allocates and copies
    nothing."""
    from zarr.codecs import BytesCodec
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    pipe = _inner_pipeline(BytesCodec())
    out = cpu.NDBuffer.from_numpy_array(np.full(4, 5.0, dtype="f4"))
    assert sync(pipe.write([], out)) is None
    assert sync(pipe.read([], out)) == ()
    assert out.as_numpy_array().tolist() == [5.0] * 4
    device = env.cupy.full(4, 5.0, dtype="f4")
    on_device = types.SimpleNamespace(as_ndarray_like=lambda: device)
    logged = len(env.log.entries)
    assert sync(pipe.read([], on_device)) == ()
    assert env.log.entries[logged:] == []
    assert np.asarray(device).tolist() == [5.0] * 4


def test_host_route_warnings_once_per_array_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """GdsCodecPipeline._warn_host_encode, _warn_host_decode and _warn_host, and
    _array_name, lines 283-284, 504, 507-508, 514-519: one HostRouteWarning per array
    and step (encode, decode), naming the array (its key without the chunk's parts:
    "/" for the root array), the codecs, why and where the chunks go; a second chunk
    of the same array and step warns no more."""
    from zarr.codecs import BytesCodec
    from zarr.core.codec_pipeline import BatchedCodecPipeline

    from xarray_gds import pipeline
    from xarray_gds.codecs import Unsupported
    from xarray_gds.errors import HostRouteWarning

    monkeypatch.setattr(pipeline, "_warned", set())
    chain = Unsupported(("bytes", "lzma"), "no GPU decoder")
    fallback = BatchedCodecPipeline.from_codecs([BytesCodec()])
    pipe = pipeline.GdsCodecPipeline(fallback, chain, chunk_key_parts=3)
    with pytest.warns(HostRouteWarning) as caught:
        pipe._warn_host_decode("g/a/c/0/0", chain)
        pipe._warn_host_decode("g/a/c/1/0", chain)
        pipe._warn_host_encode("g/a/c/0/0", "filters")
        pipe._warn_host_encode("g/a/c/1/1", "filters")
        root = pipeline.GdsCodecPipeline(fallback, chain, chunk_key_parts=2)
        root._warn_host_decode("c/0", chain)
    assert [str(w.message) for w in caught] == [
        "xarray-gds: array 'g/a' uses codecs [bytes, lzma] (no GPU decoder); its chunks "
        "are decoded on the host by zarr-python and then copied to the GPU",
        "xarray-gds: array 'g/a' uses codecs [bytes, lzma] (filters); its chunks are "
        "copied to the host and encoded there by zarr-python",
        "xarray-gds: array '/' uses codecs [bytes, lzma] (no GPU decoder); its chunks "
        "are decoded on the host by zarr-python and then copied to the GPU",
    ]


def test_store_overriding_only_async_set_is_written_through_it(tmp_path: Path) -> None:
    """pipeline._sync_io_matches, line 546: a wrapper store whose class overrides the
    async ``set`` but not ``set_sync`` gets host values through zarr's batched pipeline
    (its ``set``), not the fused one's ``set_sync``: the override sees every chunk, and
    engine="zarr" reads the values."""
    from zarr.storage import LocalStore, WrapperStore

    from xarray_gds.pipeline import writing_to

    seen: list[str] = []

    class Recording(WrapperStore[LocalStore]):
        async def set(self, key: str, value: Any) -> None:
            seen.append(key)
            await self._store.set(key, value)

    store = Recording(LocalStore(tmp_path / "r.zarr"))
    values = np.arange(24, dtype="f4").reshape(4, 6)
    with writing_to(store):
        array = zarr.create_array(store, name="a", shape=(4, 6), chunks=(2, 3), dtype="f4")
        array[:] = values
    assert sorted(k for k in seen if "/c/" in k) == [f"a/c/{i}/{j}" for i in (0, 1) for j in (0, 1)]
    np.testing.assert_array_equal(zarr.open_array(tmp_path / "r.zarr", path="a")[:], values)


# -- xarray_gds/stores/remote_device.py ---------------------------------------------------


@pytest.mark.needs("s3fs")
def test_kvikio_target_of_s3fs_with_a_session_token() -> None:
    """remote_device.kvikio_target, line 44: an s3fs store with a session token hands
    it to kvikio's S3 open (with the key, secret and endpoint); without one, none is
    passed. No request is made."""
    import s3fs
    from zarr.storage import FsspecStore

    def target(**token: str) -> Any:
        fs = s3fs.S3FileSystem(
            key="k", secret="s", endpoint_url="http://127.0.0.1:9", asynchronous=True, **token
        )
        return remote_device.kvikio_target(FsspecStore(fs, path="bucket/x.zarr"))

    base = {
        "aws_access_key_id": "k",
        "aws_secret_access_key": "s",
        "aws_endpoint_url": "http://127.0.0.1:9",
    }
    assert target(token="t") == ("s3://bucket/x.zarr", {**base, "aws_session_token": "t"})
    assert target() == ("s3://bucket/x.zarr", base)


class _HttpStore:
    """An fsspec-like HTTP store (what kvikio_target reads: ``fs.protocol``, ``path``)
    holding ``objects``, for ``exists``."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.fs = types.SimpleNamespace(protocol="http")
        self.path = "http://127.0.0.1:9/root/"
        self.objects = objects

    async def exists(self, key: str) -> bool:
        return key in self.objects


def test_open_that_fails_on_an_object_that_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """remote_device._open_one, line 193: kvikio cannot open an object the store holds:
    OSError naming the key, the URL and kvikio's error; one that the store does not
    hold reads as missing (size -1)."""

    def open_http(url: str, nbytes: int | None = None) -> Any:
        raise RuntimeError("HTTP 503 from the server")

    kvikio = types.SimpleNamespace(RemoteFile=types.SimpleNamespace(open_http=open_http))
    monkeypatch.setattr(_device, "cupy", _fake_cupy)
    monkeypatch.setattr(_device, "kvikio", lambda: kvikio)
    store = _HttpStore({"a": b"abc"})
    missing = remote_device.read_device([store], ["gone"])
    assert missing.sizes.tolist() == [-1]
    with pytest.raises(OSError) as caught:
        remote_device.read_device([store], ["a"])
    assert str(caught.value).startswith(
        "cannot read chunk 'a' at 'http://127.0.0.1:9/root/a': HTTP 503 from the server; "
    )
    assert caught.value.__cause__ is None


class _Failing:
    """A kvikio RemoteFile of ``data`` whose first ``failures`` reads' futures raise."""

    def __init__(self, data: bytes, failures: int) -> None:
        self.data, self.failures, self.reads = data, failures, 0

    def nbytes(self) -> int:
        return len(self.data)

    def pread(self, buf: np.ndarray, size: int, offset: int) -> Any:
        self.reads += 1
        buf[:size] = np.frombuffer(self.data[offset : offset + size], np.uint8)
        if self.reads <= self.failures:

            def get() -> int:
                raise RuntimeError(f"connection reset (read {self.reads})")

            return types.SimpleNamespace(get=get)
        return types.SimpleNamespace(get=lambda: size)


def test_read_whose_future_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """remote_device._pread_all, lines 225-226: a read whose future raises is read
    again, and after ``retries`` failures raises OSError naming the key, the URL and the
    future's error; another object of the batch is read whole."""
    files_ = {"a": _Failing(bytes(range(50)), 2), "b": _Failing(b"xyz" * 9, 0)}

    def open_http(url: str, nbytes: int | None = None) -> Any:
        return files_[url.rsplit("/", 1)[1]]

    kvikio = types.SimpleNamespace(RemoteFile=types.SimpleNamespace(open_http=open_http))
    monkeypatch.setattr(_device, "cupy", _fake_cupy)
    monkeypatch.setattr(_device, "kvikio", lambda: kvikio)
    store = _HttpStore({})
    got = remote_device.read_device([store, store], ["a", "b"])
    assert _batch_bytes(got) == [bytes(range(50)), b"xyz" * 9]
    assert files_["a"].reads == 3
    files_["a"] = _Failing(bytes(range(50)), 5)
    with pytest.raises(OSError) as caught:
        remote_device.read_device([store], ["a"], retries=2)
    assert str(caught.value) == (
        "cannot read chunk 'a' at http://127.0.0.1:9/root/a after 2 tries: connection "
        "reset (read 2); check the server and the network"
    )


@pytest.mark.needs("obstore")
def test_byte_ranges_of_a_missing_object_on_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """remote_device.read_ranges_device, line 256: byte ranges of an object the server
    does not have read as missing (size -1) beside the ranges of one it has (the suite's
    loopback HTTP server; xarray_gds.testing's kvikio stand-in)."""
    from tests._http import serve
    from xarray_gds import stores

    root = tmp_path / "served"
    (root / "r.zarr").mkdir(parents=True)
    held = bytes(range(200))
    (root / "r.zarr" / "c0").write_bytes(held)
    (root / "r.zarr" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    with serve(root) as base:
        source = stores.source_for(
            stores.RemoteSource.open(f"{base}/r.zarr", mode="r", storage_options=None).store
        )
        keys = ["c0", "gone", "c0"]
        starts, sizes = np.array([10, 0, 100], np.int64), np.array([20, 8, 50], np.int64)
        with device_standins(monkeypatch):
            got = source.read_ranges_all(
                [source] * 3, source.locate(keys), (starts, sizes), on_device=True
            )
    assert _batch_bytes(got) == [held[10:30], None, held[100:150]]


@pytest.mark.needs("moto", "obstore", "s3fs")
def test_whole_objects_a_listing_shows_missing_are_not_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """remote_device._open_one, line 183: a device read of 8 or more whole objects of
    an S3 store lists them once; an object the listing shows missing reads as missing
    (size -1) and kvikio never opens it; the others read whole (the suite's loopback S3
    server; xarray_gds.testing's kvikio stand-in)."""
    from tests._s3 import client, loopback_s3, storage_options
    from xarray_gds import stores
    from xarray_gds.testing import _RemoteFile

    rng = np.random.default_rng(9)
    keys = [f"v/c/{i}" for i in range(9)]
    held: dict[str, bytes | None] = {k: rng.bytes(20 + i) for i, k in enumerate(keys)}
    held["v/c/4"] = None
    opened: list[str] = []

    def open_s3(bucket: str, name: str, nbytes: int | None = None, **args: Any) -> Any:
        opened.append(name.rsplit("/", 1)[1] if "/c/" in name else name)
        return _RemoteFile.open_s3(bucket, name, nbytes, **args)

    with loopback_s3() as endpoint:
        s3 = client(endpoint, "reached-key", "reached-secret")
        s3.create_bucket(Bucket="reached-lines")
        s3.put_object(
            Bucket="reached-lines",
            Key="r.zarr/zarr.json",
            Body=b'{"zarr_format": 3, "node_type": "group"}',
        )
        for key, data in held.items():
            if data is not None:
                s3.put_object(Bucket="reached-lines", Key=f"r.zarr/{key}", Body=data)
        options = storage_options(endpoint, "reached-key", "reached-secret")
        url = "s3://reached-lines/r.zarr"
        store = stores.RemoteSource.open(url, mode="r", storage_options=options).store
        source = stores.source_for(store)
        with device_standins(monkeypatch), pytest.MonkeyPatch.context() as patch:
            kvikio = types.SimpleNamespace(RemoteFile=types.SimpleNamespace(open_s3=open_s3))
            patch.setattr(_device, "kvikio", lambda: kvikio)
            got = source.read_all([source] * len(keys), source.locate(keys), True, None)
    assert _batch_bytes(got) == [held[k] for k in keys]
    assert sorted(opened) == [str(i) for i in range(9) if i != 4]

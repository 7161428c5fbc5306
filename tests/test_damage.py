"""Damaged stores: sizes read from stored bytes are checked before anything is allocated.

Shard indexes, zstd frame content sizes, numcodecs' LZ4 size prefixes and Blosc headers
all say how many bytes to read or to decode into. A damaged one must raise
:class:`~xarray_gds.errors.ChunkDecodeError` naming the chunk, on every route (eager
loads, box reads, zarr's own indexing, dask; host and GPU), instead of an allocation of
terabytes (``MemoryError`` with an empty message on the host, CuPy's
``OutOfMemoryError`` on the GPU) or a short read.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import google_crc32c
import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.codecs as zc

from xarray_gds.errors import ChunkDecodeError
from xarray_gds.pipeline import attach

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SHAPE = (8, 64, 64)
SHARD = (4, 64, 64)
INNER = (1, 16, 64)
N_INNER = int(np.prod([s // c for s, c in zip(SHARD, INNER, strict=True)]))
MISSING = np.iinfo(np.uint64).max


def _values() -> np.ndarray:
    return np.random.default_rng(0).random(SHAPE).astype("f4")


# -- routes: every way a read reaches the decoder --------------------------------------
def _select(name: str, v: xr.DataArray) -> xr.DataArray:
    if name == "box":  # slices of step 1: region.read_box
        return v.isel(t=slice(0, 6), y=slice(3, 40))
    if name == "points":  # an array indexer: zarr's own indexing
        return v.isel(t=[0, 1, 5], x=[2, 7])
    return v


def _read(path: Path, device: str, route: str) -> xr.DataArray:
    if route == "dask":
        pytest.importorskip("dask")
    chunks = {} if route == "dask" else None
    ds = xr.open_dataset(path, engine="gds-zarr", device=device, chunks=chunks)
    return _select(route, ds.v).compute()


ROUTES = ("load", "box", "points", "dask")


# -- sharded stores ----------------------------------------------------------------------
def _sharded(path: Path, *, crc: bool = True, location: str = "end") -> Path:
    """A Zarr v3 store with one sharded array ``v`` (2 shards of 16 inner zstd chunks)."""
    group = zarr.open_group(path, mode="w", zarr_format=3)
    index_codecs = [zc.BytesCodec(), zc.Crc32cCodec()] if crc else [zc.BytesCodec()]
    sharding = zc.ShardingCodec(
        chunk_shape=INNER,
        codecs=[zc.BytesCodec(), zc.ZstdCodec()],
        index_codecs=index_codecs,
        index_location=location,
    )
    array = group.create_array(
        "v",
        shape=SHAPE,
        dtype="f4",
        chunks=SHARD,
        serializer=sharding,
        compressors=None,
        dimension_names=["t", "y", "x"],
        fill_value=np.nan,
    )
    array[:] = _values()
    return path


def _edit_index(shard: Path, edit: Callable[[np.ndarray, int], None], crc: bool = True) -> None:
    """Apply ``edit(table, file_size)`` to the (offset, nbytes) table of an end-indexed
    shard and write it back with a valid CRC-32C, so that only the range checks (not the
    checksum) can catch the damage."""
    raw = bytearray(shard.read_bytes())
    n = 16 * N_INNER
    start = len(raw) - n - (4 if crc else 0)
    table = np.frombuffer(bytes(raw[start : start + n]), dtype="<u8").reshape(-1, 2).copy()
    edit(table, len(raw))
    raw[start : start + n] = table.tobytes()
    if crc:
        raw[-4:] = struct.pack("<I", google_crc32c.value(table.tobytes()))
    shard.write_bytes(bytes(raw))


def _flip_size(table: np.ndarray, size: int) -> None:
    table[0, 1] ^= np.uint64(1 << 44)  # one bit of one byte of the first chunk's size


def _flip_offset(table: np.ndarray, size: int) -> None:
    table[0, 0] ^= np.uint64(1 << 44)


def _one_past_end(table: np.ndarray, size: int) -> None:
    # ends one byte into the index: past the chunk data
    table[0, 1] = np.uint64(size - 16 * N_INNER - 4 - int(table[0, 0]) + 1)


def _huge(table: np.ndarray, size: int) -> None:
    table[0] = (np.uint64(1 << 63), np.uint64(1 << 63))


INDEX_DAMAGE = {
    "size-flip": _flip_size,
    "offset-flip": _flip_offset,
    "one-past-end": _one_past_end,
    "huge": _huge,
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("damage", INDEX_DAMAGE)
def test_damaged_shard_index_is_named(tmp_path: Path, device: str, damage: str, route: str) -> None:
    path = _sharded(tmp_path / "s.zarr")
    _edit_index(path / "v" / "c" / "0" / "0" / "0", INDEX_DAMAGE[damage])
    with pytest.raises(ChunkDecodeError, match=r"'v/c/0/0/0 \(inner chunk \(0, 0, 0\)\)'") as err:
        _read(path, device, route)
    assert err.value.codec == "sharding_indexed"
    assert "shard file" in str(err.value)


@pytest.mark.parametrize("route", ROUTES)
def test_directory_in_place_of_a_shard_is_named(tmp_path: Path, device: str, route: str) -> None:
    """A directory where a shard's file should be fails naming the shard key and the
    array, as a damaged shard does (engine="zarr" reads it as the fill value)."""
    path = _sharded(tmp_path / "s.zarr")
    shard = path / "v" / "c" / "0" / "0" / "0"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(ChunkDecodeError, match=r"'v/c/0/0/0'.*directory") as err:
        _read(path, device, route)
    assert err.value.key == "v/c/0/0/0" and err.value.array == "v"
    assert "'v'" in str(err.value)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("crc", "location", "match"),
    [
        (True, "end", r"'v/c/1/0/0 \(shard index\)'.*checksum mismatch"),
        (False, "end", r"'v/c/1/0/0 \(inner chunk \(\d+, \d+, \d+\)\)'.*shard file"),
        (True, "start", r"'v/c/1/0/0 \(inner chunk \(\d+, \d+, \d+\)\)'.*shard file"),
        (False, "start", r"'v/c/1/0/0 \(inner chunk \(\d+, \d+, \d+\)\)'.*shard file"),
    ],
    ids=["crc-end", "end", "crc-start", "start"],
)
def test_truncated_shard_is_named(
    tmp_path: Path, device: str, crc: bool, location: str, match: str, route: str
) -> None:
    path = _sharded(tmp_path / "s.zarr", crc=crc, location=location)
    shard = path / "v" / "c" / "1" / "0" / "0"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ChunkDecodeError, match=match):
        _read(path, device, route)


def test_damaged_index_other_stores(tmp_path: Path) -> None:
    """Stores other than GdsStore (zarr's LocalStore here) are checked against the size
    the store reports."""
    path = _sharded(tmp_path / "s.zarr")
    _edit_index(path / "v" / "c" / "1" / "0" / "0", _flip_size)
    array = attach(zarr.open_array(zarr.storage.LocalStore(path, read_only=True), path="v"))
    np.testing.assert_array_equal(array[:4], _values()[:4])  # the intact shard
    with pytest.raises(ChunkDecodeError, match=r"'v/c/1/0/0 \(inner chunk \(0, 0, 0\)\)'"):
        array[4:]


def test_intact_shards_still_read(tmp_path: Path, device: str) -> None:
    """The checks accept every range zarr-python writes, missing inner chunks included."""
    for location in ("end", "start"):
        path = _sharded(tmp_path / f"{location}.zarr", location=location)
        zarr.open_array(path / "v")[5] = np.nan  # four inner chunks of the fill value
        ref = xr.open_dataset(path, engine="zarr").v
        for route in ROUTES:
            got = _read(path, device, route)
            xr.testing.assert_identical(got.as_numpy(), _select(route, ref).load())


# -- sizes declared by compressed streams -------------------------------------------------
def _unsharded(path: Path, zarr_format: int, compressor: Any) -> Path:
    ds = xr.Dataset({"v": (("t", "y", "x"), _values())})
    encoding = {"v": {"chunks": (2, 32, 64), "compressors": [compressor]}}
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, encoding=encoding, consolidated=False)
    return path


def _chunk(path: Path, zarr_format: int) -> Path:
    """The file of chunk (0, 1, 0) of ``v`` (every route reads it)."""
    return path / "v" / ("c/0/1/0" if zarr_format == 3 else "0.1.0")


def _zstd_declaring(frame: bytes, content_size: int) -> bytes:
    """``frame`` with its header rewritten to declare ``content_size`` decoded bytes (an
    8-byte frame content size field); the compressed blocks are kept."""
    fhd = frame[4]
    single = (fhd >> 5) & 1
    dict_bytes = (0, 1, 2, 4)[fhd & 3]
    flag = fhd >> 6
    width = (single, 2, 4, 8)[flag]
    pos = 5 + (1 - single) + dict_bytes
    head = bytes([fhd | 0xC0]) + frame[5:pos]
    return frame[:4] + head + struct.pack("<Q", content_size) + frame[pos + width :]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zstd_content_size_is_checked(
    tmp_path: Path, device: str, zarr_format: int, route: str
) -> None:
    compressor = numcodecs.Zstd() if zarr_format == 2 else zc.ZstdCodec()
    path = _unsharded(tmp_path / "z.zarr", zarr_format, compressor)
    chunk = _chunk(path, zarr_format)
    chunk.write_bytes(_zstd_declaring(chunk.read_bytes(), 1 << 40))
    key = "v/c/0/1/0" if zarr_format == 3 else "v/0.1.0"
    with pytest.raises(
        ChunkDecodeError, match=rf"'{key}' with codec 'zstd': frame declares 1099511627776 "
    ):
        _read(path, device, route)


@pytest.mark.parametrize("route", ROUTES)
def test_lz4_size_prefix_is_checked(tmp_path: Path, device: str, route: str) -> None:
    path = _unsharded(tmp_path / "l.zarr", 2, numcodecs.LZ4())
    chunk = _chunk(path, 2)
    raw = bytearray(chunk.read_bytes())
    raw[:4] = struct.pack("<i", 2**31 - 1)
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChunkDecodeError, match=r"'v/0.1.0' with codec 'lz4': size prefix says"):
        _read(path, device, route)


BLOSC_FIELDS = {"nbytes": 4, "blocksize": 8, "cbytes": 12, "block-start": 16}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("field", BLOSC_FIELDS)
def test_blosc_header_sizes_are_checked(
    tmp_path: Path, device: str, field: str, route: str
) -> None:
    blosc = numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.SHUFFLE, blocksize=4096)
    path = _unsharded(tmp_path / "b.zarr", 2, blosc)
    chunk = _chunk(path, 2)
    raw = bytearray(chunk.read_bytes())
    at = BLOSC_FIELDS[field]
    raw[at : at + 4] = struct.pack("<i", 2**31 - 1)
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChunkDecodeError, match=r"'v/0.1.0' with codec 'blosc'"):
        _read(path, device, route)


# -- advice that cannot destroy data --------------------------------------------------------
def _metadata_says_f8(path: Path, zarr_format: int) -> None:
    """Rewrite the metadata of ``v`` (float32 chunks) to say float64: the chunks are
    right, the metadata is wrong, and deleting a chunk would lose its data."""
    name = "zarr.json" if zarr_format == 3 else ".zarray"
    meta = json.loads((path / "v" / name).read_text())
    if zarr_format == 3:
        meta["data_type"] = "float64"
    else:
        meta["dtype"] = "<f8"
    (path / "v" / name).write_text(json.dumps(meta))


SIZE_CASES = {  # codec: (what the decoder found, the decoded bytes it gives)
    "zstd": ("frame declares 16384 decoded bytes", 16384),
    "lz4": ("size prefix says 16384 bytes", 16384),
    "bytes": ("chunk holds 16384 bytes", 16384),
    "blosc": ("header declares 16384 decoded bytes", 16384),
}


def _compressor(codec: str, zarr_format: int) -> Any:
    if codec == "bytes":
        return None
    if codec == "blosc":
        return numcodecs.Blosc(cname="lz4")
    if zarr_format == 3:
        return zc.ZstdCodec()
    return numcodecs.Zstd() if codec == "zstd" else numcodecs.LZ4()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("zarr_format", "codec"), [(3, "zstd"), (2, "zstd"), (2, "lz4"), (3, "bytes"), (2, "blosc")]
)
def test_size_mismatch_names_both_sides_and_never_advises_deleting_first(
    tmp_path: Path, device: str, zarr_format: int, codec: str, route: str
) -> None:
    """A chunk whose decoded size disagrees with the metadata: the message names the
    chunk's decoded byte count and the metadata's chunk shape x itemsize, says that
    either may be wrong and how to check, and mentions deleting the chunk only for
    metadata confirmed right (here the metadata is what is wrong)."""
    path = tmp_path / "m.zarr"
    ds = xr.Dataset({"v": (("t", "y", "x"), _values())})
    compressor = _compressor(codec, zarr_format)
    encoding = {"v": {"chunks": (2, 32, 64), "compressors": [compressor] if compressor else None}}
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, encoding=encoding, consolidated=False)
    _metadata_says_f8(path, zarr_format)
    with pytest.raises(ChunkDecodeError) as err:
        _read(path, device, route)
    found, decoded = SIZE_CASES[codec]
    key = err.value.key
    assert key in {f"v/c/{i}/{j}/0" for i in range(4) for j in range(2)} | {
        f"v/{i}.{j}.0" for i in range(4) for j in range(2)
    }
    assert str(err.value) == (
        f"cannot decode chunk {key!r} with codec {codec!r}: {found}, expected 32768. "
        f"The chunk's decoded size ({decoded} bytes) disagrees with the metadata of array "
        "'v' (chunk shape (2, 32, 64) x float64 itemsize 8 = 32768 bytes): either the "
        "stored chunk or the array metadata (dtype, chunks, codecs) is wrong. To check, "
        "read the chunk with engine='zarr' (zarr-python) and compare the dtype, chunks and "
        "codecs in the array's zarr.json (.zarray in Zarr v2) with how the data were "
        "written. If the metadata is wrong, fix the metadata and keep the chunk; only once "
        "the metadata is confirmed right, rewrite the chunk, or delete it to read the fill "
        "value."
    )
    assert (err.value.array, err.value.decoded, err.value.expected) == ("v", decoded, 32768)


def test_corrupt_chunk_advice_checks_the_codecs_first(tmp_path: Path, device: str) -> None:
    path = _unsharded(tmp_path / "z.zarr", 3, zc.ZstdCodec())
    _chunk(path, 3).write_bytes(b"not a zstd frame at all")
    with pytest.raises(ChunkDecodeError) as err:
        _read(path, device, "load")
    assert str(err.value) == (
        "cannot decode chunk 'v/c/0/1/0' with codec 'zstd': not a zstd frame (bad magic "
        "number). The stored chunk is corrupt or truncated, or the codecs in the metadata "
        "of array 'v' are not those it was written with. Read it with engine='zarr' "
        "(zarr-python) and compare the codecs in the array's zarr.json (.zarray in Zarr "
        "v2) with how it was written; only once the metadata is confirmed right, rewrite "
        "the chunk (deleting it reads the fill value instead of its data)."
    )


# -- the streamed host route: chunks of 256 KiB and more, one thread a chunk -------------
#: 3 x 2 chunks of (1, 256, 256) float32: 256 KiB each, the smallest streamed size
STREAMED_SHAPE = (3, 512, 256)
STREAMED_CHUNKS = (1, 256, 256)
STREAMED_KEYS = [f"v/c/{t}/{y}/0" for t in range(3) for y in range(2)]


def _streamed_store(path: Path) -> Path:
    values = np.random.default_rng(3).random(STREAMED_SHAPE).astype("f4")
    ds = xr.Dataset({"v": (("t", "y", "x"), values)})
    encoding = {"v": {"chunks": STREAMED_CHUNKS, "compressors": [zc.ZstdCodec()]}}
    ds.to_zarr(path, mode="w", zarr_format=3, encoding=encoding, consolidated=False)
    return path


def _read_streamed(path: Path, route: str) -> xr.DataArray:
    if route == "async":
        import asyncio

        ds = xr.open_dataset(path, engine="gds-zarr", device="cpu")
        return asyncio.run(ds.v.load_async())
    return _read(path, "cpu", route)


@pytest.mark.parametrize("route", ["load", "box", "dask", "async"])
def test_streamed_damaged_chunk_is_named_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """Host reads of chunks of 256 KiB and more are streamed (each chunk read, decoded
    and placed by one thread). A damaged chunk there is reported under its own key,
    wherever it lies in the read (first, middle, last chunk of the request), and the
    advice to rewrite a chunk names that one: never a healthy neighbour, which the user
    would otherwise rewrite or delete."""
    from xarray_gds import coalesce

    streamed: list[int] = []
    original = coalesce._serve_streamed

    def spy(group: list[Any]) -> None:
        streamed.append(sum(len(r.paths) for r in group))
        original(group)

    monkeypatch.setattr(coalesce, "_serve_streamed", spy)
    healthy = _streamed_store(tmp_path / "healthy.zarr")
    ref = xr.open_dataset(healthy, engine="zarr").v
    xr.testing.assert_identical(_read_streamed(healthy, route), _select(route, ref).load())
    assert streamed  # the route under test
    # the box route reads t 0..5 and y 3..40: chunks (t, 0) only
    keys = [k for k in STREAMED_KEYS if route != "box" or k.endswith("/0/0")]
    for n, key in enumerate(keys):
        path = tmp_path / f"broken-{n}.zarr"
        shutil.copytree(healthy, path)
        (path / key).write_bytes(b"\x00" * 64)
        streamed.clear()
        with pytest.raises(ChunkDecodeError) as err:
            _read_streamed(path, route)
        assert streamed
        assert (err.value.key, err.value.array, err.value.codec) == (key, "v", "zstd")
        message = str(err.value)
        assert message.startswith(f"cannot decode chunk {key!r} with codec 'zstd': ")
        assert "rewrite the chunk" in message
        assert not [k for k in STREAMED_KEYS if k != key and repr(k) in message]

"""Blosc1 frames made by the batched encoder (xarray_gds.codecs.formats.blosc.encode), decoded
by c-blosc (numcodecs, zarr-python) and by the project's own decoders."""

from __future__ import annotations

from pathlib import Path

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr.codecs as zc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xarray_gds
from xarray_gds.codecs import encode as enc
from xarray_gds.codecs.formats import BLOSC, blosc
from xarray_gds.codecs.formats.blosc import BloscEncode, shuffle
from xarray_gds.codecs.formats.blosc.encode import (
    DEFAULT_BLOCKSIZE,
    encode_frames,
    frame_layout,
)

CNAMES = ["lz4", "lz4hc", "zstd", "zlib"]

pytestmark = pytest.mark.filterwarnings("ignore::xarray.SerializationWarning")


def _frames(settings_: BloscEncode, rows: np.ndarray) -> list[np.ndarray]:
    data, starts, sizes = encode_frames(settings_, rows)
    assert starts[0] == 0 and np.all(starts[1:] == starts[:-1] + sizes[:-1])
    assert data.size == int(sizes.sum())
    return [data[int(s) : int(s) + int(k)] for s, k in zip(starts, sizes, strict=True)]


def _rows(seed: int, n: int, nbytes: int, kind: str) -> np.ndarray:
    """Rows of bytes: smooth values (compressible), random bytes (not), or a mix."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    smooth = (np.arange(n * nbytes) // 7 % 13).astype(np.uint8).reshape(n, nbytes)
    if kind == "smooth":
        return smooth
    noise = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    return np.where(rng.random((n, nbytes)) < 0.3, noise, smooth).astype(np.uint8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 3),
    nbytes=st.integers(1, 40_000) | st.integers(2048, 70_000),
    typesize=st.integers(1, 8),
    mode=st.sampled_from([0, 1, 2]),
    cname=st.sampled_from(CNAMES),
    blocksize=st.sampled_from([0, 1000, 1024, 4096, 10_000]) | st.sampled_from([1, 8, 100]),
    kind=st.sampled_from(["smooth", "mixed", "random"]),
    seed=st.integers(0, 2**16),
)
def test_frames_decode_bit_exactly_with_numcodecs(
    n: int, nbytes: int, typesize: int, mode: int, cname: str, blocksize: int, kind: str, seed: int
) -> None:
    """Frames of every compressor, shuffle, typesize and block size (full and short
    blocks, leftover bytes, bit-shuffled blocks whose elements are not a multiple of 8,
    raw blocks, memcpyed frames) decode to the rows, by c-blosc and by the project's
    host decoder."""
    rows = _rows(seed, n, nbytes, kind)
    frames = _frames(BloscEncode(cname, mode, typesize, blocksize), rows)
    if kind == "smooth" and nbytes >= 2048 and blocksize not in (1, 8, 100):
        assert not any(f[2] & 0x02 for f in frames)  # compressed, shuffled: not memcpyed
    for row, frame in zip(rows, frames, strict=True):
        got = np.frombuffer(numcodecs.Blosc().decode(frame), dtype=np.uint8)
        np.testing.assert_array_equal(got, row)
    keys = [f"v/{i}" for i in range(n)]
    np.testing.assert_array_equal(blosc.decode_host(frames, keys, nbytes), rows)


@pytest.mark.parametrize("typesize", range(1, 9))
@pytest.mark.parametrize("mode", [1, 2])
def test_shuffle_is_what_unshuffle_undoes(typesize: int, mode: int) -> None:
    """shuffle and blosc.unshuffle are inverses, block by block (short last block)."""
    rows = np.random.default_rng(typesize).integers(0, 256, (3, 5000), dtype=np.uint8)
    for blocksize in (8 * typesize, 1000, 4096, 5000):
        done = shuffle(rows, typesize, blocksize, mode)
        back = blosc.unshuffle(done, typesize, blocksize, mode)
        np.testing.assert_array_equal(back, rows)


@pytest.mark.parametrize("typesize", [2, 3, 4, 8])
def test_byte_shuffle_of_one_block_is_numcodecs_shuffle(typesize: int) -> None:
    """One block's byte shuffle is numcodecs' Shuffle filter (an independent writer)."""
    row = np.random.default_rng(0).integers(0, 256, 64 * typesize, dtype=np.uint8)
    want = np.frombuffer(numcodecs.Shuffle(typesize).encode(row), dtype=np.uint8)
    np.testing.assert_array_equal(shuffle(row[None], typesize, row.size, 1)[0], want)


def test_layout_stores_what_does_not_compress_as_is() -> None:
    """Random bytes make memcpyed frames (header + the bytes, flag set); a block whose
    stream is not shorter is stored raw (size prefix = its decoded size)."""
    s = BloscEncode("lz4", 1, 4, 1024)
    noise = _rows(1, 1, 4096, "random")
    (frame,) = _frames(s, noise)
    assert frame.size == 4096 + 16 and frame[2] & 0x02
    np.testing.assert_array_equal(frame[16:], noise[0])  # not shuffled
    # block 1 of 4 incompressible, the others zeros
    mixed = np.zeros((1, 4096), dtype=np.uint8)
    mixed[0, 1024:2048] = noise[0, :1024]
    layout = frame_layout(s, 4096, np.array([[10, 1100, 10, 10]]))
    assert layout.raw.tolist() == [[False, True, False, False]]
    assert layout.stored.tolist() == [[10, 1024, 10, 10]]
    (frame,) = _frames(s, mixed)
    assert not frame[2] & 0x02 and frame[2] & 0x10  # compressed, don't split
    start = int(frame[20:24].view("<i4")[0])
    assert int(frame[start : start + 4].view("<i4")[0]) == 1024  # stored as is
    np.testing.assert_array_equal(
        np.frombuffer(numcodecs.Blosc().decode(frame), dtype=np.uint8), mixed[0]
    )


def test_header_says_what_the_codec_says() -> None:
    """Header fields: version 2, compressor code, shuffle flag, typesize, sizes."""
    rows = _rows(0, 1, 3 * DEFAULT_BLOCKSIZE + 100, "smooth")
    for cname, code in (("lz4", 1), ("lz4hc", 1), ("zlib", 3), ("zstd", 4)):
        for mode, flag in ((0, 0), (1, 0x01), (2, 0x04)):
            (frame,) = _frames(BloscEncode(cname, mode, 4), rows)
            words = frame[4:16].view("<i4")
            assert (frame[0], frame[1], frame[3]) == (2, 1, 4)
            assert frame[2] == flag | 0x10 | code << 5
            assert words.tolist() == [rows.size, DEFAULT_BLOCKSIZE, frame.size]


@pytest.mark.parametrize(
    ("codec", "options"),
    [
        (numcodecs.Blosc(), BloscEncode("lz4", 1, 4)),
        (numcodecs.Blosc("zstd", shuffle=numcodecs.Blosc.AUTOSHUFFLE), BloscEncode("zstd", 1, 4)),
        (numcodecs.Blosc("zlib", shuffle=2, blocksize=4096), BloscEncode("zlib", 2, 4, 4096)),
        (zc.BloscCodec(cname="lz4", shuffle="noshuffle", typesize=4), BloscEncode("lz4", 0, 4)),
        (zc.BloscCodec(typesize=4), BloscEncode("zstd", 2, 4)),
    ],
)
def test_plan_carries_the_codecs_settings(codec: object, options: BloscEncode) -> None:
    assert BLOSC.encode_options(codec, np.dtype("f4")) == options


@pytest.mark.parametrize("host_writer", ["zarr", "batched"])
@pytest.mark.parametrize(
    ("zarr_format", "codec"),
    [
        (2, numcodecs.Blosc("lz4", shuffle=numcodecs.Blosc.SHUFFLE)),
        (2, numcodecs.Blosc("zlib", shuffle=numcodecs.Blosc.BITSHUFFLE)),
        (2, numcodecs.Blosc("zstd", shuffle=numcodecs.Blosc.NOSHUFFLE, blocksize=1000)),
        (3, zc.BloscCodec(cname="lz4", shuffle="shuffle")),
        (3, zc.BloscCodec(cname="zstd", shuffle="bitshuffle")),
    ],
)
def test_stores_written_read_back_by_zarr(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    zarr_format: int,
    codec: object,
    host_writer: str,
) -> None:
    """A Blosc store written by the batched encoder reads back through zarr-python's
    c-blosc exactly as the one xarray writes itself (dtypes of 1 to 8 bytes, an edge
    chunk, a NaN fill)."""
    if host_writer == "batched":
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    rng = np.random.default_rng(zarr_format)
    shape = (5, 37, 41)
    ds = xr.Dataset(
        {
            name: (("t", "y", "x"), (rng.normal(size=shape) * 50).astype(dtype))
            for name, dtype in (("i1", "i1"), ("u2", "u2"), ("f4", "f4"), ("f8", "f8"))
        }
    )
    ds["f4"][0, :3, :3] = np.nan
    enc_ = {v: {"compressors": codec, "chunks": (2, 16, 16)} for v in ds.data_vars}
    ours, theirs = tmp_path / "ours.zarr", tmp_path / "theirs.zarr"
    xarray_gds.to_zarr(ds, ours, encoding=enc_, zarr_format=zarr_format)
    ds.to_zarr(theirs, encoding=enc_, zarr_format=zarr_format)
    got = xr.open_dataset(ours, engine="zarr").load()
    want = xr.open_dataset(theirs, engine="zarr").load()
    xr.testing.assert_identical(got, want)
    xr.testing.assert_identical(xr.open_dataset(ours, engine="gds-zarr", device="cpu").load(), want)


def test_shards_of_blosc_inner_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded v3 with Blosc inner chunks: all inner chunks of the write in one batch."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    values = np.arange(8 * 30 * 20, dtype="f4").reshape(8, 30, 20) % 17
    ds = xr.Dataset({"a": (("t", "y", "x"), values)})
    codecs = {"compressors": zc.BloscCodec(cname="zstd", shuffle="shuffle", typesize=4)}
    encoding = {"a": {"chunks": (1, 10, 10), "shards": (4, 30, 20), **codecs}}
    xarray_gds.to_zarr(ds, tmp_path / "s.zarr", encoding=encoding, zarr_format=3)
    ds.to_zarr(tmp_path / "x.zarr", encoding=encoding, zarr_format=3)
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "s.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load(),
    )


# -- on the GPU ----------------------------------------------------------------------


def _device_frames(options: BloscEncode, rows: np.ndarray) -> list[np.ndarray]:
    cp = pytest.importorskip("cupy")
    from xarray_gds.codecs import nvcomp

    chain = enc.EncodeChain(
        (rows.shape[1],), np.dtype("u1"), (0,), BLOSC, ("blosc",), options=options
    )
    encoded = nvcomp.encode(chain, cp.asarray(rows))
    return [np.array(encoded.chunk(i)) for i in range(len(rows))]


@pytest.mark.gpu
@pytest.mark.parametrize("cname", CNAMES)
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("typesize", [1, 2, 4, 8])
def test_nvcomp_frames_decode_with_numcodecs_and_on_the_gpu(
    cname: str, mode: int, typesize: int
) -> None:
    """Frames whose blocks nvCOMP compressed (one batch) decode bit-exactly by c-blosc
    and by the project's GPU decoder (nvcomp.decode_frames)."""
    cp = pytest.importorskip("cupy")
    from xarray_gds.batch import DeviceBatch, pack_offsets
    from xarray_gds.codecs import nvcomp

    nbytes = 3 * 65536 + 1000
    rows = np.concatenate([_rows(typesize, 3, nbytes, "mixed"), _rows(7, 1, nbytes, "random")])
    frames = _device_frames(BloscEncode(cname, mode, typesize, 65536), rows)
    for row, frame in zip(rows, frames, strict=True):
        got = np.frombuffer(numcodecs.Blosc().decode(frame), dtype=np.uint8)
        np.testing.assert_array_equal(got, row)
    sizes = np.array([f.size for f in frames], dtype=np.int64)
    offsets, total = pack_offsets(sizes, 16)
    arena = np.zeros(total, dtype=np.uint8)
    for f, o in zip(frames, offsets.tolist(), strict=True):
        arena[o : o + f.size] = f
    batch = DeviceBatch(cp.asarray(arena), offsets, sizes)
    keys = [f"v/{i}" for i in range(len(frames))]
    decoded = nvcomp.decode_frames(BLOSC, batch, offsets, sizes, nbytes, keys)
    np.testing.assert_array_equal(cp.asnumpy(decoded), rows)


@pytest.mark.gpu
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_cupy_dataset_written_with_blosc_on_the_gpu(tmp_path: Path, zarr_format: int) -> None:
    """CuPy values of a Blosc array are encoded on the GPU (no host-encode warning) and
    read back by zarr-python as xarray's own write of the same values."""
    import warnings

    cp = pytest.importorskip("cupy")
    values = (np.random.default_rng(0).normal(size=(6, 50, 40)) * 10).astype("f4")
    codec = (
        numcodecs.Blosc("lz4", shuffle=numcodecs.Blosc.SHUFFLE)
        if zarr_format == 2
        else zc.BloscCodec(cname="zstd", shuffle="bitshuffle", typesize=4)
    )
    encoding = {"a": {"compressors": codec, "chunks": (2, 25, 40)}}
    ds = xr.Dataset({"a": (("t", "y", "x"), cp.asarray(values))})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        xarray_gds.to_zarr(ds, tmp_path / "g.zarr", encoding=encoding, zarr_format=zarr_format)
    xr.Dataset({"a": (("t", "y", "x"), values)}).to_zarr(
        tmp_path / "x.zarr", encoding=encoding, zarr_format=zarr_format
    )
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "g.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "x.zarr", engine="zarr").load(),
    )

"""Host deflate decoding with libdeflate (the ``deflate`` package, the ``fast-host``
extra): zlib and gzip chunks decode to the same values as numcodecs (zlib), and damaged
ones raise the same errors, whether the package is installed or not. Every test runs
both ways: ``libdeflate`` installed (it is in the ``test`` extra), and its import made
to fail."""

from __future__ import annotations

import gzip
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.codecs as zc

from xarray_gds.codecs import host
from xarray_gds.codecs.formats import GZIP, ZLIB, Compressor, blosc
from xarray_gds.codecs.formats.deflate import libdeflate
from xarray_gds.errors import ChunkDecodeError

CODECS = {"zlib": (ZLIB, numcodecs.Zlib(level=1)), "gzip": (GZIP, numcodecs.GZip(level=1))}


@pytest.fixture(params=["libdeflate", "zlib"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``"libdeflate"``: the package is installed (the test extra has it; where it is
    absent these cases skip); ``"zlib"``: importing it raises ImportError, as where it
    is not installed."""
    if request.param == "libdeflate":
        pytest.importorskip("deflate", reason="libdeflate (the fast-host extra) is not installed")
    else:
        monkeypatch.setitem(sys.modules, "deflate", None)
    libdeflate.cache_clear()
    yield str(request.param)
    libdeflate.cache_clear()  # looked for again with the real modules


def _values(kind: str, nbytes: int = 1 << 20) -> np.ndarray:
    rng = np.random.default_rng(len(kind))
    if kind == "random":  # incompressible: stored blocks
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    n = nbytes // 4  # weather-like float32: a smooth field plus quantised noise
    field = np.sin(np.linspace(0, 60, n, dtype="f4")) * 20 + 280
    return np.round(field + rng.standard_normal(n, dtype="f4"), 2).view(np.uint8)


def _decode(name: str, chunks: list[Any], nbytes: int) -> np.ndarray:
    fmt, codec = CODECS[name]
    keys = [f"var/c{i}" for i in range(len(chunks))]
    return host.decompress(Compressor(fmt, codec), chunks, nbytes, keys)


def _count_fast_decodes(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[int]:
    """A list that gets a 1 for every chunk the format's fast decoder decodes (the real
    decoder, counted)."""
    done: list[int] = []
    real = cls.fast_decoder

    def counted(self: Any) -> Any:
        fast = real(self)
        if fast is None:
            return None

        def decode(chunk: Any, nbytes: int) -> Any:
            out = fast(chunk, nbytes)
            done.append(int(out is not None))
            return out

        return decode

    monkeypatch.setattr(cls, "fast_decoder", counted)
    return done


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("kind", ["random", "compressible", "zeros"])
def test_values_equal_numcodecs(
    decoder: str, name: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fmt, codec = CODECS[name]
    data = np.zeros(1 << 20, np.uint8) if kind == "zeros" else _values(kind)
    # several chunks (the pool decodes them on its threads), one of them of other data
    rows = [data, data[::-1].copy(), _values("random")]
    chunks = [np.frombuffer(codec.encode(r), dtype=np.uint8) for r in rows]
    decoded_fast = _count_fast_decodes(monkeypatch, type(fmt))
    out = _decode(name, chunks, data.size)
    assert decoded_fast == ([1, 1, 1] if decoder == "libdeflate" else [])
    for row, chunk, expected in zip(out, chunks, rows, strict=True):
        assert np.array_equal(row, np.frombuffer(codec.decode(chunk), dtype=np.uint8))
        assert np.array_equal(row, expected)
    fast = fmt.fast_decoder()
    if decoder == "libdeflate":  # libdeflate's own output (a bytearray; zlib's is bytes)
        assert fast is not None
        assert isinstance(fast(chunks[0], data.size), bytearray)
    else:
        assert fast is None and libdeflate() is None


def test_chunk_sizes_that_libdeflate_cannot_take_go_to_zlib(decoder: str) -> None:
    """A size of 0 or over 4 GiB (the bindings' C ``unsigned int``) is never passed."""
    fast = ZLIB.fast_decoder()
    chunk = numcodecs.Zlib().encode(b"")
    if fast is not None:
        assert fast(chunk, 0) is None
        assert fast(chunk, 1 << 32) is None
    assert _decode("zlib", [np.frombuffer(chunk, np.uint8)], 0).shape == (1, 0)


def _damaged(name: str, how: str) -> bytes:
    codec = CODECS[name][1]
    good = bytes(codec.encode(_values("compressible")))
    if how == "flipped":  # bytes in the middle of the stream
        mid = len(good) // 2
        return good[:mid] + bytes(b ^ 0x5A for b in good[mid : mid + 64]) + good[mid + 64 :]
    if how == "truncated":
        return good[: len(good) // 2]
    assert how == "checksum"  # Adler-32 (zlib) or CRC-32 (gzip) wrong
    at = len(good) - (4 if name == "zlib" else 8)
    return good[:at] + bytes(b ^ 0xFF for b in good[at : at + 4]) + good[at + 4 :]


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("how", ["flipped", "truncated", "checksum"])
def test_damaged_chunk_raises_naming_it(decoder: str, name: str, how: str) -> None:
    good = np.frombuffer(CODECS[name][1].encode(_values("compressible")), np.uint8)
    bad = np.frombuffer(_damaged(name, how), np.uint8)
    with pytest.raises(ChunkDecodeError) as caught:
        _decode(name, [good, bad], 1 << 20)
    assert caught.value.key == "var/c1"
    assert caught.value.codec == name
    with pytest.raises(Exception) as reference:  # what numcodecs alone says
        CODECS[name][1].decode(bad)
    assert str(reference.value) in str(caught.value)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_chunk_of_another_size_raises_both_sizes(decoder: str, name: str) -> None:
    chunk = np.frombuffer(CODECS[name][1].encode(_values("compressible")), np.uint8)
    for nbytes in ((1 << 20) - 4, (1 << 20) + 4):
        with pytest.raises(ChunkDecodeError, match=rf"{1 << 20} bytes, expected {nbytes}"):
            _decode(name, [chunk], nbytes)


def test_gzip_members_and_trailing_bytes_as_numcodecs(decoder: str) -> None:
    """libdeflate decodes one gzip member and ignores what follows it: such chunks are
    numcodecs', which decodes every member, skips zero padding and refuses the rest."""
    data = _values("compressible", 1 << 16)
    member = gzip.compress(data.tobytes(), compresslevel=1)
    two = np.frombuffer(member + member, np.uint8)
    assert np.array_equal(_decode("gzip", [two], 2 * data.size)[0], np.tile(data, 2))
    padded = np.frombuffer(member + bytes(8), np.uint8)
    assert np.array_equal(_decode("gzip", [padded], data.size)[0], data)
    with pytest.raises(ChunkDecodeError, match="var/c0"):
        _decode("gzip", [two], data.size)  # one member's worth asked: numcodecs refuses
    with pytest.raises(ChunkDecodeError, match="Not a gzipped file"):
        _decode("gzip", [np.frombuffer(member + b"garbage!", np.uint8)], data.size)


def test_zlib_trailing_bytes_as_numcodecs(decoder: str) -> None:
    """zlib (numcodecs) ignores bytes after a zlib stream's Adler-32; so does libdeflate."""
    data = _values("compressible", 1 << 16)
    chunk = np.frombuffer(numcodecs.Zlib().encode(data) + b"tail", np.uint8)
    assert np.array_equal(_decode("zlib", [chunk], data.size)[0], data)


def test_blosc_zlib_streams(decoder: str) -> None:
    """The zlib streams inside Blosc frames, decoded on the host stream by stream."""
    data = _values("compressible", 1 << 18)
    codec = numcodecs.Blosc(cname="zlib", clevel=1, shuffle=numcodecs.Blosc.SHUFFLE)
    frames = [np.frombuffer(codec.encode(data), np.uint8)]
    out = blosc.decode_host(frames, ["var/0"], data.size)
    assert np.array_equal(out[0], data)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_store_reads_equal_engine_zarr(decoder: str, tmp_path: Path, zarr_format: int) -> None:
    """Zarr v2 zlib and v3 gzip stores, and HDF5's deflate as kerchunk describes it (a
    Zlib compressor given as the last filter, after Shuffle), read on the host."""
    values = _values("compressible", 4 * 64 * 64 * 4).view("f4").reshape(4, 64, 64)
    ds = xr.Dataset({"t": (("time", "y", "x"), values)})
    if zarr_format == 2:
        encoding: dict[str, Any] = {
            "t": {"compressors": [numcodecs.Zlib(level=4)], "chunks": (1, 64, 64)},
        }
    else:
        encoding = {"t": {"compressors": [zc.GzipCodec(level=4)], "chunks": (1, 64, 64)}}
    path = tmp_path / "s.zarr"
    ds.to_zarr(path, zarr_format=zarr_format, encoding=encoding, consolidated=False)
    ref = xr.open_dataset(path, engine="zarr", consolidated=False).load()
    got = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False).load()
    xr.testing.assert_identical(got, ref)
    if zarr_format == 2:  # the kerchunk/HDF5 form: [Shuffle, Zlib] as filters
        hdf = tmp_path / "h.zarr"
        group = zarr.open_group(hdf, mode="w", zarr_format=2)
        arr = group.create_array(
            "t",
            shape=values.shape,
            chunks=(1, 64, 64),
            dtype="f4",
            compressors=None,
            filters=[numcodecs.Shuffle(elementsize=4), numcodecs.Zlib(level=4)],
            attributes={"_ARRAY_DIMENSIONS": ["time", "y", "x"]},
        )
        arr[:] = values
        ref = xr.open_dataset(hdf, engine="zarr", consolidated=False).load()
        got = xr.open_dataset(hdf, engine="gds-zarr", device="cpu", consolidated=False).load()
        xr.testing.assert_identical(got, ref)

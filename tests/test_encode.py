"""The batched encoder: plans, stream framing and checksums (host variant, as in CI),
and on the GPU the same streams made by nvCOMP."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs as zc

from xarray_gds.codecs import encode as enc
from xarray_gds.codecs.formats import ZSTD


def _metadata(zarr_format: int, chunks: tuple[int, ...] = (8, 16), **kwargs: Any) -> Any:
    arr = zarr.create_array(
        store={}, shape=(20, 40), chunks=chunks, dtype="f4", zarr_format=zarr_format, **kwargs
    )
    return arr.metadata


@pytest.mark.parametrize("size", [1, 5, 4096, 65537, (1 << 20) + 7, 3 << 20])
def test_adler32_matches_zlib(size: int) -> None:
    rng = np.random.default_rng(size)
    rows = rng.integers(0, 256, size=(3, size), dtype=np.uint8)
    rows[1] = 255  # the largest weighted sums
    got = enc.adler32(rows, np)
    assert got.tolist() == [zlib.adler32(r.tobytes()) for r in rows]


@pytest.mark.parametrize(
    ("zarr_format", "kwargs", "reason"),
    [
        (3, {"compressors": zc.ZstdCodec(checksum=True)}, "checksum=True"),
        (3, {"compressors": zc.ZstdCodec(level=7)}, "level=7"),
        (3, {"compressors": zc.GzipCodec(level=1)}, "level=1"),
        (3, {"compressors": zc.BloscCodec(clevel=7)}, "clevel=7"),
        (3, {"compressors": zc.BloscCodec(cname="blosclz")}, "blosclz) has no GPU encoder"),
        (3, {"compressors": (zc.ZstdCodec(), zc.Crc32cCodec())}, "crc32c"),
        (
            3,
            {"shards": (16, 32), "compressors": zc.BloscCodec(cname="lz4hc")},
            "inner chunks: cname=lz4hc",
        ),
        (2, {"compressors": numcodecs.Zstd(level=5)}, "level=5"),
        (2, {"compressors": numcodecs.LZ4(acceleration=3)}, "acceleration=3"),
        (2, {"compressors": numcodecs.Blosc(cname="snappy")}, "snappy) has no GPU encoder"),
        (2, {"compressors": numcodecs.Blosc(clevel=1)}, "clevel=1"),
        (2, {"filters": [numcodecs.Shuffle(4)], "compressors": numcodecs.Zstd()}, "filters"),
    ],
)
def test_plans_name_why_an_array_encodes_on_the_host(
    zarr_format: int, kwargs: dict[str, Any], reason: str
) -> None:
    plan = enc.plan_encode(_metadata(zarr_format, **kwargs))
    assert isinstance(plan, str)
    assert reason in plan


def test_plan_levels_gpu_accepts_any_level_but_not_checksums() -> None:
    plan = enc.plan_encode(_metadata(3, compressors=zc.ZstdCodec(level=7)), levels="gpu")
    assert isinstance(plan, enc.EncodeChain) and plan.compressor is ZSTD
    plan = enc.plan_encode(_metadata(3, compressors=zc.ZstdCodec(checksum=True)), levels="gpu")
    assert isinstance(plan, str)


def test_plan_lz4_chunks_over_16_mib_encode_on_the_host() -> None:
    arr = zarr.create_array(
        store={},
        shape=(4096, 2048),
        chunks=(4096, 2048),
        dtype="f4",
        zarr_format=2,
        compressors=numcodecs.LZ4(),
    )
    plan = enc.plan_encode(arr.metadata)
    assert isinstance(plan, str) and "16 MiB" in plan


CODECS = [
    (3, {"compressors": zc.ZstdCodec()}),
    (3, {"compressors": zc.GzipCodec()}),
    (3, {"compressors": None}),
    (3, {"compressors": zc.ZstdCodec(), "serializer": zc.BytesCodec(endian="big")}),
    (3, {"compressors": zc.GzipCodec(), "filters": [zc.TransposeCodec(order=(1, 0))]}),
    (2, {"compressors": numcodecs.Zstd()}),
    (2, {"compressors": numcodecs.LZ4()}),
    (2, {"compressors": numcodecs.Zlib()}),
    (2, {"compressors": numcodecs.GZip()}),
    (2, {"compressors": numcodecs.Zlib(), "order": "F"}),
]


def _encoder(device: str) -> Any:
    if device == "cuda":
        from xarray_gds.codecs import nvcomp

        return nvcomp.encode
    return enc.encode_host


@pytest.mark.parametrize(("zarr_format", "kwargs"), CODECS)
def test_encoded_chunks_decode_with_zarr(
    zarr_format: int, kwargs: dict[str, Any], device: str
) -> None:
    """Chunks made by the batched encoder are what zarr-python reads as the same values."""
    extra = dict(kwargs)
    order = extra.pop("order", "C")
    with zarr.config.set({"array.order": order}):
        arr = zarr.create_array(
            store=zarr.storage.MemoryStore(),
            shape=(24, 16),
            chunks=(8, 16),
            dtype="f4",
            zarr_format=zarr_format,
            fill_value=0,
            **extra,
        )
    assert getattr(arr.metadata, "order", "C") == order
    plan = enc.plan_encode(arr.metadata)
    assert isinstance(plan, enc.EncodeChain), plan
    values = np.cumsum(np.random.default_rng(0).normal(size=(24, 16)), axis=0).astype("f4")
    chunks: Any = values.reshape(3, 8, 16)
    if device == "cuda":
        import cupy as cp

        chunks = cp.asarray(chunks)
    encoded = _encoder(device)(plan, chunks)
    for i in range(3):
        key = arr.metadata.encode_chunk_key((i, 0))
        buf = zarr.core.buffer.cpu.Buffer.from_bytes(bytes(encoded.chunk(i)))
        zarr.core.sync.sync(arr.store.set(key, buf))
    np.testing.assert_array_equal(arr[...], values)


def _dataset(device: str) -> Any:
    import xarray as xr

    values = np.cumsum(np.random.default_rng(1).normal(size=(32, 48)), axis=0).astype("f4")
    values[8:16, 16:32] = np.nan  # one chunk holds only the fill value
    data: Any = values
    if device == "cuda":
        import cupy as cp

        data = cp.asarray(values)
    return xr.Dataset({"a": (("x", "y"), data)}), values


@pytest.mark.parametrize("sharded", [False, True])
def test_to_zarr_encodes_in_batches_and_drops_empty_chunks(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch, sharded: bool
) -> None:
    import xarray as xr

    import xarray_gds
    from xarray_gds import writes

    calls: list[int] = []
    if device == "cuda":
        from xarray_gds.codecs import nvcomp

        module, name = nvcomp, "encode"
    else:
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
        module, name = writes, "encode_host"
    original = getattr(module, name)

    def counted(plan: Any, chunks: Any) -> Any:
        calls.append(int(chunks.shape[0]))
        return original(plan, chunks)

    monkeypatch.setattr(module, name, counted)
    ds, values = _dataset(device)
    out = tmp_path / "out.zarr"
    encoding = {"a": {"chunks": (8, 16), "compressors": zc.ZstdCodec()}}
    if sharded:
        encoding["a"]["shards"] = (16, 32)
    xarray_gds.to_zarr(ds, out, encoding=encoding, write_empty_chunks=False)
    # 12 chunks in the array (16 inner chunks in the shards' full extent), one of them
    # empty (5 of them, with the inner chunks of edge shards past the array): one batch
    assert calls == [11]
    assert (out / "a" / "c" / "1" / "1").exists() == sharded
    got = xr.open_dataset(out, engine="zarr")
    np.testing.assert_array_equal(got.a.values, values)
    # a partial region write merges with the stored chunks
    part = ds.isel(x=slice(4, 12), y=slice(10, 30)) * 2
    xarray_gds.to_zarr(part, out, region={"x": slice(4, 12), "y": slice(10, 30)})
    want = values.copy()
    want[4:12, 10:30] *= 2
    np.testing.assert_array_equal(xr.open_dataset(out, engine="zarr").a.values, want)


@pytest.mark.gpu
def test_device_values_of_codecs_without_gpu_encoder_warn(tmp_path: Path) -> None:
    pytest.importorskip("cupy")
    import xarray as xr

    import xarray_gds

    ds, values = _dataset("cuda")
    out = tmp_path / "blosc.zarr"
    codec = zc.BloscCodec(cname="blosclz")  # Blosc of lz4, lz4hc, zstd, zlib encodes there
    with pytest.warns(RuntimeWarning, match=r"'a' uses codecs .*blosc.* encoded there"):
        xarray_gds.to_zarr(ds, out, encoding={"a": {"compressors": codec}})
    np.testing.assert_array_equal(xr.open_dataset(out, engine="zarr").a.values, values)


@pytest.mark.gpu
def test_device_adler32_matches_zlib() -> None:
    cp = pytest.importorskip("cupy")
    from xarray_gds.codecs import nvcomp

    rng = np.random.default_rng(3)
    rows = rng.integers(0, 256, size=(5, (1 << 20) + 13), dtype=np.uint8)
    rows[2] = 255
    got = nvcomp.adler32(cp.asarray(rows))
    assert got.tolist() == [zlib.adler32(r.tobytes()) for r in rows]


def test_failed_batched_write_leaves_whole_chunks(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched write that fails half way (at a chunk's rename): every chunk is old or new."""
    import xarray as xr

    import xarray_gds

    if device == "cpu":
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    # batches of 3 chunks: the failure hits while the next batch is being encoded
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", str(3 * 5 * 8 * 16 * 4))
    ds, values = _dataset(device)
    out = tmp_path / "out.zarr"
    encoding = {"a": {"chunks": (8, 16), "compressors": zc.GzipCodec()}}
    xarray_gds.to_zarr(ds, out, encoding=encoding)
    real_replace = os.replace
    replaced: list[str] = []

    def flaky_replace(source: Any, target: Any) -> Any:
        # only this store's chunks: CuPy also renames files into its kernel cache
        if out in Path(target).parents and Path(target).name != "zarr.json":
            if len(replaced) == 4:
                raise OSError("disk full (injected)")
            replaced.append(str(target))
        return real_replace(source, target)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", flaky_replace)
        with pytest.raises(OSError, match="injected"):
            xarray_gds.to_zarr(ds + 1000.0, out, mode="r+", region="auto")
    got = xr.open_dataset(out, engine="zarr").a.values
    n_new = 0
    for x in range(0, 32, 8):
        for y in range(0, 48, 16):
            old = values[x : x + 8, y : y + 16]
            part = got[x : x + 8, y : y + 16]
            if np.array_equal(part, old, equal_nan=True):
                continue
            np.testing.assert_array_equal(part, old + 1000.0)  # never torn
            n_new += 1
    assert 4 <= n_new < 11
    assert not list(out.rglob("*.partial"))


@pytest.mark.parametrize("index_location", ["end", "start"])
@pytest.mark.parametrize("index_crc", [True, False])
@pytest.mark.parametrize("write_empty", [True, False])
def test_encoded_shards_decode_with_zarr(
    index_location: str, index_crc: bool, write_empty: bool, device: str
) -> None:
    """Shards made by encode_shards (inner chunks in one batch, index on the host) are
    what zarr-python reads as the same values; empty inner chunks are left out."""
    index_codecs: list[Any] = [zc.BytesCodec()] + ([zc.Crc32cCodec()] if index_crc else [])
    sharding = zc.ShardingCodec(
        chunk_shape=(4, 8),
        codecs=[zc.BytesCodec(), zc.ZstdCodec()],
        index_codecs=index_codecs,
        index_location=index_location,
    )
    arr = zarr.create_array(
        store=zarr.storage.MemoryStore(),
        shape=(16, 32),
        chunks=(8, 16),
        dtype="f4",
        fill_value=np.nan,
        serializer=sharding,
        compressors=None,
    )
    plan = enc.plan_encode(arr.metadata)
    assert isinstance(plan, enc.ShardEncode), plan
    assert plan.grid == (2, 2) and plan.inner.compressor is ZSTD
    values = np.cumsum(np.random.default_rng(2).normal(size=(16, 32)), axis=0).astype("f4")
    values[0:4, 0:8] = np.nan  # an empty inner chunk of shard (0, 0)
    values[8:16, 16:32] = np.nan  # shard (1, 1) holds only the fill value
    shards: Any = values.reshape(2, 8, 2, 16).transpose(0, 2, 1, 3).reshape(4, 8, 16)
    xp: Any = np
    if device == "cuda":
        import cupy as cp

        shards, xp = cp.asarray(shards), cp
    pieces = enc.encode_shards(plan, shards, write_empty, np.float32(np.nan), xp, _encoder(device))
    assert (pieces[3] is None) == (not write_empty)
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        key = arr.metadata.encode_chunk_key(divmod(i, 2))
        zarr.core.sync.sync(
            arr.store.set(key, zarr.core.buffer.cpu.Buffer.from_bytes(bytes(piece)))
        )
    np.testing.assert_array_equal(arr[...], values)
    if not write_empty:
        first = bytes(pieces[0])  # type: ignore[arg-type]
        index = np.frombuffer(
            first[-(64 + 4 * index_crc) :][:64] if index_location == "end" else first[:64],
            dtype="<u8",
        ).reshape(4, 2)
        assert (index[0] == 2**64 - 1).all()  # the empty inner chunk is not stored


@pytest.mark.parametrize(("fill", "value"), [(0.0, -0.0), (-0.0, 0.0), (0, -0.0)])
def test_signed_zeros_are_not_the_fill_value(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch, fill: float, value: float
) -> None:
    """As zarr-python: a chunk of -0.0 is stored when the fill value is 0.0 (and the
    reverse), so the sign survives the round trip."""
    import xarray as xr

    import xarray_gds

    if device == "cpu":
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    values = np.full((8, 6), value, dtype="f4")
    data: Any = values
    if device == "cuda":
        import cupy as cp

        data = cp.asarray(values)
    out = tmp_path / "zeros.zarr"
    encoding = {"a": {"chunks": (4, 3), "fill_value": fill, "compressors": zc.ZstdCodec()}}
    ds = xr.Dataset({"a": (("x", "y"), data)})
    xarray_gds.to_zarr(ds, out, encoding=encoding, write_empty_chunks=False)
    got = xr.open_dataset(out, engine="zarr", mask_and_scale=False).a.values
    assert np.signbit(got).all() == np.signbit(value)
    assert len(list((out / "a" / "c").rglob("*"))) >= 4
    assert enc.empty_rows(np.full((2, 3), fill, "f8"), np.float64(fill), np).all()

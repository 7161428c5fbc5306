"""The registry of compression formats (xarray_gds.codecs.formats): every format the
planner returns is the registry's object, and each format's codecs round-trip a chunk
through the host runtime as numcodecs decodes it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs as zc

from xarray_gds import route
from xarray_gds.codecs import Compressor, DecodeChain, ShardChain, host, plan_chain
from xarray_gds.codecs import encode as enc
from xarray_gds.codecs.formats import CRC32C, FORMATS, ZSTD, get

#: the formats the planner can return as a chain's compressor
COMPRESSORS = [f for f in FORMATS.values() if f is not CRC32C]

#: codecs of every kind the planner accepts: Zarr v2 compressors (numcodecs) ...
V2 = [
    numcodecs.Zstd(level=3),
    numcodecs.GZip(level=5),
    numcodecs.Zlib(level=1),
    numcodecs.LZ4(),
    *(numcodecs.Blosc(cname=c) for c in ("lz4", "lz4hc", "zstd", "zlib", "blosclz")),
]
#: ... and Zarr v3 bytes-to-bytes codecs
V3 = [
    zc.ZstdCodec(level=2),
    zc.GzipCodec(level=4),
    *(zc.BloscCodec(cname=c, typesize=4) for c in ("lz4", "zstd", "zlib", "blosclz")),
]


def _chain(codec: Any) -> DecodeChain:
    if isinstance(codec, numcodecs.abc.Codec):
        array = zarr.create_array(
            zarr.storage.MemoryStore(),
            shape=(64,),
            chunks=(64,),
            dtype="f4",
            zarr_format=2,
            compressors=codec,
        )
    else:
        array = zarr.create_array(
            zarr.storage.MemoryStore(),
            shape=(64,),
            chunks=(64,),
            dtype="f4",
            compressors=[codec, zc.Crc32cCodec()],
        )
    chain = plan_chain(array.metadata)
    assert isinstance(chain, DecodeChain), chain
    return chain


def test_registry_holds_every_format_the_planner_returns() -> None:
    """The planner returns registry objects only, and every compressor of the registry
    is returned for some codec; crc32c is claimed as the chain's checksum."""
    found = set()
    for codec in [*V2, *V3]:
        chain = _chain(codec)
        assert chain.compressor is not None
        fmt = chain.compressor.format
        assert FORMATS[fmt.name] is fmt
        found.add(fmt.name)
        assert chain.crc32c == (codec in V3)
    assert found == {f.name for f in COMPRESSORS}
    assert CRC32C.claims(zc.Crc32cCodec()) and not CRC32C.claims(zc.ZstdCodec())
    sharded = zarr.create_array(
        zarr.storage.MemoryStore(), shape=(64,), chunks=(16,), shards=(64,), dtype="f4"
    )
    plan = plan_chain(sharded.metadata)
    assert isinstance(plan, ShardChain) and plan.index_crc32c  # zarr's default index codecs


@pytest.mark.parametrize("fmt", COMPRESSORS, ids=lambda f: f.name)
def test_host_codec_round_trips_a_chunk(fmt: Any) -> None:
    """A chunk written by the format's numcodecs codec decodes through the host runtime
    to what numcodecs' own decode gives (and to the values written)."""
    values = np.round(np.sin(np.linspace(0, 40, 4096, dtype="f4")) * 20 + 280, 2)
    codec = fmt.numcodecs_codec()
    chunks = [np.frombuffer(codec.encode(values + i), dtype=np.uint8) for i in range(5)]
    compressor = fmt.from_numcodecs(codec)
    assert compressor is not None and compressor.format is fmt
    keys = [f"v/{i}" for i in range(len(chunks))]
    got = host.decompress(compressor, chunks, values.nbytes, keys)
    for i, chunk in enumerate(chunks):
        expected = np.frombuffer(numcodecs.get_codec(codec.get_config()).decode(chunk), "u1")
        np.testing.assert_array_equal(got[i], expected)
        np.testing.assert_array_equal(got[i].view("f4"), values + i)


@pytest.mark.parametrize("fmt", [f for f in COMPRESSORS if f.encodes], ids=lambda f: f.name)
def test_raw_streams_and_framing_round_trip(fmt: Any) -> None:
    """The raw stream the host writes (nvCOMP's view) decodes back, and framed as the
    batched encoder frames it, numcodecs reads it."""
    rows = np.random.default_rng(1).integers(0, 8, (3, 1024), dtype=np.uint8)
    for row in rows:
        raw = np.frombuffer(fmt.encode_raw(row), dtype=np.uint8)
        np.testing.assert_array_equal(np.frombuffer(fmt.decode_raw(raw, row.size), "u1"), row)
    chain = enc.EncodeChain((1024,), np.dtype("u1"), (0,), fmt, ("bytes", fmt.name))
    encoded = enc.encode_host(chain, rows)
    for i, row in enumerate(rows):
        decoded = fmt.numcodecs_codec().decode(encoded.chunk(i))
        np.testing.assert_array_equal(np.frombuffer(decoded, "u1"), row)


def test_crc32c_round_trips(tmp_path: Path) -> None:
    """A chunk zarr-python writes with its crc32c codec: the format's trailer is the
    one stored, and the host strips it back to the chunk's bytes."""
    values = np.arange(1000, dtype="<i4")
    array = zarr.create_array(
        tmp_path / "c.zarr",
        shape=values.shape,
        chunks=values.shape,
        dtype=values.dtype,
        compressors=[zarr.codecs.Crc32cCodec()],
    )
    array[:] = values
    data = values.view(np.uint8)
    stored = np.fromfile(tmp_path / "c.zarr" / "c" / "0", dtype=np.uint8)
    assert stored[-4:].tobytes() == CRC32C.trailer(data.tobytes())
    (body,) = host.strip_crc32c([stored], ["v/0"])
    np.testing.assert_array_equal(body, data)


def test_formats_are_singletons() -> None:
    """Formats unpickle to the registry's object; a name stands for its format."""
    for fmt in FORMATS.values():
        assert pickle.loads(pickle.dumps(fmt)) is fmt
        assert get(fmt.name) is fmt
    assert Compressor("zstd", numcodecs.Zstd()).format is ZSTD
    with pytest.raises(ValueError, match="unknown compression format 'snappy'"):
        get("snappy")


def test_route_defaults_are_the_formats_rates() -> None:
    rates = dict(route.Costs().rates)
    assert rates == {f.name: f.rates for f in FORMATS.values() if f.rates is not None}
    assert route.Costs().rate(ZSTD) == ZSTD.rates


def test_zstd_content_sizes_one_by_one_match_the_batch() -> None:
    """A few zstd headers are read one by one (a host read's single chunks), many as
    arrays: both give every header the same declared size, whatever its flags."""
    from xarray_gds.codecs.formats import base, zstd

    rng = np.random.default_rng(0)
    heads = rng.integers(0, 256, size=(4096, 18), dtype=np.uint8)  # every flag byte
    heads[:256, 4] = np.arange(256)  # each frame header descriptor at least once
    codec = numcodecs.Zstd()
    real = [codec.encode(np.zeros(n, np.uint8)) for n in (0, 1, 255, 256, 65791, 1 << 20)]
    heads[256 : 256 + len(real)] = base.heads(real)[0]  # zeros past a short frame's end
    batch = zstd.content_sizes(heads)  # more than _FEW: the array path
    assert len(heads) > zstd._FEW
    few = np.concatenate([zstd.content_sizes(heads[i : i + 1]) for i in range(len(heads))])
    np.testing.assert_array_equal(few, batch)
    assert list(batch[256 : 256 + len(real)]) == [0, 1, 255, 256, 65791, 1 << 20]

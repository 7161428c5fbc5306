"""Where device values encode (xarray_gds.route.choose_encode): nvCOMP for batches of
many chunks, the host threads (the batch copied to the host once) for the few chunks of
a small write, and what each route writes."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
import zarr.codecs as zc

from xarray_gds import route, writes
from xarray_gds.codecs import formats, nvcomp
from xarray_gds.codecs.encode import EncodeChain, encode_host, encode_host_threads, plan_encode
from xarray_gds.testing import device_standins

ZSTD = formats.get("zstd")
#: made-up rates that put the crossing at a known batch size: a chunk of 1 MB takes
#: 10 ms alone on the GPU (plus 1 ms a call, 1 ms a batch of 100), 4 ms on a host thread
RATES = {"encode_gpu_chunk": 1e8, "encode_gpu_batch": 1e11, "encode_host_thread": 2.5e8}
CONSTANTS = {
    "gpu_call": 1e-3,
    "host_call": 0.0,
    "d2h": 1e12,
    "threads": 4,
    "rates": {"zstd": RATES},
}


@pytest.fixture
def constants() -> Any:
    with zarr.config.set({"xarray_gds.route_constants": json.dumps(CONSTANTS)}):
        yield route.costs()


def test_the_encode_estimates_follow_the_model(constants: route.Costs) -> None:
    gpu, host = route.estimate_encode(ZSTD, 6, 10**6, constants)
    assert gpu == pytest.approx(1e-3 + 10**6 / 1e8 + 6 * 10**6 / 1e11)
    assert host == pytest.approx(6 * 10**6 / 1e12 + 2 * 10**6 / 2.5e8)  # 2 rounds of 4
    assert route.estimate_encode(ZSTD, 0, 10**6, constants) == (0.0, math.inf)


def test_few_chunks_encode_on_the_host_many_on_the_gpu(constants: route.Costs) -> None:
    # host: ceil(n / 4) rounds of 4 ms; GPU: about 11 ms for any small batch
    assert [route.choose_encode(ZSTD, n, 10**6) for n in (1, 4, 8, 9, 12, 13, 400)] == [
        "host",
        "host",
        "host",
        "gpu",
        "gpu",
        "gpu",
        "gpu",
    ]


def test_without_encode_rates_or_compression_device_values_encode_on_the_gpu(
    constants: route.Costs,
) -> None:
    assert route.choose_encode(None, 1, 10**6) == "gpu"
    lz4 = formats.get("lz4")
    assert route.estimate_encode(lz4, 1, 10**6, route.Costs(rates=()))[1] == math.inf
    with zarr.config.set({"xarray_gds.route_constants": json.dumps({"rates": {}})}):
        assert route.choose_encode(formats.get("zlib"), 1, 10**6) == "gpu"


@pytest.mark.parametrize("forced", ["gpu", "host"])
def test_a_forced_route_holds_for_encodes(constants: route.Costs, forced: str) -> None:
    with zarr.config.set({"xarray_gds.route": forced}):
        assert route.choose_encode(ZSTD, 1, 10**6) == forced
        assert route.choose_encode(ZSTD, 10**4, 10**6) == forced


def test_a_bad_route_names_the_setting() -> None:
    with zarr.config.set({"xarray_gds.route": "cpu"}), pytest.raises(ValueError, match="route"):
        route.choose_encode(ZSTD, 1, 10**6)


def test_encode_rates_and_the_copy_rate_are_settings() -> None:
    given = {"d2h": 3e9, "rates": {"zstd": {"encode_host_thread": 1e8}}}
    with zarr.config.set({"xarray_gds.route_constants": json.dumps(given)}):
        c = route.costs()
    assert c.d2h == 3e9
    assert c.rate(ZSTD).encode_host_thread == 1e8  # type: ignore[union-attr]
    with (
        zarr.config.set({"xarray_gds.route_constants": json.dumps({"d2x": 1})}),
        pytest.raises(ValueError, match=r"d2x.*known: .*d2h"),
    ):
        route.costs()


def _plan(compressor: Any, zarr_format: int, shape: tuple[int, ...] = (8, 16)) -> EncodeChain:
    meta = zarr.create_array(
        store={},
        shape=(6 * shape[0], shape[1]),
        chunks=shape,
        dtype="f4",
        compressors=[compressor],
        zarr_format=zarr_format,
    ).metadata
    plan = plan_encode(meta, "gpu")
    assert isinstance(plan, EncodeChain)
    return plan


def _values(n: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(7)
    return np.round(280 + rng.standard_normal((n, *shape)), 2).astype("f4")


@pytest.mark.parametrize(
    ("compressor", "zarr_format"),
    [(zc.ZstdCodec(), 3), (numcodecs.Blosc(cname="lz4"), 2), (numcodecs.LZ4(), 2)],
    ids=["zstd", "blosc", "lz4"],
)
def test_host_threads_encode_what_zarr_decodes(compressor: Any, zarr_format: int) -> None:
    plan = _plan(compressor, zarr_format)
    chunks = _values(5, (8, 16))
    encoded = encode_host_threads(plan, chunks)
    for i in range(5):
        assert bytes(encoded.chunk(i)) == bytes(encode_host(plan, chunks[i : i + 1]).chunk(0))
    store = zarr.storage.MemoryStore()
    arr = zarr.create_array(
        store=store,
        shape=(40, 16),
        chunks=(8, 16),
        dtype="f4",
        compressors=[compressor],
        zarr_format=zarr_format,
    )
    sep = "/" if zarr_format == 3 else "."
    prefix = "c/" if zarr_format == 3 else ""
    for i in range(5):
        key = f"{prefix}{i}{sep}0"
        buf = zarr.core.buffer.cpu.Buffer.from_bytes(bytes(encoded.chunk(i)))
        zarr.core.sync.sync(store.set(key, buf))
    np.testing.assert_array_equal(arr[:], chunks.reshape(40, 16))


def _entries(n: int, shape: tuple[int, ...]) -> list[Any]:
    """zarr's batch entries of a write that fills ``n`` whole chunks of ``shape``."""
    spec = SimpleNamespace(config=SimpleNamespace(write_empty_chunks=True))
    whole = tuple(slice(0, s) for s in shape)
    return [
        (
            SimpleNamespace(path=f"a/c/{j}/0"),
            spec,
            whole,
            (slice(j * shape[0], (j + 1) * shape[0]), slice(None)),
            True,
        )
        for j in range(n)
    ]


#: the rates above for chunks of 512 bytes (8 x 16 float32): the crossing at 8 chunks
SMALL = {
    **CONSTANTS,
    "gpu_call": 0.0,
    "rates": {
        "zstd": {
            "encode_gpu_chunk": 512 / 10e-3,
            "encode_gpu_batch": 1e11,
            "encode_host_thread": 512 / 4e-3,
        }
    },
}


@pytest.mark.parametrize(("n", "where"), [(3, "host"), (8, "host"), (9, "gpu"), (12, "gpu")])
def test_device_writes_take_the_chosen_route(
    monkeypatch: pytest.MonkeyPatch, n: int, where: str
) -> None:
    """Device values of a small write are copied to the host and encoded there; a large
    batch goes to nvCOMP. Either way each chunk's stored bytes decode to its values."""
    plan = _plan(zc.ZstdCodec(), 3)
    values = _values(n, (8, 16)).reshape(n * 8, 16)
    calls: list[int] = []

    def on_gpu(chain: Any, chunks: Any) -> Any:  # nvCOMP's stand-in: the host encoder
        assert type(chunks) is not np.ndarray  # still the device's array
        calls.append(len(chunks))
        return encode_host(chain, np.asarray(chunks))

    def on_host(chain: Any, chunks: Any) -> Any:  # copied to the host first
        assert type(chunks) is np.ndarray
        calls.append(-len(chunks))
        return encode_host_threads(chain, chunks)

    monkeypatch.setattr(nvcomp, "encode", on_gpu)
    monkeypatch.setattr(writes, "encode_host_threads", on_host)
    constants = zarr.config.set({"xarray_gds.route_constants": json.dumps(SMALL)})
    with constants, device_standins(monkeypatch):
        from xarray_gds import device as _device

        stage = _device.cupy().empty((n, *plan.chunk_shape), dtype=plan.dtype)
        pieces = writes._encode_part(plan, _entries(n, (8, 16)), stage, values, (), True)
    assert calls == ([n] if where == "gpu" else [-n])
    codec = numcodecs.Zstd()
    for j, piece in enumerate(pieces):
        got = np.frombuffer(codec.decode(bytes(piece)), "f4").reshape(8, 16)
        np.testing.assert_array_equal(got, values[j * 8 : (j + 1) * 8])


@pytest.mark.parametrize(("n", "where"), [(3, "host"), (12, "GPU (nvCOMP)")])
def test_a_failed_encode_names_the_route_it_took(
    monkeypatch: pytest.MonkeyPatch, n: int, where: str
) -> None:
    """The error of a failed encode of device values says where the chunks were
    encoded: the host threads for a small write, nVCOMP for a large one."""
    plan = _plan(zc.ZstdCodec(), 3)
    values = _values(n, (8, 16)).reshape(n * 8, 16)

    def fails(chain: Any, chunks: Any) -> Any:
        raise ValueError("boom")

    monkeypatch.setattr(nvcomp, "encode", fails)
    monkeypatch.setattr(writes, "encode_host_threads", fails)
    constants = zarr.config.set({"xarray_gds.route_constants": json.dumps(SMALL)})
    with constants, device_standins(monkeypatch):
        from xarray_gds import device as _device

        stage = _device.cupy().empty((n, *plan.chunk_shape), dtype=plan.dtype)
        with pytest.raises(RuntimeError, match=rf"chunks \(a/c/0/0 .. a/c/{n - 1}/0\)") as err:
            writes._encode_part(plan, _entries(n, (8, 16)), stage, values, (), True)
    assert f"on the {where} failed: boom" in str(err.value)

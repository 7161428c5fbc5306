"""A batch sent to the GPU shared with the host pool (xarray_gds.route.split, plan;
xarray_gds.decode.decode_split): the decision, exhaustively over batch shapes and
constants, on the CPU; the decode's placement with a fake CuPy and a stand-in for
nvCOMP; and on the GPU, reads with the split forced on against engine="zarr"."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from tests.conftest import open_both, to_numpy
from tests.test_host_logic import _all_chunks, _fake_cupy, _Staging
from xarray_gds import batch, config, decode, route
from xarray_gds import device as _device
from xarray_gds.codecs import DecodeChain, nvcomp
from xarray_gds.codecs.formats import ZLIB, get
from xarray_gds.errors import ChunkDecodeError

FORMATS = ("zstd", "lz4", "zlib", "gzip", "blosc")
SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
COUNTS = (*range(1, 70), 96, 128, 256, 512, 1024, 4096)


def _costs(threads: int, h2d: float = 6e9, **rates: float) -> route.Costs:
    base = route.Costs(threads=threads, h2d=h2d)
    if not rates:
        return base
    return replace(base, rates=tuple((n, replace(r, **rates)) for n, r in base.rates))


def _alone(fmt: str, n: int, nbytes: int, c: route.Costs) -> tuple[float, float]:
    """(gpu, host) seconds of the whole batch on each route, as choose() sees them."""
    with zarr.config.set({"xarray_gds.route_constants": json.loads(c.to_json())}):
        return route.estimate(get(fmt), n, nbytes)


def _best_share(fmt: str, n: int, nbytes: int, c: route.Costs) -> tuple[float, int]:
    """Brute force: the least ``max(host(k), gpu(n - k))`` over 1 <= k < n, and the
    smallest k that gives it."""
    rate = c.rate(get(fmt))
    assert rate is not None
    best = (np.inf, -1)
    for k in range(1, n):
        host = route._times(c, rate, k, nbytes, c.threads)[1]
        gpu = route._times(c, rate, n - k, nbytes, c.threads)[0]
        best = min(best, (max(host, gpu), k))
    return best


@pytest.mark.parametrize("threads", [1, 2, 16, 32])
@pytest.mark.parametrize("h2d", [6e9, 25e9])
def test_split_invariants_over_every_shape(threads: int, h2d: float) -> None:
    """Every format, chunk size and chunk count: the shares add up, never more host
    threads than the pool has, the host route exactly where it alone beats the GPU
    alone (choose()'s rule), and a split only where it saves split_gain of the GPU's
    time alone."""
    c = _costs(threads, h2d)
    rules = {}
    with zarr.config.set({"xarray_gds.route_constants": json.loads(c.to_json())}):
        for fmt, nbytes, n in itertools.product(FORMATS, SIZES, COUNTS):
            rules[fmt, nbytes, n] = route.choose(get(fmt), n, nbytes)
    for fmt, nbytes, n in itertools.product(FORMATS, SIZES, COUNTS):
        s = route.split(get(fmt), n, nbytes, c)
        assert s.host + s.gpu == n and 0 <= s.host <= n
        assert s.threads == min(s.host, threads) <= threads
        assert (s.host == n) == (rules[fmt, nbytes, n] == "host"), (fmt, nbytes, n)
        assert (s.host_s == 0.0) == (s.host == 0) and (s.gpu_s == 0.0) == (s.gpu == 0)
        if 0 < s.host < n:
            gpu_alone = route.split(get(fmt), n, nbytes, replace(c, split_gain=1.0))
            assert gpu_alone.host == 0
            assert s.seconds <= (1 - c.split_gain) * gpu_alone.seconds


def test_split_is_the_best_balance() -> None:
    """Where the batch is split, no other share of 1..n-1 chunks is predicted faster,
    and none smaller as fast (brute force); where it is not, no share saves
    split_gain of the GPU's time."""
    for threads, h2d in [(16, 6e9), (32, 25e9), (2, 6e9)]:
        c = _costs(threads, h2d)
        for fmt, nbytes, n in itertools.product(FORMATS, (256 << 10, 4 << 20), range(2, 40)):
            s = route.split(get(fmt), n, nbytes, c)
            forced = route.split(get(fmt), n, nbytes, c, force=True)
            best, k = _best_share(fmt, n, nbytes, c)
            assert (forced.host, forced.seconds) == (k, pytest.approx(best, rel=1e-12))
            gpu_alone = _alone(fmt, n, nbytes, c)[0]
            if 0 < s.host < n:
                assert s == forced
            elif s.host == 0:
                assert best > (1 - c.split_gain) * gpu_alone


def test_split_exact() -> None:
    """Constants that make every term exact: a GPU call 4.25 s plus 0.5 s a chunk, the
    host 0.5 s plus 4 s a round of 4 chunks (and a copy of 2**-20 s). Of 20 chunks,
    the host takes 8 (two rounds: 8.5 s) while the GPU decodes 12 (10.25 s), against
    14.25 s for the GPU alone and 20.5 s for the host alone."""
    rates = route.Rates(gpu_chunk=2.0**18, gpu_batch=2.0**21, host_thread=2.0**18)
    c = route.Costs(
        gpu_call=0.25,
        host_call=0.5,
        host_chunk=0.0,
        h2d=2.0**40,
        threads=4,
        rates=(("zstd", rates),),
    )
    s = route.split(get("zstd"), 20, 1 << 20, c)
    assert s == route.Split(host=8, gpu=12, threads=4, host_s=8.5 + 2.0**-20, gpu_s=10.25)
    assert s.seconds == 10.25
    # a gain of 28% is taken with split_gain up to that, not above
    assert route.split(get("zstd"), 20, 1 << 20, replace(c, split_gain=0.28)).host == 8
    assert route.split(get("zstd"), 20, 1 << 20, replace(c, split_gain=0.29)).host == 0
    # 12 chunks: the host takes 4 (4.5 s), the GPU 8 (8.25 s, against 10.25 s alone)
    s = route.split(get("zstd"), 12, 1 << 20, c)
    assert (s.host, s.seconds) == (4, 8.25)
    # one chunk cannot be split, even forced: the faster route takes it (the host's
    # 4.5 s against the GPU's 4.75 s)
    assert route.split(get("zstd"), 1, 1 << 20, c, force=True).host == 1
    assert route.split(get("zstd"), 1, 1 << 20, c).host == 1
    # forced, a split whatever the gain; the host route's batch of 2 too
    assert route.split(get("zstd"), 20, 1 << 20, replace(c, split_gain=0.9), force=True).host == 8
    assert route.split(get("zstd"), 2, 1 << 20, c).host == 2
    assert route.split(get("zstd"), 2, 1 << 20, c, force=True).host == 1


def test_many_small_chunks_are_never_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of many chunks under 256 KiB are never split (the GPU alone, or the
    host route where choose() takes it); zstd's never leave the GPU, nor would any
    format's split pay by the model but LZ4's, whose rates are measured at 4 MiB."""
    for threads, h2d, fmt, nbytes, n in itertools.product(
        (16, 32, 64), (6e9, 25e9), FORMATS, (4 << 10, 64 << 10), (256, 1024, 4096, 16384)
    ):
        c = _costs(threads, h2d)
        s = route.split(get(fmt), n, nbytes, c)
        assert s.host in (0, n), (fmt, n)
        if fmt == "zstd":
            assert s.host == 0
    assert route.SPLIT_MIN_BYTES == 256 << 10
    # without the size rule, the host's Python work per chunk (host_chunk, which the
    # GIL runs one at a time) still keeps them whole, LZ4's aside
    monkeypatch.setattr(route, "SPLIT_MIN_BYTES", 0)
    for threads, h2d, fmt, nbytes, n in itertools.product(
        (16, 32, 64), (6e9, 25e9), FORMATS, (4 << 10, 64 << 10), (256, 1024, 4096, 16384)
    ):
        s = route.split(get(fmt), n, nbytes, _costs(threads, h2d))
        assert s.host in (0, n) or fmt == "lz4", (fmt, n)


def test_without_a_gpu_or_rates() -> None:
    c = _costs(8)
    for fmt, n in itertools.product(FORMATS, (1, 5, 100, 5000)):
        s = route.split(get(fmt), n, 4 << 20, c, gpu=False)
        assert (s.host, s.gpu, s.threads) == (n, 0, min(n, 8))
    # uncompressed chunks and formats without rates: the GPU, or the host without one
    assert route.split(None, 7, 1 << 20, c) == route.Split(0, 7, 0, 0.0, 0.0)
    assert route.split(get("crc32c"), 7, 1 << 20, c, gpu=False).host == 7
    assert route.split(get("zstd"), 0, 1 << 20, c).host == 0
    with pytest.raises(ValueError, match=r"costs\.threads"):
        route.split(get("zstd"), 4, 1 << 20, route.Costs())


@pytest.mark.parametrize("fmt", FORMATS)
def test_share_grows_with_the_host_and_shrinks_with_the_gpu(fmt: str) -> None:
    """Monotonic: a faster host thread never takes chunks from the host, a faster GPU
    (per chunk or per batch) never gives it more."""
    base = dict(route.Costs().rates)[fmt]
    factors = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
    for threads, nbytes, n in itertools.product((4, 16), (256 << 10, 4 << 20), (2, 8, 33, 200)):
        by_host = [
            route.split(get(fmt), n, nbytes, _costs(threads, host_thread=base.host_thread * f)).host
            for f in factors
        ]
        assert by_host == sorted(by_host), (threads, nbytes, n, by_host)
        for field in ("gpu_chunk", "gpu_batch"):
            by_gpu = [
                route.split(
                    get(fmt), n, nbytes, _costs(threads, **{field: getattr(base, field) * f})
                ).host
                for f in factors
            ]
            assert by_gpu == sorted(by_gpu, reverse=True), (field, threads, nbytes, n, by_gpu)


def test_host_fast_rate_only_where_its_decoder_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from xarray_gds.codecs.formats.deflate import libdeflate

    pytest.importorskip("deflate", reason="libdeflate (the fast-host extra) is not installed")
    assert route.Costs().rate(get("zlib")).host_fast is not None  # type: ignore[union-attr]
    libdeflate.cache_clear()
    try:
        assert route.costs().rate(get("zlib")).host_fast is not None  # type: ignore[union-attr]
        monkeypatch.setitem(__import__("sys").modules, "deflate", None)
        libdeflate.cache_clear()
        assert route.costs().rate(get("zlib")).host_fast is None  # type: ignore[union-attr]
        assert route.costs().rate(get("gzip")).host_fast is None  # type: ignore[union-attr]
    finally:
        monkeypatch.undo()
        libdeflate.cache_clear()
    # a measured host_thread (calibrate's, without libdeflate) replaces the default fast
    # rate, unless host_fast is given too
    with zarr.config.set({"xarray_gds.route_constants": {"rates": {"zlib": {"host_thread": 1e8}}}}):
        assert route.costs().rate(get("zlib")) == replace(
            ZLIB.rates, host_thread=1e8, host_fast=None
        )  # type: ignore[type-var]
    both = {"rates": {"zlib": {"host_thread": 1e8, "host_fast": 3e8}}}
    with zarr.config.set({"xarray_gds.route_constants": both}):
        assert route.costs().rate(get("zlib")).host_fast == 3e8  # type: ignore[union-attr]
    # the host estimate takes host_fast where given
    c = {"threads": 1, "host_call": 0.0, "host_chunk": 0.0, "h2d": 1e30}
    slow = {"rates": {"zlib": {"host_thread": 1e6, "host_fast": 4e6}}}
    with zarr.config.set({"xarray_gds.route_constants": {**c, **slow}}):
        assert route.estimate(get("zlib"), 1, 1 << 20)[1] == pytest.approx((1 << 20) / 4e6)


def test_plan_follows_the_settings() -> None:
    """``plan`` is ``split`` with the settings: off, route gpu (unless on), route host,
    on (at least one chunk each side)."""
    few = (get("zstd"), 2, 4 << 20)  # the host route's by the model
    many = (get("zstd"), 4096, 4 << 20)
    assert route.plan(*few).host == 0  # off by default, until measured on a GPU
    with zarr.config.set({"xarray_gds.split": "auto"}):
        assert route.plan(*few).host == 2
    with zarr.config.set({"xarray_gds.split": "on"}):
        assert route.plan(*few).host == 1 and route.choose(*few) == "gpu"
        assert route.plan(get("zstd"), 1, 4 << 20).host in (0, 1)
        assert 1 <= route.plan(*many).host < 4096
        with zarr.config.set({"xarray_gds.route": "gpu"}):
            assert route.plan(*few).host == 1  # on wins over a forced GPU route
    with zarr.config.set({"xarray_gds.split": "off"}):
        assert route.plan(*many).host == 0 and route.plan(*few).host == 0
    with zarr.config.set({"xarray_gds.route": "gpu"}):
        assert route.plan(*few).host == 0
    with zarr.config.set({"xarray_gds.route": "host"}):
        assert route.plan(*many).host == 4096
    assert route.plan(None, 5, 4 << 20).host == 0
    with (
        zarr.config.set({"xarray_gds.split": "always"}),
        pytest.raises(ValueError, match=r"'xarray_gds.split'.*'auto', 'off', 'on'"),
    ):
        config.validate()


# -- the split decode, with a fake CuPy and nvCOMP's stand-in ------------------------


def _device_batch(fetched: list[Any]) -> Any:
    return batch.pack([None if f is None else np.asarray(f) for f in fetched])


@pytest.mark.parametrize(
    ("zarr_format", "codec"), [(3, "zstd"), (2, "shuffle-zstd"), (3, "big-endian")]
)
@pytest.mark.parametrize("host", [1, 2, 3, 100])
def test_decode_split_places_rows_as_decode_fetched(
    monkeypatch: pytest.MonkeyPatch,
    store_factory: Callable,
    zarr_format: int,
    codec: str,
    host: int,
) -> None:
    """The last ``host`` present chunks decode on the host pool, the others in one
    "nvCOMP" call (a stand-in that decodes on the host what it is given): the result
    is decode_fetched's, missing chunks left out as there."""
    chain, keys, fetched = _all_chunks(store_factory(zarr_format, codec))
    assert isinstance(chain, DecodeChain)
    want_present, want = decode.decode_fetched(chain, fetched, keys, False)
    fake = _fake_cupy()
    fake.asnumpy = np.asarray
    monkeypatch.setattr(_device, "cupy", lambda: fake)
    monkeypatch.setattr(decode, "_streams", threading.local())
    device = _device_batch(fetched)
    asked: list[list[int]] = []

    def stand_in(chain: Any, b: Any, idx: list[int], names: Any) -> np.ndarray:
        asked.append(list(idx))
        stored = [b.arena[o : o + s] for o, s in zip(b.offsets[idx], b.sizes[idx], strict=True)]
        return decode.decode_host(chain, stored, names)

    monkeypatch.setattr(nvcomp, "decode", stand_in)
    staging = _Staging()
    present, got = decode.decode_split(chain, device, keys, staging, host, 2)
    assert present == want_present
    share = min(host, len(present))
    assert asked == ([present[: len(present) - share]] if share < len(present) else [])
    assert staging.leased == [share * chain.nbytes]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), want)


def test_decode_split_names_the_failing_chunk(
    monkeypatch: pytest.MonkeyPatch, store_factory: Callable
) -> None:
    """A damaged chunk of the host's share raises naming its key, after the nvCOMP
    share is done and every host chunk finished."""
    chain, keys, fetched = _all_chunks(store_factory(3, "zstd"))
    present = [i for i, f in enumerate(fetched) if f is not None]
    broken = list(fetched)
    last = present[-1]
    broken[last] = np.frombuffer(b"\x28\xb5\x2f\xfd" + bytes(40), np.uint8)
    fake = _fake_cupy()
    fake.asnumpy = np.asarray
    monkeypatch.setattr(_device, "cupy", lambda: fake)
    monkeypatch.setattr(decode, "_streams", threading.local())
    monkeypatch.setattr(
        nvcomp,
        "decode",
        lambda chain, b, idx, names: np.zeros((len(idx), chain.nbytes), np.uint8),
    )
    with pytest.raises(ChunkDecodeError) as caught:
        decode.decode_split(chain, _device_batch(broken), keys, _Staging(), 2, 2)
    assert caught.value.key == keys[last]


def test_start_uses_at_most_the_workers_asked() -> None:
    """batch.start: every item once, on at most ``workers`` threads, errors raised by
    wait()."""
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        with lock:
            seen.append((i, threading.current_thread().name))

    batch.start(one, 50, 1)()
    assert sorted(i for i, _ in seen) == list(range(50))
    assert len({name for _, name in seen}) == 1
    batch.start(one, 0, 4)()  # nothing to do

    def fail(i: int) -> None:
        if i == 3:
            raise RuntimeError("item 3")

    with pytest.raises(RuntimeError, match="item 3"):
        batch.start(fail, 8, 2)()


# -- on the GPU: reads with the split forced on ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("fmt", "codec"), [(3, "zstd"), (3, "gzip"), (3, "blosc"), (2, "shuffle-zstd"), (2, "zlib")]
)
def test_split_reads_equal_engine_zarr(store_factory: Callable, fmt: int, codec: str) -> None:
    """Every device batch of two chunks or more shared between nvCOMP and the host pool
    (``xarray_gds.split`` on): values identical to engine="zarr", on the device."""
    import cupy as cp

    path = store_factory(fmt, codec)
    with zarr.config.set({"xarray_gds.split": "on", "xarray_gds.route": "auto"}):
        gds, ref = open_both(path, "cuda")
        for name in ("t2m", "u10"):
            got = gds[name].load()
            assert isinstance(got.data, cp.ndarray)
            xr.testing.assert_identical(got.as_numpy(), ref[name].load())
        xr.testing.assert_identical(to_numpy(gds), ref.load())


@pytest.mark.gpu
def test_split_decode_on_the_device_equals_nvcomp(store_factory: Callable) -> None:
    """decode_split with the real CuPy and nvCOMP, for every host share: the same rows
    as nvCOMP alone (decode_fetched on the device)."""
    import cupy as cp

    from xarray_gds.batch import PinnedStaging

    chain, keys, fetched = _all_chunks(store_factory(3, "zstd"))
    device = batch.pack([None if f is None else cp.asarray(f) for f in fetched])
    want_present, want = decode.decode_fetched(chain, device, keys, True)
    staging = PinnedStaging()
    for host in range(0, len(want_present) + 1):
        present, got = decode.decode_split(chain, device, keys, staging, host, 4)
        assert present == want_present
        assert isinstance(got, cp.ndarray)
        cp.testing.assert_array_equal(got, want)


@pytest.mark.gpu
def test_split_reads_of_large_chunks(tmp_path: Path) -> None:
    """Few large zstd and zlib chunks (1 MiB), split on: identical to engine="zarr"."""
    import numcodecs

    rng = np.random.default_rng(5)
    values = np.round(rng.standard_normal((6, 256, 1024), dtype="f4"), 2)
    ds = xr.Dataset({"a": (("t", "y", "x"), values), "b": (("t", "y", "x"), values * 2)})
    for name, enc in {
        "zstd": {"compressors": [zarr.codecs.ZstdCodec(level=1)]},
        "zlib": {"compressors": [numcodecs.Zlib(level=1)]},
    }.items():
        path = tmp_path / f"{name}.zarr"
        encoding = {v: {**enc, "chunks": (1, 256, 1024)} for v in ("a", "b")}
        ds.to_zarr(path, encoding=encoding, zarr_format=3 if name == "zstd" else 2)
        with zarr.config.set({"xarray_gds.split": "on", "xarray_gds.route": "auto"}):
            got = xr.open_dataset(path, engine="gds-zarr", device="cuda").load()
        ref = xr.open_dataset(path, engine="zarr").load()
        xr.testing.assert_identical(got.as_numpy(), ref)


# -- the model next to measurements (xarray-gds calibrate --compare) -------------------


def test_compare_predictions_and_table() -> None:
    """What ``calibrate --compare`` prints for the model: its seconds for each route and
    its choice, from the constants given (here exact ones), in milliseconds."""
    from xarray_gds.tools.calibrate import Compared, predict, table

    rates = route.Rates(gpu_chunk=2.0**18, gpu_batch=2.0**21, host_thread=2.0**18)
    c = route.Costs(
        gpu_call=0.25, host_call=0.5, host_chunk=0.0, h2d=2.0**40, threads=4,
        rates=(("zstd", rates),),
    )  # fmt: skip
    row = predict("zstd", 20, 1 << 20, c)
    assert row == Compared("zstd", 20, 1 << 20, "split 8", 8, 14.25, 20.5 + 2.0**-20, 10.25)
    one = predict("zstd", 1, 1 << 20, c)
    assert (one.choice, one.split_k) == ("host", 0) and one.split != one.split
    measured = replace(row, gpu_measured=0.0123, host_measured=0.5, split_measured=0.01)
    lines = table([measured, one]).splitlines()
    assert lines[0].startswith("| format | chunks | MiB each | model's choice | GPU model")
    assert lines[2] == (
        "| zstd | 20 | 1 | split 8 | 14250.0 | 12.3 | 20500.0 | 500.0 | 8 | 10250.0 | 10.0 |"
    )
    assert lines[3] == "| zstd | 1 | 1 | host | 4750.0 | - | 4500.0 | - | - | - | - |"


def test_calibrate_compare_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from xarray_gds.tools.cli import main

    if _device.cuda_status()[0]:
        pytest.skip("this machine has a GPU")  # the GPU test below runs instead
    assert main(["calibrate", "--compare"]) == 1
    assert "calibrate: needs a GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_compare_measures_every_route() -> None:
    """On the GPU: the measured seconds of nvCOMP, the host route and the split of small
    batches are there, positive, next to the model's."""
    from xarray_gds.tools.calibrate import compare, table

    rows = compare(formats=("zstd", "zlib"), counts=(1, 3), chunk_nbytes=256 << 10, repeat=1)
    assert [(r.format, r.chunks) for r in rows] == [
        ("zstd", 1), ("zstd", 3), ("zlib", 1), ("zlib", 3),
    ]  # fmt: skip
    for r in rows:
        assert r.gpu_measured > 0 and r.host_measured > 0 and r.gpu > 0 and r.host > 0
        assert (r.split_k > 0) == (r.chunks > 1)
        assert (r.split_measured > 0) if r.split_k else (r.split_measured != r.split_measured)
    assert len(table(rows).splitlines()) == 2 + len(rows)

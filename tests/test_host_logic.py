"""Logic of the GPU paths that needs no GPU, tested on the host with fakes: the decode
route's cost model and its choice for a group of requests, how the dask pass cuts
blocks into groups and when it warns, the staged decode of the device route (a fake
CuPy over numpy), kvikio remote reads that come back short (a fake kvikio), and
references whose targets are read over HTTP."""

from __future__ import annotations

import contextlib
import http.server
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from xarray_gds import coalesce, decode, fuse, route, stores
from xarray_gds import device as _device
from xarray_gds.codecs import DecodeChain, plan_chain
from xarray_gds.codecs.formats import get
from xarray_gds.request import ReadRequest
from xarray_gds.stores import refs, remote_device
from xarray_gds.stores.local import GdsStore

# -- the decode route -------------------------------------------------------------------

#: constants whose every term of the host estimate is a power of two (exact in floats):
#: one round of chunks takes 1 s, the copy of a chunk to the device 2**-20 s
EXACT = {
    "gpu_call": 0.25,
    "host_call": 0.5,
    "h2d": float(2**40),
    "threads": 4,
    "rates": {"zstd": {"gpu_chunk": 2.0**20, "gpu_batch": 2.0**22, "host_thread": 2.0**20}},
}


@pytest.mark.parametrize(
    ("n_chunks", "rounds"),
    [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)],
)
def test_route_host_estimate_exact(n_chunks: int, rounds: int) -> None:
    """The host decodes ``threads`` chunks at a time: ``ceil(n / threads)`` rounds (5
    chunks on 4 threads take two), then the last chunk's copy to the device."""
    with zarr.config.set({"xarray_gds.route_constants": EXACT}):
        gpu, host = route.estimate(get("zstd"), n_chunks, 1 << 20)
    assert gpu == 0.25 + 1.0 + n_chunks / 4
    assert host == 0.5 + rounds * 1.0 + 2.0**-20


def _chain(compressor: str | None, chunk: int = 1 << 20) -> DecodeChain:
    """The decode chain of a v3 array of float32 chunks of ``chunk`` bytes."""
    codecs: list[Any] = [zarr.codecs.BytesCodec()]
    if compressor == "zstd":
        codecs.append(zarr.codecs.ZstdCodec())
    elif compressor == "gzip":
        codecs.append(zarr.codecs.GzipCodec())
    array = zarr.create_array(
        zarr.storage.MemoryStore(), shape=(chunk // 4,), chunks=(chunk // 4,), dtype="f4"
    )
    meta = array.metadata
    chain = plan_chain(type(meta).from_dict({**meta.to_dict(), "codecs": codecs}))
    assert isinstance(chain, DecodeChain)
    return chain


def _requests(*members: tuple[DecodeChain, int]) -> list[Any]:
    return [
        coalesce._Asked(
            ReadRequest(None, chain, [f"k{i}/{j}" for j in range(n)], True),
            stores.LocalSource(None),
            [],
            0,
        )
        for i, (chain, n) in enumerate(members)
    ]


#: a GPU call costs 2.25 s and 1/64 s a chunk, the host 0.5 s and 1 s a round of 4
#: chunks: up to 4 chunks decode faster on the host, from 5 on on the GPU
ROUTE = {
    **EXACT,
    "rates": {
        name: {"gpu_chunk": 2.0**19, "gpu_batch": 2.0**26, "host_thread": 2.0**20}
        for name in ("zstd", "gzip")
    },
}


def test_host_route_sums_chunks_per_chain() -> None:
    """A group of device requests decodes on the host when every decode chain of the
    group is faster there for the chunks of all its requests together."""
    zstd, gzip, other_zstd = _chain("zstd"), _chain("gzip"), _chain("zstd")
    assert other_zstd == zstd  # chains of different arrays compare equal
    with zarr.config.set({"xarray_gds.route_constants": ROUTE}):
        assert [route.choose(get("zstd"), n, 1 << 20) for n in (1, 4, 5)] == ["host", "host", "gpu"]
        assert coalesce._host_route(_requests((zstd, 4)))
        assert not coalesce._host_route(_requests((zstd, 5)))
        # the chunks of the requests of one chain are counted together: 3 + 3 = 6
        assert not coalesce._host_route(_requests((zstd, 3), (other_zstd, 3)))
        assert coalesce._host_route(_requests((zstd, 3), (gzip, 3)))
        # every chain must be faster on the host
        assert not coalesce._host_route(_requests((zstd, 3), (gzip, 6)))
        assert not coalesce._host_route(_requests((gzip, 6), (zstd, 3)))
        # uncompressed chunks always take the GPU route
        assert not coalesce._host_route(_requests((_chain(None), 1)))


# -- the dask pass's groups -------------------------------------------------------------


def _blocks(sizes: list[int]) -> tuple[list[Any], dict[Any, Any]]:
    """Blocks of a float32 source of ``sizes[i]`` elements each, in this order."""
    source = types.SimpleNamespace(dtype=np.dtype("f4"))
    blocks = []
    at = 0
    for i, n in enumerate(sizes):
        blocks.append((("v", i), "src", (slice(at, at + n),)))
        at += n
    return blocks, {"src": (source, False)}


@pytest.mark.parametrize(
    ("sizes", "limit", "want"),
    [
        # 220 bytes, 80 a group: 3 groups; each block goes where its middle byte falls
        ([10, 10, 10, 10, 10, 5], 80, [[0, 1], [2, 3], [4, 5]]),
        ([10] * 6, 80, [[0, 1], [2, 3], [4, 5]]),
        ([10] * 7, 40, [[0], [1], [2], [3], [4], [5], [6]]),
        ([10, 10, 10, 30, 10], 100, [[0, 1], [2, 3], [4]]),
        ([25, 1, 1, 1], 40, [[0], [1, 2, 3]]),
        ([10] * 4, 1 << 30, [[0, 1, 2, 3]]),  # all in one group
        ([1, 1], 1, [[0], [1]]),  # no more groups than blocks
    ],
)
def test_fuse_groups_exact_membership(sizes: list[int], limit: int, want: list[list[int]]):
    blocks, sources = _blocks(sizes)
    with zarr.config.set({"xarray_gds.fuse_bytes": limit}):
        groups = fuse._groups(blocks, sources)
    assert [[key[1] for key, _, _ in group] for group in groups] == want


def test_fuse_warns_once_for_device_arrays_with_host_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Blocks of an array read on the GPU that xarray's default manager declares numpy
    warn once, naming the variable and the fix; CuPy blocks (GdsDaskManager) and host
    arrays do not."""

    def source(device: str, device_blocks: bool) -> tuple[Any, bool]:
        lazy = types.SimpleNamespace(key=None, array=types.SimpleNamespace(device=device, name="t"))
        return types.SimpleNamespace(array=lazy), device_blocks

    monkeypatch.setattr(fuse, "_warned_host_blocks", False)
    quiet = {"a": source("cuda", True), "b": source("cpu", False), "c": source("cpu", True)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fuse._warn_host_blocks(quiet, set(quiet))
    assert fuse._warned_host_blocks is False
    loud = {**quiet, "d": source("cuda", False)}
    match = r"'t' are decoded on the GPU.*chunked_array_type=\"gds-dask\""
    with pytest.warns(UserWarning, match=match):
        fuse._warn_host_blocks(loud, {"a", "d"})
    assert fuse._warned_host_blocks is True
    with warnings.catch_warnings():  # once a process
        warnings.simplefilter("error")
        fuse._warn_host_blocks(loud, {"d"})
    monkeypatch.setattr(fuse, "_warned_host_blocks", False)
    with warnings.catch_warnings():  # only the blocks used count
        warnings.simplefilter("error")
        fuse._warn_host_blocks(loud, {"a", "b"})


# -- the staged decode of the device route, with a fake CuPy ------------------------------


class _FakeDeviceArray(np.ndarray):
    """A numpy array standing for a CuPy array of device 0 (``set`` copies in)."""

    @property
    def device(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(id=0)

    def set(self, value: np.ndarray, stream: Any = None) -> None:
        assert stream is not None and isinstance(stream, _FakeStream)
        # a copy on a stream of its own must come after what the current stream has
        # queued: CuPy's pool may hand out memory that kernels queued there still use
        assert stream.current or any(e.source.current for e in stream.waited), (
            "a copy on another stream without waiting for the current stream"
        )
        self[...] = value


class _FakeStream:
    def __init__(self, non_blocking: bool = False, current: bool = False) -> None:
        self.synchronized = 0
        self.current = current
        self.waited: list[Any] = []

    def synchronize(self) -> None:
        self.synchronized += 1

    def record(self) -> Any:
        return types.SimpleNamespace(source=self)

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class _FakeDevice:
    def __init__(self, id: int | None = None) -> None:
        self.id = 0 if id is None else id

    def __enter__(self) -> _FakeDevice:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


def _fake_cupy() -> Any:
    """numpy, with ``empty`` giving device-like arrays (filled with 0xAB, so that a row
    nobody copied shows) and the ``cuda`` names decode_staged and read_device use."""
    stream = _FakeStream(current=True)

    def empty(shape: Any, dtype: Any = np.float64) -> Any:
        out = np.empty(shape, dtype=dtype).view(_FakeDeviceArray)
        out.view(np.uint8)[...] = 0xAB
        return out

    cuda = types.SimpleNamespace(
        Device=_FakeDevice, Stream=_FakeStream, get_current_stream=lambda: stream
    )
    fake = types.SimpleNamespace(empty=empty, cuda=cuda, uint8=np.uint8)
    return types.SimpleNamespace(
        **{k: getattr(np, k) for k in ("ascontiguousarray", "cumsum", "asarray")}, **vars(fake)
    )


class _Staging:
    """PinnedStaging's lease, in pageable memory."""

    def __init__(self) -> None:
        self.leased: list[int] = []

    @contextlib.contextmanager
    def lease(self, nbytes: int) -> Iterator[np.ndarray]:
        self.leased.append(nbytes)
        yield np.empty(nbytes, dtype=np.uint8)


def _all_chunks(path: Path, name: str = "t2m") -> tuple[Any, list[str], list[Any]]:
    """The chain of ``name`` and the stored bytes of all its chunks (None where missing)."""
    array = zarr.open_array(path / name, mode="r")
    chain = plan_chain(array.metadata)
    grid = [-(-s // c) for s, c in zip(array.shape, array.chunks, strict=True)]
    keys = [f"{name}/{array.metadata.encode_chunk_key(tuple(i))}" for i in np.ndindex(*grid)]
    source = stores.source_for(GdsStore(path, read_only=True))
    fetched = source.read_all([source] * len(keys), source.locate(keys), False, None)
    return chain, keys, fetched


@pytest.mark.parametrize(
    ("zarr_format", "codec"),
    [(3, "zstd"), (3, "none"), (3, "big-endian"), (2, "shuffle-zstd"), (2, "none")],
)
def test_decode_staged_matches_the_host_decode(
    monkeypatch: pytest.MonkeyPatch, store_factory: Callable, zarr_format: int, codec: str
) -> None:
    """The host decode for the device (each row copied as soon as it is decoded, then
    the filters and the final layout by CuPy) gives what the host decode gives,
    missing chunks left out as there."""
    chain, keys, fetched = _all_chunks(store_factory(zarr_format, codec))
    assert isinstance(chain, DecodeChain)
    assert any(f is None for f in fetched) and any(f is not None for f in fetched)
    want_present, want = decode.decode_fetched(chain, fetched, keys, False)
    monkeypatch.setattr(_device, "cupy", _fake_cupy)
    monkeypatch.setattr(decode, "_streams", threading.local())
    staging = _Staging()
    present, got = decode.decode_staged(chain, fetched, keys, staging)
    assert present == want_present
    assert staging.leased == [len(present) * chain.nbytes]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), want)
    # nothing present: nothing leased
    assert decode.decode_staged(chain, [None, None], keys[:2], staging) == ([], None)
    assert len(staging.leased) == 1


def test_joined_and_picked_keys() -> None:
    joined = decode.Joined([["a", "b"], [], ["c"], ["d", "e"]])
    assert len(joined) == 5
    assert [joined[i] for i in range(5)] == ["a", "b", "c", "d", "e"]
    assert joined[-1] == "e" and joined[1:4] == ["b", "c", "d"]
    picked = decode.Picked(joined, [4, 0, 2])
    assert list(picked) == ["e", "a", "c"] and picked[1:] == ["a", "c"]


# -- kvikio remote reads that come back short, with a fake kvikio ----------------------


class _Remote:
    """A fake kvikio ``RemoteFile`` of ``data``: its first ``short`` reads stop halfway."""

    def __init__(self, data: bytes, short: int, calls: list[str], name: str) -> None:
        self.data, self.short, self.calls, self.name = data, short, calls, name

    def nbytes(self) -> int:
        return len(self.data)

    def pread(self, buf: np.ndarray, size: int, offset: int) -> Any:
        self.calls.append(self.name)
        n = size // 2 if self.short > 0 else size
        self.short -= 1
        buf[:n] = np.frombuffer(self.data[offset : offset + n], dtype=np.uint8)
        return types.SimpleNamespace(get=lambda: n)


def _fake_kvikio(objects: dict[str, bytes], short: dict[str, int], calls: list[str]) -> Any:
    def open_http(url: str, nbytes: int | None = None) -> _Remote:
        name = url.rsplit("/", 1)[1]
        return _Remote(objects[name], short.get(name, 0), calls, name)

    return types.SimpleNamespace(RemoteFile=types.SimpleNamespace(open_http=open_http))


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "ranges"])
def test_read_device_retries_short_reads(monkeypatch: pytest.MonkeyPatch, ranged: bool) -> None:
    """A read that comes back short is read again (partial bytes are never data), at
    most ``retries`` times in all; then the error names the key and the URL."""
    rng = np.random.default_rng(0)
    objects = {name: rng.bytes(n) for name, n in (("a", 100), ("b", 37), ("c", 64))}
    calls: list[str] = []
    monkeypatch.setattr(_device, "cupy", _fake_cupy)
    monkeypatch.setattr(_device, "kvikio", lambda: _fake_kvikio(objects, {"b": 2, "c": 3}, calls))
    fs = types.SimpleNamespace(protocol="http")
    store = types.SimpleNamespace(fs=fs, path="http://127.0.0.1:9/root/")
    keys = ["a", "b"]
    starts = np.array([10, 5], dtype=np.int64) if ranged else None
    sizes = np.array([80, 30], dtype=np.int64) if ranged else None
    got = remote_device.read_device(
        [store, store], keys, ranges=None if starts is None else (starts, sizes)
    )
    for i, key in enumerate(keys):
        start = 0 if starts is None else int(starts[i])
        size = len(objects[key]) if sizes is None else int(sizes[i])
        assert int(got.sizes[i]) == size
        at = int(got.offsets[i])
        assert bytes(np.asarray(got.arena[at : at + size])) == objects[key][start : start + size]
    assert sorted(calls) == ["a", "b", "b", "b"]  # b came back short twice
    calls.clear()
    where = " bytes 10-49" if ranged else ""
    with pytest.raises(
        OSError,
        match=rf"^cannot read chunk 'c'{where} at http://127.0.0.1:9/root/c after 3 tries: "
        "short read; check the server and the network$",
    ):
        one = (np.array([10]), np.array([40])) if ranged else None
        remote_device.read_device([store], ["c"], ranges=one)
    assert calls == ["c"] * 3


# -- references whose targets are read over HTTP ------------------------------------------


class _RangeFiles(http.server.SimpleHTTPRequestHandler):
    """Files of a directory, with ``Range: bytes=a-b`` requests answered (206)."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        wanted = self.headers.get("Range")
        path = Path(self.translate_path(self.path))
        if not wanted or not path.is_file():
            return super().do_GET()
        body = path.read_bytes()
        first, _, last = wanted.removeprefix("bytes=").partition("-")
        start, end = int(first), min(len(body), int(last) + 1 if last else len(body))
        self.send_response(206)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        self.end_headers()
        self.wfile.write(body[start:end])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory and the loopback HTTP URL it is served at."""
    root = tmp_path / "served"
    root.mkdir()

    def handler(*args: Any, **kwargs: Any) -> _RangeFiles:
        return _RangeFiles(*args, directory=str(root), **kwargs)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.needs("fsspec", "aiohttp")
def test_remote_references_read_over_http(
    monkeypatch: pytest.MonkeyPatch, served: tuple[Path, str]
) -> None:
    """References to ranges of files on an HTTP server (kerchunk's ``[url, offset,
    length]``) are read through fsspec, every one of them: the values are zarr's."""
    root, url = served
    values = np.arange(7 * 10, dtype="f4").reshape(7, 10)
    xr.Dataset({"v": (("y", "x"), values)}).to_zarr(
        root / "src.zarr", zarr_format=2, consolidated=False, encoding={"v": {"chunks": (2, 4)}}
    )
    # one file of every chunk's bytes end to end, as an HDF5 file holds them
    blob = bytearray()
    references: dict[str, Any] = {}
    for f in sorted((root / "src.zarr").rglob("*")):
        key = f.relative_to(root / "src.zarr").as_posix()
        if f.is_dir():
            continue
        if key.rsplit("/", 1)[-1].startswith("."):
            references[key] = f.read_text()
            continue
        data = f.read_bytes()
        references[key] = [f"{url}/blob.bin", len(blob) + 3, len(data)]
        blob += b"pad" + data
    (root / "blob.bin").write_bytes(bytes(blob))
    n_chunks = sum(isinstance(v, list) for v in references.values())
    assert n_chunks == 4 * 3
    read: list[int] = []
    real = refs._read_remote

    def spy(refs_: Any, stores: Any) -> dict[int, bytes]:
        got = real(refs_, stores)
        read.append(len(got))
        return got

    monkeypatch.setattr(refs, "_read_remote", spy)
    ref_set = {"version": 1, "refs": references}
    got = xr.open_dataset(ref_set, engine="gds-zarr", device="cpu").load()
    want = xr.open_dataset(root / "src.zarr", engine="zarr", consolidated=False).load()
    xr.testing.assert_identical(got, want)
    assert sum(read) == n_chunks


# -- byte ranges joined into spans ------------------------------------------------------


def test_ranges_joined_into_spans_are_cut_back_exactly() -> None:
    """Ranges of one object less than ``range_gap`` apart are read as one span; each
    range is then its own slice of its span, wherever the span starts, overlapping and
    contained ranges included; ranges of other objects are never joined."""
    from xarray_gds import stores

    store = types.SimpleNamespace()
    other = types.SimpleNamespace()
    src, src_other = types.SimpleNamespace(store=store), types.SimpleNamespace(store=other)
    blobs = {"a": bytes(range(200)), "b": bytes(range(100, 200))}
    # a: [40, 60), [10, 30), [50, 70) overlapping, [12, 14) inside; b: [10, 20)
    locations = ["a", "a", "a", "a", "b", "a"]
    where = [src, src, src, src, src, src_other]
    starts = np.array([40, 10, 50, 12, 10, 150], dtype=np.int64)
    sizes = np.array([20, 20, 20, 2, 10, 5], dtype=np.int64)

    def merged(gap: int) -> list[Any]:  # spans come in the order of their stores' ids
        spans = stores.merge_ranges(where, locations, starts, sizes, gap)
        return sorted(spans, key=lambda s: (s[1], locations[s[0]]))

    assert merged(10) == [(1, 10, 70, [1, 3, 0, 2]), (4, 10, 20, [4]), (5, 150, 155, [5])]
    assert merged(0) == [
        (1, 10, 30, [1, 3]),
        (4, 10, 20, [4]),
        (0, 40, 70, [0, 2]),
        (5, 150, 155, [5]),
    ]
    asked: list[tuple[str, int, int]] = []

    def get(picked: list[int], span_starts: np.ndarray, span_sizes: np.ndarray) -> list[Any]:
        out = []
        for i, start, size in zip(picked, span_starts.tolist(), span_sizes.tolist(), strict=True):
            asked.append((locations[i], start, size))
            out.append(np.frombuffer(blobs[locations[i]][start : start + size], np.uint8))
        return out

    with zarr.config.set({"xarray_gds.range_gap": 10}):
        found = stores.read_joined(where, locations, starts, sizes, get)
    assert sorted(asked, key=lambda a: (a[1], a[0])) == [
        ("a", 10, 60),
        ("b", 10, 10),
        ("a", 150, 5),
    ]
    for i, data in enumerate(found):
        want = blobs[locations[i]][int(starts[i]) : int(starts[i]) + int(sizes[i])]
        assert data is not None and bytes(data) == want, i

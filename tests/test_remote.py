"""Remote stores, host route: real loopback servers, no client mocks.

A moto S3 server and a stdlib HTTP server that honours Range requests, both on
127.0.0.1 with a free port, started and stopped by the fixtures. Stores are written by
zarr-python through s3fs and read back with both engines.
"""

from __future__ import annotations

import http.server
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from tests._http import RangeHandler, serve
from tests._s3 import client as s3_client
from tests._s3 import loopback_s3, storage_options

s3fs = pytest.importorskip("s3fs")  # the remote extra; not every GPU image
aiohttp = pytest.importorskip("aiohttp")

KEY = "AKIAXGDSTESTKEY0001"
SECRET = "xgds-secret-do-not-print-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3():
    with loopback_s3() as endpoint:
        s3_client(endpoint, KEY, SECRET).create_bucket(Bucket="data")
        yield storage_options(endpoint, KEY, SECRET)


def test_the_s3_servers_steps_are_bounded():
    """tests/_s3.py: a server step that does not finish is an error naming it, within
    the time given; one that fails raises its own error."""
    from tests import _s3

    never = threading.Event()
    with pytest.raises(RuntimeError, match=r"did not start within 0 s"):
        _s3._bounded(never.wait, 0.05, "start")

    def broken() -> None:
        raise OSError("address in use")

    with pytest.raises(OSError, match="address in use"):
        _s3._bounded(broken, 5, "start")
    never.set()


def _dataset() -> xr.Dataset:
    rng = np.random.default_rng(17)
    return xr.Dataset(
        {
            "t": (("time", "y", "x"), rng.standard_normal((6, 8, 10)).astype("f4")),
            "n": (("y", "x"), np.arange(80, dtype="i4").reshape(8, 10)),
        },
        coords={"time": np.arange(6), "y": np.arange(8.0), "x": np.arange(10.0)},
    )


@pytest.fixture(scope="module")
def s3_store(s3):
    url = "s3://data/one.zarr"
    encoding = {"t": {"chunks": (2, 4, 5)}, "n": {"chunks": (4, 5)}}
    _dataset().to_zarr(url, storage_options=s3, mode="w", encoding=encoding, consolidated=False)
    return url


def test_open_dataset_s3_matches_zarr(s3, s3_store):
    ours = xr.open_dataset(s3_store, engine="gds-zarr", storage_options=s3, device="cpu")
    ref = xr.open_dataset(s3_store, engine="zarr", storage_options=s3)
    assert isinstance(ours.t.load().data, np.ndarray)
    xr.testing.assert_identical(ours.load(), ref.load())
    sub = ours.t.isel(time=slice(1, 4), x=[0, 3, 9]).load()
    xr.testing.assert_identical(sub, ref.t.isel(time=slice(1, 4), x=[0, 3, 9]).load())


def test_open_mfdataset_and_datatree_s3(s3, s3_store):
    ours = xr.open_mfdataset(
        [s3_store, s3_store],
        engine="gds-zarr",
        storage_options=s3,
        device="cpu",
        combine="nested",
        concat_dim="run",
    )
    ref = xr.open_mfdataset(
        [s3_store, s3_store], engine="zarr", storage_options=s3, combine="nested", concat_dim="run"
    )
    xr.testing.assert_identical(ours.load(), ref.load())
    tree = xr.open_datatree(s3_store, engine="gds-zarr", storage_options=s3, device="cpu")
    xr.testing.assert_identical(tree.to_dataset().load(), ref.isel(run=0, drop=True).load())


def test_sharded_s3_store(s3):
    url = "s3://data/sharded.zarr"
    ds = _dataset()
    encoding = {"t": {"chunks": (1, 4, 5), "shards": (2, 8, 10)}}
    ds[["t"]].to_zarr(url, storage_options=s3, mode="w", encoding=encoding, consolidated=False)
    ours = xr.open_dataset(url, engine="gds-zarr", storage_options=s3, device="cpu")
    ref = xr.open_dataset(url, engine="zarr", storage_options=s3)
    xr.testing.assert_identical(ours.load(), ref.load())


def test_to_zarr_s3_roundtrip(s3):
    import xarray_gds

    url = "s3://data/written.zarr"
    ds = _dataset()
    xarray_gds.to_zarr(ds, url, storage_options=s3, mode="w", consolidated=False)
    back = xr.open_dataset(url, engine="zarr", storage_options=s3)
    xr.testing.assert_identical(back.load(), ds)
    ours = xr.open_dataset(url, engine="gds-zarr", storage_options=s3, device="cpu")
    xr.testing.assert_identical(ours.load(), back.load())


def _failing_dataset(fail_block: int | None) -> xr.Dataset:
    """``_dataset()`` with ``t`` in three dask blocks; block ``fail_block`` raises."""
    import dask.array as da

    ds = _dataset()

    def block(x, block_info=None):
        if block_info is not None and block_info[0]["chunk-location"][0] == fail_block:
            raise RuntimeError("block failed (injected)")
        return x

    t = da.from_array(ds.t.values, chunks=(2, 8, 10)).map_blocks(block, dtype="f4")
    return ds.assign(t=(ds.t.dims, t))


def test_failed_s3_write_leaves_no_objects(s3):
    """A new store whose write fails: chunks were uploaded, then deleted; no metadata."""
    import dask

    import xarray_gds

    url = "s3://data/failed.zarr"
    fs = s3fs.S3FileSystem(**s3)
    with dask.config.set(scheduler="synchronous"), pytest.raises(RuntimeError, match="injected"):
        xarray_gds.to_zarr(
            _failing_dataset(fail_block=2), url, storage_options=s3, mode="w", consolidated=True
        )
    fs.invalidate_cache()
    assert fs.find("data/failed.zarr") == []
    with pytest.raises(FileNotFoundError):
        xr.open_dataset(url, engine="zarr", storage_options=s3)


def test_failed_s3_append_leaves_the_store_as_it_was(s3):
    import dask

    import xarray_gds

    url = "s3://data/appended.zarr"
    ds = _dataset()
    encoding = {"t": {"chunks": (2, 8, 10)}}
    xarray_gds.to_zarr(ds, url, storage_options=s3, mode="w", consolidated=True, encoding=encoding)
    fs = s3fs.S3FileSystem(**s3)
    meta = sorted(k for k in fs.find("data/appended.zarr") if k.endswith("zarr.json"))
    before = {k: fs.cat_file(k) for k in meta}
    failing = _failing_dataset(fail_block=1).drop_vars("n")
    with dask.config.set(scheduler="synchronous"), pytest.raises(RuntimeError, match="injected"):
        xarray_gds.to_zarr(failing, url, storage_options=s3, append_dim="time")
    fs.invalidate_cache()
    assert {k: fs.cat_file(k) for k in meta} == before  # metadata untouched
    for engine in ("zarr", "gds-zarr"):
        kwargs = {"device": "cpu"} if engine == "gds-zarr" else {}
        got = xr.open_dataset(url, engine=engine, storage_options=s3, **kwargs).load()
        xr.testing.assert_identical(got, ds)
    xarray_gds.to_zarr(_dataset().drop_vars("n"), url, storage_options=s3, append_dim="time")
    got = xr.open_dataset(url, engine="gds-zarr", storage_options=s3, device="cpu").load()
    ref = xr.open_dataset(url, engine="zarr", storage_options=s3).load()
    xr.testing.assert_identical(got, ref)
    assert got.sizes["time"] == 12


def test_missing_bucket_names_url_not_secret(s3):
    with pytest.raises(
        FileNotFoundError, match=r"s3://nobucket/x.zarr.*bucket 'nobucket' does not exist"
    ) as info:
        xr.open_dataset("s3://nobucket/x.zarr", engine="gds-zarr", storage_options=s3, device="cpu")
    assert SECRET not in str(info.value) and KEY not in str(info.value)


def test_missing_key(s3):
    with pytest.raises(FileNotFoundError, match=r"No Zarr store at 's3://data/absent.zarr'"):
        xr.open_dataset(
            "s3://data/absent.zarr", engine="gds-zarr", storage_options=s3, device="cpu"
        )


def test_wrong_endpoint_names_url_not_secret(s3):
    bad = dict(
        s3,
        endpoint_url=f"http://127.0.0.1:{_free_port()}",
        config_kwargs={"retries": {"max_attempts": 1}},
    )
    with pytest.raises(
        ConnectionError, match=r"s3://data/one.zarr.*endpoint cannot be reached"
    ) as info:
        xr.open_dataset("s3://data/one.zarr", engine="gds-zarr", storage_options=bad, device="cpu")
    assert SECRET not in str(info.value) and KEY not in str(info.value)


@pytest.fixture(scope="module")
def http_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    encoding = {"t": {"chunks": (2, 4, 5)}, "n": {"chunks": (4, 5)}}
    _dataset().to_zarr(root / "one.zarr", mode="w", encoding=encoding, consolidated=True)
    (root / "private").mkdir()
    with serve(root) as url:
        yield url


def test_open_dataset_http_matches_zarr(http_root):
    url = f"{http_root}/one.zarr"
    ours = xr.open_dataset(url, engine="gds-zarr", device="cpu")
    ref = xr.open_dataset(url, engine="zarr")
    xr.testing.assert_identical(ours.load(), ref.load())


def test_http_403(http_root):
    with pytest.raises(PermissionError, match=r"/private/one.zarr.*403.*credentials"):
        xr.open_dataset(f"{http_root}/private/one.zarr", engine="gds-zarr", device="cpu")


def test_remote_source_chosen_and_secrets_hidden(s3, s3_store):
    from xarray_gds import stores

    ds = xr.open_dataset(s3_store, engine="gds-zarr", storage_options=s3, device="cpu")
    from xarray_gds.backend import open_store

    store = open_store(s3_store, storage_options=s3)
    assert isinstance(stores.source_for(store), stores.RemoteSource)
    for text in (repr(store), str(store), repr(ds), str(ds.encoding)):
        assert SECRET not in text and KEY not in text


@pytest.mark.gpu
def test_s3_kvikio_route_matches_zarr(s3, s3_store):
    cupy = pytest.importorskip("cupy")
    ours = xr.open_dataset(s3_store, engine="gds-zarr", storage_options=s3, device="cuda")
    ref = xr.open_dataset(s3_store, engine="zarr", storage_options=s3).load()
    loaded = ours.load()
    assert isinstance(loaded.t.data, cupy.ndarray)
    xr.testing.assert_identical(loaded.as_numpy(), ref)


def test_listing_gives_the_sizes_of_whole_objects(s3, s3_store, monkeypatch):
    """The device route takes the sizes of whole chunk objects from one listing of their
    prefix instead of a HEAD request each: sizes as the server has them, absent keys
    known missing, a listing cut short says nothing of the keys it did not reach, and a
    refused listing (here: no such bucket) leaves every size to be asked for."""
    from zarr.storage import FsspecStore

    from xarray_gds.stores import listings

    store = FsspecStore.from_url(s3_store, storage_options=s3, read_only=True)
    fs = s3fs.S3FileSystem(**s3)
    present = sorted(k[len(s3_store) - 5 + 1 :] for k in fs.find(f"{s3_store[5:]}/t/c"))
    assert len(present) >= listings.LIST_MIN_KEYS
    keys = [*present, "t/c/9/9/9"]
    listing = listings.list_sizes(store, keys)
    assert listing is not None
    assert listing.sizes == {k: fs.size(f"{s3_store[5:]}/{k}") for k in present}
    assert listing.missing("t/c/9/9/9") and not any(listing.missing(k) for k in present)
    assert listings.list_sizes(store, present[:2]) is None  # too few to be worth a listing

    monkeypatch.setattr(listings, "LIST_PAGE", 3)  # one page of 3 objects: cut short
    short = listings.list_sizes(store, keys)
    assert short is not None and sorted(short.sizes) == present[:3]
    assert not any(short.missing(k) for k in keys[3:])

    nowhere = FsspecStore.from_url("s3://no-such-bucket/x.zarr", storage_options=s3)
    assert listings.list_sizes(nowhere, keys) is None


def test_listing_bounds_as_documented(s3, s3_store, monkeypatch):
    """docs/remote.md: a listing is made for 8 or more whole objects (not 7), asks for
    1,000 objects a request, at most one page per 100 objects wanted; through s3fs and
    through obstore alike."""
    import obstore
    from zarr.storage import FsspecStore

    from xarray_gds.backend import open_store
    from xarray_gds.stores import listings

    fs = s3fs.S3FileSystem(**s3)
    present = sorted(k[len(s3_store) - 5 + 1 :] for k in fs.find(f"{s3_store[5:]}/t/c"))
    assert len(present) >= 9
    asked: list[tuple[str, int]] = []
    real_call = s3fs.S3FileSystem._call_s3
    real_list = obstore.list

    async def call_s3(self, method, *args, **kwargs):
        if method == "list_objects_v2":
            asked.append(("s3fs", kwargs.get("MaxKeys")))
        return await real_call(self, method, *args, **kwargs)

    def listing(store, prefix=None, **kwargs):
        asked.append(("obstore", kwargs.get("chunk_size")))
        return real_list(store, prefix, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    monkeypatch.setattr(obstore, "list", listing)
    for store in (
        FsspecStore.from_url(s3_store, storage_options=s3, read_only=True),
        open_store(s3_store, storage_options=s3),
    ):
        asked.clear()
        assert listings.list_sizes(store, present[:7]) is None
        assert asked == []
        eight = listings.list_sizes(store, present[:8])
        assert eight is not None and sorted(eight.sizes) == present[:8]
        assert [n for _, n in asked] == [1000]
        monkeypatch.setattr(listings, "LIST_PAGE", 2)  # 2 objects a page: 1 page of them
        short = listings.list_sizes(store, present)
        assert short is not None and sorted(short.sizes) == present[:2]
        monkeypatch.setattr(listings, "LIST_PAGE", 1000)
    # 101 objects wanted: two pages (here of 60 objects) before the listing stops
    url = "s3://data/many.zarr"
    many = xr.Dataset({"m": (("i",), np.arange(130.0))})
    many.to_zarr(url, storage_options=s3, encoding={"m": {"chunks": (1,)}}, consolidated=False)
    keys = sorted(k[len(url) - 5 + 1 :] for k in fs.find(f"{url[5:]}/m/c"))[:101]
    monkeypatch.setattr(listings, "LIST_PAGE", 60)
    for store in (
        FsspecStore.from_url(url, storage_options=s3, read_only=True),
        open_store(url, storage_options=s3),
    ):
        got = listings.list_sizes(store, keys)
        assert got is not None and sorted(got.sizes) == keys[:101]
        assert got.complete_to is not None
        prefixed = ["m/c/1", *(f"m/c/1{i}" for i in range(10))]  # the first starts the last
        some = listings.list_sizes(store, prefixed)
        assert some is not None and sorted(some.sizes) == prefixed


def test_a_listing_knows_missing_keys_up_to_its_end_only(s3, s3_store, monkeypatch):
    """Listing.missing: a key absent from a listing is known missing anywhere up to the
    last key it covers (a complete listing covers every key wanted, an absent one between
    present ones included), not after it; a store on a file system that is not S3 is not
    listed, whatever names its protocol has."""
    from zarr.storage import FsspecStore

    from xarray_gds.stores import listings

    fs = s3fs.S3FileSystem(**s3)
    present = sorted(k[len(s3_store) - 5 + 1 :] for k in fs.find(f"{s3_store[5:]}/t/c"))
    between = present[0] + "0"  # sorts after the first key, before the second
    keys = sorted([*present, between])
    store = FsspecStore.from_url(s3_store, storage_options=s3, read_only=True)
    listing = listings.list_sizes(store, keys)
    assert listing is not None and listing.complete_to == keys[-1]
    assert listing.missing(between) and listing.missing(keys[-1] + "0") is False
    monkeypatch.setattr(listings, "LIST_PAGE", 3)  # one page: the first three keys
    short = listings.list_sizes(store, keys)
    assert short is not None and short.complete_to == present[2]
    assert short.missing(between)
    assert not any(short.missing(k) for k in keys if k > present[2])
    import types

    for protocol in (("gs",), ("gcs", "gs"), "file"):  # a file system of one name, of two
        other = types.SimpleNamespace(fs=types.SimpleNamespace(protocol=protocol), path="b/x")
        assert listings.list_sizes(other, [f"v/c/{i}" for i in range(8)]) is None


def test_obstore_listing_gives_the_sizes_of_whole_objects(s3, s3_store):
    """The same listing through obstore (the store the engine opens an s3:// URL
    with): sizes as the server has them, absent keys known missing."""
    from xarray_gds.backend import open_store
    from xarray_gds.stores import listings, objstore

    store = open_store(s3_store, storage_options=s3)
    assert objstore.inner(store) is not None
    fs = s3fs.S3FileSystem(**s3)
    present = sorted(k[len(s3_store) - 5 + 1 :] for k in fs.find(f"{s3_store[5:]}/t/c"))
    keys = [*present, "t/c/9/9/9"]
    listing = listings.list_sizes(store, keys)
    assert listing is not None
    assert listing.sizes == {k: fs.size(f"{s3_store[5:]}/{k}") for k in present}
    assert listing.missing("t/c/9/9/9") and not any(listing.missing(k) for k in present)


@pytest.mark.gpu
@pytest.mark.parametrize("gap", [None, -1])
def test_sharded_s3_kvikio_route_matches_zarr(s3, monkeypatch, gap):
    """Inner chunks of shards read by kvikio on the device: one handle a shard, ranges
    joined across gaps (or not, with range_gap=-1), each copied to its own slot."""
    cupy = pytest.importorskip("cupy")
    from xarray_gds.stores import remote_device

    url = "s3://data/sharded-device.zarr"
    ds = _dataset()
    ds["t"][2:4] = np.nan  # whole inner chunks of the fill value: not written
    encoding = {"t": {"chunks": (1, 4, 5), "shards": (2, 8, 10)}}
    ds[["t"]].to_zarr(url, storage_options=s3, mode="w", encoding=encoding, consolidated=False)
    calls = []
    real = remote_device.read_device

    def spy(stores, keys, retries=3, ranges=None):
        calls.append((len(keys), ranges is not None))
        return real(stores, keys, retries, ranges)

    monkeypatch.setattr(remote_device, "read_device", spy)
    config = {} if gap is None else {"xarray_gds.range_gap": gap}
    with zarr.config.set(config):
        loaded = xr.open_dataset(url, engine="gds-zarr", storage_options=s3, device="cuda").load()
    assert isinstance(loaded.t.data, cupy.ndarray)
    ref = xr.open_dataset(url, engine="zarr", storage_options=s3).load()
    xr.testing.assert_identical(loaded.as_numpy(), ref)
    ranged = [n for n, with_ranges in calls if with_ranges]
    assert ranged  # the inner chunks came through kvikio by range

    shards = [k for k in s3fs.S3FileSystem(**s3).find(f"{url[5:]}/t/c")]
    assert len(shards) == 2  # the middle shard held the fill value only: not written
    # joined: one request a shard; unjoined: one an inner chunk (8 a shard)
    assert sum(ranged) == (len(shards) if gap is None else 8 * len(shards))


@pytest.mark.gpu
def test_s3_kvikio_route_takes_sizes_from_a_listing(s3, monkeypatch):
    """Whole chunk objects read by kvikio open with their size from one listing (no HEAD
    request each); a chunk the listing does not hold is the fill value, never opened."""
    cupy = pytest.importorskip("cupy")
    from xarray_gds.stores import remote_device

    url = "s3://data/listed.zarr"
    ds = _dataset()
    ds["t"][0:2, 0:4, 0:5] = np.nan  # one chunk of the fill value only: not written
    encoding = {"t": {"chunks": (1, 4, 5)}}  # 24 chunks, 22 written
    ds[["t"]].to_zarr(url, storage_options=s3, mode="w", encoding=encoding, consolidated=False)
    opened: list[tuple[str, int | None]] = []
    real = remote_device._open_remote

    def spy(kvikio, target, args, nbytes=None):
        opened.append((target, nbytes))
        return real(kvikio, target, args, nbytes)

    monkeypatch.setattr(remote_device, "_open_remote", spy)
    loaded = xr.open_dataset(url, engine="gds-zarr", storage_options=s3, device="cuda").load()
    assert isinstance(loaded.t.data, cupy.ndarray)
    ref = xr.open_dataset(url, engine="zarr", storage_options=s3).load()
    xr.testing.assert_identical(loaded.as_numpy(), ref)
    chunks = [(u, n) for u, n in opened if "/t/c/" in u]
    assert len(chunks) == 22  # the two chunks of the fill value were not opened
    assert all(n is not None and n > 0 for _, n in chunks)


@pytest.mark.gpu
def test_http_kvikio_route_matches_zarr(http_root):
    cupy = pytest.importorskip("cupy")
    url = f"{http_root}/one.zarr"
    loaded = xr.open_dataset(url, engine="gds-zarr", device="cuda").load()
    assert isinstance(loaded.t.data, cupy.ndarray)
    xr.testing.assert_identical(loaded.as_numpy(), xr.open_dataset(url, engine="zarr").load())


def test_fsspec_and_object_store_objects(s3, s3_store):
    import zarr

    ref = xr.open_dataset(s3_store, engine="zarr", storage_options=s3).load()
    fss = zarr.storage.FsspecStore.from_url(s3_store, storage_options=s3, read_only=True)
    ours = xr.open_dataset(fss, engine="gds-zarr", device="cpu").load()
    xr.testing.assert_identical(ours, ref)
    obstore = pytest.importorskip("obstore.store", reason="ObjectStore needs obstore")
    obj = obstore.S3Store(
        "data",
        prefix="one.zarr",
        endpoint=s3["endpoint_url"],
        access_key_id=KEY,
        secret_access_key=SECRET,
        region="us-east-1",
        client_options={"allow_http": True},
    )
    store = zarr.storage.ObjectStore(obj, read_only=True)
    xr.testing.assert_identical(xr.open_dataset(store, engine="gds-zarr", device="cpu").load(), ref)


# --- faults: connections cut, slow or refused servers ---------------------------------


class _FaultServer(http.server.ThreadingHTTPServer):
    """The files of ``root`` (byte ranges as :class:`RangeHandler`) with a fault for
    the first ``times`` requests of each chunk of ``t`` in ``store`` (every request
    when ``times`` is None; metadata and the other variables are served as they are,
    so that the store opens): ``"truncate"`` sends the headers with the full
    Content-Length, then half the body, then closes the connection; ``"short"``
    answers a byte range that does not reach the end of the object (inner chunks of a
    shard, not its index) with half the bytes asked for, and a Content-Length that
    says so; ``"slow"`` answers after ``delay`` seconds; ``"forbid"`` answers 403,
    ``"fail"`` 500."""

    daemon_threads = True  # a handler still asleep does not hold up the stop
    # room for every connection of a batch at once: with the default backlog (5) the
    # kernel drops SYNs and the client's 1 s retransmit outlasts the tests' timeouts
    request_queue_size = 64

    def __init__(
        self,
        root: Path,
        fault: str,
        times: int | None = None,
        delay: float = 0.0,
        store: str = "one.zarr",
    ):
        self.root, self.fault, self.times, self.delay = root, fault, times, delay
        self.store, self.prefix = store, f"/{store}/t/"
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        super().__init__(("127.0.0.1", _free_port()), _FaultHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{self.store}"

    def fault_for(self, path: str, byte_range: str | None) -> str | None:
        """The fault of this request (``None``: serve it), counting the requests of each
        path and byte range."""
        if not path.startswith(self.prefix):
            return None
        path = f"{path} {byte_range}" if byte_range else path
        with self.lock:
            seen = self.counts.get(path, 0)
            self.counts[path] = seen + 1
        return self.fault if self.times is None or seen < self.times else None

    def stop(self) -> None:
        self.stopping.set()  # wakes the slow handlers
        self.shutdown()
        self.server_close()
        self.thread.join(5)

    def handle_error(self, request, client_address):
        # a slow answer to a client that gave up: the broken pipe is the point
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def finish_request(self, request, client_address):  # the root is the server's
        _FaultHandler(request, client_address, self, directory=str(self.root))


class _FaultHandler(RangeHandler):
    # HTTP/1.0 (the default): one request per connection, so that a stopped server
    # leaves no kept-alive connection behind that would still answer
    server: _FaultServer

    def do_GET(self):
        fault = self.server.fault_for(self.path, self.headers.get("Range"))
        if fault == "slow":
            if self.server.stopping.wait(self.server.delay):
                return
        elif fault == "forbid":
            self.send_error(403)
            return
        elif fault == "fail":
            self.send_error(500)
            return
        elif fault == "short" and self._short():
            return
        elif fault == "truncate":
            body = self.send_head()  # the headers, with the full Content-Length
            if body is not None:
                data = body.read()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
            return
        super().do_GET()

    def _short(self) -> bool:
        """Answer a range short of the object's end with half of it; False when the
        request is not such a range (it is then served whole)."""
        first, _, last = (self.headers.get("Range") or "").removeprefix("bytes=").partition("-")
        data = Path(self.translate_path(self.path)).read_bytes()
        if not (first.isdigit() and last.isdigit()) or int(last) >= len(data) - 1:
            return False
        start = int(first)
        body = data[start : int(last) + 1][: (int(last) + 1 - start) // 2]
        self.send_response(206)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        self.end_headers()
        self.wfile.write(body)
        return True


@pytest.fixture(scope="module")
def fault_root(tmp_path_factory):
    """An HTTP store whose ``t`` chunks are stored raw (no compressor), so that a
    short body could only be caught by the read, not by a decoder."""
    root = tmp_path_factory.mktemp("faults")
    encoding = {"t": {"chunks": (2, 4, 5), "compressors": None}, "n": {"chunks": (4, 5)}}
    _dataset().to_zarr(root / "one.zarr", mode="w", encoding=encoding, consolidated=True)
    sharded = {"t": {"chunks": (1, 4, 5), "shards": (2, 8, 10), "compressors": None}}
    _dataset()[["t"]].to_zarr(root / "sharded.zarr", mode="w", encoding=sharded, consolidated=True)
    return root


@pytest.fixture
def faulty(fault_root):
    """Start fault servers over ``fault_root``; all stopped when the test ends."""
    servers: list[_FaultServer] = []

    def start(
        fault: str, times: int | None = None, delay: float = 0.0, store: str = "one.zarr"
    ) -> _FaultServer:
        servers.append(_FaultServer(fault_root, fault, times, delay, store))
        return servers[-1]

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def _t_keys(server: _FaultServer) -> dict[str, int]:
    return {p: n for p, n in server.counts.items() if p.startswith(server.prefix)}


def _tries_bounded(server: _FaultServer, err: pytest.ExceptionInfo[BaseException]) -> None:
    """The chunk the error names was asked for 3 times, no chunk more (the first
    failure cancels the reads still going)."""
    import re

    from xarray_gds.stores import urls

    key = re.search(r"chunk '([^']+)'", str(err.value)).group(1)
    counts = _t_keys(server)
    assert counts[f"/{server.store}/{key}"] == urls.READ_ATTEMPTS
    assert max(counts.values()) == urls.READ_ATTEMPTS


def test_truncated_bodies_are_tried_again(faulty, fault_root):
    from xarray_gds.stores import urls

    server = faulty("truncate", times=urls.READ_ATTEMPTS - 1)
    ours = xr.open_dataset(server.url, engine="gds-zarr", device="cpu").load()
    ref = xr.open_dataset(fault_root / "one.zarr", engine="zarr").load()
    xr.testing.assert_identical(ours, ref)
    counts = _t_keys(server)
    assert len(counts) == 12  # every chunk of t: 3 x 2 x 2
    assert set(counts.values()) == {urls.READ_ATTEMPTS}  # two cut, the third whole


def test_truncated_bodies_for_good_raise(faulty):
    server = faulty("truncate")
    ds = xr.open_dataset(server.url, engine="gds-zarr", device="cpu")
    xr.testing.assert_identical(ds.n.load(), xr.open_dataset(server.url, engine="zarr").n.load())
    with pytest.raises(
        ConnectionError,
        match=rf"chunk 't/c/\d/\d/\d' of the remote Zarr store '{server.url}' after 3 tries: "
        r"the connection was closed before the whole object came \(no partial bytes were "
        r"used\): check the server and the network",
    ) as err:
        ds.t.load()
    _tries_bounded(server, err)


def test_forbidden_chunk_is_not_tried_again(faulty):
    server = faulty("forbid")
    ds = xr.open_dataset(server.url, engine="gds-zarr", device="cpu")
    with pytest.raises(
        PermissionError,
        match=r"chunk 't/c/\d/\d/\d' of the remote Zarr store '.*/one.zarr': "
        r"access denied \(HTTP 403\): check the credentials",
    ):
        ds.t.load()
    assert set(_t_keys(server).values()) == {1}  # a 403 does not go away: asked once


def test_slow_server_times_out(faulty):
    server = faulty("slow", delay=2.0)
    options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=0.4)}}
    ds = xr.open_dataset(server.url, engine="gds-zarr", device="cpu", storage_options=options)
    with pytest.raises(
        TimeoutError,
        match=r"chunk 't/c/\d/\d/\d' of .*/one.zarr' after 3 tries: the server was too slow.*"
        r"client_kwargs=\{'timeout': aiohttp.ClientTimeout\(total=...\)\}",
    ) as err:
        ds.t.load()
    _tries_bounded(server, err)


def test_slow_answer_once_is_tried_again(faulty, fault_root):
    server = faulty("slow", times=1, delay=2.0)
    options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=0.4)}}
    ours = xr.open_dataset(server.url, engine="gds-zarr", device="cpu", storage_options=options)
    ref = xr.open_dataset(fault_root / "one.zarr", engine="zarr")
    xr.testing.assert_identical(ours.load(), ref.load())
    assert set(_t_keys(server).values()) == {2}


def test_server_gone_after_open(faulty):
    server = faulty("none")  # no fault: a plain server, stopped after the open
    ds = xr.open_dataset(server.url, engine="gds-zarr", device="cpu")
    server.stop()
    with pytest.raises(
        ConnectionError,
        match=rf"chunk '(t|n)/c/[\d/]+' of the remote Zarr store '{server.url}' after 3 tries: "
        r"the server cannot be reached.*check that it is up and the URL",
    ):
        ds.load()


# --- credentials never appear -------------------------------------------------------

LEAK = "SECRET-abc123"


def test_credentials_never_appear(tmp_path, caplog, capsys):
    """An S3 secret key through every surface: reprs of the dataset, store and backend
    arrays, ``xarray-gds info`` (output and errors), the logs at DEBUG, and the error
    of a read whose server went away."""
    import logging

    from xarray_gds.backend import open_store
    from xarray_gds.tools import cli

    caplog.set_level(logging.DEBUG)  # every logger: ours, s3fs, botocore, aiohttp
    with loopback_s3() as endpoint:  # stopped before the last read below
        s3_client(endpoint, KEY, LEAK).create_bucket(Bucket="creds")
        options = storage_options(
            endpoint, KEY, LEAK, config_kwargs={"retries": {"max_attempts": 1}}
        )
        url = "s3://creds/one.zarr"
        _dataset().to_zarr(url, storage_options=options, mode="w", consolidated=False)

        ds = xr.open_dataset(url, engine="gds-zarr", storage_options=options, device="cpu")
        store = open_store(url, storage_options=options)
        texts = [repr(ds), str(ds), repr(store), repr(ds.t.variable._data), str(ds.t.encoding)]
        backend = ds.t.variable._data
        while not type(backend).__module__.startswith("xarray_gds"):  # xarray's wrappers
            backend = backend.array
        slots = type(backend).__slots__  # its zarr array (and through it the store)
        texts += [repr(backend), *(repr(getattr(backend, n, None)) for n in slots)]

        argv = ["info", url, "--storage-option", f"key={KEY}", "--storage-option"]
        argv += [f"secret={LEAK}", "--storage-option", f"endpoint_url={endpoint}"]
        argv += ["--storage-option", "client_kwargs.region_name=us-east-1"]
        assert cli.main(argv) == 0
        out = capsys.readouterr()
        assert "store:        s3://creds/one.zarr\n" in out.out
        assert "\n/t\n  shape       (6, 8, 10)\n" in out.out  # it read the metadata
        texts += [out.out, out.err]

        bad = [*argv[:3], f"key={KEY}", "--storage-option", f"secret={LEAK}"]
        bad += ["--storage-option", f"endpoint_url=http://127.0.0.1:{_free_port()}"]
        bad += ["--storage-option", "config_kwargs.retries.max_attempts=1"]
        assert cli.main(bad) == 1  # an unreachable store is a failure (2: usage errors)
        err = capsys.readouterr().err
        assert "s3://creds/one.zarr" in err and "endpoint cannot be reached" in err
        texts.append(err)

    with pytest.raises(
        ConnectionError,
        match=r"chunk '(t|n)/c/[\d/]+' of the remote Zarr store 's3://creds/one.zarr'"
        r"( after 3 tries)?: the server cannot be reached.*endpoint_url",
    ) as gone:
        ds.load()
    texts += [str(gone.value), repr(gone.value), caplog.text]
    assert caplog.records  # the logs were captured
    for text in texts:
        assert LEAK not in text
    for text in texts[:-1]:  # botocore's own debug log shows the access key id
        assert KEY not in text


def test_http_header_secret_never_in_retry_logs(faulty, caplog):
    import logging
    import re

    caplog.set_level(logging.DEBUG, logger="xarray_gds")
    options = {"headers": {"Authorization": f"Bearer {LEAK}"}}
    server = faulty("truncate")
    ds = xr.open_dataset(server.url, engine="gds-zarr", device="cpu", storage_options=options)
    with pytest.raises(ConnectionError, match=r"after 3 tries") as err:
        ds.t.load()
    retries = [r.getMessage() for r in caplog.records if r.name == "xarray_gds.stores.remote"]
    # aiohttp's error (fsspec) or the engine's own for obstore's
    assert any(re.search(r"try 1 of 3 failed \((ClientPayloadError|BodyCut)", m) for m in retries)
    for text in [*retries, caplog.text, str(err.value), repr(ds), repr(ds.t.variable._data)]:
        assert LEAK not in text


def test_info_storage_options_parsed(http_root, capsys):
    from xarray_gds.tools import cli

    parsed = cli._storage_options(
        ["anon=true", "client_kwargs.region_name=eu-west-1", "secret=12345", 'n={"a": 1}']
    )
    assert parsed == {
        "anon": True,
        "client_kwargs": {"region_name": "eu-west-1"},
        "secret": "12345",  # a secret stays a string
        "n": {"a": 1},
    }
    # a timeout in seconds becomes aiohttp's ClientTimeout for an http(s) URL
    url = f"{http_root}/one.zarr"
    assert cli.main(["info", url, "--storage-option", "client_kwargs.timeout=5"]) == 0
    assert f"store:        {url}\n" in capsys.readouterr().out
    assert cli.main(["info", url, "--storage-option", LEAK]) == 2
    err = capsys.readouterr().err
    assert "--storage-option takes KEY=VALUE" in err and LEAK not in err


def test_short_ranges_of_a_shard(faulty, fault_root):
    """Inner chunks of shards are byte ranges: one that comes back shorter than asked
    (with a Content-Length that matches, so aiohttp cannot tell) is caught by the length
    check, tried again, and never decoded."""
    from xarray_gds.stores import urls

    ref = xr.open_dataset(fault_root / "sharded.zarr", engine="zarr").load()
    server = faulty("short", times=urls.READ_ATTEMPTS - 1, store="sharded.zarr")
    ours = xr.open_dataset(server.url, engine="gds-zarr", device="cpu")
    xr.testing.assert_identical(ours.load(), ref)
    counts = _t_keys(server)
    index = {k: n for k, n in counts.items() if "bytes=-" in k}  # a suffix: the index
    inner = {k: n for k, n in counts.items() if k not in index}
    assert len(index) == 3 and set(index.values()) == {1}  # one shard index a shard
    # the 8 inner chunks of a shard lie one after the other: one joined range a shard
    # (xarray_gds.range_gap), tried until it comes back whole
    assert len(inner) == 3 and set(inner.values()) == {urls.READ_ATTEMPTS}
    with zarr.config.set({"xarray_gds.range_gap": -1}):  # never joined: one an inner chunk
        server = faulty("short", times=urls.READ_ATTEMPTS - 1, store="sharded.zarr")
        ours = xr.open_dataset(server.url, engine="gds-zarr", device="cpu")
        xr.testing.assert_identical(ours.load(), ref)
    inner = {k: n for k, n in _t_keys(server).items() if "bytes=-" not in k}
    assert len(inner) == 3 * 8 and set(inner.values()) == {urls.READ_ATTEMPTS}

    server = faulty("short", store="sharded.zarr")
    ds = xr.open_dataset(server.url, engine="gds-zarr", device="cpu")
    with pytest.raises(
        OSError,
        match=rf"chunk 't/c/\d/0/0' of the remote Zarr store '{server.url}' after 3 tries: "
        r"the server sent fewer bytes than asked for \(\d+ of the \d+ bytes",
    ):
        ds.t.load()


# --- no secret in any message, on any path ------------------------------------------

URL_SECRET = "urlpass-7f3c9e1d"  # the password of a URL's user information
OPTION_SECRET = "optsecret-41b2a8c0"  # a password in storage_options
HEADER_SECRET = "hdrtoken-93d0c6e5"  # an HTTP header value
SECRETS = (URL_SECRET, OPTION_SECRET, HEADER_SECRET)


def _with_userinfo(url: str) -> str:
    return url.replace("http://", f"http://reader:{URL_SECRET}@", 1)


def _http_options(where: str) -> dict:
    """Secrets in the headers, and (without user information in the URL: aiohttp takes
    credentials from one or the other) in the session's default headers."""
    if where == "userinfo":
        return {"headers": {"X-Api-Key": HEADER_SECRET}}
    return {
        "headers": {"Authorization": f"Bearer {HEADER_SECRET}"},
        "client_kwargs": {"headers": {"X-Password": OPTION_SECRET}},
    }


def _texts(err: BaseException) -> list[str]:
    """str and repr of ``err`` and of every exception chained to it (``__cause__``,
    ``__context__``, members of groups), and the traceback as printed."""
    import traceback

    texts = ["".join(traceback.format_exception(err))]
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        texts += [str(e), repr(e), str(getattr(e, "args", ""))]
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return texts


def _closed_url() -> str:
    return f"http://127.0.0.1:{_free_port()}/one.zarr"  # nothing listens there


def _open(url: str, options: dict) -> xr.Dataset:
    return xr.open_dataset(url, engine="gds-zarr", device="cpu", storage_options=options)


def _read_t(faulty, fault: str, url_of, options: dict) -> None:
    server = faulty(fault)
    _open(url_of(server.url), options).t.load()


def _read_after_stop(faulty, url_of, options: dict) -> None:
    server = faulty("none")
    ds = _open(url_of(server.url), options)
    server.stop()
    ds.load()


def _write(url_of, options: dict) -> None:
    import xarray_gds

    url = url_of(_closed_url()).replace("one.zarr", "new.zarr")
    xarray_gds.to_zarr(_dataset(), url, storage_options=options, mode="w")


#: path -> (what runs, given faulty, http_root, the URL's rewrite and the options;
#: the error it raises)
SECRET_PATHS = {
    "open-server-down": (lambda f, h, u, o: _open(u(_closed_url()), o), ConnectionError),
    "open-403": (lambda f, h, u, o: _open(u(f"{h}/private/one.zarr"), o), PermissionError),
    "open-missing": (lambda f, h, u, o: _open(u(f"{h}/absent.zarr"), o), FileNotFoundError),
    "read-403": (lambda f, h, u, o: _read_t(f, "forbid", u, o), PermissionError),
    "read-500": (lambda f, h, u, o: _read_t(f, "fail", u, o), OSError),
    "read-truncated": (lambda f, h, u, o: _read_t(f, "truncate", u, o), ConnectionError),
    "read-server-gone": (lambda f, h, u, o: _read_after_stop(f, u, o), ConnectionError),
    "write-server-down": (lambda f, h, u, o: _write(u, o), OSError),
}


@pytest.mark.parametrize("where", ["userinfo", "options"])
@pytest.mark.parametrize("path", SECRET_PATHS)
def test_no_secret_in_any_error_log_or_warning(faulty, http_root, caplog, where, path):
    """Every error path, with a secret in the URL's user information or in an auth
    object of storage_options, and in the headers: none of them in the error, its
    repr, the exceptions chained to it, the printed traceback, the logs (every logger
    at DEBUG) or the warnings."""
    import logging
    import warnings

    caplog.set_level(logging.DEBUG)
    url_of = _with_userinfo if where == "userinfo" else (lambda url: url)
    run, kind = SECRET_PATHS[path]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(kind) as err:
            run(faulty, http_root, url_of, _http_options(where))
    texts = _texts(err.value)
    texts += [caplog.text, *(r.getMessage() for r in caplog.records)]
    texts += [str(w.message) for w in caught]
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, (secret, text)
    if path.startswith(("open", "read")):  # it names the URL, without the password
        shown = "http://***@127.0.0.1:" if where == "userinfo" else "'http://127.0.0.1:"
        assert shown in str(err.value)


def test_no_secret_in_retry_logs_with_userinfo(faulty, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    server = faulty("fail")
    ds = _open(_with_userinfo(server.url), _http_options("userinfo"))
    with pytest.raises(OSError, match=r"after 3 tries") as err:
        ds.t.load()
    retries = [r.getMessage() for r in caplog.records if r.name == "xarray_gds.stores.remote"]
    assert any("try 2 of 3 failed (ClientResponseError: 500" in m for m in retries), retries
    assert any("'http://***@127.0.0.1:" in m for m in retries), retries
    for text in [*retries, caplog.text, *_texts(err.value)]:
        for secret in SECRETS:
            assert secret not in text


@pytest.mark.parametrize("where", ["userinfo", "options"])
@pytest.mark.parametrize("case", ["ok", "server-down", "missing-group"])
def test_no_secret_in_info(http_root, capsys, caplog, where, case):
    """``xarray-gds info`` (its output, its errors, the group listing of a missing
    group) with a secret in the URL and in a header."""
    import logging

    from xarray_gds.tools import cli

    caplog.set_level(logging.DEBUG)
    base = _closed_url() if case == "server-down" else f"{http_root}/one.zarr"
    url = _with_userinfo(base) if where == "userinfo" else base
    argv = ["info", url, "--storage-option", f"headers.X-Api-Key={HEADER_SECRET}"]
    if where == "options":
        argv += ["--storage-option", f"headers.X-Password={OPTION_SECRET}"]
    if case == "missing-group":
        argv += ["--group", "nope"]
    assert cli.main(argv) == (0 if case == "ok" else 1)
    out = capsys.readouterr()
    shown = base.replace("http://", "http://***@") if where == "userinfo" else base
    if case == "ok":
        assert f"store:        {shown}\n" in out.out
    else:
        assert shown in out.err
    for text in (out.out, out.err, caplog.text):
        for secret in SECRETS:
            assert secret not in text, (secret, text)


def test_no_secret_in_remote_references(http_root, tmp_path, caplog):
    """A kerchunk reference set whose targets are URLs with user information, read
    with a header secret: neither is in the errors of a target that 403s or is gone,
    nor in the store's repr."""
    import json
    import logging

    from xarray_gds.stores.refs import ReferenceStore, ReferenceTargetError

    caplog.set_level(logging.DEBUG)
    meta = {"zarr_format": 2, "shape": [4], "chunks": [4], "dtype": "<i4", "compressor": None}
    meta |= {"fill_value": 0, "filters": None, "order": "C"}
    forbidden = _with_userinfo(f"{http_root}/private/data.bin")
    gone = _with_userinfo(_closed_url().replace("one.zarr", "data.bin"))
    refs = {
        "version": 1,
        "refs": {
            ".zgroup": json.dumps({"zarr_format": 2}),
            "a/.zarray": json.dumps(meta),
            "a/.zattrs": json.dumps({"_ARRAY_DIMENSIONS": ["x"]}),
            "a/0": [forbidden, 0, 16],
            "b/.zarray": json.dumps(meta),
            "b/.zattrs": json.dumps({"_ARRAY_DIMENSIONS": ["x"]}),
            "b/0": [gone, 0, 16],
        },
    }
    refs_file = tmp_path / "refs.json"
    refs_file.write_text(json.dumps(refs))
    options = {"remote_protocol": "http", "remote_options": _http_options("userinfo")}
    ds = xr.open_dataset(refs_file, engine="gds-zarr", device="cpu", storage_options=options)
    texts = [repr(ReferenceStore(str(refs_file), options)), repr(ds)]
    for name, where in (("a", "/private/data.bin"), ("b", "/data.bin")):
        with pytest.raises(ReferenceTargetError, match=rf"reference '{name}/0' points at") as err:
            ds[name].load()
        assert "'http://***@127.0.0.1:" in str(err.value) and where in str(err.value)
        texts += _texts(err.value)
    texts.append(caplog.text)
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, (secret, text)


def test_redact_masks_userinfo_options_and_headers():
    from xarray_gds.stores import urls

    options = {
        "key": "AKIA-0001",
        "client_kwargs": {"auth": aiohttp.BasicAuth("u", OPTION_SECRET)},
        "headers": {"X-Api-Key": HEADER_SECRET, "Accept": "*/*"},
        "remote_options": {"proxy_password": "proxy-pass-1", "sas_token": "sas-token-2"},
    }
    url = f"s3://someone:{URL_SECRET}@bucket/x.zarr"
    text = (
        f"{url} AKIA-0001 {OPTION_SECRET} {HEADER_SECRET} proxy-pass-1 sas-token-2 "
        f"BasicAuth(login='someone', password='{URL_SECRET}') https://a:b%40c@host/p Accept */*"
    )
    assert urls.redact(text, options, url) == (
        "s3://***@bucket/x.zarr *** *** *** *** *** BasicAuth(login='***', "
        "password='***') https://***@host/p Accept */*"
    )
    assert urls.public_url("http://u:p@ss@host:9000/a@b") == "http://***@host:9000/a@b"
    assert urls.public_url("s3://bucket/a@b") == "s3://bucket/a@b"


def test_redact_masks_a_short_secret_where_it_stands_only():
    """A one-letter key is masked as a value, not as letters of other words."""
    from xarray_gds.stores import urls

    options = {"key": "k", "secret": "s3cr", "token": "Bearer tok"}
    text = (
        "s3://bucket/x.zarr: check endpoint_url; key='k' secret=s3cr, k tok "
        "Authorization: Bearer tok; kk sk k_1 (k)"
    )
    assert urls.redact(text, options) == (
        "s3://bucket/x.zarr: check endpoint_url; key='***' secret=***, *** *** "
        "Authorization: ***; kk sk k_1 (***)"
    )


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_unreachable_http_url_never_suggests_aws_settings(scheme):
    url = _closed_url().replace("http://", f"{scheme}://")
    with pytest.raises(ConnectionError, match="the server cannot be reached") as err:
        _open(url, {})
    text = str(err.value)
    assert url in text and "check the URL (host and port)" in text
    assert "AWS" not in text and "endpoint_url" not in text


def test_write_to_unreachable_s3_endpoint_is_classified():
    """xarray_gds.to_zarr to an S3 endpoint nobody listens on: a ConnectionError that
    names the store and the setting to check, as a read says it; no credential in it."""
    import xarray_gds

    options = {
        "key": KEY,
        "secret": SECRET,
        "endpoint_url": f"http://127.0.0.1:{_free_port()}",
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    with pytest.raises(ConnectionError) as err:
        xarray_gds.to_zarr(_dataset(), "s3://data/new.zarr", storage_options=options, mode="w")
    text = str(err.value)
    assert text.startswith("cannot write to the remote Zarr store 's3://data/new.zarr': ")
    assert "the endpoint cannot be reached: check endpoint_url (or AWS_ENDPOINT_URL)" in text
    assert err.value.__cause__ is None and err.value.__context__ is None
    for shown in _texts(err.value):
        assert KEY not in shown and SECRET not in shown


def test_a_listing_of_100_objects_asks_for_one_page(s3, monkeypatch):
    """listings ``pages = max(1, -(-len(keys) // 100) * LIST_PAGES_PER_100)`` (``-len(keys)``
    -> ``~len(keys)``, ``// 100`` -> ``// 99``, ``*`` -> ``|`` or ``^``): 100 objects wanted
    are one page's worth and the 101st makes two, through s3fs and through obstore alike;
    with pages of 40 objects the listing of 100 stops after the first 40, that of 101
    after the first 80; with pages of 1,000 the listing of 101 ends within its two pages
    (``except StopAsyncIteration`` in obstore's) and is whole, and a listing of a
    directory with no object in it is whole and empty (``return True`` there)."""
    from zarr.storage import FsspecStore

    from xarray_gds.backend import open_store
    from xarray_gds.stores import listings

    url = "s3://data/hundred.zarr"
    many = xr.Dataset({"m": (("i",), np.arange(101.0))})
    many.to_zarr(url, storage_options=s3, encoding={"m": {"chunks": (1,)}}, consolidated=False)
    fs = s3fs.S3FileSystem(**s3)
    keys = sorted(k[len(url) - 5 + 1 :] for k in fs.find(f"{url[5:]}/m/c"))
    assert len(keys) == 101
    for store in (
        FsspecStore.from_url(url, storage_options=s3, read_only=True),
        open_store(url, storage_options=s3),
    ):
        # two pages allowed, one page of objects there: the listing is whole
        none = [f"n/c/{i}" for i in range(listings.LIST_MIN_KEYS)]  # no object there
        empty = listings.list_sizes(store, none)
        assert empty is not None and empty.sizes == {} and all(map(empty.missing, none))
        whole = listings.list_sizes(store, [*keys, "m/c/999"])  # the last one absent
        assert whole is not None and sorted(whole.sizes) == keys
        assert whole.complete_to == "m/c/999" and whole.missing("m/c/999")
        monkeypatch.setattr(listings, "LIST_PAGE", 40)
        one = listings.list_sizes(store, keys[:100])
        assert one is not None and sorted(one.sizes) == keys[:40]
        assert one.complete_to == keys[39]
        two = listings.list_sizes(store, keys)
        assert two is not None and sorted(two.sizes) == keys[:80]
        assert two.complete_to == keys[79]
        monkeypatch.setattr(listings, "LIST_PAGE", 1000)


def test_a_listing_of_a_store_at_the_root_of_its_bucket(s3):
    """listings ``skip = len(root) + 1 if root else 0`` (its ``0`` -> ``1`` or ``-1``): a
    store at the root of its bucket (no path in the bucket) lists its objects under the
    keys the reader asks for, with the sizes the server has."""
    from zarr.storage import FsspecStore

    from xarray_gds.stores import listings

    s3_client(s3["endpoint_url"], KEY, SECRET).create_bucket(Bucket="root-store")
    fs = s3fs.S3FileSystem(**s3)
    url = "s3://root-store"
    ds = xr.Dataset({"m": (("i",), np.arange(12.0))})
    ds.to_zarr(url, storage_options=s3, encoding={"m": {"chunks": (1,)}}, consolidated=False)
    keys = sorted(k[len("root-store/") :] for k in fs.find("root-store/m/c"))
    assert len(keys) == 12 and keys[0] == "m/c/0"
    store = FsspecStore.from_url(url, storage_options=s3, read_only=True)
    listing = listings.list_sizes(store, keys)
    assert listing is not None
    assert listing.sizes == {k: fs.size(f"root-store/{k}") for k in keys}


def test_a_listing_asks_for_the_keys_whole_common_directory(s3, s3_store, monkeypatch):
    """listings ``return low[: low.rfind("/", 0, n) + 1]`` (its ``+ 1`` -> ``+ 0``,
    ``- 1``, ``| 1``, ``^ 1``, ``& 1``, ``>> 1``, ``* 1``, ``** 1``, ``// 1``): a listing
    asks the server for the objects under the longest directory that holds every key
    wanted (ending in ``/``), through s3fs and through obstore alike, so that the
    objects of other arrays and directories beside it take no page."""
    import obstore
    from zarr.storage import FsspecStore

    from xarray_gds.backend import open_store
    from xarray_gds.stores import listings

    fs = s3fs.S3FileSystem(**s3)
    present = sorted(k[len(s3_store) - 5 + 1 :] for k in fs.find(f"{s3_store[5:]}/t/c"))
    asked: list[str] = []
    real_call = s3fs.S3FileSystem._call_s3
    real_list = obstore.list

    async def call_s3(self, method, *args, **kwargs):
        if method == "list_objects_v2":
            asked.append(kwargs["Prefix"])
        return await real_call(self, method, *args, **kwargs)

    def listing(store, prefix=None, **kwargs):
        asked.append(prefix)
        return real_list(store, prefix, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3)
    monkeypatch.setattr(obstore, "list", listing)
    first = [k for k in present if k.startswith("t/c/0/")]
    absent = [f"t/c/0/9/{i}" for i in range(4)]  # keys of no object, wanted too
    assert len(present) >= listings.LIST_MIN_KEYS and len(present) > len(first)
    for keys, directory in ((present, "t/c/"), (first + absent, "t/c/0/")):
        asked.clear()
        fsspec_store = FsspecStore.from_url(s3_store, storage_options=s3, read_only=True)
        for store in (fsspec_store, open_store(s3_store, storage_options=s3)):
            got = listings.list_sizes(store, keys)
            assert got is not None and sorted(got.sizes) == [k for k in keys if k in present]
        assert asked == [f"one.zarr/{directory}", directory]


def test_an_http_store_is_never_listed(monkeypatch):
    """listings ``type(obj).__name__ != "S3Store"`` -> ``>``: an obstore ``HTTPStore``
    (a web server: no listing API) gets no listing request at all, and the reader asks
    for each size; the same number of keys of an ``S3Store`` is listed."""
    import obstore
    from obstore.store import HTTPStore, S3Store
    from zarr.storage import ObjectStore

    from xarray_gds.stores import listings

    asked: list[str] = []

    def listing(store, prefix=None, **kwargs):
        asked.append(type(store).__name__)
        raise OSError("no server here")

    monkeypatch.setattr(obstore, "list", listing)
    keys = [f"v/c/{i}" for i in range(listings.LIST_MIN_KEYS)]
    http = ObjectStore(HTTPStore.from_url("http://127.0.0.1:9/x.zarr"), read_only=True)
    assert listings.list_sizes(http, keys) is None
    assert asked == []
    s3 = ObjectStore(S3Store("bucket", endpoint="http://127.0.0.1:9"), read_only=True)
    assert listings.list_sizes(s3, keys) is None  # refused: each size asked for
    assert asked == ["S3Store"]

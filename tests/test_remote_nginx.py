"""Remote reads through obstore against a real fast server (nginx on 127.0.0.1,
:mod:`xarray_gds.tools.nginx`): the requests an open costs, chunks streamed into the
decoder, a listing the server refuses, and faults (a chunk missing, a chunk refused,
the server stopped in the middle of a read, a certificate not trusted), each compared
with ``engine="zarr"``."""

from __future__ import annotations

import collections
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from xarray_gds.tools.nginx import Nginx, serve

from ._nginx import require_nginx
from .conftest import write_store

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore::zarr.errors.ZarrUserWarning"),
]
obstore = pytest.importorskip("obstore", reason="the remote route's client (remote extra)")

#: a chunk of the streamed store that the server refuses (403)
FORBIDDEN = "bucket/refused.zarr/t/c/1/0/0"
#: the chunk removed from the streamed store's copy (404)
HOLE = "t/c/2/1/0"


def _big(path: Path) -> Path:
    """A float32 store of 3 x 2 x 2 chunks of 512 KiB (large enough to be streamed),
    with a chunk that holds only the fill value (never written)."""
    rng = np.random.default_rng(3)
    t = rng.standard_normal((24, 256, 256)).astype("f4").round(2)
    t[:8, :128, 128:] = np.nan  # chunk 0/0/1: every value the fill value
    ds = xr.Dataset({"t": (("time", "y", "x"), t)}, coords={"time": np.arange(24)})
    encoding = {"t": {"chunks": (8, 128, 128), "_FillValue": np.float32("nan")}}
    ds.to_zarr(path, mode="w", zarr_format=3, encoding=encoding, consolidated=True)
    return path


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    require_nginx()
    root = tmp_path_factory.mktemp("served")
    for zarr_format in (2, 3):
        write_store(root / "bucket" / f"v{zarr_format}.zarr", zarr_format, "zstd")
    big = _big(root / "bucket" / "big.zarr")
    shutil.copytree(big, root / "bucket" / "holes.zarr")
    (root / "bucket" / "holes.zarr" / HOLE).unlink()
    shutil.copytree(big, root / "bucket" / "refused.zarr")
    with serve(root, forbidden=(FORBIDDEN,)) as server:
        yield server


def _s3(server: Nginx) -> dict[str, str]:
    """storage_options of the server as a path-style S3 endpoint (nginx ignores the
    signature)."""
    return {"endpoint_url": server.http, "key": "AKIATESTKEY", "secret": "test-secret-0123"}


def _local(server: Nginx, name: str) -> xr.Dataset:
    return xr.open_dataset(server.root / "bucket" / name, engine="zarr").load()


def _zarr_obstore(server: Nginx, name: str) -> xr.Dataset:
    """engine="zarr" over zarr's ObjectStore of obstore's S3Store (s3fs cannot read
    from a server without listings)."""
    from obstore.store import S3Store

    store = S3Store(
        "bucket",
        prefix=name,
        endpoint=server.http,
        access_key_id="AKIATESTKEY",
        secret_access_key="test-secret-0123",
        region="us-east-1",
        client_options={"allow_http": True},
    )
    return xr.open_dataset(zarr.storage.ObjectStore(store, read_only=True), engine="zarr")


def _opened(server: Nginx, engine: str, scheme: str, name: str) -> list[str]:
    """The requests (``METHOD URI``) of one open_dataset of store ``name``."""
    server.clear()
    if scheme == "http":
        kwargs = {"device": "cpu"} if engine == "gds-zarr" else {}
        xr.open_dataset(f"{server.http}/bucket/{name}", engine=engine, **kwargs)
    elif engine == "gds-zarr":
        url = f"s3://bucket/{name}"
        xr.open_dataset(url, engine=engine, device="cpu", storage_options=_s3(server))
    else:
        _zarr_obstore(server, name)
    return [f"{r.method} {r.uri.split('?')[0]}" for r in server.requests()]


@pytest.mark.parametrize("scheme", ["http", "s3"])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_open_costs_no_more_requests_than_zarr(nginx: Nginx, scheme: str, zarr_format: int):
    """Opening asks the server for each metadata document once (the engine's check that
    a store is there, the consolidated metadata and xarray's open of the group share
    what was read), and no more requests in all than engine="zarr"."""
    name = f"v{zarr_format}.zarr"
    ours = _opened(nginx, "gds-zarr", scheme, name)
    theirs = _opened(nginx, "zarr", scheme, name)
    assert len(ours) <= len(theirs)
    metadata = [r for r in ours if r.rsplit("/", 1)[-1] in ("zarr.json", ".zmetadata", ".zgroup")]
    assert max(collections.Counter(metadata).values()) == 1
    assert all(r.startswith("GET ") for r in ours)  # no HEAD, no listing
    # exactly what engine="zarr" asks for: its four documents, then the coordinates
    assert collections.Counter(ours) == collections.Counter(theirs)


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_streamed_chunks_equal_zarr(nginx: Nginx, scheme: str):
    """Chunks large enough to be streamed: every chunk one GET (no HEAD before it, no
    listing), read while others decode, values equal to engine="zarr"'s."""
    if scheme == "http":
        ds = xr.open_dataset(f"{nginx.http}/bucket/big.zarr", engine="gds-zarr", device="cpu")
    else:
        ds = xr.open_dataset(
            "s3://bucket/big.zarr", engine="gds-zarr", device="cpu", storage_options=_s3(nginx)
        )
    nginx.clear()
    got = ds.load()
    xr.testing.assert_identical(got, _local(nginx, "big.zarr"))
    chunks = sorted((r.uri, r.method, r.status) for r in nginx.requests() if "/t/c/" in r.uri)
    grid = [f"t/c/{i}/{j}/{k}" for i in range(3) for j in range(2) for k in range(2)]
    never_written = "t/c/0/0/1"  # all fill values: asked for, 404, the fill value
    assert chunks == [
        (f"/bucket/big.zarr/{k}", "GET", 404 if k == never_written else 200) for k in grid
    ]


def _keys(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in (store / "t" / "c").rglob("*") if p.is_file())


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_missing_chunk_is_the_fill_value_as_with_zarr(nginx: Nginx, scheme: str):
    """A chunk the server does not have (404) in a store whose listing the server
    refuses reads as the fill value, as engine="zarr" reads it; the listing is never
    taken for an empty one (every other chunk is read)."""
    if scheme == "http":
        url = f"{nginx.http}/bucket/holes.zarr"
        ours = xr.open_dataset(url, engine="gds-zarr", device="cpu").load()
        theirs = xr.open_dataset(url, engine="zarr").load()
    else:
        opts = _s3(nginx)
        ours = xr.open_dataset(
            "s3://bucket/holes.zarr", engine="gds-zarr", device="cpu", storage_options=opts
        ).load()
        theirs = _zarr_obstore(nginx, "holes.zarr").load()
    xr.testing.assert_identical(ours, theirs)
    assert int(np.isnan(ours.t.values).sum()) == 2 * 8 * 128 * 128  # two chunks of fill
    whole = _local(nginx, "big.zarr")
    np.testing.assert_array_equal(ours.t.values[:16], whole.t.values[:16])


def test_listing_refused_is_unavailable_not_empty(nginx: Nginx):
    """The device route's sizes from a listing: a server that refuses listings (501)
    gives no listing at all, never an empty one (which would make every chunk a fill
    value)."""
    from xarray_gds.backend import open_store
    from xarray_gds.stores import listings

    store = open_store("s3://bucket/big.zarr", storage_options=_s3(nginx))
    keys = _keys(nginx.root / "bucket" / "big.zarr")
    assert len(keys) >= listings.LIST_MIN_KEYS
    nginx.clear()
    assert listings.list_sizes(store, keys) is None
    assert [(r.method, r.status) for r in nginx.requests()] == [("GET", 501)]


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_refused_chunk_is_an_access_error(nginx: Nginx, scheme: str):
    """A chunk the server refuses (403) is an access error naming the chunk and the
    store, never the fill value, and is not asked for again."""
    if scheme == "http":
        url = f"{nginx.http}/bucket/refused.zarr"
        ds = xr.open_dataset(url, engine="gds-zarr", device="cpu")
    else:
        url = "s3://bucket/refused.zarr"
        ds = xr.open_dataset(url, engine="gds-zarr", device="cpu", storage_options=_s3(nginx))
    nginx.clear()
    with pytest.raises(
        PermissionError,
        match=rf"chunk 't/c/1/0/0' of the remote Zarr store '{re.escape(url)}': access "
        r"denied \(HTTP 403\): check the credentials",
    ) as info:
        ds.t.load()
    assert "test-secret-0123" not in str(info.value)
    refused = [r for r in nginx.requests() if r.uri == f"/{FORBIDDEN}"]
    assert [(r.method, r.status) for r in refused] == [("GET", 403)]


def test_server_stopped_in_the_middle_of_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stops while a streamed read is going (as the first chunk decodes):
    the read fails within a bounded time with a ConnectionError naming a chunk and
    the store, after the bounded tries, and the reads still queued are cancelled."""
    from xarray_gds import decode
    from xarray_gds.stores import urls

    require_nginx()
    big = _big(tmp_path / "big.zarr")
    with serve(tmp_path, tls=False) as server:
        url = f"{server.http}/big.zarr"
        ds = xr.open_dataset(url, engine="gds-zarr", device="cpu")
        real = decode.decode_fetched

        def stop_then_decode(*args, **kwargs):
            server.stop()
            return real(*args, **kwargs)

        monkeypatch.setattr(decode, "decode_fetched", stop_then_decode)
        started = time.monotonic()
        with (
            zarr.config.set({"async.concurrency": 2}),
            pytest.raises(
                ConnectionError,
                match=rf"chunk 't/c/\d/\d/\d' of the remote Zarr store '{url}' after "
                rf"{urls.READ_ATTEMPTS} tries: the server cannot be reached.*check that "
                r"it is up and the URL",
            ),
        ):
            ds.t.load()
        assert time.monotonic() - started < 30
    assert len(_keys(big)) == 11  # 12 chunks, one of them never written


def test_certificate_trusted_through_ssl_cert_file(
    nginx: Nginx, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTPS: a certificate signed by an authority the client does not know is an error
    that says so (and what to give); with that authority in SSL_CERT_FILE the store
    reads as engine="zarr" reads it over HTTP."""
    assert nginx.https is not None and nginx.cafile is not None
    url = f"{nginx.https}/bucket/v3.zarr"
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(ConnectionError, match=r"TLS certificate is not trusted.*SSL_CERT_FILE"):
        xr.open_dataset(url, engine="gds-zarr", device="cpu")
    monkeypatch.setenv("SSL_CERT_FILE", str(nginx.cafile))
    ours = xr.open_dataset(url, engine="gds-zarr", device="cpu").load()
    xr.testing.assert_identical(ours, _local(nginx, "v3.zarr"))


# --- which client opens what ---------------------------------------------------------


def test_storage_options_map_to_obstore(monkeypatch: pytest.MonkeyPatch) -> None:
    """s3fs's and fsspec's HTTP options as obstore's configuration; the options only
    fsspec understands (and credentials only botocore finds) leave the URL to fsspec."""
    aiohttp = pytest.importorskip("aiohttp")
    from xarray_gds.stores.objstore import obstore_for

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    s3 = obstore_for(
        "s3://bucket/path/x.zarr",
        {
            "key": "k1",
            "secret": "s1",
            "token": "t1",
            "endpoint_url": "http://127.0.0.1:9000",
            "client_kwargs": {"region_name": "eu-west-1"},
            "config_kwargs": {"read_timeout": 7, "retries": {"max_attempts": 2}},
        },
    )
    assert type(s3).__name__ == "S3Store" and s3.prefix == "path/x.zarr"
    config = dict(s3.config)
    assert str(config.pop("virtual_hosted_style_request")).lower() == "false"  # path style
    assert config == {
        "bucket": "bucket",
        "access_key_id": "k1",
        "secret_access_key": "s1",
        "session_token": "t1",
        "endpoint": "http://127.0.0.1:9000",
        "region": "eu-west-1",
    }
    anon = obstore_for("s3://bucket/x.zarr", {"anon": True})
    assert str(anon.config["skip_signature"]).lower() == "true"
    assert anon.config["region"] == "us-east-1"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "envkey")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "envsecret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://minio.example.org")
    env = obstore_for("s3://bucket/x.zarr", None)
    assert env.config["access_key_id"] == "envkey"
    assert env.config["endpoint"] == "https://minio.example.org"
    http = obstore_for(
        "https://example.org/data/x.zarr",
        {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=3)}, "headers": {"X": "y"}},
    )
    assert type(http).__name__ == "HTTPStore" and http.url == "https://example.org/data/x.zarr"
    # fsspec's own: aiohttp's auth, basic auth in the URL, a profile, no credentials
    auth = {"client_kwargs": {"auth": ("user", "password")}}
    assert obstore_for("https://h/x.zarr", auth) is None
    assert obstore_for("https://h/x.zarr", {"encoded": True}) is None
    assert obstore_for("https://user:pw@h/x.zarr", None) is None
    assert obstore_for("s3://bucket/x.zarr", {"profile": "dev"}) is None
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert obstore_for("s3://bucket/x.zarr", None) is None  # botocore finds (or not)


def test_fsspec_still_opens_what_obstore_cannot(nginx: Nginx) -> None:
    """An option only fsspec takes: the URL is opened through fsspec, and reads the
    same."""
    from zarr.storage import FsspecStore

    from xarray_gds.backend import open_store

    url = f"{nginx.http}/bucket/v3.zarr"
    options = {"encoded": True}  # fsspec's HTTP filesystem: URLs sent as they are
    assert isinstance(open_store(url, storage_options=options), FsspecStore)
    ours = xr.open_dataset(url, engine="gds-zarr", device="cpu", storage_options=options)
    xr.testing.assert_identical(ours.load(), _local(nginx, "v3.zarr"))


def test_bench_remote_cases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The host-remote-* cases run here (nginx started and stopped by the case) and
    report the engine against the faster engine="zarr"; the GPU cases skip without a
    GPU."""
    import json

    require_nginx()
    from xarray_gds import device
    from xarray_gds.tools import cli

    out = tmp_path / "bench.json"
    argv = ["bench", "--case", "host-remote-http", "--case", "host-remote-s3"]
    argv += ["--case", "remote-http-4MB", "--size-gb", "0.04", "--repeat", "1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    gpu = device.cuda_status()[0]
    ran = 3 if gpu else 2  # remote-http-4MB runs where there is a GPU
    # each case's table, then every case's
    assert text.count("gds-zarr vs the faster other: ") == 2 * ran
    results = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert len(results) == ran
    bounds = {"gds-zarr", "zarr (obstore)", "raw GETs", "gds-zarr local file"}
    assert set(results["host-remote-http"]["seconds"]) == bounds | {"zarr (fsspec)"}
    # s3fs cannot read from a server that refuses listings: said, not timed
    assert set(results["host-remote-s3"]["seconds"]) == bounds
    assert "zarr (fsspec) not run" in results["host-remote-s3"]["note"]
    if gpu:
        assert set(results["remote-http-4MB"]["seconds"]) == bounds | {"zarr (fsspec)"}
    else:
        assert "remote-http-4MB: skipped: needs a GPU" in text

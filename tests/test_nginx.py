"""Reads over HTTP(S) from a real server: Debian's nginx on 127.0.0.1 (tests/_nginx.py),
compared with ``engine="zarr"`` over the same URLs."""

from __future__ import annotations

import os
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import xarray as xr

from ._nginx import Nginx, require_nginx, serve
from .conftest import write_store

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore::zarr.errors.ZarrUserWarning"),
]
pytest.importorskip("aiohttp", reason="fsspec's HTTP filesystem needs aiohttp")


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    require_nginx()
    root = tmp_path_factory.mktemp("served")
    for zarr_format in (2, 3):
        write_store(root / "bucket" / f"v{zarr_format}.zarr", zarr_format, "zstd")
    (root / "private").mkdir()
    write_store(root / "private" / "v3.zarr", 3, "zstd")
    with serve(root) as server:
        yield server


def _get(url: str, **kwargs: object) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10, **kwargs) as response:  # type: ignore[arg-type]
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


def test_server_serves_ranges_and_refuses_listing(nginx: Nginx) -> None:
    path = nginx.root / "bucket" / "v3.zarr" / "zarr.json"
    whole = path.read_bytes()
    request = urllib.request.Request(
        f"{nginx.http}/bucket/v3.zarr/zarr.json",
        headers={"Range": "bytes=2-9", "Authorization": "AWS4-HMAC-SHA256 Credential=k"},
    )
    assert _get(request) == (206, whole[2:10])  # type: ignore[arg-type]
    # listings are errors, never empty answers
    assert _get(f"{nginx.http}/bucket?list-type=2&prefix=v3.zarr/")[0] == 501
    assert _get(f"{nginx.http}/bucket/v3.zarr/")[0] == 403
    assert _get(f"{nginx.http}/private/v3.zarr/zarr.json")[0] == 403
    context = ssl.create_default_context(cafile=str(nginx.cafile))
    assert nginx.https is not None
    assert _get(f"{nginx.https}/bucket/v3.zarr/zarr.json", context=context) == (200, whole)
    nginx.clear()
    _get(f"{nginx.http}/bucket/v2.zarr/.zgroup")
    assert [(r.method, r.uri, r.status) for r in nginx.requests()] == [
        ("GET", "/bucket/v2.zarr/.zgroup", 200)
    ]


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_http_reads_equal_zarr(nginx: Nginx, zarr_format: int) -> None:
    url = f"{nginx.http}/bucket/v{zarr_format}.zarr"
    ours = xr.open_dataset(url, engine="gds-zarr", device="cpu").load()
    ref = xr.open_dataset(url, engine="zarr").load()
    xr.testing.assert_identical(ours, ref)
    assert {type(v.data).__module__.split(".")[0] for v in ours.variables.values()} == {"numpy"}


def test_forbidden_store_is_an_access_error(nginx: Nginx) -> None:
    url = f"{nginx.http}/private/v3.zarr"
    with pytest.raises(PermissionError, match=r"private/v3\.zarr.*403"):
        xr.open_dataset(url, engine="gds-zarr", device="cpu")


def test_untrusted_certificate_names_the_url(nginx: Nginx) -> None:
    assert nginx.https is not None
    url = f"{nginx.https}/bucket/v3.zarr"
    with pytest.raises(
        ConnectionError, match=r"TLS certificate is not trusted.*SSL_CERT_FILE"
    ) as info:
        xr.open_dataset(url, engine="gds-zarr", device="cpu")
    assert url in str(info.value)


def test_server_stops_by_its_pid(tmp_path: Path) -> None:
    require_nginx()
    with serve(tmp_path, tls=False) as server:
        port = int(server.http.rsplit(":", 1)[1])
        pid = server.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass

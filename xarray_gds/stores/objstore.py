"""The obstore client of remote stores: ``s3://`` and ``http(s)://`` URLs opened as zarr
:class:`~zarr.storage.ObjectStore`\\ s over obstore's ``S3Store`` / ``HTTPStore``
(object_store, in Rust: requests leave without the GIL, many in flight, one ``GET`` a
chunk and no ``HEAD`` before it).

:func:`obstore_for` maps the ``storage_options`` users give for s3fs and fsspec's HTTP
filesystem (``key``, ``secret``, ``token``, ``anon``, ``endpoint_url``,
``client_kwargs`` region and timeouts, ``config_kwargs`` timeouts, ``headers``, the
``AWS_*`` environment variables) to obstore's configuration, or says that it cannot
(an option only fsspec understands, credentials that only botocore finds): the URL is
then opened through fsspec as before. :class:`RemoteObjectStore` is the zarr store,
with the metadata it read while it was being opened held until the open ends
(:meth:`RemoteObjectStore.finish_open`). :func:`as_error` turns obstore's errors into
the Python errors the engine classifies (missing, refused, unreachable, cut short,
too slow, an untrusted certificate).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from zarr.storage import ObjectStore

from xarray_gds.stores.urls import ShortBody

__all__ = [
    "BodyCut",
    "HttpStatus",
    "Prefetch",
    "RemoteObjectStore",
    "Unreachable",
    "UntrustedCertificate",
    "as_error",
    "available",
    "fetch",
    "inner",
    "obstore_for",
    "options_of",
    "store_url",
]

#: the total time of one request when storage_options set none: aiohttp's default (the
#: fsspec route's), not obstore's 30 s (a large chunk on a slow link may need more)
DEFAULT_TIMEOUT = timedelta(minutes=5)
#: the time to connect when storage_options set none
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=10)

#: storage_options of fsspec's filesystems that change nothing obstore does differently
#: (caches of listings and blocks, the instance cache): taken and ignored
_IGNORED = frozenset(
    {
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "skip_instance_cache",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "cache_regions",
        "block_size",
        "cache_type",
        "cache_options",
        "simple_links",
        "same_scheme",
        "size_policy",
        "asynchronous",
    }
)


def available() -> bool:
    """Whether obstore is installed."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def _seconds(value: Any) -> timedelta | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return timedelta(seconds=float(value))


def _http_timeouts(timeout: Any, client: dict[str, Any]) -> bool:
    """``client_kwargs["timeout"]`` (seconds, or an ``aiohttp.ClientTimeout``) as
    obstore's client options; False for a value it cannot take."""
    if timeout is None:
        return True
    total = _seconds(timeout)
    if total is not None:
        client["timeout"] = total
        return True
    if type(timeout).__name__ != "ClientTimeout":
        return False
    for name, option in (
        ("total", "timeout"),
        ("connect", "connect_timeout"),
        ("sock_connect", "connect_timeout"),
        ("sock_read", "read_timeout"),
    ):
        value = _seconds(getattr(timeout, name, None))
        if value is not None:
            client[option] = value
    return True


def _headers(headers: Any, client: dict[str, Any]) -> bool:
    if headers is None:
        return True
    if not isinstance(headers, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        return False
    client["default_headers"] = {**client.get("default_headers", {}), **headers}
    return True


def _http_config(url: str, options: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    authority = url.split("://", 1)[1].split("/", 1)[0]
    if "@" in authority:  # user information: aiohttp's basic auth
        return None
    client: dict[str, Any] = {}
    for name, value in options.items():
        if name in _IGNORED:
            continue
        if name == "headers":
            if not _headers(value, client):
                return None
        elif name == "client_kwargs" and isinstance(value, dict):
            for kw, v in value.items():
                if kw == "timeout":
                    if not _http_timeouts(v, client):
                        return None
                elif kw == "headers":
                    if not _headers(v, client):
                        return None
                elif kw != "trust_env":  # reqwest reads the proxy variables itself
                    return None  # an ssl context, auth, a connector: aiohttp's own
        else:
            return None
    return "http", client


def _aws_env(name: str) -> str | None:
    return os.environ.get(name) or None


def _s3_config(url: str, options: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    config: dict[str, Any] = {}
    client: dict[str, Any] = {}
    key = options.get("key")
    secret = options.get("secret")
    token = options.get("token")
    anon = bool(options.get("anon", False))
    endpoint = options.get("endpoint_url")
    region = None
    for name, value in options.items():
        if name in _IGNORED or name in ("key", "secret", "token", "anon", "endpoint_url"):
            continue
        if name == "client_kwargs" and isinstance(value, dict):
            for kw, v in value.items():
                if kw == "region_name":
                    region = v
                elif kw == "endpoint_url":
                    endpoint = v
                elif kw == "aws_access_key_id":
                    key = v
                elif kw == "aws_secret_access_key":
                    secret = v
                elif kw == "aws_session_token":
                    token = v
                elif kw == "verify" and v is False:
                    client["allow_invalid_certificates"] = True
                else:
                    return None
        elif name == "config_kwargs" and isinstance(value, dict):
            for kw, v in value.items():
                if kw in ("read_timeout", "connect_timeout"):
                    seconds = _seconds(v)
                    if seconds is None:
                        return None
                    client["read_timeout" if kw == "read_timeout" else "connect_timeout"] = seconds
                elif kw == "retries":
                    continue  # the engine's own tries (see urls.READ_ATTEMPTS)
                elif kw == "s3" and isinstance(v, dict) and set(v) <= {"addressing_style"}:
                    style = v.get("addressing_style")
                    config["virtual_hosted_style_request"] = style == "virtual"
                else:
                    return None
        else:
            return None
    if anon:
        config["skip_signature"] = True
    elif key and secret:
        if not token and _aws_env("AWS_SESSION_TOKEN"):
            return None  # which token goes with these keys is botocore's call
        config.update(access_key_id=key, secret_access_key=secret)
        if token:
            config["session_token"] = token
    elif key or secret or token:
        return None
    elif _aws_env("AWS_ACCESS_KEY_ID") and _aws_env("AWS_SECRET_ACCESS_KEY"):
        config.update(
            access_key_id=_aws_env("AWS_ACCESS_KEY_ID"),
            secret_access_key=_aws_env("AWS_SECRET_ACCESS_KEY"),
        )
        if _aws_env("AWS_SESSION_TOKEN"):
            config["session_token"] = _aws_env("AWS_SESSION_TOKEN")
    else:
        # profiles, config files, instance roles, SSO: botocore (s3fs) finds them, and
        # says so when there are none
        return None
    endpoint = endpoint or _aws_env("AWS_ENDPOINT_URL_S3") or _aws_env("AWS_ENDPOINT_URL")
    if endpoint:
        config["endpoint"] = str(endpoint)
        if str(endpoint).lower().startswith("http://"):
            client["allow_http"] = True
    config["region"] = region or _aws_env("AWS_REGION") or _aws_env("AWS_DEFAULT_REGION")
    if not config["region"]:
        config["region"] = "us-east-1"
    config.setdefault("virtual_hosted_style_request", False)
    return "s3", {"config": config, "client": client}


def obstore_for(url: str, storage_options: dict[str, Any] | None) -> Any | None:
    """An obstore store (``S3Store`` or ``HTTPStore``) for the remote ``url`` with
    ``storage_options`` (s3fs's or fsspec's HTTP filesystem's), or ``None`` where
    obstore is not installed or the options ask for what only fsspec does (see the
    remote stores page of the docs)."""
    if not available():
        return None
    from obstore.store import HTTPStore, S3Store

    options = dict(storage_options or {})
    scheme = url.split("://", 1)[0].lower()
    retry: Any = {"max_retries": 0}  # the engine tries again where it may help
    if scheme in ("http", "https"):
        found = _http_config(url, options)
        if found is None:
            return None
        client: Any = found[1]
        client.setdefault("timeout", DEFAULT_TIMEOUT)
        client.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        if scheme == "http":
            client["allow_http"] = True
        return HTTPStore.from_url(url.rstrip("/"), client_options=client, retry_config=retry)
    if scheme in ("s3", "s3a"):
        s3 = _s3_config(url, options)
        if s3 is None:
            return None
        settings = s3[1]
        bucket, _, prefix = url.split("://", 1)[1].partition("/")
        client = settings["client"]
        client.setdefault("timeout", DEFAULT_TIMEOUT)
        client.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        return S3Store(
            bucket,
            prefix=prefix.strip("/") or None,
            client_options=client,
            retry_config=retry,
            **settings["config"],
        )
    return None


class RemoteObjectStore(ObjectStore):
    """A zarr ``ObjectStore`` opened by the engine from a URL: it knows its URL and the
    storage options it came from (for messages that name the one and hide the secrets
    of the other), and holds the metadata documents read while it is being opened
    (``zarr.json``, ``.zmetadata``, ``.zgroup``, ``.zattrs``, ``.zarray``, their absence
    too) until :meth:`finish_open`: the engine's check that a store is there and the
    reads of zarr and xarray that follow ask the server once for each."""

    def __init__(
        self,
        store: Any,
        *,
        read_only: bool = False,
        url: str = "",
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(store, read_only=read_only)
        self.url = url
        self.options = dict(options or {})
        self._held: dict[str, Any] | None = None

    def __str__(self) -> str:
        return self.url or super().__str__()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def with_read_only(self, read_only: bool = False) -> RemoteObjectStore:
        return type(self)(self.store, read_only=read_only, url=self.url, options=self.options)

    def start_open(self) -> None:
        """Hold the metadata documents read from now on, until :meth:`finish_open`."""
        self._held = {}

    def finish_open(self) -> None:
        """Read every document from the server again from now on."""
        self._held = None

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        held = self._held
        if held is None or byte_range is not None or not _is_metadata(key):
            return await super().get(key, prototype, byte_range)
        if key not in held:
            held[key] = await super().get(key, prototype)
        return held[key]

    async def exists(self, key: str) -> bool:
        held = self._held
        if held is not None and key in held:
            return held[key] is not None
        return await super().exists(key)


_METADATA = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")


def _is_metadata(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in _METADATA


def inner(store: Any) -> Any | None:
    """The obstore ``S3Store`` or ``HTTPStore`` of a zarr ``ObjectStore``, or None."""
    if not isinstance(store, ObjectStore):
        return None
    found = store.store
    if type(found).__name__ in ("S3Store", "HTTPStore"):
        return found
    return None


def store_url(store: Any) -> str:
    """The URL of an ``ObjectStore`` over ``S3Store`` / ``HTTPStore`` (its own, for a
    :class:`RemoteObjectStore`)."""
    if isinstance(store, RemoteObjectStore) and store.url:
        return store.url.rstrip("/")
    obj = inner(store)
    if obj is None:
        return ""
    if type(obj).__name__ == "HTTPStore":
        return str(obj.url).rstrip("/")
    prefix = str(obj.prefix or "").strip("/")
    bucket = (obj.config or {}).get("bucket", "")
    return f"s3://{bucket}/{prefix}".rstrip("/")


def options_of(store: Any) -> dict[str, Any]:
    """What may hold the secrets of an ``ObjectStore`` (for redaction): the storage
    options it was opened with, and its obstore configuration."""
    found: dict[str, Any] = {}
    if isinstance(store, RemoteObjectStore):
        found["options"] = store.options
    obj = inner(store)
    if obj is not None:
        found["config"] = dict(getattr(obj, "config", None) or {})
        client = dict(getattr(obj, "client_options", None) or {})
        if "default_headers" in client:
            found["headers"] = client["default_headers"]
    return found


# -- errors -------------------------------------------------------------------------------


class HttpStatus(OSError):
    """A request the server answered with an error status (``status``)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class BodyCut(ConnectionError):
    """The connection was closed before the whole body came."""


class UntrustedCertificate(ConnectionError):
    """The server's TLS certificate is not trusted."""


class Unreachable(ConnectionError):
    """The server cannot be reached (refused, reset, no route, no such host)."""


_STATUS = re.compile(r"status code: (\d{3})")
#: obstore's own check of a range's length: "Requested 0..640, got 0..320"
_RANGE = re.compile(r"Requested (\d+)\.\.(\d+), got (\d+)\.\.(\d+)")
_CUT = (
    "IncompleteBody",
    "IncompleteMessage",
    "UnexpectedEof",
    "request or response body error",
    "error decoding response body",
    "end of file before message length reached",
    "connection closed before message completed",
    "error reading a body from connection",
    "unexpected end of file",
)
_CERT = ("InvalidCertificate", "UnknownIssuer", "certificate verify failed", "CertificateRequired")
_TIMEOUT = ("TimedOut", "timed out", "kind: Timeout")
_UNREACHABLE = (
    "Connection refused",
    "ConnectionRefused",
    "ConnectError",
    "tcp connect error",
    "dns error",
    "Connection reset",
    "ConnectionReset",
    "error sending request",
    "No route to host",
)


def _summary(text: str) -> str:
    """obstore's message without its debug dump and the server's HTML error page."""
    text = text.split("\n\nDebug source:", 1)[0]
    text = re.sub(r":\s*<(?:html|!DOCTYPE).*", "", text, flags=re.S | re.I)
    return " ".join(text.split())


def as_error(err: BaseException) -> BaseException:
    """The Python error an obstore error stands for: ``FileNotFoundError`` (404),
    ``PermissionError`` with ``status`` 401/403, :class:`HttpStatus` (another error
    status), :class:`UntrustedCertificate`, ``TimeoutError``, :class:`BodyCut`,
    :class:`Unreachable` or ``OSError``; the message is obstore's first line, without
    its debug dump. Errors that are not obstore's come back as they are."""
    module = type(err).__module__ or ""
    if not module.startswith("obstore") and not (
        isinstance(err, FileNotFoundError) and "Debug source" in str(err)
    ):
        return err
    full = str(err)
    text = _summary(full)
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(text)
    name = type(err).__name__
    if name in ("PermissionDeniedError", "UnauthenticatedError"):
        found = PermissionError(text)
        found.status = 401 if name == "UnauthenticatedError" else 403  # type: ignore[attr-defined]
        return found
    if any(marker in full for marker in _CERT):
        return UntrustedCertificate(text)
    short = _RANGE.search(full)
    if short is not None:
        asked = int(short.group(2)) - int(short.group(1))
        got = int(short.group(4)) - int(short.group(3))
        return ShortBody(f"{got} of the {asked} bytes asked for came")
    status = _STATUS.search(full)
    if status is not None:
        code = int(status.group(1))
        if code == 404:
            return FileNotFoundError(text)
        if code in (401, 403):
            found = PermissionError(text)
            found.status = code  # type: ignore[attr-defined]
            return found
        return HttpStatus(text, code)
    if any(marker in full for marker in _TIMEOUT):
        return TimeoutError(text)
    if any(marker in full for marker in _CUT):
        return BodyCut(text)
    if any(marker in full for marker in _UNREACHABLE):
        return Unreachable(text)
    return OSError(f"{name}: {text}")


# -- reads ---------------------------------------------------------------------------------


async def fetch(obj: Any, key: str, start: int | None = None, size: int | None = None) -> Any:
    """Object ``key`` of the obstore store ``obj``, whole or ``size`` bytes at
    ``start``, as obstore's ``Bytes`` (a buffer); ``None`` when it does not exist.
    obstore's errors are raised as :func:`as_error` makes them."""
    import obstore

    try:
        if start is None:
            got = await obstore.get_async(obj, key)
            return await got.bytes_async()
        if size == 0:
            return b""
        return await obstore.get_range_async(obj, key, start=int(start), length=int(size or 0))
    except FileNotFoundError:
        failure: BaseException | None = None
    except Exception as err:
        failure = as_error(err)
        if isinstance(failure, FileNotFoundError):
            failure = None
    if failure is not None:
        raise failure from None
    return None


class Prefetch:
    """The reads ``read(i)`` of ``n`` items started at once (at most ``limit`` in
    flight) on zarr's event loop, while the calling threads take their results one by
    one as they come (:meth:`get`): reads and decoding overlap. The first read that
    fails for good cancels those still going; every item not read then raises that
    error. :meth:`close` cancels what is left."""

    def __init__(self, read: Callable[[int], Awaitable[Any]], n: int, limit: int) -> None:
        from zarr.core.sync import _get_loop

        self._results: list[concurrent.futures.Future[Any]] = [
            concurrent.futures.Future() for _ in range(n)
        ]
        self._driver = asyncio.run_coroutine_threadsafe(self._run(read, n, limit), _get_loop())

    async def _run(self, read: Callable[[int], Awaitable[Any]], n: int, limit: int) -> None:
        gate = asyncio.Semaphore(max(1, limit))
        results = self._results
        first: BaseException | None = None

        async def one(i: int) -> None:
            async with gate:
                try:
                    value = await read(i)
                except Exception as err:
                    results[i].set_exception(err)
                    raise
            results[i].set_result(value)

        try:
            async with asyncio.TaskGroup() as group:
                for i in range(n):
                    group.create_task(one(i))
        except BaseExceptionGroup as errors:
            first = errors.exceptions[0]
        except asyncio.CancelledError:
            first = OSError("the read was cancelled")
        finally:
            for future in results:
                if not future.done():
                    future.set_exception(first or OSError("the read was cancelled"))

    def get(self, i: int) -> Any:
        """The result of read ``i``, waiting for it; raises its error."""
        return self._results[i].result()

    def close(self) -> None:
        """Cancel the reads still going."""
        self._driver.cancel()

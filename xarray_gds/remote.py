"""Remote Zarr stores (``s3://``, ``http://``, ``https://``): opened through fsspec.

This is the host route: chunk bytes come through zarr's
:class:`~zarr.storage.FsspecStore` (s3fs for S3, fsspec's HTTP filesystem for HTTP)
and are read by the engine's :class:`~xarray_gds.sources.StoreSource`, then decoded
in the same batches as local chunks. Credentials, endpoint and region come from
``storage_options`` as s3fs takes them (``key``, ``secret``, ``token``, ``anon``,
``endpoint_url``, ``client_kwargs={"region_name": ...}``) or from the usual AWS
environment variables and config files (s3fs/botocore read them).

Errors, reprs and logs name the URL and never the credentials (see :func:`redact`):
user information in a URL (``http://user:password@host/...``) is shown as ``***@``,
and the secrets of ``storage_options`` (``key``, ``secret``, ``token``, passwords,
every HTTP header value) as ``***``, on every path (open, read, retry, listing). Chunk
reads on the host route (:func:`read_host`) are tried again when the fault is transient
(a dropped connection, a short body, a timeout, HTTP 5xx), at most :data:`READ_ATTEMPTS`
times in all, and then raise an error naming the URL and the chunk key.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from typing import Any
from urllib.parse import unquote

import numpy as np

__all__ = [
    "READ_ATTEMPTS",
    "is_remote_url",
    "mask_logs",
    "open_url",
    "public_url",
    "read_host",
    "redact",
    "scrubbed",
    "write_error",
]

logger = logging.getLogger(__name__)

#: URL schemes this engine opens as remote stores
REMOTE_SCHEMES = ("s3", "s3a", "http", "https")

#: storage_options keys whose values are secrets
SECRET_KEYS = (
    "key",
    "secret",
    "token",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "password",
    "authorization",  # an HTTP header, e.g. storage_options={"headers": {...}}
)


def is_remote_url(text: str) -> bool:
    """Whether ``text`` is a URL of a remote store this engine opens."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


#: parts of storage_options key names that mark a secret (``proxy_password``,
#: ``sas_token``, ``client_secret``, ``api_key``...)
_SECRET_PARTS = (
    "secret",
    "password",
    "passwd",
    "token",
    "credential",
    "api_key",
    "apikey",
    "authorization",
    "cookie",
)

#: header values shorter than this are not taken for secrets (``"1"`` would otherwise
#: be masked in every port number and chunk key of a message)
_MIN_HEADER_SECRET = 8

#: the user information of a URL: ``scheme://`` then everything up to the last ``@``
#: before the path (a password with a raw ``@`` in it included)
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s'\"<>]*@")


def is_secret_key(name: str) -> bool:
    """Whether a ``storage_options`` key (``a.b.c`` for a nested one) holds a secret:
    one of :data:`SECRET_KEYS`, a name with ``secret``, ``password``, ``token``... in
    it, or any header (``headers.X-Api-Key``)."""
    *parents, last = name.lower().replace("-", "_").split(".")
    if "headers" in parents:
        return True
    return last in SECRET_KEYS or any(part in last for part in _SECRET_PARTS)


def _secrets(storage_options: Any, headers: bool = False) -> list[str]:
    """The secret strings of ``storage_options``: values of secret keys (at any depth),
    every header value of a ``headers`` dict (8 characters or more), the password of
    an auth object (aiohttp's ``BasicAuth``)."""
    found: list[str] = []
    items = storage_options.items() if isinstance(storage_options, dict) else ()
    for name, value in items:
        secret = is_secret_key(str(name)) or str(name).lower() == "auth"
        if isinstance(value, dict):
            found.extend(_secrets(value, headers=str(name).lower() == "headers"))
        elif isinstance(value, str) and value:
            if secret or (headers and len(value) >= _MIN_HEADER_SECRET):
                found.append(value)
        elif isinstance(getattr(value, "password", None), str) and value.password:
            found.append(value.password)  # aiohttp.BasicAuth(login, password)
        elif secret and isinstance(value, tuple | list):  # auth=(user, password)
            found.extend(v for v in value if isinstance(v, str) and len(v) >= 4)
    return found


def _url_secrets(url: str | None) -> list[str]:
    """The user information of ``url`` and its parts (raw and percent-decoded), those
    of 4 characters or more (shorter ones would mask ordinary words of a message)."""
    if not url or "://" not in url:
        return []
    authority = url.split("://", 1)[1].split("/", 1)[0]
    if "@" not in authority:
        return []
    userinfo = authority.rpartition("@")[0]
    user, _, password = userinfo.partition(":")
    parts = {userinfo, user, password, unquote(userinfo), unquote(user), unquote(password)}
    return [p for p in parts if len(p) >= 4]


def public_url(url: str) -> str:
    """``url`` with its user information (``user:password@``) replaced by ``***@``."""
    return _USERINFO.sub(r"\g<scheme>***@", str(url))


def redact(text: str, storage_options: Any = None, url: str | None = None) -> str:
    """``text`` with every credential replaced by ``***``: the secrets of
    ``storage_options`` (see :func:`_secrets`), the user information of every URL in
    it, and that of ``url`` wherever it appears (aiohttp's ``BasicAuth`` repr, say)."""
    text = str(text)
    secrets = _secrets(storage_options) + _url_secrets(url)
    for secret in sorted(secrets, key=len, reverse=True):
        text = _masked(text, secret)
        if secret.lower().startswith(("bearer ", "basic ", "token ")):  # the token alone
            text = _masked(text, secret.split(" ", 1)[1])
    return public_url(text)


def _masked(text: str, secret: str) -> str:
    """``text`` with ``secret`` replaced by ``***`` where it stands as a value of its
    own, not where its characters are part of a longer word: a short key ``"k"`` masks
    ``key='k'``, not the letters of ``bucket`` or ``check``."""
    if not secret:
        return text
    pattern = rf"(?<![A-Za-z0-9_]){re.escape(secret)}(?![A-Za-z0-9_])"
    return re.sub(pattern, "***", text)


def scrubbed(err: BaseException, storage_options: Any, url: str | None) -> BaseException | None:
    """An error of the same kind as ``err`` (``FileNotFoundError``, ``PermissionError``,
    ``ConnectionError``, ``TimeoutError``, ``OSError``, ``ValueError``...) whose text has
    the credentials masked (see :func:`redact`), or ``None`` when ``err``'s text holds
    none. Raise it outside the ``except`` block so that ``err`` is not chained."""
    text = f"{err}"
    clean = redact(text, storage_options, url)
    if clean == text and redact(repr(err), storage_options, url) == repr(err):
        return None
    for kind in (
        FileNotFoundError,
        PermissionError,
        TimeoutError,
        ConnectionError,
        OSError,
        KeyError,
        TypeError,
        ValueError,
    ):
        if isinstance(err, kind):
            return kind(clean)
    return RuntimeError(f"{type(err).__name__}: {clean}")


class _MaskUserinfo(logging.Filter):
    """Masks the user information of URLs in the records of a logger (fsspec's HTTP
    filesystem logs every URL it fetches at DEBUG, ``http://user:password@...`` whole)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = public_url(message)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


#: loggers of the libraries a remote store goes through that log URLs
_URL_LOGGERS = ("fsspec", "fsspec.http", "fsspec.reference", "s3fs", "aiohttp.client")
_MASK = _MaskUserinfo()


def mask_logs() -> None:
    """Install the filter that masks URL user information on the loggers of fsspec,
    s3fs and aiohttp (once; called when a remote store or reference set is opened)."""
    for name in _URL_LOGGERS:
        target = logging.getLogger(name)
        if _MASK not in target.filters:
            target.addFilter(_MASK)


def _fail(
    url: str,
    storage_options: dict[str, Any] | None,
    what: str,
    err: BaseException,
    action: str = "open",
) -> str:
    detail = redact(f"{type(err).__name__}: {err}", storage_options, url)
    return f"cannot {action} the remote Zarr store {public_url(url)!r}: {what} ({detail})"


def _is_s3(url: str) -> bool:
    return url.lower().startswith(("s3://", "s3a://"))


def _unreachable(url: str) -> str:
    """What to check when the server of ``url`` cannot be reached: AWS settings for
    S3 only, never for an HTTP URL."""
    if _is_s3(url):
        return (
            "the endpoint cannot be reached: check endpoint_url (or AWS_ENDPOINT_URL) "
            "and that the server is up"
        )
    return "the server cannot be reached: check the URL (host and port) and that the server is up"


def _untrusted_certificate(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) is a failed check of the
    server's TLS certificate."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, ssl.SSLCertVerificationError) or "Certificate" in type(err).__name__:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _classified(
    url: str, options: dict[str, Any], err: BaseException, action: str = "open"
) -> OSError | None:
    """The error to raise for ``err`` of opening (or writing to) ``url``: its type says
    the kind of fault, its message what to check; ``None`` for a fault of writing that
    is not one of the store's connection or credentials."""
    if "Credential" in type(err).__name__:
        return PermissionError(
            _fail(
                url,
                options,
                "no credentials found: pass storage_options key and "
                "secret, set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or "
                "anon=True for a public bucket",
                err,
                action,
            )
        )
    if _untrusted_certificate(err):
        return ConnectionError(
            _fail(
                url,
                options,
                "the server's TLS certificate is not trusted: give the certificate of "
                "the authority that signed it (the SSL_CERT_FILE environment variable, "
                "or an ssl context in storage_options client_kwargs)",
                err,
                action,
            )
        )
    if "Connect" in type(err).__name__ or isinstance(err, ConnectionError | TimeoutError):
        return ConnectionError(_fail(url, options, _unreachable(url), err, action))
    if action == "open":
        return OSError(_fail(url, options, "reading its metadata failed", err))
    return None


def _with_timeout(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with an HTTP ``client_kwargs`` ``timeout`` given in seconds (as the
    command line gives it) made the ``aiohttp.ClientTimeout(total=...)`` aiohttp takes."""
    kwargs = options.get("client_kwargs")
    if not url.lower().startswith(("http://", "https://")) or not isinstance(kwargs, dict):
        return options
    timeout = kwargs.get("timeout")
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        import aiohttp

        options["client_kwargs"] = dict(kwargs, timeout=aiohttp.ClientTimeout(total=timeout))
    return options


def open_url(url: str, storage_options: dict[str, Any] | None, *, read_only: bool = True) -> Any:
    """A zarr :class:`~zarr.storage.FsspecStore` for a remote ``url``, checked to hold a
    Zarr store (root metadata present) when ``read_only``.

    Raises
    ------
    FileNotFoundError
        No Zarr store at ``url`` (missing bucket or key); the message says which.
    PermissionError
        The server refused access (HTTP 403): check the credentials.
    ConnectionError
        The server cannot be reached: check the URL, and for S3 ``endpoint_url`` /
        ``AWS_ENDPOINT_URL``.
    """
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync
    from zarr.storage import FsspecStore

    options = _with_timeout(url, dict(storage_options or {}))
    shown = public_url(url)
    if shown != url:
        mask_logs()
    # every error is raised outside its ``except`` block, so that the library's own
    # error (whose text may hold the URL's password) is not chained as __context__
    failure: BaseException | None = None
    try:
        store = FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    except ImportError as err:
        failure = ImportError(
            f"reading {shown!r} needs fsspec's filesystem for it "
            f"({redact(str(err), options, url)}); install s3fs for s3:// URLs or aiohttp "
            "for http(s):// URLs"
        )
    except Exception as err:
        failure = _classified(url, options, err) or err
    if failure is not None:
        raise failure from None
    if not read_only:
        return store

    async def probe() -> bool:
        for name in ("zarr.json", ".zmetadata", ".zgroup", ".zarray"):
            if await store.get(name, prototype=cpu.buffer_prototype) is not None:
                return True
        return False

    try:
        found = sync(probe())
    except Exception as err:
        if isinstance(err, PermissionError) or getattr(err, "status", None) in (401, 403):
            failure = PermissionError(
                _fail(
                    url,
                    options,
                    "access denied (HTTP 403): check the credentials "
                    "(storage_options key/secret, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) "
                    "and the bucket's policy",
                    err,
                )
            )
        else:
            failure = _classified(url, options, err) or err
    if failure is not None:
        raise failure from None
    if not found:
        where = "no zarr.json, .zgroup, .zarray or .zmetadata there"
        if _is_s3(url):
            bucket = shown.split("://", 1)[1].split("/", 1)[0]
            try:
                exists = bool(sync(store.fs._exists(bucket)))
            except Exception:
                exists = True
            if not exists:
                where = f"the bucket {bucket!r} does not exist (check the URL and endpoint_url)"
        raise FileNotFoundError(f"No Zarr store at {shown!r}: {where}")
    return store


# -- host route: the store's own get, with bounded retries --------------------------

#: tries of one chunk read on the host route (the first one included)
READ_ATTEMPTS = 3

#: pauses (seconds) before the second and third tries: a dropped connection is
#: usually back at once; a few tenths give a restarting server a moment
_BACKOFF = (0.05, 0.25)

#: exception classes (by name, so neither aiohttp nor botocore is imported here) of
#: faults worth a second try: connections cut or refused, bodies cut short, timeouts
_TRANSIENT = frozenset(
    {
        "ClientPayloadError",  # aiohttp: body shorter than Content-Length
        "ClientConnectionError",  # aiohttp: refused, reset, server disconnected
        "ContentLengthError",
        "IncompleteRead",  # http.client / urllib3
        "ProtocolError",
        "ResponseStreamingError",  # botocore
        "EndpointConnectionError",
        "ConnectionClosedError",
    }
)

#: HTTP statuses worth a second try (never 401/403/404: those do not go away)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class _ShortBody(OSError):
    """A range read that came back with fewer bytes than asked for."""


def _names(err: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(err).__mro__}


def _timeout(err: BaseException) -> bool:
    return isinstance(err, TimeoutError) or any("Timeout" in n for n in _names(err))


def _transient(err: BaseException) -> bool:
    """Whether a failed read may succeed when tried again."""
    if isinstance(err, PermissionError | FileNotFoundError | IsADirectoryError):
        return False
    status = getattr(err, "status", None)
    if isinstance(status, int):
        return status in _TRANSIENT_STATUS
    if isinstance(err, ConnectionError | _ShortBody) or _timeout(err):
        return True
    return bool(_names(err) & _TRANSIENT)


def _retries_itself(store: Any) -> bool:
    """Whether the store's filesystem retries transient faults on its own (s3fs does,
    5 tries with backoff; fsspec's HTTP filesystem does not)."""
    fs = getattr(store, "fs", None)
    protocol = getattr(fs, "protocol", "")
    protocol = protocol if isinstance(protocol, str) else protocol[0]
    return protocol in ("s3", "s3a")


def store_url(store: Any) -> str:
    """The URL of a remote fsspec store (``s3://bucket/path``, ``https://...``), without
    user information."""
    fs = getattr(store, "fs", None)
    path = str(getattr(store, "path", "") or "")
    protocol = getattr(fs, "protocol", "")
    protocol = protocol if isinstance(protocol, str) else protocol[0]
    if "://" not in path and protocol:
        path = f"{protocol}://{path.lstrip('/')}"
    return public_url(path).rstrip("/")  # http://***@host/... for user:password@


def write_error(store: Any, err: BaseException) -> OSError | None:
    """The error to raise for ``err``, raised while writing to ``store``, when ``store``
    is a remote store (``s3://``, ``http(s)://``) and ``err`` is a fault of reaching it or
    of its credentials: classified as opening such a store is (``ConnectionError``,
    ``PermissionError``), its message naming the store without user information or
    secrets and saying what to check. ``None`` for any other error (raise it as it is).
    """
    fs = getattr(store, "fs", None)
    protocol = getattr(fs, "protocol", "")
    protocol = protocol if isinstance(protocol, str) else protocol[0]
    if protocol not in REMOTE_SCHEMES or not isinstance(err, Exception):
        return None
    url = store_url(store)
    options = dict(getattr(fs, "storage_options", None) or {})
    secret_url = str(getattr(store, "path", ""))
    if isinstance(err, PermissionError) or getattr(err, "status", None) in (401, 403):
        what = "access denied: check the credentials and the " + (
            "bucket's policy" if _is_s3(url) else "server's policy"
        )
        detail = redact(f"{type(err).__name__}: {err}", options, secret_url)
        return PermissionError(f"cannot write to the remote Zarr store {url!r}: {what} ({detail})")
    classified = _classified(url, options, err, action="write to")
    if classified is None:
        return None
    classified.args = (redact(str(classified), options, secret_url),)
    return classified


def _read_error(store: Any, key: str, tries: int, err: BaseException) -> OSError:
    """The error of a chunk read that failed for good: its type says what kind of fault
    (``TimeoutError``, ``ConnectionError``, ``PermissionError``, ``OSError``), its
    message names the URL and the chunk key and says what to check."""
    options = dict(getattr(getattr(store, "fs", None), "storage_options", None) or {})
    url = store_url(store)
    s3 = url.startswith(("s3://", "s3a://"))
    where = f"cannot read chunk {key!r} of the remote Zarr store {url!r}"
    after = f" after {tries} tries" if tries > 1 else ""
    detail = redact(f"{type(err).__name__}: {err}", options, str(getattr(store, "path", "")))
    status = getattr(err, "status", None)
    if isinstance(err, PermissionError) or status in (401, 403):
        return PermissionError(
            f"{where}: access denied (HTTP {status or 403}): check the credentials "
            f"and the {'bucket' if s3 else 'server'}'s policy ({detail})"
        )
    if _timeout(err):
        setting = (
            "storage_options config_kwargs={'read_timeout': ..., 'connect_timeout': ...}"
            if s3
            else "storage_options client_kwargs={'timeout': aiohttp.ClientTimeout(total=...)}"
        )
        return TimeoutError(
            f"{where}{after}: the server was too slow (no answer within the timeout): "
            f"raise the timeout ({setting}) or check the server's load ({detail})"
        )
    if isinstance(err, _ShortBody):
        return OSError(
            f"{where}{after}: the server sent fewer bytes than asked for ({err}; no partial "
            "bytes were used): check the server, or a proxy between, honours Range requests"
        )
    if {"ClientPayloadError", "ContentLengthError"} & _names(err):
        return ConnectionError(
            f"{where}{after}: the connection was closed before the whole object came "
            f"(no partial bytes were used): check the server and the network ({detail})"
        )
    if _transient(err):
        hint = "endpoint_url (or AWS_ENDPOINT_URL)" if s3 else "the URL"
        return ConnectionError(
            f"{where}{after}: the server cannot be reached or dropped the connection: "
            f"check that it is up and {hint} ({detail})"
        )
    return OSError(f"{where}{after}: {detail}")


def read_host(
    stores: list[Any],
    keys: list[str],
    ranges: tuple[np.ndarray, np.ndarray] | None = None,
    attempts: int = READ_ATTEMPTS,
) -> list[np.ndarray | None]:
    """Objects ``keys[i]`` of ``stores[i]`` (or ``sizes[i]`` bytes at ``starts[i]`` of
    them, with ``ranges``) read through the stores' ``get``, all in flight at once, as
    uint8 arrays (``None`` for a missing object).

    A read that fails with a transient fault (see :func:`_transient`) is tried again,
    at most ``attempts`` times in all (once where the filesystem retries itself, as
    s3fs does). A body shorter than its Content-Length raises in aiohttp; a range that
    comes back shorter than asked is caught here: neither is ever returned as data.

    Raises
    ------
    ConnectionError
        The server cannot be reached or cut the body short, on every try.
    TimeoutError
        The server did not answer within the timeout set in ``storage_options``.
    PermissionError
        HTTP 401/403 (not tried again).
    """
    import zarr
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    async def once(i: int) -> np.ndarray | None:
        request = None
        if ranges is not None:
            start = int(ranges[0][i])
            request = RangeByteRequest(start, start + int(ranges[1][i]))
        got = await stores[i].get(keys[i], prototype=cpu.buffer_prototype, byte_range=request)
        if got is None:
            return None
        data = np.asarray(got.as_numpy_array()).view(np.uint8)
        if ranges is not None and data.size != int(ranges[1][i]):
            raise _ShortBody(f"{data.size} of the {int(ranges[1][i])} bytes asked for came")
        return data

    async def one(i: int) -> np.ndarray | None:
        tries = 1 if _retries_itself(stores[i]) else max(1, attempts)
        for n in range(1, tries + 1):
            try:
                return await once(i)
            except Exception as err:
                failed = err
            # raised here, not in the except block: the library's error (whose text
            # may hold credentials) is not chained as __context__
            if n == tries or not _transient(failed):
                raise _read_error(stores[i], keys[i], n, failed) from None
            fs = getattr(stores[i], "fs", None)
            logger.debug(
                "chunk %r of %r: try %d of %d failed (%s), trying again",
                keys[i],
                store_url(stores[i]),
                n,
                tries,
                redact(
                    f"{type(failed).__name__}: {failed}",
                    getattr(fs, "storage_options", None),
                    str(getattr(stores[i], "path", "")),
                ),
            )
            await asyncio.sleep(_BACKOFF[min(n, len(_BACKOFF)) - 1])
        raise AssertionError("unreachable")  # the loop returns or raises

    async def every() -> list[np.ndarray | None]:
        # as many in flight as zarr allows; the first read that fails for good cancels
        # the others (no more tries against a server that is gone)
        limit = asyncio.Semaphore(int(zarr.config.get("async.concurrency") or len(keys) or 1))

        async def bounded(i: int) -> np.ndarray | None:
            async with limit:
                return await one(i)

        first: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(bounded(i)) for i in range(len(keys))]
        except BaseExceptionGroup as errors:
            first = errors.exceptions[0]
        if first is not None:  # outside the except block: no group as __context__
            raise first from None
        return [t.result() for t in tasks]

    found: list[np.ndarray | None] = sync(every())
    return found


# -- device route: kvikio RemoteFile ---------------------------------------------------


def kvikio_target(store: Any) -> tuple[str, dict[str, Any]] | None:
    """``(base URL, kvikio open arguments)`` of an fsspec store kvikio's ``RemoteFile``
    can read (S3 through s3fs, HTTP(S)), or ``None``."""
    fs = getattr(store, "fs", None)
    path = getattr(store, "path", None)
    if fs is None or path is None:
        return None
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("s3", "s3a"):
        args = {
            "aws_access_key_id": getattr(fs, "key", None),
            "aws_secret_access_key": getattr(fs, "secret", None),
            "aws_endpoint_url": getattr(fs, "endpoint_url", None),
            "aws_region_name": (getattr(fs, "client_kwargs", None) or {}).get("region_name"),
        }
        if getattr(fs, "token", None):
            args["aws_session_token"] = fs.token
        return f"s3://{path.strip('/')}", {k: v for k, v in args.items() if v}
    if protocol in ("http", "https"):
        return path.rstrip("/"), {}
    return None


def _open_remote(kvikio: Any, url: str, args: dict[str, Any], nbytes: int | None = None) -> Any:
    """kvikio's ``RemoteFile`` of ``url``; with ``nbytes`` (the object's size, known from
    a listing) it opens without asking the server for the size (a HEAD request)."""
    if url.startswith("s3://"):
        bucket, _, name = url[5:].partition("/")
        return kvikio.RemoteFile.open_s3(bucket, name, nbytes=nbytes, **args)
    return kvikio.RemoteFile.open_http(url, nbytes=nbytes)


#: Whole objects of one S3 store read at once from which their sizes come from a listing
#: of their common prefix instead of one HEAD request each.
LIST_MIN_KEYS = 8
#: Objects a page of a listing (S3's most).
LIST_PAGE = 1000
#: A listing stops after this many of its pages per 100 objects wanted; the sizes of
#: the objects it did not reach come from HEAD requests.
LIST_PAGES_PER_100 = 1


class Listing:
    """What one listing of an S3 prefix tells of some keys: the sizes of those it found,
    and up to which key it is complete (a key at or before it that was not found does
    not exist)."""

    def __init__(self, sizes: dict[str, int], complete_to: str | None) -> None:
        self.sizes = sizes
        self.complete_to = complete_to

    def missing(self, key: str) -> bool:
        """Whether ``key`` is known not to exist."""
        return key not in self.sizes and self.complete_to is not None and key <= self.complete_to


def list_sizes(store: Any, keys: list[str]) -> Listing | None:
    """Sizes of the objects ``keys`` of an S3 fsspec store, from a listing of their
    common prefix (``ListObjectsV2``: one request per 1,000 objects), for at least
    :data:`LIST_MIN_KEYS` keys; None when no listing is made or the server refuses one
    (without ``s3:ListBucket`` permission, say): the reader then asks for each size."""
    fs = getattr(store, "fs", None)
    protocol = getattr(fs, "protocol", None)
    protocol = protocol if isinstance(protocol, str) else (protocol or ("",))[0]
    if len(keys) < LIST_MIN_KEYS or protocol not in ("s3", "s3a") or fs is None:
        return None
    bucket, _, root = str(store.path).strip("/").partition("/")
    low, high = min(keys), max(keys)  # their common start is that of every key
    n = next((i for i, (a, b) in enumerate(zip(low, high, strict=False)) if a != b), len(low))
    common = low[: low.rfind("/", 0, n) + 1]  # a whole directory of the store
    prefix = f"{root}/{common}" if root else common
    pages = max(1, -(-len(keys) // 100) * LIST_PAGES_PER_100)
    wanted = set(keys)
    sizes: dict[str, int] = {}
    skip = len(root) + 1 if root else 0
    last: str | None = None

    async def listing() -> bool:
        nonlocal last
        token = None
        for _ in range(pages):
            extra: dict[str, Any] = {"ContinuationToken": token} if token else {}
            page = await fs._call_s3(
                "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=LIST_PAGE, **extra
            )
            for item in page.get("Contents", []):
                key = item["Key"][skip:]
                last = key
                if key in wanted:
                    sizes[key] = int(item["Size"])
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return True
        return False

    from zarr.core.sync import sync  # the loop the store's file system runs on

    try:
        whole = sync(listing())
    except Exception:
        return None  # not allowed, or not answered: each size is asked for instead
    return Listing(sizes, max(keys) if whole else last)


def _options(store: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The storage options of ``store``'s filesystem and kvikio's open arguments (both
    may hold credentials), for :func:`redact`."""
    fs = getattr(store, "fs", None)
    return {"fs": dict(getattr(fs, "storage_options", None) or {}), "kvikio": args}


def read_device(
    stores: list[Any],
    keys: list[str],
    retries: int = 3,
    ranges: tuple[np.ndarray, np.ndarray] | None = None,
) -> Any:
    """Objects ``keys[i]`` of ``stores[i]`` read by kvikio into one device arena
    (:class:`~xarray_gds.batch.DeviceBatch`; size -1 for a missing object): whole, or
    with ``ranges`` (``starts, sizes``) the byte range ``i`` of its object. Each object
    is opened once however many of its ranges are read (one handle an object), and every
    read is in flight at once. A read that fails or comes back short is tried again, at
    most ``retries`` times in all, and then raises an ``OSError`` naming the URL and the
    key; partial bytes are never data."""
    from xarray_gds import device as _device
    from xarray_gds.batch import DeviceBatch, pack_offsets, parallel

    kvikio = _device.kvikio()
    cp = _device.cupy()
    targets = [kvikio_target(s) for s in stores]
    urls = [f"{t[0]}/{k}" if t is not None else "" for t, k in zip(targets, keys, strict=True)]
    first: dict[tuple[int, str], int] = {}  # the first item of each object
    for i, url in enumerate(urls):
        first.setdefault((id(stores[i]), url), i)
    opened = list(first.values())
    listed: dict[int, Listing | None] = {}
    if ranges is None:  # whole objects: their sizes from one listing a store
        by_store: dict[int, list[int]] = {}
        for i in opened:
            by_store.setdefault(id(stores[i]), []).append(i)
        for members in by_store.values():
            listing = list_sizes(stores[members[0]], [keys[i] for i in members])
            listed.update(dict.fromkeys(members, listing))
    handles: dict[int, Any] = {}

    def open_one(j: int) -> None:
        i = opened[j]
        target = targets[i]
        assert target is not None
        listing = listed.get(i)
        if listing is not None and listing.missing(keys[i]):
            return  # a missing chunk: the fill value
        nbytes = listing.sizes.get(keys[i]) if listing is not None else None
        try:
            handles[i] = _open_remote(kvikio, urls[i], target[1], nbytes)
            return
        except Exception as err:
            detail = redact(str(err), _options(stores[i], target[1]), urls[i])
        from zarr.core.sync import sync

        if not sync(stores[i].exists(keys[i])):
            return  # a missing chunk: the fill value
        raise OSError(  # outside the except block: kvikio's error is not chained
            f"cannot read chunk {keys[i]!r} at {public_url(urls[i])!r}: {detail}; check "
            "the credentials, endpoint_url and that the server is up"
        ) from None

    parallel(open_one, len(opened), min_items=2)
    handle: list[Any] = [handles.get(first[(id(stores[i]), urls[i])]) for i in range(len(keys))]
    if ranges is None:
        sizes = np.array([-1 if h is None else int(h.nbytes()) for h in handle], dtype=np.int64)
        starts = np.zeros(len(keys), dtype=np.int64)
    else:
        starts = np.asarray(ranges[0], dtype=np.int64)
        sizes = np.where([h is None for h in handle], -1, ranges[1]).astype(np.int64)
    offsets, total = pack_offsets(sizes)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    cp.cuda.get_current_stream().synchronize()
    pending = [i for i in range(len(keys)) if sizes[i] > 0]
    errors: dict[int, str] = {}
    for _ in range(max(1, retries)):
        futures = []
        for i in pending:
            start, size = int(offsets[i]), int(sizes[i])
            futures.append((i, handle[i].pread(arena[start : start + size], size, int(starts[i]))))
        failed: list[int] = []
        errors = {}
        for i, future in futures:
            try:
                if future.get() != sizes[i]:
                    failed.append(i)
                    errors[i] = "short read"
            except Exception as err:
                failed.append(i)
                errors[i] = str(err)
        pending = failed
        if not pending:
            return DeviceBatch(arena, offsets, sizes)
    i = pending[0]
    target = targets[i]
    where = f" bytes {int(starts[i])}-{int(starts[i]) + int(sizes[i]) - 1}" if ranges else ""
    raise OSError(
        f"cannot read chunk {keys[i]!r}{where} at {public_url(urls[i])} after {retries} "
        f"tries: {redact(errors[i], _options(stores[i], target[1] if target else {}), urls[i])}; "
        "check the server and the network"
    )

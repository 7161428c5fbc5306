"""What every remote store kind shares, apart from its reads: URLs (which are remote,
their public form), secrets kept out of errors, reprs and logs (:func:`redact`), the
errors of opening, writing and reading a remote store, and the retry policy of reads
(:data:`READ_ATTEMPTS`, :func:`transient`).

Errors, reprs and logs name the URL and never the credentials (see :func:`redact`):
user information in a URL (``http://user:password@host/...``) is shown as ``***@``,
and the secrets of ``storage_options`` (``key``, ``secret``, ``token``, passwords,
every HTTP header value) as ``***``, on every path (open, read, retry, listing). Chunk
reads on the host route are tried again when the fault is transient (a dropped
connection, a short body, a timeout, HTTP 5xx), at most :data:`READ_ATTEMPTS` times in
all, and then raise an error naming the URL and the chunk key (:func:`read_error`).
"""

from __future__ import annotations

import logging
import re
import ssl
from typing import Any
from urllib.parse import unquote

__all__ = [
    "READ_ATTEMPTS",
    "is_remote_url",
    "is_secret_key",
    "mask_logs",
    "public_url",
    "read_error",
    "redact",
    "scrubbed",
    "store_options",
    "store_url",
    "transient",
    "write_error",
]

#: URL schemes this engine opens as remote stores
REMOTE_SCHEMES = ("s3", "s3a", "http", "https")

#: storage_options keys whose values are secrets
SECRET_KEYS = (
    "key",
    "secret",
    "token",
    "aws_access_key_id",
    "access_key_id",  # obstore's names
    "secret_access_key",
    "session_token",
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


def fail(
    url: str,
    storage_options: dict[str, Any] | None,
    what: str,
    err: BaseException,
    action: str = "open",
) -> str:
    detail = redact(f"{type(err).__name__}: {err}", storage_options, url)
    return f"cannot {action} the remote Zarr store {public_url(url)!r}: {what} ({detail})"


def is_s3(url: str) -> bool:
    return url.lower().startswith(("s3://", "s3a://"))


def _unreachable(url: str) -> str:
    """What to check when the server of ``url`` cannot be reached: AWS settings for
    S3 only, never for an HTTP URL."""
    if is_s3(url):
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


def classified(
    url: str, options: dict[str, Any], err: BaseException, action: str = "open"
) -> OSError | None:
    """The error to raise for ``err`` of opening (or writing to) ``url``: its type says
    the kind of fault, its message what to check; ``None`` for a fault of writing that
    is not one of the store's connection or credentials."""
    if "Credential" in type(err).__name__:
        return PermissionError(
            fail(
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
            fail(
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
        return ConnectionError(fail(url, options, _unreachable(url), err, action))
    if action == "open":
        return OSError(fail(url, options, "reading its metadata failed", err))
    return None


def with_timeout(url: str, options: dict[str, Any]) -> dict[str, Any]:
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


# -- the retry policy of reads ----------------------------------------------------------

#: tries of one chunk read on the host route (the first one included)
READ_ATTEMPTS = 3

#: pauses (seconds) before the second and third tries: a dropped connection is
#: usually back at once; a few tenths give a restarting server a moment
BACKOFF = (0.05, 0.25)

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
        "BodyCut",  # obstore: the body cut short (xarray_gds.stores.objstore)
        "Unreachable",
    }
)

#: HTTP statuses worth a second try (never 401/403/404: those do not go away)
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class ShortBody(OSError):
    """A range read that came back with fewer bytes than asked for."""


def _names(err: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(err).__mro__}


def _timeout(err: BaseException) -> bool:
    return isinstance(err, TimeoutError) or any("Timeout" in n for n in _names(err))


def transient(err: BaseException) -> bool:
    """Whether a failed read may succeed when tried again."""
    if isinstance(err, PermissionError | FileNotFoundError | IsADirectoryError):
        return False
    if _untrusted_certificate(err):  # no second try trusts it more
        return False
    status = getattr(err, "status", None)
    if isinstance(status, int):
        return status in _TRANSIENT_STATUS
    if isinstance(err, ConnectionError | ShortBody) or _timeout(err):
        return True
    return bool(_names(err) & _TRANSIENT)


def retries_itself(store: Any) -> bool:
    """Whether the store's filesystem retries transient faults on its own (s3fs does,
    5 tries with backoff; fsspec's HTTP filesystem does not, nor obstore as the engine
    opens it)."""
    fs = getattr(store, "fs", None)
    protocol = getattr(fs, "protocol", "")
    protocol = protocol if isinstance(protocol, str) else protocol[0]
    return protocol in ("s3", "s3a")


def store_options(store: Any) -> dict[str, Any]:
    """What may hold the credentials of a remote store, for :func:`redact`: the storage
    options of its filesystem (fsspec), or those it was opened with and its obstore
    configuration."""
    from xarray_gds.stores import objstore

    if objstore.inner(store) is not None:
        return objstore.options_of(store)
    fs = getattr(store, "fs", None)
    return dict(getattr(fs, "storage_options", None) or {})


def store_url(store: Any) -> str:
    """The URL of a remote store (``s3://bucket/path``, ``https://...``), without user
    information."""
    from xarray_gds.stores import objstore

    if objstore.inner(store) is not None:
        return public_url(objstore.store_url(store))
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
            "bucket's policy" if is_s3(url) else "server's policy"
        )
        detail = redact(f"{type(err).__name__}: {err}", options, secret_url)
        return PermissionError(f"cannot write to the remote Zarr store {url!r}: {what} ({detail})")
    found = classified(url, options, err, action="write to")
    if found is None:
        return None
    found.args = (redact(str(found), options, secret_url),)
    return found


def read_error(store: Any, key: str, tries: int, err: BaseException) -> OSError:
    """The error of a chunk read that failed for good: its type says what kind of fault
    (``TimeoutError``, ``ConnectionError``, ``PermissionError``, ``OSError``), its
    message names the URL and the chunk key and says what to check."""
    options = store_options(store)
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
    if _untrusted_certificate(err):
        return ConnectionError(
            f"{where}: the server's TLS certificate is not trusted: give the certificate "
            "of the authority that signed it (the SSL_CERT_FILE environment variable) "
            f"({detail})"
        )
    if isinstance(err, ShortBody):
        return OSError(
            f"{where}{after}: the server sent fewer bytes than asked for ({err}; no partial "
            "bytes were used): check the server, or a proxy between, honours Range requests"
        )
    if {"ClientPayloadError", "ContentLengthError", "BodyCut"} & _names(err):
        return ConnectionError(
            f"{where}{after}: the connection was closed before the whole object came "
            f"(no partial bytes were used): check the server and the network ({detail})"
        )
    if transient(err):
        hint = "endpoint_url (or AWS_ENDPOINT_URL)" if s3 else "the URL"
        return ConnectionError(
            f"{where}{after}: the server cannot be reached or dropped the connection: "
            f"check that it is up and {hint} ({detail})"
        )
    return OSError(f"{where}{after}: {detail}")

"""Remote Zarr stores (``s3://``, ``http://``, ``https://``): opened through fsspec.

This is the host route of issue 17: chunk bytes come through zarr's
:class:`~zarr.storage.FsspecStore` (s3fs for S3, fsspec's HTTP filesystem for HTTP)
and are read by the engine's :class:`~xarray_gds.sources.StoreSource`, then decoded
in the same batches as local chunks. Credentials, endpoint and region come from
``storage_options`` as s3fs takes them (``key``, ``secret``, ``token``, ``anon``,
``endpoint_url``, ``client_kwargs={"region_name": ...}``) or from the usual AWS
environment variables and config files (s3fs/botocore read them).

Errors name the URL and never the credentials (see :func:`redact`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_remote_url", "open_url", "redact"]

#: URL schemes this engine opens as remote stores
REMOTE_SCHEMES = ("s3", "s3a", "http", "https")

#: storage_options keys whose values are secrets
_SECRET_KEYS = (
    "key",
    "secret",
    "token",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "password",
)


def is_remote_url(text: str) -> bool:
    """Whether ``text`` is a URL of a remote store this engine opens."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() in REMOTE_SCHEMES


def _secrets(storage_options: dict[str, Any] | None) -> list[str]:
    found: list[str] = []
    for name, value in (storage_options or {}).items():
        if name in _SECRET_KEYS and isinstance(value, str) and value:
            found.append(value)
        elif isinstance(value, dict):
            found.extend(_secrets(value))
    return found


def redact(text: str, storage_options: dict[str, Any] | None) -> str:
    """``text`` with every credential of ``storage_options`` replaced by ``***``."""
    for secret in sorted(_secrets(storage_options), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _fail(url: str, storage_options: dict[str, Any] | None, what: str, err: BaseException) -> str:
    detail = redact(f"{type(err).__name__}: {err}", storage_options)
    return f"cannot open the remote Zarr store {url!r}: {what} ({detail})"


def _classified(url: str, options: dict[str, Any], err: BaseException) -> OSError:
    if "Credential" in type(err).__name__:
        return PermissionError(
            _fail(
                url,
                options,
                "no credentials found: pass storage_options key and "
                "secret, set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or "
                "anon=True for a public bucket",
                err,
            )
        )
    if "Connect" in type(err).__name__ or isinstance(err, ConnectionError | TimeoutError):
        return ConnectionError(
            _fail(
                url,
                options,
                "the endpoint cannot be reached: check endpoint_url "
                "(or AWS_ENDPOINT_URL) and that the server is up",
                err,
            )
        )
    return OSError(_fail(url, options, "reading its metadata failed", err))


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
        The endpoint cannot be reached: check ``endpoint_url`` / ``AWS_ENDPOINT_URL``.
    """
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync
    from zarr.storage import FsspecStore

    options = dict(storage_options or {})
    try:
        store = FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    except ImportError as err:
        raise ImportError(
            f"reading {url!r} needs fsspec's filesystem for it ({err}); install s3fs for "
            "s3:// URLs or aiohttp for http(s):// URLs"
        ) from err
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
            raise PermissionError(
                _fail(
                    url,
                    options,
                    "access denied (HTTP 403): check the credentials "
                    "(storage_options key/secret, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) "
                    "and the bucket's policy",
                    err,
                )
            ) from None
        raise _classified(url, options, err) from None
    if not found:
        where = "no zarr.json, .zgroup, .zarray or .zmetadata there"
        if url.lower().startswith(("s3://", "s3a://")):
            bucket = url.split("://", 1)[1].split("/", 1)[0]
            try:
                exists = bool(sync(store.fs._exists(bucket)))
            except Exception:
                exists = True
            if not exists:
                where = f"the bucket {bucket!r} does not exist (check the URL and endpoint_url)"
        raise FileNotFoundError(f"No Zarr store at {url!r}: {where}")
    return store


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


def _open_remote(kvikio: Any, url: str, args: dict[str, Any]) -> Any:
    if url.startswith("s3://"):
        bucket, _, name = url[5:].partition("/")
        return kvikio.RemoteFile.open_s3(bucket, name, **args)
    return kvikio.RemoteFile.open_http(url)


def read_device(stores: list[Any], keys: list[str], retries: int = 3) -> Any:
    """Whole objects ``keys[i]`` of ``stores[i]`` read by kvikio into one device arena
    (:class:`~xarray_gds.batch.DeviceBatch`; size -1 for a missing object). A read that
    fails or comes back short is tried again, at most ``retries`` times in all, and then
    raises an ``OSError`` naming the URL and the key; partial bytes are never data."""
    import numpy as np

    from xarray_gds import device as _device
    from xarray_gds.batch import DeviceBatch, pack_offsets, parallel

    kvikio = _device.kvikio()
    cp = _device.cupy()
    targets = [kvikio_target(s) for s in stores]
    handles: list[Any] = [None] * len(keys)

    def open_one(i: int) -> None:
        target = targets[i]
        assert target is not None
        url = f"{target[0]}/{keys[i]}"
        try:
            handles[i] = _open_remote(kvikio, url, target[1])
        except Exception as err:
            from zarr.core.sync import sync

            if not sync(stores[i].exists(keys[i])):
                return  # a missing chunk: the fill value
            raise OSError(
                f"cannot read chunk {keys[i]!r} at {url!r}: "
                + redact(str(err), target[1])
                + "; check the credentials, endpoint_url and that the server is up"
            ) from None

    parallel(open_one, len(keys), min_items=2)
    sizes = np.array([-1 if h is None else int(h.nbytes()) for h in handles], dtype=np.int64)
    offsets, total = pack_offsets(sizes)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    cp.cuda.get_current_stream().synchronize()
    pending = [i for i in range(len(keys)) if sizes[i] > 0]
    for _ in range(max(1, retries)):
        futures = []
        for i in pending:
            start, size = int(offsets[i]), int(sizes[i])
            futures.append((i, handles[i].pread(arena[start : start + size], size, 0)))
        failed: list[int] = []
        errors: dict[int, str] = {}
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
    raise OSError(
        f"cannot read chunk {keys[i]!r} at {target[0] if target else ''}/{keys[i]} after "
        f"{retries} tries: {redact(errors[i], target[1] if target else None)}; check the "
        "server and the network"
    )

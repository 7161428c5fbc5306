"""Remote objects read on the device: kvikio's ``RemoteFile`` reads them (whole, or
byte ranges of them) straight into one device arena (:func:`read_device`), with the
sizes of whole objects from a listing (:mod:`xarray_gds.stores.listings`) and bounded
tries of reads that fail or come back short.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xarray_gds import config
from xarray_gds.batch import DeviceBatch
from xarray_gds.stores import objstore
from xarray_gds.stores.base import merge_ranges
from xarray_gds.stores.listings import Listing, list_sizes
from xarray_gds.stores.urls import public_url, redact, store_options

__all__ = ["kvikio_target", "read_device", "read_ranges_device"]


def kvikio_target(store: Any) -> tuple[str, dict[str, Any]] | None:
    """``(base URL, kvikio open arguments)`` of an fsspec store kvikio's ``RemoteFile``
    can read (S3 through s3fs, HTTP(S)), or of an obstore ``ObjectStore`` over
    ``S3Store`` / ``HTTPStore``, or ``None``."""
    obj = objstore.inner(store)
    if obj is not None:
        return _obstore_target(store, obj)
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


def _obstore_target(store: Any, obj: Any) -> tuple[str, dict[str, Any]]:
    """:func:`kvikio_target` of an obstore store: its URL, and for S3 the credentials,
    endpoint and region of its configuration."""
    url = objstore.store_url(store)
    if type(obj).__name__ == "HTTPStore":
        return str(obj.url).rstrip("/"), {}
    config = dict(obj.config or {})
    args = {
        "aws_access_key_id": config.get("access_key_id"),
        "aws_secret_access_key": config.get("secret_access_key"),
        "aws_session_token": config.get("session_token"),
        "aws_endpoint_url": config.get("endpoint"),
        "aws_region_name": config.get("region"),
    }
    bucket = config.get("bucket", "")
    prefix = str(obj.prefix or "").strip("/")
    base = f"s3://{bucket}/{prefix}".rstrip("/") if bucket else url
    return base, {k: v for k, v in args.items() if v}


def _open_remote(kvikio: Any, url: str, args: dict[str, Any], nbytes: int | None = None) -> Any:
    """kvikio's ``RemoteFile`` of ``url``; with ``nbytes`` (the object's size, known from
    a listing) it opens without asking the server for the size (a HEAD request)."""
    if url.startswith("s3://"):
        bucket, _, name = url[5:].partition("/")
        return kvikio.RemoteFile.open_s3(bucket, name, nbytes=nbytes, **args)
    return kvikio.RemoteFile.open_http(url, nbytes=nbytes)


def _options(store: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The storage options of ``store`` and kvikio's open arguments (both may hold
    credentials), for :func:`redact`."""
    return {"store": store_options(store), "kvikio": args}


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
    from xarray_gds.batch import pack_offsets

    kvikio = _device.kvikio()
    cp = _device.cupy()
    targets = [kvikio_target(s) for s in stores]
    urls = [f"{t[0]}/{k}" if t is not None else "" for t, k in zip(targets, keys, strict=True)]
    handle = _open_handles(kvikio, stores, keys, targets, urls, whole=ranges is None)
    if ranges is None:
        sizes = np.array([-1 if h is None else int(h.nbytes()) for h in handle], dtype=np.int64)
        starts = np.zeros(len(keys), dtype=np.int64)
    else:
        starts = np.asarray(ranges[0], dtype=np.int64)
        sizes = np.where([h is None for h in handle], -1, ranges[1]).astype(np.int64)
    offsets, total = pack_offsets(sizes)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    cp.cuda.get_current_stream().synchronize()
    errors = _pread_all(arena, handle, offsets, starts, sizes, retries)
    if not errors:
        return DeviceBatch(arena, offsets, sizes)
    i = min(errors)
    target = targets[i]
    where = f" bytes {int(starts[i])}-{int(starts[i]) + int(sizes[i]) - 1}" if ranges else ""
    raise OSError(
        f"cannot read chunk {keys[i]!r}{where} at {public_url(urls[i])} after {retries} "
        f"tries: {redact(errors[i], _options(stores[i], target[1] if target else {}), urls[i])}; "
        "check the server and the network"
    )


def _open_handles(
    kvikio: Any,
    stores: list[Any],
    keys: list[str],
    targets: list[tuple[str, dict[str, Any]] | None],
    urls: list[str],
    whole: bool,
) -> list[Any]:
    """kvikio's ``RemoteFile`` of each item (None for a missing object), each object
    opened once (all at once) and its handle shared by the items of it; for ``whole``
    objects with their sizes from one listing a store (:func:`_listings`)."""
    from xarray_gds.batch import parallel

    first: dict[tuple[int, str], int] = {}  # the first item of each object
    for i, url in enumerate(urls):
        first.setdefault((id(stores[i]), url), i)
    opened = list(first.values())
    listed = _listings(stores, keys, opened) if whole else {}
    handles: dict[int, Any] = {}

    def open_one(j: int) -> None:
        i = opened[j]
        found = _open_one(kvikio, stores[i], keys[i], urls[i], targets[i], listed.get(i))
        if found is not None:
            handles[i] = found

    parallel(open_one, len(opened), min_items=2)
    return [handles.get(first[(id(stores[i]), urls[i])]) for i in range(len(keys))]


def _listings(stores: list[Any], keys: list[str], opened: list[int]) -> dict[int, Listing | None]:
    """The listing of each item of ``opened`` (whole objects): one a store."""
    listed: dict[int, Listing | None] = {}
    by_store: dict[int, list[int]] = {}
    for i in opened:
        by_store.setdefault(id(stores[i]), []).append(i)
    for members in by_store.values():
        listing = list_sizes(stores[members[0]], [keys[i] for i in members])
        listed.update(dict.fromkeys(members, listing))
    return listed


def _open_one(
    kvikio: Any,
    store: Any,
    key: str,
    url: str,
    target: tuple[str, dict[str, Any]] | None,
    listing: Listing | None,
) -> Any:
    """The handle of one object, or None for a missing one (the fill value): known
    missing from its listing, or not there once it could not be opened."""
    assert target is not None
    if listing is not None and listing.missing(key):
        return None  # a missing chunk: the fill value
    nbytes = listing.sizes.get(key) if listing is not None else None
    try:
        return _open_remote(kvikio, url, target[1], nbytes)
    except Exception as err:
        detail = redact(str(err), _options(store, target[1]), url)
    from zarr.core.sync import sync

    if not sync(store.exists(key)):
        return None  # a missing chunk: the fill value
    raise OSError(  # outside the except block: kvikio's error is not chained
        f"cannot read chunk {key!r} at {public_url(url)!r}: {detail}; check "
        "the credentials, endpoint_url and that the server is up"
    ) from None


def _pread_all(
    arena: Any,
    handle: list[Any],
    offsets: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    retries: int,
) -> dict[int, str]:
    """Read every item of a positive size into its place in ``arena``, all in flight at
    once, the ones that fail or come back short again, at most ``retries`` times in all:
    the error of each item still not read (none when all were)."""
    pending = [i for i in range(len(handle)) if sizes[i] > 0]
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
            return {}
    return errors


def read_ranges_device(
    sources: Sequence[Any], locations: list[Any], starts: np.ndarray, sizes: np.ndarray
) -> DeviceBatch:
    """:meth:`~xarray_gds.stores.remote.RemoteSource.read_ranges_all` on the device: the
    joined spans read by kvikio into one arena, then every range copied out to an
    aligned slot of another (nvCOMP reads aligned inputs)."""
    from xarray_gds import device as _device
    from xarray_gds.batch import pack_offsets

    cp = _device.cupy()
    spans = merge_ranges(sources, locations, starts, sizes, config.get("range_gap"))
    got = read_device(
        [sources[first].store for first, _, _, _ in spans],
        [locations[first] for first, _, _, _ in spans],
        ranges=(
            np.array([start for _, start, _, _ in spans], dtype=np.int64),
            np.array([end - start for _, start, end, _ in spans], dtype=np.int64),
        ),
    )
    out_sizes = np.full(len(locations), -1, dtype=np.int64)
    source_at = np.zeros(len(locations), dtype=np.int64)
    for k, (_, start, _, members) in enumerate(spans):
        if got.sizes[k] < 0:
            continue
        for i in members:
            out_sizes[i] = sizes[i]
            source_at[i] = int(got.offsets[k]) + int(starts[i]) - start
    offsets, total = pack_offsets(out_sizes)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    for i in np.flatnonzero(out_sizes > 0).tolist():
        size, at = int(out_sizes[i]), int(offsets[i])
        arena[at : at + size] = got.arena[int(source_at[i]) : int(source_at[i]) + size]
    return DeviceBatch(arena, offsets, out_sizes)

"""Remote Zarr stores (``s3://``, ``http://``, ``https://``): opened through obstore,
or fsspec where obstore cannot serve them.

A URL opened for reading becomes a zarr ``ObjectStore`` over obstore's ``S3Store`` or
``HTTPStore`` (:mod:`xarray_gds.stores.objstore`): one ``GET`` a chunk, every chunk of a
batch in flight at once, no ``HEAD`` before it. Where obstore is not installed, for
writes, and for ``storage_options`` only fsspec understands (an aiohttp ``ssl``
context, a botocore profile...), it is zarr's :class:`~zarr.storage.FsspecStore` (s3fs
for S3, fsspec's HTTP filesystem for HTTP), as before. Credentials, endpoint and region
come from ``storage_options`` as s3fs takes them (``key``, ``secret``, ``token``,
``anon``, ``endpoint_url``, ``client_kwargs={"region_name": ...}``) or from the usual
AWS environment variables (and for s3fs, config files).

URLs, secrets kept out of errors and logs, and the retry policy of reads are
:mod:`xarray_gds.stores.urls`'s (what every remote kind shares); this module opens a
remote store and reads its chunks: :func:`read_host` through the store's ``get`` with
bounded retries of transient faults, :func:`read_device` through kvikio's
``RemoteFile`` straight into device memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from xarray_gds import config
from xarray_gds.batch import DeviceBatch, Fetched, HostBatch
from xarray_gds.stores import objstore
from xarray_gds.stores.base import Opened, Ranges, merge_ranges, on_side, read_joined
from xarray_gds.stores.generic import StoreSource
from xarray_gds.stores.urls import (
    BACKOFF,
    READ_ATTEMPTS,
    ShortBody,
    classified,
    fail,
    is_remote_url,
    is_s3,
    mask_logs,
    public_url,
    read_error,
    redact,
    retries_itself,
    store_options,
    store_url,
    transient,
    with_timeout,
)

__all__ = [
    "RemoteSource",
    "kvikio_target",
    "list_sizes",
    "open_url",
    "read_device",
    "read_host",
]

logger = logging.getLogger(__name__)


def open_url(url: str, storage_options: dict[str, Any] | None, *, read_only: bool = True) -> Any:
    """A zarr store for a remote ``url``, checked to hold a Zarr store (root metadata
    present) when ``read_only``: a :class:`~xarray_gds.stores.objstore.RemoteObjectStore`
    (obstore) for reading where obstore takes the URL and its ``storage_options`` (it
    holds the metadata it read until the engine's open ends), else a
    :class:`~zarr.storage.FsspecStore`.

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

    options = dict(storage_options or {})
    shown = public_url(url)
    if shown != url:
        mask_logs()
    # every error is raised outside its ``except`` block, so that the library's own
    # error (whose text may hold the URL's password) is not chained as __context__
    failure: BaseException | None = None
    store: Any = None
    try:
        if read_only:
            obj = objstore.obstore_for(url, options)
            if obj is not None:
                store = objstore.RemoteObjectStore(
                    obj, read_only=True, url=public_url(url), options=options
                )
                store.start_open()  # the probe's documents serve zarr's open too
        if store is None:
            options = with_timeout(url, options)
            store = FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    except ImportError as err:
        failure = ImportError(
            f"reading {shown!r} needs fsspec's filesystem for it "
            f"({redact(str(err), options, url)}); install obstore (the remote extra: "
            "pip install 'xarray-gds[remote]'), or install s3fs for s3:// URLs or aiohttp "
            "for http(s):// URLs"
        )
    except Exception as err:
        failure = classified(url, options, err) or err
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
    except Exception as raised:
        fault = objstore.as_error(raised)
        if isinstance(fault, PermissionError) or getattr(fault, "status", None) in (401, 403):
            failure = PermissionError(
                fail(
                    url,
                    options,
                    "access denied (HTTP 403): check the credentials "
                    "(storage_options key/secret, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) "
                    "and the bucket's policy",
                    fault,
                )
            )
        else:
            failure = classified(url, options, fault) or fault
    if failure is not None:
        raise failure from None
    if not found:
        where = "no zarr.json, .zgroup, .zarray or .zmetadata there"
        if is_s3(url):
            bucket = shown.split("://", 1)[1].split("/", 1)[0]
            try:
                exists = bool(sync(_bucket_exists(store, bucket)))
            except Exception:
                exists = True
            if not exists:
                where = f"the bucket {bucket!r} does not exist (check the URL and endpoint_url)"
        raise FileNotFoundError(f"No Zarr store at {shown!r}: {where}")
    return store


async def _bucket_exists(store: Any, bucket: str) -> bool:
    """Whether the bucket of an S3 store exists (asked when its root has no metadata)."""
    obj = objstore.inner(store)
    if obj is None:
        return bool(await store.fs._exists(bucket))
    import obstore

    try:  # a listing of one object: NoSuchBucket is a 404
        stream = obstore.list(obj, chunk_size=1)
        await stream.__anext__()
    except StopAsyncIteration:
        return True
    except Exception as err:
        return not isinstance(objstore.as_error(err), FileNotFoundError) and (
            "NoSuchBucket" not in str(err)
        )
    return True


# -- host route: the store's own get, with bounded retries --------------------------


def _reader(
    stores: list[Any],
    keys: list[str],
    ranges: tuple[np.ndarray, np.ndarray] | None,
    attempts: int,
) -> Any:
    """``read(i)``: the coroutine that reads item ``i`` (see :func:`read_host`), with the
    bounded retries of transient faults."""
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import cpu

    async def once(i: int) -> np.ndarray | None:
        start = size = None
        if ranges is not None:
            start, size = int(ranges[0][i]), int(ranges[1][i])
        obj = objstore.inner(stores[i])
        if obj is not None:  # obstore straight: one GET, no zarr Buffer between
            raw = await objstore.fetch(obj, keys[i], start, size)
            data = None if raw is None else np.frombuffer(raw, dtype=np.uint8)
        else:
            request = None if start is None else RangeByteRequest(start, start + (size or 0))
            got = await stores[i].get(keys[i], prototype=cpu.buffer_prototype, byte_range=request)
            data = None if got is None else np.asarray(got.as_numpy_array()).view(np.uint8)
        if data is None:
            return None
        if size is not None and data.size != size:
            raise ShortBody(f"{data.size} of the {size} bytes asked for came")
        return data

    async def one(i: int) -> np.ndarray | None:
        tries = 1 if retries_itself(stores[i]) else max(1, attempts)
        for n in range(1, tries + 1):
            try:
                return await once(i)
            except Exception as err:
                failed = err
            # raised here, not in the except block: the library's error (whose text
            # may hold credentials) is not chained as __context__
            if n == tries or not transient(failed):
                raise read_error(stores[i], keys[i], n, failed) from None
            logger.debug(
                "chunk %r of %r: try %d of %d failed (%s), trying again",
                keys[i],
                store_url(stores[i]),
                n,
                tries,
                redact(
                    f"{type(failed).__name__}: {failed}",
                    store_options(stores[i]),
                    str(getattr(stores[i], "path", "")),
                ),
            )
            await asyncio.sleep(BACKOFF[min(n, len(BACKOFF)) - 1])
        raise AssertionError("unreachable")  # the loop returns or raises

    return one


def _concurrency(n: int) -> int:
    import zarr

    return int(zarr.config.get("async.concurrency") or n or 1)


def read_host(
    stores: list[Any],
    keys: list[str],
    ranges: tuple[np.ndarray, np.ndarray] | None = None,
    attempts: int = READ_ATTEMPTS,
) -> list[np.ndarray | None]:
    """Objects ``keys[i]`` of ``stores[i]`` (or ``sizes[i]`` bytes at ``starts[i]`` of
    them, with ``ranges``), all in flight at once, as uint8 arrays (``None`` for a
    missing object): through obstore straight for an obstore store, else the store's
    ``get``.

    A read that fails with a transient fault (see :func:`~xarray_gds.stores.urls.transient`)
    is tried again, at most ``attempts`` times in all (once where the filesystem retries
    itself, as s3fs does). A body shorter than its Content-Length raises in the client;
    a range that comes back shorter than asked is caught here: neither is ever returned
    as data.

    Raises
    ------
    ConnectionError
        The server cannot be reached or cut the body short, on every try.
    TimeoutError
        The server did not answer within the timeout set in ``storage_options``.
    PermissionError
        HTTP 401/403 (not tried again).
    """
    from zarr.core.sync import sync

    one = _reader(stores, keys, ranges, attempts)

    async def every() -> list[np.ndarray | None]:
        # as many in flight as zarr allows; the first read that fails for good cancels
        # the others (no more tries against a server that is gone)
        limit = asyncio.Semaphore(_concurrency(len(keys)))

        async def bounded(i: int) -> np.ndarray | None:
            async with limit:
                found: np.ndarray | None = await one(i)
                return found

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


class HostStream:
    """Whole objects ``keys[i]`` of ``stores[i]`` all requested at once (zarr's
    ``async.concurrency`` in flight) while the host pool's threads take each as it
    comes, decode it and place it (:meth:`get`): the reads of a batch overlap its
    decoding. Retries and errors as :func:`read_host`."""

    def __init__(self, stores: list[Any], keys: list[str]) -> None:
        self._reads = objstore.Prefetch(
            _reader(stores, keys, None, READ_ATTEMPTS), len(keys), _concurrency(len(keys))
        )

    def get(self, i: int) -> np.ndarray | None:
        found: np.ndarray | None = self._reads.get(i)
        return found

    def close(self) -> None:
        self._reads.close()


# -- device route: kvikio RemoteFile ---------------------------------------------------


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
    (without ``s3:ListBucket`` permission, say) or cannot list at all (a web server:
    never taken for an empty listing): the reader then asks for each size."""
    obj = objstore.inner(store)
    if obj is not None:
        return _list_obstore(obj, keys)
    fs = getattr(store, "fs", None)
    protocol = getattr(fs, "protocol", None)
    protocol = protocol if isinstance(protocol, str) else (protocol or ("",))[0]
    if len(keys) < LIST_MIN_KEYS or protocol not in ("s3", "s3a") or fs is None:
        return None
    bucket, _, root = str(store.path).strip("/").partition("/")
    common = _common_directory(keys)  # a whole directory of the store
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


def _common_directory(keys: list[str]) -> str:
    """The longest directory (ending in ``/``) that holds every key."""
    low, high = min(keys), max(keys)  # their common start is that of every key
    n = next((i for i, (a, b) in enumerate(zip(low, high, strict=False)) if a != b), len(low))
    return low[: low.rfind("/", 0, n) + 1]


def _list_obstore(obj: Any, keys: list[str]) -> Listing | None:
    """:func:`list_sizes` through obstore (an ``S3Store``; an ``HTTPStore`` lists
    nothing)."""
    if len(keys) < LIST_MIN_KEYS or type(obj).__name__ != "S3Store":
        return None
    import obstore

    prefix = _common_directory(keys)
    pages = max(1, -(-len(keys) // 100) * LIST_PAGES_PER_100)
    wanted = set(keys)
    sizes: dict[str, int] = {}
    last: str | None = None

    async def listing() -> bool:
        nonlocal last
        stream = obstore.list(obj, prefix or None, chunk_size=LIST_PAGE)
        for _ in range(pages):
            try:
                page = await stream.__anext__()
            except StopAsyncIteration:
                return True
            for item in page:
                key = str(item["path"])
                last = key
                if key in wanted:
                    sizes[key] = int(item["size"])
        try:
            await stream.__anext__()
        except StopAsyncIteration:
            return True
        return False

    from zarr.core.sync import sync

    try:
        whole = sync(listing())
    except Exception:
        return None  # refused or not answered (a web server: 501): sizes asked for
    return Listing(sizes, max(keys) if whole else last)


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
    from xarray_gds.batch import pack_offsets, parallel

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


# -- the remote kind -------------------------------------------------------------------


class RemoteSource(StoreSource):
    """Objects of a remote store (an obstore ``ObjectStore`` over ``S3Store`` /
    ``HTTPStore``, or an fsspec store of S3 or HTTP(S)): on the host through obstore
    (or the store's ``get``) with bounded retries of transient faults
    (:func:`read_host`; large chunks streamed, their reads overlapping their decoding:
    :class:`HostStream`), on the device through kvikio's ``RemoteFile`` straight into
    the arena (:func:`read_device`). Opens ``s3://``, ``http://`` and ``https://`` URLs
    (:func:`open_url`)."""

    device_reads = True
    streams = True

    @classmethod
    def stream(cls, sources: Sequence[Any], locations: list[Any]) -> HostStream:
        return HostStream([s.store for s in sources], list(locations))

    @classmethod
    def claims(cls, store: Any) -> bool:
        return kvikio_target(store) is not None

    @classmethod
    def opens(cls, target: Any) -> bool:
        return isinstance(target, str) and is_remote_url(target)

    @classmethod
    def open(
        cls,
        target: Any,
        *,
        mode: str,
        storage_options: dict[str, Any] | None,
        consolidated: bool | None = None,
    ) -> Opened:
        # the storage options go into the store: zarr is given none
        return Opened(open_url(target, storage_options, read_only=mode == "r"), None, consolidated)

    @classmethod
    def read_all(
        cls, sources: Sequence[Any], locations: list[Any], on_device: bool, slots: Any
    ) -> Fetched:
        if not on_device:
            return HostBatch(read_host([s.store for s in sources], list(locations)))
        return read_device([s.store for s in sources], list(locations))

    @classmethod
    def read_ranges_all(
        cls, sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """Byte ranges of objects (inner chunks of shards), with the retries of
        :meth:`read_all`; a range that comes back short is an error, never data. Ranges
        less than ``xarray_gds.range_gap`` apart are read as one; on the device by kvikio
        (one handle an object), then each range copied to its own aligned slot."""
        starts, sizes = ranges
        if on_device:
            return _device_ranges(sources, locations, starts, sizes)

        def get(picked: list[int], span_starts: np.ndarray, span_sizes: np.ndarray) -> list[Any]:
            stores = [sources[i].store for i in picked]
            return read_host(stores, [locations[i] for i in picked], (span_starts, span_sizes))

        return on_side(read_joined(sources, locations, starts, sizes, get), on_device)


def _device_ranges(
    sources: Sequence[Any], locations: list[Any], starts: np.ndarray, sizes: np.ndarray
) -> DeviceBatch:
    """:meth:`RemoteSource.read_ranges_all` on the device: the joined spans read by kvikio
    into one arena, then every range copied out to an aligned slot of another (nvCOMP
    reads aligned inputs)."""
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

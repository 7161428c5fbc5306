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
remote store (:func:`open_url`) and is the remote kind (:class:`RemoteSource`), whose
chunks are read on the host by :mod:`xarray_gds.stores.remote_host` (through the
store's ``get`` with bounded retries of transient faults) and on the device by
:mod:`xarray_gds.stores.remote_device` (kvikio's ``RemoteFile`` straight into device
memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from xarray_gds._optional import missing_message
from xarray_gds.batch import Fetched, HostBatch
from xarray_gds.stores import objstore, remote_device
from xarray_gds.stores.base import Opened, Ranges, on_side, read_joined
from xarray_gds.stores.generic import StoreSource
from xarray_gds.stores.remote_host import HostStream, read_host
from xarray_gds.stores.urls import (
    classified,
    fail,
    is_remote_url,
    is_s3,
    mask_logs,
    public_url,
    with_timeout,
)

__all__ = ["RemoteSource", "open_url"]


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
    options = dict(storage_options or {})
    if public_url(url) != url:
        mask_logs()
    store, options = _open_store(url, options, read_only)
    if read_only:
        _check_zarr_root(store, url, options)
    return store


def _open_store(url: str, options: dict[str, Any], read_only: bool) -> tuple[Any, dict[str, Any]]:
    """``(store, its options)`` of :func:`open_url`, not checked yet: obstore's where it
    takes a URL opened for reading, else fsspec's (with a timeout in its options)."""
    from zarr.storage import FsspecStore

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
        # obstore reads; fsspec's filesystem (s3fs, or aiohttp for HTTP) writes, and reads
        # where obstore is missing or cannot take the options: the remote extra has both
        missing = (err.name or ("s3fs" if is_s3(url) else "aiohttp")).split(".")[0]
        if read_only and not objstore.available():
            missing = "obstore"  # the engine's client for reads
        action = "reading" if read_only else "writing to"
        failure = ImportError(
            missing_message(missing, f"{action} {public_url(url)!r}", "remote"), name=missing
        )
    except Exception as err:
        failure = classified(url, options, err) or err
    if failure is not None:
        raise failure from None
    return store, options


def _check_zarr_root(store: Any, url: str, options: dict[str, Any]) -> None:
    """Raise the error of :func:`open_url` when ``store`` holds no Zarr root metadata
    (or cannot be asked): access denied, unreachable, no bucket, no store."""
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    async def probe() -> bool:
        for name in ("zarr.json", ".zmetadata", ".zgroup", ".zarray"):
            if await store.get(name, prototype=cpu.buffer_prototype) is not None:
                return True
        return False

    failure: BaseException | None = None
    try:
        found = sync(probe())
    except Exception as raised:
        failure = _probe_error(url, options, objstore.as_error(raised))
    if failure is not None:  # outside the except block: nothing chained
        raise failure from None
    if not found:
        raise FileNotFoundError(f"No Zarr store at {public_url(url)!r}: {_why_none(store, url)}")


def _probe_error(url: str, options: dict[str, Any], fault: BaseException) -> BaseException:
    """The error of a failed look for a store's root metadata."""
    if isinstance(fault, PermissionError) or getattr(fault, "status", None) in (401, 403):
        return PermissionError(
            fail(
                url,
                options,
                "access denied (HTTP 403): check the credentials "
                "(storage_options key/secret, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) "
                "and the bucket's policy",
                fault,
            )
        )
    return classified(url, options, fault) or fault


def _why_none(store: Any, url: str) -> str:
    """Why a store that could be asked holds no Zarr store: for S3, a missing bucket."""
    from zarr.core.sync import sync

    where = "no zarr.json, .zgroup, .zarray or .zmetadata there"
    if is_s3(url):
        bucket = public_url(url).split("://", 1)[1].split("/", 1)[0]
        try:
            exists = bool(sync(_bucket_exists(store, bucket)))
        except Exception:
            exists = True
        if not exists:
            where = f"the bucket {bucket!r} does not exist (check the URL and endpoint_url)"
    return where


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


# -- the remote kind -------------------------------------------------------------------


class RemoteSource(StoreSource):
    """Objects of a remote store (an obstore ``ObjectStore`` over ``S3Store`` /
    ``HTTPStore``, or an fsspec store of S3 or HTTP(S)): on the host through obstore
    (or the store's ``get``) with bounded retries of transient faults
    (:func:`~xarray_gds.stores.remote_host.read_host`; large chunks streamed, their
    reads overlapping their decoding: :class:`~xarray_gds.stores.remote_host.HostStream`),
    on the device through kvikio's ``RemoteFile`` straight into the arena
    (:func:`~xarray_gds.stores.remote_device.read_device`). Opens ``s3://``, ``http://``
    and ``https://`` URLs (:func:`open_url`)."""

    device_reads = True
    streams = True

    @classmethod
    def stream(cls, sources: Sequence[Any], locations: list[Any]) -> HostStream:
        return HostStream([s.store for s in sources], list(locations))

    @classmethod
    def claims(cls, store: Any) -> bool:
        return remote_device.kvikio_target(store) is not None

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
        return remote_device.read_device([s.store for s in sources], list(locations))

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
            return remote_device.read_ranges_device(sources, locations, starts, sizes)

        def get(picked: list[int], span_starts: np.ndarray, span_sizes: np.ndarray) -> list[Any]:
            stores = [sources[i].store for i in picked]
            return read_host(stores, [locations[i] for i in picked], (span_starts, span_sizes))

        return on_side(read_joined(sources, locations, starts, sizes, get), on_device)

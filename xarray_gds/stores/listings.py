"""Sizes of remote objects from one listing of their common prefix (S3's
``ListObjectsV2``) instead of one ``HEAD`` request each: what the device route
(:mod:`xarray_gds.stores.remote_device`) opens kvikio's ``RemoteFile`` with.
"""

from __future__ import annotations

from typing import Any

from xarray_gds.stores import objstore

__all__ = ["LIST_MIN_KEYS", "LIST_PAGE", "LIST_PAGES_PER_100", "Listing", "list_sizes"]


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

"""Icechunk repositories: chunk bytes read where they lie, not through ``IcechunkStore.get``.

An Icechunk session's store (``session.store``) is a zarr Store whose ``get`` builds
each chunk's bytes in host memory. The store also says where every chunk lies:
``IcechunkStore.array_chunk_iterator(array_path)`` yields, in columns, each chunk's
grid coordinates, its kind (native, virtual or inline), its path (a chunk id in the
repository's storage, or the URL of a virtual reference), its byte offset and length,
and the bytes of inline chunks. :class:`IcechunkSource` reads from there:

- native chunks of a repository on the local filesystem (``<root>/chunks/<id>``) and
  virtual chunks in local files: byte ranges of files, read as the ranges of kerchunk
  references are (:func:`xarray_gds.stores.refs.read_references`: kvikio into device memory,
  ``pread`` on the host);
- native chunks of a repository on S3 (``s3://<bucket>/<prefix>/chunks/<id>``) and
  virtual chunks at ``s3://`` and ``http(s)://`` URLs: the remote route
  (:func:`xarray_gds.stores.remote_device.read_device`, kvikio's ``RemoteFile``; on the host
  :func:`xarray_gds.stores.remote_host.read_host`, with its bounded retries);
- inline chunks: the bytes Icechunk hands over.

Native chunks need to know where the repository's storage lies, which a session does
not say: the engine is told with ``storage_options={"icechunk_storage": repo.storage}``
(or the storage's local path or ``s3://bucket/prefix`` URL; the other keys are s3fs's
options for S3: credentials, ``endpoint_url``..., for native chunks on S3 and for
virtual chunks at ``s3://`` URLs, whatever the repository's storage). Whatever the
fast path cannot read (native chunks of unknown or other storage, a chunk kind it does
not know, a writable session's chunks that are not committed...) is read through
``IcechunkStore.get``, with one :class:`IcechunkFallbackWarning` an array that says why.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from zarr.abc.store import Store
from zarr.storage import WrapperStore

from xarray_gds.batch import DeviceBatch, Fetched, HostBatch
from xarray_gds.errors import XarrayGdsWarning, array_of, warn
from xarray_gds.stores import remote, remote_device, remote_host
from xarray_gds.stores.base import Opened, Ranges, Source, join
from xarray_gds.stores.generic import StoreSource
from xarray_gds.stores.refs import Reference, narrow, read_references
from xarray_gds.stores.urls import store_url

__all__ = [
    "ChunkStorage",
    "IcechunkFallbackWarning",
    "IcechunkReadStore",
    "IcechunkSource",
    "chunk_storage",
    "is_icechunk_store",
]

#: Icechunk's chunk kinds (``icechunk.ChunkType`` values in the iterator's columns)
NATIVE, VIRTUAL, INLINE = 1, 2, 3

#: the ``storage_options`` key that says where a repository's storage lies
STORAGE_KEY = "icechunk_storage"


def is_icechunk_store(store: Any) -> bool:
    """Whether ``store`` is an Icechunk session's store. Nothing imports icechunk to ask:
    a user who holds such a store has imported it."""
    icechunk = sys.modules.get("icechunk")
    return icechunk is not None and isinstance(store, icechunk.IcechunkStore)


class IcechunkFallbackWarning(XarrayGdsWarning, RuntimeWarning):
    """Chunks of an Icechunk repository are read through ``IcechunkStore.get`` (host
    memory first) instead of where they lie; the message says why."""


# -- where the repository's storage lies ----------------------------------------------


@dataclass(frozen=True)
class ChunkStorage:
    """Where the native chunks of a repository lie: ``<root>/chunks/<chunk id>``.

    Attributes
    ----------
    kind : {"local", "s3", None}
        A local directory, an S3 prefix, or ``None``: not known (every native chunk is
        then read through ``IcechunkStore.get``, for the reason ``why``).
    root : str
        The repository's directory, or ``bucket/prefix`` on S3.
    options : dict
        s3fs's options (credentials, ``endpoint_url``, ``client_kwargs``): for native
        chunks on S3, and for virtual chunks at ``s3://`` URLs, whatever the kind.
    why : str
        Why native chunks are not read where they lie (``kind`` None).
    """

    kind: str | None
    root: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    why: str = ""


_HINT = (
    f"pass storage_options={{{STORAGE_KEY!r}: repo.storage}} (or the repository's "
    "local path or s3://bucket/prefix URL) to read them where they lie"
)


def _described(storage: Any) -> dict[str, str]:
    """The fields of an ``icechunk.Storage``'s description (its ``repr``: ``type: ...``,
    ``path: ...``, ``bucket: ...``), or nothing where it has none."""
    fields: dict[str, str] = {}
    for line in repr(storage).splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() and not name.startswith(("<", " ")):
            fields[name.strip()] = value.strip()
    return fields


def chunk_storage(storage_options: dict[str, Any] | None) -> tuple[ChunkStorage, dict[str, Any]]:
    """The :class:`ChunkStorage` that ``storage_options`` name (their ``icechunk_storage``
    entry: an ``icechunk.Storage``, an ``icechunk.Repository``, a local path or an
    ``s3://bucket/prefix`` URL), and the options left (s3fs's, for S3 storage and
    remote virtual chunks).

    Raises
    ------
    TypeError
        ``icechunk_storage`` is none of these.
    """
    options = dict(storage_options or {})
    given = options.pop(STORAGE_KEY, None)
    if given is None:
        return ChunkStorage(
            None, options=options, why=f"the engine does not know the repository's storage: {_HINT}"
        ), options
    if hasattr(given, "storage") and not isinstance(given, str | os.PathLike):
        given = given.storage  # an icechunk.Repository
    if isinstance(given, os.PathLike) or (isinstance(given, str) and "://" not in given):
        return ChunkStorage("local", os.path.abspath(os.fspath(given)), options), options
    if isinstance(given, str):
        scheme, _, rest = given.partition("://")
        if scheme == "file":
            return ChunkStorage("local", os.path.abspath(rest), options), options
        if scheme in ("s3", "s3a"):
            return ChunkStorage("s3", rest.strip("/"), options), options
        why = f"the engine does not read {scheme}:// storage"
        return ChunkStorage(None, options=options, why=why), options
    if type(given).__name__ != "Storage":
        raise TypeError(
            f"storage_options[{STORAGE_KEY!r}] takes an icechunk.Storage (repo.storage), an "
            "icechunk.Repository, a local path or an s3://bucket/prefix URL, not "
            f"{type(given).__name__}"
        )
    fields = _described(given)
    kind = fields.get("type", "")
    if kind == "local filesystem" and fields.get("path"):
        return ChunkStorage("local", os.path.abspath(fields["path"]), options), options
    if kind.startswith("S3") and fields.get("bucket"):
        root = "/".join(p for p in (fields["bucket"], fields.get("prefix", "").strip("/")) if p)
        s3 = dict(options)
        endpoint = fields.get("endpoint_url")
        if endpoint and endpoint != "None":
            s3.setdefault("endpoint_url", endpoint)
        region = fields.get("region")
        if region and region != "None":
            s3.setdefault("client_kwargs", {}).setdefault("region_name", region)
        return ChunkStorage("s3", root, s3), options
    why = f"the engine does not read {kind or 'this'} storage"
    return ChunkStorage(None, options=options, why=why), options


# -- the store the engine opens --------------------------------------------------------


class IcechunkReadStore(WrapperStore[Store]):
    """An Icechunk session's store as the engine reads it: every call goes to the
    session's store; the engine's source (:class:`IcechunkSource`) reads chunk bytes
    where Icechunk says they lie, in ``storage`` (see :func:`chunk_storage`), and keeps
    each array's chunk table (for a read-only session, whose chunks never change)."""

    def __init__(self, store: Store, storage: ChunkStorage | None = None) -> None:
        super().__init__(store)
        self.storage = storage or ChunkStorage(None, why=f"no storage was given: {_HINT}")
        self._tables: dict[str, _Table | None] = {}
        self._lock = threading.Lock()
        self._remotes: dict[str, Any] = {}
        self._warned: set[tuple[str, str]] = set()

    def _with_store(self, store: Store) -> IcechunkReadStore:
        return type(self)(store, self.storage)

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self._store, "storage": self.storage}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["store"], state["storage"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"IcechunkReadStore({self._store!r})"

    def __str__(self) -> str:
        return str(self._store)

    @property
    def supports_consolidated_metadata(self) -> bool:
        return bool(getattr(self._store, "supports_consolidated_metadata", True))

    @property
    def store(self) -> Store:
        """The session's store."""
        return self._store


# -- chunk tables ------------------------------------------------------------------------


@dataclass
class _Table:
    """Every stored chunk of one array, from ``array_chunk_iterator``: its key's flat
    grid index (sorted), kind, path, offset, length, and inline bytes by row."""

    path: str  #: the array's path
    encode: Any  #: zarr's ChunkKeyEncoding of the array
    grid: tuple[int, ...]
    flat: np.ndarray
    kinds: np.ndarray
    paths: list[str]
    offsets: np.ndarray
    lengths: np.ndarray
    inlined: dict[int, bytes]


def _array_meta(store: Store, path: str) -> dict[str, Any] | None:
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    key = f"{path}/zarr.json" if path else "zarr.json"
    got = sync(store.get(key, prototype=cpu.buffer_prototype))
    if got is None:
        return None
    meta = json.loads(got.to_bytes())
    return meta if meta.get("node_type") == "array" else None


def _build_table(store: Store, path: str) -> _Table | None:
    """The chunk table of the array at ``path`` (``None``: no array there)."""
    from zarr.core.chunk_key_encodings import parse_chunk_key_encoding
    from zarr.core.sync import sync

    meta = _array_meta(store, path)
    if meta is None:
        return None
    shape = tuple(int(s) for s in meta["shape"])
    chunks = tuple(int(c) for c in meta["chunk_grid"]["configuration"]["chunk_shape"])
    grid = tuple(-(-s // c) if c else 1 for s, c in zip(shape, chunks, strict=True))
    encode = parse_chunk_key_encoding(meta.get("chunk_key_encoding", {"name": "default"}))

    async def collect() -> list[tuple[Any, ...]]:
        return [batch async for batch in store.array_chunk_iterator(path)]  # type: ignore[attr-defined]

    batches = sync(collect())
    flats, kinds, offsets, lengths = [], [], [], []
    paths: list[str] = []
    inlined: dict[int, bytes] = {}
    for coords, kind, where, offset, length, inline in batches:
        base = len(paths)
        coords = np.asarray(coords, dtype=np.int64).reshape(len(where), len(grid))
        flats.append(
            np.ravel_multi_index(tuple(coords.T), grid) if grid else np.zeros(len(where), np.int64)
        )
        kinds.append(np.asarray(kind, dtype=np.uint8))
        offsets.append(np.asarray(offset, dtype=np.int64))
        lengths.append(np.asarray(length, dtype=np.int64))
        paths.extend(where)
        inlined.update({base + int(i): bytes(data) for i, data in inline.items()})
    flat = np.concatenate(flats) if flats else np.zeros(0, np.int64)
    order = np.argsort(flat, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return _Table(
        path,
        encode,
        grid,
        flat[order],
        (np.concatenate(kinds) if kinds else np.zeros(0, np.uint8))[order],
        [paths[i] for i in order.tolist()],
        (np.concatenate(offsets) if offsets else np.zeros(0, np.int64))[order],
        (np.concatenate(lengths) if lengths else np.zeros(0, np.int64))[order],
        {int(rank[i]): data for i, data in inlined.items()},
    )


def _table(store: IcechunkReadStore, path: str) -> _Table | None:
    """The chunk table of an array: kept by the engine's store of a read-only session,
    made again for each read of a writable one, whose chunks change as it is written
    (the session says which: zarr opens its store read-only for every read)."""
    session = store.store
    if not getattr(getattr(session, "session", session), "read_only", True):
        return _build_table(session, path)
    with store._lock:
        if path not in store._tables:
            store._tables[path] = _build_table(session, path)
        return store._tables[path]


# -- locations ---------------------------------------------------------------------------


class _Remote(NamedTuple):
    """``size`` bytes at ``offset`` of the object ``key`` of the remote ``store``."""

    key: str  #: the Zarr chunk key (for messages)
    store: Any  #: a zarr FsspecStore (s3fs, fsspec's HTTP filesystem)
    name: str  #: the object's key in ``store``
    offset: int
    size: int
    virtual: bool = False  #: a virtual reference (not a chunk of the repository's storage)


class _Fallback(NamedTuple):
    """A chunk read through ``IcechunkStore.get``."""

    key: str


#: where one chunk is: a range of a local file or inline bytes (``Reference``), a range
#: of a remote object, a key for the session's ``get``, or None (missing)
Location = Reference | _Remote | _Fallback | None


def _remote_store(store: IcechunkReadStore, base: str, options: dict[str, Any]) -> Any:
    """The fsspec store of ``base`` (``s3://bucket/prefix``, ``https://host``), one a
    base for each engine store."""
    with store._lock:
        found = store._remotes.get(base)
        if found is None:
            found = store._remotes[base] = remote.open_url(base, options, read_only=False)
        return found


def _virtual(key: str, url: str, offset: int, size: int, store: IcechunkReadStore) -> Location:
    """The location of a virtual chunk at ``url``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme == "file":
        return Reference(key, rest if sep else url, offset, size)
    if scheme in ("s3", "s3a", "http", "https"):
        host, _, name = rest.partition("/")
        options = store.storage.options if scheme.startswith("s3") else {}
        base = f"{scheme}://{host}"
        return _Remote(key, _remote_store(store, base, options), name, offset, size, True)
    return _Fallback(key)


class IcechunkSource(Source):
    """Chunks of an Icechunk session's store, read where Icechunk says they lie (see
    the module); the others through the session's ``get``. Opens a session's store
    (its storage from ``storage_options``); writes go into the session, whose commit
    publishes them whole."""

    device_reads = True
    ranged_reads = True
    commits = True

    @classmethod
    def claims(cls, store: Any) -> bool:
        return isinstance(store, IcechunkReadStore) or is_icechunk_store(store)

    @classmethod
    def opens(cls, target: Any) -> bool:
        return is_icechunk_store(target)

    @classmethod
    def open(
        cls,
        target: Any,
        *,
        mode: str,
        storage_options: dict[str, Any] | None,
        consolidated: bool | None = None,
    ) -> Opened:
        # a Store object takes no storage_options: they say where its chunks lie
        return Opened(
            IcechunkReadStore(target, chunk_storage(storage_options)[0]), None, consolidated
        )

    @classmethod
    def for_store(cls, store: Any) -> Source:
        return cls(store if isinstance(store, IcechunkReadStore) else IcechunkReadStore(store))

    def locate(self, keys: list[str]) -> list[Any]:
        store: IcechunkReadStore = self.store  # made by IcechunkSource.for_store
        storage = store.storage
        by_array: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            by_array.setdefault(array_of(key), []).append(i)
        out: list[Location] = [None] * len(keys)
        for name, members in by_array.items():
            path = "" if name == "/" else name
            table = _table(store, path)
            if table is None:
                _fall_back(store, name, "Icechunk lists no chunks for it", out, keys, members)
                continue
            self._locate_array(table, storage, store, keys, members, out)
        return out

    @staticmethod
    def _locate_array(
        table: _Table,
        storage: ChunkStorage,
        store: IcechunkReadStore,
        keys: list[str],
        members: list[int],
        out: list[Location],
    ) -> None:
        prefix = f"{table.path}/" if table.path else ""
        coords = [table.encode.decode_chunk_key(keys[i][len(prefix) :]) for i in members]
        grid = np.asarray(table.grid, dtype=np.int64)
        where = np.asarray(coords, dtype=np.int64).reshape(len(members), len(grid))
        inside = np.all((where >= 0) & (where < grid), axis=1) if len(grid) else None
        flat = (
            np.ravel_multi_index(tuple(np.where(where < grid, where, 0).T), table.grid)
            if len(grid)
            else np.zeros(len(members), np.int64)
        )
        rows = np.searchsorted(table.flat, flat)
        rows = np.minimum(rows, max(len(table.flat) - 1, 0))
        found = (table.flat[rows] == flat) if len(table.flat) else np.zeros(len(members), bool)
        if inside is not None:
            found &= inside
        fallbacks: list[str] = []
        for j, i in enumerate(members):
            if not found[j]:
                continue  # not stored: the fill value
            row = int(rows[j])
            kind = int(table.kinds[row])
            offset, size = int(table.offsets[row]), int(table.lengths[row])
            key = keys[i]
            if kind == INLINE and row in table.inlined:
                out[i] = Reference(key, None, 0, 0, table.inlined[row])
            elif kind == NATIVE and storage.kind == "local":
                target = os.path.join(storage.root, "chunks", table.paths[row])
                out[i] = Reference(key, target, offset, size)
            elif kind == NATIVE and storage.kind == "s3":
                base = f"s3://{storage.root}"
                name = f"chunks/{table.paths[row]}"
                out[i] = _Remote(
                    key, _remote_store(store, base, storage.options), name, offset, size
                )
            elif kind == VIRTUAL:
                out[i] = _virtual(key, table.paths[row], offset, size, store)
            else:
                out[i] = _Fallback(key)
            if isinstance(out[i], _Fallback):
                why = (
                    f"native chunks: {storage.why}"
                    if kind == NATIVE
                    else f"virtual chunks at {table.paths[row].partition('://')[0]}:// URLs"
                    if kind == VIRTUAL
                    else f"chunks of kind {kind}, which the engine does not know"
                )
                if why not in fallbacks:
                    fallbacks.append(why)
        if fallbacks:
            _warn_fallback(store, table.path or "/", "; ".join(fallbacks))

    @classmethod
    def read_all(
        cls, sources: Sequence[Any], locations: list[Any], on_device: bool, slots: Any
    ) -> Fetched:
        return _read(sources, locations, on_device, None)

    @classmethod
    def read_ranges_all(
        cls, sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        return _read(sources, locations, on_device, ranges)


def _fall_back(
    store: IcechunkReadStore,
    name: str,
    why: str,
    out: list[Location],
    keys: list[str],
    members: list[int],
) -> None:
    for i in members:
        out[i] = _Fallback(keys[i])
    _warn_fallback(store, name, why)


def _warn_fallback(store: IcechunkReadStore, array: str, why: str) -> None:
    """One warning an array and reason for each engine store."""
    with store._lock:
        if (array, why) in store._warned:
            return
        store._warned.add((array, why))
    warn(
        f"xarray-gds: chunks of Icechunk array {array!r} are read through "
        f"IcechunkStore.get (host memory first): {why}",
        IcechunkFallbackWarning,
    )


def _narrowed(location: Location, start: int, size: int) -> Location:
    """``size`` bytes at ``start`` of what ``location`` holds (inner chunks of shards)."""
    if location is None or isinstance(location, _Fallback):
        return location
    if isinstance(location, Reference):
        return narrow(location, start, size)
    if start < 0 or size < 0 or start + size > location.size:
        raise OSError(
            f"the byte range {start}:{start + size} of chunk {location.key!r} ends past its "
            f"{location.size} bytes"
        )
    return location._replace(offset=location.offset + start, size=size)


def _read(
    sources: Sequence[Any], locations: list[Any], on_device: bool, ranges: Ranges | None
) -> Fetched:
    """Every location of a batch: local ranges and inline bytes as references are read,
    remote ranges by the remote route, the others by the session's ``get``; joined into
    one batch in location order."""
    if ranges is not None:
        starts, sizes = ranges
        locations = [
            _narrowed(loc, int(a), int(b))
            for loc, a, b in zip(locations, starts.tolist(), sizes.tolist(), strict=True)
        ]
    n = len(locations)
    groups: dict[str, list[int]] = {"refs": [], "remote": [], "store": []}
    for i, loc in enumerate(locations):
        if isinstance(loc, _Remote):
            groups["remote"].append(i)
        elif isinstance(loc, _Fallback):
            groups["store"].append(i)
        else:
            groups["refs"].append(i)  # None (missing) reads as missing there
    parts: list[tuple[np.ndarray, Fetched]] = []
    if groups["refs"] or n == 0:
        idx = np.asarray(groups["refs"], dtype=np.int64)
        refs = [locations[i] for i in groups["refs"]]
        got = read_references(refs, on_device, [None] * len(refs))
        parts.append((idx, got if on_device else HostBatch(got)))
    if groups["remote"]:
        idx = np.asarray(groups["remote"], dtype=np.int64)
        parts.append((idx, _read_remote([locations[i] for i in groups["remote"]], on_device)))
    if groups["store"]:
        idx = np.asarray(groups["store"], dtype=np.int64)
        keys = [locations[i].key for i in groups["store"]]
        stores = [StoreSource(sources[i].store.store) for i in groups["store"]]
        if ranges is None:
            got = StoreSource.read_all(stores, keys, on_device, None)
        else:
            got = StoreSource.read_ranges_all(
                stores, keys, (ranges[0][idx], ranges[1][idx]), on_device
            )
        parts.append((idx, got))
    if len(parts) == 1 and len(parts[0][0]) == n:
        return parts[0][1]
    return join(parts, n, on_device)


def _read_remote(locations: list[_Remote], on_device: bool) -> Fetched:
    stores = [loc.store for loc in locations]
    names = [loc.name for loc in locations]
    ranges = (
        np.array([loc.offset for loc in locations], dtype=np.int64),
        np.array([loc.size for loc in locations], dtype=np.int64),
    )
    if on_device:
        got: DeviceBatch = remote_device.read_device(stores, names, ranges=ranges)
        missing = np.flatnonzero(got.sizes < 0).tolist()
    else:
        found = remote_host.read_host(stores, names, ranges)
        missing = [i for i, data in enumerate(found) if data is None]
    if missing:  # Icechunk lists the chunk: its object is gone, or the storage is not this
        loc = locations[missing[0]]
        check = (
            "the virtual reference's object is gone, or storage_options (endpoint_url, "
            "credentials) are not those of its bucket"
            if loc.virtual
            else f"check storage_options[{STORAGE_KEY!r}] (the repository's bucket and "
            "prefix) and the endpoint"
        )
        raise OSError(
            f"chunk {loc.key!r} of the Icechunk repository is not at "
            f"{store_url(loc.store)}/{loc.name} ({len(missing)} chunks missing): "
            f"{check}, or read the repository with engine='zarr'"
        )
    return got if on_device else HostBatch(found)

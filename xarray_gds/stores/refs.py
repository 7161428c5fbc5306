"""Virtual Zarr stores over NetCDF4/HDF5 files: kerchunk reference sets.

A reference set (kerchunk's JSON or Parquet format, or the dict in memory, as
``kerchunk.hdf.SingleHdf5ToZarr``, ``kerchunk.combine.MultiZarrToZarr`` and
VirtualiZarr's ``to_kerchunk`` write it) maps each Zarr key to its bytes: metadata and
small chunks inline, other chunks as ``[url, offset, length]`` ranges of the original
files. fsspec's ``ReferenceFileSystem`` loads the set (both formats, templates and
generators); :class:`ReferenceStore` is a read-only zarr Store over it, and
:class:`ReferenceSource` hands the chunk ranges to the read engine,
which reads them straight from the files (kvikio into device memory, or ``pread`` on
the host; every range of a batch in flight) and decodes them in batches like any other
Zarr chunk.

Targets are local files (paths or ``file://`` URLs). Other URLs (``s3://``,
``https://``...) are read through fsspec on the host, then copied to the device.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer

from xarray_gds._optional import need
from xarray_gds.batch import Fetched, HostBatch, parallel
from xarray_gds.stores.base import Opened, Ranges, Source
from xarray_gds.stores.urls import mask_logs, public_url, redact, scrubbed

if TYPE_CHECKING:
    from zarr.core.buffer import BufferPrototype

__all__ = [
    "Reference",
    "ReferenceSource",
    "ReferenceRangeError",
    "ReferenceStore",
    "ReferenceTargetError",
    "is_reference_set",
    "open_reference_store",
    "read_references",
]

_METADATA_KEYS = (".zgroup", ".zattrs", ".zarray", "zarr.json", ".zmetadata")


class ReferenceTargetError(OSError):
    """A reference points at bytes that cannot be read: a missing file, or a range
    past its end (a truncated or replaced file).

    Attributes
    ----------
    key : str
        The Zarr key of the reference.
    target : str
        The file it points at.
    """

    def __init__(self, key: str, target: str, reason: str) -> None:
        self.key = key
        self.target = public_url(target)  # no user information (a password) of a URL
        super().__init__(
            f"reference {key!r} points at {self.target!r}: {reason}. The references no longer "
            "match the file: restore the file, or make the references again (kerchunk, "
            "VirtualiZarr) from the file as it is now."
        )


#: the largest byte offset (and offset + length) a reference may give: int64's
_MAX_BYTE = (1 << 63) - 1


class ReferenceRangeError(ValueError):
    """A reference whose byte range is not one: a negative offset or length, or an end
    past what a 64-bit offset holds.

    Attributes
    ----------
    key : str
        The Zarr key of the reference.
    """

    def __init__(self, key: str, target: str, reason: str) -> None:
        self.key = key
        super().__init__(
            f"reference {key!r} (to {public_url(target)!r}) has an invalid byte range: "
            f"{reason}. The reference set is damaged or was not written by kerchunk or "
            "VirtualiZarr: make the references again from the file."
        )


def _byte_range(key: str, part: Sequence[Any]) -> tuple[int, int]:
    """The ``(offset, length)`` of a ``[url, offset, length]`` reference, checked;
    ``(0, -1)`` (the whole file) for ``[url]``."""
    if len(part) == 1:
        return 0, -1
    target = str(part[0])
    if len(part) != 3:
        raise ReferenceRangeError(key, target, f"{len(part)} items, not [url, offset, length]")
    values = []
    for name, value in zip(("offset", "length"), part[1:], strict=True):
        if isinstance(value, bool) or not isinstance(value, int | np.integer | float):
            raise ReferenceRangeError(key, target, f"the {name} {value!r} is not an integer")
        if isinstance(value, float) and not value.is_integer():  # NaN, inf, 1.5
            raise ReferenceRangeError(key, target, f"the {name} {value!r} is not an integer")
        values.append(int(value))
    offset, length = values
    if offset < 0:
        raise ReferenceRangeError(key, target, f"the offset {offset} is negative")
    if length < 0:
        raise ReferenceRangeError(key, target, f"the length {length} is negative")
    if offset + length > _MAX_BYTE:
        raise ReferenceRangeError(
            key, target, f"offset {offset} + length {length} is past the largest byte offset"
        )
    return offset, length


class Reference(NamedTuple):
    """Where the bytes of one key are: ``data`` (inline), or ``size`` bytes at
    ``offset`` of ``target`` (``size`` -1: the whole file)."""

    key: str
    target: str | None
    offset: int
    size: int
    data: bytes | None = None
    remote: bool = False


def narrow(ref: Reference, start: int, size: int) -> Reference:
    """The ``size`` bytes at ``start`` of what ``ref`` points at, as a reference; a range
    past the end of the referenced bytes raises :class:`ReferenceTargetError`."""
    held = len(ref.data) if ref.data is not None else ref.size
    if start < 0 or size < 0 or (held >= 0 and start + size > held):
        raise ReferenceTargetError(
            ref.key,
            ref.target or "(inline)",
            f"the byte range {start}:{start + size} ends past its {held} referenced bytes",
        )
    if ref.data is not None:
        return ref._replace(data=ref.data[start : start + size])
    return ref._replace(offset=ref.offset + start, size=size)


def _local_path(url: str) -> str | None:
    """The local path of a target URL, or ``None`` for a remote one."""
    if url.startswith("file://"):
        return url[len("file://") :]
    if url.startswith("local://"):
        return url[len("local://") :]
    return None if "://" in url else url


def _inline(value: Any) -> bytes:
    """The bytes of an inline reference (kerchunk: text, or ``base64:``-prefixed)."""
    if hasattr(value, "to_bytes"):
        value = value.to_bytes()
    if isinstance(value, str):
        value = value.encode()
    if value.startswith(b"base64:"):
        return base64.b64decode(value[len(b"base64:") :])
    return bytes(value)


def _is_parquet_refs(path: Path) -> bool:
    """A directory of kerchunk's Parquet references: its ``.zmetadata`` holds the
    ``record_size`` of the reference files (a consolidated Zarr store's does not)."""
    meta = path / ".zmetadata"
    if not meta.is_file():
        return False
    try:
        return "record_size" in json.loads(meta.read_bytes())
    except (ValueError, OSError):
        return False


def is_reference_set(obj: Any) -> bool:
    """Whether ``obj`` is a kerchunk reference set: a dict of references (``{"version":
    1, "refs": {...}}`` or the references themselves), a ``.json`` file, or a directory
    of Parquet references."""
    if isinstance(obj, dict):
        if isinstance(obj.get("refs"), dict):
            return True
        return any(k in obj or f"/{k}" in obj for k in _METADATA_KEYS)
    if isinstance(obj, str | os.PathLike):
        text = os.fspath(obj)
        if text.startswith("reference://"):
            return True
        local = _local_path(text)
        if local is None:
            return text.endswith((".json", ".json.gz", ".json.zst"))
        path = Path(local).expanduser()
        if path.suffix == ".json":
            return path.is_file()
        return path.is_dir() and _is_parquet_refs(path)
    return False


def _parquet_protocol(root: str) -> str:
    """The protocol of the targets of a local Parquet reference set ("file" for local
    paths), read from the first record of its first array.

    Without ``remote_protocol``, fsspec (2026.9) finds the protocol by walking every
    top-level directory of the set as if it were an array, and a group's directory has
    no ``.zarray``: the walk raises KeyError or not depending on set order (the hash
    seed). Naming the protocol skips that walk."""
    from fsspec.core import split_protocol
    from fsspec.implementations.reference import LazyReferenceMapper

    mapper = LazyReferenceMapper(root)
    arrays = sorted(f for f in mapper.listdir() if f"{f}/.zarray" in mapper.zmetadata)
    for field in arrays:
        try:
            records = mapper.open_refs(field, 0)
        except OSError:  # no record file: every reference of the field inline or absent
            continue
        for path in (records or {}).get("path", ()):
            if isinstance(path, str) and path:
                return split_protocol(str(path))[0] or "file"
    return "file"


class ReferenceStore(Store):
    """A read-only zarr Store over a kerchunk reference set.

    Parameters
    ----------
    refs : dict, str or os.PathLike
        The references: a dict, a JSON file or a Parquet reference directory.
    storage_options : dict, optional
        Passed to ``fsspec.filesystem("reference", fo=refs, ...)``: e.g.
        ``remote_protocol`` and ``remote_options`` for remote targets,
        ``target_options`` for a remote JSON file, ``template_overrides``.
    """

    supports_writes = False
    supports_deletes = False
    supports_listing = True
    supports_partial_writes = False

    def __init__(self, refs: Any, storage_options: dict[str, Any] | None = None) -> None:
        fsspec = need("fsspec", "reading reference sets")

        super().__init__(read_only=True)
        fo = os.fspath(refs) if isinstance(refs, os.PathLike) else refs
        if isinstance(fo, str):
            fo = fo.removeprefix("reference://") or fo
            local = _local_path(fo)
            if local is not None:
                fo = str(Path(local).expanduser().resolve())
        self._spec = (fo, dict(storage_options or {}))
        options = {"skip_instance_cache": True, **self._spec[1]}
        if isinstance(fo, str) and _is_parquet_refs(Path(fo)):
            need("fastparquet", "reading Parquet reference sets")
        if isinstance(fo, str) and "remote_protocol" not in options and _is_parquet_refs(Path(fo)):
            options["remote_protocol"] = _parquet_protocol(fo)
        mask_logs()  # fsspec logs the URLs of remote targets, user information and all
        failure: BaseException | None = None
        try:
            self.fs = fsspec.filesystem("reference", fo=fo, **options)
        except Exception as err:
            failure = scrubbed(err, options, fo if isinstance(fo, str) else None)
            if failure is None:
                raise
        if failure is not None:  # outside the except block: the raw error is not chained
            raise failure from None
        self._is_open = True

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self._spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(*state["spec"])  # type: ignore[misc]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReferenceStore) and other.fs is self.fs

    def __hash__(self) -> int:
        return id(self.fs)

    def __repr__(self) -> str:
        fo = self._spec[0]
        return f"ReferenceStore({public_url(fo) if isinstance(fo, str) else '<dict>'!r})"

    def with_read_only(self, read_only: bool = False) -> ReferenceStore:
        if not read_only:
            raise ValueError("a ReferenceStore is read-only: it cannot be opened for writing")
        return self

    # -- references ---------------------------------------------------------------
    def resolve(self, key: str) -> Reference | None:
        """Where the bytes of ``key`` are; ``None`` when the set has no such key."""
        try:
            part = self.fs.references[key]
        except KeyError:
            return None
        if callable(part):
            part = part()
        if isinstance(part, str | bytes) or hasattr(part, "to_bytes"):
            return Reference(key, None, 0, 0, _inline(part))
        if not isinstance(part[0], str) or not part[0]:
            # no target: a chunk the file never wrote (Parquet sets hold a null path,
            # which pandas may read as NaN): missing, as fsspec's reader finds it
            return None
        url = part[0]
        offset, size = _byte_range(key, part)
        local = _local_path(url)
        if local is None:
            return Reference(key, url, offset, size, None, True)
        return Reference(key, local, offset, size)

    def _read(self, ref: Reference) -> bytes:
        """The bytes of one reference (on the host)."""
        if ref.data is not None:
            return ref.data
        got = read_references([ref], False, [self])[0]
        assert got is not None
        return got.tobytes()

    # -- Store API ----------------------------------------------------------------
    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        from xarray_gds.stores.files import byte_span as _byte_span

        ref = self.resolve(key)
        if ref is None:
            return None
        data = ref.data if ref.data is not None else await asyncio.to_thread(self._read, ref)
        if key.rsplit("/", 1)[-1] == ".zarray":
            _check_codecs(key, data)
        if byte_range is not None:
            start, nbytes = _byte_span(len(data), byte_range)
            data = data[start : start + nbytes]
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        return self.resolve(key) is not None

    async def set(self, key: str, value: Buffer) -> None:
        raise ValueError(f"a ReferenceStore is read-only: cannot write {key!r}")

    async def delete(self, key: str) -> None:
        raise ValueError(f"a ReferenceStore is read-only: cannot delete {key!r}")

    async def set_partial_values(self, key_start_values: Iterable[Any]) -> None:
        raise ValueError("a ReferenceStore is read-only")

    async def list(self) -> AsyncIterator[str]:
        for key in list(self.fs.references):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in list(self.fs.references):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.strip("/")
        try:
            names = self.fs.ls(prefix, detail=False)
        except FileNotFoundError:
            return
        base = f"{prefix}/" if prefix else ""
        for name in sorted({str(n).rstrip("/").removeprefix(base) for n in names}):
            if name and "/" not in name:
                yield name


def _check_codecs(key: str, data: bytes) -> None:
    """Raise a clear error for a Zarr v2 array whose filters or compressor have no
    decoder here (HDF5 szip, or a plugin filter that no installed package registers
    with numcodecs); zarr's own error names neither the array nor the file format."""
    import numcodecs

    try:
        meta = json.loads(data)
    except ValueError:
        return
    for codec in [*(meta.get("filters") or []), meta.get("compressor")]:
        if not isinstance(codec, dict) or "id" not in codec:
            continue
        try:
            numcodecs.get_codec(dict(codec))
        except Exception as err:
            name = key.rsplit("/", 1)[0] if "/" in key else "/"
            raise ValueError(
                f"variable {name!r} of the reference set uses the filter {codec['id']!r} "
                f"({codec}), which has no decoder here ({err}). Install a package that "
                "registers it with numcodecs (HDF5 plugin filters: hdf5plugin or "
                "imagecodecs), or make the references without this variable."
            ) from None


def open_reference_store(
    refs: Any, mode: str, storage_options: dict[str, Any] | None, consolidated: bool | None
) -> tuple[ReferenceStore, bool | None]:
    """The store of a reference set, and the ``consolidated`` to open it with (``False``
    unless asked: reference sets seldom hold consolidated metadata)."""
    if mode != "r":
        raise ValueError(
            f"a kerchunk reference set is read-only: open it with mode='r', not {mode!r}"
        )
    store = ReferenceStore(refs, storage_options)
    if consolidated is None and store.resolve(".zmetadata") is None:
        consolidated = False
    return store, consolidated


def _check_local(refs: Sequence[Reference | None], sizes: np.ndarray) -> list[str]:
    """The local target of each reference ("" for the others), each file ``stat``-ed
    once: a missing file or a range past its end raises :class:`ReferenceTargetError`.
    Whole-file references get the file's size in ``sizes``."""
    paths = [""] * len(refs)
    files: dict[str, int] = {}
    for i, ref in enumerate(refs):
        if ref is None or ref.data is not None or ref.remote:
            continue
        assert ref.target is not None
        size = files.get(ref.target)
        if size is None:
            try:
                size = files[ref.target] = os.stat(ref.target).st_size
            except (FileNotFoundError, NotADirectoryError):
                raise ReferenceTargetError(ref.key, ref.target, "the file does not exist") from None
        want = size - ref.offset if ref.size < 0 else ref.size
        if ref.offset < 0 or want < 0 or ref.offset + want > size:
            raise ReferenceTargetError(
                ref.key,
                ref.target,
                f"its {ref.size} bytes at offset {ref.offset} end past the end of the "
                f"{size}-byte file (truncated, or not the file the references were made from)",
            )
        paths[i] = ref.target
        sizes[i] = want
    return paths


def _read_remote(refs: Sequence[Reference | None], stores: Sequence[Any]) -> dict[int, bytes]:
    """Remote references, through each store's fsspec reference filesystem."""
    which = [i for i, r in enumerate(refs) if r is not None and r.remote]
    got: dict[int, bytes] = {}

    def one(j: int) -> None:
        i = which[j]
        ref = refs[i]
        assert ref is not None and ref.target is not None
        failure: ReferenceTargetError | None = None
        try:
            data = bytes(stores[i].fs.cat_file(ref.key))
        except Exception as err:  # fsspec's and aiohttp's texts may hold credentials
            options = getattr(stores[i], "_spec", (None, None))[1]
            detail = redact(f"{type(err).__name__}: {err}", options, ref.target)
            why = "not found" if isinstance(err, FileNotFoundError) else "cannot be read"
            failure = ReferenceTargetError(ref.key, ref.target, f"{why} ({detail})")
        if failure is not None:  # raised outside the except block: nothing chained
            raise failure from None
        if ref.size >= 0 and len(data) != ref.size:
            raise ReferenceTargetError(
                ref.key,
                ref.target,
                f"{len(data)} of its {ref.size} bytes at offset {ref.offset} came (the range "
                "ends past the end of the file, or the file is shorter than when the "
                "references were made)",
            )
        got[i] = data

    parallel(one, len(which), min_items=2)
    return got


def read_references(
    refs: Sequence[Reference | None], on_device: bool, stores: Sequence[Any]
) -> Any:
    """The bytes of every reference (``None``: a key the set does not hold, read as a
    missing chunk): one DeviceBatch when ``on_device``, else a list of uint8 arrays.

    Local ranges are read by :func:`xarray_gds.stores.files.read_ranges_device` (kvikio, or
    staged through pinned memory for small ranges) or
    :func:`~xarray_gds.stores.files.read_ranges_host`; inline bytes are copied in, remote
    ranges read through fsspec on the host.
    """
    from xarray_gds.stores.files import read_ranges_device, read_ranges_host

    n = len(refs)
    starts = np.array([0 if r is None else r.offset for r in refs], dtype=np.int64)
    sizes = np.full(n, -1, dtype=np.int64)
    paths = _check_local(refs, sizes)
    extra: dict[int, bytes] = {i: r.data for i, r in enumerate(refs) if r and r.data is not None}
    if any(r is not None and r.remote for r in refs):
        extra.update(_read_remote(refs, stores))
    if not on_device:
        out = read_ranges_host(paths, starts, sizes)
        for i, data in extra.items():
            out[i] = np.frombuffer(data, dtype=np.uint8)
        return out
    batch = read_ranges_device(paths, starts, sizes)
    if not extra:
        return batch
    from xarray_gds import device as _device
    from xarray_gds.batch import pack

    cp = _device.cupy()
    arrays: list[Any] = [None] * n
    for i, (start, size) in enumerate(
        zip(batch.offsets.tolist(), batch.sizes.tolist(), strict=True)
    ):
        if size >= 0:
            arrays[i] = batch.arena[start : start + size]
    for i, data in extra.items():
        arrays[i] = cp.asarray(np.frombuffer(data, dtype=np.uint8))
    return pack(arrays)


class ReferenceSource(Source):
    """Chunks of a reference set (:class:`ReferenceStore`): byte ranges of the files they
    point at, read by kvikio into one device arena or by ``pread`` on the host, and
    inline chunks. Opens a reference set (:func:`is_reference_set`), read-only."""

    device_reads = True
    ranged_reads = True

    @classmethod
    def claims(cls, store: Any) -> bool:
        return isinstance(store, ReferenceStore)

    @classmethod
    def opens(cls, target: Any) -> bool:
        return is_reference_set(target)

    @classmethod
    def open(
        cls,
        target: Any,
        *,
        mode: str,
        storage_options: dict[str, Any] | None,
        consolidated: bool | None = None,
    ) -> Opened:
        store, consolidated = open_reference_store(target, mode, storage_options, consolidated)
        return Opened(store, None, consolidated)

    def locate(self, keys: list[str]) -> list[Any]:
        resolve = self.store.resolve
        return [resolve(key) for key in keys]

    @classmethod
    def read_all(
        cls, sources: Sequence[Any], locations: list[Any], on_device: bool, slots: Any
    ) -> Fetched:
        found = read_references(locations, on_device, [s.store for s in sources])
        return found if on_device else HostBatch(found)

    @classmethod
    def read_ranges_all(
        cls, sources: Sequence[Any], locations: list[Any], ranges: Ranges, on_device: bool
    ) -> Fetched:
        """Byte ranges of referenced chunks (inner chunks of a shard a reference points
        at): each reference narrowed to its range, then read as :meth:`read_all`."""
        starts, sizes = ranges
        narrowed = [
            None if ref is None else narrow(ref, int(start), int(size))
            for ref, start, size in zip(locations, starts.tolist(), sizes.tolist(), strict=True)
        ]
        return cls.read_all(sources, narrowed, on_device, None)

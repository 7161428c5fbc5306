"""A local-directory zarr Store that reads chunk bytes straight into GPU memory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, cpu
from zarr.storage import LocalStore

from xarray_gds import config
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch, pack_offsets, parallel
from xarray_gds.locking import DEFAULT_TIMEOUT, WriterLock, writer_lock

if TYPE_CHECKING:
    from zarr.core.buffer import BufferPrototype

__all__ = [
    "DeviceBatch",
    "GdsStore",
    "is_metadata_key",
    "read_files_device",
    "read_file",
    "read_files_host",
    "read_threads",
]

_METADATA_NAMES = frozenset({"zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata"})


def is_metadata_key(key: str) -> bool:
    """True for keys that hold Zarr metadata (always returned in host memory)."""
    return key.rsplit("/", 1)[-1] in _METADATA_NAMES


def _is_gpu_prototype(prototype: BufferPrototype) -> bool:
    return not issubclass(prototype.buffer, cpu.Buffer)


def _byte_span(size: int, byte_range: ByteRequest | None) -> tuple[int, int]:
    """(offset, nbytes) of ``byte_range`` in an object of ``size`` bytes, as LocalStore."""
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        start = min(byte_range.start, size)
        return start, max(0, min(byte_range.end, size) - start)
    if isinstance(byte_range, OffsetByteRequest):
        start = min(byte_range.offset, size)
        return start, size - start
    if isinstance(byte_range, SuffixByteRequest):
        start = max(0, size - byte_range.suffix)
        return start, size - start
    raise TypeError(f"Unexpected byte_range, got {byte_range!r}.")


def _read_host(path: Path, byte_range: ByteRequest | None) -> bytes:
    with path.open("rb") as f:
        offset, nbytes = _byte_span(os.fstat(f.fileno()).st_size, byte_range)
        f.seek(offset)
        return f.read(nbytes)


def _read_device(path: Path, byte_range: ByteRequest | None) -> Any:
    """Read a byte span of ``path`` into a new CuPy uint8 array with kvikio."""
    offset, nbytes = _byte_span(path.stat().st_size, byte_range)
    out = _device.cupy().empty(nbytes, dtype=np.uint8)
    if nbytes:
        _read_kvikio([(path, offset, 0, nbytes)], out)
    return out


def read_files_host(paths: list[str]) -> list[np.ndarray | None]:
    """Whole files as uint8 arrays (``None`` for missing files), read by threads."""
    out: list[np.ndarray | None] = [None] * len(paths)

    def one(i: int) -> None:
        out[i] = read_file(paths[i])

    parallel(one, len(paths), min_items=2)  # a chunk file is usually worth a thread
    return out


def read_file(path: str) -> np.ndarray | None:
    """A whole file as a uint8 array; ``None`` when it is missing (or a directory)."""
    # os-level calls: half the cost of a Python file object for small chunks
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
        fd = os.open(path, os.O_RDONLY)
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                return None
            data = np.empty(info.st_size, dtype=np.uint8)
            got = 0
            while got < data.size:  # one call reads at most about 2 GiB
                n = os.preadv(fd, [data[got:]], got)
                if not n:
                    break
                got += n
            return data[:got]
        finally:
            os.close(fd)
    return None


def write_file(path: str, data: Any) -> None:
    """Write ``data`` (anything with the buffer protocol) to ``path`` whole or not at
    all: into a temporary file beside it, renamed into place. Missing parent
    directories are made. os-level calls: a chunk write costs a third less than
    through Python file objects and ``pathlib``.
    """
    tmp = f"{path}.{os.urandom(16).hex()}.partial"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, flags, 0o666)
    try:
        try:
            view = memoryview(data).cast("B")
            while view.nbytes:  # one call writes at most about 2 GiB
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_tree(path: str) -> None:
    """Delete the directory ``path`` and everything below it (as ``shutil.rmtree``:
    links inside it are removed, not followed, and ``path`` itself may not be a link),
    files and then each level of directories deleted in parallel on the host pool."""
    if os.path.islink(path):
        raise OSError(f"cannot remove a directory tree through a symbolic link: {path}")

    files: list[str] = []
    levels: list[list[str]] = []

    def walk(directory: str, depth: int) -> None:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, depth + 1)
                else:
                    files.append(entry.path)
        while len(levels) <= depth:
            levels.append([])
        levels[depth].append(directory)

    walk(path, 0)
    parallel(lambda i: os.unlink(files[i]), len(files))
    for level in reversed(levels):
        parallel(lambda i, level=level: os.rmdir(level[i]), len(level))


def _sizes(paths: list[str]) -> np.ndarray:
    """Size of each file, -1 for missing ones (``stat`` calls on :func:`read_threads`
    threads for files of no size: one by default)."""
    sizes = np.full(len(paths), -1, dtype=np.int64)

    def one(i: int) -> None:
        try:
            st = os.stat(paths[i])
        except (FileNotFoundError, NotADirectoryError):
            return
        if not stat.S_ISDIR(st.st_mode):
            sizes[i] = st.st_size

    parallel(one, len(paths), read_threads(0))
    return sizes


#: Mean file size from which staged reads use more than one thread by default.
_THREADED_READ_BYTES = 64 << 10


def read_threads(mean_bytes: float) -> int:
    """Threads that read (or ``stat``) a batch of files of ``mean_bytes`` on average.

    ``XARRAY_GDS_READ_THREADS`` when set; otherwise 1 for files under 64 KiB and 4 from
    there. Each file costs a few system calls made from Python, and each call gives up
    the GIL and takes it back: with many threads the handoffs cost more than the calls.
    Measured on an H200 host (16 cores): loading 97,656 chunks of 1 KiB took 12.2 us a
    chunk with 1 thread, 17.4 with 2 and 28.3 with 16; reading 7,600 files of 158 KB
    into pinned memory 0.10 s with 4 threads and 0.17 s with 8, 16 or 32.
    """
    configured = config.get("read_threads")
    if configured:
        return max(1, int(configured))
    return 1 if mean_bytes < _THREADED_READ_BYTES else 4


_OPEN_FILES = 512


def small_read_bytes() -> int:
    """Mean range size up to which reads are staged through pinned host memory.

    ``XARRAY_GDS_SMALL_READ`` (bytes, default 256 KiB). Below it, per-read costs
    (a kvikio file handle opens each file twice, and each read is its own copy to
    the device) outweigh the transfer, so threads read every range into one pinned
    host buffer and a single copy moves it to the device.
    """
    return int(config.get("small_read"))


#: Most pinned staging bytes that a read without ``stat`` calls reserves (its slots).
_SLOTTED_MAX_BYTES = 1 << 30


def read_files_device(paths: list[str], slot: int | np.ndarray | None = None) -> DeviceBatch:
    """Read whole files into one device arena, all reads in flight at once.

    ``slot`` is the size that each file (or every file) is expected to fit in, e.g. a
    chunk's :attr:`~xarray_gds.codecs.DecodeChain.stored_bound`. When given and small
    (staged reads, see :func:`small_read_bytes`), the files are read without first
    ``stat``-ing each one (see :func:`_read_slotted`); a file larger than its slot is
    still read whole. Otherwise every file is ``stat``-ed, then read.
    """
    n = len(paths)
    if slot is not None and n:
        slots = np.broadcast_to(np.asarray(slot, dtype=np.int64), (n,))
        slots = (slots + 15) // 16 * 16
        total = int(slots.sum())
        if total <= _SLOTTED_MAX_BYTES and total <= 2 * small_read_bytes() * n:
            return _read_slotted(paths, slots)
    sizes = _sizes(paths)
    return read_ranges_device(paths, np.zeros(n, dtype=np.int64), sizes)


def _read_slotted(paths: list[str], slots: np.ndarray) -> DeviceBatch:
    """Whole files into one device arena, each thread reading its share of the files
    into its own region of a pinned buffer, each file into at most ``slots[i]`` bytes.

    A file that fills its slot is checked with ``fstat`` (one that does not has been
    read whole); larger ones are read again afterwards into the end of the arena.
    This saves the ``stat`` pass before the reads (a system call a file, and one more
    GIL handoff: it cost a third of the reads' time of ``open_mfdataset`` blocks, with
    dask's threads running beside it). Each region is packed (16-byte aligned) and
    copied to the device in one transfer.
    """
    cp = _device.cupy()
    import cupyx

    n = len(paths)
    threads = min(n, read_threads(float(slots.mean())))
    edges = np.linspace(0, n, threads + 1).astype(np.int64)
    slot_at = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(slots, out=slot_at[1:])
    base = slot_at[edges]  # each thread's region of the pinned buffer
    capacity = int(base[-1])
    pinned = cupyx.empty_pinned((_pinned_size(capacity),), dtype=np.uint8)[:capacity]
    view = memoryview(pinned)
    sizes = np.full(n, -1, dtype=np.int64)
    at = np.zeros(n, dtype=np.int64)  # where each file's bytes are in the pinned buffer
    used = np.zeros(threads, dtype=np.int64)
    larger: dict[int, int] = {}  # files larger than their slot, and their sizes

    def region(t: int) -> None:
        pos = int(base[t])
        for i in range(int(edges[t]), int(edges[t + 1])):
            slot = int(slots[i])
            try:
                fd = os.open(paths[i], os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                got = os.preadv(fd, [view[pos : pos + slot]], 0)
                if got == slot:
                    size = os.fstat(fd).st_size
                    if size > slot:
                        larger[i] = size
                        continue
            except IsADirectoryError:
                continue
            finally:
                os.close(fd)
            sizes[i] = got
            at[i] = pos
            pos += (got + 15) // 16 * 16
        used[t] = pos - int(base[t])

    if threads > 1:
        parallel(region, threads, threads)
    else:
        region(0)
    starts = np.zeros(threads + 1, dtype=np.int64)  # each region's place in the arena
    np.cumsum(used, out=starts[1:])
    later = sorted(larger)
    later_offsets, later_total = pack_offsets(np.array([larger[i] for i in later], np.int64))
    packed = int(starts[-1])
    arena = cp.empty(max(packed + later_total, 1), dtype=cp.uint8)
    stream = cp.cuda.get_current_stream()
    for t in range(threads):
        if used[t]:
            first = int(base[t])
            arena[starts[t] : starts[t + 1]].set(pinned[first : first + used[t]], stream=stream)
    # the pinned buffer goes back to CuPy's pool when this returns: finish the copies
    stream.synchronize()
    which = np.searchsorted(edges, np.arange(n), side="right") - 1
    offsets = np.where(sizes >= 0, at - base[which] + starts[which], 0)
    if later:
        reads = []
        for i, start in zip(later, later_offsets.tolist(), strict=True):
            offsets[i], sizes[i] = packed + start, larger[i]
            reads.append((paths[i], 0, start, larger[i]))
        _read_staged(reads, arena[packed:], later_total)
    return DeviceBatch(arena, offsets, sizes)


def read_ranges_device(
    paths: list[str] | list[Path], starts: np.ndarray, sizes: np.ndarray
) -> DeviceBatch:
    """Read ``sizes[i]`` bytes at ``starts[i]`` of ``paths[i]`` into one device arena.

    Large ranges go through kvikio (GPUDirect Storage, or its compat mode), every read
    issued before any is waited on; small ones (see :func:`small_read_bytes`) are
    staged through pinned host memory. Each file is opened once however many ranges
    come from it. Ranges with a negative size are missing and left out.
    """
    cp = _device.cupy()
    offsets, total = pack_offsets(sizes)
    arena = cp.empty(max(total, 1), dtype=cp.uint8)
    present = sizes > 0
    if not present.any():
        return DeviceBatch(arena, offsets, sizes)
    reads = [
        (path, at, start, size)
        for path, at, start, size in zip(
            paths, starts.tolist(), offsets.tolist(), sizes.tolist(), strict=True
        )
        if size > 0
    ]
    if float(sizes[present].mean()) <= small_read_bytes():
        _read_staged(reads, arena, total)
    else:
        _read_kvikio(reads, arena)
    return DeviceBatch(arena, offsets, sizes)


def _short_read(path: Any, got: int, size: int) -> OSError:
    return OSError(
        f"short read from {path}: got {got} of {size} bytes; the file is truncated or "
        "changed while it was read"
    )


def _read_kvikio(reads: list[tuple[Any, int, int, int]], arena: Any) -> None:
    kvikio = _device.kvikio()
    # kvikio writes into the arena outside CuPy's stream order, and CuPy's pool may
    # have handed out memory that kernels queued on this stream still read (a buffer
    # another batch just freed): let them finish first
    _device.cupy().cuda.get_current_stream().synchronize()
    # at most _OPEN_FILES files open at once (many small chunks would exhaust the
    # process's file descriptors); all reads of a window are in flight together
    for first in range(0, len(reads), _OPEN_FILES):
        handles: dict[Any, Any] = {}
        try:
            futures = []
            for path, at, start, size in reads[first : first + _OPEN_FILES]:
                f = handles.get(path)
                if f is None:
                    f = handles[path] = kvikio.CuFile(path, "r")
                futures.append((path, size, f.pread(arena[start : start + size], size, at)))
            for path, size, future in futures:
                got = future.get()
                if got != size:
                    raise _short_read(path, got, size)
        finally:
            for f in handles.values():
                f.close()


def _pinned_size(nbytes: int) -> int:
    """Bytes of the pinned staging buffer of ``nbytes``: the next power of two (1 MiB at
    least) up to 256 MiB, then the next multiple of 64 MiB (at most a quarter more)."""
    if nbytes > 256 << 20:
        return -(-nbytes // (64 << 20)) * (64 << 20)
    return 1 << max(20, (max(nbytes, 1) - 1).bit_length())


def _read_staged(reads: list[tuple[Any, int, int, int]], arena: Any, total: int) -> None:
    """Threads read every range into one pinned host buffer; one copy to ``arena``."""
    cp = _device.cupy()
    import cupyx

    # CuPy's pinned pool reuses a freed block only for a request of the same (rounded)
    # size, and a new pinned allocation costs more than the reads: sizes rounded to a
    # power of two let reads of stores of about the same size share blocks
    pinned = cupyx.empty_pinned((_pinned_size(total),), dtype=np.uint8)[:total]
    view = memoryview(pinned)
    # ranges of one file together, so that each file is opened once
    by_file: dict[Any, list[tuple[int, int, int]]] = {}
    for path, at, start, size in reads:
        by_file.setdefault(path, []).append((at, start, size))
    files = list(by_file.items())

    def one(i: int) -> None:
        path, ranges = files[i]
        fd = os.open(path, os.O_RDONLY)
        try:
            for at, start, size in ranges:
                got = os.preadv(fd, [view[start : start + size]], at)
                if got != size:
                    raise _short_read(path, got, size)
        finally:
            os.close(fd)

    parallel(one, len(files), read_threads(total / len(reads)))
    stream = cp.cuda.get_current_stream()
    arena[:total].set(pinned, stream=stream)
    # the pinned buffer goes back to CuPy's pool when this returns: finish the copy
    stream.synchronize()


def read_ranges_host(
    paths: list[str] | list[Path], starts: np.ndarray, sizes: np.ndarray
) -> list[np.ndarray | None]:
    """Host counterpart of :func:`read_ranges_device`: a uint8 array per range."""
    out: list[np.ndarray | None] = [None] * len(paths)

    def one(i: int) -> None:
        size = int(sizes[i])
        if size < 0:
            return
        with open(paths[i], "rb") as f:
            data = os.pread(f.fileno(), size, int(starts[i]))
        if len(data) != size:
            raise OSError(f"short read from {paths[i]}: got {len(data)} of {size} bytes")
        out[i] = np.frombuffer(data, dtype=np.uint8)

    parallel(one, len(paths))
    return out


@dataclass
class _Deferred:
    """Metadata keys held back by :meth:`GdsStore.defer_metadata`."""

    keys: dict[str, Buffer] = field(default_factory=dict)
    active: bool = True
    depth: int = 1  #: nested deferrals still open
    failed: bool = False  #: one of them failed: drop the keys instead of writing them
    written: list[str] = field(default_factory=list)  #: chunk keys written meanwhile
    created: list[str] = field(default_factory=list)  #: those of them that were not there
    inflight: int = 0  #: chunk writes and deletes of this deferral running now
    lock: WriterLock | None = None  #: the store's writer lock, held until the end


@dataclass
class _Deferrals:
    """The deferral state a store shares with its copies (see ``GdsStore._deferrals``)."""

    deferred: _Deferred | None = None
    aborted: _Deferred | None = None


#: orders chunk writes' bookkeeping against the end of a deferral, which waits on it
#: for the chunk writes still running
_deferral_lock = threading.Condition()


def _read_or_none(path: str) -> bytes | None:
    """The bytes of the file ``path``, or ``None`` when there is none."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _is_array_metadata(key: str, value: Buffer) -> bool:
    """Whether ``value``, held for the metadata key ``key``, describes an array."""
    name = key.rsplit("/", 1)[-1]
    if name == ".zarray":
        return True
    if name != "zarr.json":
        return False
    try:
        return json.loads(value.to_bytes()).get("node_type") == "array"
    except (ValueError, AttributeError):
        return False


class GdsStore(LocalStore):
    """A :class:`zarr.storage.LocalStore` whose chunk reads land in GPU memory.

    When zarr asks for a key with a GPU buffer prototype (as xarray-gds does for
    arrays placed on the device), the bytes are read by kvikio straight into device
    memory: GPUDirect Storage where the driver is present, kvikio's compat mode (a
    pinned bounce buffer) otherwise. Metadata keys and reads with a host prototype
    go through ordinary file reads. Writes go to a temporary file renamed into place
    (as LocalStore's, with os-level calls); deleting a directory removes its files
    in parallel. Listing is :class:`~zarr.storage.LocalStore`'s.

    Keys that would resolve outside ``root`` (absolute paths, ``..`` segments) are
    rejected with :class:`ValueError`. So are writes and deletes whose directory is
    reached through a symbolic link that leads out of the root (a linked array
    directory, say): the error names the key and the link. Links that stay inside the
    root are followed, and so is the root itself when it is a link. Reads follow
    links wherever they lead, as :class:`~zarr.storage.LocalStore` (and so
    ``engine="zarr"``) does: a store may share arrays with another by linking them.

    Parameters
    ----------
    root : str or Path
        Directory of the store.
    read_only : bool
        Refuse writes.
    """

    def _check_key(self, key: str) -> None:
        bounded = f"/{key}/"
        if key.startswith("/") or "\\" in key or "/../" in bounded or "/./" in bounded:
            raise ValueError(
                f"invalid key {key!r} for store at {self.root}: keys must be relative and "
                "may not contain '.' or '..' segments or backslashes"
            )

    def resolve(self, key: str) -> Path:
        """The file that holds ``key``; raises ValueError for keys that escape the root."""
        self._check_key(key)
        return self.root / key

    def _read(
        self, key: str, prototype: BufferPrototype | None, byte_range: ByteRequest | None
    ) -> Buffer | None:
        if prototype is None:
            prototype = cpu.buffer_prototype
        path = self.resolve(key)
        held = self._held(key)
        if held is not None:
            offset, nbytes = _byte_span(len(held), byte_range)
            return cpu.Buffer.from_bytes(held.to_bytes()[offset : offset + nbytes])
        try:
            if _is_gpu_prototype(prototype) and not is_metadata_key(key):
                return prototype.buffer.from_array_like(_read_device(path, byte_range))
            data = _read_host(path, byte_range)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if is_metadata_key(key):
            return cpu.Buffer.from_bytes(data)
        return prototype.buffer.from_bytes(data)

    def read_chunks(self, keys: list[str], device: str, slot: int | None = None) -> Any:
        """Whole chunk files for the batched pipeline.

        Parameters
        ----------
        keys : list of str
            Chunk keys.
        device : {"cuda", "cpu"}
            ``"cuda"``: one :class:`DeviceBatch` read by kvikio. ``"cpu"``: a list
            of uint8 numpy arrays, ``None`` for missing keys.
        slot : int, optional
            Bytes a chunk file is expected to fit in (see :func:`read_files_device`).
        """
        paths = self.chunk_paths(keys)
        return read_files_device(paths, slot) if device == "cuda" else read_files_host(paths)

    def chunk_paths(self, keys: list[str]) -> list[str]:
        """The files that hold ``keys`` (checked as :meth:`resolve` checks them): what
        every batched read of chunks (:meth:`read_chunks`, and the joined reads of
        :mod:`xarray_gds.coalesce`) reads."""
        root = os.fspath(self.root)
        for key in keys:
            self._check_key(key)
        return [f"{root}/{key}" for key in keys]  # str: pathlib costs more than the read

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        self._ensure_open_sync()
        return self._read(key, prototype, byte_range)

    async def _open(self, *, mode: Any = None) -> None:
        if self.read_only and not self._is_open:
            self._ensure_open_sync()  # see _ensure_open
            return
        await super()._open(mode=mode)

    async def _ensure_open(self) -> None:
        # A read-only store only checks that its root exists: one stat, cheaper in the
        # event loop than the hop to a worker thread (LocalStore's way) and back.
        if self.read_only:
            self._ensure_open_sync()
        else:
            await super()._ensure_open()

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        await self._ensure_open()
        if is_metadata_key(key):
            # Metadata documents are small local files: read in the event loop, they
            # cost a few microseconds, where a worker thread costs a hop each way
            # (most of the time of opening a store, measured).
            return self._read(key, prototype, byte_range)
        return await asyncio.to_thread(self._read, key, prototype, byte_range)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        await self._ensure_open()
        return list(
            await asyncio.gather(
                *(asyncio.to_thread(self._read, k, prototype, r) for k, r in key_ranges)
            )
        )

    # -- metadata held back until the data it describes is written ---------------------
    # Held in one _Deferrals that every store made from this one by ``with_read_only``
    # shares: zarr writes chunks through such copies, and a copy must see the deferral
    # (and its failure) of the store it came from.

    @property
    def _deferrals(self) -> _Deferrals:
        shared = self.__dict__.get("_shared_deferrals")
        if shared is None:
            shared = self.__dict__["_shared_deferrals"] = _Deferrals()
        return shared

    @property
    def _deferred(self) -> _Deferred | None:
        return self._deferrals.deferred

    @_deferred.setter
    def _deferred(self, value: _Deferred | None) -> None:
        self._deferrals.deferred = value

    @property
    def _aborted(self) -> _Deferred | None:
        """The last deferral that failed: chunk writes of that write still running (zarr
        does not cancel the rest of a failed gather) are removed too."""
        return self._deferrals.aborted

    @_aborted.setter
    def _aborted(self, value: _Deferred | None) -> None:
        self._deferrals.aborted = value

    def defer_metadata(self, lock_timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Hold metadata writes in memory until :meth:`flush_metadata`.

        Chunks are written to disk as usual; metadata keys (``zarr.json``, ``.zarray``,
        ``.zattrs``, ``.zgroup``, ``.zmetadata``) are kept here and served to reads,
        listings and existence checks, then written after the data. A write that
        fails before the flush leaves the metadata on disk as it was: an append
        that fails does not extend the array over chunks that were never written.
        Stores made from this one by ``with_read_only`` share the held keys.

        Calls nest (two writes through one store object): the keys are written when
        the last of them flushes, and dropped instead if any of them failed.

        The outermost call takes the store's writer lock (see :mod:`xarray_gds.locking`)
        and the end of the deferral gives it back: another process or thread writing
        the same directory meanwhile waits, then reads the metadata this write left.

        Parameters
        ----------
        lock_timeout : float or None
            Seconds to wait for another writer's lock (``None``: no bound).

        Raises
        ------
        TimeoutError
            When another writer held the lock for ``lock_timeout`` seconds; it names
            the lock file and the process holding it.
        """
        with _deferral_lock:
            if self._deferred is not None and self._deferred.active:
                self._deferred.depth += 1
                return
        lock = writer_lock(self, lock_timeout)  # before zarr reads any metadata
        with _deferral_lock:
            self._deferred = _Deferred(lock=lock)
            self._aborted = None

    def flush_metadata(self) -> None:
        """Write the held metadata (arrays before their groups, consolidated last) and
        stop holding it (at the end of the outermost deferral).

        Chunk writes of the deferral still running are waited for first, so that the
        metadata goes to disk after every chunk it describes. All of it or none: the
        metadata documents on disk are read first, and when a write fails, those
        already replaced are written back (and those that did not exist are removed)
        before the error propagates, so that the store opens as it did before. The
        chunk files the write made are removed too (see :meth:`discard_metadata`).

        Raises
        ------
        RuntimeError
            When putting the old metadata back failed as well; it names the keys that
            may now be inconsistent (the original error is its cause).
        """
        deferred = self._deferred
        if deferred is None:
            return
        deferred.depth -= 1
        if deferred.depth > 0:
            return
        self._end(deferred)
        try:
            if deferred.failed:
                before = {k: _read_or_none(os.path.join(self.root, k)) for k in deferred.keys}
                self._remove_written(deferred, before)
                return
            order = sorted(deferred.keys, key=lambda k: (-k.count("/"), k))
            before = {k: _read_or_none(os.path.join(self.root, k)) for k in order}
            done: list[str] = []
            try:
                for key in order:
                    done.append(key)  # the failing write too: it may have landed
                    self._put(key, deferred.keys[key])
            except BaseException as err:
                deferred.failed = True
                with _deferral_lock:
                    self._aborted = deferred
                self._restore(done, before, err)
                self._remove_written(deferred, before)
                raise
        finally:
            deferred.keys.clear()
            if deferred.lock is not None:
                deferred.lock.release()

    def _end(self, deferred: _Deferred) -> None:
        """Stop holding metadata for ``deferred`` and wait for its chunk writes still
        running. From here on, chunk writes are not its own; when it failed, they are
        refused (see :meth:`_writing`): what is left of the failed write (zarr lets the
        other writes of a failed gather run on, dask the other tasks) writes nothing."""
        with _deferral_lock:
            self._deferred = None
            deferred.active = False
            if deferred.failed:
                self._aborted = deferred
            _deferral_lock.wait_for(lambda: deferred.inflight == 0)

    def _restore(
        self, keys: list[str], before: dict[str, bytes | None], err: BaseException
    ) -> None:
        """Put back the metadata ``keys`` as ``before`` holds them (removing those it
        holds as ``None``), in reverse order of writing; ``err`` made it necessary."""
        stuck: list[str] = []
        for key in reversed(keys):
            path = os.path.join(self.root, key)
            try:
                old = before[key]
                if old is None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                else:
                    write_file(path, old)
            except Exception:
                stuck.append(key)
        if stuck:
            raise RuntimeError(
                f"xarray-gds: writing the metadata of {self} failed ({err!r}), and putting "
                f"back the previous metadata of {sorted(stuck)} failed too: the store may not "
                "open, or open with mismatched arrays. Restore those keys from a backup, or "
                "write the dataset again with mode='w'."
            ) from err

    def _remove_written(self, deferred: _Deferred, before: dict[str, bytes | None]) -> None:
        """Delete the chunk files that the failed ``deferred`` made (those that were not
        there before it wrote them) and every chunk it wrote for arrays whose metadata
        did not exist before (``before``: the documents on disk when the write began),
        then the directories this leaves empty. Chunks it replaced stay (their old
        bytes are gone): readers read them only inside the old shape."""
        prefixes = tuple(
            key.rpartition("/")[0] + "/" if "/" in key else ""
            for key, value in deferred.keys.items()
            if before.get(key) is None and _is_array_metadata(key, value)
        )
        with _deferral_lock:
            doomed = set(deferred.created)
            if prefixes:
                doomed.update(k for k in deferred.written if k.startswith(prefixes))
        root = os.fspath(self.root)
        parents: set[str] = set()
        for key in doomed:
            if is_metadata_key(key):
                continue
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(os.path.join(root, key))
            parts = key.split("/")[:-1]
            parents.update("/".join(parts[:n]) for n in range(1, len(parts) + 1))
        for parent in sorted(parents, key=lambda p: -p.count("/")):
            with contextlib.suppress(OSError):  # not empty: it holds what was there before
                os.rmdir(os.path.join(root, parent))

    def discard_metadata(self) -> None:
        """A write failed: drop the held metadata (at the end of the outermost deferral).

        Chunk writes of the write still running are waited for, and those that start
        later are refused, so nothing of it lands after this returns. The chunk files
        it made are removed: those of arrays that did not exist before, and those of
        existing arrays that were not there (past the old end of an append, or
        chunks of a region that held only the fill value). The store holds the files
        it held before, but for the chunks the write replaced.
        """
        if self._deferred is not None:
            self._deferred.failed = True
            self.flush_metadata()

    def _held(self, key: str) -> Buffer | None:
        deferred = self._deferred
        if deferred is None or not deferred.active:
            return None
        return deferred.keys.get(key)

    def _hold(self, key: str, value: Buffer, *, keep: bool = False) -> bool:
        """Hold ``value`` for the metadata key ``key`` while writes are deferred (keep
        an existing value with ``keep``); False when ``key`` is written as usual."""
        deferred = self._deferred
        if deferred is None or not deferred.active or not is_metadata_key(key):
            return False
        self._check_writable()
        if not keep:
            deferred.keys[key] = value
        return True

    def _forget(self, key: str) -> None:
        """Drop the held ``key`` and the held keys below it (``key`` as a directory)."""
        deferred = self._deferred
        if deferred is None or not deferred.active or not deferred.keys:
            return
        deferred.keys.pop(key, None)
        for held in self._held_keys(key):
            del deferred.keys[held]

    def _held_keys(self, prefix: str = "") -> list[str]:
        """Held keys below the directory ``prefix`` (all of them for ``""``)."""
        deferred = self._deferred
        if deferred is None or not deferred.active:
            return []
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        return [k for k in deferred.keys if k.startswith(base)]

    def with_read_only(self, read_only: bool = False) -> Self:
        clone = super().with_read_only(read_only)
        clone.__dict__["_shared_deferrals"] = self._deferrals
        return clone

    # Key validation for the inherited write/list paths.
    def _put(self, key: str, value: Buffer) -> None:
        self._ensure_open_sync()
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(
                f"GdsStore.set(): the value for {key!r} must be a zarr Buffer, "
                f"not {type(value).__name__}"
            )
        self._check_links(key.split("/")[:-1], key)
        write_file(os.path.join(self.root, key), value.as_buffer_like())

    def _check_links(self, parts: list[str], key: str) -> None:
        """Refuse to write or delete ``key`` when its directory (``parts`` below the
        root) is reached through a symbolic link that leads out of the root. One
        ``lstat`` a level; links that stay inside the root are followed."""
        root = os.fspath(self.root)
        path = root
        for part in parts:
            path = f"{path}/{part}"
            try:
                is_link = stat.S_ISLNK(os.lstat(path).st_mode)
            except (FileNotFoundError, NotADirectoryError):
                return  # made by the write, as a directory
            if not is_link:
                continue
            real_root = os.path.realpath(root)
            target = os.path.realpath(os.path.join(root, *parts))
            if target == real_root or target.startswith(real_root + os.sep):
                return
            raise ValueError(
                f"xarray-gds: refusing to write or delete {key!r} in {self}: {path} is a "
                f"symbolic link to {os.path.realpath(path)}, outside the store's root "
                f"{real_root}. Replace the link by a directory (or a link inside the store)."
            )

    def _writing(self, key: str) -> _Deferred | None:
        """Note a chunk write or delete of ``key`` starting while metadata is held;
        returns the deferral it belongs to (its end waits for :meth:`_wrote`).

        Raises
        ------
        RuntimeError
            When the last deferral of this store failed and no write began since (a
            metadata write or :meth:`defer_metadata`): what is left of a failed write.
        """
        with _deferral_lock:
            deferred = self._deferred
            if deferred is not None and deferred.active:
                deferred.inflight += 1
                return deferred
            if self._aborted is None:
                return None
            if is_metadata_key(key):  # a new write through this store
                self._aborted = None
                return None
        raise RuntimeError(
            f"xarray-gds: not writing {key!r} in {self}: the write it belongs to failed "
            "and was cleaned up. Run the write again."
        )

    @staticmethod
    def _wrote(deferred: _Deferred | None, key: str | None, created: bool) -> None:
        """The write of ``key`` (``None``: a delete) noted by :meth:`_writing` is over;
        ``created``: there was no file at ``key`` before it."""
        if deferred is None:
            return
        with _deferral_lock:
            if key is not None:
                deferred.written.append(key)
                if created:
                    deferred.created.append(key)
            deferred.inflight -= 1
            if not deferred.inflight:
                _deferral_lock.notify_all()

    def _set_file(self, key: str, value: Buffer) -> None:
        """Write the chunk (or metadata outside a deferral) ``key``, counted as running
        while it runs (in the thread that writes it: a cancelled task's thread runs on)."""
        deferred = self._writing(key)
        if deferred is None:
            self._put(key, value)
            return
        created = not os.path.lexists(os.path.join(self.root, key))
        try:
            self._put(key, value)
        finally:
            self._wrote(deferred, key, created)

    def _delete_file(self, key: str) -> None:
        deferred = self._writing(key)
        try:
            self._check_links(key.split("/")[:-1], key)
            super().delete_sync(key)
        finally:
            self._wrote(deferred, None, False)

    def set_sync(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        if not self._hold(key, value):
            self._set_file(key, value)

    def delete_sync(self, key: str) -> None:
        self.resolve(key)
        self._forget(key)
        self._delete_file(key)

    async def set(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        if not self._hold(key, value):
            await asyncio.to_thread(self._set_file, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self.resolve(key)
        if not self._hold(key, value, keep=True):
            self._check_links(key.split("/")[:-1], key)
            await super().set_if_not_exists(key, value)
        elif not await self.exists(key):
            self._hold(key, value)

    async def delete(self, key: str) -> None:
        self.resolve(key)
        self._forget(key)
        await self._ensure_open()
        await asyncio.to_thread(self._delete_file, key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        prefix = prefix.rstrip("/")
        if prefix:
            self.resolve(prefix)
            self._check_links(prefix.split("/")[:-1], prefix)  # the prefix: remove_tree
        self._forget(prefix)
        path = self.root / prefix
        if path.is_dir():
            await asyncio.to_thread(remove_tree, str(path))
        elif path.is_file():
            raise ValueError(f"delete_dir was given {prefix!r}, which is a file in {self}")

    async def clear(self) -> None:
        self._check_writable()
        if self._deferred is not None:
            self._deferred.keys.clear()

        def clear_root() -> None:
            remove_tree(str(self.root))
            self.root.mkdir()

        await asyncio.to_thread(clear_root)

    async def exists(self, key: str) -> bool:
        self.resolve(key)
        if self._held(key) is not None:
            return True
        return await super().exists(key)

    async def getsize(self, key: str) -> int:
        self.resolve(key)
        held = self._held(key)
        if held is not None:
            return len(held)
        return await super().getsize(key)

    async def list(self) -> AsyncIterator[str]:
        async for key in self._and_held(super().list(), ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        async for key in self._and_held(super().list_prefix(prefix), prefix):
            yield key

    async def _and_held(self, on_disk: AsyncIterator[str], prefix: str) -> AsyncIterator[str]:
        """The keys of ``on_disk``, then the held keys below ``prefix`` not among them."""
        seen = set()
        async for key in on_disk:
            seen.add(key)
            yield key
        for key in self._held_keys(prefix):
            if key not in seen:
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        base = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        seen = set()
        async for name in super().list_dir(prefix):
            seen.add(name)
            yield name
        for key in self._held_keys(prefix):
            name = key[len(base) :].split("/", 1)[0]
            if name not in seen:
                seen.add(name)
                yield name

    def __repr__(self) -> str:
        return f"GdsStore('{self}')"

    def __str__(self) -> str:
        return f"file://{self.root.as_posix()}"

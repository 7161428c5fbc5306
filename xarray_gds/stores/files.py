"""Local files read into host or device memory and written whole: the file I/O under
:class:`~xarray_gds.stores.local.GdsStore` and the engine's reads of local chunks and ranges.

Device reads go through kvikio (GPUDirect Storage, or its compat mode) or are staged
through pinned host memory; host reads are ``os``-level calls on the host pool's
threads. Nothing here loads a CUDA library until a device read is made.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest

from xarray_gds import config
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch, pack_offsets, parallel

__all__ = [
    "TEMPORARY",
    "byte_span",
    "read_file",
    "read_files_device",
    "read_files_host",
    "read_or_none",
    "read_ranges_device",
    "read_ranges_host",
    "read_span_device",
    "read_span_host",
    "read_threads",
    "remove_tree",
    "small_read_bytes",
    "temporary_name",
    "write_file",
]

#: the name of a file :func:`write_file` is writing, beside the file ``NAME`` it becomes:
#: ``.NAME.xarray-gds-<32 hex digits>.partial`` (no user file is so named by accident:
#: :mod:`xarray_gds.tidy` takes only such files for what a killed write left)
TEMPORARY = re.compile(r"\..+\.xarray-gds-[0-9a-f]{32}\.partial", re.DOTALL)


def byte_span(size: int, byte_range: ByteRequest | None) -> tuple[int, int]:
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


def read_span_host(path: Path, byte_range: ByteRequest | None) -> bytes:
    with path.open("rb") as f:
        offset, nbytes = byte_span(os.fstat(f.fileno()).st_size, byte_range)
        f.seek(offset)
        return f.read(nbytes)


def read_span_device(path: Path, byte_range: ByteRequest | None) -> Any:
    """Read a byte span of ``path`` into a new CuPy uint8 array with kvikio."""
    offset, nbytes = byte_span(path.stat().st_size, byte_range)
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


def read_end(path: str, nbytes: int, at_end: bool) -> tuple[np.ndarray, int] | None:
    """The last (``at_end``) or first ``nbytes`` bytes of the file ``path`` (a shard's
    index) and the file's size, with one open, one ``fstat`` and one ``pread``; ``None``
    when the file does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - nbytes) if at_end else 0
        return np.frombuffer(os.pread(fd, nbytes, start), dtype=np.uint8), size
    finally:
        os.close(fd)


def temporary_name(path: str) -> str:
    """The path of a new temporary file for ``path`` (see :data:`TEMPORARY`)."""
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.xarray-gds-{os.urandom(16).hex()}.partial")


def write_file(path: str, data: Any) -> None:
    """Write ``data`` (anything with the buffer protocol) to ``path`` whole or not at
    all: into a temporary file beside it, renamed into place. Missing parent
    directories are made. os-level calls: a chunk write costs a third less than
    through Python file objects and ``pathlib``.
    """
    tmp = temporary_name(path)
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


def remove_tree(path: str, keep: frozenset[str] = frozenset()) -> None:
    """Delete the directory ``path`` and everything below it (as ``shutil.rmtree``:
    links inside it are removed, not followed, and ``path`` itself may not be a link),
    files and then each level of directories deleted in parallel on the host pool.
    With ``keep`` (names of files directly in ``path``), those files and ``path`` stay:
    only the rest of what it holds is deleted."""
    if os.path.islink(path):
        raise OSError(f"cannot remove a directory tree through a symbolic link: {path}")

    files: list[str] = []
    levels: list[list[str]] = []

    def walk(directory: str, depth: int) -> None:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, depth + 1)
                elif depth or entry.name not in keep:
                    files.append(entry.path)
        while len(levels) <= depth:
            levels.append([])
        levels[depth].append(directory)

    walk(path, 0)
    parallel(lambda i: os.unlink(files[i]), len(files))
    for level in reversed(levels[1:] if keep else levels):
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
        futures: list[tuple[Any, int, Any]] = []
        failed: OSError | None = None
        try:
            for path, at, start, size in reads[first : first + _OPEN_FILES]:
                f = handles.get(path)
                if f is None:
                    f = handles[path] = kvikio.CuFile(path, "r")
                futures.append((path, size, f.pread(arena[start : start + size], size, at)))
        finally:  # every read issued ends before its file closes and the arena can go back
            try:
                failed = _wait_reads(futures)
            finally:
                for f in handles.values():
                    f.close()
        if failed is not None:
            raise failed


def _wait_reads(futures: list[tuple[Any, int, Any]]) -> OSError | None:
    """Wait for every kvikio read ``(path, size, future)``, even after one failed: the
    first one's error (naming its file), or None when all came back whole."""
    failed: OSError | None = None
    for path, size, future in futures:
        try:
            got = future.get()
        except Exception as err:
            if failed is None:
                failed = OSError(f"cannot read {path}: {err}")
                failed.__cause__ = err
            continue
        if got != size and failed is None:
            failed = _short_read(path, got, size)
    return failed


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


def read_or_none(path: str) -> bytes | None:
    """The bytes of the file ``path``, or ``None`` when there is none."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None

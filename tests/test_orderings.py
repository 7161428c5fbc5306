"""Every stream ordering of the device path, shown without a GPU.

Each line that orders work on one CUDA stream against another stream or the host
(:data:`ORDERINGS` of ``scripts/ordering-mutants.py``; docs/internals.md, "Stream
orderings") has a test here (:func:`test_ordering`) that drives the engine's own code
through recording stand-ins for CuPy (streams, events, copies, kernels, its memory
pools), ``cupyx`` (pinned memory), kvikio and nvCOMP, and asserts the ordering from
their log, in order: without the line, or with it moved after the use it guards, the
test fails. A missing ordering is invisible on a quiet card; the GPU stress test
(tests/test_gpu_stress.py) shows some of them on a busy one.

Faults part-way through a device read (a damaged chunk in a decode batch, a file read
that fails or comes back short, nVCOMP out of memory once or twice) leave no buffer in
use by a stream when it goes back to its pool, raise one error naming the chunk, and
the next read on the same thread gets engine="zarr"'s values.
"""

from __future__ import annotations

import ast
import ctypes
import gc
import importlib.util
import itertools
import queue
import re
import sys
import threading
import types
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr

from tests.test_host_logic import _all_chunks
from xarray_gds import batch, coalesce, decode
from xarray_gds import device as _device
from xarray_gds.codecs import crc32c, nvcomp
from xarray_gds.codecs.formats import CRC32C, get
from xarray_gds.errors import ChunkDecodeError
from xarray_gds.loader import prefetch
from xarray_gds.stores import files, remote_device

ROOT = Path(__file__).resolve().parents[1]


def _load_script() -> types.ModuleType:
    """scripts/ordering-mutants.py, imported (its name is not a module name)."""
    spec = importlib.util.spec_from_file_location(
        "ordering_mutants", ROOT / "scripts" / "ordering-mutants.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


MUTANTS = _load_script()
ORDERINGS: tuple[Any, ...] = MUTANTS.ORDERINGS


# -- the log ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Event:
    """A CUDA event, recorded on ``stream``; ``seq`` counts the events of a log."""

    stream: Stream
    seq: int

    def __repr__(self) -> str:
        return f"event {self.seq} of {self.stream.name}"


@dataclass(frozen=True)
class Entry:
    """One thing a stand-in did. ``kind`` is one of: ``record``, ``wait`` (``stream``
    waits for the event ``detail``), ``sync`` (the host waits for ``stream``),
    ``alloc``, ``free`` (a buffer goes back to its pool: ``detail`` names which),
    ``copy`` (``buffers``: destination, source), ``kernel``, ``decode``, ``encode``,
    ``crc`` (work on ``stream`` that uses ``buffers``), ``pread`` and ``got`` (a kvikio
    read started, its future waited for: ``detail`` is the read's number and file),
    ``close`` (a kvikio file closed), ``free_all_blocks``, ``put`` (the prefetcher
    hands a batch over), ``error`` (a ChunkDecodeError made in nvCOMP's decode) and
    ``mark`` (a point the test itself logs)."""

    kind: str
    stream: Stream | None = None
    buffers: tuple[str | None, ...] = ()
    detail: Any = None

    def __str__(self) -> str:
        parts = [
            self.kind,
            self.stream.name if self.stream else "",
            ", ".join(map(str, self.buffers)),
        ]
        if self.detail is not None:
            parts.append(repr(self.detail))
        return " ".join(p for p in parts if p)


#: work that uses the buffers of its entry on its stream
USES = ("copy", "kernel", "decode", "encode", "crc")


class Log:
    """What the stand-ins did, in order, and the buffers they handed out: each device
    or pinned buffer has a name, and its ``free`` entry is logged when its memory goes
    back to the pool (its last reference gone, or a pinned lease given back)."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._lock = threading.RLock()
        self._events = itertools.count(1)
        self._count = itertools.count(1)
        #: live buffers: name -> (first byte, end, the array that owns the memory)
        self._live: dict[str, tuple[int, int, weakref.ref[np.ndarray]]] = {}
        self.kind: dict[str, str] = {}  #: buffer -> "device" or "pinned"
        self.owner: dict[str, Stream] = {}  #: device buffer -> the stream it was made on
        self.streams: dict[int, Stream] = {}  #: by ``ptr``
        self._threads = threading.local()
        self._maker = threading.current_thread()
        self.main = self.current()  #: the current stream of the test's thread

    # -- entries ------------------------------------------------------------------------

    def add(
        self,
        kind: str,
        stream: Stream | None = None,
        buffers: tuple[str | None, ...] = (),
        detail: Any = None,
    ) -> int:
        with self._lock:
            self.entries.append(Entry(kind, stream, buffers, detail))
            return len(self.entries) - 1

    def find(
        self,
        kind: str,
        stream: Stream | None = None,
        buffer: str | None = None,
        detail: Any = None,
    ) -> list[int]:
        """Indices of the entries of ``kind`` (on ``stream``, using ``buffer``, with
        ``detail``: each when given)."""
        return [
            i
            for i, e in enumerate(self.entries)
            if e.kind == kind
            and (stream is None or e.stream is stream)
            and (buffer is None or buffer in e.buffers)
            and (detail is None or e.detail is detail or e.detail == detail)
        ]

    def text(self) -> str:
        return "\n".join(f"{i:4} {e}" for i, e in enumerate(self.entries))

    # -- streams ------------------------------------------------------------------------

    def current(self) -> Stream:
        """This thread's current stream: the top of its ``with stream:`` blocks, else its
        own default stream (``current`` in the thread that made the log)."""
        stack = self._threads.__dict__.setdefault("stack", [])
        if stack:
            return stack[-1]
        mine = self._threads.__dict__.get("default")
        if mine is None:
            thread = threading.current_thread()
            name = "current" if thread is self._maker else f"current of {thread.name}"
            mine = self._threads.default = Stream(self, name)
        return mine

    def stream(self) -> Stream:
        return Stream(self, f"stream {next(self._count)}")

    # -- buffers ------------------------------------------------------------------------

    def register(self, owner: np.ndarray, kind: str) -> np.ndarray:
        """Name the memory of ``owner`` (a new array) and log its allocation."""
        start = int(owner.__array_interface__["data"][0])
        name = f"{kind} {next(self._count)}"
        with self._lock:
            self._live[name] = (start, start + max(1, owner.nbytes), weakref.ref(owner))
            self.kind[name] = kind
            current = self.current()
            if kind == "device":
                self.owner[name] = current
            self.add("alloc", current, (name,))
        weakref.finalize(owner, self._freed, name)
        return owner

    def device(self, owner: np.ndarray) -> DeviceArray:
        """``owner`` as a named device buffer."""
        return self.register(owner, "device").view(DeviceArray)

    def _freed(self, name: str) -> None:
        with self._lock:
            self._live.pop(name, None)
            self.add("free", None, (name,), "pool")

    def name(self, array: Any) -> str | None:
        """The name of the buffer that ``array`` (or a view of it) lies in."""
        if not isinstance(array, np.ndarray):
            return None
        return self.name_at(int(array.__array_interface__["data"][0]))

    def name_at(self, address: int) -> str | None:
        with self._lock:
            for name, (start, end, _) in self._live.items():
                if start <= address < end:
                    return name
        return None

    def at(self, address: int) -> np.ndarray:
        """The array that owns the buffer starting at ``address``."""
        with self._lock:
            for start, _, ref in self._live.values():
                if start == address and (owner := ref()) is not None:
                    return owner
        raise AssertionError(f"no buffer at {address:#x}")

    def lease_back(self, buffer: np.ndarray) -> None:
        """A pinned buffer of the staging pool, given back (another lease may take it)."""
        self.add("free", None, (self.name(buffer),), "lease")


_ACTIVE: list[Log] = []


def _log() -> Log:
    return _ACTIVE[-1]


class Stream:
    """A CUDA stream stand-in that logs its events, waits and synchronizations; a
    ``with`` block makes it the thread's current stream, as CuPy's do."""

    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name = log, name
        self.ptr = id(self)
        self.device_id = 0
        log.streams[self.ptr] = self

    def record(self, event: Any = None) -> Event:
        recorded = Event(self, next(self.log._events))
        self.log.add("record", self, detail=recorded)
        return recorded

    def wait_event(self, event: Event) -> None:
        self.log.add("wait", self, detail=event)

    def synchronize(self) -> None:
        self.log.add("sync", self)

    def __enter__(self) -> Stream:
        self.log._threads.__dict__.setdefault("stack", []).append(self)
        return self

    def __exit__(self, *args: Any) -> None:
        self.log._threads.stack.pop()

    def __repr__(self) -> str:
        return self.name


class DeviceArray(np.ndarray):
    """A host array standing for a CuPy array: copies in and out are logged, on the
    stream given or the current one."""

    @property
    def device(self) -> Any:
        return types.SimpleNamespace(id=0)

    @property
    def data(self) -> Any:
        return types.SimpleNamespace(ptr=int(self.__array_interface__["data"][0]))

    def set(self, arr: Any, stream: Stream | None = None) -> None:
        log = _log()
        on = stream if stream is not None else log.current()
        log.add("copy", on, (log.name(self), log.name(arr)), "to device")
        self[...] = arr

    def get(self, stream: Stream | None = None, out: Any = None, blocking: bool = True) -> Any:
        log = _log()
        on = stream if stream is not None else log.current()
        log.add("copy", on, (log.name(out), log.name(self)), "to host")
        log.add("sync", on, detail="get")
        if out is None:
            return np.array(self)
        out[...] = self
        return out


# -- the stand-ins ------------------------------------------------------------------------


class _Device:
    id = 0

    def __init__(self, device: int | None = None) -> None:
        pass

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class _Pool:
    def free_all_blocks(self) -> None:
        _log().add("free_all_blocks")


class _Kernel:
    """A CuPy RawKernel: ``gather`` copies its segments; a format's walk finds every
    stream whole. Logged on the current stream with the buffers it is given."""

    def __init__(self, source: str, entry: str) -> None:
        self.entry = entry

    def __call__(self, grid: Any, block: Any, args: tuple[Any, ...], **kwargs: Any) -> None:
        log = _log()
        names = tuple(log.name(a) for a in args if isinstance(a, np.ndarray))
        log.add("kernel", log.current(), names, self.entry)
        if self.entry == "gather":
            src, src_off, dst, dst_off, sizes, _ = args
            for s, d, n in zip(src_off.tolist(), dst_off.tolist(), sizes.tolist(), strict=True):
                dst[d : d + n] = src[s : s + n]
        elif self.entry.endswith("_walk"):
            args[-1][...] = 0
        else:
            raise NotImplementedError(self.entry)


class _CuPy:
    """CuPy: numpy, with named device buffers and logged streams and copies."""

    def __init__(self, log: Log) -> None:
        self._log = log
        self.ndarray = DeviceArray
        runtime = types.SimpleNamespace(
            memGetInfo=lambda: (16 << 30, 80 << 30),
            getDevice=lambda: 0,
            getDeviceCount=lambda: 1,
        )
        self.cuda = types.SimpleNamespace(
            Device=_Device,
            Stream=lambda non_blocking=False: log.stream(),
            get_current_stream=log.current,
            runtime=runtime,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def empty(self, shape: Any, dtype: Any = np.float64, order: str = "C") -> DeviceArray:
        return self._log.device(np.empty(shape, dtype=dtype, order=order))  # type: ignore[call-overload]

    def zeros(self, shape: Any, dtype: Any = np.float64) -> DeviceArray:
        return self._log.device(np.zeros(shape, dtype=dtype))

    def full(self, shape: Any, fill: Any, dtype: Any = None) -> DeviceArray:
        return self._log.device(np.full(shape, fill, dtype=dtype))

    def asarray(self, a: Any, dtype: Any = None) -> DeviceArray:
        if isinstance(a, DeviceArray) and (dtype is None or a.dtype == dtype):
            return a
        return self._log.device(np.array(a, dtype=dtype))

    def ascontiguousarray(self, a: Any, dtype: Any = None) -> DeviceArray:
        return np.ascontiguousarray(a, dtype=dtype).view(DeviceArray)

    def asnumpy(self, a: Any) -> np.ndarray:
        self._log.add("sync", self._log.current(), detail="asnumpy")
        return np.array(a)

    def RawKernel(self, source: str, entry: str) -> _Kernel:
        return _Kernel(source, entry)

    def get_default_memory_pool(self) -> _Pool:
        return _Pool()


class _Future:
    def __init__(self, log: Log, number: int, path: str, got: int, error: str | None) -> None:
        self.log, self.number, self.path, self.got, self.error = log, number, path, got, error

    def get(self) -> int:
        self.log.add("got", detail=(self.number, self.path))
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.got


class _File:
    """kvikio's ``CuFile`` (or ``RemoteFile``) over ``data``. A read's bytes land at
    once; the read counts as in flight until its future is waited for."""

    def __init__(self, kvikio: _Kvikio, path: str, data: bytes) -> None:
        self.kvikio, self.path, self.data = kvikio, path, data

    def nbytes(self) -> int:
        return len(self.data)

    def pread(self, buf: Any, size: int, file_offset: int = 0) -> _Future:
        log = self.kvikio.log
        fault = next((f for k, f in self.kvikio.faults.items() if self.path.endswith(k)), None)
        data = self.data[file_offset : file_offset + size]
        if fault == "short":
            data = data[: size // 2]
        np.asarray(buf).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
        number = next(self.kvikio.count)
        log.add("pread", None, (log.name(buf),), (number, self.path))
        error = f"cuFile read of {size} bytes failed" if fault == "raise" else None
        return _Future(log, number, self.path, len(data), error)

    def close(self) -> None:
        self.kvikio.log.add("close", detail=self.path)


class _Kvikio:
    """kvikio: ``CuFile`` over local files, ``RemoteFile.open_http`` over ``objects``
    (URL -> bytes); ``faults`` (a path's ending -> ``"short"`` or ``"raise"``) makes the
    reads of a file come back short, or their futures raise."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.count = itertools.count(1)
        self.faults: dict[str, str] = {}
        self.objects: dict[str, bytes] = {}
        self.RemoteFile = types.SimpleNamespace(open_http=self._open_http)

    def CuFile(self, path: Any, mode: str = "r") -> _File:
        return _File(self, str(path), Path(path).read_bytes())

    def _open_http(self, url: str, nbytes: int | None = None) -> _File:
        return _File(self, url, self.objects[url])


def _inflate(data: bytes) -> bytes:
    return zlib.decompress(data, -15)


def _deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(1, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


_DECODERS: dict[str, Callable[[bytes], bytes]] = {
    "Deflate": _inflate,
    "Zstd": lambda b: bytes(numcodecs.Zstd().decode(b)),
}
_ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "Deflate": _deflate,
    "Zstd": lambda b: bytes(numcodecs.Zstd(level=1).encode(b)),
}


@dataclass
class _Arrays:
    """nvCOMP's batch of arrays: views of one buffer."""

    buffer: Any
    views: list[Any]


class _Codec:
    """An nvCOMP codec on ``stream``. Its calls run at once, on the host; each is
    logged on the codec's stream with its input and output buffers. A stream it cannot
    decode comes back with size 0, or (``raise_damaged``) raises naming its array."""

    def __init__(self, nv: _NvComp, algorithm: str, stream: Stream) -> None:
        self.nv, self.algorithm, self.stream = nv, algorithm, stream

    def _logged(self, kind: str, inputs: _Arrays, out: _Arrays) -> None:
        log = self.nv.log
        log.add(kind, self.stream, (log.name(inputs.buffer), log.name(out.buffer)), self.algorithm)
        if self.nv.faults:
            raise self.nv.faults.pop(0)

    def decode(self, inputs: _Arrays, out: _Arrays) -> Any:
        self._logged("decode", inputs, out)
        sizes = []
        for i, (src, dst) in enumerate(zip(inputs.views, out.views, strict=True)):
            try:
                raw = _DECODERS[self.algorithm](np.asarray(src).tobytes())
            except Exception:
                raw = None
            if raw is None or len(raw) > dst.size:
                if self.nv.raise_damaged:
                    raise RuntimeError(f"nvCOMP: decompression of Output array {i} failed")
                sizes.append(0)
                continue
            dst[: len(raw)] = np.frombuffer(raw, np.uint8)
            sizes.append(len(raw))
        return types.SimpleNamespace(buffer_sizes=sizes)

    def encode(self, inputs: _Arrays, out: _Arrays) -> Any:
        self._logged("encode", inputs, out)
        sizes = []
        for src, dst in zip(inputs.views, out.views, strict=True):
            packed = _ENCODERS[self.algorithm](np.asarray(src).tobytes())
            if len(packed) > dst.size:
                raise ValueError(f"output buffer too small: {len(packed)} bytes required")
            dst[: len(packed)] = np.frombuffer(packed, np.uint8)
            sizes.append(len(packed))
        return types.SimpleNamespace(buffer_sizes=sizes)


class _NvComp:
    """nvidia.nvcomp: ``faults`` are raised by its next calls, one each."""

    BitstreamKind = types.SimpleNamespace(RAW="raw")

    def __init__(self, log: Log) -> None:
        self.log = log
        self.faults: list[BaseException] = []
        self.raise_damaged = False

    def Codec(
        self, algorithm: str, bitstream_kind: Any, device_id: int, cuda_stream: int
    ) -> _Codec:
        return _Codec(self, algorithm, self.log.streams[cuda_stream])

    def as_arrays(
        self, buffer: Any, offsets: list[int], sizes: list[int], cuda_stream: int = 0
    ) -> _Arrays:
        return _Arrays(buffer, [buffer[o : o + n] for o, n in zip(offsets, sizes, strict=True)])


class _Crc:
    """libnvcomp's batched CRC32 (the two functions crc32c.py calls): the sums are
    computed at once from the pointers it is given; logged on its stream with every
    buffer it reads or writes. A launch returns ``status`` (nonzero: the kernel was
    queued, then the launch reported a failure)."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.status = 0

    def nvcompBatchedCRC32GetHeuristicConf(self, *args: Any) -> int:
        return 0

    def nvcompBatchedCRC32Async(
        self, ptrs: int, lengths: int, n: int, out: int, opts: Any, kind: int, statuses: int,
        stream: int,
    ) -> int:  # fmt: skip
        log = self.log
        starts, sizes, sums, codes = (log.at(p) for p in (ptrs, lengths, out, statuses))
        chunks = tuple(log.name_at(int(p)) for p in starts[:n])
        tables = tuple(log.name_at(p) for p in (ptrs, lengths, out, statuses))
        log.add("crc", log.streams[stream], (*tables, *sorted(set(chunks), key=str)))
        for i in range(n):
            sums[i] = CRC32C.value(ctypes.string_at(int(starts[i]), int(sizes[i])))
        codes[:n] = 0
        return self.status


class _Queue(queue.Queue):
    """The prefetcher's queue: a batch handed over is logged."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        _log().add("put", detail=item[0])
        super().put(item, block, timeout)


@dataclass
class Env:
    log: Log
    cupy: _CuPy
    kvikio: _Kvikio
    nvcomp: _NvComp
    crc: _Crc


class _LoggedDecodeError(ChunkDecodeError):
    """nvCOMP's decode errors, logged when made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _log().add("error", detail=self.key)


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    """The recording stand-ins in place of CuPy, cupyx, kvikio, nvCOMP and libnvcomp's
    CRC32, with no stream, lane, staging buffer or read engine left from before."""
    log = Log()
    _ACTIVE.append(log)
    standins = Env(log, _CuPy(log), _Kvikio(log), _NvComp(log), _Crc(log))
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=np.uint8: log.register(  # type: ignore[attr-defined]
        np.empty(shape, dtype=dtype), "pinned"
    )
    give = batch.PinnedStaging._give

    def give_back(self: batch.PinnedStaging, buffer: np.ndarray) -> None:
        log.lease_back(buffer)
        give(self, buffer)

    monkeypatch.setattr(_device, "cupy", lambda: standins.cupy)
    monkeypatch.setattr(_device, "kvikio", lambda: standins.kvikio)
    monkeypatch.setattr(_device, "cuda_status", lambda: (True, ""))
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    monkeypatch.setattr(nvcomp, "_nvcomp", lambda: standins.nvcomp)
    monkeypatch.setattr(nvcomp, "ChunkDecodeError", _LoggedDecodeError)
    monkeypatch.setattr(crc32c, "_library", lambda: standins.crc)
    monkeypatch.setattr(batch.PinnedStaging, "_give", give_back)
    monkeypatch.setattr(prefetch, "queue", types.SimpleNamespace(Queue=_Queue))
    monkeypatch.setattr(decode, "_streams", threading.local())
    monkeypatch.setattr(nvcomp, "_local", threading.local())
    monkeypatch.setattr(nvcomp, "_keepers", {})
    monkeypatch.setattr(nvcomp, "_all_lanes", weakref.WeakSet())
    monkeypatch.setattr(nvcomp, "_release_registered", False)
    monkeypatch.setattr(nvcomp.atexit, "register", lambda f: None)
    monkeypatch.setattr(coalesce, "_engine", coalesce.ReadEngine())
    try:
        yield standins
    finally:
        _ACTIVE.remove(log)


# -- what the log must show ---------------------------------------------------------------


def in_use_at_return(log: Log) -> list[str]:
    """The buffers that went back to their pool while work might still use them: a
    device buffer that a stream other than its own used with no synchronize of that
    stream between (CuPy's pool orders a block's reuse after its own stream's work
    only), a pinned buffer that any stream used so, and a buffer (or file) that a kvikio
    read whose future nobody waited for was still writing."""
    using: dict[str, set[Any]] = {}
    files_open: dict[str, set[int]] = {}
    found = []
    for i, e in enumerate(log.entries):
        if e.kind == "sync":
            for users in using.values():
                users.discard(e.stream)
        elif e.kind in USES:
            for b in e.buffers:
                if b is not None:
                    using.setdefault(b, set()).add(e.stream)
        elif e.kind == "pread":
            number, path = e.detail
            using.setdefault(str(e.buffers[0]), set()).add(("kvikio read", number))
            files_open.setdefault(path, set()).add(number)
        elif e.kind == "got":
            number, path = e.detail
            for users in using.values():
                users.discard(("kvikio read", number))
            files_open.get(path, set()).discard(number)
        elif e.kind == "close" and files_open.get(e.detail):
            found.append(
                f"{i}: {e.detail} closed with reads {sorted(files_open[e.detail])} in flight"
            )
        elif e.kind == "free":
            (b,) = e.buffers
            users = using.pop(str(b), set())
            if log.kind.get(str(b)) == "device":
                users.discard(log.owner[str(b)])
            if users:
                found.append(
                    f"{i}: {b} went back ({e.detail}) while {sorted(map(str, users))} used it"
                )
    return found


def _after(log: Log, kind: str, stream: Stream, start: int, end: int) -> list[int]:
    """Indices of ``kind`` entries of ``stream`` strictly between ``start`` and ``end``."""
    return [i for i in log.find(kind, stream) if start < i < end]


def _waited_before(log: Log, waiter: Stream, source: Stream, since: int, use: int) -> None:
    """``waiter`` waited for an event of ``source`` recorded after entry ``since`` (the
    last work queued there that the use depends on), and did so before entry ``use``."""
    waits = [
        i
        for i in log.find("wait", waiter)
        if i < use and log.entries[i].detail.stream is source
        and log.find("record", detail=log.entries[i].detail)[0] > since
    ]  # fmt: skip
    assert waits, (
        f"{waiter} did not wait for {source}'s work (up to entry {since}) before entry "
        f"{use}:\n{log.text()}"
    )


def _synced_between(log: Log, stream: Stream, start: int, end: int) -> None:
    assert _after(log, "sync", stream, start, end), (
        f"{stream} not synchronized between entries {start} and {end}:\n{log.text()}"
    )


def _only(found: list[int]) -> int:
    assert len(found) == 1, found
    return found[0]


# -- stores and chunks ---------------------------------------------------------------------


def _values(shape: tuple[int, ...] = (64, 48)) -> np.ndarray:
    rng = np.random.default_rng(11)
    return np.round(rng.standard_normal(shape), 2).astype("f4")


def _store(path: Path) -> Path:
    """A Zarr v2 store of one float32 variable ``v`` (64 x 48) in twelve zlib chunks of
    16 x 16, the first one not stored (all fill value)."""
    values = _values()
    values[:16, :16] = np.nan
    ds = xr.Dataset({"v": (("y", "x"), values)})
    encoding = {"v": {"chunks": (16, 16), "compressors": [numcodecs.Zlib(level=1)]}}
    ds.to_zarr(path, mode="w", zarr_format=2, consolidated=False, encoding=encoding)
    return path


def _chunks(tmp_path: Path) -> tuple[Any, list[str], list[Any], np.ndarray]:
    """The chain, keys and stored bytes of the chunks of ``v`` of a new store (zlib),
    and their host decode."""
    chain, keys, fetched = _all_chunks(_store(tmp_path / "zlib.zarr"), "v")
    _, want = decode.decode_fetched(chain, fetched, keys, False)
    return chain, keys, fetched, want


def _rows(chunks: np.ndarray) -> np.ndarray:
    """Decoded chunks as nvCOMP's rows of bytes."""
    return np.ascontiguousarray(chunks).reshape(len(chunks), -1).view(np.uint8)


def _on_device(env: Env, fetched: list[Any]) -> batch.DeviceBatch:
    """The chunks in one device arena, written there by a copy on the current stream
    (the read before a decode)."""
    present = [np.asarray(f) for f in fetched if f is not None]
    offsets, total = batch.pack_offsets(np.array([f.size for f in present], dtype=np.int64))
    host = np.zeros(total, dtype=np.uint8)
    for f, at in zip(present, offsets.tolist(), strict=True):
        host[at : at + f.size] = f
    arena = env.cupy.empty(total, dtype=np.uint8)
    arena.set(host)
    sizes = np.full(len(fetched), -1, dtype=np.int64)
    where = np.zeros(len(fetched), dtype=np.int64)
    k = 0
    for i, f in enumerate(fetched):
        if f is not None:
            sizes[i], where[i] = np.asarray(f).size, offsets[k]
            k += 1
    return batch.DeviceBatch(arena, where, sizes)


# -- one test an ordering ----------------------------------------------------------------


def _staged(env: Env, tmp_path: Path) -> tuple[Stream, str]:
    """decode_staged of every chunk: the rows right, and the copy stream and the lease."""
    chain, keys, fetched, want = _chunks(tmp_path)
    staging = batch.PinnedStaging()
    present, got = decode.decode_staged(chain, fetched, keys, staging)
    np.testing.assert_array_equal(np.asarray(got), want)
    copy = decode._streams.by_device[0]
    log = env.log
    (lease,) = {log.entries[i].buffers[1] for i in log.find("copy", copy)}
    assert lease is not None and log.kind[lease] == "pinned"
    assert len(log.find("copy", copy, lease)) == len(present)
    return copy, lease


def staged_copy_waits(env: Env, tmp_path: Path) -> None:
    """The copy stream waits for the current stream before its first row copy."""
    copy, _ = _staged(env, tmp_path)
    log = env.log
    first = log.find("copy", copy)[0]
    rows = log.entries[first].buffers[0]
    _waited_before(log, copy, log.main, log.find("alloc", buffer=rows)[0], first)


def staged_lease_sync(env: Env, tmp_path: Path) -> None:
    """The copy stream is synchronized after its last copy from the pinned lease and
    before the lease goes back."""
    copy, lease = _staged(env, tmp_path)
    log = env.log
    back = _only(log.find("free", buffer=lease, detail="lease"))
    _synced_between(log, copy, log.find("copy", copy, lease)[-1], back)
    assert in_use_at_return(log) == []


def _split(env: Env, tmp_path: Path) -> tuple[Stream, str, int]:
    """decode_split, the host taking 3 chunks: the rows right; the copy stream, the lease
    and the entry of nvCOMP's decode of the others."""
    chain, keys, fetched, want = _chunks(tmp_path)
    device = _on_device(env, fetched)
    _, got = decode.decode_split(chain, device, keys, batch.PinnedStaging(), 3, 2)
    np.testing.assert_array_equal(np.asarray(got), want)
    copy = decode._streams.by_device[0]
    log = env.log
    (lease,) = {log.entries[i].buffers[1] for i in log.find("copy", copy)}
    assert lease is not None and len(log.find("copy", copy, lease)) == 3
    return copy, lease, _only(log.find("decode"))


def staged_copy_waits_split(env: Env, tmp_path: Path) -> None:
    """The split decode's copy stream, the same: it waits for the current stream (that
    made the rows) before the host's rows are copied."""
    copy, _, _ = _split(env, tmp_path)
    log = env.log
    first = log.find("copy", copy)[0]
    rows = log.entries[first].buffers[0]
    _waited_before(log, copy, log.main, log.find("alloc", buffer=rows)[0], first)


def split_lease_sync(env: Env, tmp_path: Path) -> None:
    """The split decode's copy stream is synchronized after its last copy from the
    pinned lease (the host's share) and before the lease goes back."""
    copy, lease, _ = _split(env, tmp_path)
    log = env.log
    back = _only(log.find("free", buffer=lease, detail="lease"))
    _synced_between(log, copy, log.find("copy", copy, lease)[-1], back)
    assert in_use_at_return(log) == []


def split_host_waits(env: Env, tmp_path: Path) -> None:
    """The split decode waits for the host pool's share (its decodes into the pinned
    lease and their copies queued on the copy stream) before it synchronizes the copy
    stream and the lease goes back, with a pool that runs the share only once it is
    waited for (after nvCOMP's decode of the others)."""

    def late(fn: Callable[[int], None], n: int, workers: int) -> Callable[[], None]:
        def wait() -> None:
            for i in range(n):
                fn(i)
            env.log.add("mark", detail="host share done")

        return wait

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "start", late)
        copy, lease, nvcomp_decode = _split(env, tmp_path)
    log = env.log
    copies = log.find("copy", copy, lease)
    done = _only(log.find("mark", detail="host share done"))
    back = _only(log.find("free", buffer=lease, detail="lease"))
    assert nvcomp_decode < copies[0] and copies[-1] < done < back
    _synced_between(log, copy, done, back)
    assert in_use_at_return(log) == []


def _lane_decode(env: Env, tmp_path: Path) -> tuple[Stream, int, Any, np.ndarray]:
    """nvcomp.decode of every present chunk (zlib: the streams behind their headers are
    gathered to aligned offsets on the current stream first): the lane's stream, the
    entry of the decode, the result and what it should be."""
    chain, keys, fetched, want = _chunks(tmp_path)
    device = _on_device(env, fetched)
    present = np.flatnonzero(device.sizes >= 0).tolist()
    got = nvcomp.decode(chain, device, present, [keys[i] for i in present])
    (lane,) = nvcomp._all_lanes
    return lane.stream, _only(env.log.find("decode", lane.stream)), got, _rows(want)


def decode_lane_waits(env: Env, tmp_path: Path) -> None:
    """nvCOMP's lane waits for an event of the current stream recorded after the
    gather that wrote its inputs, before it decodes."""
    lane, at, got, want = _lane_decode(env, tmp_path)
    np.testing.assert_array_equal(np.asarray(got), want)
    log = env.log
    inputs = log.entries[at].buffers[0]
    gather = [i for i in log.find("kernel", log.main, inputs) if log.entries[i].detail == "gather"]
    _waited_before(log, lane, log.main, gather[-1], at)


def decode_final_sync(env: Env, tmp_path: Path) -> None:
    """The lane is synchronized after the decode, before its rows come back to the
    current stream (nvCOMP's buffer_sizes waits as well on the card)."""
    lane, at, got, want = _lane_decode(env, tmp_path)
    back = env.log.add("mark", detail="decoded rows returned")
    np.testing.assert_array_equal(np.asarray(got), want)
    _synced_between(env.log, lane, at, back)


def decode_error_sync(env: Env, tmp_path: Path) -> None:
    """A decode that nvCOMP fails: the lane is synchronized before the error is made,
    the error names the chunk nvCOMP names, and no buffer went back in use."""
    chain, keys, fetched, _ = _chunks(tmp_path)
    device = _on_device(env, fetched)
    present = np.flatnonzero(device.sizes >= 0).tolist()
    names = [keys[i] for i in present]
    env.nvcomp.faults.append(RuntimeError("nvCOMP: decompression of Output array 4 failed"))
    with pytest.raises(ChunkDecodeError) as caught:
        nvcomp.decode(chain, device, present, names)
    assert caught.value.key == names[4] and caught.value.codec == "zlib"
    del caught, device
    gc.collect()
    log = env.log
    (lane,) = nvcomp._all_lanes
    error = _only(log.find("error"))
    _synced_between(log, lane.stream, _only(log.find("decode", lane.stream)), error)
    assert log.find("free", buffer=log.entries[log.find("decode")[0]].buffers[1])
    assert in_use_at_return(log) == []


def _values_on_device(env: Env, n: int, nbytes: int) -> tuple[DeviceArray, np.ndarray, int]:
    """``n`` rows of ``nbytes`` written into a device buffer by the current stream (the
    kernels that compute what is encoded): the buffer, the rows, the copy's entry."""
    rows = np.frombuffer(_values().tobytes()[: n * nbytes], np.uint8).reshape(n, nbytes)
    buffer = env.cupy.empty(n * nbytes, dtype=np.uint8)
    buffer.set(rows.reshape(-1))
    return buffer, rows, env.log.find("copy", env.log.main)[-1]


def _encoded(out: Any, starts: np.ndarray, sizes: np.ndarray) -> list[bytes]:
    flat = np.asarray(out)
    return [_inflate(flat[a : a + s].tobytes()) for a, s in zip(starts, sizes, strict=True)]


def encode_lane_waits(env: Env, tmp_path: Path) -> None:
    """nvCOMP's encode lane waits for the current stream's writes of its inputs, and for
    the current stream's users of the block CuPy's pool hands out as its output: an
    event recorded after that block's allocation."""
    buffer, rows, wrote = _values_on_device(env, 4, 1024)
    offsets = np.arange(4, dtype=np.int64) * 1024
    out, starts, sizes = nvcomp._encode_batch(get("zlib"), buffer, offsets, np.full(4, 1024))
    assert _encoded(out, starts, sizes) == [r.tobytes() for r in rows]
    (lane,) = nvcomp._all_lanes
    log = env.log
    encode = _only(log.find("encode"))
    _waited_before(log, lane.stream, log.main, wrote, encode)
    output = log.entries[encode].buffers[1]
    _waited_before(log, lane.stream, log.main, _only(log.find("alloc", buffer=output)), encode)


def encode_final_sync(env: Env, tmp_path: Path) -> None:
    """An encode that nvCOMP fails: the lane is synchronized before the error leaves
    _encode_batch (its inputs and scratch may go back to the pool then)."""
    buffer, _, _ = _values_on_device(env, 4, 1024)
    env.nvcomp.faults.append(RuntimeError("nvCOMP: compression failed"))
    offsets = np.arange(4, dtype=np.int64) * 1024
    with pytest.raises(RuntimeError, match="compression failed"):
        nvcomp._encode_batch(get("zlib"), buffer, offsets, np.full(4, 1024))
    left = env.log.add("mark", detail="the error left _encode_batch")
    (lane,) = nvcomp._all_lanes
    _synced_between(env.log, lane.stream, _only(env.log.find("encode")), left)


def encode_retry_sync(env: Env, tmp_path: Path) -> None:
    """A first encode whose rows nvCOMP finds too small: the lane is synchronized before
    those rows go back to the pool (the second attempt allocates larger ones)."""
    buffer, rows, _ = _values_on_device(env, 4, 1024)
    env.nvcomp.faults.append(ValueError("output buffer too small: 4096 bytes required"))
    offsets = np.arange(4, dtype=np.int64) * 1024
    out, starts, sizes = nvcomp._encode_batch(get("zlib"), buffer, offsets, np.full(4, 1024))
    assert _encoded(out, starts, sizes) == [r.tobytes() for r in rows]
    log = env.log
    first, second = log.find("encode")
    small = log.entries[first].buffers[1]
    assert small is not None and small != log.entries[second].buffers[1]
    (lane,) = nvcomp._all_lanes
    _synced_between(log, lane.stream, first, _only(log.find("free", buffer=small)))
    assert in_use_at_return(log) == []
    # the larger rows are a block of their own: the lane waits for its users too
    larger = log.entries[second].buffers[1]
    _waited_before(log, lane.stream, log.main, _only(log.find("alloc", buffer=larger)), second)


def oom_retry_sync(env: Env, tmp_path: Path) -> None:
    """nvCOMP out of memory once: the lane is synchronized before CuPy's pool frees its
    cached blocks, and the decode is tried again after that, with the right rows."""
    env.nvcomp.faults.append(RuntimeError("CUDA Runtime API failure: out of memory"))
    chain, keys, fetched, want = _chunks(tmp_path)
    device = _on_device(env, fetched)
    present = np.flatnonzero(device.sizes >= 0).tolist()
    got = nvcomp.decode(chain, device, present, [keys[i] for i in present])
    np.testing.assert_array_equal(np.asarray(got), _rows(want))
    log = env.log
    (lane,) = nvcomp._all_lanes
    failed, retried = log.find("decode", lane.stream)
    freed = _only(log.find("free_all_blocks"))
    assert failed < freed < retried
    _synced_between(log, lane.stream, failed, freed)


def _files(tmp_path: Path, sizes: list[int]) -> tuple[list[str], list[bytes]]:
    rng = np.random.default_rng(5)
    paths, held = [], []
    for i, n in enumerate(sizes):
        path = tmp_path / f"c{i}"
        held.append(rng.bytes(n))
        path.write_bytes(held[-1])
        paths.append(str(path))
    return paths, held


def _arena(got: batch.DeviceBatch) -> list[bytes]:
    arena = np.asarray(got.arena)
    return [arena[a : a + s].tobytes() for a, s in zip(got.offsets, got.sizes, strict=True)]


def slotted_copy_sync(env: Env, tmp_path: Path) -> None:
    """Whole small files read into pinned slots: the current stream is synchronized
    after the last copy from the pinned buffer, before it goes back to the pool."""
    paths, held = _files(tmp_path, [1000, 37, 4096, 512])
    got = files.read_files_device(paths, 4096)
    assert _arena(got) == held
    del got
    gc.collect()
    log = env.log
    (pinned,) = _pinned(log)
    copies = log.find("copy", log.main, pinned)
    assert copies
    _synced_between(log, log.main, copies[-1], _only(log.find("free", buffer=pinned)))
    assert in_use_at_return(log) == []


def _pinned(log: Log) -> list[str]:
    """The pinned buffers allocated, in order."""
    names = (log.entries[i].buffers[0] for i in log.find("alloc"))
    return [n for n in names if n is not None and log.kind[n] == "pinned"]


def _queued_then_freed(env: Env) -> int:
    """A kernel's block on the current stream, freed (CuPy's pool may hand it out next,
    with the kernel still queued): the entry of that kernel's copy."""
    scratch = env.cupy.empty(1 << 16, dtype=np.uint8)
    scratch.set(np.zeros(1 << 16, np.uint8))
    del scratch
    return env.log.find("copy", env.log.main)[-1]


def kvikio_waits_current(env: Env, tmp_path: Path) -> None:
    """Large ranges read by kvikio: the current stream is synchronized after the work
    queued there, before the first read starts."""
    paths, held = _files(tmp_path, [300_000, 400_000])
    queued = _queued_then_freed(env)
    sizes = np.array([300_000, 350_000], dtype=np.int64)
    got = files.read_ranges_device(paths, np.array([0, 50_000]), sizes)
    assert _arena(got) == [held[0], held[1][50_000:]]
    log = env.log
    _synced_between(log, log.main, queued, log.find("pread")[0])


def staged_read_sync(env: Env, tmp_path: Path) -> None:
    """Small ranges staged through pinned memory: the current stream is synchronized
    after the copy from the pinned buffer, before it goes back to the pool."""
    paths, held = _files(tmp_path, [3000, 500])
    got = files.read_ranges_device(paths, np.array([10, 0]), np.array([2000, 500]))
    assert _arena(got) == [held[0][10:2010], held[1]]
    del got
    gc.collect()
    log = env.log
    (pinned,) = _pinned(log)
    copy = _only(log.find("copy", log.main, pinned))
    _synced_between(log, log.main, copy, _only(log.find("free", buffer=pinned)))
    assert in_use_at_return(log) == []


def remote_waits_current(env: Env, tmp_path: Path) -> None:
    """kvikio's remote reads: the current stream is synchronized after the work queued
    there, before the first read starts."""
    rng = np.random.default_rng(8)
    root = "http://127.0.0.1:9/root"
    held = {"a": rng.bytes(100), "b": rng.bytes(37)}
    env.kvikio.objects = {f"{root}/{k}": v for k, v in held.items()}
    store = types.SimpleNamespace(fs=types.SimpleNamespace(protocol="http"), path=root + "/")
    queued = _queued_then_freed(env)
    got = remote_device.read_device([store, store], ["a", "b"])
    assert _arena(got) == [held["a"], held["b"]]
    log = env.log
    _synced_between(log, log.main, queued, log.find("pread")[0])


def crc_lane_waits(env: Env, tmp_path: Path) -> None:
    """The CRC32C lane waits for the current stream's writes of the chunks it sums."""
    chunks = [np.frombuffer(b, np.uint8) for b in _crc_chunks()]
    device = _on_device(env, chunks)
    keys = ["c/0", "c/1", "c/2"]
    body = nvcomp._strip_crc32c(device, device.offsets, device.sizes, keys)
    assert body.tolist() == [c.size - 4 for c in chunks]
    log = env.log
    (lane,) = nvcomp._all_lanes
    wrote = log.find("copy", log.main)[-1]
    _waited_before(log, lane.stream, log.main, wrote, _only(log.find("crc", lane.stream)))


def _crc_chunks() -> list[bytes]:
    rng = np.random.default_rng(2)
    out = []
    for n in (100, 3, 4000):
        body = rng.bytes(n)
        out.append(body + np.uint32(CRC32C.value(body)).astype("<u4").tobytes())
    return out


def crc_final_sync(env: Env, tmp_path: Path) -> None:
    """The CRC32C lane is synchronized after its kernel, before its tables (the chunks'
    pointers and lengths, the sums, the statuses) go back to the pool; a damaged chunk
    is found. A launch that reports a failure once its kernel is queued is waited for
    as well before its tables go back."""
    raw = _crc_chunks()
    raw[1] = b"\x00" + raw[1][1:]
    device = _on_device(env, [np.frombuffer(b, np.uint8) for b in raw])
    keys = ["c/0", "c/1", "c/2"]
    with pytest.raises(ChunkDecodeError) as caught:
        nvcomp._strip_crc32c(device, device.offsets, device.sizes, keys)
    assert caught.value.key == "c/1"
    env.crc.status = 10
    failed = r"^nvCOMP's batched CRC32 failed \(nvcompStatus_t 10\)$"
    with pytest.raises(RuntimeError, match=failed):
        nvcomp._strip_crc32c(device, device.offsets, device.sizes, keys)
    del caught
    gc.collect()
    log = env.log
    (lane,) = nvcomp._all_lanes
    runs = log.find("crc", lane.stream)
    assert len(runs) == 2
    for run in runs:
        for table in log.entries[run].buffers[:4]:
            _synced_between(log, lane.stream, run, _only(log.find("free", buffer=table)))
    assert in_use_at_return(log) == []


def prefetch_sync(env: Env, tmp_path: Path) -> None:
    """The prefetcher's thread synchronizes its stream, where the batch was written,
    before it hands the batch over."""

    def read(samples: np.ndarray) -> Any:
        out = env.cupy.empty(samples.size, dtype=np.int64)
        out.set(samples * 10)
        return out

    p = prefetch.Prefetcher(read, [np.arange(3), np.arange(3, 5)], 2, 0)
    try:
        got = [np.asarray(p.take()).tolist() for _ in range(2)]
    finally:
        p.stop()
    assert got == [[0, 10, 20], [30, 40]]
    log = env.log
    puts = log.find("put")
    writes = [i for i in log.find("copy") if log.entries[i].stream is not log.main]
    assert len(puts) == len(writes) == 2
    for wrote, put in zip(writes, puts, strict=True):
        stream = log.entries[wrote].stream
        assert stream is not None and stream.name.startswith("current of ")
        _synced_between(log, stream, wrote, put)


def handover_sync(env: Env, tmp_path: Path) -> None:
    """A device read through the read engine: the thread that decoded the chunks (its
    nvCOMP lane waited for that thread's current stream) synchronizes its current
    stream after the decode and before the values reach whoever asked, whose stream
    need not wait for it (another thread's default stream, a caller's own stream)."""
    path = _store(tmp_path / "s.zarr")
    want = _engine_zarr(path)
    with zarr.config.set({"xarray_gds.route": "gpu"}):
        got = np.asarray(_device_read(path)["v"].values)
    back = env.log.add("mark", detail="values returned to the caller")
    np.testing.assert_array_equal(got, want)
    log = env.log
    (lane,) = nvcomp._all_lanes
    decoded = _only(log.find("decode", lane.stream))
    lane_synced = next(i for i in log.find("sync", lane.stream) if i > decoded)
    waited = log.entries[_only(log.find("wait", lane.stream))].detail
    _synced_between(log, waited.stream, lane_synced, back)


@pytest.mark.parametrize("n_parts", [1, 2])
def test_the_part_consumer_hands_over_whole_values(env: Env, tmp_path: Path, n_parts: int) -> None:
    """handover-sync where a read in parts is consumed: the thread that placed each
    part's chunks on its current stream synchronizes it after the last one and before
    fetch_decode_parts returns (the values then go to the thread that asked)."""
    from tests.test_host_logic import GdsStore
    from xarray_gds.request import ReadRequest

    path = _store(tmp_path / "s.zarr")
    chain, keys, _ = _all_chunks(path, "v")
    store = GdsStore(path, read_only=True)
    parts = [
        ReadRequest(store, chain, [keys[i] for i in idx], True)
        for idx in np.array_split(np.arange(len(keys)), n_parts)
    ]
    log = env.log
    placed: list[int] = []

    def consume(k: int, decoded: Any) -> None:
        out = env.cupy.empty(4, dtype=np.uint8)
        out.set(np.full(4, k, dtype=np.uint8))  # a placement on this thread's stream
        placed.append(_only([i for i in log.find("copy", log.main) if i >= len(log.entries) - 1]))

    with zarr.config.set({"xarray_gds.route": "gpu"}):
        coalesce.fetch_decode_parts(parts, consume)
    back = log.add("mark", detail="fetch_decode_parts returned")
    assert len(placed) == n_parts
    _synced_between(log, log.main, placed[-1], back)


#: the test of each ordering of ORDERINGS, by its name
CASES: dict[str, Callable[..., None]] = {
    "staged-copy-waits": staged_copy_waits,
    "staged-lease-sync": staged_lease_sync,
    "split-lease-sync": split_lease_sync,
    "split-host-waits": split_host_waits,
    "decode-lane-waits": decode_lane_waits,
    "decode-final-sync": decode_final_sync,
    "decode-error-sync": decode_error_sync,
    "encode-lane-waits": encode_lane_waits,
    "encode-retry-sync": encode_retry_sync,
    "encode-final-sync": encode_final_sync,
    "oom-retry-sync": oom_retry_sync,
    "slotted-copy-sync": slotted_copy_sync,
    "kvikio-waits-current": kvikio_waits_current,
    "staged-read-sync": staged_read_sync,
    "remote-waits-current": remote_waits_current,
    "crc-lane-waits": crc_lane_waits,
    "crc-final-sync": crc_final_sync,
    "prefetch-sync": prefetch_sync,
    "handover-sync": handover_sync,
}


@pytest.mark.parametrize("name", list(CASES))
def test_ordering(name: str, env: Env, tmp_path: Path) -> None:
    """The ordering ``name`` of ORDERINGS, from the log of the engine code it orders."""
    CASES[name](env, tmp_path)


def test_split_copies_wait_too(env: Env, tmp_path: Path) -> None:
    """staged-copy-waits orders decode_split's copies as well (the same copy stream)."""
    staged_copy_waits_split(env, tmp_path)


# -- every ordering line, and a test for each ----------------------------------------------

#: lines that wait for a stream without ordering anything (another line orders the
#: same buffers), by module and text
NOT_ORDERINGS = {
    ("codecs/nvcomp.py", "stream.synchronize()  # waits in CuPy, not in buffer_sizes (see _run)"):
        "lets other threads run while an encode ends; encode-final-sync orders its buffers",
}  # fmt: skip


def test_every_ordering_has_a_cpu_test() -> None:
    assert set(CASES) == {o.name for o in ORDERINGS}
    assert len(ORDERINGS) == len(CASES)
    for o in ORDERINGS:
        if not o.device:
            assert o.tests == (f"tests/test_orderings.py::test_ordering[{o.name}]",)


def test_every_ordering_line_is_in_the_source() -> None:
    """Each ordering's line is where ORDERINGS says, and every line of the package that
    waits for a stream or an event is an ordering of ORDERINGS (or one of the few that
    order nothing): a new one must be added there, with a test here. (ORDERINGS also
    lists lines that wait for the host pool's threads before a stream is waited for.)"""
    package = ROOT / "xarray_gds"
    waits = re.compile(r"\.synchronize\(\)|\.wait_event\(")
    listed: set[tuple[str, int]] = set()
    for o in ORDERINGS:
        at = MUTANTS.find_line((package / o.module).read_text(), o)
        if waits.search(o.text):
            listed.add((o.module, at))
    found = set()
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module.startswith("tools/"):  # benchmarks: they time the streams, order nothing
            continue
        for i, line in enumerate(path.read_text().splitlines()):
            if waits.search(line) and (module, line.strip()) not in NOT_ORDERINGS:
                found.add((module, i))
    assert found == listed


def _function_of(o: Any) -> str:
    """The name of the function whose body holds ``o``'s line."""
    source = (ROOT / "xarray_gds" / o.module).read_text()
    line = MUTANTS.find_line(source, o) + 1
    holders = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= (node.end_lineno or 0)
    ]
    return max(holders, key=lambda node: node.lineno).name


def test_the_docs_table_is_orderings() -> None:
    """docs/internals.md's "Stream orderings" table: a row an ordering, in the order of
    ORDERINGS, with its module and function, what it orders (as ORDERINGS says), its
    CPU test and the device test that catches it (none where ``device`` is off)."""
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text[text.index("## Stream orderings") :]
    section = section[: section.index("\n## ", 1)]
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]
    want = []
    for o in ORDERINGS:
        cpu = f"`test_ordering[{o.name}]`"
        if o.name == "staged-copy-waits":
            cpu += ", `test_split_copies_wait_too`"
        device = "`tests/test_gpu_stress.py`" if o.device else "-"
        want.append([f"`{o.name}`", f"`{o.module}` `{_function_of(o)}`", o.what, cpu, device])
    assert [[n, w, what.replace("`", ""), c, d] for n, w, what, c, d in rows] == want


# -- faults part-way through a device read --------------------------------------------------


def _engine_zarr(path: Path) -> np.ndarray:
    return np.asarray(xr.open_dataset(path, engine="zarr", consolidated=False)["v"].values)


def _device_read(path: Path) -> xr.Dataset:
    return xr.open_dataset(path, engine="gds-zarr", device="cuda", consolidated=False)


@pytest.mark.parametrize(
    ("route", "damaged"),
    [("gpu", "size"), ("gpu", "raise"), ("host", "host")],
    ids=["nvcomp-size", "nvcomp-raises", "host-for-device"],
)
def test_a_damaged_chunk_in_a_batch(env: Env, tmp_path: Path, route: str, damaged: str) -> None:
    """One damaged chunk among twelve: nvCOMP reports it by its decoded size or raises
    naming it (or the host decodes it for the device); the read raises once, naming the
    chunk, no buffer went back to its pool in use, and the next read is right."""
    path = _store(tmp_path / "s.zarr")
    want = _engine_zarr(path)
    chunk = path / "v" / "1.2"
    intact = chunk.read_bytes()
    chunk.write_bytes(intact[:2] + bytes(len(intact) - 2))
    env.nvcomp.raise_damaged = damaged == "raise"
    with zarr.config.set({"xarray_gds.route": route}):
        ds = _device_read(path)
        with pytest.raises(ChunkDecodeError) as caught:
            ds["v"].values  # noqa: B018
        assert caught.value.key == "v/1.2"
        del caught
        gc.collect()
        log = env.log
        if route == "gpu":
            assert len(log.find("decode")) == 1 and len(log.find("error")) == 1
        else:
            assert log.find("copy", decode._streams.by_device[0])
        assert in_use_at_return(log) == []
        chunk.write_bytes(intact)
        np.testing.assert_array_equal(np.asarray(ds["v"].values), want)
    assert in_use_at_return(env.log) == []


@pytest.mark.parametrize("chunk", ["1.2", "0.1"])
@pytest.mark.parametrize("fault", ["short", "raise"])
def test_a_read_that_fails_part_way(env: Env, tmp_path: Path, fault: str, chunk: str) -> None:
    """kvikio's read of one chunk of twelve (the first one read, or one after it) comes
    back short, or its future raises: every read in flight ends before the arena goes
    back and every file opened closes, the error names the chunk (the future's own
    error its cause), and the next read is right."""
    path = _store(tmp_path / "s.zarr")
    want = _engine_zarr(path)
    env.kvikio.faults = {f"v/{chunk}": fault}
    with zarr.config.set({"xarray_gds.route": "gpu", "xarray_gds.small_read": 0}):
        ds = _device_read(path)
        with pytest.raises(OSError) as caught:
            ds["v"].values  # noqa: B018
        assert chunk in str(caught.value)
        if fault == "raise":
            assert isinstance(caught.value.__cause__, RuntimeError)
            assert str(caught.value.__cause__).startswith("cuFile read of ")
        del caught
        gc.collect()
        log = env.log
        assert len(log.find("pread")) == 11 and not log.find("decode")
        opened = sorted({log.entries[i].detail[1] for i in log.find("pread")})
        assert sorted(log.entries[i].detail for i in log.find("close")) == opened
        assert in_use_at_return(log) == []
        env.kvikio.faults = {}
        np.testing.assert_array_equal(np.asarray(ds["v"].values), want)
    assert in_use_at_return(env.log) == []


@pytest.mark.parametrize("times", [1, 2])
def test_nvcomp_out_of_memory(env: Env, tmp_path: Path, times: int) -> None:
    """nvCOMP out of memory once: the lane ends, CuPy's pool frees its cached blocks, and
    the decode runs again, right. Twice: the read raises once, naming the batch's
    chunks. No buffer went back in use; the next read is right."""
    path = _store(tmp_path / "s.zarr")
    want = _engine_zarr(path)
    oom = "CUDA Runtime API failure: out of memory : code=2."
    env.nvcomp.faults = [RuntimeError(oom) for _ in range(times)]
    log = env.log
    with zarr.config.set({"xarray_gds.route": "gpu"}):
        ds = _device_read(path)
        if times == 1:
            np.testing.assert_array_equal(np.asarray(ds["v"].values), want)
        else:
            with pytest.raises(ChunkDecodeError, match="out of memory") as caught:
                ds["v"].values  # noqa: B018
            assert caught.value.key == "v/0.1 .. v/3.2 (11 chunks)"
            del caught
            gc.collect()
            assert len(log.find("error")) == 1
        (lane,) = nvcomp._all_lanes
        first, second = log.find("decode")[:2]
        freed = _only(log.find("free_all_blocks"))
        assert first < freed < second
        _synced_between(log, lane.stream, first, freed)
        assert in_use_at_return(log) == []
        if times == 2:
            np.testing.assert_array_equal(np.asarray(ds["v"].values), want)
    assert in_use_at_return(log) == []

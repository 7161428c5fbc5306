"""Chunk reads that threads ask for at the same time, read and decoded together.

Dask computes blocks on several threads, and with ``open_mfdataset`` a block is often
a whole store of a few dozen to a few hundred chunks. One nvCOMP call per block leaves
most of the GPU idle: on an H200, 50 calls of 152 chunks of 256 KiB took 0.44 s one
after the other (0.22-0.25 s from 4 or 16 threads), one call of all 7,600 chunks
0.03 s. And 16 threads each reading their own small files spend their time handing
the GIL to each other: the 50 stores' reads took 0.48 s one after the other, 0.54 s
from 16 threads, and 0.18 s as one batch.

:func:`fetch_decode` joins the requests that arrive while another one is being served.
A thread that finds no read in progress serves every waiting request (up to the batch
budget, one side at a time): it reads all their files in one batch, decodes the
requests that share a decode chain with one call, and hands each request its chunks.
A thread that arrives while a read is in progress waits for the next one, which will
take its request along; that read starts as soon as the files of the current one are
in, while the current one decodes. Requests for different GPUs (threads with different current
CUDA devices) are never joined, and a group is served on its own GPU. A request
alone is served at once: nothing waits for company.

Host reads of large chunks in local files that come with a sink (the box reads of
:mod:`xarray_gds.region`) are streamed instead: each chunk is read, decoded and
handed to its sink by one thread of the pool (:func:`_serve_streamed`).

Failures stay with the request they belong to: when a joined read or decode fails,
each request of the group is read or decoded again on its own, so that only the
requests with a damaged or unreadable chunk raise, each naming its own chunk.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds import config, decode, route, stores
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch, PinnedStaging, parallel
from xarray_gds.codecs import DecodeChain
from xarray_gds.place import STREAMED
from xarray_gds.request import Decoded, ReadRequest

__all__ = [
    "STREAMED",
    "ReadEngine",
    "engine",
    "fetch_decode",
    "fetch_decode_many",
    "fetch_decode_parts",
    "read_only",
]


class _Withdrawn(Exception):
    """The error of a request its asker stopped waiting for (never raised to a user)."""


@dataclass(eq=False)
class _Asked:
    """A request while the engine serves it: the :class:`ReadRequest` as it was asked,
    and what coalescing keeps beside it."""

    request: ReadRequest
    source: stores.Source  #: what reads the request's store
    paths: list[Any]  #: where ``source`` reads each chunk (or byte range) from
    gpu: int = -1  #: the CUDA device current in the asking thread (-1 on the host)
    series: object = None  #: the parts of one read share it: never in one group
    #: the part before it of a read in parts: this one is not read before that is taken
    after: _Asked | None = None
    taken: bool = False  #: in a group being served
    host_decode: bool = False  #: a device request whose group decodes on the host
    #: its chunks (:data:`STREAMED` in their place where its sink took them), or the
    #: error to raise in the thread that asked
    outcome: Decoded | BaseException | None = None

    @property
    def done(self) -> bool:
        """Served: it has its chunks, or the error to raise."""
        return self.outcome is not None

    @property
    def decode_on_device(self) -> bool:
        """Whether its chunks are read into device memory and decoded by nvCOMP."""
        return self.request.on_device and not self.host_decode

    @property
    def nbytes(self) -> int:
        return len(self.request.keys) * self.request.chain.nbytes


class ReadEngine:
    """The read engine's shared state: the queue of waiting requests, the group being
    read and those being decoded (at most two), and the pinned staging buffers of
    host-decoded device reads. One per process (:func:`engine`); a forked child gets
    a new one."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiting: list[_Asked] = []
        self.reader: object | None = None  #: the group whose files are being read
        self.decoders: set[object] = set()  #: the groups read and being decoded
        self.staging = PinnedStaging()

    def fetch_decode(self, request: ReadRequest) -> Decoded:
        """See the module's :func:`fetch_decode`."""
        (outcome,) = self.fetch_decode_many([request])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def fetch_decode_many(self, asked: list[ReadRequest]) -> list[Decoded | BaseException]:
        """See the module's :func:`fetch_decode_many`."""
        config.validate()
        requests = [_located(r) for r in asked]
        with self.cond:
            self.waiting.extend(requests)
        try:
            for request in requests:
                while not request.done:
                    self._lead_or_wait(request)
        except BaseException:
            self._withdraw(requests)
            raise
        out: list[Decoded | BaseException] = []
        for request in requests:
            assert request.outcome is not None
            out.append(request.outcome)
        return out

    def fetch_decode_parts(
        self,
        parts: list[ReadRequest],
        consume: Callable[[int, Decoded], None],
    ) -> None:
        """See the module's :func:`fetch_decode_parts`."""
        config.validate()
        if len(parts) == 1:
            consume(0, self.fetch_decode(parts[0]))
            decode.hand_over(parts[0].on_device)
            return
        requests = [_located(r) for r in parts]
        series = object()
        for before, request in zip([None, *requests], requests, strict=False):
            request.series, request.after = series, before
        progress = threading.Condition()
        consumed = 0  # parts handed to ``consume``
        stop = False

        def serve(first: int) -> None:
            """Serve parts ``first``, ``first + 2``, ...: with two servers, part k + 1 is
            read while part k decodes; part k waits until part k - 2 is consumed."""
            for k in range(first, len(requests), 2):
                with progress:
                    while k > consumed + 1 and not stop:
                        progress.wait()
                    if stop:
                        return
                    # queued only now: another thread's leader serves what waits in
                    # the queue, and must not take a part before its turn
                    with self.cond:
                        self.waiting.append(requests[k])
                try:
                    while not requests[k].done:
                        self._lead_or_wait(requests[k])
                except BaseException as err:  # handed to the consumer, which raises it
                    if not requests[k].done:
                        requests[k].outcome = err
                with progress:
                    progress.notify_all()

        with ThreadPoolExecutor(2, thread_name_prefix="xarray-gds-part") as pool:
            servers = [pool.submit(serve, i) for i in range(2)]
            try:
                for k, request in enumerate(requests):
                    with progress:
                        while not request.done:
                            progress.wait(0.1)
                        result = request.outcome
                        if isinstance(result, BaseException):
                            raise result
                    assert result is not None
                    request.outcome = _CONSUMED
                    consume(k, result)
                    del result
                    with progress:
                        consumed = k + 1
                        progress.notify_all()
            except BaseException:
                with progress:
                    stop = True
                    progress.notify_all()
                self._withdraw(requests)  # nobody is to read the parts left
                raise
        for server in servers:
            server.result()
        decode.hand_over(any(r.on_device for r in parts))

    def _withdraw(self, requests: list[_Asked]) -> None:
        """Interrupted: nobody is to read the requests not taken yet any more (a part
        server waiting for one of them stops)."""
        with self.cond:
            for request in requests:
                if not request.taken and request in self.waiting:
                    self.waiting.remove(request)
                    request.outcome = _Withdrawn()
            self.cond.notify_all()

    def _lead_or_wait(self, request: _Asked) -> None:
        """Wait until ``request`` is served, or serve a group of requests (the first one
        waiting, and those that join it), then return."""
        token = object()
        group: list[_Asked] = []
        cond = self.cond
        with cond:
            while self._must_wait(request):
                cond.wait()
            if request.done:
                return
            group = self._take(request)
            self.reader = token
        try:
            if group[0].request.on_device:
                host = _host_route(group)
                for r in group:
                    r.host_decode = host
            with _on_gpu(group[0]):
                streamed = _streamable(group)
                fetched = None if streamed else _read_group(group)
                with cond:  # the next group's read may start while this one decodes
                    self.decoders.add(token)
                    self.reader = None
                    cond.notify_all()
                if streamed:
                    _serve_streamed(group)
                else:
                    _decode_group(group, fetched, self.staging)
                del fetched  # nothing of the group stays alive here once it is served
        except BaseException:
            with cond:  # the others of the group go back to the queue, for another thread
                back = [r for r in group if r is not request and not r.done]
                for r in back:
                    r.taken = False
                self.waiting[:0] = back
            raise
        finally:
            with cond:
                if self.reader is token:
                    self.reader = None
                self.decoders.discard(token)
                cond.notify_all()

    def _must_wait(self, request: _Asked) -> bool:
        """Whether the thread serving ``request`` waits: while another thread reads, or
        serves this request, or two groups are decoding (at most two groups' bytes are
        alive at once), or, for a part of a read in parts, until the part before it is
        taken (parts are read in order, whichever part server asks first). Called with
        ``cond`` held."""
        if request.done:
            return False
        before = request.after
        return (
            request.taken
            or self.reader is not None
            or len(self.decoders) >= 2
            or (before is not None and not (before.taken or before.done))
        )

    def _take(self, request: _Asked) -> list[_Asked]:
        """The waiting requests for the first one's side (the host, or its GPU) that fit
        the batch budget together (the first one always), removed from the queue. The
        first one is the oldest waiting, or, for a part of a read in parts, the leader's
        own part (a part server reads its part, not what waits ahead of it). Called with
        ``cond`` held."""
        own = request.series is not None and not request.taken
        first = request if own else self.waiting[0]
        with _on_gpu(first):
            budget = decode.budget(first.request.on_device)
        group: list[_Asked] = []
        rest: list[_Asked] = []
        total = 0
        series: set[int] = set()  # a read's parts go one a group (fetch_decode_parts)
        for r in [first, *(r for r in self.waiting if r is not first)]:
            same_side = (r.request.on_device, r.gpu) == (first.request.on_device, first.gpu)
            fits = not group or total + r.nbytes <= budget
            if same_side and fits and (r.series is None or id(r.series) not in series):
                group.append(r)
                total += r.nbytes
                if r.series is not None:
                    series.add(id(r.series))
            else:
                rest.append(r)
        for r in group:
            r.taken = True
        self.waiting[:] = rest
        return group


_engine = ReadEngine()


def engine() -> ReadEngine:
    """This process's read engine."""
    return _engine


def _new_engine_after_fork() -> None:
    """A forked child starts with no reads in flight (the parent's threads are gone)."""
    global _engine
    _engine = ReadEngine()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_engine_after_fork)


def _located(asked: ReadRequest) -> _Asked:
    """The engine's state of a request: its chunks located by the store's source."""
    source = stores.source_for(asked.store)
    gpu = _device.cupy().cuda.Device().id if asked.on_device else -1
    ranges = asked.ranges
    if ranges is None:
        return _Asked(asked, source, source.locate(list(asked.keys)), gpu)
    located = source.locate(list(ranges.held))
    return _Asked(asked, source, [located[i] for i in ranges.which.tolist()], gpu)


def fetch_decode(request: ReadRequest) -> Decoded:
    """Read and decode the chunks of ``request``, together with the requests other
    threads make meanwhile.

    Returns the indices of the request's keys whose chunk exists and their decoded
    values (see :data:`~xarray_gds.request.Decoded`), and raises what reading and
    decoding these chunks alone raises.
    """
    return _engine.fetch_decode(request)


def fetch_decode_many(requests: list[ReadRequest]) -> list[Decoded | BaseException]:
    """:func:`fetch_decode` of every request at once: all of them wait together, so the
    thread that serves them reads and decodes them in as few groups as the batch budget
    allows. Each entry of the result is what :func:`fetch_decode` returns for that
    request, or the exception it raises."""
    return _engine.fetch_decode_many(requests)


def fetch_decode_parts(parts: list[ReadRequest], consume: Callable[[int, Decoded], None]) -> None:
    """:func:`fetch_decode` of every part of a read too large for one batch, handing
    each part's result to ``consume(k, result)`` in the calling thread, in order. A
    helper thread serves part ``k + 1`` (its read, joined with what other threads ask
    for) while part ``k`` decodes and is consumed; at most two parts' results are alive
    at once. Raises the first part's error."""
    _engine.fetch_decode_parts(parts, consume)


def read_only(request: ReadRequest) -> Any:
    """The batch of ``request``'s chunks read as the engine reads them, nothing decoded
    (the ``read-only`` bound of ``xarray-gds bench``; a missing chunk: size -1, None)."""
    return _read([_located(request)])


#: what a consumed part's request keeps (its chunks are released)
_CONSUMED: Decoded = ([], None)


#: Decoded chunk size from which host reads with a sink are streamed.
STREAM_CHUNK = 256 << 10


def _streamable(group: list[_Asked]) -> bool:
    """Whether a group is served chunk by chunk (:func:`_serve_streamed`): host reads of
    whole chunks of large size from sources that stream (local files), every request
    with a sink."""
    return all(
        r.request.sink is not None
        and not r.request.on_device
        and r.request.ranges is None
        and r.source.streams
        and r.request.chain.nbytes >= STREAM_CHUNK
        for r in group
    )


def _serve_streamed(group: list[_Asked]) -> None:
    """Each chunk of the group read, decoded and handed to its request's sink by one
    thread of the host pool, one chunk after the other (no step waits for the whole
    batch, and a chunk's bytes are still in the cache for the next step). On the
    project's 2-core machine, 24 chunks of 4 MiB (zarr's default compressor): 47-49 ms
    this way, 63-68 ms reading all, then decoding all, then placing all
    (engine="zarr": 62-65 ms). A chunk its sink offers a ``target`` for (one that fills
    a contiguous part of the output whole, stored as its values lie) is decoded straight
    into the output: no temporary to allocate, no copy. A request's first failing chunk
    is its error; the other requests are served."""
    tasks = [(n, j) for n, r in enumerate(group) for j in range(len(r.paths))]
    found = [np.zeros(len(r.paths), dtype=bool) for r in group]
    errors: list[BaseException | None] = [None] * len(group)
    # a kind whose reads wait on a network starts them all here (see Source.stream)
    reads = stores.stream(
        [group[n].source for n, _ in tasks], [group[n].paths[j] for n, j in tasks]
    )

    def one(t: int) -> None:
        n, j = tasks[t]
        r = group[n].request
        if errors[n] is not None:
            return
        try:
            raw = reads.get(t)
            if raw is None:  # a missing chunk: the fill value
                return
            keys = decode.Picked(r.keys, [j])
            target = getattr(r.sink, "target", None)
            into = None if target is None else target(j)
            if into is not None:  # decoded straight into the output: no copy, no temporary
                decode.decode_host(r.chain, [raw], keys, out=into.reshape(1, -1))
            else:
                _, chunk = decode.decode_fetched(r.chain, [raw], keys, False)
                assert r.sink is not None
                r.sink(j, chunk[0])
            found[n][j] = True
        except Exception as err:  # the request's, raised in the thread that asked
            errors[n] = err

    try:
        parallel(one, len(tasks), min_items=2)
    finally:
        reads.close()
    for n, r in enumerate(group):
        error = errors[n]
        r.outcome = error if error is not None else (np.flatnonzero(found[n]).tolist(), STREAMED)


def _host_route(group: list[_Asked]) -> bool:
    """Whether a group of device requests decodes on the host (see :mod:`xarray_gds.route`):
    when every decode chain of the group is faster there for its number of chunks."""
    counts: list[tuple[DecodeChain, int]] = []
    for r in (a.request for a in group):
        for i, (chain, n) in enumerate(counts):
            if chain == r.chain:
                counts[i] = (chain, n + len(r.keys))
                break
        else:
            counts.append((r.chain, len(r.keys)))
    return all(
        route.choose(c.compressor.format if c.compressor else None, n, c.nbytes) == "host"
        for c, n in counts
    )


def _decode(r: _Asked, chain: DecodeChain, fetched: Any, keys: Any, staging: Any) -> Any:
    """Decode fetched chunks as ``r``'s group does (:func:`decode.decode_routed`)."""
    host, on_device = r.host_decode, r.request.on_device
    return decode.decode_routed(chain, fetched, keys, staging, host=host, on_device=on_device)


def _read(group: list[_Asked]) -> Any:
    """Every chunk of the requests of ``group``, in one batch (one read per kind of
    source, see :mod:`xarray_gds.stores`; whole chunks and byte ranges apart)."""
    if all(r.request.ranges is None for r in group):
        return _read_whole(group)
    bounds = np.cumsum([0] + [len(r.paths) for r in group])
    parts: list[tuple[np.ndarray, Any]] = []
    for ranged in (False, True):
        members = [i for i, r in enumerate(group) if (r.request.ranges is not None) == ranged]
        if not members:
            continue
        idx = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in members])
        picked = [group[i] for i in members]
        parts.append((idx, _read_ranges(picked) if ranged else _read_whole(picked)))
    return stores.join(parts, int(bounds[-1]), group[0].decode_on_device)


def _read_ranges(group: list[_Asked]) -> Any:
    paths = [p for r in group for p in r.paths]
    ranges = [r.request.ranges for r in group if r.request.ranges is not None]
    starts = np.concatenate([r.starts for r in ranges])
    sizes = np.concatenate([r.sizes for r in ranges])
    spread = [r.source for r in group for _ in r.paths]
    return stores.read(spread, paths, group[0].decode_on_device, None, (starts, sizes))


def _read_whole(group: list[_Asked]) -> Any:
    paths = [p for r in group for p in r.paths]
    on_device = group[0].decode_on_device
    counts = [len(r.paths) for r in group]
    slots = np.repeat([r.request.chain.stored_bound for r in group], counts) if on_device else None
    spread = [r.source for r, n in zip(group, counts, strict=True) for _ in range(n)]
    return stores.read(spread, paths, on_device, slots)


def _subset(fetched: Any, idx: np.ndarray, on_device: bool) -> Any:
    if on_device:
        return DeviceBatch(fetched.arena, fetched.offsets[idx], fetched.sizes[idx])
    return [fetched[i] for i in idx.tolist()]


def _serve_alone(
    r: _Asked, staging: PinnedStaging, fetched: Any = None, idx: np.ndarray | None = None
) -> None:
    """Serve ``r`` on its own: from rows ``idx`` of ``fetched``, or from a read of its
    own files when there is no ``fetched``."""
    try:
        if fetched is None:
            fetched = _read([r])
        elif idx is not None:
            fetched = _subset(fetched, idx, r.decode_on_device)
        r.outcome = _decode(r, r.request.chain, fetched, r.request.keys, staging)
    except Exception as err:  # raised in the thread that asked
        r.outcome = err


@contextlib.contextmanager
def _on_gpu(first: _Asked) -> Iterator[None]:
    """The requests' own GPU current while a group is served (nothing on the host)."""
    if not first.request.on_device:
        yield
        return
    with _device.cupy().cuda.Device(first.gpu):
        yield


def _read_group(group: list[_Asked]) -> Any:
    """Every file of the group's requests, in one batch; ``None`` when that read
    failed (a lone request keeps the error; a group's requests read again alone)."""
    try:
        return _read(group)
    except Exception as err:  # raised in the thread that asked, or read again alone
        if len(group) == 1:
            group[0].outcome = err
        return None


def _decode_group(group: list[_Asked], fetched: Any, staging: PinnedStaging) -> None:
    """One decode per decode chain of the group's fetched files; each request on its
    own when that fails (from the same files), or when the joined read failed (each
    reading its own files again)."""
    starts = np.cumsum([0] + [len(r.request.keys) for r in group])
    spans = [np.arange(a, b) for a, b in itertools.pairwise(starts.tolist())]
    if fetched is not None:
        # an unforeseen failure here leaves each request to be decoded alone below
        with contextlib.suppress(Exception):
            _decode_joined(group, spans, fetched, staging)
    for r, idx in zip(group, spans, strict=True):
        if not r.done:
            _serve_alone(r, staging, fetched, idx)


def _decode_joined(
    group: list[_Asked], spans: list[np.ndarray], fetched: Any, staging: PinnedStaging
) -> None:
    on_device = group[0].decode_on_device
    by_chain: list[tuple[DecodeChain, list[tuple[_Asked, np.ndarray]]]] = []
    for r, idx in zip(group, spans, strict=True):
        # chains compare equal across stores; they are not hashable (codec objects)
        members = next((m for c, m in by_chain if c == r.request.chain), None)
        if members is None:
            by_chain.append((r.request.chain, members := []))
        members.append((r, idx))
    for chain, members in by_chain:
        _decode_members(chain, members, fetched, on_device, staging)


def _decode_members(
    chain: DecodeChain,
    members: list[tuple[_Asked, np.ndarray]],
    fetched: Any,
    on_device: bool,
    staging: PinnedStaging,
) -> None:
    """One decode for the requests that share ``chain``; on failure, one each."""
    if len(members) == 1:
        _serve_alone(members[0][0], staging, fetched, members[0][1])
        return
    idx = np.concatenate([i for _, i in members])
    keys = decode.Joined([m.request.keys for m, _ in members])
    try:
        present, chunks = _decode(
            members[0][0], chain, _subset(fetched, idx, on_device), keys, staging
        )
    except Exception:  # find which request it was
        for r, i in members:
            _serve_alone(r, staging, fetched, i)
        return
    found = np.asarray(present, dtype=np.int64)
    at = 0  # first position of this request's chunks in the joined list
    for member, _ in members:
        n = len(member.request.keys)
        first = int(np.searchsorted(found, at))
        last = int(np.searchsorted(found, at + n))
        mine = (found[first:last] - at).tolist()
        member.outcome = (mine, chunks[first:last] if mine else None)
        at += n

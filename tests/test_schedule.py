"""The schedule of a read in parts (:func:`xarray_gds.coalesce.fetch_decode_parts`).

A box read larger than the batch budget goes part by part: two part servers, part
``k + 1`` read while part ``k`` decodes, part ``k`` read only once part ``k - 2`` is
consumed, each part handed to the consumer in order. These tests read a small store on
the host route with a budget of two chunks (six parts), through the engine's own
schedule; recording stand-ins wrap the steps it calls (``_read_group``,
``_decode_group``, the consumer, the part servers' condition) and log each event in
order, and some of them hold a step until another one has happened, so that what the
schedule allows (or must not allow) happens for sure. Every wait of a stand-in is
bounded: a broken schedule fails instead of hanging.
"""

from __future__ import annotations

import errno
import threading
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from xarray_gds import coalesce
from xarray_gds.errors import ChunkDecodeError

#: seconds a stand-in waits for an event before it counts the schedule as stuck
LIMIT = 10.0
ROWS, COLS, CHUNK_ROWS = 24, 4, 2
CHUNK_BYTES = 8 * CHUNK_ROWS * COLS
PARTS = ROWS // CHUNK_ROWS // 2  #: parts of a read of a whole variable (two chunks a part)
SERVER = "xarray-gds-part"  #: the name of the part servers' threads

Part = tuple[int, int]  #: (which read in parts of the test, part)


class Interrupt(BaseException):
    """An interrupt (as KeyboardInterrupt) raised by a stand-in."""


class Schedule:
    """The events of the test's reads in parts, in the order they happened: ``(kind,
    part)`` with kind ``read-start``, ``read-end``, ``decode-start``, ``decode-end``,
    ``consume-start``, ``consume-end`` (``part`` None for a read of no read in parts),
    and hooks that run in the thread of an event as it is logged."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[tuple[str, Part | None]] = []
        self.reads: list[list[Any]] = []  #: the requests of each read in parts
        self.hooks: dict[tuple[str, Part], Callable[[], None]] = {}
        self.problems: list[str] = []  #: what a stand-in saw that the schedule forbids
        self.values: dict[Part, weakref.ref[Any]] = {}  #: each part's decoded chunks
        self.parked = 0  #: part servers waiting for their turn (the consumer's progress)
        self.queued = 0  #: part servers waiting in the engine (for another group's read)
        self.waiting = False  #: whether the consumer waits for a part
        self.woken = 0  #: how many times the consumer's wait was ended by a notification
        #: called where the consumer waits for a part, before it waits (if set)
        self.consumer_waits: Callable[[], None] | None = None

    def part(self, request: Any) -> Part | None:
        for n, asked in enumerate(self.reads):
            for k, r in enumerate(asked):
                if r is request:
                    return n, k
        return None

    def log(self, kind: str, part: Part | None) -> None:
        with self.cond:
            self.events.append((kind, part))
            self.cond.notify_all()
        hook = self.hooks.get((kind, part)) if part is not None else None
        if hook is not None:
            hook()

    def at(self, kind: str, part: Part | None) -> int:
        """Where the event is in the log (it happened once)."""
        found = [i for i, e in enumerate(self.events) if e == (kind, part)]
        assert len(found) == 1, (kind, part, self.events)
        return found[0]

    def has(self, kind: str, part: Part) -> bool:
        return (kind, part) in self.events

    def parts(self, kind: str, read: int = 0) -> list[int]:
        return [p[1] for k, p in self.events if k == kind and p is not None and p[0] == read]

    def wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()``; after :data:`LIMIT` seconds, note a problem and go on."""
        with self.cond:
            if not self.cond.wait_for(ready, LIMIT):
                self.problems.append(f"waited in vain for {what}")

    def settled(self, read: int, k: int) -> bool:
        """Whether the servers are as far as the schedule lets them get while part ``k``
        is consumed: part ``k + 1`` decoded, and each server with a part left waiting
        for its turn."""
        n = len(self.reads[read])
        decoded = k + 1 >= n or self.has("decode-end", (read, k + 1))
        return decoded and self.parked >= min(2, n - k - 2)


@pytest.fixture
def schedule(monkeypatch: pytest.MonkeyPatch) -> Schedule:
    """The stand-ins, recording into the returned :class:`Schedule`."""
    s = Schedule()
    real_parts = coalesce.fetch_decode_parts
    real_read = coalesce._read_group
    real_decode = coalesce._decode_group

    def fetch_decode_parts(parts: list[Any], consume: Any) -> None:
        with s.cond:
            s.reads.append(list(parts))
            n = len(s.reads) - 1

        def consumer(k: int, decoded: Any) -> None:
            s.log("consume-start", (n, k))
            consume(k, decoded)
            del decoded
            s.log("consume-end", (n, k))

        real_parts(parts, consumer)

    def read_group(group: list[Any]) -> Any:
        parts = [s.part(r.request) for r in group]
        for p in parts:
            if p is not None:
                # at most two parts alive: the decoded values of part k - 2 are gone
                for j in range(p[1] - 1):
                    ref = s.values.get((p[0], j))
                    if ref is not None and ref() is not None:
                        s.problems.append(f"part {j} still alive as part {p[1]} is read")
            s.log("read-start", p)
        try:
            return real_read(group)
        finally:
            for p in parts:
                s.log("read-end", p)

    def decode_group(group: list[Any], fetched: Any, staging: Any) -> None:
        parts = [s.part(r.request) for r in group]
        for p in parts:
            s.log("decode-start", p)
        try:
            real_decode(group, fetched, staging)
        finally:
            for r, p in zip(group, parts, strict=True):
                if p is not None and isinstance(r.outcome, tuple):
                    s.values[p] = weakref.ref(r.outcome[1])
                s.log("decode-end", p)

    class Progress(threading.Condition):
        """The part servers' and the consumer's condition: it counts the servers that
        wait for their turn, and a wait that no notification ends within
        :data:`LIMIT` raises (the consumer's 0.1 s polls too: a part is handed over
        as soon as it is done, the poll is no more than a safety net)."""

        def wait(self, timeout: float | None = None) -> bool:
            server = threading.current_thread().name.startswith(SERVER)
            if not server and s.consumer_waits is not None:
                s.consumer_waits()
            if server:
                with s.cond:
                    s.parked += 1
                    s.cond.notify_all()
            else:
                with s.cond:
                    s.waiting = True
                    s.cond.notify_all()
            try:
                if not super().wait(LIMIT):
                    s.problems.append(f"{threading.current_thread().name} waited in vain")
                    raise AssertionError("a wait of the read in parts was never notified")
                return True
            finally:
                with s.cond:
                    if server:
                        s.parked -= 1
                    else:
                        s.waiting = False
                        s.woken += 1
                    s.cond.notify_all()

    class Engine(threading.Condition):
        """The engine's condition: it counts the part servers waiting in it."""

        def wait(self, timeout: float | None = None) -> bool:
            server = threading.current_thread().name.startswith(SERVER)
            if server:
                with s.cond:
                    s.queued += 1
                    s.cond.notify_all()
            try:
                return super().wait(timeout)
            finally:
                if server:
                    with s.cond:
                        s.queued -= 1

    proxy = types.ModuleType("threading")
    proxy.__dict__.update(vars(threading))
    proxy.Condition = Progress  # type: ignore[attr-defined]
    monkeypatch.setattr(coalesce, "fetch_decode_parts", fetch_decode_parts)
    monkeypatch.setattr(coalesce, "_read_group", read_group)
    monkeypatch.setattr(coalesce, "_decode_group", decode_group)
    monkeypatch.setattr(coalesce, "threading", proxy)
    monkeypatch.setattr(coalesce.engine(), "cond", Engine())
    return s


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Two variables of twelve chunks (rows of two) each, compressed (zstd)."""
    path = tmp_path / "parts.zarr"
    values = np.arange(ROWS * COLS, dtype="f8").reshape(ROWS, COLS)
    data = {"v": (("y", "x"), values), "w": (("y", "x"), values[::-1] * 2)}
    encoding = {name: {"chunks": (CHUNK_ROWS, COLS)} for name in data}
    xr.Dataset(data).to_zarr(path, encoding=encoding)
    return path


def _open(path: Path) -> xr.Dataset:
    return xr.open_dataset(path, engine="gds-zarr", device="cpu")


def _load(array: xr.DataArray) -> xr.DataArray:
    """``array`` loaded with a batch budget of two chunks: a read in parts."""
    with zarr.config.set({"xarray_gds.batch_bytes": 2 * CHUNK_BYTES}):
        return array.load()


def _want(path: Path, name: str = "v", rows: slice = slice(None)) -> xr.DataArray:
    return xr.open_dataset(path, engine="zarr")[name].isel(y=rows).load()


def _read(path: Path, name: str = "v", rows: slice = slice(None)) -> xr.DataArray:
    got = _load(_open(path)[name].isel(y=rows))
    xr.testing.assert_identical(got, _want(path, name, rows))
    return got


def _servers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(SERVER)]


def _assert_clean(schedule: Schedule) -> None:
    """Nothing the schedule forbids was seen, and nothing of the reads is left: no part
    server running, no request waiting, no group read or decoding."""
    assert schedule.problems == []
    assert _servers() == []
    engine = coalesce.engine()
    assert engine.waiting == []
    assert engine.reader is None
    assert engine.decoders == set()


def _most_alive(schedule: Schedule, read: int = 0) -> int:
    """The most parts of a read alive at once: their read started, their consumer not
    done."""
    alive: set[int] = set()
    most = 0
    for kind, part in schedule.events:
        if part is None or part[0] != read:
            continue
        if kind == "read-start":
            alive.add(part[1])
        elif kind == "consume-end":
            alive.discard(part[1])
        most = max(most, len(alive))
    return most


# -- the schedule -------------------------------------------------------------------------


def test_each_part_is_decoded_after_its_read(store: Path, schedule: Schedule) -> None:
    _read(store)
    (parts,) = schedule.reads
    assert len(parts) == PARTS
    # one group a part, read one after the other and in order, each consumed in order
    assert schedule.parts("read-start") == list(range(PARTS))
    assert schedule.parts("read-end") == list(range(PARTS))
    assert sorted(schedule.parts("decode-start")) == list(range(PARTS))
    assert sorted(schedule.parts("decode-end")) == list(range(PARTS))
    assert schedule.parts("consume-start") == list(range(PARTS))
    assert schedule.parts("consume-end") == list(range(PARTS))
    for k in range(PARTS):
        assert schedule.at("read-end", (0, k)) < schedule.at("decode-start", (0, k))
        assert schedule.at("decode-end", (0, k)) < schedule.at("consume-start", (0, k))
        if k:
            assert schedule.at("read-end", (0, k - 1)) < schedule.at("read-start", (0, k))
    _assert_clean(schedule)


def test_the_next_part_is_read_while_a_part_decodes(store: Path, schedule: Schedule) -> None:
    """Each part's decode waits until the next part's read has started: it can only
    end if the schedule reads part k + 1 while part k decodes."""
    for k in range(PARTS - 1):

        def overlap(k: int = k) -> None:
            schedule.wait(
                lambda: schedule.has("read-start", (0, k + 1)),
                f"part {k + 1}'s read while part {k} decodes",
            )

        schedule.hooks["decode-start", (0, k)] = overlap
    _read(store)
    for k in range(PARTS - 1):
        assert (
            schedule.at("decode-start", (0, k))
            < schedule.at("read-start", (0, k + 1))
            < schedule.at("decode-end", (0, k))
        )
    _assert_clean(schedule)


def test_parts_are_read_in_order_whichever_server_asks_first(
    store: Path, schedule: Schedule, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part 0's server is held until part 1's server waits in the engine: part 1 is
    read only once part 0 is taken."""
    real = coalesce.ReadEngine._lead_or_wait
    held: list[bool] = []

    def lead_or_wait(self: coalesce.ReadEngine, request: Any) -> None:
        if schedule.part(request.request) == (0, 0) and not held:
            held.append(True)
            schedule.wait(lambda: schedule.queued == 1, "part 1's server in the engine")
        real(self, request)

    monkeypatch.setattr(coalesce.ReadEngine, "_lead_or_wait", lead_or_wait)
    _read(store)
    assert held
    assert schedule.parts("read-start") == list(range(PARTS))
    _assert_clean(schedule)


@pytest.mark.parametrize("part", [0, PARTS // 2])
def test_a_part_decoded_after_the_next_one_is_waited_for(
    store: Path, schedule: Schedule, part: int
) -> None:
    """Part k decodes until part k + 1 is decoded and its server has woken the
    consumer (waiting for part k): the consumer waits on for part k, and hands the
    parts over in order."""
    woken: list[int] = []

    def late() -> None:
        schedule.wait(lambda: bool(woken) and schedule.woken > woken[0], "the consumer woken")

    def next_part() -> None:
        def waits_for_part() -> bool:
            consumed = not part or schedule.has("consume-end", (0, part - 1))
            return consumed and schedule.waiting

        schedule.wait(waits_for_part, f"the consumer waiting for part {part}")
        with schedule.cond:
            woken.append(schedule.woken)

    schedule.hooks["decode-start", (0, part)] = late
    schedule.hooks["decode-start", (0, part + 1)] = next_part
    _read(store)
    assert schedule.at("decode-end", (0, part + 1)) < schedule.at("decode-end", (0, part))
    assert schedule.parts("consume-end") == list(range(PARTS))
    _assert_clean(schedule)


def test_at_most_two_parts_are_alive_with_a_slow_consumer(store: Path, schedule: Schedule) -> None:
    """The consumer of each part returns only once the servers have gone as far as
    they may: the next part read and decoded, and each server with a part left
    waiting for its turn. Part k is read only after part k - 2 is consumed, and its
    decoded values are gone by then."""
    for k in range(PARTS):

        def slow(k: int = k) -> None:
            schedule.wait(lambda: schedule.settled(0, k), f"the servers while part {k} is used")

        schedule.hooks["consume-start", (0, k)] = slow
    _read(store)
    for k in range(PARTS):
        if k + 1 < PARTS:  # read and decoded while part k was consumed
            assert schedule.at("decode-end", (0, k + 1)) < schedule.at("consume-end", (0, k))
        if k >= 2:
            assert schedule.at("consume-end", (0, k - 2)) < schedule.at("read-start", (0, k))
    assert _most_alive(schedule) == 2
    assert len(schedule.values) == PARTS  # each part's values checked as they went
    _assert_clean(schedule)


@pytest.mark.parametrize(
    "rows", [slice(None), slice(3, 21), slice(1, 24)], ids=["all", "inner", "tail"]
)
def test_parts_are_consumed_in_order_once(store: Path, schedule: Schedule, rows: slice) -> None:
    _read(store, rows=rows)
    (parts,) = schedule.reads
    first, last = rows.indices(ROWS)[0] // CHUNK_ROWS, -(-rows.indices(ROWS)[1] // CHUNK_ROWS)
    keys = [k for p in parts for k in p.keys]
    assert keys == [f"v/c/{i}/0" for i in range(first, last)]  # each chunk once
    assert schedule.parts("consume-start") == list(range(len(parts)))
    assert schedule.parts("consume-end") == list(range(len(parts)))
    assert _most_alive(schedule) <= 2
    _assert_clean(schedule)


def test_another_threads_read_takes_no_part_ahead_of_its_turn(
    store: Path, schedule: Schedule
) -> None:
    """A thread that reads meanwhile serves what waits in the engine: never a part
    before its turn (part k before part k - 2 is consumed)."""
    other = _open(store).w.isel(y=slice(0, CHUNK_ROWS))  # one chunk: no read in parts
    got: list[xr.DataArray] = []

    def meanwhile() -> None:
        reader = threading.Thread(target=lambda: got.append(_load(other)))
        reader.start()
        reader.join(LIMIT)
        if reader.is_alive():
            schedule.problems.append("the other thread's read did not end")
        schedule.wait(lambda: schedule.settled(0, 0), "the servers while part 0 is used")

    schedule.hooks["consume-start", (0, 0)] = meanwhile
    _read(store)
    (values,) = got
    xr.testing.assert_identical(values, _want(store, "w", slice(0, CHUNK_ROWS)))
    for k in range(2, PARTS):
        assert schedule.at("consume-end", (0, k - 2)) < schedule.at("read-start", (0, k))
    assert _most_alive(schedule) == 2
    _assert_clean(schedule)


# -- errors ---------------------------------------------------------------------------------

ENDS = pytest.mark.parametrize("part", [0, PARTS // 2, PARTS - 1], ids=["first", "middle", "last"])


@ENDS
@pytest.mark.parametrize("where", ["read", "decode", "interrupt"])
def test_an_error_in_a_part_is_raised_once(
    store: Path, schedule: Schedule, monkeypatch: pytest.MonkeyPatch, where: str, part: int
) -> None:
    """A part's read that fails, a damaged chunk, or an interrupt while a part server
    reads: the error reaches the caller, once, naming the chunk; the parts before it
    were consumed, none after; the servers are gone, and the next read is right."""
    key = f"v/c/{2 * part + 1}/0"  # the part's second chunk
    raised: list[BaseException] = []
    stored = (store / key).read_bytes()
    if where == "decode":
        (store / key).write_bytes(b"not a zstd frame")
    elif where == "read":
        real = coalesce._read

        def read(group: list[Any]) -> Any:
            if not raised and any(key in r.request.keys for r in group):
                raised.append(OSError(errno.EIO, "Input/output error", str(store / key)))
                raise raised[-1]
            return real(group)

        monkeypatch.setattr(coalesce, "_read", read)
    else:

        def interrupt() -> None:
            if not raised:
                raised.append(Interrupt(key))
                raise raised[-1]

        schedule.hooks["read-start", (0, part)] = interrupt
    expected = {"read": OSError, "decode": ChunkDecodeError, "interrupt": Interrupt}[where]
    with pytest.raises(expected) as caught:
        _load(_open(store).v)
    assert key in str(caught.value)
    if where == "decode":
        assert str(caught.value).startswith(f"cannot decode chunk '{key}' with codec 'zstd'")
    else:
        assert caught.value is raised[0]
    assert caught.value.__context__ is None  # raised once, not while raising another
    assert schedule.parts("consume-start") == list(range(part))
    assert schedule.parts("read-start").count(part) == 1  # a lone part is not read again
    assert max(schedule.parts("read-start")) <= part + 1
    _assert_clean(schedule)
    (store / key).write_bytes(stored)
    _read(store)  # on the same thread
    assert schedule.parts("consume-end", read=1) == list(range(PARTS))
    _assert_clean(schedule)


class Stop(Exception):
    """The consumer's own error."""


@ENDS
def test_a_consumer_that_raises_stops_the_servers(
    store: Path, schedule: Schedule, part: int
) -> None:
    """The consumer raises when the servers are as far as they may get (the next part
    decoded, the others waiting for their turn): the error reaches the caller, no part
    is read after it, nothing of the read is left in the engine (no later read serves
    its parts), and the next read is right."""
    error = Stop(part)

    def fail() -> None:
        schedule.wait(lambda: schedule.settled(0, part), f"the servers at part {part}")
        schedule.log("raise", (0, part))
        raise error

    schedule.hooks["consume-start", (0, part)] = fail
    with pytest.raises(Stop) as caught:
        _load(_open(store).v)
    assert caught.value is error
    raised = schedule.at("raise", (0, part))
    assert [e for e in schedule.events[raised:] if e[0] == "read-start"] == []
    assert schedule.parts("read-start") == list(range(min(part + 2, PARTS)))
    assert schedule.parts("consume-end") == list(range(part))
    _assert_clean(schedule)
    _read(store, "w", slice(0, CHUNK_ROWS))  # one chunk: serves whatever waits first
    _read(store)
    assert schedule.parts("read-start") == list(range(min(part + 2, PARTS)))
    assert schedule.parts("consume-end", read=1) == list(range(PARTS))
    _assert_clean(schedule)


def test_an_interrupt_withdraws_parts_waiting_in_the_engine(
    store: Path, schedule: Schedule, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt while the part servers wait for another thread's read (the caller
    waiting for part 0): they stop waiting, no part is read, and the other thread's
    read and the next read are right."""
    other = _open(store).w.isel(y=slice(0, CHUNK_ROWS))
    reading, release = threading.Event(), threading.Event()
    real = coalesce._read

    def read(group: list[Any]) -> Any:
        if any(k.startswith("w/") for r in group for k in r.request.keys):
            reading.set()
            if not release.wait(LIMIT):
                schedule.problems.append("the other thread's read was held in vain")
        return real(group)

    def interrupt() -> None:
        schedule.wait(lambda: schedule.queued == 2, "both servers waiting in the engine")
        schedule.log("raise", (0, 0))
        raise Interrupt

    monkeypatch.setattr(coalesce, "_read", read)
    got: list[xr.DataArray] = []
    reader = threading.Thread(target=lambda: got.append(_load(other)))
    reader.start()
    try:
        assert reading.wait(LIMIT)
        schedule.consumer_waits = interrupt
        with pytest.raises(Interrupt):
            _load(_open(store).v)
        schedule.consumer_waits = None
    finally:
        release.set()
        reader.join(LIMIT)
    (values,) = got
    xr.testing.assert_identical(values, _want(store, "w", slice(0, CHUNK_ROWS)))
    assert schedule.parts("read-start") == []
    _assert_clean(schedule)
    _read(store)
    assert schedule.parts("consume-end", read=1) == list(range(PARTS))
    _assert_clean(schedule)

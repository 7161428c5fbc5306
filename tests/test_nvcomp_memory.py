"""nvCOMP's device memory: calls that find the device out of memory retry once after
CuPy's memory pool hands its cached free blocks back, and the codecs (with their scratch
memory) live in a bounded pool of lanes that threads share (CPU stand-ins for CuPy, the
stream and the codec)."""

from __future__ import annotations

import gc
import threading
import weakref
from types import SimpleNamespace
from typing import Any

import pytest

from xarray_gds.codecs import nvcomp


class _Pool:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def free_all_blocks(self) -> None:
        self.log.append("free")


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    events: list[str] = []
    fake_cupy = SimpleNamespace(get_default_memory_pool=lambda: _Pool(events))
    monkeypatch.setattr(nvcomp._device, "cupy", lambda: fake_cupy)
    return events


def _stream(log: list[str]) -> SimpleNamespace:
    return SimpleNamespace(synchronize=lambda: log.append("sync"))


def _codec(log: list[str], errors: list[Exception]) -> Any:
    def call(inputs: Any, *, out: Any) -> tuple[Any, Any]:
        log.append("call")
        if errors:
            raise errors.pop(0)
        return inputs, out

    return call


def test_out_of_memory_frees_the_pool_then_retries_once(log: list[str]) -> None:
    call = _codec(log, [RuntimeError("CUDA Runtime API failure: out of memory : code=1000.")])
    assert nvcomp._retry_out_of_memory(_stream(log), call, "in", "out") == ("in", "out")
    assert log == ["call", "sync", "free", "call"]


def test_a_second_out_of_memory_is_raised(log: list[str]) -> None:
    errors: list[Exception] = [RuntimeError("out of memory"), RuntimeError("out of memory 2")]
    with pytest.raises(RuntimeError, match="out of memory 2"):
        nvcomp._retry_out_of_memory(_stream(log), _codec(log, errors), "in", "out")
    assert log == ["call", "sync", "free", "call"]


@pytest.mark.parametrize("error", [RuntimeError("invalid stream"), ValueError("out of memory")])
def test_other_errors_are_raised_untouched(log: list[str], error: Exception) -> None:
    with pytest.raises(type(error), match=str(error)):
        nvcomp._retry_out_of_memory(_stream(log), _codec(log, [error]), "in", "out")
    assert log == ["call"]


def test_success_calls_once(log: list[str]) -> None:
    call = _codec(log, [])
    assert nvcomp._retry_out_of_memory(_stream(log), call, "in", "out") == ("in", "out")
    assert log == ["call"]


class _Codec:
    """Stands in for an nvCOMP codec (which holds device scratch memory)."""


class _FakeStream:
    def __init__(self, non_blocking: bool) -> None:
        assert non_blocking


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A CuPy stand-in whose current device the test sets, no lanes nor keepers yet,
    and the exit handler's registrations recorded instead of made."""
    state = SimpleNamespace(gpu=0, registered=[])
    fake_cupy = SimpleNamespace(
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=state.gpu), Stream=_FakeStream)
    )
    monkeypatch.setattr(nvcomp._device, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(nvcomp, "_local", threading.local())
    monkeypatch.setattr(nvcomp, "_keepers", {})
    monkeypatch.setattr(nvcomp, "_all_lanes", weakref.WeakSet())
    monkeypatch.setattr(nvcomp, "_release_registered", False)
    monkeypatch.setattr(nvcomp.atexit, "register", state.registered.append)
    return state


def _call(lane: nvcomp._Lane) -> weakref.ref[_Codec]:
    """What an nvCOMP call does to its lane: makes the codec it needs if missing."""
    codec = lane.codecs.setdefault("zstd", _Codec())
    return weakref.ref(codec)


def test_a_thread_keeps_its_lane_and_codec_between_calls(lanes: SimpleNamespace) -> None:
    with nvcomp._lane() as lane:
        first = _call(lane)
    with nvcomp._lane() as again:
        assert again is lane and _call(again) is first and first() is not None
    assert lanes.registered == [nvcomp._release]  # the exit handler, once


def test_only_a_few_threads_keep_their_codecs(lanes: SimpleNamespace) -> None:
    """Threads alive at once: the first KEPT_CODECS to finish a call keep their codecs,
    the others' codecs go as their call ends; all go with their threads."""
    n = nvcomp.KEPT_CODECS + 3
    codecs: list[weakref.ref[_Codec]] = []
    lanes_seen: list[weakref.ref[nvcomp._Lane]] = []
    called = threading.Semaphore(0)
    finish = threading.Event()

    def work() -> None:
        with nvcomp._lane() as lane:
            codecs.append(_call(lane))
            lanes_seen.append(weakref.ref(lane))
        called.release()
        finish.wait()

    # daemon threads, released in any case: a failed assertion must not hang the run
    threads = [threading.Thread(target=work, daemon=True) for _ in range(n)]
    try:
        for t in threads:
            t.start()
            assert called.acquire(timeout=30)  # one call at a time: the first ones keep
        gc.collect()
        kept = [ref() is not None for ref in codecs]
        assert kept == [True] * nvcomp.KEPT_CODECS + [False] * 3
        assert len({id(ref()) for ref in lanes_seen}) == n  # a lane a thread
        assert len(nvcomp._keepers[0]) == nvcomp.KEPT_CODECS
    finally:
        finish.set()
        for t in threads:
            t.join(timeout=30)
    gc.collect()
    assert [ref() for ref in codecs] == [None] * n
    assert [ref() for ref in lanes_seen] == [None] * n
    assert len(nvcomp._all_lanes) == 0 and len(nvcomp._keepers[0]) == 0
    # a thread that comes later keeps its codecs again
    with nvcomp._lane() as lane:
        later = _call(lane)
    assert later() is not None


def test_a_failed_call_drops_the_codecs(lanes: SimpleNamespace) -> None:
    with pytest.raises(RuntimeError, match="boom"), nvcomp._lane() as lane:
        made = _call(lane)
        raise RuntimeError("boom")
    gc.collect()
    assert made() is None and lane.codecs == {}
    assert lane not in nvcomp._keepers.get(0, set())
    with nvcomp._lane() as again:
        assert again is lane and _call(again)() is not None


def test_a_keeper_whose_call_failed_gives_up_its_place(lanes: SimpleNamespace) -> None:
    """A keeper's failed call drops its codecs and its place among the keepers: a
    thread that finishes a call next keeps its codecs in that place, and the failed
    lane, with every place taken, no longer keeps any."""
    with nvcomp._lane() as mine:
        _call(mine)
    called = threading.Semaphore(0)
    finish = threading.Event()

    def work() -> None:
        with nvcomp._lane() as lane:
            _call(lane)
        called.release()
        finish.wait()

    # the other keepers: threads alive until the end
    others = [threading.Thread(target=work, daemon=True) for _ in range(nvcomp.KEPT_CODECS - 1)]
    newcomer: list[weakref.ref[_Codec]] = []

    def late() -> None:
        with nvcomp._lane() as lane:
            newcomer.append(_call(lane))
        called.release()
        finish.wait()

    late_thread = threading.Thread(target=late, daemon=True)
    try:
        for t in others:
            t.start()
            assert called.acquire(timeout=30)
        assert mine in nvcomp._keepers[0] and len(nvcomp._keepers[0]) == nvcomp.KEPT_CODECS
        with pytest.raises(RuntimeError, match="boom"), nvcomp._lane() as again:
            assert again is mine
            raise RuntimeError("boom")
        assert mine not in nvcomp._keepers[0] and mine.codecs == {}
        late_thread.start()
        assert called.acquire(timeout=30)
        gc.collect()
        assert newcomer[0]() is not None  # kept, in the place the failed lane gave up
        assert len(nvcomp._keepers[0]) == nvcomp.KEPT_CODECS
        with nvcomp._lane() as again:
            made = _call(again)
        gc.collect()
        assert made() is None and mine.codecs == {}  # every place taken now
    finally:
        finish.set()
        for t in [*others, late_thread]:
            if t.is_alive():
                t.join(timeout=30)


def test_lanes_belong_to_the_device_current_when_asked(lanes: SimpleNamespace) -> None:
    with nvcomp._lane() as first:
        assert first.device == 0
    lanes.gpu = 1
    with nvcomp._lane() as other:
        assert other is not first and other.device == 1
        assert other.stream is not first.stream
    lanes.gpu = 0
    with nvcomp._lane() as again:
        assert again is first


def test_release_drops_the_codecs_of_every_lane(lanes: SimpleNamespace) -> None:
    with nvcomp._lane() as mine:
        _call(mine)
    other: list[nvcomp._Lane] = []

    def work() -> None:
        with nvcomp._lane() as lane:
            _call(lane)
            other.append(lane)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert mine.codecs
    nvcomp._release()
    assert mine.codecs == {}

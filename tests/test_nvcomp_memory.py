"""nvCOMP's device memory: calls that find the device out of memory retry once after
CuPy's memory pool hands its cached free blocks back, and the codecs (with their scratch
memory) live in a bounded pool of lanes that threads share (CPU stand-ins for CuPy, the
stream and the codec)."""

from __future__ import annotations

import gc
import threading
import weakref
from contextlib import ExitStack
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
    """A CuPy stand-in whose current device the test sets, an empty lane pool, and the
    exit handler's registrations recorded instead of made."""
    state = SimpleNamespace(gpu=0, registered=[])
    fake_cupy = SimpleNamespace(
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=state.gpu), Stream=_FakeStream)
    )
    monkeypatch.setattr(nvcomp._device, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(nvcomp, "_idle", {})
    monkeypatch.setattr(nvcomp, "_all_lanes", weakref.WeakSet())
    monkeypatch.setattr(nvcomp, "_release_registered", False)
    monkeypatch.setattr(nvcomp.atexit, "register", state.registered.append)
    return state


def test_threads_that_call_one_after_another_share_one_lane(lanes: SimpleNamespace) -> None:
    seen: list[nvcomp._Lane] = []

    def work() -> None:
        with nvcomp._lane() as lane:
            lane.codecs.setdefault("zstd", _Codec())
            seen.append(lane)

    for _ in range(5):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert len(seen) == 5 and all(lane is seen[0] for lane in seen)
    assert len(nvcomp._all_lanes) == 1
    assert lanes.registered == [nvcomp._release]  # the exit handler, once


def test_lanes_held_at_once_are_distinct_and_idle_ones_are_capped(
    lanes: SimpleNamespace,
) -> None:
    n = nvcomp.IDLE_LANES + 3
    codecs = []
    with ExitStack() as stack:
        held = [stack.enter_context(nvcomp._lane()) for _ in range(n)]
        assert len({id(lane) for lane in held}) == n
        assert len({id(lane.stream) for lane in held}) == n
        for lane in held:
            lane.codecs["zstd"] = _Codec()
            codecs.append(weakref.ref(lane.codecs["zstd"]))
    assert len(nvcomp._idle[0]) == nvcomp.IDLE_LANES
    del held, lane
    gc.collect()
    # the lanes beyond the cap went, with their codecs (and their device scratch)
    assert len(nvcomp._all_lanes) == nvcomp.IDLE_LANES
    assert sum(ref() is not None for ref in codecs) == nvcomp.IDLE_LANES
    assert lanes.registered == [nvcomp._release]


def test_a_lane_whose_call_failed_is_not_handed_out_again(lanes: SimpleNamespace) -> None:
    with pytest.raises(RuntimeError, match="boom"), nvcomp._lane() as failed:
        failed.codecs["zstd"] = _Codec()
        raise RuntimeError("boom")
    assert nvcomp._idle.get(0, []) == []
    with nvcomp._lane() as lane:
        assert lane is not failed and lane.codecs == {}


def test_lanes_belong_to_the_device_current_when_asked(lanes: SimpleNamespace) -> None:
    with nvcomp._lane() as first:
        assert first.device == 0
    lanes.gpu = 1
    with nvcomp._lane() as other:
        assert other is not first and other.device == 1
    lanes.gpu = 0
    with nvcomp._lane() as again:
        assert again is first


def test_release_drops_the_codecs_of_every_lane(lanes: SimpleNamespace) -> None:
    with nvcomp._lane() as idle:
        idle.codecs["zstd"] = _Codec()
    with nvcomp._lane() as busy:
        busy.codecs["lz4"] = _Codec()
        nvcomp._release()  # at exit, a lane may still be held by a thread
    assert idle.codecs == {} and busy.codecs == {}

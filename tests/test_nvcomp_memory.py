"""nvCOMP calls that find the device out of memory retry once after CuPy's memory pool
hands its cached free blocks back (CPU stand-ins for CuPy's pool, the stream and the
codec)."""

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


def test_a_finished_threads_stream_and_codecs_are_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Stream:
        def __init__(self, non_blocking: bool) -> None:
            assert non_blocking

    fake_cupy = SimpleNamespace(
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=0), Stream=Stream)
    )
    monkeypatch.setattr(nvcomp._device, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(nvcomp, "_release_registered", True)  # no exit handler from a test
    before = len(nvcomp._all_states)
    codecs: list[weakref.ref[_Codec]] = []
    streams: list[weakref.ref[Stream]] = []

    def work() -> None:
        stream, held = nvcomp._state()
        held["zstd"] = _Codec()
        codecs.append(weakref.ref(held["zstd"]))
        streams.append(weakref.ref(stream))
        assert nvcomp._state() == (stream, held)  # the thread keeps its own pair
        assert len(nvcomp._all_states) == before + 1

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
        t.join()
    gc.collect()
    assert len(codecs) == 3
    assert [c() for c in codecs] == [None] * 3
    assert [s() for s in streams] == [None] * 3
    assert len(nvcomp._all_states) == before

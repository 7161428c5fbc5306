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

import numpy as np
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


# -- _run on its lane: CPU stand-ins for CuPy's streams and an nvCOMP zstd codec --------


class _LaneStream:
    """A CuPy stream stand-in that records the streams whose events it waited for."""

    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = id(self)
        self.device_id = 0
        self.waited: list[Any] = []

    def record(self) -> Any:
        return SimpleNamespace(source=self)

    def wait_event(self, event: Any) -> None:
        self.waited.append(event.source)

    def synchronize(self) -> None:
        pass


class _ZstdCodec:
    """nvCOMP's zstd codec on the host (numcodecs): decodes each input view into its
    output view; it checks that its stream was made to wait for the current stream
    (the reads and copies queued there), and fails as nvCOMP does where asked."""

    def __init__(self, env: SimpleNamespace, cuda_stream: int, **kwargs: Any) -> None:
        self.env, self.stream_ptr = env, cuda_stream
        env.codecs.append(self)

    def decode(self, inputs: list[Any], *, out: list[Any]) -> Any:
        (lane_stream,) = [s for s in self.env.streams if s.ptr == self.stream_ptr]
        assert self.env.current in lane_stream.waited, "nvCOMP ran before the reads"
        if self.env.fail is not None:
            raise RuntimeError(self.env.fail)
        import numcodecs

        sizes = []
        for src, dst in zip(inputs, out, strict=True):
            raw = numcodecs.Zstd().decode(src.tobytes())
            dst[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            sizes.append(len(raw))
        return SimpleNamespace(buffer_sizes=sizes)


@pytest.fixture
def run_env(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    env = SimpleNamespace(current=_LaneStream(), streams=[], codecs=[], fail=None)

    def stream(non_blocking: bool = False) -> _LaneStream:
        made = _LaneStream(non_blocking)
        env.streams.append(made)
        return made

    fake_cupy = SimpleNamespace(
        cuda=SimpleNamespace(
            Device=lambda: SimpleNamespace(id=0),
            Stream=stream,
            get_current_stream=lambda: env.current,
        )
    )
    fake_nvcomp = SimpleNamespace(
        Codec=lambda **kwargs: _ZstdCodec(env, **kwargs),
        BitstreamKind=SimpleNamespace(RAW="raw"),
        as_arrays=lambda buffer, offs, lens, cuda_stream: [
            buffer[o : o + n] for o, n in zip(offs, lens, strict=True)
        ],
    )
    monkeypatch.setattr(nvcomp._device, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(nvcomp, "_nvcomp", lambda: fake_nvcomp)
    monkeypatch.setattr(nvcomp, "_local", threading.local())
    monkeypatch.setattr(nvcomp, "_keepers", {})
    monkeypatch.setattr(nvcomp, "_all_lanes", weakref.WeakSet())
    monkeypatch.setattr(nvcomp, "_release_registered", False)
    monkeypatch.setattr(nvcomp.atexit, "register", lambda f: None)
    return env


def _zstd_batch(chunks: list[np.ndarray]) -> tuple[Any, np.ndarray, np.ndarray]:
    """The zstd streams of ``chunks`` packed one after another, as a DeviceBatch."""
    import numcodecs

    from xarray_gds.batch import DeviceBatch

    streams = [np.frombuffer(numcodecs.Zstd().encode(c.tobytes()), np.uint8) for c in chunks]
    sizes = np.array([len(s) for s in streams], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    out_sizes = np.array([c.nbytes for c in chunks], dtype=np.int64)
    out_offsets = np.concatenate([[0], np.cumsum(out_sizes)[:-1]]).astype(np.int64)
    return DeviceBatch(np.concatenate(streams), offsets, sizes), out_offsets, out_sizes


def test_run_decodes_on_its_lane_after_the_current_stream(run_env: SimpleNamespace) -> None:
    """_run decodes with its thread's lane codec, on the lane's stream made to wait for
    the current one; the codec is kept for the next call, and a failed call names the
    chunk nvCOMP names and drops the lane's codec."""
    from xarray_gds.codecs.formats import FORMATS
    from xarray_gds.errors import ChunkDecodeError

    rng = np.random.default_rng(3)
    chunks = [rng.integers(0, 4, n).astype("<f8") for n in (10, 1, 37)]
    src, out_offsets, out_sizes = _zstd_batch(chunks)
    keys = ["v/0", "v/1", "v/2"]
    out = np.zeros(int(out_sizes.sum()), dtype=np.uint8)
    nvcomp._run(FORMATS["zstd"], "zstd", src, out, out_offsets, out_sizes, keys)
    np.testing.assert_array_equal(out.view("<f8"), np.concatenate(chunks))
    assert len(run_env.streams) == 1 and len(run_env.codecs) == 1
    nvcomp._run(FORMATS["zstd"], "zstd", src, out, out_offsets, out_sizes, keys)
    assert len(run_env.streams) == 1 and len(run_env.codecs) == 1  # the same lane, kept
    run_env.fail = "Output array 2 is too small"
    with pytest.raises(ChunkDecodeError, match="v/2") as err:
        nvcomp._run(FORMATS["zstd"], "zstd", src, out, out_offsets, out_sizes, keys)
    assert err.value.codec == "zstd"
    (lane,) = nvcomp._all_lanes
    assert lane.codecs == {}

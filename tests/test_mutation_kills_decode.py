"""Tests written for mutants of ``xarray_gds/decode.py`` that survived the quick stage of
``scripts/mutation-run.py``: each test names the mutation it stops. The GPU paths run
with a fake CuPy over numpy and nvCOMP's decode standing in as the host decode
(:mod:`tests.test_host_logic`), and are compared with the host decode, itself compared
with zarr-python elsewhere in the suite."""

from __future__ import annotations

import re
import threading
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import zarr

from tests.test_mutation_kills import device_batch
from xarray_gds import ChunkDecodeError, batch, decode, route
from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch
from xarray_gds.codecs import nvcomp

MIB = 1 << 20


def _gpu(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """A fake CuPy and nvCOMP's decode standing in as the host decode of the chunks it is
    given; returns the list of the chunk indices of each nvCOMP call."""
    from tests.test_host_logic import _fake_cupy

    calls: list[list[int]] = []

    def gpu_decode(chain: Any, fetched: DeviceBatch, idx: list[int], names: Any) -> Any:
        calls.append(list(idx))
        out = np.empty((len(idx), chain.nbytes), dtype=np.uint8)
        o, s = fetched.offsets, fetched.sizes
        decode.decode_host(chain, [fetched.arena[o[i] : o[i] + s[i]] for i in idx], names, out)
        return out

    fake = _fake_cupy()
    fake.asnumpy = np.asarray
    monkeypatch.setattr(_device, "cupy", lambda: fake)
    monkeypatch.setattr(decode, "_streams", threading.local())
    monkeypatch.setattr(nvcomp, "decode", gpu_decode)
    return calls


def _zstd(store_factory: Any) -> tuple[Any, list[str], list[Any]]:
    """The zstd chain, keys and stored bytes of the sample store's ``t2m`` (its first
    chunk not stored)."""
    from tests.test_host_logic import _all_chunks

    chain, keys, fetched = _all_chunks(store_factory(3, "zstd"))
    assert fetched[0] is None and all(f is not None for f in fetched[1:])
    return chain, keys, fetched


def _same(got: tuple[list[int], Any], want: tuple[list[int], Any]) -> None:
    assert got[0] == want[0]
    assert got[1].shape == want[1].shape and got[1].dtype == want[1].dtype
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])


# -- batch sizes ------------------------------------------------------------------------------
def test_batch_bytes_defaults_to_4_gib_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``batch_bytes(on_device=True)`` -> ``on_device=False`` as the default: asked
    without an argument, the batch is the GPU's 4 GiB, 1 GiB only on the host."""
    monkeypatch.delenv("XARRAY_GDS_BATCH_BYTES", raising=False)
    with zarr.config.set({"xarray_gds.batch_bytes": None}):
        assert decode.batch_bytes() == 4 << 30
        assert decode.batch_bytes(on_device=False) == 1 << 30
    with zarr.config.set({"xarray_gds.batch_bytes": 12345}):
        assert decode.batch_bytes() == decode.batch_bytes(on_device=False) == 12345


@pytest.mark.parametrize(("free", "want"), [(6005, 1000), (6000, 1000), (5, 1)])
def test_gpu_budget_is_a_sixth_of_free_memory_rounded_down(
    monkeypatch: pytest.MonkeyPatch, free: int, want: int
) -> None:
    """``free // 6`` dropped, replaced by ``free / 6``, ``free // 5``, ``free // 7`` or any
    other operator on 6: the GPU's budget is exactly the integer sixth of the free device
    memory (at least one byte) when that is below the configured budget."""
    monkeypatch.delenv("XARRAY_GDS_BATCH_BYTES", raising=False)
    runtime = types.SimpleNamespace(memGetInfo=lambda: (free, 1 << 40))
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(_device, "cupy", lambda: fake)
    got = decode.budget(True)
    assert type(got) is int and got == want
    assert decode.budget(False) == 1 << 30  # the host's budget asks nothing of the GPU


@pytest.mark.parametrize(
    ("n_chunks", "chunk", "parts", "batch_size", "want"),
    [
        (210_000_000, 1, 3, None, 70_000_000),  # a third exactly: not one more
        (3, 1000, 1, 100, 1),  # a chunk larger than the budget: one a part
        (3, 100, 1, 250, 2),  # two chunks fit in the budget
    ],
)
def test_part_chunks_exact_at_the_edges(
    n_chunks: int, chunk: int, parts: int, batch_size: int | None, want: int
) -> None:
    """``-(-total // parts)`` -> ``-(~total // parts)`` (a total that the parts divide
    rounded up one byte too far) and ``max(1, target // chunk_nbytes)`` -> ``max(0, ...)``
    or ``max(2, ...)``: a chunk larger than the budget is a part of its own, never zero
    or two chunks."""
    from tests.test_mutation_kills import test_part_chunks_exact

    test_part_chunks_exact(n_chunks, chunk, parts, batch_size, want)


# -- decode_routed ----------------------------------------------------------------------------
def test_decode_routed_takes_its_route_by_keyword_only(store_factory: Any) -> None:
    """``*,`` -> ``/,`` in decode_routed's signature: the batch's arguments may be named,
    the route flags ``host`` and ``on_device`` must be."""
    chain, keys, fetched = _zstd(store_factory)
    want = decode.decode_fetched(chain, fetched, keys, False)
    got = decode.decode_routed(
        chain=chain, fetched=fetched, keys=keys, staging=None, host=False, on_device=False
    )
    _same(got, want)
    with pytest.raises(TypeError, match="positional"):
        decode.decode_routed(chain, fetched, keys, None, False, False)  # type: ignore[misc]


def test_device_decode_of_uncompressed_chunks_skips_the_split_plan(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any
) -> None:
    """``chain.compressor is not None`` -> ``is None`` (decode_routed): uncompressed chunks
    read onto the device go to the device decode without a split plan, compressed ones
    are planned; both give the host decode's values."""
    from tests.test_host_logic import _all_chunks

    calls = _gpu(monkeypatch)
    planned: list[int] = []
    real_plan = route.plan

    def plan(compressor: Any, n: int, nbytes: int) -> Any:
        planned.append(n)
        return real_plan(compressor, n, nbytes)

    monkeypatch.setattr(route, "plan", plan)
    chain, keys, fetched = _all_chunks(store_factory(3, "none"))
    assert chain.compressor is None
    want = decode.decode_fetched(chain, fetched, keys, False)
    got = decode.decode_routed(chain, device_batch(fetched), keys, None, host=False, on_device=True)
    _same(got, want)
    assert planned == [] and calls == [want[0]]
    chain, keys, fetched = _zstd(store_factory)
    want = decode.decode_fetched(chain, fetched, keys, False)
    with zarr.config.set({"xarray_gds.split": "off"}):
        got = decode.decode_routed(
            chain, device_batch(fetched), keys, None, host=False, on_device=True
        )
    _same(got, want)
    assert planned == [len(want[0])] and calls[1:] == [want[0]]


class _Planned(Exception):
    """Raised by a stand-in split plan once it has been asked."""


def test_split_plan_counts_present_chunks_empty_files_included(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any
) -> None:
    """``sizes >= 0`` -> ``> 0``, ``== 0``, ``< 0``, ``<= 0``, ``!= 0``, ``>= -1`` or ``>= 1``
    (decode_routed's count for the split plan): the plan is asked for the number of
    chunks present, a stored empty file counted, a missing chunk (size -1) not."""
    chain, keys, fetched = _zstd(store_factory)
    _gpu(monkeypatch)
    asked: list[tuple[Any, Any, int]] = []

    def plan(compressor: Any, n: int, nbytes: int) -> Any:
        asked.append((compressor, n, nbytes))
        raise _Planned

    monkeypatch.setattr(route, "plan", plan)
    # one missing chunk, two empty files, three chunks with data
    some = [None, b"", fetched[1], b"", fetched[2], fetched[3]]
    with pytest.raises(_Planned):
        decode.decode_routed(chain, device_batch(some), keys[:6], None, host=False, on_device=True)
    assert asked == [(chain.compressor.format, 5, chain.nbytes)]
    assert type(asked[0][1]) is int


def test_device_batch_split_with_pinned_staging_matches_the_host_decode(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any
) -> None:
    """``int(np.count_nonzero(...))`` -> ``np.count_nonzero(...)`` (decode_routed): with the
    split on and a host far faster than the GPU, the plan gives the host pool a share and
    the pinned staging (its buffers sized by ``int.bit_length``) leases the share's
    decoded size, once; the values are the host decode's, the GPU decoding the rest."""
    from tests.test_host_logic import EXACT

    chain, keys, fetched = _zstd(store_factory)
    want = decode.decode_fetched(chain, fetched, keys, False)
    calls = _gpu(monkeypatch)
    pageable = staticmethod(lambda nbytes: np.zeros(nbytes, dtype=np.uint8))
    monkeypatch.setattr(batch.PinnedStaging, "_allocate", pageable)
    leased: list[Any] = []
    real_take = batch.PinnedStaging._take

    def take(self: batch.PinnedStaging, nbytes: int) -> Any:
        leased.append(nbytes)
        return real_take(self, nbytes)

    monkeypatch.setattr(batch.PinnedStaging, "_take", take)
    fast_host = {
        **EXACT,
        "rates": {"zstd": {"gpu_chunk": 1.0, "gpu_batch": 1.0, "host_thread": 2.0**40}},
    }
    settings = {"xarray_gds.split": "on", "xarray_gds.route_constants": fast_host}
    with zarr.config.set(settings):
        n = len(want[0])
        share = route.plan(chain.compressor.format, n, chain.nbytes)
        assert 0 < share.host < n
        staging = batch.PinnedStaging(keep_bytes=0)
        got = decode.decode_routed(
            chain, device_batch(fetched), keys, staging, host=False, on_device=True
        )
    _same(got, want)
    assert leased == [share.host * chain.nbytes] and staging.allocations == 1
    assert calls == [want[0][: n - share.host]]


@pytest.mark.parametrize("host", [0, 2])
def test_device_batch_shared_as_the_split_plan_says(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any, host: int
) -> None:
    """``if share.host:`` -> ``if not share.host:``: a plan that gives the host pool chunks
    leases their decoded size and leaves nvCOMP the others; one that gives it none
    leases nothing and gives nvCOMP every present chunk."""
    from tests.test_host_logic import _Staging

    chain, keys, fetched = _zstd(store_factory)
    want = decode.decode_fetched(chain, fetched, keys, False)
    n = len(want[0])
    calls = _gpu(monkeypatch)
    split = route.Split(host, n - host, min(host, 1), 0.0, 0.0)
    monkeypatch.setattr(route, "plan", lambda *args: split)
    staging = _Staging()
    got = decode.decode_routed(
        chain, device_batch(fetched), keys, staging, host=False, on_device=True
    )
    _same(got, want)
    assert staging.leased == ([host * chain.nbytes] if host else [])
    assert calls == [want[0][: n - host]]


# -- key names --------------------------------------------------------------------------------
class _Positions(Sequence[str]):
    """Keys that answer only what ``collections.abc.Sequence`` asks of a sequence: an
    ``int`` position from 0 to ``len - 1`` (a key sequence formatted on demand)."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, j: Any) -> Any:
        if type(j) is not int:
            raise TypeError(f"a position is an int, not {type(j).__name__}")
        if not 0 <= j < len(self._items):
            raise IndexError(j)
        return self._items[j]


def test_joined_asks_each_part_for_its_own_position() -> None:
    """``int(np.searchsorted(...))`` -> ``np.searchsorted(...)``, ``int(self._ends[k - 1])``
    -> ``self._ends[k - 1]``, and ``k - 1`` -> ``k // 1``, ``k * 1``, ``k ** 1`` or ``k - 0``
    (Joined's lookup): key ``j`` is key ``j - (keys before its part)`` of its part, asked
    as an ``int`` position, never a numpy integer or a position counted from the end."""
    parts = _Positions([_Positions(["a", "b"]), _Positions([]), _Positions(["c"])])
    joined = decode.Joined(_Positions([*parts, _Positions(["d", "e", "f"])]))
    assert len(joined) == 6
    assert [joined[j] for j in range(6)] == ["a", "b", "c", "d", "e", "f"]
    assert joined[-2] == "e" and joined[2:5] == ["c", "d", "e"] and list(joined)[5] == "f"


def test_decoders_get_the_callers_keys_when_every_chunk_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``len(present) == len(keys)`` -> ``>``, ``is``, ``present == len(keys)`` or
    ``len(present) == keys``: with every chunk of a read there (300 of them), the decoder
    names them by the caller's own key sequence, not a lookup through it; with one
    missing, by the keys of the present ones."""
    from tests.test_host_logic import _chain

    chain = _chain(None, chunk=16)
    keys = [f"v/c/{i}" for i in range(300)]
    fetched: list[Any] = [np.full(16, i % 251, dtype=np.uint8) for i in range(300)]
    named: list[Sequence[str]] = []
    real = decode.decode_host

    def decode_host(chain: Any, chunks: list[Any], names: Sequence[str], *args: Any) -> Any:
        named.append(names)
        return real(chain, chunks, names, *args)

    monkeypatch.setattr(decode, "decode_host", decode_host)
    present, values = decode.decode_fetched(chain, fetched, keys, False)
    assert present == list(range(300)) and named[-1] is keys
    np.testing.assert_array_equal(values.view(np.uint8), np.stack(fetched))
    fetched[7] = None
    present, values = decode.decode_fetched(chain, fetched, keys, False)
    assert present == [i for i in range(300) if i != 7]
    assert named[-1] is not keys and list(named[-1]) == [k for k in keys if k != "v/c/7"]


# -- the copy stream --------------------------------------------------------------------------
def test_copy_streams_are_non_blocking_and_one_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_streams = threading.local()`` -> ``threading`` and ``Stream(non_blocking=True)`` ->
    ``Stream()`` or ``non_blocking=False``: each thread copies on a stream of its own,
    made once and non-blocking (it never waits on the legacy default stream), after
    what the thread's current stream has queued."""
    from tests.test_host_logic import _fake_cupy, _FakeStream

    made: list[Any] = []

    class Stream(_FakeStream):
        def __init__(self, non_blocking: bool = False, current: bool = False) -> None:
            super().__init__(non_blocking, current)
            self.non_blocking = non_blocking
            made.append(self)

    fake = _fake_cupy()
    fake.cuda.Stream = Stream
    monkeypatch.setattr(_device, "cupy", lambda: fake)
    got: list[Any] = []

    def twice() -> None:  # a new thread each time: this thread's cache stays as it was
        got.append((decode._copy_stream(), decode._copy_stream()))

    for _ in range(2):
        thread = threading.Thread(target=twice)
        thread.start()
        thread.join()
    (a, again_a), (b, again_b) = got
    assert a is again_a and b is again_b and a is not b
    assert made == [a, b] and [s.non_blocking for s in made] == [True, True]
    current = fake.cuda.get_current_stream()
    assert [e.source for e in a.waited] == [current, current]


# -- decode_split and decode_fetched on the device --------------------------------------------
def test_an_empty_chunk_file_on_the_device_is_named_as_on_the_host(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any
) -> None:
    """``sizes >= 0`` -> ``sizes > 0`` or ``>= 1`` (decode_split's and decode_fetched's
    present chunks): a stored empty chunk file is a chunk that does not decode, named,
    as the host decode names it (zarr-python fails on it too), never a missing chunk
    read as the fill value."""
    from tests.test_host_logic import _Staging

    chain, keys, fetched = _zstd(store_factory)
    some = [*fetched[:4], b"", fetched[5]]
    key = re.escape(repr(keys[4]))
    with pytest.raises(ChunkDecodeError, match=key):
        decode.decode_fetched(chain, some, keys[:6], False)
    _gpu(monkeypatch)
    with pytest.raises(ChunkDecodeError, match=key):
        decode.decode_fetched(chain, device_batch(some), keys[:6], True)
    for host in (1, 2, 4):  # the empty file in the host's share, then in nvCOMP's
        with pytest.raises(ChunkDecodeError, match=key):
            decode.decode_split(chain, device_batch(some), keys[:6], _Staging(), host, 2)


def test_a_host_share_chunk_that_fails_is_named_by_its_own_key(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any
) -> None:
    """``Picked(names, [m + i])`` -> ``[m | i]`` or ``[m ^ i]`` (decode_split): a chunk of the
    host pool's share that does not decode is named by its own key, not another's."""
    from tests.test_host_logic import _Staging

    chain, keys, fetched = _zstd(store_factory)
    some = [None, fetched[1], fetched[2], b"not a zstd frame at all"]
    _gpu(monkeypatch)
    # three present: nvCOMP decodes the first (m = 1), the host the second (i = 0) and
    # the third (i = 1), which fails
    with pytest.raises(ChunkDecodeError, match=re.escape(repr(keys[3]))):
        decode.decode_split(chain, device_batch(some), keys[:4], _Staging(), 2, 2)


def test_a_negative_host_share_is_none(monkeypatch: pytest.MonkeyPatch, store_factory: Any) -> None:
    """``max(0, min(host, n))`` -> ``max(-1, ...)`` (decode_split): a host share below zero
    is no share: nvCOMP decodes every present chunk and nothing is leased."""
    from tests.test_host_logic import _Staging

    chain, keys, fetched = _zstd(store_factory)
    want = decode.decode_fetched(chain, fetched, keys, False)
    calls = _gpu(monkeypatch)
    staging = _Staging()
    got = decode.decode_split(chain, device_batch(fetched), keys, staging, -1, 2)
    _same(got, want)
    assert staging.leased == [] and calls == [want[0]]

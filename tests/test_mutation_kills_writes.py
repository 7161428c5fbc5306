"""Tests written for mutants of ``xarray_gds/writes.py`` (the batched writes) that
survived ``scripts/mutation-run.py``: each test names the mutation it stops, and
compares what the engine writes with what zarr-python writes (values read back, chunk
keys, chunk bytes) wherever the engine's output is at stake.

The batched writes take host values with ``XARRAY_GDS_BATCHED_HOST_WRITES=1`` (the
logic device values take), into a MemoryStore (its writes run on the event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.storage import MemoryStore

from tests.test_encode_route import _entries, _plan, _values
from xarray_gds import writes
from xarray_gds.codecs import nvcomp
from xarray_gds.codecs.encode import encode_host
from xarray_gds.pipeline import GdsCodecPipeline, writing_to
from xarray_gds.testing import device_standins

Stored = tuple[np.ndarray, dict[str, bytes]]


def _create(store: Any, **kwargs: Any) -> Any:
    """Array ``a`` of ``store`` (zstd, empty chunks not written unless asked)."""
    kwargs.setdefault("compressors", zarr.codecs.ZstdCodec())
    kwargs.setdefault("config", {"write_empty_chunks": False})
    return zarr.create_array(store, name="a", **kwargs)


def _engine_and_zarr(
    monkeypatch: pytest.MonkeyPatch, write: Callable[[Any], None], **kwargs: Any
) -> tuple[Stored, Stored]:
    """``write(array)`` on array ``a`` (``kwargs`` of ``zarr.create_array``) of a
    MemoryStore through the engine's batched writes, then through zarr-python alone:
    each one's values read back by zarr-python and its chunk keys and bytes."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    out = []
    for engine in (True, False):  # the engine first: nothing before it held fill values
        store = MemoryStore()
        with writing_to(store) if engine else contextlib.nullcontext():
            array = _create(store, **kwargs)
            assert isinstance(array._async_array.codec_pipeline, GdsCodecPipeline) == engine
            write(array)
        chunks = {k: v.to_bytes() for k, v in store._store_dict.items() if "/c/" in k}
        out.append((zarr.open_array(store, path="a")[:], chunks))
    return out[0], out[1]


def _counted_encodes(monkeypatch: pytest.MonkeyPatch, wait: threading.Event | None = None) -> list:
    """The number of chunks of each call of the batched host encoder; with ``wait``,
    every call after the first one records whether ``wait`` was set within 10 s."""
    calls: list = []

    def encode(plan: Any, chunks: Any) -> Any:
        if wait is not None and calls:
            calls.append(wait.wait(10))
        calls.append(len(chunks))
        return encode_host(plan, chunks)

    monkeypatch.setattr(writes, "encode_host", encode)
    return calls


VALUES = np.arange(1, 81, dtype="f4")  # 10 chunks of 8 float32 (32 bytes)


@pytest.mark.parametrize(
    ("budget", "parts"),
    [
        (640, [4, 4, 2]),  # 640 // (5 * 32) = 4 chunks a part
        (100, [1] * 10),  # less than 5 chunks' bytes: still one chunk a part
    ],
)
def test_a_batched_write_is_encoded_in_parts_of_the_batch_budget(
    monkeypatch: pytest.MonkeyPatch, budget: int, parts: list[int]
) -> None:
    """writes ``per_part = max(1, budget // max(1, 5 * nbytes))`` with ``max(0, ...)``,
    ``max(2, ...)``, ``//`` -> ``+ | ^ << % * ** -``, ``5 *`` -> ``4 *``/``6 *`` and
    ``5 * nbytes`` -> ``5 + - & | ^ / // % >> nbytes``: a write of 10 chunks is encoded
    in parts of the chunks whose staged, stored and encoded bytes (5 times a chunk's)
    fit the batch budget, at least one chunk a part, and reads back as written."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    calls = _counted_encodes(monkeypatch)
    store = MemoryStore()
    with writing_to(store), zarr.config.set({"xarray_gds.batch_bytes": budget}):
        array = _create(store, shape=(80,), chunks=(8,), dtype="f4", fill_value=0)
        array[:] = VALUES
    assert calls == parts
    np.testing.assert_array_equal(zarr.open_array(store, path="a")[:], VALUES, strict=True)
    assert sorted(k for k in store._store_dict if "/c/" in k) == [f"a/c/{i}" for i in range(10)]


class _SignallingStore(MemoryStore):
    """A MemoryStore that sets ``stored`` once a chunk is written."""

    def __init__(self) -> None:
        super().__init__()
        self.stored = threading.Event()

    async def set(self, key: str, value: Any, byte_range: Any = None) -> None:
        await super().set(key, value, byte_range)
        if "/c/" in key:
            self.stored.set()


def test_a_parts_chunks_are_stored_while_the_next_part_encodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes ``asyncio.ensure_future(_store_jobs(jobs))`` -> ``_store_jobs(jobs)`` (a
    coroutine, first run when awaited after the next part's encode): the chunks of a
    part are being stored while the next part is encoded, not after it."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    store = _SignallingStore()
    calls = _counted_encodes(monkeypatch, wait=store.stored)
    with writing_to(store), zarr.config.set({"xarray_gds.batch_bytes": 640}):
        array = _create(store, shape=(80,), chunks=(8,), dtype="f4", fill_value=0)
        array[:] = VALUES
    # the second part's encode saw the first part's chunks being stored, and so did
    # the third's (the second part's)
    assert calls == [4, True, 4, True, 2]
    np.testing.assert_array_equal(zarr.open_array(store, path="a")[:], VALUES, strict=True)


def test_a_failed_part_raises_only_once_the_parts_before_it_are_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes ``if writing is not None:`` -> ``if writing is None:`` / ``if not writing is
    not None:`` (in ``finally``): when the read of a later part's stored chunk fails, the
    write raises that error only after the chunks of the part before it are stored;
    they are not dropped with the failed write."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    store = MemoryStore()
    with writing_to(store), zarr.config.set({"xarray_gds.batch_bytes": 100}):  # 1 chunk a part
        array = _create(store, shape=(16,), chunks=(8,), dtype="f4", fill_value=0)

    async def unreachable(self: Any, batch: Any, out: Any, drop_axes: Any = ()) -> Any:
        raise OSError("store unreachable (injected)")

    async def write() -> list[str]:
        try:  # chunk 0 whole (part 1), chunk 1 in part (part 2: its stored chunk is read)
            await array._async_array.setitem(slice(0, 13), np.arange(1, 14, dtype="f4"))
        except OSError as err:
            assert str(err) == "store unreachable (injected)"
            return sorted(k for k in store._store_dict if "/c/" in k)  # when the error came
        raise AssertionError("the write did not fail")

    with monkeypatch.context() as patch, zarr.config.set({"xarray_gds.batch_bytes": 100}):
        patch.setattr(GdsCodecPipeline, "read", unreachable)
        assert asyncio.run(write()) == ["a/c/0"]
    got = zarr.open_array(store, path="a")[:]
    np.testing.assert_array_equal(got, np.r_[1:9, [0] * 8].astype("f4"), strict=True)


def test_a_failed_host_encode_names_the_host_and_the_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes ``on_gpu = on_device`` -> ``pass`` (a NameError in the error handler): a
    failed batched encode of host values raises the RuntimeError that names the chunks,
    the codecs and the host."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")

    def fails(plan: Any, chunks: Any) -> Any:
        raise ValueError("boom")

    monkeypatch.setattr(writes, "encode_host", fails)
    store = MemoryStore()
    with writing_to(store):
        array = _create(store, shape=(24,), chunks=(8,), dtype="f4", fill_value=0)
        with pytest.raises(RuntimeError) as err:
            array[:] = np.arange(24, dtype="f4")
    assert str(err.value) == (
        "xarray-gds: encoding 3 chunks (a/c/0 .. a/c/2) with [bytes, zstd] on the host failed: boom"
    )
    assert isinstance(err.value.__cause__, ValueError)
    assert not [k for k in store._store_dict if "/c/" in k]


def test_a_forced_gpu_route_encodes_a_small_device_write_with_nvcomp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes ``choose_encode(...) == "gpu"`` -> ``is "gpu"`` (the forced route is a new
    string, equal to "gpu" but not the same object): with ``xarray_gds.route`` set to
    "gpu", the few chunks of a small device write go to nvCOMP, not the host threads."""
    plan = _plan(zarr.codecs.ZstdCodec(), 3)
    values = _values(3, (8, 16)).reshape(24, 16)
    calls: list[str] = []

    def on_gpu(chain: Any, chunks: Any) -> Any:  # nvCOMP's stand-in: the host encoder
        calls.append("gpu")
        return encode_host(chain, np.asarray(chunks))

    def on_host(chain: Any, chunks: Any) -> Any:
        calls.append("host")
        return encode_host(chain, chunks)

    monkeypatch.setattr(nvcomp, "encode", on_gpu)
    monkeypatch.setattr(writes, "encode_host_threads", on_host)
    with zarr.config.set({"xarray_gds.route": "gpu"}), device_standins(monkeypatch):
        from xarray_gds import device as _device

        stage = _device.cupy().empty((3, *plan.chunk_shape), dtype=plan.dtype)
        pieces = writes._encode_part(plan, _entries(3, (8, 16)), stage, values, (), True)
    assert calls == ["gpu"]
    for j, piece in enumerate(pieces):
        want = encode_host(plan, values[None, j * 8 : (j + 1) * 8]).chunk(0)
        assert bytes(piece) == bytes(want)


def test_an_integer_index_into_chunks_one_row_high(monkeypatch: pytest.MonkeyPatch) -> None:
    """writes ``if not isinstance(sel, slice) or ...`` -> ``if isinstance(sel, slice) or
    ...`` / ``if not not isinstance(...)`` (``.indices`` of an integer): a write of one
    row of an array of chunks one row high (zarr counts such a chunk complete, its
    selection an integer) stores what zarr-python stores."""

    def write(array: Any) -> None:
        array[:] = np.arange(20, dtype="f4").reshape(4, 5)
        array[2] = np.array([-1, -2, -3, -4, -5], dtype="f4")

    (ours, our_chunks), (theirs, their_chunks) = _engine_and_zarr(
        monkeypatch, write, shape=(4, 5), chunks=(1, 5), dtype="f4", fill_value=0
    )
    np.testing.assert_array_equal(ours, theirs, strict=True)
    assert ours[2].tolist() == [-1, -2, -3, -4, -5]
    assert our_chunks == their_chunks


FILL = 12345.5  # a fill value nothing else in these tests holds


def test_an_edge_chunk_is_stored_with_the_fill_value_beyond_the_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes ``len(range(*sel.indices(size))) != size`` -> ``== size``, ``>= size`` and
    ``is size`` (an edge chunk then counts as covered, and its part beyond the array is
    left unset): the edge chunk's bytes are zarr-python's, the fill value beyond the
    array, and an edge chunk written with the fill value only is left out, as zarr
    leaves it out."""

    def write(array: Any) -> None:
        array[:] = np.arange(1, 8, dtype="f8")

    def write_fill(array: Any) -> None:
        array[:] = np.full(7, FILL)

    kwargs = {"shape": (7,), "chunks": (5,), "dtype": "f8", "fill_value": FILL}
    (ours, our_chunks), (theirs, their_chunks) = _engine_and_zarr(monkeypatch, write, **kwargs)
    np.testing.assert_array_equal(ours, theirs, strict=True)
    assert sorted(our_chunks) == ["a/c/0", "a/c/1"]
    assert our_chunks == their_chunks
    (ours, our_chunks), (theirs, their_chunks) = _engine_and_zarr(monkeypatch, write_fill, **kwargs)
    np.testing.assert_array_equal(ours, np.full(7, FILL), strict=True)
    assert our_chunks == their_chunks == {}


def test_an_orthogonal_selection_with_an_integer_of_a_3d_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes ``ndim = stage.ndim - 1`` -> ``stage.ndim ^ 1`` (two axes too many where
    an array has 3): a write of an orthogonal selection of a 3-d array that mixes an
    index array with an integer (zarr drops that axis) stores what zarr-python stores."""

    def write(array: Any) -> None:
        array[:] = np.arange(60, dtype="f4").reshape(4, 3, 5)
        array.set_orthogonal_selection(([0, 1, 3], 2), -np.arange(1, 16, dtype="f4").reshape(3, 5))

    (ours, our_chunks), (theirs, their_chunks) = _engine_and_zarr(
        monkeypatch, write, shape=(4, 3, 5), chunks=(2, 3, 5), dtype="f4", fill_value=0
    )
    np.testing.assert_array_equal(ours, theirs, strict=True)
    assert ours[[0, 1, 3], 2].tolist() == (-np.arange(1, 16).reshape(3, 5)).tolist()
    assert our_chunks == their_chunks


def test_a_stepped_write_reads_the_chunks_zarr_counts_incomplete(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """writes ``if not complete: return False`` -> ``if complete: ...`` / ``if not not
    complete: ...`` / ``pass`` (in ``_covers``): a write of every other row of an array
    of chunks one row high, whose selections (step 2) span those chunks but which zarr
    counts incomplete, reads the stored chunks first, as zarr-python does: a damaged
    one fails the write, naming its key, and nothing of the write is stored."""
    from zarr.core.buffer import cpu

    from xarray_gds import ChunkDecodeError

    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    damaged = cpu.Buffer.from_bytes(b"not a zstd frame at all")
    for engine in (True, False):
        store = MemoryStore()
        with writing_to(store) if engine else contextlib.nullcontext():
            array = _create(store, shape=(4, 5), chunks=(1, 5), dtype="f4", fill_value=0)
            array[:] = np.arange(1, 21, dtype="f4").reshape(4, 5)
            before = dict(store._store_dict)
            store._store_dict["a/c/2/0"] = damaged
            with pytest.raises(ChunkDecodeError if engine else RuntimeError) as err:
                array[::2] = -np.ones((2, 5), dtype="f4")
        if engine:
            assert "'a/c/2/0'" in str(err.value)
        else:
            assert "Zstd decompression error" in str(err.value)
        # the other chunk of the write (a/c/0/0) may be stored before a/c/2/0's read
        # fails (zarr-python and the engine write chunks concurrently): whole, if so;
        # every other chunk is as it was
        want = {**before, "a/c/2/0": damaged}
        assert set(store._store_dict) == set(want)
        assert {k: v for k, v in store._store_dict.items() if k != "a/c/0/0"} == {
            k: v for k, v in want.items() if k != "a/c/0/0"
        }
        row = zarr.open_array(store, path="a", mode="r")[0]
        assert row.tolist() in ([1.0, 2.0, 3.0, 4.0, 5.0], [-1.0] * 5)

"""Box reads from several threads joined into one read and decode (xarray_gds.coalesce)."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from xarray_gds import GdsStore, coalesce, decode, stores
from xarray_gds import device as _device
from xarray_gds.errors import ChunkDecodeError
from xarray_gds.pipeline import attach
from xarray_gds.region import read_box
from xarray_gds.request import ReadRequest

ALL = (slice(None), slice(None), slice(None))


def _open(path: Path) -> Any:
    return attach(zarr.open_group(GdsStore(path, read_only=True), mode="r")["t2m"])


def _asked(chain: Any, on_device: bool = False, gpu: int = -1) -> Any:
    """A waiting request of one chunk, as the engine holds it."""
    request = ReadRequest(None, chain, ["k"], on_device)
    return coalesce._Asked(request, stores.LocalSource(None), ["p"], gpu)


def _reference(path: Path) -> np.ndarray:
    return np.asarray(zarr.open_group(path, mode="r")["t2m"][ALL])


def _hold_first_read(monkeypatch: pytest.MonkeyPatch, others: int) -> list[int]:
    """Make the first joined read wait until ``others`` requests queue behind it, so
    that they are served together; returns the number of files of every read."""
    calls: list[int] = []
    real = coalesce._read

    def read(group: list[Any]) -> Any:
        calls.append(sum(len(r.paths) for r in group))
        if len(calls) == 1:
            deadline = time.monotonic() + 20
            while len(coalesce.engine().waiting) < others and time.monotonic() < deadline:
                time.sleep(0.001)
        return real(group)

    monkeypatch.setattr(coalesce, "_read", read)
    return calls


def _decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = decode.decode_fetched

    def spy(chain: Any, fetched: Any, keys: Any, on_device: bool) -> Any:
        calls.append(len(keys))
        return real(chain, fetched, keys, on_device)

    monkeypatch.setattr(decode, "decode_fetched", spy)
    return calls


def _read_all(paths: list[Path], device: str) -> list[Any]:
    """``read_box`` of every store's whole t2m, each from its own thread at once."""
    return _read_all_base(paths, device, Exception)


def _read_all_base(
    paths: list[Path], device: str, catch: type[BaseException] = BaseException
) -> list[Any]:
    arrays = [_open(p) for p in paths]

    def one(array: Any) -> Any:
        try:
            return _device.to_host(read_box(array, ALL, device))
        except catch as err:  # compared by the test
            return err

    with ThreadPoolExecutor(len(arrays)) as pool:
        return list(pool.map(one, arrays))


def _copies(tmp_path: Path, source: Path, n: int) -> list[Path]:
    out = []
    for i in range(n):
        shutil.copytree(source, tmp_path / f"s{i}.zarr")
        out.append(tmp_path / f"s{i}.zarr")
    return out


def test_concurrent_reads_are_joined(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    store_factory: Callable[[int, str], Path],
    device: str,
) -> None:
    """Requests queued behind a read are read in one batch and decoded with one call
    per decode chain; every thread gets its own store's values (missing chunks filled)."""
    zstd = _copies(tmp_path, store_factory(3, "zstd"), 3)
    paths = [*zstd, store_factory(3, "gzip"), store_factory(2, "zstd")]
    reads = _hold_first_read(monkeypatch, len(paths) - 1)
    decodes = _decode_calls(monkeypatch)
    got = _read_all(paths, device)
    for path, values in zip(paths, got, strict=True):
        assert isinstance(values, np.ndarray), values
        np.testing.assert_array_equal(values, _reference(path))
    chunks = 27  # 3 x 3 x 3 chunk keys a store
    assert reads == [chunks, chunks * (len(paths) - 1)]
    # the first request alone, then the other four: the v3 zstd stores share a chain
    # (two of them, or all three, in one call), gzip and v2 zstd have their own
    assert sorted(decodes) in ([chunks] * 3 + [2 * chunks], [chunks] * 3 + [3 * chunks])
    assert len(decodes) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [64, 320])
def test_chunks_larger_than_their_slot_are_read_whole(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    store_factory: Callable[[int, str], Path],
    bound: int,
) -> None:
    """Joined device reads size each file's slot from the chain's stored_bound; chunk
    files that do not fit it (some or all of them: the chunks decode to 320 bytes, the
    zstd files take 41 to 330) or fill it exactly are still read whole."""
    from xarray_gds.codecs import DecodeChain

    monkeypatch.setattr(DecodeChain, "stored_bound", property(lambda self: bound))
    paths = [*_copies(tmp_path, store_factory(3, "zstd"), 2), store_factory(2, "none")]
    reads = _hold_first_read(monkeypatch, len(paths) - 1)
    got = _read_all(paths, "cuda")
    for path, values in zip(paths, got, strict=True):
        assert isinstance(values, np.ndarray), values
        np.testing.assert_array_equal(values, _reference(path))
    assert len(reads) == 2


def test_a_damaged_chunk_fails_only_its_own_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v3_store: Path, device: str
) -> None:
    paths = _copies(tmp_path, v3_store, 4)
    (paths[2] / "t2m" / "c" / "1" / "1" / "1").write_bytes(b"\x28\xb5\x2f\xfd garbage")
    reads = _hold_first_read(monkeypatch, len(paths) - 1)
    got = _read_all(paths, device)
    assert len(reads) == 2  # joined, then each decoded again on its own
    assert isinstance(got[2], ChunkDecodeError)
    assert (got[2].key, got[2].codec) == ("t2m/c/1/1/1", "zstd")
    assert re.match(
        r"cannot decode chunk 't2m/c/1/1/1' with codec 'zstd': .+\. .+ either the stored "
        r"chunk or the array metadata .+; only once the metadata is confirmed right, "
        r"rewrite the chunk, or delete it to read the fill value\.$",
        str(got[2]),
    ), got[2]
    want = _reference(v3_store)
    for i in (0, 1, 3):
        assert isinstance(got[i], np.ndarray), got[i]
        np.testing.assert_array_equal(got[i], want)
    # the next reads in the same process work
    again = _read_all(paths[:2], device)
    for values in again:
        np.testing.assert_array_equal(values, want)


def test_a_failed_joined_read_is_retried_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v3_store: Path, device: str
) -> None:
    """An error of the joined read (an unreadable file, say) does not fail the others:
    each request reads again on its own and raises only its own error."""
    paths = _copies(tmp_path, v3_store, 3)
    held = _hold_first_read(monkeypatch, len(paths) - 1)
    held_read = coalesce._read
    bad = str(paths[1])

    def read(group: list[Any]) -> Any:
        files = [f for r in group for f in r.paths]
        if any(f.startswith(bad + "/") for f in files):
            raise OSError(f"short read from {files[0]}")
        return held_read(group)

    monkeypatch.setattr(coalesce, "_read", read)
    got = _read_all(paths, device)
    assert isinstance(got[1], OSError)
    assert str(got[1]) == f"short read from {paths[1]}/t2m/c/0/0/0", got[1]  # its own
    want = _reference(v3_store)
    for i in (0, 2):
        np.testing.assert_array_equal(got[i], want)
    assert len(held) >= 2


def test_groups_fit_the_batch_budget(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v3_store: Path, device: str
) -> None:
    paths = _copies(tmp_path, v3_store, 5)
    array = _open(paths[0])
    per_request = 27 * array.async_array.codec_pipeline.chain.nbytes
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", str(2 * per_request))
    reads = _hold_first_read(monkeypatch, len(paths) - 1)
    got = _read_all(paths, device)
    want = _reference(v3_store)
    for values in got:
        np.testing.assert_array_equal(values, want)
    assert reads[0] == 27
    assert sorted(reads[1:]) == [54, 54]  # four queued requests, two a batch


def test_requests_of_one_side_are_served_together(store_factory: Callable) -> None:
    """A group holds requests of the first one's side (the host, or one GPU) only, in
    order."""
    array = _open(store_factory(3, "zstd"))
    chain = array.async_array.codec_pipeline.chain
    sides = [(False, -1), (True, 0), (False, -1), (True, 1)]
    reqs = [_asked(chain, *side) for side in sides]
    with coalesce.engine().cond:
        coalesce.engine().waiting[:] = reqs
        try:
            group = coalesce.engine()._take(reqs[2])  # the oldest first, whoever leads
            assert group == [reqs[0], reqs[2]]
            assert coalesce.engine().waiting == [reqs[1], reqs[3]]
        finally:
            coalesce.engine().waiting.clear()


def test_a_part_server_reads_its_own_part_first(store_factory: Callable) -> None:
    """The leader serving a part of a read in parts takes its own part first (with the
    others that join it, one part of a series a group), not the oldest request."""
    array = _open(store_factory(3, "zstd"))
    chain = array.async_array.codec_pipeline.chain
    other, *parts = [_asked(chain) for _ in range(3)]
    series = object()
    for part in parts:
        part.series = series
    engine = coalesce.engine()
    with engine.cond:
        engine.waiting[:] = [other, *parts]
        try:
            assert engine._take(parts[1]) == [parts[1], other]
            assert engine.waiting == [parts[0]]
        finally:
            engine.waiting.clear()


def test_many_threads_agree_with_zarr(
    tmp_path: Path, store_factory: Callable[[int, str], Path], device: str
) -> None:
    """Sixteen threads reading boxes of three stores, over and over: every read gets
    its own values (no request lost, served twice or handed another's chunks)."""
    paths = [*_copies(tmp_path, store_factory(3, "zstd"), 2), store_factory(2, "lz4")]
    arrays = [_open(p) for p in paths]
    wants = [_reference(p) for p in paths]
    rng = np.random.default_rng(7)
    jobs = []
    for _ in range(160):
        which = int(rng.integers(len(paths)))
        lo = rng.integers(0, [10, 9, 12])
        hi = lo + 1 + rng.integers(0, [10, 9, 12] - lo)
        jobs.append((which, tuple(slice(int(a), int(b)) for a, b in zip(lo, hi, strict=True))))

    def one(job: tuple[int, tuple[slice, ...]]) -> bool:
        which, key = job
        got = _device.to_host(read_box(arrays[which], key, device))
        return bool(np.array_equal(got, wants[which][key], equal_nan=True))

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(one, jobs))
    assert coalesce.engine().waiting == []
    assert coalesce.engine().reader is None
    assert coalesce.engine().decoders == set()


def test_at_most_two_groups_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v3_store: Path, device: str
) -> None:
    """A group's read starts while the previous group decodes, but not while two do."""
    import threading

    paths = _copies(tmp_path, v3_store, 3)
    arrays = [_open(p) for p in paths]
    reads: list[int] = []
    decoding = threading.Semaphore(0)
    release = threading.Event()
    # set when the third request either starts its read or waits while two groups
    # decode: whichever comes first, the test then looks at which it was
    third = threading.Event()
    real_read, real_decode = coalesce._read, coalesce._decode_group

    class Condition(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            if len(coalesce.engine().decoders) >= 2:
                third.set()
            return super().wait(timeout)

    def read(group: list[Any]) -> Any:
        reads.append(sum(len(r.paths) for r in group))
        if len(reads) == 3:
            third.set()
        return real_read(group)

    def decode(group: list[Any], fetched: Any, staging: Any) -> None:
        decoding.release()
        assert release.wait(20)
        real_decode(group, fetched, staging)

    monkeypatch.setattr(coalesce, "_read", read)
    monkeypatch.setattr(coalesce, "_decode_group", decode)
    monkeypatch.setattr(coalesce.engine(), "cond", Condition())
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(read_box, arrays[0], ALL, device)]
        assert decoding.acquire(timeout=20)  # the first group decodes...
        futures.append(pool.submit(read_box, arrays[1], ALL, device))
        assert decoding.acquire(timeout=20)  # ...and the second one, read meanwhile
        futures.append(pool.submit(read_box, arrays[2], ALL, device))
        assert third.wait(20)
        assert len(reads) == 2  # the third waits for one of them
        release.set()
        got = [_device.to_host(f.result(timeout=20)) for f in futures]
    assert len(reads) == 3
    want = _reference(v3_store)
    for values in got:
        np.testing.assert_array_equal(values, want)


def test_an_interrupted_leader_leaves_the_others_to_be_served(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v3_store: Path, device: str
) -> None:
    """A KeyboardInterrupt in the thread reading a group ends that thread's read only:
    the other requests of the group go back to the queue and are served."""
    paths = _copies(tmp_path, v3_store, 3)
    reads = _hold_first_read(monkeypatch, len(paths) - 1)
    held = coalesce._read

    def read(group: list[Any]) -> Any:
        out = held(group)
        if len(reads) == 2:  # the joined read of the two queued requests
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(coalesce, "_read", read)
    got = _read_all_base(paths, device)
    assert sum(isinstance(g, KeyboardInterrupt) for g in got) == 1
    want = _reference(v3_store)
    for values in got:
        if not isinstance(values, KeyboardInterrupt):
            np.testing.assert_array_equal(values, want)
    assert coalesce.engine().waiting == []
    assert coalesce.engine().reader is None


def test_a_failure_before_reading_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch, v3_store: Path
) -> None:
    """An error while a group is formed (the memory query, say) raises in that read,
    and the next read works."""
    array = _open(v3_store)
    real = decode.budget
    calls: list[bool] = []

    def flaky(on_device: bool) -> int:
        calls.append(on_device)
        if len(calls) == 1:
            raise RuntimeError("simulated CUDA error")
        return real(on_device)

    monkeypatch.setattr(decode, "budget", flaky)
    with pytest.raises(RuntimeError, match=r"^simulated CUDA error$"):
        read_box(array, ALL, "cpu")
    assert coalesce.engine().waiting == []
    assert coalesce.engine().reader is None
    np.testing.assert_array_equal(read_box(array, ALL, "cpu"), _reference(v3_store))

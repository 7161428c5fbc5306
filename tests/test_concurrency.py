"""Readers on many threads at once, mixing engines, and what the engine leaves to others.

The engine's reads block the thread they run in (waiting for the group they joined, or
for the store reads they lead); run in zarr's event loop's default executor, a burst of
them took every worker while the leader waited for a store read that needed one (a
deadlock, 3 runs in 8 with eight threads on two cores). And opening a dataset set zarr's
process-wide ``codec_pipeline.path`` for an instant, so arrays other threads opened with
plain zarr read through the engine's pipeline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
from zarr.core.codec_pipeline import BatchedCodecPipeline

from xarray_gds import GdsStore
from xarray_gds.pipeline import GdsCodecPipeline, attach, writing_to

#: more reader threads than zarr's default executor has workers (min(32, CPUs + 4))
READERS = 24
RUNS = 6
#: seconds a run may take before the test calls it a hang (a run takes well under 1 s)
HANG = 120.0


def _default_workers() -> int:
    import os

    return min(32, (os.cpu_count() or 1) + 4)


def _readers(path: Path, reference: np.ndarray) -> list[Callable[[], Any]]:
    """Threads' jobs: the engine on a path (GdsStore), the engine on a zarr Store (the
    store read through zarr's event loop), and engine="zarr"."""

    def gds_path() -> None:
        got = xr.open_dataset(path, engine="gds-zarr", device="cpu").t2m.values
        np.testing.assert_array_equal(got, reference)

    def gds_store() -> None:
        store = zarr.storage.LocalStore(path, read_only=True)
        got = xr.open_dataset(store, engine="gds-zarr", device="cpu").t2m.values
        np.testing.assert_array_equal(got, reference)

    def plain() -> None:
        ds = xr.open_dataset(path, engine="zarr")
        got = ds.t2m.values
        np.testing.assert_array_equal(got, reference)

    def pipeline_on_store() -> None:  # zarr's own indexing, then the engine's read
        store = zarr.storage.LocalStore(path, read_only=True)
        array = attach(zarr.open_group(store, mode="r")["t2m"])
        np.testing.assert_array_equal(array[...], reference)

    def dask_threads() -> None:
        ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", chunks={})
        got = ds.t2m.compute(scheduler="threads").values
        np.testing.assert_array_equal(got, reference)

    return [pipeline_on_store, gds_store, pipeline_on_store, plain, gds_path, dask_threads]


def _run_all(jobs: list[Callable[[], Any]]) -> None:
    """Start every job at once (a barrier), fail if they do not all end within HANG."""
    start = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def run(job: Callable[[], Any]) -> None:
        try:
            start.wait()
            job()
        except BaseException as err:  # reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"{len(hung)} of {len(jobs)} reader threads still running after {HANG} s"
    if errors:
        raise errors[0]


@pytest.mark.needs("dask")
def test_mixed_engine_readers_never_hang(v3_store: Path) -> None:
    assert _default_workers() < READERS
    reference = zarr.open_group(v3_store, mode="r")["t2m"][...]
    kinds = _readers(v3_store, reference)
    jobs = [kinds[i % len(kinds)] for i in range(READERS)]
    for _ in range(RUNS):
        _run_all(jobs)


def test_opening_leaves_zarrs_pipeline_setting_alone(
    v3_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open and a read with the engine never set ``codec_pipeline.path``."""
    real_set = zarr.config.set
    seen: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return real_set(*args, **kwargs)

    monkeypatch.setattr(zarr.config, "set", spy)
    ds = xr.open_dataset(v3_store, engine="gds-zarr", device="cpu")
    ds.t2m.values  # noqa: B018
    ds.close()
    assert not [s for s in seen if "codec_pipeline" in repr(s)]


def test_arrays_others_open_meanwhile_keep_zarrs_pipeline(v3_store: Path) -> None:
    """Arrays that plain zarr opens on other threads while the engine opens and reads
    are built with zarr's own pipeline; the engine's arrays read through its own."""
    stop = threading.Event()
    kinds: set[type] = set()

    def open_plain() -> None:
        while True:  # at least once, however late the thread starts
            array = zarr.open_group(v3_store, mode="r")["t2m"]
            kinds.add(type(array.async_array.codec_pipeline))
            if stop.is_set():
                return

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(open_plain) for _ in range(2)]
        try:
            for _ in range(10):
                ds = xr.open_dataset(v3_store, engine="gds-zarr", device="cpu")
                lazy = ds.t2m.variable._data
                while not hasattr(lazy, "get_array"):
                    lazy = lazy.array
                assert isinstance(lazy.get_array().async_array.codec_pipeline, GdsCodecPipeline)
                ds.t2m.values  # noqa: B018
        finally:
            stop.set()
        for f in futures:
            f.result()
    assert kinds == {BatchedCodecPipeline}


def test_attach_keeps_the_arrays_own_pipeline_as_fallback(v3_store: Path) -> None:
    array = zarr.open_group(GdsStore(v3_store, read_only=True), mode="r")["t2m"]
    own = array.async_array.codec_pipeline
    assert attach(array) is array
    pipe = array.async_array.codec_pipeline
    assert isinstance(pipe, GdsCodecPipeline) and pipe._fallback is own
    attach(array)  # twice: nothing changes
    assert array.async_array.codec_pipeline is pipe
    np.testing.assert_array_equal(array[...], zarr.open_group(v3_store, mode="r")["t2m"][...])


def test_writing_to_gives_the_pipeline_to_that_store_only(tmp_path: Path, v3_store: Path) -> None:
    target = zarr.storage.MemoryStore()
    before = zarr.config.get("codec_pipeline.path")
    with writing_to(target, "gpu"):
        written = zarr.create_array(target, name="a", shape=(4,), dtype="f4")
        other = zarr.open_group(v3_store, mode="r")["t2m"]
        inner = zarr.create_array(zarr.storage.MemoryStore(), name="b", shape=(4,), dtype="f4")
    assert zarr.config.get("codec_pipeline.path") == before
    pipe = written.async_array.codec_pipeline
    assert isinstance(pipe, GdsCodecPipeline) and pipe._levels == "gpu"
    assert type(other.async_array.codec_pipeline) is BatchedCodecPipeline
    assert type(inner.async_array.codec_pipeline) is BatchedCodecPipeline


def test_writing_to_refuses_unknown_levels() -> None:
    refused = pytest.raises(
        ValueError, match=r"levels must be one of \('host', 'gpu'\), not 'best'"
    )
    with refused, writing_to(zarr.storage.MemoryStore(), "best"):
        pass

"""xarray_gds.BatchLoader: batches compared with what engine="zarr" reads for the same
samples; shuffling, sharding, resuming, prefetch bounds and errors."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from xarray_gds import BatchLoader
from xarray_gds.device import to_host

NT, NY, NX = 23, 6, 7


def _dataset() -> xr.Dataset:
    rng = np.random.default_rng(3)
    shape = (NT, NY, NX)
    t2m = (280 + 10 * rng.standard_normal(shape)).astype("f4")
    t2m[4, 1, 2] = np.nan
    u10 = (5 * rng.standard_normal(shape)).round(2)
    u10[7, 0, 0] = np.nan
    return xr.Dataset(
        {
            "t2m": (("time", "lat", "lon"), t2m, {"units": "K"}),
            "u10": (("time", "lat", "lon"), u10),  # int16 scaled: CF decoding
            "sp": (("time", "lat", "lon"), rng.random(shape) * 1e5),
            "member_t": (("time", "member", "lat", "lon"), rng.random((NT, 3, NY, NX), "f4")),
            "orog": (("lat", "lon"), rng.random((NY, NX))),
        },
        coords={
            "time": pd.date_range("2020-01-01", periods=NT, freq="6h"),
            "lat": np.linspace(-30, 30, NY),
            "lon": np.arange(NX) * 10.0,
        },
    )


ENCODING: dict[str, dict[str, Any]] = {
    "t2m": {"chunks": (1, NY, NX)},
    "u10": {
        "dtype": "i2",
        "scale_factor": 0.01,
        "_FillValue": -32768,
        "chunks": (3, 4, 4),  # several time steps a chunk, edge chunks
    },
    "sp": {"chunks": (2, NY, 4)},
    "member_t": {"chunks": (1, 2, NY, NX)},
}
THREE = ["t2m", "u10", "sp"]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loader") / "era.zarr"
    _dataset().to_zarr(path, encoding=ENCODING, consolidated=False, zarr_format=3)
    return path


def _gds(store: Path, device: str = "cpu", **kwargs: Any) -> xr.Dataset:
    return xr.open_dataset(store, engine="gds-zarr", device=device, consolidated=False, **kwargs)


@pytest.fixture(scope="module")
def ref(store: Path) -> xr.Dataset:
    return xr.open_dataset(store, engine="zarr", consolidated=False).load()


def _expected(ref: xr.Dataset, name: str, positions: np.ndarray) -> np.ndarray:
    return np.stack([ref[name].isel(time=int(t)).values for t in positions])


def _host(x: Any) -> np.ndarray:
    return to_host(x)


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("opened", ["lazy", "chunks", "zarr"])
def test_batches_are_the_samples_engine_zarr_reads(
    store: Path, ref: xr.Dataset, opened: str
) -> None:
    """Every batch of an epoch holds the values engine="zarr" reads for its samples:
    over a lazy gds-zarr dataset, a dask one, and (read by xarray) an engine="zarr" one."""
    if opened == "chunks":
        pytest.importorskip("dask")
    if opened == "zarr":
        ds = xr.open_dataset(store, engine="zarr", consolidated=False)
    else:
        ds = _gds(store, chunks={} if opened == "chunks" else None)
    loader = BatchLoader(ds, "time", variables=THREE, batch_size=5, seed=7, prefetch=2)
    plan = loader.batches()
    assert [len(b) for b in plan] == [5, 5, 5, 5, 3]
    got = list(loader)
    assert len(got) == len(plan) == len(loader)
    for samples, batch in zip(plan, got, strict=True):
        t = loader.positions(samples)["time"]
        assert list(batch) == THREE
        for name in THREE:
            assert isinstance(batch[name], np.ndarray)
            assert batch[name].dtype == ref[name].dtype
            np.testing.assert_array_equal(batch[name], _expected(ref, name, t))


def test_same_seed_same_batches_as_a_loader_over_engine_zarr(store: Path) -> None:
    ours = BatchLoader(_gds(store), batch_size=4, seed=11, windows={"x": 0, "y": 2})
    theirs = BatchLoader(
        xr.open_dataset(store, engine="zarr", consolidated=False),
        batch_size=4,
        seed=11,
        windows={"x": 0, "y": 2},
        prefetch=0,
    )
    assert sorted(ours.variables) == sorted(theirs.variables) == ["member_t", "sp", "t2m", "u10"]
    for _ in range(2):  # two epochs
        for a, b in zip(ours, theirs, strict=True):
            for w in ("x", "y"):
                for name in ours.variables:
                    np.testing.assert_array_equal(a[w][name], b[w][name])


def test_windows_and_stacked_channels(store: Path, ref: xr.Dataset) -> None:
    loader = BatchLoader(
        _gds(store),
        variables=["sp", "t2m", "u10"],
        batch_size=4,
        windows={"input": (-2, 0), "target": 3},
        stack="channel",
        seed=5,
    )
    plan = loader.batches()
    assert loader.n_samples == NT - 5  # positions 2 .. NT - 4
    seen = set()
    for samples, batch in zip(plan, loader, strict=True):
        t = loader.positions(samples)["time"]
        seen.update(t.tolist())
        x, y = batch["input"], batch["target"]
        assert x.shape == (len(t), 2, 3, NY, NX) and y.shape == (len(t), 3, NY, NX)
        assert x.dtype == y.dtype == np.float64  # f4, f8 and scaled i2 -> f8
        for c, name in enumerate(["sp", "t2m", "u10"]):
            np.testing.assert_array_equal(x[:, 0, c], _expected(ref, name, t - 2))
            np.testing.assert_array_equal(x[:, 1, c], _expected(ref, name, t))
            np.testing.assert_array_equal(y[:, c], _expected(ref, name, t + 3))
    assert seen == set(range(2, NT - 3))


def test_windows_sharing_an_offset_and_samples_read_into_place(
    store: Path, ref: xr.Dataset
) -> None:
    # one float32 variable stacked into float32: every sample of offset 1 is read
    # straight into its place; offset 0 feeds two windows and is copied into both
    loader = BatchLoader(
        _gds(store),
        variables=["t2m"],
        batch_size=5,
        windows={"a": 0, "b": (0, 1)},
        stack="channel",
        seed=2,
    )
    for samples, batch in zip(loader.batches(), loader, strict=True):
        t = loader.positions(samples)["time"]
        a, b = batch["a"], batch["b"]
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a[:, 0], _expected(ref, "t2m", t))
        np.testing.assert_array_equal(b[:, 0, 0], _expected(ref, "t2m", t))
        np.testing.assert_array_equal(b[:, 1, 0], _expected(ref, "t2m", t + 1))


def test_read_many_writes_into_the_arrays_given(store: Path, ref: xr.Dataset) -> None:
    from xarray.core import indexing

    from xarray_gds import region
    from xarray_gds.array import read_many
    from xarray_gds.loader.variables import engine_source as _engine_source

    ds = _gds(store)
    times = [0, 5, 22, 6]
    requests, dests, names = [], [], []
    for name, dtype in (("t2m", "f4"), ("u10", "f8"), ("sp", "f8"), ("sp", "f4")):
        found = _engine_source(ds[name].variable)
        assert found is not None
        array, _ = found
        for t in times:
            requests.append((array, indexing.BasicIndexer((t, slice(None), slice(None)))))
            dests.append(np.full((NY, NX), -7, dtype=dtype))
            names.append(name)
    got = read_many(requests, dests)
    for (_, key), value, dest, name in zip(requests, got, dests, names, strict=True):
        want = ref[name].values[key.tuple]
        np.testing.assert_array_equal(value, want)
        if dest.dtype == want.dtype:  # u10: decoded (scaled) after the read, then copied
            assert value is dest
        else:  # sp into float32: not taken, left as it was
            assert value is not dest and (dest == -7).all()
    # the box read itself: chunks placed into the array given, not a new one
    raw = ds["t2m"].variable._data
    while not hasattr(raw, "_array"):
        raw = raw.array
    dest = np.full((2, NY, NX), -7, dtype="f4")
    (value,) = region.read_boxes(
        [(raw._array, (slice(3, 5), slice(None), slice(None)), "cpu")], [dest]
    )
    assert np.shares_memory(value, dest)
    np.testing.assert_array_equal(dest, ref["t2m"].values[3:5])
    wrong = np.zeros((NY, NX), dtype="f4")  # another shape: a new array
    (value,) = region.read_boxes([(raw._array, (3, slice(None), slice(None)), "cpu")], [wrong[:2]])
    assert not np.shares_memory(value, wrong)
    np.testing.assert_array_equal(value, ref["t2m"].values[3])


def test_several_sample_dims(store: Path, ref: xr.Dataset) -> None:
    loader = BatchLoader(_gds(store), ("time", "member"), batch_size=7, seed=2)
    assert loader.variables == ["member_t"]
    assert loader.n_samples == NT * 3
    pairs = []
    for samples, batch in zip(loader.batches(), loader, strict=True):
        at = loader.positions(samples)
        want = ref["member_t"].values[at["time"], at["member"]]
        np.testing.assert_array_equal(batch["member_t"], want)
        pairs += list(zip(at["time"].tolist(), at["member"].tolist(), strict=True))
    assert sorted(pairs) == [(t, m) for t in range(NT) for m in range(3)]


def test_a_selection_after_opening_is_kept(store: Path, ref: xr.Dataset) -> None:
    ds = _gds(store).isel(time=slice(3, 20, 2), lat=slice(1, 5))
    loader = BatchLoader(ds, variables=["t2m", "u10"], batch_size=3, seed=4)
    for samples, batch in zip(loader.batches(), loader, strict=True):
        t = 3 + 2 * loader.positions(samples)["time"]
        for name in ("t2m", "u10"):
            np.testing.assert_array_equal(batch[name], _expected(ref, name, t)[:, 1:5])


def test_dataset_output(store: Path, ref: xr.Dataset) -> None:
    loader = BatchLoader(
        _gds(store),
        variables=["t2m", "u10"],
        batch_size=6,
        output="dataset",
        seed=9,
        windows={"now": 0, "next": (1, 2)},
    )
    for samples, batch in zip(loader.batches(), loader, strict=True):
        t = loader.positions(samples)["time"]
        want = ref[["t2m", "u10"]].isel(time=xr.DataArray(t, dims="sample"))
        now = batch["now"]
        assert now["t2m"].dims == ("sample", "lat", "lon")
        xr.testing.assert_identical(now.drop_vars("time"), want.drop_vars("time"))
        np.testing.assert_array_equal(now["time"].values, ref["time"].values[t])
        nxt = batch["next"]
        assert nxt["u10"].dims == ("sample", "offset", "lat", "lon")
        np.testing.assert_array_equal(nxt["offset"].values, [1, 2])
        np.testing.assert_array_equal(nxt["time"].values, ref["time"].values[t[:, None] + [1, 2]])
        np.testing.assert_array_equal(nxt["u10"].values[:, 1], _expected(ref, "u10", t + 2))


def test_to_a_dlpack_consumer_shares_memory(store: Path) -> None:
    """``to=`` gets each array (numpy.from_dlpack stands in for torch.from_dlpack here):
    what it returns is what the batch holds, a view of the loader's array."""
    given: list[np.ndarray] = []

    def consume(a: np.ndarray) -> np.ndarray:
        given.append(a)
        return np.from_dlpack(a)

    loader = BatchLoader(
        _gds(store), variables=THREE, batch_size=4, to=consume, stack="c", prefetch=0
    )
    batch = next(iter(loader))
    assert len(given) == 1
    assert batch.shape == (4, 3, NY, NX)
    assert np.shares_memory(batch, given[0])


def test_a_batch_is_one_engine_batch(store: Path, joined_calls: list[int]) -> None:
    """The pieces of a batch (samples x variables x offsets) go to the read engine in
    one call, not one read a piece."""
    calls = joined_calls
    loader = BatchLoader(
        _gds(store), variables=THREE, batch_size=6, windows={"a": 0, "b": 1}, prefetch=0
    )
    next(iter(loader))
    assert calls == [6 * 3 * 2]


# ------------------------------------------------------------------ order


def test_shuffle_seeded_new_order_each_epoch(store: Path) -> None:
    ds = _gds(store)
    a = BatchLoader(ds, batch_size=4, seed=1)
    b = BatchLoader(ds, batch_size=4, seed=1)
    c = BatchLoader(ds, batch_size=4, seed=2)
    flat = [np.concatenate(a.batches(e)) for e in range(3)]
    assert all(sorted(f.tolist()) == list(range(NT)) for f in flat)
    assert not np.array_equal(flat[0], flat[1]) and not np.array_equal(flat[1], flat[2])
    np.testing.assert_array_equal(flat[1], np.concatenate(b.batches(1)))
    assert not np.array_equal(flat[0], np.concatenate(c.batches(0)))
    plain = BatchLoader(ds, batch_size=4, shuffle=False)
    np.testing.assert_array_equal(np.concatenate(plain.batches(5)), np.arange(NT))
    # iterating advances the epoch; set_epoch picks one
    list(a)
    assert a.epoch == 1
    np.testing.assert_array_equal(np.concatenate(a.batches()), flat[1])
    a.set_epoch(0)
    np.testing.assert_array_equal(np.concatenate(a.batches()), flat[0])


def test_drop_last(store: Path) -> None:
    loader = BatchLoader(_gds(store), batch_size=5, drop_last=True, prefetch=1)
    got = list(loader)
    assert len(loader) == len(got) == NT // 5
    assert all(b["t2m"].shape[0] == 5 for b in got)


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_disjoint_and_covering(store: Path, drop_last: bool) -> None:
    ds = _gds(store)
    world = 3
    loaders = [
        BatchLoader(
            ds,
            batch_size=2,
            seed=8,
            rank=r,
            world_size=world,
            drop_last=drop_last,
            output="dataset",
            variables=["t2m"],
        )
        for r in range(world)
    ]
    for epoch in range(2):
        samples = [np.concatenate(ld.batches(epoch)) for ld in loaders]
        times = [
            np.concatenate([b["time"].values for b in ld]) for ld in loaders
        ]  # iterating reads the epoch's batches
        every = np.concatenate(samples)
        assert len(set(every.tolist())) == len(every)  # disjoint
        for s, t, ld in zip(samples, times, loaders, strict=True):
            np.testing.assert_array_equal(t, ds["time"].values[ld.positions(s)["time"]])
        if drop_last:
            assert len({len(ld) for ld in loaders}) == 1
            assert len(loaders[0]) == NT // world // 2
        else:
            assert sorted(every.tolist()) == list(range(NT))  # covering
            assert sorted(np.concatenate(times).tolist()) == sorted(ds["time"].values.tolist())


# ------------------------------------------------------------------ resuming


def _ids(batch: dict[str, Any]) -> list[float]:
    return batch["t2m"][:, 0, 0].tolist()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_resume_equals_uninterrupted(store: Path, prefetch: int) -> None:
    ds = _gds(store)

    def make() -> BatchLoader:
        return BatchLoader(ds, variables=["t2m"], batch_size=4, seed=3, prefetch=prefetch)

    whole = make()
    expected = [b["t2m"] for _ in range(2) for b in whole]  # two epochs
    first = make()
    taken = []
    for i, batch in enumerate(first):
        taken.append(batch["t2m"])
        if i == 2:
            break
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (0, 3)
    again = make()
    again.load_state_dict(state)
    rest = [b["t2m"] for b in again] + [b["t2m"] for b in again]
    assert len(taken) + len(rest) == len(expected) == 2 * len(whole)
    for a, b in zip(taken + rest, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    # the same loader continues where its iteration stopped, too
    cont = [b["t2m"] for b in first]
    for a, b in zip(taken + cont, expected, strict=False):
        np.testing.assert_array_equal(a, b)
    assert first.epoch == 1


def test_state_of_an_epoch_handed_out_whole(store: Path) -> None:
    ds = _gds(store)
    a = BatchLoader(ds, variables=["t2m"], batch_size=8, seed=1)
    it = iter(a)
    for _ in range(len(a)):
        next(it)  # the last batch held: the generator has not finished
    state = a.state_dict()
    b = BatchLoader(ds, variables=["t2m"], batch_size=8, seed=1)
    b.load_state_dict(state)
    nxt = next(iter(b))
    c = BatchLoader(ds, variables=["t2m"], batch_size=8, seed=1)
    c.set_epoch(1)
    np.testing.assert_array_equal(nxt["t2m"], next(iter(c))["t2m"])


def test_load_state_dict_refuses_another_setup(store: Path) -> None:
    ds = _gds(store)
    state = BatchLoader(ds, batch_size=4, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"seed=1.*seed=2"):
        BatchLoader(ds, batch_size=4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        BatchLoader(ds, batch_size=4, seed=1, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        BatchLoader(ds, batch_size=4, seed=1).load_state_dict({"epoch": 0})


# ------------------------------------------------------------------ prefetch


class _Counting(BatchLoader):
    """Counts the batches whose read has started (the prefetch thread's and the caller's)."""

    started: list[int]

    def _read_batch(self, samples: np.ndarray) -> Any:
        self.started.append(len(samples))
        return super()._read_batch(samples)


@pytest.mark.parametrize(("prefetch", "budget", "depth"), [(2, None, 2), (8, 2.5, 2), (3, 0.5, 0)])
def test_prefetch_is_bounded(
    store: Path, ref: xr.Dataset, prefetch: int, budget: float | None, depth: int
) -> None:
    ds = _gds(store)
    probe = BatchLoader(ds, variables=THREE, batch_size=2)
    limit = None if budget is None else int(budget * probe.batch_nbytes)
    assert probe.batch_nbytes == 2 * NY * NX * (4 + 8 + 8)
    loader = _Counting(
        ds, variables=THREE, batch_size=2, prefetch=prefetch, prefetch_bytes=limit, seed=6
    )
    loader.started = []
    assert loader.depth == depth
    plan = loader.batches()
    it = iter(loader)
    batch = next(it)
    if depth:
        # the thread stops before the batch 1 + depth ahead of the one held
        assert loader._prefetcher.wait_blocked(1 + depth, timeout=30)
    assert len(loader.started) == 1 + depth
    got = [batch, *it]
    assert len(loader.started) == len(plan)
    for samples, b in zip(plan, got, strict=True):
        t = loader.positions(samples)["time"]
        np.testing.assert_array_equal(b["u10"], _expected(ref, "u10", t))
    if depth:
        assert not loader._prefetcher._thread.is_alive()


def test_the_prefetcher_reports_where_it_waits_for_a_slot() -> None:
    """Prefetcher.wait_blocked (what the bounds above are checked with) wakes as soon as
    the thread waits for a slot, not at its timeout, and once the thread has ended it
    waits for nothing; the batches come in the plan's order."""
    import time
    import types

    from xarray_gds.loader import prefetch

    waiting = threading.Event()

    class Condition(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()  # the caller of wait_blocked waits: let the thread go on
            return super().wait(timeout)

    def read(samples: np.ndarray) -> int:
        if len(samples) == 2:  # the second batch: the thread blocks right after it
            assert waiting.wait(60)
        return int(samples.sum())

    names = ("Semaphore", "Event", "Thread")
    fake = types.SimpleNamespace(Condition=Condition, **{n: getattr(threading, n) for n in names})
    plan = [np.arange(k + 1) for k in range(5)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefetch, "threading", fake)
        prefetcher = prefetch.Prefetcher(read, plan, 2, None)
    try:
        started = time.monotonic()
        assert prefetcher.wait_blocked(2, timeout=120)  # two batches read, none taken
        assert time.monotonic() - started < 60
        assert [prefetcher.take() for _ in plan] == [0, 1, 3, 6, 10]
    finally:
        prefetcher.stop()
    assert not prefetcher._thread.is_alive()
    assert not any(prefetcher.wait_blocked(i, timeout=0) for i in range(len(plan)))


def test_the_prefetcher_reads_nothing_after_a_failed_batch() -> None:
    """A batch whose read fails is the last one the thread reads: its error is raised
    where the caller takes it, and no later batch of the plan is read, slots free or
    not."""
    from xarray_gds.loader.prefetch import Prefetcher

    reads: list[int] = []

    def read(samples: np.ndarray) -> int:
        reads.append(len(samples))
        if len(samples) == 2:
            raise OSError("chunk 't/c/1' unreadable")
        return len(samples)

    prefetcher = Prefetcher(read, [np.arange(k + 1) for k in range(5)], 5, None)
    assert prefetcher.take() == 1
    with pytest.raises(OSError, match="unreadable"):
        prefetcher.take()
    prefetcher._thread.join(60)
    assert not prefetcher._thread.is_alive()
    assert reads == [1, 2]
    prefetcher.stop()


def test_stopping_a_prefetcher_that_waits_for_a_slot() -> None:
    """A prefetcher stopped while its thread waits for a slot (the caller broke out of
    its loop with batches read ahead) ends at once, reading no further batch; a plan of
    more than 256 batches is followed to its end (wait_blocked finds batch 299)."""
    from xarray_gds.loader.prefetch import Prefetcher

    reads: list[int] = []

    def read(samples: np.ndarray) -> int:
        reads.append(len(samples))
        return len(samples)

    prefetcher = Prefetcher(read, [np.arange(k + 1) for k in range(5)], 2, None)
    assert prefetcher.wait_blocked(2, timeout=60)
    stopper = threading.Thread(target=prefetcher.stop, daemon=True)
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive(), "stop() did not return"
    assert not prefetcher._thread.is_alive()
    assert reads == [1, 2]
    long = Prefetcher(read, [np.arange(1)] * 300, 299, None)
    try:
        assert long.wait_blocked(299, timeout=60)
    finally:
        long.stop()


def test_the_prefetch_thread_reads_on_the_callers_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """current_gpu: a loader with a variable on the device reads its batches on the GPU
    current in the calling thread (a fake CuPy says GPU 1), one of host variables only
    names none."""
    import types

    from xarray_gds import device as _device
    from xarray_gds.loader.prefetch import current_gpu
    from xarray_gds.loader.variables import Var

    runtime = types.SimpleNamespace(getDevice=lambda: 1)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(_device, "cupy", lambda: fake)

    def var(device: str) -> Var:
        return Var("v", (), (), np.dtype("f4"), device)  # type: ignore[arg-type]

    assert current_gpu([var("cpu"), var("cuda")]) == 1
    assert current_gpu([var("cuda")]) == 1
    assert current_gpu([var("cpu")]) is None
    assert current_gpu([]) is None


def test_the_prefetch_thread_is_named_and_never_keeps_a_process_alive(store: Path) -> None:
    """The prefetch thread shows in thread listings (py-spy, faulthandler) by its name
    while it reads ahead, and a program that stops using a loader mid-iteration
    without closing it still exits: the thread is a daemon, blocked on a slot."""
    import subprocess
    import sys

    loader = BatchLoader(_gds(store), batch_size=2, prefetch=2)
    it = iter(loader)
    next(it)
    assert [t for t in threading.enumerate() if t.name == "xarray-gds-prefetch"] == [
        loader._prefetcher._thread
    ]
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "xarray-gds-prefetch"]
    program = (
        "import sys, xarray as xr\n"
        "from xarray_gds import BatchLoader\n"
        "ds = xr.open_dataset(sys.argv[1], engine='gds-zarr', device='cpu', consolidated=False)\n"
        "loader = BatchLoader(ds, batch_size=2, prefetch=2)\n"
        "it = iter(loader)\n"
        "next(it)\n"
        "assert loader._prefetcher.wait_blocked(3, timeout=30)  # two batches ahead\n"
        "print('left the loader', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(store)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "left the loader\n"


def test_breaking_out_stops_the_thread(store: Path) -> None:
    loader = BatchLoader(_gds(store), batch_size=2, prefetch=2)
    it = iter(loader)
    next(it)
    thread = loader._prefetcher._thread
    it.close()  # what a `break` does once the generator is dropped
    assert not thread.is_alive()
    assert threading.current_thread() is threading.main_thread()


def test_a_failed_read_is_raised_naming_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "bad.zarr"
    _dataset().to_zarr(path, encoding=ENCODING, consolidated=False, zarr_format=3)
    chunk = path / "sp" / "c" / "0" / "0" / "0"
    chunk.write_bytes(b"not zstd" * 8)
    loader = BatchLoader(_gds(path), variables=["t2m", "sp"], batch_size=4, shuffle=False)
    with pytest.raises(RuntimeError, match="'sp'"):
        list(loader)
    shutil.rmtree(path)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dims": "level"}, "no dimension 'level'"),
        ({"dims": ()}, "at least one"),
        ({"variables": ["orog"]}, "'orog' has no dimension 'time'"),
        ({"variables": ["nope"]}, "no variable 'nope'"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"rank": 2, "world_size": 2}, "rank must be below world_size=2"),
        ({"prefetch": -1}, "prefetch must be"),
        ({"prefetch_bytes": -5}, "prefetch_bytes"),
        ({"output": "tensors"}, "output must be one of"),
        ({"output": "dataset", "to": np.from_dlpack}, "to= converts arrays"),
        ({"output": "dataset", "stack": "c"}, "stack= makes one array"),
        ({"windows": {"x": 0, "y": NT}}, "need more than its 23 positions"),
        ({"windows": {"x": "now"}}, r"windows\['x'\]"),
        ({"windows": {"x": ()}}, r"windows\['x'\]"),
        ({"stack": "c"}, "must share their other dimensions"),
        ({"stack": "lat", "variables": ["t2m"]}, "is a dimension of the variables"),
    ],
)
def test_bad_arguments(store: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchLoader(_gds(store), **kwargs)


def test_not_a_dataset(store: Path) -> None:
    with pytest.raises(TypeError, match="to_dataset"):
        BatchLoader(_gds(store)["t2m"])  # type: ignore[arg-type]


def test_torch_dataset_needs_torch(store: Path) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch is installed")
    with pytest.raises(ImportError, match="needs PyTorch"):
        BatchLoader(_gds(store)).torch_dataset()


def test_worker_processes_are_refused(store: Path) -> None:
    loader = BatchLoader(_gds(store))
    with pytest.raises(RuntimeError, match="num_workers=0"):
        loader._check_worker(0, 4, forked=True)  # host data: workers would repeat it
    loader._vars[0].device = "cuda"  # as a dataset opened on the GPU
    with pytest.raises(RuntimeError, match="forked from a process that had initialised CUDA"):
        loader._check_worker(1, 4, forked=True)


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [None, {}])
def test_device_batches_are_cupy(store: Path, ref: xr.Dataset, chunks: Any) -> None:
    import cupy as cp

    from xarray_gds import GdsDaskManager

    kwargs: dict[str, Any] = {}
    if chunks is not None:
        kwargs = {"chunks": chunks, "chunked_array_type": GdsDaskManager()}
    ds = _gds(store, "cuda", **kwargs)
    loader = BatchLoader(
        ds, variables=THREE, batch_size=4, windows={"x": 0, "y": (1, 2)}, seed=3, prefetch=2
    )
    for samples, batch in zip(loader.batches(), loader, strict=True):
        t = loader.positions(samples)["time"]
        for name in THREE:
            assert isinstance(batch["x"][name], cp.ndarray)
            np.testing.assert_array_equal(_host(batch["x"][name]), _expected(ref, name, t))
            np.testing.assert_array_equal(
                _host(batch["y"][name][:, 1]), _expected(ref, name, t + 2)
            )
    stacked = BatchLoader(ds, variables=THREE, batch_size=5, stack="c", seed=1)
    for samples, batch in zip(stacked.batches(), stacked, strict=True):
        assert isinstance(batch, cp.ndarray) and batch.shape[1:] == (3, NY, NX)
        t = stacked.positions(samples)["time"]
        for c, name in enumerate(THREE):
            np.testing.assert_array_equal(_host(batch[:, c]), _expected(ref, name, t))


@pytest.mark.gpu
def test_torch_tensors_share_the_device_memory(store: Path, ref: xr.Dataset) -> None:
    torch = pytest.importorskip("torch")
    made: list[Any] = []

    def to(a: Any) -> Any:
        made.append(a)
        return torch.from_dlpack(a)

    ds = _gds(store, "cuda")
    loader = BatchLoader(ds, variables=THREE, batch_size=4, stack="c", to=to, seed=2)
    plan = loader.batches()
    for i, (samples, batch) in enumerate(zip(plan, loader, strict=True)):
        assert batch.is_cuda and batch.shape[1:] == (3, NY, NX)
        assert batch.data_ptr() == made[i].data.ptr  # zero copy
        t = loader.positions(samples)["time"]
        np.testing.assert_array_equal(batch[:, 0].cpu().numpy(), _expected(ref, "t2m", t))
    # as an IterableDataset of whole batches, without worker processes
    source = BatchLoader(ds, variables=THREE, batch_size=4, stack="c", seed=2)
    plan = source.batches()
    dl = torch.utils.data.DataLoader(source.torch_dataset(), batch_size=None, num_workers=0)
    got = list(dl)
    assert len(got) == len(plan)
    for samples, batch in zip(plan, got, strict=True):
        assert isinstance(batch, torch.Tensor) and batch.is_cuda  # zero copy, on the GPU
        t = source.positions(samples)["time"]
        np.testing.assert_array_equal(batch[:, 2].cpu().numpy(), _expected(ref, "sp", t))
    # workers forked after CUDA was initialised: the error says so
    assert torch.cuda.is_available()
    torch.zeros(1, device="cuda")
    forked = torch.utils.data.DataLoader(
        source.torch_dataset(),
        batch_size=None,
        num_workers=2,
        multiprocessing_context="fork",
    )
    with pytest.raises(RuntimeError, match="forked from a process that had initialised CUDA"):
        list(forked)


# ------------------------------------------------------------------ benchmark case


def test_bench_loader_case_reads_the_recipes_samples(tmp_path: Path) -> None:
    """The loader-* benchmark: its store, the recipe's engine="zarr" samples equal to
    the loader's batches, and a run of the smallest case."""
    from xarray_gds import device as _device
    from xarray_gds.tools import bench, bench_loader

    path = bench_loader.make_era5(tmp_path / "era5.zarr", 0, batch=4)
    names = bench_loader.NAMES[:4]
    samples = bench_loader.ZarrSamples(path, names)
    assert len(samples) == 9  # two batches and one more step: a smoke-test store
    loader = BatchLoader(_gds(path), variables=names, batch_size=4, stack="c", seed=1)
    for plan, batch in zip(loader.batches(), loader, strict=True):
        assert batch.shape == (len(plan), 4, *bench_loader.SMALL)
        for row, t in zip(batch, loader.positions(plan)["time"], strict=True):
            np.testing.assert_array_equal(row, samples[int(t)])
    (result,) = bench.run(tmp_path, size_gb=0.001, repeat=1, cases=["loader-4x4"])
    # the recipe's DataLoader with 2 workers on the host, 4, 8 and 16 on a GPU machine
    # (8 named plainly); one process without one where PyTorch is missing
    cuda, _ = _device.cuda_status()
    if bench_loader._torch() is None:
        others = {bench_loader.PLAIN}
    elif cuda:
        others = {"zarr 4 workers", "zarr", "zarr 16 workers"}
    else:
        others = {"zarr"}
    assert set(result.seconds) == {"gds-zarr loader", *others}
    assert "gds-zarr loader" in result.note and "samples/s" in result.note


def test_the_docs_first_example_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/loaders.md: its first code block (a store of its own, one epoch) runs."""
    import re
    import runpy
    import warnings

    text = (Path(__file__).parent.parent / "docs" / "loaders.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    assert match
    monkeypatch.chdir(tmp_path)
    (tmp_path / "example.py").write_text(match.group(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no GPU here: the engine says it reads on the host
        names = runpy.run_path(str(tmp_path / "example.py"))
    assert len(names["loader"]) == 5
    assert names["x"].shape == names["y"].shape == (7, 3, 32, 64)
    ref = xr.open_dataset(tmp_path / "samples.zarr", engine="zarr")
    t = names["loader"].positions(names["loader"].batches(0)[-1])["time"]
    np.testing.assert_array_equal(to_host(names["y"])[:, 1], ref["u10"].values[t + 1])

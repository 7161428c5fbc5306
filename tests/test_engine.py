"""The read engine across requests: joined dask blocks (fuse), load_async gathers,
the decode route chosen by cost, and the settings that steer them."""

from __future__ import annotations

import asyncio
import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import dask
except ImportError:  # the base install: the tests of dask blocks skip (needs("dask"))
    dask = None
import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
from tests.conftest import assert_placed, to_numpy
from xarray_gds import coalesce, config, fuse, route
from xarray_gds.batch import PinnedStaging
from xarray_gds.codecs.formats import get
from xarray_gds.errors import ChunkDecodeError

#: joined dask groups need dask's task-spec graphs (absent from the oldest dask claimed)
needs_fuse = pytest.mark.skipif(
    not fuse.available(), reason="needs dask >= 2024.12 (task-spec graphs)"
)

STORE_CASES = [(3, "zstd"), (2, "zstd"), (3, "sharded"), (2, "blosc"), (3, "gzip"), (2, "lz4")]


@pytest.fixture(params=STORE_CASES, ids=[f"v{f}-{c}" for f, c in STORE_CASES])
def store(request: pytest.FixtureRequest, store_factory: Callable[[int, str], Path]) -> Path:
    zarr_format, codec = request.param
    return store_factory(zarr_format, codec)


def _open(path: Path, device: str, **kwargs: Any) -> tuple[xr.Dataset, xr.Dataset]:
    if device == "cuda" and "chunks" in kwargs:
        kwargs["chunked_array_type"] = "gds-dask"
    gds = xr.open_dataset(path, engine="gds-zarr", device=device, **kwargs)
    kwargs.pop("chunked_array_type", None)
    return gds, xr.open_dataset(path, engine="zarr", **kwargs)


def _numeric(ds: xr.Dataset) -> list[str]:
    return [str(n) for n, v in ds.data_vars.items() if v.dtype.kind in "biufc" and v.ndim >= 2]


# -- dask blocks joined into groups -------------------------------------------------

SELECTIONS: list[Callable[[xr.Dataset], xr.Dataset]] = [
    lambda ds: ds,
    lambda ds: ds.isel(time=slice(2, 7)),
    lambda ds: ds.isel(time=3),
    lambda ds: ds.isel(time=[0, 4, 9], lat=slice(1, 8)),
    lambda ds: ds.isel(lon=slice(None, None, 3)),
]


@pytest.mark.needs("dask")
@pytest.mark.parametrize("select", range(len(SELECTIONS)))
def test_dask_compute_matches_zarr(store: Path, device: str, select: int) -> None:
    gds, ref = _open(store, device, chunks={})
    pick = SELECTIONS[select]
    with dask.config.set(scheduler="threads"):
        got = pick(gds).compute()
    xr.testing.assert_identical(to_numpy(got), pick(ref).compute())
    assert_placed(got, device)


@pytest.mark.needs("dask")
def test_dask_reduction_matches_zarr(store: Path, device: str) -> None:
    gds, ref = _open(store, device, chunks={})
    names = _numeric(ref)
    got = gds[names].mean("time").compute()
    want = ref[names].mean("time").compute()
    xr.testing.assert_allclose(to_numpy(got), want, rtol=1e-6)


@needs_fuse
def test_compute_joins_every_variable_into_one_call(
    v3_store: Path, joined_calls: list[int]
) -> None:
    gds, ref = _open(v3_store, "cpu", chunks={})
    names = _numeric(ref)
    n_blocks = sum(gds[n].data.npartitions for n in names)
    assert n_blocks > len(names)  # several blocks a variable
    with dask.config.set(scheduler="threads"):
        got = gds[names].compute()
    xr.testing.assert_identical(got, ref[names].compute())
    # one joined call; each variable's blocks tile it, so one box a variable
    chunked = [n for n, v in gds[names].variables.items() if v.chunks and n not in gds.indexes]
    assert joined_calls == [len(chunked)]


@needs_fuse
def test_scattered_blocks_are_joined_too(v3_store: Path, joined_calls: list[int]) -> None:
    gds, ref = _open(v3_store, "cpu", chunks={})
    got = gds.t2m.isel(time=[0, 5, 9]).compute()
    xr.testing.assert_identical(got, ref.t2m.isel(time=[0, 5, 9]).compute())
    assert len(joined_calls) == 1 and joined_calls[0] > 1


@pytest.mark.parametrize(
    "select",
    [
        lambda v: v,
        lambda v: v.isel(time=slice(2, 9, 2)),
        lambda v: v.isel(time=3),
        lambda v: v.isel(lat=slice(None, None, -1)),
        lambda v: v.isel(lon=slice(7, 1, -3), time=slice(1, None)),
    ],
    ids=["whole", "step", "int", "reversed", "reversed-step"],
)
def test_block_keys_are_xarrays_own(v3_store: Path, select: Callable[[Any], Any]) -> None:
    """The fusion pass works out each block's key itself; it is the key xarray's own
    indexing arithmetic gives, for every block of lazily selected variables."""
    from xarray.core import indexing

    ds = xr.open_dataset(v3_store, engine="gds-zarr", device="cpu")
    var = select(ds.t2m).variable
    adapter = indexing.ImplicitToExplicitIndexingAdapter(var._data)
    shape = var.shape
    cases = [tuple(slice(0, n) for n in shape)]
    for dim, n in enumerate(shape):  # blocks of 1 and of 3 along each dimension
        for size in (1, 3):
            for start in range(0, n, size):
                sl = [slice(0, m) for m in shape]
                sl[dim] = slice(start, min(n, start + size))
                cases.append(tuple(sl))
    for slices in cases:
        base = fuse._lazy_base(adapter)
        assert base is not None
        got = fuse._block_key(base, slices)
        lazy = fuse._lazy(adapter[slices])
        assert got is not None
        assert got[0] is lazy.array

        def ranges(pair: tuple[Any, Any]) -> tuple[Any, ...]:
            array, key = pair
            return tuple(
                range(n)[k] if isinstance(k, slice) else k
                for k, n in zip(key.tuple, array.shape, strict=True)
            )

        have, want = ranges(got), ranges((lazy.array, lazy.key))
        assert have == want, slices
    # a key with an index array is left to xarray
    outer = xr.open_dataset(v3_store, engine="gds-zarr", device="cpu").t2m.isel(time=[0, 2])
    fancy = indexing.ImplicitToExplicitIndexingAdapter(outer.variable._data)
    assert fuse._lazy_base(fancy) is None


@pytest.mark.needs("dask")
def test_fuse_off_reads_each_block_alone(v3_store: Path, joined_calls: list[int]) -> None:
    gds, ref = _open(v3_store, "cpu", chunks={})
    with zarr.config.set({"xarray_gds.fuse_dask": False}), dask.config.set(scheduler="sync"):
        got = gds.t2m.compute()
    xr.testing.assert_identical(got, ref.t2m.compute())
    assert set(joined_calls) == {1}  # one read a block (coordinates' blocks too)
    assert len(joined_calls) >= gds.t2m.data.npartitions


@needs_fuse
def test_groups_bounded_by_fuse_bytes(v3_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fuse_bytes`` of two full blocks, the 27 blocks of t2m (4,320 bytes, edge
    blocks smaller) and the one block of its coordinate ``area`` (864 bytes) are read in
    ceil(5184 / 640) = 9 groups, every block in exactly one, none more than a block over
    the limit (a block goes to the group its middle byte falls in)."""
    gds, ref = _open(v3_store, "cpu", chunks={})
    block = gds.t2m.data.blocks[0, 0, 0].nbytes
    assert (block, gds.t2m.nbytes, gds.t2m.data.npartitions) == (320, 4320, 27)
    assert (gds.area.nbytes, gds.area.data.npartitions) == (864, 1)
    made: list[list[Any]] = []
    real = fuse._groups

    def spy(blocks: list[Any], sources: Any) -> Any:
        groups = real(blocks, sources)
        made.append(groups)
        return groups

    monkeypatch.setattr(fuse, "_groups", spy)
    limit = 2 * block
    with zarr.config.set({"xarray_gds.fuse_bytes": limit}), dask.config.set(scheduler="sync"):
        got = gds.t2m.compute()
    xr.testing.assert_identical(got, ref.t2m.compute())
    (groups,) = made  # the pass ran, once

    def nbytes(source: Any, slices: tuple[slice, ...]) -> int:
        itemsize = 8 if "-area-" in str(source) else 4
        return itemsize * int(np.prod([s.stop - s.start for s in slices]))

    assert len(groups) == 9
    placed = [(source, tuple(slices)) for group in groups for _, source, slices in group]
    assert len(placed) == len(set(placed)) == 28
    assert sum(nbytes(*p) for p in placed) == 5184
    for group in groups:
        assert 0 < sum(nbytes(source, s) for _, source, s in group) <= limit + 864


@needs_fuse
@pytest.mark.parametrize("asarray", [True, False], ids=["asarray", "no-asarray"])
@pytest.mark.parametrize("chunks", [{}, {"time": 3, "lat": 4}], ids=str)
def test_read_layers_built_as_dask_builds_them(v3_store: Path, chunks: Any, asarray: bool) -> None:
    """The pass builds the block reads of xarray's ``from_array`` layers itself
    (dask materializes them slowly): the same keys, functions, arguments, sources and
    slices as dask's own materialization (``asarray=False`` is what GdsDaskManager's
    CuPy blocks use); layers that are not such reads are left to dask."""
    from dask._task_spec import DataNode, TaskRef, convert_legacy_graph

    ds = xr.open_dataset(
        v3_store,
        engine="gds-zarr",
        device="cpu",
        chunks=chunks,
        from_array_kwargs={} if asarray else {"asarray": False},
    )
    graph = ds.t2m.data.__dask_graph__()
    sources = fuse._find_sources(graph)
    built = {n: fuse._read_layer_tasks(layer, sources) for n, layer in graph.layers.items()}
    reads = {n: t for n, t in built.items() if t is not None}
    assert list(reads) == [ds.t2m.data.name]  # the source's own layer is not a read
    (tasks,) = reads.values()
    theirs = convert_legacy_graph(dict(graph.layers[ds.t2m.data.name]))
    assert tasks.keys() == theirs.keys() and len(tasks) == ds.t2m.data.npartitions
    for key, task in tasks.items():
        want = theirs[key]
        assert task.func is want.func and task.kwargs == want.kwargs
        ref, where = task.args
        assert isinstance(ref, TaskRef) and ref.key == want.args[0].key
        their_where = want.args[1].value if isinstance(want.args[1], DataNode) else want.args[1]
        assert where.value == their_where
    # the whole graph as ensure_dict gives it, and the values through the pass
    assert fuse._materialize(graph, sources).keys() == dict(graph).keys()
    ref_ds = xr.open_dataset(v3_store, engine="zarr", chunks=chunks)
    xr.testing.assert_identical(ds.t2m.compute(), ref_ds.t2m.compute())
    # a read with a lock, or of an array inlined in its tasks, is dask's to build
    locked = xr.open_dataset(
        v3_store, engine="gds-zarr", device="cpu", chunks=chunks, from_array_kwargs={"lock": True}
    )
    lgraph = locked.t2m.data.__dask_graph__()
    lsources = fuse._find_sources(lgraph)
    assert all(fuse._read_layer_tasks(layer, lsources) is None for layer in lgraph.layers.values())
    inline = xr.open_dataset(
        v3_store, engine="gds-zarr", device="cpu", chunks=chunks, inline_array=True
    )
    igraph = inline.t2m.data.__dask_graph__()
    assert all(fuse._read_layer_tasks(layer, {}) is None for layer in igraph.layers.values())
    xr.testing.assert_identical(inline.t2m.compute(), ref_ds.t2m.compute())


@pytest.fixture
def placed(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times the fused graph ran fuse._place and fuse._pick."""
    calls = {"place": 0, "pick": 0}
    place, pick = fuse._place, fuse._pick

    def spy_place(*args: Any) -> Any:
        calls["place"] += 1
        return place(*args)

    def spy_pick(*args: Any) -> Any:
        calls["pick"] += 1
        return pick(*args)

    monkeypatch.setattr(fuse, "_place", spy_place)
    monkeypatch.setattr(fuse, "_pick", spy_pick)
    return calls


@needs_fuse
@pytest.mark.parametrize(
    "chunks",
    [{}, {"time": 3, "lat": 4}, {"time": 2, "lat": 1}, {"lon": 5}],
    ids=str,
)
def test_computed_arrays_are_placed_from_their_groups(
    v3_store: Path, device: str, chunks: Any, placed: dict[str, int]
) -> None:
    """dask's final concatenation of a fused array becomes one task that copies each
    block from its group into one new array: values and type as engine="zarr" (CuPy on
    the device), no per-block tasks, and a result that is the caller's own."""
    gds, ref = _open(v3_store, device, chunks=chunks, drop_variables=["station"])
    want = ref.t2m.values
    data = gds.t2m.data
    assert data.npartitions > 1

    def host(x: Any) -> np.ndarray:
        assert type(x).__module__.split(".")[0] == ("cupy" if device == "cuda" else "numpy")
        return x.get() if device == "cuda" else x

    first = data.compute()
    try:  # dask >= 2025.1 puts the final concatenation in the graph the pass sees
        from dask._expr import HLGFinalizeCompute  # noqa: F401
    except ImportError:
        assert placed == {"place": 0, "pick": data.npartitions}
    else:
        assert placed == {"place": 1, "pick": 0}
    np.testing.assert_array_equal(host(first), want)
    first[...] = -1  # the caller's array: computing again gives the values unchanged
    np.testing.assert_array_equal(host(data.compute()), want)
    # a dataset's load places each variable; arrays computed from the blocks keep
    # dask's own concatenation, with the blocks taken from the same groups
    xr.testing.assert_identical(gds.compute().as_numpy(), ref.compute())
    same, shifted = dask.compute(gds.t2m.data, gds.t2m.data + 1)
    np.testing.assert_array_equal(host(same), want)
    np.testing.assert_array_equal(host(shifted), want + 1)
    (kept,) = dask.persist(gds.t2m.data)  # persisted blocks stay blocks
    assert kept.npartitions == data.npartitions
    np.testing.assert_array_equal(host(kept.compute()), want)


@pytest.mark.needs("dask")
def test_place_falls_back_to_dasks_finalize() -> None:
    """Blocks _place cannot copy into one array (mixed dtypes, a shape that is not its
    place's) are handed to dask's own finalize, which gives what it always gave."""
    from dask.array.core import finalize

    a, b = np.arange(6.0).reshape(2, 3), np.arange(6, dtype="i4").reshape(2, 3)
    rows = [(0, 0, (slice(0, 2), slice(0, 3))), (0, 1, (slice(2, 4), slice(0, 3)))]
    spec = ([[0], [1]], (4, 3), rows)
    mixed = fuse._place(spec, (a, b))
    assert mixed.dtype == finalize([[a], [b]]).dtype
    np.testing.assert_array_equal(mixed, finalize([[a], [b]]))
    c = np.arange(9.0).reshape(3, 3)
    np.testing.assert_array_equal(fuse._place(spec, (a, c)), finalize([[a], [c]]))
    with pytest.raises(ValueError, match="t2m/c/0"):  # a failed block raises its error
        fuse._place(spec, (a, ValueError("t2m/c/0: damaged")))


@pytest.mark.needs("dask")
def test_blocks_of_one_box_are_returned_as_the_box() -> None:
    """Blocks that are views of one array of the result's shape at their places give
    that array itself; any other blocks are copied into a new one."""
    from dask.array.core import slices_from_chunks

    box = np.arange(24.0).reshape(4, 6).copy()
    places = list(slices_from_chunks(((2, 2), (3, 3))))
    layout = [(0, i, p) for i, p in enumerate(places)]
    spec = ([[0, 1], [2, 3]], (4, 6), layout)
    assert fuse._place(spec, tuple(box[p] for p in places)) is box
    copies = tuple(box[p].copy() for p in places)
    out = fuse._place(spec, copies)
    assert out is not box and not any(np.shares_memory(out, c) for c in copies)
    np.testing.assert_array_equal(out, box)
    swapped = tuple(box[places[(i + 1) % 4]] for i in range(4))  # views in wrong places
    assert fuse._whole_base(list(swapped), places, (4, 6)) is None
    bigger = np.arange(48.0).reshape(8, 6)  # views of a larger array are copied
    assert fuse._whole_base([bigger[p] for p in places], places, (4, 6)) is None
    flat = np.arange(24.0)  # views of a flat buffer of the same size: it, reshaped
    got = fuse._place(spec, tuple(flat.reshape(4, 6)[p] for p in places))
    assert got.shape == (4, 6) and np.shares_memory(got, flat)
    np.testing.assert_array_equal(got, box)


@needs_fuse
def test_open_mfdataset_defaults_join_stores(
    tmp_path: Path, joined_calls: list[int], store_factory: Any
) -> None:
    from tests.conftest import sample_dataset, write_store

    paths = []
    for i in range(4):
        ds = sample_dataset(seed=i)
        ds = ds.assign_coords(time=ds.time + np.timedelta64(10 * 6 * i, "h"))
        paths.append(write_store(tmp_path / f"s{i}.zarr", 3, "zstd", ds))
    gds = xr.open_mfdataset(paths, engine="gds-zarr", device="cpu")
    ref = xr.open_mfdataset(paths, engine="zarr")
    joined_calls.clear()
    with dask.config.set(scheduler="threads"):
        got = gds.t2m.compute()
    xr.testing.assert_identical(got, ref.t2m.compute())
    # the four stores' boxes (and their 2-D coordinates') in one call
    assert len(joined_calls) == 1 and joined_calls[0] >= 4


@pytest.mark.needs("dask")
def test_damaged_chunk_fails_its_blocks_only(tmp_path: Path) -> None:
    ds = xr.Dataset(
        {
            "a": (("t", "x"), np.arange(40.0).reshape(4, 10)),
            "b": (("t", "x"), np.arange(40.0).reshape(4, 10) * 2),
        }
    )
    path = tmp_path / "d.zarr"
    enc = {v: {"chunks": (1, 10), "compressors": [zarr.codecs.ZstdCodec()]} for v in ds}
    ds.to_zarr(path, mode="w", encoding=enc, zarr_format=3, consolidated=False)
    (path / "a" / "c" / "2" / "0").write_bytes(b"not zstd at all")
    gds = xr.open_dataset(path, engine="gds-zarr", device="cpu", chunks={})
    with pytest.raises(ChunkDecodeError, match=r"a/c/2/0"):
        gds.compute()
    xr.testing.assert_identical(gds.b.compute(), ds.b)  # the other variable still reads
    xr.testing.assert_identical(gds.a.isel(t=[0, 1, 3]).compute(), ds.a.isel(t=[0, 1, 3]))


@needs_fuse
def test_optimize_leaves_other_graphs_alone() -> None:
    import dask.array as da

    x = da.arange(12, chunks=4)
    graph = x.__dask_graph__()
    assert fuse.optimize(graph, x.__dask_keys__()) is graph


@needs_fuse
def test_install_keeps_an_existing_optimization() -> None:
    seen: list[int] = []

    def mine(dsk: Any, keys: Any, **kwargs: Any) -> Any:
        seen.append(1)
        from dask.array.optimization import optimize

        return optimize(dsk, keys, **kwargs)

    import dask.array as da

    with dask.config.set(array_optimize=mine):
        fuse.install()
        assert isinstance(dask.config.get("array_optimize"), fuse._Optimizer)
        fuse.install()  # once only
        assert dask.config.get("array_optimize").then is mine
        assert int(da.arange(6, chunks=2).sum().compute()) == 15
    assert seen == [1]


@needs_fuse
@pytest.mark.gpu
def test_default_manager_warns_once_and_gives_numpy(v3_store: Path) -> None:
    fuse._warned_host_blocks = False
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device="cuda", chunks={})
    with pytest.warns(UserWarning, match=r"gds-dask"):
        got = gds.t2m.compute()
    assert isinstance(got.data, np.ndarray)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gds.u10.compute()  # once a process


@pytest.mark.gpu
def test_gds_manager_blocks_stay_cupy(v3_store: Path) -> None:
    import cupy as cp

    gds, ref = _open(v3_store, "cuda", chunks={})
    got = gds.t2m.mean("time").compute()
    assert isinstance(got.data, cp.ndarray)
    xr.testing.assert_allclose(to_numpy(got), ref.t2m.mean("time").compute(), rtol=1e-6)
    block = gds.t2m.data.blocks[1, 0, 0].compute()
    assert isinstance(block, cp.ndarray)


# -- load_async ---------------------------------------------------------------------


def test_load_async_matches_zarr(store: Path, device: str) -> None:
    gds, ref = _open(store, device)

    async def load() -> xr.Dataset:
        return await gds.load_async()

    got = asyncio.run(load())
    xr.testing.assert_identical(to_numpy(got), ref.load())
    assert_placed(got, device)


def test_load_async_joins_variables(v3_store: Path, joined_calls: list[int]) -> None:
    gds, ref = _open(v3_store, "cpu")
    names = _numeric(ref)

    async def load() -> xr.Dataset:
        return await gds[names].load_async()

    got = asyncio.run(load())
    xr.testing.assert_identical(got, ref[names].load())
    device_vars = [n for n in gds[names].variables if xarray_gds.placement(n, gds[n].variable)]
    assert joined_calls == [len(device_vars)]  # every variable's chunks in one call


def test_dataarray_load_async_and_selection(v3_store: Path) -> None:
    gds, ref = _open(v3_store, "cpu")

    async def load() -> list[xr.DataArray]:
        return list(
            await asyncio.gather(
                gds.t2m.isel(time=2).load_async(), gds.t2m.isel(lat=[1, 3]).load_async()
            )
        )

    a, b = asyncio.run(load())
    xr.testing.assert_identical(a, ref.t2m.isel(time=2).load())
    xr.testing.assert_identical(b, ref.t2m.isel(lat=[1, 3]).load())


def test_load_async_error_names_chunk(tmp_path: Path) -> None:
    ds = xr.Dataset({"a": (("t", "x"), np.arange(20.0).reshape(2, 10))})
    path = tmp_path / "d.zarr"
    enc = {"a": {"chunks": (1, 10), "compressors": [zarr.codecs.ZstdCodec()]}}
    ds.to_zarr(path, mode="w", encoding=enc, zarr_format=3, consolidated=False)
    (path / "a" / "c" / "1" / "0").write_bytes(b"garbage")
    gds = xr.open_dataset(path, engine="gds-zarr", device="cpu")

    async def load() -> Any:
        return await gds.load_async()

    with pytest.raises(ChunkDecodeError, match=r"a/c/1/0"):
        asyncio.run(load())


# -- eager loops over the variables of a dataset (array.ReadAhead) --------------------


def _stepped(ds: xr.Dataset) -> list[str]:
    """The variables a loop over time steps reads with one key: those over all three
    dimensions."""
    return [str(n) for n, v in ds.data_vars.items() if v.dims == ("time", "lat", "lon")]


def test_loop_over_steps_reads_the_variables_of_a_step_in_one_batch(
    v3_store: Path, device: str, joined_calls: list[int]
) -> None:
    gds, ref = _open(v3_store, device)
    names = _stepped(ref)
    assert len(names) >= 2
    for i in range(4):
        got = gds[names].isel(time=i).load()
        xr.testing.assert_identical(to_numpy(got), ref[names].isel(time=i).load())
    # the first step learns the order, each later one is one joined read of them all
    assert [n for n in joined_calls if n > 1] == [len(names)] * 3


def test_read_ahead_off_and_changed_patterns_keep_values(
    v3_store: Path, device: str, joined_calls: list[int]
) -> None:
    gds, ref = _open(v3_store, device)
    names = _stepped(ref)
    with zarr.config.set({"xarray_gds.read_ahead_bytes": 0}):
        for i in range(3):
            gds[names].isel(time=i).load()
    assert joined_calls and all(n == 1 for n in joined_calls)
    # any order of reads gets the values zarr reads, whatever was read ahead
    rng = np.random.default_rng(3)
    for _ in range(30):
        name = names[int(rng.integers(len(names)))]
        i = int(rng.integers(3))
        got = gds[name].isel(time=i).load()
        xr.testing.assert_identical(to_numpy(got), ref[name].isel(time=i).load())
    for i in (5, 6):
        for name in names:  # a whole round, then the one variable alone
            xr.testing.assert_identical(
                to_numpy(gds[name].isel(time=i).load()), ref[name].isel(time=i).load()
            )
        xr.testing.assert_identical(
            to_numpy(gds[names[0]].isel(time=i + 2).load()), ref[names[0]].isel(time=i + 2).load()
        )


# -- the decode route ---------------------------------------------------------------


def test_route_small_batches_go_to_the_host() -> None:
    with zarr.config.set({"xarray_gds.route_constants": {"threads": 16}}):
        _small_batches_go_to_the_host()


def _small_batches_go_to_the_host() -> None:
    assert route.choose(get("zstd"), 1, 4 << 20) == "host"
    assert route.choose(get("zstd"), 16, 4 << 20) == "host"
    assert route.choose(get("zstd"), 480, 4 << 20) == "gpu"
    assert route.choose(None, 1, 4 << 20) == "gpu"  # nothing to decode
    gpu, host = route.estimate(get("zstd"), 480, 4 << 20)
    assert gpu < host


def test_route_forced_and_constants_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    with zarr.config.set({"xarray_gds.route": "gpu"}):
        assert route.choose(get("zstd"), 1, 4 << 20) == "gpu"
    monkeypatch.setenv("XARRAY_GDS_ROUTE", "host")
    assert route.choose(get("zstd"), 10_000, 4 << 20) == "host"
    with zarr.config.set({"xarray_gds.route": "gpu"}):  # the config key wins
        assert route.choose(get("zstd"), 10_000, 4 << 20) == "gpu"
    with zarr.config.set({"xarray_gds.route": "auto"}):  # the default: the variable wins
        assert route.choose(get("zstd"), 10_000, 4 << 20) == "host"
    monkeypatch.delenv("XARRAY_GDS_ROUTE")
    fast_host = {"rates": {"zstd": {"host_thread": 1e15}}, "h2d": 1e15}
    with zarr.config.set({"xarray_gds.route_constants": fast_host}):
        assert route.choose(get("zstd"), 10_000, 4 << 20) == "host"
    monkeypatch.setenv("XARRAY_GDS_ROUTE_CONSTANTS", json.dumps({"gpu_call": 10.0}))
    assert route.choose(get("zstd"), 100, 4 << 20) == "host"
    assert json.loads(route.costs().to_json())["gpu_call"] == 10.0


def test_route_bad_settings_say_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with (
        zarr.config.set({"xarray_gds.route": "fastest"}),
        pytest.raises(
            ValueError, match=r"'xarray_gds.route'.* one of 'auto', 'gpu', 'host', not 'fastest'"
        ),
    ):
        route.choose(get("zstd"), 1, 100)
    monkeypatch.setenv("XARRAY_GDS_ROUTE_CONSTANTS", "{not json")
    with pytest.raises(ValueError, match=r"not valid JSON.*calibrate"):
        route.costs()
    monkeypatch.setenv("XARRAY_GDS_ROUTE_CONSTANTS", json.dumps({"speed": 1}))
    with pytest.raises(ValueError, match=r"unknown fields \['speed'\]"):
        route.costs()


def test_config_key_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", "1234")
    assert config.get("batch_bytes") == 1234
    with zarr.config.set({"xarray_gds.batch_bytes": 99}):
        assert config.get("batch_bytes") == 99
    monkeypatch.setenv("XARRAY_GDS_FUSE_DASK", "0")
    assert config.get("fuse_dask") is False
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", "lots")
    with pytest.raises(
        ValueError, match=r"XARRAY_GDS_BATCH_BYTES\) takes a value of type int, not 'lots'"
    ):
        config.get("batch_bytes")


@pytest.mark.gpu
@pytest.mark.parametrize("forced", ["gpu", "host", "auto"])
def test_device_reads_identical_on_every_route(store: Path, forced: str) -> None:
    import cupy as cp

    with zarr.config.set({"xarray_gds.route": forced}):
        for select in SELECTIONS:
            gds, ref = _open(store, "cuda")
            got = select(gds).load()
            for name in _numeric(ref):
                assert isinstance(got[name].data, cp.ndarray)
            xr.testing.assert_identical(to_numpy(got), select(ref).load())
            gds, ref = _open(store, "cuda", chunks={})
            xr.testing.assert_identical(to_numpy(select(gds).compute()), select(ref).compute())


class _HostStaging(PinnedStaging):
    """The pool's bookkeeping with pageable buffers (no GPU here)."""

    @staticmethod
    def _allocate(nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)


def test_staging_reuses_buffers_and_keeps_a_bounded_amount() -> None:
    staging = _HostStaging(keep_bytes=8 << 20)
    with staging.lease(3 << 20) as a:
        assert a.nbytes == 3 << 20
        with staging.lease(100) as b:  # in use at once: two buffers
            assert b.nbytes == 100
    assert staging.allocations == 2
    for _ in range(5):  # the 4 MiB buffer serves each of these again
        with staging.lease(4 << 20) as c:
            c[:] = 1
    assert staging.allocations == 2
    with staging.lease(16 << 20):  # more than the pool keeps: released afterwards
        pass
    assert staging.allocations == 3
    with staging.lease(9 << 20):
        pass
    assert staging.allocations == 4


@pytest.mark.gpu
def test_host_route_stages_through_reused_pinned_buffers(v3_store: Path) -> None:
    """Device reads decoded on the host go through the engine's pinned buffers: the
    second read of the same size allocates none."""
    import cupy as cp

    staging = coalesce.engine().staging
    with zarr.config.set({"xarray_gds.route": "host"}):
        gds, ref = _open(v3_store, "cuda")
        first = gds.t2m.load()
        allocated = staging.allocations
        for _ in range(3):
            again = _open(v3_store, "cuda")[0].t2m.load()
            assert isinstance(again.data, cp.ndarray)
            xr.testing.assert_identical(to_numpy(again), ref.t2m.load())
    assert isinstance(first.data, cp.ndarray)
    assert staging.allocations == allocated


def test_host_reads_stream_chunk_by_chunk(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host box reads of whole local chunk files are streamed (each chunk read, decoded
    and placed by one thread; for large chunks, every chunk here): values as
    engine="zarr" for every store kind and selection, eagerly, from dask blocks and
    through load_async; missing chunks read as the fill value; a damaged chunk fails
    its own variable only, named."""
    monkeypatch.setattr(coalesce, "STREAM_CHUNK", 0)
    streamed: list[int] = []
    original = coalesce._serve_streamed

    def spy(group: list[Any]) -> None:
        streamed.append(sum(len(r.paths) for r in group))
        original(group)

    monkeypatch.setattr(coalesce, "_serve_streamed", spy)
    for pick in SELECTIONS:
        gds, ref = _open(store, "cpu")
        xr.testing.assert_identical(pick(gds).load(), pick(ref).load())
    if dask is not None:  # dask blocks: the dask extra
        gds, ref = _open(store, "cpu", chunks={})
        xr.testing.assert_identical(gds.compute(), ref.compute())
    gds, ref = _open(store, "cpu")
    xr.testing.assert_identical(asyncio.run(gds.load_async()), ref.load())
    sharded = store.parent.name.startswith("v3-sharded")  # (store_factory's folder)
    assert streamed or sharded  # shards' inner chunks are byte ranges: read first
    if sharded:
        return
    broken = tmp_path / "broken.zarr"
    shutil.copytree(store, broken)
    var = zarr.open_group(broken, mode="r")["u10"]
    first = var.metadata.encode_chunk_key((0,) * var.ndim)
    (broken / "u10" / first).write_bytes(b"\x00" * 64)
    damaged = xr.open_dataset(broken, engine="gds-zarr", device="cpu")
    with pytest.raises(ChunkDecodeError, match=rf"u10/{first}"):
        damaged.u10.load()
    xr.testing.assert_identical(damaged.t2m.load(), ref.t2m.load())  # t2m has a missing chunk


# -- one loop for reads larger than a batch, and any zarr Store as a source ---------


def test_large_read_in_parts_matches_zarr(
    v3_store: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts: list[int] = []
    original = coalesce.fetch_decode_parts

    def spy(items: list[Any], consume: Any) -> None:
        parts.append(len(items))
        original(items, consume)

    monkeypatch.setattr(coalesce, "fetch_decode_parts", spy)
    gds, ref = _open(v3_store, device)
    chunk = int(np.prod(gds.t2m.encoding["chunks"])) * 4
    row = chunk * -(-gds.t2m.shape[1] // gds.t2m.encoding["chunks"][1])
    row *= -(-gds.t2m.shape[2] // gds.t2m.encoding["chunks"][2])
    with zarr.config.set({"xarray_gds.batch_bytes": row, "xarray_gds.fuse_dask": False}):
        monkeypatch.setattr("xarray_gds.decode.MIN_PART_BYTES", 1)
        got = gds.t2m.load()
    xr.testing.assert_identical(to_numpy(got), ref.t2m.load())
    assert max(parts) > 2  # a row of chunks a part, served one after the other


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_box_reads_from_any_zarr_store(
    v3_store: Path, device: str, kind: str, joined_calls: list[int]
) -> None:
    from zarr.storage import LocalStore, MemoryStore

    if kind == "local":
        store: Any = LocalStore(v3_store, read_only=True)
    else:
        store = MemoryStore()
        for key in _keys(v3_store):
            store._store_dict[key] = _buffer((v3_store / key).read_bytes())
    gds = xr.open_dataset(store, engine="gds-zarr", device=device)
    ref = xr.open_dataset(v3_store, engine="zarr")
    for select in SELECTIONS:
        xr.testing.assert_identical(to_numpy(select(gds).load()), select(ref).load())
    assert joined_calls  # box reads went through the engine, not zarr's indexing


def _keys(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]


def _buffer(data: bytes) -> Any:
    from zarr.core.buffer import cpu

    return cpu.Buffer.from_bytes(data)


def test_sources_read_mixed_kinds_in_key_order(v3_store: Path) -> None:
    from zarr.storage import LocalStore

    from xarray_gds import stores
    from xarray_gds.stores.local import GdsStore

    keys = [*sorted(k for k in _keys(v3_store) if k.startswith("t2m/c/"))[:4], "t2m/c/9/9/9"]
    local = stores.source_for(GdsStore(v3_store, read_only=True))
    other = stores.source_for(LocalStore(v3_store, read_only=True))
    assert isinstance(local, stores.LocalSource) and isinstance(other, stores.StoreSource)
    picks = [local, other, local, other, other]
    locations = [s.locate([k])[0] for s, k in zip(picks, keys, strict=True)]
    got = stores.read(picks, locations, False, None)
    for key, data in zip(keys[:4], got[:4], strict=True):
        assert bytes(data) == (v3_store / key).read_bytes()
    assert got[4] is None  # missing everywhere


def test_merge_ranges_joins_ranges_of_one_key_across_small_gaps() -> None:
    from types import SimpleNamespace

    from xarray_gds import stores

    a, b = SimpleNamespace(store=object()), SimpleNamespace(store=object())
    srcs = [a, a, a, b, a, a]
    locations = ["s/c/0", "s/c/0", "s/c/0", "s/c/0", "s/c/1", "s/c/0"]
    starts = np.array([100, 0, 40, 0, 0, 5000])
    sizes = np.array([50, 30, 20, 10, 8, 10])
    spans = stores.merge_ranges(srcs, locations, starts, sizes, gap=50)
    got = sorted((locations[f], srcs[f] is a, s, e, sorted(m)) for f, s, e, m in spans)
    assert got == [
        ("s/c/0", False, 0, 10, [3]),  # another store's key of the same name: apart
        ("s/c/0", True, 0, 150, [0, 1, 2]),  # gaps of 10 and 40 bytes: one request
        ("s/c/0", True, 5000, 5010, [5]),  # 4850 bytes on: its own
        ("s/c/1", True, 0, 8, [4]),
    ]
    # gap 0: only ranges that touch or overlap
    touching = stores.merge_ranges(
        [a, a, a], ["k"] * 3, np.array([0, 10, 25]), np.array([10, 10, 5]), 0
    )
    assert sorted((s, e) for _, s, e, _ in touching) == [(0, 20), (25, 30)]


def test_sharded_reads_from_a_store_join_inner_chunk_ranges(
    store_factory: Callable, device: str
) -> None:
    """Inner chunks of a shard read through a zarr Store's ``get``: one request a shard
    (they are written one after the other), for the bytes of the inner chunks a
    selection needs; values as zarr's."""
    from zarr.abc.store import RangeByteRequest
    from zarr.storage import LocalStore

    path = store_factory(3, "sharded")
    requests: list[tuple[str, Any]] = []

    class Counting(LocalStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if key.startswith("t2m/c/") and isinstance(byte_range, RangeByteRequest):
                requests.append((key, byte_range))
            return await super().get(key, prototype, byte_range)

    gds = xr.open_dataset(Counting(path, read_only=True), engine="gds-zarr", device=device)
    ref = xr.open_dataset(path, engine="zarr")
    xr.testing.assert_identical(to_numpy(gds.load()), ref.load())
    per_shard: dict[str, int] = {}
    for key, _ in requests:
        per_shard[key] = per_shard.get(key, 0) + 1
    arr = zarr.open_array(path / "t2m", mode="r")
    n_inner = int(np.prod([s // c for s, c in zip(arr.shards, arr.chunks, strict=True)]))
    assert n_inner > 1 and per_shard and max(per_shard.values()) == 1

    # the first time chunk of each shard (half its inner chunks, stored first): one
    # request a shard, for less than the shard's bytes
    requests.clear()
    gds = xr.open_dataset(Counting(path, read_only=True), engine="gds-zarr", device=device)
    part = gds.t2m[: arr.chunks[0]].load()
    xr.testing.assert_identical(to_numpy(part), ref.t2m[: arr.chunks[0]].load())
    keys = [k for k, _ in requests]
    assert keys and len(keys) == len(set(keys))
    for key, span in requests:
        assert span.end - span.start < (path / key).stat().st_size

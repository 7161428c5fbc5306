"""xarray_gds.to_zarr: datasets on either device written like Dataset.to_zarr does."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr

import xarray_gds

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore:xarray-gds. array .* encoded there:RuntimeWarning"),
]


@pytest.fixture(autouse=True, params=["zarr", "batched"])
def host_writer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Host values written by zarr-python (the default) or by the batched encoder that
    device values take (``XARRAY_GDS_BATCHED_HOST_WRITES=1``), so CI runs its logic:
    merging partial chunks, empty chunks, byte layout, stream framing."""
    device = request.node.callspec.params.get("device", "cpu")
    if request.param == "batched":
        if device == "cuda":
            pytest.skip("device values always take the batched encoder")
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    return str(request.param)


ROUND_TRIPS = [
    (3, "zstd"),
    (3, "gzip"),
    (3, "none"),
    (3, "sharded"),
    (3, "blosc"),
    (3, "big-endian"),
    (2, "zstd"),
    (2, "lz4"),
    (2, "zlib"),
    (2, "gzip"),
    (2, "blosc"),
    (2, "shuffle-zstd"),
]


def _open(path: Path) -> xr.Dataset:
    return xr.open_dataset(path, engine="zarr").load()


def _xarray_round_trip(src: Path, tmp_path: Path, **kwargs: Any) -> xr.Dataset:
    """What xarray alone gives for read -> to_zarr -> read (the reference: CF encoding
    does not round-trip every variable exactly, e.g. ``_Unsigned`` with a fill value)."""
    out = tmp_path / "xarray-round-trip.zarr"
    xr.open_dataset(src, engine="zarr").to_zarr(out, mode="w", **kwargs)
    return _open(out)


@pytest.mark.parametrize("levels", ["host", "gpu"])
@pytest.mark.parametrize(("zarr_format", "codec"), ROUND_TRIPS)
def test_round_trip_keeps_values_and_encoding(
    tmp_path: Path,
    store_factory: Callable,
    device: str,
    zarr_format: int,
    codec: str,
    levels: str,
) -> None:
    """engine="zarr"-written store -> gds-zarr read -> to_zarr -> engine="zarr" read.

    The stores set levels other than the codecs' defaults: ``levels="gpu"`` sends
    every codec with a GPU encoder through it, ``"host"`` those at default levels."""
    src = store_factory(zarr_format, codec)
    # xarray + zarr cannot write back a v2 string variable they read (both engines)
    skip = {"drop_variables": ["station"]}
    gds = xr.open_dataset(src, engine="gds-zarr", device=device, **skip)
    out, out_ref = tmp_path / "out.zarr", tmp_path / "ref.zarr"
    xarray_gds.to_zarr(gds, out, zarr_format=zarr_format, levels=levels)
    # the reference: the same round trip with xarray's own reader and writer
    xr.open_dataset(src, engine="zarr", **skip).to_zarr(out_ref, zarr_format=zarr_format)
    ref = xr.open_dataset(out_ref, engine="zarr")
    got = xr.open_dataset(out, engine="zarr")
    xr.testing.assert_identical(got.load(), ref.load())
    for name in ("t2m", "u10", "qc"):
        for key in ("chunks", "shards", "compressors", "filters", "dtype"):
            assert got[name].encoding.get(key) == ref[name].encoding.get(key), (name, key)
        fills = [np.asarray(e.get("_FillValue")) for e in (got[name].encoding, ref[name].encoding)]
        np.testing.assert_array_equal(*fills)
    # the stored bytes decode to the same raw values
    for name in ("t2m", "u10", "qc"):
        raw = xr.open_dataset(out, engine="zarr", mask_and_scale=False)[name].values
        raw_ref = xr.open_dataset(out_ref, engine="zarr", mask_and_scale=False)[name].values
        np.testing.assert_array_equal(raw, raw_ref)
    # and it reads back through the engine as it was written
    again = xr.open_dataset(out, engine="gds-zarr", device=device)
    xr.testing.assert_identical(again.load().as_numpy(), ref.load())


def test_loaded_device_values_are_written(tmp_path: Path, v3_store: Path, device: str) -> None:
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device=device).load()
    on_device = hasattr(gds.t2m.data, "__cuda_array_interface__")
    assert on_device == (device == "cuda")
    xarray_gds.to_zarr(gds, tmp_path / "out.zarr")
    want = _xarray_round_trip(v3_store, tmp_path)
    xr.testing.assert_identical(_open(tmp_path / "out.zarr"), want)


def test_modes_match_xarray(tmp_path: Path, v3_store: Path, device: str) -> None:
    """w, append_dim, w-, region (dict and "auto") with mode r+: as engine="zarr" does."""
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device=device)
    ref = xr.open_dataset(v3_store, engine="zarr")
    ours, theirs = tmp_path / "ours.zarr", tmp_path / "theirs.zarr"
    head, tail = {"time": slice(0, 4)}, {"time": slice(4, None)}
    xarray_gds.to_zarr(gds.isel(head), ours, mode="w")
    ref.isel(head).to_zarr(theirs, mode="w")
    xarray_gds.to_zarr(gds.isel(tail), ours, append_dim="time")
    ref.isel(tail).to_zarr(theirs, append_dim="time")
    xr.testing.assert_identical(_open(ours), _open(theirs))
    with pytest.raises(FileExistsError):
        ref.to_zarr(theirs, mode="w-")
    with pytest.raises(FileExistsError):
        xarray_gds.to_zarr(gds, ours, mode="w-")

    def update(ds: xr.Dataset) -> xr.Dataset:
        part = ds[["t2m", "u10"]].drop_vars(["area"]).isel(time=slice(2, 6))
        return part + 1.5

    region = {"time": slice(2, 6)}
    no_index = ["lat", "lon", "time"]
    xarray_gds.to_zarr(update(gds).drop_vars(no_index), ours, region=region, mode="r+")
    update(ref).drop_vars(no_index).to_zarr(theirs, region=region, mode="r+")
    xr.testing.assert_identical(_open(ours), _open(theirs))
    xarray_gds.to_zarr(update(gds) * 2, ours, region="auto", mode="r+")
    (update(ref) * 2).to_zarr(theirs, region="auto", mode="r+")
    xr.testing.assert_identical(_open(ours), _open(theirs))


def test_dask_compute_false_and_empty_chunks(tmp_path: Path, v3_store: Path, device: str) -> None:
    pytest.importorskip("dask.array")
    kw: dict[str, Any] = {"chunks": {}}
    if device == "cuda":
        kw["chunked_array_type"] = "gds-dask"  # CuPy blocks and meta
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device=device, **kw)
    want = _xarray_round_trip(v3_store, tmp_path)
    out = tmp_path / "out.zarr"
    delayed = xarray_gds.to_zarr(gds, out, compute=False, write_empty_chunks=False)
    assert (out / "t2m" / "zarr.json").exists()
    assert not (out / "t2m" / "c" / "1" / "1" / "1").exists()  # nothing written yet
    delayed.compute()
    xr.testing.assert_identical(_open(out), want)
    # the chunk of t2m that is all NaN (the fill value) was not written
    assert not (out / "t2m" / "c" / "0" / "0" / "0").exists()
    assert (out / "t2m" / "c" / "1" / "1" / "1").exists()


def test_failed_write_leaves_whole_chunks(
    tmp_path: Path, v3_store: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails half way: the store opens, every chunk is old or new.

    The failure is injected where a chunk's bytes, fully written to a temporary file,
    would replace the chunk: a store that wrote chunks in place could be left torn.
    """
    path = tmp_path / "store.zarr"
    shutil.copytree(v3_store, path)
    gds = xr.open_dataset(path, engine="gds-zarr", device=device)
    new = gds[["t2m"]].drop_vars(["area", "lat", "lon", "time"]) + 1000.0
    real_replace = os.replace
    replaced: list[str] = []

    def flaky_replace(source: Any, target: Any) -> Any:
        target = Path(target)
        if path in target.parents and "t2m" in target.parts and target.name != "zarr.json":
            if len(replaced) == 5:
                raise OSError("disk full (injected)")
            replaced.append(str(target))
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", flaky_replace)
    with pytest.raises(OSError, match="injected"):
        xarray_gds.to_zarr(new, path, region={"time": slice(None)}, mode="r+")
    monkeypatch.undo()
    got = xr.open_dataset(path, engine="zarr").t2m.values
    old = xr.open_dataset(v3_store, engine="zarr").t2m.values
    n_new = n_changing = 0
    for t in range(0, got.shape[0], 4):
        for y in range(0, got.shape[1], 4):
            for x in range(0, got.shape[2], 5):
                sl = (slice(t, t + 4), slice(y, y + 4), slice(x, x + 5))
                n_changing += not np.isnan(old[sl]).all()
                if np.array_equal(got[sl], old[sl], equal_nan=True):
                    continue
                np.testing.assert_array_equal(got[sl], old[sl] + 1000.0)  # never torn
                n_new += 1
    # the chunks written before the failure (and those already in flight) are new; the
    # one whose write failed is old
    assert 5 <= n_new < n_changing
    assert not list(path.rglob("*.partial"))  # no temporary file left behind


@pytest.mark.needs("fsspec")
def test_which_store_each_target_writes_through(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every store is written with held metadata around it: local paths as a GdsStore,
    zarr Stores as they are, other URLs (fsspec's, e.g. memory://) as zarr's
    FsspecStore (the engine's pipeline is given to the arrays of that one store
    object)."""
    from zarr.storage import FsspecStore, MemoryStore

    from xarray_gds.deferred import HeldMetadataStore

    seen: list[Any] = []
    monkeypatch.setattr(xr.Dataset, "to_zarr", lambda self, store, **kw: seen.append(store))
    ds = xr.Dataset({"a": ("x", np.arange(3))})
    store = xarray_gds.GdsStore(tmp_path / "s.zarr", read_only=False)
    xarray_gds.to_zarr(ds, store)
    xarray_gds.to_zarr(ds, str(tmp_path / "local.zarr"))
    memory = MemoryStore()
    xarray_gds.to_zarr(ds, memory)
    xarray_gds.to_zarr(ds, "memory://out.zarr", mode="w")
    assert all(isinstance(s, HeldMetadataStore) for s in seen)
    assert seen[0].store is store and isinstance(seen[1].store, xarray_gds.GdsStore)
    assert seen[1].store.root == tmp_path / "local.zarr"
    assert seen[2].store is memory
    assert isinstance(seen[3].store, FsspecStore)
    assert seen[3].store.path.endswith("out.zarr")


class _RecordingStore:
    """A MemoryStore that records each key set, and fails setting ``fail_key``."""

    @staticmethod
    def make(fail_key: str | None = None) -> Any:
        from zarr.storage import MemoryStore

        class Recording(MemoryStore):
            sets: list[str]
            failing: bool

            async def set(self, key: str, value: Any, byte_range: Any = None) -> None:
                if key == fail_key and self.failing:
                    self.failing = False  # once: putting the old document back works
                    raise OSError(f"injected failure writing {key}")
                self.sets.append(key)
                await super().set(key, value)

        store = Recording()
        store.sets = []
        store.failing = False
        return store


def _dask_dataset(fail_block: int | None = None) -> xr.Dataset:
    """Six time steps in three dask blocks; block ``fail_block`` raises when computed."""
    import dask.array as da

    values = np.arange(6 * 4 * 5, dtype="f4").reshape(6, 4, 5)

    def block(x: np.ndarray, block_info: Any = None) -> np.ndarray:
        if block_info is not None and block_info[0]["chunk-location"][0] == fail_block:
            raise RuntimeError("block failed (injected)")
        return x

    t = da.from_array(values, chunks=(2, 4, 5)).map_blocks(block, dtype="f4")
    return xr.Dataset({"t": (("time", "y", "x"), t)}, coords={"time": np.arange(6)})


@pytest.mark.needs("dask")
def test_any_store_gets_its_metadata_last() -> None:
    store = _RecordingStore.make()
    ds = _dask_dataset()
    xarray_gds.to_zarr(ds, store, mode="w", consolidated=True)
    names = [k.rsplit("/", 1)[-1] for k in store.sets]
    metadata = [i for i, n in enumerate(names) if n == "zarr.json"]
    chunks = [i for i, n in enumerate(names) if n != "zarr.json"]
    assert chunks and metadata and max(chunks) < min(metadata)
    assert store.sets[-1] == "zarr.json"  # the root, with the consolidated metadata
    xr.testing.assert_identical(xr.open_dataset(store, engine="zarr").load(), ds.compute())


@pytest.mark.needs("dask")
def test_failed_write_to_any_store_leaves_it_as_it_was() -> None:
    import dask

    store = _RecordingStore.make()
    with pytest.raises(RuntimeError, match="injected"), dask.config.set(scheduler="synchronous"):
        xarray_gds.to_zarr(_dask_dataset(fail_block=1), store, mode="w", consolidated=False)
    assert store.sets  # a chunk was written before the failure ...
    assert dict(store._store_dict) == {}  # ... and removed: no metadata, no chunks
    ds = _dask_dataset()
    xarray_gds.to_zarr(ds, store, mode="w", consolidated=False)
    before = dict(store._store_dict)
    with pytest.raises(RuntimeError, match="injected"), dask.config.set(scheduler="synchronous"):
        xarray_gds.to_zarr(_dask_dataset(fail_block=2), store, append_dim="time")
    assert {k: v.to_bytes() for k, v in store._store_dict.items() if k.endswith("zarr.json")} == {
        k: v.to_bytes() for k, v in before.items() if k.endswith("zarr.json")
    }
    got = xr.open_dataset(store, engine="zarr", consolidated=False).load()
    xr.testing.assert_identical(got, ds.compute())


@pytest.mark.needs("dask")
def test_failed_metadata_write_puts_the_old_back() -> None:
    store = _RecordingStore.make(fail_key="zarr.json")
    ds = _dask_dataset()
    xarray_gds.to_zarr(ds, store, mode="w", consolidated=False)
    before = {k: v.to_bytes() for k, v in store._store_dict.items() if k.endswith("zarr.json")}
    store.failing = True  # the root document fails: written after t's, which is put back
    with pytest.raises(OSError, match=r"injected failure writing zarr\.json"):
        xarray_gds.to_zarr(ds, store, append_dim="time")
    after = {k: v.to_bytes() for k, v in store._store_dict.items() if k.endswith("zarr.json")}
    assert after == before
    got = xr.open_dataset(store, engine="zarr", consolidated=False).load()
    xr.testing.assert_identical(got, ds.compute())


def _recording_replace(
    monkeypatch: pytest.MonkeyPatch, root: Path, fail_at: int | None
) -> list[str]:
    """Record the files renamed into place below ``root`` (in order; CuPy also renames
    files into its kernel cache); optionally fail at chunk ``fail_at``."""
    real_replace = os.replace
    renamed: list[str] = []

    def replace(source: Any, target: Any) -> Any:
        if root not in Path(target).parents:
            return real_replace(source, target)
        name = Path(target).name
        chunks = [r for r in renamed if not r.endswith(("zarr.json", ".zarray", ".zattrs"))]
        if fail_at is not None and name not in ("zarr.json",) and len(chunks) == fail_at:
            raise OSError("disk full (injected)")
        renamed.append(str(target))
        return real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    return renamed


def test_metadata_is_written_after_the_data(
    tmp_path: Path, v3_store: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device=device)
    out = tmp_path / "out.zarr"
    with monkeypatch.context() as patch:
        renamed = _recording_replace(patch, out, None)
        xarray_gds.to_zarr(gds, out, consolidated=True)
    metadata = [i for i, r in enumerate(renamed) if Path(r).name == "zarr.json"]
    chunks = [i for i, r in enumerate(renamed) if Path(r).name != "zarr.json"]
    assert chunks and metadata
    assert max(chunks) < min(metadata)  # every chunk file before any metadata
    assert renamed[-1] == str(out / "zarr.json")  # the root (consolidated) last
    xr.testing.assert_identical(_open(out), _xarray_round_trip(v3_store, tmp_path))


def test_failed_append_leaves_the_store_as_it_was(
    tmp_path: Path, v3_store: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store.zarr"
    shutil.copytree(v3_store, path)
    before = _open(path)
    gds = xr.open_dataset(path, engine="gds-zarr", device=device)
    more = gds.isel(time=slice(0, 4)).load()
    with monkeypatch.context() as patch:
        _recording_replace(patch, path, 3)
        with pytest.raises(OSError, match="injected"):
            xarray_gds.to_zarr(more, path, append_dim="time")
    # the metadata still describes the old arrays: the appended chunks are not visible
    xr.testing.assert_identical(_open(path), before)
    assert not list(path.rglob("*.partial"))

"""Host values written by ``xarray_gds.to_zarr`` go through zarr's own
``FusedCodecPipeline`` (``GdsCodecPipeline._host_writer``): each chunk merged, checked,
encoded and stored as one task, through the store's synchronous methods. The chunk
files must be byte for byte those xarray's own ``to_zarr`` writes (zarr's batched
pipeline, the same codecs), for every pattern; stores whose synchronous methods are not
those of their async ones keep zarr's batched pipeline, so an override of ``set`` sees
every chunk.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr.codecs as zc
from zarr.core.codec_pipeline import BatchedCodecPipeline, FusedCodecPipeline
from zarr.storage import FsspecStore, LocalStore, MemoryStore

import xarray_gds
from xarray_gds.deferred import HeldMetadataStore
from xarray_gds.pipeline import _sync_io_matches
from xarray_gds.stores.local import GdsStore

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore:.*[Cc]onsolidated metadata.*:UserWarning"),
]

_METADATA = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}


def _dataset(nt: int = 8, t0: int = 0) -> xr.Dataset:
    rng = np.random.default_rng(t0)
    f4 = np.round(rng.normal(280, 5, (nt, 12, 10)), 2).astype("f4")
    if t0 == 0:
        f4[2:4] = np.nan  # chunks of the fill value only: left out
    return xr.Dataset(
        {
            "t": (("time", "y", "x"), f4),
            "n": (("time", "y", "x"), rng.integers(-9, 9, (nt, 12, 10)).astype("i2")),
        },
        coords={"time": pd.date_range("2001-01-01", periods=nt, freq="D") + pd.Timedelta(days=t0)},
    )


def _files(path: Path) -> dict[str, bytes]:
    """Every chunk file below ``path`` and its bytes."""
    out = {}
    for d, _, names in os.walk(path):
        for name in names:
            if name not in _METADATA:
                full = os.path.join(d, name)
                out[os.path.relpath(full, path)] = Path(full).read_bytes()
    return out


def _same_bytes(ours: Path, theirs: Path) -> None:
    xr.testing.assert_identical(
        xr.open_dataset(ours, engine="zarr").load(), xr.open_dataset(theirs, engine="zarr").load()
    )
    got, want = _files(ours), _files(theirs)
    assert sorted(got) == sorted(want)
    assert want  # chunks were written
    different = [k for k in want if got[k] != want[k]]
    assert not different


ENCODINGS: dict[str, tuple[int, Any, dict[str, Any]]] = {
    "v3-zstd": (3, [zc.ZstdCodec(level=3)], {}),
    "v3-sharded": (3, [zc.ZstdCodec()], {"shards": (4, 12, 10)}),
    "v2-blosc": (2, [numcodecs.Blosc("lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)], {}),
    "v2-zlib": (2, [numcodecs.Zlib(level=1)], {}),
}


def _calls(case: str, pattern: str) -> list[tuple[xr.Dataset, dict[str, Any]]]:
    fmt, compressors, extra = ENCODINGS[case]
    chunks = (2, 6, 10) if "shards" not in extra else (1, 6, 5)
    ds = _dataset()
    encoding = {v: {"chunks": chunks, "compressors": compressors, **extra} for v in ds.data_vars}
    first = {"mode": "w", "encoding": encoding, "zarr_format": fmt}
    if pattern == "eager":
        return [(ds, first)]
    # steps that start and end inside chunks (existing ones merged); whole shards
    edges = [0, 4, 8] if "shards" in extra else [0, 3, 5, 7, 9]
    if pattern == "append":
        return [(ds.isel(time=slice(0, edges[1])), first)] + [
            (_dataset(b - a, a), {"append_dim": "time"}) for a, b in itertools.pairwise(edges[1:])
        ]
    if pattern == "region":  # a template, then its regions
        da = pytest.importorskip("dask.array")
        template = ds.copy(data={v: da.zeros_like(ds[v].data) for v in ds.data_vars})
        regions = [slice(a, min(b, 8)) for a, b in itertools.pairwise(edges)]
        return [(template, {**first, "compute": False})] + [
            (ds.isel(time=r).drop_vars("time"), {"region": {"time": r}}) for r in regions
        ]
    if pattern == "dask":
        pytest.importorskip("dask")
        return [(ds.chunk({"time": 4}), first)]
    raise AssertionError(pattern)


@pytest.mark.parametrize("pattern", ["eager", "append", "region", "dask"])
@pytest.mark.parametrize("case", list(ENCODINGS))
def test_chunk_files_are_xarrays_byte_for_byte(tmp_path: Path, case: str, pattern: str) -> None:
    ours, theirs = tmp_path / "ours.zarr", tmp_path / "theirs.zarr"
    for ds, kwargs in _calls(case, pattern):
        xarray_gds.to_zarr(ds, ours, **kwargs)
        ds.to_zarr(theirs, **kwargs)
    _same_bytes(ours, theirs)


def _spy(base: type) -> Any:
    """A subclass of ``base`` recording which of its methods wrote each key (both the
    async and the synchronous ``set`` overridden, in one class)."""

    class Spy(base):  # type: ignore[misc,valid-type]
        via: dict[str, str]

        async def set(self, key: str, value: Any, byte_range: Any = None) -> None:
            self.via[key] = "async"
            await super().set(key, value)

        def set_sync(self, key: str, value: Any) -> None:
            self.via[key] = threading.current_thread().name
            super().set_sync(key, value)

    return Spy


def test_host_chunks_are_written_by_zarrs_fused_pipeline(tmp_path: Path) -> None:
    """Through xarray-gds, every chunk of host values is stored by the synchronous
    ``set`` on zarr's pool threads or the engine's; xarray's own write (zarr's batched
    pipeline) stores them through the async one. The metadata is held and written at
    the end either way."""
    ds = _dataset()
    encoding = {v: {"chunks": (2, 6, 10)} for v in ds.data_vars}
    ours = _spy(LocalStore)(tmp_path / "ours.zarr")
    ours.via = {}
    xarray_gds.to_zarr(ds, ours, mode="w", encoding=encoding)
    theirs = _spy(LocalStore)(tmp_path / "theirs.zarr")
    theirs.via = {}
    ds.to_zarr(theirs, mode="w", encoding=encoding)

    def chunks(via: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in via.items() if k.startswith(("t/c/", "n/c/"))}

    assert set(chunks(ours.via)) == set(chunks(theirs.via))
    assert len(chunks(ours.via)) == 2 * 4 * 2 - 2  # two chunks of t hold NaN only: left out
    assert not {"async", "MainThread"} & set(chunks(ours.via).values())
    assert all(
        v.startswith(("ThreadPoolExecutor", "xarray-gds")) for v in chunks(ours.via).values()
    )
    assert set(chunks(theirs.via).values()) == {"async"}
    _same_bytes(tmp_path / "ours.zarr", tmp_path / "theirs.zarr")


def test_a_store_that_overrides_only_set_sees_every_chunk(tmp_path: Path) -> None:
    """A store subclass that overrides the async ``set`` alone (to record or change what
    is written) is written through it: zarr's batched pipeline, as xarray writes it."""
    seen: list[str] = []

    class Recording(MemoryStore):
        async def set(self, key: str, value: Any, byte_range: Any = None) -> None:
            seen.append(key)
            await super().set(key, value)

    store = Recording()
    ds = _dataset()
    xarray_gds.to_zarr(ds, store, mode="w", encoding={v: {"chunks": (2, 6, 10)} for v in ds})
    assert len([k for k in seen if k.startswith(("t/c/", "n/c/"))]) == 14
    xr.testing.assert_identical(xr.open_dataset(store, engine="zarr").load(), ds)


@pytest.mark.needs("fsspec")
def test_sync_io_matches(tmp_path: Path) -> None:
    class OnlySet(LocalStore):
        async def set(self, key: str, value: Any, byte_range: Any = None) -> None:
            await super().set(key, value)

    local = GdsStore(tmp_path / "a.zarr", read_only=False)
    assert _sync_io_matches(local)
    assert _sync_io_matches(MemoryStore())
    assert _sync_io_matches(_spy(LocalStore)(tmp_path / "b.zarr"))
    assert not _sync_io_matches(OnlySet(tmp_path / "c.zarr"))
    assert not _sync_io_matches(None)
    assert not _sync_io_matches(FsspecStore.from_url("memory://x.zarr"))  # no sync IO
    held = HeldMetadataStore(OnlySet(tmp_path / "d.zarr"))
    try:
        assert not _sync_io_matches(held)  # what it wraps counts
    finally:
        held.discard()
    held = HeldMetadataStore(local)
    try:
        assert _sync_io_matches(held)
    finally:
        held.discard()


def test_host_writer_is_zarrs_fused_pipeline_where_codecs_encode_synchronously(
    tmp_path: Path,
) -> None:
    """The pipeline an array of the write gets keeps zarr's batched pipeline for the
    rest and writes host values with zarr's fused one over the same codecs."""
    import zarr

    from xarray_gds.pipeline import GdsCodecPipeline, writing_to

    store = GdsStore(tmp_path / "a.zarr", read_only=False)
    with writing_to(store):
        array = zarr.create_array(
            store, name="a", shape=(4, 6), chunks=(2, 3), dtype="f4", compressors=zc.ZstdCodec()
        )
        pipe = array._async_array.codec_pipeline
        assert isinstance(pipe, GdsCodecPipeline)
        assert isinstance(pipe._fallback, BatchedCodecPipeline)
        array[:] = np.arange(24, dtype="f4").reshape(4, 6)
        writer = pipe._fused
    assert isinstance(writer, FusedCodecPipeline)
    assert writer.sync_transform is not None
    assert [type(c) for c in writer] == [type(c) for c in pipe._fallback]
    np.testing.assert_array_equal(
        zarr.open_array(tmp_path / "a.zarr", path="a")[:], np.arange(24).reshape(4, 6)
    )


def test_write_workers_follow_zarrs_setting(tmp_path: Path) -> None:
    import zarr

    from xarray_gds.pipeline import _write_workers

    with zarr.config.set({"codec_pipeline.max_workers": None}):
        assert _write_workers() == (os.cpu_count() or 1)
    with zarr.config.set({"codec_pipeline.max_workers": 3}):
        assert _write_workers() == 3
    ds = _dataset()
    with zarr.config.set({"codec_pipeline.max_workers": 1}):  # one thread: still the same
        xarray_gds.to_zarr(
            ds, tmp_path / "one.zarr", encoding={v: {"chunks": (2, 6, 10)} for v in ds}
        )
    xr.testing.assert_identical(xr.open_dataset(tmp_path / "one.zarr", engine="zarr").load(), ds)
    with (
        zarr.config.set({"codec_pipeline.max_workers": "many"}),
        pytest.raises(ValueError, match=r"codec_pipeline\.max_workers.*'many'"),
    ):
        xarray_gds.to_zarr(ds, tmp_path / "bad.zarr")

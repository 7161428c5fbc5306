"""NetCDF4/HDF5 files read through kerchunk reference sets (xarray_gds.stores.refs).

Every file is written here with h5py or netCDF4; its references are made with kerchunk's
HDF5 scanner (and VirtualiZarr where it installs), and every read is compared with
``engine="h5netcdf"`` on the file itself and with ``engine="zarr"`` over the same
references (fsspec's reference filesystem).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
from packaging.version import Version

from xarray_gds.stores import refs as refs_module
from xarray_gds.stores.refs import ReferenceStore, ReferenceTargetError, is_reference_set

pytest.importorskip("h5netcdf")  # the reference reader is engine="h5netcdf"
h5py = pytest.importorskip("h5py")  # the test extra has these; not every GPU image
netCDF4 = pytest.importorskip("netCDF4")
kerchunk_hdf = pytest.importorskip("kerchunk.hdf")  # the refs extra


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The garbage collector off while references are made: kerchunk holds h5py's global
    lock while it waits for zarr's event loop thread, and a collection there that frees
    an h5py object (left by an earlier test) waits for that lock, so neither thread
    moves on."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def kerchunk_refs(path: Path, inline_threshold: int = 0) -> dict[str, Any]:
    """kerchunk's references to every variable of ``path`` (version 1 dict)."""
    with no_gc():
        scanner = kerchunk_hdf.SingleHdf5ToZarr(str(path), inline_threshold=inline_threshold)
        return scanner.translate()


def open_gds(refs: Any, device: str, **kwargs: Any) -> xr.Dataset:
    return xr.open_dataset(refs, engine="gds-zarr", device=device, **kwargs)


def open_zarr_refs(refs: Any, **kwargs: Any) -> xr.Dataset:
    """zarr-python over the same references (fsspec's reference filesystem)."""
    return xr.open_dataset(
        "reference://",
        engine="zarr",
        # remote_protocol: see test_parquet_group_listed_before_its_arrays
        backend_kwargs={
            "storage_options": {"fo": refs, "remote_protocol": "file"},
            "consolidated": False,
        },
        **kwargs,
    )


def assert_on(ds: xr.Dataset, device: str) -> None:
    """Non-index numeric variables on the device (CuPy) with ``device="cuda"``, else numpy."""
    for name, var in ds.variables.items():
        on_device = hasattr(var.data, "__cuda_array_interface__")
        numeric = var.dtype.kind in "biufc" and var.dims != (name,) and var.ndim > 0
        assert on_device == (device == "cuda" and numeric), (name, type(var.data))


def host_warnings(record: Any) -> list[str]:
    return [str(w.message) for w in record if "xarray-gds: array" in str(w.message)]


class _Spy:
    """Counts the batches that :func:`xarray_gds.stores.refs.read_references` reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.ranges = 0
        real = refs_module.read_references

        def spy(refs: Any, on_device: bool, stores: Any) -> Any:
            self.calls += 1
            self.ranges += sum(r is not None and r.data is None for r in refs)
            return real(refs, on_device, stores)

        monkeypatch.setattr(refs_module, "read_references", spy)


# -- files ------------------------------------------------------------------------------


@pytest.fixture
def nc_file(tmp_path: Path) -> Path:
    """A NetCDF4 file like an archive's: an unlimited time axis, CF time units, zlib +
    shuffle chunks with a _FillValue and scale_factor (and some masked values), a
    contiguous variable, a big-endian variable, a never-written chunk and a group."""
    path = tmp_path / "archive.nc"
    rng = np.random.default_rng(0)
    with netCDF4.Dataset(path, "w") as d:
        d.title = "test archive"
        d.createDimension("time", None)
        d.createDimension("lat", 24)
        d.createDimension("lon", 36)
        t = d.createVariable("time", "f8", ("time",))
        t.units = "hours since 2000-01-01"
        t.calendar = "standard"
        t[:] = np.arange(6) * 6.0
        lat = d.createVariable("lat", "f4", ("lat",))
        lat[:] = np.linspace(-90, 90, 24)
        lon = d.createVariable("lon", "f4", ("lon",))
        lon[:] = np.linspace(0, 350, 36)
        t2m = d.createVariable(
            "t2m",
            "i2",
            ("time", "lat", "lon"),
            zlib=True,
            complevel=5,
            shuffle=True,
            chunksizes=(1, 12, 18),
            fill_value=np.int16(-32767),
        )
        t2m.scale_factor = 0.01
        t2m.add_offset = 273.15
        t2m.units = "K"
        t2m.set_auto_maskandscale(False)
        raw = rng.integers(-3000, 3000, size=(6, 24, 36), dtype=np.int16)
        raw[2, :3, :4] = -32767  # masked on decode
        t2m[:] = raw
        precip = d.createVariable(
            "precip", "f4", ("time", "lat", "lon"), zlib=True, complevel=1, chunksizes=(2, 24, 36)
        )
        precip[:] = rng.gamma(2.0, size=(6, 24, 36)).astype("f4")
        mask = d.createVariable("land", "u1", ("lat", "lon"), contiguous=True)
        mask[:] = (rng.random((24, 36)) > 0.5).astype("u1")
        big = d.createVariable(
            "height", ">f8", ("lat", "lon"), endian="big", zlib=True, chunksizes=(8, 12)
        )
        big[:] = rng.normal(100.0, 10.0, size=(24, 36))
        sparse = d.createVariable(
            "sparse", "f4", ("lat", "lon"), chunksizes=(12, 18), fill_value=np.float32(-1.0)
        )
        sparse[:12, :18] = 5.0  # three chunks never written: fill value (masked)
        g = d.createGroup("ocean")
        g.createDimension("depth", 5)
        sst = g.createVariable(
            "sst", "f4", ("depth", "lat", "lon"), zlib=True, shuffle=True, chunksizes=(1, 24, 36)
        )
        sst[:] = rng.normal(15.0, 3.0, size=(5, 24, 36)).astype("f4")
    return path


@pytest.fixture(params=["dict", "json", "parquet"])
def refs_form(request: pytest.FixtureRequest, nc_file: Path, tmp_path: Path) -> Any:
    """The references of ``nc_file`` as a dict, a JSON file or a Parquet directory."""
    refs = kerchunk_refs(nc_file, inline_threshold=300)
    if request.param == "dict":
        return refs
    if request.param == "json":
        out = tmp_path / "archive.json"
        out.write_text(json.dumps(refs))
        return str(out)
    pytest.importorskip("fastparquet", reason="Parquet references need fastparquet")
    from kerchunk.df import refs_to_dataframe

    out = tmp_path / "archive.parq"
    refs_to_dataframe(refs, str(out), record_size=4)
    return str(out)


def _null_paths_read_as_nan(refs: Any) -> bool:
    """Whether a Parquet reference set's null paths (chunks the file never wrote) come
    back as a missing value other than None (NaN, or pandas 3's ``pd.NA``): some pandas
    versions read them so, and fsspec's reference filesystem (engine="zarr"'s reader
    here) then fails on them with a TypeError. The engine reads them as missing chunks
    (test_reference_without_a_target_reads_as_missing)."""
    if not (isinstance(refs, str) and refs.endswith(".parq")):
        return False
    from fsspec.implementations.reference import LazyReferenceMapper

    mapper = LazyReferenceMapper(refs)
    assert "sparse/.zarray" in mapper.zmetadata  # (loads the set: open_refs exists after)
    records = mapper.open_refs("sparse", 0)
    return any(p is not None and not isinstance(p, str) for p in records["path"])


# -- values -----------------------------------------------------------------------------


def test_matches_h5netcdf_and_zarr(
    nc_file: Path, refs_form: Any, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(monkeypatch)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = open_gds(refs_form, device).load()
    assert host_warnings(record) == []  # every variable decoded in batches
    assert spy.calls >= 1 and spy.ranges > 0  # chunks read by byte range from the file
    assert_on(got, device)
    ref = xr.open_dataset(nc_file, engine="h5netcdf").load()
    xr.testing.assert_identical(got.as_numpy(), ref)
    if not _null_paths_read_as_nan(refs_form):
        xr.testing.assert_identical(got.as_numpy(), open_zarr_refs(refs_form).load())
    assert np.isnan(got.t2m.as_numpy().values[2, :3, :4]).all()  # _FillValue masked
    assert got.time.dtype == np.dtype("datetime64[ns]")


def test_parquet_group_listed_before_its_arrays(
    nc_file: Path, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsspec walks the top-level directories of a Parquet set in set order to find the
    target protocol, and a group's directory (no .zarray) raised KeyError when it came
    first; the store names the protocol so that order no longer matters."""
    pytest.importorskip("fastparquet", reason="Parquet references need fastparquet")
    from fsspec.implementations.reference import LazyReferenceMapper
    from kerchunk.df import refs_to_dataframe

    out = tmp_path / "archive.parq"
    refs_to_dataframe(kerchunk_refs(nc_file, inline_threshold=300), str(out), record_size=4)
    listdir = LazyReferenceMapper.listdir
    monkeypatch.setattr(
        LazyReferenceMapper,
        "listdir",
        lambda self: sorted(listdir(self), key=lambda f: f != "ocean"),
    )
    with pytest.raises(KeyError, match=r"ocean/\.zarray"):  # fsspec's own walk, unnamed
        xr.open_dataset(
            "reference://",
            engine="zarr",
            backend_kwargs={"storage_options": {"fo": str(out)}, "consolidated": False},
        )
    got = open_gds(str(out), device).load()
    ref = xr.open_dataset(nc_file, engine="h5netcdf").load()
    xr.testing.assert_identical(got.as_numpy(), ref)
    sub = open_gds(str(out), device, group="ocean").load()
    xr.testing.assert_identical(
        sub.as_numpy().rename({"ocean/depth": "depth"}),  # kerchunk's name for the dim
        xr.open_dataset(nc_file, engine="h5netcdf", group="ocean").load(),
    )


@pytest.mark.parametrize("no_path", [None, float("nan"), ""])
def test_reference_without_a_target_reads_as_missing(
    nc_file: Path, device: str, no_path: Any
) -> None:
    """A chunk reference with no path (Parquet sets store null, which some pandas
    versions read back as NaN) is a missing chunk: the fill value. (fsspec cannot take
    such a reference in a dict, so it is put into the store's references after.)"""
    store = refs_module.ReferenceStore(kerchunk_refs(nc_file, inline_threshold=300))
    store.fs.references["sparse/0.0"] = [no_path, 0, 0]  # the one chunk the file wrote
    got = xr.open_dataset(store, engine="gds-zarr", device=device).load()
    want = xr.open_dataset(nc_file, engine="h5netcdf").load()
    want["sparse"][:12, :18] = np.nan  # it held 5.0
    xr.testing.assert_identical(got.as_numpy(), want)


def test_raw_values_match(nc_file: Path, device: str) -> None:
    """Without CF decoding: the stored integers, big-endian doubles and fill values."""
    refs = kerchunk_refs(nc_file)
    got = open_gds(refs, device, mask_and_scale=False, decode_times=False).load()
    ref = xr.open_dataset(nc_file, engine="h5netcdf", mask_and_scale=False, decode_times=False)
    xr.testing.assert_identical(got.as_numpy(), ref.load())
    assert got.t2m.dtype == np.int16
    assert (got.sparse.as_numpy().values[12:, :] == -1.0).all()  # never-written chunks


def test_selections_and_dask(nc_file: Path, device: str) -> None:
    refs = kerchunk_refs(nc_file)
    ref = xr.open_dataset(nc_file, engine="h5netcdf")
    got = open_gds(refs, device)
    pick = {"time": slice(1, 5), "lat": slice(3, 20), "lon": [0, 7, 30]}
    xr.testing.assert_identical(got.isel(pick).load().as_numpy(), ref.isel(pick).load())
    lazy = open_gds(refs, device, chunks={})
    assert lazy.t2m.chunks is not None
    xr.testing.assert_identical(lazy.load().as_numpy(), ref.load())


def test_group_and_datatree(nc_file: Path, device: str) -> None:
    refs = kerchunk_refs(nc_file)
    got = open_gds(refs, device, group="ocean").load()
    assert_on(got, device)
    if Version(zarr.__version__) >= Version("3.4"):
        # engine="zarr" over the references opens this group with no variables with
        # zarr 3.3 (the lowest version claimed): compared with h5netcdf only there
        xr.testing.assert_identical(got.as_numpy(), open_zarr_refs(refs, group="ocean").load())
    # kerchunk names the group's own dimension by its HDF5 path
    ref = xr.open_dataset(nc_file, engine="h5netcdf", group="ocean").load()
    xr.testing.assert_identical(got.as_numpy().rename({"ocean/depth": "depth"}), ref)
    tree = xr.open_datatree(refs, engine="gds-zarr", device=device)
    assert set(tree.children) == {"ocean"}
    sub = tree["ocean"].to_dataset(inherit=False).load()
    xr.testing.assert_identical(sub.as_numpy(), got.as_numpy())


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("level", range(1, 10))
def test_zlib_levels(tmp_path: Path, level: int, shuffle: bool, device: str) -> None:
    path = tmp_path / "z.h5"
    x = np.linspace(0, 20, 60 * 70).reshape(60, 70)
    values = (np.sin(x) * 100 + np.cos(x.T.reshape(60, 70)) * 5).astype("f4")
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "v",
            data=values,
            chunks=(16, 32),
            compression="gzip",
            compression_opts=level,
            shuffle=shuffle,
        )
    refs = kerchunk_refs(path)
    meta = json.loads(refs["refs"]["v/.zarray"])
    ids = [f["id"] for f in meta["filters"]]
    assert ids == (["shuffle", "zlib"] if shuffle else ["zlib"])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = open_gds(refs, device).load()
    assert host_warnings(record) == []
    assert_on(got, device)
    np.testing.assert_array_equal(got.v.values if device == "cpu" else got.v.data.get(), values)
    xr.testing.assert_identical(got.as_numpy(), open_zarr_refs(refs).load())


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">i2", ">u4", ">i8", "<i4"])
@pytest.mark.parametrize("layout", ["chunked", "contiguous", "deflate"])
def test_byte_order(tmp_path: Path, dtype: str, layout: str, device: str) -> None:
    path = tmp_path / "b.h5"
    values = (np.arange(40 * 30).reshape(40, 30) * 3 - 500).astype(dtype)
    kwargs: dict[str, Any] = {}
    if layout != "contiguous":
        kwargs["chunks"] = (16, 16)
    if layout == "deflate":
        kwargs.update(compression="gzip", shuffle=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=values, **kwargs)
    refs = kerchunk_refs(path)
    assert json.loads(refs["refs"]["v/.zarray"])["dtype"] == np.dtype(dtype).str
    got = open_gds(refs, device, mask_and_scale=False).load()
    assert_on(got, device)
    assert got.v.dtype == np.dtype(dtype).newbyteorder("=")
    np.testing.assert_array_equal(got.v.to_numpy() if device == "cpu" else got.v.data.get(), values)
    xr.testing.assert_identical(got.as_numpy(), open_zarr_refs(refs, mask_and_scale=False).load())


def test_fill_values_and_unwritten_chunks(tmp_path: Path, device: str) -> None:
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset(
            "v", shape=(30, 40), dtype="i4", chunks=(10, 10), fillvalue=-7, compression="gzip"
        )
        d[:10, :10] = 1
        d[20:, 30:] = 2
        f.create_dataset("u", shape=(30, 40), dtype="f8", chunks=(15, 20), fillvalue=np.nan)
    refs = kerchunk_refs(path)
    assert "v/1.1" not in refs["refs"] and "u/0.0" not in refs["refs"]  # never written
    got = open_gds(refs, device, mask_and_scale=False).load()
    with h5py.File(path) as f:
        expected = f["v"][...]
    values = got.v.to_numpy() if device == "cpu" else got.v.data.get()
    np.testing.assert_array_equal(values, expected)
    assert (expected == -7).sum() > 0
    assert np.isnan(got.u.to_numpy() if device == "cpu" else got.u.data.get()).all()
    xr.testing.assert_identical(got.as_numpy(), open_zarr_refs(refs, mask_and_scale=False).load())


def test_inline_chunks(nc_file: Path, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks held in the reference set (base64 or text) decode with the others."""
    refs = kerchunk_refs(nc_file, inline_threshold=5000)
    chunk_values = [v for k, v in refs["refs"].items() if "/." not in k and "." not in k[:1]]
    inline = [v for v in chunk_values if isinstance(v, str)]
    ranged = [v for v in chunk_values if isinstance(v, list)]
    assert inline and ranged
    assert any(v.startswith("base64:") for v in inline)
    got = open_gds(refs, device).load()
    ref = xr.open_dataset(nc_file, engine="h5netcdf").load()
    xr.testing.assert_identical(got.as_numpy(), ref)


def test_multi_file_references(tmp_path: Path, device: str) -> None:
    """open_mfdataset over one reference set per file, and kerchunk's MultiZarrToZarr
    combination of them, match the files opened with h5netcdf."""
    combine = pytest.importorskip("kerchunk.combine", reason="MultiZarrToZarr is kerchunk's")
    files, jsons, sets = [], [], []
    for i in range(3):
        path = tmp_path / f"day{i}.nc"
        with netCDF4.Dataset(path, "w") as d:
            d.createDimension("time", None)
            d.createDimension("x", 50)
            t = d.createVariable("time", "f8", ("time",))
            t.units = "days since 2001-01-01"
            t[:] = np.arange(4) + 4 * i
            v = d.createVariable(
                "v", "f4", ("time", "x"), zlib=True, shuffle=True, chunksizes=(1, 25)
            )
            v[:] = np.arange(200, dtype="f4").reshape(4, 50) + 1000 * i
        files.append(path)
        refs = kerchunk_refs(path)
        sets.append(refs)
        jsons.append(tmp_path / f"day{i}.json")
        jsons[-1].write_text(json.dumps(refs))
    ref = xr.open_mfdataset(files, engine="h5netcdf", combine="by_coords").load()
    got = xr.open_mfdataset(
        [str(p) for p in jsons], engine="gds-zarr", device=device, combine="by_coords"
    ).load()
    xr.testing.assert_identical(got.as_numpy(), ref)
    combined = combine.MultiZarrToZarr(sets, concat_dims=["time"]).translate()
    one = open_gds(combined, device).load()
    assert_on(one, device)
    xr.testing.assert_identical(one.as_numpy(), ref)
    xr.testing.assert_identical(one.as_numpy(), open_zarr_refs(combined).load())


def test_filter_without_decoder_names_variable_and_filter(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=np.ones((10, 10), "f4"), chunks=(5, 5), compression="gzip")
    refs = kerchunk_refs(path)
    meta = json.loads(refs["refs"]["v/.zarray"])
    meta["filters"] = [{"id": "szip", "mask": 4, "pixels_per_block": 8}]  # HDF5 szip
    refs["refs"]["v/.zarray"] = json.dumps(meta)
    with pytest.raises(ValueError, match=r"variable 'v' .* filter 'szip'.*no decoder"):
        open_gds(refs, "cpu")


# -- bad input --------------------------------------------------------------------------


def _h5(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    path = tmp_path / "t.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=np.arange(4000, dtype="f8").reshape(40, 100), chunks=(10, 100))
    return path, kerchunk_refs(path)


def test_missing_target_file(tmp_path: Path, device: str) -> None:
    path, refs = _h5(tmp_path)
    os.remove(path)
    ds = open_gds(refs, device)
    with pytest.raises(ReferenceTargetError, match=rf"'v/0\.0' points at '{path}'.*does not exist"):
        ds.load()


def test_range_past_end_of_file(tmp_path: Path, device: str) -> None:
    path, refs = _h5(tmp_path)
    size = path.stat().st_size
    target, _, length = refs["refs"]["v/2.0"]
    refs["refs"]["v/2.0"] = [target, size - 10, length]
    ds = open_gds(refs, device, mask_and_scale=False)
    with pytest.raises(ReferenceTargetError, match=rf"'v/2\.0' points at '{path}'.*past the end"):
        ds.load()
    first = ds.v[:10].load()  # the other chunks still read
    with h5py.File(path) as f:
        np.testing.assert_array_equal(first.as_numpy().values, f["v"][:10])


def test_truncated_file(tmp_path: Path, device: str) -> None:
    path, refs = _h5(tmp_path)
    _, offset, _ = refs["refs"]["v/3.0"]
    with open(path, "r+b") as f:
        f.truncate(offset + 100)
    with pytest.raises(ReferenceTargetError, match=rf"'v/3\.0' points at '{path}'"):
        open_gds(refs, device).load()
    with pytest.raises(ReferenceTargetError, match=r"8000 bytes at offset"):
        open_gds(refs, device).v[30:].load()


# -- detection and the store ------------------------------------------------------------


def test_detection(tmp_path: Path, nc_file: Path) -> None:
    import zarr

    refs = kerchunk_refs(nc_file)
    assert is_reference_set(refs) and is_reference_set(refs["refs"])
    (tmp_path / "r.json").write_text(json.dumps(refs))
    assert is_reference_set(tmp_path / "r.json")
    assert is_reference_set(f"file://{tmp_path / 'r.json'}")
    zarr.open_group(tmp_path / "plain.zarr", mode="w", zarr_format=2).attrs["a"] = 1
    zarr.consolidate_metadata(tmp_path / "plain.zarr")
    assert not is_reference_set(tmp_path / "plain.zarr")  # consolidated, not Parquet refs
    assert not is_reference_set(str(nc_file))
    assert not is_reference_set({"a": 1})


def test_read_only(nc_file: Path) -> None:
    refs = kerchunk_refs(nc_file)
    with pytest.raises(ValueError, match="read-only: open it with mode='r'"):
        xr.open_dataset(refs, engine="gds-zarr", device="cpu", mode="r+")
    store = ReferenceStore(refs)
    import pickle

    again = pickle.loads(pickle.dumps(store))
    assert again.resolve("t2m/0.0.0") == store.resolve("t2m/0.0.0")


# -- VirtualiZarr (last: after its scans, kerchunk's scanner in this process was seen
# to hang while encoding metadata; not a path of this engine) ----------------------


def test_virtualizarr_references(nc_file: Path, device: str) -> None:
    pytest.importorskip("virtualizarr", reason="VirtualiZarr is not installed (virtual extra)")
    from obstore.store import LocalStore
    from virtualizarr import open_virtual_dataset
    from virtualizarr.parsers import HDFParser

    try:
        from obspec_utils.registry import ObjectStoreRegistry
    except ImportError:  # older VirtualiZarr
        from virtualizarr.registry import ObjectStoreRegistry  # type: ignore[no-redef]

    registry = ObjectStoreRegistry({"file://": LocalStore()})
    with no_gc():
        vds = open_virtual_dataset(f"file://{nc_file}", registry=registry, parser=HDFParser())
        refs = vds.vz.to_kerchunk(format="dict")
    got = open_gds(refs, device).load()
    assert_on(got, device)
    ref = xr.open_dataset(nc_file, engine="h5netcdf").load()
    xr.testing.assert_identical(got.as_numpy(), ref)


def test_fletcher32_decodes_on_the_host(tmp_path: Path, device: str) -> None:
    """HDF5's fletcher32 checksum has no batched decoder: VirtualiZarr describes it as
    numcodecs' Fletcher32, and zarr-python decodes those chunks (with a warning on the
    GPU route). kerchunk's scanner leaves such variables out."""
    pytest.importorskip("virtualizarr", reason="VirtualiZarr is not installed (virtual extra)")
    from obstore.store import LocalStore
    from virtualizarr import open_virtual_dataset
    from virtualizarr.parsers import HDFParser

    try:
        from obspec_utils.registry import ObjectStoreRegistry
    except ImportError:  # older VirtualiZarr
        from virtualizarr.registry import ObjectStoreRegistry  # type: ignore[no-redef]

    path = tmp_path / "c.h5"
    values = np.arange(60 * 80, dtype="f4").reshape(60, 80) / 7
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "v", data=values, chunks=(20, 40), compression="gzip", shuffle=True, fletcher32=True
        )
    registry = ObjectStoreRegistry({"file://": LocalStore()})
    vds = open_virtual_dataset(f"file://{path}", registry=registry, parser=HDFParser())
    refs = vds.vz.to_kerchunk(format="dict")
    assert [f["id"] for f in json.loads(refs["refs"]["v/.zarray"])["filters"]][-1] == "fletcher32"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = open_gds(refs, device, mask_and_scale=False).load()
    if device == "cuda":
        assert any("fletcher32" in m for m in host_warnings(record))
    assert_on(got, device)
    np.testing.assert_array_equal(got.v.to_numpy() if device == "cpu" else got.v.data.get(), values)


def test_references_into_a_sharded_store(
    tmp_path: Path, store_factory: Callable[[int, str], Path], device: str
) -> None:
    """References to the shard files of a Zarr v3 sharded store: the inner chunks are
    byte ranges of what each reference points at (whole files and sized ranges)."""
    store = store_factory(3, "sharded")
    files = sorted(p for p in store.rglob("*") if p.is_file())
    references: dict[str, Any] = {}
    for i, p in enumerate(files):
        key = p.relative_to(store).as_posix()
        if p.name == "zarr.json":
            references[key] = p.read_text()
        else:  # every other shard as a whole-file reference, the rest as sized ranges
            references[key] = [str(p)] if i % 2 else [str(p), 0, p.stat().st_size]
    refs = {"version": 1, "refs": references}
    got = xr.open_dataset(refs, engine="gds-zarr", device=device, consolidated=False)
    ref = xr.open_dataset(store, engine="zarr", consolidated=False)
    assert_on(got.load(), device)
    xr.testing.assert_identical(got.as_numpy(), ref.load())
    box = got.t2m.isel(time=slice(1, 3), lat=slice(2, 7)).load()
    xr.testing.assert_identical(box.as_numpy(), ref.t2m.isel(time=slice(1, 3), lat=slice(2, 7)))


def test_narrowed_reference_past_its_end_names_key_and_file() -> None:
    ref = refs_module.Reference("v/c/0", "/data/f.nc", 100, 50)
    assert refs_module.narrow(ref, 10, 20) == ref._replace(offset=110, size=20)
    with pytest.raises(ReferenceTargetError, match=r"'v/c/0' points at '/data/f\.nc'.*40:60.*50"):
        refs_module.narrow(ref, 40, 20)
    inline = refs_module.Reference("v/c/1", None, 0, 0, b"abcdef")
    assert refs_module.narrow(inline, 2, 3).data == b"cde"
    with pytest.raises(ReferenceTargetError, match=r"'v/c/1' points at '\(inline\)'"):
        refs_module.narrow(inline, 4, 3)


# -- byte ranges that are not ranges --------------------------------------------------------
INT64_MAX = (1 << 63) - 1

BAD_RANGES: dict[str, tuple[Callable[[int, int, int], tuple[int, int]], str]] = {
    # name: ((offset, length, file size) -> (offset, length), what the message says)
    "negative-offset": (lambda o, n, s: (-1, n), r"the offset -1 is negative"),
    "negative-length": (lambda o, n, s: (o, -1), r"the length -1 is negative"),
    "very-negative-length": (lambda o, n, s: (o, -n), r"the length -\d+ is negative"),
    "offset-overflows": (
        lambda o, n, s: (INT64_MAX - 10, n),
        rf"offset {INT64_MAX - 10} \+ length \d+ is past the largest byte offset",
    ),
    "length-overflows": (
        lambda o, n, s: (o, INT64_MAX),
        rf"offset \d+ \+ length {INT64_MAX} is past the largest byte offset",
    ),
}


def _as_form(tmp_path: Path, form: str, refs: dict[str, Any]) -> Any:
    """``refs`` as a dict, a JSON file or a Parquet directory."""
    if form == "dict":
        return refs
    if form == "json":
        out = tmp_path / "refs.json"
        out.write_text(json.dumps(refs))
        return str(out)
    pytest.importorskip("fastparquet", reason="Parquet references need fastparquet")
    from kerchunk.df import refs_to_dataframe

    out = tmp_path / "refs.parq"
    refs_to_dataframe(refs, str(out), record_size=4)
    return str(out)


def _bad_set(tmp_path: Path, form: str, case: str) -> tuple[Any, Path]:
    """The references of a small HDF5 file with chunk ``v/1.0`` given the range of
    ``case``, in ``form``."""
    path, refs = _h5(tmp_path)
    target, offset, length = refs["refs"]["v/1.0"]
    refs["refs"]["v/1.0"] = [target, *BAD_RANGES[case][0](offset, length, path.stat().st_size)]
    return _as_form(tmp_path, form, refs), path


@pytest.mark.parametrize("form", ["dict", "json", "parquet"])
@pytest.mark.parametrize("case", BAD_RANGES)
def test_invalid_byte_range_is_refused_naming_the_key(
    tmp_path: Path, device: str, form: str, case: str
) -> None:
    """A negative offset or length (a negative length was read as the whole file) and
    an end past int64 are refused, naming the reference's key; the other chunks read."""
    refs, path = _bad_set(tmp_path, form, case)
    ds = open_gds(refs, device, mask_and_scale=False)
    with pytest.raises(refs_module.ReferenceRangeError, match=BAD_RANGES[case][1]) as err:
        ds.v.load()
    assert isinstance(err.value, ValueError)
    assert err.value.key == "v/1.0"
    assert str(err.value).startswith(f"reference 'v/1.0' (to '{path}') has an invalid byte range")
    with pytest.raises(refs_module.ReferenceRangeError, match=r"reference 'v/1\.0'"):
        ds.v[10:20].load()  # the chunk alone, through a box read
    first = ds.v[:10].load()  # the other chunks still read
    with h5py.File(path) as f:
        np.testing.assert_array_equal(first.as_numpy().values, f["v"][:10])


@pytest.mark.parametrize("form", ["dict", "json", "parquet"])
def test_range_past_the_file_size_names_the_key(tmp_path: Path, device: str, form: str) -> None:
    path, refs = _h5(tmp_path)
    size = path.stat().st_size
    target, _, _ = refs["refs"]["v/1.0"]
    refs["refs"]["v/1.0"] = [target, 0, size + 1]
    ds = open_gds(_as_form(tmp_path, form, refs), device, mask_and_scale=False)
    with pytest.raises(
        ReferenceTargetError,
        match=rf"reference 'v/1\.0' points at '{path}': its {size + 1} bytes at offset 0 "
        rf"end past the end of the {size}-byte file",
    ):
        ds.v.load()

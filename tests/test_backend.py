"""engine="gds-zarr" against engine="zarr": values, placement, laziness, arguments, errors."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
from xarray_gds import GdsStore
from xarray_gds.backend import GdsZarrBackendEntrypoint

from .conftest import assert_placed, open_both, sample_dataset, to_numpy

pytestmark = pytest.mark.filterwarnings("ignore::xarray.SerializationWarning")


def _points(*values: Any, dim: str = "points") -> xr.DataArray:
    return xr.DataArray(list(values), dims=dim)


# Each selection is applied to both engines and the results compared.
SELECTIONS: dict[str, Any] = {
    "all": lambda ds: ds,
    "int": lambda ds: ds.isel(time=3),
    "negative-int": lambda ds: ds.isel(time=-1, lat=-2),
    "slice": lambda ds: ds.isel(time=slice(2, 9), lon=slice(1, 11)),
    "slice-step": lambda ds: ds.isel(lat=slice(1, 8, 3), lon=slice(None, None, 4)),
    "slice-negative-step": lambda ds: ds.isel(lat=slice(None, None, -1), lon=slice(10, 1, -3)),
    "list": lambda ds: ds.isel(time=[0, 3, 5], lon=[11, 2, 1]),
    "bool-mask": lambda ds: ds.isel(lat=ds.lat.values > 0),
    "vectorized": lambda ds: ds.isel(time=_points(0, 2, 9), lat=_points(1, 3, 8)),
    "vectorized-2d": lambda ds: ds.isel(
        time=xr.DataArray([[0, 1], [7, 9]], dims=("a", "b")), lon=_points(5, 3, dim="b")
    ),
    "vectorized-with-slice": lambda ds: ds.isel(
        time=_points(1, 4, 6), lat=_points(0, 8, 2), lon=slice(2, 10, 3)
    ),
    "sel-labels": lambda ds: ds.sel(lat=slice(-20, 30), lon=[60.0, 0.0]),
    "sel-time": lambda ds: ds.sel(time="2000-01-02"),
    "sel-nearest": lambda ds: ds.sel(lat=_points(-39.0, 12.0), method="nearest"),
}


@pytest.mark.parametrize("selection", list(SELECTIONS), ids=list(SELECTIONS))
def test_selections_match_zarr(store_path: Path, device: str, selection: str) -> None:
    gds, ref = open_both(store_path, device)
    pick = SELECTIONS[selection]
    got = pick(gds).load()
    assert_placed(got, device)
    xr.testing.assert_identical(got.as_numpy(), pick(ref).load())


def test_open_is_lazy_and_reads_only_touched_chunks(v3_store: Path, device: str) -> None:
    reads: list[str] = []

    class CountingStore(GdsStore):
        def _read(self, key, prototype, byte_range):  # type: ignore[no-untyped-def]
            reads.append(key)
            return super()._read(key, prototype, byte_range)

        def chunk_paths(self, keys):  # type: ignore[no-untyped-def]
            reads.extend(keys)  # every batched read (joined or not) asks for its files
            return super().chunk_paths(keys)

    store = CountingStore(v3_store, read_only=True)
    ds = xr.open_dataset(store, engine="gds-zarr", device=device)
    chunk_reads = [k for k in reads if k.startswith("t2m/")]
    assert chunk_reads == [], "opening read chunks of a data variable"

    reads.clear()
    ds.t2m.isel(time=5, lat=6, lon=7).load()
    assert [k for k in reads if k.startswith("t2m/")] == ["t2m/c/1/1/1"]

    reads.clear()
    value = ds.t2m.isel(time=slice(4, 8), lat=slice(4, 8)).load()
    touched = sorted(k for k in reads if k.startswith("t2m/"))
    assert touched == ["t2m/c/1/1/0", "t2m/c/1/1/1", "t2m/c/1/1/2"]
    ref = xr.open_dataset(v3_store, engine="zarr").t2m.isel(time=slice(4, 8), lat=slice(4, 8))
    xr.testing.assert_identical(value.as_numpy(), ref.load())


def test_types_on_device(v3_store: Path, device: str) -> None:
    ds = xr.open_dataset(v3_store, engine="gds-zarr", device=device).load()
    assert_placed(ds, device)
    if device == "cuda":
        import cupy

        assert isinstance(ds.t2m.data, cupy.ndarray)
        assert isinstance(ds.area.data, cupy.ndarray)  # non-index coordinate
    assert isinstance(ds.lat.data, np.ndarray)  # index coordinate
    assert ds.valid_time.dtype.kind == "M" and isinstance(ds.valid_time.data, np.ndarray)
    assert ds.lead.dtype.kind == "m" and isinstance(ds.lead.data, np.ndarray)
    assert ds.station.dtype.kind in "OTU" and isinstance(ds.station.data, np.ndarray)
    assert ds.indexes["time"].dtype.kind == "M"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mask_and_scale": False},
        {"mask_and_scale": {"u10": False}},
        {"decode_times": False},
        {"decode_timedelta": False},
        {"use_cftime": True, "decode_times": True},
        {"concat_characters": False},
        {"decode_coords": False},
        {"decode_coords": "all"},
        {"drop_variables": ["u10", "station"]},
        {"drop_variables": "t2m"},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
@pytest.mark.filterwarnings("ignore:Usage of .use_cftime.:FutureWarning")
def test_decoder_arguments_match_zarr(v2_store: Path, device: str, kwargs: dict) -> None:
    if "use_cftime" in kwargs:
        pytest.importorskip("cftime")
    gds, ref = open_both(v2_store, device, **kwargs)
    xr.testing.assert_identical(to_numpy(gds), ref.load())


@pytest.mark.parametrize("consolidated", [None, True, False])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_consolidated_and_zarr_format(
    store_factory: Any, device: str, consolidated: bool | None, zarr_format: int
) -> None:
    path = store_factory(zarr_format, "zstd")
    gds, ref = open_both(path, device, consolidated=consolidated, zarr_format=zarr_format)
    xr.testing.assert_identical(to_numpy(gds), ref.load())


def test_consolidated_true_requires_consolidated_metadata(tmp_path: Path) -> None:
    path = tmp_path / "plain.zarr"
    sample_dataset().to_zarr(path, zarr_format=3, consolidated=False)
    with pytest.raises(ValueError):
        xr.open_dataset(path, engine="gds-zarr", consolidated=True, device="cpu")
    with pytest.raises(ValueError):
        xr.open_dataset(path, engine="zarr", consolidated=True)
    ds = xr.open_dataset(path, engine="gds-zarr", consolidated=False, device="cpu")
    assert "t2m" in ds


def test_wrong_zarr_format_fails_like_zarr(v3_store: Path) -> None:
    with pytest.raises(Exception) as ref_err:
        xr.open_dataset(v3_store, engine="zarr", zarr_format=2, consolidated=False)
    with pytest.raises(type(ref_err.value)):
        xr.open_dataset(
            v3_store, engine="gds-zarr", zarr_format=2, consolidated=False, device="cpu"
        )


@pytest.fixture(scope="module")
def tree_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tree") / "tree.zarr"
    base = sample_dataset()
    tree = xr.DataTree.from_dict(
        {
            "/": base[["t2m"]],
            "/surface": base[["u10", "n_obs"]],
            "/surface/extra": base[["qc"]].rename(qc="flags"),
        }
    )
    tree.to_zarr(path, zarr_format=3)
    return path


def test_open_datatree_matches_zarr(tree_store: Path, device: str) -> None:
    gds = xr.open_datatree(tree_store, engine="gds-zarr", device=device)
    ref = xr.open_datatree(tree_store, engine="zarr")
    assert gds.groups == ref.groups
    for path in ref.groups:
        xr.testing.assert_identical(to_numpy(gds[path].to_dataset()), ref[path].to_dataset().load())
    if device == "cuda":
        assert hasattr(gds["/surface/u10"].data, "__cuda_array_interface__")


def test_open_groups_and_group_argument(tree_store: Path, device: str) -> None:
    groups = xr.open_groups(tree_store, engine="gds-zarr", device=device)
    assert set(groups) == {"/", "/surface", "/surface/extra"}
    sub = xr.open_groups(tree_store, engine="gds-zarr", group="surface", device=device)
    ref = xr.open_groups(tree_store, engine="zarr", group="surface")
    assert list(sub) == list(ref) and len(sub) == 2
    for key in ref:
        xr.testing.assert_identical(to_numpy(sub[key]), ref[key].load())
    tree = xr.open_datatree(tree_store, engine="gds-zarr", group="surface", device=device)
    assert tree.groups == ("/", "/extra")
    gds, ref = open_both(tree_store, device, group="surface/extra")
    xr.testing.assert_identical(to_numpy(gds), ref.load())


def test_missing_group_names_existing_groups(tree_store: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope") as err:
        xr.open_dataset(tree_store, engine="gds-zarr", group="surface/nope", device="cpu")
    assert "'/surface'" in str(err.value) and "'/surface/extra'" in str(err.value)


def _opened_with_warnings(
    source: Any, engine: str, **kwargs: Any
) -> tuple[xr.Dataset, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = xr.open_dataset(source, engine=engine, **kwargs).load()
    consolidation = [w for w in caught if "consolidated" in str(w.message).lower()]
    return ds, consolidation


@pytest.mark.parametrize("consolidated", [True, False])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_subgroups_take_the_roots_consolidated_metadata_as_with_zarr(
    tmp_path: Path, zarr_format: int, consolidated: bool
) -> None:
    """A subgroup of a store whose root holds consolidated metadata (listing it) opens
    without a warning, as with engine="zarr"; a store without any warns with both."""
    path = tmp_path / "tree.zarr"
    base = sample_dataset()
    tree = xr.DataTree.from_dict(
        {"/": base[["t2m"]], "/surface": base[["u10"]], "/surface/extra": base[["qc"]]}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: consolidated metadata is not in the v3 spec
        tree.to_zarr(path, zarr_format=zarr_format, consolidated=consolidated)
    root = zarr.open_group(path, mode="r")
    for group in ("surface", "surface/extra", "/surface"):
        ref, ref_warned = _opened_with_warnings(path, "zarr", group=group)
        for source, kwargs in ((path, {"group": group}), (root[group.strip("/")], {})):
            gds, warned = _opened_with_warnings(source, "gds-zarr", device="cpu", **kwargs)
            xr.testing.assert_identical(gds, ref)
            assert len(warned) == len(ref_warned) == (0 if consolidated else 1)
            if not consolidated:
                assert warned[0].category is xarray_gds.errors.ConsolidatedMetadataWarning


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_root_listing_read_from_one_document_is_zarrs(tmp_path: Path, zarr_format: int) -> None:
    """consolidated_at_root reads a v3 root's listing from its one document: the same
    groups listed as through zarr.open_consolidated, for every group asked for and
    every format given; a v2 root, an unconsolidated root and a group added after
    consolidation are decided as zarr decides them."""
    from xarray_gds.backend import _v3_root_listing, consolidated_at_root

    path = tmp_path / "tree.zarr"
    base = sample_dataset()
    tree = xr.DataTree.from_dict({"/": base[["t2m"]], "/surface/extra": base[["qc"]]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: consolidated metadata is not in the v3 spec
        tree.to_zarr(path, zarr_format=zarr_format, consolidated=True)
        zarr.open_group(path, mode="a").create_group("added")  # after consolidation
    store = zarr.storage.LocalStore(path, read_only=True)
    listed = _v3_root_listing(store, None)
    if zarr_format == 2:
        assert listed is None  # zarr's own open decides
    else:
        zarr_listed = zarr.open_consolidated(store, mode="r").metadata.consolidated_metadata
        assert listed is not None and zarr_listed is not None
        assert listed.flattened_metadata.keys() == zarr_listed.flattened_metadata.keys()
        assert _v3_root_listing(store, 2) is None
    for fmt in (None, zarr_format):
        for group, expected in (
            (None, True), ("/", True), ("surface", True), ("/surface/extra", True),
            ("added", False), ("missing", False),
        ):  # fmt: skip
            assert consolidated_at_root(store, group, fmt) is expected, (group, fmt)
    plain = tmp_path / "plain.zarr"
    base.to_zarr(plain, zarr_format=zarr_format, consolidated=False)
    plain_store = zarr.storage.LocalStore(plain, read_only=True)
    assert _v3_root_listing(plain_store, None) is None
    assert consolidated_at_root(plain_store, None, None) is False


def test_missing_path_raises_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "missing.zarr"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        xr.open_dataset(missing, engine="gds-zarr", device="cpu")


def test_directory_that_is_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a Zarr store") as err:
        xr.open_dataset(tmp_path, engine="gds-zarr", device="cpu")
    assert str(tmp_path) in str(err.value)
    with pytest.raises(ValueError, match="not a Zarr store"):
        xr.open_dataset(tmp_path / "notes.txt", engine="gds-zarr", device="cpu")


def _layout(path: Path, dirs: tuple[str, ...], files: tuple[str, ...]) -> Path:
    """A directory holding the directories ``dirs`` and empty files ``files``."""
    path.mkdir()
    for d in dirs:
        (path / d).mkdir()
    for f in files:
        (path / f).write_bytes(b"")
    return path


@pytest.mark.parametrize(
    ("dirs", "files"),
    [((), ()), (("snapshots", "refs"), ()), (("snapshots",), ("repo",))],
    ids=["neither", "icechunk-1", "icechunk-2"],
)
def test_an_icechunk_repository_by_its_layout(
    tmp_path: Path, dirs: tuple[str, ...], files: tuple[str, ...]
) -> None:
    """A snapshots directory beside a refs directory (Icechunk 1) or a repo file
    (Icechunk 2) is a repository; a directory of neither is no Zarr store."""
    path = _layout(tmp_path / "repo", dirs, files)
    kind = "an Icechunk repository" if dirs else "not a Zarr store: it is not a directory"
    with pytest.raises(ValueError, match=f"^'{path}' is {kind}"):
        xr.open_dataset(path, engine="gds-zarr", device="cpu")


def test_a_store_with_variables_named_snapshots_and_refs_opens(
    tmp_path: Path,
) -> None:
    """A Zarr store whose variables are named snapshots and refs (their directories
    those of an Icechunk 1 repository) is a Zarr store: its root holds Zarr metadata."""
    path = tmp_path / "s.zarr"
    xr.Dataset({"snapshots": ("x", np.arange(3.0)), "refs": ("x", np.arange(3.0))}).to_zarr(
        path, zarr_format=3, consolidated=False
    )
    with (
        xr.open_dataset(path, engine="zarr") as ref,
        xr.open_dataset(path, engine="gds-zarr", device="cpu") as ds,
    ):
        xr.testing.assert_identical(ds.load(), ref.load())


@pytest.mark.parametrize(
    ("dirs", "files"),
    [(("snapshots",), ()), (("refs",), ("repo",)), (("snapshots", "repo"), ())],
    ids=["snapshots-alone", "no-snapshots", "repo-a-directory"],
)
def test_not_an_icechunk_repository(
    tmp_path: Path, dirs: tuple[str, ...], files: tuple[str, ...]
) -> None:
    path = _layout(tmp_path / "repo", dirs, files)
    with pytest.raises(ValueError, match=f"^'{path}' is not a Zarr store: it is not a directory"):
        xr.open_dataset(path, engine="gds-zarr", device="cpu")


@pytest.mark.parametrize(
    ("magic", "engines"),
    [
        (b"\x89HDF\r\n\x1a\n", "engine='netcdf4') or engine='h5netcdf'"),
        (b"CDF\x01", "engine='netcdf4') or engine='scipy'"),
        (b"CDF\x02", "engine='netcdf4') or engine='scipy'"),
    ],
)
def test_netcdf_file_names_the_engines_that_read_it(
    tmp_path: Path, magic: bytes, engines: str
) -> None:
    path = tmp_path / "era5.nc"
    path.write_bytes(magic + bytes(120))
    with pytest.raises(ValueError, match="not a Zarr store") as err:
        xr.open_dataset(path, engine="gds-zarr", device="cpu")
    text = str(err.value)
    assert str(path) in text and "NetCDF" in text
    assert engines in text
    assert "kerchunk or VirtualiZarr" in text and "docs/netcdf.md" in text


def test_hdf5_after_a_user_block_is_recognised(tmp_path: Path) -> None:
    path = tmp_path / "blocked.h5"
    path.write_bytes(bytes(512) + b"\x89HDF\r\n\x1a\n" + bytes(64))
    with pytest.raises(ValueError, match="is a NetCDF-4/HDF5 file, not a Zarr store"):
        xr.open_dataset(path, engine="gds-zarr", device="cpu")


@pytest.mark.parametrize("path", ["t", "forecast/t"])
def test_zarr_array_error_suggests_a_call_that_works(tmp_path: Path, path: str) -> None:
    """The TypeError for a zarr.Array names a call that opens it: run that call."""
    root = zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=3)
    array = root.create_array(path, shape=(4,), dtype="f4", dimension_names=("x",))
    array[:] = np.arange(4, dtype="f4")
    with pytest.raises(TypeError, match="pick the variable") as err:
        xr.open_dataset(array, engine="gds-zarr", device="cpu")
    call = str(err.value).split("pick the variable: ", 1)[1]
    with warnings.catch_warnings():  # no GPU here; no consolidated metadata
        warnings.simplefilter("ignore")
        got = eval(call, {"xr": xr, "array": array})  # the suggestion, as a user types it
    assert isinstance(got, xr.DataArray)
    np.testing.assert_array_equal(got.as_numpy().values, np.arange(4, dtype="f4"))


def test_root_zarr_array_error_says_to_read_it_with_zarr(tmp_path: Path) -> None:
    array = zarr.create_array(tmp_path / "a.zarr", shape=(4,), dtype="f4", zarr_format=3)
    with pytest.raises(TypeError, match="root of its store") as err:
        xr.open_dataset(array, engine="gds-zarr", device="cpu")
    text = str(err.value)
    assert "zarr.config.enable_gpu()" in text and "['']" not in text and "group='/'" not in text


def test_other_remote_urls_are_refused_with_a_pointer(tmp_path: Path) -> None:
    # s3:// and http(s):// are opened (tests/test_remote.py); other schemes are not
    with pytest.raises(ValueError, match="zarr Store object"):
        xr.open_dataset("gs://bucket/data.zarr", engine="gds-zarr", device="cpu")


def test_unknown_argument_raises_type_error(v3_store: Path) -> None:
    with pytest.raises(TypeError, match="chunk_size"):
        xr.open_dataset(v3_store, engine="gds-zarr", chunk_size=3, device="cpu")
    with pytest.raises(TypeError):
        xr.open_datatree(v3_store, engine="gds-zarr", bogus=1, device="cpu")
    with pytest.raises(ValueError, match="device"):
        xr.open_dataset(v3_store, engine="gds-zarr", device="tpu")
    with pytest.raises(ValueError, match="zarr_format"):
        xr.open_dataset(v3_store, engine="gds-zarr", zarr_format=4, device="cpu")


def test_opening_never_writes(tmp_path: Path, v2_store: Path, device: str) -> None:
    path = tmp_path / "copy.zarr"
    shutil.copytree(v2_store, path)
    # remove the consolidated metadata: engine="zarr" then falls back to the listing
    (path / ".zmetadata").unlink()

    def snapshot() -> dict[str, tuple[int, int]]:
        return {
            str(p.relative_to(path)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in path.rglob("*")
        }

    before = snapshot()
    os.chmod(path, 0o555)
    try:
        with pytest.warns(RuntimeWarning, match="consolidated"):
            ds = xr.open_dataset(path, engine="gds-zarr", device=device)
        to_numpy(ds)
        xr.open_datatree(path, engine="gds-zarr", device=device).load()
    finally:
        os.chmod(path, 0o755)
    assert snapshot() == before


def test_store_objects_are_accepted(v3_store: Path, device: str) -> None:
    local = zarr.storage.LocalStore(v3_store, read_only=True)
    gds = xr.open_dataset(local, engine="gds-zarr", device=device)
    ref = xr.open_dataset(v3_store, engine="zarr")
    xr.testing.assert_identical(to_numpy(gds), ref.load())
    gds = xr.open_dataset(GdsStore(v3_store, read_only=True), engine="gds-zarr", device=device)
    xr.testing.assert_identical(to_numpy(gds), ref.load())


def test_memory_store(device: str) -> None:
    store = zarr.storage.MemoryStore()
    sample_dataset().to_zarr(store, zarr_format=3)
    gds = xr.open_dataset(store, engine="gds-zarr", device=device)
    ref = xr.open_dataset(store, engine="zarr")
    xr.testing.assert_identical(to_numpy(gds), ref.load())


def test_guess_can_open_defers_to_zarr(v3_store: Path) -> None:
    assert GdsZarrBackendEntrypoint().guess_can_open(str(v3_store)) is False
    assert "gds-zarr" in xr.backends.list_engines()
    # auto-detection still picks engine="zarr" for .zarr paths
    assert xr.backends.plugins.guess_engine(str(v3_store)) == "zarr"


def test_package_import_loads_no_cuda_library() -> None:
    import subprocess
    import sys

    # `import zarr` itself tries `import cupy` (zarr.core.buffer.gpu); beyond that,
    # importing the package must load no CUDA library
    code = (
        "import sys, zarr, xarray; cuda = ('cupy', 'kvikio', 'nvidia.nvcomp'); "
        "before = {m for m in cuda if m in sys.modules}; "
        "import xarray_gds, xarray_gds.backend, xarray_gds.pipeline, xarray_gds.tools.cli; "
        "added = {m for m in cuda if m in sys.modules} - before; "
        "print(added); sys.exit(1 if added else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names() -> None:
    for name in xarray_gds.__all__:
        assert hasattr(xarray_gds, name)


def test_open_groups_takes_open_datasets_arguments_only(v3_store: Path) -> None:
    """open_datatree / open_groups take what open_dataset takes (but store=), and a
    misspelt name raises TypeError naming it."""
    with pytest.raises(TypeError, match="decode_time"):
        xr.open_groups(v3_store, engine="gds-zarr", device="cpu", decode_time=False)
    tree = xr.open_datatree(v3_store, engine="gds-zarr", device="cpu", decode_times=False)
    ref = xr.open_datatree(v3_store, engine="zarr", decode_times=False)
    xr.testing.assert_identical(tree.to_dataset().load(), ref.to_dataset().load())

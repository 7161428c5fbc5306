"""engine="gds-zarr" takes every argument engine="zarr" takes and reads every variable
engine="zarr" round-trips; each case compared with it."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr
from xarray.backends import ZarrStore
from xarray.backends.zarr import ZarrBackendEntrypoint

import xarray_gds
from xarray_gds.backend import GdsZarrBackendEntrypoint, _open_zarr_stores

from .conftest import sample_dataset

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore:.*consolidated metadata.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*vlen-utf8.*:UserWarning"),
    pytest.mark.filterwarnings("ignore::zarr.errors.UnstableSpecificationWarning"),
    pytest.mark.filterwarnings("ignore:The specified chunks separate:UserWarning"),
]


def assert_same(gds: xr.Dataset, ref: xr.Dataset, device: str) -> None:
    """``gds`` (engine="gds-zarr" on ``device``) equals ``ref`` (engine="zarr"), and its
    device variables are CuPy arrays when ``device="cuda"``."""
    gds = gds.load()
    if device == "cuda":
        import cupy

        for name, var in gds.variables.items():
            if xarray_gds.placement(str(name), var) == "cuda":
                assert isinstance(var.data, cupy.ndarray), (name, type(var.data))
            else:
                assert not isinstance(var.data, cupy.ndarray), (name, type(var.data))
        gds = gds.as_numpy()
    xr.testing.assert_identical(gds, ref.load())


def assert_same_tree(gds: xr.DataTree, ref: xr.DataTree, device: str) -> None:
    assert gds.groups == ref.groups
    for path in ref.groups:
        assert_same(gds[path].to_dataset(), ref[path].to_dataset(), device)


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("args") / "data.zarr"
    sample_dataset().to_zarr(path, zarr_format=3, consolidated=True)
    return path


@pytest.fixture(scope="module")
def tree_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tree") / "tree.zarr"
    base = sample_dataset()
    xr.DataTree.from_dict(
        {"/": base[["t2m"]], "/surface": base[["u10", "n_obs"]], "/surface/deep": base[["qc"]]}
    ).to_zarr(path, zarr_format=3)
    return path


# -- arguments ---------------------------------------------------------------------


def _parameters(func: Callable[..., Any]) -> set[str]:
    return {p for p in inspect.signature(func).parameters if p not in ("self", "kwargs")}


#: zarr-python 2 arguments that older xarray (2025.11, the lowest claimed) still lists
#: and that zarr 3 has no use for; newer xarray dropped them
_ZARR2_ONLY = frozenset({"zarr_version", "chunk_store", "synchronizer", "stacklevel"})


def test_every_zarr_argument_is_a_parameter() -> None:
    zarr_entry, gds_entry = ZarrBackendEntrypoint, GdsZarrBackendEntrypoint
    wanted = _parameters(zarr_entry.open_dataset) - _ZARR2_ONLY
    assert wanted <= _parameters(gds_entry.open_dataset)
    assert wanted <= set(gds_entry.open_dataset_parameters)
    assert set(gds_entry.open_dataset_parameters) == _parameters(gds_entry.open_dataset)
    for method in ("open_groups_as_dict", "open_datatree"):
        assert _parameters(getattr(zarr_entry, method)) - _ZARR2_ONLY <= _parameters(
            gds_entry.open_groups_as_dict
        )


@pytest.mark.parametrize("mode", ["r", "r+", "a", "a-"])
def test_mode_matches_zarr(tmp_path: Path, v3_path: Path, device: str, mode: str) -> None:
    path = tmp_path / "copy.zarr"
    shutil.copytree(v3_path, path)

    def files() -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in path.rglob("*")}

    before = files()
    gds = xr.open_dataset(path, engine="gds-zarr", mode=mode, device=device)
    gds_tree = xr.open_datatree(path, engine="gds-zarr", mode=mode, device=device)
    groups = xr.open_groups(path, engine="gds-zarr", mode=mode, device=device)
    gds.load(), gds_tree.load(), [g.load() for g in groups.values()]
    assert files() == before  # a writable mode opens the store, it writes nothing
    assert_same(gds, xr.open_dataset(path, engine="zarr", mode=mode), device)
    assert_same_tree(gds_tree, xr.open_datatree(path, engine="zarr", mode=mode), device)
    assert list(groups) == ["/"]


@pytest.mark.parametrize("mode", ["w", "w-"])
def test_write_modes_are_refused_and_leave_the_store(
    tmp_path: Path, v3_path: Path, mode: str
) -> None:
    path = tmp_path / "copy.zarr"
    shutil.copytree(v3_path, path)
    before = sorted(p.name for p in path.rglob("*"))
    for opener in (xr.open_dataset, xr.open_datatree, xr.open_groups):
        with pytest.raises(ValueError, match=f"mode must be one of .* not '{mode}'.*to_zarr"):
            opener(path, engine="gds-zarr", mode=mode, device="cpu")
    assert sorted(p.name for p in path.rglob("*")) == before
    xr.testing.assert_identical(
        xr.open_dataset(path, engine="gds-zarr", device="cpu").load(),
        xr.open_dataset(path, engine="zarr").load(),
    )


@pytest.mark.parametrize("cache_members", [True, False])
def test_cache_members_matches_zarr(tree_path: Path, device: str, cache_members: bool) -> None:
    gds = xr.open_dataset(tree_path, engine="gds-zarr", cache_members=cache_members, device=device)
    assert_same(gds, xr.open_dataset(tree_path, engine="zarr", cache_members=cache_members), device)
    # engine="zarr" takes cache_members in open_dataset only (pydata/xarray#11361)
    tree = xr.open_datatree(
        tree_path, engine="gds-zarr", cache_members=cache_members, device=device
    )
    assert_same_tree(tree, xr.open_datatree(tree_path, engine="zarr"), device)


def test_cache_members_false_lists_members_on_demand(tmp_path: Path, v3_path: Path) -> None:
    path = tmp_path / "copy.zarr"
    shutil.copytree(v3_path, path)
    for cache in (True, False):
        (gds_store,) = _open_zarr_stores(
            xarray_gds.open_store(path),
            group=None,
            mode="r",
            consolidated=False,
            storage_options=None,
            zarr_format=None,
            use_zarr_fill_value_as_mask=None,
            cache_members=cache,
            all_groups=False,
        ).values()
        ref_store = ZarrStore.open_group(str(path), mode="r", cache_members=cache)
        zarr.open_group(path, mode="a").create_array(f"extra{cache}", shape=(2,), dtype="i1")
        # a cached listing misses the array created after the store was opened
        assert (f"extra{cache}" in gds_store.members) == (not cache)
        assert (f"extra{cache}" in ref_store.members) == (not cache)


def test_storage_options_are_passed_to_zarr(v3_path: Path, tree_path: Path, device: str) -> None:
    gds = xr.open_dataset(v3_path, engine="gds-zarr", storage_options=None, device=device)
    assert_same(gds, xr.open_dataset(v3_path, engine="zarr", storage_options=None), device)
    tree = xr.open_datatree(tree_path, engine="gds-zarr", storage_options=None, device=device)
    assert_same_tree(tree, xr.open_datatree(tree_path, engine="zarr"), device)
    # zarr refuses options it would not use (a local path), for both engines alike
    for opener in (xr.open_dataset, xr.open_datatree, xr.open_groups):
        with pytest.raises(TypeError, match="'storage_options' was provided but unused"):
            opener(v3_path, engine="zarr", storage_options={"anon": True})
        with pytest.raises(TypeError, match="'storage_options' was provided but unused"):
            opener(v3_path, engine="gds-zarr", storage_options={"anon": True}, device="cpu")


def test_remote_url_without_its_filesystem_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """URLs open through obstore, or fsspec where it is not installed
    (tests/test_remote.py reads them from loopback servers); with neither the error
    names the engine's client and the extra that brings it."""
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore now fails
    monkeypatch.setitem(sys.modules, "s3fs", None)  # and so does import s3fs
    if importlib.util.find_spec("fsspec") is not None:
        # fsspec keeps the class of every filesystem it has imported once (an earlier
        # test's S3 reads): forget it for this test, so that fsspec imports s3fs again
        registry = importlib.import_module("fsspec.registry")  # the module, not its mapping
        monkeypatch.delitem(registry._registry, "s3", raising=False)
    want = (
        "reading 's3://bucket/d.zarr' needs obstore: "
        'pip install ".[remote]" in a checkout of xarray-gds'
    )
    for opener in (xr.open_dataset, xr.open_datatree, xr.open_groups):
        with pytest.raises(ImportError) as info:
            opener(
                "s3://bucket/d.zarr",
                engine="gds-zarr",
                storage_options={"anon": True},
                device="cpu",
            )
        assert str(info.value) == want


def test_zarr_group_as_filename(tree_path: Path, device: str) -> None:
    root = zarr.open_group(tree_path, mode="r")
    sub = root["surface"]
    assert isinstance(sub, zarr.Group)
    # xarray's annotations leave zarr objects out; engine="gds-zarr" takes groups
    cases: list[tuple[Any, str | None, str]] = [
        (root, None, "/"),
        (root, "surface", "surface"),
        (sub, None, "surface"),
        (sub, "deep", "surface/deep"),
        (sub, "/deep", "surface/deep"),
    ]
    for group_obj, group, path in cases:
        gds = xr.open_dataset(group_obj, engine="gds-zarr", group=group, device=device)
        assert_same(gds, xr.open_dataset(tree_path, engine="zarr", group=path), device)
    sub_any: Any = sub
    gds_tree = xr.open_datatree(sub_any, engine="gds-zarr", device=device)
    assert_same_tree(gds_tree, xr.open_datatree(tree_path, engine="zarr", group="surface"), device)
    groups = xr.open_groups(sub_any, engine="gds-zarr", device=device)
    assert list(groups) == list(xr.open_groups(tree_path, engine="zarr", group="surface"))


def test_zarr_array_and_zarr_store_as_filename_say_what_to_pass(tree_path: Path) -> None:
    array: Any = zarr.open_group(tree_path, mode="r")["surface/u10"]
    with pytest.raises(TypeError, match=r"not the zarr.Array 'surface/u10'.*group='surface'"):
        xr.open_dataset(array, engine="gds-zarr", device="cpu")
    with pytest.raises(TypeError, match=r"not the zarr\.Array"):
        xr.open_datatree(array, engine="gds-zarr", device="cpu")
    zstore = ZarrStore.open_group(str(tree_path), mode="r")
    with pytest.raises(TypeError, match=r"as the store= argument"):
        xr.open_dataset(zstore, engine="gds-zarr", device="cpu")


def test_store_argument_matches_zarr(tree_path: Path, device: str) -> None:
    def store() -> ZarrStore:
        return ZarrStore.open_group(str(tree_path), group="surface", mode="r")

    # the path is ignored when store= is given, as with engine="zarr"
    gds = xr.open_dataset("ignored.zarr", engine="gds-zarr", store=store(), device=device)
    assert_same(gds, xr.open_dataset("ignored.zarr", engine="zarr", store=store()), device)
    with pytest.raises(TypeError, match=r"store= takes an xarray\.backends\.ZarrStore"):
        xr.open_dataset(
            tree_path, engine="gds-zarr", store=zarr.storage.MemoryStore(), device="cpu"
        )


def test_engine_argument_is_ignored_as_by_zarr(v3_path: Path) -> None:
    gds = GdsZarrBackendEntrypoint().open_dataset(v3_path, engine="zarr", device="cpu")
    ref = ZarrBackendEntrypoint().open_dataset(v3_path, engine="zarr")
    xr.testing.assert_identical(gds.load(), ref.load())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"decode_cf": False},
        {"chunks": {}},
        {"chunks": {"time": 3}},
        {"cache": False},
        {"inline_array": True, "chunks": {}},
        {"create_default_indexes": False},
        {"backend_kwargs": {"consolidated": True, "zarr_format": 3}},
    ],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()),
)
def test_xarray_arguments_match_zarr(v3_path: Path, device: str, kwargs: dict[str, Any]) -> None:
    gds_kwargs = dict(kwargs)
    if "chunks" in kwargs:
        pytest.importorskip("dask")
        # xarray's default dask manager copies device blocks to numpy (see chunks.py)
        gds_kwargs["chunked_array_type"] = "gds-dask"
    gds = xr.open_dataset(v3_path, engine="gds-zarr", device=device, **gds_kwargs)
    ref = xr.open_dataset(v3_path, engine="zarr", **kwargs)
    assert set(gds.xindexes) == set(ref.xindexes)
    assert {k: v.chunks for k, v in gds.variables.items()} == {
        k: v.chunks for k, v in ref.variables.items()
    }
    assert_same(gds, ref, device)


# -- variables ---------------------------------------------------------------------

_STRINGS = np.array(["a", "bcd", "", "é"], dtype=object)

VARIABLES: dict[str, Callable[[], xr.Dataset]] = {
    "named-None": lambda: xr.Dataset({None: (("y", "x"), np.arange(6.0).reshape(2, 3))}),
    "named-None-coord": lambda: xr.Dataset(
        {None: (("x",), np.arange(3, dtype="i2"))}, coords={"x": [10, 20, 30]}
    ),
    "0d-None": lambda: xr.Dataset({"v": ((), None)}),
    "object-with-None": lambda: xr.Dataset({"v": (("x",), np.array([None, "a", "bc"], object))}),
    "all-None": lambda: xr.Dataset({"v": (("x",), np.array([None, None], dtype=object))}),
    "None-and-floats": lambda: xr.Dataset({"v": (("x",), np.array([None, 1.5], dtype=object))}),
    "object-strings": lambda: xr.Dataset({"s": (("x",), _STRINGS)}),
    "unicode": lambda: xr.Dataset({"s": (("x",), _STRINGS.astype("U3"))}),
    "bytes": lambda: xr.Dataset({"b": (("x",), np.array([b"ab", b"", b"xyz", b"q"]))}),
    "object-bytes": lambda: xr.Dataset({"b": (("x",), np.array([b"ab", b"", b"c"], object))}),
    "char-array": lambda: xr.Dataset({"c": (("x", "n"), np.array([[b"a", b"b"], [b"c", b""]]))}),
    "string-coord": lambda: xr.Dataset(
        {"v": (("x",), np.arange(4.0))}, coords={"x": _STRINGS, "label": ("x", _STRINGS)}
    ),
    "0d-float": lambda: xr.Dataset({"v": ((), 2.5)}),
    "0d-int": lambda: xr.Dataset({"v": ((), np.int16(-3))}),
    "0d-bool": lambda: xr.Dataset({"v": ((), True)}),
    "0d-string": lambda: xr.Dataset({"v": ((), "hello")}),
    "0d-datetime": lambda: xr.Dataset({"v": ((), np.datetime64("2001-02-03T04", "ns"))}),
    "0d-coord": lambda: xr.Dataset(
        {"v": (("x",), np.arange(3.0))}, coords={"x": [1, 2, 3], "t": ((), 7.0)}
    ),
    "datetime-with-NaT": lambda: xr.Dataset(
        {"t": (("x",), pd.to_datetime(["2000-01-01", None, "2000-01-03"]).values)}
    ),
    "timedelta-with-NaT": lambda: xr.Dataset(
        {"d": (("x",), pd.to_timedelta(["1h", None, "3h"]).values)}
    ),
}


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("case", list(VARIABLES))
def test_variables_round_trip_as_with_zarr(
    tmp_path: Path, device: str, case: str, zarr_format: int
) -> None:
    path = tmp_path / "v.zarr"
    VARIABLES[case]().to_zarr(path, zarr_format=zarr_format, consolidated=False)
    ref = xr.open_dataset(path, engine="zarr", consolidated=False)
    gds = xr.open_dataset(path, engine="gds-zarr", consolidated=False, device=device)
    assert_same(gds, ref, device)
    tree = xr.open_datatree(path, engine="gds-zarr", consolidated=False, device=device)
    assert_same_tree(tree, xr.open_datatree(path, engine="zarr", consolidated=False), device)


def test_variable_named_none_selections(tmp_path: Path, device: str) -> None:
    path = tmp_path / "none.zarr"
    VARIABLES["named-None"]().to_zarr(path, zarr_format=3)
    gds = xr.open_dataset(path, engine="gds-zarr", device=device)
    ref = xr.open_dataset(path, engine="zarr")
    assert list(gds.data_vars) == [None]
    assert_same(gds.isel(x=slice(1, 3)), ref.isel(x=slice(1, 3)), device)
    assert_same(gds.isel(y=1), ref.isel(y=1), device)


# Fill values set through xarray's encoding (CF ``_FillValue``; v3 also zarr's
# ``fill_value``), with missing chunks (all fill) and stored fill values.
def _encoded_fill_dataset() -> xr.Dataset:
    f = np.arange(24.0).reshape(4, 6)
    f[:2, :3] = np.nan  # one chunk of NaN: not written
    f[3, 5] = np.nan
    i = np.arange(24, dtype="i4").reshape(4, 6)
    return xr.Dataset(
        {
            "f_nan": (("y", "x"), f),
            "f_sentinel": (("y", "x"), f),
            "f_packed": (("y", "x"), f),
            "i_fill": (("y", "x"), i),
            "u_fill": (("y", "x"), i.astype("u1")),
            "f_none": (("y", "x"), f),
            "i_v3_fill_value": (("y", "x"), i),
            "f_v3_fill_value": (("y", "x"), f),
        }
    )


def _encoded_fill_encoding(zarr_format: int) -> dict[str, dict[str, Any]]:
    chunks = {"chunks": (2, 3)}
    enc: dict[str, dict[str, Any]] = {
        "f_nan": {"_FillValue": np.nan, **chunks},
        "f_sentinel": {"_FillValue": -999.0, **chunks},
        "f_packed": {"dtype": "i2", "scale_factor": 0.5, "_FillValue": -1, **chunks},
        "i_fill": {"_FillValue": 5, **chunks},
        "u_fill": {"_FillValue": 7, **chunks},
        "f_none": {"_FillValue": None, **chunks},
        "i_v3_fill_value": dict(chunks),
        "f_v3_fill_value": dict(chunks),
    }
    if zarr_format == 3:  # zarr's fill_value through the encoding (v3 only)
        enc["i_v3_fill_value"]["fill_value"] = 9
        enc["f_v3_fill_value"]["fill_value"] = 3.0
    return enc


def _zarr_fill_store(path: Path, zarr_format: Literal[2, 3]) -> Path:
    """Arrays written by zarr itself: a ``fill_value`` and no ``_FillValue``; the lower
    chunks are never written and one stored element equals the fill value."""
    group = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    specs: dict[str, tuple[str, Any]] = {
        "f8": ("f8", 1.5),
        "f4_zero": ("f4", 0.0),
        "f2_nan": ("f2", np.nan),
        "i4": ("i4", 7),
        "u1": ("u1", 255),
        "bool": ("bool", True),
        "c8": ("c8", 0j),
    }
    for name, (dtype, fill) in specs.items():
        array = group.create_array(
            name,
            shape=(6, 5),
            chunks=(3, 2),
            dtype=dtype,
            fill_value=fill,
            dimension_names=("y", "x") if zarr_format == 3 else None,
        )
        if zarr_format == 2:
            array.attrs["_ARRAY_DIMENSIONS"] = ["y", "x"]
        values = np.arange(30).reshape(6, 5).astype(dtype)
        values[0, 0] = fill
        array[:3, :] = values[:3]
    zarr.consolidate_metadata(path)
    return path


def _xarray_reference(path: Path, use_zarr_fill_value_as_mask: bool | None) -> xr.Dataset:
    """xarray's own reading with this ``use_zarr_fill_value_as_mask``: engine="zarr"
    passes None whatever it is given (pydata/xarray#10269), its ZarrStore applies it."""
    zstore = ZarrStore.open_group(
        str(path), mode="r", use_zarr_fill_value_as_mask=use_zarr_fill_value_as_mask
    )
    ref = xr.open_dataset(zstore)
    if use_zarr_fill_value_as_mask is None:
        xr.testing.assert_identical(ref.load(), xr.open_dataset(path, engine="zarr").load())
    return ref


@pytest.mark.parametrize("mask", [None, True, False], ids=lambda m: f"mask={m}")
@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("source", ["encoding", "zarr-fill_value"])
def test_fill_values_match_zarr(
    tmp_path: Path, device: str, source: str, zarr_format: Literal[2, 3], mask: bool | None
) -> None:
    path = tmp_path / "fill.zarr"
    if source == "encoding":
        _encoded_fill_dataset().to_zarr(
            path, zarr_format=zarr_format, encoding=_encoded_fill_encoding(zarr_format)
        )
    else:
        _zarr_fill_store(path, zarr_format)
    ref = _xarray_reference(path, mask)
    gds = xr.open_dataset(path, engine="gds-zarr", use_zarr_fill_value_as_mask=mask, device=device)
    assert_same(gds, ref, device)
    # the argument changes what is read: compare with the default reading
    if mask is not None and source == "zarr-fill_value" and mask != (zarr_format == 2):
        default = xr.open_dataset(path, engine="gds-zarr", device="cpu").load()
        assert not default.identical(gds.load().as_numpy())
    # the same through open_datatree and open_groups, and lazily selected
    tree = xr.open_datatree(
        path, engine="gds-zarr", use_zarr_fill_value_as_mask=mask, device=device
    )
    assert_same(tree.to_dataset(), ref, device)
    (only,) = xr.open_groups(
        path, engine="gds-zarr", use_zarr_fill_value_as_mask=mask, device=device
    ).values()
    assert_same(only.isel(y=slice(1, 5), x=[0, 4]), ref.isel(y=slice(1, 5), x=[0, 4]), device)


def test_fill_value_mask_argument_is_checked(v3_path: Path) -> None:
    with pytest.raises(TypeError, match="use_zarr_fill_value_as_mask must be True, False or None"):
        xr.open_dataset(v3_path, engine="gds-zarr", use_zarr_fill_value_as_mask="yes", device="cpu")


@pytest.mark.parametrize("mask_and_scale", [False, True], ids=lambda m: f"mask_and_scale={m}")
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_fill_value_mask_false_as_xarray_store(
    tmp_path: Path, device: str, zarr_format: Literal[2, 3], mask_and_scale: bool
) -> None:
    """``_FillValue`` set through encoding, read with ``use_zarr_fill_value_as_mask=False``.
    In Zarr v2 xarray stores it as the array's ``fill_value`` only, so the argument
    (ignore that) leaves no ``_FillValue`` attribute and no mask: what
    ``xarray.backends.ZarrStore.open_group`` reads. ``engine="zarr"`` passes None for the
    argument whatever it is given (pydata/xarray#10269) and so reports and masks with it;
    if the last assertion fails, xarray now applies the argument and both engines read
    the same: compare with engine="zarr" directly then."""
    ds = xr.Dataset({"a": (("y", "x"), np.arange(12, dtype="f4").reshape(3, 4))})
    ds["a"].encoding["_FillValue"] = 5.0  # the value at [1, 1]
    path = tmp_path / "fill.zarr"
    ds.to_zarr(path, zarr_format=zarr_format, consolidated=True)
    kwargs: dict[str, Any] = {"mask_and_scale": mask_and_scale}
    ref = xr.open_dataset(
        ZarrStore.open_group(str(path), mode="r", use_zarr_fill_value_as_mask=False), **kwargs
    )
    gds = xr.open_dataset(
        path, engine="gds-zarr", use_zarr_fill_value_as_mask=False, device=device, **kwargs
    )
    assert_same(gds, ref, device)
    fill_attr = "_FillValue" in gds["a"].attrs
    assert fill_attr == (zarr_format == 3 and not mask_and_scale)
    value = float(gds["a"].as_numpy()[1, 1])
    masked = zarr_format == 3 and mask_and_scale  # a v3 _FillValue is an attribute
    assert np.isnan(value) if masked else value == 5.0
    # engine="zarr" ignores the argument: it reads as with None (the default)
    with_zarr = xr.open_dataset(path, engine="zarr", use_zarr_fill_value_as_mask=False, **kwargs)
    default = xr.open_dataset(path, engine="zarr", **kwargs)
    xr.testing.assert_identical(with_zarr.load(), default.load())
    assert with_zarr.identical(ref.load()) == (zarr_format == 3)

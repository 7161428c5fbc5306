"""Settings and warnings as users of zarr and dask expect them, and no side effect at import."""

from __future__ import annotations

import json
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
from xarray_gds import config, device
from xarray_gds.errors import ConsolidatedMetadataWarning, HostRouteWarning, XarrayGdsWarning


def test_defaults_are_visible_in_zarrs_configuration() -> None:
    for name, knob in config.KNOBS.items():
        assert zarr.config.get(f"xarray_gds.{name}") == knob.default, name
    assert zarr.config.get("xarray_gds.route") == "auto"
    assert zarr.config.get("xarray_gds.fuse_dask") is True


def test_every_knob_is_documented() -> None:
    table = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    for knob in config.KNOBS.values():
        assert f"| `{knob.name}` | `{knob.env}` |" in table, knob.name


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"xarray_gds.rout": "gpu"},
            r"unknown xarray-gds setting 'xarray_gds.rout'; did you mean ",
        ),
        ({"xarray_gds.route": "fast"}, r"'xarray_gds.route'.* one of 'auto', 'gpu', 'host', not"),
        ({"xarray_gds.host_threads": "zero"}, r"'xarray_gds.host_threads'.* type int, not 'zero'"),
        ({"xarray_gds.host_threads": 0}, r"'xarray_gds.host_threads'.* an integer >= 1, not 0"),
        ({"xarray_gds.fuse_dask": "maybe"}, r"'xarray_gds.fuse_dask'.* a boolean"),
        ({"xarray_gds.levels": "best"}, r"'xarray_gds.levels'.* one of 'host', 'gpu', not"),
    ],
)
def test_bad_settings_fail_the_next_read(v3_store: Path, settings: dict, message: str) -> None:
    ds = xr.open_dataset(v3_store, engine="gds-zarr", device="cpu")
    with zarr.config.set(settings):
        with pytest.raises(ValueError, match=message):
            ds.t2m.values  # noqa: B018
        with pytest.raises(ValueError, match=message):
            xr.open_dataset(v3_store, engine="gds-zarr", device="cpu")
    # the setting gone, the same dataset reads
    ref = xr.open_dataset(v3_store, engine="zarr").t2m.values
    np.testing.assert_array_equal(ds.t2m.values, ref)


def test_bad_environment_variable_names_it(v3_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XARRAY_GDS_ROUTE", "sideways")
    with pytest.raises(ValueError, match=r"environment variable XARRAY_GDS_ROUTE\) takes one of"):
        xr.open_dataset(v3_store, engine="gds-zarr", device="cpu").t2m.values  # noqa: B018


def test_disable_cuda_is_a_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    device.cuda_status.cache_clear()
    try:
        with zarr.config.set({"xarray_gds.disable_cuda": True}):
            ok, reason = device.cuda_status()
        assert not ok and "xarray_gds.disable_cuda" in reason
    finally:
        device.cuda_status.cache_clear()


def _fake_kvikio(threads: int) -> types.ModuleType:
    state = {"num_threads": threads}
    defaults = types.ModuleType("kvikio.defaults")
    defaults.get = lambda key: state[key]  # type: ignore[attr-defined]
    defaults.set = lambda key, value: state.__setitem__(key, value)  # type: ignore[attr-defined]
    defaults.state = state  # type: ignore[attr-defined]
    return defaults


@pytest.mark.parametrize(("users", "expected"), [(1, "ours"), (4, 4), (32, 32)])
def test_users_kvikio_threads_are_kept(
    monkeypatch: pytest.MonkeyPatch, users: int, expected: object
) -> None:
    defaults = _fake_kvikio(users)
    module = types.ModuleType("kvikio")
    module.defaults = defaults  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    device._configure_kvikio.cache_clear()
    try:
        device._configure_kvikio(module)
    finally:
        device._configure_kvikio.cache_clear()
    import os

    ours = min(16, os.cpu_count() or 1)
    assert defaults.state["num_threads"] == (ours if expected == "ours" else expected)  # type: ignore[attr-defined]


def test_warnings_have_the_packages_category_and_the_users_line(tmp_path: Path) -> None:
    path = tmp_path / "plain.zarr"
    xr.Dataset({"a": (("x", "y"), np.ones((3, 4)))}).to_zarr(path, consolidated=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        xr.open_dataset(path, engine="gds-zarr", device="cpu")
    ours = [w for w in record if issubclass(w.category, XarrayGdsWarning)]
    assert [w.category for w in ours] == [ConsolidatedMetadataWarning]
    assert ours[0].filename == __file__
    assert "zarr.consolidate_metadata" in str(ours[0].message)
    assert not [w for w in record if "consolidated" in str(w.message) and w not in ours]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=xarray_gds.XarrayGdsWarning)
        xr.open_dataset(path, engine="gds-zarr", device="cpu").a.values  # noqa: B018
    assert issubclass(HostRouteWarning, RuntimeWarning)


_SIDE_EFFECTS = """
import importlib.util, json, sys
import numpy as np, xarray as xr, dask
netcdf = importlib.util.find_spec("netCDF4") is not None  # the test extra has it
xr.Dataset({"a": ("x", np.arange(4.0))}).to_zarr(sys.argv[1] + "/s.zarr")
if netcdf:
    xr.Dataset({"a": ("x", np.arange(4.0))}).to_netcdf(sys.argv[1] + "/s.nc")
before = repr(dask.config.get("array_optimize", None))
import xarray_gds
xr.open_dataset(sys.argv[1] + "/s.zarr", engine="zarr", chunks={}).a.values
if netcdf:
    xr.open_dataset(sys.argv[1] + "/s.nc", engine="netcdf4", chunks={}).a.values
after_others = repr(dask.config.get("array_optimize", None))
xr.open_dataset(sys.argv[1] + "/s.zarr", engine="gds-zarr", device="cpu", chunks={}).a.values
after_ours = type(dask.config.get("array_optimize", None)).__name__
print(json.dumps([before, after_others, after_ours, "xarray_gds.tools" in sys.modules]))
"""


@pytest.mark.needs("dask")
def test_import_and_other_engines_leave_dask_alone(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SIDE_EFFECTS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    before, after_others, after_ours, tools = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == after_others == "None"
    assert after_ours == "_Optimizer"  # installed with the first engine array
    assert tools is False


def test_the_warning_classes_are_exported_by_the_package() -> None:
    """config.md names them as xarray_gds.X: the package exports each one."""
    from xarray_gds import errors

    names = ["XarrayGdsWarning", "HostRouteWarning", "HostBlocksWarning"]
    for name in [*names, "ConsolidatedMetadataWarning"]:
        assert getattr(xarray_gds, name) is getattr(errors, name)
        assert name in xarray_gds.__all__
        assert f"xarray_gds.{name}" in (Path(__file__).parent.parent / "docs/config.md").read_text()

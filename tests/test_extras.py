"""The optional packages: each is imported where its feature is used, and a missing one
raises ImportError naming the feature and the extra of pyproject.toml to install.

The public entry points run in a subprocess where every optional package fails to
import (``sys.modules[name] = None``), as on a plain ``pip install .``; the base lane of
``scripts/test-min.sh`` runs the same with none installed."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import xarray_gds
from xarray_gds import _optional

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
#: what the package imports that the base install does not have (import names)
OPTIONAL = sorted({*_optional.EXTRAS, "torch", "dask_cuda", "cupy", "cupyx", "kvikio", "nvidia"})


def _blocked(code: str, *, allow: tuple[str, ...] = ()) -> list[str]:
    """Run ``code`` in a Python where every optional package (but ``allow``) fails to
    import; the lines it printed."""
    # zarr imports universal-pathlib where it is installed (VirtualiZarr brings it), and
    # it imports fsspec: blocked too, zarr does without it
    block = [name for name in [*OPTIONAL, "upath"] if name not in allow]
    prelude = f"import sys\nfor name in {block!r}:\n    sys.modules[name] = None\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


# -- the helper ------------------------------------------------------------------------


def test_need_names_the_feature_and_the_extra() -> None:
    assert _optional.need("json", "anything") is json
    with pytest.raises(ImportError) as info:
        _optional.need("xarray_gds_no_such_package.sub", "reading things", "refs")
    assert str(info.value) == (
        'reading things needs xarray_gds_no_such_package: pip install ".[refs]" in a '
        "checkout of xarray-gds"
    )
    assert info.value.name == "xarray_gds_no_such_package"
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert _optional.missing_message("fsspec", "reading reference sets") == (
        'reading reference sets needs fsspec: pip install ".[refs]" in a checkout of xarray-gds'
    )
    assert _optional.missing_message("torch", "BatchLoader.torch_dataset()") == (
        "BatchLoader.torch_dataset() needs torch, which is not installed: pip install torch"
    )
    assert _optional.install_hint(["dask", "refs"]) == 'pip install ".[dask,refs]"'


def test_need_names_the_package_a_module_itself_could_not_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module that is there but imports a missing package (kerchunk's HDF5 scanner
    without h5py): the message names the missing package."""
    (tmp_path / "xgds_scanner.py").write_text("import xgds_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"^scanning needs xgds_missing_dependency: pip"):
        _optional.need("xgds_scanner", "scanning", "refs")


def test_need_names_the_package_whose_module_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package that is there without the module asked for (a version without it):
    the message names the package, not its module."""
    (tmp_path / "xgds_package").mkdir()
    (tmp_path / "xgds_package" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as info:
        _optional.need("xgds_package.scanner", "scanning", "refs")
    assert str(info.value) == (
        'scanning needs xgds_package: pip install ".[refs]" in a checkout of xarray-gds'
    )
    assert info.value.name == "xgds_package"


def test_every_package_of_the_map_has_its_extra() -> None:
    """Each optional package names an extra of pyproject.toml that installs it (itself
    or through the package it serves); ``all`` holds every feature's extra."""
    assert set(_optional.EXTRAS.values()) <= set(EXTRAS)
    listed = {extra: " ".join(EXTRAS[extra]) for extra in EXTRAS}
    through = {"obspec_utils": "virtualizarr"}  # a dependency of VirtualiZarr
    for package, extra in _optional.EXTRAS.items():
        assert through.get(package, package) in listed[extra], (package, extra)
    features = {"dask", "refs", "icechunk", "remote", "virtual", "xbatcher", "fast-host"}
    assert EXTRAS["all"] == [f"xarray-gds[{','.join(sorted(features, key=list(EXTRAS).index))}]"]


# -- no optional import at module level ---------------------------------------------------


def _module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """The imports a module runs when it is imported: its top-level statements and
    those of top-level ``if``/``with`` blocks (not ``if TYPE_CHECKING:``, not a ``try``
    whose ``except ImportError`` handles a missing package)."""
    found: list[tuple[int, str]] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((node.lineno, node.module))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.With):
                visit(node.body)
            elif isinstance(node, ast.Try):
                handled = any(
                    h.type is not None and "ImportError" in ast.unparse(h.type)
                    for h in node.handlers
                )
                if not handled:
                    visit(node.body)

    visit(tree.body)
    return found


def test_no_module_imports_an_optional_package_when_imported() -> None:
    """Every module of the package imports its optional packages where they are used
    (in the function of the feature), so that ``import xarray_gds`` and the engine's
    entry points work on the base install."""
    offending = []
    for path in sorted((ROOT / "xarray_gds").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for line, module in _module_level_imports(tree):
            if module.split(".")[0] in OPTIONAL:
                offending.append(f"{path.relative_to(ROOT)}:{line}: import {module}")
    assert offending == []


def test_every_module_imports_without_the_optional_packages() -> None:
    names = [m.name for m in pkgutil.walk_packages(xarray_gds.__path__, prefix="xarray_gds.")]
    assert "xarray_gds.tools.bench" in names and "xarray_gds.stores.refs" in names
    out = _blocked(
        "import importlib, json\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] in "
        f"{OPTIONAL!r} and sys.modules[n] is not None)))\n"
    )
    assert json.loads(out[-1]) == []


# -- the entry points of each feature, without its packages ----------------------------

_OPEN = """
import numpy as np, xarray as xr, xarray_gds, tempfile, pathlib
root = pathlib.Path(tempfile.mkdtemp())
ds = xr.Dataset({"v": ("x", np.arange(4.0))})
ds.to_zarr(root / "s.zarr")
def error(call):
    try:
        call()
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
"""


def test_features_without_their_packages_name_the_extra() -> None:
    out = _blocked(
        _OPEN
        + """
refs = {"version": 1, "refs": {".zgroup": '{"zarr_format": 2}'}}
print(error(lambda: xr.open_dataset(refs, engine="gds-zarr", device="cpu")))
print(error(lambda: xr.open_dataset("s3://bucket/d.zarr", engine="gds-zarr", device="cpu")))
print(error(lambda: xr.open_datatree("https://h.example/d.zarr", engine="gds-zarr")))
print(error(lambda: xarray_gds.to_zarr(ds, "s3://bucket/out.zarr")))
print(error(lambda: xarray_gds.to_zarr(ds, "memory://out.zarr")))
print(error(lambda: xarray_gds.to_zarr(ds.chunk(), root / "o.zarr")))
print(error(lambda: xr.open_dataset(root / "s.zarr", engine="gds-zarr", chunks={})))
print(xr.open_dataset(root / "s.zarr", engine="gds-zarr", device="cpu").v.values.tolist())
"""
    )
    checkout = "in a checkout of xarray-gds"
    assert out[:5] == [
        f'ImportError: reading reference sets needs fsspec: pip install ".[refs]" {checkout}',
        "ImportError: reading 's3://bucket/d.zarr' needs obstore: "
        f'pip install ".[remote]" {checkout}',
        "ImportError: reading 'https://h.example/d.zarr' needs obstore: "
        f'pip install ".[remote]" {checkout}',
        "ImportError: writing to 's3://bucket/out.zarr' needs fsspec: "
        f'pip install ".[remote]" {checkout}',
        f'ImportError: writing to memory:// URLs needs fsspec: pip install ".[remote]" {checkout}',
    ]
    # dask: xarray's own chunk manager check, which names the package
    assert "ImportError" in out[5] and "dask" in out[5]
    assert "ImportError" in out[6] and "dask" in out[6]
    assert out[7] == "[0.0, 1.0, 2.0, 3.0]"  # an eager read needs nothing more


def test_remote_write_without_its_filesystem_names_the_one_for_the_url() -> None:
    """With fsspec there but not s3fs (or aiohttp, for HTTP), a write names the one
    its URL needs; reads name obstore, the engine's client."""
    pytest.importorskip("fsspec")
    out = _blocked(
        _OPEN
        + """
print(error(lambda: xarray_gds.to_zarr(ds, "s3://bucket/out.zarr")))
print(error(lambda: xarray_gds.to_zarr(ds, "https://h.example/out.zarr")))
try:
    xarray_gds.to_zarr(ds, "https://user:secret@h.example/out.zarr")
except ImportError as err:
    print(err.name, err)
print(error(lambda: xr.open_dataset("s3://bucket/d.zarr", engine="gds-zarr", device="cpu")))
""",
        allow=("fsspec",),
    )
    assert out == [
        "ImportError: writing to 's3://bucket/out.zarr' needs s3fs: "
        'pip install ".[remote]" in a checkout of xarray-gds',
        "ImportError: writing to 'https://h.example/out.zarr' needs aiohttp: "
        'pip install ".[remote]" in a checkout of xarray-gds',
        "aiohttp writing to 'https://***@h.example/out.zarr' needs aiohttp: "
        'pip install ".[remote]" in a checkout of xarray-gds',
        "ImportError: reading 's3://bucket/d.zarr' needs obstore: "
        'pip install ".[remote]" in a checkout of xarray-gds',
    ]


def test_parquet_references_without_fastparquet_name_the_extra(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    refs = tmp_path / "refs.parq"
    refs.mkdir()
    (refs / ".zmetadata").write_text(json.dumps({"record_size": 10, "metadata": {}}))
    plain = tmp_path / "refs.json"  # a JSON reference set needs no fastparquet
    plain.write_text(json.dumps({"version": 1, "refs": {".zgroup": '{"zarr_format": 2}'}}))
    out = _blocked(
        "import xarray as xr, xarray_gds\n"
        "try:\n"
        f"    xr.open_dataset({str(refs)!r}, engine='gds-zarr', device='cpu')\n"
        "except ImportError as err:\n"
        "    print(err)\n"
        f"print(dict(xr.open_dataset({str(plain)!r}, engine='gds-zarr', device='cpu').sizes))\n",
        allow=("fsspec",),
    )
    assert out == [
        'reading Parquet reference sets needs fastparquet: pip install ".[refs]" in a '
        "checkout of xarray-gds",
        "{}",
    ]


def test_the_command_line_names_the_extra() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys\nfor n in {[*OPTIONAL, 'upath']!r}:\n    sys.modules[n] = None\n"
            "from xarray_gds.tools import cli\nsys.exit(cli.main(['info', 's3://bucket/d.zarr']))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert 'needs obstore: pip install ".[remote]" in a checkout of xarray-gds' in done.stderr

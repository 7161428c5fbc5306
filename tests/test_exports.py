"""What the package exports: every warning and exception class of
:mod:`xarray_gds.errors`, and every warning class of the package wherever it is
defined (``IcechunkFallbackWarning`` lives with the Icechunk kind), as docs/config.md
promises."""

from __future__ import annotations

import ast
from pathlib import Path

import xarray_gds
from xarray_gds import errors

PACKAGE = Path(xarray_gds.__file__).parent


def _exported_classes() -> dict[str, type]:
    """The warning and exception classes in ``xarray_gds.__all__``."""
    found = {name: getattr(xarray_gds, name) for name in xarray_gds.__all__}
    return {
        name: obj
        for name, obj in found.items()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    }


def test_every_class_of_errors_is_exported() -> None:
    defined = {
        name: obj
        for name, obj in vars(errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    }
    assert {"XarrayGdsWarning", "HostRouteWarning", "ChunkDecodeError"} <= set(defined)
    exported = _exported_classes()
    missing = sorted(set(defined) - set(exported))
    assert not missing, f"export these from xarray_gds/__init__.py: {missing}"
    assert all(exported[name] is cls for name, cls in defined.items())
    assert set(errors.__all__) == {*defined, "warn"}


def _warning_classes() -> set[str]:
    """Classes of the core package whose bases name ``XarrayGdsWarning`` (or a class
    that does), found in the source: a module nobody imports counts too."""
    bases: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if (PACKAGE / "tools") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                names = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                bases[node.name] = names
    found = {"XarrayGdsWarning"}
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            return found
        found |= more


def test_every_warning_class_of_the_package_is_exported() -> None:
    warnings = _warning_classes()
    assert {"IcechunkFallbackWarning", "HostRouteWarning"} <= warnings
    exported = _exported_classes()
    missing = sorted(warnings - set(exported))
    assert not missing, f"export these from xarray_gds/__init__.py: {missing}"
    assert all(issubclass(exported[name], xarray_gds.XarrayGdsWarning) for name in warnings)
    assert xarray_gds.IcechunkFallbackWarning.__module__ == "xarray_gds.stores.icechunk"

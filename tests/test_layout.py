"""The package's layout: the core (every module of ``xarray_gds`` outside
``xarray_gds/tools``) never imports the tools (command line, demo, benchmarks,
calibration, the loopback S3 server), starts no server, and a read with
``engine="gds-zarr"`` loads none of the tools; no core module is over 600 lines and no
core function over 80."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import xarray_gds

PACKAGE = Path(xarray_gds.__file__).parent
TOOLS = PACKAGE / "tools"
CORE = sorted(p for p in PACKAGE.rglob("*.py") if TOOLS not in p.parents)
#: modules that start or stand in for servers: the benchmarks' and tests' business
SERVERS = ("moto", "boto3", "http.server", "socketserver", "subprocess")


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative imports
    resolved, ``from X import Y`` giving ``X.Y`` too (``Y`` may be a module), and
    ``importlib.import_module``/``__import__`` calls with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = _module_name(path, package).split(".")
    package_parts = name if path.name == "__init__.py" else name[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((node.lineno, arg.value))
    return found


def _named(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_layout_finds_the_core_and_the_tools() -> None:
    names = {_module_name(p) for p in CORE}
    assert {
        "xarray_gds",
        "xarray_gds.backend",
        "xarray_gds.stores.local",
        "xarray_gds.stores.files",
    } <= names
    assert not any(_named(n, "xarray_gds.tools") for n in names)
    tools = {p.stem for p in TOOLS.glob("*.py")}
    assert {"cli", "demo", "bench", "bench_cluster", "bench_refs", "calibrate"} <= tools
    for old in ("cli", "demo", "bench", "bench_cluster", "bench_refs", "calibrate"):
        assert not (PACKAGE / f"{old}.py").exists(), f"xarray_gds/{old}.py belongs in tools/"


def test_imports_resolve_relative_and_dynamic_forms(tmp_path: Path) -> None:
    """The checker sees every way of naming the tools from a core module."""
    sub = tmp_path / "xarray_gds" / "zarr"
    sub.mkdir(parents=True)
    (tmp_path / "xarray_gds" / "__init__.py").write_text("")
    probe = sub / "probe.py"
    probe.write_text(
        "from .. import tools\n"
        "from ..tools.cli import main\n"
        "import importlib\n"
        "importlib.import_module('xarray_gds.tools.bench')\n"
        "from xarray_gds import tools as t\n"
    )
    found = _imports(probe, tmp_path / "xarray_gds")
    hits = [(line, m) for line, m in found if _named(m, "xarray_gds.tools")]
    assert sorted({line for line, _ in hits}) == [1, 2, 4, 5]


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_module_never_imports_the_tools(path: Path) -> None:
    bad = [
        f"line {line}: {module}"
        for line, module in _imports(path)
        if _named(module, "xarray_gds.tools")
    ]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports the tools: {bad}"


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_module_starts_no_server(path: Path) -> None:
    bad = [
        f"line {line}: {module}"
        for line, module in _imports(path)
        if any(_named(module, server) for server in SERVERS)
    ]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports a server module: {bad}"


def test_read_loads_no_tools(v3_store: Path) -> None:
    """Importing the package and reading a store with the engine leave every tool
    module unloaded (a fresh interpreter: this one has imported them for other
    tests)."""
    code = (
        "import sys, json, xarray as xr, xarray_gds\n"
        f"ds = xr.open_dataset({str(v3_store)!r}, engine='gds-zarr', device='cpu')\n"
        "ds.load()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('xarray_gds.tools'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr


def test_command_line_entry_point_is_the_tools_cli() -> None:
    """pyproject's ``xarray-gds`` script names :func:`xarray_gds.tools.cli.main`."""
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    target = pyproject["project"]["scripts"]["xarray-gds"]
    assert target == "xarray_gds.tools.cli:main"
    from xarray_gds.tools import cli

    assert callable(cli.main)


#: the most lines a core module and a core function (its docstring included) may have:
#: past them a module holds more than one job and a function more than one step
MODULE_LINES = 600
FUNCTION_LINES = 80


def _long_functions(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(root)}:{node.lineno} {node.name} "
        f"({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    ]


def test_core_modules_and_functions_stay_short() -> None:
    long_modules = [
        f"{p.relative_to(PACKAGE.parent)} ({n} lines)"
        for p in CORE
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    ]
    long_functions = [f for p in CORE for f in _long_functions(p)]
    assert long_modules == [], f"split these modules by job: {long_modules}"
    assert long_functions == [], f"split these functions into named steps: {long_functions}"


def test_the_length_check_sees_long_functions_at_any_depth(tmp_path: Path) -> None:
    def source(name: str, lines: int, indent: str = "") -> str:
        body = "\n".join(f"{indent}    x{i} = {i}" for i in range(lines - 1))
        return f"{indent}{name}:\n{body}\n"

    text = source("async def long_async()", FUNCTION_LINES + 1)
    text += source("def just_short()", FUNCTION_LINES)
    text += "class C:\n" + source("def long_method(self)", FUNCTION_LINES + 1, "    ")
    (tmp_path / "m.py").write_text(text)
    found = [f.split(" (")[0] for f in _long_functions(tmp_path / "m.py", tmp_path)]
    assert found == ["m.py:1 long_async", f"m.py:{2 * FUNCTION_LINES + 3} long_method"]

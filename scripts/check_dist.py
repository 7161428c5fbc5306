"""Checks what the sdist and the wheel in a directory hold (scripts/build-check.sh).

    python scripts/check_dist.py DIST_DIR

The sdist must hold every file git tracks under the package, tests, docs,
constraints and scripts directories, plus the files a build and the docs read, and
nothing from a working tree beyond them (virtual environments, built docs, caches,
wheels, byte code). The wheel must hold the package alone, with the entry points and
the version of ``xarray_gds/__init__.py``. Exits 1 naming every problem found.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "xarray_gds"
#: directories whose tracked files all belong in the sdist
SDIST_DIRS = (PACKAGE, "tests", "docs", "constraints", "scripts")
#: files outside them that the sdist needs: the build reads the first three, the docs
#: mkdocs.yml, the tests of the docs' examples CONTRIBUTING.md
SDIST_FILES = ("pyproject.toml", "README.md", "LICENSE", "mkdocs.yml", "CONTRIBUTING.md")
#: path parts and name endings that never belong in a distribution
JUNK_PARTS = {
    ".git",
    ".venv",
    ".venv-min",
    ".whl",
    ".hypothesis",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    "__pycache__",
    ".asv",
    "site",
    "dist",
    "build",
}
JUNK_ENDINGS = (".whl", ".tar.gz", ".pyc", ".so", ".lock")


def version() -> str:
    """``__version__`` as ``xarray_gds/__init__.py`` assigns it, read without importing."""
    tree = ast.parse((ROOT / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    raise SystemExit(f"no __version__ = '...' in {PACKAGE}/__init__.py")


def junk(names: list[str]) -> list[str]:
    """The ``names`` (archive paths) that no distribution should hold."""
    return [
        n for n in names if JUNK_PARTS & set(PurePosixPath(n).parts) or n.endswith(JUNK_ENDINGS)
    ]


def tracked() -> set[str]:
    out = subprocess.run(
        ["git", "ls-files", "--", *SDIST_DIRS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {n for n in out.splitlines() if (ROOT / n).is_file()} | set(SDIST_FILES)


def check_sdist(path: Path, ver: str) -> list[str]:
    with tarfile.open(path) as tar:
        members = [m.name for m in tar.getmembers() if m.isfile()]
    top = f"xarray_gds-{ver}/"
    problems = [f"sdist: {n} is outside {top}" for n in members if not n.startswith(top)]
    names = [n.removeprefix(top) for n in members]
    problems += [f"sdist: holds {n}, which no build needs" for n in junk(names)]
    problems += [f"sdist: lacks {n}" for n in sorted(tracked() - set(names))]
    if "PKG-INFO" not in names:
        problems.append("sdist: lacks PKG-INFO")
    return problems


def check_wheel(path: Path, ver: str) -> list[str]:
    info = f"xarray_gds-{ver}.dist-info/"
    with zipfile.ZipFile(path) as whl:
        names = whl.namelist()
        metadata = whl.read(info + "METADATA").decode() if info + "METADATA" in names else ""
        entry_points = (
            whl.read(info + "entry_points.txt").decode()
            if info + "entry_points.txt" in names
            else ""
        )
    problems = [
        f"wheel: holds {n}, outside the package"
        for n in names
        if not (n.startswith(f"{PACKAGE}/") or n.startswith(info))
    ]
    problems += [f"wheel: holds {n}" for n in junk(names)]
    sources = {n for n in tracked() if n.startswith(f"{PACKAGE}/") and n.endswith(".py")}
    problems += [f"wheel: lacks {n}" for n in sorted(sources - set(names))]
    if f"\nVersion: {ver}\n" not in metadata:
        problems.append(f"wheel: METADATA does not say Version: {ver}")
    for line in (
        "gds-zarr = xarray_gds.backend:GdsZarrBackendEntrypoint",
        "xarray-gds = xarray_gds.tools.cli:main",
    ):
        if line not in entry_points:
            problems.append(f"wheel: entry_points.txt lacks {line!r}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dist = Path(argv[0])
    ver = version()
    sdist = dist / f"xarray_gds-{ver}.tar.gz"
    wheel = dist / f"xarray_gds-{ver}-py3-none-any.whl"
    found = sorted(p.name for p in dist.iterdir())
    if found != sorted([sdist.name, wheel.name]):
        print(f"error: expected {sdist.name} and {wheel.name} in {dist}, found {found}")
        return 1
    problems = check_sdist(sdist, ver) + check_wheel(wheel, ver)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"{sdist.name} and {wheel.name}: contents as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Every code block of README.md, CONTRIBUTING.md and docs/*.md runs.

Each page's ``python`` blocks run in order in one namespace, in a temporary directory
that holds small stores of the names the examples open (``doc_stores``). The commands
of its shell blocks (``bash``, ``console``, ``sh``) that are the project's own run too:
``xarray-gds ...`` through the command line's ``main``, ``python scripts/NAME.py ...``
with this interpreter; a ``console`` block's lines after a ``$ `` command are that
command's expected output. A block that cannot run on a CPU machine without network is
marked in the markdown, on the line before its fence (an HTML comment, not rendered;
in a list item, where an HTML block would end the list, at the end of the paragraph
above the block):

    <!-- doc-test: gpu -->                      needs a GPU: skipped without one
    <!-- doc-test: skip reason=WHY -->          never run here, for the reason given
    <!-- doc-test: needs=torch,matplotlib -->   skipped when a package is missing

A page whose examples need extras of ``pyproject.toml`` says so near its top, on the
line after the mark ``<!-- doc-test: page extras=dask,refs -->``: its blocks run where
every package of those extras is installed, and the page is skipped elsewhere (the base
install of ``scripts/test-min.sh``, where every other page runs).

A shell block with any other command (an install, ``bash scripts/...``) must be marked
``skip``; ``text``, ``markdown`` and ``mermaid`` blocks are not code. An unmarked block
that fails fails its page's test, and ``test_marked_block`` lists each skipped block
with its reason.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.metadata
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr
import zarr

from xarray_gds import device
from xarray_gds.tools import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

#: languages of blocks that are not code to run
NOT_CODE = {"text", "markdown", "mermaid"}
SHELL = {"bash", "console", "sh", "shell"}

_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)
_MARK = re.compile(r"<!--\s*doc-test:\s*(?P<mark>.*?)\s*-->")
_PAGE_MARK = re.compile(r"^<!-- doc-test: page extras=(?P<extras>[\w,-]+) -->\n(?P<line>.*)$", re.M)
_REQUIREMENT = re.compile(r"(?P<name>[A-Za-z0-9._-]+)(?:\[(?P<extras>[\w,-]+)\])?")


def page_extras(page: Path) -> tuple[list[str], str]:
    """The extras a page's examples need (its ``page extras=`` mark) and the line after
    the mark, which names them to the reader; ``([], "")`` without a mark."""
    found = _PAGE_MARK.search(_FENCE.sub("", page.read_text()))  # not in an example
    if found is None:
        return [], ""
    return found["extras"].split(","), found["line"]


def extra_packages(extra: str) -> list[str]:
    """The distributions that ``extra`` of pyproject.toml installs, the extras it names
    of the project itself followed."""
    names: list[str] = []
    for requirement in EXTRAS[extra]:
        found = _REQUIREMENT.match(requirement)
        assert found, requirement
        if found["name"] == "xarray-gds":
            for inner in (found["extras"] or "").split(","):
                names += extra_packages(inner)
        else:
            names.append(found["name"])
    return names


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def why_page_not(page: Path) -> str | None:
    """Why the examples of ``page`` do not run here (an extra it names is not
    installed), or None."""
    for extra in page_extras(page)[0]:
        missing = [d for d in extra_packages(extra) if not _installed(d)]
        if missing:
            return f"needs the {extra} extra ({', '.join(missing)} not installed)"
    return None


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    gpu: bool = False
    skip: str | None = None
    needs: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def why_not(self) -> str | None:
        """Why the block does not run here, or None."""
        if self.skip is not None:
            return self.skip
        missing = [n for n in self.needs if importlib.util.find_spec(n) is None]
        if missing:
            return f"needs {', '.join(missing)}"
        if self.gpu and not device.cuda_status()[0]:
            return "needs a GPU"
        return None


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` with the marks on the lines before each."""
    text = page.read_text()
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        block = Block(name, line, m.group("lang"), m.group("body"))
        before = text[: m.start()].splitlines()
        while before and not before[-1].strip():  # a mark may end the paragraph above
            before.pop()
        while before and _MARK.fullmatch(before[-1].strip()):
            mark = _MARK.fullmatch(before.pop().strip())["mark"]  # type: ignore[index]
            if mark.startswith("skip"):  # skip reason=WHY, the rest of the comment
                reason = mark[4:].strip().removeprefix("reason=").strip().strip("'\"")
                block.skip = reason or "marked skip"
                continue
            for word in mark.split():
                if word == "gpu":
                    block.gpu = True
                elif word.startswith("needs="):
                    block.needs += word[6:].split(",")
                else:
                    raise ValueError(f"{block.id}: unknown doc-test mark {word!r}")
        out.append(block)
    return out


def commands(code: str) -> list[tuple[str, list[str]]]:
    """A shell block's commands (continuation lines joined, comments dropped), each
    with the lines of output a ``console`` block shows after it."""
    out: list[tuple[str, list[str]]] = []
    lines = code.splitlines()
    console = any(line.startswith("$ ") for line in lines)
    i = 0
    while i < len(lines):
        line = lines[i]
        if console and not line.startswith("$ "):
            if out:
                out[-1][1].append(line)
            i += 1
            continue
        command = line[2:] if console else line
        while command.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command.rstrip()[:-1] + " " + lines[i].strip()
        words = shlex.split(command, comments=True)
        if words:
            out.append((shlex.join(words), []))
        i += 1
    return out


def _kind(command: str) -> str:
    words = shlex.split(command)
    if words[0] in ("xarray-gds", ".venv/bin/xarray-gds"):
        return "cli"
    if (
        words[0] in ("python", "python3", ".venv/bin/python")
        and len(words) > 1
        and words[1].startswith("scripts/")
    ):
        return "script"
    return "other"


def _run_command(command: str) -> str:
    words = shlex.split(command)
    if _kind(command) == "cli":
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                rc = cli.main(words[1:])
            except SystemExit as stop:  # --help
                rc = int(stop.code or 0)
        assert rc == 0, f"{command!r} exited {rc}:\n{buffer.getvalue()}"
        return buffer.getvalue()
    done = subprocess.run(
        [sys.executable, str(ROOT / words[1]), *words[2:]],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def _matches(output: str, shown: list[str]) -> bool:
    """The output a console block shows: its lines in order, ``...`` for any lines."""
    pattern = "".join(
        r"(?:.*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n"
        for line in shown
    )
    text = "".join(line.rstrip() + "\n" for line in output.splitlines())
    return re.fullmatch(pattern, text) is not None


# --------------------------------------------------------------------------------------
# the stores the examples open
# --------------------------------------------------------------------------------------

_NAMES = ("t2m", "u10", "v10", "msl", "z500", "t850")


def _era5(start: str, steps: int, names: tuple[str, ...] = _NAMES) -> xr.Dataset:
    """An ERA5-like dataset: hourly steps on a 64 x 128 grid."""
    rng = np.random.default_rng(steps)
    lat = np.linspace(90.0, -90.0, 64)
    lon = np.arange(128) * 360 / 128
    time = pd.date_range(start, periods=steps, freq="h")
    shape = (steps, lat.size, lon.size)
    return xr.Dataset(
        {n: (("time", "lat", "lon"), (250 + 50 * rng.random(shape)).astype("f4")) for n in names},
        coords={"time": time, "lat": lat, "lon": lon},
    )


def _write_stores(root: Path) -> None:
    chunks = {n: {"chunks": (24, 64, 128)} for n in _NAMES}
    _era5("2024-01-01", 48).to_zarr(root / "era5.zarr", encoding=chunks)
    _era5("2024-01-03", 48).to_zarr(root / "era5-later.zarr", encoding=chunks)
    for year in (2020, 2021):
        _era5(f"{year}-01-01", 24, ("t2m",)).to_zarr(root / f"era5-{year}.zarr")
    tree = xr.DataTree.from_dict(
        {
            "/surface": _era5("2024-01-01", 24, ("t2m",)),
            "/upper": _era5("2024-01-01", 24, ("t850",)),
        }
    )
    tree.to_zarr(root / "tree.zarr")
    if importlib.util.find_spec("h5netcdf") is not None:
        for year in (2020, 2021):
            ds = _era5(f"{year}-01-01", 24, ("t2m",))
            encoding = {"t2m": {"zlib": True, "shuffle": True, "chunksizes": (6, 64, 128)}}
            ds.to_netcdf(root / f"era5_{year}.nc", engine="h5netcdf", encoding=encoding)
    if importlib.util.find_spec("icechunk") is not None:
        import icechunk

        repo = icechunk.Repository.create(
            icechunk.local_filesystem_storage(str(root / "era5-repo"))
        )
        session = repo.writable_session("main")
        _era5("2024-01-01", 48, ("t2m",)).to_zarr(session.store, zarr_format=3, consolidated=False)
        session.commit("ERA5-like data")


@pytest.fixture(scope="session")
def _store_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("doc-stores")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: consolidated metadata is not in the v3 spec
        _write_stores(root)
    return root


@pytest.fixture
def doc_stores(_store_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding the stores the docs open (a copy for each page)."""
    work = tmp_path / "work"
    shutil.copytree(_store_template, work)
    monkeypatch.chdir(work)
    return work


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    """Settings an example changes (xarray's options, zarr's and dask's configuration,
    warning filters) put back afterwards; the garbage collector off meanwhile (see
    docs/netcdf.md: kerchunk and zarr's event loop thread share h5py's lock)."""
    from xarray.core.options import OPTIONS

    dask = sys.modules.get("dask") or (
        importlib.import_module("dask") if importlib.util.find_spec("dask") else None
    )
    xr_options = dict(OPTIONS)
    zarr_config = copy.deepcopy(zarr.config.config)
    dask_config = copy.deepcopy(dask.config.config) if dask is not None else None
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        gc.enable()
        OPTIONS.clear()
        OPTIONS.update(xr_options)
        zarr.config.config.clear()
        zarr.config.config.update(zarr_config)
        if dask is not None:
            dask.config.config.clear()
            dask.config.config.update(dask_config)


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------


def _page_ids() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in PAGES]


def _close_clients(namespace: dict[str, Any]) -> None:
    """Close the dask-distributed clients (and their clusters) an example started."""
    if "distributed" not in sys.modules:
        return
    from distributed import Client

    for value in namespace.values():
        if isinstance(value, Client):
            cluster = value.cluster
            value.close()
            if cluster is not None:
                cluster.close()


def run_page(page: Path) -> int:
    """Run the blocks of ``page`` that run here, in order, in one namespace, in the
    working directory; the number that ran. An example that fails raises
    AssertionError naming its page and line."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    ran = 0
    with _isolated(), contextlib.ExitStack() as stack:
        stack.callback(_close_clients, namespace)
        for block in blocks(page):
            if block.lang in NOT_CODE or block.why_not() is not None:
                continue
            if block.lang == "python":
                try:
                    exec(compile(block.code, block.id, "exec"), namespace)
                except Exception as err:
                    raise AssertionError(f"{block.id}: the example fails: {err!r}") from err
            elif block.lang in SHELL:
                for command, shown in commands(block.code):
                    assert _kind(command) != "other", (
                        f"{block.id}: {command!r} is not a command of the project: mark the "
                        "block <!-- doc-test: skip reason=... -->"
                    )
                    output = _run_command(command)
                    if shown:
                        assert _matches(output, shown), (
                            f"{block.id}: {command!r} printed\n{output}\nnot what the page "
                            "shows:\n" + "\n".join(shown)
                        )
            else:
                raise AssertionError(f"{block.id}: a block of unknown language {block.lang!r}")
            ran += 1
    return ran


@pytest.mark.parametrize("page", _page_ids())
def test_page_blocks_run(page: str, doc_stores: Path) -> None:
    why = why_page_not(ROOT / page)
    if why is not None:
        pytest.skip(why)
    ran = run_page(ROOT / page)
    if not [b for b in blocks(ROOT / page) if b.lang not in NOT_CODE]:
        pytest.skip("no code blocks")
    if ran == 0:
        pytest.skip("every block is marked (see test_marked_block)")


def test_a_broken_example_fails_its_page(doc_stores: Path) -> None:
    page = doc_stores / "page.md"
    good = "```python\nimport xarray as xr\n"
    good += "ds = xr.open_dataset('era5.zarr', engine='gds-zarr')\n```\n"
    page.write_text(good + "\n```python\nds.t2m.sel(level=500)\n```\n")
    with pytest.raises(AssertionError, match=r"page.md:6: the example fails: KeyError"):
        run_page(page)
    page.write_text("```console\n$ xarray-gds tidy era5.zarr --dry-run\nall clean\n```\n")
    with pytest.raises(AssertionError, match="not what the page shows"):
        run_page(page)
    page.write_text("```bash\npip install xarray-gds\n```\n")
    with pytest.raises(AssertionError, match="is not a command of the project"):
        run_page(page)
    page.write_text(
        good + "<!-- doc-test: skip reason=broken on purpose -->\n```python\n1 / 0\n```\n"
    )
    assert run_page(page) == 1


def _marked() -> list[Block]:
    return [b for p in PAGES for b in blocks(p) if b.gpu or b.skip is not None or b.needs]


@pytest.mark.parametrize("block", _marked(), ids=lambda b: b.id)
def test_marked_block(block: Block) -> None:
    """A marked block, with the reason it did not run here (it ran in its page's test
    where nothing is missing)."""
    why = block.why_not()
    if why is not None:
        pytest.skip(why)


def test_pages_name_the_extras_their_examples_need() -> None:
    """The line after a page's ``page extras=`` mark names each extra and the command
    that installs them, in a checkout; each is an extra of pyproject.toml. The pages
    whose examples need extras are marked; every other page runs on the base install."""
    marked = {}
    for page in PAGES:
        extras, line = page_extras(page)
        if not extras:
            continue
        marked[str(page.relative_to(ROOT))] = extras
        assert set(extras) <= set(EXTRAS), (page, extras)
        assert f'`pip install ".[{",".join(extras)}]"`' in line, (page, line)
        assert all(f"`{extra}`" in line for extra in extras), (page, line)
    assert marked == {
        "docs/dask.md": ["dask"],
        "docs/icechunk.md": ["icechunk", "dask"],
        "docs/netcdf.md": ["refs", "dask"],
        "docs/remote.md": ["remote"],
    }
    assert why_page_not(ROOT / "docs" / "config.md") is None
    assert extra_packages("dask") == ["dask", "distributed"]


def test_every_block_is_code_or_marked() -> None:
    """Every block has a language; every shell block is the project's commands or
    marked; the marks name what the test knows."""
    problems = []
    for page in PAGES:
        for block in blocks(page):
            if not block.lang:
                problems.append(f"{block.id}: a block without a language")
            elif block.lang in SHELL and block.skip is None:
                others = [c for c, _ in commands(block.code) if _kind(c) == "other"]
                if others:
                    problems.append(f"{block.id}: {others[0]!r} runs only with a skip mark")
            elif block.lang not in SHELL | NOT_CODE | {"python"}:
                problems.append(f"{block.id}: unknown language {block.lang!r}")
    assert problems == []


def test_the_runner_reads_marks_commands_and_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- doc-test: gpu needs=torch -->\n```python\nx = 1\n```\n\n"
        "<!-- doc-test: skip reason='needs S3 credentials' -->\n```bash\n"
        "xarray-gds info s3://b/p.zarr \\\n  --storage-option anon=true  # remote\n```\n\n"
        "```console\n$ xarray-gds --version\nxarray-gds 1.0\n...\n$ xarray-gds --help\n```\n"
    )
    found = blocks(page)
    assert [(b.lang, b.gpu, b.skip, b.needs) for b in found] == [
        ("python", True, None, ["torch"]),
        ("bash", False, "needs S3 credentials", []),
        ("console", False, None, []),
    ]
    assert commands(found[1].code) == [
        ("xarray-gds info s3://b/p.zarr --storage-option anon=true", [])
    ]
    assert commands(found[2].code) == [
        ("xarray-gds --version", ["xarray-gds 1.0", "..."]),
        ("xarray-gds --help", []),
    ]
    assert _kind("xarray-gds demo") == "cli"
    assert _kind("python scripts/plot_bench.py r.json --table") == "script"
    assert _kind("pip install .") == "other"
    assert _matches("xarray-gds 1.0\nmore\n", ["xarray-gds 1.0", "..."])
    assert _matches("a\nb\nc\n", ["a", "...", "c"])
    assert not _matches("xarray-gds 2.0\n", ["xarray-gds 1.0"])
    assert not _matches("a\nb\n", ["a"])  # all of the output, unless "..." says more
    assert _matches("a  \n", ["a"])

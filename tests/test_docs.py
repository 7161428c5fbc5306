"""The user docs stay true: the home page's quick start runs as written, what the
examples import exists, and the performance page's chart and table are the committed
benchmark data's."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import runpy
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _plot_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plot_bench", ROOT / "scripts" / "plot_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quick_start() -> str:
    """The first Python code block under the home page's "Quick start" heading."""
    text = (DOCS / "index.md").read_text()
    section = text[text.index("## Quick start") :]
    section = section[: section.find("\n## ", 1)]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/index.md: no ```python block under ## Quick start"
    return match.group(1)


def test_quick_start_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the block makes its own store in the working directory; without a GPU the engine
    # falls back to the host (a warning), with one it reads to the device: both run
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "quick_start.py"
    path.write_text(quick_start())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = runpy.run_path(str(path), run_name="__main__")
    assert (tmp_path / "example.zarr").is_dir()
    day1 = names["day1"]
    assert day1.sizes == {"time": 24, "lat": 181, "lon": 360}
    values = day1.data if isinstance(day1.data, np.ndarray) else day1.data.get()
    np.testing.assert_array_equal(values, names["t2m"][:24])
    assert names["tree"]["t2m"].shape == (48, 181, 360)


def python_blocks() -> list[tuple[str, str]]:
    """Every ```python block of README.md and docs/, with the page it is on."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    return [
        (page.name, match.group(1))
        for page in pages
        for match in re.finditer(r"```python\n(.*?)```", page.read_text(), re.S)
    ]


def test_what_the_examples_import_exists() -> None:
    blocks = python_blocks()
    assert len(blocks) > 20
    missing = []
    for page, code in blocks:
        for node in ast.walk(ast.parse(code)):  # every block is Python as written
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xarray_gds"):
                module = importlib.import_module(str(node.module))
                missing += [
                    f"{page}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if not hasattr(module, alias.name)
                ]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("xarray_gds"):
                        importlib.import_module(alias.name)
    assert missing == []


def _free_names(code: str) -> set[str]:
    """Names a block reads that it neither assigns, imports nor takes as arguments."""
    tree = ast.parse(code)
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    loaded = {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return loaded - bound


#: names examples once used without making them (what a reader cannot guess)
_UNGUESSABLE = {"more", "fix", "model", "encoding", "block", "k", "client", "write_part"}
_UNGUESSABLE |= {"parts", "paths"}


def test_examples_define_the_names_a_reader_cannot_guess() -> None:
    undefined = {
        (page, name) for page, code in python_blocks() for name in _free_names(code) & _UNGUESSABLE
    }
    assert undefined == set()


def test_fill_value_mask_masks_the_first_time_as_the_guide_says(tmp_path: Path) -> None:
    """user-guide.md: with use_zarr_fill_value_as_mask=True, the first time of a v3
    store written by xarray reads as NaT (stored as 0, the fill value)."""
    import pandas as pd
    import xarray as xr

    assert "the first value of `masked.time` is `NaT`" in (DOCS / "user-guide.md").read_text()
    path = tmp_path / "era5.zarr"
    times = pd.date_range("2024-01-01", periods=3, freq="h")
    data = np.ones((3, 2), "f4")
    ds = xr.Dataset({"t2m": (("time", "x"), data)}, coords={"time": times})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: consolidated metadata is not in the v3 spec
        ds.to_zarr(path, zarr_format=3)
    masked = xr.open_dataset(
        path, engine="gds-zarr", device="cpu", use_zarr_fill_value_as_mask=True
    )
    assert masked.time.encoding["_FillValue"] == 0
    assert np.isnat(masked.time.values).tolist() == [True, False, False]
    plain = xr.open_dataset(path, engine="gds-zarr", device="cpu")
    np.testing.assert_array_equal(plain.time.values, times.values)


def test_the_case_table_names_every_bench_case() -> None:
    from xarray_gds.tools.bench import CASES

    page = (DOCS / "performance.md").read_text()
    table = page[page.index("### Cases") :]
    table = table[: table.index("\n## ")]
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `")]
    named = [name for row in rows for name in re.findall(r"`([^`]+)`", row)]
    assert sorted(named) == sorted(CASES)


@pytest.mark.parametrize("card", ["h200", "h100"])
def test_bench_chart_matches_its_data(card: str) -> None:
    # the committed image is what the script draws from the committed JSON, byte for
    # byte: regenerate both with `python scripts/plot_bench.py` after a new run
    plot = _plot_bench()
    data, image = DOCS / "data" / f"bench-{card}.json", DOCS / "img" / f"bench-{card}.svg"
    drawn = plot.svg(plot.load(data))
    assert image.read_text() == drawn, (
        f"docs/img/bench-{card}.svg is stale: run "
        f"`python scripts/plot_bench.py docs/data/bench-{card}.json docs/img/bench-{card}.svg`"
    )


@pytest.mark.parametrize("card", ["h200", "h100", "host"])
def test_bench_table_on_the_page_matches_its_data(card: str) -> None:
    plot = _plot_bench()
    page = (DOCS / "performance.md").read_text()
    assert plot.table(plot.load(DOCS / "data" / f"bench-{card}.json")) in page, (
        f"the {card.upper()} table of docs/performance.md differs from "
        f"docs/data/bench-{card}.json: paste the output of "
        f"`python scripts/plot_bench.py docs/data/bench-{card}.json --table`"
    )


def test_goals_table_on_the_page_matches_its_data() -> None:
    # the goals met and missed are made from the "goal" of the H100 results
    plot = _plot_bench()
    page = (DOCS / "performance.md").read_text()
    goals = plot.goals(plot.load(DOCS / "data" / "bench-h100.json"))
    assert goals.count("\n") > 2 and goals in page, (
        "the Goals table of docs/performance.md differs from docs/data/bench-h100.json: "
        "paste the output of `python scripts/plot_bench.py docs/data/bench-h100.json --goals`"
    )
    data = {
        "results": [
            {"case": "a", "goal": 2, "seconds": {"gds-zarr": 1.0, "zarr": 1.96}},
            {"case": "b", "goal": 3, "seconds": {"gds-zarr": 1.0, "zarr": 2.9}},
            {"case": "c", "seconds": {"gds-zarr": 1.0, "zarr": 9.0}},
        ]
    }
    assert plot.goals(data).splitlines()[2:] == [
        "| `a` | 2x | 2.0x | met |",
        "| `b` | 3x | 2.9x | **missed** |",
    ]


def test_the_remote_cases_pair_with_the_faster_zarr_client() -> None:
    plot = _plot_bench()
    seconds = {"gds-zarr": 1.0, "zarr (fsspec)": 3.0, "zarr (obstore)": 2.0, "raw GETs": 0.5}
    assert plot.pairs({"seconds": seconds}) == [("", "gds-zarr", "zarr (obstore)")]
    seconds["zarr (fsspec)"] = 1.5
    assert plot.pairs({"seconds": seconds}) == [("", "gds-zarr", "zarr (fsspec)")]


def test_bench_chart_pairs_suffixes_and_plain_output(tmp_path: Path) -> None:
    # plain `xarray-gds bench --json` output (no title/date/command keys) draws too
    plot = _plot_bench()
    result = {
        "case": "c",
        "nbytes": 10**9,
        "n_chunks": 4,
        "seconds": {"gds-zarr": 0.5, "zarr": 1.0, "gds-zarr chunks={}": 2.0, "zarr chunks={}": 1.0},
        "note": "",
    }
    assert plot.pairs(result) == [
        ("", "gds-zarr", "zarr"),
        (" chunks={}", "gds-zarr chunks={}", "zarr chunks={}"),
    ]
    data = {"env": {"cuda": True, "cpus": 2}, "results": [result]}
    image = plot.svg(data)
    assert image.startswith("<svg") and "2.0x" in image and "0.5x" in image
    assert plot.svg(data) == image  # deterministic
    out = tmp_path / "x.svg"
    (tmp_path / "x.json").write_text(__import__("json").dumps(data))
    assert plot.main([str(tmp_path / "x.json"), str(out)]) == 0
    assert out.read_text() == image


def test_the_comparison_figures_are_the_committed_runs() -> None:
    """docs/comparison.md's measured table: each time is the committed bench JSON's,
    and each GB/s is the case's decoded bytes over that time."""
    import json

    page = (DOCS / "comparison.md").read_text()
    runs = {
        "H200": ("bench-h200.json", "zstd-4MB"),
        "H100": ("bench-h100.json", "usage-eager-2var"),
    }
    header = next(line for line in page.splitlines() if line.startswith("| route |"))
    cards = [cell.split(":")[0].strip() for cell in header.strip("|").split("|")[1:]]
    assert cards == ["H200", "H100"]
    routes = {
        '`engine="zarr"`': "zarr",
        '`engine="gds-zarr"`': "gds-zarr",
        "`raw-limit`": "raw-limit",
        "`decode-only`": "decode-only",
    }
    checked = 0
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = next((n for prefix, n in routes.items() if cells[0].startswith(prefix)), None)
        if name is None or len(cells) != 3:
            continue
        for card, cell in zip(cards, cells[1:], strict=True):
            file, case = runs[card]
            data = json.loads((DOCS / "data" / file).read_text())
            (result,) = [r for r in data["results"] if r["case"] == case]
            if not cell:
                assert name not in result["seconds"]
                continue
            seconds = result["seconds"][name]
            assert cell == f"{seconds:.3f} s ({result['nbytes'] / seconds / 1e9:.1f} GB/s)"
            assert f"{card}: `--case {case}`" in header
            assert set(result["command"].split()) >= {"--size-gb", "2", "--repeat", "3"}
            checked += 1
    assert checked == 7

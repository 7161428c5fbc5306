"""scripts/device-mutants.py: mutants of the lines only a card runs, made here and run
against their GPU tests there. Its steps run on a tiny package, the GPU tests replaced by
a stand-in for pytest that fails when the module's behaviour changed."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
pytest.importorskip("mutation_tool")

MODULE = """\
def scale(x, k):
    y = x * k
    return y + 1


def host(x):
    return x - 1
"""


def _script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "device_mutants", ROOT / "scripts" / "device-mutants.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, Path]:
    """A checkout with one module whose ``scale`` lines only a card runs."""
    dm = _script()
    (tmp_path / "xarray_gds").mkdir()
    (tmp_path / "xarray_gds" / "mod.py").write_text(MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "pyproject.toml").write_text("")
    lines = {
        "revision": "abc1234",
        "modules": {
            "xarray_gds/mod.py": [
                {"kind": "device", "lines": [2, 3], "device_tests": ["tests/t.py::test_a"]},
                {"kind": "cpu-gap", "lines": [7], "device_tests": []},
            ]
        },
    }
    (tmp_path / "lines.json").write_text(json.dumps(lines))
    monkeypatch.setattr(dm, "ROOT", tmp_path)
    return dm, tmp_path


def _made(dm: types.ModuleType, root: Path) -> dict[str, Any]:
    assert dm.make(root / "lines.json", root / "out" / "mutants.json") == 0
    return json.loads((root / "out" / "mutants.json").read_text())


def test_make_mutates_the_device_lines_only(tree: tuple[types.ModuleType, Path]) -> None:
    dm, root = tree
    doc = _made(dm, root)
    assert doc["revision"] == "abc1234"
    digest = hashlib.sha256((root / "xarray_gds" / "mod.py").read_bytes()).hexdigest()
    assert doc["files"] == {"xarray_gds/mod.py": digest}
    mutants = doc["mutants"]
    assert {m["line"] for m in mutants} == {2, 3}  # not the cpu-gap line 7
    original = MODULE.split("\n")
    news = set()
    for m in mutants:
        assert m["tests"] == ["tests/t.py::test_a"]
        changed = dm._mutated(MODULE, m).split("\n")
        # the mutant changes its own line and nothing else
        assert changed[: m["line"] - 1] == original[: m["line"] - 1]
        assert changed[m["line"] :] == original[m["line"] :]
        assert changed[m["line"] - 1] != original[m["line"] - 1]
        news.add(changed[m["line"] - 1].strip())
    # the standard operators: an arithmetic swap, a constant moved, a statement removed
    assert {"y = x / k", "return y + 2", "pass"} <= news
    assert len({m["id"] for m in mutants}) == len(mutants)


def _fake_pytest(
    root: Path,
    failing_base: set[str],
    calls: list[tuple[str, list[str]]],
    sources: list[str] | None = None,
):
    """pytest's stand-in: fails a test when ``scale`` of the copy it runs in gives
    another value than the original's (a GPU test comparing with engine="zarr")."""

    def run(where: Path, tests: list[str], timeout: float, env: dict[str, str]):
        calls.append((where.name, list(tests)))
        if where.name == "base":
            return ("failed" if set(tests) & failing_base else "passed"), ""
        assert env["XARRAY_GDS_REQUIRE_GPU"] == "1"
        namespace: dict[str, Any] = {}
        source = (where / "xarray_gds" / "mod.py").read_text()
        if sources is not None:
            sources.append(source)
        exec(source, namespace)
        try:
            same = namespace["scale"](3, 5) == 16
        except Exception:
            same = False
        return ("passed" if same else "failed"), ""

    return run


def test_run_kills_what_changes_behaviour_and_restores_every_copy(
    tree: tuple[types.ModuleType, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dm, root = tree
    doc = _made(dm, root)
    calls: list[tuple[str, list[str]]] = []
    sources: list[str] = []
    monkeypatch.setattr(dm, "_pytest", _fake_pytest(root, set(), calls, sources))
    seen_sources: list[str] = []
    real_copy = dm._copy

    def copy(dest: Path) -> None:
        real_copy(dest)
        seen_sources.append(str(dest))

    monkeypatch.setattr(dm, "_copy", copy)
    out = tmp_path / "result.json"
    rc = dm.run(root / "out" / "mutants.json", 2, 30.0, out, "1/1")
    summary = json.loads(out.read_text())
    results = {r["id"]: r for r in summary["results"]}
    assert len(results) == len(doc["mutants"])
    for m in doc["mutants"]:
        namespace: dict[str, Any] = {}
        exec(dm._mutated(MODULE, m), namespace)
        try:
            same = namespace["scale"](3, 5) == 16
        except Exception:
            same = False
        assert results[m["id"]]["outcome"] == ("survived" if same else "killed"), m["new"]
    survivors = [r for r in summary["results"] if r["outcome"] == "survived"]
    assert rc == (1 if survivors else 0)
    assert summary["counts"]["killed"] == sum(
        1 for r in summary["results"] if r["outcome"] == "killed"
    )
    # the baseline ran the one test, then each mutant ran once, in a worker's copy
    assert calls[0] == ("base", ["tests/t.py::test_a"])
    assert {name for name, _ in calls[1:]} <= {"w0", "w1"}
    assert summary["counts"]["killed"] > 0
    assert len(calls) == 1 + len(doc["mutants"])
    # each run saw its one mutant alone: the file was put back after each
    assert sorted(sources) == sorted(dm._mutated(MODULE, m) for m in doc["mutants"])
    # the checkout is never changed
    assert (root / "xarray_gds" / "mod.py").read_text() == MODULE
    assert len(seen_sources) == 3  # base and two workers


def test_run_parts_and_tests_failing_unmutated(
    tree: tuple[types.ModuleType, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dm, root = tree
    doc = _made(dm, root)
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(dm, "_pytest", _fake_pytest(root, {"tests/t.py::test_a"}, calls))
    out = tmp_path / "result.json"
    assert dm.run(root / "out" / "mutants.json", 1, 30.0, out, "2/3") == 0
    summary = json.loads(out.read_text())
    assert [r["id"] for r in summary["results"]] == [m["id"] for m in doc["mutants"][1::3]]
    # a test failing unmutated judges nothing: its mutants have no test and are not run
    assert summary["counts"] == {"no test": len(doc["mutants"][1::3])}
    assert summary["failing_tests"] == ["tests/t.py::test_a"]
    assert calls == [("base", ["tests/t.py::test_a"])]


def test_run_refuses_mutants_of_a_changed_file(
    tree: tuple[types.ModuleType, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    dm, root = tree
    _made(dm, root)
    (root / "xarray_gds" / "mod.py").write_text(MODULE.replace("x - 1", "x - 2"))
    with pytest.raises(SystemExit, match=r"xarray_gds/mod.py changed since the mutants"):
        dm.run(root / "out" / "mutants.json", 1, 30.0, None, "1/1")

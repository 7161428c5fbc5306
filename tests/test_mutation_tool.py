"""scripts/mutation-run.py's diff and full modes, piece by piece (scripts/mutation_tool.py):
the lines a diff changes, the mutants of the operators Cosmic Ray lacks, the tests that
run each line (a coverage run of a tiny module), the fork server's code swap, the
whole-suite stage's halving and the survivors file."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from xarray_gds.entries import whole_tiling

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

mt = pytest.importorskip("mutation_tool")


def _script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_run", ROOT / "scripts" / "mutation-run.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the lines a change adds or edits ---------------------------------------------------

DIFF = """\
diff --git a/xarray_gds/a.py b/xarray_gds/a.py
index 1111111..2222222 100644
--- a/xarray_gds/a.py
+++ b/xarray_gds/a.py
@@ -3 +3 @@ def f():
-    return 1
+    return 2
@@ -10,0 +11,3 @@ def g():
+++ x
+    y = 1
+    return y
@@ -20,2 +23,0 @@ def h():
-    gone = 1
-    return gone
diff --git a/xarray_gds/gone.py b/xarray_gds/gone.py
deleted file mode 100644
--- a/xarray_gds/gone.py
+++ /dev/null
@@ -1,2 +0,0 @@
-x = 1
-y = 2
diff --git a/xarray_gds/old.py b/xarray_gds/new.py
similarity index 90%
rename from xarray_gds/old.py
rename to xarray_gds/new.py
--- a/xarray_gds/old.py
+++ b/xarray_gds/new.py
@@ -5,0 +6,2 @@ def k():
+    a = 1
+    b = 2
"""


def test_changed_lines_of_a_diff() -> None:
    """Edited and added lines by the new file's numbers, an added line that looks like a
    header (``+++ x``) among them; deletions and deleted files have none; a renamed
    file goes by its new name."""
    assert mt.changed_lines(DIFF) == {
        "xarray_gds/a.py": {3, 11, 12, 13},
        "xarray_gds/new.py": {6, 7},
    }


def test_changed_lines_from_git(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    git("init", "-q")
    (tmp_path / "m.py").write_text("a = 1\nb = 2\nc = 3\n")
    git("add", "m.py")
    git("commit", "-q", "-m", "one")
    (tmp_path / "m.py").write_text("a = 1\nb = 20\nc = 3\nd = 4\n")
    diff = git("diff", "-U0", "--src-prefix=a/", "--dst-prefix=b/", "HEAD")
    assert mt.changed_lines(diff) == {"m.py": {2, 4}}


# --- mutants -----------------------------------------------------------------------------

SNIPPET = textwrap.dedent(
    """\
    import numpy as np


    def f(a, b):
        x = g(a, k=1, *b)
        h(z=2)
        y = np.asarray(a).sum()
        v = b.view(a)
        w = call(
            a,
            key=1,
        )
        return int(x) + y
    """
)


def _made(operator: str, source: str = SNIPPET) -> set[str]:
    found, _ = mt.mutants(source, "m.py", "m")
    return {m.new for m in found if m.operator == operator}


def test_remove_statement() -> None:
    assert _made("RemoveStatement") == {"pass"}
    found, _ = mt.mutants(SNIPPET, "m.py", "m")
    removed = {m.old for m in found if m.operator == "RemoveStatement"}
    assert removed == {
        "x = g(a, k=1, *b)",
        "h(z=2)",
        "y = np.asarray(a).sum()",
        "v = b.view(a)",
        "w = call(\na,\nkey=1,\n)",
        "return int(x) + y",
    }
    # no value, nothing to remove; __all__ only names
    assert _made("RemoveStatement", "x: int\n__all__ = ['f']\n") == set()


def test_remove_call() -> None:
    """A function's call of one argument becomes the argument; a method call without
    arguments is dropped; a method's call of one argument is left (``b.view(a)``)."""
    assert _made("RemoveCall") == {
        "y = a.sum()",
        "y = np.asarray(a)",
        "return x + y",
    }
    assert _made("RemoveCall", "z = -f(a + b)\n") == {"z = -(a + b)"}


#: a function of the package whose mutants once broke the tree for the ones after them
#: (a call removed left nodes under the node it made), after an import
TILING = "import numpy as np\n\n\n" + inspect.getsource(whole_tiling)


def test_every_mutant_leaves_the_tree_as_it_was() -> None:
    """After each mutant of every operator, every node of the tree hangs from the module
    again (a call removed moves its argument under another node while the mutant is
    made: a later mutant that looks for the module from there found that node)."""
    import parso
    from cosmic_ray.ast import ast_nodes

    tree = parso.parse(TILING)

    def walk(n: Any) -> list[Any]:
        return [n, *(c for k in getattr(n, "children", []) for c in walk(k))]

    before = [(n, n.parent) for n in walk(tree)]
    made = 0
    for _, op in mt.operators():
        for node in ast_nodes(tree):
            for index, _ in enumerate(list(op.mutation_positions(node))):
                mt._mutated(tree, node, op, index)
                made += 1
    assert made > 100
    assert [(n, n.parent) for n in walk(tree)] == before
    assert tree.get_code() == TILING
    assert all(n.get_root_node() is tree for n, _ in before)
    found, _ = mt.mutants(TILING, "tiling.py", "tiling")
    assert len(found) > 100


def test_drop_keyword() -> None:
    assert _made("DropKeyword") == {"x = g(a, *b)", "h()", ""}  # "" : the line ``key=1,``
    source = "w = call(\n    a,\n    key=1,\n)\n"
    (dropped,) = [m for m in mt.mutants(source, "m.py", "m")[0] if m.operator == "DropKeyword"]
    assert dropped.apply(source) == "w = call(\n    a,\n)\n"
    assert (dropped.old, dropped.new, dropped.context) == ("key=1,", "", "a,")
    found, _ = mt.mutants("f(k=1, j=2)\n", "m.py", "m")
    assert {m.apply("f(k=1, j=2)\n") for m in found if m.operator == "DropKeyword"} == {
        "f(j=2)\n",
        "f(k=1)\n",
    }


def test_operators_examples() -> None:
    from cosmic_ray.mutating import mutate_code

    for cls in (mt.RemoveStatement, mt.RemoveCall, mt.DropKeyword):
        for ex in cls.examples():
            assert mutate_code(ex.pre_mutation_code, cls(), ex.occurrence) == (
                ex.post_mutation_code
            )


def test_mutants_match_cosmic_rays_and_lines_filter() -> None:
    """The mutants made on one parse (each put back after) are Cosmic Ray's own, made
    on a fresh parse each; a line filter keeps the mutants starting on those lines;
    annotations and duplicates are left out."""
    import parso
    from cosmic_ray.ast import ast_nodes
    from cosmic_ray.mutating import mutate_code

    source = "from __future__ import annotations\n\n\ndef f(a: int | None, n=1):\n"
    source += "    if a is None or n < 2:\n        return [n - 1]\n    return not a\n"
    found, left = mt.mutants(source, "m.py", "m")
    spans = mt.annotation_spans(source)
    expected = set()
    for _, op in mt.operators():
        positions = [p for n in ast_nodes(parso.parse(source)) for p in op.mutation_positions(n)]
        for occurrence, (start, _) in enumerate(positions):
            if any(lo <= tuple(start) < hi for lo, hi in spans):
                continue
            mutated = mutate_code(source, op, occurrence)
            try:
                compile(mutated or "", "m", "exec")
            except SyntaxError:
                continue
            if mutated and mutated != source:
                expected.add(mutated)
    assert {m.apply(source) for m in found} == expected
    assert left["annotations"] > 0
    some, _ = mt.mutants(source, "m.py", "m", {6})
    assert some and {m.line for m in some} == {6}
    assert {m.apply(source) for m in some} <= expected


def test_mutants_of_a_string_comparison_under_warnings_as_errors() -> None:
    """``x == "a"`` made ``x is "a"`` compiles with a SyntaxWarning: the mutant is made
    (not left out as not compiling, even under ``-W error``) and nothing is shown."""
    import warnings

    source = 'def f(x):\n    return x == "a"\n'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found, left = mt.mutants(source, "m.py", "m")
    assert 'return x is "a"' in {m.new for m in found}
    assert left["not_compiling"] == 0


def test_apply_all_and_layers() -> None:
    run = _script()
    source = "a = 1\nb = 2\nc = 3\n"
    found, _ = mt.mutants(source, "m.py", "m")
    one = next(m for m in found if m.line == 1 and m.new == "a = 2")
    three = next(m for m in found if m.line == 3 and m.new == "pass")
    other = next(m for m in found if m.line == 3 and m.new == "c = 4")
    assert mt.apply_all(source, [one, three]) == "a = 2\nb = 2\npass\n"
    assert run._layers([one, three, other]) == [[one, three], [other]]


class _FakeRunner:
    """Runs nothing: a group's run fails while it holds the mutant of line 6 (its
    failing test named ``t6``) or, by a timeout (no test named), the one of line 3."""

    def __init__(self, source: str):
        self.source = source
        self.together_runs: list[list[int]] = []
        self.alone: list[int] = []

    def together(self, group, tests, timeout):
        lines = sorted(m.line for m in group)
        self.together_runs.append(lines)
        if 6 in lines:
            return 1, "FAILED t6 - assert 6\n"
        if 3 in lines:
            return None, ""
        return 0, ""

    def one(self, m, tests):
        self.alone.append(m.line)
        return (1 if m.line == 6 and tests == ["t6"] else 0), True


def _eight_statements_removed() -> tuple[str, list[Any]]:
    """A module of eight assignments, and the mutant removing each (line 1 to 8)."""
    source = "".join(f"v{i} = {i}\n" for i in range(1, 9))
    found, _ = mt.mutants(source, "m.py", "m")
    removed = [
        next(m for m in found if m.line == i and m.operator == "RemoveStatement")
        for i in range(1, 9)
    ]
    return source, removed


def test_whole_suite_stage_finds_the_killed() -> None:
    """The mutants alive go to the whole suite together. A failing run's first failing
    test runs against the mutants whose line it ran, alone: the one it kills leaves
    the group. A run that fails naming no test (a timeout) halves the group."""
    run = _script()
    source, alive = _eight_statements_removed()
    for m in alive:
        m.selected = {"t6"} if m.line in (5, 6) else {"t1"}
    fake = _FakeRunner(source)
    runs = run.confirm(alive, fake, lambda group: ["tests"], 60, "suite")
    assert {m.line: m.outcome for m in alive if m.outcome} == {3: "timeout", 6: "killed"}
    assert fake.alone == [5, 6]  # only the mutants whose line t6 ran
    assert fake.together_runs == [
        [1, 2, 3, 4, 5, 6, 7, 8],  # t6 fails: 6 killed alone
        [1, 2, 3, 4, 5, 7, 8],  # a timeout: halved
        [1, 2, 3],
        [1],
        [2, 3],
        [2],
        [3],
        [4, 5, 7, 8],
    ]
    assert runs == len(fake.together_runs)
    assert all(m.stage == "suite" for m in alive)


class _ImportBreakingRunner(_FakeRunner):
    """A run with the mutant of line 2 fails at conftest's import (exit status 4), one
    with line 7's at a test file's collection (2): pytest names a file, not a test."""

    def together(self, group, tests, timeout):
        lines = sorted(m.line for m in group)
        self.together_runs.append(lines)
        if 2 in lines:
            return 4, "ImportError while loading conftest '/c/tests/conftest.py'.\n"
        if 7 in lines:
            return 2, "ERROR tests/test_b.py - NameError: name 'v7' is not defined\n"
        return 0, ""


def test_an_error_outside_the_tests_halves_the_group() -> None:
    """No test is named: the group is halved (a file named by a collection error is not
    run against each mutant alone) down to the mutants that break the import."""
    run = _script()
    source, alive = _eight_statements_removed()
    for m in alive:
        m.selected = {"tests/test_b.py::t"}
    fake = _ImportBreakingRunner(source)
    run.confirm(alive, fake, lambda group: ["tests"], 60, "suite")
    assert {m.line: m.outcome for m in alive if m.outcome} == {2: "killed", 7: "killed"}
    assert fake.alone == []
    assert fake.together_runs == [
        [1, 2, 3, 4, 5, 6, 7, 8],
        [1, 2, 3, 4],
        [1, 2],
        [1],
        [2],
        [3, 4],
        [5, 6, 7, 8],
        [5, 6],
        [7, 8],
        [7],
        [8],
    ]


def test_mutants_applied_together_are_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _script()
    source = "a = 1\nb = 2\n"
    (tmp_path / "m.py").write_text(source)
    found, _ = mt.mutants(source, "m.py", "m")
    seen = []

    def fake_pytest(args, copy, env, timeout):
        seen.append((copy / "m.py").read_text())
        return 0, ""

    runner = run.Runner(tmp_path, {}, {"m.py": source}, {}, None, {})
    group = [m for m in found if m.new in ("a = 2", "pass") and m.line == 1 + (m.new == "pass")]
    monkeypatch.setattr(run, "_pytest", fake_pytest)
    assert runner.together(group, ["tests"], 60) == (0, "")
    assert seen == ["a = 2\npass\n"]
    assert (tmp_path / "m.py").read_text() == source


# --- which tests run a line -------------------------------------------------------------

MINI = textwrap.dedent(
    """\
    LIMIT = 3


    def f(x, n=1):
        if x > LIMIT:
            return x
        return x + n


    class C:
        size = 2

        def g(self):
            return self.size * 2


    def never():
        return 0
    """
)

TESTS = textwrap.dedent(
    """\
    import pytest

    import mini


    def test_f():
        assert mini.f(5) == 5


    @pytest.mark.parametrize("x", [1, 2])
    def test_f_small(x):
        assert mini.f(x) == x + 1


    def test_g():
        assert mini.C().g() == 4


    def test_fails():
        assert mini.f(0) == 99
    """
)


@pytest.fixture(scope="module")
def mini_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    where = tmp_path_factory.mktemp("mini")
    (where / "mini.py").write_text(MINI)
    (where / "test_mini.py").write_text(TESTS)
    (where / "rc").write_text(
        f"[run]\ndata_file = {where / 'cov'}\ninclude = {where / 'mini.py'}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COVERAGE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(where)
    out = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
            "-p", "no:randomly", "-p", "no:hypothesispytest", "-p", "no:asyncio",
            "--cov", f"--cov-config={where / 'rc'}", "--cov-context=test", "--cov-report=",
            "--durations=0", "--durations-min=0", "test_mini.py",
        ],
        cwd=where, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    return where, out.stdout


def test_line_tests_from_a_coverage_run(mini_run: tuple[Path, str]) -> None:
    where, _ = mini_run
    lines = mt.LineTests.from_coverage(where / "cov", where)
    stmts = mt.statements(MINI)
    small = {"test_mini.py::test_f_small[1]", "test_mini.py::test_f_small[2]"}
    every_f = {"test_mini.py::test_f", "test_mini.py::test_fails", *small}
    # a function's line: the tests that ran it
    assert lines.tests_for("mini.py", 6, stmts) == {"test_mini.py::test_f"}
    assert lines.tests_for("mini.py", 7, stmts) == {"test_mini.py::test_fails", *small}
    # a def statement (a default): the tests that ran the function
    assert lines.tests_for("mini.py", 4, stmts) == every_f
    # a class body's statement: the tests that ran the class's lines
    assert lines.tests_for("mini.py", 11, stmts) == {"test_mini.py::test_g"}
    # the module's own statement (run at import): every test of the module
    assert lines.tests_for("mini.py", 1, stmts) == {*every_f, "test_mini.py::test_g"}
    # a line no test runs
    assert lines.tests_for("mini.py", 18, stmts) is None
    again = mt.LineTests.from_json(json.loads(json.dumps(lines.to_json())))
    assert again.by_file == lines.by_file


def test_statements_of_a_module() -> None:
    stmts = mt.statements(MINI)
    assert stmts[5].lines == range(5, 6) and stmts[5].in_function
    assert stmts[5].outer == ("f", 4) and stmts[14].outer == ("C.g", 13)
    assert not stmts[4].in_function and stmts[4].scope == range(4, 8)
    assert not stmts[11].in_function and stmts[11].scope == range(10, 15)
    assert stmts[14].function == "C.g"


def test_durations_and_failures_from_pytest_output(mini_run: tuple[Path, str]) -> None:
    _, out = mini_run
    times = mt.durations(out)
    assert set(times) == {
        "test_mini.py::test_f",
        "test_mini.py::test_f_small[1]",
        "test_mini.py::test_f_small[2]",
        "test_mini.py::test_g",
        "test_mini.py::test_fails",
    }
    assert mt.failures(out) == {"test_mini.py::test_fails"}


# --- the fork server's code swap ---------------------------------------------------------


def test_code_swapped_in_place(tmp_path: Path) -> None:
    """A mutant's function found by its qualified name and first line (a method, a
    property, a static method, a decorated function) and its code swapped: every
    reference to the function object runs the mutant."""
    import functools

    source = textwrap.dedent(
        """\
        import functools


        def plain():
            return 1


        @functools.lru_cache
        def cached():
            return 1


        class K:
            @property
            def p(self):
                return 1

            @staticmethod
            def s():
                return 1
        """
    )
    module = types.ModuleType("mini_swap")
    exec(compile(source, str(tmp_path / "m.py"), "exec"), module.__dict__)
    mutated = compile(source.replace("return 1", "return 2"), "m.py", "exec")
    taken = module.plain
    for qualname, first in (("plain", 4), ("cached", 8), ("K.p", 14), ("K.s", 18)):
        live = mt._live_function(module, qualname, first)
        live.__code__ = mt._code(mutated, qualname, first)
    assert taken() == 2 and module.K().p == 2 and module.K.s() == 2
    assert isinstance(module.cached, functools._lru_cache_wrapper) and module.cached() == 2
    with pytest.raises(LookupError):
        mt._live_function(module, "plain", 5)


def test_fork_server_runs_a_mutant_in_a_fork(tmp_path: Path) -> None:
    """The fork server collects the tests once; each request forks, swaps the mutated
    function's code in and runs the tests asked for: the unmutated tests pass, a
    mutant's fail where they should, and a test it did not collect is named."""
    (tmp_path / "mini.py").write_text(MINI)
    (tmp_path / "test_mini.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COVERAGE_", "PYTEST_"))}
    env["PYTHONPATH"] = str(tmp_path)
    spec = {"modules": ["mini"], "test_files": ["test_mini.py"], "deny": []}
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "mutation_tool.py"), "serve", json.dumps(spec)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdin is not None and server.stdout is not None

    def ask(args: list[str], patch: dict[str, object] | None) -> dict[str, object]:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps({"args": args, "timeout": 60, "patch": patch}) + "\n")
        server.stdin.flush()
        return json.loads(server.stdout.readline())

    try:
        ready = json.loads(server.stdout.readline())
        assert ready["ready"] and ready["tests"] == 5
        small = ["test_mini.py::test_f_small[1]", "test_mini.py::test_f_small[2]"]
        assert ask(small, None) == {"status": 0, "patched": True, "missing": []}
        (tmp_path / "mini.py").write_text(MINI.replace("return x + n", "return x - n"))
        f = {"module": "mini", "qualname": "f", "first": 4}
        assert ask(small, f)["status"] == 1
        assert ask(["test_mini.py::test_f", "test_mini.py::nothing"], f) == {
            "status": 0,
            "patched": True,
            "missing": ["test_mini.py::nothing"],
        }
        assert ask(small, {"module": "mini", "qualname": "f", "first": 5})["patched"] is False
    finally:
        server.stdin.close()
        server.wait(timeout=30)


# --- the survivors file -----------------------------------------------------------------


def test_survivors_file(tmp_path: Path) -> None:
    source = "def f(a):\n    return a < 2\n"
    found, _ = mt.mutants(source, "xarray_gds/m.py", "m")
    lt = next(m for m in found if m.new == "return a <= 2")
    gt = next(m for m in found if m.new == "return a > 2")
    gone = next(m for m in found if m.new == "pass")
    lt.outcome, lt.triage, lt.why, lt.stage = "survived", "equivalent", "a is never 2", "suite"
    gt.outcome, gt.stage, gt.tests = "survived", "suite", 3
    gone.outcome = "killed"
    report = mt.Report(mode="diff", revision="abc1234", base="main")
    report.unreached.append({"module": "m", "file": "xarray_gds/m.py", "line": 9, "text": "x"})
    mt.summarize(report, [lt, gt, gone])
    path = tmp_path / "out" / "mutation-survivors.json"
    mt.write_report(path, report)
    data = json.loads(path.read_text())
    assert data["mode"] == "diff" and data["base"] == "main"
    assert data["counts"] == {
        "mutants": 3,
        "run": 3,
        "killed": 1,
        "timeouts": 0,
        "survived": 2,
        "equivalent": 1,
        "gpu_only": 0,
        "open": 1,
        "unreached_mutants": 0,
        "unreached_lines": 1,
    }
    first = data["survivors"][0]
    assert {"file", "module", "line", "column", "operator", "old", "new", "context"} <= set(first)
    assert first["old"] == "return a < 2" and first["context"] == "def f(a):"
    assert "lines" not in first and "start" not in first
    assert [s.get("triage") for s in data["survivors"]] == ["equivalent", None]
    assert mt.read_report(path) == report


def test_module_names_and_paths() -> None:
    run = _script()
    assert run._module_name("xarray_gds/stores/local.py") == "store"
    assert run._module_name("xarray_gds/stores/icechunk.py") == "stores/icechunk"
    assert run._module_name("xarray_gds/codecs/__init__.py") == "codecs"
    assert run._resolve("codecs", ROOT) == "xarray_gds/codecs/__init__.py"
    assert run._resolve("xarray_gds/region.py", ROOT) == "xarray_gds/region.py"
    assert run._resolve("nothing_here", ROOT) is None
    assert run._dotted("xarray_gds/codecs/__init__.py") == "xarray_gds.codecs"


def test_coverage_map_merged_after_new_tests() -> None:
    """A map kept from an earlier run, the test files changed since run again: their
    old contexts dropped, their new ones added, the rest kept."""
    run = _script()
    old = {
        "map": {"a.py": {"3": ["", "tests/test_a.py::t1", "tests/test_b.py::t2"]}},
        "durations": {"tests/test_a.py::t1": 1.0, "tests/test_b.py::t2": 2.0},
        "failing": ["tests/test_b.py::t2"],
        "seconds": 9.0,
    }
    new = {
        "map": {"a.py": {"3": ["tests/test_b.py::t3"], "4": ["tests/test_b.py::t3"]}},
        "durations": {"tests/test_b.py::t3": 0.5},
        "failing": [],
    }
    merged = run._merged(old, new, {"tests/test_b.py"})
    assert merged["map"] == {
        "a.py": {
            "3": ["", "tests/test_a.py::t1", "tests/test_b.py::t3"],
            "4": ["tests/test_b.py::t3"],
        }
    }
    assert merged["durations"] == {"tests/test_a.py::t1": 1.0, "tests/test_b.py::t3": 0.5}
    assert merged["failing"] == []


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_kept_map_brought_up_to_date_after_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a package file changes, only the test files that ran it run again under
    coverage: the map keeps what the other tests ran of the unchanged files, and takes
    the changed file's lines from the new run alone."""
    run = _script()
    monkeypatch.setattr(run, "WORK", tmp_path / "work")
    copy = tmp_path / "copy"
    _tree(
        copy,
        {
            "pyproject.toml": "[project]\n",
            "xarray_gds/a.py": "A = 1\n",
            "xarray_gds/b.py": "B = 1\n",
            **{f"tests/test_{n}.py": f"# {n}\n" for n in "abcdef"},
        },
    )
    runs: list[list[str]] = []

    def coverage_run(copy_: Path, suite: list[str], env: dict[str, str]) -> dict[str, Any]:
        runs.append(list(suite))
        if suite == ["tests"]:  # the whole suite: a.py run by test_a, b.py by test_b
            return {
                "map": {
                    "xarray_gds/a.py": {"1": ["", "tests/test_a.py::t"]},
                    "xarray_gds/b.py": {"1": ["tests/test_b.py::t"], "2": ["tests/test_c.py::t"]},
                },
                "durations": {"tests/test_a.py::t": 1.0, "tests/test_b.py::t": 2.0},
                "failing": ["tests/test_b.py::t"],
                "seconds": 9.0,
            }
        return {
            "map": {"xarray_gds/b.py": {"5": ["tests/test_b.py::u"]}},
            "durations": {"tests/test_b.py::u": 0.5},
            "failing": [],
            "seconds": 1.0,
        }

    monkeypatch.setattr(run, "_coverage_run", coverage_run)
    first = run.coverage_map(copy, ["tests"], {})
    assert first["how"] == "whole" and runs == [["tests"]]
    (first_map,) = run.WORK.glob("coverage-*.json")
    os.utime(first_map, (1_000_000, 1_000_000))  # older than every map made below
    assert run.coverage_map(copy, ["tests"], {})["how"] == "kept"
    assert runs == [["tests"]]

    (copy / "xarray_gds/b.py").write_text("B = 2\n")
    second = run.coverage_map(copy, ["tests"], {})
    assert runs[1] == ["tests/test_b.py", "tests/test_c.py"]
    assert second["how"] == "1 package file(s) changed, 2 test file(s) again"
    assert second["map"] == {
        "xarray_gds/a.py": {"1": ["", "tests/test_a.py::t"]},
        "xarray_gds/b.py": {"5": ["tests/test_b.py::u"]},
    }
    assert second["durations"] == {"tests/test_a.py::t": 1.0, "tests/test_b.py::u": 0.5}
    assert second["failing"] == []
    assert second["seconds"] == 9.0  # the whole suite's time, not the rerun's
    # kept under the new content: read back as it is
    assert run.coverage_map(copy, ["tests"], {})["how"] == "kept" and len(runs) == 2

    # the next change starts from the newest map kept (the one after b.py changed)
    (copy / "xarray_gds/a.py").write_text("A = 2\n")
    newest = run.coverage_map(copy, ["tests"], {})
    assert newest["how"] == "1 package file(s) changed, 1 test file(s) again"
    assert runs[2] == ["tests/test_a.py"] and newest["seconds"] == 9.0
    (copy / "xarray_gds/a.py").write_text("A = 1\n")
    assert run.coverage_map(copy, ["tests"], {})["how"] == "kept" and len(runs) == 3

    # a test file deleted: its tests leave the map, nothing runs
    (copy / "tests/test_f.py").unlink()
    third = run.coverage_map(copy, ["tests"], {})
    assert third["how"] == "0 package file(s) changed, 0 test file(s) again" and len(runs) == 3

    # a module added: no test in the map runs it, so the whole suite runs again
    (copy / "xarray_gds/c.py").write_text("C = 1\n")
    assert run.coverage_map(copy, ["tests"], {})["how"] == "whole" and runs[-1] == ["tests"]


def test_what_a_kept_map_runs_again() -> None:
    run = _script()
    package = {"xarray_gds/a.py": "1", "xarray_gds/b.py": "1", "pyproject.toml": "1"}
    tests = {f"tests/test_{n}.py": "1" for n in "abcdef"} | {"tests/conftest.py": "1"}
    base: dict[str, Any] = {
        "package": dict(package),
        "tests": dict(tests),
        "map": {
            "xarray_gds/a.py": {"1": ["", "tests/test_a.py::t"]},
            "xarray_gds/b.py": {"3": ["tests/test_b.py::t", "tests/test_c.py::t[1]"]},
        },
    }
    assert run.since(base, package, tests) == (frozenset(), set())
    # a test file changed: it alone
    assert run.since(base, package, {**tests, "tests/test_f.py": "2"}) == (
        frozenset(),
        {"tests/test_f.py"},
    )
    # a test file deleted: its tests dropped (nothing to run)
    gone = {k: v for k, v in tests.items() if k != "tests/test_e.py"}
    assert run.since(base, package, gone) == (frozenset(), {"tests/test_e.py"})
    # a package file changed: the files of the tests that ran it
    assert run.since(base, {**package, "xarray_gds/b.py": "2"}, tests) == (
        frozenset({"xarray_gds/b.py"}),
        {"tests/test_b.py", "tests/test_c.py"},
    )
    # a package file deleted: nothing ran only it, nothing to run
    no_a = {k: v for k, v in package.items() if k != "xarray_gds/a.py"}
    assert run.since(base, no_a, tests) == (frozenset({"xarray_gds/a.py"}), {"tests/test_a.py"})
    # the whole suite: a module added, pytest's settings, a conftest, half the suite
    assert run.since(base, {**package, "xarray_gds/new.py": "1"}, tests) is None
    assert run.since(base, {**package, "pyproject.toml": "2"}, tests) is None
    assert run.since(base, package, {**tests, "tests/conftest.py": "2"}) is None
    three = {**tests, **{f"tests/test_{n}.py": "2" for n in "def"}}
    assert run.since(base, package, three) is None
    two = {**tests, **{f"tests/test_{n}.py": "2" for n in "ef"}}
    assert run.since(base, package, two) == (frozenset(), {"tests/test_e.py", "tests/test_f.py"})


def test_merged_drops_the_changed_files_lines() -> None:
    run = _script()
    old = {
        "map": {
            "a.py": {"3": ["tests/test_a.py::t"]},
            "b.py": {"7": ["tests/test_a.py::t"], "8": ["", "tests/test_z.py::t"]},
        },
        "durations": {"tests/test_a.py::t": 1.0, "tests/test_z.py::t": 3.0},
        "failing": [],
        "seconds": 9.0,
    }
    new = {"map": {"b.py": {"2": ["tests/test_a.py::t"]}}, "durations": {}, "failing": []}
    merged = run._merged(old, new, {"tests/test_a.py"}, frozenset({"b.py"}))
    assert merged["map"] == {"b.py": {"2": ["tests/test_a.py::t"]}}
    assert merged["durations"] == {"tests/test_z.py::t": 3.0}


def test_retriage_of_a_diff_runs_survivors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--retriage`` of a ``--diff``/``--all`` summary applies the triage file again to
    its survivors: equivalents and GPU-only ones by their verdict, one a test written
    since kills as killed since; the rest stay open, are listed, and exit 1."""
    run = _script()

    def survivor(old: str, new: str) -> dict[str, Any]:
        return {"file": "xarray_gds/m.py", "module": "m", "line": 3, "old": old, "new": new}

    summary = {
        "mode": "diff",
        "survivors": [
            survivor("a = 1", "a = 2"),
            survivor("b = f(x)", "b = x"),
            survivor("c = g()", "pass"),
            survivor("d = 0", "d = 1"),
        ],
        "counts": {"run": 9, "survived": 4, "equivalent": 0, "gpu_only": 0, "open": 4},
    }
    triage = [
        {"module": "m", "old": "a = 1", "new": "a = 2", "verdict": "equivalent", "reason": "r"},
        {"module": "m", "old": "b = f(x)", "new": "b = x", "verdict": "killed", "test": "t::k"},
        {"module": "m", "old": "c = g()", "new": "pass", "verdict": "gpu-only", "reason": "g"},
        {"module": "other", "old": "d = 0", "new": "d = 1", "verdict": "equivalent", "reason": "x"},
    ]
    out = tmp_path / "survivors.json"
    out.write_text(json.dumps(summary))
    monkeypatch.setattr(run, "_triage", lambda: triage)
    monkeypatch.setattr(
        sys, "argv", ["mutation-run.py", "--diff", "HEAD", "--retriage", "--out", str(out)]
    )
    assert run.main() == 1
    done = json.loads(out.read_text())
    assert done["counts"] == {
        "run": 9,
        "survived": 4,
        "equivalent": 1,
        "gpu_only": 1,
        "killed_since": 1,
        "open": 1,
    }
    assert [r.get("triage") for r in done["survivors"]] == [
        "equivalent",
        "killed",
        "gpu-only",
        None,
    ]
    assert done["survivors"][1]["why"] == "t::k"
    triage.append(
        {"module": "m", "old": "d = 0", "new": "d = 1", "verdict": "equivalent", "reason": "y"}
    )
    assert run.main() == 0
    assert json.loads(out.read_text())["counts"]["open"] == 0

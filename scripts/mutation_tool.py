"""The pieces of ``scripts/mutation-run.py``'s diff and full modes (``--diff``, ``--all``).

- :func:`changed_lines`: the lines a ``git diff -U0`` adds or edits, per file;
- :func:`mutants`: every mutant of a module's source (or of some of its lines): Cosmic
  Ray's operators, and three of its own where Cosmic Ray has none
  (:class:`RemoveStatement`, :class:`RemoveCall`, :class:`DropKeyword`);
- :class:`LineTests`: which tests run each line, from a coverage run with a context a
  test (pytest-cov's ``--cov-context=test``);
- :func:`durations`, :func:`failures`: each test's time and the tests that failed, from
  pytest's output;
- :func:`write_report`: the survivors file.

No test runs here; the script runs them.
"""

from __future__ import annotations

import ast
import bisect
import difflib
import hashlib
import json
import re
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import parso
import parso.python.tree as pt
import pytest
from cosmic_ray.operators.operator import Example, Operator

# --- the lines a change adds or edits ---------------------------------------------------

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


def changed_lines(diff: str) -> dict[str, set[int]]:
    """File (the new side's path) -> the numbers of the lines that ``diff`` (a ``git diff
    -U0``) adds or edits there, in the new file. A file only deleted from, or deleted,
    has none and is left out."""
    files: dict[str, set[int]] = {}
    current: str | None = None
    header = False
    for line in diff.splitlines():
        if line.startswith("diff --git "):
            header, current = True, None
        elif header and line.startswith("+++ "):
            name = line[4:].rstrip("\t")
            current = None if name == "/dev/null" else name.removeprefix("b/")
        elif line.startswith("@@"):
            header = False
            match = _HUNK.match(line)
            if current is None or match is None:
                continue
            start, count = int(match[1]), 1 if match[2] is None else int(match[2])
            files.setdefault(current, set()).update(range(start, start + count))
    return {name: lines for name, lines in files.items() if lines}


# --- the operators Cosmic Ray lacks ---------------------------------------------------

#: simple statements whose removal is a mutant (``pass`` takes their place)
_STATEMENTS = {"expr_stmt", "return_stmt", "raise_stmt", "del_stmt", "assert_stmt"}
_BARE = {"return", "raise", "break", "continue"}


def _is_call(trailer: Any) -> bool:
    return (
        trailer.type == "trailer"
        and trailer.children[0].type == "operator"
        and (trailer.children[0].value == "(")
    )


def _is_attribute(trailer: Any) -> bool:
    return (
        trailer.type == "trailer"
        and trailer.children[0].type == "operator"
        and (trailer.children[0].value == ".")
    )


class RemoveStatement(Operator):
    """A simple statement (an assignment, a call, ``return``, ``raise``, ``del``,
    ``assert``, ``break``, ``continue``) replaced by ``pass``."""

    def mutation_positions(self, node: Any) -> Iterator[tuple[Any, Any]]:
        if node.parent is None or node.parent.type != "simple_stmt":
            return
        if node.type == "expr_stmt" and node.get_first_leaf().value == "__all__":
            removable = False
        elif node.type == "expr_stmt" and node.children[1].type == "annassign":
            removable = len(node.children[1].children) == 4  # not ``x: int``, no value
        else:
            removable = (
                node.type in _STATEMENTS
                or (node.type == "keyword" and node.value in _BARE)
                or (node.type == "atom_expr" and _is_call(node.children[-1]))
            )
        if removable:
            yield node.start_pos, node.end_pos

    def mutate(self, node: Any, index: int) -> Any:
        return pt.Keyword("pass", node.start_pos, prefix=node.get_first_leaf().prefix)

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (
            Example("x = 1\n", "pass\n"),
            Example("def f():\n    g(1)\n    return 2\n", "def f():\n    pass\n    return 2\n"),
            Example("for i in y:\n    break\n", "for i in y:\n    pass\n"),
        )


#: expressions that need no parentheses where a call stood
_PRIMARY = {"name", "number", "atom", "atom_expr", "keyword", "string", "strings", "fstring"}
#: what is not one positional argument
_NOT_ONE = {"arglist", "argument", "star_expr"}


def _imported(node: Any) -> set[str]:
    """The names the imports of ``node``'s module bind."""
    module = node.get_root_node()
    kept = _IMPORTS.get(id(module))
    if kept is None or kept[0] is not module:
        if len(_IMPORTS) > 8:
            _IMPORTS.clear()
        names = {n.value for imp in module.iter_imports() for n in imp.get_defined_names()}
        kept = _IMPORTS[id(module)] = (module, names)
    return kept[1]


#: id of a parsed module -> (the module, the names its imports bind)
_IMPORTS: dict[int, tuple[Any, set[str]]] = {}


def _plain_callee(callee: list[Any]) -> bool:
    """Whether ``callee`` is a function's name (``int``) or a name in an imported module
    (``np.asarray``), not a method of an object (``data.view``)."""
    if callee[0].type != "name":
        return False
    if len(callee) == 1:
        return True
    return len(callee) == 2 and _is_attribute(callee[1]) and callee[0].value in _imported(callee[0])


class RemoveCall(Operator):
    """A call taken out of an expression: a call of a function (not a method) with one
    positional argument replaced by its argument (``int(n)`` -> ``n``,
    ``np.asarray(a).sum()`` -> ``a.sum()``), a method call without arguments dropped
    (``x.copy()`` -> ``x``). Calls that are statements are :class:`RemoveStatement`'s."""

    def mutation_positions(self, node: Any) -> Iterator[tuple[Any, Any]]:
        for start, end, _ in self._sites(node):
            yield start, end

    @staticmethod
    def _sites(node: Any) -> list[tuple[Any, Any, tuple[int, int, Any]]]:
        """(start, end, (first child, last child replaced, the replacement or None))."""
        if node.type != "atom_expr" or node.parent.type == "simple_stmt":
            return []
        kids = node.children
        if kids[0].type == "keyword":  # ``await f(x)``
            return []
        sites = []
        calls_before = False
        for i in range(1, len(kids)):
            if not _is_call(kids[i]):
                continue
            inner = kids[i].children[1:-1]
            if (
                not calls_before
                and len(inner) == 1
                and inner[0].type not in _NOT_ONE
                and _plain_callee(kids[:i])
            ):
                sites.append((kids[0].start_pos, kids[i].end_pos, (0, i, inner[0])))
            if not inner and i >= 2 and _is_attribute(kids[i - 1]):
                sites.append((kids[i - 1].start_pos, kids[i].end_pos, (i - 1, i, None)))
            calls_before = True
        return sites

    def mutate(self, node: Any, index: int) -> Any:
        first, last, replacement = self._sites(node)[index][2]
        kids = node.children
        if replacement is None:
            rest = kids[:first] + kids[last + 1 :]
        else:
            arg = replacement
            prefix = kids[0].get_first_leaf().prefix
            arg.get_first_leaf().prefix = ""
            if arg.type not in _PRIMARY:  # ``f(a + b) * 2`` -> ``(a + b) * 2``
                arg = pt.PythonNode(
                    "atom", [pt.Operator("(", arg.start_pos), arg, pt.Operator(")", arg.end_pos)]
                )
            arg.get_first_leaf().prefix = prefix
            rest = [arg, *kids[last + 1 :]]
        if len(rest) == 1:
            return rest[0]
        node.children = rest
        return node

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (
            Example("y = int(n)\n", "y = n\n"),
            Example("y = x.copy()\n", "y = x\n"),
            Example(
                "import numpy as np\ny = np.asarray(a).sum()\n", "import numpy as np\ny = a.sum()\n"
            ),
            Example(
                "import numpy as np\ny = np.asarray(a).sum()\n",
                "import numpy as np\ny = np.asarray(a)\n",
                occurrence=1,
            ),
            Example("y = data.view(a).sum()\n", "y = data.view(a)\n"),
        )


class DropKeyword(Operator):
    """A keyword argument dropped from a call (``f(a, strict=True)`` -> ``f(a)``)."""

    def mutation_positions(self, node: Any) -> Iterator[tuple[Any, Any]]:
        for arg in self._keywords(node):
            yield arg.start_pos, arg.end_pos

    @staticmethod
    def _keywords(node: Any) -> list[Any]:
        if node.type == "trailer" and _is_call(node):
            args = node.children[1:-1]
        elif node.type == "arglist" and node.parent.type == "trailer":
            args = node.children
        else:
            return []
        return [
            a
            for a in args
            if a.type == "argument"
            and len(a.children) == 3
            and a.children[1].type == "operator"
            and a.children[1].value == "="
        ]

    def mutate(self, node: Any, index: int) -> Any:
        arg = self._keywords(node)[index]
        kids = node.children
        k = kids.index(arg)
        if node.type == "trailer":
            node.children = [kids[0], kids[-1]]
            return node
        if k + 1 < len(kids) and kids[k + 1].type == "operator" and kids[k + 1].value == ",":
            drop = {k, k + 1}
            if k + 2 < len(kids) and k == 0 and kids[k + 2].get_first_leaf().prefix == " ":
                kids[k + 2].get_first_leaf().prefix = arg.get_first_leaf().prefix
        else:
            drop = {k - 1, k}
        node.children = [c for i, c in enumerate(kids) if i not in drop]
        return node

    @classmethod
    def examples(cls) -> tuple[Example, ...]:
        return (
            Example("f(a, strict=True)\n", "f(a)\n"),
            Example("f(k=1, j=2)\n", "f(j=2)\n"),
            Example("f(k=1)\n", "f()\n"),
        )


def operators() -> list[tuple[str, Operator]]:
    """(name, instance) of every operator: Cosmic Ray's (``core/...``, those that take no
    arguments) and the three above."""
    import cosmic_ray.plugins

    found: list[tuple[str, Operator]] = []
    for name in cosmic_ray.plugins.operator_names():
        cls = cosmic_ray.plugins.get_operator(name)
        if not cls.arguments():
            found.append((name, cls()))
    for cls in (RemoveStatement, RemoveCall, DropKeyword):
        found.append((cls.__name__, cls()))
    return found


# --- mutants ----------------------------------------------------------------------------


@dataclass
class Mutant:
    """One mutant of one file: the lines ``start:stop`` (0-based, of the source split at
    ``\\n``) replaced by ``lines``."""

    file: str
    module: str
    line: int
    column: int
    operator: str
    start: int
    stop: int
    lines: list[str]
    old: str
    new: str
    context: str
    outcome: str = ""
    tests: int = 0
    stage: str = ""
    seconds: float = 0.0
    triage: str | None = None
    why: str | None = None
    #: the tests that run its line, and those of them not run with it alone (not written
    #: to the survivors file)
    selected: set[str] = field(default_factory=set, repr=False)
    rest: list[str] = field(default_factory=list, repr=False)

    def apply(self, source: str) -> str:
        return apply_all(source, [self])

    def entry(self) -> dict[str, Any]:
        """The mutant as the survivors file lists it."""
        hidden = ("start", "stop", "lines", "selected", "rest")
        out = {k: v for k, v in asdict(self).items() if k not in hidden}
        return {k: v for k, v in out.items() if v not in (None, "")}


def apply_all(source: str, mutants: Iterable[Mutant]) -> str:
    """``source`` with every one of ``mutants`` applied (their lines must not overlap)."""
    lines = source.split("\n")
    for m in sorted(mutants, key=lambda m: m.start, reverse=True):
        lines[m.start : m.stop] = m.lines
    return "\n".join(lines)


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions, (line, column), of every annotation in ``source``."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        found: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        for a in found:
            if a is not None and a.end_lineno is not None and a.end_col_offset is not None:
                spans.append(((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)))
    return spans


def context_line(diff: str) -> str:
    """The unchanged line just before the change in a unified diff, stripped: what tells
    apart two mutants of the same text (two ``return False`` made ``return True``)."""
    before = ""
    for ln in diff.splitlines():
        if ln.startswith(("---", "+++", "@@")):
            continue
        if ln.startswith(("-", "+")):
            return before
        before = ln[1:].strip()
    return before


def changed_text(diff: str) -> tuple[str, str]:
    """The removed and added lines of a one-change diff, stripped."""
    body = [ln for ln in diff.splitlines() if not ln.startswith(("---", "+++"))]
    old = [ln[1:].strip() for ln in body if ln.startswith("-")]
    new = [ln[1:].strip() for ln in body if ln.startswith("+")]
    return "\n".join(old), "\n".join(new)


def _patch(old: list[str], new: list[str]) -> tuple[int, int, list[str]]:
    """The one region where ``new`` differs from ``old``: (start, stop, new lines)."""
    head = 0
    while head < min(len(old), len(new)) and old[head] == new[head]:
        head += 1
    tail = 0
    while tail < min(len(old), len(new)) - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    return head, len(old) - tail, new[head : len(new) - tail]


def _mutated(tree: Any, node: Any, op: Operator, index: int) -> str:
    """The module's code with ``op``'s ``index``-th mutation of ``node`` made, the tree
    put back as it was after (what Cosmic Ray's ``mutate_code`` makes, without parsing
    the module again for each mutant)."""
    saved_leaves: list[tuple[Any, str, str]] = []
    saved_nodes: list[tuple[Any, list[Any]]] = []
    #: every node's parent too: an operator may move a node under a new one (RemoveCall
    #: puts the argument in the call's place), and a later mutant of another node that
    #: climbs to the module (``get_root_node``) must find the module, not that node
    saved_parents: list[tuple[Any, Any]] = []
    stack = [node]
    while stack:
        n = stack.pop()
        saved_parents.append((n, n.parent))
        if hasattr(n, "children"):
            saved_nodes.append((n, list(n.children)))
            stack.extend(n.children)
        else:
            saved_leaves.append((n, n.value, n.prefix))
    parent = node.parent
    siblings = list(parent.children) if parent is not None else []
    try:
        new = op.mutate(node, index)
        if parent is None:
            return "" if new is None else new.get_code()
        at = siblings.index(node)
        parent.children = siblings[:at] + ([] if new is None else [new]) + siblings[at + 1 :]
        return tree.get_code()
    finally:
        if parent is not None:
            parent.children = siblings
        for n, kids in saved_nodes:
            n.children = kids
        for leaf, value, prefix in saved_leaves:
            leaf.value, leaf.prefix = value, prefix
        for n, up in saved_parents:
            n.parent = up


def _spans_lines(node: Any, lines: list[int]) -> bool:
    """Whether one of ``lines`` (sorted) is within ``node``'s lines."""
    at = bisect.bisect_left(lines, node.start_pos[0])
    return at < len(lines) and lines[at] <= node.end_pos[0]


def compiles(source: str, file: str) -> Any:
    """``source`` compiled (SyntaxError where it does not compile); its
    SyntaxWarnings (``x is "a"``: a mutant of ``x == "a"``) neither shown nor, under
    ``-W error``, taken for errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        return compile(source, file, "exec", dont_inherit=True)


def mutants(
    source: str, file: str, module: str, lines: set[int] | None = None
) -> tuple[list[Mutant], dict[str, int]]:
    """Every mutant of ``source`` whose change starts on one of ``lines`` (all lines when
    None), and counts of those left out: inside annotations (never evaluated under
    ``from __future__ import annotations``), not compiling, or the same source as an
    earlier one."""
    from cosmic_ray.ast import ast_nodes

    tree = parso.parse(source)
    wanted = None if lines is None else sorted(lines)
    nodes = [n for n in ast_nodes(tree) if wanted is None or _spans_lines(n, wanted)]
    spans = annotation_spans(source)
    original = source.split("\n")
    seen: set[str] = set()
    found: list[Mutant] = []
    left = {"annotations": 0, "not_compiling": 0, "duplicates": 0}
    for name, op in operators():
        for node in nodes:
            for index, (start, _end) in enumerate(list(op.mutation_positions(node))):
                if lines is not None and start[0] not in lines:
                    continue
                if any(lo <= tuple(start) < hi for lo, hi in spans):
                    left["annotations"] += 1
                    continue
                mutated = _mutated(tree, node, op, index)
                if mutated == source:
                    continue
                digest = hashlib.sha256(mutated.encode()).hexdigest()
                if digest in seen:
                    left["duplicates"] += 1
                    continue
                seen.add(digest)
                try:
                    compiles(mutated, file)
                except (SyntaxError, ValueError):
                    left["not_compiling"] += 1
                    continue
                new_lines = mutated.split("\n")
                lo, hi, repl = _patch(original, new_lines)
                diff = "\n".join(difflib.unified_diff(original, new_lines, lineterm=""))
                old_text, new_text = changed_text(diff)
                found.append(
                    Mutant(
                        file=file,
                        module=module,
                        line=start[0],
                        column=start[1],
                        operator=name.removeprefix("core/"),
                        start=lo,
                        stop=hi,
                        lines=repl,
                        old=old_text,
                        new=new_text,
                        context=context_line(diff),
                    )
                )
    found.sort(key=lambda m: (m.line, m.column, m.operator, m.new))
    return found, left


# --- which tests run a line -----------------------------------------------------------


@dataclass
class _Stmt:
    lines: range
    in_function: bool
    function: str
    scope: range | None = None
    #: (qualified name, first line) of the outermost function around a statement in a
    #: function's body: the code object a mutant there replaces
    outer: tuple[str, int] | None = None


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def statements(source: str) -> dict[int, _Stmt]:
    """Line -> the innermost statement it belongs to: the statement's own lines (for a
    compound statement, its header up to its body; a function's or a class's with its
    decorators), whether it runs when a function is called (not when the module or a
    class body runs), the qualified name of the function or class it is in, for a
    statement that runs with a class body or a ``def``/``class`` statement the lines of
    that class (or of the function or class the statement defines), and for one in a
    function's body, the outermost function's qualified name and first line."""
    out: dict[int, _Stmt] = {}

    def visit(
        node: ast.AST,
        in_function: bool,
        qual: str,
        scope: range | None,
        outer: tuple[str, int] | None,
    ) -> None:
        for child in ast.iter_child_nodes(node):
            inner, name, inner_scope, inner_outer = in_function, qual, scope, outer
            if isinstance(child, ast.stmt | ast.ExceptHandler):
                first = child.lineno
                end = child.end_lineno or child.lineno
                own_scope = scope
                if isinstance(child, _DEFS):
                    first = min([first, *(d.lineno for d in child.decorator_list)])
                    own_scope = range(first, end + 1)
                    name = f"{qual}.{child.name}" if qual else child.name
                    is_function = not isinstance(child, ast.ClassDef)
                    inner = in_function or is_function
                    inner_scope = own_scope
                    if is_function and outer is None:
                        inner_outer = (name, first)
                body = getattr(child, "body", None)
                last = (
                    max(first, body[0].lineno - 1)
                    if isinstance(body, list) and body and isinstance(body[0], ast.stmt)
                    else end
                )
                info = _Stmt(range(first, last + 1), in_function, name, own_scope, outer)
                for ln in info.lines:
                    out[ln] = info
            visit(child, inner, name, inner_scope, inner_outer)

    visit(ast.parse(source), False, "", None, None)
    return out


class LineTests:
    """The tests that run each line of some files, from a coverage data file whose
    contexts are pytest node ids (``--cov-context=test``: ``nodeid|setup``, ``|run``,
    ``|teardown``; the empty context is what ran outside a test: imports, collection,
    subprocesses)."""

    def __init__(self, by_file: dict[str, dict[int, set[str]]]):
        self.by_file = by_file

    @classmethod
    def from_coverage(cls, data_file: Path, root: Path) -> LineTests:
        from coverage import CoverageData

        data = CoverageData(basename=str(data_file))
        data.read()
        by_file: dict[str, dict[int, set[str]]] = {}
        for measured in data.measured_files():
            try:
                rel = Path(measured).resolve().relative_to(root.resolve()).as_posix()
            except ValueError:
                continue
            by_line: dict[int, set[str]] = {}
            for line, contexts in data.contexts_by_lineno(measured).items():
                by_line[line] = {c.rpartition("|")[0] if "|" in c else c for c in contexts}
            by_file[rel] = by_line
        return cls(by_file)

    def to_json(self) -> dict[str, Any]:
        return {
            f: {str(ln): sorted(t) for ln, t in lines.items()} for f, lines in self.by_file.items()
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LineTests:
        return cls({f: {int(ln): set(t) for ln, t in v.items()} for f, v in data.items()})

    def module_tests(self, file: str) -> set[str]:
        """Every test that ran some line of ``file``."""
        found: set[str] = set()
        for tests in self.by_file.get(file, {}).values():
            found |= tests
        found.discard("")
        return found

    def tests_for(self, file: str, line: int, stmts: dict[int, _Stmt]) -> set[str] | None:
        """The tests a mutant starting on ``line`` of ``file`` can change: those that ran
        its statement. A statement that runs with the module or a class body runs once a
        process, in whichever test imports the module first: for a ``def`` or ``class``
        statement (a default, a decorator) or a class body's, the tests that ran a line
        of that function or class; for the module's own statements, or those that ran
        outside any test only (in a subprocess), every test that ran a line of the file.
        None when nothing ran it: the line is unreached. The set may be empty (a module
        only imported): then only the whole suite can judge the mutant."""
        lines = self.by_file.get(file, {})
        stmt = stmts.get(line)
        span = stmt.lines if stmt is not None else range(line, line + 1)
        ran: set[str] = set()
        for ln in span:
            ran |= lines.get(ln, set())
        if not ran:
            return None
        if stmt is not None and stmt.in_function and ran != {""}:
            return ran - {""}
        if stmt is not None and stmt.scope is not None:
            scoped: set[str] = set()
            for ln in stmt.scope:
                scoped |= lines.get(ln, set())
            scoped.discard("")
            if scoped:
                return scoped
        return self.module_tests(file)


# --- the fork server ----------------------------------------------------------------

#: pytest's arguments for a mutant's tests
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly")


def _live_function(module: Any, qualname: str, first: int) -> Any:
    """The function object of ``module`` whose code is ``qualname`` at line ``first``:
    through classes, properties, static and class methods and ``__wrapped__``."""
    import functools
    import types

    obj = module
    for part in qualname.split("."):
        obj = vars(obj)[part]
    found = [obj]
    if isinstance(obj, property):
        found = [obj.fget, obj.fset, obj.fdel]
    elif isinstance(obj, staticmethod | classmethod):
        found = [obj.__func__]
    elif isinstance(obj, functools.cached_property):
        found = [obj.func]
    for f in found:
        while f is not None and not isinstance(f, types.FunctionType):
            f = getattr(f, "__wrapped__", None)
        while isinstance(f, types.FunctionType) and f.__code__.co_firstlineno != first:
            f = getattr(f, "__wrapped__", None)
        if isinstance(f, types.FunctionType) and f.__code__.co_qualname == qualname:
            return f
    raise LookupError(f"no function {qualname} at line {first}")


def _code(code: Any, qualname: str, first: int) -> Any:
    """The code object of ``qualname`` at line ``first`` within ``code``."""
    for const in code.co_consts:
        if hasattr(const, "co_qualname"):
            if const.co_qualname == qualname and const.co_firstlineno == first:
                return const
            try:
                return _code(const, qualname, first)
            except LookupError:
                pass
    raise LookupError(f"no code {qualname} at line {first}")


def _prepare(patch: dict[str, Any] | None) -> tuple[Any, Any]:
    """(the live function, the mutated file's code of it) for ``patch`` (None: the
    tests unmutated, what the server's answers are checked against)."""
    import importlib

    if patch is None:
        return None, None
    module = importlib.import_module(patch["module"])
    live = _live_function(module, patch["qualname"], patch["first"])
    path = Path(module.__file__ or "")
    code = compiles(path.read_text(), str(path))
    new = _code(code, patch["qualname"], patch["first"])
    if new.co_freevars != live.__code__.co_freevars:
        raise LookupError("the mutant changes the function's free variables")
    return live, new


def _run_items(session: Any, items: list[Any]) -> int:
    """``items`` run as pytest's own loop runs them, stopping at the first failure
    (``-x``): 0 when all passed, 1 when one failed. (The counts start again from
    zero: files the server could not import count as failed in its collection.)"""
    session.testsfailed = 0
    session.shouldfail = session.shouldstop = False
    for i, item in enumerate(items):
        nextitem = items[i + 1] if i + 1 < len(items) else None
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        if session.shouldfail or session.shouldstop:
            break
    return 1 if session.testsfailed else 0


def _serve_one(session: Any, items: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    import os
    import signal
    import time

    global _child
    try:
        live, new = _prepare(request["patch"])
    except (LookupError, KeyError, SyntaxError, ImportError) as e:
        return {"status": None, "patched": False, "error": str(e)}
    chosen = [items[t] for t in request["args"] if t in items]
    missing = [t for t in request["args"] if t not in items]
    pid = _child = os.fork()
    if pid == 0:  # the child: the mutant's function, its tests, in this process
        status = 98
        try:
            os.setsid()
            if _finder is not None and _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
            if live is not None:
                live.__code__ = new
            status = _run_items(session, chosen)
        finally:
            os._exit(status)
    deadline = time.monotonic() + request["timeout"]
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            _child = 0
            status = os.waitstatus_to_exitcode(wait_status)
            return {"status": status, "patched": True, "missing": missing}
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            _child = 0
            return {"status": None, "patched": True, "missing": missing}
        time.sleep(0.01)


#: what the fork server imports before it collects the tests
PRELOAD = ("numpy", "pandas", "xarray", "zarr", "zarr.codecs", "numcodecs", "hypothesis")

_child = 0
_finder: _Deny | None = None


def _stop(signum: int, frame: Any) -> None:
    import os
    import signal

    if _child:
        os.killpg(_child, signal.SIGKILL)
    os._exit(1)


def _threads() -> int:
    import os
    import threading

    task = "/proc/self/task"
    return len(os.listdir(task)) if os.path.isdir(task) else threading.active_count()


class _Deny:
    """An import finder that refuses the top-level packages named (in the server
    only: each child takes it away before its tests)."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"{name} is imported after the fork", name=name)


class _Server:
    """The pytest plugin of the fork server: after each test file collected, a check
    that the process has no more threads than before (a library that starts threads
    when imported, as the Rust runtimes of Icechunk and obstore do, does not survive a
    fork: a child that uses it waits forever); then, in place of pytest's test loop,
    the requests."""

    def __init__(self, requests: Any, channel: Any):
        self.requests, self.channel = requests, channel
        self.base = _threads()
        self.before = {n.partition(".")[0] for n in sys.modules}
        self.culprits: set[str] = set()

    def pytest_collectreport(self, report: Any) -> None:
        now = {n.partition(".")[0] for n in sys.modules}
        if _threads() > self.base and not self.culprits:
            self.culprits = now - self.before - {"tests", "xarray_gds"}
            self.culprits -= set(sys.stdlib_module_names)
            raise pytest.UsageError(f"threads started by {sorted(self.culprits)}")
        self.before = now

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: Any) -> bool:
        items = {item.nodeid: item for item in session.items}
        self._say({"ready": True, "tests": len(items), "threads": _threads()})
        for line in self.requests:  # (pytest's capture has taken sys.stdin away)
            if line.strip():
                self._say(_serve_one(session, items, json.loads(line)))
        return True

    def _say(self, message: dict[str, Any]) -> None:
        self.channel.write(json.dumps(message) + "\n")
        self.channel.flush()


def serve(modules: list[str], test_files: list[str], deny: list[str]) -> None:
    """The fork server (``python mutation_tool.py serve``, in the copy of the tree):
    pytest, the libraries of :data:`PRELOAD` and the package's ``modules`` imported and
    the tests of ``test_files`` collected once; then for each request on stdin (a JSON
    line: node ids, a timeout, the function a mutant changes), a fork that swaps that
    function's code for the mutated file's and runs those of the collected tests in
    pytest's own way; its answer on stdout (the exit status, None past the timeout, the
    node ids it did not collect). A mutant's tests so cost no interpreter start, no
    import and no collection: a fraction of a second where a fresh pytest takes ten.

    The packages in ``deny`` are not imported here (test files that import them are
    left to a fresh interpreter). If a test file starts threads when imported, the
    server answers ``{"deny": [the packages it imported]}`` and stops: the caller
    starts another with those denied too."""
    import contextlib
    import importlib
    import os
    import signal

    global _finder
    signal.signal(signal.SIGTERM, _stop)
    requests = os.fdopen(os.dup(0), "r")
    channel = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    _finder = _Deny(set(deny))
    sys.meta_path.insert(0, _finder)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for name in modules:
        importlib.import_module(name)
    plugin = _Server(requests, channel)
    args = [*PYTEST_ARGS, "--continue-on-collection-errors", *test_files]
    pytest.main(args, plugins=[plugin])
    if plugin.culprits:
        plugin._say({"deny": sorted(plugin.culprits)})


# --- pytest's output --------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown) +(\S.*)$")
_FAILED = re.compile(r"^(FAILED|ERROR) (\S.*)$")


def durations(output: str) -> dict[str, float]:
    """Node id -> seconds (setup, call and teardown together) from the output of a run
    with ``--durations=0 --durations-min=0``."""
    found: dict[str, float] = defaultdict(float)
    for line in output.splitlines():
        match = _DURATION.match(line.strip())
        if match:
            found[match[3].strip()] += float(match[1])
    return dict(found)


def failures(output: str) -> set[str]:
    """The node ids that failed or errored, from the short summary (``-ra``)."""
    found = set()
    for line in output.splitlines():
        match = _FAILED.match(line.strip())
        if match:
            found.add(match[2].split(" - ", 1)[0].strip())
    return found


# --- the survivors file ---------------------------------------------------------------


@dataclass
class Report:
    """What a diff or full run found: every mutant that survived, the lines no CPU test
    reached, and counts."""

    mode: str
    revision: str
    base: str | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    survivors: list[dict[str, Any]] = field(default_factory=list)
    unreached: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


NOT_OPEN = ("equivalent", "gpu-only")


def summarize(report: Report, done: list[Mutant]) -> None:
    """``report``'s survivors and counts, from the mutants run (``outcome`` set)."""
    report.survivors = [m.entry() for m in done if m.outcome == "survived"]
    outcomes = [m.outcome for m in done]
    report.counts = {
        "mutants": len(done),
        "run": sum(o in ("killed", "timeout", "survived") for o in outcomes),
        "killed": sum(o in ("killed", "timeout") for o in outcomes),
        "timeouts": outcomes.count("timeout"),
        "survived": outcomes.count("survived"),
        "equivalent": sum(m.outcome == "survived" and m.triage == "equivalent" for m in done),
        "gpu_only": sum(m.outcome == "survived" and m.triage == "gpu-only" for m in done),
        "open": sum(m.outcome == "survived" and m.triage not in NOT_OPEN for m in done),
        "unreached_mutants": outcomes.count("unreached"),
        "unreached_lines": len(report.unreached),
    }


def write_report(path: Path, report: Report) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=1) + "\n")


def read_report(path: Path) -> Report:
    return Report(**json.loads(path.read_text()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        spec = json.loads(sys.argv[2])
        serve(spec["modules"], spec["test_files"], spec["deny"])

"""docs/icechunk.md's dask-distributed example starts its cluster under
``if __name__ == "__main__":``: copied into a script, the worker processes that import
the script start no cluster of their own (the page's test runs it as ``__main__``)."""

from __future__ import annotations

import ast

from tests.test_doc_blocks import ROOT, blocks


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and isinstance(node.test.ops[0], ast.Eq)
        and isinstance(node.test.comparators[0], ast.Constant)
        and node.test.comparators[0].value == "__main__"
    )


def _unguarded_clients(tree: ast.Module) -> list[int]:
    """Lines of ``Client(...)`` calls outside a ``__main__`` guard and outside functions."""
    found: list[int] = []

    def visit(node: ast.AST) -> None:
        if _is_main_guard(node) or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Client":
            found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_the_distributed_example_is_guarded() -> None:
    code = [b for b in blocks(ROOT / "docs" / "icechunk.md") if "Client(" in b.code]
    assert len(code) == 1
    tree = ast.parse(code[0].code)
    assert _unguarded_clients(tree) == []
    assert any(_is_main_guard(node) for node in tree.body)
    # the function the workers run stays at the top level, where they can find it
    assert "write_part" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_the_check_finds_an_unguarded_client() -> None:
    assert _unguarded_clients(ast.parse("from distributed import Client\nc = Client()\n")) == [2]

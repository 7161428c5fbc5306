"""Griffe extension for the docs build: render Sphinx roles in docstrings.

The package's numpydoc docstrings use Sphinx roles such as ``:func:`placement```,
which mkdocstrings would print literally. This extension rewrites each role into an
optional cross-reference: a link where the target is documented on the site, plain
code otherwise (so a reference to, say, ``xarray.open_dataset`` never fails the
strict build). The source files are not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|obj|exc|data|const):`(?P<target>[^`]+)`")


def _resolve(obj: griffe.Object, target: str) -> str:
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except Exception:  # NameResolutionError, or an alias that does not resolve
        return target
    return f"{path}.{rest}" if rest else path


def _rewrite(obj: griffe.Object, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~.")
        title = target.rsplit(".", 1)[-1] if short else target
        identifier = _resolve(obj, target)
        return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'

    return _ROLE.sub(replace, text)


def _walk(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = _rewrite(obj, obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _walk(member)  # type: ignore[arg-type]


class RstRoles(griffe.Extension):
    """Rewrite Sphinx roles in the docstrings of ``xarray_gds``."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == "xarray_gds":
            _walk(pkg)

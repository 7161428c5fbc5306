"""Zarr metadata documents that do not parse: which one, and what is wrong with it.

zarr-python parses a store's metadata documents (``zarr.json``; ``.zgroup``,
``.zarray``, ``.zattrs`` and ``.zmetadata`` in Zarr v2) with :func:`json.loads` and
raises what it raises (``JSONDecodeError: Extra data: line 49 column 2``), naming no
document. When an open fails, :func:`find_damage` reads the documents that open read,
in the order it read them, and names the first one that is damaged
(:class:`~xarray_gds.errors.MetadataError`); :func:`naming_damage` puts it in the
place of the parser's error. Only the documents zarr reads are looked at: where
consolidated metadata describes the nodes, their own documents are not (as
``engine="zarr"`` does not read them either).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from xarray_gds.errors import MetadataError
from xarray_gds.stores.urls import redact

__all__ = ["consolidated_damage", "find_damage", "naming_damage", "problem"]

#: the documents of one node, as zarr reads them (``.zmetadata`` apart)
_NODE_DOCS = ("zarr.json", ".zgroup", ".zarray", ".zattrs")
_V2_KINDS = (".zarray", ".zattrs", ".zgroup")
#: the documents that hold consolidated metadata (v3, v2)
_CONSOLIDATED = ("zarr.json", ".zmetadata")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name


def _get(store: Any, key: str) -> bytes | None:
    """The bytes of ``key`` (None where it is missing or cannot be read)."""
    try:
        found = sync(store.get(key, default_buffer_prototype()))
    except Exception:  # unreadable: the open's own error says why
        return None
    return None if found is None else bytes(found.to_bytes())


def _json_problem(raw: bytes) -> str | None:
    """What keeps ``raw`` from being one JSON object, or None."""
    if not raw.strip():
        return "it is empty"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not UTF-8 text (byte {err.start} is {raw[err.start]:#04x})"
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        nul = len(text) - len(text.rstrip("\x00"))
        reason = f"not valid JSON ({err.msg}: line {err.lineno}, column {err.colno})"
        if nul:
            return f"{reason}: it ends with {nul} NUL byte{'s' if nul > 1 else ''}"
        if "\x00" in text:
            return f"{reason}: it holds NUL bytes"
        ran_out = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
        if ran_out:  # the parser wanted more: the document was cut short
            return f"{reason}: it ends before the JSON does (truncated after {len(raw)} bytes?)"
        return reason
    if not isinstance(doc, dict):
        return f"not a JSON object but a JSON {type(doc).__name__}"
    return None


def _v3_problem(doc: dict[str, Any], consolidated: bool | None, strict: bool) -> str | None:
    node_type = doc.get("node_type")
    if node_type not in ("array", "group") and (strict or node_type is not None):
        return f"its node_type is {node_type!r}, not 'array' or 'group'"
    listing = doc.get("consolidated_metadata")
    if node_type == "array" or listing is None or consolidated is False:
        return None
    members = listing.get("metadata") if isinstance(listing, dict) else None
    if not isinstance(members, dict) or not all(
        isinstance(m, dict) and m.get("node_type") in ("array", "group") for m in members.values()
    ):
        return (
            "its consolidated_metadata does not list nodes as Zarr does (an object of "
            "metadata objects, each with its node_type)"
        )
    return None


def _zmetadata_problem(doc: dict[str, Any]) -> str | None:
    members = doc.get("metadata")
    if isinstance(members, dict) and all(
        isinstance(v, dict) and k.rpartition("/")[2] in _V2_KINDS for k, v in members.items()
    ):
        return None
    return (
        "it does not list metadata as Zarr v2 does (a 'metadata' object of "
        "'PATH/.zarray', 'PATH/.zattrs' and 'PATH/.zgroup' objects)"
    )


def problem(
    key: str, raw: bytes, consolidated: bool | None = None, strict: bool = True
) -> str | None:
    """What is wrong with the document ``key`` (its name tells the kind) holding
    ``raw``, or None: it is one JSON object, a ``zarr.json`` names its node type
    (where ``strict``: zarr opens a root group's ``{}``) and consolidated metadata
    (unless ``consolidated`` is False) lists nodes."""
    wrong = _json_problem(raw)
    if wrong is not None:
        return wrong
    doc = json.loads(raw)
    name = key.rpartition("/")[2]
    if name == "zarr.json":
        return _v3_problem(doc, consolidated, strict)
    if name == ".zmetadata":
        return _zmetadata_problem(doc)
    return None


def _hint(key: str, consolidated: bool | None) -> str:
    name = key.rpartition("/")[2]
    if name == ".zmetadata" or (name == "zarr.json" and consolidated is not False):
        return (
            "restore it from a copy of the store; where it is consolidated metadata "
            "and the nodes' own documents are sound, consolidated=False reads those "
            "instead (zarr.consolidate_metadata(store) then writes it again)"
        )
    return "restore it from a copy of the store, or write the node again"


def _damaged(
    store: Any, key: str, consolidated: bool | None, strict: bool = True
) -> MetadataError | None:
    raw = _get(store, key)
    if raw is None:
        return None
    wrong = problem(key, raw, consolidated, strict)
    if wrong is None:
        return None
    return MetadataError(key, redact(str(store), None), wrong, _hint(key, consolidated))


def consolidated_damage(
    store: Any, group: str = "", zarr_format: int | None = None
) -> MetadataError | None:
    """The error of a damaged consolidated metadata document of ``group`` (the root
    when empty): a Zarr v2 ``.zmetadata``, or a Zarr v3 ``zarr.json`` (which holds the
    consolidated metadata), of ``zarr_format`` where given; None where it is missing or
    sound."""
    prefix = group.strip("/")
    names = {2: (".zmetadata",), 3: ("zarr.json",)}.get(zarr_format or 0, _CONSOLIDATED)
    for name in names:
        found = _damaged(store, _join(prefix, name), None, strict=False)
        if found is not None:
            return found
    return None


def _path_docs(group: str, consolidated: bool | None) -> list[str]:
    """The documents of the root, the groups down to ``group`` and ``group`` itself;
    the root's and ``group``'s ``.zmetadata`` unless ``consolidated`` is False."""
    parts = [p for p in group.strip("/").split("/") if p]
    prefixes = ["/".join(parts[:i]) for i in range(len(parts) + 1)]
    keys = [_join(prefix, name) for prefix in prefixes for name in _NODE_DOCS]
    if consolidated is not False:
        keys += list(dict.fromkeys(_join(p, ".zmetadata") for p in (prefixes[0], prefixes[-1])))
    return keys


def _listed(store: Any, group: str) -> list[str]:
    """The documents of the nodes below ``group`` (none where the store cannot list);
    no ``.zmetadata``: they are read where no consolidated metadata is."""
    prefix = group.strip("/")

    async def collect() -> list[str]:
        return [key async for key in store.list_prefix(f"{prefix}/" if prefix else "")]

    try:
        keys = sync(collect())
    except Exception:  # a store that cannot list (HTTP): the documents on the path only
        return []
    return sorted(k for k in keys if k.rpartition("/")[2] in _NODE_DOCS)


def _has_consolidated(store: Any, group: str) -> bool:
    """Whether ``group`` or the root holds consolidated metadata zarr reads its nodes
    from (the v2 ``.zmetadata`` or a v3 group's ``consolidated_metadata``)."""
    prefixes = {"", group.strip("/")}
    for prefix in prefixes:
        if _get(store, _join(prefix, ".zmetadata")) is not None:
            return True
        raw = _get(store, _join(prefix, "zarr.json"))
        ok = raw is not None and _json_problem(raw) is None
        if ok and json.loads(raw or b"").get("consolidated_metadata") is not None:
            return True
    return False


def find_damage(
    store: Any, group: str | None = None, *, consolidated: bool | None = None
) -> MetadataError | None:
    """The first damaged metadata document an open of ``group`` in ``store`` reads,
    as a :class:`~xarray_gds.errors.MetadataError`, or None.

    The documents of the root and of the groups down to ``group`` come first, then
    the consolidated metadata (unless ``consolidated`` is False), then, where no
    consolidated metadata is read, the documents of every node below ``group``.
    """
    path = (group or "").strip("/")
    for key in _path_docs(path, consolidated):  # opened as groups: no node_type is one
        found = _damaged(store, key, consolidated, strict=False)
        if found is not None:
            return found
    if consolidated is not False and _has_consolidated(store, path):
        return None  # the nodes are read from the consolidated metadata
    for key in _listed(store, path):
        found = _damaged(store, key, False)
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def naming_damage(
    store: Any, group: str | None = None, *, consolidated: bool | None = None
) -> Iterator[None]:
    """Raise :class:`~xarray_gds.errors.MetadataError` (the original error chained)
    in place of an error of the block where a metadata document it read is damaged
    (see :func:`find_damage`); any other error goes on as it is."""
    try:
        yield
    except MetadataError:
        raise
    except Exception as err:
        found = find_damage(store, group, consolidated=consolidated)
        if found is None:
            raise
        raise found from err

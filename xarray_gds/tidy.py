"""What a killed write leaves in a local store, found and removed.

:func:`xarray_gds.to_zarr` writes every chunk file whole (a temporary file renamed into
place) and the metadata after the chunks, consolidated metadata last; a write that
fails with an exception cleans up after itself (:mod:`xarray_gds.deferred`). A process
killed with ``SIGKILL`` (out of memory, a pre-empted node) cleans nothing, and can leave:

- ``*.partial`` files: a chunk or metadata file that was being written (never read:
  no reader looks for those names);
- chunk files outside the shape the metadata gives (the rows of an append whose
  metadata was never written): never read, but a later append of a smaller step
  would not overwrite them all, and ``zarr`` lists them;
- the directories of new arrays whose metadata was never written (a ``mode="a"``
  write of new variables);
- array metadata documents newer than the consolidated metadata, and nodes it does
  not list (killed while the metadata was being written, which is several files):
  readers that use the consolidated metadata (xarray's default) see the store as it
  was before the write, readers and writers that read each array's own document may
  see some arrays after it; the consolidated metadata, written last, is then the
  store's last complete state. But a store also differs from its consolidated
  metadata when someone wrote it without consolidating (``consolidated=False``,
  zarr-python adding an array): there the documents are the newer truth. Only the
  user knows which, so these two kinds are put back or removed only when asked
  (``trust_consolidated=True``, ``--trust-consolidated``); otherwise they are listed
  and kept;
- the writer lock file ``.xarray-gds.lock`` in the store's root (its lock died with
  the process): not listed (no chunk, node or document), it goes when the next write
  or :func:`tidy` gives the lock back (see :mod:`xarray_gds.stores.lock`).

Chunks inside the metadata's shape are the write's only visible trace: a step whose
chunks were written but whose metadata was not is invisible; a region write (which
replaces chunks in place) killed half way leaves each chunk whole, some old, some new.

:func:`tidy` lists all of it and, unless ``dry_run``, removes what only a killed write
can leave (and, with ``trust_consolidated``, puts the array documents back as the
consolidated metadata gives them), holding the store's writer lock;
``xarray-gds tidy PATH [--dry-run] [--trust-consolidated]`` does the same from the
command line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xarray_gds.stores.files import remove_tree, write_file
from xarray_gds.stores.lock import DEFAULT_TIMEOUT

__all__ = ["TRUSTING", "Leftover", "find_leftovers", "tidy"]

_V3 = "zarr.json"
_V2 = (".zarray", ".zgroup", ".zattrs")
_METADATA = frozenset({_V3, *_V2, ".zmetadata"})


@dataclass(frozen=True)
class Leftover:
    """One thing a killed write left behind.

    Attributes
    ----------
    path : str
        Relative to the store's root (``/``-separated).
    kind : str
        ``"partial-file"``, ``"orphan-chunk"`` (outside its array's shape),
        ``"unpublished-node"`` (an array directory with chunks and no metadata),
        ``"unconsolidated-node"`` (a node with metadata that the consolidated metadata
        does not list) or ``"metadata-ahead"`` (a document that differs from the
        consolidated metadata). The last two are acted on only when the consolidated
        metadata is trusted (:data:`TRUSTING`).
    detail : str
        Why, in words.
    """

    path: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind:17} {self.path}  ({self.detail})"


#: kinds of leftover that only a trusted consolidated metadata says are leftovers
TRUSTING = frozenset({"unconsolidated-node", "metadata-ahead"})


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None


def _published(root: Path) -> dict[str, Any] | None:
    """The consolidated metadata: document key (relative path of ``zarr.json``,
    ``.zarray``, ...) -> its JSON, or None when the store has none."""
    v3 = _load(root / _V3)
    if isinstance(v3, dict) and isinstance(v3.get("consolidated_metadata"), dict):
        entries = v3["consolidated_metadata"].get("metadata") or {}
        return {f"{name}/{_V3}": doc for name, doc in entries.items()}
    v2 = _load(root / ".zmetadata")
    if isinstance(v2, dict) and isinstance(v2.get("metadata"), dict):
        return {k: v for k, v in v2["metadata"].items() if not k.startswith(".")}
    return None


def _array_grid(doc: dict[str, Any], v3: bool) -> tuple[tuple[int, ...], str, bool] | None:
    """``(grid, separator, prefixed)`` of an array's chunk keys, or None (not an array,
    or a grid this does not know)."""
    try:
        shape = [int(s) for s in doc["shape"]]
        if v3:
            if doc.get("node_type") != "array" or doc["chunk_grid"]["name"] != "regular":
                return None
            chunks = doc["chunk_grid"]["configuration"]["chunk_shape"]
            encoding = doc.get("chunk_key_encoding") or {"name": "default"}
            config = encoding.get("configuration") or {}
            prefixed = encoding.get("name", "default") == "default"
            sep = config.get("separator", "/" if prefixed else ".")
        else:
            chunks = doc["chunks"]
            sep, prefixed = doc.get("dimension_separator") or ".", False
        grid = tuple(math.ceil(s / max(1, int(c))) for s, c in zip(shape, chunks, strict=True))
    except (KeyError, TypeError, ValueError):
        return None
    return grid, sep, prefixed


def _outside(key: str, grid: tuple[int, ...], sep: str, prefixed: bool) -> bool | None:
    """Whether the chunk ``key`` (relative to its array) lies outside ``grid``; None when
    ``key`` is not a chunk key of that encoding."""
    if prefixed:
        if key == "c" and not grid:
            return False
        if not key.startswith("c" + sep):
            return None
        key = key[2:]
    parts = key.split(sep)
    if not grid:
        return None if key != "0" else False
    if len(parts) != len(grid) or not all(p.isdigit() for p in parts):
        return None
    return any(int(p) >= g for p, g in zip(parts, grid, strict=True))


def _within(path: str, top: str) -> bool:
    """Whether the store path ``path`` is ``top`` or lies below it."""
    return path == top or path.startswith(top + "/")


def _walk(root: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Every file (relative, ``/``-separated) and, per directory, the files in it."""
    files: list[str] = []
    by_dir: dict[str, list[str]] = {}
    for dirpath, dirnames, names in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel = "" if rel == "." else rel
        by_dir[rel] = sorted(names)
        files.extend(f"{rel}/{n}" if rel else n for n in sorted(names))
    return files, by_dir


def _store_dir(store: str | os.PathLike[str]) -> Path:
    """``store``, checked to be a directory."""
    root = Path(store)
    if not root.is_dir():
        raise FileNotFoundError(f"xarray-gds tidy: {root} is not a directory (a local store)")
    return root


def find_leftovers(
    root: str | os.PathLike[str], *, trust_consolidated: bool = False
) -> list[Leftover]:
    """Every leftover in the local store at ``root``, those :func:`tidy` keeps without
    ``trust_consolidated`` (kinds in :data:`TRUSTING`) included. Chunks lie outside
    their array's shape as the consolidated metadata gives it when it is trusted, as
    the array's own document gives it otherwise."""
    root = _store_dir(root)
    files, by_dir = _walk(root)
    found: list[Leftover] = []
    found += [
        Leftover(f, "partial-file", "a file being written when the writer stopped")
        for f in files
        if f.endswith(".partial")
    ]
    published = _published(root)
    nodes = {d for d, names in by_dir.items() if any(n in names for n in (_V3, *_V2[:2]))}
    v3_nodes = {d for d in nodes if _V3 in by_dir[d]}
    dropped: list[str] = []
    if published is not None:
        known = {k.rpartition("/")[0] for k in published}
        for node in sorted(nodes - {""}):
            if node not in known and not any(_within(node, d) for d in dropped):
                dropped.append(node)
                found.append(
                    Leftover(node, "unconsolidated-node", "not in the consolidated metadata")
                )
        for key, doc in sorted(published.items()):
            if key.rpartition("/")[0] in dropped:
                continue
            if _load(root / key) != doc:
                found.append(
                    Leftover(key, "metadata-ahead", "differs from the consolidated metadata")
                )
    # arrays: their chunk files outside the shape; directories of chunks with no node
    for node in sorted(nodes):
        if any(_within(node, d) for d in dropped):
            continue
        v3 = node in v3_nodes
        doc_key = f"{node}/{_V3 if v3 else '.zarray'}".lstrip("/")
        doc = published.get(doc_key) if published is not None and trust_consolidated else None
        if doc is None:
            doc = _load(root / doc_key)
        grid = _array_grid(doc, v3) if isinstance(doc, dict) else None
        if grid is None:
            continue
        base = f"{node}/" if node else ""
        for f in files:
            if not f.startswith(base) or f.rsplit("/", 1)[-1] in _METADATA:
                continue
            if f.endswith(".partial"):
                continue
            outside = _outside(f[len(base) :], *grid)
            if outside:
                found.append(Leftover(f, "orphan-chunk", f"outside the shape of {node or '/'}"))
    for d in sorted(by_dir):
        if not d or d in nodes or any(_within(d, x) for x in dropped):
            continue
        parent = d.rpartition("/")[0]
        if parent in nodes and not _is_array(root, parent, parent in v3_nodes):
            # a directory in a group with no metadata anywhere below it: a new array
            below = [x for x in by_dir if _within(x, d)]
            if not any(x in nodes for x in below) and any(by_dir[x] for x in below):
                dropped.append(d)
                found.append(Leftover(d, "unpublished-node", "chunks of an array with no metadata"))
    return found


def _is_array(root: Path, node: str, v3: bool) -> bool:
    if not v3:
        return (root / node / ".zarray").exists()
    doc = _load(root / node / _V3)
    return isinstance(doc, dict) and doc.get("node_type") == "array"


def tidy(
    store: str | os.PathLike[str],
    *,
    dry_run: bool = False,
    trust_consolidated: bool = False,
    lock_timeout: float | None = DEFAULT_TIMEOUT,
) -> list[Leftover]:
    """Remove what killed writes left in the local store ``store`` (see the module).

    Partial files, chunks outside each array's shape and array directories without
    metadata go. Documents that differ from the consolidated metadata and nodes it
    does not list are kept (they may be someone's write made without consolidating)
    unless ``trust_consolidated``: then the consolidated metadata (written last by
    every complete write of this package) is the store's state, documents are put
    back as it gives them and the nodes it does not list are removed.

    Parameters
    ----------
    store : str or path
        A local directory store.
    dry_run : bool
        Only list what would go.
    trust_consolidated : bool
        The consolidated metadata is the store's last complete state (the store is
        written only by complete writes of this package, and one was killed).
    lock_timeout : float or None
        Seconds to wait for a writer of the store (its writer lock is held while
        tidying, see :mod:`xarray_gds.stores.lock`).

    Returns
    -------
    list of Leftover
        What was removed or put back (with ``dry_run``, what would be). What is kept
        is what :func:`find_leftovers` still lists.
    """
    from xarray_gds.stores import source_for
    from xarray_gds.stores.local import GdsStore

    root = _store_dir(store)  # before the lock, which would make it
    kind = source_for(GdsStore(root, read_only=True))
    lock = kind.writer_lock(lock_timeout) if not dry_run else None
    try:
        found = find_leftovers(root, trust_consolidated=trust_consolidated)
        if not trust_consolidated:
            found = [item for item in found if item.kind not in TRUSTING]
        if dry_run:
            return found
        published = _published(root) or {}
        for item in found:
            path = root / item.path
            if item.kind == "metadata-ahead":
                write_file(str(path), json.dumps(published[item.path], indent=2).encode())
            elif item.kind in ("unpublished-node", "unconsolidated-node"):
                if path.is_dir():
                    remove_tree(str(path))
            elif path.exists():
                path.unlink()
        _remove_empty_dirs(root)
        return found
    finally:
        if lock is not None:
            lock.release()


def _remove_empty_dirs(root: Path) -> None:
    for dirpath, _, _ in sorted(os.walk(root), key=lambda e: -e[0].count(os.sep)):
        if Path(dirpath) != root:
            try:
                os.rmdir(dirpath)
            except OSError:
                continue

"""What a killed write leaves in a local store, found and removed.

:func:`xarray_gds.to_zarr` writes every chunk file whole (a temporary file renamed into
place) and the metadata after the chunks, consolidated metadata last; a write that
fails with an exception cleans up after itself (:mod:`xarray_gds.deferred`). A process
killed with ``SIGKILL`` (out of memory, a pre-empted node) cleans nothing, and can leave:

- temporary files, ``.NAME.xarray-gds-<32 hex digits>.partial`` beside the chunk or
  metadata file ``NAME`` that was being written (never read: no reader looks for those
  names; :data:`xarray_gds.stores.files.TEMPORARY`). Other ``*.partial`` files are not
  the engine's and stay;
- chunk files outside the shape the metadata gives (the rows of an append whose
  metadata was never written): never read, but a later append of a smaller step
  would not overwrite them all, and ``zarr`` lists them;
- the directories of new arrays whose metadata was never written (a ``mode="a"``
  write of new variables): directories of a group that hold only chunk keys of one
  layout and that no metadata of the store, consolidated metadata included, lists;
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

A killed write never leaves a document that does not parse (documents are renamed into
place whole) nor deletes one. A node whose document does not parse, or whose document
is missing while consolidated metadata lists it, is *damaged*: it is listed
(:data:`DAMAGED`) and nothing of it is removed, its chunks included; a consolidated
metadata document that does not parse leaves only the temporary files provably the
engine's. A directory whose root holds no Zarr metadata is not a store and is refused.
Chunks are outside an array's shape only when they are outside every shape the
store's metadata gives the array (its own document and the consolidated metadata).

Chunks inside the metadata's shape are the write's only visible trace: a step whose
chunks were written but whose metadata was not is invisible; a region write (which
replaces chunks in place) killed half way leaves each chunk whole, some old, some new.

:func:`tidy` lists all of it (a dry run, the default) or, with ``dry_run=False``,
removes what only a killed write can leave (and, with ``trust_consolidated``, puts the
array documents back as the consolidated metadata gives them), holding the store's
writer lock; ``xarray-gds tidy PATH [--delete] [--trust-consolidated]`` does the same
from the command line.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xarray_gds.stores.files import TEMPORARY, write_file
from xarray_gds.stores.lock import DEFAULT_TIMEOUT

__all__ = ["DAMAGED", "TRUSTING", "Leftover", "find_leftovers", "tidy"]

_V3 = "zarr.json"
_V2 = (".zarray", ".zgroup", ".zattrs")
_ZMETADATA = ".zmetadata"
#: the documents one of which a Zarr store's root holds
_ROOT = (_V3, ".zgroup", ".zarray", _ZMETADATA)
#: a chunk key below its array's directory: v3 ``c/0/1``, ``c.0.1``, ``c``; v2 ``0.1``, ``0/1``
_CHUNK_KEY = re.compile(r"c([./]\d+)*|\d+([./]\d+)*")
_BAD = object()  #: what :func:`_load` gives for a file that cannot be read as JSON


@dataclass(frozen=True)
class Leftover:
    """One thing a killed write left behind, or a damaged node that is kept.

    Attributes
    ----------
    path : str
        Relative to the store's root (``/``-separated).
    kind : str
        ``"partial-file"`` (a temporary file of the engine), ``"orphan-chunk"``
        (outside its array's shape), ``"unpublished-node"`` (an array directory with
        chunks and no metadata), ``"unconsolidated-node"`` (a node with metadata that
        the consolidated metadata does not list), ``"metadata-ahead"`` (a document that
        differs from the consolidated metadata) or ``"damaged"`` (a document that does
        not parse, or is missing while consolidated metadata lists its node). The
        ``unconsolidated-node`` and ``metadata-ahead`` kinds are acted on only when the
        consolidated metadata is trusted (:data:`TRUSTING`); ``damaged`` never is.
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

#: the kind of a damaged node or document: listed, never removed or rewritten
DAMAGED = "damaged"


@dataclass(frozen=True)
class _Node:
    """A directory of the store with a document: ``kind`` is ``"group"``, ``"array"``
    or :data:`DAMAGED` (``why`` says how); ``doc`` its own v3 or ``.zarray`` document;
    ``key`` that document's."""

    kind: str
    key: str
    doc: Any = None
    why: str = "does not parse as a Zarr document"


@dataclass(frozen=True)
class _Step:
    """A leftover, the files its removal deletes and the document it puts back."""

    item: Leftover
    remove: tuple[str, ...] = ()
    put: Any = None


@dataclass
class _Survey:
    """The store as :func:`find_leftovers` sees it."""

    root: Path
    v3: bool
    files: list[str]
    by_dir: dict[str, list[str]]
    nodes: dict[str, _Node] = field(default_factory=dict)
    bare: list[str] = field(default_factory=list)  #: directories of groups, no document
    listed: set[str] = field(default_factory=set)  #: nodes consolidated metadata lists
    published: dict[str, Any] | None = None  #: the root's consolidated metadata
    damaged: list[Leftover] = field(default_factory=list)
    certain: bool = True  #: every consolidated metadata document parses


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError):
        return _BAD


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _within(path: str, top: str) -> bool:
    """Whether the store path ``path`` is ``top`` or lies below it (``""``: the root)."""
    return not top or path == top or path.startswith(top + "/")


def _walk(root: Path) -> tuple[list[str], dict[str, list[str]]]:
    """Every file (relative, ``/``-separated) and, per directory, the files in it."""
    files: list[str] = []
    by_dir: dict[str, list[str]] = {}
    for dirpath, dirnames, names in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel = "" if rel == "." else rel
        by_dir[rel] = sorted(names)
        files.extend(_join(rel, n) for n in sorted(names))
    return files, by_dir


def _store_dir(store: str | os.PathLike[str]) -> Path:
    """``store``, checked to be a directory holding Zarr metadata in its root."""
    root = Path(store).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"No such Zarr store: '{root}'")
    if not root.is_dir() or not any((root / name).is_file() for name in _ROOT):
        raise ValueError(
            f"'{root}' is not a Zarr store: it is not a directory holding zarr.json "
            "(Zarr v3) or .zgroup/.zarray/.zmetadata (Zarr v2); nothing was removed"
        )
    return root


def _read_node(root: Path, d: str, names: list[str], v3: bool) -> _Node | None:
    """The node of directory ``d`` (None when it holds no document of the format)."""
    if v3:
        if _V3 not in names:
            return None
        doc = _load(root / d / _V3)
        kind = doc.get("node_type") if isinstance(doc, dict) else None
        if kind not in ("group", "array") or doc.get("zarr_format") != 3:
            return _Node(DAMAGED, _join(d, _V3))
        return _Node(kind, _join(d, _V3), doc)
    if ".zarray" not in names and ".zgroup" not in names:
        return None
    docs = {n: _load(root / d / n) for n in _V2 if n in names}
    for name, doc in docs.items():
        if not isinstance(doc, dict):
            return _Node(DAMAGED, _join(d, name))
    if len(docs.keys() & {".zarray", ".zgroup"}) == 2:
        return _Node(DAMAGED, _join(d, ".zgroup"))
    if ".zarray" in docs:
        return _Node("array", _join(d, ".zarray"), docs[".zarray"])
    return _Node("group", _join(d, ".zgroup"))


def _survey(root: Path) -> _Survey:
    """The nodes below the root's groups, the bare directories of groups, what the
    consolidated metadata of every group lists."""
    files, by_dir = _walk(root)
    s = _Survey(root, _V3 in by_dir[""], files, by_dir)
    children: dict[str, list[str]] = {}
    for d in sorted(by_dir):
        if d:
            children.setdefault(d.rpartition("/")[0], []).append(d)
    todo = [""]
    while todo:
        d = todo.pop()
        node = _read_node(root, d, by_dir[d], s.v3)
        if node is None and d:
            s.bare.append(d)
            continue
        node = node or _Node(DAMAGED, ".zgroup", why="missing beside .zmetadata")
        s.nodes[d] = node
        if node.kind == DAMAGED:
            s.damaged.append(Leftover(node.key, DAMAGED, node.why))
        elif node.kind == "group":
            todo += children.get(d, [])
            _consolidated(s, d)
    for d in sorted(s.bare):
        if d in s.listed:
            s.damaged.append(
                Leftover(
                    _join(d, _V3 if s.v3 else ".zarray"),
                    DAMAGED,
                    "missing, and consolidated metadata lists its node",
                )
            )
    s.damaged.sort(key=lambda item: item.path)
    return s


def _consolidated(s: _Survey, group: str) -> None:
    """Add the nodes that the consolidated metadata of ``group`` lists to
    ``s.listed``; the root's is ``s.published``."""
    key = _join(group, _V3 if s.v3 else _ZMETADATA)
    if s.v3:
        metadata = s.nodes[group].doc.get("consolidated_metadata")
        if metadata is None:
            return
        entries = metadata.get("metadata") if isinstance(metadata, dict) else None
    else:
        if _ZMETADATA not in s.by_dir[group]:
            return
        doc = _load(s.root / key)
        entries = doc.get("metadata") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        s.certain = False
        s.damaged.append(Leftover(key, DAMAGED, "its consolidated metadata does not parse"))
        return
    names = list(entries) if s.v3 else [k.rpartition("/")[0] for k in entries]
    s.listed.update(_join(group, name) for name in names if name)
    if not group:
        s.published = (
            {f"{name}/{_V3}": doc for name, doc in entries.items()}
            if s.v3
            else {k: v for k, v in entries.items() if not k.startswith(".")}
        )


def _lengths(values: Any, least: int) -> list[int]:
    """A document's shape or chunk shape, each a whole number of at least ``least``;
    ValueError for anything else (a string, a float, a bool: zarr refuses such a
    document, so tidy does not guess what its chunks are)."""
    if not isinstance(values, list) or not all(type(v) is int and v >= least for v in values):
        raise ValueError(f"not a list of whole numbers >= {least}: {values!r}")
    return values


def _array_grid(doc: Any, v3: bool) -> tuple[tuple[int, ...], str, bool] | None:
    """``(grid, separator, prefixed)`` of an array's chunk keys, or None (not an array,
    a grid or chunk key encoding this does not know, or a document zarr would refuse:
    then every file below the array stays)."""
    try:
        shape = _lengths(doc["shape"], 0)
        if v3:
            if doc.get("node_type") != "array" or doc["chunk_grid"]["name"] != "regular":
                return None
            chunks = _lengths(doc["chunk_grid"]["configuration"]["chunk_shape"], 1)
            encoding = doc.get("chunk_key_encoding") or {"name": "default"}
            name = encoding.get("name", "default")
            if name not in ("default", "v2"):
                return None
            config = encoding.get("configuration") or {}
            prefixed = name == "default"
            sep = config.get("separator", "/" if prefixed else ".")
        else:
            chunks = _lengths(doc["chunks"], 1)
            sep, prefixed = doc.get("dimension_separator") or ".", False
        grid = tuple(-(-s // c) for s, c in zip(shape, chunks, strict=True))
    except (AttributeError, KeyError, TypeError, ValueError):
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


def _temporary(path: str) -> bool:
    return TEMPORARY.fullmatch(path.rpartition("/")[2]) is not None


def _below(path: str, top: str) -> str:
    return path[len(top) + 1 :] if top else path


def _orphans(s: _Survey, node: str, trust: bool) -> list[_Step]:
    """The chunk files of the array ``node`` outside every shape its metadata gives
    (only the consolidated metadata's when it is trusted)."""
    key = s.nodes[node].key
    published = (s.published or {}).get(key)
    docs = [published] if trust and published is not None else [s.nodes[node].doc, published]
    found = [_array_grid(doc, s.v3) for doc in docs if doc is not None]
    grids = [grid for grid in found if grid is not None]
    if not grids or len(grids) != len(found):
        return []
    where = f"outside the shape of {node or '/'}"
    return [
        _Step(Leftover(f, "orphan-chunk", where), (f,))
        for f in s.files
        if f != key
        and _within(f, node)
        and all(_outside(_below(f, node), *grid) is True for grid in grids)
    ]


def _chunk_keys(s: _Survey, top: str) -> tuple[str, ...] | None:
    """The files below the bare directory ``top`` when they are the chunks of one array
    (at least one chunk key, all of one layout) and the engine's temporary files."""
    files = tuple(f for f in s.files if _within(f, top))
    keys = [_below(f, top) for f in files if not _temporary(f)]
    if not keys or not all(_CHUNK_KEY.fullmatch(k) for k in keys):
        return None
    if len({re.sub(r"\d+", "0", k) for k in keys}) != 1:
        return None
    return files


def _engine_files(s: _Survey, top: str) -> tuple[str, ...]:
    """The files below the node ``top`` that the engine writes: documents of nodes that
    are not damaged, chunk keys of their arrays and of bare directories of their groups,
    temporary files. The files of damaged nodes and the user's stay."""
    docs = {_V3} if s.v3 else {*_V2, _ZMETADATA}
    out = []
    for f in s.files:
        if not _within(f, top):
            continue
        d, _, name = f.rpartition("/")
        if _temporary(f) or (d in s.nodes and s.nodes[d].kind != DAMAGED and name in docs):
            out.append(f)
            continue
        owner, child = d, ""
        while owner not in s.nodes:
            owner, child = owner.rpartition("/")[0], owner
        kind = s.nodes[owner].kind
        array = kind == "array" and _CHUNK_KEY.fullmatch(_below(f, owner))
        bare = kind == "group" and child in s.bare and _CHUNK_KEY.fullmatch(_below(f, child))
        if array or bare:
            out.append(f)
    return tuple(out)


def _unconsolidated(s: _Survey, published: dict[str, Any], dropped: list[str]) -> list[_Step]:
    """The nodes that no consolidated metadata lists (added to ``dropped``: the top
    ones) and the documents that differ from the root's consolidated metadata."""
    steps = []
    for node in sorted(s.nodes):
        if not node or s.nodes[node].kind == DAMAGED or node in s.listed:
            continue
        if not any(_within(node, d) for d in dropped):
            dropped.append(node)
            why = "not in the consolidated metadata"
            steps.append(_Step(Leftover(node, "unconsolidated-node", why), _engine_files(s, node)))
    for key, doc in sorted(published.items()):
        node = key.rpartition("/")[0]
        here = s.nodes.get(node)
        if here is None or here.kind == DAMAGED or any(_within(node, d) for d in dropped):
            continue
        if _own(_load(s.root / key)) != _own(doc):
            why = "differs from the consolidated metadata"
            steps.append(_Step(Leftover(key, "metadata-ahead", why), put=_own(doc)))
    return steps


def _own(doc: Any) -> Any:
    """A document as its node holds it: without the consolidated metadata that zarr
    gives the entries of groups in a consolidated listing."""
    if isinstance(doc, dict) and "consolidated_metadata" in doc:
        return {k: v for k, v in doc.items() if k != "consolidated_metadata"}
    return doc


def _plan(root: Path, trust: bool) -> list[_Step]:
    """Every leftover of the store at ``root``, each with what acting on it does."""
    s = _survey(root)
    steps = [
        _Step(Leftover(f, "partial-file", "a file being written when the writer stopped"), (f,))
        for f in s.files
        if _temporary(f)
    ]
    steps += [_Step(item) for item in s.damaged]
    if not s.certain:  # (a damaged root has no nodes below it)
        return steps
    dropped: list[str] = []
    if s.published is not None:
        steps += _unconsolidated(s, s.published, dropped)
    for node in sorted(s.nodes):
        if s.nodes[node].kind == "array" and not any(_within(node, d) for d in dropped):
            steps += _orphans(s, node, trust)
    for d in sorted(s.bare):
        if d in s.listed or any(_within(d, x) for x in dropped):
            continue
        files = _chunk_keys(s, d)
        if files is not None:
            why = "chunks of an array with no metadata"
            steps.append(_Step(Leftover(d, "unpublished-node", why), files))
    return steps


def find_leftovers(
    root: str | os.PathLike[str], *, trust_consolidated: bool = False
) -> list[Leftover]:
    """Every leftover in the local store at ``root``, those :func:`tidy` keeps without
    ``trust_consolidated`` (kinds in :data:`TRUSTING`) and damaged nodes (kind
    :data:`DAMAGED`, always kept) included. Chunks lie outside their array's shape as
    the consolidated metadata gives it when it is trusted, as every document of the
    store gives it otherwise.

    Raises
    ------
    FileNotFoundError
        When ``root`` does not exist.
    ValueError
        When ``root`` is not a directory holding Zarr metadata in its root.
    """
    return [step.item for step in _plan(_store_dir(root), trust_consolidated)]


def tidy(
    store: str | os.PathLike[str],
    *,
    dry_run: bool = True,
    trust_consolidated: bool = False,
    lock_timeout: float | None = DEFAULT_TIMEOUT,
) -> list[Leftover]:
    """List, or with ``dry_run=False`` remove, what killed writes left in the local
    store ``store`` (see the module).

    Temporary files of the engine, chunks outside each array's shape and array
    directories without metadata go. Documents that differ from the consolidated
    metadata and nodes it does not list are kept (they may be someone's write made
    without consolidating) unless ``trust_consolidated``: then the consolidated
    metadata (written last by every complete write of this package) is the store's
    state, documents are put back as it gives them and the engine's files of the nodes
    it does not list are removed. Damaged nodes (a document that does not parse, or is
    missing while consolidated metadata lists it) are kept whole.

    Parameters
    ----------
    store : str or path
        A local directory store.
    dry_run : bool
        Only list what would go (the default); ``False`` removes it.
    trust_consolidated : bool
        The consolidated metadata is the store's last complete state (the store is
        written only by complete writes of this package, and one was killed).
    lock_timeout : float or None
        Seconds to wait for a writer of the store (its writer lock is held while
        removing, see :mod:`xarray_gds.stores.lock`).

    Returns
    -------
    list of Leftover
        What was removed or put back (with ``dry_run``, what would be). What is kept
        is what :func:`find_leftovers` still lists.

    Raises
    ------
    FileNotFoundError
        When ``store`` does not exist.
    ValueError
        When ``store`` is not a directory holding Zarr metadata in its root: nothing
        in it is removed.
    TimeoutError
        When another writer held the store's lock for ``lock_timeout`` seconds.
    """
    from xarray_gds.stores import source_for
    from xarray_gds.stores.local import GdsStore

    root = _store_dir(store)  # before the lock, which would make it
    lock = None
    if not dry_run:
        lock = source_for(GdsStore(root, read_only=True)).writer_lock(lock_timeout)
    try:
        steps = [
            step
            for step in _plan(root, trust_consolidated)
            if step.item.kind != DAMAGED and (trust_consolidated or step.item.kind not in TRUSTING)
        ]
        if not dry_run:
            _apply(root, steps)
        return [step.item for step in steps]
    finally:
        if lock is not None:
            lock.release()


def _apply(root: Path, steps: list[_Step]) -> None:
    """Put back the documents of ``steps``, delete their files, then the directories
    this leaves empty (those only)."""
    emptied: set[str] = set()
    for step in steps:
        if step.put is not None:
            write_file(str(root / step.item.path), json.dumps(step.put, indent=2).encode())
        for f in step.remove:
            try:
                os.unlink(root / f)
            except FileNotFoundError:
                continue
            emptied.add(f.rpartition("/")[0])
    for d in sorted(emptied, key=lambda d: -d.count("/")):
        while d:
            try:
                os.rmdir(root / d)
            except OSError:
                break
            d = d.rpartition("/")[0]

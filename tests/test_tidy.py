"""``xarray_gds.tidy`` and ``xarray-gds tidy`` remove only what a killed write of this
package provably left: damaged and decorated stores (Zarr v2 and v3, consolidated or
not) keep every file a reader reads and every file the engine did not make, byte for
byte, and read the same values with ``engine="zarr"`` and ``engine="gds-zarr"``; the
engine's temporary files, chunks outside every shape and directories of chunks that no
metadata lists still go; a directory that is not a Zarr store is refused."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
from xarray_gds.deferred import HeldMetadataStore
from xarray_gds.stores.files import TEMPORARY, temporary_name, write_file
from xarray_gds.stores.local import GdsStore
from xarray_gds.stores.lock import LOCK_NAME
from xarray_gds.tidy import DAMAGED, Leftover, find_leftovers, tidy
from xarray_gds.tools.cli import main

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray_gds.XarrayGdsWarning"),
    pytest.mark.filterwarnings("ignore:Object at .* is not recognized:UserWarning"),
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
]

HEX = "0123456789abcdef" * 2
LAYOUTS = [(3, True), (3, False), (2, True), (2, False)]


def _temp(name: str) -> str:
    """A temporary file of the engine's for ``name`` (as ``write_file`` names them)."""
    return f".{name}.xarray-gds-{HEX}.partial"


def _doc(fmt: int) -> str:
    return "zarr.json" if fmt == 3 else ".zarray"


def _chunk(fmt: int, *index: int) -> str:
    """The key of a chunk of the default encoding, relative to its array."""
    return "c/" + "/".join(map(str, index)) if fmt == 3 else ".".join(map(str, index))


def _dataset() -> xr.Dataset:
    rng = np.random.default_rng(11)
    shape = (3, 4, 8)
    return xr.Dataset(
        {n: (("time", "y", "x"), rng.normal(size=shape).astype("f4")) for n in ("t2m", "sp")},
        coords={"time": np.arange(3), "y": np.arange(4.0), "x": np.arange(8.0)},
    )


def _write(root: Path, fmt: int, consolidated: bool) -> None:
    enc = {"chunks": (1, 2, 4)}
    xarray_gds.to_zarr(
        _dataset(),
        root,
        zarr_format=fmt,
        consolidated=consolidated,
        encoding={"t2m": enc, "sp": enc},
    )


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file below ``root``: relative path -> bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _read(root: Path, engine: str) -> xr.Dataset | str:
    """The store's values as ``engine`` reads them, or the name of the error it raises."""
    kwargs: dict[str, Any] = {"device": "cpu"} if engine == "gds-zarr" else {}
    try:
        with xr.open_dataset(root, engine=engine, **kwargs) as ds:
            return ds.load()
    except Exception as err:  # the store does not open: it must fail the same after
        return type(err).__name__


def _same(after: xr.Dataset | str, before: xr.Dataset | str) -> None:
    if isinstance(before, xr.Dataset):
        assert isinstance(after, xr.Dataset)
        xr.testing.assert_identical(after, before)
    else:
        assert after == before


@dataclass
class Case:
    """What a case makes of the store: the files tidy removes besides the base
    leftovers, the leftovers it lists, the damaged documents, whether chunks outside
    every shape are provably leftovers, whether the store opens with engine="zarr"."""

    gone: set[str] = field(default_factory=set)
    found: set[tuple[str, str]] = field(default_factory=set)
    damaged: set[str] = field(default_factory=set)
    certain: bool = True
    opens: bool = True


def _append(path: Path, data: bytes) -> None:
    path.write_bytes(path.read_bytes() + data)


def _clean(root: Path, fmt: int, consolidated: bool) -> Case:
    return Case()


def _nul_appended(root: Path, fmt: int, consolidated: bool) -> Case:
    _append(root / "t2m" / _doc(fmt), b"\0")
    return Case(damaged={f"t2m/{_doc(fmt)}"}, opens=consolidated)


def _truncated(root: Path, fmt: int, consolidated: bool) -> Case:
    doc = root / "t2m" / _doc(fmt)
    doc.write_bytes(doc.read_bytes()[: len(doc.read_bytes()) // 2])
    return Case(damaged={f"t2m/{_doc(fmt)}"}, opens=consolidated)


def _doc_deleted(root: Path, fmt: int, consolidated: bool) -> Case:
    (root / "t2m" / _doc(fmt)).unlink()
    return Case(damaged={f"t2m/{_doc(fmt)}"})


def _foreign_document(root: Path, fmt: int, consolidated: bool) -> Case:
    """JSON that is no Zarr document: a v3 one without its format, a v2 one a list."""
    doc = root / "t2m" / _doc(fmt)
    if fmt == 3:
        text = json.loads(doc.read_text())
        del text["zarr_format"]
        doc.write_text(json.dumps(text))
    else:
        doc.write_text("[1, 2]")
    return Case(damaged={f"t2m/{_doc(fmt)}"}, opens=consolidated or fmt == 3)


def _array_and_group(root: Path, fmt: int, consolidated: bool) -> Case:
    (root / "t2m" / ".zgroup").write_text('{"zarr_format": 2}')
    return Case(damaged={"t2m/.zgroup"})


def _attrs_corrupt(root: Path, fmt: int, consolidated: bool) -> Case:
    _append(root / "t2m" / ".zattrs", b"\0")
    return Case(damaged={"t2m/.zattrs"}, opens=consolidated)


def _root_corrupt(root: Path, fmt: int, consolidated: bool) -> Case:
    name = "zarr.json" if fmt == 3 else ".zgroup"
    _append(root / name, b"\0")
    return Case(damaged={name}, certain=False, opens=False)


def _consolidated_corrupt(root: Path, fmt: int, consolidated: bool) -> Case:
    if fmt == 2:
        _append(root / ".zmetadata", b"\0")
        return Case(damaged={".zmetadata"}, certain=False, opens=False)
    doc = json.loads((root / "zarr.json").read_text())
    doc["consolidated_metadata"] = {}  # no listing in it
    (root / "zarr.json").write_text(json.dumps(doc))
    return Case(damaged={"zarr.json"}, certain=False)  # zarr lists the store instead


def _extra_documents(root: Path, fmt: int, consolidated: bool) -> Case:
    group = (root / ("zarr.json" if fmt == 3 else ".zgroup")).read_bytes()
    if fmt == 3:
        (root / "t2m" / ".zarray").write_text('{"zarr_format": 2}')
        (root / "t2m" / ".zattrs").write_text('{"units": "K"}')
        (root / "t2m" / "c" / "zarr.json").write_bytes(group)
        (root / "notes").mkdir()
        (root / "notes" / ".zgroup").write_text('{"zarr_format": 2}')
    else:
        (root / "t2m" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
        (root / "t2m" / "sub").mkdir()
        (root / "t2m" / "sub" / ".zgroup").write_bytes(group)
        (root / "notes").mkdir()
        (root / "notes" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    return Case()


def _user_files(root: Path, fmt: int, consolidated: bool) -> Case:
    chunk_dir = root / "t2m" / ("c/0/0" if fmt == 3 else "")
    files = {
        "notes.partial": b"mine",
        "README.txt": b"about",
        "t2m/data.partial": b"mine",
        "t2m/README.txt": b"about t2m",
        "docs/guide.txt": b"guide",
        "mixed/c/0/0": b"two layouts",
        "mixed/1.1": b"two layouts",
        "new2/c/0/0": b"a chunk",
        "new2/README.txt": b"and a user's file",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    # names near the engine's: a short random part, an earlier form, no leading dot
    (chunk_dir / ".0.xarray-gds-0123.partial").write_bytes(b"mine")
    (chunk_dir / f"0.{HEX}.partial").write_bytes(b"mine")
    (chunk_dir / f"0.xarray-gds-{HEX}.partial").write_bytes(b"mine")
    (chunk_dir / f".0.xarray-gds-{HEX}.partial.txt").write_bytes(b"mine")
    (root / "scratch").mkdir()
    return Case()


def _killed_write(root: Path, fmt: int, consolidated: bool) -> Case:
    """What a killed write leaves beyond the base leftovers: the chunks of a new array
    whose metadata was never written, with a temporary file among them, and a chunk of
    t2m past its end."""
    data = (root / "sp" / _chunk(fmt, 0, 0, 0)).read_bytes()
    new = {f"new/{_chunk(fmt, 0, 0, i)}" for i in range(2)} | {f"new/{_temp('9')}"}
    for rel in (*new, f"t2m/{_chunk(fmt, 3, 0, 1)}"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    found = {
        ("new", "unpublished-node"),
        (f"new/{_temp('9')}", "partial-file"),
        (f"t2m/{_chunk(fmt, 3, 0, 1)}", "orphan-chunk"),
    }
    return Case(gone={*new, f"t2m/{_chunk(fmt, 3, 0, 1)}"}, found=found)


CASES: dict[str, Callable[[Path, int, bool], Case]] = {
    "clean": _clean,
    "nul-appended": _nul_appended,
    "truncated": _truncated,
    "doc-deleted": _doc_deleted,
    "foreign-document": _foreign_document,
    "array-and-group": _array_and_group,
    "attrs-corrupt": _attrs_corrupt,
    "root-corrupt": _root_corrupt,
    "consolidated-corrupt": _consolidated_corrupt,
    "extra-documents": _extra_documents,
    "user-files": _user_files,
    "killed-write": _killed_write,
}
#: cases that need consolidated metadata, or a format
ONLY = {
    "doc-deleted": "consolidated",
    "consolidated-corrupt": "consolidated",
    "attrs-corrupt": 2,
    "array-and-group": 2,
}
TABLE = [
    pytest.param(
        name, fmt, consolidated, trust, id=f"{name}-v{fmt}-{con}-{'trust' if trust else 'plain'}"
    )
    for name in CASES
    for fmt, consolidated in LAYOUTS
    for con in ["consolidated" if consolidated else "unconsolidated"]
    for trust in (False, True)
    if ONLY.get(name) in (None, fmt) or (ONLY.get(name) == "consolidated" and consolidated)
]


def _decorate(root: Path, fmt: int) -> tuple[dict[str, str], set[str]]:
    """The leftovers every case gets: temporary files of the engine in the root and in
    t2m, a chunk of sp past its end (a killed append). ``(temporary files by kind,
    the chunk)``."""
    temps = {
        _temp("zarr.json"): "partial-file",
        f"t2m/{'c/0/0/' if fmt == 3 else ''}{_temp('0')}": "partial-file",
    }
    for rel in temps:
        (root / rel).write_bytes(b"half a chunk")
    orphan = f"sp/{_chunk(fmt, 5, 0, 0)}"
    (root / orphan).parent.mkdir(parents=True, exist_ok=True)
    (root / orphan).write_bytes((root / "sp" / _chunk(fmt, 0, 0, 0)).read_bytes())
    return temps, {orphan}


@pytest.mark.parametrize(("name", "fmt", "consolidated", "trust"), TABLE)
def test_tidy_keeps_what_it_cannot_prove(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    fmt: int,
    consolidated: bool,
    trust: bool,
) -> None:
    """After tidy (dry run, then deleting) of a damaged or decorated store, every file
    but the killed writes' is there byte for byte, values read the same with both
    engines, damaged documents are listed and kept, leftovers are exactly found."""
    root = tmp_path / "s.zarr"
    _write(root, fmt, consolidated)
    temps, orphans = _decorate(root, fmt)
    case = CASES[name](root, fmt, consolidated)
    want = {*temps.items(), *case.found}
    gone = {*temps, *case.gone}
    if case.certain:
        want |= {(o, "orphan-chunk") for o in orphans}
        gone |= orphans
    damaged = {(path, DAMAGED) for path in case.damaged}
    assert {(i.path, i.kind) for i in find_leftovers(root)} == want | damaged
    before = _snapshot(root)
    reads = {engine: _read(root, engine) for engine in ("zarr", "gds-zarr")}
    assert isinstance(reads["zarr"], xr.Dataset) == case.opens
    # a dry run, the default, changes nothing
    assert {(i.path, i.kind) for i in tidy(root, trust_consolidated=trust)} == want
    argv = ["tidy", str(root), *(["--trust-consolidated"] if trust else [])]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _snapshot(root) == before and (root / "scratch").is_dir() == (name == "user-files")
    assert f"{len(want)} leftover(s) would be removed or put back (dry run)" in out
    for path in case.damaged:
        assert f"kept  {DAMAGED:17} {path}  (" in out
    # deleting removes the killed writes' files and nothing else
    acted = tidy(root, dry_run=False, trust_consolidated=trust)
    assert {(i.path, i.kind) for i in acted} == want
    assert _snapshot(root) == {k: v for k, v in before.items() if k not in gone}
    assert not (root / LOCK_NAME).exists()
    assert (root / "scratch").is_dir() == (name == "user-files")
    assert {(i.path, i.kind) for i in find_leftovers(root, trust_consolidated=True)} == damaged
    for engine, values in reads.items():
        _same(_read(root, engine), values)


def test_the_reported_store_keeps_its_array(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A consolidated v3 store whose t2m/zarr.json has a NUL byte appended: the command
    line lists t2m as damaged, ``--delete`` keeps every chunk, and t2m reads its values
    (not the fill value)."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    _append(root / "t2m" / "zarr.json", b"\0")
    before = _snapshot(root)
    assert main(["tidy", str(root), "--delete"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "0 leftover(s) removed or put back",
        f"kept  {Leftover('t2m/zarr.json', DAMAGED, 'does not parse as a Zarr document')}",
        "1 damaged document(s) kept, with all of their nodes: a killed xarray-gds write "
        "leaves none; repair them or rewrite those arrays",
    ]
    assert _snapshot(root) == before
    with xr.open_dataset(root, engine="zarr") as ds:
        xr.testing.assert_identical(ds.t2m.load(), _dataset().t2m)


@pytest.mark.parametrize("fmt", [2, 3])
def test_trust_removes_only_the_engine_files_of_unlisted_nodes(tmp_path: Path, fmt: int) -> None:
    """Trusting the consolidated metadata removes the documents and chunks of the nodes
    it does not list (a group, its array, a new array's chunks in it), and keeps the
    user's files in them and damaged nodes (one in that group, one beside it) whole;
    without trust nothing of them goes, only a new array's chunks beside them."""
    root = tmp_path / "s.zarr"
    _write(root, fmt, True)
    group = zarr.create_group(root / "grp", zarr_format=fmt)
    for name in ("ok", "bad"):
        array = group.create_array(name, shape=(3,), chunks=(1,), dtype="i4")
        array[:] = [1, 2, 3]
    _append(root / "grp" / "bad" / _doc(fmt), b"\0")
    bad = zarr.create_array(root / "bad", shape=(2,), chunks=(1,), dtype="i4", zarr_format=fmt)
    bad[:] = [4, 5]
    _append(root / "bad" / _doc(fmt), b"\0")
    (root / "grp" / "ok" / "README.txt").write_bytes(b"mine")
    (root / "grp" / "c.partial").write_bytes(b"mine")
    engine = {"grp/ok/" + k for k in (_doc(fmt), _chunk(fmt, 0), _chunk(fmt, 1), _chunk(fmt, 2))}
    engine.add("grp/zarr.json" if fmt == 3 else "grp/.zgroup")
    if fmt == 2:
        engine |= {"grp/.zattrs", "grp/ok/.zattrs"}
    new = f"grpx/{_chunk(fmt, 0)}"  # a new array's chunk, named like grp
    for rel in (new, f"grp/new/{_chunk(fmt, 0)}", f"grp/ok/{_chunk(fmt, 5)}"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"a chunk")
    engine |= {f"grp/new/{_chunk(fmt, 0)}", f"grp/ok/{_chunk(fmt, 5)}"}
    before = _snapshot(root)
    assert engine < set(before)
    acted = tidy(root, dry_run=False)
    assert [(i.path, i.kind) for i in acted] == [("grpx", "unpublished-node")]
    del before[new]
    assert _snapshot(root) == before
    acted = tidy(root, dry_run=False, trust_consolidated=True)
    assert [(i.path, i.kind) for i in acted] == [("grp", "unconsolidated-node")]
    assert _snapshot(root) == {k: v for k, v in before.items() if k not in engine}
    # grp has no document left: what stays below it is no node, and no leftover
    assert find_leftovers(root, trust_consolidated=True) == [
        Leftover(f"bad/{_doc(fmt)}", DAMAGED, "does not parse as a Zarr document")
    ]


@pytest.mark.parametrize("fmt", [2, 3])
def test_documents_ahead_keep_their_chunks_unless_trusted(tmp_path: Path, fmt: int) -> None:
    """An append whose consolidated metadata was not written (as a killed write or one
    made without consolidating leaves it): the chunks past the consolidated shape are
    inside the arrays' own documents, so they stay without trust (the documents are
    listed as ahead, kept); trusting the consolidated metadata puts it back and removes
    them. Readers of the consolidated metadata read the same throughout."""
    root = tmp_path / "s.zarr"
    _write(root, fmt, True)
    listing = root / ("zarr.json" if fmt == 3 else ".zmetadata")
    old = listing.read_bytes()
    xarray_gds.to_zarr(_dataset().assign_coords(time=np.arange(3, 6)), root, append_dim="time")
    listing.write_bytes(old)
    reads = _read(root, "zarr")
    assert isinstance(reads, xr.Dataset) and reads.sizes["time"] == 3
    before = _snapshot(root)
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before
    added = {
        f"{name}/{_chunk(fmt, t, y, x)}"
        for name in ("t2m", "sp")
        for t in (3, 4, 5)
        for y in (0, 1)
        for x in (0, 1)
    }
    ahead = {(f"{name}/{_doc(fmt)}", "metadata-ahead") for name in ("t2m", "sp", "time")}
    found = {(i.path, i.kind) for i in tidy(root, dry_run=False, trust_consolidated=True)}
    assert found - ahead == {(k, "orphan-chunk") for k in added} | {
        (f"time/{_chunk(fmt, 1)}", "orphan-chunk")
    }
    assert ahead <= found
    assert added < set(before) and not added & set(_snapshot(root))
    _same(_read(root, "zarr"), reads)
    _same(xr.open_dataset(root, engine="zarr", consolidated=False).load(), reads)


@pytest.mark.parametrize("fmt", [2, 3])
def test_nested_groups_are_not_ahead_of_the_consolidated_metadata(tmp_path: Path, fmt: int) -> None:
    """zarr's consolidated metadata gives a group's entry a consolidated listing its own
    document does not hold: that is no difference, and trusting tidy rewrites nothing."""
    root = tmp_path / "s.zarr"
    xarray_gds.to_zarr(_dataset(), root, group="g", zarr_format=fmt)
    zarr.consolidate_metadata(root, zarr_format=fmt)
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False, trust_consolidated=True) == []
    assert _snapshot(root) == before
    # g consolidated too, then an attribute of g/sp set without consolidating: only
    # the root's consolidated metadata is the store's state
    zarr.consolidate_metadata(root, path="g", zarr_format=fmt)
    zarr.open_array(root / "g" / "sp", mode="r+").attrs["units"] = "Pa"
    doc = "g/sp/zarr.json" if fmt == 3 else "g/sp/.zattrs"
    assert [(i.path, i.kind) for i in find_leftovers(root)] == [(doc, "metadata-ahead")]


@pytest.mark.parametrize("fmt", [2, 3])
def test_root_array_leftovers(tmp_path: Path, fmt: int) -> None:
    """A store that is one array (its document in the root) is a store: a chunk past
    its end and a temporary file go, a user's file stays."""
    root = tmp_path / "a.zarr"
    array = zarr.create_array(root, shape=(4,), chunks=(2,), dtype="f4", zarr_format=fmt)
    array[:] = [1, 2, 3, 4]
    (root / (_chunk(fmt, 2))).parent.mkdir(parents=True, exist_ok=True)
    (root / _chunk(fmt, 2)).write_bytes((root / _chunk(fmt, 0)).read_bytes())
    (root / _temp("0")).write_bytes(b"half")
    (root / "notes.txt").write_bytes(b"mine")
    before = _snapshot(root)
    want = [(_temp("0"), "partial-file"), (_chunk(fmt, 2), "orphan-chunk")]
    assert [(i.path, i.kind) for i in tidy(root, dry_run=False)] == want
    assert _snapshot(root) == {k: v for k, v in before.items() if k not in dict(want)}
    np.testing.assert_array_equal(zarr.open_array(root, mode="r")[:], [1, 2, 3, 4])


def _not_a_store(root: Path) -> dict[str, bytes]:
    for rel in ("notes.partial", f"{_temp('0')}", "data/0.0", "data/c/0/0", "a/.zattrs"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"the user's")
    return _snapshot(root)


def test_a_directory_that_is_not_a_store_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No zarr.json, .zgroup, .zarray or .zmetadata in its root: the function raises,
    the command line says so in one line and exits 1; nothing is removed or made, not
    even the engine-named temporary file."""
    root = tmp_path / "mine"
    before = _not_a_store(root)
    message = (
        f"'{root}' is not a Zarr store: it is not a directory holding zarr.json (Zarr v3) "
        "or .zgroup/.zarray/.zmetadata (Zarr v2); nothing was removed"
    )
    for dry_run in (True, False):
        with pytest.raises(ValueError) as info:
            tidy(root, dry_run=dry_run)
        assert str(info.value) == message
        with pytest.raises(ValueError):
            find_leftovers(root)
    assert main(["tidy", str(root), "--delete"]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"xarray-gds tidy: error: {message}\n" and captured.out == ""
    assert _snapshot(root) == before
    (root / "file").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a Zarr store"):
        tidy(root / "file")


def test_a_missing_path_is_named_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.zarr"
    with pytest.raises(FileNotFoundError):
        tidy(missing, dry_run=False)
    assert main(["tidy", str(missing)]) == 1
    assert capsys.readouterr().err == f"xarray-gds tidy: error: No such Zarr store: '{missing}'\n"
    assert not missing.exists()


def test_deleting_asks_for_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line lists unless ``--delete``; ``-n``/``--dry-run`` is the default
    said aloud and cannot be given with ``--delete``; the help says so."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    (root / _temp("zarr.json")).write_bytes(b"half")
    before = _snapshot(root)
    for argv in ([], ["-n"], ["--dry-run"], ["--trust-consolidated"]):
        assert main(["tidy", str(root), *argv]) == 0
        assert capsys.readouterr().out.splitlines() == [
            f"partial-file      {_temp('zarr.json')}  "
            "(a file being written when the writer stopped)",
            "1 leftover(s) would be removed or put back (dry run)",
            "run again with --delete to remove them",
        ]
        assert _snapshot(root) == before
    assert main(["tidy", str(root), "--delete", "-n"]) == 2
    assert _snapshot(root) == before
    assert main(["tidy", str(root), "--delete"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 leftover(s) removed or put back"
    assert set(_snapshot(root)) == set(before) - {_temp("zarr.json")}
    assert main(["tidy", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Nothing changes unless --delete is given" in text
    assert "--delete remove what is listed" in text


def test_the_engine_names_its_temporary_files_so(tmp_path: Path, monkeypatch: Any) -> None:
    """A write stopped before its rename leaves the file ``write_file`` made, hidden
    beside its target: tidy finds exactly it, and removes it."""
    root = tmp_path / "s.zarr"
    _write(root, 3, False)
    name = temporary_name(str(root / "t2m" / "c" / "0" / "0" / "0"))
    assert os.path.dirname(name) == str(root / "t2m" / "c" / "0" / "0")
    assert TEMPORARY.fullmatch(os.path.basename(name))
    assert os.path.basename(name).startswith(".0.xarray-gds-")
    before = _snapshot(root)
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", lambda src, dst: None)  # the rename never happens
        write_file(str(root / "t2m" / "c" / "9" / "0" / "0"), b"chunk")
    (left,) = set(_snapshot(root)) - set(before)
    assert left.startswith("t2m/c/9/0/.0.xarray-gds-")
    assert [(i.path, i.kind) for i in tidy(root, dry_run=False)] == [(left, "partial-file")]
    assert _snapshot(root) == before and not (root / "t2m" / "c" / "9").exists()


def test_only_deleting_waits_for_a_writer(tmp_path: Path) -> None:
    """A dry run lists while a write holds the store's lock; deleting waits for the
    lock and, when it does not come, removes nothing."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    (root / _temp("zarr.json")).write_bytes(b"half")
    before = _snapshot(root)
    writer = HeldMetadataStore(GdsStore(root, read_only=False))  # a write in progress
    try:
        assert [i.path for i in tidy(root, lock_timeout=0.05)] == [_temp("zarr.json")]
        with pytest.raises(TimeoutError):
            tidy(root, dry_run=False, lock_timeout=0.05)
        assert set(_snapshot(root)) - {LOCK_NAME} == set(before)
    finally:
        writer.discard()
    assert [i.path for i in tidy(root, dry_run=False)] == [_temp("zarr.json")]
    assert set(_snapshot(root)) == set(before) - {_temp("zarr.json")}


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_grid_tidy_does_not_know_keeps_its_chunks(tmp_path: Path, fmt: int) -> None:
    """An array whose own document gives a chunk grid tidy does not read: chunks past
    the consolidated shape may be inside it, and stay."""
    root = tmp_path / "s.zarr"
    _write(root, fmt, True)
    doc = json.loads((root / "sp" / _doc(fmt)).read_text())
    if fmt == 3:
        doc["chunk_grid"]["name"] = "rectilinear"
    else:
        doc["chunks"] = "auto"
    (root / "sp" / _doc(fmt)).write_text(json.dumps(doc))
    orphan = f"sp/{_chunk(fmt, 5, 0, 0)}"
    (root / orphan).parent.mkdir(parents=True, exist_ok=True)
    (root / orphan).write_bytes(b"a chunk")
    before = _snapshot(root)
    assert [(i.path, i.kind) for i in find_leftovers(root)] == [
        (f"sp/{_doc(fmt)}", "metadata-ahead")
    ]
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_group_listing_of_its_own_keeps_its_nodes(tmp_path: Path, fmt: int) -> None:
    """Only group g is consolidated, and the document of g/sp is deleted: g's listing
    still names g/sp, so its chunks stay and it is listed as damaged."""
    root = tmp_path / "s.zarr"
    xarray_gds.to_zarr(_dataset(), root, group="g", zarr_format=fmt, consolidated=False)
    zarr.consolidate_metadata(root, path="g", zarr_format=fmt)
    (root / "g" / "sp" / _doc(fmt)).unlink()
    before = _snapshot(root)
    with xr.open_dataset(root, engine="zarr", group="g") as ds:
        reads = ds.load()
    assert ("sp" in reads) == (fmt == 3)  # zarr reads g's v3 listing, not its .zmetadata
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before
    assert [(i.path, i.kind) for i in find_leftovers(root)] == [(f"g/sp/{_doc(fmt)}", DAMAGED)]
    with xr.open_dataset(root, engine="zarr", group="g") as ds:
        xr.testing.assert_identical(ds.load(), reads)


@pytest.mark.parametrize("fmt", [2, 3])
def test_chunks_inside_the_consolidated_shape_stay(tmp_path: Path, fmt: int) -> None:
    """An array's own document says it is shorter than its consolidated metadata does:
    the chunks past the document's end are read through the consolidated metadata
    (xarray's default) and stay, trusted or not; trusted, it puts the document back."""
    root = tmp_path / "s.zarr"
    _write(root, fmt, True)
    doc = json.loads((root / "t2m" / _doc(fmt)).read_text())
    doc["shape"][0] = 2
    (root / "t2m" / _doc(fmt)).write_text(json.dumps(doc))
    before = _snapshot(root)
    reads = _read(root, "zarr")
    assert isinstance(reads, xr.Dataset) and reads.sizes["time"] == 3
    ahead = [(f"t2m/{_doc(fmt)}", "metadata-ahead")]
    assert [(i.path, i.kind) for i in find_leftovers(root)] == ahead
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before
    assert [(i.path, i.kind) for i in tidy(root, dry_run=False, trust_consolidated=True)] == ahead
    assert set(_snapshot(root)) == set(before)
    _same(_read(root, "zarr"), reads)


def test_leftovers_are_listed_in_path_order(tmp_path: Path) -> None:
    """Whatever order the file system lists directories and files in."""
    root = tmp_path / "store.zarr"
    _write(root, 3, True)
    made = []
    for name in ("t2m", "sp"):
        for i, j in [(2, 1), (0, 1), (1, 0), (2, 0), (0, 0), (1, 1)]:
            for last in (5, 0, 7, 2, 4, 1, 6, 3):
                path = f"{name}/c/{i}/{j}/{_temp(str(last))}"
                (root / path).write_bytes(b"partial")
                made.append(path)
    found = [item.path for item in find_leftovers(root)]
    assert found == sorted(made)


def test_a_node_whose_name_sorts_before_a_dot(tmp_path: Path) -> None:
    """A variable named "+anomaly" (its directory's name sorts before ".") is a node
    like any other, not taken for the store's root."""
    root = tmp_path / "store.zarr"
    ds = _dataset().rename({"t2m": "+anomaly"})
    xarray_gds.to_zarr(ds, root, zarr_format=3, consolidated=True)
    assert find_leftovers(root) == []
    (root / "+anomaly" / _temp("zarr.json")).write_bytes(b"{")
    assert [item.path for item in find_leftovers(root)] == [f"+anomaly/{_temp('zarr.json')}"]


def test_a_store_under_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    _write(tmp_path / "store.zarr", 3, True)
    (tmp_path / "store.zarr" / _temp("zarr.json")).write_bytes(b"{")
    assert [item.kind for item in tidy("~/store.zarr")] == ["partial-file"]


@pytest.mark.parametrize("zarr_format", [2, 4])
def test_a_v3_document_of_another_format_is_damaged(tmp_path: Path, zarr_format: int) -> None:
    root = tmp_path / "store.zarr"
    _write(root, 3, False)
    doc = json.loads((root / "t2m/zarr.json").read_text())
    doc["zarr_format"] = zarr_format
    (root / "t2m/zarr.json").write_text(json.dumps(doc))
    assert find_leftovers(root) == [
        Leftover("t2m/zarr.json", DAMAGED, "does not parse as a Zarr document")
    ]


def test_a_v2_directory_both_array_and_group_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "store.zarr"
    _write(root, 2, False)
    (root / "t2m/.zgroup").write_text('{"zarr_format": 2}')
    before = _snapshot(root)
    assert find_leftovers(root) == [
        Leftover("t2m/.zgroup", DAMAGED, "does not parse as a Zarr document")
    ]
    tidy(root, dry_run=False)
    assert _snapshot(root) == before


def test_a_v2_root_without_its_group_document(tmp_path: Path) -> None:
    """A .zmetadata without the root's .zgroup: the root is damaged, only the engine's
    temporary files go."""
    root = tmp_path / "store.zarr"
    _write(root, 2, True)
    (root / ".zgroup").unlink()
    (root / "t2m" / _temp("0.0.0")).write_bytes(b"partial")
    before = _snapshot(root)
    assert find_leftovers(root) == [
        Leftover(
            f"t2m/{_temp('0.0.0')}", "partial-file", "a file being written when the writer stopped"
        ),
        Leftover(".zgroup", DAMAGED, "missing beside .zmetadata"),
    ]
    tidy(root, dry_run=False)
    del before[f"t2m/{_temp('0.0.0')}"]
    assert _snapshot(root) == before


def test_damaged_nodes_are_listed_in_path_order(tmp_path: Path) -> None:
    root = tmp_path / "store.zarr"
    _write(root, 3, False)
    for name in ("sp", "t2m", "x"):
        (root / name / "zarr.json").write_bytes(b"{")
    assert find_leftovers(root) == [
        Leftover(f"{name}/zarr.json", DAMAGED, "does not parse as a Zarr document")
        for name in ("sp", "t2m", "x")
    ]


def test_the_command_line_on_a_node_the_consolidated_metadata_does_not_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Someone added an array without consolidating: kept and said why, unless the
    consolidated metadata is trusted; a damaged document is counted apart."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    zarr.open_group(root, mode="a", use_consolidated=False).create_array(
        "new", shape=(2,), dtype="f4"
    )
    assert main(["tidy", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "0 leftover(s) would be removed or put back (dry run)",
        "kept  unconsolidated-node new  (not in the consolidated metadata)",
    ]
    assert out[2].startswith("1 difference(s) from the consolidated metadata kept: if only ")
    assert len(out) == 3
    assert main(["tidy", str(root), "--trust-consolidated"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "unconsolidated-node new  (not in the consolidated metadata)",
        "1 leftover(s) would be removed or put back (dry run)",
        "run again with --delete to remove them",
    ]
    (root / "sp" / "zarr.json").write_bytes(b"{")
    assert main(["tidy", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:3] == [
        "kept  damaged           sp/zarr.json  (does not parse as a Zarr document)",
        "kept  unconsolidated-node new  (not in the consolidated metadata)",
    ]
    assert out[3].startswith("1 difference(s) from the consolidated metadata kept")
    assert out[4].startswith("1 damaged document(s) kept, with all of their nodes: ")
    (root / "t2m" / "zarr.json").write_bytes(b"{")
    assert main(["tidy", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("2 damaged document(s) kept, with all of their nodes: ")

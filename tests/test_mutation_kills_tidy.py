"""Tests written for mutants of ``xarray_gds/tidy.py`` that survived the quick stage of
``scripts/mutation-run.py``: each test names the mutation it stops, and checks what a
user sees: the leftovers ``find_leftovers`` and ``tidy`` report (paths, kinds, order,
details), the files ``tidy`` removes, keeps or writes, and the values engine="zarr"
reads back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
from tests.test_tidy import _chunk, _dataset, _doc, _snapshot, _temp, _write
from xarray_gds.tidy import DAMAGED, TRUSTING, Leftover, find_leftovers, tidy

pytestmark = [
    pytest.mark.filterwarnings("ignore::xarray_gds.XarrayGdsWarning"),
    pytest.mark.filterwarnings("ignore:Object at .* is not recognized:UserWarning"),
    pytest.mark.filterwarnings("ignore::xarray.SerializationWarning"),
    pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part"),
]

AHEAD = "differs from the consolidated metadata"


def _put(root: Path, rel: str, data: bytes = b"a chunk") -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)


def _edit(path: Path, change: Any) -> None:
    """Rewrite the JSON document ``path`` as ``change(doc)`` leaves it."""
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _zarr(root: Path, **kwargs: Any) -> xr.Dataset:
    with xr.open_dataset(root, engine="zarr", **kwargs) as ds:
        return ds.load()


def _one_array(root: Path, encoding: dict[str, Any] | None = None) -> np.ndarray:
    """A v3 group holding array ``a`` (2 x 4, chunks 1 x 2), never consolidated."""
    group = zarr.open_group(root, mode="w", zarr_format=3)
    kwargs: dict[str, Any] = {"chunk_key_encoding": encoding} if encoding else {}
    array = group.create_array("a", shape=(2, 4), chunks=(1, 2), dtype="i4", **kwargs)
    values = np.arange(8, dtype="i4").reshape(2, 4)
    array[:] = values
    return values


def test_trusting_kinds_are_an_immutable_set() -> None:
    """TRUSTING a mutable set (the ``frozenset()`` call removed)."""
    assert isinstance(TRUSTING, frozenset)
    assert frozenset({"unconsolidated-node", "metadata-ahead"}) == TRUSTING


def test_find_leftovers_takes_trust_by_keyword_only(tmp_path: Path) -> None:
    """find_leftovers' ``*`` -> ``/`` (root positional-only, trust positional)."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    with pytest.raises(TypeError):
        find_leftovers(root, True)  # type: ignore[misc]
    assert find_leftovers(root=root, trust_consolidated=True) == []


def test_the_partial_last_chunk_of_an_array_stays(tmp_path: Path) -> None:
    """The grid counted with ``//`` instead of ``/`` (a partial last chunk taken for
    one outside the shape): time has 5 steps in chunks of 2, its third chunk (holding
    step 4) stays and reads back; only the chunk past it goes."""
    root = tmp_path / "s.zarr"
    ds = _dataset().isel(y=0, x=0).drop_vars(["y", "x"])
    ds = xr.concat([ds, ds.isel(time=slice(0, 2))], "time").assign_coords(time=np.arange(5))
    xarray_gds.to_zarr(ds, root, zarr_format=3, encoding={"t2m": {"chunks": (2,)}})
    _put(root, "t2m/c/3", (root / "t2m" / "c" / "0").read_bytes())
    before = _snapshot(root)
    assert "t2m/c/2" in before
    want = [Leftover("t2m/c/3", "orphan-chunk", "outside the shape of t2m")]
    assert find_leftovers(root) == want
    assert tidy(root, dry_run=False) == want
    assert _snapshot(root) == {k: v for k, v in before.items() if k != "t2m/c/3"}
    xr.testing.assert_identical(_zarr(root), ds)


@pytest.mark.parametrize("fmt", [2, 3])
def test_orphan_details_name_their_array(tmp_path: Path, fmt: int) -> None:
    """The detail ``node or '/'`` -> ``node and '/'``: a chunk past the end of sp is
    "outside the shape of sp", one past a root array's end "outside the shape of /"."""
    root = tmp_path / "s.zarr"
    _write(root, fmt, True)
    _put(root, f"sp/{_chunk(fmt, 5, 0, 0)}")
    assert find_leftovers(root) == [
        Leftover(f"sp/{_chunk(fmt, 5, 0, 0)}", "orphan-chunk", "outside the shape of sp")
    ]
    single = tmp_path / "a.zarr"
    zarr.create_array(single, shape=(2,), chunks=(1,), dtype="i4", zarr_format=fmt)[:] = [1, 2]
    _put(single, _chunk(fmt, 2))
    assert tidy(single) == [Leftover(_chunk(fmt, 2), "orphan-chunk", "outside the shape of /")]


@pytest.mark.parametrize("fmt", [2, 3])
def test_a_damaged_array_keeps_its_chunks_past_the_consolidated_shape(
    tmp_path: Path, fmt: int
) -> None:
    """Orphans looked for in nodes of kind ``>= "array"`` (damaged nodes and groups too):
    t2m's document does not parse, so its chunk past the consolidated shape stays, even
    when the consolidated metadata is trusted."""
    root = tmp_path / "s.zarr"
    _write(root, fmt, True)
    doc = root / "t2m" / _doc(fmt)
    doc.write_bytes(doc.read_bytes() + b"\0")
    _put(root, f"t2m/{_chunk(fmt, 5, 0, 0)}")
    before = _snapshot(root)
    damaged = [Leftover(f"t2m/{_doc(fmt)}", DAMAGED, "does not parse as a Zarr document")]
    assert find_leftovers(root) == damaged
    assert find_leftovers(root, trust_consolidated=True) == damaged
    assert tidy(root, dry_run=False, trust_consolidated=True) == []
    assert _snapshot(root) == before


def test_orphans_of_several_arrays_are_listed_in_path_order(tmp_path: Path) -> None:
    """The arrays looked at in the survey's order (``sorted`` removed): orphans of sp
    come before those of t2m, as their paths sort."""
    root = tmp_path / "s.zarr"
    _write(root, 3, False)
    for name in ("t2m", "sp"):
        _put(root, f"{name}/c/5/0/0")
    assert [i.path for i in find_leftovers(root)] == ["sp/c/5/0/0", "t2m/c/5/0/0"]


def test_unconsolidated_nodes_are_listed_in_path_order(tmp_path: Path) -> None:
    """The nodes looked at in the survey's order (``sorted`` removed): two arrays added
    without consolidating are listed as their paths sort."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    group = zarr.open_group(root, mode="a", use_consolidated=False)
    for name in ("new_a", "new_b"):
        group.create_array(name, shape=(2,), dtype="f4")
    assert [(i.path, i.kind) for i in find_leftovers(root)] == [
        ("new_a", "unconsolidated-node"),
        ("new_b", "unconsolidated-node"),
    ]


def test_documents_ahead_are_listed_in_path_order(tmp_path: Path) -> None:
    """The consolidated entries looked at in their listing's order (``sorted``
    removed): a listing that names t2m before sp still gives sp's document first."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)

    def reverse(doc: dict[str, Any]) -> None:
        entries = doc["consolidated_metadata"]["metadata"]
        doc["consolidated_metadata"]["metadata"] = dict(reversed(list(entries.items())))

    _edit(root / "zarr.json", reverse)
    for name in ("sp", "t2m"):
        _edit(root / name / "zarr.json", lambda doc: doc["attributes"].update(units="K"))
    assert find_leftovers(root) == [
        Leftover("sp/zarr.json", "metadata-ahead", AHEAD),
        Leftover("t2m/zarr.json", "metadata-ahead", AHEAD),
    ]


def test_a_damaged_node_does_not_hide_documents_ahead_after_it(tmp_path: Path) -> None:
    """``continue`` -> ``break`` when a consolidated entry's node is damaged: t2m's
    document, ahead of the consolidated metadata, is still listed after damaged sp."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    (root / "sp" / "zarr.json").write_bytes(b"{")
    _edit(root / "t2m" / "zarr.json", lambda doc: doc["attributes"].update(units="K"))
    assert find_leftovers(root) == [
        Leftover("sp/zarr.json", DAMAGED, "does not parse as a Zarr document"),
        Leftover("t2m/zarr.json", "metadata-ahead", AHEAD),
    ]


def test_a_group_document_ahead_is_put_back_without_its_listing(tmp_path: Path) -> None:
    """Documents ahead looked for only in nodes of kind ``< "damaged"`` (groups
    skipped), the group's entry put back whole (``_own()`` removed, with the empty
    listing zarr gives it) and documents written with another ``indent``: group g's
    attribute set without consolidating is listed, and trusted tidy writes g's entry
    back as the engine writes documents, so g/a still reads."""
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    array = group.create_group("g").create_array(
        "a", shape=(2,), chunks=(1,), dtype="i4", dimension_names=["n"]
    )
    array[:] = [1, 2]
    zarr.consolidate_metadata(root)
    reads = _zarr(root, group="g")
    entry = json.loads((root / "zarr.json").read_text())["consolidated_metadata"]["metadata"]["g"]
    zarr.open_group(root / "g", mode="r+", use_consolidated=False).attrs["title"] = "new"
    want = [Leftover("g/zarr.json", "metadata-ahead", AHEAD)]
    assert find_leftovers(root) == want
    assert tidy(root, dry_run=False) == []
    assert tidy(root, dry_run=False, trust_consolidated=True) == want
    del entry["consolidated_metadata"]
    assert (root / "g" / "zarr.json").read_text() == json.dumps(entry, indent=2)
    xr.testing.assert_identical(_zarr(root, group="g"), reads)
    xr.testing.assert_identical(_zarr(root, group="g", consolidated=False), reads)


def test_a_missing_attributes_document_the_listing_holds_is_ahead(tmp_path: Path) -> None:
    """``isinstance(doc, dict) and`` -> ``or`` (a document that cannot be read made
    tidy fail): t2m/.zattrs, deleted while .zmetadata lists it, is listed as ahead and,
    trusted, written back (indented as the engine writes) with t2m's attributes."""
    root = tmp_path / "s.zarr"
    _write(root, 2, True)
    reads = _zarr(root, consolidated=False)
    entry = json.loads((root / ".zmetadata").read_text())["metadata"]["t2m/.zattrs"]
    (root / "t2m" / ".zattrs").unlink()
    want = [Leftover("t2m/.zattrs", "metadata-ahead", AHEAD)]
    assert find_leftovers(root) == want
    assert tidy(root, dry_run=False, trust_consolidated=True) == want
    assert (root / "t2m" / ".zattrs").read_text() == json.dumps(entry, indent=2)
    xr.testing.assert_identical(_zarr(root, consolidated=False), reads)


@pytest.mark.parametrize("node_type", ["Array", "table"])
def test_a_consolidated_entry_that_is_no_array_keeps_the_chunks(
    tmp_path: Path, node_type: str
) -> None:
    """The consolidated entry's ``node_type != "array"`` as ``>``, ``<`` or ``is not``
    (an entry of another node type read for a grid): t2m's entry names another node
    type, so its chunk past both shapes stays; only its document is listed."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)

    def retype(doc: dict[str, Any]) -> None:
        doc["consolidated_metadata"]["metadata"]["t2m"]["node_type"] = node_type

    _edit(root / "zarr.json", retype)
    _put(root, "t2m/c/5/0/0")
    before = _snapshot(root)
    assert find_leftovers(root) == [Leftover("t2m/zarr.json", "metadata-ahead", AHEAD)]
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_a_chunk_grid_named_after_regular_keeps_the_chunks(tmp_path: Path) -> None:
    """The grid's ``name != "regular"`` as ``<`` (an unknown grid whose name sorts after
    "regular" read as regular): sp's own grid is "varying", so its chunk past the
    consolidated shape may be inside it, and stays."""
    root = tmp_path / "s.zarr"
    _write(root, 3, True)
    _edit(root / "sp" / "zarr.json", lambda doc: doc["chunk_grid"].update(name="varying"))
    _put(root, "sp/c/5/0/0")
    before = _snapshot(root)
    assert find_leftovers(root) == [Leftover("sp/zarr.json", "metadata-ahead", AHEAD)]
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


@pytest.mark.parametrize(
    ("encoding", "orphan"),
    [
        ({"name": "default"}, "c/2/0"),
        ({"name": "default", "configuration": {"separator": "."}}, "c.2.0"),
        ({"name": "v2"}, "2.0"),
        ({"name": "v2", "configuration": {"separator": "/"}}, "2/0"),
    ],
    ids=["default", "default-dot", "v2", "v2-slash"],
)
def test_chunk_keys_of_every_encoding_and_its_default_separator(
    tmp_path: Path, encoding: dict[str, Any], orphan: str
) -> None:
    """The encoding's configuration read as ``or {}`` -> ``and {}`` and its default
    separator swapped (``not prefixed``): a chunk past the end of an array whose chunk
    key encoding is written with or without its configuration (the v3 spec's defaults:
    "/" for "default", "." for "v2") is found and removed; the values read the same."""
    root = tmp_path / "s.zarr"
    values = _one_array(root, encoding)
    _edit(root / "a" / "zarr.json", lambda doc: doc.update(chunk_key_encoding=encoding))
    np.testing.assert_array_equal(zarr.open_array(root / "a", mode="r")[:], values)
    first = orphan.replace("2", "0")
    assert (root / "a" / first).is_file()
    _put(root, f"a/{orphan}", (root / "a" / first).read_bytes())
    want = [Leftover(f"a/{orphan}", "orphan-chunk", "outside the shape of a")]
    assert find_leftovers(root) == want
    assert tidy(root, dry_run=False) == want
    assert not (root / "a" / orphan).exists()
    np.testing.assert_array_equal(zarr.open_array(root / "a", mode="r")[:], values)


def test_an_unknown_chunk_key_encoding_keeps_default_named_files(tmp_path: Path) -> None:
    """The encoding's ``name == "default"`` as ``<=`` (a name sorting before "default"
    read as the default encoding): files named as default-encoded chunks past the end
    of an array whose encoding is "custom" stay."""
    root = tmp_path / "s.zarr"
    _one_array(root)
    _edit(root / "a" / "zarr.json", lambda doc: doc.update(chunk_key_encoding={"name": "custom"}))
    _put(root, "a/c/5/0")
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_a_user_directory_below_an_array_is_no_chunk(tmp_path: Path) -> None:
    """``return None`` -> ``pass`` for keys not below the "c" prefix (their first two
    characters cut off): t2m/x/5/0/0, a user's file below the array, is kept."""
    root = tmp_path / "s.zarr"
    _write(root, 3, False)
    _put(root, "t2m/x/5/0/0", b"mine")
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_keys_of_another_rank_are_no_chunks(tmp_path: Path) -> None:
    """The key's ``len(parts) != len(grid)`` as ``>`` or ``<``: files named as chunk
    keys of two and of four indices past the end of the 3-d t2m are kept."""
    root = tmp_path / "s.zarr"
    _write(root, 3, False)
    for rel in ("t2m/c/5/1", "t2m/c/6/0/0/0"):
        _put(root, rel, b"mine")
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_an_array_of_more_than_256_dimensions(tmp_path: Path) -> None:
    """The key's ``len(parts) != len(grid)`` as ``is not`` (the same length, past the
    integers CPython caches, taken for another): a chunk past the end of a 257-d array
    (the v3 spec sets no bound on the rank) is found."""
    root = tmp_path / "a.zarr"
    root.mkdir()
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [1] * 257,
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1] * 257}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes"}],
        "attributes": {},
    }
    (root / "zarr.json").write_text(json.dumps(doc))
    inside, outside = "c" + "/0" * 257, "c/1" + "/0" * 256
    for rel in (inside, outside):
        _put(root, rel, b"\1")
    assert find_leftovers(root) == [Leftover(outside, "orphan-chunk", "outside the shape of /")]


def test_a_chunk_length_of_zero_does_not_fail_tidy(tmp_path: Path) -> None:
    """``max(1, ...)`` -> ``max(0, ...)`` (a division by zero): an array document giving
    a chunk length of 0 is read without error, and nothing is listed or removed."""
    root = tmp_path / "s.zarr"
    _write(root, 2, False)
    _edit(root / "sp" / ".zarray", lambda doc: doc.update(chunks=[0, 0, 0]))
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


@pytest.mark.parametrize("chunks", [[1, 2], [1, 2, 4, 1]])
def test_chunks_and_shape_of_different_lengths_keep_the_chunks(
    tmp_path: Path, chunks: list[int]
) -> None:
    """``zip(..., strict=True)`` -> ``strict=False`` or no ``strict`` (a grid cut to the
    shorter of shape and chunks): t2m's document gives 3 lengths and 2 or 4 chunk
    lengths, so no grid is known and files named as chunks past its end stay."""
    root = tmp_path / "s.zarr"
    _write(root, 3, False)

    def rechunk(doc: dict[str, Any]) -> None:
        doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks

    _edit(root / "t2m" / "zarr.json", rechunk)
    _put(root, "t2m/c/5" + "/0" * (min(len(chunks), 3) - 1), b"mine")
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_a_directory_another_process_emptied_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``continue`` -> ``pass`` after a file tidy removes is already gone: a temporary
    file that someone else removes first is not tidy's removal, and its directory,
    left empty by them, is not removed by tidy."""
    root = tmp_path / "s.zarr"
    _write(root, 3, False)
    temp = f"t2m/c/9/0/{_temp('0')}"
    _put(root, temp, b"half")
    real_unlink = os.unlink

    def raced(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path) == root / temp:
            real_unlink(path)  # the other process is first
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", raced)
    assert [i.path for i in tidy(root, dry_run=False)] == [temp]
    assert (root / "t2m" / "c" / "9" / "0").is_dir()
    assert not any((root / "t2m" / "c" / "9" / "0").iterdir())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shape", '["2", "4"]'),
        ("shape", "[2.0, 4]"),
        ("shape", "[true, 4]"),
        ("shape", "[1e400, 4]"),
        ("shape", "[-2, 4]"),
        ("shape", "[-1, 4]"),
        ("chunk_shape", '[1, "2"]'),
        ("chunk_shape", "[1, 0]"),
    ],
)
def test_an_array_document_zarr_refuses_keeps_every_chunk(
    tmp_path: Path, field: str, value: str
) -> None:
    """A shape or chunk shape that is not a list of whole numbers (strings, floats, a
    bool, a number past a float's range, a negative length, a chunk length of 0) is
    not read as a grid: a chunk that is past the end of the valid document's shape is
    kept, and nothing is listed or removed (zarr refuses such a document; tidy does not
    guess which of its chunks are outside)."""
    root = tmp_path / "s.zarr"
    _one_array(root)
    _put(root, "a/c/5/0", (root / "a" / "c" / "0" / "0").read_bytes())
    orphan = [Leftover("a/c/5/0", "orphan-chunk", "outside the shape of a")]
    assert find_leftovers(root) == orphan  # with the valid document it is a leftover
    doc = json.loads((root / "a" / "zarr.json").read_text())
    text = json.dumps(doc)
    if field == "shape":
        old = json.dumps(doc["shape"])
    else:
        old = json.dumps(doc["chunk_grid"]["configuration"]["chunk_shape"])
    assert text.count(old) == 1
    (root / "a" / "zarr.json").write_text(text.replace(old, value))
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_a_v2_array_of_float_chunk_lengths_keeps_every_chunk(tmp_path: Path) -> None:
    """Zarr v2's ``chunks`` given as floats is not read as a grid: a chunk past the end
    of the shape stays."""
    root = tmp_path / "s.zarr"
    array = zarr.open_array(root, mode="w", shape=(4,), chunks=(2,), dtype="i4", zarr_format=2)
    array[:] = np.arange(4, dtype="i4")
    _put(root, "5", (root / "0").read_bytes())
    assert find_leftovers(root) == [Leftover("5", "orphan-chunk", "outside the shape of /")]
    _edit(root / ".zarray", lambda doc: doc.update(chunks=[2.0]))
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_an_unknown_chunk_key_encoding_keeps_v2_named_files(tmp_path: Path) -> None:
    """A chunk key encoding other than "default" and "v2" is not read as "v2": a file
    named as a v2-encoded chunk past the end of the array (``a/5.0``) stays, as files
    named as default-encoded ones do."""
    root = tmp_path / "s.zarr"
    _one_array(root, {"name": "v2"})
    _put(root, "a/5.0", (root / "a" / "0.0").read_bytes())
    assert find_leftovers(root) == [Leftover("a/5.0", "orphan-chunk", "outside the shape of a")]
    _edit(root / "a" / "zarr.json", lambda doc: doc.update(chunk_key_encoding={"name": "mine"}))
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before


def test_an_empty_dimension_makes_every_chunk_a_leftover(tmp_path: Path) -> None:
    """A shape length of 0 is read as a shape (the lowest whole number a shape takes,
    where a chunk length is at least 1): every chunk key of an array of shape (0, 4) is
    outside it, and tidy removes the one a killed write left; zarr reads the array as
    before."""
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=3)
    group.create_array("a", shape=(0, 4), chunks=(1, 2), dtype="i4")
    _put(root, "a/c/0/1")
    want = [Leftover("a/c/0/1", "orphan-chunk", "outside the shape of a")]
    assert find_leftovers(root) == want
    assert tidy(root, dry_run=False) == want
    assert not (root / "a" / "c" / "0" / "1").exists()
    assert zarr.open_array(root / "a", mode="r")[:].shape == (0, 4)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_the_chunk_of_a_0d_array_stays(tmp_path: Path, zarr_format: int) -> None:
    """A 0-d array's one chunk (``c`` in Zarr v3, ``0`` in v2) is inside its empty grid:
    tidy lists nothing and keeps it, and the value reads back (the chunk taken as outside
    the grid would be removed; a file named like a chunk of another rank is no chunk)."""
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    array = group.create_array("a", shape=(), dtype="f8", fill_value=0.0)
    array[...] = 2.5
    chunk = "a/c" if zarr_format == 3 else "a/0"
    assert (root / chunk).is_file()
    _put(root, "a/1" if zarr_format == 2 else "a/x/0")
    before = _snapshot(root)
    assert find_leftovers(root) == []
    assert tidy(root, dry_run=False) == []
    assert _snapshot(root) == before
    assert zarr.open_array(root / "a", mode="r")[...] == 2.5

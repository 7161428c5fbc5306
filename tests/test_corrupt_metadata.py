"""Damaged metadata documents: a NUL byte appended, a truncated write, consolidated
metadata that does not parse.

Where ``engine="zarr"`` opens the damaged store (consolidated metadata describes the
array whose own document is damaged), ``engine="gds-zarr"`` opens it too, with the
same values. Everywhere else both fail, and ``engine="gds-zarr"`` raises
:class:`~xarray_gds.errors.MetadataError` naming the document and what is wrong with it
(zarr's ``JSONDecodeError`` names neither): through ``open_dataset``,
``open_datatree`` and ``xarray-gds info``, which prints it as one line.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
from xarray_gds import documents
from xarray_gds.errors import ConsolidatedMetadataWarning, MetadataError
from xarray_gds.tools import cli

pytestmark = pytest.mark.filterwarnings("ignore::xarray_gds.errors.ConsolidatedMetadataWarning")

#: how a document is damaged: its bytes, damaged
DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "nul": lambda raw: raw + b"\x00",
    "truncated": lambda raw: raw[: len(raw) // 2],
}


def _dataset() -> xr.Dataset:
    t2m = np.arange(12, dtype="f4").reshape(3, 4) + 270
    return xr.Dataset(
        {"t2m": (("y", "x"), t2m, {"units": "K"})},
        coords={"x": np.arange(4)},
        attrs={"title": "damaged"},
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, bool], Path]:
    """One store of each Zarr format, consolidated and not, copied before damage."""
    root = tmp_path_factory.mktemp("pristine")
    made = {}
    for zarr_format in (2, 3):
        for consolidated in (True, False):
            path = root / f"v{zarr_format}-{'c' if consolidated else 'n'}.zarr"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # zarr's v3 consolidated metadata warning
                _dataset().to_zarr(path, zarr_format=zarr_format, consolidated=consolidated)
            made[zarr_format, consolidated] = path
    return made


def _damaged(
    pristine: dict[tuple[int, bool], Path],
    tmp_path: Path,
    zarr_format: int,
    consolidated: bool,
    document: str,
    how: str,
) -> tuple[Path, bytes]:
    """A copy of the store with ``document`` damaged ``how``, and its damaged bytes."""
    path = tmp_path / "store.zarr"
    shutil.copytree(pristine[zarr_format, consolidated], path)
    raw = DAMAGE[how]((path / document).read_bytes())
    (path / document).write_bytes(raw)
    return path, raw


def _reason(how: str, raw: bytes) -> str:
    """The end of the reason MetadataError gives for a document damaged ``how``."""
    if how == "nul":
        return ": it ends with 1 NUL byte"
    return f": it ends before the JSON does (truncated after {len(raw)} bytes?)"


def _open_gds(path: Path, **kwargs: Any) -> xr.Dataset:
    return xr.open_dataset(path, engine="gds-zarr", device="cpu", **kwargs)


def _info(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["info", str(path), "--device", "cpu"])
    out, err = capsys.readouterr()
    return code, out, err


# (zarr_format, consolidated, document, how, whether engine="zarr" opens the store)
CASES = [
    (2, True, "t2m/.zarray", "nul", True),
    (2, True, "t2m/.zarray", "truncated", True),
    (2, True, "t2m/.zattrs", "truncated", True),
    (2, True, ".zgroup", "truncated", False),
    (2, True, ".zattrs", "nul", False),
    (2, True, ".zmetadata", "truncated", False),
    (2, True, ".zmetadata", "nul", False),
    (2, False, "t2m/.zarray", "nul", False),
    (2, False, "t2m/.zarray", "truncated", False),
    (2, False, "t2m/.zattrs", "truncated", False),
    (2, False, ".zgroup", "nul", False),
    (3, True, "t2m/zarr.json", "nul", True),
    (3, True, "t2m/zarr.json", "truncated", True),
    (3, True, "zarr.json", "truncated", False),
    (3, True, "zarr.json", "nul", False),
    (3, False, "t2m/zarr.json", "nul", False),
    (3, False, "t2m/zarr.json", "truncated", False),
    (3, False, "zarr.json", "truncated", False),
]
IDS = [f"v{f}-{'c' if c else 'n'}-{d}-{h}" for f, c, d, h, _ in CASES]


@pytest.mark.parametrize(
    ("zarr_format", "consolidated", "document", "how", "opens"), CASES, ids=IDS
)
def test_open_dataset_and_datatree(
    zarr_format: int,
    consolidated: bool,
    document: str,
    how: str,
    opens: bool,
    pristine: dict[tuple[int, bool], Path],
    tmp_path: Path,
) -> None:
    path, raw = _damaged(pristine, tmp_path, zarr_format, consolidated, document, how)
    if opens:  # as engine="zarr" does, from the consolidated metadata, same values
        with xr.open_dataset(path, engine="zarr") as ref, _open_gds(path) as ds:
            xr.testing.assert_identical(ds.load(), ref.load())
            xr.testing.assert_identical(ds, _dataset())
        tree = xr.open_datatree(path, engine="gds-zarr", device="cpu")
        xr.testing.assert_identical(tree.to_dataset().load(), _dataset())
        return
    with pytest.raises(ValueError):  # zarr's JSONDecodeError, as it is
        xr.open_dataset(path, engine="zarr")
    opens_here: list[Callable[[], object]] = [
        lambda: _open_gds(path),
        lambda: xr.open_datatree(path, engine="gds-zarr", device="cpu"),
        lambda: xr.open_groups(path, engine="gds-zarr", device="cpu"),
    ]
    for open_ in opens_here:
        with pytest.raises(MetadataError) as caught:
            open_()
        err = caught.value
        assert err.document == document
        assert err.store == str(xarray_gds.open_store(path))
        assert err.reason.startswith("not valid JSON (")
        assert err.reason.endswith(_reason(how, raw))
        assert str(err).startswith(f"corrupt Zarr metadata document {document!r} in {err.store}: ")
        assert isinstance(err.__cause__, json.JSONDecodeError | UnicodeDecodeError)


@pytest.mark.parametrize(
    ("zarr_format", "consolidated", "document", "how", "opens"), CASES, ids=IDS
)
def test_info(
    zarr_format: int,
    consolidated: bool,
    document: str,
    how: str,
    opens: bool,
    pristine: dict[tuple[int, bool], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, raw = _damaged(pristine, tmp_path, zarr_format, consolidated, document, how)
    code, out, err = _info(path, capsys)
    if opens:
        assert (code, err) == (0, "")
        assert "\n/t2m\n" in out
        return
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    prefix = f"xarray-gds info: error: corrupt Zarr metadata document {document!r} in "
    assert lines[0].startswith(prefix)
    assert _reason(how, raw) + "; " in lines[0]
    assert "Traceback" not in err


def test_consolidated_false_reads_the_nodes_documents(
    pristine: dict[tuple[int, bool], Path], tmp_path: Path
) -> None:
    """A damaged .zmetadata is passed over with consolidated=False, as engine="zarr"
    does; a damaged array document is then read, and named."""
    path, _ = _damaged(pristine, tmp_path, 2, True, ".zmetadata", "truncated")
    with (
        xr.open_dataset(path, engine="zarr", consolidated=False) as ref,
        _open_gds(path, consolidated=False) as ds,
    ):
        xr.testing.assert_identical(ds.load(), ref.load())
    (path / "t2m/.zarray").write_bytes((path / "t2m/.zarray").read_bytes() + b"\x00")
    with pytest.raises(MetadataError, match=r"^corrupt Zarr metadata document 't2m/\.zarray' in "):
        _open_gds(path, consolidated=False)


def test_consolidated_true_names_the_consolidated_document(
    pristine: dict[tuple[int, bool], Path], tmp_path: Path
) -> None:
    path, _ = _damaged(pristine, tmp_path, 2, True, ".zmetadata", "nul")
    with pytest.raises(MetadataError) as caught:
        _open_gds(path, consolidated=True)
    assert caught.value.document == ".zmetadata"
    assert "consolidated=False reads those instead" in str(caught.value)


def test_a_damaged_zmetadata_is_not_taken_for_none(
    pristine: dict[tuple[int, bool], Path], tmp_path: Path
) -> None:
    """No "has no consolidated metadata" warning and fallback: the error."""
    path, _ = _damaged(pristine, tmp_path, 2, True, ".zmetadata", "truncated")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConsolidatedMetadataWarning)
        with pytest.raises(MetadataError, match=r"'\.zmetadata'"):
            _open_gds(path)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_subgroup_of_a_store_with_damaged_consolidated_metadata(
    zarr_format: Literal[2, 3], tmp_path: Path
) -> None:
    """engine="zarr" reads the root's consolidated metadata for a subgroup too."""
    path = tmp_path / "store.zarr"
    ds = _dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds.to_zarr(path, zarr_format=zarr_format, consolidated=False)
        ds.to_zarr(path, group="sub", zarr_format=zarr_format, consolidated=False)
        zarr.consolidate_metadata(path, zarr_format=zarr_format)
    document = ".zmetadata" if zarr_format == 2 else "zarr.json"
    (path / document).write_bytes((path / document).read_bytes()[:-10])
    with pytest.raises(ValueError):
        xr.open_dataset(path, group="sub", engine="zarr")
    with pytest.raises(MetadataError) as caught:
        _open_gds(path, group="sub")
    assert caught.value.document == document


def test_a_damaged_subgroup_document_in_a_datatree(tmp_path: Path) -> None:
    path = tmp_path / "store.zarr"
    _dataset().to_zarr(path, zarr_format=3, consolidated=False)
    _dataset().to_zarr(path, group="forecast/day1", zarr_format=3, consolidated=False)
    document = path / "forecast/day1/t2m/zarr.json"
    document.write_bytes(document.read_bytes() + b"\x00\x00")
    with pytest.raises(MetadataError) as caught:
        xr.open_datatree(path, engine="gds-zarr", device="cpu", consolidated=False)
    assert caught.value.document == "forecast/day1/t2m/zarr.json"
    assert caught.value.reason.endswith(": it ends with 2 NUL bytes")
    # the root group alone does not read it, with either engine
    with xr.open_dataset(path, engine="zarr", consolidated=False) as ref:
        xr.testing.assert_identical(_open_gds(path, consolidated=False).load(), ref.load())


def test_damaged_members_listed_lazily(
    pristine: dict[tuple[int, bool], Path], tmp_path: Path
) -> None:
    """cache_members=False lists the members when the variables are read."""
    path, _ = _damaged(pristine, tmp_path, 3, False, "t2m/zarr.json", "nul")
    with pytest.raises(MetadataError, match=r"'t2m/zarr\.json'"):
        _open_gds(path, cache_members=False)


# -- consolidated metadata that parses as JSON but lists no nodes --------------------------


def test_v2_zmetadata_without_a_metadata_object(
    pristine: dict[tuple[int, bool], Path], tmp_path: Path
) -> None:
    path, _ = _damaged(pristine, tmp_path, 2, True, ".zmetadata", "nul")
    (path / ".zmetadata").write_text('{"metadata": 5, "zarr_consolidated_format": 1}')
    with pytest.raises(AttributeError):  # zarr: 'int' object has no attribute 'pop'
        xr.open_dataset(path, engine="zarr")
    with pytest.raises(MetadataError) as caught:
        _open_gds(path)
    assert caught.value.reason == (
        "it does not list metadata as Zarr v2 does (a 'metadata' object of "
        "'PATH/.zarray', 'PATH/.zattrs' and 'PATH/.zgroup' objects)"
    )


def test_v3_consolidated_metadata_without_node_types(
    pristine: dict[tuple[int, bool], Path], tmp_path: Path
) -> None:
    path, _ = _damaged(pristine, tmp_path, 3, True, "t2m/zarr.json", "nul")
    root = json.loads((path / "zarr.json").read_text())
    root["consolidated_metadata"]["metadata"]["t2m"] = {}
    (path / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(zarr.errors.GroupNotFoundError):
        xr.open_dataset(path, engine="zarr")
    with pytest.raises(MetadataError) as caught:
        _open_gds(path)
    assert caught.value.document == "zarr.json"
    assert caught.value.reason == (
        "its consolidated_metadata does not list nodes as Zarr does (an object of "
        "metadata objects, each with its node_type)"
    )
    with pytest.raises(MetadataError, match=r"'t2m/zarr\.json'"):  # the nodes' own
        _open_gds(path, consolidated=False)


# -- what the documents module says of one document ---------------------------------------


ZMETADATA_REASON = (
    "it does not list metadata as Zarr v2 does (a 'metadata' object of "
    "'PATH/.zarray', 'PATH/.zattrs' and 'PATH/.zgroup' objects)"
)


@pytest.mark.parametrize(
    ("key", "raw", "reason"),
    [
        ("a/zarr.json", b"", "it is empty"),
        ("a/zarr.json", b" \n", "it is empty"),
        ("a/zarr.json", b'{"node_type": "array"\xff}', "not UTF-8 text (byte 21 is 0xff)"),
        ("a/.zattrs", b"[1, 2]", "not a JSON object but a JSON list"),
        (
            "a/.zarray",
            b'{"a": 1}\x00{}',
            "not valid JSON (Extra data: line 1, column 9): it holds NUL bytes",
        ),
        (
            "a/zarr.json",
            b'{"node_type": "table"}',
            "its node_type is 'table', not 'array' or 'group'",
        ),
        ("a/zarr.json", b"{}", "its node_type is None, not 'array' or 'group'"),
        ("a/.zarray", b'{"zarr_format": 2}', None),
        ("zarr.json", b'{"node_type": "group", "consolidated_metadata": null}', None),
        # a file of NUL bytes (a crash after the file's size was set, before its data)
        (
            "a/zarr.json",
            b"\x00" * 8,
            "not valid JSON (Expecting value: line 1, column 1): it ends with 8 NUL bytes",
        ),
        (
            "a/zarr.json",
            b'{"a\x00\x00\x00\x00',
            "not valid JSON (Invalid control character at: line 1, column 4): it ends "
            "with 4 NUL bytes",
        ),
        # cut inside a string, a line break after: the parser ran out of document
        (
            "a/zarr.json",
            b'{"node_type": "arr\n',
            "not valid JSON (Invalid control character at: line 1, column 19): it ends "
            "before the JSON does (truncated after 19 bytes?)",
        ),
        # an array's document has no listing to check
        ("a/zarr.json", b'{"node_type": "array", "consolidated_metadata": 5}', None),
        (".zmetadata", b'{"metadata": {".zgroup": {"zarr_format": 2}}}', None),
        (".zmetadata", b'{"metadata": {"t2m/zarr.json": {}}}', ZMETADATA_REASON),
        (".zmetadata", b'{"metadata": {".zgroup": 2}}', ZMETADATA_REASON),
    ],
)
def test_problem(key: str, raw: bytes, reason: str | None) -> None:
    assert documents.problem(key, raw) == reason


def test_a_root_group_without_node_type_opens_as_zarr_opens_it(
    pristine: dict[tuple[int, bool], Path], tmp_path: Path
) -> None:
    path, _ = _damaged(pristine, tmp_path, 3, False, "zarr.json", "nul")
    (path / "zarr.json").write_text("{}")
    with xr.open_dataset(path, engine="zarr") as ref:
        xr.testing.assert_identical(_open_gds(path).load(), ref.load())


# -- which document an open names, and what it says to do --------------------------------


def _store(tmp_path: Path, zarr_format: int, consolidated: bool, groups: tuple[str, ...]) -> Path:
    """A store with the dataset at the root and in each of ``groups``."""
    path = tmp_path / "store.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for group in ("", *groups):
            _dataset().to_zarr(
                path,
                group=group or None,
                mode="a" if group else "w",
                zarr_format=zarr_format,
                consolidated=consolidated,
            )
    return path


def _append_nul(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\x00")


NODE_HINT = "restore it from a copy of the store, or write the node again"
CONSOLIDATED_HINT = (
    "restore it from a copy of the store; where it is consolidated metadata and the "
    "nodes' own documents are sound, consolidated=False reads those instead "
    "(zarr.consolidate_metadata(store) then writes it again)"
)


@pytest.mark.parametrize(
    ("zarr_format", "consolidated", "document", "kwargs", "hint"),
    [
        (3, False, "t2m/zarr.json", {"consolidated": False}, NODE_HINT),
        (3, False, "t2m/zarr.json", {}, NODE_HINT),
        (2, False, "t2m/.zarray", {"consolidated": False}, NODE_HINT),
        (2, False, "t2m/.zarray", {}, NODE_HINT),
        (2, False, ".zattrs", {}, NODE_HINT),
        (3, True, "zarr.json", {}, CONSOLIDATED_HINT),
        (3, True, "zarr.json", {"consolidated": True}, CONSOLIDATED_HINT),
        (2, True, ".zmetadata", {}, CONSOLIDATED_HINT),
    ],
)
def test_the_hint_fits_the_document(
    zarr_format: int,
    consolidated: bool,
    document: str,
    kwargs: dict[str, Any],
    hint: str,
    tmp_path: Path,
) -> None:
    """A node's own document: write the node again; consolidated metadata (a v3 root
    zarr.json read for its listing, a .zmetadata): consolidated=False reads the nodes'
    documents instead."""
    path = _store(tmp_path, zarr_format, consolidated, ())
    _append_nul(path / document)
    with pytest.raises(MetadataError) as caught:
        _open_gds(path, **kwargs)
    assert caught.value.document == document
    assert str(caught.value).endswith(f": it ends with 1 NUL byte; {hint}")


def test_a_groups_own_document_is_named_before_its_members(tmp_path: Path) -> None:
    """zarr reads the group's document first: of a damaged group document and a damaged
    array document in it, the group's is named."""
    path = _store(tmp_path, 3, False, ("sub",))
    _append_nul(path / "sub/zarr.json")
    _append_nul(path / "sub/t2m/zarr.json")
    with pytest.raises(ValueError):
        xr.open_dataset(path, group="sub", engine="zarr")
    with pytest.raises(MetadataError) as caught:
        _open_gds(path, group="sub")
    assert caught.value.document == "sub/zarr.json"
    assert str(caught.value).endswith(CONSOLIDATED_HINT)  # a group's zarr.json may list nodes


@pytest.mark.parametrize("kwargs", [{}, {"consolidated": False}])
def test_the_documents_of_the_group_opened_are_named_not_a_siblings(
    kwargs: dict[str, Any], tmp_path: Path
) -> None:
    path = _store(tmp_path, 3, False, ("a", "sub"))
    _append_nul(path / "a/t2m/zarr.json")
    _append_nul(path / "sub/t2m/zarr.json")
    with pytest.raises(MetadataError) as caught:
        _open_gds(path, group="sub", **kwargs)
    assert caught.value.document == "sub/t2m/zarr.json"


def test_a_root_group_without_node_type_is_passed_over_for_the_damaged_array(
    tmp_path: Path,
) -> None:
    """zarr opens a root group's {} (as a group): the document named is the array's."""
    path = _store(tmp_path, 3, False, ())
    (path / "zarr.json").write_text("{}")
    _append_nul(path / "t2m/zarr.json")
    with pytest.raises(ValueError):
        xr.open_dataset(path, engine="zarr", consolidated=False)
    with pytest.raises(MetadataError) as caught:
        _open_gds(path, consolidated=False)
    assert caught.value.document == "t2m/zarr.json"


def test_an_array_document_without_node_type(tmp_path: Path) -> None:
    path = _store(tmp_path, 3, False, ())
    (path / "t2m/zarr.json").write_text("{}")
    with pytest.raises(zarr.errors.MetadataValidationError):
        xr.open_dataset(path, engine="zarr")
    with pytest.raises(MetadataError) as caught:
        _open_gds(path)
    assert caught.value.document == "t2m/zarr.json"
    assert caught.value.reason == "its node_type is None, not 'array' or 'group'"


def test_a_groups_own_damaged_zmetadata_is_named(tmp_path: Path) -> None:
    """A group consolidated on its own (not the root), opened with consolidated=True:
    zarr reads the group's .zmetadata."""
    path = _store(tmp_path, 2, False, ("sub",))
    zarr.consolidate_metadata(path, path="sub", zarr_format=2)
    (path / "sub/.zmetadata").write_bytes((path / "sub/.zmetadata").read_bytes()[:-10])
    with pytest.raises(ValueError):
        xr.open_dataset(path, group="sub", engine="zarr", consolidated=True)
    with pytest.raises(MetadataError) as caught:
        _open_gds(path, group="sub", consolidated=True)
    assert caught.value.document == "sub/.zmetadata"


@pytest.mark.parametrize(
    ("zarr_format", "stray", "raw"),
    [(2, "zarr.json", b'{"zarr_format": 3,'), (3, ".zmetadata", b'{"metadata": ')],
)
def test_a_damaged_document_of_the_other_format_is_not_read(
    zarr_format: int, stray: str, raw: bytes, tmp_path: Path
) -> None:
    """With zarr_format given, the other format's documents are not read (nor named),
    as engine="zarr" does not read them."""
    path = _store(tmp_path, zarr_format, False, ())
    (path / stray).write_bytes(raw)
    with (
        xr.open_dataset(path, engine="zarr", zarr_format=zarr_format) as ref,
        _open_gds(path, zarr_format=zarr_format) as ds,
    ):
        xr.testing.assert_identical(ds.load(), ref.load())


def test_a_damaged_member_of_a_datatree_without_consolidated_metadata(tmp_path: Path) -> None:
    path = _store(tmp_path, 3, False, ("sub",))
    _append_nul(path / "sub/t2m/zarr.json")
    with pytest.raises(MetadataError) as caught:
        xr.open_datatree(path, engine="gds-zarr", device="cpu")
    assert caught.value.document == "sub/t2m/zarr.json"


@pytest.mark.parametrize("cache_members", [True, False])
def test_an_error_not_of_a_document_read_through_consolidated_metadata(
    tmp_path: Path, cache_members: bool
) -> None:
    """The open reads the nodes from the root's consolidated metadata and fails for
    another reason (an array without dimension names): a damaged array document it does
    not read is not named; the error is engine="zarr"'s (members listed at the open, or
    as the variables are read)."""
    path = _store(tmp_path, 3, True, ())
    root = json.loads((path / "zarr.json").read_text())
    del root["consolidated_metadata"]["metadata"]["t2m"]["dimension_names"]
    (path / "zarr.json").write_text(json.dumps(root))
    _append_nul(path / "t2m/zarr.json")
    with pytest.raises(KeyError) as ref:
        xr.open_dataset(path, engine="zarr")
    with pytest.raises(KeyError) as caught:
        _open_gds(path, cache_members=cache_members)
    assert str(caught.value) == str(ref.value)


def test_a_missing_group_is_not_taken_for_damage(tmp_path: Path) -> None:
    path = _store(tmp_path, 3, False, ())
    with pytest.raises(FileNotFoundError, match=r"group 'nope' not found in Zarr store"):
        _open_gds(path, group="nope")

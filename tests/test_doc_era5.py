"""The ``era5.zarr`` the docs tell readers to make (README.md, docs/index.md) is the
one the examples are tested against (tests/test_doc_blocks.py's ``doc_stores``): the
same variables, coordinates, values, chunks and format."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import xarray as xr
import zarr

from tests.test_doc_blocks import _NAMES, ROOT, _era5, blocks

PAGES = ["README.md", "docs/index.md"]


def _maker(page: str) -> str:
    """The one python block of ``page`` that writes ``era5.zarr``."""
    found = [
        b.code
        for b in blocks(ROOT / page)
        if b.lang == "python" and 'to_zarr("era5.zarr"' in b.code
    ]
    assert len(found) == 1, f"{page}: {len(found)} blocks write era5.zarr"
    return found[0]


def test_both_pages_make_it_the_same_way() -> None:
    assert _maker("README.md") == _maker("docs/index.md")


@pytest.mark.parametrize("page", PAGES)
def test_the_docs_era5_is_the_tested_one(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: consolidated metadata is not in the v3 spec
        exec(compile(_maker(page), page, "exec"), {"__name__": "__main__"})
        chunks = {n: {"chunks": (24, 64, 128)} for n in _NAMES}
        _era5("2024-01-01", 48).to_zarr(tmp_path / "tested.zarr", encoding=chunks)
    made = xr.open_dataset(tmp_path / "era5.zarr", engine="zarr").load()
    tested = xr.open_dataset(tmp_path / "tested.zarr", engine="zarr").load()
    xr.testing.assert_identical(made, tested)
    for name in _NAMES:
        assert made[name].encoding["chunks"] == tested[name].encoding["chunks"] == (24, 64, 128)
    formats = [
        zarr.open_group(tmp_path / s, mode="r").metadata.zarr_format
        for s in ("era5.zarr", "tested.zarr")
    ]
    assert formats == [3, 3]
    gds = xr.open_dataset(tmp_path / "era5.zarr", engine="gds-zarr", device="cpu").load()
    xr.testing.assert_identical(gds, made)

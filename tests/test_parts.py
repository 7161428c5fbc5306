"""Reads in parts on the host: a box read larger than the batch budget
(``xarray_gds.batch_bytes``) goes part by part (:func:`xarray_gds.coalesce.fetch_decode_parts`),
and every part must land at its own rows, through each placing path of
:meth:`xarray_gds.region._Reader.place`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from xarray_gds import coalesce

#: (shape, chunks, chunks per batch): many rows of one chunk a part (a task a row), one
#: row of one chunk a part, few rows of several chunks a part (a task a chunk), and 3-d
PART_LAYOUTS = [
    ((40, 6), (1, 6), 20),
    ((40, 6), (1, 6), 1),
    ((40, 6), (10, 3), 4),
    ((40, 7, 5), (3, 4, 5), 6),
]


@pytest.fixture
def part_reads(monkeypatch: pytest.MonkeyPatch) -> list[list[list[str]]]:
    """The keys of each part of every read in parts."""
    reads: list[list[list[str]]] = []
    real = coalesce.fetch_decode_parts

    def spy(items: list[Any], consume: Any) -> None:
        reads.append([list(request.keys) for request in items])
        real(items, consume)

    monkeypatch.setattr(coalesce, "fetch_decode_parts", spy)
    return reads


@pytest.mark.parametrize(("shape", "chunks", "per_batch"), PART_LAYOUTS, ids=str)
@pytest.mark.parametrize("rows", [slice(None), slice(5, 37)], ids=["all-rows", "inner-rows"])
def test_parts_land_at_their_own_rows(
    tmp_path: Path,
    part_reads: list[list[list[str]]],
    device: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    per_batch: int,
    rows: slice,
) -> None:
    path = tmp_path / "parts.zarr"
    values = np.arange(np.prod(shape), dtype="f8").reshape(shape)
    dims = [f"d{i}" for i in range(len(shape))]
    xr.Dataset({"v": (dims, values)}).to_zarr(path, encoding={"v": {"chunks": chunks}})
    chunk_nbytes = 8 * int(np.prod(chunks))
    with zarr.config.set({"xarray_gds.batch_bytes": per_batch * chunk_nbytes}):
        got = xr.open_dataset(path, engine="gds-zarr", device=device).v.isel(d0=rows).load()
    want = xr.open_dataset(path, engine="zarr").v.isel(d0=rows).load()
    xr.testing.assert_identical(got.as_numpy(), want)
    # read in parts of whole rows of chunks, in order, each chunk once
    start, stop, _ = rows.indices(shape[0])
    first, last = start // chunks[0], -(-stop // chunks[0])
    row = int(np.prod([-(-n // c) for n, c in zip(shape[1:], chunks[1:], strict=True)]))
    per_part = max(1, per_batch // row)
    (read,) = part_reads
    assert [len(p) for p in read] == [
        row * (min(r + per_part, last) - r) for r in range(first, last, per_part)
    ]
    assert len(read) > 1
    leading = [int(p[0].split("/")[2]) for p in read]
    assert leading == list(range(first, last, per_part))
    keys = [k for p in read for k in p]
    assert len(set(keys)) == len(keys)

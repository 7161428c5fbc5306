"""Tests written for mutants that survived ``scripts/mutation-run.py`` (Cosmic Ray's
mutants of the read and write modules, sampled without a person choosing them): each
test names the module and the mutation it stops, and compares with what zarr-python
(``engine="zarr"``) reads or writes wherever the engine's output is at stake."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from tests.conftest import open_both
from xarray_gds import ChunkDecodeError


def _rows_store(path: Path, rows: int = 12) -> Path:
    """``rows`` rows of one zstd chunk each (float64, 1 x 6)."""
    values = np.arange(rows * 6, dtype="f8").reshape(rows, 6)
    xr.Dataset({"v": (("r", "c"), values)}).to_zarr(
        path, zarr_format=3, encoding={"v": {"chunks": (1, 6)}}
    )
    return path


def _bounded(read: Any, seconds: float = 60.0) -> Any:
    """``read()`` in a thread: its result or its exception, failing the test when it has
    not finished within ``seconds`` (a read that hangs, not a slow one)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = read()
        except BaseException as err:
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read did not finish"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# -- coalesce.py ----------------------------------------------------------------------------
def test_points_read_in_one_part(v3_store: Path, v2_store: Path) -> None:
    """coalesce ``while not state.done`` -> ``while state.done``: zarr's own indexing (a
    points selection) reads through the pipeline in one part, ``fetch_decode`` of one
    request, as engine="zarr" reads it."""
    for store in (v3_store, v2_store):
        gds, ref = open_both(store, "cpu")
        sel = {"time": [0, 7, 3], "lon": [1, 10]}
        xr.testing.assert_identical(gds.isel(sel).load(), ref.isel(sel).load())


def test_failing_first_part_stops_the_part_servers(tmp_path: Path) -> None:
    """coalesce ``stop = True`` -> ``stop = False`` (after a part fails): a read in many
    parts whose first part's chunk is damaged raises ChunkDecodeError naming it, as
    zarr-python fails on it, instead of waiting for ever on the part servers."""
    path = _rows_store(tmp_path / "rows.zarr")
    (path / "v" / "c" / "0" / "0").write_bytes(b"not a zstd frame at all")
    with pytest.raises(RuntimeError, match="Zstd decompression error"):  # zarr-python too
        xr.open_dataset(path, engine="zarr").v.load()

    def read() -> Any:
        with zarr.config.set({"xarray_gds.batch_bytes": 48}):  # one chunk a part
            return xr.open_dataset(path, engine="gds-zarr", device="cpu").v.load()

    with pytest.raises(ChunkDecodeError, match=r"'v/c/0/0'"):
        _bounded(read)

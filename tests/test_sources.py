"""Byte ranges read through any zarr Store: zarr's own ``get_ranges`` joins them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
from zarr.storage import LocalStore

from xarray_gds import stores


class _Counting(LocalStore):
    """zarr's LocalStore counting the ranged reads of chunk objects."""

    ranged: list[str]

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        if byte_range is not None and "/c/" in key:
            self.ranged.append(key)
        return await super().get(key, prototype, byte_range)


def _sharded(path: Path) -> xr.Dataset:
    data = np.arange(8 * 8 * 6, dtype="f4").reshape(8, 8, 6)
    ds = xr.Dataset({"v": (("a", "b", "c"), data)})
    ds.to_zarr(
        path,
        zarr_format=3,
        consolidated=False,
        encoding={"v": {"chunks": (2, 2, 6), "shards": (4, 8, 6)}},
    )
    return ds


@pytest.mark.parametrize(("gap", "per_shard"), [(None, 1), (-1, 8)])
def test_ranges_of_a_store_joined_by_get_ranges(tmp_path: Path, gap: Any, per_shard: int) -> None:
    """Eight inner chunks of a shard read through a zarr Store: one request a shard with
    the default gap, one a range with ``range_gap=-1``; values as zarr reads them."""
    path = tmp_path / "s.zarr"
    expected = _sharded(path)
    store = _Counting(path, read_only=True)
    store.ranged = []
    assert isinstance(stores.source_for(store), stores.StoreSource)
    settings = {} if gap is None else {"xarray_gds.range_gap": gap}
    with zarr.config.set(settings):
        ds = xr.open_dataset(store, engine="gds-zarr", device="cpu", consolidated=False)
        got = ds.v.isel(a=slice(0, 4), b=slice(0, 8)).values
    np.testing.assert_array_equal(got, expected.v.values[:4])
    assert len(store.ranged) == per_shard + 1  # and one read of the shard's index
    assert set(store.ranged) == {"v/c/0/0/0"}


def test_a_missing_shard_reads_as_the_fill_value(tmp_path: Path) -> None:
    path = tmp_path / "s.zarr"
    _sharded(path)
    (path / "v" / "c" / "1" / "0" / "0").unlink()
    store = LocalStore(path, read_only=True)
    gds = xr.open_dataset(store, engine="gds-zarr", device="cpu", consolidated=False)
    ref = xr.open_dataset(store, engine="zarr", consolidated=False)
    xr.testing.assert_identical(gds.load(), ref.load())

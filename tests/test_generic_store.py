"""Any other zarr Store (``stores/generic.py``): URLs no other kind opens written
through fsspec with the caller's options, and byte ranges that must come back whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import xarray as xr
from zarr.abc.store import RangeByteRequest
from zarr.core.buffer import cpu
from zarr.storage import MemoryStore

import xarray_gds
from xarray_gds import stores
from xarray_gds.stores.generic import StoreSource, _exactly


@pytest.mark.needs("fsspec")
def test_a_url_no_other_kind_opens_is_written_with_its_storage_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A URL of a filesystem fsspec knows (not a local path, S3 or HTTP) is written
    through zarr's FsspecStore, writable, with ``storage_options`` handed to the
    filesystem: the values zarr reads back are those written."""
    import importlib

    from fsspec.implementations.memory import MemoryFileSystem

    class TokenMemory(MemoryFileSystem):
        """A memory filesystem of its own that refuses a caller without its token."""

        protocol = "xgdstoken"
        store: dict[str, Any] = {}  # noqa: RUF012 (fsspec's class-level state)
        pseudo_dirs = [""]  # noqa: RUF012

        def __init__(self, token: str | None = None, **kwargs: Any) -> None:
            if token != "secret":
                raise PermissionError(f"xgdstoken: bad token {token!r}")
            super().__init__(**kwargs)

    # fsspec's registry of protocols, the entry gone again after the test
    registry = importlib.import_module("fsspec.registry")._registry
    monkeypatch.setitem(registry, "xgdstoken", TokenMemory)
    options = {"token": "secret"}
    ds = xr.Dataset({"v": (("t", "x"), np.arange(24, dtype="f4").reshape(4, 6))})
    url = "xgdstoken://bucket/out.zarr"
    xarray_gds.to_zarr(ds, url, mode="w", storage_options=options, consolidated=False)
    back = xr.open_dataset(url, engine="zarr", storage_options=options, consolidated=False)
    np.testing.assert_array_equal(back["v"].values, ds["v"].values)
    with pytest.raises(PermissionError, match="bad token None"):
        xarray_gds.to_zarr(ds, "xgdstoken://bucket/other.zarr", mode="w", consolidated=False)


def test_a_range_read_comes_back_whole_or_raises_naming_the_key() -> None:
    """A range past an object's end (a damaged or rewritten shard) is an error naming
    the key and the bytes asked for, never shorter data; so is a range longer than
    asked (a store that ignores the range's end)."""
    store = MemoryStore({"v/c/0": cpu.Buffer.from_bytes(bytes(range(10)))})
    source = stores.source_for(store)
    assert isinstance(source, StoreSource)
    ranges = (np.array([2, 4]), np.array([3, 8]))
    with pytest.raises(OSError, match=r"short read of 'v/c/0': got 6 of the 8 bytes at 4;"):
        source.read_ranges_all([source, source], ["v/c/0", "v/c/0"], ranges, False)
    got: Any = source.read_ranges_all([source], ["v/c/0"], (np.array([2]), np.array([3])), False)
    assert bytes(got[0]) == bytes([2, 3, 4])
    longer = cpu.Buffer.from_bytes(bytes(7))
    with pytest.raises(OSError, match=r"got 7 of the 5 bytes at 4;"):
        _exactly(longer, "v/c/0", RangeByteRequest(4, 9))
    assert bytes(_exactly(longer, "v/c/0", RangeByteRequest(3, 10))) == bytes(7)

"""The read bound of a benchmark case: ``read-only``.

A load reads every chunk, then decodes it; it can be no faster than the slower of the
two. ``decode-only`` (:func:`xarray_gds.tools.bench.decode_only`) times the decode
alone, on chunks already in device memory; ``read-only`` times the reads alone: the
chunks of every data variable the case loads, read by the engine's own reads (the
source of the store's kind, the engine's parts, into device memory for a device load)
and nothing decoded. Beside the engine's time, the two say which bounds a case (the
reads, the decode, or the engine itself, where it is well above both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import xarray as xr
import zarr

from xarray_gds import coalesce, decode
from xarray_gds.codecs import DecodeChain, plan_chain
from xarray_gds.entries import split
from xarray_gds.request import ReadRequest
from xarray_gds.stores import open_target

__all__ = ["chunk_requests", "read_bound", "read_only"]


def chunk_requests(
    target: Any,
    on_device: bool,
    *,
    storage_options: dict[str, Any] | None = None,
    consolidated: bool | None = None,
) -> list[ReadRequest] | None:
    """The engine's read requests of every chunk of every data variable of ``target``
    (what a load of the whole dataset asks for), one per part of a variable as the
    engine splits it (:func:`xarray_gds.decode.part_chunks`). ``None`` when a variable
    is sharded (its reads are byte ranges of shards, planned per shard) or has no
    chain the engine plans."""
    opened = open_target(
        target, mode="r", storage_options=storage_options, consolidated=consolidated
    )
    if opened is None:
        raise ValueError(f"no store kind opens {target!r}")
    names = list(
        xr.open_dataset(
            target,
            engine="gds-zarr",
            device="cpu",
            storage_options=storage_options,
            consolidated=consolidated,
        ).data_vars
    )
    group = zarr.open_group(opened.store, mode="r", use_consolidated=opened.consolidated)
    requests: list[ReadRequest] = []
    for name in names:
        array = group[str(name)]
        assert isinstance(array, zarr.Array)
        chain = plan_chain(array.metadata)
        if not isinstance(chain, DecodeChain):
            return None
        prefix = f"{array.path}/" if array.path else ""
        grid = np.ndindex(*array.cdata_shape)
        keys = [prefix + array.metadata.encode_chunk_key(c) for c in grid]
        per_part = decode.part_chunks(len(keys), chain.nbytes, on_device)
        requests += [
            ReadRequest(opened.store, chain, part, on_device) for part in split(keys, per_part)
        ]
    return requests


def read_only(requests: list[ReadRequest]) -> Callable[[], None]:
    """A function that reads every chunk of ``requests`` as the engine reads it, one
    request after the other (each read's bytes are let go before the next one, as a
    decoded part's are), and decodes nothing."""

    def run() -> None:
        for request in requests:
            fetched = coalesce.read_only(request)
            del fetched

    return run


def read_bound(target: Any, *, on_device: bool, **kwargs: Any) -> dict[str, Callable[[], Any]]:
    """The ``read-only`` contender of a read case of ``target`` (its requests made now,
    its reads timed), or none where a variable is sharded. ``kwargs`` go to
    :func:`chunk_requests`."""
    requests = chunk_requests(target, on_device, **kwargs)
    if requests is None:
        return {}
    return {"read-only": read_only(requests)}

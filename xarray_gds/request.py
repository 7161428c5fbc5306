"""The read engine's contract: what it is asked to read, and what it hands back.

A :class:`ReadRequest` names the chunks of one array to read and decode; the engine
(:mod:`xarray_gds.coalesce`) joins the requests of many threads and arrays, reads their
bytes through the stores' sources (:mod:`xarray_gds.stores`) and decodes them
(:mod:`xarray_gds.decode`). Each request gets back its :data:`Decoded` chunks, or its own error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xarray_gds.codecs import DecodeChain

__all__ = ["ByteRanges", "Decoded", "ReadRequest", "Sink"]

#: ``sink(i, chunk)`` takes decoded chunk ``i`` of a request as soon as it is decoded.
#: A sink may also have ``target(i)``: the flat ``uint8`` bytes of its output that chunk
#: ``i`` fills whole, laid out as the chunk decodes (no filter, byte swap or transpose
#: between), for the engine to decode the chunk straight into; ``None`` where there are
#: none, and the chunk is decoded and handed to ``sink`` then.
Sink = Callable[[int, Any], None]

#: What a request gets back: the indices (into its keys) of the chunks that exist, and
#: their decoded values as :func:`xarray_gds.decode.decode_fetched` returns them (or
#: :data:`xarray_gds.place.STREAMED` where a sink took them)
Decoded = tuple[list[int], Any]


@dataclass(frozen=True, eq=False)
class ByteRanges:
    """Byte ranges a request reads instead of whole chunks (the inner chunks of
    shards): range ``j`` is ``sizes[j]`` bytes at ``starts[j]`` of the object
    ``held[which[j]]``."""

    held: Sequence[str]  #: the keys (shards) that hold the ranges
    which: np.ndarray  #: for each range, the index in ``held`` of its key
    starts: np.ndarray
    sizes: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.which)
        if len(self.starts) != n or len(self.sizes) != n:
            raise ValueError(
                f"ByteRanges: {n} ranges but {len(self.starts)} starts and {len(self.sizes)} sizes"
            )


@dataclass(frozen=True, eq=False)
class ReadRequest:
    """Chunks of one array for the engine to read and decode.

    Attributes
    ----------
    store : zarr.abc.store.Store
        The store that holds the chunks (its source reads them).
    chain : DecodeChain
        How every chunk of the array decodes.
    keys : sequence of str
        The chunk keys, or names of the inner chunks when ``ranges`` is given (used in
        messages).
    on_device : bool
        Decoded chunks in device memory (CuPy) or host memory (numpy).
    ranges : ByteRanges, optional
        Read these byte ranges of other keys instead of the keys whole.
    sink : Sink, optional
        Takes each decoded chunk as soon as it is decoded (host reads of large local
        chunks are then streamed chunk by chunk; the result holds
        :data:`xarray_gds.place.STREAMED` in place of the chunks).
    """

    store: Any
    chain: DecodeChain
    keys: Sequence[str]
    on_device: bool
    ranges: ByteRanges | None = None
    sink: Sink | None = None

    def __post_init__(self) -> None:
        if self.ranges is not None and len(self.ranges.which) != len(self.keys):
            raise ValueError(
                f"ReadRequest: {len(self.keys)} keys but {len(self.ranges.which)} byte ranges"
            )

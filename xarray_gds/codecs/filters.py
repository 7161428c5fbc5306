"""Byte-level filters undone for a whole batch of chunks at once, with numpy or CuPy.

Each filter takes and returns a C-contiguous ``(n_chunks, chunk_nbytes)`` uint8 array,
so one call (one kernel on the device) covers every chunk of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ByteFilter", "Undelta", "Unshuffle"]


class ByteFilter:
    """Base class: a decode step on stacked chunk bytes."""

    #: Whether the step is implemented on the device with identical results.
    device_ready: bool = True

    def apply(self, data: Any, xp: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class Unshuffle(ByteFilter):
    """Undo numcodecs ``Shuffle``: byte ``j`` of every element was stored together."""

    elementsize: int

    def apply(self, data: Any, xp: Any) -> Any:
        n, nbytes = data.shape
        if self.elementsize <= 1:
            return data
        if nbytes % self.elementsize:
            raise ValueError(
                f"Shuffle: chunk of {nbytes} bytes is not a multiple of the element size "
                f"{self.elementsize}"
            )
        planes = data.reshape(n, self.elementsize, nbytes // self.elementsize)
        return xp.ascontiguousarray(planes.transpose(0, 2, 1)).reshape(n, nbytes)


@dataclass(frozen=True)
class Undelta(ByteFilter):
    """Undo numcodecs ``Delta``: a running sum over each chunk, in ``dtype``."""

    dtype: np.dtype

    @property
    def device_ready(self) -> bool:  # type: ignore[override]
        # CuPy's parallel scan adds floats in another order than numpy's loop.
        return self.dtype.kind in "iu"

    def apply(self, data: Any, xp: Any) -> Any:
        n = data.shape[0]
        values = data.view(self.dtype)
        summed = xp.cumsum(values, axis=1, dtype=self.dtype)
        return xp.ascontiguousarray(summed).view(np.uint8).reshape(n, -1)

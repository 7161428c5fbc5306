"""Exceptions raised by xarray-gds."""

from __future__ import annotations

import math
import os
import re
import warnings
from typing import Any

__all__ = [
    "ChunkDecodeError",
    "ConsolidatedMetadataWarning",
    "HostBlocksWarning",
    "HostRouteWarning",
    "MetadataError",
    "WriterLockWarning",
    "XarrayGdsWarning",
    "warn",
]


class XarrayGdsWarning(Warning):
    """The category of every warning xarray-gds emits: silence them all with
    ``warnings.filterwarnings("ignore", category=xarray_gds.XarrayGdsWarning)``."""


class HostRouteWarning(XarrayGdsWarning, RuntimeWarning):
    """Values take the host instead of the GPU: no usable device, or codecs without a
    GPU decoder or encoder (decoded or encoded by zarr-python on the host)."""


class ConsolidatedMetadataWarning(XarrayGdsWarning, RuntimeWarning):
    """A store opened with ``consolidated=None`` has no consolidated metadata."""


class WriterLockWarning(XarrayGdsWarning, RuntimeWarning):
    """A write goes on without its writer lock file, which could not be made: a
    concurrent writer of the same store is not excluded."""


class HostBlocksWarning(XarrayGdsWarning, UserWarning):
    """Dask blocks decoded on the GPU come back as numpy blocks (xarray's default chunk
    manager); pass ``chunked_array_type="gds-dask"`` to keep them."""


class MetadataError(ValueError):
    """A Zarr metadata document of a store is damaged: not JSON (a truncated write,
    bytes appended to it), not a JSON object, or consolidated metadata that lists no
    nodes as Zarr lays them out.

    Raised by ``xr.open_dataset``, ``xr.open_datatree`` and ``xr.open_groups`` with
    ``engine="gds-zarr"`` in place of the parser's error (which names no document),
    that error chained as ``__cause__``. A document the open does not read (an
    array's own document where consolidated metadata describes the array, as
    ``engine="zarr"`` reads it too) is not looked at.

    Attributes
    ----------
    document : str
        The document's key in the store: ``"t2m/zarr.json"``, ``".zmetadata"``.
    store : str
        The store, as its ``str`` shows it (without credentials).
    reason : str
        What is wrong with the document.
    """

    def __init__(self, document: str, store: str, reason: str, hint: str = "") -> None:
        self.document = document
        self.store = store
        self.reason = reason
        message = f"corrupt Zarr metadata document {document!r} in {store}: {reason}"
        super().__init__(message + (f"; {hint}" if hint else ""))


def _package_dir(module: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.abspath(next(iter(spec.submodule_search_locations))) + os.sep


_internal: tuple[str, ...] | None = None


def _internal_dirs() -> tuple[str, ...]:
    """Folders of the libraries a user's call passes through before the engine warns."""
    global _internal
    if _internal is None:
        found = (_package_dir(m) for m in ("xarray_gds", "xarray", "zarr", "dask", "numcodecs"))
        _internal = tuple(d for d in found if d)
    return _internal


def warn(message: str, category: type[XarrayGdsWarning]) -> None:
    """Emit ``message`` pointing at the user's line: the first frame outside
    xarray-gds, xarray, zarr and dask (where the warning is raised in a worker thread
    with no user frame, at that thread's outermost frame)."""
    warnings.warn(message, category, skip_file_prefixes=_internal_dirs())


#: the last parts of a chunk key: v3 ``c/0/1/0`` or ``c.0.1.0`` (``c`` alone for a 0-d
#: array), v2 ``0.1.0`` or ``0/1/0``
_V3_GRID = re.compile(r"^c([./]\d+)*$")
_V2_GRID = re.compile(r"^\d+(\.\d+)*$")


def array_of(key: str) -> str:
    """The path of the array a chunk key belongs to (``"v"`` for ``"v/c/0/1/0"``,
    ``"v/0.1.0"`` or ``"v/c/0/0/0 (inner chunk (0, 0, 0))"``; ``"/"`` for the root)."""
    parts = key.split(" (", 1)[0].split("/")
    tail = list(parts)
    while tail and tail[-1].isdigit():
        tail.pop()
    if tail and _V3_GRID.match(tail[-1]):  # v3: .../c/0/1/0, .../c.0.1.0, .../c
        parts = tail[:-1]
    else:  # v2: .../0.1.0 or .../0/1/0
        while parts and _V2_GRID.match(parts[-1]):
            parts.pop()
    return "/".join(parts) or "/"


class ChunkDecodeError(ValueError):
    """A stored chunk could not be decoded (corrupt, truncated, of the wrong size, or
    not what the array metadata says it is).

    For a chunk whose decoded size disagrees with the array metadata (``decoded`` and
    ``expected`` set), the message names both sizes and says that either the chunk or
    the metadata (dtype, chunks, codecs) may be wrong: deleting the chunk is advised
    only once the metadata is confirmed right, since it destroys data otherwise.

    Attributes
    ----------
    key : str
        The chunk key in the store (it begins with the array's path).
    codec : str
        The codec that failed.
    array : str
        The path of the array (from ``key``).
    decoded : int or None
        The chunk's decoded byte count (as decoded, or as its stream declares it),
        for a size mismatch.
    expected : int or None
        The decoded byte count the array metadata gives a chunk (chunk shape x dtype
        itemsize), for a size mismatch.
    """

    def __init__(
        self,
        key: str,
        codec: str,
        reason: str,
        *,
        decoded: int | None = None,
        expected: int | None = None,
    ) -> None:
        self.key = key
        self.codec = codec
        self.reason = reason
        self.array = array_of(key)
        self.decoded = decoded
        self.expected = expected
        self.chunk_shape: tuple[int, ...] | None = None
        self.dtype: Any = None
        super().__init__(self._message())

    def describe(self, chunk_shape: tuple[int, ...], dtype: Any) -> ChunkDecodeError:
        """Name the metadata's chunk shape and dtype in the message of a size mismatch
        (the decoder that raised it knows only the byte count); returns ``self``."""
        size = math.prod(chunk_shape) * dtype.itemsize
        if self.expected == size and self.chunk_shape is None:
            self.chunk_shape, self.dtype = tuple(chunk_shape), dtype
            self.args = (self._message(),)
        return self

    def _message(self) -> str:
        where = f"cannot decode chunk {self.key!r} with codec {self.codec!r}: {self.reason}. "
        if self.expected is None:
            return where + (
                "The stored chunk is corrupt or truncated, or the codecs in the metadata "
                f"of array {self.array!r} are not those it was written with. Read it with "
                "engine='zarr' (zarr-python) and compare the codecs in the array's "
                "zarr.json (.zarray in Zarr v2) with how it was written; only once the "
                "metadata is confirmed right, rewrite the chunk (deleting it reads the "
                "fill value instead of its data)."
            )
        if self.chunk_shape is not None:
            size = (
                f"chunk shape {self.chunk_shape} x {self.dtype} itemsize "
                f"{self.dtype.itemsize} = {self.expected} bytes"
            )
        else:
            size = f"chunk shape x dtype itemsize = {self.expected} bytes"
        decoded = "unknown" if self.decoded is None else f"{self.decoded} bytes"
        return where + (
            f"The chunk's decoded size ({decoded}) disagrees with the metadata of array "
            f"{self.array!r} ({size}): either the stored chunk or the array metadata "
            "(dtype, chunks, codecs) is wrong. To check, read the chunk with "
            "engine='zarr' (zarr-python) and compare the dtype, chunks and codecs in the "
            "array's zarr.json (.zarray in Zarr v2) with how the data were written. If "
            "the metadata is wrong, fix the metadata and keep the chunk; only once the "
            "metadata is confirmed right, rewrite the chunk, or delete it to read the "
            "fill value."
        )

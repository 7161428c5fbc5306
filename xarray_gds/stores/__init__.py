"""The store kinds: one module each, one ordered registry of them.

==================  ================================================================
kind (its module)   what it reads and writes
==================  ================================================================
:mod:`.refs`        kerchunk / VirtualiZarr reference sets (JSON, Parquet, a dict)
:mod:`.icechunk`    an Icechunk session's store, chunks read where they lie
:mod:`.remote`      ``s3://``, ``http(s)://`` URLs and their fsspec stores
:mod:`.local`       local directories (paths, ``file://`` URLs, zarr ``LocalStore``)
:mod:`.generic`     ``MemoryStore`` and any other zarr Store, through its ``get``
==================  ================================================================

The registry asks them in this order (:func:`kinds`): the first kind that
:meth:`~xarray_gds.stores.base.Source.opens` a path, URL or reference set opens it
(:func:`open_target`); the first that :meth:`~xarray_gds.stores.base.Source.claims` a
zarr Store reads and writes it (:func:`source_for`). A new kind is one module with one
:class:`~xarray_gds.stores.base.Source` subclass, put in the registry with
:func:`register` (see "Adding a store kind" in the internals page of the docs).
"""

from __future__ import annotations

from xarray_gds.stores.base import (
    Opened,
    Ranges,
    Source,
    Stream,
    WriterLock,
    join,
    kinds,
    merge_ranges,
    on_side,
    open_target,
    read,
    read_joined,
    register,
    source_for,
    stream,
)
from xarray_gds.stores.generic import MemorySource, StoreSource
from xarray_gds.stores.icechunk import IcechunkSource
from xarray_gds.stores.local import DirectorySource, LocalSource
from xarray_gds.stores.refs import ReferenceSource
from xarray_gds.stores.remote import RemoteSource

__all__ = [
    "DirectorySource",
    "IcechunkSource",
    "LocalSource",
    "MemorySource",
    "Opened",
    "Ranges",
    "ReferenceSource",
    "RemoteSource",
    "Source",
    "StoreSource",
    "Stream",
    "WriterLock",
    "join",
    "kinds",
    "merge_ranges",
    "on_side",
    "open_target",
    "read",
    "read_joined",
    "register",
    "source_for",
    "stream",
]

# the order they are asked in: a reference set may be a path or an s3:// URL, so
# references come before the remote and local kinds; every store is a StoreSource's
for _kind in (
    ReferenceSource,
    IcechunkSource,
    RemoteSource,
    LocalSource,
    DirectorySource,
    MemorySource,
    StoreSource,
):
    register(_kind)

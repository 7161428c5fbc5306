"""Writing datasets that live (partly) in GPU memory to Zarr.

:func:`to_zarr` takes what ``Dataset.to_zarr`` takes and accepts datasets whose
variables are CuPy arrays, dask arrays of CuPy blocks, or lazily loaded variables of
``engine="gds-zarr"``, none of which xarray's own ``to_zarr`` can write (zarr-python
encodes with numpy and CuPy refuses implicit conversion).

xarray still does everything it does for any Zarr write (metadata, CF encoding,
modes, regions, appends, consolidated metadata, ``compute=False``); the arrays it
opens write through :class:`~xarray_gds.pipeline.GdsCodecPipeline`, which encodes
device values on the GPU in batches (nvCOMP) and writes each chunk file whole. Device
values reach xarray as they are, wrapped in :class:`~xarray_gds.pipeline.DeviceValues`
so that xarray's CF encoding runs on them on the device (lazily loaded engine
variables are read first, on the device); no dask is needed unless the dataset has
dask variables of its own or ``compute=False`` asks for a delayed write. Host
variables are written by zarr-python's codecs, the bytes ``engine="zarr"`` writes
(through zarr's fused pipeline where the store allows: see
``GdsCodecPipeline._host_writer``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import xarray as xr
from zarr.abc.store import Store
from zarr.storage import LocalStore

from xarray_gds import device as _device
from xarray_gds.chunks import GdsDaskManager, device_of
from xarray_gds.deferred import HeldMetadataStore
from xarray_gds.pipeline import DeviceValues, writing_to
from xarray_gds.stores import open_target, source_for
from xarray_gds.stores.lock import DEFAULT_TIMEOUT
from xarray_gds.stores.urls import write_error

__all__ = ["for_device_write", "for_direct_write", "to_zarr"]

_LEVELS = ("host", "gpu")
_DASK_EXTRA = 'pip install ".[dask]"'


def _one_block(var: xr.Variable) -> Any:
    """A device variable's values as a one-block dask array: CuPy values as they are,
    lazily loaded engine variables read on the device when the block is computed."""
    data: Any = var._data
    if _device.is_device_array(data):
        import dask.array as da

        # name=False: a random name; dask would otherwise hash the values to make one
        return da.from_array(data, chunks=data.shape, asarray=False, name=False)
    chunks = {d: -1 for d in var.dims}
    return var.chunk(chunks, chunked_array_type=GdsDaskManager()).data


def for_device_write(ds: xr.Dataset) -> tuple[xr.Dataset, bool]:
    """``ds`` with every device variable that is not a dask array yet as a one-block
    dask array of CuPy values (the values of a ``compute=False`` write, written when
    the delayed write is computed).

    Returns
    -------
    (dataset, user_dask)
        The dataset (attributes and encodings kept) and whether ``ds`` has dask
        variables of its own.
    """
    user_dask = False
    out = ds.copy(deep=False)
    for name, var in ds.variables.items():
        data: Any = var._data
        if name in ds.indexes or var.ndim == 0:
            continue
        if _is_dask(data):
            user_dask = True
        elif device_of(data) == "cuda":
            out[name] = out[name].copy(data=_one_block(var), deep=False)
    return out, user_dask


def for_direct_write(ds: xr.Dataset) -> tuple[xr.Dataset, bool]:
    """``ds`` with the values of every device variable that is not a dask array in
    device memory, wrapped in :class:`~xarray_gds.pipeline.DeviceValues` (the values
    of a write that xarray makes at once). No dask is imported.

    Lazily loaded engine variables are read on the device here, each whole, as
    xarray reads lazily loaded variables for a write (before any chunk is written);
    ``ds`` itself keeps them lazy (nothing is cached in it).

    Returns
    -------
    (dataset, user_dask)
        The dataset (attributes and encodings kept) and whether ``ds`` has dask
        variables of its own.
    """
    user_dask = False
    out = ds.copy(deep=False)
    for name, var in ds.variables.items():
        data: Any = var._data
        if name in ds.indexes or var.ndim == 0:
            continue
        if _is_dask(data):
            user_dask = True
        elif device_of(data) == "cuda":
            values = data if _device.is_device_array(data) else var[...].load().data
            wrapped: Any = DeviceValues(values)
            out[name] = var.copy(data=wrapped, deep=False)
    return out, user_dask


def _write(prepared: xr.Dataset, store: Any, kwargs: dict[str, Any]) -> Any:
    """``prepared.to_zarr(store, **kwargs)``. A write with ``compute=True`` whose tasks
    all run in this process (no dask variables, or dask's scheduler is its threads or
    none) says so to a :class:`~xarray_gds.deferred.HeldMetadataStore`, which then
    removes the chunks it recorded after a failure, never by listing. Otherwise, as
    with xarray, the dask variables are written where the user's scheduler runs them:
    on a cluster of worker processes, each task writes its chunks into the store it
    holds, which :class:`~xarray_gds.deferred.HeldMetadataStore` pickles as the store
    written (its metadata stays held in this process and is written after the tasks)."""
    computed = kwargs.get("compute", True)
    if isinstance(store, HeldMetadataStore) and computed and _runs_here(prepared):
        store.runs_here()
    return prepared.to_zarr(store, **kwargs)


def _runs_here(ds: xr.Dataset) -> bool:
    """Whether every write task of ``ds`` runs in this process: it has no dask
    variables (dask is not imported then), or dask computes in this process now (its
    threads or none; not a ``distributed`` client, not its process pool)."""
    if not any(_is_dask(var._data) for var in ds.variables.values()):
        return True
    import dask.base
    import dask.local
    import dask.threaded

    return dask.base.get_scheduler() in (None, dask.threaded.get, dask.local.get_sync)


def _is_dask(data: Any) -> bool:
    return hasattr(data, "dask") and hasattr(data, "map_blocks")


def _require_dask() -> None:
    """Raise ImportError, naming the extra, when dask cannot be imported."""
    try:
        import dask  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "xarray_gds.to_zarr(..., compute=False) returns a dask.delayed.Delayed, as "
            f"Dataset.to_zarr does, and needs dask: install it ({_DASK_EXTRA} in a "
            "checkout of xarray-gds), or write with compute=True (the default), which "
            "needs no dask."
        ) from err


def to_zarr(
    ds: xr.Dataset,
    store: str | os.PathLike[str] | Any,
    *,
    levels: str = "host",
    lock_timeout: float | None = DEFAULT_TIMEOUT,
    **kwargs: Any,
) -> Any:
    """Write ``ds`` to a Zarr store, whichever device its variables are on.

    Parameters
    ----------
    ds : xarray.Dataset
        Variables may be numpy, CuPy, dask (of numpy or CuPy blocks), or lazily loaded
        by ``engine="gds-zarr"``.
    store : str, path or zarr Store
        A local directory is written through :class:`~xarray_gds.stores.local.GdsStore`,
        URLs such as ``"s3://..."`` through the engine's remote stores; every store
        (those and zarr Store objects) is wrapped in
        :class:`~xarray_gds.deferred.HeldMetadataStore`, which holds the writer lock,
        writes the metadata after the chunks it describes and cleans up after a
        failed write (a directory the write made is removed again if it is left
        empty). An Icechunk session's store
        (``session.store``) is written as zarr writes it: Icechunk checks chunk keys
        against the metadata, and the session's commit publishes the write whole (or
        nothing, if it is never committed).
    levels : {"host", "gpu"}
        nvCOMP's encoders have no compression levels. ``"host"`` (default): arrays
        whose codec sets a level (or acceleration) other than the codec's default
        are encoded on the host by zarr-python, so the level is applied. ``"gpu"``:
        they are encoded by nvCOMP too, at its own level (the metadata keeps theirs).
    lock_timeout : float or None
        Seconds to wait (600 by default; ``None``: no bound) while another process or
        thread writes the same local directory or memory store: the write holds the
        store's writer lock (see :mod:`xarray_gds.stores.lock`) from reading its metadata
        to writing it. Then ``TimeoutError``, naming the lock file and the writer.
    **kwargs
        Everything ``xarray.Dataset.to_zarr`` takes (``mode``, ``append_dim``,
        ``region``, ``encoding``, ``consolidated``, ``zarr_format``, ``compute``,
        ``write_empty_chunks``, ...), with the same meaning. With ``compute=False``,
        CuPy variables are written when the returned object is computed, as dask
        variables are.

    Returns
    -------
    Whatever ``Dataset.to_zarr`` returns (a ``dask.delayed.Delayed`` with
    ``compute=False``).

    Raises
    ------
    ImportError
        With ``compute=False`` when dask is not installed (``pip install ".[dask]"``
        in a checkout). A write with ``compute=True`` of a dataset without dask
        variables needs no dask.

    Notes
    -----
    Device values of arrays whose codecs have no GPU encoder (a compressor or option
    the batched encoder does not write, filters, a checksum on the chunks, a
    non-default level with ``levels="host"``; the Writing page lists them) are copied
    to the host and encoded by zarr-python, with one ``RuntimeWarning`` per array that
    names the codecs and the reason.
    """
    if levels not in _LEVELS:
        raise ValueError(f"levels must be one of {_LEVELS}, not {levels!r}")
    prepared = _prepared(ds, kwargs)
    store = _opened(store, kwargs)
    if not isinstance(store, Store):
        store = _as_store(store, kwargs.pop("storage_options", None))
    if source_for(store).commits:
        return _write_committed(prepared, store, kwargs, levels)
    made = _missing_dirs(store)
    try:
        return _write_held(prepared, store, kwargs, levels, lock_timeout)
    except BaseException:
        _remove_empty(made)
        raise


def _prepared(ds: xr.Dataset, kwargs: dict[str, Any]) -> xr.Dataset:
    """``ds`` as xarray is given it: device values wrapped for a write made at once
    (:func:`for_direct_write`), as one-block dask arrays for a ``compute=False`` write
    (:func:`for_device_write`, which needs dask)."""
    if kwargs.get("compute", True):
        return for_direct_write(ds)[0]
    _require_dask()
    prepared, user_dask = for_device_write(ds)
    if not user_dask:
        # every dask variable is one of the one-block ones made here: one task writes
        # each variable, so no two tasks share a chunk (xarray's check would refuse
        # region writes that start inside a chunk, which it allows for numpy values)
        kwargs.setdefault("safe_chunks", False)
    return prepared


def _opened(store: Any, kwargs: dict[str, Any]) -> Any:
    """The store of a path or URL, opened by its store kind (the ``storage_options`` of
    ``kwargs`` dropped where the store took them); any other ``store`` as it is."""
    if isinstance(store, str | os.PathLike):
        opened = open_target(store, mode="w", storage_options=kwargs.get("storage_options"))
        if opened is not None and opened.storage_options is None:
            kwargs.pop("storage_options", None)  # the store took them
        store = store if opened is None else opened.store
    return store


def _missing_dirs(store: Store) -> list[Path]:
    """The directories a write into the local store ``store`` makes (its root and the
    missing ones above it, deepest first); none for other stores."""
    if not isinstance(store, LocalStore):
        return []
    missing = []
    path = Path(store.root).absolute()
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """Remove the directories ``dirs`` (deepest first) that a failed write made and
    left empty; one that holds anything stays, with those above it."""
    for path in dirs:
        try:
            path.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty: another writer's data, or what this one could not remove
            return


def _write_committed(
    prepared: xr.Dataset, store: Store, kwargs: dict[str, Any], levels: str
) -> Any:
    """The write into a store whose commit publishes it (an Icechunk session): its
    commit is the all-or-nothing guarantee, and it checks chunk keys against the
    metadata, so everything is written in the order zarr writes it, nothing held back."""
    try:
        with writing_to(store, levels):
            return _write(prepared, store, kwargs)
    except Exception as err:
        err.add_note(_uncommitted_note(store))
        raise


def _write_held(
    prepared: xr.Dataset,
    store: Store,
    kwargs: dict[str, Any],
    levels: str,
    lock_timeout: float | None,
) -> Any:
    """The write into any other store: its metadata goes to it after the data it
    describes (see :mod:`xarray_gds.deferred`); with ``compute=False`` after what this
    call writes, as xarray writes it at once (a store initialised with ``compute=False``
    is the template of later region writes). A remote store out of reach raises an
    error that says what to check."""
    held = HeldMetadataStore(store, lock_timeout=lock_timeout)
    failure: BaseException | None = None
    try:
        try:
            with writing_to(held, levels):
                result = _write(prepared, held, kwargs)
        except BaseException:
            held.discard()
            raise
        held.flush()
    except Exception as err:  # a remote store out of reach: say what to check
        failure = write_error(store, err)
        if failure is None:
            raise
    if failure is not None:  # raised outside the except block: nothing chained
        raise failure from None
    return result


def _uncommitted_note(store: Any) -> str:
    """What a failed write into an Icechunk session left: the repository as it was at
    its last commit, and the session holding part of the write."""
    session = getattr(store, "session", None)
    snapshot = getattr(session, "snapshot_id", None)
    at = f" (snapshot {snapshot})" if snapshot else ""
    return (
        "xarray-gds: the write into the Icechunk session failed and nothing was "
        f"committed: the repository is as it was at its last commit{at}. The session "
        "holds what the write did before it failed: call session.discard_changes() (or "
        "open a new session) before writing again, and do not commit this one."
    )


def _as_store(store: Any, storage_options: dict[str, Any] | None) -> Store:
    """The zarr Store of a store-like that is not one (as zarr makes it): the engine's
    pipeline is given to the arrays of this one store object (see
    :func:`xarray_gds.pipeline.writing_to`)."""
    from zarr.storage import FsspecStore, MemoryStore

    if isinstance(store, str):
        return FsspecStore.from_url(store, storage_options=storage_options, read_only=False)
    if type(store).__name__ == "FSMap":
        return FsspecStore.from_mapper(store, read_only=False)
    if isinstance(store, dict):
        return MemoryStore(store_dict=store)
    raise TypeError(
        f"store must be a path, a URL, a zarr Store, an fsspec mapper or a dict, "
        f"not {type(store).__name__}"
    )

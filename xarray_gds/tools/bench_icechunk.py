"""The ``icechunk-*`` benchmark cases: Icechunk repositories.

``icechunk-2var``: the case's Zarr store (4 MiB zstd chunks, two variables ``t`` and
``v1``) copied into an Icechunk repository on local filesystem storage, then every
variable opened and loaded into GPU memory from one read-only session by:

- ``gds-zarr`` (chunks read where Icechunk says they lie, by kvikio; nvCOMP decodes),
  eagerly and with ``chunks={}``;
- ``engine="zarr"`` on the same session (``IcechunkStore.get``, zarr-python decodes),
  then ``cupy.asarray``, eagerly and with ``chunks={}``.

``icechunk-virtual``: the variable ``t`` written as a NetCDF4 file (zlib level 1 +
shuffle, as :mod:`xarray_gds.tools.bench_refs` writes it), VirtualiZarr's references to
it stored in an Icechunk repository; ``gds-zarr`` over the repository against
``engine="h5netcdf"`` over the file (then ``cupy.asarray``) and ``engine="zarr"`` over
the repository.

The ``host-`` variants load on the host (``device="cpu"``, numpy): smoke tests of the
cases for machines without a GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xarray as xr

from xarray_gds import device as _device
from xarray_gds.tools import bench_bounds
from xarray_gds.tools.bench_refs import note, write_netcdf

__all__ = [
    "contenders",
    "host_contenders",
    "host_virtual_contenders",
    "note",
    "to_repository",
    "virtual_contenders",
    "virtual_repository",
]


def _icechunk() -> Any:
    """The ``icechunk`` module, its log lines (Rust warnings about local storage,
    written to stderr) limited to errors unless ``ICECHUNK_LOG`` says otherwise: the
    benchmark's output is its table."""
    import icechunk

    if "ICECHUNK_LOG" not in os.environ:
        icechunk.set_logs_filter("error")
    return icechunk


def to_repository(store: Path) -> Any:
    """An Icechunk repository (local filesystem storage, beside ``store``) holding the
    arrays of the Zarr store ``store`` with their chunks and codecs, in one commit."""
    icechunk = _icechunk()

    repo = icechunk.Repository.create(
        icechunk.local_filesystem_storage(str(store.with_name(f"{store.stem}.icechunk")))
    )
    session = repo.writable_session("main")
    ds = xr.open_dataset(store, engine="zarr", chunks={}, consolidated=False)
    encoding = {
        name: {"chunks": var.encoding["chunks"], "compressors": var.encoding["compressors"]}
        for name, var in ds.data_vars.items()
    }
    for var in ds.variables.values():  # written as the encoding above says
        var.encoding = {}
    ds.to_zarr(session.store, mode="w", encoding=encoding, consolidated=False)
    session.commit("bench")
    return repo


def _load(repo: Any, engine: str, device: str | None, chunks: dict[str, Any] | None) -> list[Any]:
    """Every data variable of the repository's main branch, loaded (into GPU memory:
    CuPy, when ``device`` is "cuda")."""
    store = repo.readonly_session("main").store
    kwargs: dict[str, Any] = {} if chunks is None else {"chunks": chunks}
    if engine == "gds-zarr":
        from xarray_gds.chunks import GdsDaskManager

        if chunks is not None and device == "cuda":
            kwargs["chunked_array_type"] = GdsDaskManager()
        kwargs.update(device=device, storage_options={"icechunk_storage": repo.storage})
    ds = xr.open_dataset(store, engine=engine, **kwargs)
    if engine != "gds-zarr" and device == "cuda":
        cp = _device.cupy()
        return [cp.asarray(var.values) for var in ds.data_vars.values()]
    return [var.compute().data for var in ds.data_vars.values()]


def _loads(repo: Any, device: str) -> dict[str, Callable[[], Any]]:
    """Each engine's load of the repository, eager and with ``chunks={}``."""
    loads: dict[str, Callable[[], Any]] = {
        f"{engine}{suffix}": functools.partial(_load, repo, engine, device, chunks)
        for engine in ("gds-zarr", "zarr")
        for suffix, chunks in (("", None), (" chunks={}", {}))
    }
    store = repo.readonly_session("main").store
    options = {"icechunk_storage": repo.storage}
    on_device = device == "cuda"
    return loads | bench_bounds.read_bound(store, on_device=on_device, storage_options=options)


def contenders(store: Path) -> dict[str, Callable[[], Any]]:
    """The ``icechunk-2var`` case (see the module)."""
    return _loads(to_repository(store), "cuda")


def host_contenders(store: Path) -> dict[str, Callable[[], Any]]:
    """The same loads on the host (numpy)."""
    return _loads(to_repository(store), "cpu")


def virtual_repository(store: Path) -> tuple[Path, Any]:
    """The NetCDF4 file of the bench store's ``t`` and an Icechunk repository of
    VirtualiZarr's references to it (local storage, the file's folder authorised as a
    virtual chunk container)."""
    from obspec_utils.registry import ObjectStoreRegistry
    from obstore.store import LocalStore
    from virtualizarr import open_virtual_dataset
    from virtualizarr.parsers import HDFParser

    icechunk = _icechunk()
    nc = write_netcdf(store, store.with_name(f"{store.stem}.nc")).resolve()
    prefix = f"file://{nc.parent}/"
    registry = ObjectStoreRegistry({"file://": LocalStore()})
    vds = open_virtual_dataset(f"file://{nc}", registry=registry, parser=HDFParser())
    config = icechunk.RepositoryConfig.default()
    config.set_virtual_chunk_container(
        icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(str(nc.parent)))
    )
    repo = icechunk.Repository.create(
        icechunk.local_filesystem_storage(str(store.with_name(f"{store.stem}.virtual"))),
        config=config,
        authorize_virtual_chunk_access={prefix: icechunk.credentials.LocalFileSystemAccess},
    )
    session = repo.writable_session("main")
    vds.vz.to_icechunk(session.store)
    session.commit("virtual")
    return nc, repo


def virtual_contenders(store: Path) -> dict[str, Callable[[], Any]]:
    """The ``icechunk-virtual`` case (see the module)."""
    nc, repo = virtual_repository(store)
    cp = _device.cupy()
    return {
        "gds-zarr": lambda: _load(repo, "gds-zarr", "cuda", None),
        "gds-zarr chunks={}": lambda: _load(repo, "gds-zarr", "cuda", {}),
        "h5netcdf": lambda: cp.asarray(xr.open_dataset(nc, engine="h5netcdf")["t"].values),
        "zarr": lambda: _load(repo, "zarr", "cuda", None),
    }


def host_virtual_contenders(store: Path) -> dict[str, Callable[[], Any]]:
    """The virtual case's eager loads on the host (numpy)."""
    nc, repo = virtual_repository(store)
    return {
        "gds-zarr": lambda: _load(repo, "gds-zarr", "cpu", None),
        "h5netcdf": lambda: xr.open_dataset(nc, engine="h5netcdf")["t"].values,
        "zarr": lambda: _load(repo, "zarr", "cpu", None),
    }

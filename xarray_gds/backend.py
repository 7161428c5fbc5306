"""The ``gds-zarr`` xarray backend engine."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr
from xarray import conventions
from xarray.backends import BackendEntrypoint, ZarrStore
from xarray.backends.common import datatree_from_dict_with_io_cleanup
from xarray.core import indexing
from xarray.core.treenode import NodePath
from xarray.core.utils import close_on_error
from zarr.abc.store import Store

from xarray_gds import device as _device
from xarray_gds import fuse
from xarray_gds.array import GdsBackendArray, HostDecodedArray
from xarray_gds.cf import plan_cf_decoding
from xarray_gds.pipeline import use_gds_pipeline
from xarray_gds.store import GdsStore

__all__ = ["GdsZarrBackendEntrypoint", "open_store", "placement"]

_ROOT_METADATA = ("zarr.json", ".zgroup", ".zarray", ".zmetadata")


def open_store(filename_or_obj: str | os.PathLike[str] | Store) -> Store:
    """Return a read-only zarr Store for a local path (a :class:`GdsStore`) or a Store.

    Raises
    ------
    FileNotFoundError
        The path does not exist.
    ValueError
        The path exists but is not a Zarr store.
    """
    if isinstance(filename_or_obj, Store):
        return filename_or_obj
    if not isinstance(filename_or_obj, str | os.PathLike):
        raise TypeError(
            "engine='gds-zarr' opens a local Zarr directory (str or os.PathLike) or a "
            f"zarr.abc.store.Store, not {type(filename_or_obj).__name__}"
        )
    text = os.fspath(filename_or_obj)
    if "://" in text and not text.startswith("file://"):
        raise ValueError(
            f"engine='gds-zarr' reads local directories only, got {text!r}; for remote "
            "stores pass a zarr Store object (e.g. zarr.storage.FsspecStore)"
        )
    path = Path(text.removeprefix("file://")).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"No such Zarr store: '{path}'")
    if not path.is_dir() or not any((path / name).exists() for name in _ROOT_METADATA):
        raise ValueError(
            f"'{path}' is not a Zarr store: it is not a directory holding "
            "zarr.json (Zarr v3) or .zgroup/.zarray/.zmetadata (Zarr v2)"
        )
    return GdsStore(path, read_only=True)


def _group_paths(store: Store, zarr_format: int | None) -> list[str]:
    try:
        root = zarr.open_group(store, mode="r", zarr_format=zarr_format)  # type: ignore[arg-type]
    except Exception:
        return []
    groups = (path for path, node in root.members(max_depth=None) if isinstance(node, zarr.Group))
    return ["/", *sorted("/" + path for path in groups)]


def _open_zarr_stores(
    store: Store,
    *,
    group: str | None,
    consolidated: bool | None,
    zarr_format: int | None,
    all_groups: bool,
) -> dict[str, ZarrStore]:
    """xarray ZarrStores (read-only) for ``group``, and its subgroups if ``all_groups``."""
    if zarr_format not in (None, 2, 3):
        raise ValueError(f"zarr_format must be 2, 3 or None, got {zarr_format!r}")
    if consolidated not in (None, True, False):
        raise TypeError(f"consolidated must be True, False or None, got {consolidated!r}")
    kwargs: dict[str, Any] = dict(
        mode="r", group=group, consolidated=consolidated, zarr_format=zarr_format
    )
    try:
        # arrays opened here read through the batched pipeline (see pipeline.py)
        with use_gds_pipeline():
            if all_groups:
                return ZarrStore.open_store(store, **kwargs)
            return {group or "/": ZarrStore.open_group(store, **kwargs)}
    except (KeyError, FileNotFoundError) as err:
        if group in (None, "", "/"):
            raise
        existing = _group_paths(store, zarr_format)
        if not existing or group.strip("/") in (p.strip("/") for p in existing):
            raise
        raise FileNotFoundError(
            f"group {group!r} not found in Zarr store {store}; the groups in it are: "
            + ", ".join(repr(p) for p in existing)
        ) from err


def placement(name: str, variable: xr.Variable) -> _device.Device | None:
    """Where a decoded variable belongs: ``"cuda"`` for numeric data, else the host.

    Index coordinates (1-D variables named after their dimension, which xarray turns
    into pandas indexes), 0-d variables, strings, datetimes and timedeltas stay on the
    host; every other numeric (bool, integer, float, complex) variable goes to the
    device. 0-d variables stay on the host because dask never chunks them and xarray
    combines them with numpy (``open_mfdataset`` broadcasts them along the
    concatenation dimension); a selection from a device variable stays on the device
    whatever its shape.

    Returns
    -------
    "cuda" or None
        ``None`` means "host, read by xarray's own zarr path".
    """
    if variable.dims == (name,) or variable.ndim == 0:
        return None
    return "cuda" if variable.dtype.kind in "biufc" else None


def _dataset_from_store(
    zstore: ZarrStore,
    device: _device.Device,
    *,
    mask_and_scale: bool | Mapping[str, bool],
    decode_times: Any,
    concat_characters: Any,
    decode_coords: Any,
    drop_variables: str | Iterable[str] | None,
    use_cftime: Any,
    decode_timedelta: Any,
) -> xr.Dataset:
    fuse.install()  # dask blocks of these arrays read in joined batches (xarray_gds.fuse)
    raw_vars, attrs = zstore.load()
    encoding = zstore.get_encoding()
    # xarray's decoders may pop CF attributes from the variables they are given
    raw_attrs = {name: dict(var.attrs) for name, var in raw_vars.items()}
    decoded, attrs, coord_names = conventions.decode_cf_variables(
        raw_vars,
        attrs,
        mask_and_scale=mask_and_scale,
        decode_times=decode_times,
        concat_characters=concat_characters,
        decode_coords=decode_coords,
        drop_variables=drop_variables,
        use_cftime=use_cftime,
        decode_timedelta=decode_timedelta,
    )
    members = zstore.members
    data_vars: dict[str, xr.Variable] = {}
    coord_vars: dict[str, xr.Variable] = {}
    for name, var in decoded.items():
        if placement(name, var) is not None:
            zarr_array = members[name]
            assert isinstance(zarr_array, zarr.Array)
            plan = plan_cf_decoding(
                name,
                raw_attrs[name],
                np.dtype(zarr_array.dtype).newbyteorder("="),
                var.dtype,
                var.encoding,
                mask_and_scale,
            )
            lazy: Any = (
                GdsBackendArray(zarr_array, name, device, plan)
                if plan is not None
                # Variable._data is xarray's lazily decoded array: read it on the
                # host and move the result (see HostDecodedArray).
                else HostDecodedArray(var._data, device)
            )
            var = xr.Variable(var.dims, indexing.LazilyIndexedArray(lazy), var.attrs, var.encoding)
        if name in coord_names or var.dims == (name,):
            coord_vars[name] = var
        else:
            data_vars[name] = var
    coords = xr.Coordinates(coord_vars, indexes={})
    ds = xr.Dataset(data_vars, coords=coords, attrs=attrs)
    ds.set_close(zstore.close)
    ds.encoding = encoding
    return ds


class GdsZarrBackendEntrypoint(BackendEntrypoint):
    """Open Zarr stores (formats 2 and 3) with chunks read into GPU memory.

    Use it through xarray: ``xr.open_dataset(path, engine="gds-zarr")``,
    ``xr.open_datatree(path, engine="gds-zarr")`` or
    ``xr.open_groups(path, engine="gds-zarr")``.

    Numeric variables that are not index coordinates come back as CuPy arrays when a
    GPU is used, numpy arrays otherwise; see :func:`placement`. The engine never
    claims a path on its own (``guess_can_open`` is False), so ``engine="zarr"``
    keeps auto-detection of ``.zarr`` paths.
    """

    description = "Open Zarr stores into GPU memory (kvikio reads, CuPy arrays)"
    url = "https://github.com/xarray-gds/xarray-gds"
    supports_groups = True
    open_dataset_parameters = (
        "filename_or_obj",
        "mask_and_scale",
        "decode_times",
        "concat_characters",
        "decode_coords",
        "drop_variables",
        "use_cftime",
        "decode_timedelta",
        "group",
        "consolidated",
        "zarr_format",
        "device",
    )

    def guess_can_open(self, filename_or_obj: Any) -> bool:
        return False

    def open_dataset(  # type: ignore[override]
        self,
        filename_or_obj: str | os.PathLike[str] | Store,
        *,
        mask_and_scale: bool | Mapping[str, bool] = True,
        decode_times: Any = True,
        concat_characters: Any = True,
        decode_coords: Any = True,
        drop_variables: str | Iterable[str] | None = None,
        use_cftime: Any = None,
        decode_timedelta: Any = None,
        group: str | None = None,
        consolidated: bool | None = None,
        zarr_format: int | None = None,
        device: str | None = None,
    ) -> xr.Dataset:
        """Open one group of a Zarr store as a lazily indexed Dataset.

        Parameters
        ----------
        filename_or_obj : str, os.PathLike or zarr.abc.store.Store
            A local Zarr directory, or any zarr Store.
        mask_and_scale : bool or mapping of name to bool
            As for :func:`xarray.open_dataset`.
        decode_times : bool, CFDatetimeCoder or mapping
            As for :func:`xarray.open_dataset`.
        concat_characters : bool or mapping
            As for :func:`xarray.open_dataset`.
        decode_coords : bool or {"coordinates", "all"}
            As for :func:`xarray.open_dataset`.
        drop_variables : str or iterable of str, optional
            Variables to leave out.
        use_cftime : bool, optional
            As for :func:`xarray.open_dataset` (deprecated there in favour of
            ``decode_times=xr.coders.CFDatetimeCoder(use_cftime=...)``).
        decode_timedelta : bool, CFTimedeltaCoder or mapping, optional
            As for :func:`xarray.open_dataset`.
        group : str, optional
            Path of the group to open.
        consolidated : bool or None
            Use consolidated metadata: ``None`` tries it and falls back, ``True``
            requires it, ``False`` ignores it (as ``engine="zarr"``).
        zarr_format : {None, 2, 3}
            Zarr format to read; ``None`` detects it.
        device : {None, "cuda", "cpu"}
            Where numeric variables are placed. ``None`` uses the GPU when one is
            usable and otherwise warns once and reads on the host.
        """
        dev = _device.resolve_device(device)
        store = open_store(filename_or_obj)
        (zstore,) = _open_zarr_stores(
            store,
            group=group,
            consolidated=consolidated,
            zarr_format=zarr_format,
            all_groups=False,
        ).values()
        with close_on_error(zstore):
            return _dataset_from_store(
                zstore,
                dev,
                mask_and_scale=mask_and_scale,
                decode_times=decode_times,
                concat_characters=concat_characters,
                decode_coords=decode_coords,
                drop_variables=drop_variables,
                use_cftime=use_cftime,
                decode_timedelta=decode_timedelta,
            )

    def open_groups_as_dict(  # type: ignore[override]
        self,
        filename_or_obj: str | os.PathLike[str] | Store,
        *,
        mask_and_scale: bool | Mapping[str, bool] = True,
        decode_times: Any = True,
        concat_characters: Any = True,
        decode_coords: Any = True,
        drop_variables: str | Iterable[str] | None = None,
        use_cftime: Any = None,
        decode_timedelta: Any = None,
        group: str | None = None,
        consolidated: bool | None = None,
        zarr_format: int | None = None,
        device: str | None = None,
    ) -> dict[str, xr.Dataset]:
        """Open ``group`` and every group below it; keys are paths relative to it."""
        dev = _device.resolve_device(device)
        store = open_store(filename_or_obj)
        parent = str(NodePath("/") / NodePath(group)) if group else "/"
        stores = _open_zarr_stores(
            store,
            group=parent,
            consolidated=consolidated,
            zarr_format=zarr_format,
            all_groups=True,
        )
        out: dict[str, xr.Dataset] = {}
        for path, zstore in stores.items():
            with close_on_error(zstore):
                ds = _dataset_from_store(
                    zstore,
                    dev,
                    mask_and_scale=mask_and_scale,
                    decode_times=decode_times,
                    concat_characters=concat_characters,
                    decode_coords=decode_coords,
                    drop_variables=drop_variables,
                    use_cftime=use_cftime,
                    decode_timedelta=decode_timedelta,
                )
            key = str(NodePath(path).relative_to(parent)) if group else str(NodePath(path))
            out[key] = ds
        return out

    def open_datatree(  # type: ignore[override]
        self, filename_or_obj: str | os.PathLike[str] | Store, **kwargs: Any
    ) -> xr.DataTree:
        """Open a store as a :class:`xarray.DataTree`; arguments as :meth:`open_dataset`."""
        return datatree_from_dict_with_io_cleanup(
            self.open_groups_as_dict(filename_or_obj, **kwargs)
        )

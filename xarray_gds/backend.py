"""The ``gds-zarr`` xarray backend engine."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import xarray as xr
import zarr
from xarray import conventions
from xarray.backends import BackendEntrypoint, ZarrStore
from xarray.backends.common import NONE_VAR_NAME, datatree_from_dict_with_io_cleanup
from xarray.backends.zarr import ZarrArrayWrapper
from xarray.core import indexing
from xarray.core.treenode import NodePath
from xarray.core.utils import close_on_error
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.group import GroupMetadata
from zarr.core.sync import sync

from xarray_gds import config, documents, fuse
from xarray_gds import device as _device
from xarray_gds.array import GdsBackendArray, HostDecodedArray, ReadAhead
from xarray_gds.cf import plan_cf_decoding
from xarray_gds.codecs import netcdf_filters
from xarray_gds.errors import ConsolidatedMetadataWarning, warn
from xarray_gds.pipeline import attach, read_as_netcdf
from xarray_gds.stores import Opened, open_target
from xarray_gds.stores.urls import redact

__all__ = ["GdsZarrBackendEntrypoint", "open_store", "placement"]

#: ``mode`` values that open an existing store (``"a-"`` is xarray's own ``"a"``)
_READ_MODES = ("r", "r+", "a", "a-")


def open_store(
    filename_or_obj: str | os.PathLike[str] | Store,
    *,
    read_only: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> Store:
    """Return a zarr Store for a local path (a :class:`GdsStore`) or a Store.

    Parameters
    ----------
    filename_or_obj : str, os.PathLike or zarr.abc.store.Store
        A local Zarr directory (``file://`` URLs too), or any zarr Store (returned as
        it is).
    read_only : bool
        Open a local directory read-only (``mode="r"``) or writable (``"r+"``, ``"a"``).

    Raises
    ------
    FileNotFoundError
        The path does not exist.
    ValueError
        The path exists but is not a Zarr store, or it is a remote URL.
    TypeError
        ``filename_or_obj`` is neither a path nor a Store.
    """
    if isinstance(filename_or_obj, Store):
        return filename_or_obj
    mode = "r" if read_only else "r+"
    store = _opened(filename_or_obj, mode, storage_options, None).store
    _finish_open(store)
    return store


def _opened(
    target: Any, mode: str, storage_options: dict[str, Any] | None, consolidated: bool | None
) -> Opened:
    """``target`` opened by the first store kind that opens it (see
    :mod:`xarray_gds.stores`)."""
    opened = open_target(
        target, mode=mode, storage_options=storage_options, consolidated=consolidated
    )
    if opened is not None:
        return opened
    if isinstance(target, zarr.Array):
        raise TypeError(_array_hint(target))
    if isinstance(target, ZarrStore):
        raise TypeError(
            "engine='gds-zarr' takes an xarray ZarrStore as the store= argument (as "
            "engine='zarr' does), not as filename_or_obj; or pass its zarr Store: "
            "xr.open_dataset(zarr_store.zarr_group.store, group=zarr_store.zarr_group.path, "
            "engine='gds-zarr')"
        )
    raise TypeError(
        "engine='gds-zarr' opens a local Zarr directory (str or os.PathLike), a "
        f"zarr.abc.store.Store or a zarr.Group, not {type(target).__name__}"
    )


def _array_hint(array: zarr.Array) -> str:
    """What to pass instead of a ``zarr.Array``: the group that holds it, then the variable;
    a store whose root is an array has no group, so zarr reads it."""
    parent, _, name = array.path.strip("/").rpartition("/")
    if not name:
        return (
            "engine='gds-zarr' opens Zarr groups as Datasets, and this zarr.Array is the "
            "root of its store, so no group holds it: read it with zarr instead "
            "(array[...]; into GPU memory: `with zarr.config.enable_gpu(): array[...]`), "
            "or write it into a group with a name and dimension names and open that group"
        )
    group = f"group={parent!r}, " if parent else ""
    return (
        f"engine='gds-zarr' opens Zarr groups as Datasets, not the zarr.Array {array.path!r}; "
        f"open the group that holds it and pick the variable: "
        f"xr.open_dataset(array.store, {group}engine='gds-zarr')[{name!r}]"
    )


def _in_group(filename_or_obj: Any, group: str | None, mode: str) -> tuple[Any, str | None]:
    """What to open and the group path in it; a ``zarr.Group`` stands for its store
    and path (``group`` is then relative to it)."""
    if mode not in _READ_MODES:
        raise ValueError(
            f"engine='gds-zarr' opens existing stores: mode must be one of {_READ_MODES}, "
            f"not {mode!r} (with engine='zarr', 'w' erases the store and 'w-' creates "
            "one); write with xarray_gds.to_zarr or Dataset.to_zarr"
        )
    if isinstance(filename_or_obj, zarr.Group):
        base = filename_or_obj.path.strip("/")
        if not base:
            return filename_or_obj.store, group
        sub = (group or "").strip("/")
        return filename_or_obj.store, f"{base}/{sub}" if sub else base
    return filename_or_obj, group


def _store_name(name: Any) -> str:
    """The zarr array name of a variable (xarray stores a variable named ``None`` as
    ``"__values__"``)."""
    return NONE_VAR_NAME if name is None else str(name)


def _group_paths(store: Store, zarr_format: int | None) -> list[str]:
    try:
        root = zarr.open_group(store, mode="r", zarr_format=zarr_format)  # type: ignore[arg-type]
    except Exception:
        return []
    groups = (path for path, node in root.members(max_depth=None) if isinstance(node, zarr.Group))
    return ["/", *sorted("/" + path for path in groups)]


def consolidated_at_root(store: Store, group: str | None, zarr_format: int | None) -> bool:
    """Whether the store's root holds consolidated metadata that lists ``group`` (the
    root itself when ``group`` is empty or "/"): the metadata xarray's engine="zarr"
    reads a group from, whichever group is asked for.

    Raises
    ------
    MetadataError
        The root's consolidated metadata is there but damaged (a ``.zmetadata`` or a
        root ``zarr.json`` that does not parse).
    """
    listed = _v3_root_listing(store, zarr_format)
    if listed is None:
        try:
            root = zarr.open_consolidated(store, mode="r", path="", zarr_format=zarr_format)
        except Exception as err:  # no consolidated metadata at the root, or no root
            damage = documents.consolidated_damage(store, "", zarr_format)
            if damage is not None:
                raise damage from err
            return False
        listed = root.metadata.consolidated_metadata
    path = (group or "").strip("/")
    return listed is not None and (not path or path in listed.flattened_metadata)


def _v3_root_listing(store: Store, zarr_format: int | None) -> Any:
    """The consolidated metadata of a Zarr v3 root group, parsed by zarr from the root's
    one document (``zarr.open_consolidated`` without a format asks for four, through
    its event loop); None where the root is no such
    group or its document does not parse (``zarr.open_consolidated`` then decides)."""
    if zarr_format == 2:
        return None
    try:
        doc = sync(store.get("zarr.json", default_buffer_prototype()))
        meta = None if doc is None else json.loads(doc.to_bytes())
        if not isinstance(meta, dict) or meta.get("node_type") != "group":
            return None
        return GroupMetadata.from_dict(meta).consolidated_metadata
    except Exception:
        return None


def _consolidated(store: Store, group: str | None, zarr_format: int | None) -> bool | None:
    """Whether the group has consolidated metadata (``consolidated=None``), as xarray
    decides it (the root's consolidated metadata, which lists every group below it),
    but warning at the user's line in the package's own category (xarray's warning
    would point into this module). None: the group does not open at all (the open that
    follows raises what engine="zarr" raises)."""
    if consolidated_at_root(store, group, zarr_format):  # MetadataError where damaged
        return True
    where: dict[str, Any] = {"path": group or "", "zarr_format": zarr_format}
    try:
        zarr.open_group(store, mode="r", use_consolidated=False, **where)
    except Exception:
        return None
    warn(
        f"xarray-gds: the Zarr store {redact(str(store), None)} has no consolidated "
        "metadata, so every array's "
        "metadata is read on its own. Consolidate it once with "
        "zarr.consolidate_metadata(store), or pass consolidated=False to skip this check.",
        ConsolidatedMetadataWarning,
    )
    return False


#: arguments of open_dataset that xarray's CF decoding takes
_DECODERS = (
    "mask_and_scale",
    "decode_times",
    "concat_characters",
    "decode_coords",
    "drop_variables",
    "use_cftime",
    "decode_timedelta",
)
#: arguments of open_dataset that say how the store is opened
_OPEN_ARGUMENTS = (
    "mode",
    "consolidated",
    "storage_options",
    "zarr_format",
    "use_zarr_fill_value_as_mask",
    "cache_members",
)


def _bind(open_dataset: Any, filename_or_obj: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of ``open_dataset`` for these (defaults filled in); a name it does
    not take raises TypeError naming it, as a call of it would."""
    if kwargs.get("store") is not None:
        raise TypeError("store= is not taken when opening groups; pass the store itself")
    bound = inspect.signature(open_dataset).bind(filename_or_obj, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _open_stores(
    filename_or_obj: Any,
    group: str | None,
    *,
    mode: str,
    consolidated: bool | None,
    storage_options: dict[str, Any] | None,
    all_groups: bool,
    **kwargs: Any,
) -> tuple[str | None, dict[str, ZarrStore]]:
    """The group path in the store (``group`` resolved against a zarr Group given as
    ``filename_or_obj``), and the xarray ZarrStores of ``filename_or_obj`` (a path, URL,
    Store, zarr Group or set of kerchunk references): that group, and the groups below
    it if ``all_groups``."""
    target, group = _in_group(filename_or_obj, group, mode)
    store, storage_options, consolidated = _opened(target, mode, storage_options, consolidated)
    root = group
    if all_groups:  # the root of the groups, as a path from the store's root
        root = str(NodePath("/") / NodePath(group)) if group else "/"
    try:
        return group, _open_zarr_stores(
            store,
            group=root,
            mode=mode,
            consolidated=consolidated,
            storage_options=storage_options,
            all_groups=all_groups,
            **kwargs,
        )
    finally:
        _finish_open(store)


def _finish_open(store: Any) -> None:
    """End the open of a store that holds the metadata documents read while it opens
    (a remote store the engine opened: its check that a store is there, the
    consolidated metadata and xarray's open of the group ask the server once for each
    document); later reads go to the server."""
    finish = getattr(store, "finish_open", None)
    if callable(finish):
        finish()


def _open_zarr_stores(
    store: Store, *, group: str | None, all_groups: bool, **kwargs: Any
) -> dict[str, ZarrStore]:
    """xarray ZarrStores for ``group``, and its subgroups if ``all_groups``; the other
    arguments (:data:`_OPEN_ARGUMENTS`) mean what they mean to
    ``ZarrStore.open_group`` (engine="zarr")."""
    zarr_format, consolidated = kwargs["zarr_format"], kwargs["consolidated"]
    if zarr_format not in (None, 2, 3):
        raise ValueError(f"zarr_format must be 2, 3 or None, got {zarr_format!r}")
    for name in ("consolidated", "use_zarr_fill_value_as_mask"):
        if kwargs[name] not in (None, True, False):
            raise TypeError(f"{name} must be True, False or None, got {kwargs[name]!r}")
    if not getattr(store, "supports_consolidated_metadata", True):
        kwargs["consolidated"] = consolidated = False  # as engine="zarr" (Icechunk)
    if consolidated is None:
        kwargs["consolidated"] = _consolidated(store, group, zarr_format)
    kwargs.update(group=group, consolidate_on_close=False)
    kwargs["cache_members"] = bool(kwargs["cache_members"])
    try:
        with documents.naming_damage(store, group, consolidated=kwargs["consolidated"]):
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


def _nczarr_shuffles(
    raw_vars: Mapping[str, xr.Variable], members: Mapping[str, Any]
) -> dict[str, xr.Variable]:
    """The raw variables of a group, those whose arrays hold NCZarr's shuffle of
    ``elementsize`` 0 read through zarr as netCDF-C reads them
    (:func:`~xarray_gds.pipeline.read_as_netcdf`): xarray's own reads of them (index
    coordinates, datetimes, :class:`HostDecodedArray`) included."""
    fixed = dict(raw_vars)
    for name, var in raw_vars.items():
        array = members.get(_store_name(name))
        if isinstance(array, zarr.Array) and netcdf_filters(array.metadata) is not None:
            data = indexing.LazilyIndexedArray(ZarrArrayWrapper(read_as_netcdf(array)))
            fixed[name] = xr.Variable(var.dims, data, var.attrs, var.encoding)
    return fixed


def _dataset_from_store(
    zstore: ZarrStore, device: _device.Device, decoders: dict[str, Any], gpu: int | None = None
) -> xr.Dataset:
    """The dataset of one group: xarray's CF decoding (``decoders``: the arguments of
    open_dataset named in :data:`_DECODERS`), numeric variables read by the engine (on
    GPU number ``gpu`` when given, see :func:`xarray_gds.device.resolve`)."""
    config.validate()
    fuse.install()  # the engine's arrays are made here: dask's pass comes with them
    group = zstore.zarr_group
    listed = group.metadata.consolidated_metadata is not None
    with documents.naming_damage(group.store, group.path, consolidated=listed):
        raw_vars, attrs = zstore.load()  # members listed here with cache_members=False
    raw_vars = _nczarr_shuffles(raw_vars, zstore.members)
    encoding = zstore.get_encoding()
    # xarray's decoders may pop CF attributes from the variables they are given
    raw_attrs = {name: dict(var.attrs) for name, var in raw_vars.items()}
    decoded, attrs, coord_names = conventions.decode_cf_variables(raw_vars, attrs, **decoders)
    mask_and_scale = decoders["mask_and_scale"]
    members = zstore.members
    ahead = ReadAhead()  # a loop over the variables reads them in one batch
    data_vars: dict[str, xr.Variable] = {}
    coord_vars: dict[str, xr.Variable] = {}
    for name, var in decoded.items():
        if placement(name, var) is not None:
            zarr_array = members[_store_name(name)]
            assert isinstance(zarr_array, zarr.Array)
            attach(zarr_array)  # this array only: read through the batched pipeline
            plan = plan_cf_decoding(
                name,
                raw_attrs[name],
                np.dtype(zarr_array.dtype).newbyteorder("="),
                var.dtype,
                var.encoding,
                mask_and_scale,
            )
            lazy: Any = (
                GdsBackendArray(zarr_array, _store_name(name), device, plan, ahead, gpu)
                if plan is not None
                # Variable._data is xarray's lazily decoded array: read it on the
                # host and move the result (see HostDecodedArray).
                else HostDecodedArray(var._data, device, gpu)
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
    ``xr.open_groups(path, engine="gds-zarr")``. Every argument of
    ``engine="zarr"`` is accepted with the same meaning, plus ``device``.

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
        *_DECODERS,
        "group",
        *_OPEN_ARGUMENTS,
        "store",
        "engine",
        "device",
    )

    def guess_can_open(self, filename_or_obj: Any) -> bool:
        return False

    def open_dataset(  # type: ignore[override]
        self,
        filename_or_obj: str | os.PathLike[str] | Store | zarr.Group | None,
        *,
        mask_and_scale: bool | Mapping[str, bool] = True,
        decode_times: Any = True,
        concat_characters: Any = True,
        decode_coords: Any = True,
        drop_variables: str | Iterable[str] | None = None,
        use_cftime: Any = None,
        decode_timedelta: Any = None,
        group: str | None = None,
        mode: str = "r",
        consolidated: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        zarr_format: int | None = None,
        store: ZarrStore | None = None,
        engine: Any = None,
        use_zarr_fill_value_as_mask: bool | None = None,
        cache_members: bool = True,
        device: str | None = None,
    ) -> xr.Dataset:
        """Open one group of a Zarr store as a lazily indexed Dataset.

        Parameters
        ----------
        filename_or_obj : str, os.PathLike, zarr.abc.store.Store or zarr.Group
            A local Zarr directory, any zarr Store, or a ``zarr.Group`` (its store, at its
            path). A ``zarr.Array`` is refused with a ``TypeError`` that says what to pass.
        mask_and_scale, decode_times, concat_characters, decode_coords, drop_variables
            As for :func:`xarray.open_dataset`.
        use_cftime, decode_timedelta : optional
            As for :func:`xarray.open_dataset` (``use_cftime`` is deprecated there in
            favour of ``decode_times=xr.coders.CFDatetimeCoder(use_cftime=...)``).
        group : str, optional
            Path of the group to open (relative to a ``zarr.Group`` given as ``filename_or_obj``).
        mode : {"r", "r+", "a", "a-"}
            How the store is opened, as with ``engine="zarr"``: ``"r"`` (default) read-only;
            the others open it writable (a local directory becomes a writable
            :class:`GdsStore`), which changes nothing in what is read but turns off the
            NCZarr dimension fallback, as with ``engine="zarr"``. ``"w"`` and ``"w-"``,
            which erase or create a store with ``engine="zarr"``, raise ``ValueError``.
        consolidated : bool or None
            Use consolidated metadata: ``None`` tries it and falls back, ``True``
            requires it, ``False`` ignores it (as ``engine="zarr"``).
        storage_options : dict, optional
            Options of the store a remote URL (``s3://``, ``http(s)://``, ...) is opened
            with (credentials, ``endpoint_url``, ...; see the remote stores page): the
            engine reads such URLs itself, with bounded retries, on the GPU through kvikio
            where it can. With a local path or a Store object, zarr raises ``TypeError``
            for them, as with ``engine="zarr"``.
        zarr_format : {None, 2, 3}
            Zarr format to read; ``None`` detects it.
        use_zarr_fill_value_as_mask : bool, optional
            Whether the Zarr arrays' ``fill_value`` masks values as a CF
            ``_FillValue`` does: ``None`` (default) means ``True`` for Zarr v2 and
            ``False`` for Zarr v3. With ``False``, a Zarr v3 ``fill_value`` goes to
            the variable's ``encoding["fill_value"]``. (``engine="zarr"`` documents
            this argument but passes ``None`` whatever it is given, pydata/xarray#10269;
            this engine applies it as ``xarray.backends.ZarrStore.open_group`` does.)
        cache_members : bool
            As with ``engine="zarr"``: ``True`` (default) lists the group's members
            once when it is opened; ``False`` lists them each time they are needed.
        store : xarray.backends.ZarrStore, optional
            An xarray ZarrStore already open: read from it and ignore
            ``filename_or_obj`` and the opening arguments, as ``engine="zarr"`` does.
        engine : optional
            Accepted and ignored, as by ``engine="zarr"``.
        device : {None, "cpu", "gpu", "cuda", "cuda:N"}
            Where numeric variables are placed. ``None`` uses the GPU when one is
            usable and otherwise warns once and reads on the host. ``"gpu"`` and
            ``"cuda"`` read into the CUDA device current at each read; ``"cuda:N"``
            into GPU number ``N`` (counted from 0), whichever device is current then.
        """
        given = locals()  # the arguments, before any other name is bound
        dev, gpu = _device.resolve(device)
        zstore = _one_store(store, filename_or_obj, group, given)
        with close_on_error(zstore):
            return _dataset_from_store(zstore, dev, {name: given[name] for name in _DECODERS}, gpu)

    def open_groups_as_dict(  # type: ignore[override]
        self, filename_or_obj: str | os.PathLike[str] | Store | zarr.Group, **kwargs: Any
    ) -> dict[str, xr.Dataset]:
        """Open ``group`` and every group below it; keys are paths relative to it.

        Takes every argument of :meth:`open_dataset` but ``store``, with the same
        meaning; ``group`` is the root of the groups opened.
        """
        args = _bind(self.open_dataset, filename_or_obj, kwargs)
        dev, gpu = _device.resolve(args["device"])
        opening = {name: args[name] for name in _OPEN_ARGUMENTS}
        group, stores = _open_stores(filename_or_obj, args["group"], **opening, all_groups=True)
        parent = str(NodePath("/") / NodePath(group)) if group else "/"
        decoders = {name: args[name] for name in _DECODERS}
        out: dict[str, xr.Dataset] = {}
        for path, zstore in stores.items():
            with close_on_error(zstore):
                ds = _dataset_from_store(zstore, dev, decoders, gpu)
            key = str(NodePath(path).relative_to(parent)) if group else str(NodePath(path))
            out[key] = ds
        return out

    def open_datatree(  # type: ignore[override]
        self, filename_or_obj: str | os.PathLike[str] | Store | zarr.Group, **kwargs: Any
    ) -> xr.DataTree:
        """Open a store as a :class:`xarray.DataTree`; arguments as :meth:`open_groups_as_dict`."""
        return datatree_from_dict_with_io_cleanup(
            self.open_groups_as_dict(filename_or_obj, **kwargs)
        )


def _one_store(
    store: ZarrStore | None,
    filename_or_obj: Any,
    group: str | None,
    given: Mapping[str, Any],
) -> ZarrStore:
    """The xarray ZarrStore ``open_dataset`` reads: ``store`` when one is given (checked
    to be one), else the group ``group`` of ``filename_or_obj`` opened with the opening
    arguments of ``given`` (:data:`_OPEN_ARGUMENTS`)."""
    if store is not None:
        if not isinstance(store, ZarrStore):
            raise TypeError(
                "store= takes an xarray.backends.ZarrStore (as with engine='zarr'), "
                f"not {type(store).__name__}; pass a zarr Store as filename_or_obj"
            )
        return store
    opening = {name: given[name] for name in _OPEN_ARGUMENTS}
    _, stores = _open_stores(filename_or_obj, group, **opening, all_groups=False)
    (zstore,) = stores.values()
    return zstore


def _groups_signature() -> inspect.Signature:
    """open_dataset's signature less ``store`` and ``engine``: what open_groups_as_dict
    takes (through ``**kwargs``) and what ``help`` and ``inspect`` show for it."""
    full = inspect.signature(GdsZarrBackendEntrypoint.open_dataset)
    kept = [p for name, p in full.parameters.items() if name not in ("store", "engine")]
    return full.replace(parameters=kept, return_annotation="dict[str, xr.Dataset]")


GdsZarrBackendEntrypoint.open_groups_as_dict.__signature__ = _groups_signature()  # type: ignore[attr-defined]

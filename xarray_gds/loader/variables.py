"""The variables of a :class:`~xarray_gds.loader.BatchLoader`: which, and how each is
read (by the engine, from the backend array under it, or by xarray)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from xarray_gds import device as _device

__all__ = ["Var", "describe", "engine_source", "pick_variables", "stack_dtype"]


@dataclass
class Var:
    """One variable of the batches and how its pieces are read."""

    name: Hashable
    rest_dims: tuple[Hashable, ...]  #: its dimensions other than the sample dimensions
    rest_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    device: _device.Device  #: "cuda" or "cpu": where its values come back
    #: read by the engine: the backend array, its key (one entry an axis) and, for each
    #: sample dimension, the backend axis it indexes and the positions its key selects
    array: Any = None
    base: tuple[Any, ...] = ()
    axes: tuple[tuple[int, range], ...] = ()
    #: read by xarray (when ``array`` is None): the variable itself
    variable: xr.Variable | None = None


def pick_variables(
    ds: xr.Dataset, dims: tuple[str, ...], variables: Sequence[Hashable] | None
) -> list[Hashable]:
    """The names of the variables of a batch: ``variables`` checked, or every data
    variable that has all of ``dims``."""
    if variables is None:
        names = [n for n, v in ds.data_vars.items() if set(dims) <= set(v.dims)]
        if not names:
            raise ValueError(f"no data variable of the dataset has the dimensions {dims}")
        return names
    if isinstance(variables, str):
        variables = [variables]
    names = list(variables)
    if not names:
        raise ValueError("variables: give at least one variable")
    if len(set(names)) != len(names):
        raise ValueError(f"variables: {names} names a variable twice")
    for n in names:
        if n not in ds.variables:
            raise ValueError(f"variables: the dataset has no variable {n!r}")
        missing = [d for d in dims if d not in ds[n].dims]
        if missing:
            raise ValueError(
                f"variables: {n!r} has no dimension {missing[0]!r} (its dimensions: "
                f"{ds[n].dims}); samples are taken along {dims}"
            )
    return names


def describe(ds: xr.Dataset, dims: tuple[str, ...], name: Hashable) -> Var:
    """How variable ``name`` of ``ds`` is read, samples taken along ``dims``."""
    var = ds[name].variable
    rest = tuple(d for d in var.dims if d not in dims)
    spec = Var(
        name=name,
        rest_dims=rest,
        rest_shape=tuple(int(var.sizes[d]) for d in rest),
        dtype=np.dtype(var.dtype),
        device="cpu",
    )
    found = engine_source(var)
    if found is None:
        spec.variable = var
        spec.device = _where(var)
        return spec
    array, key = found
    backend_axes = [a for a, k in enumerate(key) if isinstance(k, slice)]
    axes = []
    for d in dims:
        a = backend_axes[var.dims.index(d)]
        axes.append((a, range(array.shape[a])[key[a]]))
    spec.array, spec.base, spec.axes = array, key, tuple(axes)
    spec.device = array.device
    return spec


def stack_dtype(variables: list[Var], stack: str | None) -> np.dtype[Any] | None:
    """The dtype of the stacked array of ``variables`` (None without ``stack``), once
    they share their other dimensions and ``stack`` is none of them."""
    if stack is None:
        return None
    shapes = {(v.rest_dims, v.rest_shape) for v in variables}
    if len(shapes) > 1:
        listed = ", ".join(
            f"{v.name!r} {dict(zip(v.rest_dims, v.rest_shape, strict=True))}" for v in variables
        )
        raise ValueError(
            f"stack={stack!r}: the variables must share their other dimensions "
            f"to be stacked ({listed}); pass variables= of one shape"
        )
    if stack in variables[0].rest_dims:
        raise ValueError(f"stack={stack!r} is a dimension of the variables already")
    return np.result_type(*(v.dtype for v in variables))


def _where(var: xr.Variable) -> _device.Device:
    """Where the values of a variable the engine does not read come back."""
    data = var._data
    meta = getattr(data, "_meta", None)
    if _device.is_device_array(data) or (meta is not None and _device.is_device_array(meta)):
        return "cuda"
    return "cpu"


def engine_source(var: xr.Variable) -> tuple[Any, tuple[Any, ...]] | None:
    """``(GdsBackendArray, key)`` under a variable opened with the engine (lazy, or a
    dask array made straight from it), the key one integer or slice an axis of the
    backend array; None for anything else (read by xarray then)."""
    from xarray.core import indexing

    from xarray_gds.array import GdsBackendArray

    data = var._data
    if hasattr(data, "__dask_graph__"):
        from xarray_gds import fuse

        graph = data.__dask_graph__()
        layers = getattr(graph, "layers", {})
        found = fuse._find_sources(graph) if len(layers) == 2 else {}
        if len(found) != 1:
            return None
        ((adapter, _),) = found.values()
        if tuple(adapter.shape) != tuple(data.shape):
            return None
        data = adapter.array
    while isinstance(data, indexing.CopyOnWriteArray | indexing.MemoryCachedArray):
        data = data.array
    if type(data) is not indexing.LazilyIndexedArray:
        return None
    if not isinstance(data.array, GdsBackendArray):
        return None
    key = tuple(data.key.tuple)
    if not all(
        isinstance(k, slice) or (isinstance(k, int | np.integer) and not isinstance(k, bool))
        for k in key
    ):
        return None
    n_dims = sum(isinstance(k, slice) for k in key)
    if n_dims != var.ndim:
        return None
    return data.array, tuple(k if isinstance(k, slice) else int(k) for k in key)

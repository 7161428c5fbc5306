"""One batch of a :class:`~xarray_gds.loader.BatchLoader` read: its empty arrays made,
every piece of it (a sample of a variable at one offset) read in one
:func:`~xarray_gds.array.read_many` batch (or by xarray), put in place, and handed out
as arrays, converted arrays or a Dataset."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from xarray_gds import device as _device
from xarray_gds.loader.sampling import OFFSET_DIM, SAMPLE_DIM
from xarray_gds.loader.variables import Var

__all__ = ["BatchReader"]

#: where the samples of a ``(variable, offset)`` go: ``(array, where)`` pairs, ``where``
#: beginning with the sample axis (or empty)
_Targets = dict[tuple[int, int], list[tuple[Any, tuple[Any, ...]]]]

#: a sample read straight into its place in the batch (nothing left to copy)
_PLACED: Any = object()


@dataclass
class BatchReader:
    """Reads the batches of a loader: its dataset, sample dimensions, variables,
    windows (window -> offset or tuple of offsets) and their distinct offsets, the
    dtype of the stacked array (None unless stacked), the output and ``to=``."""

    ds: xr.Dataset
    dims: tuple[str, ...]
    variables: list[Var]
    windows: dict[Any, Any]
    offsets: list[int]
    stack_dtype: np.dtype[Any] | None
    output: str
    to: Callable[[Any], Any] | None

    def read(self, at: dict[str, np.ndarray], n: int) -> Any:
        """The batch of the ``n`` samples at positions ``at`` along each of ``dims``."""
        out, targets = self._outputs(n)
        pieces = self._read_pieces(at, n, targets)
        for key, places in targets.items():
            for array, where in places:
                _put(array, pieces[key], where, _module_of(array))
        if self.output == "dataset":
            out = {w: self._dataset(value, at, self.windows[w]) for w, value in out.items()}
        elif self.to is not None:
            out = {w: _convert(value, self.to) for w, value in out.items()}
        return out.get(None, out)

    def _outputs(self, n: int) -> tuple[dict[Any, Any], _Targets]:
        """The empty arrays of a batch of ``n`` samples (window -> stacked array or dict
        of arrays) and where each ``(variable, offset)``'s samples go in them: a list of
        ``(array, where)``, ``where`` beginning with the sample axis (or empty)."""
        out: dict[Any, Any] = {}
        targets: _Targets = {}
        where: tuple[Any, ...]
        for window, offsets in self.windows.items():
            steps = offsets if isinstance(offsets, tuple) else (offsets,)
            lead = (n, len(steps)) if isinstance(offsets, tuple) else (n,)
            if self.stack_dtype is not None:
                cuda = any(v.device == "cuda" for v in self.variables)
                shape = (*lead, len(self.variables), *self.variables[0].rest_shape)
                array = _new("cuda" if cuda else "cpu", shape, self.stack_dtype)
                out[window] = array
                for k in range(len(self.variables)):
                    for s, o in enumerate(steps):
                        where = (slice(None), s, k) if len(lead) == 2 else (slice(None), k)
                        targets.setdefault((k, o), []).append((array, where))
                continue
            arrays = {}
            for k, v in enumerate(self.variables):
                array = _new(v.device, (*lead, *v.rest_shape), v.dtype)
                arrays[v.name] = array
                for s, o in enumerate(steps):
                    where = (slice(None), s) if len(lead) == 2 else ()
                    targets.setdefault((k, o), []).append((array, where))
            out[window] = arrays
        return out, targets

    def _read_pieces(
        self, at: dict[str, np.ndarray], n: int, targets: _Targets
    ) -> dict[tuple[int, int], Any]:
        """``(variable, offset) -> array`` of the samples ``at`` at each offset: for
        variables the engine reads, a list of one array a sample (all read in one
        :func:`~xarray_gds.array.read_many` batch, each written straight into its place
        in the batch when ``targets`` gives it exactly one: it is then :data:`_PLACED`);
        for the others, one array with the samples first (xarray's vectorized indexing,
        dask arrays computed together)."""
        items: list[tuple[Any, Any]] = []
        dests: list[Any] = []
        where: list[tuple[int, int]] = []
        others: dict[str, xr.Variable] = {}
        first = self.dims[0]
        for k, v in enumerate(self.variables):
            for o in self.offsets:
                shifted = dict(at)
                shifted[first] = at[first] + o
                if v.array is None:
                    assert v.variable is not None
                    indexers = {d: xr.Variable("__sample__", shifted[d]) for d in self.dims}
                    picked = v.variable.isel(indexers).transpose("__sample__", *v.rest_dims)
                    others[f"{k}/{o}"] = picked
                    continue
                along = [shifted[d] for d in self.dims]
                places = targets.get((k, o), [])
                only = places[0] if len(places) == 1 else None
                for b in range(n):
                    items.append((v.array, _engine_key(v, along, b)))
                    dests.append(None if only is None else only[0][(b, *only[1][1:])])
                    where.append((k, o))
        pieces: dict[tuple[int, int], Any] = {}
        if items:
            self._read_engine(items, dests, where, pieces)
        if others:
            got = xr.Dataset(others).compute()
            for name in others:
                k, o = (int(x) for x in name.split("/"))
                pieces[(k, o)] = got[name].data
        return pieces

    def _read_engine(
        self,
        items: list[tuple[Any, Any]],
        dests: list[Any],
        where: list[tuple[int, int]],
        pieces: dict[tuple[int, int], Any],
    ) -> None:
        """Read ``items`` (backend array, key) in one batch, into ``dests`` where given,
        each appended to the pieces of its ``(variable, offset)``."""
        from xarray.core import indexing

        from xarray_gds.array import read_many

        values = read_many([(a, indexing.BasicIndexer(key)) for a, key in items], dests)
        for (k, o), value, dest in zip(where, values, dests, strict=True):
            if isinstance(value, BaseException):
                raise RuntimeError(
                    f"BatchLoader: reading variable {self.variables[k].name!r} failed: {value}"
                ) from value
            pieces.setdefault((k, o), []).append(
                _PLACED if dest is not None and value is dest else value
            )

    def _dataset(self, value: dict[Hashable, Any], at: dict[str, np.ndarray], offsets: Any) -> Any:
        ds = self.ds
        windowed = isinstance(offsets, tuple)
        lead: tuple[str, ...] = (SAMPLE_DIM, OFFSET_DIM) if windowed else (SAMPLE_DIM,)
        data_vars = {
            v.name: ((*lead, *v.rest_dims), value[v.name], ds[v.name].attrs) for v in self.variables
        }
        coords: dict[Hashable, Any] = {}
        for d in self.dims:
            if d not in ds.coords:
                continue
            labels = ds[d].values
            if d == self.dims[0]:
                pos = at[d][:, None] + np.asarray(offsets if windowed else (offsets,))[None]
                coords[d] = (lead, labels[pos if windowed else pos[:, 0]], ds[d].attrs)
            else:
                coords[d] = (SAMPLE_DIM, labels[at[d]], ds[d].attrs)
        if windowed:
            coords[OFFSET_DIM] = (OFFSET_DIM, np.asarray(offsets))
        for r in {d for v in self.variables for d in v.rest_dims}:
            if r in ds.indexes:
                coords[r] = ds[r].variable
        return xr.Dataset(data_vars, coords=coords)


def _new(device: _device.Device, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
    return _device.array_module(device).empty(shape, dtype=dtype)


def _engine_key(v: Var, at: list[np.ndarray], b: int) -> tuple[Any, ...]:
    """The backend key of sample ``b`` of variable ``v`` (``at``: the samples' positions
    along each sample dimension, in the order of ``dims``)."""
    key = list(v.base)
    for (axis, positions), pos in zip(v.axes, at, strict=True):
        key[axis] = positions[int(pos[b])]
    return tuple(key)


def _module_of(array: Any) -> Any:
    return _device.array_module("cuda" if _device.is_device_array(array) else "cpu")


def _put(out: Any, piece: Any, where: tuple[Any, ...], xp: Any) -> None:
    """``piece`` (a list of one array a sample, or one array with the samples first)
    into ``out[where]`` (``where`` begins with the sample axis, or is empty); samples
    that are :data:`_PLACED` are there already."""
    if isinstance(piece, list):
        rest = where[1:]
        for b, one in enumerate(piece):
            if one is _PLACED:
                continue
            out[(b, *rest)] = one if _same_module(one, xp) else xp.asarray(one)
    else:
        out[where or (slice(None),)] = piece if _same_module(piece, xp) else xp.asarray(piece)


def _same_module(x: Any, xp: Any) -> bool:
    return _device.is_device_array(x) == (xp is not np)


def _convert(value: Any, to: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        return {k: to(a) for k, a in value.items()}
    return to(value)

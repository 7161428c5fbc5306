"""Batches of samples for training: shuffled, sharded, prefetched, resumable.

:class:`BatchLoader` takes a dataset opened with ``engine="gds-zarr"`` (lazily or with
dask) and yields batches of samples taken along one or more dimensions (``time``, say),
each a dict of arrays (CuPy on the GPU, numpy on the host), an :class:`xarray.Dataset`,
or whatever a DLPack consumer makes of the arrays (``to=torch.from_dlpack``: PyTorch
tensors sharing the memory).

A batch is one joined read: every piece of it (a sample of a variable at one offset)
is a box of a lazily indexed array, and all of them go to
:func:`xarray_gds.array.read_many` together, so that a batch of 16 time steps of 20
variables is one batch of the read engine (one file batch, one decode a codec chain),
not 320 reads. Variables the engine does not read itself (values already in memory,
arrays of another backend, selections xarray cannot express as boxes) are taken with
xarray's vectorized indexing instead, their dask arrays computed together.

While the caller uses a batch, a background thread reads the next ones (``prefetch``
of them at most, and no more than ``prefetch_bytes`` of batches ahead). Each epoch
has its own order (a permutation drawn from ``seed`` and the epoch), the same on every
rank, and rank ``r`` of ``world_size`` takes every ``world_size``-th sample of it from
``r`` on: the ranks' samples are disjoint and, with ``drop_last=False``, cover the
dataset. :meth:`BatchLoader.state_dict` and :meth:`BatchLoader.load_state_dict`
continue an epoch where it stopped.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from xarray_gds import device as _device

__all__ = ["BatchLoader"]

#: the names of the batch axis and of the axis of a window's offsets
SAMPLE_DIM = "sample"
OFFSET_DIM = "offset"

_OUTPUTS = ("arrays", "dataset")
_STATE_VERSION = 1


@dataclass
class _Var:
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


class BatchLoader:
    """Batches of samples of an xarray-gds dataset, for a training loop.

    Parameters
    ----------
    ds : xarray.Dataset
        Opened with ``engine="gds-zarr"`` (lazily or with ``chunks=``); selections made
        with ``isel``/``sel`` slices after opening are kept.
    dims : str or sequence of str
        The dimensions samples are taken along (``"time"``; ``("time", "member")``
        takes every combination). The other dimensions of a variable stay whole.
    variables : sequence of names, optional
        The variables of a batch, in this order (the channel order when stacked).
        Default: every data variable that has all of ``dims``.
    batch_size : int
        Samples a batch.
    windows : mapping of name to int or sequence of ints, optional
        Offsets along ``dims[0]``: ``{"input": 0, "target": 6}`` gives each batch as
        ``{"input": ..., "target": ...}`` with the target 6 steps after the input;
        ``{"input": (-1, 0), "target": 1}`` gives the input an ``offset`` axis of two
        steps after the sample axis. Only samples whose every offset lies inside the
        dimension are drawn. Default: a batch is the samples themselves.
    stack : str, optional
        Stack the variables into one array with a channel axis of this name, in the
        order of ``variables``, after the sample (and offset) axes; the variables must
        then share their other dimensions. With ``output="arrays"`` a batch (or each
        window of it) is then one array instead of a dict.
    output : {"arrays", "dataset"}
        ``"arrays"``: a dict of arrays keyed by variable (CuPy or numpy, where the
        dataset was opened); ``"dataset"``: an :class:`xarray.Dataset` with a ``sample``
        dimension and the coordinates of the samples.
    to : callable, optional
        Applied to every array of an ``"arrays"`` batch: ``torch.from_dlpack`` makes
        PyTorch tensors that share the arrays' memory.
    shuffle : bool
        A new random order of the samples every epoch (else their order in ``ds``).
    seed : int
        The seed of the orders; give every rank the same.
    drop_last : bool
        Drop the last batch of an epoch when it is short. With several ranks, every
        rank then has the same number of batches (what data-parallel training needs).
    rank, world_size : int
        This process's share of each epoch: every ``world_size``-th sample of the
        epoch's order, from the ``rank``-th on.
    prefetch : int
        Batches read ahead by a background thread while the caller uses the current
        one; 0 reads each batch when it is asked for.
    prefetch_bytes : int, optional
        At most this many bytes of batches read ahead (GPU memory for a device
        dataset); ``prefetch`` is lowered to fit (to 0 when one batch is larger).

    Examples
    --------
    >>> ds = xr.open_dataset("era5.zarr", engine="gds-zarr")  # doctest: +SKIP
    >>> loader = BatchLoader(ds, "time", batch_size=16, stack="channel",
    ...                      windows={"x": 0, "y": 1}, to=torch.from_dlpack)  # doctest: +SKIP
    >>> for epoch in range(10):  # doctest: +SKIP
    ...     for batch in loader:
    ...         loss = model(batch["x"], batch["y"])
    """

    def __init__(
        self,
        ds: xr.Dataset,
        dims: str | Sequence[str] = "time",
        *,
        variables: Sequence[Hashable] | None = None,
        batch_size: int = 1,
        windows: Mapping[str, int | Sequence[int]] | None = None,
        stack: str | None = None,
        output: str = "arrays",
        to: Callable[[Any], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
        prefetch_bytes: int | None = None,
    ) -> None:
        if not isinstance(ds, xr.Dataset):
            raise TypeError(
                f"BatchLoader takes an xarray.Dataset (got {type(ds).__name__}); for a "
                "DataArray pass da.to_dataset()"
            )
        self._dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if not self._dims:
            raise ValueError("dims: give at least one dimension to take samples along")
        for d in self._dims:
            if d not in ds.dims:
                raise ValueError(
                    f"dims: the dataset has no dimension {d!r} (it has {sorted(map(str, ds.dims))})"
                )
        if len(set(self._dims)) != len(self._dims):
            raise ValueError(f"dims: {self._dims} names a dimension twice")
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("seed", seed, 0),
            ("world_size", world_size, 1),
            ("rank", rank, 0),
            ("prefetch", prefetch, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"{name} must be an integer >= {low} (got {value!r})")
        if rank >= world_size:
            raise ValueError(f"rank must be below world_size={world_size} (got rank={rank})")
        if prefetch_bytes is not None and (
            isinstance(prefetch_bytes, bool)
            or not isinstance(prefetch_bytes, int | np.integer)
            or prefetch_bytes < 0
        ):
            raise ValueError(f"prefetch_bytes must be None or an integer >= 0 ({prefetch_bytes!r})")
        if output not in _OUTPUTS:
            raise ValueError(f"output must be one of {_OUTPUTS} (got {output!r})")
        if to is not None and not callable(to):
            raise TypeError(f"to must be a callable such as torch.from_dlpack (got {to!r})")
        if to is not None and output != "arrays":
            raise ValueError("to= converts arrays: use it with output='arrays'")
        if stack is not None and output != "arrays":
            raise ValueError(
                "stack= makes one array of the variables: use it with output='arrays' "
                "(output='dataset' keeps the variables apart)"
            )
        for taken in (SAMPLE_DIM, OFFSET_DIM, stack):
            if output == "dataset" and taken is not None and taken in ds.dims:
                raise ValueError(
                    f"the dataset has a dimension {taken!r}, which output='dataset' uses "
                    "for its batches: rename it first"
                )
        self._ds = ds
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.output = output
        self.stack = stack
        self._to = to
        self._windows, self._offsets = _parse_windows(windows)
        sizes = [int(ds.sizes[d]) for d in self._dims]
        low, high = min(self._offsets), max(self._offsets)
        first_valid = sizes[0] - (high - low)
        if first_valid < 1:
            raise ValueError(
                f"windows: offsets from {low} to {high} along {self._dims[0]!r} need more "
                f"than its {sizes[0]} positions"
            )
        self._first = -low  #: the first position of dims[0] a sample starts at
        self._grid = (first_valid, *sizes[1:])
        self.n_samples = math.prod(self._grid)
        self._vars = [self._var(ds, name) for name in self._variables(ds, variables)]
        self._stack_dtype: np.dtype[Any] | None = None
        if stack is not None:
            shapes = {(v.rest_dims, v.rest_shape) for v in self._vars}
            if len(shapes) > 1:
                listed = ", ".join(
                    f"{v.name!r} {dict(zip(v.rest_dims, v.rest_shape, strict=True))}"
                    for v in self._vars
                )
                raise ValueError(
                    f"stack={stack!r}: the variables must share their other dimensions "
                    f"to be stacked ({listed}); pass variables= of one shape"
                )
            if stack in self._vars[0].rest_dims:
                raise ValueError(f"stack={stack!r} is a dimension of the variables already")
            self._stack_dtype = np.result_type(*(v.dtype for v in self._vars))
        self.prefetch = int(prefetch)
        self.prefetch_bytes = None if prefetch_bytes is None else int(prefetch_bytes)
        self._epoch = 0
        self._position = 0  #: batches of the epoch handed out

    # ----------------------------------------------------------------- description

    @property
    def variables(self) -> list[Hashable]:
        """The variables of a batch, in order (the channel order when stacked)."""
        return [v.name for v in self._vars]

    @property
    def dims(self) -> tuple[str, ...]:
        return self._dims

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (it continues where the last stopped)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        if isinstance(epoch, bool) or not isinstance(epoch, int | np.integer) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0 (got {epoch!r})")
        self._epoch, self._position = int(epoch), 0

    def __len__(self) -> int:
        """Batches of an epoch on this rank."""
        n = len(self._mine(0))
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def batch_nbytes(self) -> int:
        """Bytes of the arrays of one full batch."""
        total = 0
        for offsets in self._windows.values():
            n = self.batch_size * (len(offsets) if isinstance(offsets, tuple) else 1)
            if self._stack_dtype is not None:
                size = math.prod(self._vars[0].rest_shape) * len(self._vars)
                total += n * size * self._stack_dtype.itemsize
            else:
                total += sum(n * math.prod(v.rest_shape) * v.dtype.itemsize for v in self._vars)
        return int(total)

    @property
    def depth(self) -> int:
        """Batches read ahead: ``prefetch``, lowered to fit ``prefetch_bytes``."""
        if self.prefetch_bytes is None:
            return self.prefetch
        return min(self.prefetch, self.prefetch_bytes // max(1, self.batch_nbytes))

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """The sample numbers of each batch of ``epoch`` (default: the current one) on
        this rank; :meth:`positions` gives where a sample lies."""
        mine = self._mine(self._epoch if epoch is None else epoch)
        n = len(self)
        return [mine[i * self.batch_size : (i + 1) * self.batch_size] for i in range(n)]

    def positions(self, samples: np.ndarray | Sequence[int]) -> dict[str, np.ndarray]:
        """Integer positions along each of ``dims`` of the samples numbered
        ``samples`` (offset 0 of a window; a window's offsets are added to the first)."""
        at = np.unravel_index(np.asarray(samples, dtype=np.int64), self._grid)
        out = {d: np.asarray(a, dtype=np.int64) for d, a in zip(self._dims, at, strict=True)}
        out[self._dims[0]] = out[self._dims[0]] + self._first
        return out

    def _mine(self, epoch: int) -> np.ndarray:
        n = self.n_samples
        if self.shuffle:
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(n)
        else:
            order = np.arange(n)
        mine = order[self.rank :: self.world_size]
        if self.drop_last:  # the same number of full batches on every rank
            per_rank = n // self.world_size // self.batch_size * self.batch_size
            mine = mine[:per_rank]
        return mine

    # ----------------------------------------------------------------- resuming

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands: the epoch and the batches of it handed out.
        :meth:`load_state_dict` on a loader made with the same arguments continues
        from there (batches read ahead but not handed out are read again)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "n_samples": self.n_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where the loader that made ``state`` (:meth:`state_dict`) stopped."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"load_state_dict: not a BatchLoader state of version {_STATE_VERSION} "
                f"(version {state.get('version')!r})"
            )
        mine = self.state_dict()
        for key in (
            "n_samples",
            "batch_size",
            "shuffle",
            "seed",
            "drop_last",
            "rank",
            "world_size",
        ):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"load_state_dict: the state was saved with {key}={state.get(key)!r}, "
                    f"this loader has {key}={mine[key]!r}; make the loader with the same "
                    "dataset and arguments to continue its epoch"
                )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])

    # ----------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Any]:
        if self._position >= len(self):  # the last epoch was handed out whole
            self._epoch, self._position = self._epoch + 1, 0
        plan = self.batches()
        start = self._position
        depth = self.depth
        if depth == 0 or len(plan) - start <= 1:
            return self._serial(plan, start)
        return self._prefetched(plan, start, depth)

    def _serial(self, plan: list[np.ndarray], start: int) -> Iterator[Any]:
        for i in range(start, len(plan)):
            batch = self._read_batch(plan[i])
            self._position = i + 1
            yield batch
        self._epoch, self._position = self._epoch + 1, 0

    def _prefetched(self, plan: list[np.ndarray], start: int, depth: int) -> Iterator[Any]:
        prefetcher = _Prefetcher(self, plan[start:], depth)
        self._prefetcher = prefetcher
        try:
            for i in range(start, len(plan)):
                batch = prefetcher.take()
                self._position = i + 1
                yield batch
            self._epoch, self._position = self._epoch + 1, 0
        finally:
            prefetcher.stop()

    # ----------------------------------------------------------------- reading

    def _read_batch(self, samples: np.ndarray) -> Any:
        """The batch of the samples numbered ``samples``."""
        at = self.positions(samples)
        n = len(samples)
        out, targets = self._outputs(n)
        pieces = self._read_pieces(at, n, targets)
        for key, places in targets.items():
            for array, where in places:
                _put(array, pieces[key], where, _module_of(array))
        if self.output == "dataset":
            out = {w: self._dataset(value, at, self._windows[w]) for w, value in out.items()}
        elif self._to is not None:
            out = {w: _convert(value, self._to) for w, value in out.items()}
        return out.get(None, out)

    def _outputs(
        self, n: int
    ) -> tuple[dict[Any, Any], dict[tuple[int, int], list[tuple[Any, tuple[Any, ...]]]]]:
        """The empty arrays of a batch of ``n`` samples (window -> stacked array or dict
        of arrays) and where each ``(variable, offset)``'s samples go in them: a list of
        ``(array, where)``, ``where`` beginning with the sample axis (or empty)."""
        out: dict[Any, Any] = {}
        targets: dict[tuple[int, int], list[tuple[Any, tuple[Any, ...]]]] = {}
        where: tuple[Any, ...]
        for window, offsets in self._windows.items():
            steps = offsets if isinstance(offsets, tuple) else (offsets,)
            lead = (n, len(steps)) if isinstance(offsets, tuple) else (n,)
            if self._stack_dtype is not None:
                cuda = any(v.device == "cuda" for v in self._vars)
                shape = (*lead, len(self._vars), *self._vars[0].rest_shape)
                array = self._new("cuda" if cuda else "cpu", shape, self._stack_dtype)
                out[window] = array
                for k in range(len(self._vars)):
                    for s, o in enumerate(steps):
                        where = (slice(None), s, k) if len(lead) == 2 else (slice(None), k)
                        targets.setdefault((k, o), []).append((array, where))
                continue
            arrays = {}
            for k, v in enumerate(self._vars):
                array = self._new(v.device, (*lead, *v.rest_shape), v.dtype)
                arrays[v.name] = array
                for s, o in enumerate(steps):
                    where = (slice(None), s) if len(lead) == 2 else ()
                    targets.setdefault((k, o), []).append((array, where))
            out[window] = arrays
        return out, targets

    def _read_pieces(
        self,
        at: dict[str, np.ndarray],
        n: int,
        targets: Mapping[tuple[int, int], list[tuple[Any, tuple[Any, ...]]]],
    ) -> dict[tuple[int, int], Any]:
        """``(variable, offset) -> array`` of the samples ``at`` at each offset: for
        variables the engine reads, a list of one array a sample (all read in one
        :func:`~xarray_gds.array.read_many` batch, each written straight into its place
        in the batch when ``targets`` gives it exactly one: it is then :data:`_PLACED`);
        for the others, one array with the samples first (xarray's vectorized indexing,
        dask arrays computed together)."""
        from xarray_gds.array import read_many

        items: list[tuple[Any, Any]] = []
        dests: list[Any] = []
        where: list[tuple[int, int]] = []
        others: dict[str, xr.Variable] = {}
        first = self._dims[0]
        for k, v in enumerate(self._vars):
            for o in self._offsets:
                shifted = dict(at)
                shifted[first] = at[first] + o
                if v.array is None:
                    assert v.variable is not None
                    indexers = {d: xr.Variable("__sample__", shifted[d]) for d in self._dims}
                    picked = v.variable.isel(indexers).transpose("__sample__", *v.rest_dims)
                    others[f"{k}/{o}"] = picked
                    continue
                along = [shifted[d] for d in self._dims]
                places = targets.get((k, o), [])
                only = places[0] if len(places) == 1 else None
                for b in range(n):
                    items.append((v.array, _engine_key(v, along, b)))
                    dests.append(None if only is None else only[0][(b, *only[1][1:])])
                    where.append((k, o))
        pieces: dict[tuple[int, int], Any] = {}
        if items:
            from xarray.core import indexing

            values = read_many([(a, indexing.BasicIndexer(key)) for a, key in items], dests)
            for (k, o), value, dest in zip(where, values, dests, strict=True):
                if isinstance(value, BaseException):
                    raise RuntimeError(
                        f"BatchLoader: reading variable {self._vars[k].name!r} failed: {value}"
                    ) from value
                pieces.setdefault((k, o), []).append(
                    _PLACED if dest is not None and value is dest else value
                )
        if others:
            got = xr.Dataset(others).compute()
            for name in others:
                k, o = (int(x) for x in name.split("/"))
                pieces[(k, o)] = got[name].data
        return pieces

    def _new(self, device: _device.Device, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        return _device.array_module(device).empty(shape, dtype=dtype)

    def _dataset(self, value: dict[Hashable, Any], at: dict[str, np.ndarray], offsets: Any) -> Any:
        windowed = isinstance(offsets, tuple)
        lead: tuple[str, ...] = (SAMPLE_DIM, OFFSET_DIM) if windowed else (SAMPLE_DIM,)
        data_vars = {
            v.name: ((*lead, *v.rest_dims), value[v.name], self._ds[v.name].attrs)
            for v in self._vars
        }
        coords: dict[Hashable, Any] = {}
        for d in self._dims:
            if d not in self._ds.coords:
                continue
            labels = self._ds[d].values
            if d == self._dims[0]:
                pos = at[d][:, None] + np.asarray(offsets if windowed else (offsets,))[None]
                coords[d] = (lead, labels[pos if windowed else pos[:, 0]], self._ds[d].attrs)
            else:
                coords[d] = (SAMPLE_DIM, labels[at[d]], self._ds[d].attrs)
        if windowed:
            coords[OFFSET_DIM] = (OFFSET_DIM, np.asarray(offsets))
        for r in {d for v in self._vars for d in v.rest_dims}:
            if r in self._ds.indexes:
                coords[r] = self._ds[r].variable
        return xr.Dataset(data_vars, coords=coords)

    # ----------------------------------------------------------------- set-up

    def _variables(self, ds: xr.Dataset, variables: Sequence[Hashable] | None) -> list[Hashable]:
        if variables is None:
            names = [n for n, v in ds.data_vars.items() if set(self._dims) <= set(v.dims)]
            if not names:
                raise ValueError(f"no data variable of the dataset has the dimensions {self._dims}")
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
            missing = [d for d in self._dims if d not in ds[n].dims]
            if missing:
                raise ValueError(
                    f"variables: {n!r} has no dimension {missing[0]!r} (its dimensions: "
                    f"{ds[n].dims}); samples are taken along {self._dims}"
                )
        return names

    def _var(self, ds: xr.Dataset, name: Hashable) -> _Var:
        var = ds[name].variable
        rest = tuple(d for d in var.dims if d not in self._dims)
        spec = _Var(
            name=name,
            rest_dims=rest,
            rest_shape=tuple(int(var.sizes[d]) for d in rest),
            dtype=np.dtype(var.dtype),
            device="cpu",
        )
        found = _engine_source(var)
        if found is None:
            spec.variable = var
            spec.device = _where(var)
            return spec
        array, key = found
        backend_axes = [a for a, k in enumerate(key) if isinstance(k, slice)]
        axes = []
        for d in self._dims:
            a = backend_axes[var.dims.index(d)]
            axes.append((a, range(array.shape[a])[key[a]]))
        spec.array, spec.base, spec.axes = array, key, tuple(axes)
        spec.device = array.device
        return spec

    # ----------------------------------------------------------------- PyTorch

    def torch_dataset(self) -> Any:
        """This loader as a ``torch.utils.data.IterableDataset`` of whole batches, for
        ``DataLoader(loader.torch_dataset(), batch_size=None, num_workers=0)``. Its
        arrays come as torch tensors (zero copy through DLPack: CUDA tensors for GPU
        batches), unless ``to=`` already made something else.

        The loader reads and prefetches in its own thread: a DataLoader's worker
        processes would each read every batch again, and a device dataset cannot be
        read in a worker forked after CUDA was initialised, so iterating it in a worker
        raises an error that says so."""
        try:
            import torch.utils.data  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "BatchLoader.torch_dataset() needs PyTorch (pip install torch); the loader "
                "itself does not: iterate it directly, with to=torch.from_dlpack if wanted"
            ) from err
        cls = _torch_dataset_class()
        return cls(self)

    def _check_worker(self, worker_id: int, num_workers: int, forked: bool) -> None:
        """Raise the error for iterating this loader in DataLoader worker ``worker_id``."""
        on_device = any(v.device == "cuda" for v in self._vars)
        if on_device and forked:
            raise RuntimeError(
                f"BatchLoader: iterated in DataLoader worker process {worker_id} of "
                f"{num_workers}, which was forked from a process that had initialised CUDA. "
                "CUDA cannot be used in a forked child (the driver state does not survive "
                "fork(); reads there fail or hang). Pass num_workers=0: the loader already "
                "reads, decodes on the GPU and prefetches batches in a background thread of "
                "the main process (set prefetch= for more batches ahead)."
            )
        raise RuntimeError(
            f"BatchLoader: iterated in DataLoader worker process {worker_id} of {num_workers}; "
            "every worker would read every batch again (the loader batches, shuffles and "
            "shards itself). Pass num_workers=0 and batch_size=None to the DataLoader: the "
            "loader prefetches in a background thread (prefetch=)."
        )


def _parse_windows(
    windows: Mapping[str, int | Sequence[int]] | None,
) -> tuple[dict[Any, Any], list[int]]:
    """``(window -> offset or tuple of offsets, the distinct offsets in order)``."""
    if windows is None:
        return {None: 0}, [0]
    if not isinstance(windows, Mapping) or not windows:
        raise ValueError(
            "windows: give a mapping of names to offsets, e.g. {'input': 0, 'target': 1}"
        )
    out: dict[Any, Any] = {}
    seen: list[int] = []
    for name, spec in windows.items():
        if not isinstance(name, str):
            raise ValueError(f"windows: names must be strings (got {name!r})")
        many = not isinstance(spec, int | np.integer)
        steps: tuple[Any, ...] = tuple(spec) if many else (spec,)  # type: ignore[arg-type]
        if not steps or any(
            isinstance(s, bool) or not isinstance(s, int | np.integer) for s in steps
        ):
            raise ValueError(
                f"windows[{name!r}]: an integer offset or a non-empty sequence of them "
                f"(got {spec!r})"
            )
        ints = tuple(int(s) for s in steps)
        out[name] = ints if many else ints[0]
        seen += [s for s in ints if s not in seen]
    return out, seen


def _engine_key(v: _Var, at: list[np.ndarray], b: int) -> tuple[Any, ...]:
    """The backend key of sample ``b`` of variable ``v`` (``at``: the samples' positions
    along each sample dimension, in the order of ``dims``)."""
    key = list(v.base)
    for (axis, positions), pos in zip(v.axes, at, strict=True):
        key[axis] = positions[int(pos[b])]
    return tuple(key)


#: a sample read straight into its place in the batch (nothing left to copy)
_PLACED: Any = object()


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


def _where(var: xr.Variable) -> _device.Device:
    """Where the values of a variable the engine does not read come back."""
    data = var._data
    meta = getattr(data, "_meta", None)
    if _device.is_device_array(data) or (meta is not None and _device.is_device_array(meta)):
        return "cuda"
    return "cpu"


def _engine_source(var: xr.Variable) -> tuple[Any, tuple[Any, ...]] | None:
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


class _Prefetcher:
    """Reads the batches of one iteration in a background thread, ``depth`` ahead of
    the one the caller holds at most (a slot a batch: taken before its read starts,
    given back when the caller takes a batch)."""

    def __init__(self, loader: BatchLoader, plan: list[np.ndarray], depth: int) -> None:
        self._loader = loader
        self._plan = plan
        self._slots = threading.Semaphore(depth)
        self._ready: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._stopping = threading.Event()
        self._state = threading.Condition()
        self._blocked_at: int | None = None  #: the batch whose read waits for a slot
        self._gpu = _current_gpu(loader)
        self._thread = threading.Thread(target=self._run, name="xarray-gds-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with _device.on_gpu(self._gpu):
            for i, samples in enumerate(self._plan):
                if not self._slots.acquire(blocking=False):
                    with self._state:
                        self._blocked_at = i
                        self._state.notify_all()
                    self._slots.acquire()
                    with self._state:
                        self._blocked_at = None
                if self._stopping.is_set():
                    return
                try:
                    batch = self._loader._read_batch(samples)
                    _sync(self._gpu)
                except BaseException as err:
                    self._ready.put((False, err))
                    return
                self._ready.put((True, batch))

    def take(self) -> Any:
        ok, value = self._ready.get()
        self._slots.release()
        if not ok:
            raise value
        return value

    def wait_blocked(self, i: int, timeout: float) -> bool:
        """Wait until the thread waits for a slot to read the ``i``-th batch of its plan
        (True), or ``timeout`` seconds (False)."""
        with self._state:
            return self._state.wait_for(lambda: self._blocked_at == i, timeout)

    def stop(self) -> None:
        self._stopping.set()
        self._slots.release()  # a thread waiting for a slot sees the stop
        self._thread.join()


def _current_gpu(loader: BatchLoader) -> int | None:
    """The CUDA device current in the calling thread, for a loader of device data."""
    if not any(v.device == "cuda" for v in loader._vars):
        return None
    return int(_device.cupy().cuda.runtime.getDevice())


def _sync(gpu: int | None) -> None:
    """Wait for the batch's kernels, so that a consumer on any stream sees it whole."""
    if gpu is not None:
        _device.cupy().cuda.get_current_stream().synchronize()


_torch_class: Any = None


def _as_tensors(batch: Any) -> Any:
    """A batch's arrays as torch tensors, zero copy through DLPack (CuPy arrays on the
    GPU, numpy on the host); what ``to=`` already made, and Datasets, as they are."""
    import torch

    if isinstance(batch, dict):
        return {name: _as_tensors(value) for name, value in batch.items()}
    if hasattr(batch, "__dlpack__") and not isinstance(batch, torch.Tensor):
        return torch.from_dlpack(batch)
    return batch


def _torch_dataset_class() -> Any:
    """The IterableDataset adapter (made on first use: importing torch is slow)."""
    global _torch_class
    if _torch_class is None:
        import torch.utils.data

        class _TorchDataset(torch.utils.data.IterableDataset):
            def __init__(self, loader: BatchLoader) -> None:
                self.loader = loader
                self._pid = os.getpid()

            def __iter__(self) -> Iterator[Any]:
                info = torch.utils.data.get_worker_info()
                if info is not None:
                    forked = os.getpid() != self._pid and not getattr(self, "_unpickled", False)
                    self.loader._check_worker(info.id, info.num_workers, forked)
                return (_as_tensors(batch) for batch in self.loader)

            def __len__(self) -> int:
                return len(self.loader)

            def __setstate__(self, state: dict[str, Any]) -> None:
                self.__dict__.update(state)
                self._unpickled = True  # a spawned worker's copy

            def state_dict(self) -> dict[str, Any]:
                return self.loader.state_dict()

            def load_state_dict(self, state: Mapping[str, Any]) -> None:
                self.loader.load_state_dict(state)

        _TorchDataset.__module__ = __name__
        _TorchDataset.__qualname__ = "_TorchDataset"
        _torch_class = _TorchDataset
    return _torch_class


def __getattr__(name: str) -> Any:
    if name == "_TorchDataset":  # pickle's lookup of the adapter class in a spawned worker
        return _torch_dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from xarray_gds.loader import sampling
from xarray_gds.loader.prefetch import Prefetcher, current_gpu
from xarray_gds.loader.read import BatchReader
from xarray_gds.loader.torch_adapter import torch_dataset_class
from xarray_gds.loader.variables import describe, pick_variables, stack_dtype

__all__ = ["BatchLoader"]

_STATE_VERSION = 1


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
        self._dims = sampling.check_dims(ds, dims)
        sampling.check_counts(batch_size, seed, world_size, rank, prefetch, prefetch_bytes)
        sampling.check_output(ds, output, to, stack)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.output = output
        self.stack = stack
        self._windows, self._offsets = sampling.parse_windows(windows)
        #: the first position of dims[0] a sample starts at, and the samples a dimension
        self._first, self._grid = sampling.sample_grid(ds, self._dims, self._offsets)
        self.n_samples = math.prod(self._grid)
        names = pick_variables(ds, self._dims, variables)
        self._vars = [describe(ds, self._dims, name) for name in names]
        self._stack_dtype = stack_dtype(self._vars, stack)
        self.prefetch = int(prefetch)
        self.prefetch_bytes = None if prefetch_bytes is None else int(prefetch_bytes)
        self._epoch = 0
        self._position = 0  #: batches of the epoch handed out
        self._reader = BatchReader(
            ds, self._dims, self._vars, self._windows, self._offsets, self._stack_dtype, output, to
        )

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
        return sampling.epoch_samples(
            self.n_samples,
            epoch,
            shuffle=self.shuffle,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
            batch_size=self.batch_size,
        )

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
        prefetcher = Prefetcher(self._read_batch, plan[start:], depth, current_gpu(self._vars))
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
        return self._reader.read(self.positions(samples), len(samples))

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
        cls = torch_dataset_class()
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

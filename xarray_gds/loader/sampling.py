"""The samples of a :class:`~xarray_gds.loader.BatchLoader`: its arguments checked, the
windows of offsets, the grid of samples and each epoch's order of them on a rank."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

__all__ = [
    "OFFSET_DIM",
    "OUTPUTS",
    "SAMPLE_DIM",
    "check_counts",
    "check_dims",
    "check_output",
    "epoch_samples",
    "parse_windows",
    "sample_grid",
]

#: the names of the batch axis and of the axis of a window's offsets
SAMPLE_DIM = "sample"
OFFSET_DIM = "offset"

OUTPUTS = ("arrays", "dataset")


def check_dims(ds: Any, dims: str | Sequence[str]) -> tuple[str, ...]:
    """The sample dimensions as a tuple, once ``ds`` is a Dataset that has each once."""
    if not isinstance(ds, xr.Dataset):
        raise TypeError(
            f"BatchLoader takes an xarray.Dataset (got {type(ds).__name__}); for a "
            "DataArray pass da.to_dataset()"
        )
    out = (dims,) if isinstance(dims, str) else tuple(dims)
    if not out:
        raise ValueError("dims: give at least one dimension to take samples along")
    for d in out:
        if d not in ds.dims:
            raise ValueError(
                f"dims: the dataset has no dimension {d!r} (it has {sorted(map(str, ds.dims))})"
            )
    if len(set(out)) != len(out):
        raise ValueError(f"dims: {out} names a dimension twice")
    return out


def check_counts(
    batch_size: Any,
    seed: Any,
    world_size: Any,
    rank: Any,
    prefetch: Any,
    prefetch_bytes: Any,
) -> None:
    """Raise the error of the first count that is not an integer in its range."""
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


def check_output(
    ds: xr.Dataset, output: str, to: Callable[[Any], Any] | None, stack: str | None
) -> None:
    """Raise the error of an output, ``to=`` or ``stack=`` that does not go with the
    others, or whose names the dataset uses already."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS} (got {output!r})")
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


def parse_windows(
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


def sample_grid(
    ds: xr.Dataset, dims: tuple[str, ...], offsets: list[int]
) -> tuple[int, tuple[int, ...]]:
    """``(first, grid)``: the first position of ``dims[0]`` a sample starts at, and the
    number of samples along each of ``dims`` (those of ``dims[0]`` whose every offset
    lies inside it)."""
    sizes = [int(ds.sizes[d]) for d in dims]
    low, high = min(offsets), max(offsets)
    first_valid = sizes[0] - (high - low)
    if first_valid < 1:
        raise ValueError(
            f"windows: offsets from {low} to {high} along {dims[0]!r} need more "
            f"than its {sizes[0]} positions"
        )
    return -low, (first_valid, *sizes[1:])


def epoch_samples(
    n: int,
    epoch: int,
    *,
    shuffle: bool,
    seed: int,
    rank: int,
    world_size: int,
    drop_last: bool,
    batch_size: int,
) -> np.ndarray:
    """The sample numbers of ``epoch`` on ``rank``, in order: every ``world_size``-th of
    the epoch's order (a permutation of the ``n`` samples drawn from ``seed`` and the
    epoch, or their order), cut to the same number of full batches on every rank with
    ``drop_last``."""
    rng = np.random.default_rng([seed, int(epoch)]) if shuffle else None
    order = np.arange(n) if rng is None else rng.permutation(n)
    mine = order[rank::world_size]
    if drop_last:  # the same number of full batches on every rank
        per_rank = n // world_size // batch_size * batch_size
        mine = mine[:per_rank]
    return mine

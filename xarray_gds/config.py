"""Every knob of xarray-gds: a ``zarr.config`` key first, an environment variable second.

Set a knob for a block of code with zarr's configuration object, or for the whole
process with the environment variable; the configuration key wins when both are set::

    import zarr
    with zarr.config.set({"xarray_gds.batch_bytes": 1 << 30}):
        ds.load()

    XARRAY_GDS_BATCH_BYTES=1073741824 python train.py

:data:`KNOBS` lists them all, with their defaults; ``docs/config.md`` says what each
one does. Values are read at the moment they are used (never cached), so a
``zarr.config.set`` block takes effect at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["KNOBS", "Knob", "get"]

_UNSET = object()


@dataclass(frozen=True)
class Knob:
    """One setting: its ``zarr.config`` key is ``xarray_gds.<name>``, its environment
    variable ``XARRAY_GDS_<NAME>``."""

    name: str
    kind: type
    default: Any  #: ``None`` when the default depends on where the read runs
    doc: str

    @property
    def key(self) -> str:
        return f"xarray_gds.{self.name}"

    @property
    def env(self) -> str:
        return f"XARRAY_GDS_{self.name.upper()}"


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("batch_bytes", int, None, "decoded bytes per batch (4 GiB on the GPU, 1 GiB host)"),
        Knob("pipeline_parts", int, 1, "parts a read is split into at least"),
        Knob("host_threads", int, None, "threads of the host pool (CPU count, at most 32)"),
        Knob("read_threads", int, None, "threads that read a batch of files (1 or 4)"),
        Knob("small_read", int, 256 << 10, "mean range size staged through pinned memory"),
        Knob("batched_host_writes", bool, False, "host values take the batched encoder"),
        Knob("staging_bytes", int, 1 << 30, "pinned host staging kept between reads"),
        Knob("read_ahead_bytes", int, 1 << 30, "values read ahead for a loop over variables"),
        Knob("range_gap", int, 1 << 20, "byte gap across which a store's ranges are joined"),
        Knob("route", str, "auto", "decode route of device reads: auto, gpu or host"),
        Knob("route_constants", str, "", "cost-model constants (see xarray-gds calibrate)"),
        Knob("fuse_dask", bool, True, "read a computation's dask blocks in joined batches"),
        Knob("fuse_bytes", int, 2 << 30, "decoded bytes of one joined group of dask blocks"),
    )
}


def _convert(knob: Knob, value: Any) -> Any:
    if knob.kind is bool and isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    try:
        return knob.kind(value)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"xarray-gds setting {knob.key!r} (environment variable {knob.env}) must be "
            f"a {knob.kind.__name__}, got {value!r}"
        ) from err


def get(name: str, default: Any = _UNSET) -> Any:
    """The value of knob ``name``: ``zarr.config["xarray_gds.<name>"]`` when set, else
    the environment variable ``XARRAY_GDS_<NAME>`` when set, else ``default`` (or the
    knob's own default)."""
    import zarr

    knob = KNOBS[name]
    value = zarr.config.get(knob.key, None)
    if value is None:
        value = os.environ.get(knob.env)
        if value in (None, ""):
            return knob.default if default is _UNSET else default
    return _convert(knob, value)

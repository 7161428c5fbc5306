"""Every knob of xarray-gds: a ``zarr.config`` key first, an environment variable second.

Set a knob for a block of code with zarr's configuration object, or for the whole
process with the environment variable; the configuration key wins when both are set
(to a value other than the default)::

    import zarr
    with zarr.config.set({"xarray_gds.batch_bytes": 1 << 30}):
        ds.load()

    XARRAY_GDS_BATCH_BYTES=1073741824 python train.py

:data:`KNOBS` lists them all, with their defaults; ``docs/config.md`` says what each
one does. The defaults are part of zarr's configuration from import on, as dask's
sub-projects add theirs to dask's (``zarr.config.get("xarray_gds.route")`` is
``"auto"``); no key that zarr or anyone else set is changed. Values are read at the
moment they are used (never cached), so a ``zarr.config.set`` block takes effect at
once, and every read checks them first (:func:`validate`): a misspelt key or a value
out of range raises an error that names the key and what it takes.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KNOBS", "Knob", "get", "validate"]

_UNSET = object()


@dataclass(frozen=True)
class Knob:
    """One setting: its ``zarr.config`` key is ``xarray_gds.<name>``, its environment
    variable ``XARRAY_GDS_<NAME>``."""

    name: str
    kind: type
    default: Any  #: ``None`` when the default depends on where the read runs
    doc: str
    choices: tuple[str, ...] = ()  #: the values a ``str`` knob takes (any when empty)
    minimum: int | None = None  #: the least value of an ``int`` knob

    @property
    def key(self) -> str:
        return f"xarray_gds.{self.name}"

    @property
    def env(self) -> str:
        return f"XARRAY_GDS_{self.name.upper()}"


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob(
            "batch_bytes",
            int,
            None,
            "decoded bytes per batch (4 GiB on the GPU, 1 GiB host)",
            minimum=1,
        ),
        Knob("pipeline_parts", int, 1, "parts a read is split into at least", minimum=1),
        Knob(
            "host_threads",
            int,
            None,
            "threads of the host pool (CPU count, at most 32)",
            minimum=1,
        ),
        Knob("read_threads", int, None, "threads that read a batch of files (1 or 4)", minimum=1),
        Knob(
            "small_read",
            int,
            256 << 10,
            "mean range size staged through pinned memory",
            minimum=0,
        ),
        Knob("batched_host_writes", bool, False, "host values take the batched encoder"),
        Knob("staging_bytes", int, 1 << 30, "pinned host staging kept between reads", minimum=0),
        Knob(
            "read_ahead_bytes",
            int,
            1 << 30,
            "values read ahead for a loop over variables",
            minimum=0,
        ),
        Knob(
            "range_gap",
            int,
            1 << 20,
            "byte gap across which a store's ranges are joined",
            minimum=-1,
        ),
        Knob(
            "route",
            str,
            "auto",
            "decode route of device reads: auto, gpu or host",
            choices=("auto", "gpu", "host"),
        ),
        Knob(
            "split",
            str,
            "off",  # auto once its gain is measured on a GPU (docs/config.md)
            "device batches shared between nvCOMP and the host pool: auto, off or on",
            choices=("auto", "off", "on"),
        ),
        Knob("route_constants", str, "", "cost-model constants (see xarray-gds calibrate)"),
        Knob("fuse_dask", bool, True, "read a computation's dask blocks in joined batches"),
        Knob(
            "fuse_bytes",
            int,
            2 << 30,
            "decoded bytes of one joined group of dask blocks",
            minimum=1,
        ),
        Knob(
            "levels",
            str,
            "host",
            "compression levels of device writes with codec_pipeline.path set by hand",
            choices=("host", "gpu"),
        ),
        Knob("disable_cuda", bool, False, "read on the host even where a GPU is usable"),
    )
}


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _bad(knob: Knob, value: Any, takes: str) -> ValueError:
    return ValueError(
        f"xarray-gds setting {knob.key!r} (environment variable {knob.env}) takes "
        f"{takes}, not {value!r}"
    )


def _convert(knob: Knob, value: Any) -> Any:
    """``value`` as the knob's kind, checked against its choices and minimum."""
    if knob.name == "route_constants" and isinstance(value, Mapping):
        return value  # a mapping, or its JSON text (checked by xarray_gds.route)
    if knob.kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise _bad(knob, value, "a boolean (true/false, on/off, 1/0)")
    if knob.kind is int and isinstance(value, bool | float):
        raise _bad(knob, value, "an integer")
    try:
        converted = knob.kind(value)
    except (TypeError, ValueError):
        raise _bad(knob, value, f"a value of type {knob.kind.__name__}") from None
    if knob.choices and str(converted).lower() not in knob.choices:
        raise _bad(knob, value, "one of " + ", ".join(repr(c) for c in knob.choices))
    if knob.minimum is not None and converted < knob.minimum:
        raise _bad(knob, value, f"an integer >= {knob.minimum}")
    return converted


def defaults() -> dict[str, Any]:
    """The ``xarray_gds`` section of zarr's configuration defaults (``None`` where the
    default depends on where the read runs)."""
    return {name: knob.default for name, knob in KNOBS.items()}


def _register_defaults() -> None:
    import zarr

    zarr.config.update_defaults({"xarray_gds": defaults()})


def validate() -> None:
    """Raise ``ValueError`` for a ``zarr.config`` key under ``xarray_gds.`` that is no
    knob, or a knob's value (in zarr's configuration or its environment variable) that
    it cannot take; the message names the key and the values it takes."""
    import zarr

    section = zarr.config.get("xarray_gds", None)
    if section is not None and not isinstance(section, Mapping):
        raise ValueError(f"zarr.config 'xarray_gds' must be a mapping of settings, not {section!r}")
    for name, value in (section or {}).items():
        knob = KNOBS.get(str(name))
        if knob is None:
            near = difflib.get_close_matches(str(name), list(KNOBS), n=1)
            hint = f"; did you mean 'xarray_gds.{near[0]}'?" if near else ""
            raise ValueError(
                f"unknown xarray-gds setting 'xarray_gds.{name}'{hint} The settings are: "
                + ", ".join(sorted(KNOBS))
                + " (docs/config.md)"
            )
        if value is not None:
            _convert(knob, value)
    for knob in KNOBS.values():
        value = os.environ.get(knob.env)
        if value not in (None, ""):
            _convert(knob, value)


def get(name: str, default: Any = _UNSET) -> Any:
    """The value of knob ``name``: ``zarr.config["xarray_gds.<name>"]`` when set, else
    the environment variable ``XARRAY_GDS_<NAME>`` when set, else ``default`` (or the
    knob's own default)."""
    import zarr

    knob = KNOBS[name]
    value = zarr.config.get(knob.key, None)
    if value is None or (value == knob.default and type(value) is type(knob.default)):
        # unset, or the default zarr's configuration holds: the environment may set it
        env = os.environ.get(knob.env)
        if env not in (None, ""):
            value = env
        elif value is None:
            return knob.default if default is _UNSET else default
    return _convert(knob, value)


_register_defaults()

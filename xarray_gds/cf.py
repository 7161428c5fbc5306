"""CF decoding (masking, scaling, ``_Unsigned``, booleans) on any array module.

xarray's own CF decoders call ``np.array`` on the data, which CuPy refuses. The
engine therefore lets xarray decode the *metadata* (attributes move to encoding,
the decoded dtype is chosen) and applies the same arithmetic itself, with CuPy on
the device or numpy on the host, following xarray's ``CFMaskCoder``,
``CFScaleOffsetCoder`` and ``BooleanCoder`` step by step so that the values are
bit-identical to ``engine="zarr"``. Scalars are promoted as numpy does
(``np.result_type``), so CuPy's own scalar rules never decide a result dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["CFPlan", "plan_cf_decoding"]


@dataclass(frozen=True)
class CFPlan:
    """What to do to raw values to get xarray's decoded values.

    Attributes
    ----------
    raw_dtype : numpy.dtype
        dtype of the values as zarr returns them (native byte order).
    dtype : numpy.dtype
        dtype of the decoded values.
    signedness : numpy.dtype or None
        ``_Unsigned``: reinterpret the integers with this dtype first.
    fill_values : tuple
        Encoded fill values (after ``_Unsigned``) that become NaN.
    scale_factor, add_offset : scalar or None
        Packing parameters.
    to_bool : bool
        ``dtype: bool`` attribute: values are cast to bool.
    """

    raw_dtype: np.dtype
    dtype: np.dtype
    signedness: np.dtype | None = None
    fill_values: tuple[Any, ...] = ()
    scale_factor: Any = None
    add_offset: Any = None
    to_bool: bool = False

    @property
    def is_identity(self) -> bool:
        return (
            self.signedness is None
            and not self.fill_values
            and self.scale_factor is None
            and self.add_offset is None
            and not self.to_bool
            and self.dtype == self.raw_dtype
        )

    def apply(self, data: Any, xp: ModuleType) -> Any:
        """Decode ``data`` (a numpy or CuPy array of ``raw_dtype``) with ``xp``."""
        if self.is_identity:
            return data
        if self.signedness is not None:
            data = data.astype(self.signedness)
        if self.fill_values:
            data = data.astype(self.dtype, copy=True)
            condition = xp.zeros(data.shape, dtype=bool)
            for fv in self.fill_values:
                condition |= _binary(xp, xp.equal, data, fv)
            # xarray's decoded fill: NaN, or NaN+NaNj for complex data
            data[condition] = complex(np.nan, np.nan) if self.dtype.kind == "c" else np.nan
        if self.scale_factor is not None or self.add_offset is not None:
            data = data.astype(self.dtype, copy=True)
            if self.scale_factor is not None:
                data = _binary(xp, xp.multiply, data, self.scale_factor).astype(self.dtype)
            if self.add_offset is not None:
                data = _binary(xp, xp.add, data, self.add_offset).astype(self.dtype)
        if self.to_bool:
            data = data.astype(bool)
        return data.astype(self.dtype, copy=False)


def _binary(xp: ModuleType, ufunc: Any, data: Any, scalar: Any) -> Any:
    """``ufunc(data, scalar)`` computed in the dtype numpy would pick."""
    dtype = np.result_type(data.dtype, scalar)
    return ufunc(data.astype(dtype, copy=False), xp.asarray(scalar, dtype=dtype))


def _item_or_default(value: bool | Mapping[str, bool], name: str, default: bool) -> bool:
    if isinstance(value, Mapping):
        return bool(value.get(name, default))
    return bool(value)


def _encoded_fill_values(attrs: dict[str, Any], raw_dtype: np.dtype) -> tuple[dict, set]:
    """The raw fill attributes and the set of values they mask (as xarray)."""
    raw_fill: dict[str, Any] = {}
    for attr in ("missing_value", "_FillValue"):
        if attr in attrs:
            raw_fill[attr] = attrs[attr]
    encoded: set[Any] = set()
    for key in list(raw_fill):
        values = {fv for fv in np.ravel(raw_fill[key]) if not pd.isnull(fv)}
        if not values and np.issubdtype(raw_dtype, np.integer):
            del raw_fill[key]
        else:
            encoded |= values
    return raw_fill, encoded


def plan_cf_decoding(
    name: str,
    raw_attrs: Mapping[str, Any],
    raw_dtype: np.dtype,
    decoded_dtype: np.dtype,
    decoded_encoding: Mapping[str, Any],
    mask_and_scale: bool | Mapping[str, bool] = True,
) -> CFPlan | None:
    """Work out the arithmetic xarray applied to variable ``name``.

    Parameters
    ----------
    name : str
        Variable name (for per-variable ``mask_and_scale`` mappings).
    raw_attrs : mapping
        Attributes of the variable as stored (before CF decoding).
    raw_dtype : numpy.dtype
        dtype as zarr returns it, in native byte order.
    decoded_dtype : numpy.dtype
        ``dtype`` of the variable xarray decoded lazily.
    decoded_encoding : mapping
        ``encoding`` of the variable xarray decoded lazily.
    mask_and_scale : bool or mapping
        The ``mask_and_scale`` argument given to ``open_dataset``.

    Returns
    -------
    CFPlan or None
        ``None`` when the decoding is not one this module reproduces; the caller
        then decodes on the host with xarray and moves the result.
    """
    if decoded_dtype.kind not in "biufc":
        return None
    dtype = raw_dtype
    signedness = None
    fills: set[Any] = set()
    scale_factor: Any = None
    add_offset: Any = None
    if _item_or_default(mask_and_scale, name, True):
        raw_fill, fills = _encoded_fill_values(dict(raw_attrs), raw_dtype)
        if "_Unsigned" in raw_attrs:
            unsigned = raw_attrs["_Unsigned"]
            raw_fv = raw_fill.get("_FillValue")
            if dtype.kind == "i" and unsigned == "true":
                signedness = np.dtype(f"u{dtype.itemsize}")
                if raw_fv is not None:
                    fills.remove(raw_fv)
                    fills.add(np.array(raw_fv, dtype=dtype).view(signedness).item())
            elif dtype.kind == "u" and unsigned == "false":
                signedness = np.dtype(f"i{dtype.itemsize}")
                if raw_fv is not None:
                    fills.remove(raw_fv)
                    fills.add(signedness.type(raw_fv))
            if signedness is not None:
                dtype = signedness
        if "scale_factor" in raw_attrs or "add_offset" in raw_attrs:
            scale_factor = raw_attrs.get("scale_factor")
            add_offset = raw_attrs.get("add_offset")
            if np.ndim(scale_factor) > 0:
                scale_factor = np.asarray(scale_factor).item()
            if np.ndim(add_offset) > 0:
                add_offset = np.asarray(add_offset).item()
    to_bool = decoded_encoding.get("dtype") == "bool" and raw_attrs.get("dtype") == "bool"
    if fills and decoded_dtype.kind not in "fc":
        return None  # masked to a non-NaN sentinel (time-like): not handled here
    if to_bool and (fills or scale_factor is not None or add_offset is not None):
        return None
    transforms = fills or scale_factor is not None or add_offset is not None or to_bool
    if not transforms and decoded_dtype != dtype:
        return None  # some other decoder changed the dtype
    return CFPlan(
        raw_dtype=raw_dtype,
        dtype=decoded_dtype,
        signedness=signedness,
        fill_values=tuple(sorted(fills, key=repr)),
        scale_factor=scale_factor,
        add_offset=add_offset,
        to_bool=to_bool,
    )

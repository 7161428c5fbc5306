"""CF decoding on an array module, compared bit for bit with xarray's own decoders."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import xarray as xr
from xarray import conventions

from xarray_gds.cf import CFPlan, plan_cf_decoding

RNG = np.random.default_rng(42)

# (dtype, attrs) cases: every branch of CFMaskCoder / CFScaleOffsetCoder / BooleanCoder.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "plain-f4": ("f4", {}),
    "fill-f4": ("f4", {"_FillValue": np.float32(-999.0)}),
    "fill-f4-py-float": ("f4", {"_FillValue": 1e20}),
    "fill-nan-f8": ("f8", {"_FillValue": np.nan}),
    "fill-f2": ("f2", {"_FillValue": np.float16(0.5)}),
    "fill-i2": ("i2", {"_FillValue": np.int16(-7)}),
    "fill-i4": ("i4", {"_FillValue": -1}),
    "fill-i8": ("i8", {"_FillValue": 3}),
    "fill-u1": ("u1", {"_FillValue": 255}),
    "missing-list": ("i2", {"missing_value": [1, 2], "_FillValue": np.int16(3)}),
    "fill-and-missing": ("f4", {"_FillValue": np.float32(1.0), "missing_value": np.float32(2.0)}),
    "scale-f4": ("f4", {"scale_factor": np.float32(0.5)}),
    "scale-py": ("i2", {"scale_factor": 0.01}),
    "offset-only": ("i2", {"add_offset": 10}),
    "scale-offset-f4": ("i2", {"scale_factor": np.float32(0.1), "add_offset": np.float32(3.0)}),
    "scale-offset-i4": ("i4", {"scale_factor": np.float32(0.1), "add_offset": np.float32(3.0)}),
    "scale-offset-fill": ("i2", {"scale_factor": 0.01, "add_offset": 2.0, "_FillValue": -32768}),
    "unsigned-true": ("i1", {"_Unsigned": "true"}),
    "unsigned-true-fill": ("i1", {"_Unsigned": "true", "_FillValue": np.int8(-1)}),
    "unsigned-false-fill": ("u2", {"_Unsigned": "false", "_FillValue": np.uint16(65535)}),
    "unsigned-scale": ("i1", {"_Unsigned": "true", "scale_factor": 2.0, "add_offset": 1.0}),
    "bool": ("i1", {"dtype": "bool"}),
    "complex-fill": ("c8", {"_FillValue": np.complex64(1 + 1j)}),
}


def _raw(dtype: str) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "f":
        values = RNG.standard_normal((6, 7)) * 100
    elif dt.kind == "c":
        values = RNG.standard_normal((6, 7)) + 1j * RNG.standard_normal((6, 7))
    else:
        info = np.iinfo(dt)
        values = RNG.integers(max(info.min, -300), min(info.max, 300), size=(6, 7), endpoint=True)
    data = values.astype(dt)
    if dt.kind in "iu":
        data.flat[:6] = np.array([-7, -1, 1, 2, 3, 255], dtype="i8").astype(dt)
        data.flat[6:8] = [np.iinfo(dt).min, np.iinfo(dt).max]
    elif dt.kind == "f":
        with np.errstate(over="ignore"):
            data.flat[:5] = np.array([-999.0, 1e20, 0.5, 1.0, 2.0]).astype(dt)
        data.flat[5] = np.nan
    else:
        data.flat[0] = 1 + 1j
    return data


def _decode_both(dtype: str, attrs: dict[str, Any], mask_and_scale: bool, xp: Any) -> tuple:
    raw = _raw(dtype)
    var = xr.Variable(("y", "x"), raw, dict(attrs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = conventions.decode_cf_variable("v", var, mask_and_scale=mask_and_scale)
        plan = plan_cf_decoding(
            "v", attrs, raw.dtype, ref.dtype, ref.encoding, mask_and_scale=mask_and_scale
        )
    assert plan is not None
    got = plan.apply(xp.asarray(raw), xp)
    return got, ref.values, plan


def _assert_bit_identical(got: Any, want: np.ndarray) -> None:
    got = got.get() if hasattr(got, "get") else np.asarray(got)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    # NaNs in the same places (GPU arithmetic does not keep NaN payloads) and every
    # other value bit-identical: no rounding differences anywhere
    nan = np.isnan(want) if want.dtype.kind in "fc" else np.zeros(want.shape, bool)
    np.testing.assert_array_equal(np.isnan(got) if got.dtype.kind in "fc" else nan, nan)
    assert got[~nan].tobytes() == want[~nan].tobytes(), (got, want)


@pytest.mark.parametrize("mask_and_scale", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_xarray_numpy(case: str, mask_and_scale: bool) -> None:
    dtype, attrs = CASES[case]
    got, want, _ = _decode_both(dtype, attrs, mask_and_scale, np)
    _assert_bit_identical(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_and_scale", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_xarray_cupy(case: str, mask_and_scale: bool) -> None:
    import cupy

    dtype, attrs = CASES[case]
    got, want, _ = _decode_both(dtype, attrs, mask_and_scale, cupy)
    assert isinstance(got, cupy.ndarray)
    _assert_bit_identical(got, want)


def test_identity_plan_returns_input_untouched() -> None:
    raw = _raw("f4")
    plan = CFPlan(raw_dtype=raw.dtype, dtype=raw.dtype)
    assert plan.is_identity
    assert plan.apply(raw, np) is raw


def test_per_variable_mask_and_scale_mapping() -> None:
    dtype, attrs = CASES["scale-offset-fill"]
    plan = plan_cf_decoding(
        "other", attrs, np.dtype(dtype), np.dtype("f8"), {}, mask_and_scale={"v": False}
    )
    # names missing from the mapping are decoded (xarray's default)
    assert plan is not None and plan.fill_values == (-32768,) and plan.scale_factor == 0.01
    plan = plan_cf_decoding(
        "v", attrs, np.dtype(dtype), np.dtype(dtype), {}, mask_and_scale={"v": False}
    )
    assert plan is not None and plan.is_identity


def test_unreproducible_decodings_are_declined() -> None:
    # masked integers that xarray keeps as int64 (time-like): not ours to decode
    assert plan_cf_decoding("t", {"_FillValue": -1}, np.dtype("i8"), np.dtype("i8"), {}) is None
    # a non-numeric result
    assert plan_cf_decoding("s", {}, np.dtype("i8"), np.dtype("M8[ns]"), {}) is None
    # a dtype change nobody explains
    assert plan_cf_decoding("x", {}, np.dtype("i2"), np.dtype("f4"), {}) is None

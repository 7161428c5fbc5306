"""xarray_gds.to_zarr on the base install (numpy, xarray, zarr, numcodecs): no dask.

Writes of datasets without dask variables never import dask: the modes run in a
process of this interpreter where ``import dask`` fails, host values and device values
alike (device values stand in as numpy values that ``device_of`` calls device values:
they take the route of CuPy values, wrapped in
:class:`~xarray_gds.pipeline.DeviceValues` through xarray's CF encoding), and each
store is compared with the one xarray's own ``to_zarr`` writes with the same calls.
A failed write leaves no directory it made.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
import xarray_gds.pipeline
import xarray_gds.write
from xarray_gds.pipeline import DeviceValues
from xarray_gds.stores.local import GdsStore

from .conftest import _cf_encoding, sample_dataset

pytestmark = pytest.mark.filterwarnings("ignore::xarray.SerializationWarning")

#: run first in the process of the scenarios: ``import dask`` (and its submodules) fails
_NO_DASK = "import sys; sys.modules['dask'] = None; sys.modules['distributed'] = None\n"

Writer = Callable[..., Any]


def _dataset() -> xr.Dataset:
    """The sample dataset as users write it: read back (CF-decoded) from a store."""
    store = zarr.storage.MemoryStore()
    # object strings: xarray and zarr cannot read back every v2 string variable they write
    sample_dataset().drop_vars("station").to_zarr(store, encoding=_cf_encoding())
    read: Any = store
    return xr.open_dataset(read, engine="zarr").load().drop_encoding()


def _encoding() -> dict[str, dict[str, Any]]:
    encoding = _cf_encoding()
    encoding["u10"]["_FillValue"] = np.int16(-32768)  # a numpy scalar of another dtype
    return encoding


def _as_device_values() -> Counter[str]:
    """Numeric numpy values count as device values (the writer's ``device_of``); returns
    the counts of the value types ``GdsCodecPipeline.write`` is given from now on."""
    given: Counter[str] = Counter()
    real_device_of = xarray_gds.write.device_of
    real_write = xarray_gds.pipeline.GdsCodecPipeline.write

    def device_of(data: Any) -> str | None:
        numeric = isinstance(data, np.ndarray) and data.dtype.kind in "biufc"
        return "cuda" if numeric else real_device_of(data)

    async def write(self: Any, batch_info: Any, value: Any, drop_axes: Any = ()) -> None:
        given[type(value.as_ndarray_like()).__name__] += 1
        await real_write(self, batch_info, value, drop_axes)

    xarray_gds.write.device_of = device_of
    xarray_gds.pipeline.GdsCodecPipeline.write = write  # type: ignore[method-assign]
    return given


def _modes(write: Writer, ds: xr.Dataset, path: Path) -> None:
    """Every mode, as a user calls them one after another on ``path``: w, append_dim,
    a (a new variable), region (a dict with r+, then "auto"), w- (a new store, then
    refused on it)."""
    head, tail = ds.isel(time=slice(0, 4)), ds.isel(time=slice(4, None))
    write(head, path / "modes.zarr", mode="w", encoding=_encoding())
    write(tail, path / "modes.zarr", append_dim="time")
    extra = (ds[["t2m"]] * 2).rename(t2m="t2m_twice")
    write(extra, path / "modes.zarr", mode="a")
    part = (ds[["t2m", "u10"]].drop_vars("area").isel(time=slice(2, 6)) + 1.5).drop_vars(
        ["time", "lat", "lon"]
    )
    write(part, path / "modes.zarr", region={"time": slice(2, 6)}, mode="r+")
    later = ds[["t2m"]].drop_vars("area").isel(time=slice(6, 9)) - 3
    write(later, path / "modes.zarr", region="auto", mode="r+")
    write(ds, path / "new.zarr", mode="w-", zarr_format=2, encoding=_encoding())
    try:
        write(ds, path / "new.zarr", mode="w-")
    except FileExistsError:
        pass
    else:
        raise AssertionError("mode w- wrote over an existing store")


def _memory(write: Writer, ds: xr.Dataset) -> zarr.storage.MemoryStore:
    store = zarr.storage.MemoryStore()
    write(ds.isel(time=slice(0, 5)), store, mode="w", encoding=_encoding(), consolidated=False)
    write(ds.isel(time=slice(5, None)), store, append_dim="time", consolidated=False)
    return store


def _stored(store: zarr.storage.MemoryStore) -> dict[str, bytes]:
    return {key: value.to_bytes() for key, value in store._store_dict.items()}


def _assert_no_dask() -> None:
    try:
        import dask  # noqa: F401
    except ImportError:
        return
    raise AssertionError("dask is importable: the scenarios must run without it")


def _xarray_write(data: xr.Dataset, target: Any, **kwargs: Any) -> Any:
    return data.to_zarr(target, **kwargs)


def scenarios(out: str, values: str) -> None:
    """Write with ``xarray_gds.to_zarr`` into ``out``/gds and with xarray's own
    ``to_zarr`` into ``out``/xarray (``values``: "host" or "device"); memory stores
    are compared here. Run in a process where dask cannot be imported."""
    _assert_no_dask()
    given = _as_device_values() if values == "device" else Counter()
    ds = _dataset()

    for name, write in (("gds", xarray_gds.to_zarr), ("xarray", _xarray_write)):
        (Path(out) / name).mkdir()
        _modes(write, ds, Path(out) / name)
    got, want = _memory(xarray_gds.to_zarr, ds), _memory(_xarray_write, ds)
    assert _stored(got) == _stored(want), sorted(set(_stored(got)) ^ set(_stored(want)))
    if values == "device":
        assert given["DeviceValues"] > 0 and given["ndarray"] > 0, given
    try:
        xarray_gds.to_zarr(ds, Path(out) / "later.zarr", compute=False)
    except ImportError as err:
        assert 'pip install ".[dask]"' in str(err), err
    else:
        raise AssertionError("compute=False without dask returned")
    assert not (Path(out) / "later.zarr").exists()


def _open(path: Path, **kwargs: Any) -> xr.Dataset:
    return xr.open_dataset(path, engine="zarr", **kwargs).load()


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _assert_same_stores(ours: Path, theirs: Path, *, same_bytes: bool) -> None:
    """The stores :func:`_modes` wrote below ``ours`` and ``theirs`` read back the same
    (values and raw values) and hold the same files; byte for byte with ``same_bytes``
    (zarr-python's encoders on both sides; nvCOMP's streams differ from theirs)."""
    for store in ("modes.zarr", "new.zarr"):
        got, want = ours / store, theirs / store
        xr.testing.assert_identical(_open(got), _open(want))
        raw = {"mask_and_scale": False, "decode_times": False}
        xr.testing.assert_identical(_open(got, **raw), _open(want, **raw))
        files, ref = _files(got), _files(want)
        assert sorted(files) == sorted(ref) and len(ref) > 10
        if same_bytes:
            assert files == ref


@pytest.mark.parametrize("values", ["host", "device"])
def test_writes_need_no_dask(tmp_path: Path, values: str) -> None:
    """Every mode and a memory store, without dask: the same stores as xarray's own
    writes, byte for byte, and a ``compute=False`` write refused naming the extra."""
    code = _NO_DASK + (
        "from tests.test_write_plain import scenarios; scenarios(sys.argv[1], sys.argv[2])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), values],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    _assert_same_stores(tmp_path / "gds", tmp_path / "xarray", same_bytes=True)


def test_device_values_stay_wrapped_through_numpy_calls() -> None:
    """What xarray's CF encoding does to device values runs on the values inside and
    comes back wrapped; nothing converts them to numpy implicitly."""
    raw = np.array([[1.5, np.nan], [-2.25, 4.0]], dtype="f4")
    values = DeviceValues(raw.copy())
    filled = np.where(np.isnan(values), values, np.int16(-1).astype("f4"))
    assert isinstance(filled, DeviceValues)
    np.testing.assert_array_equal(filled.values, np.where(np.isnan(raw), raw, np.float32(-1)))
    packed = values.astype("f8", copy=True)
    before = packed
    packed -= 2.0
    packed /= 0.5
    assert packed is before and isinstance(packed, DeviceValues)
    np.testing.assert_array_equal(packed.values, (raw.astype("f8") - 2.0) / 0.5)
    assert isinstance(np.round(packed), DeviceValues)
    assert np.result_type(values, np.int16(1)) == np.dtype("f4")
    assert (values.shape, values.dtype, values.ndim, values.size) == ((2, 2), np.dtype("f4"), 2, 4)
    assert values.nbytes == 16 and values.itemsize == 4
    assert isinstance(values[0], DeviceValues) and not isinstance(values[0, 0], DeviceValues)
    assert values[0, 0] == np.float32(1.5)
    assert isinstance(np.isnan(values), DeviceValues)
    # device values as an index, and as a keyword argument of a numpy function
    rows = values[DeviceValues(np.array([True, False]))]
    assert isinstance(rows, DeviceValues)
    np.testing.assert_array_equal(rows.values, raw[:1])
    taken = np.take(values, indices=DeviceValues(np.array([1, 0])), axis=0)
    assert isinstance(taken, DeviceValues)
    np.testing.assert_array_equal(taken.values, raw[::-1])
    # a ufunc of two outputs in place: both wrappers given come back
    quotient, remainder = DeviceValues(np.empty(2, "f4")), DeviceValues(np.empty(2, "f4"))
    both = np.divmod(values[1], np.float32(2), out=(quotient, remainder))
    assert isinstance(both, tuple) and both[0] is quotient and both[1] is remainder
    np.testing.assert_array_equal(quotient.values, np.divmod(raw[1], np.float32(2))[0])
    with pytest.raises(TypeError, match="not converted to numpy implicitly"):
        np.asarray(values)


def test_device_values_with_dask_variables_of_the_user(tmp_path: Path) -> None:
    """Device values beside the user's dask variables: written at once, the dask ones
    by dask, as xarray writes numpy values beside dask ones."""
    pytest.importorskip("dask")
    given = Counter[str]()
    original = (xarray_gds.write.device_of, xarray_gds.pipeline.GdsCodecPipeline.write)
    try:
        given = _as_device_values()
        ds = _dataset()
        ds["t2m"] = ds.t2m.chunk({"time": 4})
        xarray_gds.to_zarr(ds, tmp_path / "gds.zarr", encoding=_encoding())
    finally:
        xarray_gds.write.device_of = original[0]
        xarray_gds.pipeline.GdsCodecPipeline.write = original[1]  # type: ignore[method-assign]
    ds.to_zarr(tmp_path / "xarray.zarr", encoding=_encoding())
    xr.testing.assert_identical(_open(tmp_path / "gds.zarr"), _open(tmp_path / "xarray.zarr"))
    assert given["DeviceValues"] > 0, given


def test_failed_write_to_a_new_path_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails before or while writing chunks into a path that did not exist
    leaves nothing there, not even the directories it made; a directory that was there
    stays."""
    ds = _dataset()
    with pytest.raises(ValueError, match="unexpected encoding parameters"):
        xarray_gds.to_zarr(ds, tmp_path / "a" / "b" / "out.zarr", encoding={"t2m": {"bad": 1}})
    assert list(tmp_path.iterdir()) == []
    real_put = GdsStore._put

    def put(self: GdsStore, key: str, value: Any) -> None:
        if key.startswith("u10/"):
            raise OSError("disk full (injected)")
        real_put(self, key, value)

    monkeypatch.setattr(GdsStore, "_put", put)
    with pytest.raises(OSError, match="injected"):
        xarray_gds.to_zarr(ds, tmp_path / "out.zarr", encoding=_encoding())
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").mkdir()
    with pytest.raises(OSError, match="injected"):
        xarray_gds.to_zarr(ds, tmp_path / "there", encoding=_encoding())
    assert [p.name for p in tmp_path.iterdir()] == ["there"]
    assert list((tmp_path / "there").iterdir()) == []
    monkeypatch.undo()
    xarray_gds.to_zarr(ds, tmp_path / "there", encoding=_encoding())
    ds.to_zarr(tmp_path / "xarray.zarr", encoding=_encoding())
    xr.testing.assert_identical(_open(tmp_path / "there"), _open(tmp_path / "xarray.zarr"))


def device_scenarios(src: str, out: str) -> None:
    """The modes of :func:`_modes` with ``xarray_gds.to_zarr`` from ``engine="gds-zarr"``
    datasets of ``src`` read on the GPU, lazily loaded and loaded (CuPy values), into
    ``out``/lazy and ``out``/loaded. Run in a process where dask cannot be imported."""
    _assert_no_dask()
    for source in ("lazy", "loaded"):
        ds = xr.open_dataset(src, engine="gds-zarr", device="cuda", drop_variables=["station"])
        if source == "loaded":
            ds = ds.load()
            assert hasattr(ds.u10.data, "__cuda_array_interface__")
        (Path(out) / source).mkdir()
        _modes(xarray_gds.to_zarr, ds.drop_encoding(), Path(out) / source)


@pytest.mark.gpu
def test_device_writes_need_no_dask_on_the_gpu(tmp_path: Path, v3_store: Path) -> None:
    """CuPy values (loaded, and read on the device for the write) through every mode
    without dask: GPU-encoded, the same stores as xarray's own writes of the values
    ``engine="zarr"`` reads."""
    code = _NO_DASK + (
        "from tests.test_write_plain import device_scenarios; "
        "device_scenarios(sys.argv[1], sys.argv[2])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(v3_store), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    ref = xr.open_dataset(v3_store, engine="zarr", drop_variables=["station"]).drop_encoding()
    (tmp_path / "xarray").mkdir()
    _modes(_xarray_write, ref, tmp_path / "xarray")
    for source in ("lazy", "loaded"):
        _assert_same_stores(tmp_path / source, tmp_path / "xarray", same_bytes=False)


def test_unsigned_values_encode_as_device_values() -> None:
    """xarray's CF encoding of a variable stored as signed bytes with ``_Unsigned`` (it
    asks the values for their ``itemsize``): the same as of the same values on the host,
    still wrapped."""
    from xarray.conventions import encode_cf_variable

    raw = np.array([[0, 7, 255], [128, 254, 3]], dtype="u1")
    encoding = {"_Unsigned": "true", "_FillValue": np.int8(-1), "dtype": np.dtype("i1")}
    host = xr.Variable(("y", "x"), raw.astype("f4"), encoding=encoding)
    want = encode_cf_variable(host, name="qc")
    got = encode_cf_variable(host.copy(data=DeviceValues(raw.astype("f4"))), name="qc")
    assert isinstance(got._data, DeviceValues)
    assert got.dtype == want.dtype == np.dtype("i1")
    np.testing.assert_array_equal(got._data.values, want.values)
    assert got.attrs == want.attrs

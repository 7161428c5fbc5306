"""Tests that tell surviving mutants of ``xarray_gds/write.py`` from the original.

Device values stand in as :class:`_DeviceLike` (numpy values behind CuPy's protocols: a
``__cuda_array_interface__``, ``get()``, implicit conversion to numpy refused, and an
array namespace whose functions refuse numpy arrays and scalars, as CuPy's refuse the
fill values xarray's CF encoding passes), lazily loaded device variables as
``engine="gds-zarr"`` opens them with ``device="cuda"`` on test_orderings' stand-ins.
Their arrays are written with a non-default zstd level, which nvCOMP has no encoder
for: the values are copied to the host (``get()``) and encoded by zarr-python, so no
GPU library is needed. What is written is read back with ``engine="zarr"``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr.codecs as zc
from numpy.lib.mixins import NDArrayOperatorsMixin

import tests.test_orderings as orderings
import xarray_gds
import xarray_gds.pipeline
import xarray_gds.write
from tests.test_orderings import Env
from tests.test_reached_lines import _engine_zarr, _numpy_dataset
from xarray_gds import fuse
from xarray_gds.errors import HostBlocksWarning, HostRouteWarning

#: the recording stand-ins of tests/test_orderings.py (CuPy, kvikio, nvCOMP), a fixture
env = orderings.env

# -- a CuPy stand-in ----------------------------------------------------------------------


def _flat(x: Any) -> Iterator[Any]:
    if isinstance(x, tuple | list):
        for v in x:
            yield from _flat(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _flat(v)
    else:
        yield x


def _unwrap(x: Any) -> Any:
    if isinstance(x, _DeviceLike):
        return x.values
    if isinstance(x, tuple | list):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _wrap(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return _DeviceLike(x)
    if isinstance(x, tuple | list):
        return type(x)(_wrap(v) for v in x)
    return x


class _Namespace:
    """CuPy as an array namespace: numpy's functions, refusing numpy inputs."""

    def __getattr__(self, name: str) -> Any:
        func = getattr(np, name)

        def strict(*args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, np.ndarray | np.generic) for a in _flat((args, kwargs))):
                raise TypeError("Input should be a CuPy array")
            return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))

        return strict


class _DeviceLike(NDArrayOperatorsMixin):
    """numpy values standing for a CuPy array; counts the deep copies made of it."""

    deep_copies = 0

    def __init__(self, values: Any) -> None:
        self.values = np.asarray(values)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        v = self.values
        return {"shape": v.shape, "typestr": v.dtype.str, "data": (0, False), "version": 3}

    def __array_namespace__(self, api_version: Any = None) -> _Namespace:
        return _Namespace()

    shape = property(lambda self: self.values.shape)
    dtype = property(lambda self: self.values.dtype)
    ndim = property(lambda self: self.values.ndim)
    size = property(lambda self: self.values.size)
    nbytes = property(lambda self: self.values.nbytes)
    itemsize = property(lambda self: self.values.itemsize)

    def __len__(self) -> int:
        return len(self.values)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed.")

    def get(self, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
        return np.array(self.values)

    def __deepcopy__(self, memo: dict[int, Any]) -> _DeviceLike:
        type(self).deep_copies += 1
        return _DeviceLike(self.values.copy())

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self.values[_unwrap(key)])

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> _DeviceLike:
        return _DeviceLike(self.values.astype(dtype, *args, **kwargs))

    def copy(self, *args: Any, **kwargs: Any) -> _DeviceLike:
        return _DeviceLike(self.values.copy())

    def reshape(self, *args: Any, **kwargs: Any) -> _DeviceLike:
        return _DeviceLike(self.values.reshape(*args, **kwargs))

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        return _wrap(getattr(ufunc, method)(*_unwrap(inputs), **_unwrap(kwargs)))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs)))


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """No deep copies counted yet; every warning given once a process is given again."""
    _DeviceLike.deep_copies = 0
    monkeypatch.setattr(xarray_gds.pipeline, "_warned", set())
    monkeypatch.setattr(fuse, "_warned_host_blocks", False)


#: a codec nvCOMP has no encoder for with levels="host": device values go to the host
_HOST = {"compressors": [zc.ZstdCodec(level=5)]}
_PACKED = {**_HOST, "dtype": "i2", "scale_factor": 0.125, "_FillValue": np.int16(-1)}

_V = np.arange(48.0).reshape(8, 6)
_W = np.arange(6.0) / 4


def _host_values() -> xr.Dataset:
    """What :func:`_device_values` holds, in numpy (as engine="zarr" reads it back)."""
    return xr.Dataset(
        {
            "s": ((), 2.5),
            "v": (("y", "x"), _V),
            "w": (("x",), _W),
            "p": (("y", "x"), _V / 8),
            "h": (("x",), np.arange(6, dtype="i4")),
        },
        coords={"y": np.arange(8)},
    )


def _device_values() -> xr.Dataset:
    """A 0-d device variable first, then 2-D and 1-D ones (one packed to int16 with a
    numpy fill value, as CF encoding writes it), a numpy one, an index coordinate."""
    host = _host_values()
    ds = host.copy()
    for name in ("s", "v", "w", "p"):
        ds[name] = host[name].copy(data=_DeviceLike(host[name].values))
    return ds


def _encoding(ds: xr.Dataset) -> dict[str, dict[str, Any]]:
    out = {name: dict(_HOST) for name in ("s", "v", "w") if name in ds}
    out["p"] = dict(_PACKED)
    if "w" in ds:
        out["w"] = dict(_PACKED)
    return out


def _write_recorded(ds: xr.Dataset, target: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``xarray_gds.to_zarr(ds, target, **kwargs)``: what it returns and the messages
    of its HostRouteWarnings (in order)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = xarray_gds.to_zarr(ds, target, consolidated=False, **kwargs)
    assert all(issubclass(w.category, HostRouteWarning) for w in caught), caught
    return result, [str(w.message).split(" uses ")[0] for w in caught]


# -- for_direct_write ---------------------------------------------------------------------


def test_device_values_go_through_cf_encoding_wrapped_and_uncopied(tmp_path: Path) -> None:
    """for_direct_write: the depth check ``ndim == 0`` turned into ``> 0``, ``!= 0`` or
    ``== 1``, ``continue`` turned into ``break``, ``_is_dask`` negated, ``== "cuda"``
    turned into ``!= "cuda"`` or ``is not "cuda"`` (a device variable reaches xarray's
    CF encoding unwrapped: CuPy's namespace refuses the numpy fill value), and the
    dataset copied deep (``deep=True``: every device variable copied on the device)."""
    ds = _device_values()
    _, warned = _write_recorded(ds, tmp_path / "a.zarr", encoding=_encoding(ds))
    assert sorted(warned) == [f"xarray-gds: array '{n}'" for n in ("p", "s", "v", "w")]
    xr.testing.assert_identical(_engine_zarr(tmp_path / "a.zarr"), _host_values())
    assert _DeviceLike.deep_copies == 0


def test_for_direct_write_says_whether_the_dataset_has_dask_variables() -> None:
    """for_direct_write ``user_dask = True`` dropped or made False: the second value it
    returns is whether the dataset has dask variables of its own."""
    pytest.importorskip("dask")
    ds = _numpy_dataset()
    assert xarray_gds.write.for_direct_write(ds)[1] is False
    chunked = ds.assign(d=ds.v.chunk(y=4))
    prepared, user_dask = xarray_gds.write.for_direct_write(chunked)
    assert user_dask is True
    assert prepared.d.data is chunked.d.data


# -- for_device_write (compute=False) -----------------------------------------------------


@pytest.mark.needs("dask")
def test_compute_false_defers_n_d_device_values_and_writes_the_rest_at_once(
    tmp_path: Path,
) -> None:
    """for_device_write: the depth check ``ndim == 0`` turned into ``< 0``, ``== -1`` or
    ``== 1``, ``continue`` dropped or turned into ``break`` (the 0-d device variable
    deferred with the others, or device variables written at once), the dataset or the
    variables' coordinates copied deep (``deep=True``: device values copied on the
    device). The 0-d and numpy variables are in the store when to_zarr returns, the N-d
    device ones (and a 2-D device coordinate) once the delayed write is computed."""
    ds = _device_values().assign_coords(c=(("y", "x"), _DeviceLike(_V + 100)))
    encoding = _encoding(ds)
    encoding["s"] = encoding["c"] = dict(_HOST)
    target = tmp_path / "a.zarr"
    delayed, warned = _write_recorded(ds, target, encoding=encoding, compute=False)
    assert warned == ["xarray-gds: array 's'"]
    want = _host_values().assign_coords(c=(("y", "x"), _V + 100))
    before = want.copy(deep=True)
    before["v"][...] = before["c"][...] = np.nan  # not written yet: the fill value
    before["w"][...] = before["p"][...] = 0.0  # the packed ones': zarr's (0), unpacked
    xr.testing.assert_identical(_engine_zarr(target), before)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        delayed.compute()
    names = sorted(str(w.message).split("'")[1] for w in caught)
    assert names == ["c", "p", "v", "w"]
    xr.testing.assert_identical(_engine_zarr(target), want)
    assert _DeviceLike.deep_copies == 0


@pytest.mark.needs("dask")
def test_compute_false_write_of_users_dask_across_zarr_chunks_is_refused(tmp_path: Path) -> None:
    """for_device_write ``user_dask = True`` dropped or made False, ``_is_dask`` made
    ``pass`` (None): a ``compute=False`` write of the user's dask variable whose blocks
    straddle the Zarr chunks is refused as xarray refuses it (safe_chunks is left to
    the user), and nothing is written."""
    ds = _numpy_dataset().chunk(y=3)
    target = tmp_path / "a.zarr"
    with pytest.raises(ValueError, match=r"^Specified Zarr chunks encoding\['chunks'\]=\(4, 6\)"):
        xarray_gds.to_zarr(
            ds, target, compute=False, consolidated=False, encoding={"v": {"chunks": (4, 6)}}
        )
    assert not target.exists()


@pytest.mark.needs("dask")
def test_compute_false_write_of_a_lazily_loaded_device_variable_is_one_device_block(
    env: Env, tmp_path: Path
) -> None:
    """_one_block: ``chunks`` of ``-1`` turned into ``1`` or ``+1`` (blocks of one
    element, which xarray refuses to write into chunks of 4 x 6 when safe_chunks is
    asked for), and ``chunked_array_type=GdsDaskManager()`` dropped (dask's default
    manager copies the decoded blocks to the host, with a HostBlocksWarning). The
    delayed write writes the source's values."""
    ds = _numpy_dataset()
    src, out = tmp_path / "src.zarr", tmp_path / "out.zarr"
    ds.to_zarr(src, consolidated=False, encoding={"v": {"chunks": (4, 6)}})
    lazy = xr.open_dataset(src, engine="gds-zarr", device="cuda", consolidated=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostBlocksWarning)
        delayed = xarray_gds.to_zarr(lazy, out, compute=False, safe_chunks=True, consolidated=False)
        delayed.compute()
    xr.testing.assert_identical(_engine_zarr(out), ds)


@pytest.mark.needs("dask")
def test_lazily_loaded_device_variable_is_read_whole_and_written(env: Env, tmp_path: Path) -> None:
    """for_direct_write ``is_device_array`` negated: a lazily loaded device variable
    (not a device array yet) is handed to xarray unread instead of its values."""
    ds = _numpy_dataset()
    src, out = tmp_path / "src.zarr", tmp_path / "out.zarr"
    ds.to_zarr(src, consolidated=False, encoding={"v": {"chunks": (4, 6)}})
    lazy = xr.open_dataset(src, engine="gds-zarr", device="cuda", consolidated=False)
    xarray_gds.to_zarr(lazy, out, consolidated=False)
    xr.testing.assert_identical(_engine_zarr(out), ds)


# -- to_zarr: dask, arguments, stores -----------------------------------------------------


@pytest.fixture
def no_dask(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import dask`` fails from here on, as on the base install."""
    monkeypatch.setitem(sys.modules, "dask", None)


@pytest.mark.usefixtures("no_dask")
def test_a_write_without_dask_variables_needs_no_dask(tmp_path: Path) -> None:
    """_prepared ``compute`` defaulting to False, ``return for_direct_write(...)``
    dropped, _runs_here's ``not any(...)`` made ``any(...)`` or its ``return True``
    dropped: a write of numpy and device values with compute=True (the default) needs
    no dask."""
    ds = _device_values()
    _, warned = _write_recorded(ds, tmp_path / "a.zarr", encoding=_encoding(ds))
    assert len(warned) == 4
    xr.testing.assert_identical(_engine_zarr(tmp_path / "a.zarr"), _host_values())


@pytest.mark.usefixtures("no_dask")
def test_compute_false_without_dask_names_the_extra(tmp_path: Path) -> None:
    """_DASK_EXTRA dropped, _require_dask's ``except ImportError`` replaced, its
    ``raise`` or its call dropped: compute=False without dask raises this ImportError,
    before anything is made at the target."""
    target = tmp_path / "new" / "a.zarr"
    message = (
        "xarray_gds.to_zarr(..., compute=False) returns a dask.delayed.Delayed, as "
        'Dataset.to_zarr does, and needs dask: install it (pip install ".[dask]" in a '
        "checkout of xarray-gds), or write with compute=True (the default), which "
        "needs no dask."
    )
    for ds in (_numpy_dataset(), _device_values()):
        with pytest.raises(ImportError) as caught:
            xarray_gds.to_zarr(ds, target, compute=False)
        assert str(caught.value) == message
        assert isinstance(caught.value.__cause__, ImportError)
    assert not (tmp_path / "new").exists()


def test_dataset_and_store_by_keyword_levels_by_keyword_only(tmp_path: Path) -> None:
    """to_zarr's ``*`` turned into ``/``: ``ds`` and ``store`` may be passed by keyword,
    ``levels`` may not be passed by position."""
    ds = _numpy_dataset()
    xarray_gds.to_zarr(ds=ds, store=tmp_path / "a.zarr", consolidated=False)
    xr.testing.assert_identical(_engine_zarr(tmp_path / "a.zarr"), ds)
    with pytest.raises(TypeError, match=r"takes 2 positional arguments but 3 were given$"):
        xarray_gds.to_zarr(ds, tmp_path / "b.zarr", "gpu")
    assert not (tmp_path / "b.zarr").exists()


class _UrlPath:
    """An ``os.PathLike`` of a URL (no store kind opens it)."""

    def __fspath__(self) -> str:
        return "memory://mutation-kills-write/a.zarr"


def test_a_path_like_url_no_kind_opens_is_refused_by_type() -> None:
    """_opened's ``opened is not None and ...`` turned into ``or``: a path-like target no
    store kind opens is refused with the TypeError naming what store may be."""
    with pytest.raises(TypeError) as caught:
        xarray_gds.to_zarr(_numpy_dataset(), _UrlPath())
    assert str(caught.value) == (
        "store must be a path, a URL, a zarr Store, an fsspec mapper or a dict, not _UrlPath"
    )


class Buffer:
    """A class whose name sorts before "FSMap" (and is no mapper)."""


def test_a_target_of_another_type_is_refused_whatever_its_name() -> None:
    """_as_store's ``type(store).__name__ == "FSMap"`` turned into ``<=``: an object of a
    class named before "FSMap" is refused as any other, not taken for an fsspec mapper."""
    with pytest.raises(TypeError) as caught:
        xarray_gds.to_zarr(_numpy_dataset(), Buffer())
    assert str(caught.value) == (
        "store must be a path, a URL, a zarr Store, an fsspec mapper or a dict, not Buffer"
    )


@pytest.mark.needs("fsspec")
def test_as_store_of_a_url_takes_its_storage_options() -> None:
    """_as_store ``storage_options=storage_options`` dropped: a URL's store is opened
    with the storage options given."""
    store = xarray_gds.write._as_store("memory://mutation-kills-write/b.zarr", {"key": "k"})
    assert store.fs.sync_fs.storage_options["key"] == "k"  # memory: wrapped for async
    assert not store.read_only


def _elsewhere(dsk: Any, keys: Any, **kwargs: Any) -> Any:
    """A dask scheduler whose tasks run on a pickled copy of the graph, as a cluster's
    worker processes run them (here, one after another in this thread)."""
    import cloudpickle
    import dask.local

    return dask.local.get_sync(cloudpickle.loads(cloudpickle.dumps(dsk)), keys, **kwargs)


@pytest.mark.needs("dask", "cloudpickle")
def test_a_failed_write_whose_tasks_ran_elsewhere_removes_their_chunks(tmp_path: Path) -> None:
    """_write's ``and`` turned into ``or``, ``_runs_here(prepared)`` into ``prepared``,
    _runs_here's ``not any`` into ``any`` or ``not not any``, ``_is_dask`` made ``pass``:
    under a scheduler whose tasks run in other processes, the store is sent to them as
    the store itself, so a failed write finds the chunks they wrote by listing and
    removes them: nothing of the new store is left."""
    import dask

    from tests.test_write import _dask_dataset

    target = tmp_path / "a.zarr"
    failing = pytest.raises(RuntimeError, match=r"^block failed \(injected\)$")
    with failing, dask.config.set(scheduler=_elsewhere):
        # blocks run last to first here: blocks 2 and 1 write their chunks first
        xarray_gds.to_zarr(_dask_dataset(fail_block=0), target, consolidated=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []

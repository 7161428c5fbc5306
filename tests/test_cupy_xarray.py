"""GPU data through xarray's own calls.

- xarray's own ``Dataset.to_zarr`` writes CuPy-backed datasets when the project's
  codec pipeline is selected in zarr's configuration: the arrays xarray creates then
  encode device values on the GPU (``GdsCodecPipeline.write``). Without it zarr's own
  pipeline receives the CuPy values and CuPy refuses the implicit conversion.
- cupy-xarray's ``.cupy`` accessor (``is_cupy``, ``as_numpy``, ``as_cupy``) on every
  kind of dataset the engine returns: lazily loaded, loaded, dask (with xarray's
  default chunk manager and with :class:`~xarray_gds.GdsDaskManager`), DataTree nodes.

Every result is compared with ``engine="zarr"``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr

import xarray_gds
import xarray_gds.pipeline
from xarray_gds.pipeline import writing_to

from .conftest import sample_dataset

pytestmark = pytest.mark.filterwarnings("ignore::xarray.SerializationWarning")

#: the zarr configuration that selects the project's codec pipeline
PIPELINE = {"codec_pipeline.path": "xarray_gds.pipeline.GdsCodecPipeline"}


def _device_names(ds: xr.Dataset) -> list[str]:
    """Data variables the engine places on the device."""
    return [
        str(n)
        for n, v in ds.data_vars.items()
        if xarray_gds.placement(str(n), v.variable) == "cuda"
    ]


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Count the calls of the function ``owner.name`` (plain or ``async``) from now on."""
    calls: list[int] = []
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):

        async def counted_async(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return await original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted_async)
    else:

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls


# -- xarray's own Dataset.to_zarr ----------------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_xarray_to_zarr_goes_through_the_pipeline_when_selected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zarr_format: int
) -> None:
    """On the host: with the pipeline selected, xarray's own ``to_zarr`` hands the
    arrays' chunks to ``GdsCodecPipeline``'s batched encoder (the route device values
    take; host values take it with ``XARRAY_GDS_BATCHED_HOST_WRITES=1``), and the
    store reads back as the one xarray writes with zarr's own pipeline."""
    monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    batched = _count_calls(monkeypatch, xarray_gds.writes, "write_batched")
    ds = sample_dataset().drop_vars("station")
    codec: Any = zarr.codecs.ZstdCodec() if zarr_format == 3 else numcodecs.Zstd()
    encoding = {name: {"compressors": [codec]} for name in ("t2m", "n_obs", "u16")}
    with zarr.config.set(PIPELINE):
        ds.to_zarr(tmp_path / "own.zarr", zarr_format=zarr_format, encoding=encoding)
    assert zarr.config.get("codec_pipeline.path") != PIPELINE["codec_pipeline.path"]
    assert batched, "xarray's writes did not reach GdsCodecPipeline's batched encoder"
    ds.to_zarr(tmp_path / "ref.zarr", zarr_format=zarr_format, encoding=encoding)
    got = xr.open_dataset(tmp_path / "own.zarr", engine="zarr").load()
    ref = xr.open_dataset(tmp_path / "ref.zarr", engine="zarr").load()
    xr.testing.assert_identical(got, ref)
    for name in ("t2m", "n_obs", "u16"):
        raw = zarr.open_array(tmp_path / "own.zarr", path=name, mode="r")[...]
        raw_ref = zarr.open_array(tmp_path / "ref.zarr", path=name, mode="r")[...]
        np.testing.assert_array_equal(raw, raw_ref)


#: xarray's public option that keeps dask blocks of device variables on the device
_ON_DEVICE: Any = "gds-dask"

#: how a dataset of the engine is made before xarray writes it
_SOURCES: dict[str, Callable[[Path], xr.Dataset]] = {
    "loaded": lambda p: xr.open_dataset(p, engine="gds-zarr", device="cuda").load(),
    "lazy": lambda p: xr.open_dataset(p, engine="gds-zarr", device="cuda"),
    "dask-cupy-blocks": lambda p: xr.open_dataset(
        p,
        engine="gds-zarr",
        device="cuda",
        chunks={},
        chunked_array_type=_ON_DEVICE,
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("select", ["zarr.config", "writing_to"])
@pytest.mark.parametrize("source", list(_SOURCES))
def test_xarray_to_zarr_writes_cupy_data_on_the_gpu(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    v3_store: Path,
    source: str,
    select: str,
) -> None:
    import cupy

    from xarray_gds.codecs import nvcomp

    gpu_encodes = _count_calls(monkeypatch, nvcomp, "encode")
    src = _SOURCES[source](v3_store)
    if source == "loaded":
        assert isinstance(src.t2m.data, cupy.ndarray)
    out, out_ref = tmp_path / "out.zarr", tmp_path / "ref.zarr"
    target = zarr.storage.LocalStore(out)
    # levels="gpu": the store's zstd level 3 is encoded by nvCOMP too (see to_zarr)
    context = (
        zarr.config.set({**PIPELINE, "xarray_gds.levels": "gpu"})
        if select == "zarr.config"
        else writing_to(target, "gpu")
    )
    masked = _cf_masked(src) if source != "dask-cupy-blocks" else []
    with context:
        src.drop_vars(masked).to_zarr(target, mode="w")  # xarray's own to_zarr
    assert gpu_encodes, "no chunk was encoded by nvCOMP"
    # the reference: xarray's own reader and writer, on the host
    xr.open_dataset(v3_store, engine="zarr").drop_vars(masked).to_zarr(out_ref, mode="w")
    got = xr.open_dataset(out, engine="zarr").load()
    ref = xr.open_dataset(out_ref, engine="zarr").load()
    xr.testing.assert_identical(got, ref)
    for name in _device_names(ref):
        for key in ("chunks", "compressors", "dtype"):
            assert got[name].encoding.get(key) == ref[name].encoding.get(key), (name, key)


#: what xarray's CF masking and packing encoders take from a variable
_CF_MASK_KEYS = ("_FillValue", "missing_value", "scale_factor", "add_offset")


def _cf_masked(ds: xr.Dataset) -> list[str]:
    """Variables that xarray's CF encoding masks or packs: on CuPy values (not dask)
    it fails inside xarray, before any zarr pipeline sees them (xarray passes a numpy
    scalar to ``cupy.astype``); the user guide sends them to ``xarray_gds.to_zarr``."""
    return [
        str(name)
        for name, var in ds.variables.items()
        if any(k in var.encoding or k in var.attrs for k in _CF_MASK_KEYS)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["loaded", "lazy"])
def test_xarray_to_zarr_of_masked_cupy_values_fails_in_xarray(
    tmp_path: Path, v3_store: Path, source: str
) -> None:
    """xarray's own CF encoder cannot mask or pack CuPy values (the limitation the user
    guide documents); ``xarray_gds.to_zarr`` writes the same variables."""
    src = _SOURCES[source](v3_store)
    masked = _cf_masked(src)
    assert "u10" in masked  # packed to int16 with a _FillValue
    target = zarr.storage.LocalStore(tmp_path / "out.zarr")
    with writing_to(target, "gpu"), pytest.raises(TypeError, match="while encoding variable"):
        src[masked].to_zarr(target, mode="w")
    xarray_gds.to_zarr(src[masked], tmp_path / "ok.zarr", mode="w")
    ref = xr.open_dataset(v3_store, engine="zarr")[masked]
    ref.to_zarr(tmp_path / "ref.zarr", mode="w")
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "ok.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "ref.zarr", engine="zarr").load(),
    )


@pytest.mark.gpu
def test_xarray_to_zarr_without_the_pipeline_is_refused_by_cupy(
    tmp_path: Path, v3_store: Path
) -> None:
    """zarr's own pipeline cannot take device values; the user guide says to use
    ``xarray_gds.to_zarr`` or to select the pipeline."""
    src = xr.open_dataset(v3_store, engine="gds-zarr", device="cuda").load()
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        src.drop_vars(_cf_masked(src)).to_zarr(tmp_path / "out.zarr", mode="w")
    xarray_gds.to_zarr(src, tmp_path / "ok.zarr", mode="w")
    # the reference: xarray's own reader and writer, on the host
    xr.open_dataset(v3_store, engine="zarr").to_zarr(tmp_path / "ref.zarr", mode="w")
    xr.testing.assert_identical(
        xr.open_dataset(tmp_path / "ok.zarr", engine="zarr").load(),
        xr.open_dataset(tmp_path / "ref.zarr", engine="zarr").load(),
    )


# -- cupy-xarray's .cupy accessor ----------------------------------------------------


def _check_accessor(gds: xr.Dataset, ref: xr.Dataset, *, blocks_on_device: bool) -> None:
    """``.cupy`` on a dataset of the engine (``gds``) against engine="zarr" (``ref``).

    ``blocks_on_device``: whether the device variables' values (dask blocks included)
    are CuPy arrays; False for dask arrays of xarray's default chunk manager, whose
    blocks are numpy copies (see docs/dask.md).
    """
    import cupy

    pytest.importorskip("cupy_xarray")
    names = _device_names(gds)
    host_names = [str(n) for n in gds.data_vars if str(n) not in names]
    assert names and host_names  # the sample has both kinds
    ref = ref.load()
    for name in names:
        assert gds[name].cupy.is_cupy is blocks_on_device, name
    for name in host_names:  # strings, datetimes, 0-d variables stay numpy
        assert gds[name].cupy.is_cupy is False, name
    assert gds.cupy.is_cupy is False  # not every data variable is a CuPy array
    assert gds[names].cupy.is_cupy is blocks_on_device

    # as_numpy: each data variable in host memory, the values engine="zarr" reads
    host = gds[names].cupy.as_numpy().load()
    for name in names:
        assert isinstance(host[name].data, np.ndarray), name
    # (the accessor converts data variables only; xarray's as_numpy the coordinates)
    xr.testing.assert_identical(host.as_numpy(), ref[names])
    one = gds["t2m"].cupy.as_numpy().load()
    assert isinstance(one.data, np.ndarray)
    xr.testing.assert_identical(one.as_numpy(), ref["t2m"])

    # as_cupy: from the engine's values or engine="zarr"'s, the same CuPy values
    for start in (gds[names], ref[names]):
        on_gpu = start.cupy.as_cupy()
        assert on_gpu.cupy.is_cupy
        loaded = on_gpu.load()
        for name in names:
            assert isinstance(loaded[name].data, cupy.ndarray), name
        xr.testing.assert_identical(loaded.as_numpy(), ref[names])
    t2m = gds["t2m"].cupy.as_cupy()
    assert t2m.cupy.is_cupy
    cupy.testing.assert_array_equal(t2m.load().data, cupy.asarray(ref["t2m"].values))


@pytest.mark.gpu
@pytest.mark.parametrize("loaded", [False, True], ids=["lazy", "loaded"])
def test_accessor_on_eager_datasets(v3_store: Path, loaded: bool) -> None:
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device="cuda")
    if loaded:
        gds = gds.load()
    _check_accessor(gds, xr.open_dataset(v3_store, engine="zarr"), blocks_on_device=True)


@pytest.mark.gpu
@pytest.mark.parametrize("manager", ["GdsDaskManager", "xarray-default"])
def test_accessor_on_dask_datasets(v3_store: Path, manager: str) -> None:
    pytest.importorskip("dask")
    kwargs: dict[str, Any] = {"chunks": {}}
    if manager == "GdsDaskManager":
        kwargs["chunked_array_type"] = xarray_gds.GdsDaskManager()
    gds = xr.open_dataset(v3_store, engine="gds-zarr", device="cuda", **kwargs)
    assert gds.t2m.chunks is not None
    ref = xr.open_dataset(v3_store, engine="zarr", chunks={})
    _check_accessor(gds, ref, blocks_on_device=manager == "GdsDaskManager")


@pytest.fixture(scope="module")
def tree_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tree") / "tree.zarr"
    base = sample_dataset()
    xr.DataTree.from_dict(
        {
            "/": base[["t2m", "station"]],
            "/surface": base[["u10", "n_obs", "valid_time"]],
            "/surface/deep": base[["qc", "lead", "u16"]],
        }
    ).to_zarr(path, zarr_format=3)
    return path


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [None, {}], ids=["eager", "dask"])
def test_accessor_on_datatree_nodes(tree_path: Path, chunks: dict[str, Any] | None) -> None:
    import cupy

    pytest.importorskip("cupy_xarray")
    kwargs: dict[str, Any] = {}
    if chunks is not None:
        pytest.importorskip("dask")
        kwargs = {"chunks": chunks, "chunked_array_type": xarray_gds.GdsDaskManager()}
    tree = xr.open_datatree(tree_path, engine="gds-zarr", device="cuda", **kwargs)
    ref = xr.open_datatree(tree_path, engine="zarr")
    assert tree.groups == ref.groups
    for path in ref.groups:
        node, ref_node = tree[path], ref[path]
        assert isinstance(node, xr.DataTree) and isinstance(ref_node, xr.DataTree)
        names = _device_names(node.to_dataset())
        assert names, path
        for name in map(str, node.data_vars):
            assert node[name].cupy.is_cupy is (name in names), (path, name)
        # the node's own dataset view and a copy of it
        assert node.dataset[names].cupy.is_cupy
        assert not node.dataset.cupy.is_cupy  # each node holds a host variable too
        host = node.to_dataset()[names].cupy.as_numpy().load()
        for name in names:
            assert isinstance(host[name].data, np.ndarray), (path, name)
        want = ref_node.to_dataset()[names].load()
        xr.testing.assert_identical(host.as_numpy(), want)
        back = want.cupy.as_cupy()
        assert back.cupy.is_cupy
        for name in names:
            cupy.testing.assert_array_equal(back[name].data, node[name].load().data)

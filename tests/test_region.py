"""Box reads without zarr's indexing (xarray_gds.region) against zarr-python's reads."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from xarray_gds import GdsStore, decode
from xarray_gds import device as _device
from xarray_gds.codecs import DecodeChain
from xarray_gds.errors import ChunkDecodeError
from xarray_gds.pipeline import attach
from xarray_gds.region import read_box

from .conftest import STORE_CASES

# boxes of t2m (time 10, lat 9, lon 12; chunks 4 x 4 x 5 in every sample store)
BOXES: list[tuple[Any, ...]] = [
    (slice(None), slice(None), slice(None)),
    (3, slice(None), slice(None)),
    (-1, -2, slice(None)),
    (slice(2, 9), slice(None), slice(1, 11)),
    (slice(4, 8), slice(4, 8), slice(5, 10)),  # exactly one chunk
    (slice(9, 10), slice(8, 9), slice(11, 12)),  # the last element: an edge chunk
    (0, 0, 0),
    (slice(1, 3), 4, slice(-3, None)),
]


def _open(path: Path, name: str = "t2m") -> Any:
    return attach(zarr.open_group(GdsStore(path, read_only=True), mode="r")[name])


def _reference(path: Path, key: tuple[Any, ...], name: str = "t2m") -> np.ndarray:
    return np.asarray(zarr.open_group(path, mode="r")[name][key])


def _batched(array: Any, device: str) -> bool:
    chain = array.async_array.codec_pipeline.chain
    return isinstance(chain, DecodeChain) and (device == "cpu" or chain.device_ready)


@pytest.mark.parametrize(("zarr_format", "codec"), STORE_CASES)
def test_boxes_match_zarr(store_factory: Callable, device: str, zarr_format: int, codec: str):
    path = store_factory(zarr_format, codec)
    array = _open(path)
    for key in BOXES:
        got = read_box(array, key, device)
        if not _batched(array, device):
            assert got is None  # sharded, or codecs without a batched decoder: zarr's path
            continue
        assert got is not None, key
        assert isinstance(got, _device.array_module(device).ndarray)
        want = _reference(path, key)
        assert got.dtype == want.dtype.newbyteorder("=")
        np.testing.assert_array_equal(_device.to_host(got), want, err_msg=str(key))


def test_missing_chunks_read_as_the_fill_value(v3_store: Path, device: str) -> None:
    """The sample t2m has one chunk never written (all NaN): read as its fill value."""
    array = _open(v3_store)
    key = (slice(None), slice(None), slice(None))
    got = _device.to_host(read_box(array, key, device))
    want = _reference(v3_store, key)
    assert np.isnan(want).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "key",
    [
        (slice(None, None, 2), slice(None), slice(None)),  # a step
        (slice(5, 5), slice(None), slice(None)),  # empty
        (10, slice(None), slice(None)),  # out of bounds: zarr raises
        (np.array([0, 2]), slice(None), slice(None)),  # not a box
        (slice(None), slice(None)),  # too few axes
    ],
)
def test_other_selections_are_left_to_zarr(v3_store: Path, device: str, key: Any) -> None:
    assert read_box(_open(v3_store), key, device) is None


def test_arrays_zarr_opened_are_left_to_zarr(v3_store: Path, device: str) -> None:
    array = zarr.open_group(v3_store, mode="r")["t2m"]  # zarr's pipeline and LocalStore
    assert read_box(array, (slice(None),) * 3, device) is None


def test_read_missing_chunks_false_is_left_to_zarr(v3_store: Path, device: str) -> None:
    """zarr raises for missing chunks when its read_missing_chunks is off: its path reads."""
    key = (slice(None),) * 3
    # with_config builds the array's codec pipeline again: attach to the new arrays
    reads = attach(_open(v3_store).with_config({"read_missing_chunks": True}))
    raises = attach(_open(v3_store).with_config({"read_missing_chunks": False}))
    assert read_box(reads, key, device) is not None
    assert read_box(raises, key, device) is None


def test_parts_are_bounded(monkeypatch: pytest.MonkeyPatch, v3_store: Path, device: str) -> None:
    """A box larger than the batch budget reads in parts of whole rows of chunks; when
    a single row does not fit, zarr's path (which splits finer) takes the read."""
    decoded: list[int] = []
    real = decode.decode_fetched

    def spy(chain: Any, fetched: Any, keys: list, *args: Any) -> Any:
        decoded.append(len(keys))
        return real(chain, fetched, keys, *args)

    monkeypatch.setattr(decode, "decode_fetched", spy)
    array = _open(v3_store)
    chunk = array.async_array.codec_pipeline.chain.nbytes  # decoded bytes of a chunk
    key = (slice(None), slice(None), slice(None))
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", str(9 * chunk))  # one row: 3 x 3 chunks
    got = read_box(array, key, device)
    assert decoded == [9, 9, 9]
    np.testing.assert_array_equal(_device.to_host(got), _reference(v3_store, key))
    monkeypatch.setenv("XARRAY_GDS_BATCH_BYTES", str(8 * chunk))
    assert read_box(array, key, device) is None


def test_damaged_chunk_is_named(tmp_path: Path, v3_store: Path, device: str) -> None:
    path = tmp_path / "damaged.zarr"
    shutil.copytree(v3_store, path)
    (path / "t2m" / "c" / "1" / "1" / "1").write_bytes(b"\x28\xb5\x2f\xfd garbage")
    array = _open(path)
    with pytest.raises(ChunkDecodeError, match="t2m/c/1/1/1"):
        read_box(array, (slice(None),) * 3, device)
    # the next read in the same process works
    key = (slice(0, 4), slice(None), slice(None))
    got = _device.to_host(read_box(array, key, device))
    np.testing.assert_array_equal(got, _reference(v3_store, key))


def test_integer_axes_are_dropped(v3_store: Path, device: str) -> None:
    got = read_box(_open(v3_store), (np.int64(2), slice(1, 4), 7), device)
    assert got.shape == (3,)
    want = _reference(v3_store, (2, slice(1, 4), 7))
    np.testing.assert_array_equal(_device.to_host(got), want)


@pytest.mark.parametrize(
    ("zarr_format", "encoding"),
    [
        (3, {"name": "default", "separator": "/"}),
        (3, {"name": "default", "separator": "."}),
        (3, {"name": "v2", "separator": "."}),
        (3, {"name": "v2", "separator": "/"}),
        (2, {"name": "v2", "separator": "/"}),
        (2, {"name": "v2", "separator": "."}),
    ],
)
def test_chunk_key_encodings(tmp_path: Path, device: str, zarr_format: int, encoding: dict):
    """Keys built for a box are zarr's own, whatever the chunk key encoding."""
    values = np.arange(7 * 11 * 13, dtype="i4").reshape(7, 11, 13)
    kwargs: dict[str, Any] = {"chunk_key_encoding": encoding}
    root = zarr.open_group(tmp_path / "keys.zarr", mode="w", zarr_format=zarr_format)
    root.create_array("v", shape=values.shape, chunks=(2, 3, 4), dtype="i4", **kwargs)[...] = values
    array = _open(tmp_path / "keys.zarr", "v")
    key = (slice(1, 6), slice(None), slice(2, 12))
    got = read_box(array, key, device)
    assert got is not None
    np.testing.assert_array_equal(_device.to_host(got), values[key])


def test_outer_keys_without_arrays_read_as_boxes(
    monkeypatch: pytest.MonkeyPatch, v3_store: Path, device: str
) -> None:
    """xarray's outer indexers of integers and slices only take the box read; those with
    an array take zarr's orthogonal selection."""
    from xarray.core import indexing

    import xarray_gds.array
    from xarray_gds.array import GdsBackendArray

    boxes: list[tuple[Any, ...]] = []

    def spy(array: Any, key: tuple[Any, ...], dev: str) -> Any:
        boxes.append(key)
        return read_box(array, key, dev)

    monkeypatch.setattr(xarray_gds.array, "read_box", spy)
    backend = GdsBackendArray(_open(v3_store), "t2m", device)
    key = (slice(1, 7), 2, slice(None))
    got = backend[indexing.OuterIndexer(key)]
    assert len(boxes) == 1
    np.testing.assert_array_equal(_device.to_host(got), _reference(v3_store, key))
    boxes.clear()
    with_array = (np.array([0, 3, 9]), slice(None), slice(2, 8))
    got = backend[indexing.OuterIndexer(with_array)]
    assert not boxes
    want = _reference(v3_store, (slice(None),) * 3)[np.ix_([0, 3, 9], range(9), range(2, 8))]
    np.testing.assert_array_equal(_device.to_host(got), want)


# -- whole chunks decoded straight into the output (host, streamed) ----------------

_WHOLE_LAYOUTS = {
    # name: (zarr format, dtype, chunks, create_array keywords): array (7, 16, 8)
    "v3-zstd": (3, "<f4", (2, 16, 8), {}),
    "v3-raw": (3, "<i4", (2, 16, 8), {"compressors": None}),
    "v3-big-endian": (3, "<f4", (2, 16, 8), {"endian": "big"}),
    "v3-transposed": (3, "<f4", (2, 16, 8), {"order": "F"}),
    "v2-shuffle": (2, "<f4", (2, 16, 8), {"filters": "shuffle"}),
    "v3-half-rows": (3, "<f4", (2, 8, 8), {}),  # whole chunks, not contiguous in the box
}


def _whole_store(path: Path, layout: str) -> tuple[Path, int]:
    """A ``(7, 16, 8)`` array ``v`` of ``layout`` with chunk ``(1, 0, 0)`` missing, and
    how many of its chunks lie whole and contiguous in a read of it all."""
    import numcodecs

    fmt, dtype, chunks, extra = _WHOLE_LAYOUTS[layout]
    kwargs: dict[str, Any] = dict(extra)
    if kwargs.get("filters") == "shuffle":
        kwargs["filters"] = [numcodecs.Shuffle(elementsize=4)]
        kwargs["compressors"] = [numcodecs.Zstd(level=1)]
    if kwargs.pop("endian", None) == "big":
        kwargs["serializer"] = zarr.codecs.BytesCodec(endian="big")
    if kwargs.pop("order", None) == "F":
        if fmt == 3:
            kwargs["serializer"] = "auto"
            kwargs["filters"] = [zarr.codecs.TransposeCodec(order=(2, 1, 0))]
        else:
            kwargs["order"] = "F"
    group = zarr.open_group(path, mode="w", zarr_format=fmt)
    names = ("t", "y", "x")
    if fmt == 3:
        kwargs["dimension_names"] = names
    else:
        kwargs["attributes"] = {"_ARRAY_DIMENSIONS": list(names)}
    array = group.create_array("v", shape=(7, 16, 8), chunks=chunks, dtype=dtype, **kwargs)
    values = np.arange(7 * 16 * 8).reshape(7, 16, 8).astype(dtype)
    array[...] = values
    key = array.metadata.encode_chunk_key((1, 0, 0))
    (path / "v" / key).unlink()
    whole = 2 if layout in ("v3-zstd", "v3-raw") else 0  # chunks 0 and 2; 3 is an edge
    return path, whole


@pytest.mark.parametrize("layout", list(_WHOLE_LAYOUTS))
@pytest.mark.parametrize(
    "pick",
    [
        {},
        {"t": slice(2, 6)},  # whole chunks 1 and 2
        {"t": slice(1, 5)},  # every chunk cut along t
        {"t": 4},
        {"x": slice(1, 7)},  # cut along x
    ],
    ids=["all", "rows-2-6", "rows-1-5", "row-4", "x-1-7"],
)
def test_whole_chunks_decode_into_the_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, pick: dict[str, Any]
) -> None:
    """Host reads of local chunks, streamed: a chunk that fills a contiguous part of the
    output whole, stored as its values lie (no filter, native byte order, C order) is
    decoded into the output; every other chunk (a filter, big-endian, transposed, cut
    by the selection, not contiguous) is decoded and copied. Values as engine="zarr"
    reads them, the missing chunk the fill value."""
    import xarray as xr

    from xarray_gds import coalesce

    monkeypatch.setattr(coalesce, "STREAM_CHUNK", 0)
    root, whole = _whole_store(tmp_path / "w.zarr", layout)
    into: list[int] = []
    real = decode.decode_host

    def spy(chain: Any, chunks: Any, keys: Any, out: Any = None, done: Any = None) -> Any:
        if out is not None:
            into.append(len(chunks))
        return real(chain, chunks, keys, out, done)

    monkeypatch.setattr(decode, "decode_host", spy)
    ours = xr.open_dataset(root, engine="gds-zarr", device="cpu", consolidated=False)
    ref = xr.open_dataset(root, engine="zarr", consolidated=False)
    got = ours["v"].isel(pick).values
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, ref["v"].isel(pick).values)
    assert got.dtype == ref["v"].dtype
    if not pick:
        assert sum(into) == whole, (layout, into)
    elif pick == {"t": slice(2, 6)}:
        assert sum(into) == (1 if whole else 0), (layout, into)  # chunk 1 is missing
    else:
        assert sum(into) == 0, (layout, pick, into)


@pytest.mark.parametrize(
    ("dtype", "serializer", "plain"),
    [
        ("<f4", None, True),
        ("<i2", zarr.codecs.BytesCodec(endian="big"), False),  # stored big-endian
        ("<f4", zarr.codecs.BytesCodec(endian="big"), False),
        ("u1", None, True),  # one byte: no byte order
    ],
)
def test_plain_chains(tmp_path: Path, dtype: str, serializer: Any, plain: bool) -> None:
    """DecodeChain.plain: decoded bytes lie as the values only for a native byte order,
    no filter and C order (the filter and transposed cases are the layouts above)."""
    kwargs: dict[str, Any] = {} if serializer is None else {"serializer": serializer}
    group = zarr.open_group(tmp_path / "p.zarr", mode="w", zarr_format=3)
    group.create_array("v", shape=(4, 4), chunks=(2, 4), dtype=dtype, **kwargs)
    chain = _open(tmp_path / "p.zarr", "v").async_array.codec_pipeline.chain
    assert isinstance(chain, DecodeChain)
    assert chain.plain is plain
    for layout, expected in (("v3-transposed", False), ("v2-shuffle", False)):
        root, _ = _whole_store(tmp_path / f"{layout}.zarr", layout)
        assert _open(root, "v").async_array.codec_pipeline.chain.plain is expected


def test_placer_targets_are_flat_views_of_whole_chunks(tmp_path: Path) -> None:
    """A host box read's sink offers, for a whole chunk in a contiguous part of the
    output, that part as one flat uint8 view of the output itself; nothing for a chunk
    the box's edge cuts, one whose part is not contiguous, or a chain that is not plain."""
    from xarray_gds import region

    def sink(layout: str) -> Any:
        root, _ = _whole_store(tmp_path / f"{layout}.zarr", layout)
        planned = region._plan(_open(root, "v"), (slice(None),) * 3, "cpu")
        assert planned is not None
        return planned.sink()

    placer = sink("v3-zstd")
    out = placer.out
    out[...] = 0  # (a new output holds whatever its memory held)
    got = placer.target(1)  # rows 2-3
    assert got is not None
    assert got.ndim == 1 and got.dtype == np.uint8 and got.nbytes == 2 * 16 * 8 * 4
    got[:] = 7
    assert np.all(out[2:4].view(np.uint8) == 7) and not np.any(out[:2].view(np.uint8) == 7)
    assert placer.target(3) is None  # row 6 only: the edge cuts it
    assert sink("v3-half-rows").target(0) is None  # half of each row of the output
    assert sink("v3-big-endian").target(0) is None  # not plain

"""Layouts x routes x store kinds on the host, each compared with engine="zarr"
(zarr-python, the reference decoder): values, and the dtype with its byte order
(``xr.testing.assert_identical`` compares values only: ``>f4`` and ``<f4`` alike).

- shards with their index at the start or the end of the shard file, with and
  without a CRC-32C of the index, from a local directory, zarr's ``LocalStore`` and
  ``MemoryStore``, an fsspec store (``memory://``) and an HTTP server (the remote
  source): a shard's index is read through each store's own byte-range reads there,
  not only by ``pread`` of a local file;
- big-endian and little-endian arrays, Zarr v2 and v3: every route (box, points,
  vectorized points, dask (``.chunk()`` and ``chunks={}``), ``load_async``, the
  loader) gives the dtype box reads, the declared dtype and engine="zarr" give.

- the layout space as a whole (``test_layout_space_on_every_route_and_store``, drawn by
  hypothesis with a fixed seed): Zarr v2 and v3; both byte orders; fill values 0, NaN,
  a nonzero value and none, written with ``write_empty_chunks`` true and false; shards
  with the index at either end; chunks below and above the size from which local host
  reads are streamed chunk by chunk; from a local path, a ``MemoryStore``, an HTTP
  server, kerchunk references (v2) and an Icechunk repository (v3); on every route.

Every route opens the store anew: a variable loaded once is kept in memory by
xarray, and later selections of it would never reach the engine.
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.codecs as zc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._http import serve
from xarray_gds.loader import BatchLoader

pytestmark = [
    pytest.mark.filterwarnings("ignore::zarr.errors.UnstableSpecificationWarning"),
    pytest.mark.filterwarnings("ignore:.*[Cc]onsolidated metadata.*:UserWarning"),
]

SHAPE = (6, 20, 16)
DIMS = ("t", "y", "x")

# -- routes: every way a host read reaches the decoder ------------------------------------
ROUTES: dict[str, Callable[[xr.Dataset], xr.Dataset]] = {
    "load": lambda ds: ds.load(),
    "box": lambda ds: ds.isel(t=slice(1, 5), y=slice(3, 17), x=slice(None, None, 3)).load(),
    "points": lambda ds: ds.isel(t=[0, 5, 2], x=[1, 15]).load(),
    "vectorized": lambda ds: ds.isel(
        t=xr.DataArray([0, 3, 5, 3], dims="p"), y=xr.DataArray([2, 19, 7, 2], dims="p")
    ).load(),
    "scalar": lambda ds: ds.isel(t=4, y=11, x=13).load(),
    "dask": lambda ds: ds.chunk({"t": 2}).compute(),
    "async": lambda ds: asyncio.run(ds.load_async()),
}
#: the routes through dask (the dask extra): last, skipped where dask is not installed
DASK_ROUTES = ("dask", "chunks={}")


def assert_same(gds: xr.Dataset, ref: xr.Dataset, what: Any) -> None:
    """Values as engine="zarr", and each variable's dtype, byte order included."""
    xr.testing.assert_identical(gds, ref)
    for name, var in ref.variables.items():
        got = gds[name]
        assert isinstance(got.data, np.ndarray), (what, name, type(got.data))
        assert got.dtype.str == var.dtype.str, (what, name, got.dtype.str, var.dtype.str)


Both = Callable[[], tuple[xr.Dataset, xr.Dataset]]


def opener(
    store: Any, ref_store: Any = None, gds_kwargs: dict[str, Any] | None = None, **ref_kwargs: Any
) -> Both:
    """Opens ``store`` with engine="gds-zarr" (``device="cpu"``, ``gds_kwargs``) and
    ``ref_store`` (the same store unless given) with engine="zarr" (``ref_kwargs``), anew
    each call."""

    def both(**kwargs: Any) -> tuple[xr.Dataset, xr.Dataset]:
        """``kwargs``: more arguments of both opens (``chunks={}``)."""
        gds_kw = {**(gds_kwargs or {}), **kwargs}
        gds = xr.open_dataset(store, engine="gds-zarr", device="cpu", **gds_kw)
        target = store if ref_store is None else ref_store
        ref = xr.open_dataset(target, engine="zarr", **ref_kwargs, **kwargs)
        return gds, ref

    return both


def assert_route(both: Both, name: str, declared: dict[str, np.dtype[Any]] | None = None) -> None:
    """Route ``name`` (of ``ROUTES``, or ``"loader"``) of engine="gds-zarr" as engine="zarr"
    on the same store, and, given ``declared`` (variable -> the dtype the metadata
    declares), that dtype in native byte order for every variable read."""
    if name in DASK_ROUTES:
        pytest.importorskip("dask")
    if name == "chunks={}":  # dask arrays of the stored chunks, from the open
        gds, ref = both(chunks={})
        assert all(v.chunks is not None for v in gds.data_vars.values()), name
        assert_same(gds.compute(), ref.compute(), name)
        return
    gds, ref = both()
    if name == "loader":
        loader = BatchLoader(gds, "t", batch_size=4, shuffle=False, prefetch=0, drop_last=True)
        batch = next(iter(loader))
        want = ref.isel(t=slice(0, 4)).load()
        for var, values in batch.items():
            assert isinstance(values, np.ndarray), ("loader", var, type(values))
            np.testing.assert_array_equal(values, want[var].values, strict=True)
            assert values.dtype.str == want[var].dtype.str, ("loader", var, values.dtype.str)
        return
    # engine="zarr" loads synchronously: its fsspec HTTP session belongs to zarr's
    # event loop, not to the one asyncio.run makes
    got, want = ROUTES[name](gds), ROUTES["load" if name == "async" else name](ref)
    assert_same(got, want, name)
    for var, dtype in (declared or {}).items():
        assert got[var].dtype.str == dtype.newbyteorder("=").str, (name, var, got[var].dtype)


def assert_every_route(
    store: Any, declared: dict[str, np.dtype[Any]] | None = None, both: Both | None = None
) -> None:
    """Every route of engine="gds-zarr" (``device="cpu"``) on ``store`` as engine="zarr"
    on it (``both`` opens the two, when they take different arguments), and, given
    ``declared`` (variable -> the dtype the metadata declares), that dtype in native
    byte order for every variable read."""
    both = both or opener(store)
    names = [*ROUTES, "chunks={}", "loader"]
    for name in sorted(names, key=lambda name: name in DASK_ROUTES):
        assert_route(both, name, declared)


# -- store kinds ------------------------------------------------------------------------------
STORE_KINDS = ("path", "zarr-local", "memory", "fsspec", "http")


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@contextmanager
def as_store(kind: str, root: Path) -> Iterator[Any]:
    """The local store at ``root`` as a store of ``kind``, what both engines open."""
    from zarr.core.buffer import cpu
    from zarr.storage import FsspecStore, LocalStore, MemoryStore

    if kind == "path":
        yield root
    elif kind == "zarr-local":
        yield LocalStore(root, read_only=True)
    elif kind == "memory":
        yield MemoryStore({k: cpu.Buffer.from_bytes(v) for k, v in _files(root).items()})
    elif kind == "fsspec":
        fsspec = pytest.importorskip("fsspec")

        fs = fsspec.filesystem("memory")
        base = f"/layouts-{uuid.uuid4().hex}/{root.name}"
        try:
            for key, data in _files(root).items():
                fs.pipe_file(f"{base}/{key}", data)
            yield FsspecStore.from_url(f"memory://{base}", read_only=True)
        finally:
            fs.rm(base, recursive=True)
    elif kind == "http":
        pytest.importorskip("aiohttp")  # engine="zarr" reads URLs through fsspec's HTTP
        with serve(root.parent) as url:
            yield f"{url}/{root.name}"
    else:
        raise AssertionError(kind)


def test_store_kinds_take_the_sources_they_name(tmp_path: Path) -> None:
    """The store kinds of this module reach the engine's sources they stand for (the
    HTTP one the remote source, whose shard indexes are range requests)."""
    from xarray_gds import stores
    from xarray_gds.backend import open_store

    root = _sharded(tmp_path / "s.zarr", "start", True)
    want = {
        "path": stores.LocalSource,
        "zarr-local": stores.DirectorySource,
        "memory": stores.MemorySource,
        "fsspec": stores.StoreSource,
        "http": stores.RemoteSource,
    }
    for kind in STORE_KINDS:
        with as_store(kind, root) as store:
            opened = store if not isinstance(store, str | Path) else open_store(store)
            assert type(stores.source_for(opened)) is want[kind], kind


# -- shards: the index at the start or the end ---------------------------------------------
def _sharded(path: Path, location: str, crc: bool) -> Path:
    """Two sharded arrays (float32 with NaN fill, int16) of 3 x 2 x 2 shards of 2 x 2 x 2
    inner chunks each, some of them missing (the fill value only), some shards at the
    edge of the array."""
    rng = np.random.default_rng(5)
    f4 = rng.standard_normal(SHAPE).astype("f4")
    f4[2:4, :10, :8] = np.nan  # the inner chunks of one shard: the shard is not written
    f4[0, :5, :4] = np.nan  # one inner chunk of another: missing from its index
    i2 = rng.integers(-300, 300, SHAPE).astype("i2")
    group = zarr.open_group(path, mode="w", zarr_format=3)
    index_codecs = [zc.BytesCodec(), zc.Crc32cCodec()] if crc else [zc.BytesCodec()]
    for name, values, fill in (("f", f4, np.nan), ("i", i2, -1)):
        sharding = zc.ShardingCodec(
            chunk_shape=(1, 5, 4),
            codecs=[zc.BytesCodec(), zc.ZstdCodec()],
            index_codecs=index_codecs,
            index_location=location,
        )
        array = group.create_array(
            name,
            shape=SHAPE,
            dtype=values.dtype,
            chunks=(2, 10, 8),
            serializer=sharding,
            compressors=None,
            dimension_names=list(DIMS),
            fill_value=fill,
        )
        array[:] = values
    zarr.consolidate_metadata(path)  # an HTTP server lists no keys
    return path


@pytest.mark.parametrize("kind", STORE_KINDS)
@pytest.mark.parametrize("crc", [True, False], ids=["crc", "no-crc"])
@pytest.mark.parametrize("location", ["start", "end"])
def test_shard_index_at_either_end_from_every_store(
    tmp_path: Path, location: str, crc: bool, kind: str
) -> None:
    """Sharded arrays whose index sits at the start or at the end of each shard read as
    engine="zarr" reads them, on every route, from every kind of store."""
    root = _sharded(tmp_path / "s.zarr", location, crc)
    first = (root / "f" / "c" / "0" / "0" / "0").read_bytes()
    n_index = 16 * 2 * 2 * 2 + 4 * crc
    table = first[:n_index] if location == "start" else first[len(first) - n_index :]
    offsets = np.frombuffer(table[: 16 * 8], dtype="<u8").reshape(-1, 2)[:, 0]
    present = offsets[offsets != np.iinfo(np.uint64).max]
    # the layout under test: inner chunks after (start) or before (end) the index
    assert (present.min() >= n_index) == (location == "start")
    assert not (root / "f" / "c" / "1" / "0" / "0").exists()  # a shard of the fill value
    with as_store(kind, root) as store:
        assert_every_route(store, {"f": np.dtype("f4"), "i": np.dtype("i2")})


# -- byte order ------------------------------------------------------------------------------
def _endian_store(path: Path, zarr_format: int, endian: str) -> tuple[Path, dict[str, Any]]:
    """Variables of several dtypes stored ``endian`` (``"big"`` or ``"little"``) in
    zarr_format 2 (the dtype says it: ``>f4``) or 3 (the ``bytes`` codec says it), with
    missing chunks; returns the store and the dtypes it declares."""
    rng = np.random.default_rng(9)
    f4 = rng.standard_normal(SHAPE).astype("f4")
    f4[:2, :8, :8] = np.nan  # a chunk of the fill value: not written
    values = {
        "f": f4,
        "d": rng.standard_normal(SHAPE),
        "i": rng.integers(-300, 300, SHAPE).astype("i2"),
        "u": rng.integers(0, 2**31, SHAPE).astype("u4"),
    }
    order = ">" if endian == "big" else "<"
    ds = xr.Dataset(
        {
            k: (DIMS, v.astype(v.dtype.newbyteorder(order)) if zarr_format == 2 else v)
            for k, v in values.items()
        }
    )
    encoding: dict[str, dict[str, Any]] = {}
    for name in values:
        encoding[name] = {"chunks": (2, 8, 8)}
        if zarr_format == 3:
            encoding[name]["serializer"] = zc.BytesCodec(endian=endian)
    ds.to_zarr(path, mode="w", zarr_format=zarr_format, encoding=encoding, consolidated=True)
    declared = {k: v.dtype for k, v in values.items()}
    if zarr_format == 2:  # the layout under test
        assert zarr.open_array(path / "f").dtype == np.dtype(f"{order}f4")
    return path, declared


@pytest.mark.parametrize("kind", ["path", "memory"])
@pytest.mark.parametrize("endian", ["big", "little"])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_byte_order_on_every_route(
    tmp_path: Path, zarr_format: int, endian: str, kind: str
) -> None:
    """Arrays stored big- or little-endian come back in the native byte order on every
    route (box, points, vectorized points, dask, load_async, the loader): the dtype box
    reads give, the dtype declared and engine="zarr"'s, never the stored order."""
    root, declared = _endian_store(tmp_path / "e.zarr", zarr_format, endian)
    with as_store(kind, root) as store:
        assert_every_route(store, declared)


# -- writes: which chunk files exist -----------------------------------------------------------
def _chunk_files(root: Path) -> set[str]:
    meta = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
    return {k for k in _files(root) if k.rsplit("/", 1)[-1] not in meta}


def _empty_chunks_dataset() -> xr.Dataset:
    rng = np.random.default_rng(2)
    f4 = rng.standard_normal(SHAPE).astype("f4")
    f4[2:4, :8, :8] = np.nan  # one whole chunk of the fill value (NaN)
    f4[4:, 16:, 8:] = np.nan  # one whole edge chunk of it
    i2 = rng.integers(1, 300, SHAPE).astype("i2")
    i2[:2, 8:16, :8] = 0  # one whole chunk of the fill value (0)
    n4 = rng.standard_normal(SHAPE).astype("f4")
    n4[2:4, 8:16, 8:] = 7  # one whole chunk of a nonzero fill value (FILL_ENCODING)
    u2 = rng.integers(1, 300, SHAPE).astype("u2")
    u2[4:, :8, :8] = 0  # one whole chunk of zeros, in an array with no fill value (v2)
    return xr.Dataset({"f": (DIMS, f4), "i": (DIMS, i2), "n": (DIMS, n4), "u": (DIMS, u2)})


def _fill_encoding(zarr_format: int) -> dict[str, dict[str, Any]]:
    """The zarr fill values of ``_empty_chunks_dataset``'s "n" (7) and "u" (none in v2, where
    ``_FillValue`` sets it; zarr's default in v3, which always has one)."""
    if zarr_format == 2:
        return {"n": {"_FillValue": 7.0}, "u": {"_FillValue": None}}
    return {"n": {"fill_value": 7.0}, "u": {}}


@pytest.mark.parametrize(
    ("zarr_format", "sharded"), [(2, False), (3, False), (3, True)], ids=["v2", "v3", "v3-shards"]
)
@pytest.mark.parametrize("write_empty", [True, False])
@pytest.mark.parametrize("writer", ["zarr-codecs", "batched"])
def test_write_empty_chunks_files_as_zarr(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    writer: str,
    write_empty: bool,
    zarr_format: int,
    sharded: bool,
) -> None:
    """``xarray_gds.to_zarr(..., write_empty_chunks=...)`` writes the chunk files
    xarray's engine="zarr" writes with the same setting, whole writes and region writes
    alike (a region of the fill value deletes its file or writes it): with host values
    through zarr's codecs, and through the batched encoder, the path device values
    always take (``XARRAY_GDS_BATCHED_HOST_WRITES=1``)."""
    import xarray_gds
    from xarray_gds import writes

    if writer == "batched":
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    batched: list[int] = []
    original = writes.write_batched

    async def spy(*args: Any) -> None:
        batched.append(1)
        await original(*args)

    monkeypatch.setattr(writes, "write_batched", spy)
    ds = _empty_chunks_dataset()
    encoding: dict[str, dict[str, Any]] = {k: {"chunks": (2, 8, 8)} for k in ds}
    for name, fill in _fill_encoding(zarr_format).items():
        encoding[name].update(fill)
    if sharded:
        for enc in encoding.values():
            enc["shards"], enc["chunks"] = (2, 16, 16), (2, 8, 8)
    ours, ref = tmp_path / "ours.zarr", tmp_path / "ref.zarr"
    region = {"t": slice(0, 2), "y": slice(0, 16), "x": slice(0, 16)}  # a whole shard
    blank = ds.isel(region)
    blank = blank.assign(f=blank.f * np.nan, i=blank.i * 0, n=blank.n * 0 + 7, u=blank.u * 0)
    for root, write in ((ours, xarray_gds.to_zarr), (ref, None)):
        kwargs: dict[str, Any] = {"zarr_format": zarr_format, "write_empty_chunks": write_empty}
        if write is None:
            ds.to_zarr(root, mode="w", encoding=encoding, **kwargs)
            blank.to_zarr(root, region=region, **kwargs)
        else:
            write(ds, root, mode="w", encoding=encoding, **kwargs)
            write(blank, root, region=region, **kwargs)
    assert bool(batched) == (writer == "batched")  # the writer under test
    files = _chunk_files(ref)
    assert _chunk_files(ours) == files
    # the layout under test: empty chunks (shards) written only with write_empty_chunks
    first = "f/c/0/0/0" if zarr_format == 3 else "f/0.0.0"
    assert (first in files) == write_empty
    if not sharded:  # and of the nonzero fill value
        assert (("n/c/1/1/1" if zarr_format == 3 else "n/1.1.1") in files) == write_empty
    gds = xr.open_dataset(ours, engine="gds-zarr", device="cpu").load()
    assert_same(gds, xr.open_dataset(ref, engine="zarr").load(), "written")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_backend_array_declares_the_native_order_it_returns(
    tmp_path: Path, zarr_format: int
) -> None:
    """An engine array over a big-endian zarr array with no CF plan (how a caller wraps
    one zarr array itself) declares the dtype its reads return, in native byte order,
    on every indexer kind; a variable over it is the same lazily and loaded, as
    engine="zarr"'s. (The engine's own variables always carry a CF plan, whose dtype
    xarray decodes to the native order, so only this construction shows the array's
    own dtype.)"""
    from xarray.core import indexing

    from xarray_gds.array import GdsBackendArray

    root, declared = _endian_store(tmp_path / "e.zarr", zarr_format, "big")
    ref = xr.open_dataset(root, engine="zarr").load()
    group = zarr.open_group(root, mode="r")
    for name in declared:
        za = group[name]
        assert isinstance(za, zarr.Array)
        native = declared[name].newbyteorder("=")
        array = GdsBackendArray(za, name, "cpu")
        assert array.dtype.str == native.str, (name, array.dtype.str)
        keys = (
            indexing.BasicIndexer((slice(1, 5), 3, slice(None, None, 3))),
            indexing.OuterIndexer((np.array([0, 5, 2]), slice(None), np.array([1, 15]))),
            indexing.VectorizedIndexer(
                (np.array([0, 3, 5]), np.array([2, 19, 7]), np.array([0, 1, 15]))
            ),
        )
        for key in keys:
            got = array[key]
            assert isinstance(got, np.ndarray), (name, key)
            assert got.dtype.str == array.dtype.str, (name, key, got.dtype.str)
        var = xr.Variable(DIMS, indexing.LazilyIndexedArray(array))
        assert var.dtype.str == ref[name].dtype.str == native.str, (name, var.dtype.str)
        loaded = var.load()
        assert loaded.dtype.str == native.str, (name, loaded.dtype.str)
        np.testing.assert_array_equal(loaded.values, ref[name].values, strict=True)


# -- the layout space: formats, byte orders, fill values, empty chunks, shards, chunk sizes,
# -- store kinds and routes together ------------------------------------------------------
BIG_SHAPE = (6, 256, 256)  # float32 chunks of one time step: 256 KiB
META = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}
FILLS: dict[str, float | None] = {"zero": 0.0, "nan": np.nan, "nonzero": 7.0, "none": None}
#: the declared dtype of "f", whatever the layout (that of "i" turns float32 where xarray
#: masks a v2 array's fill value, as engine="zarr" does)
F4 = {"f": np.dtype("f4")}


def _layout(
    path: Path,
    *,
    zarr_format: int,
    endian: str,
    fill: str,
    write_empty: bool,
    big: bool,
    shards: str | None,
) -> Path:
    """A float32 and an int16 variable written by zarr-python in the layout named: the
    first chunk and the last (an edge chunk) hold the fill value only (0 with no fill
    value), and are written or not as ``write_empty`` says; ``shards`` is the place of
    the shard index (``"start"``, ``"end"``) or None for no shards (v3 only)."""
    shape, chunks = (BIG_SHAPE, (1, 256, 256)) if big else (SHAPE, (2, 8, 8))
    rng = np.random.default_rng(17)
    values = {
        "f": rng.standard_normal(shape).astype("f4"),
        "i": rng.integers(-300, 300, shape).astype("i2"),
    }
    first = tuple(slice(0, c) for c in chunks)
    last = tuple(slice(n - (n % c or c), n) for n, c in zip(shape, chunks, strict=True))
    order = ">" if endian == "big" else "<"
    group = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    for name, data in values.items():
        fv = FILLS[fill]
        if fv is not None and np.isnan(fv) and data.dtype.kind == "i":
            fv = -5  # an integer's own stand-in for NaN
        for region in (first, last):
            data[region] = 0 if fv is None else fv
        kwargs: dict[str, Any] = {"chunks": chunks}
        if zarr_format == 2:
            dtype = data.dtype.newbyteorder(order)
            kwargs["attributes"] = {"_ARRAY_DIMENSIONS": list(DIMS)}
        else:
            dtype = data.dtype
            kwargs["dimension_names"] = list(DIMS)
            kwargs["serializer"] = zc.BytesCodec(endian=endian)
            if shards is not None:
                kwargs["chunks"] = (2 * chunks[0], *chunks[1:])
                kwargs["serializer"] = zc.ShardingCodec(
                    chunk_shape=chunks,
                    codecs=[zc.BytesCodec(endian=endian), zc.ZstdCodec()],
                    index_location=shards,
                )
                kwargs["compressors"] = None
        array = group.create_array(
            name,
            shape=shape,
            dtype=dtype,
            fill_value=fv,
            config={"write_empty_chunks": write_empty},
            **kwargs,
        )
        array[:] = data
    zarr.consolidate_metadata(path)  # an HTTP server lists no keys
    # the layout under test: the first chunk's file is there only with write_empty
    if shards is None:
        key = "f/0.0.0" if zarr_format == 2 else "f/c/0/0/0"
        assert (path / key).exists() == write_empty, key
    return path


def _references(root: Path) -> dict[str, Any]:
    """kerchunk's form of references (version 1) to the Zarr v2 store at ``root``:
    metadata inline, each chunk a [file, offset, length] of its own file."""
    refs: dict[str, Any] = {}
    for key, data in _files(root).items():
        if key.rsplit("/", 1)[-1] in META:
            refs[key] = data.decode()
        else:
            refs[key] = [str(root / key), 0, len(data)]
    return {"version": 1, "refs": refs}


@contextmanager
def both_engines(kind: str, root: Path) -> Iterator[Both]:
    """The store at ``root`` as a store of ``kind`` (those of ``as_store``, ``"refs"``:
    kerchunk references to it, ``"icechunk"``: its keys committed to an Icechunk
    repository), opened by both engines."""
    if kind == "refs":
        pytest.importorskip("fsspec")
        refs = _references(root)
        options = {"fo": refs, "remote_protocol": "file"}
        yield opener(
            refs,
            "reference://",
            backend_kwargs={"storage_options": options, "consolidated": False},
        )
    elif kind == "icechunk":
        icechunk = pytest.importorskip("icechunk")
        from zarr.core.buffer import cpu

        repo = icechunk.Repository.create(
            icechunk.local_filesystem_storage(str(root.with_name(root.name + ".icechunk")))
        )
        session = repo.writable_session("main")

        async def copy() -> None:
            for key, data in _files(root).items():
                if key != ".zmetadata":
                    await session.store.set(key, cpu.Buffer.from_bytes(data))

        asyncio.run(copy())
        session.commit("the layout")
        # the repository's storage: its chunks read from their files, not through the store
        options = {"icechunk_storage": repo.storage}
        store = repo.readonly_session(branch="main").store
        yield opener(store, gds_kwargs={"storage_options": options})
    else:
        with as_store(kind, root) as store:
            yield opener(store)


@pytest.mark.parametrize("write_empty", [True, False], ids=["empty-written", "empty-skipped"])
@pytest.mark.parametrize("fill", list(FILLS))
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_fill_values_with_and_without_empty_chunks(
    tmp_path: Path, zarr_format: int, fill: str, write_empty: bool
) -> None:
    """Fill values 0, NaN, nonzero and none, their chunks written or not
    (``write_empty_chunks``): every route reads what engine="zarr" reads."""
    root = _layout(
        tmp_path / "l.zarr",
        zarr_format=zarr_format,
        endian="little",
        fill=fill,
        write_empty=write_empty,
        big=False,
        shards=None,
    )
    assert_every_route(root, F4)


def test_large_local_chunks_are_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 256 KiB and more read from a local path on the host are served chunk by
    chunk (the streamed route), smaller ones are not; both as engine="zarr" reads."""
    from xarray_gds import coalesce

    streamed: list[int] = []
    original = coalesce._serve_streamed

    def spy(group: Any) -> None:
        streamed.append(len(group))
        original(group)

    monkeypatch.setattr(coalesce, "_serve_streamed", spy)
    for big in (False, True):
        streamed.clear()
        root = _layout(
            tmp_path / f"{big}.zarr",
            zarr_format=3,
            endian="big",
            fill="nan",
            write_empty=False,
            big=big,
            shards=None,
        )
        assert_route(opener(root), "load", F4)
        assert bool(streamed) == big, (big, streamed)


# the kinds of store each Zarr format can be: kerchunk's references are v2, Icechunk v3
KINDS = {2: ("path", "memory", "http", "refs"), 3: ("path", "memory", "http", "icechunk")}


@st.composite
def _layouts(draw: st.DrawFn) -> dict[str, Any]:
    zarr_format = draw(st.sampled_from([2, 3]))
    layout = {
        "zarr_format": zarr_format,
        "endian": draw(st.sampled_from(["little", "big"])),
        "fill": draw(st.sampled_from(list(FILLS))),
        "write_empty": draw(st.booleans()),
        "big": draw(st.booleans()),
        "shards": None,
    }
    kind = draw(st.sampled_from(KINDS[zarr_format]))
    if zarr_format == 3:
        layout["shards"] = draw(st.sampled_from([None, "start", "end"]))
    route = draw(st.sampled_from([*ROUTES, "chunks={}", "loader"]))
    return {"layout": layout, "kind": kind, "route": route}


@settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_layouts())
def test_layout_space_on_every_route_and_store(case: dict[str, Any]) -> None:
    """A fixed draw of the whole space: format x byte order x fill value x empty chunks
    written or not x shards (index at either end) x chunks below or above the streamed
    size x store kind x route, each as engine="zarr" reads it, dtype and byte order
    included."""
    with tempfile.TemporaryDirectory() as tmp:
        root = _layout(Path(tmp) / "l.zarr", **case["layout"])
        with both_engines(case["kind"], root) as both:
            assert_route(both, case["route"], F4)


@pytest.mark.parametrize("kind", ["refs", "icechunk"])
def test_every_route_from_references_and_icechunk(tmp_path: Path, kind: str) -> None:
    """kerchunk's references (to a big-endian v2 store with NaN fill and unwritten chunks)
    and an Icechunk repository (a sharded big-endian v3 store): every route as engine="zarr"."""
    zarr_format = 2 if kind == "refs" else 3
    root = _layout(
        tmp_path / "l.zarr",
        zarr_format=zarr_format,
        endian="big",
        fill="nan",
        write_empty=False,
        big=False,
        shards=None if kind == "refs" else "end",
    )
    with both_engines(kind, root) as both:
        assert_every_route(root, F4, both)


async def _keys(store: Any) -> set[str]:
    return {k async for k in store.list()}


@pytest.mark.parametrize("write_empty", [True, False], ids=["empty-written", "empty-skipped"])
@pytest.mark.parametrize("kind", ["memory-v2", "memory-v3", "icechunk"])
def test_write_empty_chunks_keys_in_memory_and_icechunk(
    tmp_path: Path, kind: str, write_empty: bool
) -> None:
    """Into a ``MemoryStore`` and an Icechunk session, ``xarray_gds.to_zarr`` writes the
    keys xarray's engine="zarr" writes (fill values NaN, 0, nonzero and, in v2, none;
    ``write_empty_chunks`` true and false, whole and region writes), and what it wrote
    reads back as engine="zarr" reads xarray's."""
    from zarr.storage import MemoryStore

    import xarray_gds

    zarr_format = 2 if kind == "memory-v2" else 3
    ds = _empty_chunks_dataset()
    encoding: dict[str, dict[str, Any]] = {k: {"chunks": (2, 8, 8)} for k in ds}
    for name, fill in _fill_encoding(zarr_format).items():
        encoding[name].update(fill)
    region = {"t": slice(0, 2), "y": slice(0, 16), "x": slice(0, 16)}
    blank = ds.isel(region)
    blank = blank.assign(f=blank.f * np.nan, i=blank.i * 0, n=blank.n * 0 + 7, u=blank.u * 0)
    stores: list[Any] = []
    options: dict[str, Any] = {}  # the storage of our repository, to read its chunks
    for n, write in enumerate((xarray_gds.to_zarr, None)):
        kwargs: dict[str, Any] = {"zarr_format": zarr_format, "write_empty_chunks": write_empty}
        if kind == "icechunk":
            icechunk = pytest.importorskip("icechunk")
            storage = icechunk.local_filesystem_storage(str(tmp_path / f"repo{n}"))
            session = icechunk.Repository.create(storage).writable_session("main")
            store, kwargs["consolidated"] = session.store, False
            options = options or {"storage_options": {"icechunk_storage": storage}}
        else:
            store = MemoryStore()
        if write is None:
            ds.to_zarr(store, mode="w", encoding=encoding, **kwargs)
            blank.to_zarr(store, region=region, **kwargs)
        else:
            write(ds, store, mode="w", encoding=encoding, **kwargs)
            write(blank, store, region=region, **kwargs)
        stores.append(store)
    ours, ref = stores
    keys = asyncio.run(_keys(ref))
    assert asyncio.run(_keys(ours)) == keys
    first = "f/c/0/0/0" if zarr_format == 3 else "f/0.0.0"
    assert (first in keys) == write_empty  # the layout under test
    gds = xr.open_dataset(ours, engine="gds-zarr", device="cpu", **options).load()
    assert_same(gds, xr.open_dataset(ref, engine="zarr").load(), kind)

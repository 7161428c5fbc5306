"""Icechunk repositories read where their chunks lie (``xarray_gds/ice.py``).

Real repositories (``icechunk`` on the local filesystem, and on S3 against a moto server
on 127.0.0.1 started and stopped here), with native, virtual and inline chunks; every
read is compared with ``engine="zarr"`` on the same session, and the locations the
engine read from are checked (files under the repository's ``chunks/``, objects of
its S3 prefix, the referenced file, inline bytes).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from tests._s3 import client as s3_client
from tests._s3 import loopback_s3
from xarray_gds.stores.icechunk import (
    IcechunkFallbackWarning,
    IcechunkReadStore,
    IcechunkSource,
    chunk_storage,
)
from xarray_gds.stores.refs import Reference

icechunk = pytest.importorskip("icechunk")  # the test extra has it; not every GPU image

pytestmark = pytest.mark.filterwarnings("error::xarray_gds.stores.icechunk.IcechunkFallbackWarning")

#: selections applied to both engines
SELECTIONS: list[dict[str, Any]] = [
    {"time": slice(1, 5)},
    {"x": [0, 3, 7, 29]},
    {"time": 2, "y": slice(None, None, 2)},
    {"time": [5, 0, 3], "x": slice(2, 23, 3)},
]


def _dataset(t0: int = 0, nt: int = 6) -> xr.Dataset:
    rng = np.random.default_rng(t0)
    return xr.Dataset(
        {
            "t2m": (("time", "y", "x"), rng.standard_normal((nt, 20, 30)).astype("f4")),
            "flag": (("time", "x"), rng.integers(-500, 500, (nt, 30)).astype("i4")),
        },
        coords={"time": np.arange(t0, t0 + nt), "y": np.arange(20.0), "x": np.arange(30.0)},
        attrs={"title": "icechunk"},
    )


#: chunks larger than Icechunk's inline threshold (512 bytes): stored as native chunks
ENCODING = {
    "t2m": {"chunks": (2, 10, 15), "compressors": zarr.codecs.ZstdCodec(level=1)},
    "flag": {"chunks": (5, 30), "compressors": None},
}


def _placed(kw: dict[str, Any], device: str) -> dict[str, Any]:
    """``kw`` for a read on ``device``: on the GPU, dask blocks stay CuPy only with the
    engine's chunk manager; xarray's default one declares numpy blocks, and the engine
    hands those back as numpy (HostBlocksWarning), as test_engine.py's ``_open`` says."""
    if device == "cuda" and "chunks" in kw:
        return {**kw, "chunked_array_type": "gds-dask"}
    return kw


def _repo(path: Path, **kw: Any) -> icechunk.Repository:
    return icechunk.Repository.create(icechunk.local_filesystem_storage(str(path)), **kw)


def _commit(repo: icechunk.Repository, ds: xr.Dataset, message: str, **kw: Any) -> str:
    session = repo.writable_session("main")
    ds.to_zarr(session.store, consolidated=False, **kw)  # xarray's own writer
    return session.commit(message)


def _both(
    store: Any, storage_options: dict[str, Any] | None, **kw: Any
) -> tuple[xr.Dataset, xr.Dataset]:
    gds = xr.open_dataset(
        store, engine="gds-zarr", device="cpu", storage_options=storage_options, **kw
    )
    ref = xr.open_dataset(store, engine="zarr", **kw)
    return gds, ref


def _check_reads(store: Any, storage_options: dict[str, Any] | None) -> None:
    """Eager, chunks={} and selections, identical to engine='zarr' on the same store."""
    gds, ref = _both(store, storage_options)
    expected = ref.load()
    xr.testing.assert_identical(gds.load(), expected)
    assert isinstance(gds.t2m.data, np.ndarray)
    for sel in SELECTIONS:
        xr.testing.assert_identical(gds.isel(sel).load(), expected.isel(sel))
    lazy, _ = _both(store, storage_options, chunks={})
    assert lazy.t2m.chunks is not None
    xr.testing.assert_identical(lazy.load(), expected)
    for sel in SELECTIONS:
        xr.testing.assert_identical(lazy.isel(sel).compute(), expected.isel(sel))


def _locations(store: Any, storage_options: dict[str, Any] | None, keys: list[str]) -> list[Any]:
    storage, _ = chunk_storage(storage_options)
    return IcechunkSource(IcechunkReadStore(store, storage)).locate(keys)


@pytest.fixture
def local_repo(tmp_path: Path) -> icechunk.Repository:
    repo = _repo(tmp_path / "repo")
    _commit(repo, _dataset(), "first", mode="w", encoding=ENCODING)
    return repo


# -- local filesystem storage, written by xarray's own to_zarr --------------------------


@pytest.mark.parametrize("given", ["storage", "repository", "path"])
def test_local_native_chunks_read_from_their_files(
    local_repo: icechunk.Repository, tmp_path: Path, given: str
) -> None:
    hint = {
        "storage": local_repo.storage,
        "repository": local_repo,
        "path": str(tmp_path / "repo"),
    }[given]
    options = {"icechunk_storage": hint}
    store = local_repo.readonly_session("main").store
    _check_reads(store, options)
    found = _locations(store, options, ["t2m/c/0/0/0", "t2m/c/2/1/1", "flag/c/1/0"])
    chunk_dir = (tmp_path / "repo" / "chunks").resolve()
    for loc in found:
        assert isinstance(loc, Reference) and loc.data is None
        assert Path(loc.target).parent == chunk_dir and Path(loc.target).is_file()
        assert loc.offset == 0 and loc.size == Path(loc.target).stat().st_size


def test_missing_chunks_read_as_fill_values(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    session = repo.writable_session("main")
    ds = _dataset()  # dask variables: compute=False writes none of their chunks
    ds = ds.assign(t2m=ds.t2m.chunk({"time": 2}), flag=ds.flag.chunk({"time": 5}))
    ds.to_zarr(session.store, mode="w", encoding=ENCODING, consolidated=False, compute=False)
    ds.isel(time=slice(2, 4)).drop_vars(["y", "x"]).to_zarr(
        session.store, region={"time": slice(2, 4)}, consolidated=False, safe_chunks=False
    )
    session.commit("part")
    store = repo.readonly_session("main").store
    options = {"icechunk_storage": repo.storage}
    found = _locations(store, options, ["t2m/c/0/0/0", "t2m/c/1/0/0", "t2m/c/9/0/0"])
    assert found[0] is None and isinstance(found[1], Reference) and found[2] is None
    _check_reads(store, options)


def test_datatree_matches_zarr(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    session = repo.writable_session("main")
    twice = _dataset().assign(t2m=lambda d: d.t2m * 2)
    tree = xr.DataTree.from_dict(
        {"/": _dataset(), "/sub": twice, "/sub/deep": _dataset()[["flag"]]}
    )
    tree.to_zarr(session.store, consolidated=False, encoding={"/sub": ENCODING})
    session.commit("tree")
    store = repo.readonly_session("main").store
    options = {"icechunk_storage": repo.storage}
    gds = xr.open_datatree(store, engine="gds-zarr", device="cpu", storage_options=options)
    ref = xr.open_datatree(store, engine="zarr")
    xr.testing.assert_identical(gds.load(), ref.load())
    group = xr.open_dataset(
        store, engine="gds-zarr", device="cpu", storage_options=options, group="sub/deep"
    )
    expected = xr.open_dataset(store, engine="zarr", group="sub/deep").load()
    xr.testing.assert_identical(group.load(), expected)


def test_snapshots_branches_and_tags(local_repo: icechunk.Repository) -> None:
    """A read-only session at an older snapshot, at a branch and at a tag: each reads
    what engine='zarr' reads there, and they differ from each other."""
    first = local_repo.lookup_branch("main")
    second = _commit(local_repo, _dataset(6, 4), "append", append_dim="time")
    local_repo.create_tag("v1", second)
    local_repo.create_branch("dev", first)
    other = _dataset(50, 6).assign_coords(time=np.arange(6)).drop_vars(["y", "x"])
    _commit_branch(local_repo, "dev", other, region="auto")
    options = {"icechunk_storage": local_repo.storage}
    sessions = {
        "old": local_repo.readonly_session(snapshot_id=first),
        "main": local_repo.readonly_session(branch="main"),
        "tag": local_repo.readonly_session(tag="v1"),
        "dev": local_repo.readonly_session(branch="dev"),
    }
    seen = {}
    for name, session in sessions.items():
        _check_reads(session.store, options)
        seen[name] = xr.open_dataset(
            session.store, engine="gds-zarr", device="cpu", storage_options=options
        ).t2m.values
    assert seen["old"].shape == (6, 20, 30) and seen["main"].shape == (10, 20, 30)
    np.testing.assert_array_equal(seen["tag"], seen["main"])
    np.testing.assert_array_equal(seen["main"][:6], seen["old"])
    assert not np.array_equal(seen["dev"], seen["old"])
    np.testing.assert_array_equal(seen["dev"], other.t2m.values)


def _commit_branch(repo: icechunk.Repository, branch: str, ds: xr.Dataset, **kw: Any) -> str:
    session = repo.writable_session(branch)
    ds.to_zarr(session.store, consolidated=False, **kw)
    return session.commit("on " + branch)


def test_writable_session_reads_its_uncommitted_chunks(local_repo: icechunk.Repository) -> None:
    session = local_repo.writable_session("main")
    _dataset(6, 4).to_zarr(session.store, append_dim="time", consolidated=False)
    options = {"icechunk_storage": local_repo.storage}
    _check_reads(session.store, options)
    got = xr.open_dataset(session.store, engine="gds-zarr", device="cpu", storage_options=options)
    assert got.sizes["time"] == 10


def test_writable_session_reads_what_it_writes_after_the_open(tmp_path: Path) -> None:
    """Datasets opened on a writable session read the chunks written into it after the
    open (new ones and rewritten ones, uncommitted), as engine='zarr' does: zarr opens
    the session's store read-only, and the session still changes."""
    repo = _repo(tmp_path / "repo")
    session = repo.writable_session("main")
    empty = _dataset()  # fill values only: no chunk stored
    empty["t2m"] = empty.t2m.where(False)
    empty["flag"] = empty.flag * 0
    empty.to_zarr(session.store, mode="w", consolidated=False, encoding=ENCODING)
    options = {"icechunk_storage": repo.storage}
    kw: dict[str, Any] = {"consolidated": False, "cache": False}
    eager, ref = _both(session.store, options, **kw)
    lazy, _ = _both(session.store, options, chunks={}, **kw)
    xr.testing.assert_identical(eager.compute(), ref.compute())
    assert np.isnan(eager.t2m.values).all() and not eager.flag.values.any()
    _dataset().to_zarr(session.store, mode="r+", consolidated=False)
    expected = ref.compute()
    xr.testing.assert_identical(expected, xr.open_dataset(session.store, engine="zarr").load())
    assert not np.isnan(expected.t2m.values).any()
    for ds in (eager, lazy):
        xr.testing.assert_identical(ds.compute(), expected)
        for sel in SELECTIONS:
            xr.testing.assert_identical(ds.isel(sel).compute(), expected.isel(sel))


def test_sharded_arrays_read_by_byte_ranges(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    encoding = {
        "t2m": {"chunks": (1, 10, 15), "shards": (2, 20, 30)},
        "flag": {"chunks": (3, 10), "shards": (6, 30)},
    }
    _commit(repo, _dataset(), "sharded", mode="w", encoding=encoding)
    _check_reads(repo.readonly_session("main").store, {"icechunk_storage": repo.storage})


def test_zarr_group_of_a_session(local_repo: icechunk.Repository) -> None:
    store = local_repo.readonly_session("main").store
    group = zarr.open_group(store, mode="r")
    gds = xr.open_dataset(
        group,
        engine="gds-zarr",
        device="cpu",
        storage_options={"icechunk_storage": local_repo.storage},
    )
    xr.testing.assert_identical(gds.load(), xr.open_dataset(store, engine="zarr").load())


def test_engine_store_pickles_with_its_storage(local_repo: icechunk.Repository) -> None:
    """What dask-distributed workers get: the session's store and where its chunks lie."""
    import pickle

    storage, _ = chunk_storage({"icechunk_storage": local_repo.storage})
    store = IcechunkReadStore(local_repo.readonly_session("main").store, storage)
    again = pickle.loads(pickle.dumps(store))
    assert again.storage == storage
    keys = ["t2m/c/0/0/0", "flag/c/1/0"]
    assert IcechunkSource(again).locate(keys) == IcechunkSource(store).locate(keys)


# -- native, virtual and inline chunks in one repository --------------------------------


def _virtual_repo(
    path: Path, folder: Path, config: icechunk.RepositoryConfig | None = None
) -> icechunk.Repository:
    """A repository at ``path`` (with ``config``) whose virtual chunks may be files of
    ``folder`` (``file://`` URLs)."""
    prefix = f"file://{folder}/"
    config = config or icechunk.RepositoryConfig.default()
    config.set_virtual_chunk_container(
        icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(str(folder)))
    )
    access = {prefix: icechunk.credentials.LocalFileSystemAccess}
    return _repo(path, config=config, authorize_virtual_chunk_access=access)


def _mixed_repo(tmp_path: Path) -> tuple[icechunk.Repository, np.ndarray]:
    """An array whose rows are native chunks (0, 1), a virtual chunk in a local file
    (row 3, at an offset of 7), a missing chunk (row 2), and an inline group array."""
    raw = tmp_path / "raw"
    raw.mkdir(parents=True)
    values = np.arange(300, dtype="<f4") / 3
    (raw / "blob.bin").write_bytes(b"headers" + values[100:200].tobytes() + b"tail")
    prefix = f"file://{raw}/"
    config = icechunk.RepositoryConfig.default()
    config.inline_chunk_threshold_bytes = 64
    repo = _virtual_repo(tmp_path / "repo", raw, config)
    session = repo.writable_session("main")
    root = zarr.group(session.store)
    a = root.create_array(
        "a",
        shape=(4, 100),
        chunks=(1, 100),
        dtype="f4",
        compressors=None,
        dimension_names=["row", "col"],
    )
    a[0:2] = values[:200].reshape(2, 100)
    session.store.set_virtual_ref("a/c/3/0", f"{prefix}blob.bin", offset=7, length=400)
    b = root.create_array(
        "b", shape=(8,), chunks=(2,), dtype="i2", compressors=None, dimension_names=["n"]
    )
    b[:] = np.arange(8, dtype="i2") * 3
    session.commit("mixed")
    expected = np.zeros((4, 100), dtype="f4")
    expected[:2] = values[:200].reshape(2, 100)
    expected[3] = values[100:200]
    return repo, expected


def test_native_virtual_and_inline_chunks(tmp_path: Path) -> None:
    repo, expected = _mixed_repo(tmp_path)
    store = repo.readonly_session("main").store
    options = {"icechunk_storage": repo.storage}
    found = _locations(store, options, ["a/c/0/0", "a/c/1/0", "a/c/2/0", "a/c/3/0", "b/c/1"])
    assert [type(x).__name__ for x in found] == [
        "Reference",
        "Reference",
        "NoneType",
        "Reference",
        "Reference",
    ]
    assert Path(found[0].target).parent.name == "chunks" and found[0].size == 400
    assert (found[3].target, found[3].offset, found[3].size) == (
        str(tmp_path / "raw" / "blob.bin"),
        7,
        400,
    )
    assert found[4].data == np.array([6, 9], dtype="<i2").tobytes()
    for kw in ({}, {"chunks": {}}):
        gds, ref = _both(store, options, **kw)
        xr.testing.assert_identical(gds.load(), ref.load())
        for sel in ({"row": [3, 0]}, {"row": 3, "col": slice(5, 50, 7)}, {"n": slice(1, 6)}):
            xr.testing.assert_identical(gds.isel(sel).load(), ref.isel(sel).load())
    raw = xr.open_dataset(
        store, engine="gds-zarr", device="cpu", storage_options=options, mask_and_scale=False
    )
    np.testing.assert_array_equal(raw.a.values, expected)
    np.testing.assert_array_equal(raw.b.values, np.arange(8) * 3)


# -- VirtualiZarr: references to NetCDF4 files in a repository ----------------------------


def _netcdf(path: Path) -> None:
    """A NetCDF4 file as archives hold them: an unlimited time axis with CF units, zlib +
    shuffle chunks of a packed int16 variable (scale_factor, add_offset, _FillValue and
    masked values) and of a float variable, coordinate variables."""
    import netCDF4

    rng = np.random.default_rng(3)
    with netCDF4.Dataset(path, "w") as d:
        d.title = "virtual"
        d.createDimension("time", None)
        d.createDimension("lat", 24)
        d.createDimension("lon", 36)
        t = d.createVariable("time", "f8", ("time",))
        t.units = "hours since 2000-01-01"
        t[:] = np.arange(6) * 6.0
        d.createVariable("lat", "f4", ("lat",))[:] = np.linspace(-90, 90, 24)
        d.createVariable("lon", "f4", ("lon",))[:] = np.linspace(0, 350, 36)
        packed = d.createVariable(
            "t2m",
            "i2",
            ("time", "lat", "lon"),
            zlib=True,
            shuffle=True,
            chunksizes=(1, 12, 18),
            fill_value=np.int16(-32767),
        )
        packed.scale_factor = 0.01
        packed.add_offset = 273.15
        values = rng.normal(0, 1000, (6, 24, 36)).astype("i2")
        packed.set_auto_maskandscale(False)
        values[0, :3, :4] = -32767
        packed[:] = values
        rain = d.createVariable(
            "rain", "f4", ("time", "lat", "lon"), zlib=True, shuffle=True, chunksizes=(2, 24, 36)
        )
        rain[:] = rng.gamma(1.0, 2.0, (6, 24, 36)).astype("f4")


def test_virtualizarr_repository_matches_h5netcdf(tmp_path: Path, device: str) -> None:
    """A repository VirtualiZarr made of references to two NetCDF4 files (zlib + shuffle
    chunks, decoded by the engine: on the GPU with the cuda device) reads what h5netcdf
    reads from the files; every chunk is virtual, read from the files' byte ranges."""
    pytest.importorskip("virtualizarr", reason="VirtualiZarr is not installed (virtual extra)")
    from obspec_utils.registry import ObjectStoreRegistry
    from obstore.store import LocalStore
    from virtualizarr import open_virtual_dataset
    from virtualizarr.parsers import HDFParser

    files = tmp_path / "files"
    files.mkdir()
    _netcdf(files / "a.nc")
    registry = ObjectStoreRegistry({"file://": LocalStore()})
    vds = open_virtual_dataset(f"file://{files / 'a.nc'}", registry=registry, parser=HDFParser())
    repo = _virtual_repo(tmp_path / "repo", files)
    session = repo.writable_session("main")
    vds.vz.to_icechunk(session.store)
    session.commit("virtual")
    store = repo.readonly_session("main").store
    found = _locations(store, {"icechunk_storage": repo.storage}, ["t2m/c/0/1/1", "rain/c/2/0/0"])
    assert [(Path(r.target).name, r.data) for r in found] == [("a.nc", None), ("a.nc", None)]
    options = {"icechunk_storage": repo.storage}
    expected = xr.open_dataset(files / "a.nc", engine="h5netcdf").load()
    for kw in ({}, {"chunks": {}}):
        got = xr.open_dataset(
            store, engine="gds-zarr", device=device, storage_options=options, **_placed(kw, device)
        )
        loaded = got.load()
        if device == "cuda":
            import cupy as cp

            assert isinstance(loaded.t2m.data, cp.ndarray) and isinstance(
                loaded.rain.data, cp.ndarray
            )
        xr.testing.assert_identical(loaded.as_numpy(), expected)
        sel = {"time": [4, 1], "lat": slice(3, 20), "lon": slice(None, None, 5)}
        xr.testing.assert_identical(got.isel(sel).load().as_numpy(), expected.isel(sel))


# -- fallbacks ---------------------------------------------------------------------------


def test_unknown_storage_falls_back_with_a_reason(local_repo: icechunk.Repository) -> None:
    store = local_repo.readonly_session("main").store
    with pytest.warns(IcechunkFallbackWarning) as record:
        gds, ref = _both(store, None)
        xr.testing.assert_identical(gds.load(), ref.load())
    messages = {str(w.message) for w in record}
    assert len(messages) == 2  # one an array (t2m, flag), each said once
    for text in messages:
        assert "IcechunkStore.get" in text and "icechunk_storage" in text and "\n" not in text


def test_storage_of_another_kind_falls_back(tmp_path: Path) -> None:
    repo = icechunk.Repository.create(icechunk.in_memory_storage())
    _commit(repo, _dataset(), "mem", mode="w", encoding=ENCODING)
    store = repo.readonly_session("main").store
    with pytest.warns(
        IcechunkFallbackWarning, match="does not read in memory storage|does not read .* storage"
    ):
        gds, ref = _both(store, {"icechunk_storage": repo.storage})
        xr.testing.assert_identical(gds.load(), ref.load())


def test_bad_storage_hint_is_refused(local_repo: icechunk.Repository) -> None:
    store = local_repo.readonly_session("main").store
    with pytest.raises(TypeError, match="icechunk_storage"):
        xr.open_dataset(
            store, engine="gds-zarr", device="cpu", storage_options={"icechunk_storage": 3}
        )


def test_chunk_storage_descriptions() -> None:
    s3 = icechunk.s3_storage(
        bucket="bkt",
        prefix="a/b",
        endpoint_url="http://127.0.0.1:9",
        allow_http=True,
        access_key_id="AK",
        secret_access_key="SK",
        region="eu-west-1",
        force_path_style=True,
    )
    storage, rest = chunk_storage({"icechunk_storage": s3, "key": "AK", "secret": "SK"})
    assert (storage.kind, storage.root) == ("s3", "bkt/a/b")
    assert storage.options["endpoint_url"] == "http://127.0.0.1:9"
    assert storage.options["client_kwargs"] == {"region_name": "eu-west-1"}
    assert rest == {"key": "AK", "secret": "SK"}
    assert chunk_storage({"icechunk_storage": "s3://bkt/x/"})[0].root == "bkt/x"
    assert chunk_storage({"icechunk_storage": "file:///data/r"})[0].root == "/data/r"
    assert chunk_storage(None)[0].kind is None


# -- S3 storage against a moto server ------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    with loopback_s3() as endpoint:
        client = s3_client(endpoint, "ice", "cold")
        client.create_bucket(Bucket="ice")
        yield {"endpoint_url": endpoint, "client": client}


def _s3_repo(s3: dict[str, Any], prefix: str) -> icechunk.Repository:
    storage = icechunk.s3_storage(
        bucket="ice",
        prefix=prefix,
        endpoint_url=s3["endpoint_url"],
        allow_http=True,
        force_path_style=True,
        access_key_id="ice",
        secret_access_key="cold",
        region="us-east-1",
    )
    return icechunk.Repository.create(storage)


def test_s3_native_chunks_read_by_the_remote_route(s3: dict[str, Any]) -> None:
    repo = _s3_repo(s3, "repos/one")
    _commit(repo, _dataset(), "first", mode="w", encoding=ENCODING)
    store = repo.readonly_session("main").store
    options = {"icechunk_storage": repo.storage, "key": "ice", "secret": "cold"}
    _check_reads(store, options)
    names = {
        o["Key"]
        for o in s3["client"].list_objects_v2(Bucket="ice", Prefix="repos/one/chunks/")["Contents"]
    }
    found = _locations(store, options, ["t2m/c/0/0/0", "flag/c/1/0"])
    for loc in found:
        assert type(loc).__name__ == "_Remote"
        assert f"repos/one/{loc.name}" in names and loc.store.path.endswith("ice/repos/one")


def test_s3_storage_of_another_prefix_fails_clearly(s3: dict[str, Any]) -> None:
    """A listed chunk whose object is not where the given storage says is an error
    naming the chunk and the place, never the fill value (nor the secret)."""
    repo = _s3_repo(s3, "repos/two")
    _commit(repo, _dataset(), "first", mode="w", encoding=ENCODING)
    store = repo.readonly_session("main").store
    options = {
        "icechunk_storage": "s3://ice/repos/elsewhere",
        "key": "ice",
        "secret": "cold-secret",
        "endpoint_url": s3["endpoint_url"],
    }
    gds = xr.open_dataset(store, engine="gds-zarr", device="cpu", storage_options=options)
    with pytest.raises(OSError, match="icechunk_storage") as info:
        gds.t2m.load()
    text = str(info.value)
    assert (
        "cold-secret" not in text
        and "'t2m/c/" in text
        and "s3://ice/repos/elsewhere/chunks/" in text
    )


#: the secret of the virtual chunks' bucket: no error may show it
VIRTUAL_SECRET = "virtual-secret-9f2c"


def _s3_virtual_repo(
    s3: dict[str, Any], root: Path, bucket: str
) -> tuple[icechunk.Repository, dict[str, Any]]:
    """A repository on the local filesystem whose chunks are virtual references to byte
    ranges of one object in the moto bucket ``bucket`` (one a test): an uncompressed float array
    (rows at offsets 5 and 405) and a zstd array (two compressed chunks after them; its
    third chunk missing: the fill value). Icechunk reads them through its virtual chunk
    container for ``s3://<bucket>/`` (the moto endpoint) with the container's
    credentials. Returns the repository and the values engine='zarr' must read."""
    from numcodecs import Zstd

    client = s3_client(s3["endpoint_url"], "vkey", VIRTUAL_SECRET)
    client.create_bucket(Bucket=bucket)
    floats = (np.arange(200, dtype="<f4") - 50) / 7
    ints = np.arange(-40, 40, dtype="<i4") * 1001
    packed = [Zstd(level=3).encode(ints[:40].tobytes()), Zstd(level=3).encode(ints[40:].tobytes())]
    blob = b"head!" + floats.tobytes() + packed[0] + b"gap" + packed[1] + b"tail"
    client.put_object(Bucket=bucket, Key="data/blob.bin", Body=blob)
    config = icechunk.RepositoryConfig.default()
    store_config = icechunk.s3_store(
        region="us-east-1",
        endpoint_url=s3["endpoint_url"],
        allow_http=True,
        s3_compatible=True,
        force_path_style=True,
    )
    config.set_virtual_chunk_container(
        icechunk.VirtualChunkContainer(f"s3://{bucket}/", store_config)
    )
    credentials = icechunk.containers_credentials(
        {
            f"s3://{bucket}/": icechunk.s3_credentials(
                access_key_id="vkey", secret_access_key=VIRTUAL_SECRET
            )
        }
    )
    repo = icechunk.Repository.create(
        icechunk.local_filesystem_storage(str(root)),
        config=config,
        authorize_virtual_chunk_access=credentials,
    )
    session = repo.writable_session("main")
    group = zarr.group(session.store)
    group.create_array(
        "raw",
        shape=(2, 100),
        chunks=(1, 100),
        dtype="<f4",
        compressors=None,
        dimension_names=["row", "col"],
    )
    group.create_array(
        "packed",
        shape=(120,),
        chunks=(40,),
        dtype="<i4",
        fill_value=-7,
        compressors=zarr.codecs.ZstdCodec(),
        dimension_names=["n"],
    )
    url = f"s3://{bucket}/data/blob.bin"
    session.store.set_virtual_ref("raw/c/0/0", url, offset=5, length=400)
    session.store.set_virtual_ref("raw/c/1/0", url, offset=405, length=400)
    start = 805
    session.store.set_virtual_ref("packed/c/0", url, offset=start, length=len(packed[0]))
    start += len(packed[0]) + 3
    session.store.set_virtual_ref("packed/c/1", url, offset=start, length=len(packed[1]))
    session.commit("virtual s3")
    expected = {
        "raw": floats.reshape(2, 100),
        "packed": np.concatenate([ints, np.full(40, -7, "<i4")]),
    }
    options = {
        "icechunk_storage": repo.storage,
        "key": "vkey",
        "secret": VIRTUAL_SECRET,
        "endpoint_url": s3["endpoint_url"],
        "client_kwargs": {"region_name": "us-east-1"},
    }
    return repo, {"expected": expected, "options": options}


def test_s3_virtual_chunks_read_by_the_remote_route(s3: dict[str, Any], tmp_path: Path) -> None:
    """Virtual chunks at s3:// URLs of a local repository: byte ranges of an object in
    the moto bucket, read by the remote route with the s3fs options given (no
    IcechunkFallbackWarning: the module turns it into an error), identical to
    engine='zarr' (Icechunk's own virtual chunk container) on the same session."""
    repo, made = _s3_virtual_repo(s3, tmp_path / "repo", "virtual-read")
    options = made["options"]
    store = repo.readonly_session("main").store
    found = _locations(store, options, ["raw/c/0/0", "raw/c/1/0", "packed/c/1", "packed/c/2"])
    assert [type(x).__name__ for x in found] == ["_Remote", "_Remote", "_Remote", "NoneType"]
    assert [(loc.name, loc.offset, loc.size) for loc in found[:2]] == [
        ("data/blob.bin", 5, 400),
        ("data/blob.bin", 405, 400),
    ]
    assert found[0].store.path.rstrip("/") == "virtual-read"
    for kw in ({}, {"chunks": {}}):
        gds, ref = _both(store, options, **kw)
        expected = ref.load()
        xr.testing.assert_identical(gds.load(), expected)
        for sel in ({"row": [1, 0], "col": slice(3, 90, 9)}, {"n": slice(30, 95)}):
            xr.testing.assert_identical(gds.isel(sel).load(), expected.isel(sel))
    raw = xr.open_dataset(
        store, engine="gds-zarr", device="cpu", storage_options=options, mask_and_scale=False
    )
    for name, values in made["expected"].items():
        np.testing.assert_array_equal(raw[name].values, values)


def test_s3_virtual_chunk_of_a_missing_object_fails_clearly(
    s3: dict[str, Any], tmp_path: Path
) -> None:
    """A virtual reference to an object that is not in the bucket: an error naming the
    chunk and the object, never the fill value, and never the secret."""
    repo, made = _s3_virtual_repo(s3, tmp_path / "repo", "virtual-gone")
    session = repo.writable_session("main")
    gone = "s3://virtual-gone/data/gone.bin"
    session.store.set_virtual_ref("packed/c/2", gone, offset=0, length=9)
    session.commit("a reference to nothing")
    store = repo.readonly_session("main").store
    gds = xr.open_dataset(store, engine="gds-zarr", device="cpu", storage_options=made["options"])
    with pytest.raises(OSError) as info:
        gds.packed.load()
    text = "".join(traceback.format_exception(info.value))
    assert VIRTUAL_SECRET not in text
    assert "'packed/c/2'" in str(info.value) and "s3://virtual-gone/data/gone.bin" in text
    assert "virtual reference" in str(info.value)


# -- on the GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_device_reads_match_zarr(tmp_path: Path, local_repo: icechunk.Repository) -> None:
    import cupy as cp

    options = {"icechunk_storage": local_repo.storage}
    store = local_repo.readonly_session("main").store
    for kw in ({}, {"chunks": {}}):
        gds = xr.open_dataset(
            store, engine="gds-zarr", device="cuda", storage_options=options, **_placed(kw, "cuda")
        )
        ref = xr.open_dataset(store, engine="zarr", **kw).load()
        got = gds.load()
        assert isinstance(got.t2m.data, cp.ndarray) and isinstance(got.flag.data, cp.ndarray)
        xr.testing.assert_identical(got.as_numpy(), ref)
        for sel in SELECTIONS:
            xr.testing.assert_identical(gds.isel(sel).load().as_numpy(), ref.isel(sel))
    repo, _ = _mixed_repo(tmp_path / "mixed")
    mixed = repo.readonly_session("main").store
    got = xr.open_dataset(
        mixed, engine="gds-zarr", device="cuda", storage_options={"icechunk_storage": repo.storage}
    ).load()
    assert isinstance(got.a.data, cp.ndarray)
    xr.testing.assert_identical(got.as_numpy(), xr.open_dataset(mixed, engine="zarr").load())


@pytest.mark.gpu
def test_device_reads_of_s3_chunks_match_zarr(s3: dict[str, Any]) -> None:
    import cupy as cp

    repo = _s3_repo(s3, "repos/gpu")
    _commit(repo, _dataset(), "first", mode="w", encoding=ENCODING)
    store = repo.readonly_session("main").store
    options = {"icechunk_storage": repo.storage, "key": "ice", "secret": "cold"}
    got = xr.open_dataset(store, engine="gds-zarr", device="cuda", storage_options=options).load()
    assert isinstance(got.t2m.data, cp.ndarray)
    xr.testing.assert_identical(got.as_numpy(), xr.open_dataset(store, engine="zarr").load())


@pytest.mark.gpu
def test_device_reads_of_s3_virtual_chunks_match_zarr(s3: dict[str, Any], tmp_path: Path) -> None:
    import cupy as cp

    repo, made = _s3_virtual_repo(s3, tmp_path / "repo", "virtual-gpu")
    store = repo.readonly_session("main").store
    for kw in ({}, {"chunks": {}}):
        gds = xr.open_dataset(
            store,
            engine="gds-zarr",
            device="cuda",
            storage_options=made["options"],
            **_placed(kw, "cuda"),
        )
        got = gds.load()
        assert isinstance(got.raw.data, cp.ndarray) and isinstance(got.packed.data, cp.ndarray)
        xr.testing.assert_identical(got.as_numpy(), xr.open_dataset(store, engine="zarr").load())

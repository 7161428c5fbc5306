"""Every store kind against the conformance suite (:mod:`xarray_gds.testing`), and the
registry that picks them."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zarr.core.buffer import cpu
from zarr.core.sync import sync
from zarr.storage import LocalStore, MemoryStore, WrapperStore

from tests._http import serve
from tests._s3 import client as s3_client
from tests._s3 import loopback_s3, storage_options
from xarray_gds import stores
from xarray_gds.deferred import HeldMetadataStore
from xarray_gds.stores.local import GdsStore
from xarray_gds.testing import StoreKindTests


def _write_files(root: Path, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class TestLocal(StoreKindTests):
    kind = stores.LocalSource

    def make_store(self, tmp_path: Path, objects: dict[str, bytes]) -> Any:
        root = tmp_path / "local.zarr"
        _write_files(root, objects)
        (root / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
        return GdsStore(root, read_only=True)

    def target(self, tmp_path: Path, store: Any) -> Any:
        return str(store.root)

    def writable_store(self, tmp_path: Path) -> Any:
        return GdsStore(tmp_path / "written.zarr", read_only=False)

    def damage(self, tmp_path: Path, store: Any, key: str) -> bool:
        path = Path(store.root) / key
        path.unlink()
        path.mkdir()  # a directory where the chunk's file was
        return True


class TestDirectory(StoreKindTests):
    kind = stores.DirectorySource

    def make_store(self, tmp_path: Path, objects: dict[str, bytes]) -> Any:
        root = tmp_path / "plain.zarr"
        _write_files(root, objects)
        return LocalStore(root, read_only=True)

    def writable_store(self, tmp_path: Path) -> Any:
        return LocalStore(tmp_path / "written.zarr", read_only=False)

    def damage(self, tmp_path: Path, store: Any, key: str) -> bool:
        (Path(store.root) / key).write_bytes(b"xx")  # cut short
        return True


class TestMemory(StoreKindTests):
    kind = stores.MemorySource

    def make_store(self, tmp_path: Path, objects: dict[str, bytes]) -> Any:
        return MemoryStore({k: cpu.Buffer.from_bytes(v) for k, v in objects.items()})

    def writable_store(self, tmp_path: Path) -> Any:
        return MemoryStore()

    def damage(self, tmp_path: Path, store: Any, key: str) -> bool:
        store._store_dict[key] = cpu.Buffer.from_bytes(b"xx")  # cut short
        return True


class _Wrapped(WrapperStore[MemoryStore]):
    """A zarr Store that no kind but the last (any Store) claims."""


class TestAnyStore(StoreKindTests):
    """Any other zarr Store, read and written through its own methods."""

    kind = stores.StoreSource

    def make_store(self, tmp_path: Path, objects: dict[str, bytes]) -> Any:
        held = MemoryStore({k: cpu.Buffer.from_bytes(v) for k, v in objects.items()})
        return _Wrapped(held.with_read_only(True))

    def writable_store(self, tmp_path: Path) -> Any:
        return _Wrapped(MemoryStore())

    def damage(self, tmp_path: Path, store: Any, key: str) -> bool:
        store._store._store_dict[key] = cpu.Buffer.from_bytes(b"xx")  # cut short
        return True


@pytest.mark.needs("fsspec")  # the refs extra
class TestReferences(StoreKindTests):
    """A kerchunk reference set: every object a byte range of one file (the empty one
    inline)."""

    kind = stores.ReferenceSource

    def _refs(self, tmp_path: Path, objects: dict[str, bytes]) -> dict[str, Any]:
        blob = tmp_path / "blob.bin"
        refs: dict[str, Any] = {".zgroup": json.dumps({"zarr_format": 2})}
        offset = 0
        with blob.open("wb") as f:
            for key, data in objects.items():
                if not data:
                    refs[key] = "base64:" + base64.b64encode(data).decode()
                    continue
                f.write(data)
                refs[key] = [str(blob), offset, len(data)]
                offset += len(data)
        return {"version": 1, "refs": refs}

    def make_store(self, tmp_path: Path, objects: dict[str, bytes]) -> Any:
        refs = self._refs(tmp_path, objects)
        path = tmp_path / "refs.json"
        path.write_text(json.dumps(refs))
        opened = stores.open_target(str(path), mode="r", storage_options=None)
        assert opened is not None
        return opened.store

    def target(self, tmp_path: Path, store: Any) -> Any:
        return str(tmp_path / "refs.json")

    def damage(self, tmp_path: Path, store: Any, key: str) -> bool:
        (tmp_path / "blob.bin").write_bytes(b"")  # every range now past the file's end
        return True

    def no_writer(self) -> str:
        return (
            "a reference set is read-only: other tools write the files it points into, "
            "and a chunk stored anew needs a new reference set"
        )


@pytest.mark.needs("obstore")  # the remote extra
class TestRemote(StoreKindTests):
    """Objects over HTTP (the suite's loopback server), through obstore on the host and
    a kvikio stand-in on the device."""

    kind = stores.RemoteSource
    consolidated = True  # HTTP lists no keys
    #: storage options of the open (none: obstore's HTTPStore)
    options: dict[str, Any] | None = None

    @pytest.fixture
    def store(self, tmp_path: Path, held: dict[str, bytes]) -> Iterator[Any]:
        root = tmp_path / "served"
        _write_files(root / "r.zarr", held)
        (root / "r.zarr" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
        with serve(root) as base:
            self.url = f"{base}/r.zarr"
            yield stores.RemoteSource.open(self.url, mode="r", storage_options=self.options).store

    def target(self, tmp_path: Path, store: Any) -> Any:
        return self.url

    def damage(self, tmp_path: Path, store: Any, key: str) -> bool:
        (tmp_path / "served" / "r.zarr" / key).write_bytes(b"xx")  # cut short
        return True

    def rewritable_store(self, tmp_path: Path) -> Any:
        """The files the server serves, written on its side (HTTP takes no writes)."""
        return LocalStore(tmp_path / "served" / "w.zarr")

    def reader(self, tmp_path: Path, written: Any) -> Any:
        url = self.url.rsplit("/", 1)[0] + "/w.zarr"
        return stores.RemoteSource.open(url, mode="r", storage_options=self.options).store


@pytest.mark.needs("fsspec", "aiohttp")
class TestRemoteFsspec(TestRemote):
    """The same through fsspec's HTTP filesystem (an option only it takes)."""

    options = {"encoded": True}  # noqa: RUF012 (read only)


@pytest.mark.needs("moto", "obstore", "s3fs")  # the loopback server; the remote extra
class TestRemoteS3(StoreKindTests):
    """Objects of a bucket of the suite's loopback S3 server (moto, one for the class),
    read through obstore on the host and a kvikio stand-in on the device, written
    through s3fs."""

    kind = stores.RemoteSource
    bucket = "store-kinds"

    @pytest.fixture(scope="class")
    @classmethod
    def endpoint(cls) -> Iterator[str]:
        with loopback_s3() as endpoint:
            s3_client(endpoint, "kinds-key", "kinds-secret").create_bucket(Bucket=cls.bucket)
            yield endpoint

    @pytest.fixture
    def store(self, endpoint: str, tmp_path: Path, held: dict[str, bytes]) -> Any:
        self.options = storage_options(endpoint, "kinds-key", "kinds-secret")
        self.root = f"s3://{self.bucket}/{tmp_path.name}"
        client = s3_client(endpoint, "kinds-key", "kinds-secret")
        group = {"r.zarr/zarr.json": b'{"zarr_format": 3, "node_type": "group"}'}
        for key, data in {**group, **{f"r.zarr/{k}": v for k, v in held.items()}}.items():
            client.put_object(Bucket=self.bucket, Key=f"{tmp_path.name}/{key}", Body=data)
        return self.open(f"{self.root}/r.zarr", "r")

    def open(self, url: str, mode: str) -> Any:
        return stores.RemoteSource.open(url, mode=mode, storage_options=self.options).store

    def target(self, tmp_path: Path, store: Any) -> Any:
        return None  # a URL opens only with the server's options

    def rewritable_store(self, tmp_path: Path) -> Any:
        return self.open(f"{self.root}/w.zarr", "w")


class TestIcechunk(StoreKindTests):
    """An Icechunk repository on the local filesystem: its objects are the chunks of a
    real array (Icechunk holds nothing else), uncompressed."""

    kind = stores.IcechunkSource

    def objects(self, tmp_path: Path) -> dict[str, bytes]:
        return {f"a/c/{i}": np.arange(i, i + 64, dtype="u1").tobytes() for i in range(4)}

    def missing_key(self) -> str:
        return "a/c/5"

    def make_store(self, tmp_path: Path, objects: dict[str, bytes]) -> Any:
        icechunk = pytest.importorskip("icechunk")
        import zarr

        repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(tmp_path / "r")))
        session = repo.writable_session("main")
        array = zarr.create_array(
            session.store, name="a", shape=(6 * 64,), chunks=(64,), dtype="u1", compressors=None
        )
        for key, data in objects.items():
            i = int(key.rsplit("/", 1)[1])
            array[i * 64 : (i + 1) * 64] = np.frombuffer(data, dtype="u1")
        session.commit("the suite's objects")
        opened = stores.open_target(
            repo.readonly_session("main").store,
            mode="r",
            storage_options={"icechunk_storage": str(tmp_path / "r")},
        )
        assert opened is not None
        return opened.store

    def rewritable_store(self, tmp_path: Path) -> Any:
        """A writable session of a new repository: written and read, uncommitted."""
        icechunk = pytest.importorskip("icechunk")
        storage = icechunk.local_filesystem_storage(str(tmp_path / "rewritten"))
        return icechunk.Repository.create(storage).writable_session("main").store

    def read_options(self, tmp_path: Path) -> dict[str, Any] | None:
        return {"icechunk_storage": str(tmp_path / "rewritten")}


# -- the registry ------------------------------------------------------------------------


def test_registry_order_and_fallback(tmp_path: Path) -> None:
    """Kinds are asked in order; any other zarr Store is read through its ``get``; a
    store held for a write is read as the store it wraps."""
    order = stores.kinds()
    assert order[0] is stores.ReferenceSource and order[-1] is stores.StoreSource
    assert order.index(stores.RemoteSource) < order.index(stores.LocalSource)
    from zarr.storage import ZipStore

    zipped = ZipStore(tmp_path / "z.zip", mode="w")
    assert type(stores.source_for(zipped)) is stores.StoreSource
    zipped.close()
    held = HeldMetadataStore(MemoryStore(), lock_timeout=1)
    try:
        assert type(stores.source_for(held)) is stores.MemorySource
    finally:
        held.discard()
    local = GdsStore(tmp_path / "x.zarr", read_only=False)
    held = HeldMetadataStore(local, lock_timeout=1)
    try:
        source = stores.source_for(held)
        assert type(source) is stores.LocalSource and source.writes_in_threads
    finally:
        held.discard()


def test_a_fifth_kind_joins_the_registry(tmp_path: Path) -> None:
    """A kind registered before the fallback claims its stores; the others stay."""

    class Tagged(MemoryStore):
        pass

    class TaggedSource(stores.StoreSource):
        @classmethod
        def claims(cls, store: Any) -> bool:
            return isinstance(store, Tagged)

    before = stores.kinds()
    stores.register(TaggedSource, before=stores.MemorySource)
    try:
        assert type(stores.source_for(Tagged())) is TaggedSource
        assert type(stores.source_for(MemoryStore())) is stores.MemorySource
    finally:
        stores.base._KINDS[:] = before
    assert stores.kinds() == before


def test_memory_lock_excludes_a_second_writer() -> None:
    """A memory store's writers, and those of a copy of it, one at a time; the kind
    says it locks (so the conformance suite checks its lock)."""
    store = MemoryStore()
    assert stores.source_for(store).locking
    first = stores.source_for(store).writer_lock(1)
    assert first is not None
    try:
        for other in (store, store.with_read_only(False)):
            with pytest.raises(TimeoutError, match="another writer"):
                stores.source_for(other).writer_lock(0.05)
    finally:
        first.release()
    again = stores.source_for(store).writer_lock(0.05)
    assert again is not None
    again.release()


def test_local_kind_keeps_reading_after_a_store_moves(tmp_path: Path) -> None:
    """A path opens as a GdsStore checked to hold a Zarr store."""
    with pytest.raises(FileNotFoundError):
        stores.open_target(str(tmp_path / "none.zarr"), mode="r", storage_options=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a Zarr store"):
        stores.open_target(str(tmp_path / "empty"), mode="r", storage_options=None)
    root = tmp_path / "g.zarr"
    root.mkdir()
    (root / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    opened = stores.open_target(f"file://{root}", mode="r", storage_options=None)
    assert opened is not None and isinstance(opened.store, GdsStore)
    assert sync(opened.store.get("zarr.json", cpu.buffer_prototype)) is not None
    shutil.rmtree(root)


def test_the_capability_table_of_the_docs_is_the_sources() -> None:
    """docs/internals.md's table of capabilities says, for every kind, what its source
    class declares (a capability the table and the class disagree on fails here)."""
    from xarray_gds.stores import base
    from xarray_gds.stores.generic import MemorySource, StoreSource
    from xarray_gds.stores.icechunk import IcechunkSource
    from xarray_gds.stores.local import DirectorySource, LocalSource
    from xarray_gds.stores.refs import ReferenceSource
    from xarray_gds.stores.remote import RemoteSource

    columns = {
        "local": LocalSource,
        "directory": DirectorySource,
        "memory": MemorySource,
        "refs": ReferenceSource,
        "remote": RemoteSource,
        "icechunk": IcechunkSource,
        "any Store": StoreSource,
    }
    page = (Path(__file__).resolve().parent.parent / "docs" / "internals.md").read_text()
    lines = [line for line in page.splitlines() if line.startswith("| ")]
    header = next(line for line in lines if line.startswith("| capability |"))
    names = [cell.strip() for cell in header.strip("|").split("|")][2:]
    assert names == list(columns)
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        capability = cells[0].strip("`")
        if len(cells) == len(names) + 2 and hasattr(base.Source, capability):
            rows[capability] = [cell == "yes" for cell in cells[2:]]
    declared = {
        name
        for name, value in vars(base.Source).items()
        if isinstance(value, bool) and not name.startswith("_")
    }
    assert set(rows) == declared
    for capability, marks in rows.items():
        got = [getattr(cls, capability) for cls in columns.values()]
        assert got == marks, f"{capability}: the classes declare {got}, the table {marks}"


@pytest.mark.parametrize("wrap", [False, True])
def test_existed_says_whether_the_store_holds_a_key(wrap: bool) -> None:
    """What a failed write asks of every written key before removing what it created:
    a key the store holds existed, one it lacks did not (a memory store's own source,
    and any other zarr Store's)."""
    from zarr.storage import LoggingStore

    inner = MemoryStore()
    store = LoggingStore(inner) if wrap else inner
    sync(store.set("v/zarr.json", cpu.Buffer.from_bytes(b"{}")))
    source = stores.source_for(store)
    assert type(source).__name__ == ("StoreSource" if wrap else "MemorySource")
    assert source.existed("v/zarr.json") is True
    assert source.existed("v/c/0") is False


def _bytes_of(batch: Any, i: int) -> bytes | None:
    size = int(batch.sizes[i])
    start = int(batch.offsets[i])
    return None if size < 0 else bytes(np.asarray(batch.arena[start : start + size]))


def test_reads_for_the_device_are_packed_and_joined_in_location_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A source's reads for the device (CuPy stood in for by numpy): host arrays packed
    into one arena, missing ones left out; disjoint reads of parts of the locations
    joined into one batch in location order, a single read in order handed on as it
    is."""
    from tests.test_host_logic import _fake_cupy
    from xarray_gds import device as _device
    from xarray_gds.batch import DeviceBatch
    from xarray_gds.stores import base

    monkeypatch.setattr(_device, "cupy", _fake_cupy)
    chunks = [b"abc", None, b"", b"defgh", b"ij"]
    found = [None if c is None else np.frombuffer(c, np.uint8) for c in chunks]
    packed = base.on_side(found, True)
    assert isinstance(packed, DeviceBatch)
    assert [_bytes_of(packed, i) for i in range(5)] == chunks
    # the locations read in two parts, each in an order of its own
    first, second = [3, 0, 1], [4, 2]
    parts = [
        (np.array(idx), base.on_side([found[i] for i in idx], True)) for idx in (first, second)
    ]
    joined = base.join(parts, 5, True)
    assert [_bytes_of(joined, i) for i in range(5)] == chunks
    # one part of every location: as it is when in order, reordered when not
    assert base.join([(np.arange(5), packed)], 5, True) is packed
    backwards = base.on_side(found[::-1], True)
    again = base.join([(np.arange(5)[::-1], backwards)], 5, True)
    assert [_bytes_of(again, i) for i in range(5)] == chunks

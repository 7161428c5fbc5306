"""The conformance suite of a store kind, as ``zarr.testing.store.StoreTests`` is zarr's.

A kind's tests subclass :class:`StoreKindTests`, name the kind (``kind``) and say how
to make a store of it holding given objects (:meth:`~StoreKindTests.make_store`); the
suite then checks what every kind promises the engine (see
:class:`xarray_gds.stores.base.Source`): the registry picks the kind, whole objects and
byte ranges come back exactly (empty ranges too), a missing key reads as missing, a
range past an object's end is never returned as data, reads land on the host or in
device memory, concurrent reads do not mix, errors name the key, and a write through
:func:`xarray_gds.to_zarr` takes the kind's writer lock and leaves nothing of itself
after a failure, and datasets opened before a write read what it wrote.

Device placement runs without a GPU: :func:`device_standins` puts numpy stand-ins for
CuPy, ``cupyx`` and kvikio (``CuFile`` over local files, ``RemoteFile`` over HTTP and
path-style S3) in place of the real ones for a test. pytest is imported by this module: it is a test
helper, never imported by a read.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import threading
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from xarray_gds import device as _device
from xarray_gds.batch import DeviceBatch, HostBatch
from xarray_gds.stores import Source, open_target, source_for

__all__ = ["StoreKindTests", "device_standins"]


# -- stand-ins for CuPy, cupyx and kvikio -------------------------------------------------


class DeviceArray(np.ndarray):
    """A host array standing for a CuPy array (``set``/``get`` as CuPy's)."""

    def set(self, arr: Any, stream: Any = None) -> None:
        self[...] = arr

    def get(self) -> np.ndarray:
        return np.asarray(self)


class _Stream:
    def synchronize(self) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class _Device:
    id = 0

    def __init__(self, *args: Any) -> None:
        pass

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


def _cupy() -> Any:
    stream = _Stream()

    def empty(shape: Any, dtype: Any = np.float64) -> Any:
        return np.empty(shape, dtype=dtype).view(DeviceArray)

    def asarray(a: Any, dtype: Any = None) -> Any:
        return np.asarray(a, dtype=dtype).view(DeviceArray)

    cuda = types.SimpleNamespace(Device=_Device, Stream=_Stream, get_current_stream=lambda: stream)
    names = ("ascontiguousarray", "cumsum", "uint8", "zeros", "concatenate")
    return types.SimpleNamespace(
        **{k: getattr(np, k) for k in names},
        empty=empty,
        asarray=asarray,
        asnumpy=lambda a: np.array(a, copy=True).view(np.ndarray),
        cuda=cuda,
    )


class _Future:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class _CuFile:
    """kvikio's ``CuFile`` over a local file, reading into host arrays."""

    def __init__(self, path: Any, mode: str = "r") -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close(), as kvikio's)

    def pread(self, buf: Any, size: int, offset: int = 0) -> _Future:
        self._file.seek(offset)
        data = self._file.read(size)
        np.asarray(buf).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
        return _Future(len(data))

    def close(self) -> None:
        self._file.close()


class _RemoteFile:
    """kvikio's ``RemoteFile`` over HTTP(S) (range requests with urllib), and over a
    path-style S3 endpoint (requests signed with botocore's SigV4)."""

    def __init__(self, url: str, nbytes: int | None, s3: dict[str, Any] | None = None) -> None:
        self.url = url
        self._s3 = s3
        if nbytes is None:
            with urllib.request.urlopen(self._request("HEAD", {})) as got:
                nbytes = int(got.headers["Content-Length"])
        self._nbytes = nbytes

    @classmethod
    def open_http(cls, url: str, nbytes: int | None = None) -> _RemoteFile:
        return cls(url, nbytes)

    @classmethod
    def open_s3(cls, bucket: str, name: str, nbytes: int | None = None, **args: Any) -> _RemoteFile:
        endpoint = args.get("aws_endpoint_url") or "https://s3.amazonaws.com"
        return cls(f"{endpoint.rstrip('/')}/{bucket}/{name}", nbytes, args)

    def _request(self, method: str, headers: dict[str, str]) -> urllib.request.Request:
        if self._s3 is None:
            return urllib.request.Request(self.url, headers=headers, method=method)
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials

        s3 = self._s3
        request = AWSRequest(method=method, url=self.url, headers=headers)
        credentials = Credentials(
            s3.get("aws_access_key_id"),
            s3.get("aws_secret_access_key"),
            s3.get("aws_session_token"),
        )
        SigV4Auth(credentials, "s3", s3.get("aws_region_name") or "us-east-1").add_auth(request)
        return urllib.request.Request(self.url, headers=dict(request.headers), method=method)

    def nbytes(self) -> int:
        return self._nbytes

    def pread(self, buf: Any, size: int, offset: int = 0) -> _Future:
        headers = {"Range": f"bytes={offset}-{offset + size - 1}"}
        with urllib.request.urlopen(self._request("GET", headers)) as got:
            data = got.read()
        np.asarray(buf).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
        return _Future(len(data))


@contextlib.contextmanager
def device_standins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """numpy stand-ins for CuPy, ``cupyx`` and kvikio for the ``with`` block: device
    reads run on the host and their arena is a :class:`DeviceArray`."""
    cupyx = types.ModuleType("cupyx")
    cupyx.empty_pinned = lambda shape, dtype=np.uint8: np.empty(shape, dtype=dtype)  # type: ignore[attr-defined]
    kvikio = types.SimpleNamespace(CuFile=_CuFile, RemoteFile=_RemoteFile)
    with monkeypatch.context() as patch:
        patch.setattr(_device, "cupy", _cupy)
        patch.setattr(_device, "kvikio", lambda: kvikio)
        patch.setitem(sys.modules, "cupyx", cupyx)
        yield


# -- the suite ------------------------------------------------------------------------------


def _objects() -> dict[str, bytes]:
    """The objects every kind's store holds: chunks of several sizes, one empty."""
    rng = np.random.default_rng(42)
    sizes = {"a/c/0": 1000, "a/c/1": 4096, "a/c/2": 17, "b/c/0/0": 65536, "b/c/0/1": 0}
    return {key: rng.bytes(n) for key, n in sizes.items()}


class StoreKindTests:
    """The tests every store kind passes. A subclass sets :attr:`kind` and implements
    :meth:`make_store`; it may override :meth:`target` (what the kind opens),
    :meth:`writable_store` (a store to write, for kinds that declare ``writes``), and
    :meth:`rewritable_store`, :meth:`reader` and :meth:`read_options` (a store written
    and read again, what reads it, the options of those reads).

    The objects (:meth:`objects`) are raw bytes under chunk-like keys; a kind that can
    hold only the chunks of real arrays (Icechunk) overrides :meth:`objects` too.
    """

    #: the :class:`~xarray_gds.stores.base.Source` subclass under test
    kind: ClassVar[type[Source]]
    #: whether :meth:`test_read_after_write` writes and reads consolidated metadata
    #: (for stores that cannot list their keys: HTTP)
    consolidated: ClassVar[bool] = False

    # -- what a subclass provides ------------------------------------------------------

    def make_store(self, tmp_path: Path, objects: dict[str, bytes]) -> Any:
        """A zarr Store of this kind holding ``objects`` (key -> bytes), read-only."""
        raise NotImplementedError

    def target(self, tmp_path: Path, store: Any) -> Any:
        """What the kind opens (a path, URL or reference set) for ``store``; None when
        it opens only Store objects."""
        return None

    def writable_store(self, tmp_path: Path) -> Any:
        """A store of this kind to write into, or None (the write tests skip)."""
        return None

    def rewritable_store(self, tmp_path: Path) -> Any:
        """A store to write, read, write again and read (:meth:`test_read_after_write`):
        :meth:`writable_store`'s by default; None where the kind has no writer (the test
        skips, saying why: :meth:`no_writer`)."""
        return self.writable_store(tmp_path)

    def reader(self, tmp_path: Path, written: Any) -> Any:
        """What :meth:`test_read_after_write` reads what was written into ``written``
        through: the same store by default."""
        return written

    def read_options(self, tmp_path: Path) -> dict[str, Any] | None:
        """The ``storage_options`` of the engine's reads of :meth:`reader`'s store."""
        return None

    def no_writer(self) -> str:
        """Why :meth:`rewritable_store` is None."""
        return f"{self.kind.__name__} is not written here"

    def objects(self, tmp_path: Path) -> dict[str, bytes]:
        """The objects the store holds."""
        return _objects()

    def damage(self, tmp_path: Path, store: Any, key: str) -> bool:
        """Make ``key`` unreadable (e.g. a directory where its file was); False when the
        kind has no way to (the test skips)."""
        return False

    def missing_key(self) -> str:
        """A key the store does not hold."""
        return "a/c/9"

    # -- fixtures --------------------------------------------------------------------

    @pytest.fixture
    def held(self, tmp_path: Path) -> dict[str, bytes]:
        return self.objects(tmp_path)

    @pytest.fixture
    def store(self, tmp_path: Path, held: dict[str, bytes]) -> Any:
        return self.make_store(tmp_path, held)

    @pytest.fixture
    def source(self, store: Any) -> Source:
        return source_for(store)

    def _read(self, source: Source, keys: list[str], on_device: bool = False) -> list[Any]:
        got = source.read_all([source] * len(keys), source.locate(keys), on_device, None)
        return _as_list(got)

    def _ranges(
        self, source: Source, keys: list[str], starts: list[int], sizes: list[int], on_device: bool
    ) -> list[Any]:
        ranges = (np.array(starts, dtype=np.int64), np.array(sizes, dtype=np.int64))
        got = source.read_ranges_all([source] * len(keys), source.locate(keys), ranges, on_device)
        return _as_list(got)

    # -- recognising -----------------------------------------------------------------

    def test_registry_picks_the_kind(self, store: Any, source: Source) -> None:
        assert type(source) is self.kind
        assert self.kind.claims(store)
        capabilities = ("device_reads", "ranged_reads", "sizes", "streams", "writes")
        assert all(isinstance(getattr(source, name), bool) for name in capabilities)

    def test_opens_its_targets(self, tmp_path: Path, store: Any) -> None:
        target = self.target(tmp_path, store)
        if target is None:
            pytest.skip(f"{self.kind.__name__} opens Store objects only")
        opened = open_target(target, mode="r", storage_options=None)
        assert opened is not None
        assert type(source_for(opened.store)) is self.kind

    # -- reading ---------------------------------------------------------------------

    def test_whole_objects_on_the_host(self, source: Source, held: dict[str, bytes]) -> None:
        keys = sorted(held)
        got = self._read(source, keys)
        assert [bytes(g) for g in got] == [held[k] for k in keys]
        assert all(isinstance(g, np.ndarray) and g.dtype == np.uint8 for g in got)

    def test_missing_keys_read_as_missing(self, source: Source, held: dict[str, bytes]) -> None:
        key = sorted(held)[0]
        got = self._read(source, [self.missing_key(), key])
        assert got[0] is None and bytes(got[1]) == held[key]
        try:  # ranges of a missing key: missing, or the error of a missing file
            got = self._ranges(source, [self.missing_key()], [0], [4], False)
        except FileNotFoundError:
            return
        assert got == [None]

    def test_byte_ranges(self, source: Source, held: dict[str, bytes]) -> None:
        """Ranges of one and of several objects, overlapping, touching, at the end, and
        empty ones, each exactly the bytes asked for."""
        big = max(held, key=lambda k: len(held[k]))
        other = sorted(k for k in held if k != big and len(held[k]) > 8)[0]
        n = len(held[big])
        asked = [
            (big, 0, 10),
            (big, 5, 10),
            (big, 15, min(100, n - 15)),
            (big, n - 7, 7),
            (other, 3, 5),
        ]
        asked.append((big, 40, 0))
        keys, starts, sizes = (list(x) for x in zip(*asked, strict=True))
        for on_device in (False, True):
            got = self._read_side(source, keys, starts, sizes, on_device)
            want = [held[k][s : s + z] for k, s, z in asked]
            assert [bytes(g) for g in got] == want

    def _read_side(
        self, source: Source, keys: list[str], starts: list[int], sizes: list[int], on_device: bool
    ) -> list[Any]:
        if not on_device:
            return self._ranges(source, keys, starts, sizes, False)
        with pytest.MonkeyPatch.context() as patch, device_standins(patch):
            return [np.asarray(g) for g in self._ranges(source, keys, starts, sizes, True)]

    def test_range_past_the_end_is_never_data(self, source: Source, held: dict[str, bytes]) -> None:
        """A range that runs past its object's end raises, or reads as missing: never
        fewer bytes than asked for."""
        key = sorted(held)[0]
        size = len(held[key])
        try:
            got = self._ranges(source, [key], [size - 2], [10], False)
        except (OSError, ValueError) as err:
            assert key in str(err) or "short" in str(err) or "range" in str(err)
        else:
            assert got[0] is None or len(got[0]) == 10

    def test_device_placement(
        self, monkeypatch: pytest.MonkeyPatch, source: Source, held: dict[str, bytes]
    ) -> None:
        """Device reads give one arena holding every object (a stand-in CuPy array),
        missing ones with size -1."""
        keys = [*sorted(held), self.missing_key()]
        with device_standins(monkeypatch):
            got = source.read_all([source] * len(keys), source.locate(keys), True, None)
        assert isinstance(got, DeviceBatch)
        assert int(got.sizes[-1]) < 0
        arena = np.asarray(got.arena)
        for i, key in enumerate(keys[:-1]):
            at, size = int(got.offsets[i]), int(got.sizes[i])
            assert size == len(held[key]) and bytes(arena[at : at + size]) == held[key]

    def test_concurrent_reads(self, source: Source, held: dict[str, bytes]) -> None:
        """Reads from several threads at once each get their own objects."""
        keys = sorted(held)
        errors: list[BaseException] = []

        def reader(shift: int) -> None:
            mine = keys[shift:] + keys[:shift]
            try:
                for _ in range(5):
                    got = self._read(source, mine)
                    assert [bytes(g) for g in got] == [held[k] for k in mine]
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]

    def test_errors_name_the_key(
        self, tmp_path: Path, store: Any, source: Source, held: dict[str, bytes]
    ) -> None:
        """A chunk that cannot be read fails with an error that names its key (or the
        file or URL that holds it), never with data."""
        key = sorted(held)[0]
        if not self.damage(tmp_path, store, key):
            pytest.skip(f"no way to damage a chunk of {self.kind.__name__} here")
        with pytest.raises((OSError, ValueError)) as caught:
            self._ranges(source, [key], [0], [len(held[key])], False)
        assert key in str(caught.value)

    def test_read_end(self, source: Source, held: dict[str, bytes]) -> None:
        """A shard index's read: the first or last bytes of an object, and its size (on
        zarr's event loop, where the codec pipeline asks for it)."""
        from zarr.core.sync import sync

        key = max(held, key=lambda k: len(held[k]))
        found = sync(source.read_end(key, 8, True))
        assert found is not None
        tail, size = found
        assert bytes(tail) == held[key][-8:] and size == len(held[key])
        found = sync(source.read_end(key, 8, False))
        assert found is not None and bytes(found[0]) == held[key][:8]
        assert sync(source.read_end(self.missing_key(), 8, True)) is None

    # -- writing ---------------------------------------------------------------------

    def test_write_and_cleanup(self, tmp_path: Path) -> None:
        """A write through to_zarr lands whole; a failed one leaves the store as it was;
        while a write runs, the kind's writer lock is held."""
        store = self.writable_store(tmp_path)
        if store is None:
            pytest.skip(f"{self.kind.__name__} is not written through to_zarr here")
        pytest.importorskip("dask")  # the write fails in one of its dask blocks
        import xarray as xr

        import xarray_gds

        source = source_for(store)
        assert source.writes
        ds = xr.Dataset({"v": ("x", np.arange(40, dtype="f4"))}).chunk({"x": 10})
        xarray_gds.to_zarr(ds, store, mode="w", consolidated=False)
        back = xr.open_dataset(store, engine="gds-zarr", device="cpu", consolidated=False)
        np.testing.assert_array_equal(back["v"].values, ds["v"].values)
        bad = ds.assign(w=ds["v"].copy(data=ds["v"].data.map_blocks(_fail_late, dtype="f4")))
        with pytest.raises(RuntimeError, match="late failure"):
            xarray_gds.to_zarr(bad, store, mode="a", consolidated=False)
        again = xr.open_dataset(store, engine="gds-zarr", device="cpu", consolidated=False)
        assert set(again.data_vars) == {"v"}
        if source.locking:
            lock = source.writer_lock(0.0)
            assert lock is not None
            try:
                with pytest.raises(TimeoutError, match="another writer"):
                    source_for(store).writer_lock(0.0)
            finally:
                lock.release()

    def test_read_after_write(self, tmp_path: Path, store: Any) -> None:
        """Datasets opened before a write read what it wrote, as engine="zarr" does:
        values written over stored chunks and chunks stored where only the fill value
        was, written through the same store (an Icechunk session: the same session).
        Reads on the host, eager and through dask, opened with ``cache=False``
        (``store``, unused, keeps the kind's servers up for the test)."""
        written = self.rewritable_store(tmp_path)
        if written is None:
            pytest.skip(self.no_writer())
        import xarray as xr

        first, second = _rewrites()
        encoding = {"v": {"chunks": (2, 5)}}
        consolidated = self.consolidated
        first.to_zarr(
            written, mode="w", consolidated=consolidated, zarr_format=3, encoding=encoding
        )
        read = self.reader(tmp_path, written)
        kw: dict[str, Any] = {"consolidated": consolidated, "cache": False}
        gds = {"storage_options": self.read_options(tmp_path), "device": "cpu", **kw}
        opened = [xr.open_dataset(read, engine="gds-zarr", **gds)]
        if importlib.util.find_spec("dask") is not None:  # through dask: the dask extra
            opened.append(xr.open_dataset(read, engine="gds-zarr", chunks={}, **gds))
        zarr_read = xr.open_dataset(read, engine="zarr", **kw)
        for want in (first, second):
            if want is second:
                second.to_zarr(written, mode="r+", consolidated=consolidated)
                opened.append(xr.open_dataset(read, engine="gds-zarr", **gds))
            expected = zarr_read.compute()
            np.testing.assert_array_equal(expected["v"].values, want["v"].values)
            for ds in opened:
                xr.testing.assert_identical(ds.compute(), expected)
                xr.testing.assert_identical(
                    ds.isel(t=slice(1, 3)).compute(), expected.isel(t=slice(1, 3))
                )


def _rewrites() -> tuple[Any, Any]:
    """The datasets :meth:`StoreKindTests.test_read_after_write` writes: the first
    holds only the fill value (NaN) in its last two rows (chunks left unstored), the
    second other values everywhere."""
    import xarray as xr

    values = np.arange(40, dtype="f4").reshape(4, 10)
    first = values.copy()
    first[2:] = np.nan
    coords = {"t": np.arange(4), "x": np.arange(10)}
    return (
        xr.Dataset({"v": (("t", "x"), first)}, coords=coords),
        xr.Dataset({"v": (("t", "x"), 100 + values)}, coords=coords),
    )


def _fail_late(block: np.ndarray, block_info: Any = None) -> np.ndarray:
    """A dask block that fails (the last one), so that a write fails midway."""
    if block_info is not None and block_info[0]["chunk-location"][0] == 3:
        raise RuntimeError("late failure")
    return block


def _as_list(got: Any) -> list[Any]:
    """A read's result as a list of arrays (None where missing), from either side."""
    if isinstance(got, HostBatch):
        return list(got)
    arena = np.asarray(got.arena)
    return [
        None if size < 0 else arena[int(at) : int(at) + int(size)]
        for at, size in zip(got.offsets, got.sizes, strict=True)
    ]

"""Tests written for mutants that survived ``scripts/mutation-run.py`` (Cosmic Ray's
mutants of the read and write modules, sampled without a person choosing them): each
test names the module and the mutation it stops, and compares with what zarr-python
(``engine="zarr"``) reads or writes wherever the engine's output is at stake."""

from __future__ import annotations

import ssl
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xarray as xr
import zarr

from tests.conftest import open_both
from xarray_gds import ChunkDecodeError


def _rows_store(path: Path, rows: int = 12) -> Path:
    """``rows`` rows of one zstd chunk each (float64, 1 x 6)."""
    values = np.arange(rows * 6, dtype="f8").reshape(rows, 6)
    xr.Dataset({"v": (("r", "c"), values)}).to_zarr(
        path, zarr_format=3, encoding={"v": {"chunks": (1, 6)}}
    )
    return path


def _bounded(read: Any, seconds: float = 60.0) -> Any:
    """``read()`` in a thread: its result or its exception, failing the test when it has
    not finished within ``seconds`` (a read that hangs, not a slow one)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = read()
        except BaseException as err:
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the read did not finish"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# -- coalesce.py ----------------------------------------------------------------------------
def test_points_read_in_one_part(v3_store: Path, v2_store: Path) -> None:
    """coalesce ``while not request.done`` -> ``while request.done``: zarr's own indexing (a
    points selection) reads through the pipeline in one part, ``fetch_decode`` of one
    request, as engine="zarr" reads it."""
    for store in (v3_store, v2_store):
        gds, ref = open_both(store, "cpu")
        sel = {"time": [0, 7, 3], "lon": [1, 10]}
        xr.testing.assert_identical(gds.isel(sel).load(), ref.isel(sel).load())


def test_failing_first_part_stops_the_part_servers(tmp_path: Path) -> None:
    """coalesce ``stop = True`` -> ``stop = False`` (after a part fails): a read in many
    parts whose first part's chunk is damaged raises ChunkDecodeError naming it, as
    zarr-python fails on it, instead of waiting for ever on the part servers."""
    path = _rows_store(tmp_path / "rows.zarr")
    (path / "v" / "c" / "0" / "0").write_bytes(b"not a zstd frame at all")
    with pytest.raises(RuntimeError, match="Zstd decompression error"):  # zarr-python too
        xr.open_dataset(path, engine="zarr").v.load()

    def read() -> Any:
        with zarr.config.set({"xarray_gds.batch_bytes": 48}):  # one chunk a part
            return xr.open_dataset(path, engine="gds-zarr", device="cpu").v.load()

    with pytest.raises(ChunkDecodeError, match=r"'v/c/0/0'"):
        _bounded(read)


def test_host_route_asks_once_per_chain_with_its_total(monkeypatch: pytest.MonkeyPatch) -> None:
    """coalesce ``break`` -> ``continue`` (in ``_host_route``): the route is asked once a
    decode chain, for the chunks of all the group's requests of that chain together,
    never for one request's share (a cost model need not be monotone in the count)."""
    from tests.test_host_logic import _chain, _requests
    from xarray_gds import coalesce, route

    asked: list[tuple[str | None, int]] = []

    def choose(compressor: Any, n: int, nbytes: int) -> str:
        asked.append((getattr(compressor, "name", compressor), n))
        return "host"

    monkeypatch.setattr(route, "choose", choose)
    zstd, gzip = _chain("zstd"), _chain("gzip")
    assert coalesce._host_route(_requests((zstd, 3), (gzip, 2), (zstd, 5), (zstd, 1)))
    assert sorted(asked) == [("gzip", 2), ("zstd", 9)]


def _mixed_store(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A v3 store of a sharded variable (its chunks read by byte ranges), an unsharded one
    (whole chunk files) and a second unsharded one of the same codecs."""
    import zarr.codecs as zc

    rng = np.random.default_rng(3)
    values = {n: rng.standard_normal((8, 12)).astype("f4") for n in ("s", "w", "x")}
    group = zarr.open_group(path, mode="w", zarr_format=3)
    for name, data in values.items():
        kwargs: dict[str, Any] = {"chunks": (4, 6), "compressors": [zc.ZstdCodec()]}
        if name == "s":
            kwargs["shards"] = (8, 12)
        array = group.create_array(
            name, shape=data.shape, dtype=data.dtype, dimension_names=["a", "b"], **kwargs
        )
        array[:] = data
    zarr.consolidate_metadata(path)
    return path, values


def test_a_batch_of_whole_chunks_and_byte_ranges(tmp_path: Path) -> None:
    """coalesce ``for ranged in (False, True)`` -> ``(False, False)``: a dataset loaded in
    one batch whose variables are read as whole chunk files and as byte ranges of shards
    at once reads both, as engine="zarr" does."""
    path, values = _mixed_store(tmp_path / "mixed.zarr")
    gds, ref = open_both(path, "cpu")
    got = gds.load()
    xr.testing.assert_identical(got, ref.load())
    for name, data in values.items():
        np.testing.assert_array_equal(got[name].values, data, strict=True)


# -- decode.py ------------------------------------------------------------------------------
MIB = 1 << 20


@pytest.mark.parametrize(
    ("n_chunks", "chunk", "parts", "batch", "want"),
    [
        (1000, MIB, 1, None, 1000),  # 1000 MiB: within the host's 1 GiB, one part
        (2000, MIB, 1, None, 1024),  # the budget: 1 GiB a part
        (200, MIB, 4, None, 64),  # 50 MiB a part asked: never below 64 MiB
        (1000, MIB, 4, None, 250),  # 250 MiB a part
        (1000, MIB, 4, 100 * MIB, 100),  # the configured budget wins
        (10, 0, 1, None, 64 * MIB),  # empty chunks count as one byte
        (210_000_001, 1, 3, None, 70_000_001),  # a third, rounded up: three parts, not four
    ],
)
def test_part_chunks_exact(
    n_chunks: int, chunk: int, parts: int, batch: int | None, want: int
) -> None:
    """decode ``max(1, pipeline_parts)`` -> ``max(2, ...)`` and ``MIN_PART_BYTES = 64 << 20``
    -> ``64 << 19``: the chunks a part of a host read holds, exactly, for reads below
    and above the batch budget and the smallest part, split into parts or not."""
    from xarray_gds import decode

    settings: dict[str, Any] = {"xarray_gds.pipeline_parts": parts}
    if batch is not None:
        settings["xarray_gds.batch_bytes"] = batch
    with zarr.config.set(settings):
        assert decode.part_chunks(n_chunks, chunk, on_device=False) == want


def test_joined_keys_of_nothing() -> None:
    """decode ``... else 0`` -> ``... else -1`` (``Joined.__len__``): no key sequences at
    all join into an empty sequence."""
    from xarray_gds import decode

    joined = decode.Joined([])
    assert len(joined) == 0 and list(joined) == [] and joined[:] == []


def device_batch(fetched: list[Any]) -> Any:
    """The fetched chunks in one arena at 16-byte boundaries (as a device read packs
    them), ``-1`` the size of a missing one, ``0`` that of an empty file."""
    from xarray_gds.batch import DeviceBatch

    offsets, sizes, at = [], [], 0
    for data in fetched:
        offsets.append(at)
        sizes.append(-1 if data is None else len(data))
        at += 0 if data is None else -(-len(data) // 16) * 16
    arena = np.zeros(at + 16, dtype=np.uint8)
    for o, data in zip(offsets, fetched, strict=True):
        if data is not None:
            arena[o : o + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return DeviceBatch(arena, np.asarray(offsets, np.int64), np.asarray(sizes, np.int64))


@pytest.mark.parametrize("host", [0, 1, 3, 100])
def test_decode_split_matches_the_host_decode(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any, host: int
) -> None:
    """decode_split (the GPU's batch shared with the host pool) with a fake CuPy over numpy
    and nvCOMP's decode standing in as the host decode: the rows of the nvCOMP share and
    of the host share (the last present chunks, their stored bytes from the arena) land
    where ``decode_fetched`` on the host puts them, and the pinned lease is the host
    share's decoded size. Kills decode ``o + s`` -> ``o // s``, ``host * nbytes`` ->
    ``host | nbytes``, ``rows[m + i]`` -> ``rows[m ** i]`` and ``if m:`` -> ``if not m:``."""
    import threading

    from tests.test_host_logic import _all_chunks, _fake_cupy, _Staging
    from xarray_gds import decode
    from xarray_gds import device as _device
    from xarray_gds.batch import DeviceBatch
    from xarray_gds.codecs import nvcomp

    chain, keys, fetched = _all_chunks(store_factory(3, "zstd"))
    want_present, want = decode.decode_fetched(chain, fetched, keys, False)
    batch = device_batch(fetched)

    def gpu_decode(chain: Any, batch: DeviceBatch, idx: list[int], names: Any) -> Any:
        out = np.empty((len(idx), chain.nbytes), dtype=np.uint8)
        stored = [batch.arena[batch.offsets[i] : batch.offsets[i] + batch.sizes[i]] for i in idx]
        decode.decode_host(chain, stored, names, out)
        return out

    fake = _fake_cupy()
    fake.asnumpy = np.asarray
    monkeypatch.setattr(_device, "cupy", lambda: fake)
    monkeypatch.setattr(decode, "_streams", threading.local())
    monkeypatch.setattr(nvcomp, "decode", gpu_decode)
    staging = _Staging()
    present, got = decode.decode_split(chain, batch, keys, staging, host, 2)
    assert present == want_present
    shared = min(host, len(present))
    assert staging.leased == ([shared * chain.nbytes] if shared else [])
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), want)


# -- region.py ------------------------------------------------------------------------------
@pytest.mark.parametrize(("codec", "box_read"), [("zstd", True), ("blosc-blosclz", False)])
def test_device_box_reads_only_of_chains_the_device_decodes(
    monkeypatch: pytest.MonkeyPatch, store_factory: Any, codec: str, box_read: bool
) -> None:
    """region ``on_device and not chain.device_ready`` -> ``on_device and
    chain.device_ready``: with a fake CuPy, a device read of a chain nVCOMP decodes
    (zstd) is a box read, one of a chain it cannot (Blosc's blosclz) is left to zarr's
    own path; on the host both are box reads."""
    import types

    from tests.test_host_logic import _fake_cupy
    from xarray_gds import device as _device
    from xarray_gds import region

    ds = xr.open_dataset(store_factory(2, codec), engine="gds-zarr", device="cpu")
    lazy = ds.t2m.variable._data
    while not hasattr(lazy, "get_array"):  # xarray's wrappers around the engine's array
        lazy = lazy.array
    array = lazy.get_array()
    key = (slice(None),) * 3
    assert region._plan(array, key, "cpu") is not None
    fake = _fake_cupy()
    fake.cuda.runtime = types.SimpleNamespace(memGetInfo=lambda: (1 << 30, 1 << 30))
    monkeypatch.setattr(_device, "cupy", lambda: fake)
    assert (region._plan(array, key, "cuda") is not None) == box_read


# -- stores/lock.py ----------------------------------------------------------------------
def _writer_lock(store: Any, timeout: float | None = 600.0) -> Any:
    """The writer lock of ``store``, taken as a write takes it (its kind's source)."""
    from xarray_gds.stores import source_for

    return source_for(store).writer_lock(timeout)


def test_lock_timeout_default_is_the_documented_600_s() -> None:
    """locking ``DEFAULT_TIMEOUT = 600.0`` -> ``601.0``: ``to_zarr``'s docstring says a writer
    waits 600 s by default; the default it has, and the lock's, are that."""
    import inspect

    import xarray_gds
    from xarray_gds.stores import lock as locking

    assert "600 by default" in (xarray_gds.to_zarr.__doc__ or "")
    default = inspect.signature(xarray_gds.to_zarr).parameters["lock_timeout"].default
    assert default == 600.0
    for cls in (locking.FileLock, locking.ProcessLock):
        assert inspect.signature(cls.acquire).parameters["timeout"].default == 600.0


def test_releasing_a_memory_lock_not_held_gives_nothing_back() -> None:
    """locking ``self._held = False`` -> ``True`` (in ``__init__`` and in ``release``): a
    memory store's lock that was never taken, or was given back already, gives nothing
    back when released, so the writer that holds the lock keeps it."""
    from zarr.storage import MemoryStore

    from xarray_gds.stores import lock as locking

    store = MemoryStore()
    first = _writer_lock(store)
    first.release()
    first.release()  # a second release: nothing
    holder = _writer_lock(store, timeout=0)
    try:
        locking.ProcessLock(str(store), store).release()  # never taken: nothing
        first.release()
        with pytest.raises(TimeoutError, match="being written by another writer"):
            _writer_lock(store, timeout=0)
    finally:
        holder.release()
    _writer_lock(store, timeout=0).release()


def test_lock_file_mode_follows_the_umask(tmp_path: Path) -> None:
    """locking ``0o666`` -> ``437`` (the lock file's mode): the file is made readable and
    writable by everyone the umask lets, as other files of the store are."""
    import os
    import stat

    from zarr.storage import LocalStore

    from xarray_gds.stores.lock import lock_path

    umask = os.umask(0o022)
    os.umask(umask)
    root = tmp_path / "s.zarr"
    held = _writer_lock(LocalStore(root))
    try:
        assert stat.S_IMODE(lock_path(root).stat().st_mode) == 0o666 & ~umask
    finally:
        held.release()
    assert not lock_path(root).exists()


def test_a_lock_file_that_cannot_be_made_warns_and_writes(tmp_path: Path) -> None:
    """locking ``except OSError`` -> another exception, and the warning's ``stacklevel``: a
    lock file that cannot be opened (a directory stands at its path) warns, naming it,
    at the line that asked for the lock, and the write goes on without the lock, writing
    what engine="zarr" reads back as the dataset written."""
    import inspect
    import warnings

    from zarr.storage import LocalStore

    import xarray_gds
    from xarray_gds.errors import WriterLockWarning
    from xarray_gds.stores.lock import lock_path

    root = tmp_path / "s.zarr"
    lock_path(root).mkdir(parents=True)
    with pytest.warns(WriterLockWarning, match="cannot make the writer lock file") as caught:
        _writer_lock(LocalStore(root)).release()
    (warning,) = caught
    assert str(lock_path(root)) in str(warning.message)
    assert warning.filename == __file__, warning.filename
    ds = xr.Dataset({"v": (("a",), np.arange(6.0))})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", WriterLockWarning)
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        xarray_gds.to_zarr(ds, root, mode="w")
    # at the user's line, in the package's category (a RuntimeWarning too)
    (warning,) = [w for w in caught if w.category is WriterLockWarning]
    assert (warning.filename, warning.lineno) == (__file__, line)
    assert issubclass(WriterLockWarning, RuntimeWarning | xarray_gds.XarrayGdsWarning)
    xr.testing.assert_identical(xr.open_dataset(root, engine="zarr").load(), ds)


def test_a_file_lock_waiter_polls_from_1_ms_doubling_up_to_50_ms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """locking ``delay if left is None else ...`` -> ``delay if not left is None ...`` and
    the backoff ``min(2 * delay, 0.05)`` (-> ``1 * delay``, -> ``1.05``): a writer that
    waits for a local store's lock (with no time limit, or with one) polls after 1 ms,
    then twice as long each time up to 50 ms, and takes the
    lock once the holder gives it back."""
    from zarr.storage import LocalStore

    from xarray_gds.stores import lock as locking

    store = LocalStore(tmp_path / "s.zarr")
    for timeout in (None, 30.0):
        holder = _writer_lock(store)
        slept: list[float] = []

        def sleep(seconds: float, holder: Any = holder, slept: list[float] = slept) -> None:
            slept.append(seconds)
            if len(slept) == 9:
                holder.release()  # the waiter takes it at its next try

        monkeypatch.setattr(locking.time, "sleep", sleep)
        waiter = _bounded(lambda timeout=timeout: _writer_lock(store, timeout))
        waiter.release()
        monkeypatch.undo()
        assert slept == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05], timeout


def test_a_memory_lock_waits_as_long_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """locking ``timeout=-1 if timeout is None`` -> ``- 0``, and ``max(0.0, timeout)`` ->
    ``max(-1.0, timeout)``: a memory store's lock is waited for without a bound for
    ``timeout=None``, for ``timeout`` seconds, and not at all for a negative one (which
    fails at once when the lock is held)."""
    from zarr.storage import MemoryStore

    from xarray_gds.stores import lock as locking

    store = MemoryStore()
    key = str(store)
    _writer_lock(store).release()  # the store's lock exists
    real = locking._memory_locks[key]
    asked: list[float] = []

    class Spy:
        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            asked.append(timeout)
            return real.acquire(blocking, timeout)

        def release(self) -> None:
            real.release()

    monkeypatch.setitem(locking._memory_locks, key, Spy())
    for timeout in (None, 2.5, -3.0):
        _writer_lock(store, timeout).release()
    assert asked == [-1, 2.5, 0.0]
    holder = _writer_lock(store)
    try:
        with pytest.raises(TimeoutError, match="being written by another writer"):
            _bounded(lambda: _writer_lock(store, -3.0))
    finally:
        holder.release()


# -- stores/urls.py -------------------------------------------------------------------------
def _certificate_error() -> ssl.SSLCertVerificationError:
    return ssl.SSLCertVerificationError(
        1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"
    )


def _raised_from_certificate_error() -> OSError:
    """An ``OSError`` whose ``__cause__`` is the failed certificate check (``raise ...
    from``, outside any ``except``: no ``__context__``)."""
    cause = _certificate_error()
    try:
        raise OSError("Cannot connect to host 127.0.0.1:1 ssl:True") from cause
    except OSError as err:
        return err


def _raised_while_handling_certificate_error() -> OSError:
    """An ``OSError`` raised while the failed certificate check was handled (no
    ``from``): the check is only its ``__context__``."""
    try:
        try:
            raise _certificate_error()
        except ssl.SSLError:
            raise OSError("Cannot connect to host 127.0.0.1:1 ssl:True")  # noqa: B904
    except OSError as err:
        return err


@pytest.mark.parametrize(
    "make", [_raised_from_certificate_error, _raised_while_handling_certificate_error]
)
def test_a_certificate_error_down_the_chain_says_the_certificate_is_not_trusted(make) -> None:
    """urls ``err.__cause__ or err.__context__`` -> either one alone (and
    ``isinstance(err, ssl.SSLCertVerificationError)`` dropped): an error whose
    ``__cause__`` or ``__context__`` is a failed TLS certificate check is classified
    as an untrusted certificate, for opening and for writing; an ``OSError`` with no
    such error down its chain is not."""
    from xarray_gds.stores.urls import classified

    err = make()
    chain = (err.__cause__, err.__context__)
    assert sum(isinstance(e, ssl.SSLCertVerificationError) for e in chain) >= 1
    url = "https://127.0.0.1:1/data.zarr"
    for action in ("open", "write to"):
        found = classified(url, {}, err, action=action)
        assert type(found) is ConnectionError
        assert str(found).startswith(f"cannot {action} the remote Zarr store {url!r}: ")
        assert "the server's TLS certificate is not trusted" in str(found)
    plain = classified(url, {}, OSError("Cannot connect to host 127.0.0.1:1 ssl:True"))
    assert type(plain) is OSError
    assert "reading its metadata failed" in str(plain)
    assert "TLS certificate" not in str(plain)


# -- tidy.py --------------------------------------------------------------------------------
#: layout -> (zarr format, chunk key encoding, consolidated, key of chunk (5, 0), of (0, 0))
TIDY_LAYOUTS: dict[str, tuple[int, dict[str, str] | None, bool, str, str]] = {
    "v2-dot": (2, None, True, "5.0", "0.0"),
    "v2-slash": (2, {"name": "v2", "separator": "/"}, True, "5/0", "0/0"),
    "v3": (3, None, True, "c/5/0", "c/0/0"),
    "v3-v2-keys": (3, {"name": "v2", "separator": "."}, True, "5.0", "0.0"),
    "v3-unconsolidated": (3, None, False, "c/5/0", "c/0/0"),
}


@pytest.mark.parametrize("layout", list(TIDY_LAYOUTS))
def test_tidy_in_every_key_layout(tmp_path: Path, layout: str) -> None:
    """tidy ``.zmetadata`` read only when it is a dict (``not isinstance`` / ``or``), the
    ``chunk_key_encoding`` of v3 arrays (``or`` -> ``and``), v2 groups' ``.zgroup`` as
    nodes (``_V2[:2]`` -> ``_V2[:1]``), leftovers hashable (``frozen=False``) and
    ``tidy``'s keyword-only arguments (``*`` -> ``/``): in v2 stores (``.`` and ``/`` keys),
    v3 stores (default and v2 keys) and a v3 store never consolidated, an orphan chunk, a
    new array's chunks without metadata and (consolidated) a document ahead of the
    consolidated metadata are found, exactly, and removed or put back; the store then
    reads as engine="zarr" read it before."""
    import dataclasses
    import json

    from xarray_gds.tidy import find_leftovers, tidy

    zarr_format, keys, consolidated, orphan, first = TIDY_LAYOUTS[layout]
    root = tmp_path / "s.zarr"
    group = zarr.open_group(root, mode="w", zarr_format=zarr_format)
    for name in ("a", "b"):
        kwargs: dict[str, Any] = {"chunk_key_encoding": keys} if keys else {}
        if zarr_format == 2:
            kwargs["attributes"] = {"_ARRAY_DIMENSIONS": ["y", "x"]}
        else:
            kwargs["dimension_names"] = ["y", "x"]
        array = group.create_array(name, shape=(2, 4), chunks=(1, 4), dtype="f4", **kwargs)
        array[:] = np.arange(8, dtype="f4").reshape(2, 4)
    if consolidated:
        zarr.consolidate_metadata(root)
    before = xr.open_dataset(root, engine="zarr").load()
    (root / "a" / orphan).parent.mkdir(parents=True, exist_ok=True)
    (root / "a" / orphan).write_bytes((root / "a" / first).read_bytes())
    (root / "new" / first).parent.mkdir(parents=True)
    (root / "new" / first).write_bytes(b"chunk")
    want = {(f"a/{orphan}", "orphan-chunk"), ("new", "unpublished-node")}
    if consolidated:
        doc_key = "b/zarr.json" if zarr_format == 3 else "b/.zarray"
        doc = json.loads((root / doc_key).read_text())
        doc["shape"] = [3, 4]
        (root / doc_key).write_text(json.dumps(doc))
        want.add((doc_key, "metadata-ahead"))
    found = find_leftovers(root, trust_consolidated=True)
    assert {(f.path, f.kind) for f in found} == want
    assert len(set(found)) == len(found)  # leftovers are hashable values
    with pytest.raises(dataclasses.FrozenInstanceError):
        found[0].kind = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        tidy(root, True)  # type: ignore[misc]  # dry_run is keyword-only
    acted = tidy(store=root, dry_run=False, trust_consolidated=True)
    assert {(f.path, f.kind) for f in acted} == want
    assert find_leftovers(root, trust_consolidated=True) == []
    xr.testing.assert_identical(xr.open_dataset(root, engine="zarr").load(), before)


# -- write.py -------------------------------------------------------------------------------
@pytest.mark.needs("dask")
def test_a_users_dask_region_write_across_chunks_is_refused_as_xarray_refuses(
    tmp_path: Path,
) -> None:
    """write ``for name, var in ds.variables.items()`` -> ``in []``, ``if name in ds.indexes
    or ...`` -> ``if not name in ...`` and ``var.ndim == 0`` -> ``var.ndim >= 0``: the
    user's own dask variables are seen as such, so xarray's check of dask chunks against
    zarr chunks stays on (``safe_chunks``): a region write whose dask chunks would share
    a zarr chunk fails with xarray's error, and the store keeps what engine="zarr" reads
    there before, as with ``Dataset.to_zarr``."""
    import xarray_gds

    ds = xr.Dataset({"v": (("a",), np.arange(8.0))})
    part = ds.isel(a=slice(2, 6)).chunk({"a": 2}) * 10
    stores = {}
    for name, write in (("ours", xarray_gds.to_zarr), ("xarray", None)):
        root = tmp_path / f"{name}.zarr"
        ds.to_zarr(root, encoding={"v": {"chunks": (4,)}}, consolidated=False)
        with pytest.raises(ValueError, match="would overlap multiple Dask chunks"):
            if write is None:
                part.to_zarr(root, region={"a": slice(2, 6)}, consolidated=False)
            else:
                write(part, root, region={"a": slice(2, 6)}, consolidated=False)
        stores[name] = xr.open_dataset(root, engine="zarr", consolidated=False).load()
    xr.testing.assert_identical(stores["ours"], stores["xarray"])
    xr.testing.assert_identical(stores["ours"], ds)


@pytest.mark.needs("dask")
def test_a_users_dask_chunks_across_zarr_chunks_are_refused_as_xarray_refuses(
    tmp_path: Path,
) -> None:
    """write ``if not user_dask:`` -> ``if True:`` (and ``user_dask = True`` -> ``False``):
    ``safe_chunks`` is left to xarray for the user's own dask variables, so a whole-array
    write whose dask chunks (3) share zarr chunks (4) fails with the error that
    ``Dataset.to_zarr`` raises, word for word."""
    import xarray_gds

    ds = xr.Dataset({"v": (("x",), np.arange(12.0))}).chunk(x=3)
    encoding = {"v": {"chunks": (4,)}}
    with pytest.raises(ValueError, match="would overlap multiple Dask chunks") as theirs:
        ds.to_zarr(tmp_path / "xarray.zarr", encoding=encoding)
    with pytest.raises(ValueError, match="would overlap multiple Dask chunks") as ours:
        xarray_gds.to_zarr(ds, tmp_path / "ours.zarr", encoding=encoding)
    assert str(ours.value) == str(theirs.value)
    assert "variable named 'v'" in str(ours.value)


# -- store.py -------------------------------------------------------------------------------
def test_clearing_a_store_whose_directories_do_not_exist_yet_makes_them(
    tmp_path: Path,
) -> None:
    """stores/local ``self.root.mkdir(parents=True, ...)`` -> ``parents=False`` (``clear``):
    clearing a store at a path whose parent directories do not exist yet leaves an
    empty store there, which takes writes that engine="zarr" reads."""
    from zarr.core.sync import sync

    from xarray_gds.stores.local import GdsStore

    root = tmp_path / "not" / "yet" / "s.zarr"
    store = GdsStore(root, read_only=False)
    sync(store.clear())
    assert root.is_dir() and list(root.iterdir()) == []
    ds = xr.Dataset({"v": (("x",), np.arange(5.0))})
    ds.to_zarr(store, consolidated=False)
    xr.testing.assert_identical(xr.open_dataset(root, engine="zarr").load(), ds)


def test_store_methods_take_arguments_as_zarrs_local_store_does() -> None:
    """store ``*`` -> ``/`` in ``get_sync`` and ``_open``: the engine's store keeps the kinds
    of parameters of zarr's ``LocalStore`` (keyword-only where zarr's are), so that every
    call zarr makes of a local store works on it."""
    import inspect

    from zarr.storage import LocalStore

    from xarray_gds import GdsStore

    for name in ("get_sync", "_open", "get", "get_partial_values", "set", "delete_dir"):
        ours = inspect.signature(getattr(GdsStore, name)).parameters
        theirs = inspect.signature(getattr(LocalStore, name)).parameters
        assert [(p.name, p.kind) for p in ours.values()] == [
            (p.name, p.kind) for p in theirs.values()
        ], name


async def test_writes_and_deletes_through_a_link_at_any_level_are_refused(tmp_path: Path) -> None:
    """store ``key.split("/")[:-1]`` -> ``[:-2]`` (``set``, ``delete_sync``), -> ``[:-0]``
    (``set_if_not_exists``) and prefix ``[:-1]`` -> ``[:not 1]`` (``delete_dir``): a
    chunk's own directory linked out of the root, or its array's, refuses writes,
    conditional writes, deletes and deletes of a tree through it, and the files outside
    stay."""
    import shutil

    from zarr.core.buffer import cpu

    from xarray_gds import GdsStore

    outside = tmp_path / "outside"
    (outside / "c").mkdir(parents=True)
    (outside / "c" / "0").write_bytes(b"kept")
    root = tmp_path / "s.zarr"
    store = await GdsStore.open(root, read_only=False)
    await store.set("v/zarr.json", cpu.Buffer.from_bytes(b"{}"))
    value = cpu.Buffer.from_bytes(b"chunk")
    for link, target in (("v/c", outside / "c"), ("v", outside)):
        if (root / "v").is_symlink():
            (root / "v").unlink()
        shutil.rmtree(root / "v", ignore_errors=True)
        (root / link).parent.mkdir(parents=True, exist_ok=True)
        (root / link).symlink_to(target, target_is_directory=True)
        with pytest.raises(ValueError, match="is a symbolic link"):
            await store.set("v/c/1", value)
        with pytest.raises(ValueError, match="is a symbolic link"):
            await store.set_if_not_exists("v/c/2", value)
        with pytest.raises(ValueError, match="is a symbolic link"):
            store.delete_sync("v/c/0")
        with pytest.raises(ValueError, match="is a symbolic link"):
            await store.delete_dir("v/c" if link == "v" else "v/c/0")
        assert sorted(p.name for p in (outside / "c").iterdir()) == ["0"], link
        assert (outside / "c" / "0").read_bytes() == b"kept"


@pytest.mark.parametrize("kind", ["gds", "zarr"])
def test_a_failed_writes_clean_up_removes_empty_directories_below_the_root_only(
    tmp_path: Path, kind: str
) -> None:
    """stores/local ``range(1, len(parts) + 1)`` -> ``range(0, ...)`` (``_remove_empty_dirs``):
    the clean-up of a local store after a failed write (``after_failed_write`` of the
    chunks it removed) removes the directories those chunks leave empty, deepest first,
    keeps those that hold anything else, and never the store's root, even when it is
    left empty (the root is where the next write of the store goes; a v2 array at the
    root has its chunks there)."""
    from zarr.storage import LocalStore

    from xarray_gds import stores
    from xarray_gds.stores.local import GdsStore

    root = tmp_path / "s.zarr"
    (root / "p" / "c" / "0").mkdir(parents=True)
    (root / "q" / "c").mkdir(parents=True)
    (root / "q" / "c" / "0").write_bytes(b"kept")
    store = GdsStore(root, read_only=False) if kind == "gds" else LocalStore(root)
    source = stores.source_for(store)
    source.after_failed_write({"p/c/0/1", "q/c/1", "top"})
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "q",
        "q/c",
        "q/c/0",
    ]
    (root / "q" / "c" / "0").unlink()
    source.after_failed_write({"q/c/0"})
    assert root.is_dir() and list(root.iterdir()) == []
    source.after_failed_write({"0"})  # the chunk of a v2 array at the store's root
    assert root.is_dir() and list(root.iterdir()) == []


# -- deferred.py ----------------------------------------------------------------------------
@pytest.mark.needs("fsspec")
def test_a_failed_write_keeps_chunks_of_existing_arrays_below_new_group_documents() -> None:
    """deferred ``return False`` -> ``return True`` (``.zattrs``/``.zgroup`` taken for an
    array's metadata): a failed write that made a new group document (the root's
    ``.zattrs``, missing from a store zarr-python made) and added a chunk to an existing
    v2 array keeps that chunk, as it keeps every chunk of arrays that existed before; it
    removes only the new documents' held state and the new arrays' chunks."""
    from zarr.storage import FsspecStore

    from tests.test_deferred import _buffer, _keys
    from xarray_gds.deferred import HeldMetadataStore, sync

    inner = FsspecStore.from_url(f"memory://held-groups-{id(object())}", read_only=False)
    sync(inner.set(".zgroup", _buffer(b'{"zarr_format": 2}')))
    sync(inner.set("q/.zarray", _buffer(b'{"zarr_format": 2, "shape": [8]}')))
    sync(inner.set("q/0", _buffer(b"old")))
    store = HeldMetadataStore(inner)
    sync(store.set(".zattrs", _buffer(b'{"title": "new"}')))
    sync(store.set("g/.zgroup", _buffer(b'{"zarr_format": 2}')))
    sync(store.set("q/1", _buffer(b"more")))
    store.discard()
    assert _keys(inner) == [".zgroup", "q/.zarray", "q/0", "q/1"]


def test_after_a_failed_metadata_flush_later_chunk_writes_are_refused() -> None:
    """deferred ``write.failed = True`` -> ``False`` (when writing the held metadata fails):
    the write has failed, so a chunk write of it that comes later is refused, naming
    the key, and writes nothing, as after a discard."""
    from zarr.storage import MemoryStore

    from tests.test_deferred import ARRAY_META, _buffer, _keys
    from xarray_gds.deferred import HeldMetadataStore, sync

    class Failing(MemoryStore):
        async def set(self, key: str, value: Any) -> None:
            if key.endswith("zarr.json"):
                raise OSError("metadata write failed")
            await super().set(key, value)

    inner = Failing()
    store = HeldMetadataStore(inner)
    sync(store.set("p/zarr.json", _buffer(ARRAY_META)))
    sync(store.set("p/c/0", _buffer(b"early")))
    with pytest.raises(OSError, match="metadata write failed"):
        store.flush()
    with pytest.raises(RuntimeError, match=r"not writing 'p/c/1' .* failed"):
        sync(store.set("p/c/1", _buffer(b"later")))
    assert _keys(inner) == []


def test_partial_reads_of_held_metadata_only_are_served_from_what_is_held() -> None:
    """deferred ``self._held(k) is not None`` -> ``is None`` (``get_partial_values``): byte
    ranges of held documents alone are served from what is held (not from the store
    below, where they are older or missing), as are those of held and stored keys
    mixed."""
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import MemoryStore

    from tests.test_deferred import ARRAY_META, _buffer
    from xarray_gds.deferred import HeldMetadataStore, sync

    inner = MemoryStore()
    sync(inner.set("q/zarr.json", _buffer(b'{"old": 1}')))
    sync(inner.set("q/c/0", _buffer(b"chunk")))
    store = HeldMetadataStore(inner)
    sync(store.set("p/zarr.json", _buffer(ARRAY_META)))
    sync(store.set("q/zarr.json", _buffer(ARRAY_META)))
    proto = default_buffer_prototype()
    for asked, want in (
        (
            [("p/zarr.json", None), ("q/zarr.json", RangeByteRequest(2, 13))],
            [ARRAY_META, ARRAY_META[2:13]],
        ),
        ([("q/zarr.json", None), ("q/c/0", RangeByteRequest(1, 3))], [ARRAY_META, b"hu"]),
    ):
        got = sync(store.get_partial_values(proto, asked))
        assert [g.to_bytes() for g in got] == want
    store.discard()


def test_a_dict_target_is_written_as_xarray_writes_it_and_others_are_refused() -> None:
    """write ``isinstance(store, dict)`` -> ``not isinstance(...)``: a dict is a memory
    store of its own keys, written with the keys and bytes ``Dataset.to_zarr`` writes
    into a dict; a target of no kind the function takes is refused, naming the kinds."""
    import xarray_gds

    ds = xr.Dataset({"v": (("a",), np.arange(6.0))})
    ours: dict[str, Any] = {}
    theirs: dict[str, Any] = {}
    xarray_gds.to_zarr(ds, ours, encoding={"v": {"chunks": (4,)}}, consolidated=False)
    ds.to_zarr(theirs, encoding={"v": {"chunks": (4,)}}, consolidated=False)
    assert sorted(ours) == sorted(theirs) and ours
    got = {k: v.to_bytes() for k, v in ours.items() if not k.endswith("zarr.json")}
    assert got == {k: v.to_bytes() for k, v in theirs.items() if not k.endswith("zarr.json")}
    with pytest.raises(TypeError, match="must be a path, a URL, a zarr Store"):
        xarray_gds.to_zarr(ds, 42)


def test_chunk_paths_refuse_keys_that_leave_the_root(tmp_path: Path) -> None:
    """store ``for key in keys`` -> ``for key in []`` (``chunk_paths``): the files of the
    engine's batched chunk reads are checked as ``resolve`` checks keys: one that would
    leave the store's root is refused, whichever of the keys it is."""
    from xarray_gds import GdsStore

    store = GdsStore(tmp_path / "s.zarr", read_only=True)
    assert store.chunk_paths(["v/c/0", "v/c/1"]) == [
        f"{tmp_path / 's.zarr'}/v/c/0",
        f"{tmp_path / 's.zarr'}/v/c/1",
    ]
    for bad in ("../other/c/0", "v/../../x", "/etc/passwd"):
        with pytest.raises(ValueError, match="invalid key"):
            store.chunk_paths(["v/c/0", bad])


@pytest.mark.parametrize(
    ("shape", "chunks", "rows"),
    [((24, 6), (3, 6), slice(None)), ((30, 8), (4, 3), slice(5, 29)), ((26, 5, 4), (5, 2, 4), 7)],
)
def test_box_reads_of_many_rows_of_tall_chunks(
    tmp_path: Path, shape: tuple[int, ...], chunks: tuple[int, ...], rows: Any
) -> None:
    """region ``origin[0] + grid[0] * cs[0]`` -> ``origin[0] + grid[0] + cs[0]``: a host box
    read of four rows of chunks or more (placed as one tiling of the block), chunks
    several rows tall, reads every row as engine="zarr" does."""
    values = np.arange(np.prod(shape), dtype="f4").reshape(shape)
    dims = [f"d{i}" for i in range(len(shape))]
    path = tmp_path / "tall.zarr"
    xr.Dataset({"v": (dims, values)}).to_zarr(path, encoding={"v": {"chunks": chunks}})
    gds, ref = open_both(path, "cpu")
    sel = {"d0": rows} if not isinstance(rows, int) else {"d1": slice(1, None)}
    xr.testing.assert_identical(gds.v.isel(sel).load(), ref.v.isel(sel).load())


# -- sources.py -----------------------------------------------------------------------------
@pytest.mark.needs("aiohttp")  # engine="zarr" reads URLs through fsspec's HTTP
def test_whole_chunk_objects_over_http_on_the_host(tmp_path: Path, v3_store: Path) -> None:
    """sources ``if not on_device`` -> ``if not not on_device`` (``RemoteSource.read_all``):
    unsharded chunks of a store served over HTTP, each a whole object, read on the host
    as engine="zarr" reads them."""
    import shutil

    from tests._http import serve

    root = tmp_path / "served"
    shutil.copytree(v3_store, root / "s.zarr")
    with serve(root) as url:
        gds, ref = open_both(f"{url}/s.zarr", "cpu")
        xr.testing.assert_identical(gds.load(), ref.load())


@pytest.mark.needs("fsspec")
@pytest.mark.filterwarnings("ignore::zarr.errors.UnstableSpecificationWarning")
def test_references_to_a_sharded_v3_store(tmp_path: Path) -> None:
    """sources ``None if ref is None else narrow(...)`` -> ``None if not ref is None ...``
    (``ReferenceSource.read_ranges_all``): references to the shard files of a v3 store
    read each inner chunk by its byte range of the referenced file, missing ones as the
    fill value, as engine="zarr" reads the store itself."""
    from tests.test_layouts import _references, _sharded

    root = _sharded(tmp_path / "s.zarr", "end", True)
    got = xr.open_dataset(_references(root), engine="gds-zarr", device="cpu").load()
    xr.testing.assert_identical(got, xr.open_dataset(root, engine="zarr").load())


@pytest.mark.parametrize("ranged", [False, True])
def test_a_batch_of_two_store_kinds_reads_each_through_its_own_kind(
    tmp_path: Path, ranged: bool
) -> None:
    """stores ``if len(classes) == 1`` -> ``if not len(classes) == 1`` (``stores.read``): a
    batch whose chunks lie in a local directory and in a memory store, interleaved, is
    read by each kind's reader (paths by the local one, keys through the memory store's
    ``get``), whole or by byte ranges, and joined in the batch's order: each chunk's
    bytes as zarr-python reads them from its own store."""
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync
    from zarr.storage import MemoryStore

    from xarray_gds import stores
    from xarray_gds.stores.local import GdsStore

    local = GdsStore(tmp_path / "s.zarr", read_only=False)
    memory = MemoryStore()
    rng = np.random.default_rng(7)
    keys = [f"v/c/{i}" for i in range(4)]
    for store in (local, memory):
        for key in keys:
            data = rng.integers(0, 256, size=40, dtype=np.uint8).tobytes()
            sync(store.set(key, cpu.Buffer.from_bytes(data)))
    kinds = [stores.source_for(local), stores.source_for(memory)]
    assert len({type(s) for s in kinds}) == 2
    order = [(kinds[i % 2], keys[i // 2 + 2 * (i % 2)]) for i in range(4)]
    picked = [s for s, _ in order]
    locations = [s.locate([k])[0] for s, k in order]
    want = [sync(s.store.get(k, prototype=cpu.buffer_prototype)).to_bytes() for s, k in order]
    if ranged:
        starts = np.array([3, 0, 10, 39], dtype=np.int64)
        sizes = np.array([5, 40, 20, 1], dtype=np.int64)
        got = stores.read(picked, locations, False, None, (starts, sizes))
        want = [w[int(a) : int(a) + int(n)] for w, a, n in zip(want, starts, sizes, strict=True)]
    else:
        got = stores.read(picked, locations, False, None)
    assert [np.asarray(g).tobytes() for g in got] == want


# -- entries.py -----------------------------------------------------------------------------
def _tile_entries(
    cells: list[tuple[int, ...]], chunk: tuple[int, ...], complete: bool = True
) -> list[Any]:
    """zarr's batch entries of whole chunks at grid ``cells``: the first one's selection
    starts at None and the others' alternate between step None and step 1, as zarr's
    indexing makes them."""
    entries = []
    for k, cell in enumerate(cells):
        out = tuple(
            slice(None if k == 0 and i * c == 0 else i * c, (i + 1) * c, 1 if k % 2 else None)
            for i, c in zip(cell, chunk, strict=True)
        )
        entries.append((None, None, (), out, complete))
    return entries


def test_whole_tiling_exactly_when_whole_chunks_tile_the_output() -> None:
    """entries ``whole_tiling``, every condition and term: the tiling of whole chunks
    that cover the output once each (its grid, the whole output as window and crop, the
    chunks' order when not C order), and None for each batch that does not qualify;
    chunks placed by the tiling give the array they were cut from."""
    from xarray_gds import entries
    from xarray_gds.place import place

    chunk = (2, 3)
    whole = np.arange(4 * 9).reshape(4, 9)
    full = (slice(0, 4), slice(0, 9))

    def tiled(cells: list[tuple[int, ...]], shape: tuple[int, ...] = (4, 9), **kw: Any) -> Any:
        batch = kw.pop("batch", None) or _tile_entries(cells, kw.pop("chunk", chunk))
        return entries.whole_tiling(
            np.zeros(shape), kw.pop("chunk_shape", chunk), batch, kw.pop("drop", ())
        )

    c_order = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    tiling = tiled(c_order)
    assert tiling is not None
    assert (tiling.grid, tiling.window, tiling.crop, tiling.order) == ((2, 3), full, full, None)
    assert all(type(g) is int for g in tiling.grid)
    shuffled = [(1, 2), (0, 0), (1, 0), (0, 2), (0, 1), (1, 1)]
    tiling = tiled(shuffled)
    assert tiling is not None and (tiling.grid, tiling.window, tiling.crop) == ((2, 3), full, full)
    assert tiling.order is not None and tiling.order.tolist() == [5, 0, 3, 2, 1, 4]
    for cells, shape in (([(0, 0), (0, 1)], (2, 6)), ([(0, 0), (1, 0)], (4, 3))):
        two = tiled(cells, shape)  # two chunks are enough
        assert two is not None and two.order is None
        assert two.grid == tuple(s // c for s, c in zip(shape, chunk, strict=True))
    rotated = [(0, 2), (0, 0), (0, 1)]  # each step back or one forward: still not C order
    assert tiled(rotated, (2, 9)).order.tolist() == [2, 0, 1]
    many = [(r, c) for r in range(18) for c in range(18)]  # 324 chunks: more than 256
    assert tiled(many, (18, 18), chunk=(1, 1), chunk_shape=(1, 1)).grid == (18, 18)
    for cells, tiling in ((c_order, tiled(c_order)), (shuffled, tiled(shuffled))):
        batch = _tile_entries(cells, chunk)
        stack = np.stack([whole[e[3]] for e in batch])
        target = np.zeros_like(whole)
        n = len(batch)
        place(
            target,
            stack,
            list(range(n)),
            n,
            lambda k, b=batch: (b[k][3], ()),
            0,
            False,
            tiling=tiling,
        )
        np.testing.assert_array_equal(target, whole)

    # batches that do not qualify
    assert tiled(c_order, drop=(0,)) is None  # an axis dropped
    assert tiled([(0, 0)], (2, 3)) is None  # one chunk: nothing to tile
    assert tiled([], batch=_tile_entries(c_order, chunk, complete=False)) is None
    assert tiled(c_order, chunk_shape=(2, 3, 1)) is None  # chunks of other dimensions
    assert tiled(c_order, chunk_shape=(2,)) is None
    stepped = _tile_entries(c_order, chunk)
    stepped[3] = (None, None, (), (slice(2, 6, 2), slice(0, 3)), True)
    assert tiled([], batch=stepped) is None  # a strided selection
    points = _tile_entries(c_order, chunk)
    points[3] = (None, None, (), (np.array([2, 3]), slice(0, 3)), True)
    assert tiled([], batch=points) is None  # a points selection
    shifted = [
        (None, None, (), (slice(r * 2 + 1, r * 2 + 3), slice(c * 3, c * 3 + 3)), True)
        for r, c in c_order
    ]
    assert tiled([], (5, 9), batch=shifted) is None  # chunks off the grid
    off = _tile_entries(c_order, chunk)
    off[1] = (None, None, (), (slice(0, 2), slice(4, 7)), True)
    assert tiled([], batch=off) is None  # one chunk off the grid
    assert tiled([(0, 0), (0, 1), (1, 0)], (4, 6)) is None  # a gap in the grid
    square = [(0, 0), (0, 1), (1, 0), (1, 1)]  # chunks of two dimensions, a shape of one
    assert tiled(square, (2, 2), chunk=(1, 1), chunk_shape=(1,)) is None
    assert tiled(c_order, (4, 10)) is None  # the grid smaller than the output
    assert tiled(c_order, (4, 8)) is None
    assert tiled([(0, 0), (0, 0), (1, 0), (1, 1)], (4, 6)) is None  # a chunk twice


def _grid_store(path: Path, shards: tuple[int, int] | None) -> Path:
    """A v3 store of ``v`` (8 x 12 float64, 0..95) in chunks of 2 x 3, in shards of
    ``shards`` when given."""
    encoding: dict[str, Any] = {"chunks": (2, 3)}
    if shards is not None:
        encoding["shards"] = shards
    values = np.arange(8 * 12, dtype="f8").reshape(8, 12)
    xr.Dataset({"v": (("r", "c"), values)}).to_zarr(path, zarr_format=3, encoding={"v": encoding})
    return path


@pytest.mark.parametrize("shards", [None, (4, 6)], ids=["chunks", "shards"])
def test_missing_chunks_are_errors_when_zarr_is_told_so(
    tmp_path: Path, shards: tuple[int, int] | None
) -> None:
    """entries ``GetResult(status="present" if i in found else "missing")`` (its status
    negated or dropped), and shards' the same: with zarr's ``array.read_missing_chunks``
    off, a read that meets a missing chunk (or shard) fails as engine="zarr" fails, naming
    the same chunk, and a read of chunks all present gives zarr's values."""
    path = _grid_store(tmp_path / "gaps.zarr", shards)
    gone = "v/c/1/1"  # a chunk, or the shard of rows 4-7, columns 6-11
    (path / gone).unlink()
    reads = {
        "all": lambda v: v,
        "points": lambda v: v.isel(r=[0, 2, 5, 7], c=[1, 4, 7, 10]),
        "present": lambda v: v.isel(r=slice(0, 2)),
        "present points": lambda v: v.isel(r=[0, 1], c=[1, 2, 4, 11]),
    }
    with zarr.config.set({"array.read_missing_chunks": False}):
        for name, pick in reads.items():
            ref = xr.open_dataset(path, engine="zarr").v
            gds = xr.open_dataset(path, engine="gds-zarr", device="cpu").v
            if name.startswith("present"):
                xr.testing.assert_identical(pick(gds).load(), pick(ref).load())
                continue
            with pytest.raises(zarr.errors.ChunkNotFoundError) as want:
                pick(ref).load()
            with pytest.raises(zarr.errors.ChunkNotFoundError) as got:
                pick(gds).load()
            assert str(got.value) == str(want.value)
            assert "'c/1/1'" in str(got.value)


def test_a_device_batch_is_tiled_in_one_copy_only_when_every_chunk_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """entries ``on_device and present and len(present) == len(batch)`` (its comparison
    changed, a ``len`` dropped) and ``target = out.as_ndarray_like()`` -> ``out``: with
    numpy standing in for CuPy, a device batch of whole chunks all present (also one of
    more than 256) is placed with one tiling, one with a chunk missing chunk by chunk
    (the fill value where it is missing), a host batch never tiled; the output is the
    chunks' array either way."""
    import types

    from zarr.core.buffer import cpu

    from xarray_gds import device as _device
    from xarray_gds import entries

    monkeypatch.setattr(_device, "cupy", lambda: np)
    tried: list[bool] = []
    real = entries.whole_tiling

    def spy(*args: Any) -> Any:
        done = real(*args)
        tried.append(done is not None)
        return done

    monkeypatch.setattr(entries, "whole_tiling", spy)
    placed: list[bool] = []
    real_place = entries.place

    def place_spy(*args: Any, **kw: Any) -> Any:
        placed.append(kw.get("tiling") is not None)
        return real_place(*args, **kw)

    monkeypatch.setattr(entries, "place", place_spy)
    spec = types.SimpleNamespace(fill_value=-1.0)
    for rows, cols in ((2, 3), (17, 16)):  # 6 chunks, 272
        whole = np.arange(rows * 2 * cols * 3, dtype="f8").reshape(rows * 2, cols * 3)
        cells = [(r, c) for r in range(rows) for c in range(cols)]
        batch = [(None, spec, *e[2:]) for e in _tile_entries(cells, (2, 3))]
        stack = np.stack([whole[e[3]] for e in batch])
        for on_device, present, tiled in (
            (True, list(range(len(batch))), [True]),
            (True, list(range(1, len(batch))), []),
            (False, list(range(len(batch))), []),
        ):
            tried.clear()
            placed.clear()
            out = cpu.NDBuffer.from_numpy_array(np.zeros_like(whole))
            results = entries.scatter(batch, present, stack[present], out, (), on_device)
            assert tried == tiled
            assert placed == [bool(tiled)]  # the tiling found is the one placed with
            want = whole.copy()
            if len(present) < len(batch):
                want[batch[0][3]] = -1.0
            np.testing.assert_array_equal(out.as_numpy_array(), want)
            assert [r["status"] for r in results] == [
                "present" if k in present else "missing" for k in range(len(batch))
            ]


@pytest.mark.parametrize("shards", [None, (4, 6)], ids=["chunks", "shards"])
def test_zarrs_selections_that_drop_an_axis(tmp_path: Path, shards: tuple[int, int] | None) -> None:
    """entries ``drop_axes=drop_axes`` dropped from ``place_entries``' call: zarr's
    orthogonal and coordinate selections through the engine's codec pipeline, an integer
    among index arrays (the chunks' selections keep the axis that the output drops), read
    as zarr-python reads them."""
    from xarray_gds import GdsStore
    from xarray_gds.pipeline import attach

    path = _grid_store(tmp_path / "drop.zarr", shards)
    ours = attach(zarr.open_group(GdsStore(path, read_only=True), mode="r")["v"])
    ref = zarr.open_group(path, mode="r")["v"]
    for sel in (([0, 5, 6], 4), (3, [1, 7, 11]), (np.array([1, 6]), slice(2, 9))):
        want = ref.get_orthogonal_selection(sel)
        got = ours.get_orthogonal_selection(sel)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


# -- shards.py ------------------------------------------------------------------------------
def test_zarrs_boolean_selections_of_a_sharded_array(tmp_path: Path) -> None:
    """shards ``if idx.dtype == bool`` -> ``is bool``, ``< bool``: zarr's orthogonal
    selection with a boolean mask on one axis hands each shard the mask itself (not its
    indices); through the engine's codec pipeline it reads the rows the mask picks from
    every inner chunk, as zarr-python reads them."""
    from xarray_gds import GdsStore
    from xarray_gds.pipeline import attach

    path = _grid_store(tmp_path / "mask.zarr", (4, 6))
    ours = attach(zarr.open_group(GdsStore(path, read_only=True), mode="r")["v"])
    ref = zarr.open_group(path, mode="r")["v"]
    for rows in ([6], [1, 6], [3, 7], [0, 2, 5]):  # inner chunks 0 and 1 of both shards
        mask = np.zeros(8, dtype=bool)
        mask[rows] = True
        want = ref.oindex[mask, :]
        got = ours.oindex[mask, :]
        assert got.shape == want.shape == (len(rows), 12)
        np.testing.assert_array_equal(got, want)


def test_a_shard_file_shorter_than_its_index_is_named(tmp_path: Path) -> None:
    """shards ``if raw.size != n`` -> ``if raw.size > n``: a shard file cut shorter than
    its index (index at the end or at the start, with a CRC-32C or without) fails naming
    the shard, the bytes read and the index's size, not with numpy's error about a
    buffer that does not fit the table."""
    import zarr.codecs as zc

    for location in ("end", "start"):
        for index_codecs in ([zc.BytesCodec(), zc.Crc32cCodec()], [zc.BytesCodec()]):
            path = tmp_path / f"{location}-{len(index_codecs)}.zarr"
            _sharded_grid(path, location, index_codecs)
            (path / "v" / "c" / "1" / "0").write_bytes(b"0123456789")
            expected = 4 * 16 + 4 * (len(index_codecs) - 1)  # 4 inner chunks, the CRC
            ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False)
            with pytest.raises(ChunkDecodeError) as err:
                ds.v.load()
            assert err.value.key == "v/c/1/0" and err.value.codec == "sharding_indexed"
            assert f"index of 10 bytes, expected {expected} (the shard file holds 10)" in str(
                err.value
            )


def _sharded_grid(path: Path, location: str, index_codecs: list[Any] | None = None) -> Path:
    """``v`` (8 x 12 float64, 0..95) in inner chunks of 2 x 3, shards of 4 x 6 (4 inner
    chunks each), the shard index at ``location`` (with its CRC-32C, unless
    ``index_codecs`` say otherwise)."""
    import zarr.codecs as zc

    sharding = zc.ShardingCodec(
        chunk_shape=(2, 3),
        codecs=[zc.BytesCodec(), zc.ZstdCodec()],
        index_codecs=index_codecs or [zc.BytesCodec(), zc.Crc32cCodec()],
        index_location=location,
    )
    group = zarr.open_group(path, mode="w", zarr_format=3)
    array = group.create_array(
        "v",
        shape=(8, 12),
        dtype="f8",
        chunks=(4, 6),
        serializer=sharding,
        compressors=None,
        dimension_names=["r", "c"],
    )
    array[:] = np.arange(96.0).reshape(8, 12)
    return path


def _set_index_entry(shard: Path, location: str, k: int, offset: int, nbytes: int) -> None:
    """Give inner chunk ``k`` of ``shard`` the range (``offset``, ``nbytes``) in its index
    (4 entries and a valid CRC-32C, so that only the range checks can catch it)."""
    import struct

    import google_crc32c

    raw = bytearray(shard.read_bytes())
    start = 0 if location == "start" else len(raw) - 68
    table = np.frombuffer(bytes(raw[start : start + 64]), dtype="<u8").reshape(4, 2).copy()
    table[k] = (np.uint64(offset), np.uint64(nbytes))
    raw[start : start + 64] = table.tobytes()
    raw[start + 64 : start + 68] = struct.pack("<I", google_crc32c.value(table.tobytes()))
    shard.write_bytes(bytes(raw))


@pytest.mark.parametrize("location", ["end", "start"])
def test_shard_index_ranges_of_2_62_bytes_and_more_are_named(tmp_path: Path, location: str) -> None:
    """shards ``huge = np.any(table >= np.uint64(1 << 62), axis=1)`` (``>=`` -> ``==`` or
    ``>``, the bound -> ``1 << 63`` or ``2 << 62``) and ``bad = huge | (start < lo)`` ->
    ``huge ^ (start < lo)``: an index entry whose offset and size are 2**62 or more (their
    sum past what an int64 holds) fails naming the inner chunk and the range the index
    gives it, with the index at the end or at the start of the shard, instead of a read
    of exabytes."""
    cases = [(1 << 62, 1 << 62), ((1 << 62) + 8, (1 << 62) + 8), (1 << 63, 1 << 63)]
    for n, (offset, nbytes) in enumerate(cases):
        path = _sharded_grid(tmp_path / f"{n}.zarr", location)
        _set_index_entry(path / "v" / "c" / "0" / "1", location, 1, offset, nbytes)
        ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False)
        xr.testing.assert_identical(
            ds.v.isel(c=slice(0, 6)).load(),
            xr.open_dataset(path, engine="zarr", consolidated=False).v.isel(c=slice(0, 6)).load(),
        )
        with pytest.raises(ChunkDecodeError) as err:
            ds.v.load()
        assert err.value.key == "v/c/0/1 (inner chunk (0, 1))", (offset, err.value.key)
        assert f"gives it {nbytes} bytes at offset {offset}, outside the chunk data" in str(
            err.value
        )


def test_shard_index_ranges_outside_the_chunk_data_are_named(tmp_path: Path) -> None:
    """shards ``bad = huge | (start < lo) | (start + size > hi)``: its ``|`` -> ``<<``,
    ``>>`` or ``^``, ``start < lo`` -> ``start is lo``, ``start + size`` -> ``start | size``
    or ``start ^ size``: a range that starts inside an index at the start of the shard,
    one that also ends past the file, and one that ends a byte past the chunk data (an
    offset and a size with bits in common) each fail naming the inner chunk and the
    range, where the rest of the array reads as engine="zarr" reads it."""
    import os

    for n, location in enumerate(["start", "start", "start", "end"]):
        path = _sharded_grid(tmp_path / f"{n}.zarr", location)
        shard = path / "v" / "c" / "0" / "1"
        size = os.path.getsize(shard)
        lo, hi = (68, size) if location == "start" else (0, size - 68)
        if n == 0:  # inside the index
            offset, nbytes = 0, 8
        elif n == 1:  # inside the index and past the end of the file
            offset, nbytes = 0, size + 8
        else:  # a byte past the chunk data; offset | nbytes and offset ^ nbytes inside
            offset = next(o for o in range(lo, hi) if (o | (hi + 1 - o)) <= hi)
            nbytes = hi + 1 - offset
            assert (offset ^ nbytes) <= hi < offset + nbytes
        _set_index_entry(shard, location, 1, offset, nbytes)
        ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False)
        xr.testing.assert_identical(
            ds.v.isel(c=slice(0, 6)).load(),
            xr.open_dataset(path, engine="zarr", consolidated=False).v.isel(c=slice(0, 6)).load(),
        )
        with pytest.raises(ChunkDecodeError) as err:
            ds.v.load()
        assert err.value.key == "v/c/0/1 (inner chunk (0, 1))", (n, err.value.key)
        assert (
            f"gives it {nbytes} bytes at offset {offset}, outside the chunk data (bytes {lo} "
            f"to {hi}) of the {size}-byte shard file"
        ) in str(err.value)


def test_the_first_bad_range_of_a_shard_index_is_named(tmp_path: Path) -> None:
    """shards ``j = int(np.flatnonzero(bad)[0])`` -> ``[-1]`` and ``offset, nbytes =
    int(table[j, 0]), int(table[j, 1])`` (either column taken for the other): of two
    inner chunks whose ranges lie outside the chunk data, the error names the first in
    C order, with its offset and its size each where it belongs."""
    path = _sharded_grid(tmp_path / "two.zarr", "end")
    shard = path / "v" / "c" / "1" / "0"
    _set_index_entry(shard, "end", 1, 5000, 7)
    _set_index_entry(shard, "end", 3, 9000, 11)
    ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False)
    with pytest.raises(ChunkDecodeError) as err:
        ds.v.load()
    assert err.value.key == "v/c/1/0 (inner chunk (0, 1))"
    assert "the shard index gives it 7 bytes at offset 5000, outside the chunk data" in str(
        err.value
    )


@pytest.mark.parametrize("per_part", [1, 3])
def test_a_sharded_read_in_parts_of_shards(tmp_path: Path, per_part: int) -> None:
    """shards ``found, at = indexes[at : at + len(part)], at + len(part)`` (either ``+``
    -> ``|``, ``^``, ``&``): a read of four shards in parts of one shard, or of three and
    one (a batch budget of that many shards' bytes), gives each part its own shards'
    indexes: the values engine="zarr" reads."""
    path = _sharded_grid(tmp_path / "parts.zarr", "end")
    ref = xr.open_dataset(path, engine="zarr", consolidated=False).v.load()
    with zarr.config.set({"xarray_gds.batch_bytes": per_part * 4 * 6 * 8}):
        got = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False).v
        xr.testing.assert_identical(got.load(), ref)


def test_a_shard_index_entry_half_missing_is_named(tmp_path: Path) -> None:
    """shards ``keep = ~((table[:, 0] == missing) & (table[:, 1] == missing))`` (a
    comparison -> ``is not``, ``<=``, a column for the other, ``&`` -> ``|`` or ``+``): an
    inner chunk is missing (read as the fill value) only when both its offset and its
    size are 2**64 - 1; an entry with one of them alone so fails naming the inner chunk,
    while a missing one reads as engine="zarr" reads it."""
    full = (1 << 64) - 1
    for n, (offset, nbytes) in enumerate([(8, full), (full, 8)]):
        path = _sharded_grid(tmp_path / f"{n}.zarr", "end")
        _set_index_entry(path / "v" / "c" / "0" / "1", "end", 1, offset, nbytes)
        ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False)
        with pytest.raises(ChunkDecodeError) as err:
            ds.v.load()
        assert err.value.key == "v/c/0/1 (inner chunk (0, 1))"
        assert f"gives it {nbytes} bytes at offset {offset}, outside the chunk data" in str(
            err.value
        )
    path = _sharded_grid(tmp_path / "missing.zarr", "end")
    _set_index_entry(path / "v" / "c" / "0" / "1", "end", 1, full, full)
    got = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False).v.load()
    want = xr.open_dataset(path, engine="zarr", consolidated=False).v.load()
    xr.testing.assert_identical(got, want)
    values = np.arange(96.0).reshape(8, 12)
    assert (got.values[0:2, 9:12] != values[0:2, 9:12]).all()  # the fill value there
    np.testing.assert_array_equal(got.values[:, :9], values[:, :9])


@pytest.mark.parametrize("per_part", [1, 4])
def test_reads_of_missing_shards_only(tmp_path: Path, per_part: int) -> None:
    """shards ``empty = np.zeros(0, dtype=np.int64)`` (dropped, or one element long):
    a read whose shards are all missing (the rows of a deleted shard, or a part of one
    missing shard) reads the fill value there, as engine="zarr" reads it."""
    path = _sharded_grid(tmp_path / "gone.zarr", "end")
    (path / "v" / "c" / "1" / "1").unlink()
    ref = xr.open_dataset(path, engine="zarr", consolidated=False).v
    with zarr.config.set({"xarray_gds.batch_bytes": per_part * 4 * 6 * 8}):
        ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", consolidated=False)
        for sel in ({"r": slice(4, 8), "c": slice(6, 12)}, {"r": slice(5, 7)}, {}):
            xr.testing.assert_identical(ds.v.isel(sel).load(), ref.isel(sel).load())


@pytest.mark.parametrize("rows", [slice(4, None), slice(None)], ids=["alone", "second-of-two"])
def test_a_shard_that_vanishes_while_it_is_read_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: slice
) -> None:
    """shards ``if len(present) != len(plan.sizes)`` -> ``>``, and ``set(...) -
    set(present)`` -> ``|`` (which names the part's first inner chunk): a shard file of a
    store that reads a missing object as nothing (zarr's LocalStore) deleted after its
    index was read and before its inner chunks were fails naming the first inner chunk
    that was not there, instead of reading as the fill value; read with an intact shard
    before it in the same part ("second-of-two"), the error still names the lost one."""
    from xarray_gds import shards
    from xarray_gds.pipeline import attach

    path = _sharded_grid(tmp_path / "vanish.zarr", "end")
    real = shards._shard_plan

    def plan_then_delete(chain: Any, part: list[Any], indexes: list[Any]) -> Any:
        done = real(chain, part, indexes)
        if "v/c/1/0" in [bg.path for bg, *_ in part]:
            (path / "v" / "c" / "1" / "0").unlink()
        return done

    monkeypatch.setattr(shards, "_shard_plan", plan_then_delete)
    array = attach(zarr.open_array(zarr.storage.LocalStore(path, read_only=True), path="v"))
    np.testing.assert_array_equal(array[:4], np.arange(48.0).reshape(4, 12))
    with pytest.raises(ChunkDecodeError) as err:
        array[rows, :6]
    assert err.value.key == "v/c/1/0 (inner chunk (0, 0))"
    assert "the shard vanished while it was read" in str(err.value)


class _WrongLengthRanges(zarr.storage.MemoryStore):
    """A store whose range reads come back ``extra`` bytes longer (or shorter, when
    negative) than asked for, as a server that ignores or cuts a Range request."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.extra = extra

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        from zarr.abc.store import RangeByteRequest

        if isinstance(byte_range, RangeByteRequest):
            byte_range = RangeByteRequest(byte_range.start, byte_range.end + self.extra)
        return await super().get(key, prototype, byte_range)


@pytest.mark.parametrize("extra", [-2, 3], ids=["shorter", "longer"])
def test_a_range_of_another_length_than_asked_is_an_error(extra: int) -> None:
    """stores/remote_host ``if size is not None and data.size != size`` -> ``<``, and
    ``raise ShortBody(...)`` -> ``raise "..."``: a range read of a remote store that
    comes back shorter or longer than asked for is an error naming the chunk key and
    both lengths, never data."""
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    from xarray_gds.stores.remote_host import read_host

    store = _WrongLengthRanges(extra)
    sync(store.set("v/c/0", cpu.Buffer.from_bytes(bytes(range(16)))))
    ranges = (np.array([4]), np.array([6]))
    with pytest.raises(OSError) as err:
        read_host([store], ["v/c/0"], ranges, attempts=1)
    assert type(err.value) is OSError
    message = str(err.value)
    assert "cannot read chunk 'v/c/0'" in message
    assert f"{6 + extra} of the 6 bytes asked for came" in message
    store.extra = 0
    (got,) = read_host([store], ["v/c/0"], ranges, attempts=1)
    assert got is not None and got.tolist() == list(range(4, 10))


class _Flaky(zarr.storage.MemoryStore):
    """A remote-like store (its filesystem's ``protocol``, with a secret in its storage
    options) whose first ``fails`` reads fail with a transient fault whose text holds
    the secret; each read is counted."""

    SECRET = "s3cr3t-token-value"

    def __init__(self, fails: int, protocol: Any = "https") -> None:
        super().__init__()
        import types

        self.fs = types.SimpleNamespace(protocol=protocol, storage_options={"token": self.SECRET})
        self.fails = fails
        self.reads = 0

    async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
        self.reads += 1
        if self.reads <= self.fails:
            raise ConnectionError(f"reset by peer (token={self.SECRET})")
        return await super().get(key, prototype, byte_range)


def _flaky(fails: int, protocol: Any = "https") -> _Flaky:
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    store = _Flaky(fails, protocol)
    sync(store.set("v/c/0", cpu.Buffer.from_bytes(b"chunk")))
    return store


def test_a_store_that_retries_itself_is_read_once() -> None:
    """stores/remote_host ``tries = 1 if retries_itself(...)`` -> ``2``: a read through a
    filesystem that retries transient faults itself (s3fs) is not tried again on top of
    its own tries: one read, then the error naming the chunk."""
    from xarray_gds.stores.remote_host import read_host

    store = _flaky(fails=3, protocol=("s3", "s3a"))
    with pytest.raises(ConnectionError, match=r"cannot read chunk 'v/c/0'"):
        read_host([store], ["v/c/0"], attempts=3)
    assert store.reads == 1


@pytest.fixture
def backoffs(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The backoffs remote_host waits between tries (recorded, not waited)."""
    import asyncio
    import types

    from xarray_gds.stores import remote_host

    waited: list[float] = []

    async def sleep(seconds: float) -> None:
        waited.append(seconds)

    fake = types.SimpleNamespace(**{k: getattr(asyncio, k) for k in dir(asyncio)})
    fake.sleep = sleep
    monkeypatch.setattr(remote_host, "asyncio", fake)
    return waited


@pytest.mark.parametrize(("attempts", "fails"), [(0, 0), (1, 1), (3, 2), (3, 3)])
def test_a_remote_read_is_tried_exactly_attempts_times(
    attempts: int, fails: int, backoffs: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    """stores/remote_host ``max(1, attempts)`` -> ``max(0, ...)`` / ``max(2, ...)``,
    ``range(1, tries + 1)`` -> ``range(0, ...)``, and the backoff
    ``BACKOFF[min(n, len(BACKOFF)) - 1]`` (dropped, or another index): a read that
    fails with a transient fault is tried ``attempts`` times in all (once for 0), with
    the backoffs in order between the tries, each retry logged at DEBUG with the
    store's secrets masked; it returns the bytes once a try succeeds, or raises the
    error naming the chunk after the last."""
    import logging

    from xarray_gds.stores.remote_host import read_host
    from xarray_gds.stores.urls import BACKOFF

    store = _flaky(fails)
    tries = max(1, attempts)
    caplog.set_level(logging.DEBUG, logger="xarray_gds.stores.remote")
    if fails >= tries:
        with pytest.raises(ConnectionError, match=r"cannot read chunk 'v/c/0'"):
            read_host([store], ["v/c/0"], attempts=attempts)
    else:
        (got,) = read_host([store], ["v/c/0"], attempts=attempts)
        assert got is not None and got.tobytes() == b"chunk"
    assert store.reads == min(fails + 1, tries)
    retried = min(fails, tries - 1)
    assert backoffs == [BACKOFF[min(n, len(BACKOFF)) - 1] for n in range(1, retried + 1)]
    logged = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
    assert len(logged) == retried
    for line in logged:
        assert _Flaky.SECRET not in line and "token=***" in line


def _streamed(stores: list[Any], keys: list[str], attempts: int) -> list[Any]:
    from xarray_gds.stores.remote_host import HostStream

    stream = HostStream(stores, keys)
    try:
        return [stream.get(i) for i in range(len(keys))]
    finally:
        stream.close()


@pytest.mark.parametrize("how", ["read_host", "HostStream"])
@pytest.mark.parametrize("concurrency", [2, None])
def test_remote_reads_in_flight_are_bounded_by_zarrs_concurrency(
    concurrency: int | None, how: str
) -> None:
    """stores/remote_host ``_concurrency`` (and its use by ``read_host`` and
    ``HostStream``): at most zarr's ``async.concurrency`` reads of a batch are in
    flight at once (each read here waits until that many have begun, so fewer would
    fail); with no limit set, every read of the batch is."""
    import asyncio

    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    from xarray_gds.stores.remote_host import read_host

    reader = read_host if how == "read_host" else _streamed

    keys = [f"v/c/{i}" for i in range(6)]
    limit = concurrency or len(keys)

    class Counted(zarr.storage.MemoryStore):
        now = 0
        most = 0
        full: asyncio.Event | None = None

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if self.full is None:
                type(self).full = asyncio.Event()
            assert self.full is not None
            type(self).now += 1
            type(self).most = max(self.most, self.now)
            if self.now >= limit:
                self.full.set()
            await asyncio.wait_for(self.full.wait(), 10)
            await asyncio.sleep(0)
            type(self).now -= 1
            return await super().get(key, prototype, byte_range)

    store = Counted()
    for i, key in enumerate(keys):
        sync(store.set(key, cpu.Buffer.from_bytes(bytes([i]))))
    with zarr.config.set({"async.concurrency": concurrency}):
        got = reader([store] * len(keys), keys, attempts=1)
    assert [g.tolist() for g in got if g is not None] == [[i] for i in range(len(keys))]
    assert Counted.most == limit


def test_a_closed_host_stream_cancels_the_reads_left() -> None:
    """stores/remote_host ``HostStream.close``: closing a stream cancels the reads still
    going: an item not read yet then raises at once instead of waiting for a server
    that never answers."""
    import asyncio

    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    from xarray_gds.stores.remote_host import HostStream

    class Stalls(zarr.storage.MemoryStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if key == "v/c/1":
                await asyncio.Event().wait()  # never answers
            return await super().get(key, prototype, byte_range)

    store = Stalls()
    sync(store.set("v/c/0", cpu.Buffer.from_bytes(b"first")))
    stream = HostStream([store, store], ["v/c/0", "v/c/1"])
    first = stream.get(0)
    assert first is not None and first.tobytes() == b"first"
    stream.close()
    outcome: list[BaseException] = []

    def take() -> None:
        try:
            stream.get(1)
        except BaseException as err:
            outcome.append(err)

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    waiter.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], OSError), outcome
    assert "cancelled" in str(outcome[0])


def test_the_first_read_that_fails_for_good_is_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stores/remote_host ``first = errors.exceptions[0]`` -> ``pass``: when one read of a
    batch fails for good while another is still waiting, the error raised is that
    read's (naming its chunk), not the cancellation of the other."""
    import asyncio

    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    from xarray_gds.stores.remote_host import read_host

    class OneFails(zarr.storage.MemoryStore):
        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if key == "v/c/1":
                raise PermissionError("403 Forbidden")
            await asyncio.Event().wait()  # never answers: cancelled by the failure

    store = OneFails()
    sync(store.set("v/c/0", cpu.Buffer.from_bytes(b"x")))
    with pytest.raises(PermissionError, match=r"cannot read chunk 'v/c/1'"):
        read_host([store, store], ["v/c/0", "v/c/1"], attempts=1)


@pytest.mark.needs("dask")
@pytest.mark.filterwarnings("ignore:Object at t is not recognized:UserWarning")
def test_a_failed_write_under_dasks_synchronous_scheduler_removes_only_its_own_chunks() -> None:
    """write ``_runs_here``'s ``dask.local.get_sync`` dropped: a write computed by dask's
    synchronous scheduler runs in this process, so a failed one removes the chunks it
    wrote, as recorded, and never a key it did not write (found by listing, as for a
    write whose tasks run elsewhere)."""
    import dask
    from zarr.core.buffer import cpu
    from zarr.core.sync import sync

    import xarray_gds
    from tests.test_write import _dask_dataset, _RecordingStore

    store = _RecordingStore.make()
    xarray_gds.to_zarr(xr.Dataset({"other": ("z", np.arange(3.0))}), store, mode="w")
    sync(store.set("t/c/9/9/9", cpu.Buffer.from_bytes(b"not the write's")))
    failing = _dask_dataset(fail_block=1).drop_vars("time")
    with pytest.raises(RuntimeError, match="injected"), dask.config.set(scheduler="synchronous"):
        xarray_gds.to_zarr(failing, store, mode="a", consolidated=False)
    keys = set(store._store_dict)
    assert "t/c/9/9/9" in keys
    assert not any(k.startswith("t/") and k != "t/c/9/9/9" for k in keys)


def test_a_read_into_a_read_only_array_gets_a_new_one(tmp_path: Path) -> None:
    """region ``_fits`` without ``into.flags.writeable``: a host read offered a read-only
    array to place its chunks in reads into a new array instead, with the values
    engine="zarr" reads."""
    from xarray_gds.pipeline import attach
    from xarray_gds.region import read_boxes

    values = np.arange(24, dtype="f4").reshape(6, 4)
    z = zarr.create_array(tmp_path / "a.zarr", shape=(6, 4), chunks=(2, 2), dtype="f4")
    z[:] = values
    array = attach(zarr.open_array(tmp_path / "a.zarr", mode="r"))
    ro = np.zeros((6, 4), "f4")
    ro.flags.writeable = False
    (got,) = read_boxes([(array, (slice(None), slice(None)), "cpu")], into=[ro])
    assert not isinstance(got, BaseException), got
    assert got is not ro and not np.shares_memory(got, ro)
    np.testing.assert_array_equal(got, values)
    assert not ro.any()


def test_cache_members_defaults_as_the_zarr_engine() -> None:
    """backend ``cache_members: bool = True`` -> ``False``: open_dataset's
    ``cache_members`` has the default of xarray's own zarr engine."""
    import inspect

    from xarray.backends.zarr import ZarrBackendEntrypoint

    from xarray_gds.backend import GdsZarrBackendEntrypoint

    ours = inspect.signature(GdsZarrBackendEntrypoint.open_dataset).parameters
    theirs = inspect.signature(ZarrBackendEntrypoint.open_dataset).parameters
    assert ours["cache_members"].default is theirs["cache_members"].default is True


def test_a_one_element_scale_factor_scales_as_a_scalar() -> None:
    """cf ``if np.ndim(scale_factor) > 0`` -> ``> 1``: a ``scale_factor`` given as a
    one-element array (as netCDF attributes hold it) is taken as its scalar: values
    keep their shape."""
    from xarray_gds.cf import plan_cf_decoding

    plan = plan_cf_decoding(
        "v", {"scale_factor": np.array([0.5])}, np.dtype("i2"), np.dtype("f4"), {}, True
    )
    assert plan is not None
    assert np.ndim(plan.scale_factor) == 0 and plan.scale_factor == 0.5
    got = plan.apply(np.array([[4, 6]], "i2"), np)
    assert got.shape == (1, 2)
    np.testing.assert_array_equal(got, np.array([[2.0, 3.0]], "f4"))
    one = plan.apply(np.array(4, "i2"), np)
    assert np.shape(one) == () and float(one) == 2.0


def test_redact_masks_a_four_character_password_of_an_auth_tuple() -> None:
    """``len(v) >= 4`` -> ``> 4`` for ``auth=(user, password)``: a password (and a user
    name) of exactly four characters is masked in error text, as longer ones are; three
    characters stay, being too short to tell from ordinary words."""
    from xarray_gds.stores.urls import redact

    options = {"client_kwargs": {"auth": ("user1", "pw12")}}
    text = "GET failed for 'user1' with 'pw12'"
    assert redact(text, options) == "GET failed for '***' with '***'"
    assert redact("'pw1' and 'user'", {"auth": ("user", "pw1")}) == "'pw1' and '***'"


@pytest.mark.parametrize(("style", "want"), [("virtual", "true"), ("path", "false")])
def test_s3_addressing_style_sets_obstores_request_style(style: str, want: str) -> None:
    """``style == "virtual"`` -> ``!=``: ``config_kwargs={"s3": {"addressing_style": ...}}``
    (s3fs's option, passed on to botocore) gives obstore virtual-hosted requests for
    "virtual" and path-style requests for "path"."""
    pytest.importorskip("obstore")
    from xarray_gds.stores.objstore import obstore_for

    options = {
        "key": "AKIAEXAMPLE",
        "secret": "an-example-secret",
        "config_kwargs": {"s3": {"addressing_style": style}},
    }
    store = obstore_for("s3://bucket/x.zarr", options)
    assert store is not None
    assert store.config["virtual_hosted_style_request"] == want

"""All-or-nothing writes to existing stores: a failed append leaves the dataset as it was.

``xarray_gds.to_zarr`` writes every chunk first and the metadata after it (see
:class:`~xarray_gds.deferred.HeldMetadataStore`); when one of the metadata writes
fails, the documents already replaced are put back. Failures are injected at each
metadata write in turn (``os.replace``, by which every file of the store is moved into
place, counting only renames inside the store under test: CuPy renames files into its
kernel cache too), for Zarr v2, v3 and sharded v3 stores, consolidated or not.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import xarray_gds
from xarray_gds.stores.local import is_metadata_key

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

LAYOUTS = {
    "v2": (2, {"v": {"chunks": (3, 5)}, "w": {"chunks": (3,)}}),
    "v3": (3, {"v": {"chunks": (3, 5)}, "w": {"chunks": (3,)}}),
    "sharded": (3, {"v": {"chunks": (1, 5), "shards": (3, 5)}, "w": {"chunks": (3,)}}),
}


class Injected(OSError):
    """The failure injected into a write."""


def _dataset(t0: int, nt: int, seed: int) -> xr.Dataset:
    rng = np.random.default_rng(seed)
    return xr.Dataset(
        {
            "v": (("t", "x"), rng.random((nt, 5)).astype("f4"), {"units": "K"}),
            "w": (("t",), rng.integers(0, 100, nt).astype("i4")),
        },
        coords={"t": pd.date_range("2000-01-01", periods=t0 + nt, freq="h")[t0:]},
        attrs={"title": "append test"},
    )


def _open(path: Path, consolidated: bool | None = None) -> xr.Dataset:
    return xr.open_dataset(path, engine="zarr", consolidated=consolidated).load()


def _files(path: Path) -> set[str]:
    return {str(f.relative_to(path)) for f in path.rglob("*") if f.is_file()}


def _fail_at(
    monkeypatch: pytest.MonkeyPatch, store: Path, k: int, which: Callable[[str], bool]
) -> list[str]:
    """Make the ``k``-th rename (1-based) into ``store`` of a key that ``which`` accepts
    fail; returns the list of such keys renamed (or attempted) so far."""
    real = os.replace
    seen: list[str] = []
    root = os.path.realpath(store)

    def replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        target = os.path.realpath(dst)
        if target.startswith(root + os.sep):
            key = os.path.relpath(target, root).replace(os.sep, "/")
            if which(key):
                seen.append(key)
                if len(seen) == k:
                    raise Injected(f"injected failure writing {key}")
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    return seen


def _base(tmp_path: Path, layout: str, consolidated: bool) -> tuple[Path, dict[str, Any]]:
    fmt, encoding = LAYOUTS[layout]
    path = tmp_path / "base.zarr"
    xarray_gds.to_zarr(
        _dataset(0, 7, 0), path, zarr_format=fmt, encoding=encoding, consolidated=consolidated
    )
    return path, {"consolidated": consolidated}


def _each_failure(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    base: Path,
    write: Callable[[Path], None],
    which: Callable[[str], bool],
) -> int:
    """Fail ``write`` at each of the renames ``which`` selects in turn, on a fresh copy of
    ``base`` each time; after each, the store must open as ``base`` did and hold the same
    files. Returns the number of such renames of a write that does not fail."""
    dry = tmp_path / "dry.zarr"
    shutil.copytree(base, dry)
    with monkeypatch.context() as m:
        count = _fail_at(m, dry, 0, which)
        write(dry)
    n = len(count)
    assert n >= 2, count
    want = {c: _open(base, c) for c in (None, False)}
    files = _files(base)
    for k in range(1, n + 1):
        path = tmp_path / f"fail-{k}.zarr"
        shutil.copytree(base, path)
        with monkeypatch.context() as m:
            seen = _fail_at(m, path, k, which)
            with pytest.raises(Injected):
                write(path)
        for consolidated, ds in want.items():
            got = _open(path, consolidated)
            xr.testing.assert_identical(got, ds)
        # no chunk past the old end of appended arrays, nor of new arrays
        assert _files(path) == files, seen[-1]
    return n


def _on(writer: str, ds: xr.Dataset, monkeypatch: pytest.MonkeyPatch) -> xr.Dataset:
    """``ds`` as ``writer`` writes it: zarr-python (numpy values), the batched encoder
    on the host (``XARRAY_GDS_BATCHED_HOST_WRITES=1``; with "dask", one dask block per
    variable, written concurrently as the GPU writes are), or on the GPU (CuPy values)."""
    if writer in ("batched", "dask"):
        monkeypatch.setenv("XARRAY_GDS_BATCHED_HOST_WRITES", "1")
    if writer == "dask":  # one dask task per variable, as the GPU writes run: concurrently
        pytest.importorskip("dask")
        return ds.chunk({d: -1 for d in ds.dims})
    if writer != "cuda":
        return ds
    import cupy as cp

    return ds.copy(data={k: cp.asarray(v.values) for k, v in ds.data_vars.items()})


WRITERS = ["zarr", "batched", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "plain"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_failed_append_leaves_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, consolidated: bool, writer: str
) -> None:
    base, kwargs = _base(tmp_path, layout, consolidated)
    more = _dataset(7, 8, 1)
    device_more = _on(writer, more, monkeypatch)

    def append(path: Path) -> None:
        xarray_gds.to_zarr(device_more, path, append_dim="t", **kwargs)

    n = _each_failure(tmp_path, monkeypatch, base, append, is_metadata_key)
    assert n >= 3  # t, v and w at least
    # a store left by a failed append takes the same append again
    path = tmp_path / f"fail-{n}.zarr"
    append(path)
    want = xr.concat([_open(base), more], dim="t")
    xr.testing.assert_identical(_open(path, False), want)
    xr.testing.assert_identical(_open(path), want)


@pytest.mark.parametrize("writer", [*WRITERS, "dask"])
@pytest.mark.parametrize("consolidated", [True, False], ids=["consolidated", "plain"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_failed_new_variables_leave_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, consolidated: bool, writer: str
) -> None:
    """A ``mode="a"`` write of several new variables: at each metadata write, and at the
    first chunk write; the new arrays' chunks are removed too."""
    base, kwargs = _base(tmp_path, layout, consolidated)
    encoding = LAYOUTS[layout][1]
    rng = np.random.default_rng(2)
    new = xr.Dataset(
        {
            "p": (("t", "x"), rng.random((7, 5)).astype("f4")),
            "q": (("t",), rng.random(7)),
        },
        attrs={"title": "append test", "more": "yes"},
    )
    enc = {"p": encoding["v"], "q": encoding["w"]}
    device_new = _on(writer, new, monkeypatch)

    def add(path: Path) -> None:
        xarray_gds.to_zarr(device_new, path, mode="a", encoding=enc, **kwargs)

    _each_failure(tmp_path, monkeypatch, base, add, is_metadata_key)

    def chunk(key: str) -> bool:
        return not is_metadata_key(key)

    for k in (1, 2):  # the first chunk write of the first new variable, then a later one
        path = tmp_path / f"chunk-{k}.zarr"
        shutil.copytree(base, path)
        with monkeypatch.context() as m:
            _fail_at(m, path, k, chunk)
            with pytest.raises(Injected):
                add(path)
        xr.testing.assert_identical(_open(path, False), _open(base, False))
        # zarr-python lets the other writes of a failed gather run on: to_zarr returns
        # once those running finished, and refuses those that start later
        assert _files(path) == _files(base)
    path = tmp_path / "chunk-1.zarr"
    add(path)
    want = _open(base).assign(p=new.p, q=new.q)
    want.attrs.update(new.attrs)
    xr.testing.assert_identical(_open(path), want)


# -- full disks ------------------------------------------------------------------------


class _Writes:
    """``xarray_gds.stores.files.write_file`` counted for the chunk files of one store: how many
    are running; the ``fail_at``-th one (1-based) fails with ENOSPC once a later chunk
    write has started, and the writes around it wait (at most ``hold`` seconds) for the
    test to see ``to_zarr`` return, so that writes are still in flight when it fails."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, fail_at: int | None) -> None:
        from xarray_gds.stores import files as local_io

        self.real = local_io.write_file
        self.root = os.path.realpath(root) + os.sep
        self.fail_at = fail_at
        self.hold = 0.5
        self.count = 0
        self.running = 0
        self.lock = threading.Condition()
        self.later = threading.Event()  #: a chunk write after the failing one began
        self.returned = threading.Event()  #: to_zarr returned
        monkeypatch.setattr(local_io, "write_file", self)

    def __call__(self, path: str, data: Any) -> None:
        key = os.path.realpath(path)[len(self.root) :]
        if not os.path.realpath(path).startswith(self.root) or is_metadata_key(key):
            return self.real(path, data)
        with self.lock:
            self.count += 1
            k = self.count
            self.running += 1
        try:
            if self.fail_at is not None and k > self.fail_at:
                self.later.set()
            if self.fail_at is not None and k == self.fail_at:
                # fail once a later write is in flight (the writes before it are held
                # at most ``hold`` seconds, so a thread frees for it however loaded)
                assert self.later.wait(timeout=60), "no chunk write after the failing one"
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            if self.fail_at is not None and k <= self.fail_at + 4:
                self.returned.wait(timeout=self.hold)
            self.real(path, data)
        finally:
            with self.lock:
                self.running -= 1
                self.lock.notify_all()

    def settle(self) -> int:
        """Note that to_zarr returned; the number of chunk writes it left running (then
        wait for them, at most 10 s, so that what they leave can be listed)."""
        with self.lock:
            left = self.running
        self.returned.set()
        with self.lock:
            self.lock.wait_for(lambda: not self.running, timeout=10)
        return left


def _big(t0: int, nt: int) -> xr.Dataset:
    rng = np.random.default_rng(t0)
    return xr.Dataset(
        {"v": (("t", "x"), rng.random((nt, 512)))},  # 64 KiB a chunk, incompressible
        coords={"t": np.arange(t0, t0 + nt)},
    )


_BIG_CHUNKS = {"v": {"chunks": (16, 512)}}


@pytest.mark.parametrize("writer", ["zarr", "batched", "dask"])
@pytest.mark.parametrize("new", [False, True], ids=["append", "new-store"])
def test_full_disk_leaves_only_referenced_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, new: bool
) -> None:
    """ENOSPC at the third chunk write, with others in flight: to_zarr returns after
    they finished, and the store holds the files it held before (an append: no chunk
    past the old end; a new store: no file at all), nothing landing later."""
    path = tmp_path / "s.zarr"
    if not new:
        xarray_gds.to_zarr(_big(0, 20), path, encoding=_BIG_CHUNKS)
    before = _files(path) if path.exists() else set()
    more = _on(writer, _big(20 if not new else 0, 200), monkeypatch)
    writes = _Writes(monkeypatch, path, fail_at=3)
    kwargs: dict[str, Any] = {"append_dim": "t"} if not new else {"encoding": _BIG_CHUNKS}
    with pytest.raises(OSError) as info:
        xarray_gds.to_zarr(more, path, **kwargs)
    at_return = _files(path)
    assert writes.settle() == 0  # no chunk write of it still running
    assert info.value.errno == errno.ENOSPC
    assert at_return == before
    assert _files(path) == before
    assert writes.count > 3
    if not new:
        xr.testing.assert_identical(_open(path), _big(0, 20))
        xarray_gds.to_zarr(more, path, append_dim="t")  # the same append, with space
        xr.testing.assert_identical(_open(path), xr.concat([_big(0, 20), _big(20, 200)], "t"))


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs (root only, where mounting works)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _allocated(root: Path) -> int:
    """Bytes allocated to the files below ``root``."""
    return sum(f.lstat().st_blocks * 512 for f in root.rglob("*") if f.is_file())


@pytest.mark.parametrize("writer", ["zarr", "batched"])
def test_append_to_a_full_tmpfs_leaves_the_store(
    tiny_disk: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """A real full disk: an append of 2.4 MiB to a store on a 1 MiB tmpfs fails with
    ENOSPC, leaves the files of before and frees the space it took."""
    path = tiny_disk / "s.zarr"
    xarray_gds.to_zarr(_big(0, 20), path, encoding=_BIG_CHUNKS)
    before = _files(path)
    free, allocated = shutil.disk_usage(tiny_disk).free, _allocated(tiny_disk)
    writes = _Writes(monkeypatch, path, fail_at=None)
    with pytest.raises(OSError) as info:
        xarray_gds.to_zarr(_on(writer, _big(20, 300), monkeypatch), path, append_dim="t")
    at_return = _files(path)
    assert writes.settle() == 0
    assert info.value.errno == errno.ENOSPC
    assert at_return == before
    assert _files(path) == before
    # the space taken is that of the files there (the last chunk, replaced, grew)
    assert free - shutil.disk_usage(tiny_disk).free == _allocated(tiny_disk) - allocated
    xr.testing.assert_identical(_open(path), _big(0, 20))

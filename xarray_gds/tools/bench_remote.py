"""The remote cases of ``xarray-gds bench``: the case's store served by nginx on
127.0.0.1 (:mod:`xarray_gds.tools.nginx`, started and stopped by the case), read over
``http://`` and over ``s3://`` (the same server as a path-style S3 endpoint) by
``engine="gds-zarr"`` and by ``engine="zarr"`` through obstore and through fsspec,
against two bounds: every chunk object fetched by obstore with nothing decoded (the
server's and the client's rate), and the same store read by the engine from local disk.

On the host (``host-remote-*``) the goal is 1.3x the faster ``engine="zarr"`` and
within 1.25x of the local read; on the GPU (``remote-*-4MB``, the kvikio ``RemoteFile``
route) 90% of the raw GET rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xarray as xr

from xarray_gds import device as _device
from xarray_gds.tools import nginx

__all__ = ["contenders", "host_contenders", "note"]

#: the bucket the store is served in (a folder of the served root)
_BUCKET = "bench"
#: the credentials the S3 clients sign with (nginx reads no signature)
_KEY, _SECRET = "AKIABENCHKEY", "bench-secret"

#: contenders that could not run against the server, and why (for :func:`note`)
_NOT_RUN: dict[str, str] = {}
#: the CPU seconds of each contender's cheapest run (for :func:`note`)
_CPU: dict[str, float] = {}


def _chunk_keys(path: Path) -> list[str]:
    """The keys of the chunk objects of ``t``."""
    found = (str(p.relative_to(path)) for p in (path / "t").rglob("*") if p.is_file())
    return sorted(k for k in found if k.rsplit("/", 1)[-1] not in ("zarr.json", ".zarray"))


def _serve(path: Path, stack: contextlib.ExitStack) -> tuple[str, str, dict[str, Any]]:
    """nginx serving the folder of ``path`` until the case ends: the store's HTTP URL,
    its S3 URL and the S3 storage options."""
    root = path.parent / f"{path.stem}-served"
    (root / _BUCKET).mkdir(parents=True, exist_ok=True)
    link = root / _BUCKET / path.name  # the store as the object path.name of a bucket
    if not link.exists():
        link.symlink_to(path.resolve(), target_is_directory=True)
    workers = max(1, min(4, os.cpu_count() or 1))
    server = stack.enter_context(nginx.serve(root, tls=False, workers=workers))
    options = {"endpoint_url": server.http, "key": _KEY, "secret": _SECRET}
    return f"{server.http}/{_BUCKET}/{path.name}", f"s3://{_BUCKET}/{path.name}", options


def _obstore(scheme: str, server: str, path: Path) -> Any:
    from obstore.store import HTTPStore, S3Store

    if scheme == "http":
        url = f"{server}/{_BUCKET}/{path.name}"
        return HTTPStore.from_url(url, client_options={"allow_http": True})
    return S3Store(
        _BUCKET,
        prefix=path.name,
        endpoint=server,
        access_key_id=_KEY,
        secret_access_key=_SECRET,
        region="us-east-1",
        client_options={"allow_http": True},
        virtual_hosted_style_request=False,
    )


def _readers(
    path: Path, stack: contextlib.ExitStack, scheme: str, device: str
) -> dict[str, Callable[[], Any]]:
    import obstore
    from zarr.storage import ObjectStore

    http, s3, options = _serve(path, stack)
    server = options["endpoint_url"]
    kwargs: dict[str, Any] = {} if scheme == "http" else {"storage_options": options}
    url = http if scheme == "http" else s3
    obj = _obstore(scheme, server, path)
    keys = _chunk_keys(path)
    on_gpu = device == "cuda"

    def values(ds: xr.Dataset) -> Any:
        return _device.cupy().asarray(ds["t"].values) if on_gpu else ds["t"].values

    def ours() -> Any:
        ds = xr.open_dataset(url, engine="gds-zarr", device=device, consolidated=True, **kwargs)
        return ds["t"].variable.data if on_gpu else ds["t"].values

    def zarr_obstore() -> Any:
        store: Any = ObjectStore(obj, read_only=True)
        return values(xr.open_dataset(store, engine="zarr", consolidated=True))

    def zarr_fsspec() -> Any:
        return values(xr.open_dataset(url, engine="zarr", consolidated=True, **kwargs))

    loop = asyncio.new_event_loop()
    stack.callback(loop.close)

    async def gets() -> list[Any]:
        got = await asyncio.gather(*(obstore.get_async(obj, k) for k in keys))
        return list(await asyncio.gather(*(g.bytes_async() for g in got)))

    def raw() -> Any:
        return loop.run_until_complete(gets())

    def local() -> Any:
        ds = xr.open_dataset(path, engine="gds-zarr", device=device, consolidated=True)
        return ds["t"].variable.data if on_gpu else ds["t"].values

    found: dict[str, Callable[[], Any]] = {
        "gds-zarr": ours,
        "zarr (obstore)": zarr_obstore,
        "zarr (fsspec)": zarr_fsspec,
        "raw GETs": raw,
        "gds-zarr local file": local,
    }
    _NOT_RUN.clear()
    _CPU.clear()
    try:
        zarr_fsspec()
    except Exception as err:  # s3fs: a HEAD, then a listing the server refuses (501)
        del found["zarr (fsspec)"]
        _NOT_RUN["zarr (fsspec)"] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    return {label: _cpu_timed(label, fn) for label, fn in found.items()}


def _cpu_timed(label: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn``, its CPU time (every thread of this process: the client's receiving and
    decoding, not the server's) kept in :data:`_CPU`, the least of its runs: on a
    machine shared with other work, the cost of a read that a busy neighbour does not
    change as much as it changes the seconds."""

    def timed() -> Any:
        start = time.process_time()
        out = fn()
        used = time.process_time() - start
        _CPU[label] = min(_CPU.get(label, used), used)
        return out

    return timed


def host_contenders(scheme: str) -> Callable[[Path, contextlib.ExitStack], dict[str, Any]]:
    """The host cases' contenders (``device="cpu"``; ``engine="zarr"`` reads to numpy)."""
    return lambda path, stack: _readers(path, stack, scheme, "cpu")


def contenders(scheme: str) -> Callable[[Path, contextlib.ExitStack], dict[str, Any]]:
    """The GPU cases' contenders: the engine on the device (kvikio's ``RemoteFile``),
    ``engine="zarr"`` followed by ``cupy.asarray``."""
    return lambda path, stack: _readers(path, stack, scheme, "cuda")


def note(result: Any) -> str:
    """gds-zarr against the faster ``engine="zarr"``, the raw GETs and the local read."""
    seconds = result.seconds
    ours = seconds["gds-zarr"]
    others = [seconds[k] for k in ("zarr (obstore)", "zarr (fsspec)") if k in seconds]
    parts = [f"gds-zarr vs the faster other: {min(others) / ours:.2f}x"]
    parts.append(f"gds-zarr at {seconds['raw GETs'] / ours:.0%} of the raw GET rate")
    parts.append(f"local file / gds-zarr: {seconds['gds-zarr local file'] / ours:.2f}")
    if _CPU:
        spent = ", ".join(f"{name} {cpu:.2f}" for name, cpu in _CPU.items())
        parts.append(f"client CPU seconds: {spent}")
    parts += [f"{name} not run ({why})" for name, why in _NOT_RUN.items()]
    return "; ".join(parts)

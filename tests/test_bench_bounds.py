"""The ``read-only`` bound of the benchmark (xarray_gds.tools.bench_bounds): the chunks of
every data variable read by the engine's own reads, in the engine's parts, nothing
decoded; and what the performance page says bounds each read case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr

from xarray_gds import coalesce
from xarray_gds.request import ReadRequest
from xarray_gds.tools import bench, bench_bounds

from .test_docs import _plot_bench

METADATA = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}


def _chunk_files(store: Path, names: list[str]) -> dict[str, bytes]:
    """Every chunk file of the variables ``names``, by its key."""
    return {
        str(p.relative_to(store)): p.read_bytes()
        for name in names
        for p in (store / name).rglob("*")
        if p.is_file() and p.name not in METADATA
    }


def _fetched(requests: list[ReadRequest]) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for request in requests:
        batch = coalesce.read_only(request)
        assert len(batch) == len(request.keys)
        for key, chunk in zip(request.keys, batch, strict=True):
            out[key] = None if chunk is None else bytes(chunk)
    return out


def _two_variables(path: Path, zarr_format: int, compressor: Any) -> Path:
    rng = np.random.default_rng(3)
    ds = xr.Dataset(
        {name: (("time", "y"), rng.random((12, 10)).astype("f4")) for name in ("a", "b")},
        coords={"time": np.arange(12), "y": np.arange(10)},
    )
    enc = {name: {"chunks": (3, 5), "compressors": [compressor]} for name in ("a", "b")}
    ds.to_zarr(path, mode="w", encoding=enc, zarr_format=zarr_format, consolidated=True)
    return path


@pytest.mark.parametrize(
    ("zarr_format", "compressor"),
    [(3, zarr.codecs.ZstdCodec()), (2, numcodecs.Blosc(cname="lz4"))],
    ids=["v3-zstd", "v2-blosc"],
)
def test_read_only_reads_every_chunk_of_the_data_variables(
    tmp_path: Path, zarr_format: int, compressor: Any
) -> None:
    """Each chunk of each data variable exactly once, byte for byte as stored (the
    coordinates are not loaded by the cases' calls: left out)."""
    store = _two_variables(tmp_path / "s.zarr", zarr_format, compressor)
    requests = bench_bounds.chunk_requests(store, on_device=False, consolidated=True)
    assert requests is not None
    keys = [k for r in requests for k in r.keys]
    want = _chunk_files(store, ["a", "b"])
    assert len(keys) == len(set(keys)) == len(want) == 16
    assert _fetched(requests) == want
    assert {r.on_device for r in requests} == {False}
    assert all(r.chain.nbytes == 3 * 5 * 4 for r in requests)


@pytest.mark.parametrize(
    ("per_part", "sizes"), [(3, [3, 3, 2]), (1, [1] * 8), (7, [7, 1]), (8, [8])]
)
def test_read_only_parts_are_the_engines(tmp_path: Path, per_part: int, sizes: list[int]) -> None:
    """A variable larger than a batch is read in the parts the engine reads it in, the
    last chunk too (a part of one chunk at the end)."""
    store = _two_variables(tmp_path / "s.zarr", 3, zarr.codecs.ZstdCodec())
    with zarr.config.set({"xarray_gds.batch_bytes": per_part * 60}):
        requests = bench_bounds.chunk_requests(store, on_device=False)
    assert requests is not None
    assert [len(r.keys) for r in requests] == sizes * 2
    assert [r.keys[0].split("/")[0] for r in requests] == ["a"] * len(sizes) + ["b"] * len(sizes)
    assert _fetched(requests) == _chunk_files(store, ["a", "b"])


def test_read_only_missing_chunks_read_as_missing(tmp_path: Path) -> None:
    store = _two_variables(tmp_path / "s.zarr", 3, zarr.codecs.ZstdCodec())
    (store / "a" / "c" / "1" / "0").unlink()
    requests = bench_bounds.chunk_requests(store, on_device=False)
    assert requests is not None
    got = _fetched(requests)
    assert got["a/c/1/0"] is None
    assert {k: v for k, v in got.items() if v is not None} == _chunk_files(store, ["a", "b"])


def test_read_only_has_no_bound_for_sharded_variables(tmp_path: Path) -> None:
    ds = xr.Dataset({"t": (("x",), np.arange(64, dtype="f4"))})
    enc = {"t": {"chunks": (8,), "shards": (32,)}}
    ds.to_zarr(tmp_path / "s.zarr", mode="w", encoding=enc, zarr_format=3)
    assert bench_bounds.chunk_requests(tmp_path / "s.zarr", on_device=False) is None
    assert bench_bounds.read_bound(tmp_path / "s.zarr", on_device=False) == {}


def test_read_only_runs_each_request_once_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _two_variables(tmp_path / "s.zarr", 3, zarr.codecs.ZstdCodec())
    requests = bench_bounds.chunk_requests(store, on_device=False)
    assert requests is not None
    seen: list[ReadRequest] = []
    monkeypatch.setattr(coalesce, "read_only", lambda r: seen.append(r) or [])
    (contender,) = bench_bounds.read_bound(store, on_device=False).values()
    contender()
    assert [r.keys for r in seen] == [r.keys for r in requests]


def test_an_unopenable_target_names_itself(tmp_path: Path) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="nowhere"):
        bench_bounds.chunk_requests(tmp_path / "nowhere.zarr", on_device=False)


def test_host_usage_case_times_its_read_bound(tmp_path: Path) -> None:
    (result,) = bench.run(tmp_path, size_gb=0.004, repeat=1, cases=["host-usage-eager-2var"])
    assert set(result.seconds) == {"gds-zarr", "zarr", "read-only"}
    assert all(s > 0 for s in result.seconds.values())


def test_references_read_bound_reads_the_referenced_bytes(tmp_path: Path) -> None:
    """Through a reference set, the bytes each reference names in the NetCDF4 file."""
    pytest.importorskip("netCDF4")
    pytest.importorskip("h5netcdf")
    pytest.importorskip("kerchunk.hdf")
    from xarray_gds.tools import bench_refs

    store = bench.make_store(tmp_path / "s.zarr", 1 << 20, 128 << 10)
    nc, refs = bench_refs.prepare(store)
    requests = bench_bounds.chunk_requests(refs, on_device=False)
    assert requests is not None
    table = json.loads(refs.read_text())["refs"]
    blob = nc.read_bytes()
    want = {}
    for key, ref in table.items():
        if key.startswith("t/") and isinstance(ref, list):
            _, offset, size = ref
            want[key] = blob[offset : offset + size]
    assert want and _fetched(requests) == want


def test_the_page_names_what_bounds_each_read_case() -> None:
    plot = _plot_bench()

    def said(**seconds: float) -> str:
        named = {k.replace("_", "-"): v for k, v in seconds.items()}
        return str(plot.bound({"seconds": {"gds-zarr": 1.15, "zarr": 9.0, **named}}))

    assert said(read_only=1.0, decode_only=0.5) == (
        "bound by the reads: gds-zarr at 1.15x max(read-only, decode-only)"
    )
    assert said(read_only=0.5, decode_only=1.0).startswith("bound by the decode: ")
    assert said(read_only=0.99, decode_only=0.5).startswith("bound by the engine: ")
    assert said(read_only=1.0).startswith("bound by the reads: ")
    assert said(decode_only=1.0) == ""  # no read bound measured: nothing said
    row = plot.table(
        {
            "results": [
                {
                    "case": "c",
                    "nbytes": 10**9,
                    "n_chunks": 2,
                    "seconds": {"gds-zarr": 2.0, "zarr": 8.0, "read-only": 1.0},
                }
            ]
        }
    ).splitlines()[2]
    assert "read-only 1.000 s; bound by the engine: gds-zarr at 2.00x" in row

"""The ``xarray-gds`` command line tool (CPU only)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import xarray as xr
import zarr
import zarr.codecs as zc

import xarray_gds
from xarray_gds.codecs import crc32c, plan_chain
from xarray_gds.tools import _text, cli, demo

ROOT = Path(__file__).resolve().parent.parent


def sections(text: str) -> dict[str, str]:
    """``info`` output split into one block per array, keyed by the array's path."""
    blocks = [b for b in text.split("\n\n") if b.startswith("/")]
    return {b.splitlines()[0]: b for b in blocks}


def field(block: str, name: str) -> str:
    """The value of one ``name  value`` line of an ``info`` block, columns joined by " | "."""
    for line in block.splitlines():
        key, *cells = re.split(r"\s{2,}", line.strip())
        if key == name:
            return " | ".join(cells)
    raise AssertionError(f"no {name!r} line in:\n{block}")


# --- demo ----------------------------------------------------------------------------


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_demo_cpu(
    zarr_format: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = cli.main(["demo", "--device", "cpu", "--zarr-format", str(zarr_format)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "\nidentical: yes" in out  # the read
    assert "\nwrite round trip identical: yes\n" in out  # the write
    assert f"Zarr v{zarr_format}" in out
    assert "device:     cpu" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    for name in ("t2m", "precip", "u10", "v10", "land_mask", "time", "lat", "lon"):
        assert rows[name].endswith("host (numpy)"), rows[name]
    assert rows["t2m"].split()[1:5] == ["data", "(time,", "lat,", "lon)"]
    assert "(48, 73, 144)" in rows["t2m"]
    assert "GPU (cupy)" not in out
    assert "gds-zarr" in rows and "zarr" in rows  # the timing table
    assert "one cold run each" in out and "`xarray-gds bench`" in out
    assert "Pass --device cpu" not in err  # asked for cpu: nothing to warn about
    # The temporary store is gone, and the demo says so and how to keep it.
    assert list(tmp_path.iterdir()) == []
    assert out.rstrip().splitlines()[-1] == (
        "The stores above are in a temporary directory, removed as the demo ends. "
        "`xarray-gds demo --dir DIR` keeps them; then "
        f"`xarray-gds info DIR/weather-small-v{zarr_format}.zarr` describes the store."
    )


def test_demo_keeps_store_in_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--device", "cpu", "--dir", str(tmp_path / "out")]) == 0
    path = tmp_path / "out" / "weather-small-v3.zarr"
    assert str(path) in capsys.readouterr().out
    group = zarr.open_group(path, mode="r")
    u10 = group["u10"]
    assert isinstance(u10, zarr.Array)
    assert u10.dtype == np.int16
    assert u10.chunks == (12, 73, 144)
    assert [zc.ZstdCodec(level=3)] == list(u10.compressors)
    assert u10.attrs["scale_factor"] == 0.01
    with xr.open_dataset(path, engine="gds-zarr", device="cpu") as ds:
        assert ds["u10"].dtype.kind == "f"
        assert int(ds["u10"].isnull().sum()) > 0  # masked by _FillValue
        assert ds["time"].dtype.kind == "M"


def test_demo_dir_then_info_on_the_kept_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The README's two steps, with a relative --dir as there: the demo keeps its store
    # and names the `info` command to run on it, which then describes that store.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--device", "cpu", "--dir", "demo data"]) == 0
    out = capsys.readouterr().out
    store = Path("demo data", "weather-small-v3.zarr")
    assert store.is_dir()
    assert sorted(p.name for p in store.parent.iterdir() if not p.name.startswith(".")) == [
        "weather-small-v3.zarr",
        "written-by-gds.zarr",
        "written-by-xarray.zarr",
    ]
    last = out.rstrip().splitlines()[-1]
    assert (
        last
        == "next:       xarray-gds info 'demo data/weather-small-v3.zarr'   (describes the store)"
    )
    command = shlex.split(last.removeprefix("next:").split("  (")[0])
    assert command[:2] == ["xarray-gds", "info"]

    assert cli.main([*command[1:], "--device", "cpu"]) == 0
    info = capsys.readouterr().out
    assert info.splitlines()[0].endswith("demo data/weather-small-v3.zarr")
    blocks = sections(info)
    assert sorted(blocks) == [
        "/land_mask", "/lat", "/lon", "/precip", "/t2m", "/time", "/u10", "/v10"
    ]  # fmt: skip
    assert field(blocks["/u10"], "shape") == "(48, 73, 144)"
    assert field(blocks["/u10"], "chunks") == "(12, 73, 144)"
    assert field(blocks["/u10"], "dtype") == "int16"


def test_demo_dataset_is_weather_like() -> None:
    ds = demo.make_demo_dataset("small")
    assert dict(ds.sizes) == {"time": 48, "lat": 73, "lon": 144}
    assert ds["t2m"].dtype == np.float32
    assert 220 < float(ds["t2m"].min()) < float(ds["t2m"].max()) < 320
    assert float((ds["precip"] == 0).mean()) > 0.5
    assert float(ds["precip"].max()) > 0
    assert 0 < int(ds["u10"].isnull().sum()) < ds["u10"].size // 100
    assert ds["land_mask"].dims == ("lat", "lon")
    assert set(np.unique(ds["land_mask"])) == {0, 1}
    for name in ("t2m", "precip", "u10", "v10", "lat", "lon"):
        assert {"units", "long_name", "standard_name"} <= set(ds[name].attrs), name
    # Reproducible.
    xr.testing.assert_identical(ds, demo.make_demo_dataset("small"))


def test_demo_reports_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = demo._timed_load

    def wrong(path: Path, engine: str, **kwargs: Any) -> tuple[xr.Dataset, float]:
        ds, seconds = real(path, engine, **kwargs)
        if engine == "gds-zarr":
            ds["t2m"] = ds["t2m"] + 1
        return ds, seconds

    monkeypatch.setattr(demo, "_timed_load", wrong)
    assert cli.main(["demo", "--device", "cpu"]) == 1
    out, err = capsys.readouterr()
    assert "identical: NO" in out
    assert "disagree" in err and "t2m" in err


def test_demo_auto_without_gpu_warns_in_cli_terms(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(xarray_gds.device, "cuda_status", lambda: (False, "no GPU in this test"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["demo"]) == 0
    out, err = capsys.readouterr()
    assert (
        "xarray-gds demo: warning: no usable GPU (no GPU in this test); reading on the host "
        "with numpy instead. Pass --device cpu to silence this warning." in err
    )
    assert "device='cpu'" not in err + out
    assert not [w for w in caught if "device='cpu'" in str(w.message)]  # not the engine's
    assert "device:     cpu (host, numpy: no usable GPU: no GPU in this test)" in out


def test_demo_cuda_without_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(xarray_gds.device, "cuda_status", lambda: (False, "no GPU in this test"))
    assert cli.main(["demo", "--device", "cuda"]) == 1
    assert "no GPU in this test" in capsys.readouterr().err


# --- info ----------------------------------------------------------------------------


def _v2_store(path: Path) -> Path:
    root = zarr.open_group(path, mode="w", zarr_format=2)
    t2m = root.create_array(
        "t2m",
        shape=(10, 9, 12),
        chunks=(4, 5, 6),
        dtype="f4",
        compressors=[numcodecs.Zstd(level=5)],
        filters=[numcodecs.Shuffle(elementsize=4)],
        attributes={"_ARRAY_DIMENSIONS": ["time", "lat", "lon"], "units": "K"},
    )
    t2m[:] = 280.0
    root.create_array(
        "time",
        shape=(10,),
        chunks=(10,),
        dtype="i8",
        compressors=[numcodecs.Zstd(level=5)],
        attributes={"_ARRAY_DIMENSIONS": ["time"], "units": "hours since 2000-01-01"},
    )
    root.create_array(
        "valid_time",
        shape=(10, 9),
        chunks=(10, 9),
        dtype="i8",
        compressors=None,
        attributes={"_ARRAY_DIMENSIONS": ["time", "lat"], "units": "hours since 2000-01-01"},
    )
    return path


def _v3_store(path: Path) -> Path:
    root = zarr.open_group(path, mode="w", zarr_format=3)
    sub = root.create_group("forecast")
    sub.create_array(
        "t2m",
        shape=(16, 20),
        chunks=(4, 5),
        shards=(8, 10),
        dtype="f4",
        compressors=[zc.ZstdCodec(level=7)],
        dimension_names=("lat", "lon"),
    )[:] = 1.5
    root.create_array(
        "lat", shape=(16,), chunks=(16,), dtype="f8", dimension_names=("lat",), compressors=None
    )
    return path


def test_info_counts_the_groups_and_arrays_below_the_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _v3_store(tmp_path / "s.zarr")
    assert cli.main(["info", str(path), "--device", "cpu"]) == 0
    assert "node:         / (group: 2 arrays in 2 groups)\n" in capsys.readouterr().out
    analysis = zarr.open_group(path, mode="a").create_group("analysis")
    analysis.create_array("sst", shape=(4,), dtype="f4", dimension_names=("lat",))
    assert cli.main(["info", str(path), "--device", "cpu"]) == 0
    assert "node:         / (group: 3 arrays in 3 groups)\n" in capsys.readouterr().out
    assert cli.main(["info", str(path), "--group", "analysis", "--device", "cpu"]) == 0
    assert "node:         /analysis (group: 1 array in 1 group)\n" in capsys.readouterr().out


def test_info_names_a_relative_path_as_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _v2_store(tmp_path / "rel.zarr")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["info", "rel.zarr", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "rel.zarr" in out and "file://" not in out
    assert cli.main(["info", "rel.zarr", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["store"] == "rel.zarr"


def test_info_v2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _v2_store(tmp_path / "v2.zarr")
    assert cli.main(["info", str(path), "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "zarr format:  2" in out
    assert "device:       cuda (--device cuda)" in out
    blocks = sections(out)
    assert set(blocks) == {"/t2m", "/time", "/valid_time"}
    t2m = blocks["/t2m"]
    assert field(t2m, "shape") == "(10, 9, 12)"
    assert field(t2m, "chunks") == "(4, 5, 6)"
    assert field(t2m, "dims") == "(time, lat, lon)"
    assert field(t2m, "dtype") == "float32"
    assert "shards" not in t2m
    assert field(t2m, "filter") == "shuffle(elementsize=4) | GPU (batched)"
    assert field(t2m, "compressor").startswith("zstd(level=5")
    assert field(t2m, "placement") == "GPU (CuPy)"
    assert field(t2m, "encode").startswith("zarr-python on the host (filters")
    assert field(blocks["/time"], "placement") == "host (numpy: index coordinate)"
    assert "datetime64" in field(blocks["/valid_time"], "placement")
    assert "compressor" not in blocks["/valid_time"]


def test_info_v3_sharded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _v3_store(tmp_path / "v3.zarr")
    assert cli.main(["info", str(path), "--device", "cuda"]) == 0
    blocks = sections(capsys.readouterr().out)
    assert set(blocks) == {"/forecast/t2m", "/lat"}
    t2m = blocks["/forecast/t2m"]
    assert field(t2m, "chunks") == "(4, 5)"
    assert field(t2m, "shards") == "(8, 10)"
    assert field(t2m, "serializer").startswith("sharding_indexed(chunk_shape=(4, 5)")
    assert field(t2m, "inner compressor").startswith("zstd(level=7")
    assert field(t2m, "index compressor").startswith("crc32c")
    assert field(t2m, "placement") == "GPU (CuPy)"
    assert field(t2m, "encode").startswith("zarr-python on the host (inner chunks: level=7")
    lat = blocks["/lat"]
    assert field(lat, "placement") == "host (numpy: index coordinate)"
    assert field(lat, "shape") == "(16,)"
    # index coordinates stay on the host, so zarr-python writes them
    assert field(lat, "encode") == "zarr-python on the host (the values are on the host)"


@pytest.mark.parametrize(
    ("asked", "gpu", "device_line"),
    [
        ("cpu", True, "cpu (--device cpu)"),
        ("cuda", False, "cuda (--device cuda); no usable GPU here: no GPU in this test"),
        ("auto", False, "cpu (no usable GPU: no GPU in this test); --device cuda shows"),
        ("auto", True, "cuda ("),
    ],
)
def test_info_routes_are_for_the_device_of_the_run(
    asked: str,
    gpu: bool,
    device_line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    status = (True, "") if gpu else (False, "no GPU in this test; install hint")
    monkeypatch.setattr(xarray_gds.device, "cuda_status", lambda: status)
    monkeypatch.setattr(_text, "gpu_name", lambda: "Test GPU")
    path = _v2_store(tmp_path / "v2.zarr")
    assert cli.main(["info", str(path), "--device", asked]) == 0
    out = capsys.readouterr().out
    (line,) = (x for x in out.splitlines() if x.startswith("device:"))
    assert line.removeprefix("device:").strip().startswith(device_line), line
    t2m = sections(out)["/t2m"]
    if device_line.startswith("cuda"):
        assert field(t2m, "placement") == "GPU (CuPy)"
        assert field(t2m, "decode") == "batched: nvCOMP on the GPU"
        assert field(t2m, "compressor").endswith("| GPU (batched)")
    else:
        assert field(t2m, "placement") == "host (numpy: the run is on cpu)"
        assert field(t2m, "decode") == "batched on the host (numcodecs, threaded)"
        assert field(t2m, "compressor").endswith("| host (batched)")
        assert field(t2m, "encode") == "zarr-python on the host (the values are on the host)"
        assert "GPU" not in t2m and "nvCOMP" not in t2m


def test_info_shows_fill_value_decoded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = xr.Dataset({"u": ("t", np.array([1.0, np.nan, 3.0], "f4"), {"units": "m s-1"})})
    ds["u"].encoding["_FillValue"] = np.float32(-9999.0)
    ds.to_zarr(tmp_path / "v3.zarr", zarr_format=3, consolidated=False)
    stored = zarr.open_array(tmp_path / "v3.zarr" / "u", mode="r").attrs["_FillValue"]
    assert stored == "AAAAAICHw8A="  # xarray's base64 of the little-endian float64
    assert cli.main(["info", str(tmp_path / "v3.zarr")]) == 0
    u = sections(capsys.readouterr().out)["/u"]
    assert field(u, "cf") == "units='m s-1', _FillValue=-9999.0"
    assert stored not in u


def test_info_group_and_root_array(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _v3_store(tmp_path / "v3.zarr")
    assert cli.main(["info", str(path), "--group", "forecast"]) == 0
    assert set(sections(capsys.readouterr().out)) == {"/forecast/t2m"}

    zarr.create_array(tmp_path / "a.zarr", shape=(6,), chunks=(3,), dtype="i2", zarr_format=2)
    assert cli.main(["info", str(tmp_path / "a.zarr")]) == 0
    out = capsys.readouterr().out
    assert "(array)" in out
    assert "(none recorded)" in sections(out)["/"]


@pytest.mark.parametrize("consolidated", [True, False])
@pytest.mark.parametrize("zarr_format", [2, 3])
def test_info_group_consolidated_by_the_root(
    tmp_path: Path, zarr_format: int, consolidated: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group listed in the consolidated metadata of the store's root reads with it."""
    path = tmp_path / "tree.zarr"
    values = xr.Dataset({"t": ("x", np.arange(4.0))})
    tree = xr.DataTree.from_dict({"/surface": values, "/surface/deep": values})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: consolidated metadata is not in the v3 spec
        tree.to_zarr(path, zarr_format=zarr_format, consolidated=consolidated)
    want = "yes" if consolidated else "no"
    for group in ("surface", "surface/deep"):
        argv = ["info", str(path), "--group", group, "--device", "cpu"]
        assert cli.main(argv) == 0
        assert f"\nconsolidated: {want}\n" in capsys.readouterr().out
        assert cli.main([*argv, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["consolidated"] is consolidated


def test_info_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.zarr"
    assert cli.main(["info", str(missing)]) == 1  # a failure, not a usage error
    out, err = capsys.readouterr()
    assert str(missing) in err and not out

    assert cli.main(["info", str(tmp_path)]) == 1
    assert "not a Zarr store" in capsys.readouterr().err

    path = _v3_store(tmp_path / "v3.zarr")
    assert cli.main(["info", str(path), "--group", "nope"]) == 1
    err = capsys.readouterr().err
    assert f"group 'nope' not found in Zarr store {open_store_url(path)}" in err
    assert err.rstrip().endswith("the groups in it are: '/', '/forecast'")
    # as open_dataset says it
    with pytest.raises(FileNotFoundError, match=r"the groups in it are: '/', '/forecast'"):
        xr.open_dataset(path, engine="gds-zarr", group="nope", device="cpu")

    assert cli.main(["info"]) == 2  # argparse usage error, no SystemExit
    assert "path" in capsys.readouterr().err


def test_info_json_has_the_facts_of_the_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``info --json`` parses as JSON and says what the text says: arrays, shapes,
    chunks, shards, codecs and where each decodes, placement and routes."""
    for path in (_v2_store(tmp_path / "v2.zarr"), _v3_store(tmp_path / "v3.zarr")):
        assert cli.main(["info", str(path), "--device", "cuda"]) == 0
        text = capsys.readouterr().out
        assert cli.main(["info", str(path), "--device", "cuda", "--json"]) == 0
        facts = json.loads(capsys.readouterr().out)
        blocks = sections(text)
        assert facts["store"] == text.split("store:", 1)[1].split("\n", 1)[0].strip()
        assert f"zarr format:  {facts['zarr_format']}\n" in text
        assert facts["kind"] == "group" and facts["node"] == "/"
        device_line = text.split("device:", 1)[1].split("\n", 1)[0].strip()
        assert facts["device"] == {"device": "cuda", "gpu": None, "text": device_line}
        assert {a["path"] for a in facts["arrays"]} == set(blocks)
        for array in facts["arrays"]:
            block = blocks[array["path"]]
            assert field(block, "shape") == _text.shape(tuple(array["shape"]))
            assert field(block, "chunks") == _text.shape(tuple(array["chunks"]))
            assert field(block, "dtype") == array["dtype"]
            if array["shards"] is None:
                assert "shards" not in block
            else:
                assert field(block, "shards") == _text.shape(tuple(array["shards"]))
            if array["dims"] is not None:
                assert field(block, "dims") == _text.dims(tuple(array["dims"]))
            for name in ("placement", "decode", "encode"):
                assert field(block, name) == array[name]
            for codec in array["codecs"]:
                row = field(block, codec["role"])
                assert row == f"{codec['codec']} | {codec['decodes_on']}"
    t2m = next(a for a in facts["arrays"] if a["path"] == "/forecast/t2m")
    assert t2m["shards"] == [8, 10] and t2m["chunks"] == [4, 5]
    roles = [c["role"] for c in t2m["codecs"]]
    assert "serializer" in roles and "inner compressor" in roles


def test_info_json_of_cf_attributes_is_strict_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = xr.Dataset({"u": ("t", np.array([1.0, np.nan, 3.0], "f4"), {"units": "m s-1"})})
    ds["u"].encoding["_FillValue"] = np.float32(np.nan)
    ds.to_zarr(tmp_path / "v3.zarr", zarr_format=3, consolidated=False)
    assert cli.main(["info", str(tmp_path / "v3.zarr"), "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out
    facts = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    (u,) = (a for a in facts["arrays"] if a["path"] == "/u")
    assert u["cf"]["units"] == "m s-1" and u["cf"]["_FillValue"] == "nan"
    assert facts["device"]["device"] == "cpu"


@pytest.mark.parametrize(
    ("given", "line"),
    [
        ("gpu", "cuda (--device cuda)"),
        ("cuda", "cuda (--device cuda)"),
        ("cuda:1", "cuda:1 (--device cuda:1)"),
        ("cpu", "cpu (--device cpu)"),
    ],
)
def test_info_device_takes_what_python_takes(
    given: str,
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from types import SimpleNamespace

    runtime = SimpleNamespace(getDeviceCount=lambda: 2)
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(xarray_gds.device, "cuda_status", lambda: (True, ""))
    monkeypatch.setattr(xarray_gds.device, "cupy", lambda: fake)
    path = _v2_store(tmp_path / "v2.zarr")
    assert cli.main(["info", str(path), "--device", given]) == 0
    out = capsys.readouterr().out
    assert f"device:       {line}\n" in out
    assert cli.main(["info", str(path), "--device", "cuda:2"]) == 2  # beyond the 2 GPUs
    assert "this machine has 2 GPUs (cuda:0 to cuda:1)" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["tpu", "cuda:x", "cuda:-1"])
@pytest.mark.parametrize("command", ["info", "demo"])
def test_bad_device_is_a_usage_error(
    given: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [command, "--device", given] + ([str(tmp_path)] if command == "info" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{given!r} is not a device: use auto, cpu, gpu, cuda or cuda:N" in err


@pytest.mark.parametrize("repeat", ["0", "-1", "two"])
def test_bench_repeat_below_one_is_a_usage_error(
    repeat: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "--repeat", repeat, "--case", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--repeat" in err and ("must be 1 or more" in err or "whole number" in err)


@pytest.mark.needs("obstore")
def test_unreachable_store_is_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/one.zarr"  # bound but never listening: refused
    assert cli.main(["info", url]) == 1
    err = capsys.readouterr().err
    assert url in err and "the server cannot be reached" in err and "AWS" not in err


def open_store_url(path: Path) -> str:
    return str(xarray_gds.open_store(path))


def test_info_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    root = zarr.open_group(tmp_path / "many.zarr", mode="w", zarr_format=3)
    for i in range(500):  # about 290 kB of output: several times what a pipe holds
        root.create_array(f"a{i:03d}", shape=(4,), chunks=(2,), dtype="f4", dimension_names=["x"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "xarray_gds.tools.cli", "info", str(tmp_path / "many.zarr")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # read only the first line from the pipe
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"store:")  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""  # no BrokenPipeError traceback, no "Exception ignored"


# Substrings that identify each conftest codec case in ``info`` output.
_CODEC_MARKS = {
    "zstd": "zstd(",
    "zstd-checksum": "checksum=True",
    "gzip": "gzip(",
    "none": "serializer",
    "blosc": "blosc(",
    "blosc-zstd-bit": "blosc(",
    "blosc-blosclz": "blosclz",
    "crc32c": "crc32c",
    "big-endian": "endian='big'",
    "sharded": "sharding_indexed(",
    "lz4": "lz4(",
    "zlib": "zlib(",
    "shuffle-zstd": "shuffle(",
    "delta-zlib": "delta(",
    "shuffle-zlib": "numcodecs.shuffle(elementsize=4)",
    "lzma": "numcodecs.lzma(preset=1)",
    "bz2": "bz2(level=5)",
}


def test_info_on_every_codec_case(
    store_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    zarr_format, codec = request.node.callspec.params["store_path"]
    assert cli.main(["info", str(store_path), "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    blocks = sections(out)
    assert "/t2m" in blocks and "/time" in blocks
    if codec == "none" and zarr_format == 2:
        assert "compressor" not in blocks["/t2m"]
    else:
        assert _CODEC_MARKS[codec] in blocks["/t2m"]
    assert field(blocks["/t2m"], "placement") == "GPU (CuPy)"
    assert field(blocks["/station"], "placement").startswith("host")
    assert "datetime64" in field(blocks["/valid_time"], "placement")


@pytest.mark.parametrize(
    ("codec", "device", "where"),
    [
        ("zstd", "cuda", "GPU (batched)"),
        ("sharded", "cuda", "GPU (batched)"),
        # without a GPU crc32c kernel, reads on the GPU fall back to zarr-python
        ("crc32c", "cuda", "GPU (batched)" if crc32c.available() else "host (zarr-python)"),
        ("blosc", "cuda", "GPU (batched)"),
        ("big-endian", "cuda", "GPU (batched)"),
        ("zstd", "cpu", "host (batched)"),
        ("crc32c", "cpu", "host (batched)"),
        ("blosc", "cpu", "host (batched)"),
    ],
)
def test_decode_route_follows_the_plan(
    store_factory: Any, codec: str, device: str, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = store_factory(3, codec)
    plan = plan_chain(zarr.open_array(path / "t2m", mode="r").metadata)
    assert cli.decode_path(zc.ZstdCodec(), plan, device) == where
    assert cli.main(["info", str(path), "--device", device]) == 0
    t2m = sections(capsys.readouterr().out)["/t2m"]
    assert where in t2m
    route = field(t2m, "decode")
    assert route.startswith("batched" if where != "host (zarr-python)" else "zarr-python")
    assert ("nvCOMP on the GPU" in route) == (where == "GPU (batched)")


def test_codec_name() -> None:
    assert cli.codec_name(zc.ZstdCodec()) == "zstd"
    assert cli.codec_name(zc.ShardingCodec(chunk_shape=(2,))) == "sharding_indexed"
    assert cli.codec_name(numcodecs.GZip()) == "gzip"


# --- bench, --version, entry points ---------------------------------------------------


def test_profile_names_are_plain() -> None:
    from xarray_gds.tools.bench import profile_name

    assert profile_name("netcdf-refs", "gds-zarr chunks={}") == "netcdf-refs.gds-zarr_chunks.txt"
    assert profile_name("remote-s3", "s3fs GETs only") == "remote-s3.s3fs_GETs_only.txt"
    assert profile_name("zstd-4MB", "zarr") == "zstd-4MB.zarr.txt"


def test_bench_host_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--case", "host-zstd-4MB", "--size-gb", "0.04", "--repeat", "1"]
    profiles = tmp_path / "profiles"
    assert cli.main([*argv, "--json", str(out_json), "--profile", str(profiles)]) == 0
    out = capsys.readouterr().out
    assert "| host-zstd-4MB |" in out and "| gds-zarr |" in out and "| zarr |" in out
    data = json.loads(out_json.read_text())
    (result,) = data["results"]
    assert set(result["seconds"]) == {"gds-zarr", "zarr"}
    assert all(v > 0 for v in result["seconds"].values())
    # one profile per contender, showing the engine's own read path
    names = sorted(p.name for p in profiles.iterdir())
    assert names == ["host-zstd-4MB.gds-zarr.txt", "host-zstd-4MB.zarr.txt"]
    # the calling thread's side of it (cProfile follows that thread only: the decode
    # itself may run in the engine's threads, out of the profile's sight)
    text = (profiles / "host-zstd-4MB.gds-zarr.txt").read_text()
    assert "xarray_gds/array.py" in text and "__getitem__" in text


@pytest.mark.needs("dask")
def test_bench_shard_chunks_are_one_block_a_shard(tmp_path: Path) -> None:
    """usage-sharded-shards' chunks= gives dask blocks of exactly one shard each."""
    from xarray_gds.tools import bench

    spec = bench.CASES["usage-sharded-shards"]
    path = bench.make_store(tmp_path / "s.zarr", int(0.004e9), **spec["store"])
    chunks = bench._shard_chunks(path)
    ds = xr.open_dataset(path, engine="gds-zarr", device="cpu", chunks=chunks)
    shards = ds.t.encoding["shards"]
    assert tuple(chunks.values()) == tuple(shards) and ds.t.encoding["chunks"] != tuple(shards)
    assert all(
        c == s for dim, s in zip(ds.t.dims, shards, strict=True) for c in ds.t.chunksizes[dim][:-1]
    )
    xr.testing.assert_identical(ds.t.compute(), xr.open_dataset(path, engine="zarr").t.load())
    with pytest.raises(ValueError, match="not sharded"):
        bench._shard_chunks(bench.make_store(tmp_path / "plain.zarr", int(0.002e9), 64 << 10))


@pytest.mark.gpu
def test_bench_usage_sharded_shards_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--case", "usage-sharded-shards", "--size-gb", "0.02", "--repeat", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| usage-sharded-shards |" in out and "| gds-zarr |" in out and "| zarr |" in out


@pytest.mark.gpu
def test_bench_usage_eager_has_its_bounds_and_split_contenders(tmp_path: Path) -> None:
    """The bounds (the engine's reads alone, one nvCOMP call over chunks already on the
    device) and the GPU/host split are timed beside the engine in the same case."""
    from xarray_gds.tools import bench

    (result,) = bench.run(tmp_path, size_gb=0.02, repeat=1, cases=["usage-eager-2var"])
    assert set(result.seconds) == {
        "gds-zarr",
        "gds-zarr, split=auto",
        "zarr",
        "raw-limit",
        "decode-only",
        "read-only",
    }


def test_bench_s3_server_is_a_loopback_process_of_its_own() -> None:
    """The remote case's moto server runs in a process of its own on 127.0.0.1 (not in
    the measured client's), answering S3 calls."""
    pytest.importorskip("moto.server", reason="needs moto[server]")
    s3fs = pytest.importorskip("s3fs")
    import threading

    from xarray_gds.tools import s3_server

    before = threading.active_count()
    options = s3_server.loopback_s3()
    assert options["endpoint_url"].startswith("http://127.0.0.1:")
    assert threading.active_count() == before  # no server threads in this process
    fs = s3fs.S3FileSystem(**options)
    fs.pipe("bench/probe", b"chunk bytes")
    assert fs.cat("bench/probe") == b"chunk bytes"
    assert s3_server.loopback_s3() is options  # started once


def test_bench_netcdf_refs_host_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The netcdf-refs case on the host: its NetCDF4 file holds the bench store's values,
    and every reader of it is timed."""
    pytest.importorskip("netCDF4", reason="the netcdf-refs case writes NetCDF4 (bench extra)")
    pytest.importorskip("kerchunk", reason="the netcdf-refs case needs kerchunk (refs extra)")
    from xarray_gds.tools import bench, bench_refs

    store = bench.make_store(tmp_path / "s.zarr", 2 << 20, 256 << 10)
    nc = bench_refs.write_netcdf(store, tmp_path / "s.nc")
    got = xr.open_dataset(nc, engine="h5netcdf")["t"]
    want = xr.open_dataset(store, engine="zarr")["t"]
    np.testing.assert_array_equal(got.values, want.values)
    out_json = tmp_path / "bench.json"
    argv = ["bench", "--case", "host-netcdf-refs", "--size-gb", "0.1", "--repeat", "1"]
    assert cli.main([*argv, "--json", str(out_json)]) == 0
    assert "gds-zarr vs the faster other" in capsys.readouterr().out
    (result,) = json.loads(out_json.read_text())["results"]
    assert set(result["seconds"]) == {"gds-zarr", "h5netcdf", "zarr", "read-only"}


def test_bench_stores_do_not_warn_about_consolidated_metadata(tmp_path: Path) -> None:
    from xarray_gds.tools import bench

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):  # one store a case
            bench.make_store(tmp_path / f"s{i}.zarr", 1 << 20, 256 << 10)
    assert [str(w.message) for w in caught] == []
    assert zarr.open_group(tmp_path / "s0.zarr", mode="r").metadata.consolidated_metadata


def test_bench_skips_cases_whose_packages_are_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A case whose packages are not installed is skipped with a line naming them and
    the extra that brings them; the other cases run."""
    from xarray_gds.tools import bench

    absent = {"netCDF4", "virtualizarr"}
    monkeypatch.setattr(bench, "_installed", lambda package: package not in absent)
    cases = ["host-netcdf-refs", "host-icechunk-virtual", "host-zstd-4MB"]
    argv = ["bench", *(a for c in cases for a in ("--case", c)), "--size-gb", "0.01"]
    assert cli.main([*argv, "--repeat", "1", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if ": skipped: " in line] == [
        'host-netcdf-refs: skipped: needs netCDF4 (the bench extra: pip install ".[bench]" '
        "in a checkout)",
        "host-icechunk-virtual: skipped: needs netCDF4, virtualizarr (the bench and "
        'virtual extras: pip install ".[bench,virtual]" in a checkout)',
    ]
    assert sum(line.startswith("| host-zstd-4MB | ") for line in lines) == 4  # row, all
    assert list(tmp_path.iterdir()) == []


def test_bench_skips_a_case_on_an_import_it_does_not_declare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from xarray_gds.tools import bench

    def contenders(path: Path) -> dict[str, Any]:
        raise ModuleNotFoundError("No module named 'obspec_utils'", name="obspec_utils.registry")

    case = {"gpu": False, "scale": 1.0, "store": {"chunk_bytes": 64 << 10}}
    monkeypatch.setitem(bench.CASES, "fake", {**case, "contenders": contenders})
    argv = ["bench", "--case", "fake", "--size-gb", "0.001", "--dir", str(tmp_path)]
    assert cli.main(argv) == 1  # nothing that was asked for ran
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-1] == (
        'fake: skipped: needs obspec_utils (the virtual extra: pip install ".[virtual]" '
        "in a checkout)"
    )
    assert "all cases" not in captured.out
    assert (
        captured.err
        == "xarray-gds bench: error: none of the cases asked for ran (see the lines above)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_bench_gpu_cases_without_a_gpu_say_so_and_fail(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(xarray_gds.device, "cuda_status", lambda: (False, "no GPU in this test"))
    assert cli.main(["bench", "--case", "zstd-4MB", "--case", "usage-chunks-2var"]) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "no GPU (no GPU in this test): the cases that need one are skipped",
        "zstd-4MB: skipped: needs a GPU (on the host: --case host-zstd-4MB; the "
        "host-usage-* cases, docs/performance.md)",
        "usage-chunks-2var: skipped: needs a GPU (on the host: --case "
        "host-usage-chunks-2var; the host-usage-* cases, docs/performance.md)",
    ]
    assert "none of the cases asked for ran" in captured.err


def test_bench_prints_one_line_per_distinct_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from xarray_gds.tools import bench

    def contenders(path: Path) -> dict[str, Any]:
        def ours() -> None:
            for _ in range(50):
                warnings.warn("the same warning", UserWarning, stacklevel=1)

        def theirs() -> None:
            warnings.warn("another", RuntimeWarning, stacklevel=1)

        return {"gds-zarr": ours, "zarr": theirs}

    case = {"gpu": False, "scale": 1.0, "store": {"chunk_bytes": 64 << 10}}
    monkeypatch.setitem(bench.CASES, "fake", {**case, "contenders": contenders})
    argv = ["bench", "--case", "fake", "--size-gb", "0.001", "--repeat", "2"]
    assert cli.main([*argv, "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    at = out.index("warnings (count, category: message):")
    # each contender runs three times: the warm-up and two timed runs
    assert out[at + 1 :] == [
        "  150 x UserWarning: the same warning",
        "  3 x RuntimeWarning: another",
    ]
    assert captured.err == ""


def test_bench_append_case_writes_times_without_warnings(tmp_path: Path) -> None:
    """The append case gives its hourly times units of hours: xarray has nothing to
    warn about at each append."""
    from xarray_gds.tools import bench_write

    path = bench_write.make_append(tmp_path / "a.zarr", 1 << 20)
    contenders = bench_write.append_contenders(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for write in contenders.values():
            write()
            written = xr.open_dataset(tmp_path / "a-written.zarr", engine="zarr")
            xr.testing.assert_identical(written.time, xr.open_dataset(path, engine="zarr").time)
    assert [str(w.message) for w in caught if "serialized" in str(w.message)] == []


def test_bench_icechunk_logs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Icechunk's warnings about local storage (Rust log lines on stderr) stay out of the
    benchmark's output."""
    pytest.importorskip("icechunk")
    from xarray_gds.tools import bench, bench_icechunk

    monkeypatch.delenv("ICECHUNK_LOG", raising=False)
    store = bench.make_store(tmp_path / "s.zarr", 1 << 20, 256 << 10)
    capfd.readouterr()
    bench_icechunk.to_repository(store)
    assert capfd.readouterr().err == ""


def test_bench_help_lists_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    from xarray_gds.tools import bench

    assert cli.main(["bench", "--help"]) == 0
    listed = capsys.readouterr().out.split("runs only when named with --case):\n")[1]
    names = [n.strip().removesuffix("*").removesuffix(" (GPU)") for n in listed.split(",")]
    assert names == list(bench.CASES)
    assert "zstd-4MB (GPU)" in listed and "host-zstd-4MB," in listed
    assert "loader-4x4*" in listed and "multi-gpu-mfdataset*" in listed


def test_bench_unknown_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--case", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_version_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"xarray-gds {xarray_gds.__version__}"
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2


def test_module_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "xarray_gds.tools.cli", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"xarray-gds {xarray_gds.__version__}"


def test_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "xarray-gds"
    if not script.exists():
        pytest.skip("the xarray-gds console script is not installed next to this Python")
    result = subprocess.run(
        [str(script), "info", str(tmp_path / "nope.zarr")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1  # a missing store is a failure, not a usage error
    assert "nope.zarr" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.gpu
def test_peak_device_bytes_counts_what_the_load_allocates() -> None:
    cp = pytest.importorskip("cupy")
    from xarray_gds.tools import bench

    def allocate() -> object:
        scratch = cp.empty(10 << 20, dtype=cp.uint8)
        kept = cp.empty(30 << 20, dtype=cp.uint8)
        del scratch
        return kept

    peak = bench.peak_device_bytes(allocate)
    assert (40 << 20) <= peak < (41 << 20)
    # the default allocator is back
    assert cp.cuda.get_allocator() == cp.get_default_memory_pool().malloc


def test_bench_json_holds_what_the_committed_data_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench --json`` writes the keys of docs/data/bench-*.json, so that
    ``scripts/plot_bench.py --table`` fills every column of a fresh run."""
    import datetime
    import importlib.util

    from xarray_gds.tools import bench

    out_json = tmp_path / "out.json"
    argv = ["bench", "--case", "host-zstd-4MB", "--size-gb", "0.01", "--repeat", "2"]
    assert cli.main([*argv, "--json", str(out_json)]) == 0
    capsys.readouterr()
    data = json.loads(out_json.read_text())
    committed = json.loads((ROOT / "docs" / "data" / "bench-h100.json").read_text())
    assert set(committed["env"]) <= set(data["env"])
    assert set(committed["results"][0]) <= set(data["results"][0])
    assert data["env"]["machine"].endswith(f", {os.cpu_count()} CPU cores")
    assert "zarr " in data["env"]["software"] and "xarray " in data["env"]["software"]
    (result,) = data["results"]
    assert result["title"] == bench.TITLES["host-zstd-4MB"] == 'device="cpu", zstd'
    assert result["date"] == datetime.datetime.now(datetime.UTC).date().isoformat()
    assert re.fullmatch(r"[0-9a-f]{7,40}\+?|v\S+", result["commit"]), result["commit"]
    # host-zstd-4MB keeps --repeat; a case that sets its own repeat records that one
    assert result["command"] == "xarray-gds bench --case host-zstd-4MB --size-gb 0.01 --repeat 2"
    assert bench.command("host-small-chunks", 0.5, 3) == (
        "xarray-gds bench --case host-small-chunks --size-gb 0.5 --repeat 1"
    )

    spec = importlib.util.spec_from_file_location("plot_bench", ROOT / "scripts" / "plot_bench.py")
    assert spec is not None and spec.loader is not None
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert plot.main([str(out_json), "--table"]) == 0
    table = capsys.readouterr().out
    row = table.splitlines()[2]
    assert "?" not in table
    assert row.startswith('| `host-zstd-4MB` | device="cpu", zstd | 0.01 GB, 2 chunks |')
    assert row.endswith(f"| 0.01, 2 | {result['date']} `{result['commit']}` |")


def test_every_bench_case_has_a_title() -> None:
    from xarray_gds.tools import bench

    assert set(bench.TITLES) == set(bench.CASES)
    assert all(bench.TITLES.values())


# --- errors: one line, the traceback only with --debug ---------------------------------


def _icechunk_repository(path: Path) -> Path:
    icechunk = pytest.importorskip("icechunk")
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(str(path)))
    session = repo.writable_session("main")
    zarr.create_group(session.store).create_array("a", shape=(4,), dtype="f4")
    session.commit("one array")
    return path


def _corrupt_store(path: Path) -> Path:
    _v3_store(path)
    (path / "zarr.json").write_bytes((path / "zarr.json").read_bytes() + b"\x00")
    return path


#: (name, arguments, exit status, the error line after "xarray-gds COMMAND: error: "
#: as its start); {tmp} stands for the test's directory
USER_ERRORS = [
    ("missing path", ["info", "{tmp}/missing.zarr"], 1, "No such Zarr store: '{tmp}/missing.zarr'"),
    (
        "not a store",
        ["info", "{tmp}"],
        1,
        "'{tmp}' is not a Zarr store: it is not a directory holding zarr.json (Zarr v3) or "
        ".zgroup/.zarray/.zmetadata (Zarr v2)",
    ),
    (
        "corrupt metadata",
        ["info", "{tmp}/corrupt.zarr"],
        1,
        "corrupt Zarr metadata document 'zarr.json' in file://{tmp}/corrupt.zarr: not valid "
        "JSON (Extra data: line ",
    ),
    (
        "icechunk repository",
        ["info", "{tmp}/repo"],
        1,
        "'{tmp}/repo' is an Icechunk repository, not a Zarr store: open a session's store, "
        "repo = icechunk.Repository.open(icechunk.local_filesystem_storage('{tmp}/repo')), "
        "then xr.open_dataset(repo.readonly_session('main').store, engine='gds-zarr', "
        "storage_options={{'icechunk_storage': repo.storage}})",
    ),
    ("group of a corrupt store", ["info", "{tmp}/corrupt.zarr", "--group", "x"], 1, "corrupt Zarr"),
]


def _setup_errors(tmp_path: Path, name: str) -> None:
    if name in ("corrupt metadata", "group of a corrupt store"):
        _corrupt_store(tmp_path / "corrupt.zarr")
    if name == "icechunk repository":
        _icechunk_repository(tmp_path / "repo")


@pytest.mark.parametrize(
    ("name", "argv", "status", "start"), USER_ERRORS, ids=[c[0] for c in USER_ERRORS]
)
def test_user_errors_are_one_line(
    name: str,
    argv: list[str],
    status: int,
    start: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _setup_errors(tmp_path, name)
    argv = [a.format(tmp=tmp_path) for a in argv]
    start = f"xarray-gds {argv[0]}: error: " + start.format(tmp=tmp_path)
    assert cli.main(argv) == status
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert line.startswith(start), line
    # --debug, before or after the command: the traceback, then the same line
    for debug in (["--debug", *argv], [*argv, "--debug"]):
        assert cli.main(debug) == status
        err = capsys.readouterr().err
        assert err.startswith("Traceback (most recent call last):\n")
        assert err.splitlines()[-1] == line


@pytest.mark.parametrize(
    ("url", "blocked"),
    [
        ("{tmp}/refs.json", ["fsspec.implementations.reference", "kerchunk"]),
        ("s3://bucket/store.zarr", ["s3fs", "obstore"]),
    ],
)
def test_a_missing_optional_package_is_one_line(
    url: str, blocked: list[str], tmp_path: Path
) -> None:
    refs = {"version": 1, "refs": {".zgroup": json.dumps({"zarr_format": 2})}}
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    url = url.format(tmp=tmp_path)
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # as if it were not installed\n"
        "from xarray_gds.tools.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    for debug in ([], ["--debug"]):
        done = subprocess.run(
            [sys.executable, "-c", code, "info", url, *debug],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 1
        assert done.stdout == ""
        lines = done.stderr.splitlines()
        assert lines[-1].startswith("xarray-gds info: error: ")
        if debug:
            assert lines[0] == "Traceback (most recent call last):"
            assert "ImportError" in done.stderr
        else:
            assert len(lines) == 1, done.stderr
    assert "Traceback" not in lines[-1]


@pytest.mark.parametrize("size", ["-1", "0", "nan", "inf", "two"])
def test_bench_size_gb_must_be_above_zero(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--size-gb", size, "--case", "host-zstd-4MB"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: xarray-gds bench ")
    why = f"{size!r} is not a number" if size == "two" else f"must be more than 0, got {size}"
    assert err.splitlines()[-1] == f"xarray-gds bench: error: argument --size-gb: {why}"


def test_an_error_of_the_program_says_so_and_how_to_see_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: Any) -> int:
        return 1 // 0

    monkeypatch.setattr(cli, "_run_calibrate", broken)
    assert cli.main(["calibrate"]) == 1
    assert capsys.readouterr().err == (
        "xarray-gds calibrate: error: internal error: ZeroDivisionError: integer division "
        "or modulo by zero; rerun with --debug for the traceback\n"
    )
    assert cli.main(["calibrate", "--debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert "return 1 // 0" in err
    assert err.splitlines()[-1] == (
        "xarray-gds calibrate: error: internal error: ZeroDivisionError: integer division "
        "or modulo by zero"
    )


@pytest.mark.parametrize("argv", [["--help"], ["info", "--help"], ["tidy", "--help"]])
def test_help_tells_what_debug_does(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--debug on an error, print its traceback too (before or after the command)" in out


def test_tidy_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tidy list, and with --delete remove, what killed writes left in a local store" in out
    assert cli.main(["tidy", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "List what a writer killed with SIGKILL can leave in a local Zarr store" in out


def test_tidy_deletes_or_dry_runs_not_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _v3_store(tmp_path / "s.zarr")
    before = sorted(p.name for p in path.rglob("*"))
    assert cli.main(["tidy", str(path), "--delete", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "xarray-gds tidy: error: argument -n/--dry-run: not allowed with argument --delete"
    )
    assert sorted(p.name for p in path.rglob("*")) == before


def _raising(error: Callable[[], BaseException]) -> Callable[[Any], int]:
    def run(args: Any) -> int:
        raise error()

    return run


def _import_error_from_a_missing_module() -> ImportError:
    """ImportError(None) raised from the ModuleNotFoundError, as fsspec raises it."""
    try:
        import xgds_no_such_module  # noqa: F401
    except ImportError as err:
        try:
            raise ImportError(None) from err
        except ImportError as wrapped:
            return wrapped
    raise AssertionError("imported")


def _import_error_in_handling_a_missing_module() -> ImportError:
    """ImportError(None) raised while handling the ModuleNotFoundError (its context)."""
    try:
        import xgds_no_such_module  # noqa: F401
    except ImportError:
        try:
            raise ImportError(None)
        except ImportError as wrapped:
            return wrapped
    raise AssertionError("imported")


def _import_error_caused_outside_a_handler() -> ImportError:
    """ImportError(None) whose cause (of two lines) was set outside any handler (no
    context)."""
    error = ImportError(None)
    error.__cause__ = ModuleNotFoundError("No module named 'xgds_no_such_module'\n  (why)")
    return error


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (_import_error_from_a_missing_module, "No module named 'xgds_no_such_module'"),
        (_import_error_in_handling_a_missing_module, "No module named 'xgds_no_such_module'"),
        (_import_error_caused_outside_a_handler, "No module named 'xgds_no_such_module' (why)"),
        (
            lambda: ImportError(None, name="aiohttp"),
            "a package this needs is not installed (aiohttp)",
        ),
        (ImportError, "a package this needs is not installed (ImportError)"),
        (ValueError, "ValueError"),
        (lambda: ValueError("first line\n  second line"), "first line second line"),
    ],
    ids=[
        "import-error-from",
        "import-error-in-handler",
        "import-error-cause-only",
        "import-error-named",
        "import-error-bare",
        "empty",
        "two-lines",
    ],
)
def test_a_users_error_without_words_of_its_own(
    error: Callable[[], BaseException],
    line: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An error with no text says what it is; an ImportError without text says what its
    cause says, else which package is missing; a text of several lines comes as one."""
    monkeypatch.setattr(cli, "_run_calibrate", _raising(error))
    assert cli.main(["calibrate"]) == 1
    assert capsys.readouterr().err == f"xarray-gds calibrate: error: {line}\n"
    assert cli.main(["calibrate", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):\n" in err
    assert err.endswith(f"\nxarray-gds calibrate: error: {line}\n")
    assert err.splitlines()[-2].strip() != ""  # the traceback's last line, right above


@pytest.mark.parametrize(
    ("error", "internal"),
    [
        (TypeError("unsupported operand"), True),  # a bug of the program, not the user's
        (KeyError("t2m"), True),
        (ValueError("not a Zarr store"), False),
        (FileNotFoundError("no such store"), False),
        (ImportError('reading reference sets needs fsspec: pip install ".[refs]"'), False),
    ],
)
def test_which_errors_are_the_users(
    error: BaseException,
    internal: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def failing(args: Any) -> int:
        raise error

    monkeypatch.setattr(cli, "_run_calibrate", failing)
    assert cli.main(["calibrate"]) == 1
    text = " ".join(str(error).split()) if not isinstance(error, KeyError) else "'t2m'"
    if internal:
        text = (
            f"internal error: {type(error).__name__}: {text}; rerun with --debug for the traceback"
        )
    assert capsys.readouterr().err == f"xarray-gds calibrate: error: {text}\n"


def test_ctrl_c_exits_130_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_calibrate", interrupted)
    assert cli.main(["calibrate"]) == 130
    assert capsys.readouterr() == ("", "")


def test_help_names_debug(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "--debug" in capsys.readouterr().out
    assert cli.main(["info", "--help"]) == 0
    assert "--debug" in capsys.readouterr().out


def test_info_names_the_host_deflate_decoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("deflate")
    from xarray_gds.codecs.formats import deflate

    root = zarr.open_group(tmp_path / "zlib.zarr", mode="w", zarr_format=2)
    root.create_array(
        "v",
        shape=(8,),
        dtype="f4",
        compressors=[numcodecs.Zlib()],
        attributes={"_ARRAY_DIMENSIONS": ["x"]},
    )
    argv = ["info", str(tmp_path / "zlib.zarr"), "--device", "cpu"]
    assert cli.main(argv) == 0
    fast = "libdeflate, threaded; numcodecs for a chunk it cannot decode exactly"
    decode = field(sections(capsys.readouterr().out)["/v"], "decode")
    assert decode == f"batched on the host ({fast})"
    monkeypatch.setitem(sys.modules, "deflate", None)  # not installed
    deflate.libdeflate.cache_clear()
    try:
        assert cli.main(argv) == 0
    finally:
        deflate.libdeflate.cache_clear()
    assert field(sections(capsys.readouterr().out)["/v"], "decode") == (
        "batched on the host (numcodecs, threaded)"
    )

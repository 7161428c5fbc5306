"""What the benchmarks tell a user: a case skipped for want of a GPU names the cases
that run on the host, and the loader cases label their baseline for what it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_doc_blocks import ROOT
from xarray_gds.tools import bench, bench_loader


@pytest.mark.parametrize("name", [n for n, spec in bench.CASES.items() if spec["gpu"]])
def test_a_gpu_case_without_a_gpu_names_the_host_cases(name: str) -> None:
    why = bench.skip_reason(name, cuda=False)
    twin = f"host-{name}"
    named = f"--case {twin}; " if twin in bench.CASES else ""
    assert why == f"needs a GPU (on the host: {named}the host-usage-* cases, docs/performance.md)"
    assert bench.skip_reason(name, cuda=True) != why
    for case in re.findall(r"--case (\S+);", why):
        assert not bench.CASES[case]["gpu"]
        # runs on the host, where the packages of its extras are installed
        assert bench.missing(case) or bench.skip_reason(case, cuda=False) is None


def test_the_host_usage_cases_the_message_names_run_on_the_host() -> None:
    host_usage = [n for n in bench.CASES if n.startswith("host-usage-")]
    assert len(host_usage) >= 4
    assert all(not bench.CASES[n]["gpu"] for n in host_usage)
    page = (ROOT / "docs" / "performance.md").read_text()
    assert all(f"`{n}`" in page for n in host_usage)


def test_the_loader_baseline_without_pytorch_is_labelled_a_plain_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without PyTorch the baseline is engine="zarr" in a loop of this process: it is
    labelled so, not as the DataLoader, and still counts as engine="zarr" in ratios."""
    monkeypatch.setattr(bench_loader, "_torch", lambda: None)
    path = bench_loader.make_era5(tmp_path / "era5.zarr", 0, batch=4)
    made = bench_loader.contenders(4, 4)(path)
    assert set(made) == {"gds-zarr loader", "zarr (one process, no DataLoader)"}
    assert bench_loader.PLAIN == "zarr (one process, no DataLoader)"
    for run in made.values():
        run()
    case = "loader-4x4"
    samples = {label: bench_loader._seen[(case, label)]["samples"] for label in made}
    assert samples["gds-zarr loader"] == samples[bench_loader.PLAIN] == 9 * bench_loader.EPOCHS
    result = bench.Result(case, 1, 1, {"gds-zarr loader": 1.0, bench_loader.PLAIN: 2.0})
    assert result.ratio("gds-zarr loader") == 2.0
    rate = samples["gds-zarr loader"]
    assert bench_loader.note(result) == (
        f"gds-zarr loader {rate:.1f} samples/s; zarr (one process, no DataLoader) "
        f"{rate / 2:.1f} samples/s; loader vs the fastest other: 2.00x"
    )

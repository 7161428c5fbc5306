"""What a new user meets first: the version, the README's install and demo steps,
``scripts/demo.sh``'s install and the distribution checks of ``scripts/check_dist.py``
(``scripts/build-check.sh`` runs the build itself, in ``scripts/test.sh``)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest

import xarray_gds
from xarray_gds.tools import cli

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    """The README's ``## title`` section, up to the next one."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end >= 0 else None]


def _commands(text: str) -> list[str]:
    """The lines of the ```bash blocks of ``text``, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = (line.split("#")[0].strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line]


# --- the version ----------------------------------------------------------------------


def test_version_lives_in_the_package_only() -> None:
    project = PYPROJECT["project"]
    assert "version" not in project
    assert project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "xarray_gds/__init__.py"
    # the installed metadata (built from pyproject.toml) and the package agree
    assert importlib.metadata.version("xarray-gds") == xarray_gds.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", xarray_gds.__version__)


# --- the README -----------------------------------------------------------------------


def test_readme_installs_from_a_checkout() -> None:
    # Not on PyPI yet: every install command of the section installs the checkout, in a
    # virtual environment it makes, with an extra that pyproject.toml defines.
    commands = _commands(_section("Install"))
    assert commands[:3] == [
        "git clone https://github.com/xarray-gds/xarray-gds.git",
        "cd xarray-gds",
        "python3 -m venv .venv",
    ]
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    named = []
    for command in commands[3:]:
        target = re.fullmatch(r'\.venv/bin/pip install (\.|"\.\[(\w+)\]")', command)
        assert target, command
        assert target[2] is None or target[2] in extras, command
        named.append(target[2])
    assert named == ["cuda13", "cuda12", None]
    # the published form is shown, as the future one, outside the commands
    assert 'Once it is published, the same installs will be `pip install "xarray-gds[cuda13]"`' in (
        " ".join(_section("Install").split())
    )
    assert PYPROJECT["project"]["urls"]["Repository"] in commands[0]


def test_readme_demo_then_info_on_the_store_it_keeps() -> None:
    commands = _commands(_section("Run the demo on a fresh machine"))
    demo = re.fullmatch(r"bash scripts/demo\.sh --dir (\S+)", commands[0])
    info = re.fullmatch(r"\.venv/bin/xarray-gds info (\S+)/(\S+)", commands[1])
    assert demo and info, commands
    assert info[1] == demo[1]
    # the store `xarray-gds demo` writes with its default size and format
    args = cli._parser().parse_args(["demo"])
    assert info[2] == f"weather-{args.size}-v{args.zarr_format}.zarr"
    assert f"/{demo[1]}/" in (ROOT / ".gitignore").read_text().splitlines()


def test_readme_docs_serve_after_installing_the_docs_extra() -> None:
    commands = _commands(_section("Documentation"))
    assert commands == ['.venv/bin/pip install -e ".[docs]"', ".venv/bin/mkdocs serve"]
    assert any(
        d.startswith("mkdocs>") for d in PYPROJECT["project"]["optional-dependencies"]["docs"]
    )


# --- scripts/demo.sh and scripts/_env.sh ----------------------------------------------


def _bash() -> str:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    return bash


def test_demo_sh_installs_the_package_alone(tmp_path: Path) -> None:
    # demo.sh run beside a stand-in _env.sh and xarray-gds that record what they get
    scripts, log = tmp_path / "scripts", tmp_path / "log"
    scripts.mkdir()
    shutil.copy(ROOT / "scripts" / "demo.sh", scripts / "demo.sh")
    (scripts / "_env.sh").write_text('setup_venv() { echo "extras=[$*]" >> "$LOG"; }\n')
    fake = tmp_path / "bin" / "xarray-gds"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "run=[$*]" >> "$LOG"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_EXTRA"}
    env.update(LOG=str(log), PATH=f"{fake.parent}{os.pathsep}{env['PATH']}")
    for extra in (None, "cuda13"):
        run_env = env if extra is None else {**env, "CUDA_EXTRA": extra}
        subprocess.run(
            [_bash(), str(scripts / "demo.sh"), "--dir", "demo-data"], env=run_env, check=True
        )
    assert log.read_text().splitlines() == [
        "extras=[]",
        "run=[demo --dir demo-data]",
        "extras=[cuda13]",
        "run=[demo --dir demo-data]",
    ]
    # and the script names no extra of its own (test, docs, virtual)
    text = (ROOT / "scripts" / "demo.sh").read_text()
    assert re.findall(r"^setup_venv .*$", text, flags=re.M) == ['setup_venv "${CUDA_EXTRA:-}"']
    assert not re.search(r"\b(test|docs|virtual)\b", text.split("setup_venv", 1)[1])


@pytest.mark.parametrize(("extras", "target"), [("", "."), ("cuda13", ".[cuda13]")])
def test_setup_venv_installs_the_extras_asked_for(tmp_path: Path, extras: str, target: str) -> None:
    # a stand-in venv whose python records its arguments (and passes the version check)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "$*" >> "$LOG"\n')
    python.chmod(0o755)
    log = tmp_path / "log"
    script = 'source scripts/_env.sh && setup_venv "$1" "$2"'
    subprocess.run(
        [_bash(), "-c", script, "bash", extras, str(tmp_path / "venv")],
        cwd=ROOT,
        env={**os.environ, "LOG": str(log), "PYTHON": str(python)},
        check=True,
    )
    pip = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert pip[-1].split()[-2:] == ["-e", target]


# --- scripts/check_dist.py ------------------------------------------------------------


@pytest.fixture
def check_dist(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / "scripts" / "check_dist.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # the tracked files, as git would list them, without needing a git checkout
    monkeypatch.setattr(
        module, "tracked", lambda: {"pyproject.toml", "README.md", "xarray_gds/__init__.py"}
    )
    return module


def _tar(path: Path, names: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    return path


def test_check_dist_junk(check_dist: ModuleType) -> None:
    names = [
        ".venv/bin/python",
        "docs/site/x.html",
        "xarray_gds/__pycache__/a.cpython-312.pyc",
        "wheels/xarray_gds-0.1.0-py3-none-any.whl",
        "tests/.hypothesis/examples/x",
        "xarray_gds/array.py",
        "xarray_gds/tools/build_info.py",
        "docs/development.md",
    ]
    assert check_dist.junk(names) == names[:5]


def test_check_dist_sdist(check_dist: ModuleType, tmp_path: Path) -> None:
    top = "xarray_gds-0.1.0/"
    good = [top + n for n in ("PKG-INFO", "pyproject.toml", "README.md", "xarray_gds/__init__.py")]
    assert check_dist.check_sdist(_tar(tmp_path / "good.tar.gz", good), "0.1.0") == []
    bad = [*good[:3], top + ".venv/bin/python", "elsewhere.txt"]
    assert check_dist.check_sdist(_tar(tmp_path / "bad.tar.gz", bad), "0.1.0") == [
        "sdist: elsewhere.txt is outside xarray_gds-0.1.0/",
        "sdist: holds .venv/bin/python, which no build needs",
        "sdist: lacks xarray_gds/__init__.py",
    ]


# --- the wheels of a GPU machine without network access --------------------------------


def _gpu_wheels(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-wheels.sh"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": sys.executable},
    )


def test_gpu_wheels_default_list_covers_the_cuda13_extra() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    listed = _gpu_wheels("--list").stdout.split()

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()

    # CuPy is the one package of the extra the GPU image is expected to have
    wanted = {name(r) for r in extras["cuda13"]} - {"cupy-cuda13x"}
    wanted |= {"dask", "distributed", "pytest-asyncio", "pytest-timeout", "cftime", "zarr"}
    assert wanted <= set(listed)
    assert {"pytest-xdist", "dask-cuda", "numcodecs"} <= set(listed)


def test_gpu_wheels_dry_run_prints_the_downloads_and_the_project_wheel(tmp_path: Path) -> None:
    out = tmp_path / "wheels"
    done = _gpu_wheels("--dry-run", "--dir", str(out), "Cftime==1.6.6.1")
    assert done.returncode == 0, done.stderr
    download, wheel, *rest = [line for line in done.stdout.splitlines() if line.startswith("+ ")]
    words = download.split()
    assert words[1:4] == [sys.executable, "-m", "pip"] and words[4] == "download"
    for option in ("--only-binary=:all:", "--no-deps", "--platform"):
        assert option in words
    assert words[words.index("--python-version") + 1] == "3.12"
    assert words[words.index("-d") + 1] == str(out)
    assert "manylinux_2_28_x86_64" in words and "kvikio-cu13" in words
    # a default the arguments name again is left to them: cftime once, pinned
    assert [w for w in words if w.lower().startswith("cftime")] == ["Cftime==1.6.6.1"]
    assert wheel.split()[1:] == [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--disable-pip-version-check",
        "--no-deps",
        "-w",
        str(out),
        ".",
    ]
    assert all(line.startswith("+ echo ") for line in rest)
    assert not out.exists()  # a dry run makes nothing


def test_gpu_wheels_rejects_unknown_options() -> None:
    done = _gpu_wheels("--bogus")
    assert done.returncode == 2
    assert "unknown option --bogus" in done.stderr
    assert "--python-version V" in _gpu_wheels("--help").stdout


def test_gpu_nginx_bundle_serves_with_its_own_libraries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/gpu-nginx.sh: the bundle starts nginx through its own loader and
    libraries (a machine with another C library runs it), and the project's nginx
    runner serves through it when it is first on PATH."""
    from tests._nginx import require_nginx
    from xarray_gds.tools import nginx

    require_nginx()
    bundle = tmp_path / "bundle"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-nginx.sh"), "--dir", str(bundle)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "nginx version: nginx/" in done.stderr
    libs = sorted(p.name for p in (bundle / "lib").iterdir())
    assert "libc.so.6" in libs and any(name.startswith("ld-linux") for name in libs)
    wrapper = (bundle / "nginx").read_text()
    assert "--library-path" in wrapper and os.access(bundle / "nginx", os.X_OK)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "x.bin").write_bytes(b"0123456789")
    monkeypatch.setattr(nginx, "NGINX", str(bundle / "nginx"))
    with nginx.serve(tmp_path / "www", tls=False) as server:
        request = urllib.request.Request(server.http + "/x.bin", headers={"Range": "bytes=2-5"})
        with urllib.request.urlopen(request, timeout=10) as got:
            assert got.status == 206 and got.read() == b"2345"
    assert subprocess.run([str(bundle / "nginx"), "-v"], capture_output=True).returncode == 0


def test_gpu_nginx_bundles_a_bundle_on_path(tmp_path: Path) -> None:
    """scripts/gpu-nginx.sh where the nginx first on PATH is itself its bundle (a GPU
    machine running the tests with one): the bundle is copied whole and runs; bundling
    it into its own folder leaves it as it was."""
    from tests._nginx import require_nginx

    require_nginx()
    script = str(ROOT / "scripts" / "gpu-nginx.sh")
    first = tmp_path / "first"
    made = subprocess.run(["bash", script, "--dir", str(first)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    env = {**os.environ, "PATH": f"{first}{os.pathsep}{os.environ['PATH']}"}
    for target in (tmp_path / "second", first):
        done = subprocess.run(
            ["bash", script, "--dir", str(target)], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr
        assert "nginx version: nginx/" in done.stderr
        assert sorted(p.name for p in (target / "lib").iterdir()) == sorted(
            p.name for p in (first / "lib").iterdir()
        )
        assert (target / "nginx.bin").read_bytes() == (first / "nginx.bin").read_bytes()
        ran = subprocess.run([str(target / "nginx"), "-v"], capture_output=True, text=True)
        assert ran.returncode == 0 and "nginx version" in ran.stderr


@pytest.mark.parametrize("missing", ["nginx.bin", "lib"])
def test_gpu_nginx_takes_no_half_bundle_for_a_bundle(tmp_path: Path, missing: str) -> None:
    """scripts/gpu-nginx.sh: a wrapper script on PATH without both the binary and the
    libraries of a bundle beside it is not copied as one: the script fails (it is no
    nginx binary either) and never leaves a bundle without its binary."""
    half = tmp_path / "half"
    half.mkdir()
    if missing != "lib":
        (half / "lib").mkdir()
    if missing != "nginx.bin":
        (half / "nginx.bin").write_bytes(b"")
    wrapper = half / "nginx"
    wrapper.write_text("#!/bin/sh\nexit 0\n")
    wrapper.chmod(0o755)
    target = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-nginx.sh"), "--dir", str(target)],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{half}{os.pathsep}{os.environ['PATH']}"},
        timeout=60,
    )
    assert done.returncode != 0
    assert "no dynamic loader" in done.stderr
    assert not (target / "nginx").exists()


# --- the extras and the lanes of CI ---------------------------------------------------

FEATURES = ["dask", "refs", "icechunk", "remote", "virtual", "xbatcher", "fast-host"]


def _requirement(text: str) -> tuple[str, str]:
    """``(name, lower bound)`` of a requirement such as ``"dask[array]>=2024.8"``."""
    found = re.fullmatch(r"([\w.-]+)(?:\[[\w,-]+\])?(?:>=([\w.]+))?", text)
    assert found, text
    return found[1], found[2] or ""


def test_extras_by_feature_and_the_tools_built_from_them() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) == {
        *FEATURES,
        "all",
        "cuda12",
        "cuda13",
        "test-base",
        "test",
        "docs",
        "dev",
        "bench",
    }
    assert extras["all"] == [f"xarray-gds[{','.join(FEATURES)}]"]
    # the suite's extra: every feature and the runner, then what the tests compare with
    assert extras["test"][0] == "xarray-gds[all,test-base]"
    assert [_requirement(r)[0] for r in extras["test-base"]] == [
        "pytest",
        "pytest-asyncio",
        "pytest-timeout",
        "hypothesis",
    ]
    tools = {_requirement(r)[0] for e in ("test-base", "test", "docs", "dev") for r in extras[e]}
    for feature in FEATURES:  # a user's extra brings no test or docs tool
        assert not {_requirement(r)[0] for r in extras[feature]} & tools - {"h5py"}, feature


def test_readme_lists_every_feature_extra() -> None:
    rows = re.findall(r"^\| `([\w-]+)` \| ", _section("Install"), flags=re.M)
    assert rows == [*FEATURES, "all"]
    assert 'pip install ".[refs]" in a checkout of xarray-gds' in _section("Install")


def test_lowest_pins_are_the_lower_bounds() -> None:
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints" / "min.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    extras = PYPROJECT["project"]["optional-dependencies"]
    bounds = dict(
        _requirement(r)
        for r in [*PYPROJECT["project"]["dependencies"], *extras["dask"], *extras["fast-host"]]
    )
    assert {name: pins[name] for name in bounds} == {
        name: bound + ".0" * (2 - bound.count(".")) for name, bound in bounds.items()
    }
    assert set(pins) - set(bounds) == {"pandas"}  # what xarray needs, not a bound of ours


def _lines(path: Path) -> list[str]:
    """A script's lines, without comments (the shebang among them) and blank lines."""
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_ci_runs_the_readme_demo_then_both_lanes() -> None:
    demo = _commands(_section("Run the demo on a fresh machine"))
    assert _lines(ROOT / ".ci" / "run") == [
        "set -e",
        'cd "$(dirname "$0")/.."',
        *demo,
        *_commands(_section("Run the tests")),
        "bash scripts/test-min.sh",
    ]
    assert demo == [
        "bash scripts/demo.sh --dir demo-data",
        ".venv/bin/xarray-gds info demo-data/weather-small-v3.zarr",
    ]


def test_lowest_lane_runs_the_base_install_then_the_dask_extra() -> None:
    text = (ROOT / "scripts" / "test-min.sh").read_text()
    assert re.findall(r"^setup_venv .*$", text, flags=re.M) == [
        "setup_venv test-base .venv-min 3.12 -c constraints/min.txt"
    ]
    assert '-e ".[test-base,dask,fast-host]"' in text
    assert re.findall(r"^setup_venv .*$", (ROOT / "scripts" / "test.sh").read_text(), re.M) == [
        'setup_venv "test,docs,dev"'
    ]

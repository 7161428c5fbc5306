"""The optional packages of xarray-gds and the extras that install them.

The base install (numpy, xarray, zarr, numcodecs) opens local Zarr stores; each other
feature needs packages that an extra of ``pyproject.toml`` brings. An optional package
is imported where its feature is used, through :func:`need`, so that a missing one
raises :class:`ImportError` naming the feature and the extra to install. The CUDA
libraries have their own messages (:mod:`xarray_gds.device`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "install_hint", "missing_message", "need"]

#: the extra of pyproject.toml that brings each optional package (import names)
EXTRAS = {
    "dask": "dask",
    "distributed": "dask",
    "fsspec": "refs",
    "kerchunk": "refs",
    "h5py": "refs",
    "fastparquet": "refs",
    "icechunk": "icechunk",
    "obstore": "remote",
    "s3fs": "remote",
    "aiohttp": "remote",
    "virtualizarr": "virtual",
    "obspec_utils": "virtual",
    "xbatcher": "xbatcher",
    "deflate": "fast-host",
}


def install_hint(extras: str | list[str]) -> str:
    """The command that installs ``extras`` into a checkout's environment (xarray-gds
    is installed from a checkout: the README's Install section)."""
    names = [extras] if isinstance(extras, str) else list(extras)
    return f'pip install ".[{",".join(names)}]"'


def missing_message(package: str, purpose: str, extra: str | None = None) -> str:
    """The message of a missing optional ``package``: what needs it, and the extra
    (``extra``, else the one :data:`EXTRAS` names) that installs it."""
    extra = extra or EXTRAS.get(package)
    if extra is None:
        return f"{purpose} needs {package}, which is not installed: pip install {package}"
    return f"{purpose} needs {package}: {install_hint(extra)} in a checkout of xarray-gds"


def need(module: str, purpose: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` (``"fsspec"``, ``"dask.array"``) for ``purpose`` (what the
    user asked for: ``"reading reference sets"``).

    Raises
    ------
    ImportError
        ``module`` or a package it imports is not installed; the message names the
        missing package and the extra that installs it, the original error chained.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing = (err.name or module).split(".")[0]
        raise ImportError(missing_message(missing, purpose, extra), name=missing) from err

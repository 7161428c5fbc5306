"""The suite's fast file server: :mod:`xarray_gds.tools.nginx` (the benchmarks' too)."""

import os

import pytest

from xarray_gds.tools.nginx import NGINX, Nginx, Request, serve

__all__ = ["NGINX", "Nginx", "Request", "require_nginx", "serve"]


def require_nginx() -> None:
    """Skip the calling test where nginx is not installed; fail it in CI, where
    ``scripts/test.sh`` installs it."""
    if NGINX is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is not installed: scripts/test.sh installs it (ensure_nginx)")
        pytest.skip("nginx is not installed (apt-get install nginx)")

"""The suite's fast file server: :mod:`xarray_gds.tools.nginx` (the benchmarks' too)."""

from xarray_gds.tools.nginx import NGINX, Nginx, Request, serve

__all__ = ["NGINX", "Nginx", "Request", "serve"]

"""The suite's loopback S3 server: moto's threaded server on 127.0.0.1, started and
stopped by the test that uses it, each within a bounded time.

Port 0: the operating system gives a free port when the server binds, so no other
process can take it between choosing and binding. moto keeps its buckets in the
process, shared by every server started in it: give each test module buckets of its
own names. ``xarray_gds.tools.s3_server`` is the benchmarks' server (a process of its
own, so that its request handling does not take the GIL from the client measured).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["REGION", "client", "loopback_s3", "storage_options"]

REGION = "us-east-1"
#: seconds the server may take to start listening, and to stop
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def _bounded(step: Any, timeout: float, what: str) -> None:
    """Run ``step()`` in a daemon thread and wait for it ``timeout`` seconds at most;
    raise what it raised, or RuntimeError naming ``what`` when it took longer."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except BaseException as err:  # handed to the caller
            failed.append(err)

    thread = threading.Thread(target=run, name=f"moto-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RuntimeError(f"the loopback moto S3 server did not {what} within {timeout:.0f} s")
    if failed:
        raise failed[0]


@contextmanager
def loopback_s3(timeout: float = START_TIMEOUT) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a port the system chooses), running for the
    ``with`` block; yields its endpoint URL. Needs ``moto[server]`` (the test extra)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    _bounded(server.start, timeout, "start")
    try:
        host, port = server.get_host_and_port()
        if host != "127.0.0.1":
            raise RuntimeError(f"the moto S3 server listens on {host}, not 127.0.0.1")
        yield f"http://{host}:{port}"
    finally:
        _bounded(server.stop, STOP_TIMEOUT, "stop")


def client(endpoint: str, key: str, secret: str, **config: Any) -> Any:
    """A boto3 S3 client of the server at ``endpoint`` (moto takes any credentials)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name=REGION,
        config=Config(connect_timeout=10, read_timeout=60, **config),
    )


def storage_options(endpoint: str, key: str, secret: str, **extra: Any) -> dict[str, Any]:
    """s3fs's ``storage_options`` for the server at ``endpoint``."""
    return {
        "key": key,
        "secret": secret,
        "endpoint_url": endpoint,
        "client_kwargs": {"region_name": REGION},
        **extra,
    }

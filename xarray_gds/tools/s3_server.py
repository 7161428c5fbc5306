"""A tool for the benchmarks and tests, not part of the engine: a moto S3 server on the
loopback interface, the remote store of the ``remote-*`` cases of ``xarray-gds bench``
(:mod:`xarray_gds.tools.bench`). Needs ``moto[server]`` and ``boto3`` (the ``test``
extra).
"""

from __future__ import annotations

from typing import Any

__all__ = ["loopback_s3", "stop"]

#: the server's storage_options (started once, stopped at exit)
_S3: dict[str, Any] = {}


def loopback_s3() -> dict[str, Any]:
    """storage_options of a moto S3 server on 127.0.0.1 (a free port), started once in
    a process of its own (``python -m moto.server``), as a real server is: in this
    process its request handling (about 100 ``stat`` calls a request, looking up its
    backends) would take the GIL from the client being measured."""
    if not _S3:
        import atexit
        import socket
        import subprocess
        import sys
        import time

        import boto3
        import botocore.exceptions

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        atexit.register(stop, server)
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        )
        for _ in range(300):  # up to 30 s for the server to answer
            if server.poll() is not None:
                raise RuntimeError(f"the moto server exited with {server.returncode}")
            try:
                client.create_bucket(Bucket="bench")
                break
            except botocore.exceptions.EndpointConnectionError:  # not listening yet
                time.sleep(0.1)
        else:
            stop(server)
            raise RuntimeError(f"the moto server on {endpoint} did not answer in 30 s")
        _S3.update(
            key="bench",
            secret="bench",
            endpoint_url=endpoint,
            client_kwargs={"region_name": "us-east-1"},
        )
    return _S3


def stop(server: Any) -> None:
    """End the server process ``server``: terminated, killed if it does not exit in 10 s."""
    import subprocess

    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()

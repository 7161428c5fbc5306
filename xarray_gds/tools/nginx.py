"""A tool for the tests and benchmarks, not part of the engine: a fast file server,
Debian's nginx serving a folder on 127.0.0.1 (the ``host-remote-*`` and ``remote-*``
cases of ``xarray-gds bench`` and the tests of remote reads use it).

:func:`serve` writes a configuration of its own (pid file, logs and temporary paths in
a fresh folder, nothing under ``/etc`` or ``/var``), starts ``nginx`` in the
foreground on a free port of 127.0.0.1 (HTTP, and HTTPS with a certificate made for
the run, signed by an authority made for the run: :attr:`Nginx.cafile`), and stops it
by its pid, each step within a bounded time.

What it serves, for both the HTTP and the S3 clients of the engine and of zarr:

- ``GET`` and ``HEAD`` of the folder's files, with byte ranges (``Range``), so a
  path-style S3 URL ``/bucket/key`` is the file ``bucket/key`` of the folder;
  ``Authorization`` headers are ignored (any credentials read);
- listing is refused, never answered empty: S3 list requests (``list-type``,
  ``prefix`` or ``delimiter`` in the query) get ``501 Not Implemented`` and a folder's
  URL ``403``. A client that took an empty listing for a complete one would read every
  chunk as fill values;
- everything under ``/private/`` is ``403`` (a file the server may not read), and so
  are the paths given as ``forbidden``.

Every request is logged as ``METHOD URI STATUS RANGE`` (:meth:`Nginx.requests`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NGINX", "Nginx", "Request", "serve"]

#: the nginx binary, or None where it is not installed (``scripts/test.sh`` installs it)
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)
#: seconds nginx may take to start listening, and to stop
START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0

_CONF = """\
daemon off;
master_process on;
{user}worker_processes {workers};
pid {run}/nginx.pid;
error_log {run}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    default_type application/octet-stream;
    log_format requests '$request_method $request_uri $status $http_range';
    access_log {run}/access.log requests;
    client_body_temp_path {run}/body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    server_tokens off;
    server {{
        listen 127.0.0.1:{port};
        {tls}
        root {root};
        autoindex off;
        location /private/ {{ return 403; }}
{forbidden}
        location / {{
            if ($args ~* "(^|&)(list-type|prefix|delimiter)=") {{ return 501; }}
        }}
    }}
}}
"""
_TLS = """listen 127.0.0.1:{port} ssl;
        ssl_certificate {run}/cert.pem;
        ssl_certificate_key {run}/key.pem;"""


@dataclass(frozen=True)
class Request:
    """One request nginx served, from its access log."""

    method: str
    uri: str
    status: int
    range: str  #: the ``Range`` header, ``-`` when there was none


@dataclass
class Nginx:
    """A running server (see :func:`serve`)."""

    root: Path
    http: str  #: ``http://127.0.0.1:PORT``
    https: str | None  #: ``https://127.0.0.1:PORT`` (None when started without TLS)
    cafile: Path | None  #: the certificate of the authority that signed the server's
    run: Path
    pid: int
    skip: int = 0  #: lines of the access log that :meth:`clear` left out
    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        """Stop the server now (the block's end does nothing more): a server gone in
        the middle of a read."""
        if self.proc is not None:
            _stop(self.proc)

    def requests(self) -> list[Request]:
        """Every request served so far, in the order nginx finished them.

        A marker request is sent and waited for in the log first: nginx writes a
        request's line after its response, so without it the last requests of the
        caller could still be missing. With one worker (the default) requests are
        finished in the order they came, so every request made before this call is in
        the list.
        """
        marker = f"/.served-{time.monotonic_ns()}"
        with contextlib.suppress(urllib.error.HTTPError):  # 404, as wanted
            urllib.request.urlopen(self.http + marker, timeout=STOP_TIMEOUT).close()
        deadline = time.monotonic() + STOP_TIMEOUT
        while True:
            lines = (self.run / "access.log").read_text().splitlines()
            if any(f" {marker} " in line for line in lines):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"nginx did not log {marker} within {STOP_TIMEOUT} s")
            time.sleep(0.01)
        out = []
        for line in lines[self.skip :]:
            method, uri, status, rng = line.split(" ", 3)
            if uri.startswith("/.served-"):
                continue
            out.append(Request(method, uri, int(status), rng))
        return out

    def clear(self) -> None:
        """Leave out of :meth:`requests` every request served so far."""
        self.requests()
        self.skip = len((self.run / "access.log").read_text().splitlines())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _certificate(run: Path) -> None:
    """An authority (``ca.pem``) and the server's certificate for 127.0.0.1 signed by it
    (``cert.pem``, ``key.pem``): a certificate that is its own authority is refused by
    some TLS stacks (rustls: "CA used as end entity") whatever they trust."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=xarray-gds test authority",
        "-keyout", str(run / "ca-key.pem"), "-out", str(run / "ca.pem"),
    )  # fmt: skip
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(run / "key.pem"), "-out", str(run / "server.csr"),
    )  # fmt: skip
    (run / "ext.cnf").write_text(
        "basicConstraints=CA:FALSE\nsubjectAltName=IP:127.0.0.1\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    openssl(
        "x509", "-req", "-in", str(run / "server.csr"), "-days", "2",
        "-CA", str(run / "ca.pem"), "-CAkey", str(run / "ca-key.pem"), "-CAcreateserial",
        "-extfile", str(run / "ext.cnf"), "-out", str(run / "cert.pem"),
    )  # fmt: skip


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _start(
    root: Path, run: Path, workers: int, tls: bool, forbidden: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int, int]:
    port, tls_port = _free_port(), _free_port() if tls else 0
    conf = _CONF.format(
        # workers of a master started as root run as this user (not nginx's default,
        # nobody), so that they read the files a test wrote under its own user
        user=f"user {pwd.getpwuid(os.getuid()).pw_name};\n" if os.getuid() == 0 else "",
        workers=workers,
        run=run,
        root=root.resolve(),
        port=port,
        tls=_TLS.format(port=tls_port, run=run) if tls else "",
        forbidden="".join(
            f"        location = /{path.strip('/')} {{ return 403; }}\n" for path in forbidden
        ),
    )
    (run / "nginx.conf").write_text(conf)
    (run / "access.log").write_text("")
    proc = subprocess.Popen(
        [str(NGINX), "-p", str(run), "-c", str(run / "nginx.conf"), "-e", str(run / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + START_TIMEOUT
    while not (_listening(port) and (not tls or _listening(tls_port))):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            err = proc.stderr.read().decode() if proc.stderr else ""
            log = (run / "error.log").read_text() if (run / "error.log").exists() else ""
            raise OSError(f"nginx did not start on 127.0.0.1:{port}: {err}{log}")
        time.sleep(0.01)
    return proc, port, tls_port


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # fast shutdown of the master and its workers
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)
    if proc.stderr:
        proc.stderr.close()


@contextmanager
def serve(
    root: Path, *, tls: bool = True, workers: int = 1, forbidden: tuple[str, ...] = ()
) -> Iterator[Nginx]:
    """nginx serving the files under ``root`` on 127.0.0.1 while the block runs.

    ``workers``: nginx's worker processes (1 keeps :meth:`Nginx.requests` in arrival
    order; benchmarks ask for more). ``forbidden``: paths under ``root`` answered
    ``403`` (an object the server may not read). A port taken between its choice and nginx's start
    is retried with another, three times at most.
    """
    if NGINX is None:
        raise FileNotFoundError("nginx is not installed (apt-get install nginx)")
    run = Path(tempfile.mkdtemp(prefix="xarray-gds-nginx-"))
    try:
        if tls:
            _certificate(run)
        for attempt in range(3):
            try:
                proc, port, tls_port = _start(root, run, workers, tls, forbidden)
                break
            except OSError:
                if attempt == 2:
                    raise
        try:
            yield Nginx(
                root=root,
                http=f"http://127.0.0.1:{port}",
                https=f"https://127.0.0.1:{tls_port}" if tls else None,
                cafile=run / "ca.pem" if tls else None,
                run=run,
                pid=proc.pid,
                proc=proc,
            )
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(run, ignore_errors=True)

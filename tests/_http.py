"""The suite's loopback HTTP server: the files of a folder, with single byte ranges
(what zarr's ``FsspecStore`` over HTTP asks for: a shard's index is a range request),
on 127.0.0.1 at a port the system chooses, started and stopped by the test that uses
it, each within a bounded time."""

from __future__ import annotations

import http.server
import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["RangeHandler", "serve"]

#: seconds the server's thread may take to stop
STOP_TIMEOUT = 5.0


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Files under the server's directory, with single byte ranges; 403 under /private/."""

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def send_head(self) -> Any:
        if self.path.startswith("/private/"):
            self.send_error(403)
            return None
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        data = Path(path).read_bytes()
        header = self.headers.get("Range")
        status, body = 200, data
        start = end = 0
        if header and header.startswith("bytes="):
            first, _, last = header[6:].partition("-")
            if first == "":
                start, end = max(0, len(data) - int(last)), len(data) - 1
            else:
                start = int(first)
                end = min(int(last), len(data) - 1) if last else len(data) - 1
            status, body = 206, data[start : end + 1]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        return io.BytesIO(body)


class _Server(http.server.ThreadingHTTPServer):
    # the default backlog (5) drops the connections a read opens at once beyond it, and
    # the client sends them again a second later
    request_queue_size = 128


@contextmanager
def serve(root: Path, handler: type[RangeHandler] = RangeHandler) -> Iterator[str]:
    """The files of ``root`` served over HTTP for the ``with`` block; yields the base
    URL (``http://127.0.0.1:PORT``)."""

    def make(*args: Any, **kwargs: Any) -> RangeHandler:
        return handler(*args, directory=str(root), **kwargs)

    server = _Server(("127.0.0.1", 0), make)
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="http-server", daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(STOP_TIMEOUT)

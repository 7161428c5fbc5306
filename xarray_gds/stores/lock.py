"""One writer at a time per store: the lock a write holds while metadata is held back.

A :class:`~xarray_gds.deferred.HeldMetadataStore` over a local or memory store takes
the store's writer lock when it is made, and the end of the write (flush or discard)
gives it back: it spans what :func:`xarray_gds.to_zarr` does, from xarray reading the
metadata through the chunk writes to the metadata written last. A second writer of the same store
waits, then reads the metadata the first one wrote (its append lands after the first
one's), or fails after ``timeout`` seconds naming the writer that holds the lock.

- Local directories: an advisory ``flock`` on the file ``.<name>.xarray-gds.lock``
  beside the store's directory (its real path: links to one store share the lock),
  holding the process id and host name of the writer that holds it. Beside, not in
  it: zarr warns about files it does not know in a hierarchy (Zarr v3), and
  ``mode="w"`` removes the whole directory. The file is left in place (removing a
  lock file lets a third writer lock a new file while the second holds the old).
  Every process of one machine that writes through xarray-gds takes it; writers that
  do not (``engine="zarr"``, other tools) are not excluded. Lock files on network
  file systems are as reliable as the file system's locks.
- Memory stores: a lock of the process (a memory store is not shared between them).
- Other stores (S3, HTTP, ``FsspecStore``): no lock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "FileLock", "ProcessLock", "lock_path"]

#: Seconds a writer waits for another one's lock by default.
DEFAULT_TIMEOUT = 600.0

_memory_locks: dict[str, threading.Lock] = {}
_memory_holders: dict[str, str] = {}
_memory_guard = threading.Lock()


def lock_path(root: str | os.PathLike[str]) -> Path:
    """The lock file of the local store at ``root``: ``.<name>.xarray-gds.lock`` beside
    the directory that ``root`` resolves to."""
    real = Path(os.path.realpath(root))
    return real.parent / f".{real.name}.xarray-gds.lock"


class FileLock:
    """An advisory ``flock`` on the file ``path``, naming its holder in the file: taken
    by :meth:`acquire`, given back by :meth:`release`. ``store`` names the store in
    errors."""

    def __init__(self, path: Path, store: Any) -> None:
        self.path = path
        self.store = store
        self._fd: int | None = None

    def acquire(self, timeout: float | None = DEFAULT_TIMEOUT) -> FileLock:
        """Wait until no other writer holds the lock, at most ``timeout`` seconds
        (``None``: as long as it takes); returns the lock.

        Raises
        ------
        TimeoutError
            After ``timeout`` seconds, naming the lock file and the writer holding it.
        """
        self._acquire_file(self.path, timeout)
        return self

    def release(self) -> None:
        """Give the lock back (nothing when it is not held)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor of the file releases the flock

    def _acquire_file(self, path: Path, timeout: float | None) -> None:
        import fcntl

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as err:
            warnings.warn(
                f"xarray-gds: cannot make the writer lock file {path} ({err}): writing "
                f"{self.store} without it, so a concurrent writer of the same store is not "
                "excluded. Make the directory of the store writable to have it.",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
                        raise TimeoutError(
                            f"xarray-gds: {self.store} is being written by another writer "
                            f"({holder or 'not recorded'}), which holds its lock file {path}; "
                            f"waited {timeout} s. Wait for that write to finish, or raise "
                            "lock_timeout."
                        ) from None
                    time.sleep(delay if left is None else min(delay, left))
                    delay = min(2 * delay, 0.05)
            with contextlib.suppress(OSError):  # who holds it: for the others' errors only
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd


class ProcessLock:
    """A lock of this process named by ``key`` (a memory store's, shared by its copies):
    taken by :meth:`acquire`, given back by :meth:`release`."""

    def __init__(self, key: str, store: Any) -> None:
        self.key = key
        self.store = store
        self._held = False

    def acquire(self, timeout: float | None = DEFAULT_TIMEOUT) -> ProcessLock:
        """As :meth:`FileLock.acquire`, within this process."""
        key = self.key
        with _memory_guard:
            lock = _memory_locks.setdefault(key, threading.Lock())
        if not lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise TimeoutError(
                f"xarray-gds: {self.store} is being written by another writer "
                f"({_memory_holders.get(key, 'not recorded')}); waited {timeout} s. Wait for "
                "that write to finish, or raise lock_timeout."
            )
        _memory_holders[key] = f"thread {threading.current_thread().name!r}"
        self._held = True
        return self

    def release(self) -> None:
        """Give the lock back (nothing when it is not held)."""
        if self._held:
            self._held = False
            _memory_holders.pop(self.key, None)
            _memory_locks[self.key].release()

"""One writer at a time per store: the lock a write holds while metadata is held back.

A :class:`~xarray_gds.deferred.HeldMetadataStore` over a local or memory store takes
the store's writer lock when it is made, and the end of the write (flush or discard)
gives it back: it spans what :func:`xarray_gds.to_zarr` does, from xarray reading the
metadata through the chunk writes to the metadata written last. A second writer of the same store
waits, then reads the metadata the first one wrote (its append lands after the first
one's), or fails after ``timeout`` seconds naming the writer that holds the lock.

- Local directories: an advisory ``flock`` on the file ``.xarray-gds.lock`` in the
  store's root directory (its real path: links to one store share the lock), holding
  the process id and host name of the writer that holds it. Inside, so that a write
  leaves nothing outside the store and needs no write access to the directory above
  it (a store whose root does not exist yet is made first). The file is not zarr's:
  the store's listings leave it out, and a ``mode="w"`` write, which deletes the
  store's contents, keeps it. The writer that holds the lock removes the file when
  it gives the lock back; a writer that waited on a removed file finds, once it has
  the ``flock``, that the path no longer names the file it locked, and takes the
  lock again on the file now there (so a removed lock file never lets two writers
  in). A killed writer's file stays in the store until the next write or
  :func:`xarray_gds.tidy` takes the lock and removes it; its ``flock`` died with the
  process. Every process of one machine that writes through xarray-gds takes it;
  writers that do not (``engine="zarr"``, other tools) are not excluded. Lock files
  on network file systems are as reliable as the file system's locks.
- Memory stores: a lock of the process (a memory store is not shared between them).
- Other stores (S3, HTTP, ``FsspecStore``): no lock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from xarray_gds.errors import WriterLockWarning, warn

__all__ = ["DEFAULT_TIMEOUT", "LOCK_NAME", "FileLock", "ProcessLock", "lock_path"]

#: Seconds a writer waits for another one's lock by default.
DEFAULT_TIMEOUT = 600.0

#: The name of a local store's lock file, in its root directory.
LOCK_NAME = ".xarray-gds.lock"

_memory_locks: dict[str, threading.Lock] = {}
_memory_holders: dict[str, str] = {}
_memory_guard = threading.Lock()


def lock_path(root: str | os.PathLike[str]) -> Path:
    """The lock file of the local store at ``root``: :data:`LOCK_NAME` in the directory
    that ``root`` resolves to."""
    return Path(os.path.realpath(root)) / LOCK_NAME


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        there = os.stat(path)
    except OSError:
        return False
    here = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)


class FileLock:
    """An advisory ``flock`` on the file ``path``, naming its holder in the file: taken
    by :meth:`acquire`, given back (and the file removed) by :meth:`release`. ``store``
    names the store in errors."""

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
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._fd is None:
            fd = self._open()
            if fd is None:
                return self
            self._fd = self._lock(fd, deadline, timeout)
        return self

    def release(self) -> None:
        """Give the lock back and remove the lock file (nothing when it is not held)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                if _same_file(fd, self.path):  # never another writer's file
                    os.unlink(self.path)  # while locked: a waiter then sees it gone
            os.close(fd)  # closing the last descriptor of the file releases the flock

    def _open(self) -> int | None:
        """The lock file, open (made, with the store's root, where missing); None, with
        a warning, when it cannot be made."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as err:
            warn(
                f"xarray-gds: cannot make the writer lock file {self.path} ({err}): writing "
                f"{self.store} without it, so a concurrent writer of the same store is not "
                "excluded. Make the store's directory writable to have it.",
                WriterLockWarning,
            )
            return None

    def _lock(self, fd: int, deadline: float | None, timeout: float | None) -> int | None:
        """``flock`` the open lock file ``fd``, waiting until ``deadline``; returns
        ``fd`` locked, or None (``fd`` closed) when the path names another file by
        then (its holder removed it: the caller opens the new one)."""
        import fcntl

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
                            f"({holder or 'not recorded'}), which holds its lock file "
                            f"{self.path}; waited {timeout} s. Wait for that write to "
                            "finish, or raise lock_timeout."
                        ) from None
                    time.sleep(delay if left is None else min(delay, left))
                    delay = min(2 * delay, 0.05)
            if not _same_file(fd, self.path):
                os.close(fd)  # the file of a writer that has ended: take the new one
                return None
            with contextlib.suppress(OSError):  # who holds it: for the others' errors only
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd


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

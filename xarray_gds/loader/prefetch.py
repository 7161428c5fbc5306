"""The background thread that reads a :class:`~xarray_gds.loader.BatchLoader`'s next
batches while the caller uses the current one."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from xarray_gds import device as _device
from xarray_gds.loader.variables import Var

__all__ = ["Prefetcher", "current_gpu"]


class Prefetcher:
    """Reads the batches of one iteration (``read(samples)`` each of ``plan``) in a
    background thread, on CUDA device ``gpu`` (None for host data), ``depth`` ahead of
    the one the caller holds at most (a slot a batch: taken before its read starts,
    given back when the caller takes a batch)."""

    def __init__(
        self,
        read: Callable[[np.ndarray], Any],
        plan: list[np.ndarray],
        depth: int,
        gpu: int | None,
    ) -> None:
        self._read = read
        self._plan = plan
        self._slots = threading.Semaphore(depth)
        self._ready: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._stopping = threading.Event()
        self._state = threading.Condition()
        self._blocked_at: int | None = None  #: the batch whose read waits for a slot
        self._gpu = gpu
        self._thread = threading.Thread(target=self._run, name="xarray-gds-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with _device.on_gpu(self._gpu):
            for i, samples in enumerate(self._plan):
                if not self._slots.acquire(blocking=False):
                    with self._state:
                        self._blocked_at = i
                        self._state.notify_all()
                    self._slots.acquire()
                    with self._state:
                        self._blocked_at = None
                if self._stopping.is_set():
                    return
                try:
                    batch = self._read(samples)
                    _sync(self._gpu)
                except BaseException as err:
                    self._ready.put((False, err))
                    return
                self._ready.put((True, batch))

    def take(self) -> Any:
        ok, value = self._ready.get()
        self._slots.release()
        if not ok:
            raise value
        return value

    def wait_blocked(self, i: int, timeout: float) -> bool:
        """Wait until the thread waits for a slot to read the ``i``-th batch of its plan
        (True), or ``timeout`` seconds (False)."""
        with self._state:
            return self._state.wait_for(lambda: self._blocked_at == i, timeout)

    def stop(self) -> None:
        self._stopping.set()
        self._slots.release()  # a thread waiting for a slot sees the stop
        self._thread.join()


def current_gpu(variables: list[Var]) -> int | None:
    """The CUDA device current in the calling thread, for a loader of device data."""
    if not any(v.device == "cuda" for v in variables):
        return None
    return int(_device.cupy().cuda.runtime.getDevice())


def _sync(gpu: int | None) -> None:
    """Wait for the batch's kernels, so that a consumer on any stream sees it whole."""
    if gpu is not None:
        _device.cupy().cuda.get_current_stream().synchronize()

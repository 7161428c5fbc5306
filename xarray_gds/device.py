"""Device choice and the one place where CUDA libraries are imported.

Nothing here imports CuPy, kvikio or nvCOMP at module import time: ``import
xarray_gds`` works on a machine without CUDA. The GPU libraries load on first use,
and a missing one raises :class:`ImportError` naming the extra to install.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from types import ModuleType
from typing import Any, Literal

import numpy as np

from xarray_gds import config
from xarray_gds.errors import HostRouteWarning, warn

Device = Literal["cuda", "cpu"]

#: xarray-gds is installed from a checkout (the README's Install section)
INSTALL_HINT = (
    "install the CUDA extra matching your driver from a checkout of xarray-gds: "
    '`pip install ".[cuda13]"` (CUDA 13) or `pip install ".[cuda12]"` (CUDA 12), '
    "as the README's Install section says"
)


class NoCudaDeviceError(RuntimeError):
    """Raised when ``device="cuda"`` is asked for but no usable GPU is present."""


def _import(name: str, purpose: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"xarray-gds needs the `{name}` package {purpose}, but it could not be "
            f"imported ({err}); {INSTALL_HINT}."
        ) from err


def cupy() -> ModuleType:
    """Return the ``cupy`` module, importing it on first use."""
    return _import("cupy", "to hold arrays in GPU memory")


def kvikio() -> ModuleType:
    """Return the ``kvikio`` module, importing and configuring it on first use.

    kvikio's thread pool defaults to one thread, which caps compat-mode reads at a
    few GB/s. Where the pool is still at that default when xarray-gds first uses
    kvikio (``KVIKIO_NTHREADS`` unset, no ``kvikio.defaults.set("num_threads", ...)``
    before), it takes up to 16 threads; a user's own setting is never changed.
    """
    module = _import("kvikio", "to read files into GPU memory")
    _configure_kvikio(module)
    return module


@functools.cache
def _configure_kvikio(module: ModuleType) -> None:
    if "KVIKIO_NTHREADS" in os.environ:
        return
    threads = min(16, os.cpu_count() or 1)
    defaults = importlib.import_module("kvikio.defaults")
    if _kvikio_threads(defaults) not in (None, 1):
        return  # set by the user (kvikio's own default is one thread)
    try:
        defaults.set("num_threads", threads)
    except (AttributeError, TypeError):  # kvikio < 25: the older setter
        with contextlib.suppress(AttributeError):
            defaults.num_threads_reset(threads)


def _kvikio_threads(defaults: ModuleType) -> int | None:
    """kvikio's thread pool size, or None where this kvikio does not say."""
    with contextlib.suppress(AttributeError, TypeError, KeyError, ValueError):
        return int(defaults.get("num_threads"))
    with contextlib.suppress(AttributeError, TypeError):
        return int(defaults.num_threads())
    return None


@functools.cache
def cuda_status() -> tuple[bool, str]:
    """Whether a CUDA device can be used, and if not, why not.

    Returns
    -------
    (available, reason)
        ``reason`` is empty when a device is available.
    """
    if config.get("disable_cuda"):
        return False, "xarray_gds.disable_cuda (XARRAY_GDS_DISABLE_CUDA) is set"
    try:
        cp = importlib.import_module("cupy")
    except ImportError as err:
        return False, f"CuPy is not installed ({err}); {INSTALL_HINT}"
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError: no driver, no device
        return False, f"CuPy found no usable CUDA driver or device ({err})"
    if count < 1:
        return False, "CuPy reports zero CUDA devices"
    try:
        importlib.import_module("kvikio")
    except ImportError as err:
        return False, f"kvikio is not installed ({err}); {INSTALL_HINT}"
    return True, ""


_warned_fallback = False

#: the forms ``device`` takes, as error messages list them
DEVICE_FORMS = "None (a GPU when one is usable), 'cpu', 'gpu' or 'cuda', or 'cuda:N' (GPU number N)"


def parse_device(device: str | None) -> tuple[Device | None, int | None]:
    """Check the form of the user's ``device`` argument, without looking for a GPU.

    Parameters
    ----------
    device : {None, "cpu", "gpu", "cuda", "cuda:N"}
        ``"host"`` is taken for ``"cpu"``; ``"gpu"`` and ``"cuda"`` mean the current
        CUDA device, ``"cuda:N"`` GPU number ``N`` (counted from 0, as CuPy counts).

    Returns
    -------
    (device, gpu)
        ``device`` is ``None`` (choose), ``"cuda"`` or ``"cpu"``; ``gpu`` the GPU
        number of ``"cuda:N"``, else ``None``.

    Raises
    ------
    TypeError
        ``device`` is not a string or None.
    ValueError
        ``device`` is a string of none of these forms; the message lists them.
    """
    if device is None:
        return None, None
    if not isinstance(device, str):
        raise TypeError(f"device must be {DEVICE_FORMS}, not {type(device).__name__}")
    text = device.strip().lower()
    if text in ("cpu", "host"):
        return "cpu", None
    if text in ("cuda", "gpu"):
        return "cuda", None
    kind, sep, number = text.partition(":")
    if kind == "cuda" and sep and number.isdigit() and number.isascii():
        return "cuda", int(number)
    raise ValueError(f"device must be {DEVICE_FORMS}; got {device!r}")


def resolve_device(device: str | None) -> Device:
    """Turn the user's ``device`` argument into ``"cuda"`` or ``"cpu"``.

    Parameters
    ----------
    device : {None, "cpu", "gpu", "cuda", "cuda:N"}
        ``None`` picks ``"cuda"`` when a GPU, CuPy and kvikio are usable, and
        otherwise falls back to the host with a single warning per process.
        ``"cuda:N"`` is checked to name a GPU of this machine (see :func:`resolve`,
        which also returns ``N``).

    Raises
    ------
    NoCudaDeviceError
        A GPU was asked for but none can be used; the message says why.
    ValueError
        ``device`` is not one of the accepted forms, or ``"cuda:N"`` names a GPU this
        machine does not have (the message gives how many it has).
    """
    return resolve(device)[0]


def resolve(device: str | None) -> tuple[Device, int | None]:
    """:func:`resolve_device`, and the GPU number of ``device="cuda:N"`` (else ``None``:
    reads use the CUDA device current when they run)."""
    global _warned_fallback
    kind, gpu = parse_device(device)
    if kind == "cpu":
        return "cpu", None
    ok, reason = cuda_status()
    if ok:
        if gpu is not None:
            count = int(cupy().cuda.runtime.getDeviceCount())
            if gpu >= count:
                have = f"cuda:0 to cuda:{count - 1}" if count > 1 else "cuda:0"
                raise ValueError(
                    f"device={device!r} asks for GPU {gpu}, but this machine has "
                    f"{count} GPU{'s' if count != 1 else ''} ({have}); GPUs are counted "
                    "from 0, as CUDA_VISIBLE_DEVICES leaves them"
                )
        return "cuda", gpu
    if kind is None:
        if not _warned_fallback:
            _warned_fallback = True
            warn(
                f"xarray-gds: no CUDA device is usable ({reason}); reading on the host "
                "with numpy instead. Pass device='cpu' to silence this warning.",
                HostRouteWarning,
            )
        return "cpu", None
    raise NoCudaDeviceError(f"device={device!r} was requested but {reason}.")


def on_gpu(gpu: int | None) -> contextlib.AbstractContextManager[Any]:
    """A context in which GPU number ``gpu`` is CuPy's current device (the device the
    engine's reads allocate on and record), or one that changes nothing for ``None``."""
    if gpu is None:
        return contextlib.nullcontext()
    context: contextlib.AbstractContextManager[Any] = cupy().cuda.Device(gpu)
    return context


def array_module(device: Device) -> ModuleType:
    """The array module (``numpy`` or ``cupy``) that holds data on ``device``."""
    return cupy() if device == "cuda" else np


def buffer_prototype(device: Device) -> Any:
    """zarr's buffer prototype whose buffers live on ``device``."""
    if device == "cuda":
        cupy()  # a clear ImportError first, rather than zarr's
        from zarr.core.buffer import gpu

        return gpu.buffer_prototype
    from zarr.core.buffer import cpu

    return cpu.buffer_prototype


def is_device_array(x: Any) -> bool:
    """True for arrays in GPU memory (anything with ``__cuda_array_interface__``)."""
    return hasattr(x, "__cuda_array_interface__")


def to_host(x: Any) -> np.ndarray:
    """``x`` as a host numpy array (copied from the GPU when it is a CuPy array)."""
    if is_device_array(x):
        host: np.ndarray = x.get()
        return host
    return np.asarray(x)

"""CRC-32C of many device buffers in one call: nvCOMP's batched CRC32 (C API).

nvCOMP's Python module does not expose its CRC32 functions, so they are called
through ``ctypes`` from the ``libnvcomp`` library that module loads
(``nvidia.libnvcomp.load_library``), with the CRC-32C (Castagnoli) model of
nvCOMP's ``crc32.h``: the checksum Zarr v3's ``crc32c`` codec appends.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from xarray_gds import device as _device

__all__ = ["available", "crc32c"]


class _Spec(ctypes.Structure):
    _fields_ = [
        ("poly", ctypes.c_uint32),
        ("init", ctypes.c_uint32),
        ("ref_in", ctypes.c_bool),
        ("ref_out", ctypes.c_bool),
        ("xorout", ctypes.c_uint32),
        ("reserved", ctypes.c_char * 16),
    ]


class _KernelConf(ctypes.Structure):
    _fields_ = [
        ("kernel_kind", ctypes.c_int),
        ("bytes_per_read", ctypes.c_int32),
        ("blocks_per_msg", ctypes.c_int32),
        ("reserved", ctypes.c_char * 20),
    ]


class _Opts(ctypes.Structure):
    _fields_ = [("spec", _Spec), ("kernel_conf", _KernelConf), ("reserved", ctypes.c_char * 64)]


#: CRC-32C (CRC-32/ISCSI): nvCOMP's ``nvcompCRC32_C`` preset
_CASTAGNOLI = (0x1EDC6F41, 0xFFFFFFFF, True, True, 0xFFFFFFFF)
_ONLY_SEGMENT = 0  # nvcompCRC32OnlySegment: each buffer is a whole message


@functools.cache
def _library() -> Any:
    """libnvcomp with the argument types of the two CRC32 functions set, or None."""
    try:
        from nvidia.libnvcomp import load_library

        lib = load_library()
        run, conf = lib.nvcompBatchedCRC32Async, lib.nvcompBatchedCRC32GetHeuristicConf
    except (ImportError, OSError, AttributeError):
        return None
    p = ctypes.c_void_p
    run.argtypes = [p, p, ctypes.c_size_t, p, _Opts, ctypes.c_int, p, p]
    run.restype = ctypes.c_int
    conf.argtypes = [p, ctypes.c_size_t, ctypes.POINTER(_KernelConf), ctypes.c_size_t, p]
    conf.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when nvCOMP's batched CRC32 can be called (nvCOMP wheels that ship
    ``nvidia.libnvcomp`` with the CRC32 API); else crc32c arrays decode on the host."""
    return _library() is not None


def crc32c(arena: Any, offsets: np.ndarray, sizes: np.ndarray, stream: Any) -> np.ndarray:
    """CRC-32C of ``arena[offsets[i]:][:sizes[i]]`` for every ``i`` (device bytes), as a
    host uint32 array. Runs on ``stream`` after the work queued so far on CuPy's
    current stream, and waits for it."""
    lib = _library()
    if lib is None:
        raise RuntimeError(
            "nvCOMP's CRC32 functions could not be loaded from libnvcomp "
            "(nvidia.libnvcomp): this nvCOMP cannot check crc32c on the GPU"
        )
    n = len(sizes)
    if not n:
        return np.empty(0, dtype=np.uint32)
    cp = _device.cupy()
    ptrs = cp.asarray(np.asarray(offsets, dtype=np.uint64) + np.uint64(arena.data.ptr))
    lengths = cp.asarray(np.asarray(sizes, dtype=np.uint64))
    out = cp.empty(n, dtype=cp.uint32)
    statuses = cp.zeros(n, dtype=cp.int32)
    opts = _Opts()
    poly, init, ref_in, ref_out, xorout = _CASTAGNOLI
    opts.spec.poly, opts.spec.init, opts.spec.xorout = poly, init, xorout
    opts.spec.ref_in, opts.spec.ref_out = ref_in, ref_out
    largest = max(1, int(np.max(sizes)))
    _check(lib.nvcompBatchedCRC32GetHeuristicConf(None, n, opts.kernel_conf, largest, None))
    stream.wait_event(cp.cuda.get_current_stream().record())
    try:
        _check(
            lib.nvcompBatchedCRC32Async(
                ptrs.data.ptr,
                lengths.data.ptr,
                n,
                out.data.ptr,
                opts,
                _ONLY_SEGMENT,
                statuses.data.ptr,
                stream.ptr,
            )
        )
    finally:
        stream.synchronize()  # the tables go back to CuPy's pool only after the kernel
    codes = cp.asnumpy(statuses)
    if codes.any():
        _check(int(codes[np.flatnonzero(codes)[0]]))
    return cp.asnumpy(out)


def _check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"nvCOMP's batched CRC32 failed (nvcompStatus_t {status})")

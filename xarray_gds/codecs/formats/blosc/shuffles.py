"""Blosc's byte and bit shuffles, block by block, both ways (numpy or CuPy).

Each block is shuffled on its own, as c-blosc does: the bytes past the block's whole
elements stay as they are, and so does a bit-shuffled block whose number of elements
is not a multiple of 8 (see :mod:`xarray_gds.codecs.formats.blosc.tables`).
:func:`unshuffle` undoes what :func:`shuffle` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["shuffle", "unshuffle"]

_BIT_PASS_NBYTES = 1 << 25  # bit-shuffled bytes undone per pass (8x that in temporaries)


def _per_frame(value: Any, n: int, name: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.int64)
    if arr.ndim == 0:
        return np.full(n, int(arr), dtype=np.int64)
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a scalar or have one entry per frame ({n})")
    return arr


def _byte_unshuffle(blocks: Any, typesize: int, xp: Any) -> Any:
    """Undo the byte shuffle of the rows of ``blocks`` (each one block), or None."""
    size = blocks.shape[1]
    elements = size // typesize
    whole = elements * typesize
    if elements == 0:
        return None
    planes = blocks[:, :whole].reshape(-1, typesize, elements)
    return xp.ascontiguousarray(planes.transpose(0, 2, 1)).reshape(-1, whole)


def _bit_unshuffle(blocks: Any, typesize: int, xp: Any) -> Any:
    """Undo the bit shuffle of the rows of ``blocks`` (each one block), or None."""
    size = blocks.shape[1]
    elements = size // typesize
    whole = elements * typesize
    if elements == 0 or elements % 8:
        return None  # c-blosc stores such a block as is
    # Shuffled: 8 * typesize rows (byte k, bit b of every element) of elements / 8 bytes,
    # element e's bit at bit e % 8 of byte e // 8.
    bits = xp.unpackbits(xp.ascontiguousarray(blocks[:, :whole]).reshape(-1), bitorder="little")
    bits = bits.reshape(-1, typesize, 8, elements).transpose(0, 3, 1, 2)
    packed = xp.packbits(xp.ascontiguousarray(bits).reshape(-1), bitorder="little")
    return packed.reshape(-1, whole)


def unshuffle(data: Any, typesize: Any, blocksize: Any, shuffle: Any, *, xp: Any = np) -> Any:
    """Undo Blosc's byte or bit shuffle on decoded frames, block by block.

    Each block is unshuffled on its own, as c-blosc does (see the module docstring: the
    bytes past the block's whole elements stay as they are, and so does a bit-shuffled
    block whose number of elements is not a multiple of 8). Frames sharing
    ``(typesize, blocksize, shuffle)`` (normally the whole batch) are done together: a few
    vectorized operations for all their full blocks, a few more for their short last
    blocks. Only ``reshape``, ``transpose``, ``ascontiguousarray``, ``unpackbits`` /
    ``packbits`` (flat, ``bitorder="little"``) and indexing are used, so CuPy runs it too.

    Parameters
    ----------
    data : numpy.ndarray or cupy.ndarray
        ``(n_frames, nbytes)`` uint8: the decoded, still shuffled bytes of each frame.
    typesize, blocksize, shuffle : int or array-like
        Per frame (host arrays, e.g. :class:`BloscStreams` fields) or one for all;
        ``shuffle`` is 0 none, 1 byte, 2 bit, as resolved by :func:`parse_frames`.
    xp : module
        ``numpy`` or ``cupy``, the array module of ``data``.

    Returns
    -------
    array
        ``(n_frames, nbytes)`` uint8 unshuffled bytes: a new array, or ``data`` itself
        when no frame is shuffled.
    """
    n, nbytes = data.shape
    typesizes = _per_frame(typesize, n, "typesize")
    blocksizes = _per_frame(blocksize, n, "blocksize")
    shuffles = _per_frame(shuffle, n, "shuffle")
    active = ((shuffles == 1) & (typesizes > 1)) | (shuffles == 2)
    if nbytes == 0 or not active.any():
        return data
    if np.any(typesizes[active] <= 0) or np.any(blocksizes[active] <= 0):
        raise ValueError("typesize and blocksize must be positive")
    out = data.copy()
    params = np.stack([typesizes, blocksizes, shuffles], axis=1)[active]
    groups, inverse = np.unique(params, axis=0, return_inverse=True)
    frame_ids = np.flatnonzero(active)
    for g, (ts, bs, mode) in enumerate(groups.tolist()):
        members = frame_ids[inverse.reshape(-1) == g]
        undo = _byte_unshuffle if mode == 1 else _bit_unshuffle
        nfull = nbytes // bs
        spans = [(0, nfull * bs, bs), (nfull * bs, nbytes, nbytes - nfull * bs)]
        for start, stop, size in spans:
            if stop == start:
                continue
            # bound the temporaries of the bit shuffle by doing a few frames at a time
            step = len(members) if mode == 1 else max(1, _BIT_PASS_NBYTES // (stop - start))
            for lo in range(0, len(members), step):
                part = members[lo : lo + step]
                if len(part) == part[-1] - part[0] + 1:  # consecutive frames: slice
                    rows: Any = slice(int(part[0]), int(part[-1]) + 1)
                else:
                    rows = xp.asarray(part)
                region = data[rows, start:stop]
                blocks = region.reshape(-1, size)
                done = undo(blocks, ts, xp)
                if done is None:
                    continue
                if done.shape[1] < size:  # leftover bytes at each block's end stay
                    blocks = blocks.copy()
                    blocks[:, : done.shape[1]] = done
                    done = blocks
                out[rows, start:stop] = done.reshape(len(part), stop - start)
    return out


def _shuffle_blocks(blocks: Any, typesize: int, mode: int, xp: Any) -> Any:
    """The shuffled whole elements of the rows of ``blocks`` (each one block), or None
    when c-blosc stores such a block as is (see :func:`unshuffle`)."""
    size = blocks.shape[1]
    elements = size // typesize
    whole = elements * typesize
    if elements == 0:
        return None
    part = xp.ascontiguousarray(blocks[:, :whole])
    if mode == 1:
        planes = part.reshape(-1, elements, typesize).transpose(0, 2, 1)
        return xp.ascontiguousarray(planes).reshape(-1, whole)
    if elements % 8:
        return None
    # bit k of byte j of element e goes to bit e % 8 of byte e // 8 of row (j, k)
    bits = xp.unpackbits(part.reshape(-1), bitorder="little")
    bits = bits.reshape(-1, elements, typesize, 8).transpose(0, 2, 3, 1)
    packed = xp.packbits(xp.ascontiguousarray(bits).reshape(-1), bitorder="little")
    return packed.reshape(-1, whole)


def shuffle(data: Any, typesize: int, blocksize: int, mode: int, *, xp: Any = np) -> Any:
    """Blosc's byte (``mode=1``) or bit (``mode=2``) shuffle of every block of every row.

    Parameters
    ----------
    data : numpy.ndarray or cupy.ndarray
        ``(n, nbytes)`` uint8: one chunk's bytes a row.
    typesize, blocksize : int
        Bytes an element and a block (the last block of a row may be shorter).
    mode : int
        0 none (``data`` is returned), 1 byte shuffle, 2 bit shuffle.
    xp : module
        ``numpy`` or ``cupy``, the array module of ``data``.

    Returns
    -------
    array
        ``(n, nbytes)`` uint8, what :func:`unshuffle` undoes.
    """
    n, nbytes = data.shape
    if mode == 0 or (mode == 1 and typesize == 1) or nbytes == 0:
        return data
    out = xp.empty_like(data)  # every span is written below
    nfull = nbytes // blocksize
    for start, stop, size in ((0, nfull * blocksize, blocksize), (nfull * blocksize, nbytes, 0)):
        size = size or stop - start
        if stop == start:
            continue
        blocks = data[:, start:stop].reshape(-1, size)
        done = _shuffle_blocks(blocks, typesize, mode, xp)
        if done is None:  # blocks c-blosc stores as they are
            out[:, start:stop] = data[:, start:stop]
            continue
        if done.shape[1] < size:
            blocks = blocks.copy()
            blocks[:, : done.shape[1]] = done
            done = blocks
        out[:, start:stop] = done.reshape(n, stop - start)
    return out

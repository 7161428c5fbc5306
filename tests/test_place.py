"""place: decoded chunks into their output, on the host (the device runs the same code
with CuPy arrays)."""

from __future__ import annotations

import numpy as np
import pytest

from xarray_gds.place import STREAMED, Tiling, place

#: a 4 x 6 array in chunks of 2 x 3: a grid of 2 x 2 chunks, numbered in C order
WHOLE = np.arange(24, dtype="i4").reshape(4, 6)
GRID = (2, 2)
CHUNKS = np.stack([WHOLE[r * 2 : r * 2 + 2, c * 3 : c * 3 + 3] for r in range(2) for c in range(2)])
FULL = (slice(0, 4), slice(0, 6))


def _where(k: int) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    r, c = divmod(k, 2)
    return (slice(r * 2, r * 2 + 2), slice(c * 3, c * 3 + 3)), (slice(None), slice(None))


def test_chunks_given_out_of_order_land_at_their_positions() -> None:
    """Every chunk present, listed in another order than C order: each at its place."""
    order = [3, 1, 0, 2]
    for tiling in (None, Tiling(GRID, FULL, FULL)):
        out = np.zeros_like(WHOLE)
        place(out, CHUNKS[order], order, 4, _where, -1, False, tiling=tiling)
        np.testing.assert_array_equal(out, WHOLE)


def test_missing_chunks_read_as_the_fill_value() -> None:
    expected = WHOLE.copy()
    expected[2:4, 0:3] = -1  # chunk 2 is missing
    for tiling in (None, Tiling(GRID, FULL, FULL)):
        out = np.zeros_like(WHOLE)
        place(out, CHUNKS[[0, 1, 3]], [0, 1, 3], 4, _where, -1, False, tiling=tiling)
        np.testing.assert_array_equal(out, expected)
    out = np.zeros_like(WHOLE)
    place(out, None, [], 4, _where, -1, False, tiling=Tiling(GRID, FULL, FULL))
    assert (out == -1).all()


def test_streamed_chunks_only_fill_the_missing() -> None:
    out = np.full_like(WHOLE, 7)
    place(out, STREAMED, [0, 3], 4, _where, -1, False)
    assert (out[0:2, 3:6] == -1).all() and (out[2:4, 0:3] == -1).all()
    assert (out[0:2, 0:3] == 7).all() and (out[2:4, 3:6] == 7).all()


def test_a_window_of_the_block_into_a_window_of_the_output() -> None:
    """Rows 1-3 and columns 2-5 of the block go to rows 5-7 of a larger output."""
    out = np.zeros((8, 4), dtype="i4")
    window, crop = (slice(5, 8), slice(0, 4)), (slice(1, 4), slice(2, 6))
    place(out, CHUNKS, [0, 1, 2, 3], 4, _where, -1, False, tiling=Tiling(GRID, window, crop))
    np.testing.assert_array_equal(out[5:8], WHOLE[1:4, 2:6])
    assert not out[:5].any()


def test_tiling_order_puts_chunk_j_at_grid_position_order_j() -> None:
    order = np.array([2, 0, 3, 1])  # chunk j belongs at grid position order[j]
    given = np.empty_like(CHUNKS)
    given[np.arange(4)] = CHUNKS[order]
    out = np.zeros_like(WHOLE)
    place(out, given, [0, 1, 2, 3], 4, _where, -1, False, tiling=Tiling(GRID, FULL, FULL, order))
    np.testing.assert_array_equal(out, WHOLE)


def test_the_device_branches_place_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's branches (one untile of every row, copies one after the other) with
    numpy standing in for CuPy: what runs on the GPU places what the host places."""
    from xarray_gds import place as place_module

    monkeypatch.setattr(place_module._device, "array_module", lambda device: np)
    window, crop = (slice(5, 8), slice(0, 4)), (slice(1, 4), slice(2, 6))
    for tiling in (None, Tiling(GRID, window, crop)):
        host, device = np.zeros((8, 6), dtype="i4"), np.zeros((8, 6), dtype="i4")
        for out, on_device in ((host, False), (device, True)):
            if tiling is None:
                place(out, CHUNKS[[0, 2]], [0, 2], 4, _where, -1, on_device)
            else:
                place(out, CHUNKS[[0, 2]], [0, 2], 4, _where, -1, on_device, tiling=tiling)
        np.testing.assert_array_equal(device, host)
        assert (host != 0).any()


def test_a_crop_that_ends_inside_a_row_of_chunks() -> None:
    """A window whose crop starts and ends inside rows of chunks after the first (rows
    3-4 and 1-2 of the block, row by row on the host): each row's part of the block is
    cut at both ends (place ``last - lo`` -> ``last + lo`` read past the crop)."""
    for crop_rows, at in ((slice(3, 4), 2), (slice(1, 3), 0)):
        out = np.zeros((6, 4), dtype="i4")
        n = crop_rows.stop - crop_rows.start
        window, crop = (slice(at, at + n), slice(0, 4)), (crop_rows, slice(2, 6))
        place(out, CHUNKS, [0, 1, 2, 3], 4, _where, -1, False, tiling=Tiling(GRID, window, crop))
        expected = np.zeros((6, 4), dtype="i4")
        expected[at : at + n] = WHOLE[crop_rows, 2:6]
        np.testing.assert_array_equal(out, expected)

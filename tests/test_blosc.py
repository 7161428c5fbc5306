"""Blosc frames taken apart on the host: parse, unshuffle and a host decode, checked
bit for bit against numcodecs (c-blosc 1.x)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numcodecs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numcodecs import blosc as nc_blosc

from xarray_gds.codecs.formats.blosc import (
    BLOSC,
    BloscStreams,
    decode_host,
    parse_arena,
    parse_frames,
    unshuffle,
)
from xarray_gds.codecs.formats.blosc import frames as frames_module
from xarray_gds.codecs.formats.blosc import shuffles as shuffle_module
from xarray_gds.errors import ChunkDecodeError

CNAMES = ("lz4", "lz4hc", "zstd", "zlib")
SHUFFLES = (numcodecs.Blosc.NOSHUFFLE, numcodecs.Blosc.SHUFFLE, numcodecs.Blosc.BITSHUFFLE)
STREAM_FORMAT = {"lz4": "lz4", "lz4hc": "lz4", "zstd": "zstd", "zlib": "zlib", "blosclz": "blosclz"}


def _data(kind: str, nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` bytes: smooth values (compressible) or random (incompressible)."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    steps = (np.arange(nbytes // 4 + 1, dtype=np.uint32) // 3) * 1000 + 7
    return steps.view(np.uint8)[:nbytes].copy()


def _encode(codec: numcodecs.Blosc, data: np.ndarray) -> np.ndarray:
    return np.frombuffer(codec.encode(data), dtype=np.uint8)


def _reference(codec: numcodecs.Blosc, frames: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.frombuffer(codec.decode(f), dtype=np.uint8) for f in frames])


def _check_layout(streams: BloscStreams, frames: list[np.ndarray]) -> None:
    """Streams tile each frame's decoded bytes and lie inside the frame."""
    for i, frame in enumerate(frames):
        mine = streams.chunk == i
        dst, dsize = streams.dst[mine], streams.dsize[mine]
        order = np.argsort(dst)
        ends = np.concatenate([[0], (dst + dsize)[order]])
        assert np.array_equal(dst[order], ends[:-1])
        assert ends[-1] == streams.nbytes[i]
        assert np.all(streams.src[mine] + streams.csize[mine] <= frame.size)
        bounds = streams.block_bounds(i)
        assert bounds[0] == 0 and bounds[-1] == streams.nbytes[i]
        if streams.nbytes[i] == 0:
            assert not mine.any()
        elif streams.memcpyed[i]:
            assert mine.sum() == 1 and streams.src[mine][0] == 16 and streams.raw[mine][0]
        else:  # every stream lies inside one block
            block = np.searchsorted(bounds, dst, side="right") - 1
            assert np.all(dst + dsize <= bounds[block + 1])
    assert np.array_equal(streams.raw, streams.csize == streams.dsize)


def _roundtrip(codec: numcodecs.Blosc, frames: list[np.ndarray], nbytes: int) -> BloscStreams:
    keys = [f"x/{i}" for i in range(len(frames))]
    got = decode_host(frames, keys, nbytes)
    assert got.shape == (len(frames), nbytes) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, _reference(codec, frames))
    streams = parse_frames(frames, keys, nbytes)
    _check_layout(streams, frames)
    return streams


@contextmanager
def _split_mode(mode: str) -> Iterator[None]:
    """Have c-blosc's global compressor split blocks by ``mode`` (restored after)."""
    saved = nc_blosc.use_threads
    nc_blosc.use_threads = True  # blosc_compress, which reads BLOSC_SPLITMODE
    os.environ["BLOSC_SPLITMODE"] = mode
    try:
        yield
    finally:
        os.environ["BLOSC_SPLITMODE"] = "FORWARD_COMPAT"  # c-blosc keeps the last mode
        numcodecs.Blosc("lz4").encode(np.zeros(16, np.uint8))
        del os.environ["BLOSC_SPLITMODE"]
        nc_blosc.use_threads = saved


# --- bit-for-bit against numcodecs ---------------------------------------------------------


@pytest.mark.parametrize("blocksize", [0, 256, 1024])
@pytest.mark.parametrize("clevel", [0, 5])
@pytest.mark.parametrize("dtype", ["u1", "u2", "u4", "u8"])
@pytest.mark.parametrize("shuffle", SHUFFLES)
@pytest.mark.parametrize("cname", CNAMES)
def test_matches_numcodecs(cname: str, shuffle: int, dtype: str, clevel: int, blocksize: int):
    codec = numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=shuffle, blocksize=blocksize)
    itemsize = np.dtype(dtype).itemsize
    # below the 128-byte minimum (memcpyed), under a block, many blocks with a short last one
    for elements in (5, 1000 // itemsize + 3, 150_000 // itemsize + 3):
        nbytes = elements * itemsize
        frames = [_encode(codec, _data(kind, nbytes).view(dtype)) for kind in ("smooth", "random")]
        streams = _roundtrip(codec, frames, nbytes)
        assert streams.cname == (STREAM_FORMAT[cname],) * 2
        assert np.all(streams.typesize == itemsize)
        if clevel == 0 or nbytes < 128:
            assert streams.memcpyed.all() and np.all(streams.shuffle == 0)
        elif shuffle == numcodecs.Blosc.SHUFFLE and itemsize > 1:
            assert np.all(streams.shuffle[~streams.memcpyed] == 1)


@pytest.mark.parametrize("typesize", [2, 3, 4, 8, 16, 17])
@pytest.mark.parametrize("nbytes", [1001, 4099, 70_001])
@pytest.mark.parametrize("shuffle", SHUFFLES)
@pytest.mark.parametrize("cname", ["lz4", "zstd"])
def test_nbytes_not_a_multiple_of_typesize(cname: str, shuffle: int, nbytes: int, typesize: int):
    for blocksize in (0, 640):
        codec = numcodecs.Blosc(cname, 5, shuffle, blocksize=blocksize, typesize=typesize)
        frames = [_encode(codec, _data(kind, nbytes)) for kind in ("smooth", "random")]
        streams = _roundtrip(codec, frames, nbytes)
        assert np.all(streams.typesize == typesize)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cname=st.sampled_from([*CNAMES, "blosclz"]),
    clevel=st.integers(0, 9),
    shuffle=st.sampled_from(SHUFFLES),
    typesize=st.sampled_from([1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 32, 255]),
    blocksize=st.one_of(st.just(0), st.integers(1, 5000)),
    nbytes=st.integers(0, 40_000),
    kind=st.sampled_from(["smooth", "random"]),
    seed=st.integers(0, 2**16),
)
def test_matches_numcodecs_property(
    cname: str,
    clevel: int,
    shuffle: int,
    typesize: int,
    blocksize: int,
    nbytes: int,
    kind: str,
    seed: int,
):
    codec = numcodecs.Blosc(cname, clevel, shuffle, blocksize=blocksize, typesize=typesize)
    frames = [_encode(codec, _data(kind, nbytes, seed)), _encode(codec, _data("random", nbytes))]
    keys = ["a/0", "a/1"]
    streams = parse_frames(frames, keys, nbytes)
    _check_layout(streams, frames)
    if "blosclz" in streams.compressed_cnames:
        with pytest.raises(ChunkDecodeError, match="no batched decoder"):
            decode_host(frames, keys, nbytes)
        return
    expected = _reference(codec, frames) if nbytes else np.zeros((2, 0), np.uint8)  # numcodecs
    np.testing.assert_array_equal(decode_host(frames, keys, nbytes), expected)  # fails on b""


@pytest.mark.parametrize("tail", [0, 1, 3, 96, 98, 100, 102, 1023])
@pytest.mark.parametrize("shuffle", SHUFFLES[1:])
def test_short_last_block(shuffle: int, tail: int):
    """Short last blocks: whole elements a multiple of 8 or not, leftover bytes or not."""
    nbytes = 8 * 1024 + tail
    codec = numcodecs.Blosc("zstd", 5, shuffle, blocksize=1024, typesize=4)
    frames = [_encode(codec, _data(kind, nbytes)) for kind in ("smooth", "random")]
    streams = _roundtrip(codec, frames, nbytes)
    assert np.all(streams.blocksize == 1024)


#: Blosc settings that differ in every respect, for batches mixing them
_MIXED = [
    numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, typesize=4),
    numcodecs.Blosc("zstd", 3, numcodecs.Blosc.BITSHUFFLE, blocksize=1024, typesize=8),
    numcodecs.Blosc("zlib", 1, numcodecs.Blosc.NOSHUFFLE),
    numcodecs.Blosc("lz4hc", 0, numcodecs.Blosc.SHUFFLE, typesize=2),
    numcodecs.Blosc("lz4", 9, numcodecs.Blosc.BITSHUFFLE, blocksize=256, typesize=1),
]


@pytest.mark.parametrize("pass_nbytes", [None, 3000])
def test_mixed_batch(monkeypatch: pytest.MonkeyPatch, pass_nbytes: int | None):
    """Frames of one batch with different compressors, shuffles, typesizes and blocks."""
    if pass_nbytes is not None:  # bit shuffle undone a frame or two at a time
        monkeypatch.setattr(shuffle_module, "_BIT_PASS_NBYTES", pass_nbytes)
    nbytes = 96_000
    codecs = [
        *_MIXED,
        numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, typesize=4),
        numcodecs.Blosc("zstd", 3, numcodecs.Blosc.BITSHUFFLE, blocksize=1024, typesize=8),
    ]
    data = [_data("smooth", nbytes, i) for i in range(len(codecs))]
    frames = [_encode(c, d) for c, d in zip(codecs, data, strict=True)]
    keys = [f"m/{i}" for i in range(len(frames))]
    np.testing.assert_array_equal(decode_host(frames, keys, nbytes), np.stack(data))
    streams = parse_frames(frames, keys, nbytes)
    assert streams.cname == ("lz4", "zstd", "zlib", "lz4", "lz4", "lz4", "zstd")
    assert streams.shuffle.tolist() == [1, 2, 0, 0, 2, 1, 2]
    assert streams.memcpyed.tolist() == [False, False, False, True, False, False, False]
    assert streams.compressed_cnames == {"lz4", "zstd", "zlib"}
    assert np.array_equal(
        np.flatnonzero(streams.compressed("zstd")), np.flatnonzero(np.isin(streams.chunk, [1, 6]))
    )


def test_scalar_and_vectorized_walks_agree(monkeypatch: pytest.MonkeyPatch):
    frames, nbytes = [], 60_003
    for cname, shuffle, blocksize, typesize in [
        ("lz4", 1, 0, 4),
        ("lz4", 2, 256, 8),
        ("zstd", 1, 1024, 3),
        ("zlib", 0, 300, 1),
        ("lz4hc", 1, 0, 16),
        ("zstd", 2, 0, 2),
    ]:
        codec = numcodecs.Blosc(cname, 5, shuffle, blocksize=blocksize, typesize=typesize)
        frames += [_encode(codec, _data(kind, nbytes)) for kind in ("smooth", "random")]
    keys = [f"w/{i}" for i in range(len(frames))]
    walks = []
    for limit in (0, 40, 10**9):  # all vectorized, mixed, all scalar
        monkeypatch.setattr(frames_module, "_SCALAR_MAX_STREAMS", limit)
        walks.append(parse_frames(frames, keys, nbytes))
    for other in walks[1:]:
        for name in ("chunk", "src", "csize", "dst", "dsize", "raw"):
            np.testing.assert_array_equal(getattr(other, name), getattr(walks[0], name))
    _check_layout(walks[0], frames)


def test_empty_chunks():
    codec = numcodecs.Blosc("zstd", 5, numcodecs.Blosc.SHUFFLE)
    frames = [_encode(codec, np.zeros(0, np.float32))] * 2
    out = decode_host(frames, ["e/0", "e/1"], 0)
    assert out.shape == (2, 0)
    assert parse_frames(frames, ["e/0", "e/1"], 0).n_streams == 0
    assert parse_frames([], [], 10).n_frames == 0


# --- the decoder follows the frame ---------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "cname", "split"),
    [("ALWAYS", "zstd", True), ("NEVER", "lz4", False), ("FORWARD_COMPAT", "lz4", True)],
)
def test_split_flag(mode: str, cname: str, split: bool):
    """zstd frames split into byte planes and lz4 frames left whole are read right: the
    "don't split" flag decides, not the compressor."""
    data = _data("smooth", 400_000)
    codec = numcodecs.Blosc(cname, 5, numcodecs.Blosc.SHUFFLE, blocksize=1024, typesize=4)
    with _split_mode(mode):
        frames = [_encode(codec, data)]
    assert bool(frames[0][2] & 0x10) is not split
    streams = _roundtrip(codec, frames, data.size)
    nblocks = len(streams.block_bounds(0)) - 1
    short_last = data.size % int(streams.blocksize[0]) != 0
    expected = (nblocks - short_last) * 4 + short_last if split else nblocks
    assert streams.n_streams == expected


def test_blocks_in_any_order():
    """Block starts are followed, whatever the order of the blocks in the frame."""
    data = _data("smooth", 50_000)
    codec = numcodecs.Blosc("zstd", 5, numcodecs.Blosc.BITSHUFFLE, blocksize=4096, typesize=4)
    frame = _encode(codec, data)
    nblocks = -(-data.size // 4096)
    starts = frame[16 : 16 + 4 * nblocks].view("<i4").astype(int)
    ends = [*starts[1:], frame.size]
    pieces = [frame[s:e] for s, e in zip(starts, ends, strict=True)][::-1]
    new_starts = 16 + 4 * nblocks + np.cumsum([0] + [len(p) for p in pieces[:-1]])
    reordered = np.concatenate(
        [frame[:16], np.asarray(new_starts[::-1], "<i4").view(np.uint8), *pieces]
    )
    assert reordered.size == frame.size and not np.array_equal(reordered, frame)
    np.testing.assert_array_equal(np.frombuffer(codec.decode(reordered), np.uint8), data)
    np.testing.assert_array_equal(decode_host([reordered], ["r/0"], data.size)[0], data)


def test_incompressible_streams_are_raw():
    data = _data("random", 200_000)
    codec = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.NOSHUFFLE, blocksize=8192)
    frames = [_encode(codec, _data("smooth", data.size)), _encode(codec, data)]
    streams = _roundtrip(codec, frames, data.size)
    # random data: blosc stores the whole frame uncompressed (memcpyed), or raw streams
    assert streams.memcpyed[1] or streams.raw[streams.chunk == 1].all()
    assert not streams.raw[streams.chunk == 0].all()


def test_unshuffle_passthrough_and_groups():
    data = np.arange(2 * 1000, dtype=np.uint32).view(np.uint8).reshape(2, -1)
    assert unshuffle(data, 4, 1000, 0) is data
    assert unshuffle(data, 1, 1000, 1) is data  # byte shuffle of 1-byte types: nothing
    shuffled = data.reshape(2, -1, 4).transpose(0, 2, 1).reshape(2, -1)  # one block each
    back = unshuffle(np.ascontiguousarray(shuffled), [4, 4], [4000, 4000], [1, 1])
    np.testing.assert_array_equal(back, data)
    mixed = np.stack([shuffled[0], data[1]])
    np.testing.assert_array_equal(unshuffle(mixed, 4, 4000, [1, 0]), data)
    with pytest.raises(ValueError, match="one entry per frame"):
        unshuffle(data, [4, 4, 4], 1000, 1)


# --- damaged frames -------------------------------------------------------------------------


@pytest.fixture(params=["scalar", "vectorized"])
def frame(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> tuple[np.ndarray, int]:
    """A compressed lz4 frame with split blocks and a short last block, its streams
    walked with plain Python or with numpy."""
    limit = 10**9 if request.param == "scalar" else 0
    monkeypatch.setattr(frames_module, "_SCALAR_MAX_STREAMS", limit)
    data = _data("smooth", 300_001)
    frame = _encode(numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, typesize=4), data)
    assert not frame[2] & 0x12 and frame.view(np.uint8)[3] == 4  # compressed, split
    return frame.copy(), data.size


def _set_i32(frame: np.ndarray, offset: int, value: int) -> np.ndarray:
    out = frame.copy()
    out[offset : offset + 4] = np.array([value], "<i4").view(np.uint8)
    return out


def _expect_error(frames: list[np.ndarray], nbytes: int, match: str) -> None:
    keys = [f"t2m/0.{i}" for i in range(len(frames))]
    bad = keys[-1]
    with pytest.raises(ChunkDecodeError, match=match) as info:
        parse_frames(frames, keys, nbytes)
    assert info.value.key == bad and info.value.codec == "blosc" and repr(bad) in str(info.value)
    with pytest.raises(ChunkDecodeError, match=match):
        decode_host(frames, keys, nbytes)


def test_damaged_truncated(frame: tuple[np.ndarray, int]):
    f, nbytes = frame
    _expect_error([f, f[:-1]], nbytes, "truncated")
    _expect_error([f, f[:10]], nbytes, "too short for a Blosc header")


def test_damaged_trailing_bytes(frame: tuple[np.ndarray, int]):
    f, nbytes = frame
    _expect_error([f, np.concatenate([f, np.zeros(3, np.uint8)])], nbytes, "trailing bytes")


def test_damaged_header(frame: tuple[np.ndarray, int]):
    f, nbytes = frame
    _expect_error([f, _set_i32(f, 4, nbytes + 4)], nbytes, f"declares {nbytes + 4} decoded")
    _expect_error([f], nbytes - 1, f"expected {nbytes - 1}")
    _expect_error([f, _set_i32(f, 8, 0)], nbytes, "block size 0")
    _expect_error([f, _set_i32(f, 8, nbytes + 1)], nbytes, "block size")
    _expect_error([f, _set_i32(f, 8, 4)], nbytes, "table of .* block starts does not fit")
    bad = f.copy()
    bad[0] = 3
    _expect_error([f, bad], nbytes, "format version 3")
    bad = f.copy()
    bad[1] = 2
    _expect_error([f, bad], nbytes, "lz4 format version 2")
    bad = f.copy()
    bad[2] |= 0x08
    _expect_error([f, bad], nbytes, "reserved bit")
    bad = f.copy()
    bad[2] = (bad[2] & 0x1F) | (6 << 5)
    _expect_error([f, bad], nbytes, "unknown compressor code 6")
    bad = f.copy()
    bad[2] |= 0x02  # memcpyed, but the frame is compressed
    _expect_error([f, bad], nbytes, "memcpyed")


def test_damaged_block_start(frame: tuple[np.ndarray, int]):
    f, nbytes = frame
    _expect_error([f, _set_i32(f, 20, f.size)], nbytes, "block 1 of .* starts at byte")
    _expect_error([f, _set_i32(f, 16, 8)], nbytes, "block 0 of .* starts at byte 8,")
    _expect_error([f, _set_i32(f, 16, -1)], nbytes, "starts at byte -1")


def test_damaged_stream_size(frame: tuple[np.ndarray, int]):
    f, nbytes = frame
    start = int(f[16:20].view("<i4")[0])
    _expect_error([f, _set_i32(f, start, f.size)], nbytes, "stream 0 of block 0 declares")
    _expect_error([f, _set_i32(f, start, -5)], nbytes, "declares -5 bytes")
    # stream 0 so long that the size of stream 1 runs past the end
    _expect_error(
        [f, _set_i32(f, start, f.size - start - 6)], nbytes, "size of stream 1 of block 0"
    )


def test_damaged_payload(frame: tuple[np.ndarray, int]):
    f, nbytes = frame
    start = int(f[16:20].view("<i4")[0])
    bad = f.copy()
    bad[start + 4 : start + 20] = 0xFF  # lz4 tokens asking for far too many literals
    parse_frames([bad], ["t2m/0.0"], nbytes)  # sizes are in bounds: only decoding can tell
    with pytest.raises(ChunkDecodeError, match="lz4 stream") as info:
        decode_host([f, bad], ["t2m/0.0", "t2m/0.1"], nbytes)
    assert info.value.key == "t2m/0.1"


def test_split_block_not_a_multiple_of_typesize(frame: tuple[np.ndarray, int]):
    f, nbytes = frame
    blocksize = int(f[8:12].view("<i4")[0])
    _expect_error([f, _set_i32(f, 8, blocksize - 2)], nbytes, "not a multiple of the typesize")


def test_blosclz_parses_but_has_no_batched_decoder():
    data = _data("smooth", 100_000)
    codec = numcodecs.Blosc("blosclz", 5, numcodecs.Blosc.SHUFFLE, typesize=4)
    frames = [_encode(codec, data)]
    streams = parse_frames(frames, ["b/0"], data.size)
    assert streams.cname == ("blosclz",) and not streams.raw.all()
    _check_layout(streams, frames)
    with pytest.raises(ChunkDecodeError, match="'blosclz' has no batched decoder") as info:
        decode_host(frames, ["b/0"], data.size)
    assert info.value.key == "b/0"
    snappy = frames[0].copy()
    snappy[2] = (snappy[2] & 0x1F) | (2 << 5)  # the snappy code: parsed, not decoded
    assert parse_frames([snappy], ["s/0"], data.size).cname == ("snappy",)
    with pytest.raises(ChunkDecodeError, match="'snappy' has no batched decoder"):
        decode_host([snappy], ["s/0"], data.size)
    # a blosclz frame stored uncompressed needs no blosclz decoder
    stored = numcodecs.Blosc("blosclz", 0, numcodecs.Blosc.SHUFFLE, typesize=4)
    plain = [_encode(stored, data)]
    np.testing.assert_array_equal(decode_host(plain, ["b/1"], data.size)[0], data)


# --- only the bytes the parser reads come to the host --------------------------------------


class _CountingXp:
    """numpy as the array module of :func:`parse_arena`, counting the bytes it copies to
    the "host" (``asnumpy``) and the copies, and recording every byte it gathers."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.copies = 0
        self.read: list[np.ndarray] = []

    def __getattr__(self, name: str) -> object:
        return getattr(np, name)

    def asarray(self, a: np.ndarray) -> np.ndarray:
        self.read.append(np.array(a).reshape(-1))
        return np.asarray(a)

    def asnumpy(self, a: np.ndarray) -> np.ndarray:
        self.nbytes += a.nbytes
        self.copies += 1
        return np.array(a)


def _lay_out(
    frames: list[np.ndarray], seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``frames`` in one arena with gaps of junk (nonzero bytes) before, between and after
    them: ``(arena, offsets, sizes, junk)``, ``junk`` the mask of the junk bytes."""
    rng = np.random.default_rng(seed)
    pieces, offsets, at = [], [], 0
    for f in [*frames, None]:
        gap = rng.integers(1, 256, int(rng.integers(1, 40)), dtype=np.uint8)
        pieces.append(gap)
        at += gap.size
        if f is not None:
            pieces.append(f)
            offsets.append(at)
            at += f.size
    arena = np.concatenate(pieces)
    sizes = np.array([f.size for f in frames], dtype=np.int64)
    offsets_ = np.array(offsets, dtype=np.int64)
    junk = np.ones(arena.size, dtype=bool)
    for o, n in zip(offsets_.tolist(), sizes.tolist(), strict=True):
        junk[o : o + n] = False
    return arena, offsets_, sizes, junk


def _views(host: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    return [host[o : o + n] for o, n in zip(offsets.tolist(), sizes.tolist(), strict=True)]


def _assert_same_streams(got: BloscStreams, want: BloscStreams) -> None:
    for name in BloscStreams.__dataclass_fields__:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a == b, name


def _arena_check(frames: list[np.ndarray], nbytes: int, seed: int = 0) -> BloscStreams:
    """parse_arena on an arena of the frames lists what parse_frames lists for host copies
    of them, reading exactly the headers, block-start tables and size prefixes."""
    arena, offsets, sizes, junk = _lay_out(frames, seed)
    keys = [f"s/{i}" for i in range(len(frames))]
    xp = _CountingXp()
    got = parse_arena(arena, offsets, sizes, keys, nbytes, xp=xp)
    want = parse_frames(_views(arena, offsets, sizes), keys, nbytes)
    _assert_same_streams(got, want)
    read = np.concatenate([np.zeros(0, np.int64), *xp.read])
    assert not junk[read].any()  # nothing outside the frames
    # the bytes fetched: 16 per header, 4 per block start and 4 per stream size
    expected = 16 * len(frames)
    if nbytes:
        compressed = ~want.memcpyed
        nblocks = -(-nbytes // want.blocksize[compressed])
        expected += 4 * int(nblocks.sum()) + 4 * int(compressed[want.chunk].sum())
    assert xp.nbytes == expected
    assert xp.copies <= 2 + 16
    return want


@pytest.mark.parametrize("blocksize", [0, 256, 4096])
@pytest.mark.parametrize("typesize", [1, 2, 4, 8])
@pytest.mark.parametrize("shuffle", SHUFFLES)
@pytest.mark.parametrize("cname", [*CNAMES, "blosclz"])
def test_parse_arena_matches_parse_frames(cname: str, shuffle: int, typesize: int, blocksize: int):
    """Compressible, incompressible and stored (clevel 0) frames, many blocks with a short
    last one and leftover bytes, or a chunk smaller than a block."""
    for nbytes in (300_003, 30_003, 1000, 100):
        frames = []
        for i, (kind, clevel) in enumerate([("smooth", 5), ("random", 5), ("smooth", 0)]):
            codec = numcodecs.Blosc(cname, clevel, shuffle, blocksize=blocksize, typesize=typesize)
            frames.append(_encode(codec, _data(kind, nbytes, seed=i)))
        with _split_mode("ALWAYS"):  # split blocks for every compressor
            frames.append(_encode(codec, _data("smooth", nbytes, seed=3)))
        streams = _arena_check(frames, nbytes, seed=nbytes)
        assert streams.memcpyed[2]
    codec = numcodecs.Blosc(cname, 5, shuffle, blocksize=blocksize, typesize=typesize)
    _arena_check([_encode(codec, _data("smooth", 30_000))] * 3, 30_000)  # one frame, 3 times


def test_parse_arena_mixed_batch():
    """Frames of one batch with different layouts, blocks out of order, split or not."""
    nbytes = 300_003
    codecs = [
        *_MIXED,
        numcodecs.Blosc("blosclz", 5, numcodecs.Blosc.SHUFFLE, blocksize=3000, typesize=16),
        numcodecs.Blosc("lz4", 5, numcodecs.Blosc.NOSHUFFLE, blocksize=4096, typesize=8),
    ]
    frames = [_encode(c, _data("smooth", nbytes, i)) for i, c in enumerate(codecs)]
    frames.append(_encode(codecs[0], _data("random", nbytes)))
    with _split_mode("NEVER"):
        frames.append(_encode(codecs[0], _data("smooth", nbytes, 7)))
    assert frames[-1][2] & 0x10
    # the blocks of a frame in reverse order: the short last one, not split, comes first
    frame = _encode(
        numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, blocksize=8192, typesize=4),
        _data("smooth", nbytes, 9),
    )
    blocksize = int(frame[8:12].view("<i4")[0])
    nblocks = -(-nbytes // blocksize)
    assert not frame[2] & 0x12 and nbytes % blocksize and nblocks > 2  # split, short last
    starts = frame[16 : 16 + 4 * nblocks].view("<i4").astype(int)
    ends = [*starts[1:], frame.size]
    pieces = [frame[s:e] for s, e in zip(starts, ends, strict=True)][::-1]
    new_starts = 16 + 4 * nblocks + np.cumsum([0] + [len(p) for p in pieces[:-1]])
    frames.append(
        np.concatenate([frame[:16], np.asarray(new_starts[::-1], "<i4").view(np.uint8), *pieces])
    )
    for seed in range(3):
        _arena_check(frames, nbytes, seed)
        _arena_check(frames[::-1], nbytes, seed)


def test_parse_arena_empty():
    codec = numcodecs.Blosc("zstd", 5, numcodecs.Blosc.SHUFFLE)
    frames = [_encode(codec, np.zeros(0, np.float32))] * 2
    assert _arena_check(frames, 0).n_streams == 0
    none = np.zeros(0, dtype=np.int64)
    assert parse_arena(np.ones(5, np.uint8), none, none, [], 10).n_frames == 0


def test_parse_arena_rejects_frames_outside_the_arena():
    arena = np.zeros(64, np.uint8)
    for offsets, sizes in [([60], [16]), ([-1], [16]), ([0], [-3])]:
        with pytest.raises(ValueError, match="inside the arena"):
            parse_arena(arena, np.array(offsets), np.array(sizes), ["k"], 10)
    with pytest.raises(ValueError, match="keys"):
        parse_arena(arena, np.array([0]), np.array([16]), ["a", "b"], 10)


def _damaged(f: np.ndarray, nbytes: int) -> dict[str, np.ndarray]:
    """Damaged copies of frame ``f`` (of ``nbytes`` decoded bytes), by name."""
    start = int(f[16:20].view("<i4")[0])
    blocksize = int(f[8:12].view("<i4")[0])
    half = f.size // 2
    out = {
        "truncated": f[:-1],
        "too short": f[:10],
        "empty": f[:0],
        "trailing": np.concatenate([f, np.full(3, 7, np.uint8)]),
        "cut, cbytes fixed": _set_i32(f[:half], 12, half),
        "cut in the table": _set_i32(f[:40], 12, 40),
        "nbytes": _set_i32(f, 4, nbytes + 4),
        "blocksize 0": _set_i32(f, 8, 0),
        "blocksize too big": _set_i32(f, 8, nbytes + 1),
        "table does not fit": _set_i32(f, 8, 4),
        "split not a multiple": _set_i32(f, 8, blocksize - 2),
        "block start past the end": _set_i32(f, 20, f.size),
        "block start in the table": _set_i32(f, 16, 8),
        "block start negative": _set_i32(f, 16, -1),
        "last block start at the end": _set_i32(f, 16, f.size - 4),
        "stream size past the end": _set_i32(f, start, f.size),
        "stream size negative": _set_i32(f, start, -5),
        "stream size zero": _set_i32(f, start, 0),
        "next size past the end": _set_i32(f, start, f.size - start - 6),
        "next size at the end": _set_i32(f, start, f.size - start - 8),
        "payload": f.copy(),
        "zeroed after the tables": f.copy(),
    }
    out["payload"][start + 4 : start + 20] = 0xFF
    out["zeroed after the tables"][f.size // 2 :] = 0
    for name, byte, value in [
        ("version", 0, 3),
        ("lz4 version", 1, 2),
        ("reserved bit", 2, f[2] | 0x08),
        ("compressor code", 2, (f[2] & 0x1F) | (6 << 5)),
        ("memcpyed flag", 2, f[2] | 0x02),
        ("don't split flag", 2, f[2] | 0x10),
        ("typesize 0", 3, 0),
        ("typesize 3", 3, 3),
        ("typesize 200", 3, 200),
    ]:
        bad = f.copy()
        bad[byte] = value
        out[name] = bad
    return out


def test_parse_arena_damaged(frame: tuple[np.ndarray, int]):
    """A damaged frame among good ones: the same error, naming the same chunk, from the
    arena as from host copies of the frames (or the same streams, where the damage only
    shows when decoding), and no byte outside the frames is read."""
    f, nbytes = frame
    for name, bad in _damaged(f, nbytes).items():
        for frames in ([f, bad, f], [bad], [bad, bad[::-1].copy()]):
            arena, offsets, sizes, junk = _lay_out(frames)
            keys = [f"d/{i}" for i in range(len(frames))]
            xp = _CountingXp()
            try:
                want = parse_frames(_views(arena, offsets, sizes), keys, nbytes)
            except ChunkDecodeError as err:
                with pytest.raises(ChunkDecodeError) as info:
                    parse_arena(arena, offsets, sizes, keys, nbytes, xp=xp)
                assert (info.value.key, str(info.value)) == (err.key, str(err)), name
            else:
                got = parse_arena(arena, offsets, sizes, keys, nbytes, xp=xp)
                _assert_same_streams(got, want)
            read = np.concatenate([np.zeros(0, np.int64), *xp.read])
            assert not junk[read].any(), name


# --- many frames at once ---------------------------------------------------------------------


def _batch(nbytes: int, count: int) -> list[np.ndarray]:
    """``count`` compressed lz4 frames of 65536-byte blocks split in 4 streams (and a
    short last block), of different data."""
    codec = numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, blocksize=16384, typesize=4)
    frames = [_encode(codec, _data("smooth", nbytes) + np.uint8(i)) for i in range(count)]
    for f in frames:  # c-blosc enlarges the blocks it splits to 64 KiB
        assert not f[2] & 0x12 and int(f[8:12].view("<i4")[0]) == 65536
    return frames


def test_frames_in_any_form():
    """Frames as separate arrays, bytes, views of one arena (in any order, or of a
    non-uint8 array), or views of arrays whose bytes are not contiguous: the same streams."""
    nbytes = 200_000
    frames = [*_batch(nbytes, 4), *(_encode(c, _data("smooth", nbytes)) for c in _MIXED)]
    keys = [f"f/{i}" for i in range(len(frames))]
    want = parse_frames([f.copy() for f in frames], keys, nbytes)
    _check_layout(want, frames)
    arena, offsets, sizes, _ = _lay_out(frames)
    views = _views(arena, offsets, sizes)
    wide = np.zeros(-(-arena.size // 8), dtype=np.float64)  # the arena's bytes in floats
    wide.view(np.uint8)[: arena.size] = arena
    rows = np.zeros((len(frames), int(sizes.max()) + 8), dtype=np.uint8, order="F")
    for i, f in enumerate(frames):
        rows[i, 3 : 3 + f.size] = f
    columns = np.asfortranarray(rows.T)  # one frame per (contiguous) column
    forms = {
        "bytes": [f.tobytes() for f in frames],
        "bytearray": [bytearray(f.tobytes()) for f in frames],
        "memoryview": [memoryview(f.tobytes()) for f in frames],
        "views": views,
        "views of floats": _views(wide.view(np.uint8), offsets, sizes),
        "columns": [columns[3 : 3 + f.size, i] for i, f in enumerate(frames)],
        "rows": [rows[i, 3 : 3 + f.size] for i, f in enumerate(frames)],  # copied
        "mixed": [
            v if i % 2 else f.tobytes() for i, (v, f) in enumerate(zip(views, frames, strict=True))
        ],
    }
    for form in forms.values():
        _assert_same_streams(parse_frames(form, keys, nbytes), want)
    backwards = [f.copy() for f in frames[::-1]]  # the last frame of the arena first
    _assert_same_streams(
        parse_frames(views[::-1], keys, nbytes), parse_frames(backwards, keys, nbytes)
    )


def _stream_at(frame: np.ndarray, nbytes: int, block: int, j: int) -> int:
    """Where the size prefix of stream ``j`` of block ``block`` of ``frame`` is."""
    streams = parse_frames([frame], ["x"], nbytes)
    split = np.flatnonzero(streams.dst == block * int(streams.blocksize[0]))[0] + j
    return int(streams.src[split]) - 4


@pytest.mark.parametrize("arena", [True, False])
def test_damaged_frames_in_a_large_batch(arena: bool):
    """Several damaged frames among many: the first one is named, and the stream walk
    comes after every frame's header is checked."""
    nbytes = 1_000_000  # 16 blocks, 61 streams: the damage is named block by block
    frames = _batch(nbytes, 40)
    keys = [f"big/0.{i}" for i in range(len(frames))]

    def check(batch: list[np.ndarray], key: str, reason: str) -> None:
        if arena:
            host, offsets, sizes, _ = _lay_out(batch)
            batch = _views(host, offsets, sizes)
        with pytest.raises(ChunkDecodeError) as info:
            parse_frames(batch, keys, nbytes)
        assert info.value.key == key
        assert info.value.codec == "blosc" and info.value.reason == reason

    f17, f30 = frames[17], frames[30]
    pos17, pos30 = _stream_at(f17, nbytes, 2, 1), _stream_at(f30, nbytes, 0, 0)
    batch = list(frames)
    batch[17] = _set_i32(f17, pos17, -5)  # stream 1 of block 2
    batch[30] = _set_i32(f30, pos30, f30.size)
    size17 = f"{f17.size}-byte frame"
    check(
        batch,
        keys[17],
        f"stream 1 of block 2 declares -5 bytes at byte {pos17 + 4}, which "
        f"does not fit in the {size17}",
    )
    batch[17] = _set_i32(batch[17], 16 + 4 * 3, 8)  # block 3 starts in the table: later
    check(
        batch,
        keys[17],
        f"stream 1 of block 2 declares -5 bytes at byte {pos17 + 4}, which "
        f"does not fit in the {size17}",
    )
    batch[17] = _set_i32(batch[17], 16 + 4 * 1, -1)  # block 1 starts outside: first
    check(
        batch,
        keys[17],
        f"block 1 of 16 starts at byte -1, outside the 80..{f17.size - 4} "
        f"range of stream data in this {size17}",
    )
    batch[30] = _set_i32(f30, 4, nbytes + 1)  # a later header: checked before any walk
    check(batch, keys[30], f"header declares {nbytes + 1} decoded bytes, expected {nbytes}")
    batch[30] = f30
    f3 = frames[3]  # an earlier frame whose last block starts too late
    batch[3] = _set_i32(f3, 16 + 4 * 15, f3.size - 3)
    check(
        batch,
        keys[3],
        f"block 15 of 16 starts at byte {f3.size - 3}, outside the 80..{f3.size - 4} range of "
        f"stream data in this {f3.size}-byte frame",
    )


def test_damaged_frame_with_many_streams():
    """In a frame of more than 128 streams, the damage named first is the first of the
    block starts, then of the streams 0 of every block, then of the streams 1, ..."""
    nbytes = 3_000_000  # 46 blocks, 181 streams
    good, f = _batch(nbytes, 2)
    keys = ["many/0", "many/1"]
    pos = _stream_at(f, nbytes, 1, 2)
    bad = _set_i32(f, pos, 0)  # stream 2 of block 1
    size = f"{f.size}-byte frame"
    stream = (
        f"stream 2 of block 1 declares 0 bytes at byte {pos + 4}, which does not fit in the {size}"
    )
    for batch in ([good, bad], [good.tobytes(), bad.tobytes()]):
        with pytest.raises(ChunkDecodeError, match=re.escape(stream)):
            parse_frames(batch, keys, nbytes)
    late = _stream_at(f, nbytes, 40, 1)
    worse = _set_i32(bad, late, f.size)  # stream 1 of block 40: an earlier round
    reason = f"stream 1 of block 40 declares {f.size} bytes at byte {late + 4}"
    with pytest.raises(ChunkDecodeError, match=re.escape(reason)):
        parse_frames([good, worse], keys, nbytes)
    worst = _set_i32(worse, 16 + 4 * 30, 17)  # block 30 starts in the table: first of all
    reason = f"block 30 of 46 starts at byte 17, outside the 200..{f.size - 4} range"
    with pytest.raises(ChunkDecodeError, match=re.escape(reason)) as info:
        parse_frames([good, worst], keys, nbytes)
    assert info.value.key == "many/1"


# -- the device decoder (nvCOMP streams, CuPy unshuffle) against numcodecs -----------


def _decode_on(device: str, frames: list[np.ndarray], keys: list[str], nbytes: int) -> np.ndarray:
    if device == "cpu":
        return decode_host(frames, keys, nbytes)
    import cupy as cp

    from xarray_gds.codecs import nvcomp

    batch = nvcomp.pack([cp.asarray(f) for f in frames])
    got = nvcomp.decode_frames(BLOSC, batch, batch.offsets, batch.sizes, nbytes, keys)
    assert isinstance(got, cp.ndarray)
    return cp.asnumpy(got)


@pytest.mark.parametrize("cname", CNAMES)
@pytest.mark.parametrize("shuffle", SHUFFLES)
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("blocksize", [0, 4096])
def test_batch_decode_matches_numcodecs(
    device: str, cname: str, shuffle: int, itemsize: int, blocksize: int
) -> None:
    """Mixed batches: compressible and random chunks, memcpyed frames (clevel 0)."""
    nbytes = 24_000 // itemsize * itemsize
    frames = []
    for i, clevel in enumerate((5, 0, 9, 5)):
        codec = numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=shuffle, blocksize=blocksize)
        raw = _data("random" if i == 2 else "smooth", nbytes, seed=i)
        frames.append(_encode(codec, raw.view(f"u{itemsize}")))
    keys = [f"v/c/{i}" for i in range(len(frames))]
    got = _decode_on(device, frames, keys, nbytes)
    want = _reference(numcodecs.Blosc(), frames)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("damage", ["truncated", "sizes", "payload"])
def test_damaged_frames_raise_on_every_device(device: str, damage: str) -> None:
    codec = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
    nbytes = 40_000
    frames = [_encode(codec, _data("smooth", nbytes, seed=i).view("u4")) for i in range(3)]
    bad = frames[1].copy()
    if damage == "truncated":
        bad = bad[: len(bad) // 2]
    elif damage == "sizes":
        bad[4:8] = np.frombuffer(np.int32(nbytes + 8).tobytes(), dtype=np.uint8)
    else:  # LZ4 data garbled after the tables: the stream walk or nvCOMP must notice
        bad[len(bad) // 2 :] = 0xFF
    frames[1] = bad
    keys = ["v/c/0", "v/c/1", "v/c/2"]
    with pytest.raises(ChunkDecodeError, match="v/c/1"):
        _decode_on(device, frames, keys, nbytes)
    # the next decode in the same process works
    good = [frames[0], frames[2]]
    got = _decode_on(device, good, ["v/c/0", "v/c/2"], nbytes)
    assert got.tobytes() == _reference(numcodecs.Blosc(), good).tobytes()


def _host_stream_decode(
    fmt: Any,
    arena: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    decoded_sizes: np.ndarray,
    keys: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """The device runtime's batch decode of raw streams, on the host: each stream by its
    format's raw decoder, end to end in one buffer."""
    parts = [
        np.frombuffer(fmt.decode_raw(arena[s : s + n], int(d)), dtype=np.uint8)
        for s, n, d in zip(starts.tolist(), lengths.tolist(), decoded_sizes.tolist(), strict=True)
    ]
    assert [p.size for p in parts] == decoded_sizes.tolist(), list(keys)
    at = np.cumsum(decoded_sizes) - decoded_sizes
    return np.concatenate([np.zeros(0, np.uint8), *parts]), at.astype(np.int64)


def test_device_decode_of_an_arena_with_numpy() -> None:
    """The device route's decode of frames in an arena (``decode_frames``: tables to the
    host, raw streams gathered, one batch call an inner format, the shuffles undone),
    run with numpy and a host stand-in for the batch call, gives the frames' bytes."""
    from xarray_gds.codecs.formats.blosc.encode import gather_host

    nbytes = 96_000
    codecs = [*_MIXED, numcodecs.Blosc("zstd", 3, numcodecs.Blosc.BITSHUFFLE, typesize=8)]
    data = [_data("smooth", nbytes, i) for i in range(len(codecs))]
    data[1] = _data("random", nbytes, 1)  # raw streams too
    frames = [_encode(c, d) for c, d in zip(codecs, data, strict=True)]
    arena, offsets, sizes, _ = _lay_out(frames)
    keys = [f"d/{i}" for i in range(len(frames))]
    got = BLOSC.decode_frames(
        arena, offsets, sizes, nbytes, keys, xp=np, gather=gather_host, decode=_host_stream_decode
    )
    np.testing.assert_array_equal(got, np.stack(data))
    empty = BLOSC.decode_frames(
        arena, offsets[:0], sizes[:0], nbytes, [], xp=np, gather=gather_host, decode=None
    )
    assert empty.shape == (0, nbytes)

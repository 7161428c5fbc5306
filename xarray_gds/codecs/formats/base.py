"""What a compression format is to the package: the :class:`Format` base, the decode
stage a planned array holds (:class:`Compressor`), and the stream-header helpers that
every format's checks share.

Each format's module (:mod:`~xarray_gds.codecs.formats.zstd`, ``lz4``, ``deflate``,
``blosc``, ``crc32c``) defines one subclass and its object(s); the registry in
:mod:`xarray_gds.codecs.formats` lists them. The decode and encode runtimes
(:mod:`~xarray_gds.codecs.host`, :mod:`~xarray_gds.codecs.nvcomp`,
:mod:`~xarray_gds.codecs.encode`, :mod:`xarray_gds.route`) take these objects and
never test a format's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from xarray_gds.errors import ChunkDecodeError

__all__ = [
    "PEEK",
    "Compressor",
    "DeviceWalk",
    "Format",
    "Rates",
    "first_bad",
    "first_word",
    "heads",
]

PEEK = 18  #: bytes of each chunk that header checks read (the longest zstd frame header)


@dataclass(frozen=True)
class Rates:
    """Decode (and encode) rates of one compressor, in decoded bytes a second (see
    :mod:`xarray_gds.route`)."""

    gpu_chunk: float  #: one chunk alone on the GPU
    gpu_batch: float  #: a large batch on the GPU
    host_thread: float  #: one host thread
    #: one host thread with the format's fast decoder (:meth:`Format.fast_decoder`),
    #: where it has one; the route takes it only where that decoder is installed
    host_fast: float | None = None
    #: encoding: one chunk alone by nvCOMP, a large nvCOMP batch, one host thread (the
    #: numcodecs codec); where any is unknown, device values always encode on the GPU
    encode_gpu_chunk: float | None = None
    encode_gpu_batch: float | None = None
    encode_host_thread: float | None = None


@dataclass(frozen=True)
class DeviceWalk:
    """A CUDA kernel that checks on the device that every raw stream of a batch is whole
    (nvCOMP does not report truncated or corrupt zstd and LZ4 input: it returns the
    expected sizes and garbage). One thread per stream writes a status, 0 when whole.

    Attributes
    ----------
    source : str
        CUDA source of the kernel.
    entry : str
        Its ``extern "C"`` name. It takes ``(arena, offsets, sizes, n[, wanted], status)``.
    errors : mapping of int to str
        Message of each nonzero status.
    sized : bool
        The kernel also takes the decoded size of every stream (``wanted``).
    """

    source: str
    entry: str
    errors: Mapping[int, str]
    sized: bool = False


def heads(chunks: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The first :data:`PEEK` bytes of each host chunk (zeros past its end) and its size,
    as :meth:`Format.check` takes them.

    Parameters
    ----------
    chunks : sequence of array-like
        Encoded chunks in host memory (anything with the buffer protocol).

    Returns
    -------
    (heads, sizes)
        ``(n, PEEK)`` uint8 and ``(n,)`` int64.
    """
    out = np.zeros((len(chunks), PEEK), dtype=np.uint8)
    sizes = np.empty(len(chunks), dtype=np.int64)
    for i, raw in enumerate(chunks):
        data = np.frombuffer(raw, dtype=np.uint8)
        sizes[i] = data.size
        out[i, : min(PEEK, data.size)] = data[:PEEK]
    return out, sizes


def first_bad(bad: np.ndarray) -> int | None:
    """Index of the first true entry of ``bad``, or None."""
    where = np.flatnonzero(bad)
    return int(where[0]) if where.size else None


def first_word(heads: np.ndarray) -> np.ndarray:
    """The first 4 bytes of every head as a little-endian integer (int64)."""
    h = heads.astype(np.int64)
    return h[:, 0] | h[:, 1] << 8 | h[:, 2] << 16 | h[:, 3] << 24


def _instance(codec: Any, cls: type | None) -> bool:
    """Whether ``codec`` is an instance of ``cls`` (never, when ``cls`` is None)."""
    return cls is not None and isinstance(codec, cls)


@dataclass(frozen=True, eq=False, repr=False)
class Format:
    """One compression format and everything the package knows about it.

    Formats are singletons, listed by :data:`xarray_gds.codecs.formats.FORMATS`: they
    compare by identity and unpickle to the registry's object.

    Attributes
    ----------
    name : str
        The format's name: in messages, and the key of its route rates in
        ``xarray_gds.route_constants``.
    nvcomp : str or None
        nvCOMP algorithm that decodes and encodes its raw stream (``BitstreamKind.RAW``),
        or None when nvCOMP has none (Blosc, whose streams are decoded one by one).
    skip, trim : int
        Framing bytes before the raw stream, and in all (numcodecs' LZ4 size prefix,
        zlib's header and Adler-32 trailer): what nvCOMP must not see. The encoder
        reserves ``skip`` bytes before each raw stream and ``trim - skip`` after it.
    min_size : int
        Bytes of the shortest valid stream.
    rates : Rates or None
        Default rates of the decode-route cost model (measured on the H200 host,
        nvCOMP 6, numcodecs 0.16, 4 MiB chunks of weather-like float32, by
        ``xarray-gds calibrate`` on 3 December 2026); None: always the GPU route.
    walk : DeviceWalk or None
        Device check that every raw stream is whole, run before nvCOMP decodes.
    tail : int
        Bytes at the end of each raw stream that :meth:`check_tail` reads (device
        decodes only; gzip's ISIZE).
    encodes : bool
        The batched encoder writes this format (with nvCOMP, or on the host the same
        streams).
    encode_limit : int or None
        Largest chunk nvCOMP's encoder takes, in bytes.
    adler32 : bool
        Its framing ends with the Adler-32 of the decoded bytes (zlib), which the encoder
        computes on the device or the host.
    container : bool
        Its chunks are frames holding streams of other formats (Blosc): the device
        decodes them with :meth:`decode_frames`, the streams of each inner format in one
        batch call.
    """

    name: str
    nvcomp: str | None = None
    skip: int = 0
    trim: int = 0
    min_size: int = 0
    rates: Rates | None = None
    walk: DeviceWalk | None = None
    tail: int = 0
    encodes: bool = True
    encode_limit: int | None = None
    adler32: bool = False
    container: bool = False

    #: numcodecs codec class of the format, and the Zarr v3 codec class (whose ``level``
    #: the numcodecs codec takes), if any
    numcodecs_class: ClassVar[type | None] = None
    zarr_class: ClassVar[type | None] = None
    #: the codecs' level-like setting (None: none that nvCOMP's encoders ignore)
    level_name: ClassVar[str | None] = "level"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} format {self.name!r}>"

    def __reduce__(self) -> Any:
        from xarray_gds.codecs.formats import get

        return get, (self.name,)

    # -- building codecs and planning -------------------------------------------------

    def numcodecs_codec(self, **options: Any) -> Any:
        """A numcodecs codec that writes (and decodes) this format's chunks."""
        if self.numcodecs_class is None:
            raise NotImplementedError(f"{self.name} has no numcodecs codec")
        return self.numcodecs_class(**options)

    def from_numcodecs(self, codec: Any) -> Compressor | None:
        """The decode stage of a Zarr v2 (numcodecs) compressor of this format, else None."""
        return Compressor(self, codec) if _instance(codec, self.numcodecs_class) else None

    def from_zarr(self, codec: Any) -> Compressor | None:
        """The decode stage of a Zarr v3 codec of this format, else None."""
        if not _instance(codec, self.zarr_class):
            return None
        return Compressor(self, self.numcodecs_codec(level=codec.level))

    def refuse_encode(self, codec: Any) -> str:
        """Why nvCOMP cannot write exactly what ``codec`` describes ("" when it can),
        compression levels aside (see :meth:`level_setting`)."""
        return ""

    def encode_options(self, codec: Any, dtype: np.dtype) -> Any:
        """What the batched encoder needs to know of ``codec`` (``None``: the codec's
        default when ``codec`` is None) beyond the format, for formats whose chunks are
        containers made by :meth:`encode_frames` (Blosc); None for raw-stream formats."""
        return None

    def level_setting(self, codec: Any) -> tuple[str, Any, Any] | None:
        """``(name, level, default level)`` of the level-like setting of ``codec``."""
        classes = tuple(c for c in (self.numcodecs_class, self.zarr_class) if c is not None)
        if self.level_name is None or not isinstance(codec, classes):
            return None
        value, default = getattr(codec, self.level_name), getattr(type(codec)(), self.level_name)
        return self.level_name, value, default

    # -- framing ----------------------------------------------------------------------

    def check(
        self, heads: np.ndarray, sizes: np.ndarray, nbytes: int, keys: Sequence[str]
    ) -> tuple[int, int]:
        """Validate the headers of a batch of streams of this format.

        Parameters
        ----------
        heads : numpy.ndarray
            ``(n, PEEK)`` uint8: the first bytes of each chunk (zeros past its end).
        sizes : numpy.ndarray
            Encoded size of each chunk.
        nbytes : int
            Expected decoded size of every chunk.
        keys : list of str
            Chunk keys, for errors.

        Returns
        -------
        (skip, trim)
            Bytes before the raw stream and bytes to drop in all (nvCOMP's view of the
            stream).

        Raises
        ------
        ChunkDecodeError
            A chunk is too short, has a bad header, or declares another decoded size.
        """
        sizes = np.asarray(sizes)
        j = first_bad(sizes < self.min_size)
        if j is not None:
            raise ChunkDecodeError(
                keys[j], self.name, f"{int(sizes[j])} bytes is too short for a {self.name} stream"
            )
        self._check_heads(heads, nbytes, keys)
        return self.skip, self.trim

    def _check_heads(self, heads: np.ndarray, nbytes: int, keys: Sequence[str]) -> None:
        """Raise ChunkDecodeError for the first chunk whose header is wrong."""

    def _wrong_size(self, key: str, says: str, declared: int, nbytes: int) -> ChunkDecodeError:
        """The error of a chunk whose framing declares another decoded size (``says``
        formats the declared size)."""
        return ChunkDecodeError(
            key,
            self.name,
            f"{says.format(declared)}, expected {nbytes}",
            decoded=declared,
            expected=nbytes,
        )

    def check_tail(self, tails: np.ndarray, nbytes: int, keys: Sequence[str]) -> None:
        """Check the last :attr:`tail` bytes ``(n, tail)`` of every raw stream."""

    def check_host(self, chunks: Sequence[Any], nbytes: int, keys: Sequence[str]) -> bool:
        """Check host chunks before numcodecs decodes them (numcodecs allocates what a
        stream declares before it decodes a byte, so a damaged header would otherwise ask
        for terabytes); return whether every chunk is known to decode to ``nbytes``
        bytes, so that numcodecs may decode straight into the output."""
        found, sizes = heads(chunks)
        self.check(found, sizes, nbytes, keys)
        return self._decodes_into(found, nbytes)

    def _decodes_into(self, heads: np.ndarray, nbytes: int) -> bool:
        return False

    def fast_decoder(self) -> Callable[[Any, int], Any] | None:
        """A faster host decoder of whole chunks (framing included) than the numcodecs
        codec, when its optional package is installed (the ``fast-host`` extra), else
        None.

        ``decode(chunk, nbytes)`` returns the decoded bytes, or None wherever it cannot
        decode the chunk to exactly ``nbytes`` bytes as the numcodecs codec would (a
        damaged stream, another size, a framing it does not follow): the numcodecs codec
        then decodes that chunk, and raises what it raises. Called once a batch.
        """
        return None

    # -- raw streams (nvCOMP's view), on the host ---------------------------------------

    def encode_raw(self, row: np.ndarray) -> bytes:
        """One raw stream as nvCOMP writes it (``BitstreamKind.RAW``), made on the host
        (by default: the numcodecs codec's stream, for formats without framing)."""
        if self.trim:
            raise NotImplementedError(f"{self.name} has no raw stream encoder")
        return bytes(self.numcodecs_codec().encode(row))

    def decode_raw(self, stream: np.ndarray, nbytes: int) -> Any:
        """Decode one raw stream (no framing) of ``nbytes`` decoded bytes on the host."""
        return self.decode_framed(stream, nbytes)

    def decode_framed(self, stream: np.ndarray, nbytes: int) -> Any:
        """Decode one stream with its framing on the host (numcodecs' view)."""
        return self.numcodecs_codec().decode(stream)

    def decode_frames(self, *frames: Any, **runtime: Any) -> Any:
        """Decode the frames of a :attr:`container` on the device.

        ``frames`` are ``(arena, offsets, sizes, nbytes, keys)``: the frames at
        ``offsets`` (of ``sizes`` bytes) of ``arena``, each of ``nbytes`` decoded bytes,
        and their chunk keys; ``runtime`` the device runtime's ``xp`` (the array module),
        ``gather(src, src_offsets, dst, dst_offsets, sizes)`` and ``decode(format, arena,
        starts, lengths, decoded_sizes, keys) -> (buffer, offsets)`` (one batch call of
        raw streams of ``format``). Returns a ``(n, nbytes)`` ``xp`` array."""
        raise NotImplementedError(f"{self.name} chunks are not frames of other formats")

    # -- encoding ---------------------------------------------------------------------

    def encode_bound(self, nbytes: int) -> int:
        """Output capacity per chunk that nvCOMP's encoder accepts (it asks for its
        worst case)."""
        return nbytes + nbytes // 64 + 65536

    def write_framing(
        self, out: np.ndarray, starts: np.ndarray, raw_sizes: np.ndarray, nbytes: int, sums: Any
    ) -> None:
        """Write the framing around raw streams placed at ``starts + skip`` of ``out``
        (``sums``: the Adler-32 of every chunk's decoded bytes where :attr:`adler32`)."""


@dataclass(frozen=True)
class Compressor:
    """One bytes-to-bytes decompression stage.

    Attributes
    ----------
    format : Format
        Stream format (see :mod:`xarray_gds.codecs.formats`). A format's name is accepted
        too and looked up in the registry.
    host_codec : numcodecs.abc.Codec
        The numcodecs codec that decodes one chunk on the host.
    device_ready : bool
        Whether the device decodes it (Blosc: not with blosclz or snappy streams).
    detail : str
        What the codec is, for messages (e.g. ``"blosc (cname blosclz)"``).
    """

    format: Format
    host_codec: Any
    device_ready: bool = True
    detail: str = ""

    def __init__(
        self,
        format: Format | str,
        host_codec: Any,
        device_ready: bool = True,
        detail: str = "",
    ) -> None:
        if isinstance(format, str):
            from xarray_gds.codecs.formats import get

            format = get(format)
        object.__setattr__(self, "format", format)
        object.__setattr__(self, "host_codec", host_codec)
        object.__setattr__(self, "device_ready", device_ready)
        object.__setattr__(self, "detail", detail)

    @property
    def name(self) -> str:
        """The format's name."""
        return self.format.name

"""Where a batch of GPU-bound chunks decodes (and a batch of device values encodes):
nvCOMP on the GPU, or the host pool.

nvCOMP spreads a batch over its chunks, so a batch of few chunks uses a small part of
the GPU: on an H200 one 4 MB chunk of zarr's default compressor took 37.8 ms alone, 8
of them 51 ms and 152 of
them 66 ms, while one host thread decodes such a chunk in 14.6 ms and 16 threads do
about 900 a second. :func:`choose` compares two estimates for each batch and picks the
faster one:

- GPU: ``call + chunk_bytes / gpu_chunk + batch_bytes / gpu_batch`` (a fixed cost per
  nvCOMP call, the time of the slowest chunk alone, and the batch's bytes at the GPU's
  full rate);
- host: ``host_call + rounds * chunk_bytes / host_thread + batch_bytes / h2d`` with
  ``rounds = ceil(chunks / threads)`` (the pool decodes ``threads`` chunks at a time),
  then one copy of the decoded bytes to the device.

The rates are per compressor and in decoded bytes a second. The defaults (each format's
``rates``, see :mod:`xarray_gds.codecs.formats`) were measured on the H200 host by
``xarray-gds calibrate``, which measures them on the machine at
hand and prints them in the form the ``xarray_gds.route_constants`` setting takes (a mapping,
or its JSON text in ``XARRAY_GDS_ROUTE_CONSTANTS``). ``xarray_gds.route`` forces a
route: ``"gpu"``, ``"host"``, or ``"auto"`` (the default). Values are identical on
either route: both decode the same streams and place the same chunks, and the result
is on the device either way.

Writes of device values take the same decision the other way (:func:`choose_encode`):
nvCOMP's ``call + chunk_bytes / encode_gpu_chunk + batch_bytes / encode_gpu_batch``
against one copy of the batch to the host (``d2h``) and ``rounds * chunk_bytes /
encode_host_thread``, the host threads encoding a chunk each with the array's numcodecs
codec (so the stored bytes are those zarr writes). Small writes in loops (an append of
a step, a region of a chunk) are what the host route serves.

A batch sent to the GPU may still give the host pool a share (:func:`split`, a
:class:`Split`): ``k`` of its chunks decode on the host threads while nvCOMP decodes
the other ``n - k``, and the batch takes ``max(host(k), gpu(n - k))`` by the two
estimates above. nvCOMP's time hardly shrinks with fewer chunks (its slowest chunk
sets it), so a share pays where the host's time for ``k`` chunks fits beside it: ``k``
is the smallest that balances the two. A split is taken only where it promises to
save at least ``split_gain`` (10%) of the GPU's time alone, for what the model leaves
out (the host share's stored bytes copied back from the device, the host threads'
Python work), and never for chunks under 256 KiB (:data:`SPLIT_MIN_BYTES`).
``xarray_gds.split`` is ``"auto"`` (the default), ``"off"`` (never), or
``"on"`` (every batch sent to the GPU of two chunks or more, at least one chunk each
side: for tests and measurements).

Host rates: a format with a faster host decoder installed
(:meth:`~xarray_gds.codecs.formats.base.Format.fast_decoder`) decodes at its
``host_fast`` rate, where :func:`costs` finds that decoder.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from xarray_gds import config
from xarray_gds.codecs.formats import FORMATS, Format, Rates

__all__ = [
    "Costs",
    "Rates",
    "Split",
    "choose",
    "choose_encode",
    "costs",
    "estimate",
    "estimate_encode",
    "plan",
    "split",
]

#: Each format's default rates, by name.
_DEFAULT_RATES = tuple((name, f.rates) for name, f in FORMATS.items() if f.rates is not None)


@dataclass(frozen=True)
class Costs:
    """The cost model's constants (see the module docstring)."""

    gpu_call: float = 2.1e-3  #: seconds of one nvCOMP batch call (of one tiny chunk)
    host_call: float = 1.0e-4  #: seconds of one host batch, pool hand-off included
    h2d: float = 6.0e9  #: bytes a second of the copy of decoded chunks to the device
    #: bytes a second of the copy of chunks to encode to (pageable) host memory (H100)
    d2h: float = 3.1e9
    threads: int = 0  #: host decode threads (0: the shared pool's size)
    #: seconds of a chunk's Python work on the host (header checks, the pool's hand-off),
    #: which the GIL runs one at a time (17 us on the CI machine's CPU)
    host_chunk: float = 1.5e-5
    #: the least share of the GPU's time alone that a split must save
    split_gain: float = 0.1
    #: by format name; the defaults are each format's own (:attr:`Format.rates`)
    rates: tuple[tuple[str, Rates], ...] = _DEFAULT_RATES

    def rate(self, compressor: Format) -> Rates | None:
        """The rates of a format, if known."""
        return dict(self.rates).get(compressor.name)

    def to_json(self) -> str:
        """The constants as ``xarray_gds.route_constants`` takes them."""
        body = asdict(self)
        body["rates"] = {name: asdict(r) for name, r in self.rates}
        return json.dumps(body, indent=1, sort_keys=True)


def costs() -> Costs:
    """The defaults, updated by ``xarray_gds.route_constants`` (a mapping or JSON text
    with any of :class:`Costs`' fields; ``rates`` maps compressor names to any of
    :class:`Rates`' fields)."""
    import zarr

    given: Any = zarr.config.get("xarray_gds.route_constants", None)
    if given is None or given == "":
        given = config.get("route_constants")
    if not given:
        return _installed(Costs())
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except json.JSONDecodeError as err:
            raise ValueError(
                "xarray_gds.route_constants (XARRAY_GDS_ROUTE_CONSTANTS) is not valid JSON: "
                f"{err}; `xarray-gds calibrate` prints a valid value"
            ) from err
    if not isinstance(given, dict):
        raise ValueError(
            f"xarray_gds.route_constants must be a mapping or its JSON text, got {given!r}"
        )
    base = _installed(Costs())
    rates = dict(base.rates)
    for name, fields in dict(given.get("rates", {})).items():
        start = rates.get(name, Rates(110e6, 10e9, 300e6))
        given_rates: dict[str, Any] = {
            k: None if v is None else float(v) for k, v in fields.items()
        }
        if "host_thread" in given_rates:  # a measured host rate: the default fast one goes
            given_rates.setdefault("host_fast", None)
        rates[name] = replace(start, **given_rates)
    scalars = {k: v for k, v in given.items() if k != "rates"}
    known = {"gpu_call", "host_call", "host_chunk", "h2d", "d2h", "threads", "split_gain"}
    unknown = set(scalars) - known
    if unknown:
        raise ValueError(
            f"xarray_gds.route_constants has unknown fields {sorted(unknown)}; "
            "known: gpu_call, host_call, host_chunk, h2d, d2h, threads, split_gain, rates"
        )
    return replace(base, rates=tuple(rates.items()), **scalars)


def _installed(c: Costs) -> Costs:
    """``c`` without the ``host_fast`` rates of formats whose fast host decoder is not
    installed (those decode at ``host_thread``)."""
    rates = []
    for name, r in c.rates:
        fmt = FORMATS.get(name)
        if r.host_fast is not None and (fmt is None or fmt.fast_decoder() is None):
            r = replace(r, host_fast=None)
        rates.append((name, r))
    return replace(c, rates=tuple(rates))


def estimate(
    compressor: Format | None,
    n_chunks: int,
    chunk_nbytes: int,
    constants: Costs | None = None,
) -> tuple[float, float]:
    """Seconds ``(gpu, host)`` to decode ``n_chunks`` chunks of ``chunk_nbytes`` decoded
    bytes compressed with ``compressor`` (``inf`` where a route has no rate), by
    ``constants`` (default: :func:`costs`)."""
    c = costs() if constants is None else constants
    rate = c.rate(compressor) if compressor else None
    if rate is None or n_chunks <= 0:
        return 0.0, math.inf
    from xarray_gds.batch import pool_threads

    threads = c.threads or pool_threads()
    return _times(c, rate, n_chunks, chunk_nbytes, threads)


def _times(
    c: Costs, rate: Rates, n_chunks: int, chunk_nbytes: int, threads: int
) -> tuple[float, float]:
    """Seconds ``(gpu, host)`` of ``n_chunks`` chunks on each route alone (0 for none)."""
    if n_chunks <= 0:
        return 0.0, 0.0
    total = n_chunks * chunk_nbytes
    gpu = c.gpu_call + chunk_nbytes / rate.gpu_chunk + total / rate.gpu_batch
    rounds = -(-n_chunks // max(1, threads))
    # each chunk's copy to the device starts as soon as it is decoded (decode_staged):
    # the copies overlap the decoding but for the last chunk's
    decoding = rounds * chunk_nbytes / (rate.host_fast or rate.host_thread)
    decoding = max(decoding, n_chunks * c.host_chunk)  # Python's part: one thread at a time
    host = c.host_call + max(decoding, total / c.h2d) + chunk_nbytes / c.h2d
    return gpu, host


def choose(compressor: Format | None, n_chunks: int, chunk_nbytes: int) -> str:
    """``"gpu"`` or ``"host"``: where a GPU-bound batch of ``n_chunks`` chunks decodes.

    Uncompressed chunks (``compressor`` None) and compressors without rates always take
    the GPU route; ``xarray_gds.route`` set to ``"gpu"`` or ``"host"`` forces one.
    """
    forced = _forced()
    if forced != "auto":
        return forced
    if compressor is None:
        return "gpu"
    if _split_mode() == "on" and n_chunks >= 2:
        return "gpu"  # read onto the device, where its chunks are shared (plan)
    gpu, host = estimate(compressor, n_chunks, chunk_nbytes)
    return "host" if host < gpu else "gpu"


def estimate_encode(
    compressor: Format | None,
    n_chunks: int,
    chunk_nbytes: int,
    constants: Costs | None = None,
) -> tuple[float, float]:
    """Seconds ``(gpu, host)`` to encode ``n_chunks`` chunks of ``chunk_nbytes`` bytes
    held in device memory with ``compressor``: one nvCOMP call, or one copy to the host
    and the host threads a chunk each (``inf`` for the host where a rate is unknown)."""
    c = costs() if constants is None else constants
    rate = c.rate(compressor) if compressor else None
    if rate is None:
        return 0.0, math.inf
    one, batch, thread = rate.encode_gpu_chunk, rate.encode_gpu_batch, rate.encode_host_thread
    if one is None or batch is None or thread is None or n_chunks <= 0:
        return 0.0, math.inf
    from xarray_gds.batch import pool_threads

    threads = c.threads or pool_threads()
    total = n_chunks * chunk_nbytes
    gpu = c.gpu_call + chunk_nbytes / one + total / batch
    rounds = -(-n_chunks // max(1, threads))
    host = c.host_call + total / c.d2h + rounds * chunk_nbytes / thread
    return gpu, host


def choose_encode(compressor: Format | None, n_chunks: int, chunk_nbytes: int) -> str:
    """``"gpu"`` or ``"host"``: where a batch of ``n_chunks`` chunks of device values
    encodes. nvCOMP encodes each chunk of a batch on a small part of the GPU, so a batch
    of few chunks takes about as long as its slowest chunk alone (on an H100, 8 ms for
    one 1 MiB zstd chunk), where the host threads encode a few chunks side by side.
    Uncompressed chunks and compressors without encode rates take the GPU;
    ``xarray_gds.route`` set to ``"gpu"`` or ``"host"`` forces one."""
    forced = _forced()
    if forced != "auto":
        return forced
    if compressor is None:
        return "gpu"
    gpu, host = estimate_encode(compressor, n_chunks, chunk_nbytes)
    return "host" if host < gpu else "gpu"


def _forced() -> str:
    forced = str(config.get("route")).lower()
    if forced not in ("auto", "gpu", "host"):
        raise ValueError(
            f"xarray_gds.route (XARRAY_GDS_ROUTE) must be 'auto', 'gpu' or 'host', got {forced!r}"
        )
    return forced


def _split_mode() -> str:
    return str(config.get("split")).lower()


#: Chunks smaller than this are never split between the GPU and the host (unless
#: forced): the default rates are measured at 4 MiB, and nvCOMP decodes small chunks
#: several times faster than they say (the fastest format: 53 GB/s at 256 KiB, 7 GB/s
#: at 4 MiB).
SPLIT_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class Split:
    """How a batch sent to the GPU decodes: ``host`` of its chunks on ``threads``
    threads of the host pool while nvCOMP decodes the other ``gpu``, with the cost
    model's seconds of each side."""

    host: int  #: chunks decoded on the host pool (the batch's last ones)
    gpu: int  #: chunks decoded by nvCOMP meanwhile
    threads: int  #: host threads the host's chunks take (at most the pool's)
    host_s: float  #: predicted seconds of the host's share (0 without one)
    gpu_s: float  #: predicted seconds of nvCOMP's share (0 without one)

    @property
    def seconds(self) -> float:
        """Predicted seconds of the batch: the slower side."""
        return max(self.host_s, self.gpu_s)


def split(
    compressor: Format | None,
    n_chunks: int,
    chunk_nbytes: int,
    costs: Costs,
    gpu: bool = True,
    force: bool = False,
) -> Split:
    """The share of the host pool in a batch of ``n_chunks`` chunks of ``chunk_nbytes``
    decoded bytes (see the module docstring); a pure function of its arguments.

    Parameters
    ----------
    compressor : Format or None
        The chunks' format; None (uncompressed) and formats without rates go to the
        GPU whole.
    n_chunks, chunk_nbytes : int
        The batch.
    costs : Costs
        The constants, with ``threads`` (the host pool's size) set.
    gpu : bool
        Whether a GPU decodes at all: without one, every chunk is the host's.
    force : bool
        Split whatever the gain: at least one chunk each side (``xarray_gds.split``
        ``"on"``), where there are two.

    Returns
    -------
    Split
        ``host == n_chunks``: the host route (it alone is faster than the GPU alone);
        ``host == 0``: nvCOMP alone; else the balanced share, where it saves at least
        ``costs.split_gain`` of the GPU's time alone (or ``force``).
    """
    if costs.threads < 1:
        raise ValueError("split() needs costs.threads, the host pool's size (>= 1)")
    n, threads = max(0, n_chunks), costs.threads
    rate = costs.rate(compressor) if compressor is not None else None
    if rate is None:  # nothing to estimate: where the chunks must go
        return Split(0, n, 0, 0.0, 0.0) if gpu else Split(n, 0, min(n, threads), 0.0, 0.0)

    def plan_of(k: int) -> Split:
        host_s = _times(costs, rate, k, chunk_nbytes, threads)[1]
        gpu_s = _times(costs, rate, n - k, chunk_nbytes, threads)[0]
        return Split(k, n - k, min(k, threads), host_s, gpu_s)

    whole_gpu, whole_host = plan_of(0), plan_of(n)
    if not gpu:
        return whole_host
    if whole_host.seconds < whole_gpu.seconds and not (force and n >= 2):
        return whole_host  # choose()'s rule: the host route
    if n < 2 or (chunk_nbytes < SPLIT_MIN_BYTES and not force):
        return whole_gpu
    # the host's time grows with k and nvCOMP's shrinks: the best k is the first where
    # the host's is at least nvCOMP's, or the one before it (the smaller on a tie)
    lo, hi = 0, n  # plan_of(n).host_s >= plan_of(n).gpu_s == 0
    while lo < hi:
        mid = (lo + hi) // 2
        p = plan_of(mid)
        if p.host_s >= p.gpu_s:
            hi = mid
        else:
            lo = mid + 1
    shares = sorted({min(max(k, 1), n - 1) for k in (lo - 1, lo)})
    best = min((plan_of(k) for k in shares), key=lambda p: p.seconds)
    if force or best.seconds <= (1.0 - costs.split_gain) * whole_gpu.seconds:
        return best
    return whole_gpu


def plan(compressor: Format | None, n_chunks: int, chunk_nbytes: int) -> Split:
    """:func:`split` of a batch read onto the device, by the settings: with ``costs()``
    and the host pool's size; ``xarray_gds.split`` ``"off"``, or ``xarray_gds.route``
    ``"gpu"`` unless ``xarray_gds.split`` is ``"on"``, keep the batch on nvCOMP."""
    mode, forced, n = _split_mode(), _forced(), max(0, n_chunks)
    from xarray_gds.batch import pool_threads

    c = costs()
    c = replace(c, threads=c.threads or pool_threads())
    if forced == "host":
        return Split(n, 0, min(n, c.threads), 0.0, 0.0)
    if compressor is None or mode == "off" or (forced == "gpu" and mode != "on"):
        return Split(0, n, 0, 0.0, 0.0)
    return split(compressor, n_chunks, chunk_nbytes, c, force=mode == "on")

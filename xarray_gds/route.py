"""Where a batch of GPU-bound chunks decodes: nvCOMP on the GPU, or the host pool.

nvCOMP spreads a batch over its chunks, so a batch of few chunks uses a small part of
the GPU: on an H200 one 4 MB zstd chunk took 37.8 ms alone, 8 of them 51 ms and 152 of
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
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from xarray_gds import config
from xarray_gds.codecs.formats import FORMATS, Format, Rates

__all__ = ["Costs", "Rates", "choose", "costs", "estimate"]

#: Each format's default rates, by name.
_DEFAULT_RATES = tuple((name, f.rates) for name, f in FORMATS.items() if f.rates is not None)


@dataclass(frozen=True)
class Costs:
    """The cost model's constants (see the module docstring)."""

    gpu_call: float = 2.1e-3  #: seconds of one nvCOMP batch call (of one tiny chunk)
    host_call: float = 1.0e-4  #: seconds of one host batch, pool hand-off included
    h2d: float = 6.0e9  #: bytes a second of the copy of decoded chunks to the device
    threads: int = 0  #: host decode threads (0: the shared pool's size)
    #: by format name; the defaults are each format's own (:attr:`Format.rates`)
    rates: tuple[tuple[str, Rates], ...] = _DEFAULT_RATES

    def rate(self, compressor: Format | str) -> Rates | None:
        """The rates of a format (or of the format of that name), if known."""
        return dict(self.rates).get(_name(compressor))

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
        return Costs()
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
    base = Costs()
    rates = dict(base.rates)
    for name, fields in dict(given.get("rates", {})).items():
        start = rates.get(name, Rates(110e6, 10e9, 300e6))
        rates[name] = replace(start, **{k: float(v) for k, v in fields.items()})
    scalars = {k: v for k, v in given.items() if k != "rates"}
    unknown = set(scalars) - {"gpu_call", "host_call", "h2d", "threads"}
    if unknown:
        raise ValueError(
            f"xarray_gds.route_constants has unknown fields {sorted(unknown)}; "
            "known: gpu_call, host_call, h2d, threads, rates"
        )
    return replace(base, rates=tuple(rates.items()), **scalars)


def _name(compressor: Format | str) -> str:
    return compressor if isinstance(compressor, str) else compressor.name


def estimate(
    compressor: Format | str | None, n_chunks: int, chunk_nbytes: int
) -> tuple[float, float]:
    """Seconds ``(gpu, host)`` to decode ``n_chunks`` chunks of ``chunk_nbytes`` decoded
    bytes compressed with ``compressor`` (a format, or a format's name; ``inf`` where a
    route has no rate)."""
    c = costs()
    rate = c.rate(compressor) if compressor else None
    if rate is None or n_chunks <= 0:
        return 0.0, math.inf
    from xarray_gds.batch import pool_threads

    threads = c.threads or pool_threads()
    total = n_chunks * chunk_nbytes
    gpu = c.gpu_call + chunk_nbytes / rate.gpu_chunk + total / rate.gpu_batch
    rounds = -(-n_chunks // max(1, threads))
    # each chunk's copy to the device starts as soon as it is decoded (decode_staged):
    # the copies overlap the decoding but for the last chunk's
    decoding = rounds * chunk_nbytes / rate.host_thread
    host = c.host_call + max(decoding, total / c.h2d) + chunk_nbytes / c.h2d
    return gpu, host


def choose(compressor: Format | str | None, n_chunks: int, chunk_nbytes: int) -> str:
    """``"gpu"`` or ``"host"``: where a GPU-bound batch of ``n_chunks`` chunks decodes.

    Uncompressed chunks (``compressor`` None) and compressors without rates always take
    the GPU route; ``xarray_gds.route`` set to ``"gpu"`` or ``"host"`` forces one.
    """
    forced = str(config.get("route")).lower()
    if forced not in ("auto", "gpu", "host"):
        raise ValueError(
            f"xarray_gds.route (XARRAY_GDS_ROUTE) must be 'auto', 'gpu' or 'host', got {forced!r}"
        )
    if forced != "auto":
        return forced
    if compressor is None:
        return "gpu"
    gpu, host = estimate(compressor, n_chunks, chunk_nbytes)
    return "host" if host < gpu else "gpu"

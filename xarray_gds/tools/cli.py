"""The ``xarray-gds`` command line tool: ``demo``, ``info``, ``bench`` and ``calibrate``.

``xarray-gds demo`` writes a synthetic weather-like Zarr store, reads it back with
``engine="gds-zarr"`` and ``engine="zarr"``, and shows where each variable landed and
that both engines agree (:mod:`xarray_gds.tools.demo`). ``xarray-gds info PATH`` lists
the arrays of a store with their chunking, codec chain, where each codec decodes and
where the engine places the data, for reads on the device this machine would use
(``--device`` picks another).
``xarray-gds bench`` times open + load against ``engine="zarr"`` (see
:mod:`xarray_gds.tools.bench`); ``xarray-gds calibrate`` measures the cost model's
constants (:mod:`xarray_gds.tools.calibrate`).

An error is one line on stderr, ``xarray-gds COMMAND: error: ...`` (exit status 1, 2
for usage errors); ``--debug``, before or after the command, prints its traceback too
(:mod:`xarray_gds.tools._errors`).

Like the rest of the package, importing this module loads no CUDA library.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
import zarr
import zarr.codecs
from numcodecs.abc import Codec as NumcodecsCodec
from xarray import conventions
from zarr.abc.codec import ArrayArrayCodec, ArrayBytesCodec, BytesBytesCodec

import xarray_gds
from xarray_gds import device as _device
from xarray_gds import documents
from xarray_gds.backend import consolidated_at_root, open_store, placement
from xarray_gds.codecs import DecodeChain, ShardChain, Unsupported, codec_name, plan_chain
from xarray_gds.codecs.formats import GZIP, ZLIB
from xarray_gds.errors import MetadataError
from xarray_gds.stores import urls as remote
from xarray_gds.tools import _errors, _text
from xarray_gds.tools import demo as demo_cmd
from xarray_gds.tools._text import PROG

__all__ = ["HOST_DECODE", "codec_name", "decode_path", "main"]

_EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE, what a shell reports for `yes | head`

# --------------------------------------------------------------------------------------
# Codec decode paths
# --------------------------------------------------------------------------------------

#: Decode route of codecs that zarr-python decodes (no batched decoder here).
HOST_DECODE = "host (zarr-python)"
GPU_DECODE = "GPU (batched)"
HOST_BATCHED = "host (batched)"


def decode_path(codec: Any, plan: Any = None, device: _device.Device = "cuda") -> str:
    """Where ``engine="gds-zarr"`` decodes ``codec`` of an array decoded by ``plan``.

    Parameters
    ----------
    codec : zarr codec or numcodecs.abc.Codec
        A codec from an array's codec chain (Zarr v3) or its filters/compressor (v2).
    plan : DecodeChain, ShardChain, Unsupported or None
        The array's plan from :func:`xarray_gds.codecs.plan_chain`.
    device : {"cuda", "cpu"}
        The device the engine reads with.

    Returns
    -------
    str
        ``"GPU (batched)"`` when reads on ``device="cuda"`` decode the array with the
        batched pipeline (nvCOMP, CuPy filters); ``"host (batched)"`` when reads on
        ``device="cpu"`` do (threaded numcodecs); else ``"host (zarr-python)"``: the
        plan is not batched, or it is but has no GPU decoder and the read is on
        ``"cuda"`` (such reads fall back to zarr-python, with a warning).
    """
    if not isinstance(plan, DecodeChain | ShardChain):
        return HOST_DECODE
    if device == "cpu":
        return HOST_BATCHED
    return GPU_DECODE if plan.device_ready else HOST_DECODE


# --------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------


#: Attributes that change how xarray decodes the values (shown by ``info``).
_CF_DECODING_ATTRS = frozenset(
    {
        "_FillValue",
        "missing_value",
        "scale_factor",
        "add_offset",
        "_Unsigned",
        "units",
        "calendar",
        "dtype",
    }
)


def _dimension_names(array: Any) -> tuple[str, ...] | None:
    """Dimension names as xarray reads them: v3 metadata or the v2 ``_ARRAY_DIMENSIONS``."""
    if array.metadata.zarr_format == 3:
        names = array.metadata.dimension_names
    else:
        names = array.attrs.get("_ARRAY_DIMENSIONS")
    if names is None or len(names) != array.ndim or any(n is None for n in names):
        return None
    return tuple(str(n) for n in names)


def _cf_attrs(array: Any) -> dict[str, Any]:
    """The array's attributes as xarray decodes them: without ``_ARRAY_DIMENSIONS`` and,
    in Zarr v3, with ``_FillValue`` decoded (xarray stores float fill values there as
    base64 of the little-endian float64)."""
    attrs = {k: v for k, v in array.attrs.asdict().items() if k != "_ARRAY_DIMENSIONS"}
    if array.metadata.zarr_format == 3 and "_FillValue" in attrs:
        from xarray.backends.zarr import FillValueCoder

        with contextlib.suppress(Exception):  # show what is stored when it cannot
            attrs["_FillValue"] = FillValueCoder.decode(attrs["_FillValue"], array.dtype)
    return attrs


def _decoded_dtype(name: str, dims: tuple[str, ...], array: Any) -> np.dtype[Any]:
    """The dtype xarray's CF decoding gives (times become datetime64), from metadata only."""
    dtype = np.dtype(array.dtype)
    attrs = _cf_attrs(array)
    sample = xr.Variable(dims, np.zeros((1,) * len(dims), dtype=dtype), attrs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return np.dtype(conventions.decode_cf_variable(name, sample).dtype)
    except Exception:  # undecodable attributes: xarray would complain on open instead
        return dtype


def _on_device(array: Any) -> bool | None:
    """Whether ``engine="gds-zarr"`` reading on a GPU puts this array's values there
    (``None``: xarray cannot read the array)."""
    name = array.basename
    dims = _dimension_names(array)
    if dims is None:
        return None
    dtype = _decoded_dtype(name, dims, array)
    return placement(name, xr.Variable(dims, np.empty((0,) * len(dims), dtype=dtype))) == "cuda"


def _engine_placement(array: Any, device: _device.Device) -> str:
    """Where ``engine="gds-zarr"`` on ``device`` puts this array's values, and why."""
    name = array.basename
    dims = _dimension_names(array)
    on_device = _on_device(array)
    if dims is None or on_device is None:
        return "not readable by xarray (no dimension names)"
    if on_device:
        return "GPU (CuPy)" if device == "cuda" else "host (numpy: the run is on cpu)"
    if dims == (name,):
        return "host (numpy: index coordinate)"
    return f"host (numpy: {_decoded_dtype(name, dims, array)} after CF decoding)"


def _codec_config(codec: Any) -> dict[str, Any]:
    if isinstance(codec, NumcodecsCodec):
        config = dict(codec.get_config())
        config.pop("id", None)
        return config
    meta = codec.to_dict() if callable(getattr(codec, "to_dict", None)) else {}
    config = dict(meta.get("configuration") or {}) if isinstance(meta, Mapping) else {}
    # Nested chains (sharding) are listed on lines of their own.
    config.pop("codecs", None)
    config.pop("index_codecs", None)
    return config


def _codec_text(codec: Any) -> str:
    config = _codec_config(codec)
    args = ", ".join(f"{k}={v!r}" for k, v in config.items())
    return f"{codec_name(codec)}({args})" if args else codec_name(codec)


def _v3_role(codec: Any) -> str:
    if isinstance(codec, ArrayArrayCodec):
        return "filter"
    if isinstance(codec, ArrayBytesCodec):
        return "serializer"
    if isinstance(codec, BytesBytesCodec):
        return "compressor"
    return "codec"


def _v3_rows(
    codecs: Iterable[Any], plan: Any, device: _device.Device, prefix: str = "", depth: int = 0
) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    pad = "  " * depth
    for codec in codecs:
        where = decode_path(codec, plan, device)
        if prefix == "index " and where != HOST_DECODE:
            where = "host (shard index)"
        rows.append((pad + prefix + _v3_role(codec), _codec_text(codec), where))
        inner = getattr(codec, "codecs", None)
        index = getattr(codec, "index_codecs", None)
        if isinstance(codec, zarr.codecs.ShardingCodec) and inner is not None:
            rows += _v3_rows(inner, plan, device, "inner ", depth + 1)
            rows += _v3_rows(index or (), plan, device, "index ", depth + 1)
    return rows


def _codec_rows(array: Any, device: _device.Device) -> list[tuple[str, ...]]:
    """(role, codec, where it decodes on ``device``) in encoding order."""
    metadata = array.metadata
    plan = plan_chain(metadata)
    if metadata.zarr_format == 3:
        return _v3_rows(metadata.codecs, plan, device)
    rows: list[tuple[str, ...]] = [
        ("filter", _codec_text(f), decode_path(f, plan, device)) for f in (metadata.filters or ())
    ]
    if metadata.compressor is not None:
        where = decode_path(metadata.compressor, plan, device)
        rows.append(("compressor", _codec_text(metadata.compressor), where))
    return rows


def _host_decoder(plan: DecodeChain | ShardChain) -> str:
    """The host decoder of the compressor of a batched ``plan``: the faster one its
    format names where its package is installed (libdeflate for zlib and gzip, the
    ``fast-host`` extra), else numcodecs."""
    chain = plan.inner if isinstance(plan, ShardChain) else plan
    compressor = chain.compressor
    if compressor is None or compressor.format.fast_decoder() is None:
        return "numcodecs, threaded"
    name = "libdeflate" if compressor.format in (ZLIB, GZIP) else "its fast decoder"
    return f"{name}, threaded; numcodecs for a chunk it cannot decode exactly"


def _route(array: Any, device: _device.Device) -> str:
    """One line on how reads of ``array`` on ``device`` are decoded."""
    plan = plan_chain(array.metadata)
    to_gpu = device == "cuda" and _on_device(array)
    if isinstance(plan, Unsupported):
        then = ", then copied to the GPU" if to_gpu else ""
        return f"zarr-python on the host ({plan.reason}){then}"
    if device == "cpu":
        return f"batched on the host ({_host_decoder(plan)})"
    if plan.device_ready:
        return "batched: nvCOMP on the GPU"
    then = ", then copied to the GPU" if to_gpu else ""
    return f"zarr-python on the host (a codec here has no GPU decoder){then}, with a warning"


def _write_route(array: Any, device: _device.Device) -> str:
    """One line on how ``xarray_gds.to_zarr`` encodes the values of ``array`` that a
    read on ``device`` gave."""
    from xarray_gds.codecs.encode import plan_encode

    if device == "cpu" or not _on_device(array):
        return "zarr-python on the host (the values are on the host)"
    plan = plan_encode(array.metadata)
    if isinstance(plan, str):
        return f"zarr-python on the host ({plan}); the values are copied from the GPU first"
    return "batched: nvCOMP on the GPU"


def _attr_text(value: Any) -> str:
    """An attribute value as Python would write it: ``nan``, ``-32767``, ``'K'``."""
    if isinstance(value, np.generic):
        value = value.item()
    return repr(value)


def _describe_array(array: Any, device: _device.Device) -> str:
    path = "/" + array.path if array.path else "/"
    dims = _dimension_names(array)
    fields = [
        ("shape", _text.shape(array.shape)),
        ("dtype", str(array.dtype)),
        ("dims", _text.dims(dims) if dims is not None else "(none recorded)"),
        ("chunks", _text.shape(array.chunks)),
    ]
    if array.shards is not None:
        fields.append(("shards", _text.shape(array.shards)))
    if array.metadata.zarr_format == 2 and array.metadata.order == "F":
        fields.append(("order", "F (column-major chunks)"))
    fields.append(("fill_value", str(array.fill_value)))
    cf = {k: v for k, v in _cf_attrs(array).items() if k in _CF_DECODING_ATTRS}
    if cf:
        fields.append(("cf", ", ".join(f"{k}={_attr_text(v)}" for k, v in cf.items())))
    fields.append(("placement", _engine_placement(array, device)))
    fields.append(("decode", _route(array, device)))
    fields.append(("encode", _write_route(array, device)))
    width = max(len(k) for k, _ in fields)
    lines = [path] + [f"  {k.ljust(width)}  {v}" for k, v in fields]
    rows = _codec_rows(array, device)
    if rows:
        lines.append(f"  {'codecs'.ljust(width)}  (in encoding order; decoding runs bottom-up)")
        lines.append(_text.table(("role", "codec", "decodes on"), rows, indent="    "))
    else:
        lines.append(f"  {'codecs'.ljust(width)}  (none)")
    return "\n".join(lines)


def _json_value(value: Any) -> Any:
    """An attribute or fill value as JSON holds it: numpy scalars as Python ones, and
    the floats JSON has no literal for (nan, inf) as the text Python writes for them."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return repr(value)
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, bytes | complex | np.ndarray):
        return str(value)
    return value


def _array_json(array: Any, device: _device.Device) -> dict[str, Any]:
    """What :func:`_describe_array` prints, as a JSON object."""
    dims = _dimension_names(array)
    order = array.metadata.order if array.metadata.zarr_format == 2 else None
    cf = {k: v for k, v in _cf_attrs(array).items() if k in _CF_DECODING_ATTRS}
    return {
        "path": "/" + array.path if array.path else "/",
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "dims": list(dims) if dims is not None else None,
        "chunks": list(array.chunks),
        "shards": list(array.shards) if array.shards is not None else None,
        "order": order,
        "fill_value": _json_value(array.fill_value),
        "cf": _json_value(cf),
        "placement": _engine_placement(array, device),
        "decode": _route(array, device),
        "encode": _write_route(array, device),
        "codecs": [
            {"role": role.strip(), "codec": codec, "decodes_on": where}
            for role, codec, where in _codec_rows(array, device)
        ],
    }


def _group_paths(store: Any) -> list[str]:
    """Paths of the groups in ``store``, root first (empty when it has no root group)."""
    try:
        root = zarr.open_group(store=store, mode="r")
    except Exception:
        return []
    groups = (p for p, n in root.members(max_depth=None) if isinstance(n, zarr.Group))
    return ["/", *sorted("/" + p for p in groups)]


def _device_arg(text: str) -> str:
    """``--device``: ``auto`` or what ``device=`` takes in Python (see
    :func:`xarray_gds.device.parse_device`); anything else is a usage error."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        _device.parse_device(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device: use auto, cpu, gpu, cuda or cuda:N (GPU number N, from 0)"
        ) from None
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _gpu_of(asked: str) -> tuple[str, int | None]:
    """``--device`` as ``auto``, ``cpu`` or ``cuda``, and the GPU number of ``cuda:N``,
    checked against this machine's GPUs where it has any.

    Raises
    ------
    ValueError
        ``cuda:N`` beyond the GPUs of this machine (the message gives their count).
    """
    if asked == "auto":
        return "auto", None
    kind, gpu = _device.parse_device(asked)
    if gpu is not None and _device.cuda_status()[0]:
        _device.resolve(asked)  # refuses N beyond the count, naming it
    return kind or "auto", gpu


def _info_device(asked: str, gpu: int | None = None) -> tuple[_device.Device, str]:
    """The device ``info`` describes reads on, and a line that says why."""
    if asked == "cpu":
        return "cpu", "cpu (--device cpu)"
    ok, reason = _device.cuda_status()
    reason = reason.split("; ")[0]  # without the install hint
    if asked == "cuda":
        name = "cuda" if gpu is None else f"cuda:{gpu}"
        return "cuda", f"{name} (--device {name})" + (
            "" if ok else f"; no usable GPU here: {reason}"
        )
    if ok:
        return "cuda", f"cuda ({_text.gpu_name()})"
    return "cpu", f"cpu (no usable GPU: {reason}); --device cuda shows a GPU run's routes"


def _storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``--storage-option KEY=VALUE`` pairs as ``storage_options``: a dotted key is a
    nested one (``client_kwargs.region_name=us-east-1``), a value that is JSON
    (``true``, ``5``, ``{"a": 1}``) is read as JSON, any other value is a string.

    Raises
    ------
    ValueError
        A pair without ``=`` or without a key (the message does not repeat the pair:
        it may be a secret).
    """
    import json

    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:  # the text is not echoed: it may be a secret
            raise ValueError(
                "--storage-option takes KEY=VALUE (e.g. endpoint_url=http://host:9000 or "
                "client_kwargs.region_name=us-east-1); one of them has no "
                + ("'='" if not sep else "KEY")
            )
        *parents, last = name.split(".")
        value: Any = text
        if not remote.is_secret_key(name):  # a secret stays a string, always
            with contextlib.suppress(ValueError):
                value = json.loads(text)
        where = options
        for part in parents:
            where = where.setdefault(part, {})
            if not isinstance(where, dict):
                raise ValueError(f"--storage-option {name!r}: {part!r} is set to a value already")
        where[last] = value
    return options


def _consolidated(store: Any, group: zarr.Group) -> bool:
    """Whether reads of ``group`` take consolidated metadata: its own, or the store
    root's, which lists every group below it (xarray reads a group from the root's)."""
    if group.metadata.consolidated_metadata is not None:
        return True
    return consolidated_at_root(store, group.path, group.metadata.zarr_format)


def _arrays_of(store: Any, node: Any) -> tuple[list[Any], str]:
    """The arrays ``info`` describes (``node`` itself, or the arrays of the group
    ``node`` and of every group below it), and what ``node`` is, in words.

    Raises
    ------
    MetadataError
        A metadata document of a node below ``node`` that is read does not parse.
    """
    if not isinstance(node, zarr.Group):
        return [node], "array"
    listed = node.metadata.consolidated_metadata is not None
    with documents.naming_damage(store, node.path, consolidated=listed):
        members = [n for _, n in node.members(max_depth=None)]
    arrays = sorted((a for a in members if isinstance(a, zarr.Array)), key=lambda a: a.path)
    groups = _text.plural(1 + sum(isinstance(n, zarr.Group) for n in members), "group")
    return arrays, f"group: {_text.plural(len(arrays), 'array')} in {groups}"


def _open_node(store: Any, path: str, group: str | None) -> Any:
    """The node ``info`` describes: ``group`` of ``store`` (opened from ``path``), or
    its root.

    Raises
    ------
    MetadataError
        A metadata document the open reads does not parse.
    FileNotFoundError
        ``group`` is not in the store (the message lists the groups that are).
    OSError, ValueError
        The store has no Zarr node there, or its metadata cannot be read.
    """
    try:
        with documents.naming_damage(store, group):
            return zarr.open(store=store, mode="r", path=group or "")
    except MetadataError:  # names the document and what is wrong with it
        raise
    except (OSError, ValueError, KeyError) as err:
        groups = _group_paths(store) if group else []
        if group and groups and group.strip("/") not in (g.strip("/") for g in groups):
            raise FileNotFoundError(
                f"group {group!r} not found in Zarr store {store}; the groups in it "
                "are: " + ", ".join(repr(g) for g in groups),
            ) from err
        if str(path) in str(err) and not isinstance(err, KeyError):  # zarr names the path
            raise
        raise ValueError(f"cannot read the Zarr metadata of {path!r}: {err!r}") from err


def _run_info(args: argparse.Namespace) -> int:
    try:
        options = _storage_options(args.storage_option or ())
    except ValueError as err:
        _text.error("info", err)
        return 2

    # no credential of the URL or options in a message (main prints the errors)
    args.redact = lambda text: remote.redact(str(text), options, str(args.path))
    try:
        asked, gpu = _gpu_of(args.device)
    except ValueError as err:
        _text.error("info", err)
        return 2
    store = open_store(args.path, storage_options=options or None)  # names the path
    node = _open_node(store, args.path, args.group)
    device, device_line = _info_device(asked, gpu)
    arrays, kind = _arrays_of(store, node)
    # a URL without its user information; a path as it was given
    shown = remote.store_url(store) if remote.is_remote_url(str(args.path)) else args.path
    if args.json:
        import json

        facts = {
            "store": str(shown),
            "zarr_format": node.metadata.zarr_format,
            "node": "/" + node.path,
            "kind": "group" if isinstance(node, zarr.Group) else "array",
            "consolidated": _consolidated(store, node) if isinstance(node, zarr.Group) else None,
            "device": {"device": device, "gpu": gpu, "text": device_line},
            "arrays": [_array_json(a, device) for a in arrays],
        }
        print(json.dumps(facts, indent=2))
        return 0
    print(f"store:        {shown}")
    print(f"zarr format:  {node.metadata.zarr_format}")
    print(f"node:         /{node.path} ({kind})")
    if isinstance(node, zarr.Group):
        print(f"consolidated: {'yes' if _consolidated(store, node) else 'no'}")
    print(f"device:       {device_line}")
    print("              (placement, decode and encode below are for reads on this device)")
    for array in arrays:
        print()
        print(_describe_array(array, device))
    return 0


# --------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------


def _run_bench(args: argparse.Namespace) -> int:
    from xarray_gds.tools import bench

    cases = args.case or None
    unknown = sorted(set(cases or ()) - set(bench.CASES))
    if unknown:
        _text.error("bench", f"unknown case(s) {unknown}; choose from {sorted(bench.CASES)}")
        return 2
    ok, reason = _device.cuda_status()
    if not ok:
        print(f"no GPU ({reason}): the cases that need one are skipped")
    profile_dir = Path(args.profile) if args.profile else None
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    tally = bench.WarningTally()
    results = bench.run(
        workdir=Path(args.dir) if args.dir else None,
        size_gb=args.size_gb,
        repeat=args.repeat,
        cases=cases,
        on_result=lambda r: print(bench.format_table([r]), flush=True),
        profile_dir=profile_dir,
        on_skip=lambda name, why: print(f"{name}: skipped: {why}", flush=True),
        tally=tally,
    )
    if results:
        print("\nall cases:")
        print(bench.format_table(results))
    if tally.counts:
        print("\nwarnings (count, category: message):")
        for line in tally.lines():
            print(f"  {line}")
    if args.json:
        bench.dump(results, Path(args.json), size_gb=args.size_gb, repeat=args.repeat)
        print(f"results written to {args.json}")
    if not results:
        _text.error("bench", "none of the cases asked for ran (see the lines above)")
        return 1
    return 0


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------


def _bench_cases() -> str:
    """The bench cases, for ``bench --help``: those that need a GPU marked "(GPU)", those
    that run only when named "*"."""
    import textwrap

    from xarray_gds.tools.bench import CASES

    names = ", ".join(
        name + (" (GPU)" if spec["gpu"] else "") + ("*" if spec.get("named_only") else "")
        for name, spec in CASES.items()
    )
    text = textwrap.fill(
        names, width=88, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False
    )
    return f"cases ((GPU): needs a GPU; *: runs only when named with --case):\n{text}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Read Zarr stores straight into GPU memory with xarray (engine='gds-zarr').",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {xarray_gds.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="write a sample weather store and read it with both engines",
        description=(
            "Write a synthetic weather-like Zarr store (zstd, chunked), read it with "
            "engine='gds-zarr' and engine='zarr', show where each variable landed and "
            "the time each engine took (one run each: `xarray-gds bench` measures), and "
            "check that both agree."
        ),
    )
    demo.add_argument(
        "--dir", help="keep the store in this directory (default: a temporary one, removed)"
    )
    demo.add_argument("--zarr-format", type=int, choices=(2, 3), default=3)
    demo.add_argument(
        "--device",
        type=_device_arg,
        default="auto",
        metavar="{auto,cpu,gpu,cuda,cuda:N}",
        help="where gds-zarr places numeric data, as device= in Python; auto uses a GPU "
        "when one is usable",
    )
    demo.add_argument("--size", choices=tuple(demo_cmd.DEMO_SIZES), default="small")
    demo.set_defaults(run=_run_demo)

    info = commands.add_parser(
        "info",
        help="show arrays, chunking, codecs and placement of a Zarr store",
        description=(
            "List the arrays of a Zarr store (v2 or v3) with shape, dtype, chunks, shards, "
            "the codec chain, where each codec decodes and where engine='gds-zarr' puts "
            "the values. Opens the store read-only."
        ),
    )
    info.add_argument(
        "path", help="a Zarr store: a local directory, or an s3://, http:// or https:// URL"
    )
    info.add_argument("--group", help="only this group (path inside the store)")
    info.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="a storage option of a remote URL, as storage_options= of open_dataset "
        "(repeat it): key=..., secret=..., endpoint_url=..., anon=true, "
        "client_kwargs.region_name=us-east-1 (a dotted KEY is nested; a JSON VALUE is "
        "read as JSON). Credentials never appear in the output",
    )
    info.add_argument(
        "--device",
        type=_device_arg,
        default="auto",
        metavar="{auto,cpu,gpu,cuda,cuda:N}",
        help="describe reads on this device (as device= in Python); auto: the GPU when "
        "one is usable, as the engine's default",
    )
    info.add_argument(
        "--json",
        action="store_true",
        help="print a JSON object (store, device, and per array: shape, chunks, codecs, "
        "where each decodes, placement, routes) instead of the text",
    )
    info.set_defaults(run=_run_info)

    bench = commands.add_parser(
        "bench",
        help="time open + load against engine='zarr' (ratios measured in one run)",
        description="Write benchmark stores, then time open + load of each with\n"
        "engine='gds-zarr', engine='zarr' (+ cupy.asarray on the GPU) and, for the\n"
        "zstd case, the raw kvikio + nvCOMP limit. Prints GB/s and ratios. A case that\n"
        "cannot run here (no GPU, packages missing) is skipped with a line saying why.",
        epilog=_bench_cases(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--size-gb", type=_positive_float, default=2.0, help="store size in GB (default 2)"
    )
    bench.add_argument(
        "--repeat", type=_positive_int, default=3, help="timed runs, best kept (1 or more)"
    )
    bench.add_argument(
        "--case",
        action="append",
        metavar="CASE",
        help="run only this case (repeatable; the cases are listed below); without it, "
        "every case this machine can run, except those that run only when named",
    )
    bench.add_argument("--dir", help="where to write the stores (default: a temp dir)")
    bench.add_argument("--json", help="also write the results as JSON to this file")
    bench.add_argument(
        "--profile",
        metavar="DIR",
        help="after the timed runs, profile one more run of each contender (cProfile) "
        "and write CASE.CONTENDER.txt to DIR",
    )
    bench.set_defaults(run=_run_bench)

    calibrate = commands.add_parser(
        "calibrate",
        help="measure the decode-route cost model's constants on this machine",
        description="Time nvCOMP batches of one and of many chunks, one host thread's "
        "decode of a chunk for each compressor, and the copy to the device; print the "
        "constants as the JSON value of xarray_gds.route_constants "
        "(XARRAY_GDS_ROUTE_CONSTANTS). Needs a GPU.",
    )
    calibrate.add_argument(
        "--compare",
        action="store_true",
        help="instead, print the model's predicted time (with the constants in effect) "
        "for nvCOMP alone, the host route and the split, next to the measured time of "
        "each, for batches of 1, 4, 16 and 64 chunks of 4 MiB (zstd and zlib)",
    )
    calibrate.set_defaults(run=_run_calibrate)

    tidy = commands.add_parser(
        "tidy",
        help="list, and with --delete remove, what killed writes left in a local store",
        description="List what a writer killed with SIGKILL can leave in a local Zarr "
        "store: the engine's temporary files (.NAME.xarray-gds-HEX.partial), chunk files "
        "outside every shape the metadata gives their array, directories of chunks that "
        "no metadata lists; with --trust-consolidated also metadata documents that "
        "differ from the consolidated metadata (put back) and nodes it does not list. "
        "Nothing changes unless --delete is given (a dry run, as with -n/--dry-run); "
        "--delete removes what is listed, holding the store's writer lock. Damaged "
        "nodes (a document that does not parse, or is missing while consolidated "
        "metadata lists it) are listed and kept whole, and a directory that is not a "
        "Zarr store is refused.",
    )
    tidy.add_argument("path", help="a local Zarr store (directory)")
    what = tidy.add_mutually_exclusive_group()
    what.add_argument(
        "-n", "--dry-run", action="store_true", help="only list what would go (the default)"
    )
    what.add_argument("--delete", action="store_true", help="remove what is listed")
    tidy.add_argument(
        "--trust-consolidated",
        action="store_true",
        help="the consolidated metadata is the store's last complete state (only "
        "complete xarray-gds writes made it, and one was killed): list (with --delete, "
        "put back) documents as it gives them and the nodes it does not list",
    )
    tidy.set_defaults(run=_run_tidy)
    return parser


def _run_tidy(args: argparse.Namespace) -> int:
    from xarray_gds.tidy import DAMAGED, TRUSTING, find_leftovers, tidy

    trust, delete = args.trust_consolidated, args.delete
    try:
        found = tidy(args.path, dry_run=not delete, trust_consolidated=trust)
        kept = [
            i
            for i in find_leftovers(args.path, trust_consolidated=trust)
            if i.kind == DAMAGED or (not trust and i.kind in TRUSTING)
        ]
    except (OSError, ValueError) as err:  # missing, not a store, locked, not removable
        _text.error("tidy", err)
        return 1
    for item in found:
        print(item)
    verb = "removed or put back" if delete else "would be removed or put back (dry run)"
    print(f"{len(found)} leftover(s) {verb}")
    if found and not delete:
        print("run again with --delete to remove them")
    for item in kept:
        print(f"kept  {item}")
    differ = [i for i in kept if i.kind != DAMAGED]
    if differ:
        print(
            f"{len(differ)} difference(s) from the consolidated metadata kept: if only complete "
            "xarray-gds writes made this store and one was killed, run again with --delete "
            "--trust-consolidated to put the consolidated state back; if the store was "
            "written without consolidating, keep them and run zarr.consolidate_metadata"
        )
    if len(differ) < len(kept):
        print(
            f"{len(kept) - len(differ)} damaged document(s) kept, with all of their nodes: "
            "a killed xarray-gds write leaves none; repair them or rewrite those arrays"
        )
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    """The demo, with ``--device`` as the demo takes it (``auto``, ``cpu``, ``cuda``):
    ``gpu`` is ``cuda``; ``cuda:N`` is ``cuda`` run with GPU N current."""
    try:
        asked, gpu = _gpu_of(args.device)
    except ValueError as err:
        _text.error("demo", err)
        return 2
    args.device = asked
    if gpu is None or not _device.cuda_status()[0]:
        return demo_cmd.run(args)  # without a GPU the demo says so for --device cuda
    with _device.on_gpu(gpu):
        return demo_cmd.run(args)


def _run_calibrate(args: argparse.Namespace) -> int:
    ok, why = _device.cuda_status()
    if not ok:
        print(f"{PROG} calibrate: needs a GPU ({why})", file=sys.stderr)
        return 1
    from xarray_gds.tools.calibrate import calibrate, compare, table

    print(table(compare()) if args.compare else calibrate().to_json())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the ``xarray-gds`` command line tool.

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name; ``None`` uses ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status: 0 on success, 1 when a command failed (a store that cannot be
        opened or read, unreachable, missing or with damaged metadata, an optional
        package that is not installed, an error of the program itself), 2 for usage
        errors (unknown commands or options, a ``--device`` that is not a device,
        ``--repeat`` below 1, a ``--size-gb`` not above 0, a malformed
        ``--storage-option``), 130 after Ctrl-C, 141 (as for a process killed by
        SIGPIPE) when the reader of the output went away before it was all written.

    Notes
    -----
    Errors are one line on stderr, ``xarray-gds COMMAND: error: WHAT``; an error of
    the program itself says so and to rerun with ``--debug`` (before or after the
    command), which prints the traceback too (see :mod:`xarray_gds.tools._errors`).
    """
    parser = _parser()
    _errors.add_debug(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except BrokenPipeError:
        # the reader went away (`xarray-gds info STORE | head`): stop quietly. Point
        # stdout at /dev/null so that the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _EXIT_BROKEN_PIPE
    except (Exception, KeyboardInterrupt) as err:
        redact: Callable[[str], str] = getattr(args, "redact", str)
        return _errors.report(args.command, err, args.debug, redact)


if __name__ == "__main__":
    raise SystemExit(main())

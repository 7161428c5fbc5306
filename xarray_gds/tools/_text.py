"""Plain-text formatting shared by the command line's commands."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from xarray_gds import device as _device

PROG = "xarray-gds"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> str:
    """Left-aligned plain-text table."""
    rows = [list(map(str, row)) for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def shape(shape: Iterable[Any]) -> str:
    """``(48, 73, 144)``; ``(73,)`` for one dimension, like a tuple."""
    return str(tuple(int(n) for n in shape))


def dims(dims: Iterable[Any]) -> str:
    """``(time, lat, lon)``, as xarray prints dimensions."""
    return "(" + ", ".join(str(d) for d in dims) + ")"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def nbytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def error(command: str, message: object) -> None:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)


def gpu_name() -> str:
    """The current CUDA device's name, for the output (``"CUDA device"`` when unknown)."""
    try:
        cp = _device.cupy()
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the name is decoration only
        return "CUDA device"

"""Draw the speed-up chart and the summary table of docs/performance.md from the JSON
that ``xarray-gds bench --json FILE`` writes.

    python scripts/plot_bench.py                  # the committed JSON to the committed SVG
    python scripts/plot_bench.py IN.json OUT.svg  # any bench output
    python scripts/plot_bench.py IN.json --table  # the Markdown summary table instead
    python scripts/plot_bench.py IN.json --goals  # the goals met and missed (``"goal"``)

The chart has one bar per way of loading: gds-zarr's time against engine="zarr"'s in
the same run (``seconds["zarr"] / seconds["gds-zarr"]``; where engine="zarr" ran through
several clients, ``"zarr (obstore)"`` and ``"zarr (fsspec)"``, the faster), on a log
scale. Pairs with a suffix (``"gds-zarr chunks={}"`` against ``"zarr chunks={}"``) get
bars of their own.
A result with ``"chart": false`` is left out of the chart, not of the table. Each
result of ``bench --json`` carries what the table shows besides the timings: its
``title``, the ``date``, the ``commit`` and the ``command`` that measures it again
(whose ``--size-gb`` and ``--repeat`` fill the "size, repeat" column); ``env.machine``
names the machine in the chart's title. A result may carry a ``goal``: the speed-up of
its first pair the project aims at (``--goals``). Results without them draw too. A
result with a ``read-only`` contender says in its table row what bounds it
(:func:`bound`).

The SVG is written by hand (no plotting library) and is the same bytes for the same
JSON; tests/test_docs.py checks that the committed image matches the committed data.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data" / "bench-h200.json"
IMAGE = ROOT / "docs" / "img" / "bench-h200.svg"

OURS = "gds-zarr"
THEIRS = "zarr"

# layout, in pixels
_ROW = 24
_BAR = 14
_TOP = 58
_BOTTOM = 40
_PAD = 12
_CHAR = 7.3  # width of one character of the 12 px monospace labels
_PLOT = 440  # width of the bar area
_VALUE = 230  # room for the value text right of the longest bar
_FAST = "#2e7d32"
_SLOW = "#c62828"
_GRID = "#d0d0d0"
_TEXT = "#222222"
_MUTED = "#666666"
_MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"
_SANS = "DejaVu Sans, Helvetica, Arial, sans-serif"


def load(path: Path) -> dict[str, Any]:
    """The JSON ``xarray-gds bench --json`` wrote (``{"env": ..., "results": [...]}``)."""
    return json.loads(Path(path).read_text())


def pairs(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(suffix, ours, theirs)`` for each gds-zarr contender with an engine="zarr"
    contender doing the same thing in the same run."""
    seconds = result["seconds"]
    out = []
    for name in seconds:
        if name.startswith(OURS):
            suffix = name[len(OURS) :]
            if THEIRS + suffix in seconds:
                out.append((suffix, name, THEIRS + suffix))
    if not out and THEIRS in seconds:  # e.g. "gds-zarr, 1 GPU" against one baseline
        ours = [name for name in seconds if name.startswith(OURS)]
        if ours:
            out.append((ours[0][len(OURS) :], ours[0], THEIRS))
    # engine="zarr" through several clients ("zarr (obstore)", "zarr (fsspec)"): the
    # faster of them
    clients = [name for name in seconds if name.startswith(THEIRS + " (")]
    if not out and OURS in seconds and clients:
        out.append(("", OURS, min(clients, key=seconds.__getitem__)))
    return out


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value < 10 else f"{value:.2f} s"


def _rows(data: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    rows = []
    for result in data["results"]:
        if result.get("chart", True) is False:
            continue
        for suffix, ours, theirs in pairs(result):
            mine, other = result["seconds"][ours], result["seconds"][theirs]
            rows.append((result["case"] + suffix, other / mine, mine, other))
    return rows


def svg(data: dict[str, Any]) -> str:
    """The chart as an SVG document (a string; the same bytes for the same data)."""
    rows = _rows(data)
    if not rows:
        raise ValueError("no result has both a gds-zarr and a zarr contender")
    ratios = [r for _, r, _, _ in rows]
    lo = 2.0 ** math.floor(math.log2(min(1.0, *ratios)))
    hi = 2.0 ** math.ceil(math.log2(max(2.0, *ratios)))
    label_w = math.ceil(max(len(label) for label, *_ in rows) * _CHAR)
    x0 = _PAD + label_w + _PAD
    width = x0 + _PLOT + _VALUE
    height = _TOP + len(rows) * _ROW + _BOTTOM

    def x(ratio: float) -> float:
        return x0 + _PLOT * (math.log2(ratio) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))

    env = data.get("env", {})
    machine = env.get("machine", "this machine")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-labelledby="title">',
        f'<title id="title">gds-zarr against engine="zarr" on {escape(machine)}</title>',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{_PAD}" y="22" font-family="{_SANS}" font-size="15" font-weight="bold" '
        f'fill="{_TEXT}">gds-zarr against engine="zarr" (+ cupy.asarray), same run: '
        f"how many times faster</text>",
        f'<text x="{_PAD}" y="42" font-family="{_SANS}" font-size="12" fill="{_MUTED}">'
        f"{escape(machine)}; time of engine=&quot;zarr&quot; / time of gds-zarr, log scale; "
        f"right of 1x is faster</text>",
    ]
    bottom = _TOP + len(rows) * _ROW
    tick = lo
    while tick <= hi:
        tx = x(tick)
        colour = _TEXT if tick == 1 else _GRID
        out.append(
            f'<line x1="{tx:.1f}" y1="{_TOP - 4}" x2="{tx:.1f}" y2="{bottom}" '
            f'stroke="{colour}" stroke-width="1"/>'
        )
        text = f"{tick:g}x"
        out.append(
            f'<text x="{tx:.1f}" y="{bottom + 16}" font-family="{_SANS}" font-size="11" '
            f'fill="{_MUTED}" text-anchor="middle">{text}</text>'
        )
        tick *= 2
    for i, (label, ratio, mine, other) in enumerate(rows):
        y = _TOP + i * _ROW
        mid = y + _ROW / 2
        start, end = sorted((x(1.0), x(ratio)))
        colour = _FAST if ratio >= 1 else _SLOW
        out.append(
            f'<text x="{x0 - _PAD}" y="{mid + 4:.1f}" font-family="{_MONO}" font-size="12" '
            f'fill="{_TEXT}" text-anchor="end">{escape(label)}</text>'
        )
        out.append(
            f'<rect x="{start:.1f}" y="{mid - _BAR / 2:.1f}" width="{max(end - start, 1):.1f}" '
            f'height="{_BAR}" fill="{colour}"/>'
        )
        value = f"{ratio:.1f}x  ({_seconds(mine)} vs {_seconds(other)})"
        out.append(
            f'<text x="{max(end, x(1.0)) + 6:.1f}" y="{mid + 4:.1f}" font-family="{_SANS}" '
            f'font-size="12" fill="{_TEXT}">{escape(value)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def table(data: dict[str, Any]) -> str:
    """The Markdown summary table: one row per gds-zarr / engine="zarr" pair."""
    lines = [
        '| case | what is timed | data | gds-zarr | engine="zarr" | speed-up '
        "| others in the same run | size, repeat | measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in data["results"]:
        found = pairs(result)
        paired = {name for _, ours, theirs in found for name in (ours, theirs)}
        others = [
            f"{name} {_seconds(sec)}"
            for name, sec in result["seconds"].items()
            if name not in paired
        ]
        if result.get("note"):
            others.append(result["note"])
        if bound(result):
            others.append(bound(result))
        command = result.get("command", "")
        size = _option(command, "--size-gb")
        repeat = _option(command, "--repeat")
        measured = " ".join(p for p in (result.get("date", ""), _code(result.get("commit"))) if p)
        data_text = f"{result['nbytes'] / 1e9:.2f} GB, {result['n_chunks']:,} chunks"
        for k, (suffix, ours, theirs) in enumerate(found):
            mine, other = result["seconds"][ours], result["seconds"][theirs]
            lines.append(
                f"| `{result['case']}{escape_md(suffix)}` | {escape_md(result.get('title', ''))} "
                f"| {data_text} | {_seconds(mine)} | {_seconds(other)} | **{other / mine:.1f}x** "
                f"| {escape_md('; '.join(others)) if k == 0 else ''} "
                f"| {size}, {repeat} | {measured} |"
            )
    return "\n".join(lines) + "\n"


#: how far above the slower of its reads and its decode a load may be and still count
#: as bound by them (the goal of the device usage cases)
BOUND_SLACK = 1.15


def bound(result: dict[str, Any]) -> str:
    """What bounds a read case that has a ``read-only`` contender: the reads or the
    decode, whichever of ``read-only`` and ``decode-only`` is slower, where gds-zarr is
    within :data:`BOUND_SLACK` of it, and the engine otherwise; with gds-zarr's time
    over that bound. Empty for a case without ``read-only``."""
    seconds = result["seconds"]
    if "read-only" not in seconds or OURS not in seconds:
        return ""
    limits = {"the reads": seconds["read-only"]}
    if "decode-only" in seconds:
        limits["the decode"] = seconds["decode-only"]
    which, limit = max(limits.items(), key=lambda item: item[1])
    over = seconds[OURS] / limit
    by = which if over <= BOUND_SLACK else "the engine"
    return f"bound by {by}: gds-zarr at {over:.2f}x max(read-only, decode-only)"


def goals(data: dict[str, Any]) -> str:
    """The Markdown table of the results that carry a ``goal`` (the speed-up of their
    first gds-zarr / engine="zarr" pair that the project aims at): met or missed."""
    lines = ["| case | goal | measured | |", "|---|---|---|---|"]
    for result in data["results"]:
        if "goal" not in result:
            continue
        suffix, ours, theirs = pairs(result)[0]
        ratio = result["seconds"][theirs] / result["seconds"][ours]
        goal = float(result["goal"])
        verdict = "met" if round(ratio, 1) >= goal else "**missed**"
        lines.append(
            f"| `{result['case']}{escape_md(suffix)}` | {goal:g}x | {ratio:.1f}x | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def _option(command: str, name: str) -> str:
    words = command.split()
    return words[words.index(name) + 1] if name in words else "?"


def _code(text: str | None) -> str:
    return f"`{text}`" if text else ""


def escape_md(text: str) -> str:
    """Text safe in a Markdown table cell (pipes, and braces that look like attributes)."""
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", nargs="?", default=str(DATA), help="bench JSON")
    parser.add_argument("image", nargs="?", default=str(IMAGE), help="SVG to write")
    parser.add_argument("--table", action="store_true", help="print the Markdown table")
    parser.add_argument(
        "--goals", action="store_true", help="print the table of goals met and missed"
    )
    args = parser.parse_args(argv)
    data = load(Path(args.data))
    if args.table or args.goals:
        sys.stdout.write(table(data) if args.table else goals(data))
        return 0
    Path(args.image).parent.mkdir(parents=True, exist_ok=True)
    Path(args.image).write_text(svg(data))
    print(f"wrote {args.image}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

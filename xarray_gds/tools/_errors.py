"""How the command line reports an error: one line, ``xarray-gds CMD: error: ...``.

- exit status 2, usage errors: an unknown command or option, a value an option does
  not take (``--device``, ``--repeat``, ``--size-gb``...): argparse's usage and error
  lines;
- exit status 1, the user's errors: a missing optional package (``ImportError``), a
  missing or unreadable path (``OSError``), a store or argument that is not what it
  should be (``ValueError``; the package's own errors: damaged metadata or chunks), no
  usable GPU: one line that says what is wrong;
- exit status 1, an error of the program itself (any other exception): one line
  that names it and says to rerun with ``--debug``;
- exit status 130 (128 + SIGINT, as a shell reports it), Ctrl-C: nothing.

``--debug`` (before or after the command) prints the traceback above the error line.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from xarray_gds.device import NoCudaDeviceError
from xarray_gds.tools._text import PROG

__all__ = ["FAILURE", "INTERRUPTED", "USAGE", "add_debug", "is_user_error", "report"]

#: exit status of a command that failed
FAILURE = 1
#: exit status of a usage error (as argparse's ``parser.error``)
USAGE = 2
#: exit status of a command stopped with Ctrl-C (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130

#: errors that say what the user asked for cannot be done (see the module docstring)
_USER_ERRORS: tuple[type[BaseException], ...] = (
    ImportError,
    OSError,
    ValueError,
    NoCudaDeviceError,
)

_DEBUG_HELP = "on an error, print its traceback too (before or after the command)"


def add_debug(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and each of its commands the ``--debug`` flag (so it may stand
    before or after the command)."""
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.add_argument(
                    "--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP
                )


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is the user's to act on (else an error of the program)."""
    return isinstance(err, _USER_ERRORS)


def one_line(err: BaseException) -> str:
    """The text of ``err`` on one line (an ``ImportError`` without one names the
    package that is missing)."""
    text = " ".join(str(err).split())
    if isinstance(err, ImportError) and text in ("", "None"):
        cause = err.__cause__ or err.__context__  # fsspec raises ImportError(None) from it
        if cause is not None and cause is not err:
            return one_line(cause)
        text = f"a package this needs is not installed ({err.name or 'ImportError'})"
    return text or type(err).__name__


def report(
    command: str, err: BaseException, debug: bool, redact: Callable[[str], str] = str
) -> int:
    """Print ``err`` as ``xarray-gds COMMAND: error: ...`` on stderr (its traceback
    first when ``debug``), every text through ``redact``; return the exit status."""
    if isinstance(err, KeyboardInterrupt):
        if debug:
            traceback.print_exception(err, file=sys.stderr)
        return INTERRUPTED
    if debug:
        print(redact("".join(traceback.format_exception(err))), end="", file=sys.stderr)
    text = redact(one_line(err))
    if not is_user_error(err):
        again = "" if debug else "; rerun with --debug for the traceback"
        text = f"internal error: {type(err).__name__}: {text}{again}"
    print(f"{PROG} {command}: error: {text}", file=sys.stderr)
    return FAILURE

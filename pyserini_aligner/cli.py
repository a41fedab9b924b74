"""Helpers shared by the command lines: the help layout, argparse value checks that name the flag, and the one-line
exits."""
from __future__ import annotations

import argparse
import re
import sys
from typing import Callable

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default in its help: "(default: X)" unless the default is
    None or False (an unset option or switch) or the help text already speaks of the default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
                and "default" not in text):
            text += (" " if text else "") + "(default: %(default)s)"
        return text


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1 (argparse prefixes the flag: "argument --hits: ...")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def fraction(text: str) -> float:
    """argparse ``type``: a number in (0, 1], such as β^d for --doc-prune and β^q for --query-prune."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def non_negative(text: str) -> float:
    """argparse ``type``: a number >= 0, such as a minimum gain."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """argparse ``type``: a number > 0, such as a timeout in seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def device(text: str) -> str:
    """argparse ``type``: "cpu" or "cuda[:N]", a CUDA device only where this torch can use it (torch is imported
    only for a CUDA device)."""
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    if text.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise argparse.ArgumentTypeError(f"{text!r}: {why}; use cpu")
        count, number = torch.cuda.device_count(), int(text.partition(":")[2] or 0)
        if number >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: only {count} CUDA device(s) are visible")
    return text


def strategy(text: str) -> str:
    """argparse ``type``: an alignment strategy (top-k:1, top-p:0.015, da:4:0.04), checked before any model loads."""
    from pyserini_aligner.alignment import parse_strategy

    try:
        parse_strategy(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``argv`` (``--flag VALUE`` or ``--flag=VALUE``; the last one wins), or None."""
    value = None
    for position, arg in enumerate(argv):
        if arg == flag and position + 1 < len(argv):
            value = argv[position + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def run_main(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a command's ``main``: Ctrl-C prints "interrupted" and gives exit status 130 instead of a traceback."""
    try:
        return main(argv) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT

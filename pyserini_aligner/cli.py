"""What every command line shares: the help layout, argparse types that parse a flag's value into what the
library takes (and name the flag when it is wrong; the index's own, such as ``--codec``, are in
:mod:`pyserini_aligner.index.options`), one logging set-up and one runner with one exit-status convention
(:func:`run_main`)."""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pyserini_aligner.alignment import Strategy
    from pyserini_aligner.filters import Filter

USAGE_EXIT = 2  # a flag value or combination that can't work (argparse's own status)
ERROR_EXIT = 1  # the command failed while it ran
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports Ctrl-C
TERMINATED_EXIT = 143  # 128 + SIGTERM, as a shell reports a process ended by kill
RUN_TIME_ERRORS = (ValueError, OSError, RuntimeError, ImportError)  # one line, no traceback; others are bugs
_NOISY_LOGGERS = ("faiss", "faiss.loader", "matplotlib", "urllib3", "httpx", "filelock")


class UsageError(ValueError):
    """A flag value or combination that can't work, found after argparse parsed the flags: one line naming the flag
    and exit status 2, as argparse's own errors."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt (a subclass of it), so that whatever
    cleans up after Ctrl-C (a build's temporary folder, a temporary run file) cleans up after it too."""


def _raise_terminated(number: int, frame) -> None:
    """SIGTERM handler of :func:`run_main`."""
    raise Terminated()


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


def port_number(text: str) -> int:
    """argparse ``type``: a TCP port, 0 to 65535 (0: any free port, chosen by the system)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {text!r}")
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


def strategy(text: str) -> Strategy:
    """argparse ``type``: an alignment strategy (top-k:1, top-p:0.015, da:4:0.04), parsed before any model loads."""
    from pyserini_aligner.strategy import parse_strategy

    try:
        return parse_strategy(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def search_filter(text: str, field: str | None = None) -> Filter:
    """The filter of ``--filter TEXT`` (and ``--filter-field FIELD``), parsed before anything loads: ``@FILE`` is the
    documents whose ``field`` (default: the docid) is one of the file's lines, anything else a predicate over the
    stored fields (:meth:`.filters.Filter.where`). FilterError (a ValueError) naming the token, file or flag."""
    from pyserini_aligner.filters import ID_FIELD, Filter, FilterError

    if text.startswith("@"):
        return Filter.from_file(text[1:], field or ID_FIELD)
    if field is not None:
        raise FilterError("--filter-field goes with --filter @FILE (a predicate names its fields itself)")
    return Filter.where(text)


def add_filter_flags(parser: argparse.ArgumentParser) -> None:
    """``--filter EXPR|@FILE`` and ``--filter-field FIELD`` of the search command lines (parsed by
    :func:`parse_filter_flags`)."""
    parser.add_argument("--filter", metavar="EXPR|@FILE", default=None,
                        help="search only the documents it matches: a predicate over the fields stored with the "
                             "index, e.g. \"year >= 2020 AND lang = 'en'\" (id is the docid), or @FILE, a file of "
                             "values one per line (docids, or values of --filter-field)")
    parser.add_argument("--filter-field", metavar="FIELD", default=None,
                        help="the stored field that the values of --filter @FILE are matched against (default: the "
                             "docid)")


def parse_filter_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Replace ``args.filter`` (the text of :func:`add_filter_flags`' flags) by its Filter (None without one); a
    malformed filter is argparse's usage error naming the flag and the token (exit status 2)."""
    if args.filter is None:
        if args.filter_field is not None:
            parser.error("argument --filter-field: goes with --filter @FILE")
        return
    from pyserini_aligner.filters import FilterError

    try:
        args.filter = search_filter(args.filter, args.filter_field)
    except FilterError as error:
        parser.error(f"argument --filter: {one_line(error)}")


def filter_matches(searcher, flt: Filter) -> int:
    """How many documents of ``searcher``'s index (an AlignerSearcher) ``flt`` matches, before any query: a filter
    that matches none is told in one ``warning:`` line on stderr (its searches have no hits); UsageError naming the
    field for a filter the index can't evaluate (a field it does not store)."""
    from pyserini_aligner.filters import FilterError

    try:
        count = searcher.matching(flt)
    except FilterError as error:
        raise UsageError(f"--filter: {one_line(error)}") from None
    if count == 0:
        print(f"warning: --filter matches no document of {searcher.index_dir}: the run has no hits", file=sys.stderr)
    return count


def add_quiet_flag(parser: argparse.ArgumentParser) -> None:
    """``--quiet``, which every command line has: warnings and errors only (:func:`configure_logging`), no
    progress bars."""
    parser.add_argument("--quiet", action="store_true", help="warnings and errors only: no info messages and no "
                                                             "progress bars")


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` in ``argv`` (``--flag VALUE`` or ``--flag=VALUE``; the last one wins), or None."""
    value = None
    for position, arg in enumerate(argv):
        if arg == flag and position + 1 < len(argv):
            value = argv[position + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def configure_logging(quiet: bool = False, timestamps: bool = False) -> None:
    """The logging of a command line: INFO messages on stderr (WARNING and up with ``quiet``, which also hides the
    Hugging Face progress bars; the commands hide their own with it), each line "LEVEL logger: message" (preceded by
    the time with ``timestamps``); FAISS's and other libraries' chatter stays at WARNING."""
    form = "%(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        format=f"%(asctime)s {form}" if timestamps else form)
    logging.getLogger().setLevel(logging.WARNING if quiet else logging.INFO)  # also when a handler exists already
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if quiet:  # the variable is read when huggingface_hub is imported (not imported for nothing here)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line (its type's name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def exit_status(code: int | str | None) -> int:
    """The exit status ``sys.exit(code)`` gives: None 0, an integer itself, a message 1 (printed to stderr)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return ERROR_EXIT


def run_main(parse: Callable[[list[str] | None], argparse.Namespace],
             command: Callable[[argparse.Namespace], int | None], argv: list[str] | None = None, *,
             timestamps: bool = False) -> int:
    """Run a command line: ``parse(argv)`` (argparse), :func:`configure_logging` from its ``--quiet``, then
    ``command(args)``; returns the exit status, never raises for a user's error:

    - 0 when the command returns None or 0 (or its status when it returns one);
    - 2 for a usage error: argparse's own (its message and usage printed by argparse) or a :class:`UsageError`
      (``error: <message>``);
    - 1 for a run-time error (ValueError, OSError, RuntimeError, ImportError): ``error: <message>`` on one line, no
      traceback (any other exception is a bug, and shows its traceback);
    - 130 for Ctrl-C (``interrupted``), 143 for SIGTERM (``terminated``; handled as Ctrl-C while the command runs
      in the main thread).
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    try:
        args = parse(argv)
        configure_logging(bool(getattr(args, "quiet", False)), timestamps)
        return command(args) or 0
    except SystemExit as stop:  # --help, argparse's usage error (already printed), or the command's own exit
        return exit_status(stop.code)
    except Terminated:
        print("terminated", file=sys.stderr)
        return TERMINATED_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except UsageError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return USAGE_EXIT
    except RUN_TIME_ERRORS as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return ERROR_EXIT
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

"""What every ``python -m eval.*`` command line sets up the same way, and argparse types they share: the plugin's
logging set-up and types (:mod:`pyserini_aligner.cli`), and the benchmarks' own."""
import argparse
import sys
from pathlib import Path
from typing import Callable

from pyserini_aligner.cli import configure_logging, positive_int

__all__ = ["configure_logging", "corpus_size", "positive_int", "positive_ints", "run_report", "string_list",
           "write_report"]


def corpus_size(text: str) -> int:
    """argparse type: a number of passages such as 300, 5k or 1m (:func:`eval.bench_scale.corpus.parse_size`)."""
    from eval.bench_scale.corpus import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers, each at least 1, such as 75,150,300."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every number must be >= 1, got {text!r}")
    return values


def string_list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names, each one of ``choices``, such as graphed,steps."""
    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        wrong = [value for value in values if value not in choices]
        if not values or wrong:
            raise argparse.ArgumentTypeError(f"expected comma-separated names of {', '.join(choices)}, got {text!r}")
        return values

    return parse


def run_report(run: Callable[[], object], report: Path) -> int:
    """Run a benchmark, then print the markdown ``report`` it wrote; a bad corpus or an existing work folder ends
    in one ``error:`` line and exit status 1."""
    from pyserini_aligner.textio import InputError

    try:
        run()
    except (InputError, FileExistsError) as err:  # CorpusError is an InputError
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(report.read_text(encoding="utf-8"), end="")
    return 0


def write_report(folder: Path | str, stem: str, report: dict, markdown: str) -> None:
    """``<stem>.json`` (``report``, indented) and ``<stem>.md`` (``markdown``) in ``folder`` (made if missing), then
    the markdown printed."""
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (folder / f"{stem}.md").write_text(markdown, encoding="utf-8")
    print(markdown)

"""What every ``python -m eval.*`` command line sets up the same way, and argparse types they share: the plugin's
logging set-up and types (:mod:`pyserini_aligner.cli`), and the benchmarks' own."""
import argparse

from pyserini_aligner.cli import configure_logging, positive_int

__all__ = ["configure_logging", "corpus_size", "positive_int"]


def corpus_size(text: str) -> int:
    """argparse type: a number of passages such as 300, 5k or 1m (:func:`eval.bench_scale.corpus.parse_size`)."""
    from eval.bench_scale.corpus import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None

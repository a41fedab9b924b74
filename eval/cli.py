"""What every ``python -m eval.*`` command line sets up the same way, and argparse types they share."""
import argparse
import logging


def configure_logging(quiet: bool = False) -> None:
    """INFO logging (WARNING with ``quiet``, which also hides Hugging Face progress bars); faiss and matplotlib
    stay at WARNING."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("faiss", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def corpus_size(text: str) -> int:
    """argparse type: a number of passages such as 300, 5k or 1m (:func:`eval.bench_scale.corpus.parse_size`)."""
    from eval.bench_scale.corpus import parse_size

    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value

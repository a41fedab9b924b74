"""What every ``python -m eval.*`` command line sets up the same way."""
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

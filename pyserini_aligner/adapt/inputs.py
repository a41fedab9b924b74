"""Labelled queries for adaptation: the judged topics (topics and qrels are read by ``pyserini_aligner.topics``)."""
from __future__ import annotations

import logging
import random

from pyserini_aligner.topics import Qrels

MIN_JUDGED = 8  # below this, the choice of strategy is mostly noise
log = logging.getLogger(__name__)


def labelled_topics(topics: dict[str, str], qrels: Qrels, sample: int | None = None,
                    seed: int = 0) -> dict[str, str]:
    """The topics that have at least one positive judgement, optionally a random ``sample`` of them (``seed``).

    Logs a warning when fewer than MIN_JUDGED (8) remain.
    """
    labelled = {q: t for q, t in topics.items() if any(rel > 0 for rel in qrels.get(q, {}).values())}
    if not labelled:
        raise ValueError(f"none of the {len(topics)} topics has a positive judgement in the qrels "
                         "(do the query ids match?)")
    if sample is not None:
        if sample < 1:
            raise ValueError(f"sample must be >= 1, got {sample}")
        if sample < len(labelled):
            picked = random.Random(seed).sample(sorted(labelled), sample)
            labelled = {q: labelled[q] for q in sorted(picked)}
    if len(labelled) < MIN_JUDGED:
        log.warning("only %d judged queries: a strategy chosen on fewer than %d is unreliable", len(labelled),
                    MIN_JUDGED)
    return labelled

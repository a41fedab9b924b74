"""The documents a codec is trained on: a uniform sample of the whole corpus, not its first documents.

A streaming build must train its codec before it writes the first code, but the corpus may be a one-pass stream
whose first documents are unlike the rest (sorted by source, topic or date). :class:`Spill` reads the stream once
into a temporary file beside the index while it keeps a uniform reservoir of the documents (Vitter's algorithm R);
the codec is trained on the reservoir's documents and the build then encodes the spilled stream, in the corpus's
order. A corpus whose sample would be a large share of it keeps the first-documents sample: it then differs little
from a uniform one, and encoding its sample twice would cost more than it saves.
"""
from __future__ import annotations

import pickle
import random
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

RESERVOIR_DOCS = 131_072  # documents held for the sample: 2.1M tokens (65,536 centroids × 32) at 16 tokens each
SPILL_BATCH = 4096  # documents written to the spill file at a time
UNIFORM_SHARE = 0.25  # a sample of at most this share of the corpus's tokens is drawn uniformly


class Spill:
    """Items of a stream written once to a temporary file in ``folder`` (removed on :meth:`close`), with a uniform
    reservoir of ``capacity`` of them (a text past ``max_chars`` cut there: a model reads far fewer) drawn with
    ``seed``. Use as a context manager; :meth:`items` replays the stream in its order."""

    def __init__(self, folder: Path, capacity: int = RESERVOIR_DOCS, max_chars: int = 1 << 16, seed: int = 0):
        self._file = tempfile.TemporaryFile(dir=folder, prefix=".spill-")
        self.capacity, self.max_chars = capacity, max_chars
        self.seed = seed
        self._rng = random.Random(seed)
        self.reservoir: list[tuple] = []
        self.count = 0

    def __enter__(self) -> "Spill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def read(self, items: Iterable[tuple]) -> "Spill":
        """Spill every item of ``items`` and keep the reservoir; returns self."""
        batch = []
        for item in items:
            batch.append(item)
            self._offer(item)
            if len(batch) == SPILL_BATCH:
                pickle.dump(batch, self._file, protocol=pickle.HIGHEST_PROTOCOL)
                batch = []
        if batch:
            pickle.dump(batch, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        self._file.flush()
        return self

    def _offer(self, item: tuple) -> None:
        self.count += 1
        kept = (item[0], item[1][:self.max_chars], *item[2:])
        if len(self.reservoir) < self.capacity:
            self.reservoir.append(kept)
            return
        slot = self._rng.randrange(self.count)
        if slot < self.capacity:
            self.reservoir[slot] = kept

    def sample(self) -> list[tuple]:
        """The reservoir in a random order (the same at every call): each prefix is a uniform sample of the
        stream."""
        out = list(self.reservoir)
        random.Random(self.seed).shuffle(out)
        return out

    def items(self) -> Iterator[tuple]:
        """The spilled items, in the stream's order."""
        self._file.seek(0)
        while True:
            try:
                batch = pickle.load(self._file)
            except EOFError:
                return
            yield from batch


def uniform_is_worth_it(sample_tokens: int, corpus_tokens: int) -> bool:
    """Whether to draw the codec's sample of ``sample_tokens`` tokens uniformly from a corpus of ``corpus_tokens``
    (encoding those documents twice) rather than take the first documents: when it is at most UNIFORM_SHARE of it."""
    return sample_tokens <= UNIFORM_SHARE * corpus_tokens

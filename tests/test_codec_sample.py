"""The codec's training sample: a uniform reservoir of the whole corpus, spilled once, replayed in order."""
from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from pyserini_aligner.index import build_index
from pyserini_aligner.index import sample as sample_module
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.index.sample import Spill, uniform_is_worth_it


def test_spill_replays_the_stream_in_order_and_keeps_a_uniform_reservoir(tmp_path):
    items = [(f"d{i}", f"text {i}", {"n": i}) for i in range(10_000)]
    with Spill(tmp_path, capacity=1000, seed=3) as spill:
        spill.read(iter(items))
        assert list(spill.items()) == items and list(spill.items()) == items  # replayed at every call
        assert spill.count == 10_000 and len(spill.reservoir) == 1000
        rows = [int(docid[1:]) for docid, *_ in spill.sample()]
        assert len(set(rows)) == 1000 and all(items[r] == (f"d{r}", f"text {r}", {"n": r}) for r in rows)
        # uniform over the stream: each tenth of it holds about a tenth of the reservoir (binomial sd ~9.5)
        counts = np.bincount(np.array(rows) // 1000, minlength=10)
        assert counts.min() > 60 and counts.max() < 140, counts
        assert os.listdir(tmp_path) == []  # the spill file has no name in the folder
    with Spill(tmp_path, capacity=1000, seed=3) as again:
        assert again.read(iter(items)).sample() == spill.sample()  # the seed decides the sample


def test_a_short_stream_is_held_whole_and_long_texts_are_cut(tmp_path):
    with Spill(tmp_path, capacity=50, max_chars=8) as spill:
        spill.read(iter([("a", "0123456789abc"), ("b", "short")]))
        assert sorted(spill.sample()) == [("a", "01234567"), ("b", "short")]
        assert list(spill.items()) == [("a", "0123456789abc"), ("b", "short")]  # the index gets the whole text


def test_uniform_only_where_the_sample_is_a_small_share():
    assert uniform_is_worth_it(100, 400) and not uniform_is_worth_it(101, 400)


def _two_topic_corpus(n: int) -> list[tuple[str, str]]:
    """Documents about cells first, then documents about orbits: a corpus sorted by source."""
    first = [(f"a{i}", f"cell membrane protein binding assay {i % 13} mitochondria receptor") for i in range(n)]
    second = [(f"b{i}", f"orbital telescope galaxy redshift spectrum {i % 11} comet planet") for i in range(n)]
    return first + second


def _squared_error(index, exact, rows: slice) -> float:
    """Mean squared error of the decoded tokens of the documents ``rows`` against the fp16 index's."""
    store, reference = StoredIndex(index), StoredIndex(exact)
    positions = np.arange(int(store.offsets[rows.start]), int(store.offsets[rows.stop]))
    got, want = store.token_vectors(positions), reference.token_vectors(positions)
    return float(((got - want) ** 2).sum(1).mean())


def test_the_codec_learns_the_whole_corpus_not_its_first_documents(tmp_path, monkeypatch, caplog):
    """A corpus sorted by topic: a codec trained on its first documents codes the second topic worse, and the whole
    corpus worse, than one trained on a uniform sample; the index holds the documents in the corpus's order either
    way."""
    docs = _two_topic_corpus(200)
    common = dict(codec="IVF16,PQ4,Refine(PQ8)", train_size=256, batch_size=8, progress=False, device="cpu")
    build_index(docs, tmp_path / "exact", codec="fp16", progress=False, device="cpu")
    with caplog.at_level(logging.INFO, logger="pyserini_aligner.index.builder"):
        build_index(iter(docs), tmp_path / "uniform", **common)
    assert "drawn uniformly from the 400 read" in caplog.text
    monkeypatch.setattr(sample_module, "UNIFORM_SHARE", 0.0)  # a sample never small enough: the first documents
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pyserini_aligner.index.builder"):
        build_index(iter(docs), tmp_path / "first", **common)
    assert "on the first" in caplog.text
    for name in ("uniform", "first"):
        assert StoredIndex(tmp_path / name).docids == [docid for docid, _ in docs]
        assert not [f for f in os.listdir(tmp_path / name) if f.startswith(".spill")]
    uniform, first = ([_squared_error(tmp_path / name, tmp_path / "exact", part)
                       for part in (slice(0, 200), slice(200, 400))] for name in ("uniform", "first"))
    assert first[1] > 1.5 * uniform[1], (first, uniform)  # the topic the first documents lack
    assert sum(uniform) < sum(first), (first, uniform)

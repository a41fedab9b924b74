"""Pyserini encoder wrappers return exactly what AlignerModel.encode returns (real MiniLM, no mocks)."""

import numpy as np
import pytest
import torch
from pyserini.encode import DocumentEncoder, QueryEncoder

from pyserini_aligner.encoders import AlignerDocumentEncoder, AlignerQueryEncoder

QUERIES = ["what causes protein misfolding", "aligner sparse alignment", "x"]
DOCS = ["Chaperones prevent aggregation of misfolded proteins in the cytoplasm.", "", "A short doc.",
        "word " * 400]
TITLES = ["Protein folding", "Empty", "", "Long"]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x.vectors, y.vectors, atol=1e-5)
        np.testing.assert_allclose(x.salience, y.salience, atol=1e-5)
        assert x.truncated == y.truncated


def test_encoders_are_pyserini_encoders(model):
    assert isinstance(AlignerQueryEncoder(model), QueryEncoder)
    assert isinstance(AlignerDocumentEncoder(model), DocumentEncoder)


def test_query_encoder_matches_model(model):
    encoder = AlignerQueryEncoder(model, batch_size=2)
    expected = model.encode(QUERIES, is_query=True)
    _same([encoder.encode(q) for q in QUERIES], expected)
    _same(encoder.batch_encode(QUERIES), expected)
    assert encoder.encode(QUERIES[0]).vectors.shape[1] == 128


def test_document_encoder_matches_model(model):
    encoder = AlignerDocumentEncoder(model, batch_size=3)
    _same(encoder.encode(DOCS), model.encode(DOCS, is_query=False))
    joined = [f"{t} {d}" if t else d for t, d in zip(TITLES, DOCS)]
    with_titles = encoder.encode(DOCS, titles=TITLES)
    _same(with_titles, model.encode(joined, is_query=False))
    assert with_titles[3].truncated and with_titles[3].vectors.shape == (256, 128)
    short = encoder.encode(DOCS, max_length=32)
    assert short[0].vectors.shape[0] <= 32 and short[3].vectors.shape == (32, 128)
    with pytest.raises(ValueError, match="titles"):
        encoder.encode(DOCS, titles=TITLES[:2])


def test_encoders_load_checkpoint_by_name(model):
    encoder = AlignerDocumentEncoder("aligner", device="cpu")
    assert encoder.model.fingerprint() == model.fingerprint()
    _same(encoder.encode(DOCS[:1]), model.encode(DOCS[:1], is_query=False))
    assert AlignerQueryEncoder("aligner", dtype="bf16").model.compute_dtype == torch.bfloat16

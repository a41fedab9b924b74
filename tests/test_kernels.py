"""Triton kernels against their plain-torch references, through Triton's CPU interpreter (skipped without Triton)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported; nothing else runs kernels on the CPU
triton = pytest.importorskip("triton")


@pytest.fixture()
def interpreted(monkeypatch):
    from pyserini_aligner.search import kernels

    if not torch.cuda.is_available():
        monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "interpret")
    kernels._interaction_kernel.cache_clear()
    yield kernels
    kernels._interaction_kernel.cache_clear()


def test_interaction_kernel_matches_reference(interpreted):
    kernels = interpreted
    torch.manual_seed(0)
    batch, nlist, npad, docs = 3, 50, 16, 40
    lengths = torch.randint(0, 9, (docs,))
    lengths[3] = 0  # a document without tokens scores −inf
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    token_ids = torch.randint(0, nlist, (int(offsets[-1]),), dtype=torch.int16)
    table = torch.randn(batch, nlist, npad).half()
    rows = torch.randint(0, docs, (batch, 37))
    rows[0, 0] = 3
    valid = torch.rand(batch, 37) > 0.2
    valid[0, 0] = True
    q_mask = torch.zeros(batch, npad, dtype=torch.bool)
    q_mask[:, :5] = True
    q_mask[1, :12] = True
    got = kernels.interaction(table, rows, valid, offsets, token_ids, q_mask, block=8)
    want = kernels.interaction_reference(table, rows, valid, offsets, token_ids, q_mask)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and bool(torch.isinf(got[0, 0]))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)], atol=1e-5)


def test_engine_ranks_alike_with_and_without_kernels(default_index, model, interpreted, monkeypatch):
    """The torch backend's centroid-interaction stage through the kernel ranks as through plain torch."""
    from pyserini_aligner.search import AlignerSearcher

    queries = ["coronavirus transmission in hospitals", "gene expression of tumour cells", "vitamin D deficiency"]
    knobs = dict(encoder=model, backend="torch", k_per_token=20, nprobe=4, max_candidates=16, interaction_candidates=64)
    with_kernel = AlignerSearcher(default_index, **knobs).rank(queries, k=10)
    monkeypatch.setenv("PYSERINI_ALIGNER_TRITON", "0")
    interpreted._triton.cache_clear()
    try:
        plain = AlignerSearcher(default_index, **knobs).rank(queries, k=10)
    finally:
        interpreted._triton.cache_clear()
    for got, want in zip(with_kernel, plain):
        assert [d for d, _ in got] == [d for d, _ in want]


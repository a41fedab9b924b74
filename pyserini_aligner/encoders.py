"""Pyserini encoder classes around :class:`AlignerModel` (multi-vector output: one EncodedText per text)."""

from __future__ import annotations

import torch
from pyserini.encode import DocumentEncoder, QueryEncoder

from pyserini_aligner.model import AlignerModel, EncodedText
from pyserini_aligner.resolve import AUTO, load_model
from pyserini_aligner.textio import check_collection


def _load(model: str | AlignerModel, device: str, dtype: str | torch.dtype | None, fp16: bool) -> AlignerModel:
    """Checkpoint name/folder or a ready model → AlignerModel on ``device``; fp16=True means dtype "fp16".
    Without either, a loaded checkpoint computes in fp32 (Pyserini's encoders are fp32 unless --fp16)."""
    if dtype is None:
        dtype = "fp16" if fp16 else (AUTO if isinstance(model, AlignerModel) else "fp32")
    return load_model(model, device, dtype)


class AlignerQueryEncoder(QueryEncoder):
    """Query side: ``encode(query)`` → EncodedText (vectors [n, 128], salience [n]) with the query head/maxlen."""

    def __init__(self, model: str | AlignerModel = "aligner", device: str = "cpu",
                 dtype: str | torch.dtype | None = None, fp16: bool = False, batch_size: int = 32):
        super().__init__(encoded_query_dir=None)
        self.model = _load(model, device, dtype, fp16)
        self.device = device
        self.batch_size = batch_size
        self.has_model = True

    def encode(self, query: str, **kwargs) -> EncodedText:
        return self.model.encode([query], is_query=True, batch_size=1)[0]

    def batch_encode(self, queries: list[str], progress: bool = False) -> list[EncodedText]:
        """Encode many queries in length-sorted batches; returns them in input order."""
        return self.model.encode(queries, is_query=True, batch_size=self.batch_size, progress=progress)


class AlignerDocumentEncoder(DocumentEncoder):
    """Document side: ``encode(texts, titles=None)`` → list[EncodedText] (vectors [m, 128], salience [m])."""

    def __init__(self, model: str | AlignerModel = "aligner", device: str = "cpu",
                 dtype: str | torch.dtype | None = None, fp16: bool = False, batch_size: int = 32):
        self.model = _load(model, device, dtype, fp16)
        self.device = device
        self.batch_size = batch_size

    def encode(self, texts: list[str], titles: list[str] | None = None, max_length: int | None = None,
               progress: bool = False, **kwargs) -> list[EncodedText]:
        """Titles are prepended as "title text" (Pyserini's convention); ``max_length`` may only lower doc_maxlen."""
        check_collection(texts, "texts")
        texts = list(texts)
        if titles is not None:
            check_collection(titles, "titles")
            if len(titles) != len(texts):
                raise ValueError(f"titles has {len(titles)} entries but texts has {len(texts)}")
            texts = [f"{title} {text}" if title else text for title, text in zip(titles, texts)]
        maxlen = min(max_length, self.model.config.doc_maxlen) if max_length else None
        return self.model.encode(texts, is_query=False, batch_size=self.batch_size, progress=progress, maxlen=maxlen)

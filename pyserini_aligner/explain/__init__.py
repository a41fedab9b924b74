"""AligneR "explain" view: which document tokens each salient query token aligns to, and what a document scored.

``explain(index_dir, query)`` searches the index (or takes ``docids``), looks each document's text up in the corpus
the index was built from (the index stores only vectors), re-tokenises it with the index's model, checks the
re-encoded vectors against the stored ones, and returns one :class:`Explanation` per document; ``render_html`` /
``render_png`` draw them. CLI: ``python -m pyserini_aligner.explain --index <dir> --query <text> --corpus <spec>``.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from pyserini_aligner.alignment import Strategy, alignment_scores_paired, alignment_weights
from pyserini_aligner.explain.render import Explanation, Token, render_html, render_png
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.textio import check_collection

__all__ = ["Explanation", "Token", "explain", "explain_document", "load_texts", "text_tokens", "render_html",
           "render_png"]

MIN_COSINE = 0.99  # re-encoded vs stored doc token vectors (stored as fp16)


def text_tokens(model: AlignerModel, text: str, is_query: bool) -> tuple[list[Token], bool]:
    """The tokens behind ``model.encode([text], is_query)``'s vectors, in order, and whether the text was cut.

    Uses the model's own tokenize (same ids, same truncation, same special-token mask); with a fast tokenizer each
    token shows its span of the original text (original case), else the wordpiece with "##" glued to the word.
    """
    ids, truncated = model.tokenize([text], is_query)
    row = ids[0]
    keep = model.token_mask(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))[0].tolist()
    pieces = model.tokenizer.tokens(row)
    special = set(model.special_ids.tolist())
    spans = _offsets(model, text, is_query, row, truncated[0])
    tokens, prev_end = [], None
    for pos, (token_id, piece) in enumerate(zip(row, pieces)):
        if token_id in special:
            tok = Token(piece, False, True, piece)
        elif spans is not None:
            start, end = spans[pos]
            tok = Token(text[start:end], prev_end == start, False, piece)
            prev_end = end
        else:
            tok = Token(piece[2:] if piece.startswith("##") else piece, piece.startswith("##"), False, piece)
        if keep[pos]:
            tokens.append(tok)
    return tokens, truncated[0]


def _offsets(model: AlignerModel, text: str, is_query: bool, row: list[int], truncated: bool):
    """Character span of each token of ``row`` (cut like AlignerModel.tokenize), or None without a fast tokenizer."""
    limit = model.config.query_maxlen if is_query else model.config.doc_maxlen
    try:
        ids, spans = model.tokenizer.ids_and_offsets(text, max_length=limit + 1)
    except ValueError:  # a tokenizer without character offsets
        return None
    spans = [tuple(span) for span in spans]
    if truncated:
        ids, spans = ids[:limit - 1] + ids[-1:], spans[:limit - 1] + spans[-1:]
    return spans if list(ids) == list(row) else None


def load_texts(corpus: str | os.PathLike, docids: list[str]) -> dict[str, str]:
    """Text of each of ``docids`` from a JsonCollection file/folder or an ir_datasets id (scans until all found)."""
    from pyserini_aligner.index.corpus import read_corpus

    check_collection(docids, "docids")
    wanted, texts = set(docids), {}
    for docid, text, *_ in read_corpus(corpus):
        if docid in wanted:
            texts[docid] = text
            if len(texts) == len(wanted):
                break
    missing = [d for d in docids if d not in texts]
    if missing:
        raise ValueError(f"corpus {corpus}: no document with id {', '.join(map(repr, missing[:5]))}; "
                         "pass the corpus the index was built from (--corpus)")
    return texts


def explain_document(model: AlignerModel, query: str, doc_text: str, doc_vectors: np.ndarray,
                     doc_salience: np.ndarray, strategy: Strategy, docid: str = "",
                     rank: int | None = None, min_cosine: float | None = MIN_COSINE) -> Explanation:
    """Explain one (query, document) pair scored from the stored doc_vectors [m, d] and doc_salience [m].

    doc_text is re-encoded with ``model``; its tokens must reproduce the stored vectors (same count, and cosine ≥
    ``min_cosine`` per token unless None, as for compressed stores), otherwise ValueError (wrong text or a
    different model). The score equals the searcher's.
    """
    if not query.strip():
        raise ValueError("the query is empty")
    q_tokens, query_truncated = text_tokens(model, query, is_query=True)
    d_tokens, truncated = text_tokens(model, doc_text, is_query=False)
    q_enc, d_enc = model.encode([query], is_query=True)[0], model.encode([doc_text], is_query=False)[0]
    stored = np.asarray(doc_vectors, dtype=np.float32)
    _check_doc(docid, d_enc.vectors, stored, len(d_tokens), min_cosine)
    q, d = torch.from_numpy(q_enc.vectors), torch.from_numpy(stored)
    q_sal = torch.from_numpy(q_enc.salience)
    d_sal = torch.from_numpy(np.array(doc_salience, dtype=np.float32))
    use_salience = model.scores_with_salience  # u shown and used only when it weights the score
    sim = q @ d.T
    align = alignment_weights(sim, torch.ones(len(d), dtype=torch.bool), strategy)
    weights = align * (q_sal[:, None] * d_sal[None, :]) if use_salience else align
    contribution = (weights * sim).sum(1) / weights.sum().clamp_min(1e-12)
    ones_q, ones_d = torch.ones(1, len(q), dtype=torch.bool), torch.ones(1, len(d), dtype=torch.bool)
    score = alignment_scores_paired(q[None], ones_q, d[None], ones_d, strategy,
                                    q_sal[None] if use_salience else None, d_sal[None] if use_salience else None)
    return Explanation(
        query=query, docid=docid, rank=rank, score=float(score[0]), strategy=str(strategy), use_salience=use_salience,
        q_tokens=q_tokens, d_tokens=d_tokens,
        q_weight=(q_sal if use_salience else sim.max(1).values).numpy(),
        d_weight=(d_sal if use_salience else sim.max(0).values).numpy(),
        sim=sim.numpy(), align=align.numpy(), contribution=contribution.numpy(), truncated=truncated,
        query_truncated=query_truncated)


def _check_doc(docid: str, encoded: np.ndarray, stored: np.ndarray, n_tokens: int,
               min_cosine: float | None = MIN_COSINE) -> None:
    name = f"document {docid!r}" if docid else "the document"
    if not (len(encoded) == len(stored) == n_tokens):
        raise ValueError(f"{name}: its text encodes to {len(encoded)} tokens but the index stores {len(stored)}; "
                         "the corpus text differs from the indexed text (wrong --corpus?)")
    cosine = (encoded * stored).sum(1) / np.maximum(np.linalg.norm(encoded, axis=1) * np.linalg.norm(stored, axis=1),
                                                     1e-12)
    if min_cosine is not None and len(cosine) and cosine.min() < min_cosine:
        raise ValueError(f"{name}: re-encoded token vectors differ from the stored ones (min cosine "
                         f"{cosine.min():.3f}); the corpus text or the model differs from the index's")


def explain(index_dir: str | os.PathLike, query: str, docids: list[str] | None = None, hits: int = 3,
            strategy: Strategy | None = None, corpus: str | os.PathLike | None = None, encoder=None,
            **searcher_args) -> list[Explanation]:
    """Explanations for ``docids`` (in the order given), or for the top ``hits`` documents AlignerSearcher returns.

    strategy: alignment strategy (default: the index's). corpus: JsonCollection file/folder or ir_datasets id holding
    the documents' text (default: the corpus the manifest records, if it records one). encoder: as AlignerSearcher's.
    searcher_args go to AlignerSearcher (k_per_token, max_candidates, ...).
    """
    from pyserini_aligner.index.reader import StoredIndex

    if docids is not None:
        check_collection(docids, "docids")
    store = StoredIndex(index_dir)
    source = corpus or getattr(store.manifest, "corpus", "")  # indexes that record their corpus need no --corpus
    if not source:
        raise ValueError(f"index {index_dir} stores only vectors and its manifest ({Path(index_dir) / 'manifest.json'}) "
                         "records no corpus; pass the corpus it was built from (--corpus <JsonCollection file | "
                         "ir_datasets id>)")
    strategy = strategy or store.manifest.default_strategy
    if docids:
        from pyserini_aligner.resolve import model_for_index

        missing = [d for d in docids if store.row_of(d) is None]
        if missing:
            raise ValueError(f"index {index_dir} has no document with id {', '.join(map(repr, missing[:5]))}")
        model = model_for_index(encoder, store.manifest, index_dir)
        ranked = [(d, None) for d in docids]
    else:
        from pyserini_aligner.search import AlignerSearcher

        if hits < 1:
            raise ValueError(f"hits must be >= 1, got {hits}")
        if not query.strip():
            raise ValueError("the query is empty")
        searcher = AlignerSearcher(index_dir, encoder=encoder, strategy=strategy, **searcher_args)
        model, store = searcher.model, searcher.store
        ranked = [(hit.docid, rank) for rank, hit in enumerate(searcher.search(query, k=hits), 1)]
    texts = load_texts(source, [d for d, _ in ranked])
    out = []
    for docid, rank in ranked:
        row = store.row_of(docid)
        positions = np.arange(store.offsets[row], store.offsets[row + 1])
        out.append(explain_document(model, query, texts[docid], store.token_vectors(positions).numpy(),
                                    store.token_salience(positions), strategy, docid=docid, rank=rank,
                                    min_cosine=None if store.manifest.codec.compressed else MIN_COSINE))
    return out

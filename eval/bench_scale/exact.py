"""The fidelity reference of the scale benchmark: exhaustive top-k:1 scoring of every passage with its exact
(unpruned, uncompressed float16) token vectors, on the device."""
from __future__ import annotations

from contextlib import contextmanager
from itertools import islice
from typing import Callable, Iterable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

TOKENS_PER_BLOCK = 1 << 18  # document tokens scored at once
ENCODE_STEP = 8192  # passages encoded per call


@contextmanager
def float32_products() -> Iterator[None]:
    """TF32 off for CUDA matrix products inside the block (float32 products, as the searcher's refinement)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def encode_tokens(model, texts: Sequence[str], batch_size: int, progress: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [T, d] float16, salience [T] float32, lengths [N] int64) of every text's stored tokens, text after
    text, on the model's device."""
    parts, saliences, lengths = [], [], []
    for start in tqdm(range(0, len(texts), ENCODE_STEP), desc="encode (exact)", disable=not progress):
        out = model.encode_padded(list(texts[start:start + ENCODE_STEP]), is_query=False, batch_size=batch_size)
        parts.append(out.vectors[out.mask].half())
        saliences.append(out.salience[out.mask].float())
        lengths.append(out.mask.sum(1))
    return torch.cat(parts), torch.cat(saliences), torch.cat(lengths).long()


def exhaustive_top(q: torch.Tensor, q_mask: torch.Tensor, tokens, lengths: torch.Tensor, k: int,
                   decode: Callable[[int, int], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, k], rows [B, k]) of top-k:1 alignment (mean over a query's tokens of its best document token)
    over every document, best first. q [B, n, d] float32, q_mask [B, n]; tokens [T, d] with lengths [N] (or any
    codes that ``decode(a, b)`` turns into the float32 vectors of tokens a..b-1)."""
    flat = q[q_mask].float()  # [Q, d]
    owner = torch.repeat_interleave(torch.arange(len(q), device=q.device), q_mask.sum(1))
    weights = torch.zeros(len(flat), len(q), device=q.device)
    weights[torch.arange(len(flat), device=q.device), owner] = 1.0 / q_mask.sum(1)[owner].float()
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    best_s = torch.full((len(q), 0), -torch.inf, device=q.device)
    best_r = torch.zeros((len(q), 0), dtype=torch.long, device=q.device)
    doc = 0
    while doc < len(lengths):
        stop = max(int(torch.searchsorted(offsets, offsets[doc] + TOKENS_PER_BLOCK, right=True)) - 1, doc + 1)
        a, b = int(offsets[doc]), int(offsets[stop])
        block = tokens[a:b].float() if decode is None else decode(a, b)
        best = torch.segment_reduce(block @ flat.T, "max", lengths=lengths[doc:stop], axis=0, unsafe=True)
        scores = (best @ weights).T  # [B, docs]
        rows = torch.arange(doc, stop, device=q.device).expand(len(q), -1)
        both_s, both_r = torch.cat([best_s, scores], 1), torch.cat([best_r, rows], 1)
        top = both_s.topk(min(k, both_s.shape[1]), dim=1)
        best_s, best_r = top.values, both_r.gather(1, top.indices)
        doc = stop
    return best_s, best_r


def exact_ranking(passages: Iterable[tuple[str, str]], queries: Sequence[str], encoder: str, device: str,
                  batch_size: int, k: int = 10, progress: bool = False,
                  total: int | None = None) -> list[list[tuple[str, float]]]:
    """Per query, the top-k (docid, score) of exhaustive top-k:1 scoring with exact token vectors. The passages are
    encoded ENCODE_STEP at a time, scored against every query and dropped: memory for one step's tokens and the
    queries' k best, whatever the corpus's size (8.8M passages hold 162 GB of float16 tokens). ``total``: the
    passages' count, for the progress bar."""
    from pyserini_aligner.resolve import load_model

    with float32_products():
        model = load_model(encoder, device=device)
        out = model.encode_padded(list(queries), is_query=True, batch_size=64)
        q, q_mask = out.vectors.float(), out.mask
        best_s = torch.full((len(q), 0), -torch.inf, device=q.device)
        best_r = torch.zeros((len(q), 0), dtype=torch.long, device=q.device)
        docids: list[str] = []
        texts = iter(passages)
        with tqdm(total=total, desc="exact", unit="passage", disable=not progress) as bar:
            while step := list(islice(texts, ENCODE_STEP)):
                tokens, _, lengths = encode_tokens(model, [text for _, text in step], batch_size)
                scores, rows = exhaustive_top(q, q_mask, tokens, lengths, k)
                both_s, both_r = torch.cat([best_s, scores], 1), torch.cat([best_r, rows + len(docids)], 1)
                top = both_s.topk(min(k, both_s.shape[1]), dim=1)
                best_s, best_r = top.values, both_r.gather(1, top.indices)
                docids += [docid for docid, _ in step]
                bar.update(len(step))
    return [[(docids[r], s) for r, s in zip(rr, ss)] for rr, ss in zip(best_r.tolist(), best_s.tolist())]


def merged_rankings(parts: Sequence[list[list[tuple[str, float]]]], k: int = 10) -> list[list[tuple[str, float]]]:
    """Per query, the k best (docid, score) of several rankings of the same queries over disjoint passages (a
    score tie keeps the earlier part's passage first, as one pass over the parts in order ranks it)."""
    return [sorted((hit for part in hits for hit in part), key=lambda hit: -hit[1])[:k] for hits in zip(*parts)]


def exact_top(model, queries: Sequence[str], tokens: torch.Tensor, lengths: torch.Tensor, docids: Sequence[str],
              k: int = 10) -> list[list[tuple[str, float]]]:
    """Per query, the top-k (docid, score) of :func:`exhaustive_top` over exact tokens [T, d] with lengths [N] and
    their ``docids`` [N]; the queries are encoded by ``model`` (every token), products in float32."""
    with float32_products():
        out = model.encode_padded(list(queries), is_query=True, batch_size=64)
        scores, rows = exhaustive_top(out.vectors.float(), out.mask, tokens, lengths, k)
    return [[(docids[r], s) for r, s in zip(rr, ss)] for rr, ss in zip(rows.tolist(), scores.tolist())]

"""Backends on the CPU through FAISS: a compressed index (:class:`FaissIVF`: FAISS's ``IndexIVFPQ`` scans the
inverted lists read from their files (:class:`PagedLists`), interaction and refinement read the candidates' codes, one
:class:`.torch_codes.TorchCodes` a segment) and an fp16 index (:class:`FaissFlat`: each segment's FAISS index finds the
tokens, refinement scores the stored float16 tokens; top-k:1 over a flat index of every token scores every
document exactly)."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.alignment import alignment_scores, maxsim_mean, packs_maxsim, weighted_mean
from pyserini_aligner.index.reader import StoredIndex, Workspace
from pyserini_aligner.search.backends.base import Clock, Queries, Scoring, Staged, no_clock
from pyserini_aligner.search.backends.torch_codes import SegmentCodes, codes_on
from pyserini_aligner.search.candidates import merge_probes, top_hits
from pyserini_aligner.search.codes import probe_parts
from pyserini_aligner.search.allowed import AllowedRows, allowed_entries, allowed_rows, row_selector
from pyserini_aligner.search.flat import flat_vectors, search_index
from pyserini_aligner.search.options import Depth

REFINE_CHUNK = 512  # documents scored at once by the fp16 CPU refinement (bounds the padded token tensor)
PACKED_TOKENS = 1 << 13  # document tokens multiplied at once by the packed refinement (4 MiB of float32)
EXHAUSTIVE_ELEMENTS = 1 << 23  # query-token x document-token products computed at once by exhaustive scoring
DEFAULT_EF_SEARCH = 128
LOADED_ENTRIES = 1 << 21  # inverted-list entries handed to FAISS at once (8 + M bytes each, twice while loading)


class PagedLists:
    """Every segment's inverted lists, left in their files: for each part of a batch's probes, only
    the lists that part probes are handed to a FAISS ``IndexIVFPQ`` (which holds 8 + M bytes an entry), scanned and
    dropped, so that an index's memory does not grow with its lists (an index of at most LOADED_ENTRIES entries is
    handed over whole, once). A list holds the same entries in the same
    order (segment after segment, labelled by global document row) as an index of all of them, so FAISS finds the
    same entries."""

    def __init__(self, store: StoredIndex):
        import faiss

        self.index = store.codec.faiss_index()  # the quantizer and the codebooks; entries come per search
        self._idle = faiss.ArrayInvertedLists(self.index.nlist, self.index.code_size)  # empty, between searches
        self.index.replace_invlists(self._idle, False)
        self.parts = [(seg, int(base)) for seg, base in zip(store.segments, store.row_base)]
        self.list_sizes = sum((np.diff(seg.ivf_offsets) for seg, _ in self.parts), np.zeros(self.index.nlist, np.int64))
        self._listno_bytes = self.index.coarse_code_size()  # FAISS's codes with their list: list number, then code
        # an index of at most LOADED_ENTRIES entries is loaded once and kept: no search copies its lists again
        self.resident = int(self.list_sizes.sum()) <= LOADED_ENTRIES
        if self.resident:
            self._load(np.flatnonzero(self.list_sizes))

    def search(self, x: np.ndarray, lists: np.ndarray, lists_scores: np.ndarray, k: int,
               params) -> tuple[np.ndarray, np.ndarray]:
        """(scores [R, k] float32, rows [R, k] int64) as ``IndexIVF.search_preassigned`` over all the lists: x [R, d]
        float32 probes, lists / lists_scores [R, P] each probe's lists and their centroid scores; ``params``: the
        FAISS search parameters (nprobe, selector)."""
        import faiss

        distances = np.empty((len(x), k), dtype=np.float32)
        labels = np.empty((len(x), k), dtype=np.int64)
        if self.resident:
            self.index.search_preassigned_c(len(x), faiss.swig_ptr(x), k, faiss.swig_ptr(lists),
                                            faiss.swig_ptr(lists_scores), faiss.swig_ptr(distances),
                                            faiss.swig_ptr(labels), False, params)
            return distances, labels
        entries = np.where(lists >= 0, self.list_sizes[lists], 0).sum(1)  # FAISS marks missing lists −1
        try:
            for part, _ in probe_parts(entries, max(LOADED_ENTRIES, int(entries.max(initial=0)))):
                wanted = np.unique(lists[part])
                self._load(wanted[wanted >= 0])
                xs, ls, ss = (np.ascontiguousarray(a[part]) for a in (x, lists, lists_scores))
                d, i = np.empty((len(xs), k), dtype=np.float32), np.empty((len(xs), k), dtype=np.int64)
                self.index.search_preassigned_c(len(xs), faiss.swig_ptr(xs), k, faiss.swig_ptr(ls),
                                                faiss.swig_ptr(ss), faiss.swig_ptr(d), faiss.swig_ptr(i), False,
                                                params)
                distances[part], labels[part] = d, i
        finally:
            self.index.replace_invlists(self._idle, False)  # frees the entries
            self.index.ntotal = 0
        return distances, labels

    def _load(self, wanted: np.ndarray) -> None:
        """Make the FAISS index hold exactly the entries of lists ``wanted`` (sorted list numbers), in lists of its
        own (freed when replaced)."""
        import faiss

        lists = faiss.ArrayInvertedLists(self.index.nlist, self.index.code_size)
        self.index.replace_invlists(lists, True)
        lists.this.disown()  # the index owns and frees it
        self.index.ntotal = 0
        width = self._listno_bytes
        for seg, base in self.parts:
            counts, docs, codes = seg.read_lists(wanted)  # read by position: the lists' files are never mapped in
            total = len(docs)
            if total == 0:
                continue
            coded = np.empty((total, width + codes.shape[1]), dtype=np.uint8)
            coded[:, :width] = np.repeat(wanted, counts).astype("<i8").view(np.uint8).reshape(total, 8)[:, :width]
            coded[:, width:] = codes
            self.index.add_sa_codes(coded, docs.astype(np.int64) + base)


class FaissIVF(Staged):
    """A compressed index on the CPU: FAISS's IndexIVFPQ scans every segment's inverted lists (:class:`PagedLists`,
    labelled by global document row) for each probe's best entries; interaction and refinement decode the
    candidates' codes (memory-mapped, or read by position for a large index: :class:`..codes.CodeShard`)."""

    def __init__(self, store: StoredIndex, scoring: Scoring):
        self.store, self.device, self.num_rows = store, torch.device("cpu"), store.num_docs
        self.lists = PagedLists(store)
        self.index = self.lists.index
        self.codes = SegmentCodes([codes_on(store, [i], "cpu", scoring) for i in range(len(store.segments))]) \
            if store.segments else None
        allowed = allowed_rows(store)
        self._selector = None if allowed.all() else row_selector(allowed)  # FAISS skips the other rows' entries

    def probe(self, probes: Tensor, per_token: int, nprobe: int,
              allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """The coarse step (each probe's nprobe nearest centroids) on torch's BLAS, then FAISS scans the chosen
        lists, skipping the entries of rows that are not allowed (deleted, or outside ``allowed``)."""
        import faiss

        x = np.ascontiguousarray(probes.cpu().numpy(), dtype=np.float32)
        params = faiss.SearchParametersIVF(nprobe=nprobe)
        selector = self._selector if allowed is None else allowed.selector()
        if selector is not None:
            params.sel = selector
        lists_scores, lists = search_index(self.index.quantizer, x, nprobe)
        distances, labels = self.lists.search(x, lists, lists_scores, per_token, params)
        return torch.from_numpy(distances), torch.from_numpy(labels)

    def interaction(self, q, q_mask, rows, valid) -> Tensor:
        return self.codes.interaction(q, q_mask, rows, valid)

    def refine(self, q, q_mask, q_sal, rows, valid) -> Tensor:
        return self.codes.refine(q, q_mask, q_sal, rows, valid)


class FaissFlat(Staged):
    """An fp16 index on the CPU: each segment's FAISS index finds each probe's best tokens; refinement scores the
    candidates' stored float16 tokens. No interaction stage. Where every segment's FAISS index is flat and holds
    every stored token in order (β^d = 1), the strategy is top-k:1 without salience in the score and every query token
    probes (β^q = 1), the probe's products are every query token's with every document token, so a search scores
    every document exactly from them instead (:meth:`exhaustive`): no document is left out by the candidates, for the
    probe's cost."""

    has_interaction = False

    def __init__(self, store: StoredIndex, scoring: Scoring, nprobe: int | None, ef_search: int | None,
                 k_per_token: int):
        self.store, self.scoring, self.device, self.num_rows = store, scoring, torch.device("cpu"), store.num_docs
        self.index = [(seg.faiss_index(), base) for seg, base in zip(store.segments, store.token_base)]
        self._flat = [flat_vectors(index) for index, _ in self.index]
        self.scores_every_document = packs_maxsim(scoring.strategy) and all(
            vectors is not None and len(vectors) == seg.info.num_kept == seg.info.num_tokens  # every token, in order
            for vectors, seg in zip(self._flat, store.segments))
        allowed = allowed_rows(store)
        self._allowed = [allowed_entries(store, number, allowed) for number in range(len(store.segments))]
        self._workspace = Workspace()
        self._set_params(store, nprobe, ef_search, k_per_token)

    def _set_params(self, store: StoredIndex, nprobe: int | None, ef_search: int | None, k_per_token: int) -> None:
        import faiss

        space = faiss.ParameterSpace()
        for index, _ in self.index:
            ivf = faiss.try_extract_index_ivf(index)
            if ivf is not None:
                space.set_index_parameter(index, "nprobe", min(nprobe or 32, ivf.nlist))
            elif nprobe is not None:
                raise ValueError(f"nprobe given but the index ({store.manifest.index_type}) is not an IVF index")
            try:
                space.set_index_parameter(index, "efSearch", max(ef_search or DEFAULT_EF_SEARCH, k_per_token))
            except RuntimeError:
                if ef_search is not None:
                    raise ValueError(f"ef_search given but the index ({store.manifest.index_type}) is not an HNSW "
                                     "index") from None

    def search(self, queries: Queries, depth: Depth, k: int, clock: Clock = no_clock,
               allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        if self.scores_every_document and queries.refine_salience is None and torch.equal(queries.probe_mask,
                                                                                         queries.mask):
            found = self.exhaustive(queries.vectors, queries.mask, k, allowed)
            clock("refine")
            return found
        return super().search(queries, depth, k, clock, allowed)

    def exhaustive(self, q: Tensor, q_mask: Tensor, k: int,
                   allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """Top ``k`` (scores [B, k'], rows [B, k']) by the top-k:1 score of every live (or ``allowed``) document,
        ties to the lower row: every real query token of the batch [B, n, d] (``q_mask`` [B, n]) multiplied by a
        block of whole documents' tokens at once (the flat indexes' float32 vectors), each query token's best over
        each document's tokens (:func:`~pyserini_aligner.alignment.maxsim_mean` in the query's own positions: the
        value refinement gives, to float rounding)."""
        live = allowed_rows(self.store) if allowed is None else allowed.mask
        owner, position = q_mask.nonzero(as_tuple=True)
        tokens = q[owner, position].float()  # [N, d]
        weights = q_mask.to(torch.float32)[:, None, :]  # [B, 1, n]
        best_scores = torch.full((len(q), 0), -torch.inf)
        best_rows = torch.full((len(q), 0), -1, dtype=torch.long)
        per_block = max(1, EXHAUSTIVE_ELEMENTS // max(len(tokens), 1))
        for vectors, seg, row_base in zip(self._flat, self.store.segments, self.store.row_base):
            base = torch.from_numpy(vectors)
            for first, last in document_blocks(seg.lengths, per_block):
                lengths = seg.lengths[first:last]
                filled = np.flatnonzero(lengths > 0)
                lo = int(seg.offsets[first])
                if not len(filled):
                    continue
                sim = (tokens @ base[lo:lo + int(lengths.sum())].T).numpy()  # [N, t]
                best = np.maximum.reduceat(sim, (seg.offsets[first:last] - lo)[filled], axis=1)  # [N, docs]
                padded = torch.zeros(len(q), len(filled), q.shape[1])
                padded[owner, :, position] = torch.from_numpy(best)
                scores = maxsim_mean(padded, weights)  # [B, docs]
                rows = torch.from_numpy(filled + first + int(row_base))
                scores[:, ~torch.from_numpy(live[rows.numpy()])] = -torch.inf
                best_scores, best_rows = top_hits(torch.cat([best_scores, scores], 1),
                                                  torch.cat([best_rows, rows.expand(len(q), -1)], 1), k)
        return best_scores, best_rows

    def probe(self, probes: Tensor, per_token: int, nprobe: int,
              allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        x = np.ascontiguousarray(probes.cpu().numpy(), dtype=np.float32)
        parts = []
        entries = self._allowed if allowed is None else allowed.form("fp16 entries", lambda: [
            allowed_entries(self.store, number, allowed.mask) for number in range(len(self.store.segments))])
        for (index, base), seg, kept in zip(self.index, self.store.segments, entries):
            distances, labels = search_index(index, x, min(per_token, max(index.ntotal, 1)), kept)
            found = labels >= 0  # a FAISS label is a position in the segment's faiss_ids, not a token position
            positions = seg.faiss_ids[np.where(found, labels, 0)] if index.ntotal else np.zeros_like(labels)
            rows = np.where(found, self.store.doc_of_token(positions + base), -1)
            distances = np.where(rows >= 0, distances, -np.inf).astype(np.float32)
            parts.append((torch.from_numpy(distances), torch.from_numpy(rows)))
        return merge_probes(parts, per_token) if len(parts) > 1 else parts[0]

    def refine(self, q, q_mask, q_sal, rows, valid) -> Tensor:
        if q_sal is None and packs_maxsim(self.scoring.strategy):
            return self._refine_packed(q, q_mask, rows, valid)
        if q_sal is None and self.scoring.strategy.kind in ("top-k", "top-p"):
            return self._refine_packed_top(q, q_mask, rows, valid)
        out = torch.full(rows.shape, -torch.inf)
        kept_only = self.scoring.refine_with == "kept"
        for b in range(len(rows)):
            picked = rows[b][valid[b]].numpy()
            for start in range(0, len(picked), REFINE_CHUNK):
                chunk = picked[start:start + REFINE_CHUNK]
                d, d_mask, d_sal = self.store.gather(chunk, kept_only, self._workspace)
                out[b, start:start + len(chunk)] = alignment_scores(
                    q[b:b + 1], q_mask[b:b + 1], d, d_mask, self.scoring.strategy,
                    None if q_sal is None else q_sal[b:b + 1], None if q_sal is None else d_sal)[0]
        return out

    def _refine_packed(self, q, q_mask, rows, valid) -> Tensor:
        """Top-k:1 scores [B, C] of each query's valid candidate rows [B, C] (−inf elsewhere) without padding: the
        candidates' tokens one after another, a block of them multiplied by the query's real tokens at once, each
        query token's best over each document's own tokens (:func:`~pyserini_aligner.alignment.maxsim_mean`: the
        value the padded scoring gives, to float rounding)."""
        out = torch.full(rows.shape, -torch.inf)
        kept_only = self.scoring.refine_with == "kept"
        for b in range(len(rows)):
            where = torch.nonzero(valid[b]).squeeze(1)
            tokens = q[b][q_mask[b]]  # [n, d]
            positions, owner, _, lengths = self.store.token_layout(rows[b][where].numpy(), kept_only)
            best = torch.full((len(where), len(tokens)), -torch.inf)
            ends = np.cumsum(lengths)
            for start in range(0, len(positions), PACKED_TOKENS):
                stop = min(start + PACKED_TOKENS, len(positions))
                sim = (self.store.token_vectors(positions[start:stop]) @ tokens.T).numpy()  # [t, n]
                docs = np.unique(owner[start:stop])  # the documents with tokens in the block, in order
                firsts = np.maximum(ends[docs] - lengths[docs], start) - start
                block = torch.from_numpy(np.maximum.reduceat(sim, firsts, axis=0))
                best[docs] = torch.maximum(best[docs], block)
            padded = torch.zeros(len(where), q.shape[1])  # in the query's own positions: the padded sums' order
            padded[:, q_mask[b]] = best
            out[b, where] = maxsim_mean(padded, q_mask[b].to(q.dtype))
        return out

    def _refine_packed_top(self, q, q_mask, rows, valid) -> Tensor:
        """Top-k and top-p scores [B, C] (as :meth:`_refine_packed`, −inf where not valid) without padding the
        candidates to the longest of them: documents one after another, about PACKED_TOKENS tokens of whole
        documents multiplied by the query's real tokens at once and laid out only as wide as the block's longest
        document for each query token's best min(k, m) (top-p: max(⌊p·m⌋, 1)) similarities; the value
        :func:`~pyserini_aligner.alignment.alignment_scores` gives, to float rounding."""
        strategy = self.scoring.strategy
        out = torch.full(rows.shape, -torch.inf)
        kept_only = self.scoring.refine_with == "kept"
        for b in range(len(rows)):
            where = torch.nonzero(valid[b]).squeeze(1)
            tokens = q[b][q_mask[b]]  # [n, d]
            positions, owner, within, lengths = self.store.token_layout(rows[b][where].numpy(), kept_only)
            counts = torch.from_numpy(lengths)
            k_doc = (counts.clamp(max=int(strategy.k)) if strategy.kind == "top-k"
                     else torch.floor(counts.double() * strategy.p + 1e-9).clamp_min(1).long())
            num = torch.zeros(len(where), q.shape[1])  # in the query's own positions: the padded sums' order
            den = torch.zeros(len(where), q.shape[1])
            ends = np.cumsum(lengths)
            for first, last in document_blocks(lengths, PACKED_TOKENS):
                lo, hi = int(ends[first] - lengths[first]), int(ends[last - 1])
                if lo == hi:
                    continue
                sim = self.store.token_vectors(positions[lo:hi]) @ tokens.T  # [t, n]
                width = int(lengths[first:last].max())
                laid = torch.full((last - first, len(tokens), width), -torch.inf)
                laid[torch.from_numpy(owner[lo:hi] - first), :, torch.from_numpy(within[lo:hi])] = sim
                top = min(int(k_doc[first:last].max()), width)
                vals = laid.topk(top, dim=-1).values if top > 1 else laid.amax(dim=-1, keepdim=True)
                kept = torch.isfinite(vals) & (torch.arange(top) < k_doc[first:last, None, None])
                num[first:last, q_mask[b]] = torch.where(kept, vals, torch.zeros_like(vals)).sum(-1)
                den[first:last, q_mask[b]] = kept.to(num.dtype).sum(-1)
            out[b, where] = weighted_mean(num, den, q_mask[b].to(q.dtype))
        return out


def document_blocks(lengths: np.ndarray, tokens: int) -> list[tuple[int, int]]:
    """[first, last) ranges of consecutive documents of ``lengths`` tokens, each block of whole documents holding
    at most ``tokens`` tokens, or one document longer than that."""
    blocks, first, total = [], 0, 0
    for number, length in enumerate(lengths.tolist()):
        if total and total + length > tokens:
            blocks.append((first, number))
            first, total = number, 0
        total += length
    if first < len(lengths):
        blocks.append((first, len(lengths)))
    return blocks

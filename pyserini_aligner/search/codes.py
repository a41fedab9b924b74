"""A compressed index's codes on a device (:class:`CodeShard`): IVF probing with residual look-up tables, centroid
interaction and refinement decoded from the codes.

Three steps, each a function of plain tensors so that every backend and every sharding computes the same ranking:

1. :meth:`CodeShard.probe` (torch) or FAISS ``IndexIVFPQ.search`` (CPU): each kept query token q scores the entries
   of the inverted lists of its ``nprobe`` nearest centroids c as q·c + Σ_m LUT_q[m, code_m] (the residual's
   inner product from a [M, 256] table) and keeps its ``K`` best (score, document) entries.
2. :func:`.candidates.select_candidates`: per query, a document's proxy is Σ over query tokens of w · (its best entry score −
   that token's K-th score), a MaxSim estimate in which a token's missing documents get its K-th score; the best
   ``limit`` documents (ties to the lower row) are the candidates. Optionally (:meth:`CodeShard.interaction`, in the
   manner of PLAID's centroid interaction) a larger candidate set is first narrowed by MaxSim over the centroids of
   all of each document's tokens, read from query-centroid scores.
3. :meth:`CodeShard.refine`: each candidate's tokens (all, or only the kept ones) are decoded from their codes on the
   device and scored with the full alignment score (top-k:1 on a GPU over each query's candidate tokens packed
   without padding: :meth:`CodeShard.refine_packed`).

Only the codes live in memory (2 + R bytes a token, plus 4 + M bytes an inverted-list entry: M = R unless the codec
has a refinement tier); nothing is decoded ahead of time.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.alignment import (Strategy, alignment_scores_grouped, maxsim_mean, packs_maxsim,
                                        scores_from_similarity)
from pyserini_aligner.index.codec import row_norms, unit_rows
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner import kernels
from pyserini_aligner.search.allowed import AllowedRows, allowed_rows
from pyserini_aligner.search.candidates import best_entries

_MAX_ELEMENTS = 1 << 26  # bound on the largest intermediate tensor (scores, padded entries, decoded tokens)
GPU_ELEMENTS = 1 << 28  # the same bound on a GPU: larger blocks, fewer kernel launches and host round trips a batch
NORM_CACHE_BYTES = 256 << 20  # shards keep their tokens' inverse norms while the index's tokens × (4 + 2 + R) fit
PAIR_MAX_SUB = 8  # on a GPU without kernels, codes of sub-vectors this short decode two sub-quantisers at a time


def _tensor(array: np.ndarray, device: torch.device) -> Tensor:
    """A tensor of ``array`` on ``device`` (shares a CPU memmap without copying)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # memmaps are read-only; they are never written to
        tensor = torch.from_numpy(np.asarray(array))
    return tensor if device.type == "cpu" else tensor.to(device)


class CodeShard:
    """Compressed segments ``numbers`` of ``store`` resident on ``device`` (memory-mapped, not copied, on the CPU
    when there is one segment; a large index's one segment on the CPU reads its candidates' tokens from the files by
    position instead: :meth:`fetched`). Rows are the store's global document rows."""

    def __init__(self, store: StoredIndex, numbers: list[int], device: str | torch.device = "cpu",
                 refine_with: str = "all"):
        if store.codec is None:
            raise ValueError("CodeShard needs a compressed index")
        self.device = torch.device(device)
        self.elements = element_bound(self.device)
        self.dtype = torch.float32  # refinement decodes and scores in float32: near-ties rank as exhaustively
        codec = store.codec.to(self.device)
        self.centroids = codec.centroids.float()
        self.books = codec.codebooks.float()  # [M, 256, sub]: the inverted lists' codes
        self.m = self.books.shape[0]
        self.token_books = codec.token_books.float()  # [R, 256, d/R]: every token's residual code
        self.token_m = self.token_books.shape[0]
        self.pair_tables(paired_decoding(self.device, self.token_books))
        self._inverse_norms: Tensor | None = None
        tokens = sum(seg.info.num_tokens for seg in store.segments)  # the whole index's, however it is split
        self.keeps_norms = tokens * (6 + self.token_m) <= NORM_CACHE_BYTES  # see inverse_norms_at
        # a large index's one-segment shard on the CPU reads its candidates' tokens from the files by position
        # (see fetched): random reads through the maps would soon make the codes resident whole
        self._reads = store.segments[numbers[0]] if self.device.type == "cpu" and len(numbers) == 1 and \
            not self.keeps_norms else None
        self.nlist = len(self.centroids)
        self.refine_kept = refine_with == "kept"
        segs = [store.segments[i] for i in numbers]
        self.row_base = int(store.row_base[numbers[0]]) if numbers else 0
        rows = [s.info.num_docs for s in segs]
        self.num_rows = sum(rows)
        if numbers and list(numbers) != list(range(numbers[0], numbers[0] + len(numbers))):
            raise ValueError("a shard holds consecutive segments")
        cat = (lambda parts: parts[0]) if len(segs) == 1 else np.concatenate
        self.token_ids = _tensor(cat([s.centroid_ids.view(np.int16) for s in segs]), self.device)
        self.token_codes = _tensor(cat([s.residuals for s in segs]), self.device)
        if len(segs) == 1:  # one segment: its own arrays (shared on the CPU)
            self.offsets, self.lengths = _tensor(segs[0].offsets, self.device), _tensor(segs[0].lengths, self.device)
        else:
            token_base = np.concatenate([[0], np.cumsum([s.info.num_tokens for s in segs])])
            self.offsets = _tensor(np.concatenate([[0]] + [s.offsets[1:] + b for s, b in zip(segs, token_base)])
                                   .astype(np.int64), self.device)
            self.lengths = self.offsets[1:] - self.offsets[:-1]
        self.kept = _tensor(np.concatenate([s.kept for s in segs]), self.device) if self.refine_kept else None
        self.allowed = _tensor(allowed_rows(store)[self.row_base:self.row_base + self.num_rows], self.device)
        self._build_ivf(segs, np.concatenate([[0], np.cumsum(rows)]))

    def pair_tables(self, paired: bool) -> None:
        """Decode token codes through one table per sub-quantiser (256 entries) or, ``paired``, one per two of
        them (65,536 entries of both sub-vectors: half the look-ups, each twice as wide; 32 MiB at 128-d)."""
        self._paired = paired
        if paired:
            first, second = self.token_books[0::2], self.token_books[1::2]  # [R/2, 256, sub]
            pairs = torch.cat([first[:, :, None].expand(-1, -1, 256, -1), second[:, None].expand(-1, 256, -1, -1)],
                              -1)  # [R/2, 256, 256, 2·sub]
            self._flat_books = pairs.reshape(-1, pairs.shape[-1]).contiguous()
            self._book_base = torch.arange(self.token_m // 2, device=self.device, dtype=torch.int32) * 65536
        else:
            self._flat_books = self.token_books.reshape(self.token_m * 256, -1)
            self._book_base = torch.arange(self.token_m, device=self.device, dtype=torch.int32) * 256

    def _build_ivf(self, segs, doc_base: np.ndarray) -> None:
        """One set of inverted lists over the shard's segments (entries of a list in segment order)."""
        if len(segs) == 1:
            s = segs[0]
            self.ivf_offsets = _tensor(s.ivf_offsets, self.device)
            self.ivf_docs = _tensor(s.ivf_docs, self.device)
            self.ivf_codes = _tensor(s.ivf_codes, self.device)
        else:
            lists = torch.cat([torch.repeat_interleave(torch.arange(self.nlist), torch.from_numpy(np.diff(s.ivf_offsets)))
                               for s in segs]) if segs else torch.zeros(0, dtype=torch.long)
            order = torch.sort(lists, stable=True).indices
            docs = np.concatenate([np.asarray(s.ivf_docs) + b for s, b in zip(segs, doc_base)]) if segs else \
                np.zeros(0, np.int32)
            codes = np.concatenate([s.ivf_codes for s in segs]) if segs else np.zeros((0, self.m), np.uint8)
            self.ivf_docs = torch.from_numpy(docs.astype(np.int32))[order].to(self.device)
            self.ivf_codes = torch.from_numpy(codes)[order].to(self.device)
            counts = torch.bincount(lists, minlength=self.nlist)
            self.ivf_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(self.device)
        self.ivf_lengths = self.ivf_offsets[1:] - self.ivf_offsets[:-1]

    @property
    def num_entries(self) -> int:
        return len(self.ivf_docs)

    def to(self, device: str | torch.device) -> "CodeShard":
        """A copy of this shard on ``device``: its tensors copied there (device to device, without reading the
        segments again), its decoding tables made for that device."""
        copy = object.__new__(CodeShard)
        copy.__dict__.update({name: value.to(device) if isinstance(value, Tensor) else value
                              for name, value in vars(self).items()})
        copy.device = torch.device(device)
        copy._reads = self._reads if copy.device.type == "cpu" else None  # on a GPU the codes are resident
        copy.elements = element_bound(copy.device)
        copy.pair_tables(paired_decoding(copy.device, copy.token_books))
        return copy

    # ------------------------------------------------------------------ step 1
    def probe(self, probes: Tensor, k_per_token: int, nprobe: int,
              allowed: AllowedRows | None = None) -> tuple[Tensor, Tensor]:
        """(scores [R, K] float32, global rows [R, K] int64) of each probe's K best entries of allowed rows
        (:func:`.allowed.allowed_rows`, or ``allowed`` when given: a filtered search's) in its ``nprobe`` nearest
        lists, best first; −inf / −1 where fewer exist. probes [R, d]."""
        mask = self.allowed if allowed is None else \
            allowed.on(self.device)[self.row_base:self.row_base + self.num_rows]
        probes = probes.to(self.device, torch.float32)
        nprobe = min(nprobe, self.nlist)
        width = max(1, k_per_token)
        out_scores = torch.full((len(probes), width), -torch.inf, device=self.device)
        out_rows = torch.full((len(probes), width), -1, dtype=torch.long, device=self.device)
        if not len(probes) or not self.num_entries:
            return out_scores, out_rows
        step = max(1, self.elements // max(self.nlist, 1))
        cells = [(probes[a:a + step] @ self.centroids.T).topk(nprobe, dim=1) for a in range(0, len(probes), step)]
        cval, cidx = torch.cat([c.values for c in cells]), torch.cat([c.indices for c in cells])
        entries = self.ivf_lengths[cidx].sum(1).cpu().numpy()  # entries per probe
        for part, span in probe_parts(entries, max(self.elements // 4, int(entries.max()))):
            if not isinstance(part, slice):
                part = torch.from_numpy(part).to(self.device)
            scores, docs = self._probe_entries(probes[part], cval[part], cidx[part], span, mask)
            out_scores[part], rows = best_entries(scores, docs, width)
            out_rows[part] = torch.where(rows >= 0, rows + self.row_base, rows)
        return out_scores, out_rows

    def _probe_entries(self, probes: Tensor, cval: Tensor, cidx: Tensor, span: int,
                       allowed: Tensor) -> tuple[Tensor, Tensor]:
        """(scores [r, span] float32, shard-local docs [r, span]) of every entry of each probe's lists, packed list
        after list (:func:`pyserini_aligner.kernels.probe_entries`; −inf past a probe's entries and for rows
        not ``allowed`` [rows of the shard], bool). probes [r, d], cval / cidx [r, P]: the probed lists' centroid
        scores and ids; span: the most entries a probe has."""
        r, nprobe = cidx.shape
        lut = torch.einsum("rms,mks->rmk", probes.view(r, self.m, -1), self.books).reshape(r, -1)  # [r, M·256]
        if kernels.available(self.device):
            return kernels.probe_entries(lut, cval, cidx, self.ivf_offsets, self.ivf_codes, self.ivf_docs, allowed,
                                         torch.ones(r, dtype=torch.bool, device=self.device), span)
        scores = torch.full((r, span), -torch.inf, device=self.device)
        docs = torch.zeros((r, span), dtype=torch.long, device=self.device)
        counts = self.ivf_lengths[cidx].reshape(-1)  # [r·P]
        total = int(counts.sum())
        if total == 0:
            return scores, docs
        cell = torch.repeat_interleave(torch.arange(r * nprobe, device=self.device), counts, output_size=total)
        first = torch.cumsum(counts, 0) - counts
        within = torch.arange(total, device=self.device) - first[cell]
        pos = self.ivf_offsets[cidx.reshape(-1)][cell] + within
        owner = torch.div(cell, nprobe, rounding_mode="floor")
        codes = self.ivf_codes.index_select(0, pos)  # [E, M]
        base = owner * (self.m * 256)
        residual = lut.reshape(-1)[base + codes[:, 0].long()]
        for m in range(1, self.m):
            residual = residual + lut.reshape(-1)[base + (m * 256 + codes[:, m].long())]
        score = cval.reshape(-1).index_select(0, cell) + residual
        doc = self.ivf_docs.index_select(0, pos).long()
        at = torch.arange(total, device=self.device) - first[owner * nprobe]  # packed position within the probe
        scores[owner, at] = torch.where(allowed[doc], score, torch.full_like(score, -torch.inf))
        docs[owner, at] = doc
        return scores, docs

    def documents(self, rows: Tensor, residuals: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """What another device needs to score documents this shard holds: (token counts [N], centroid ids [T],
        residual codes [T, R] or None, kept flags [T] or None) of global ``rows`` [N], their tokens in row order;
        codes and flags only with ``residuals`` (refinement reads them, centroid interaction does not)."""
        local = rows.to(self.device) - self.row_base
        if self._reads is not None:
            lengths, ids, codes = self._reads.read_tokens(local.numpy(), residuals)
            lengths, ids = torch.from_numpy(lengths), torch.from_numpy(ids).view(torch.int16)
            kept = None
            if residuals and self.kept is not None:
                start = self.offsets[local] - (torch.cumsum(lengths, 0) - lengths)
                kept = self.kept[torch.repeat_interleave(start, lengths) + torch.arange(len(ids))]
            return lengths, ids, None if codes is None else torch.from_numpy(codes), kept
        lengths = self.lengths[local]
        total = int(lengths.sum()) if len(lengths) else 0
        start = self.offsets[local] - (torch.cumsum(lengths, 0) - lengths)  # token position minus output position
        pos = torch.repeat_interleave(start, lengths, output_size=total) + torch.arange(total, device=self.device)
        codes = self.token_codes[pos] if residuals else None
        kept = self.kept[pos] if residuals and self.kept is not None else None
        return lengths, self.token_ids[pos], codes, kept

    def holding(self, lengths: Tensor, token_ids: Tensor, token_codes: Tensor | None,
                kept: Tensor | None) -> "CodeShard":
        """A shard of this codec that holds only the given documents, as rows 0 .. N−1 (``lengths`` [N] tokens each,
        their ``token_ids`` [T], ``token_codes`` [T, R] and ``kept`` [T] in row order, as :meth:`documents` returns
        them): candidates fetched from the shards that hold them, to score by centroid interaction (no codes
        needed) or refinement. It is not probed (its inverted lists are not its documents')."""
        shard = object.__new__(CodeShard)
        shard.__dict__.update(vars(self))
        shard.row_base, shard.num_rows = 0, len(lengths)
        shard.lengths = lengths.to(self.device)
        shard.offsets = torch.cat([shard.lengths.new_zeros(1), torch.cumsum(shard.lengths, 0)])
        shard.token_ids = token_ids.to(self.device)
        shard.token_codes = self.token_codes[:0] if token_codes is None else token_codes.to(self.device)
        shard.kept = None if kept is None else kept.to(self.device)
        shard._inverse_norms = None  # its own tokens'
        shard._reads = None  # they are in memory
        return shard

    def fetched(self, rows: Tensor, valid: Tensor, residuals: bool) -> tuple["CodeShard", Tensor, Tensor]:
        """(a shard holding only the candidates, their rows there [B, C], held [B, C]) for candidate global ``rows``
        [B, C] where ``valid``: each candidate this shard holds read once (:meth:`documents`, by position from the
        files when the shard reads them), the others marked not held. Scores there are the scores here: a document's
        tokens are the same, in the same order."""
        local, mine, _ = self._held(rows, valid)
        wanted, at = torch.unique(local[mine], return_inverse=True)
        shard = self.holding(*self.documents(wanted + self.row_base, residuals))
        return shard, torch.zeros_like(local).masked_scatter(mine, at), mine

    def _held(self, rows: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(shard-local rows, held mask, token counts) of candidate global ``rows`` [B, C] (0 where not held)."""
        local = rows - self.row_base
        mine = valid & (local >= 0) & (local < self.num_rows)
        local = torch.where(mine, local, torch.zeros_like(local))
        return local, mine, torch.where(mine, self.lengths[local], torch.zeros_like(local))

    # ------------------------------------------------------------------ step 2b
    def interaction(self, q: Tensor, q_mask: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
        """Centroid-interaction scores [B, C] of the candidate global ``rows`` [B, C] this shard holds (−inf for the
        others): MaxSim with every token of a document replaced by its centroid, Σ_i max_j q_i·c(d_j) / n, read from
        the query-centroid scores without decoding anything. q [B, n, d], q_mask [B, n]."""
        q, q_mask = q.to(self.device, torch.float32), q_mask.to(self.device)
        if self._reads is not None:
            shard, at, held = self.fetched(rows, valid, residuals=False)
            return shard.interaction(q, q_mask, at, held)
        local, mine, lengths = self._held(rows.to(self.device), valid.to(self.device))
        if kernels.available(self.device):
            return self._interaction_kernel(q, q_mask, local, mine)
        out = torch.full(rows.shape, -torch.inf, device=self.device)
        half = torch.float16 if self.device.type == "cuda" else torch.float32
        budget = self.elements
        real = q_mask.sum(1)
        tokens = lengths.sum(1)
        for part, n in query_chunks(real, tokens, self.nlist, budget):
            count = rows.shape[1]
            table = torch.einsum("bnd,cd->bcn", q[part, :n], self.centroids).to(half)  # [b, nlist, n]
            flat = lengths[part].reshape(-1)
            total = int(flat.sum())
            if total == 0:
                continue
            doc = torch.repeat_interleave(torch.arange(len(flat), device=self.device), flat, output_size=total)
            first = torch.cumsum(flat, 0) - flat
            pos = self.offsets[local[part].reshape(-1)][doc] + torch.arange(total, device=self.device) - first[doc]
            cid = self.token_ids[pos].long() & 0xFFFF
            row = torch.div(doc, count, rounding_mode="floor") * self.nlist + cid
            values = table.reshape(-1, n).index_select(0, row)  # [T, n]
            best = torch.full((len(flat), n), -torch.inf, dtype=values.dtype, device=self.device).scatter_reduce_(
                0, doc.unsqueeze(1).expand(-1, n), values, "amax").float()  # [b·C, n]: each document's maximum
            mask = q_mask[part, :n].repeat_interleave(count, dim=0)
            score = torch.where(mask, best, torch.zeros((), device=self.device)).sum(1) / \
                real[part].clamp_min(1).repeat_interleave(count).float()
            out[part] = torch.where(mine[part], score.view(-1, count), out[part])
        return out

    def query_table(self, q: Tensor) -> Tensor:
        """Query-centroid scores [B, nlist, NPAD] (float16 on CUDA), lanes past q's n tokens zero. q [B, n, d]."""
        npad = kernels.pad_width(q.shape[1])
        half = torch.float16 if self.device.type == "cuda" else torch.float32
        table = torch.zeros(q.shape[0], self.nlist, npad, dtype=half, device=self.device)
        table[:, :, :q.shape[1]] = torch.einsum("bnd,cd->bcn", q, self.centroids)
        return table

    def _interaction_kernel(self, q: Tensor, q_mask: Tensor, local: Tensor, mine: Tensor) -> Tensor:
        """:meth:`interaction` through :func:`.kernels.interaction`. A shard of a split index holds a share of the
        candidates: they are gathered to the front of each query's list first, so that the kernel's blocks of
        documents hold only them (a document's score does not depend on its place)."""
        held = int(mine.sum(1).max()) if mine.numel() else 0
        if 0 < held <= mine.shape[1] // 2:
            order = held_first(mine, held)
            scores = self._interaction_blocks(q, q_mask, local.gather(1, order), mine.gather(1, order))
            return torch.full(local.shape, -torch.inf, device=self.device).scatter(1, order, scores)
        return self._interaction_blocks(q, q_mask, local, mine)

    def _interaction_blocks(self, q: Tensor, q_mask: Tensor, local: Tensor, mine: Tensor) -> Tensor:
        """:func:`.kernels.interaction` of candidates ``local`` [B, C] where ``mine``, a few queries' tables at a
        time."""
        out = torch.empty(local.shape, device=self.device)
        npad = kernels.pad_width(q.shape[1])
        mask = torch.zeros(q.shape[0], npad, dtype=torch.bool, device=self.device)
        mask[:, :q.shape[1]] = q_mask
        step = max(1, self.elements // (self.nlist * npad))
        for a in range(0, len(q), step):
            out[a:a + step] = kernels.interaction(self.query_table(q[a:a + step]), local[a:a + step],
                                                  mine[a:a + step], self.offsets, self.token_ids, mask[a:a + step])
        return out

    # ------------------------------------------------------------------ step 3
    def refine(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor,
               strategy: Strategy, width: int | None = None) -> Tensor:
        """Alignment scores [B, C] of each query's candidate global ``rows`` [B, C] that this shard holds (−inf for
        the others and where not ``valid``). q [B, n, d], q_mask [B, n]. width: documents are padded to this many
        tokens (default: the longest candidate here); a width common to every shard makes the arithmetic, and so
        the scores to the last bit, independent of how the index is split into segments and shards."""
        q, q_mask = q.to(self.device), q_mask.to(self.device)
        if self._reads is not None:
            shard, at, held = self.fetched(rows, valid, residuals=True)
            return shard.refine(q, q_mask, q_sal, at, held, strategy, width)
        local, mine, lengths = self._held(rows.to(self.device), valid.to(self.device))
        out = torch.full(rows.shape, -torch.inf, device=self.device)
        if not mine.numel():
            return out
        held, longest = torch.stack([mine.any().long(), lengths.max().long()]).tolist()  # one copy to the host
        if not held:
            return out
        if self.device.type == "cuda" and packs_maxsim(strategy):
            return self.refine_packed(q, q_mask, q_sal, local, mine, lengths, out)
        width = max(longest, 1) if width is None else width
        span = torch.arange(width, device=self.device)
        budget = self.elements if self.device.type == "cuda" else 1 << 22  # small blocks stay in a CPU's cache
        padded = torch.full_like(lengths[:, 0], rows.shape[1] * width)  # padded candidate tokens per query
        for part, n in query_chunks(q_mask.sum(1), padded, 0, budget, padded * self.centroids.shape[1]):
            positions = (self.offsets[local[part]].unsqueeze(-1) + span).clamp_max(max(len(self.token_ids) - 1, 0))
            mask = span < lengths[part].unsqueeze(-1)
            if self.kept is not None:
                mask &= self.kept[positions]
            sal = None if q_sal is None else q_sal[part, :n]
            if self.device.type == "cpu":
                scores = scores_from_similarity(self.similarity(q[part, :n], positions, mask), q_mask[part, :n], mask,
                                                strategy, sal)
            else:
                scores = alignment_scores_grouped(q[part, :n].to(self.dtype), q_mask[part, :n],
                                                  self.decode(positions, mask), mask, strategy, sal, None)
            out[part] = torch.where(mine[part], scores.float(), out[part])
        return out

    def refine_packed(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, local: Tensor, mine: Tensor,
                      lengths: Tensor, out: Tensor) -> Tensor:
        """Top-k:1 (MaxSim) refinement of the held candidates (shard-local rows ``local`` [B, C] where ``mine``,
        ``lengths`` [B, C] tokens each) with each query's candidate tokens packed one after another instead of
        padded to the longest document: decoding and products over the tokens that exist (documents average far
        fewer tokens than the longest). Each token's similarity with each query token is the padded path's; a
        document's maximum over its tokens and the weighted mean over query tokens (:func:`..alignment.maxsim_mean`)
        are taken in the same order, so the scores are those of :func:`..alignment.alignment_scores_grouped`.
        Scores go into ``out`` [B, C] where held (−inf elsewhere)."""
        count = local.shape[1]
        dim = self.centroids.shape[1]
        per_query = lengths.sum(1)
        budget = self.elements
        for part, n in query_chunks(q_mask.sum(1), per_query, 0, budget, per_query * dim):
            flat = lengths[part].reshape(-1)  # [b·C] tokens of each candidate slot
            host = torch.stack([flat.sum(), per_query[part].max()]).tolist()  # one copy to the host
            total, width = int(host[0]), max(int(host[1]), 1)
            if total == 0:
                continue
            b = len(part)
            slot = torch.repeat_interleave(torch.arange(b * count, device=self.device), flat, output_size=total)
            first = torch.cumsum(flat, 0) - flat  # each slot's first token among all tokens of the chunk
            owner = torch.div(slot, count, rounding_mode="floor")
            query_first = first.view(b, count)[:, 0]  # each query's first token
            within = torch.arange(total, device=self.device) - first[slot]  # token's place in its document
            place = first[slot] + within - query_first[owner]  # token's place in its query's packed row
            positions = torch.zeros(b, width, dtype=torch.long, device=self.device)
            positions[owner, place] = self.offsets[local[part].reshape(-1)][slot] + within
            mask = torch.zeros(b, width, dtype=torch.bool, device=self.device)
            mask[owner, place] = True if self.kept is None else self.kept[positions[owner, place]]
            qm = q_mask[part, :n]
            qp = torch.where(qm.unsqueeze(-1), q[part, :n].to(self.dtype), torch.zeros((), device=self.device))
            sim = torch.einsum("bnh,bth->btn", qp, self.decode(positions, mask))  # [b, width, n]
            sim = sim.masked_fill_(~mask.unsqueeze(-1), -torch.inf)
            best = torch.full((b * count, n), -torch.inf, device=self.device).scatter_reduce_(
                0, slot.unsqueeze(1).expand(-1, n), sim[owner, place], "amax").view(b, count, n)
            weights = qm.to(self.dtype) if q_sal is None else \
                torch.where(qm, q_sal[part, :n].to(self.device, self.dtype), torch.zeros((), device=self.device))
            scores = maxsim_mean(best, weights.unsqueeze(1))
            out[part] = torch.where(mine[part], scores.float(), out[part])
        return out

    def similarity(self, q: Tensor, positions: Tensor, mask: Tensor | None = None) -> Tensor:
        """q·d [B, C, n, L] (float32) of queries q [B, n, d] with the tokens at shard ``positions`` [B, C, L], read
        from their codes without decoding: q·c from a query-centroid table plus Σ_m q_m·r_m from per-sub-quantiser
        look-up tables (asymmetric distance computation; the CPU's refinement, a few times cheaper than decoding
        and multiplying), times the token's inverse norm (:meth:`inverse_norms_at`): q·d of the unit-length decoded
        token. mask [B, C, L] or None: the tokens scored (the others' values are undefined)."""
        b, n = q.shape[:2]
        q = q.float()
        m = self.token_m
        rows = torch.empty(b * (self.nlist + m * 256), n, device=self.device)  # every query's tables, stacked
        centroid_rows = rows[:b * self.nlist].view(b, self.nlist, n)
        torch.matmul(self.centroids, q.transpose(1, 2), out=centroid_rows)  # q·c
        rows[b * self.nlist:] = torch.einsum("bnms,mks->bmkn", q.view(b, n, m, -1), self.token_books).reshape(-1, n)
        owner = torch.arange(b, dtype=torch.int32, device=self.device).view(b, 1, 1)
        # one row per token: its centroid's row plus its R look-up-table rows, summed in that order (int32 indices:
        # half the bytes of int64 to write and read)
        index = torch.empty(*positions.shape, 1 + m, dtype=torch.int32, device=self.device)
        index[..., 0] = (self.token_ids[positions].int() & 0xFFFF) + owner * self.nlist
        index[..., 1:] = self.token_codes[positions]
        index[..., 1:] += (b * self.nlist + owner * (m * 256)).unsqueeze(-1) + \
            torch.arange(m, dtype=torch.int32, device=self.device) * 256
        sim = torch.nn.functional.embedding_bag(index.view(-1, 1 + m), rows, mode="sum")
        sim = sim.view(*positions.shape, n) * self.inverse_norms_at(positions, mask).unsqueeze(-1)  # [b, C, L, n]
        return sim.transpose(-1, -2)

    def decode(self, positions: Tensor, mask: Tensor | None = None) -> Tensor:
        """Decoded token vectors [..., d] (float32) at shard token ``positions`` [...]; with ``mask`` [...], only
        where it is True (zeros elsewhere: padding is not decoded)."""
        if kernels.available(self.device):
            keep = torch.ones_like(positions, dtype=torch.bool) if mask is None else mask
            return kernels.decode_tokens(positions.reshape(-1), keep.reshape(-1), self.token_ids, self.token_codes,
                                         self.centroids, self.token_books).view(*positions.shape, -1)
        if mask is not None:
            out = torch.zeros(*positions.shape, self.centroids.shape[1], dtype=self.dtype, device=self.device)
            out[mask] = self.decode(positions[mask])
            return out
        return unit_rows(self._sums(positions)).to(self.dtype)

    def _sums(self, positions: Tensor) -> Tensor:
        """Centroid + residual [..., d] (float32, before scaling to unit length) of the tokens at ``positions``."""
        ids = self.token_ids[positions].int() & 0xFFFF
        codes = self.token_codes[positions].int()
        if self._paired:
            codes = codes[..., 0::2] * 256 + codes[..., 1::2]
        residual = torch.nn.functional.embedding(codes + self._book_base, self._flat_books)  # [..., R or R/2, ·]
        return torch.nn.functional.embedding(ids, self.centroids) + residual.flatten(-2)

    def inverse_norms_at(self, positions: Tensor, mask: Tensor | None = None) -> Tensor:
        """float32 [...]: 1 / |centroid + residual| of the tokens at shard ``positions`` [...] (only where ``mask``
        [...] is True, zero elsewhere, when given): read from :meth:`inverse_norms` when the index is small enough
        for its shards to keep them (``keeps_norms``: every token's 4 bytes, and 2 + R read once, within
        ``NORM_CACHE_BYTES``), else computed for these tokens alone (the same values: a token's norm is its own row's
        float64 sum), so that a large index keeps neither 4 bytes a token in memory nor every token's codes paged in."""
        if self.keeps_norms or self._inverse_norms is not None:
            return self.inverse_norms()[positions]
        if mask is None:
            return 1.0 / row_norms(self._sums(positions)).clamp_min(1e-12)
        out = torch.zeros(positions.shape, device=self.device)
        out[mask] = 1.0 / row_norms(self._sums(positions[mask])).clamp_min(1e-12)
        return out

    def inverse_norms(self) -> Tensor:
        """float32 [tokens]: 1 / |centroid + residual| of every token of the shard, computed once (decoding scales
        a token to unit length; the look-up tables of :meth:`similarity` score the unscaled sum)."""
        if self._inverse_norms is None:
            out = torch.empty(len(self.token_ids), device=self.device)
            step = max(1, (1 << 22) // self.centroids.shape[1])
            for a in range(0, len(out), step):
                sums = self._sums(torch.arange(a, min(a + step, len(out)), device=self.device))
                out[a:a + len(sums)] = 1.0 / row_norms(sums).clamp_min(1e-12)
            self._inverse_norms = out
        return self._inverse_norms


def probe_parts(entries: np.ndarray, budget: int):
    """Parts of the probes (a slice of all of them, or index arrays) with their span, the most entries a probe of the
    part has, so that each part's entries padded to its span are at most ``budget`` elements (at least one probe).
    Probes with the most entries go first and together: lists vary in length by orders of magnitude, so a part of
    like probes wastes little on padding and a batch takes few parts. entries [R]: entries of each probe's lists."""
    if not len(entries):
        return
    most = int(entries.max())
    if len(entries) * most <= budget:
        yield slice(0, len(entries)), most
        return
    order = np.argsort(-entries, kind="stable")
    start = 0
    while start < len(order):
        span = int(entries[order[start]])
        stop = min(len(order), start + max(1, budget // max(span, 1)))
        yield order[start:stop], span
        start = stop


def paired_decoding(device: torch.device, token_books: Tensor) -> bool:
    """Whether torch operations decode tokens two sub-quantisers at a time on ``device`` (a GPU without the decoding
    kernel, sub-vectors of at most PAIR_MAX_SUB dimensions, an even count of them). token_books [R, 256, d/R]."""
    return (device.type == "cuda" and not kernels.available(device) and token_books.shape[0] % 2 == 0
            and token_books.shape[2] <= PAIR_MAX_SUB)


def held_first(mine: Tensor, count: int) -> Tensor:
    """Column indices [B, count] of each row of ``mine`` [B, C] (bool) with its True columns first, in order."""
    return torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices[:, :count]


def element_bound(device: torch.device) -> int:
    """Elements of the largest intermediate tensor a search step makes at once on ``device``."""
    return GPU_ELEMENTS if device.type == "cuda" else _MAX_ELEMENTS


def query_chunks(real: Tensor, tokens: Tensor, table_width: int, budget: int, extra: Tensor | None = None):
    """Chunks of queries (index tensors, longest queries first) with their width n (longest real query length in the
    chunk). A query costs n × (tokens + table_width) + extra elements; a chunk holds at most ``budget`` (at least one
    query). real [B]: real query tokens; tokens [B]: candidate tokens per query; extra [B] or None."""
    order = torch.argsort(real, descending=True, stable=True)
    columns = [real, tokens] + ([extra] if extra is not None else [])
    host = torch.stack([column[order].long() for column in columns]).cpu().tolist()  # one copy to the host
    real_host, tokens_host = host[0], host[1]
    extra_host = host[2] if extra is not None else [0] * len(real_host)
    start = 0
    while start < len(order):
        n = max(int(real_host[start]), 1)
        size, stop = 0, start
        while stop < len(order):
            cost = n * (tokens_host[stop] + table_width) + extra_host[stop]
            if stop > start and size + cost > budget:
                break
            size += cost
            stop += 1
        yield order[start:stop], n
        start = stop

"""CUDA graphs: the query encoder's forward pass (:class:`GraphedQueryEncoder`) and the search of a small batch with
fixed tensor shapes (:class:`StaticPlan`, replayed by :class:`GraphedSearch`): the rule of :mod:`.candidates` without
host synchronisation.

The step-by-step search (:mod:`.codes`) sizes its tensors from the data (entries in the probed lists, candidates
found, tokens of the candidates), which costs a host round trip per step; for one query or a few that overhead, not
the arithmetic, sets the latency. :class:`StaticPlan` computes the same ranking with shapes fixed by the index (the
longest inverted lists; the longest document, where top-k:1 refinement cannot walk each candidate's own tokens in
one kernel), by the batch bucket and by the queries' padded width, so that
:class:`GraphedSearch` can capture it in a CUDA graph and replay query encoding plus search as two launches. The plan
also runs eagerly on any device (that is how it is tested against the step-by-step search on the CPU).
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict

import numpy as np

import torch
from torch import Tensor

from pyserini_aligner.alignment import Strategy, alignment_scores_grouped, packs_maxsim
from pyserini_aligner.salience import keep_count
from pyserini_aligner import kernels
from pyserini_aligner.search.candidates import ascending, descending_key, fixed_candidates
from pyserini_aligner.search.codes import CodeShard
from pyserini_aligner.search.options import Depth

_BLOCK = 1 << 24  # elements of the largest padded intermediate (entries, centroid look-ups) built at once


class StaticPlan:
    """The search of a batch of ``batch`` queries of at most ``width`` tokens against ``shard`` (which holds the
    whole index), with the depth (K entries per probe, nprobe, W candidates narrowed by centroid interaction or 0, C
    refined) and k fixed. :meth:`run` allocates the same tensors on every call and never reads a value back to the
    host. ``allowed``: bool [shard rows], the rows the probes may take (default the shard's live rows), read at each
    run (a graph's buffer that a filtered search fills)."""

    def __init__(self, shard: CodeShard, batch: int, width: int, depth: Depth, k: int, query_prune: float,
                 strategy: Strategy, use_salience: bool, allowed: Tensor | None = None):
        self.shard, self.batch, self.width, self.k, self.strategy = shard, batch, width, k, strategy
        self.allowed = shard.allowed if allowed is None else allowed
        self.query_prune, self.use_salience = query_prune, use_salience
        self.probes = keep_count(width, query_prune)  # most probes a query of ``width`` tokens keeps
        self.nprobe = min(depth.nprobe, shard.nlist)
        self.cap = max(int(shard.ivf_lengths.max()) if shard.nlist else 1, 1)  # longest inverted list
        # the most entries a probe's lists hold: the nprobe longest lists together
        self.span = max(int(shard.ivf_lengths.topk(self.nprobe).values.sum()) if shard.nlist else 1, 1)
        self.per_token = max(1, min(depth.per_probe, self.span))
        self.entries = self.probes * self.per_token
        self.wide, self.limit = min(depth.interaction, self.entries), min(depth.refined, self.entries)
        self.tokens = max(int(shard.lengths.max()) if shard.num_rows else 1, 1)  # longest document
        self.sentinel = shard.row_base + shard.num_rows  # a row past every row the shard holds

    def workspace_bytes(self) -> int:
        """About the most device memory a run holds at once: the probes' packed entries with their sort keys, and
        the candidate rule's sorts over every probe's K entries (the later steps go a few queries at a time)."""
        probes = self.batch * self.probes
        return probes * (self.span * 24 + self.per_token * 64)

    # ------------------------------------------------------------------ steps
    def _select_probes(self, q_mask: Tensor, q_sal: Tensor) -> tuple[Tensor, Tensor]:
        """(token positions [B, R] in ascending order, valid [B, R]): each query's ceil(β^q·n) most salient real
        tokens, as :func:`pyserini_aligner.salience.prune_mask` keeps them (none for a query of no real token).
        q_mask, q_sal [B, n]."""
        keyed = q_sal.float().masked_fill(~q_mask, -math.inf)
        order = keyed.sort(dim=1, descending=True, stable=True).indices[:, :self.probes]
        real = q_mask.sum(1, keepdim=True).double()
        count = torch.minimum(torch.ceil(real * self.query_prune - 1e-9).clamp_min(1), real)
        valid = torch.arange(self.probes, device=q_mask.device) < count
        positions = torch.where(valid, order, torch.full_like(order, self.width)).sort(dim=1).values
        return positions.clamp_max(self.width - 1), valid

    def _probe(self, probes: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """(scores [R, K], global rows [R, K]) of each probe's K best live entries, best first (−inf / −1 past
        the entries found), ties in list order: :meth:`CodeShard.probe`'s result. probes [R, d] float32."""
        shard, r = self.shard, len(probes)
        cval, cidx = (probes @ shard.centroids.T).topk(self.nprobe, dim=1)
        lut = torch.einsum("rms,mks->rmk", probes.view(r, shard.m, -1), shard.books).reshape(r, -1)
        if kernels.available(probes.device):
            # the probe's entries packed list after list, in as many places as the nprobe longest lists hold
            score, docs = kernels.probe_entries(lut, cval, cidx, shard.ivf_offsets, shard.ivf_codes, shard.ivf_docs,
                                                self.allowed, valid, self.span)
        else:
            score, docs = self._probe_torch(lut, cval, cidx, valid)
        flat = score.reshape(r, -1)
        # the K smallest of (descending score, position) keys: best first, ties in list order, as a stable sort
        key = (descending_key(flat) << 31) | torch.arange(flat.shape[1], device=flat.device)
        at = key.topk(self.per_token, dim=1, largest=False).values & ((1 << 31) - 1)
        values = flat.gather(1, at)
        rows = docs.reshape(r, -1).gather(1, at).long() + shard.row_base
        return values, torch.where(torch.isfinite(values), rows, torch.full_like(rows, -1))

    def _probe_torch(self, lut: Tensor, cval: Tensor, cidx: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """The scores of :func:`pyserini_aligner.kernels.probe_entries` in torch operations, a few probes at a time,
        in ``cap`` places a list ([R, P, cap]: the same order of entries, −inf in between)."""
        shard, r = self.shard, len(cidx)
        span = torch.arange(self.cap, device=cidx.device)
        score = torch.empty(r, self.nprobe, self.cap, device=cidx.device)
        docs = torch.empty(r, self.nprobe, self.cap, dtype=torch.long, device=cidx.device)
        step = max(1, _BLOCK // max(self.nprobe * self.cap * shard.m, 1))
        book = torch.arange(shard.m, device=cidx.device) * 256
        for a in range(0, r, step):
            part = slice(a, a + step)
            lengths = shard.ivf_lengths[cidx[part]].unsqueeze(-1)
            pos = (shard.ivf_offsets[cidx[part]].unsqueeze(-1) + span).clamp_max(max(shard.num_entries - 1, 0))
            codes = shard.ivf_codes[pos].long() + book  # [p, P, cap, M]
            looked = lut[part].gather(1, codes.reshape(len(codes), -1)).view(codes.shape)
            residual = looked[..., 0]
            for m in range(1, shard.m):  # CodeShard.probe's order of additions
                residual = residual + looked[..., m]
            entry = shard.ivf_docs[pos].long()
            ok = (span < lengths) & self.allowed[entry] & valid[part].view(-1, 1, 1)
            score[part] = torch.where(ok, cval[part].unsqueeze(-1) + residual, torch.full_like(residual, -math.inf))
            docs[part] = entry
        return score, docs

    def _interaction(self, q: Tensor, q_mask: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
        """Centroid-interaction scores [B, W] of candidate ``rows`` [B, W] (−inf where not valid), as
        :meth:`CodeShard.interaction`, a few queries at a time. q [B, n, d] float32, q_mask [B, n]."""
        shard = self.shard
        out = torch.empty(rows.shape, device=q.device)
        if kernels.available(q.device):
            local = torch.where(valid, rows - shard.row_base, torch.zeros_like(rows))
            mask = torch.nn.functional.pad(q_mask, (0, kernels.pad_width(self.width) - self.width))
            step = max(1, shard.elements // (shard.nlist * kernels.pad_width(self.width)))
            for a in range(0, len(q), step):
                part = slice(a, a + step)
                out[part] = kernels.interaction(shard.query_table(q[part]), local[part], valid[part], shard.offsets,
                                                shard.token_ids, mask[part])
            return out
        for b in range(len(q)):
            out[b] = self._interaction_one(q[b], q_mask[b], rows[b], valid[b])
        return out

    def _interaction_one(self, q: Tensor, q_mask: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
        """:meth:`_interaction` of one query (q [n, d], rows [W]) in torch operations."""
        shard = self.shard
        half = torch.float16 if q.device.type == "cuda" else torch.float32
        table = (q @ shard.centroids.T).T.contiguous().to(half)  # [nlist, n]
        span = torch.arange(self.tokens, device=q.device)
        real = q_mask.sum().clamp_min(1).float()
        out = torch.empty(len(rows), device=q.device)
        step = max(1, _BLOCK // (self.tokens * self.width))
        for a in range(0, len(rows), step):
            part = slice(a, a + step)
            local = torch.where(valid[part], rows[part] - shard.row_base, torch.zeros_like(rows[part]))
            pos = (shard.offsets[local].unsqueeze(-1) + span).clamp_max(max(len(shard.token_ids) - 1, 0))
            ok = span < shard.lengths[local].unsqueeze(-1)
            cid = shard.token_ids[pos].long() & 0xFFFF
            values = torch.where(ok.unsqueeze(-1), table[cid], torch.full((), -math.inf, dtype=half,
                                                                           device=q.device))
            best = values.amax(dim=1).float()  # [w, n]
            score = torch.where(q_mask, best, torch.zeros((), device=q.device)).sum(1) / real
            out[part] = torch.where(valid[part], score, torch.full_like(score, -math.inf))
        return out

    def _refine(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor) -> Tensor:
        """Alignment scores [B, C] of candidate ``rows`` [B, C] decoded from their codes (−inf where not valid):
        top-k:1 through :func:`pyserini_aligner.kernels.refine_maxsim` where the kernels run (each candidate's own
        tokens, decoded and scored in one launch), else every candidate padded to the longest document, a few
        queries at a time. q [B, n, d] float32, q_mask [B, n], q_sal [B, n] or None."""
        shard = self.shard
        local = torch.where(valid, rows - shard.row_base, torch.zeros_like(rows))
        if kernels.available(q.device) and packs_maxsim(self.strategy):
            return kernels.refine_maxsim(q.to(shard.dtype), q_mask, q_sal, local, valid, shard.offsets, shard.kept,
                                         shard.token_ids, shard.token_codes, shard.centroids, shard.token_books)
        span = torch.arange(self.tokens, device=q.device)
        out = torch.empty(rows.shape, device=q.device)
        step = max(1, shard.elements // max(rows.shape[1] * self.tokens * q.shape[2], 1))
        for a in range(0, len(q), step):
            part = slice(a, a + step)
            pos = (shard.offsets[local[part]].unsqueeze(-1) + span).clamp_max(max(len(shard.token_ids) - 1, 0))
            mask = (span < shard.lengths[local[part]].unsqueeze(-1)) & valid[part].unsqueeze(-1)
            if shard.kept is not None:
                mask &= shard.kept[pos]
            scores = alignment_scores_grouped(q[part].to(shard.dtype), q_mask[part], shard.decode(pos), mask,
                                              self.strategy, None if q_sal is None else q_sal[part], None)
            out[part] = torch.where(valid[part], scores.float(), torch.full_like(out[part], -math.inf))
        return out

    # ------------------------------------------------------------------ the search
    def run(self, q: Tensor, q_mask: Tensor, q_sal: Tensor) -> tuple[Tensor, Tensor]:
        """(scores [B, k], global rows [B, k]) of the batch, best first (−inf / −1 past the documents found; a
        query of no real token finds none). q [B, width, d], q_mask [B, width] bool, q_sal [B, width], on the
        shard's device."""
        q = q.float()
        positions, valid = self._select_probes(q_mask, q_sal)
        picked = positions.unsqueeze(-1).expand(-1, -1, q.shape[2])
        weights = q_sal.float().gather(1, positions) if self.use_salience else None
        scores, rows = self._probe(q.gather(1, picked).reshape(-1, q.shape[2]), valid.reshape(-1))
        rows, ok = fixed_candidates(scores.view(len(q), self.probes, -1), rows.view(len(q), self.probes, -1),
                                    weights, self.wide or self.limit, self.sentinel)
        if self.wide:
            narrowed = self._interaction(q, q_mask, rows, ok)
            best = narrowed.sort(dim=1, descending=True, stable=True)
            kept = rows.gather(1, best.indices[:, :self.limit])
            rows, ok = ascending(torch.where(torch.isfinite(best.values[:, :self.limit]), kept,
                                             torch.full_like(kept, -1)))
        refined = self._refine(q, q_mask, q_sal.float() if self.use_salience else None, rows, ok)
        best = refined.sort(dim=1, descending=True, stable=True)
        values = best.values[:, :self.k]
        picked = rows.gather(1, best.indices[:, :self.k])
        return values, torch.where(torch.isfinite(values), picked, torch.full_like(picked, -1))


def width_bucket(tokens: int, limit: int) -> int:
    """The padded query width used for queries of at most ``tokens`` tokens: the next of 16, 24, 32, 48, 64, ...
    (:func:`batch_bucket`'s sizes from 16), at most ``limit``."""
    return min(limit, batch_bucket(max(tokens, 16)))


def batch_bucket(count: int) -> int:
    """The captured batch size that holds ``count`` queries: the next of 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of
    two and one and a half times them), so that padding rows are at most a third of a batch."""
    size = 1 << max(count - 1, 0).bit_length()
    return size * 3 // 4 if size >= 4 and count <= size * 3 // 4 else size


PLAN_WORKSPACE_BYTES = 2 << 30  # device memory a captured batch plan may hold (StaticPlan.workspace_bytes)
# the most queries a captured plan takes (a batch bucket): a plan's fixed shapes (every probe a padded query could
# have, candidate lists at their full depth) cost device time that, past this batch, the host round trips of the
# step-by-step search it saves no longer pay for: at 1M passages on an H200, 75 queries through the plan of 96 took
# 45 ms against 36 step by step, and that plan holds 5.3 GB (eval.experiments.batch_cost)
MAX_PLAN_BATCH = 32


class GraphedSearch:
    """Query encoding and the :class:`StaticPlan` search of a batch, each replayed from a CUDA graph.

    ``encoder`` is a :class:`GraphedQueryEncoder`; plans are captured on first use per (batch bucket, padded width,
    depth, k) and kept (the ``keep`` most recent). All plans share one memory pool: they never run at once, and each
    call copies its result to the host before the next starts. Every plan probes the rows of one buffer
    (``allowed``): the live rows, or a filtered search's rows copied in before its replay. The rows of a captured
    batch past the texts search nothing (their mask is cleared in the graph, from ``live``).
    """

    def __init__(self, encoder, shard: CodeShard, query_prune: float, strategy: Strategy, use_salience: bool,
                 keep: int = 32):
        self.encoder, self.shard = encoder, shard
        self.query_prune, self.strategy, self.use_salience, self.keep = query_prune, strategy, use_salience, keep
        self.graphs: OrderedDict = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.allowed = shard.allowed.clone()  # what the plans probe
        self.filtered = False  # whether it holds a filter's rows (else the live rows)
        self.live = torch.zeros(MAX_PLAN_BATCH, dtype=torch.bool, device=shard.device)  # rows holding a text
        self._largest: dict = {}

    def largest_batch(self, depth: Depth, k: int) -> int:
        """The most queries one replay takes at ``depth``: the largest batch bucket (at most MAX_PLAN_BATCH) whose
        plan at the encoder's full width fits PLAN_WORKSPACE_BYTES (at least 1)."""
        if (depth, k) not in self._largest:
            width, size = self.encoder.ids.shape[1], 1
            while size < MAX_PLAN_BATCH:
                larger = batch_bucket(size + 1)
                plan = StaticPlan(self.shard, larger, width, depth, k, self.query_prune, self.strategy,
                                  self.use_salience)
                if plan.workspace_bytes() > PLAN_WORKSPACE_BYTES:
                    break
                size = larger
            self._largest[(depth, k)] = size
        return self._largest[(depth, k)]

    def _graph(self, captured, width: int, depth: Depth, k: int):
        batch = captured.ids.shape[0]
        key = (batch, width, depth, k)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        plan = StaticPlan(self.shard, batch, width, depth, k, self.query_prune, self.strategy, self.use_salience,
                          self.allowed)
        out = captured.out
        vectors, salience = out.vectors[:, :width], out.salience[:, :width]
        live = self.live[:batch].unsqueeze(1)
        device = self.shard.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(side):
            plan.run(vectors, out.mask[:, :width] & live, salience)  # warm-up outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            result = plan.run(vectors, out.mask[:, :width] & live, salience)
        self.graphs[key] = (graph, result)
        while len(self.graphs) > self.keep:
            self.graphs.popitem(last=False)
        return graph, result

    def __call__(self, texts: list[str], depth: Depth, k: int,
                 allowed: Tensor | None = None) -> tuple[Tensor, Tensor, list[int], Tensor]:
        """(scores [n, k], rows [n, k]) on the host of ``texts`` (n of them, at most :meth:`largest_batch`), each
        text's real token count, and their vectors [n, maxlen, d] on the device (a graph's buffer, valid until the
        next call). ``allowed``: bool [shard rows] on the shard's device, the only rows a filtered search may return
        (None: the live rows)."""
        if allowed is not None or self.filtered:
            self.allowed.copy_(self.shard.allowed if allowed is None else allowed)
            self.filtered = allowed is not None
        captured, tokens = self.encoder.replay(texts)
        self.live.copy_(torch.arange(MAX_PLAN_BATCH) < len(texts), non_blocking=True)
        width = width_bucket(max(tokens), self.encoder.ids.shape[1])
        graph, (scores, rows) = self._graph(captured, width, depth, k)
        graph.replay()
        n = len(texts)
        return scores[:n].cpu(), rows[:n].cpu(), tokens, captured.out.vectors[:n]


MAX_GRAPHED_BATCH = 512  # queries a captured batch encoding takes at most


class _Captured:
    """The model's query forward pass over ``size`` rows of ``width`` token ids, captured in a CUDA graph: fill
    ``ids`` and ``attention``, replay ``graph``, read ``out``."""

    def __init__(self, model, size: int, width: int):
        device = model.device
        self.ids = torch.full((size, width), model.pad_id, dtype=torch.long, device=device)
        self.attention = torch.zeros(size, width, dtype=torch.long, device=device)
        self.attention[:, :2] = 1
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(3):
                model(self.ids, self.attention, is_query=True)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.out = model(self.ids, self.attention, is_query=True)


class GraphedQueryEncoder:
    """Queries through CUDA graphs of the model's forward pass, padded to ``maxlen`` (default the model's
    ``query_maxlen``): one query at a time (``__call__``), a batch (``encode_batch``), or a batch left in a graph's
    buffers (``replay``).

    The eager forward of a small encoder on one short query is bound by kernel launches (~4 ms); replaying a
    captured graph launches them all at once. Padding only adds masked positions, so the vectors of the real tokens
    are those of the eager pass up to floating-point rounding. Raises RuntimeError when the model cannot be captured.
    """

    def __init__(self, model, maxlen: int | None = None):
        self.model = model.eval()
        one = _Captured(model, 1, maxlen or model.config.query_maxlen)
        self.ids = one.ids  # the captured width and device (every batch bucket's graph shares them)
        self._batches = {1: one}

    def replay(self, texts: list[str]) -> tuple[_Captured, list[int]]:
        """The captured forward pass of the batch bucket (:func:`batch_bucket`) that holds ``texts`` (1 to
        MAX_GRAPHED_BATCH of them), captured on first use, replayed on them: its ``out`` holds their vectors in its
        first rows, in input order, until its next replay; and each text's real token count."""
        width = self.ids.shape[1]
        ids = self.model.tokenize_reported(texts, is_query=True, maxlen=width)
        batch = self._batch_graph(batch_bucket(len(ids)))
        host = np.zeros((2, batch.ids.shape[0], width), dtype=np.int64)
        host[0] = self.model.pad_id
        host[1, :, :2] = 1  # rows past the texts: two attended positions, as in the capture
        lengths = np.array([len(row) for row in ids])
        real = np.arange(width) < lengths[:, None]
        host[1, :len(ids)] = real
        host[0, :len(ids)][real] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64,
                                              count=int(lengths.sum()))
        host = torch.from_numpy(host).pin_memory().to(self.ids.device, non_blocking=True)
        batch.ids.copy_(host[0])
        batch.attention.copy_(host[1])
        batch.graph.replay()
        return batch, lengths.tolist()

    def encode_batch(self, texts: list[str]):
        """TokenOutput (vectors [n, maxlen, dim], mask, salience) of ``texts`` (n of them), in input order, through
        :meth:`replay` in batches of at most MAX_GRAPHED_BATCH. A new tensor, not a graph's buffer."""
        from pyserini_aligner.model import TokenOutput

        parts = []
        for start in range(0, len(texts), MAX_GRAPHED_BATCH):
            rows = texts[start:start + MAX_GRAPHED_BATCH]
            out = self.replay(rows)[0].out
            parts.append([t[:len(rows)].clone() for t in (out.vectors, out.mask, out.salience)])
        return TokenOutput(*(torch.cat(column) for column in zip(*parts)))

    def _batch_graph(self, size: int):
        """The captured forward pass of ``size`` padded queries (captured on first use)."""
        if size not in self._batches:
            self._batches[size] = _Captured(self.model, size, self.ids.shape[1])
        return self._batches[size]

    def __call__(self, text: str):
        """TokenOutput (vectors [1, maxlen, dim], mask, salience) of ``text``, valid until the next call."""
        return self.replay([text])[0].out

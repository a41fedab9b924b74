"""CUDA graphs: the query encoder's forward pass (:class:`GraphedQueryEncoder`) and the search of one query with
fixed tensor shapes (:class:`StaticPlan`, replayed by :class:`GraphedSearch`): the rule of :mod:`.candidates` without
host synchronisation.

The step-by-step search (:mod:`.codes`) sizes its tensors from the data (entries in the probed lists, candidates found, tokens of the
candidates), which costs a host round trip per step; for a single query that overhead, not the arithmetic, sets the
latency. :class:`StaticPlan` computes the same ranking with shapes fixed by the index (longest inverted list,
longest document) and by the query's padded width, so that :class:`GraphedSearch` can capture it in a CUDA graph
and replay query encoding plus search as two launches. The plan also runs eagerly on any device (that is how it is
tested against the step-by-step search on the CPU).
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict

import numpy as np

import torch
from torch import Tensor

from pyserini_aligner.alignment import Strategy, alignment_scores_grouped
from pyserini_aligner.salience import keep_count
from pyserini_aligner import kernels
from pyserini_aligner.search.candidates import ascending_one, descending_key, fixed_candidates
from pyserini_aligner.search.codes import CodeShard
from pyserini_aligner.search.options import Depth

_BLOCK = 1 << 24  # elements of the largest padded intermediate (entries, centroid look-ups) built at once


class StaticPlan:
    """The search of one query of at most ``width`` tokens against ``shard`` (which holds the whole index), with
    the depth (K entries per probe, nprobe, W candidates narrowed by centroid interaction or 0, C refined) and k
    fixed. :meth:`run` allocates the same tensors on every call and never reads a value back to the host.
    ``allowed``: bool [shard rows], the rows the probes may take (default the shard's live rows), read at each run
    (a graph's buffer that a filtered search fills)."""

    def __init__(self, shard: CodeShard, width: int, depth: Depth, k: int, query_prune: float,
                 strategy: Strategy, use_salience: bool, allowed: Tensor | None = None):
        self.shard, self.width, self.k, self.strategy = shard, width, k, strategy
        self.allowed = shard.allowed if allowed is None else allowed
        self.query_prune, self.use_salience = query_prune, use_salience
        self.probes = keep_count(width, query_prune)  # most probes a query of ``width`` tokens keeps
        self.nprobe = min(depth.nprobe, shard.nlist)
        self.cap = max(int(shard.ivf_lengths.max()) if shard.nlist else 1, 1)  # longest inverted list
        self.per_token = max(1, min(depth.per_probe, self.nprobe * self.cap))
        self.entries = self.probes * self.per_token
        self.wide, self.limit = min(depth.interaction, self.entries), min(depth.refined, self.entries)
        self.tokens = max(int(shard.lengths.max()) if shard.num_rows else 1, 1)  # longest document
        self.sentinel = shard.row_base + shard.num_rows  # a row past every row the shard holds

    # ------------------------------------------------------------------ steps
    def _select_probes(self, q_mask: Tensor, q_sal: Tensor) -> tuple[Tensor, Tensor]:
        """(token positions [R] in ascending order, valid [R]): the ceil(β^q·n) most salient real tokens, as
        :func:`pyserini_aligner.salience.prune_mask` keeps them. q_mask, q_sal [n]."""
        keyed = q_sal.float().masked_fill(~q_mask, -math.inf)
        order = keyed.sort(descending=True, stable=True).indices[:self.probes]
        real = q_mask.sum()
        count = torch.minimum(torch.ceil(real.double() * self.query_prune - 1e-9).clamp_min(1), real.double())
        valid = torch.arange(self.probes, device=q_mask.device) < count
        positions = torch.where(valid, order, torch.full_like(order, self.width)).sort().values
        return positions.clamp_max(self.width - 1), valid

    def _probe(self, probes: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """(scores [R, K], global rows [R, K]) of each probe's K best live entries, best first (−inf / −1 past
        the entries found), ties in list order: :meth:`CodeShard.probe`'s result. probes [R, d] float32."""
        shard, r = self.shard, len(probes)
        cval, cidx = (probes @ shard.centroids.T).topk(self.nprobe, dim=1)
        lut = torch.einsum("rms,mks->rmk", probes.view(r, shard.m, -1), shard.books).reshape(r, -1)
        if kernels.available(probes.device):
            # the probe's entries packed list after list, in at most nprobe × the longest list's places
            score, docs = kernels.probe_entries(lut, cval, cidx, shard.ivf_offsets, shard.ivf_codes, shard.ivf_docs,
                                                self.allowed, valid, self.nprobe * self.cap)
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
        """Centroid-interaction scores [W] of candidate ``rows`` [W] (−inf where not valid), as
        :meth:`CodeShard.interaction`. q [n, d] float32, q_mask [n]."""
        shard = self.shard
        if kernels.available(q.device):
            local = torch.where(valid, rows - shard.row_base, torch.zeros_like(rows))
            return kernels.interaction(shard.query_table(q.unsqueeze(0)), local.unsqueeze(0), valid.unsqueeze(0),
                                       shard.offsets, shard.token_ids,
                                       torch.nn.functional.pad(q_mask, (0, kernels.pad_width(len(q)) - len(q)))
                                       .unsqueeze(0))[0]
        half = torch.float16 if q.device.type == "cuda" else torch.float32
        table = (q @ shard.centroids.T).T.contiguous().to(half)  # [nlist, n]
        span = torch.arange(self.tokens, device=q.device)
        real = q_mask.sum().clamp_min(1).float()
        out = torch.empty(len(rows), device=q.device)
        step = max(1, _BLOCK // (self.tokens * self.width))
        for a in range(0, len(rows), step):
            local = torch.where(valid[a:a + step], rows[a:a + step] - shard.row_base, torch.zeros_like(rows[a:a + step]))
            pos = (shard.offsets[local].unsqueeze(-1) + span).clamp_max(max(len(shard.token_ids) - 1, 0))
            ok = span < shard.lengths[local].unsqueeze(-1)
            cid = shard.token_ids[pos].long() & 0xFFFF
            values = torch.where(ok.unsqueeze(-1), table[cid], torch.full((), -math.inf, dtype=half,
                                                                           device=q.device))
            best = values.amax(dim=1).float()  # [w, n]
            score = torch.where(q_mask, best, torch.zeros((), device=q.device)).sum(1) / real
            out[a:a + step] = torch.where(valid[a:a + step], score, torch.full_like(score, -math.inf))
        return out

    def _refine(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor) -> Tensor:
        """Alignment scores [C] of candidate ``rows`` [C] decoded from their codes (−inf where not valid)."""
        shard = self.shard
        local = torch.where(valid, rows - shard.row_base, torch.zeros_like(rows))
        span = torch.arange(self.tokens, device=q.device)
        pos = (shard.offsets[local].unsqueeze(-1) + span).clamp_max(max(len(shard.token_ids) - 1, 0))
        mask = (span < shard.lengths[local].unsqueeze(-1)) & valid.unsqueeze(-1)
        if shard.kept is not None:
            mask &= shard.kept[pos]
        d = shard.decode(pos)
        scores = alignment_scores_grouped(q.unsqueeze(0).to(shard.dtype), q_mask.unsqueeze(0), d.unsqueeze(0),
                                          mask.unsqueeze(0), self.strategy,
                                          None if q_sal is None else q_sal.unsqueeze(0), None)[0]
        return torch.where(valid, scores.float(), torch.full_like(scores, -math.inf, dtype=torch.float32))

    # ------------------------------------------------------------------ the search
    def run(self, q: Tensor, q_mask: Tensor, q_sal: Tensor) -> tuple[Tensor, Tensor]:
        """(scores [k], global rows [k]) of one query, best first (−inf / −1 past the documents found).
        q [width, d], q_mask [width] bool, q_sal [width], on the shard's device."""
        q = q.float()
        positions, valid = self._select_probes(q_mask, q_sal)
        weights = q_sal[positions].float() if self.use_salience else None
        scores, rows = self._probe(q[positions], valid)
        rows, ok = fixed_candidates(scores, rows, weights, self.wide or self.limit, self.sentinel)
        if self.wide:
            narrowed = self._interaction(q, q_mask, rows, ok)
            best = narrowed.sort(descending=True, stable=True)
            rows, ok = ascending_one(rows[best.indices[:self.limit]], torch.isfinite(best.values[:self.limit]))
        refined = self._refine(q, q_mask, q_sal.float() if self.use_salience else None, rows, ok)
        best = refined.sort(descending=True, stable=True)
        values = best.values[:self.k]
        picked = rows[best.indices[:self.k]]
        return values, torch.where(torch.isfinite(values), picked, torch.full_like(picked, -1))


def width_bucket(tokens: int, limit: int) -> int:
    """The padded query width used for a query of ``tokens`` tokens: the next power of two from 16, at most
    ``limit``."""
    return min(limit, max(16, 1 << max(tokens - 1, 0).bit_length()))


class GraphedSearch:
    """Query encoding and the :class:`StaticPlan` search of one query, each replayed from a CUDA graph.

    ``encoder`` is a :class:`GraphedQueryEncoder`; plans are captured on first use per (padded
    width, depth, k) and kept (the ``keep`` most recent). All plans share one memory pool: they never run at once,
    and each call copies its result to the host before the next starts. Every plan probes the rows of one buffer
    (``allowed``): the live rows, or a filtered search's rows copied in before its replay.
    """

    def __init__(self, encoder, shard: CodeShard, query_prune: float, strategy: Strategy, use_salience: bool,
                 keep: int = 8):
        self.encoder, self.shard = encoder, shard
        self.query_prune, self.strategy, self.use_salience, self.keep = query_prune, strategy, use_salience, keep
        self.graphs: OrderedDict = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle()
        self.allowed = shard.allowed.clone()  # what the plans probe
        self.filtered = False  # whether it holds a filter's rows (else the live rows)

    def _graph(self, width: int, depth: Depth, k: int):
        key = (width, depth, k)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        plan = StaticPlan(self.shard, width, depth, k, self.query_prune, self.strategy, self.use_salience,
                          self.allowed)
        out = self.encoder.out
        inputs = (out.vectors[0, :width], out.mask[0, :width], out.salience[0, :width])
        device = self.shard.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(side):
            plan.run(*inputs)  # warm-up: kernels and allocator blocks are set up outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            result = plan.run(*inputs)
        self.graphs[key] = (graph, result)
        while len(self.graphs) > self.keep:
            self.graphs.popitem(last=False)
        return graph, result

    def __call__(self, text: str, depth: Depth, k: int, allowed: Tensor | None = None) -> tuple[Tensor, Tensor, int]:
        """(scores [k], rows [k]) on the host, and the query's real token count (its vectors stay in
        ``self.encoder.out``). ``allowed``: bool [shard rows] on the shard's device, the only rows a filtered search
        may return (None: the live rows)."""
        if allowed is not None or self.filtered:
            self.allowed.copy_(self.shard.allowed if allowed is None else allowed)
            self.filtered = allowed is not None
        self.encoder(text)
        tokens = self.encoder.tokens
        graph, (scores, rows) = self._graph(width_bucket(tokens, self.encoder.ids.shape[1]), depth, k)
        graph.replay()
        return scores.cpu(), rows.cpu(), tokens


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
    ``query_maxlen``): one query at a time (``__call__``), or a batch (``encode_batch``).

    The eager forward of a small encoder on one short query is bound by kernel launches (~4 ms); replaying a
    captured graph launches them all at once. Padding only adds masked positions, so the vectors of the real tokens
    are those of the eager pass up to floating-point rounding. Raises RuntimeError when the model cannot be captured.
    """

    def __init__(self, model, maxlen: int | None = None):
        self.model = model.eval()
        one = _Captured(model, 1, maxlen or model.config.query_maxlen)
        self.ids, self.attention, self.graph, self.out = one.ids, one.attention, one.graph, one.out
        self._batches = {1: one}

    def encode_batch(self, texts: list[str]):
        """TokenOutput (vectors [n, maxlen, dim], mask, salience) of ``texts`` (n of them), in input order, through the
        graph of the smallest power-of-two batch (at most MAX_GRAPHED_BATCH) that holds them, captured on first use;
        longer lists go in such batches one after the other. A new tensor, not a graph's buffer."""
        from pyserini_aligner.model import TokenOutput

        width = self.ids.shape[1]
        ids = self.model.tokenize_reported(texts, is_query=True, maxlen=width)
        parts = []
        for start in range(0, len(ids), MAX_GRAPHED_BATCH):
            rows = ids[start:start + MAX_GRAPHED_BATCH]
            batch = self._batch_graph(1 << (len(rows) - 1).bit_length())
            host = np.zeros((2, batch.ids.shape[0], width), dtype=np.int64)
            host[0] = self.model.pad_id
            host[1, :, :2] = 1  # rows past the texts: two attended positions, as in the capture
            lengths = np.array([len(row) for row in rows])
            real = np.arange(width) < lengths[:, None]
            host[1, :len(rows)] = real
            host[0, :len(rows)][real] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                                   count=int(lengths.sum()))
            host = torch.from_numpy(host).pin_memory().to(self.ids.device, non_blocking=True)
            batch.ids.copy_(host[0])
            batch.attention.copy_(host[1])
            batch.graph.replay()
            parts.append([t[:len(rows)].clone() for t in (batch.out.vectors, batch.out.mask, batch.out.salience)])
        return TokenOutput(*(torch.cat(column) for column in zip(*parts)))

    def _batch_graph(self, size: int):
        """The captured forward pass of ``size`` padded queries (captured on first use)."""
        if size not in self._batches:
            self._batches[size] = _Captured(self.model, size, self.ids.shape[1])
        return self._batches[size]

    def __call__(self, text: str):
        """TokenOutput (vectors [1, maxlen, dim], mask, salience) of ``text``, valid until the next call."""
        width = self.ids.shape[1]
        ids = self.model.tokenize_reported([text], is_query=True, maxlen=width)
        self.tokens = len(ids[0])  # real tokens of the last query
        row = torch.full((2, self.ids.shape[1]), 0, dtype=torch.long)
        row[0].fill_(self.model.pad_id)
        row[0, :len(ids[0])] = torch.tensor(ids[0])
        row[1, :len(ids[0])] = 1
        row = row.to(self.ids.device, non_blocking=True)
        self.ids.copy_(row[:1])
        self.attention.copy_(row[1:])
        self.graph.replay()
        return self.out

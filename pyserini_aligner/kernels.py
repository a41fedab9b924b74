"""Triton kernels for GPU builds and searches, each with the plain-torch computation it replaces as its reference.

- :func:`nearest`: the index of each vector's best centroid by inner product, without writing the [n, k] score
  matrix (the codec's assignment and its k-means).
- :func:`probe_entries`: the search's scores of every entry of each probe's inverted lists.
- :func:`decode_tokens`: refinement's token vectors decoded from their codes.
- :func:`interaction`: the search's centroid-interaction scores.
- :func:`refine_maxsim`: the batch plan's top-k:1 refinement, each candidate's own tokens decoded and scored at once.

Used only where Triton and a CUDA device are present (:func:`available`); elsewhere the callers run their torch code.
``PYSERINI_ALIGNER_TRITON=0`` turns them off; ``PYSERINI_ALIGNER_TRITON=interpret`` runs them on the CPU through
Triton's interpreter (which needs ``TRITON_INTERPRET=1`` set before Triton is imported; for tests). Launches are
made one thread at a time (a search on several GPUs launches from a thread a GPU): Triton compiles a kernel at its
first launch, and compilations started at once from several threads can fail.
"""
from __future__ import annotations

import os
import threading
from functools import lru_cache

import torch
from torch import Tensor


_LAUNCH = threading.Lock()  # held while a kernel is launched (and compiled, the first time)


@lru_cache(maxsize=None)
def _triton():
    """The triton module, or None when it is missing or switched off."""
    if os.environ.get("PYSERINI_ALIGNER_TRITON", "1") == "0":
        return None
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return None
    return triton


def available(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: a CUDA device with Triton installed (or the interpreter, on request)."""
    setting = os.environ.get("PYSERINI_ALIGNER_TRITON", "1")
    if device.type != "cuda" and setting != "interpret":
        return False
    return _triton() is not None


@lru_cache(maxsize=None)
def _interaction_kernel():
    triton = _triton()
    tl = triton.language

    @triton.jit
    def interaction_kernel(table, rows, valid, offsets, token_ids, q_mask, real, out, count, nlist,
               NPAD: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = d < count
        ok = (tl.load(valid + b * count + d, mask=inside, other=0) != 0) & inside
        row = tl.load(rows + b * count + d, mask=ok, other=0)
        start = tl.load(offsets + row, mask=ok, other=0)
        length = tl.where(ok, tl.load(offsets + row + 1, mask=ok, other=0) - start, 0)
        lanes = tl.arange(0, NPAD)
        best = tl.full((BLOCK, NPAD), float("-inf"), tl.float32)
        longest = tl.max(length, 0)
        j = 0
        while j < longest:  # a while loop: Triton's interpreter cannot take a tensor as range()'s bound
            present = j < length
            cid = tl.load(token_ids + start + j, mask=present, other=0).to(tl.int32) & 0xFFFF
            values = tl.load(table + (b * nlist + cid[:, None]).to(tl.int64) * NPAD + lanes[None, :],
                             mask=present[:, None], other=float("-inf"))
            best = tl.maximum(best, values.to(tl.float32))
            j += 1
        use = tl.load(q_mask + b * NPAD + lanes) != 0
        score = tl.sum(tl.where(use[None, :], best, 0.0), axis=1) / tl.load(real + b)
        tl.store(out + b * count + d, tl.where(ok, score, float("-inf")), mask=inside)

    return interaction_kernel


def interaction(table: Tensor, rows: Tensor, valid: Tensor, offsets: Tensor, token_ids: Tensor, q_mask: Tensor,
                block: int = 32) -> Tensor:
    """Centroid-interaction scores [B, W]: for each query b and document ``rows[b, w]`` (shard-local, used where
    ``valid``), Σ_i max_j table[b, c(d_j), i] / (real tokens of b), with c(d_j) the centroid of the document's
    j-th token; −inf where not valid or the document has no token. table [B, nlist, NPAD] (NPAD a power of two, at
    least 16; float16 or float32), rows [B, W] int64, valid [B, W] bool, offsets [N + 1] int64, token_ids [T]
    int16 (centroid ids stored as uint16), q_mask [B, NPAD] bool."""
    batch, nlist, npad = table.shape
    count = rows.shape[1]
    out = torch.empty(batch, count, dtype=torch.float32, device=table.device)
    if batch == 0 or count == 0:
        return out
    real = q_mask.sum(1).clamp_min(1).float()
    grid = (batch, (count + block - 1) // block)
    args = (table.contiguous(), rows.contiguous(), valid.to(torch.int8).contiguous(), offsets, token_ids,
            q_mask.to(torch.int8).contiguous(), real, out, count, nlist)
    with _LAUNCH:
        _interaction_kernel()[grid](*args, NPAD=npad, BLOCK=block)
    return out


def interaction_reference(table: Tensor, rows: Tensor, valid: Tensor, offsets: Tensor, token_ids: Tensor,
                          q_mask: Tensor) -> Tensor:
    """:func:`interaction`, one document at a time in plain torch (slow; for tests)."""
    out = torch.full(rows.shape, -torch.inf)
    for b in range(rows.shape[0]):
        for w in range(rows.shape[1]):
            if not bool(valid[b, w]):
                continue
            row = int(rows[b, w])
            cids = token_ids[int(offsets[row]):int(offsets[row + 1])].long() & 0xFFFF
            if len(cids) == 0:
                continue
            best = table[b, cids].float().max(dim=0).values
            out[b, w] = best[q_mask[b]].sum() / max(int(q_mask[b].sum()), 1)
    return out


def pad_width(n: int) -> int:
    """The lane count of a query of ``n`` tokens: the next power of two, at least 16."""
    return max(16, 1 << max(n - 1, 0).bit_length())


@lru_cache(maxsize=None)
def _nearest_kernel():
    triton = _triton()
    tl = triton.language

    @triton.jit
    def nearest_kernel(x, centroids, out, n, k, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        inside = rows < n
        block = tl.load(x + rows[:, None].to(tl.int64) * D + dims[None, :], mask=inside[:, None], other=0.0)
        best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        arg = tl.zeros((BLOCK_N,), tl.int32)
        start = 0
        while start < k:  # a while loop: Triton's interpreter cannot take a tensor as range()'s bound
            cols = start + tl.arange(0, BLOCK_K)
            present = cols < k
            c = tl.load(centroids + cols[None, :] * D + dims[:, None], mask=present[None, :], other=0.0)
            scores = tl.where(present[None, :], tl.dot(block, c), float("-inf"))  # [BLOCK_N, BLOCK_K], fp32
            top = tl.max(scores, axis=1)
            where = tl.argmax(scores, axis=1).to(tl.int32) + start
            better = top > best  # ties keep the earlier centroid
            best = tl.where(better, top, best)
            arg = tl.where(better, where, arg)
            start += BLOCK_K
        tl.store(out + rows, arg, mask=inside)

    return nearest_kernel


def nearest_supported(x: Tensor, centroids: Tensor) -> bool:
    """Whether :func:`nearest` runs for x [n, d] and centroids [k, d]: kernels available on x's device, and d a
    power of two from 16 to 256."""
    dim = x.shape[-1]
    return available(x.device) and 16 <= dim <= 256 and dim & (dim - 1) == 0 and centroids.shape[-1] == dim


def nearest(x: Tensor, centroids: Tensor, block_n: int = 128, block_k: int = 128) -> Tensor:
    """Index [n] (int64) of the centroid [k, d] with the largest inner product with each row of x [n, d], in
    float16 with float32 sums, one block of rows against all centroids at a time (only the running best is kept);
    ties go to the lower index. See :func:`nearest_supported`."""
    out = torch.empty(len(x), dtype=torch.int32, device=x.device)
    if len(x) == 0:
        return out.long()
    half_x = x.to(torch.float16).contiguous()
    half_c = centroids.to(x.device, torch.float16).contiguous()
    grid = ((len(x) + block_n - 1) // block_n,)
    with _LAUNCH:
        _nearest_kernel()[grid](half_x, half_c, out, len(x), len(half_c), D=x.shape[1], BLOCK_N=block_n,
                                BLOCK_K=block_k)
    return out.long()


def nearest_reference(x: Tensor, centroids: Tensor) -> Tensor:
    """:func:`nearest` in plain torch: argmax of the float32 scores of the float16-rounded inputs (for tests)."""
    scores = x.to(torch.float16).float() @ centroids.to(torch.float16).float().T
    return scores.argmax(-1)


@lru_cache(maxsize=None)
def _probe_kernel():
    triton = _triton()
    tl = triton.language

    @triton.jit
    def probe_kernel(lut, cval, cidx, ivf_offsets, ivf_codes, ivf_docs, live, valid, score_out, docs_out, nprobe, width,
               M: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)  # a probe; its entries packed list after list: e = (entries of lists < j) + i
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = e < width
        pos = tl.zeros([BLOCK], dtype=tl.int64)
        base = tl.zeros([BLOCK], dtype=tl.float32)
        found = e < 0
        first = (r * 0).to(tl.int64)  # entries of the lists before the j-th
        j = 0
        while j < nprobe:  # a while loop: Triton's interpreter cannot take a tensor as range()'s bound
            lst = tl.load(cidx + r * nprobe + j)
            start = tl.load(ivf_offsets + lst)
            length = tl.load(ivf_offsets + lst + 1) - start
            here = (e >= first) & (e < first + length)
            pos = tl.where(here, start + e - first, pos)
            base = tl.where(here, tl.load(cval + r * nprobe + j), base)
            found = found | here
            first += length
            j += 1
        ok = found & inside & (tl.load(valid + r) != 0)
        residual = tl.load(lut + r * (M * 256) + tl.load(ivf_codes + pos * M, mask=ok, other=0).to(tl.int32),
                           mask=ok, other=0.0)
        for m in tl.static_range(1, M):  # the engine's order of additions, so its float32 sums to the bit
            code = tl.load(ivf_codes + pos * M + m, mask=ok, other=0).to(tl.int32)
            residual = residual + tl.load(lut + r * (M * 256) + m * 256 + code, mask=ok, other=0.0)
        doc = tl.load(ivf_docs + pos, mask=ok, other=0)
        ok = ok & (tl.load(live + doc, mask=ok, other=0) != 0)
        score = base + residual
        out = r.to(tl.int64) * width + e
        tl.store(score_out + out, tl.where(ok, score, float("-inf")), mask=inside)
        tl.store(docs_out + out, tl.where(ok, doc, 0), mask=inside)

    return probe_kernel


def probe_entries(lut: Tensor, cval: Tensor, cidx: Tensor, ivf_offsets: Tensor, ivf_codes: Tensor, ivf_docs: Tensor,
                  live: Tensor, valid: Tensor, width: int, block: int = 256) -> tuple[Tensor, Tensor]:
    """(scores [R, width] float32, shard-local docs [R, width] int32) of the entries of each probe's P lists packed
    one list after another (list order, then entry order; the first ``width`` of them): centroid score ``cval[r, j]``
    plus the residual's look-up-table sum; −inf (doc 0) past the last entry, for dead documents and for probes not
    ``valid``. lut [R, M·256] float32, cval [R, P] float32, cidx [R, P] int64 (list ids), ivf_offsets [nlist + 1]
    int64, ivf_codes [E, M] uint8, ivf_docs [E] int32, live [N] bool, valid [R] bool."""
    r, nprobe = cidx.shape
    scores = torch.empty(r, width, dtype=torch.float32, device=lut.device)
    docs = torch.empty(r, width, dtype=torch.int32, device=lut.device)
    if r == 0 or width == 0:
        return scores, docs
    grid = (r, (width + block - 1) // block)
    args = (lut.contiguous(), cval.contiguous(), cidx.contiguous(), ivf_offsets, ivf_codes, ivf_docs,
            live.view(torch.uint8), valid.to(torch.uint8).contiguous(), scores, docs, nprobe, width)
    with _LAUNCH:
        _probe_kernel()[grid](*args, M=ivf_codes.shape[1], BLOCK=block)
    return scores, docs


def probe_entries_reference(lut: Tensor, cval: Tensor, cidx: Tensor, ivf_offsets: Tensor, ivf_codes: Tensor,
                            ivf_docs: Tensor, live: Tensor, valid: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """:func:`probe_entries`, one entry at a time in plain Python (slow; for tests)."""
    r, nprobe = cidx.shape
    m = ivf_codes.shape[1]
    scores = torch.full((r, width), -torch.inf)
    docs = torch.zeros((r, width), dtype=torch.int32)
    for i in range(r):
        e = 0
        for j in range(nprobe):
            start, end = int(ivf_offsets[cidx[i, j]]), int(ivf_offsets[cidx[i, j] + 1])
            for entry in range(start, end):
                doc = int(ivf_docs[entry])
                residual = lut[i, int(ivf_codes[entry, 0])]
                for book in range(1, m):
                    residual = residual + lut[i, book * 256 + int(ivf_codes[entry, book])]
                if e < width and bool(valid[i]) and bool(live[doc]):
                    scores[i, e], docs[i, e] = cval[i, j] + residual, doc
                e += 1
    return scores, docs


@lru_cache(maxsize=None)
def _decode_kernel():
    triton = _triton()
    tl = triton.language

    @triton.jit
    def decode_kernel(positions, keep, token_ids, token_codes, centroids, books, out, count, dim, sub, R: tl.constexpr,
               BLOCK: tl.constexpr, DPAD: tl.constexpr):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        lanes = tl.arange(0, DPAD)
        inside = t < count
        ok = inside & (tl.load(keep + t, mask=inside, other=0) != 0)
        pos = tl.load(positions + t, mask=ok, other=0)
        cid = tl.load(token_ids + pos, mask=ok, other=0).to(tl.int32) & 0xFFFF
        lane_ok = ok[:, None] & (lanes[None, :] < dim)
        book = lanes // sub
        code = tl.load(token_codes + pos[:, None] * R + book[None, :], mask=lane_ok, other=0).to(tl.int32)
        residual = tl.load(books + (book[None, :] * 256 + code) * sub + (lanes - book * sub)[None, :], mask=lane_ok,
                           other=0.0)
        centroid = tl.load(centroids + cid[:, None].to(tl.int64) * dim + lanes[None, :], mask=lane_ok, other=0.0)
        vector = tl.where(lane_ok, centroid + residual, 0.0)
        scale = 1.0 / tl.maximum(tl.sqrt(tl.sum(vector * vector, axis=1)), 1e-12)  # unit length, as the model's
        tl.store(out + t[:, None].to(tl.int64) * dim + lanes[None, :], vector * scale[:, None],
                 mask=inside[:, None] & (lanes[None, :] < dim))

    return decode_kernel


def decode_tokens(positions: Tensor, keep: Tensor, token_ids: Tensor, token_codes: Tensor, centroids: Tensor,
                  books: Tensor, block: int = 32) -> Tensor:
    """Token vectors [T, d] float32 at ``positions`` [T] (int64) where ``keep`` [T] (bool), zeros elsewhere: the
    token's centroid plus its residual codewords side by side, c + r element by element, scaled to unit length.
    token_ids [N] int16 (centroid ids stored as uint16), token_codes [N, R] uint8, centroids [nlist, d] float32, books
    [R, 256, d/R] float32."""
    count, dim = len(positions), centroids.shape[1]
    out = torch.empty(count, dim, dtype=torch.float32, device=centroids.device)
    if count == 0:
        return out
    r, sub = books.shape[0], books.shape[2]
    args = (positions.contiguous(), keep.to(torch.uint8).contiguous(), token_ids, token_codes.contiguous(),
            centroids.contiguous(), books.contiguous(), out, count, dim, sub)
    with _LAUNCH:
        _decode_kernel()[((count + block - 1) // block,)](*args, R=r, BLOCK=block,
                                                          DPAD=max(16, 1 << max(dim - 1, 0).bit_length()))
    return out


def decode_tokens_reference(positions: Tensor, keep: Tensor, token_ids: Tensor, token_codes: Tensor,
                            centroids: Tensor, books: Tensor) -> Tensor:
    """:func:`decode_tokens`, one token at a time in plain torch (slow; for tests)."""
    out = torch.zeros(len(positions), centroids.shape[1])
    for t, pos in enumerate(positions.tolist()):
        if bool(keep[t]):
            residual = torch.cat([books[m, int(code)] for m, code in enumerate(token_codes[pos])])
            vector = centroids[int(token_ids[pos]) & 0xFFFF] + residual
            out[t] = vector / vector.norm().clamp_min(1e-12)
    return out


# refine_maxsim's products: three TF32 tensor-core products a block (high and low parts), as accurate as float32
# multiply-adds (scores within 1e-6 of them) and, on an H200, about twice as fast
REFINE_PRECISION = "tf32x3"


@lru_cache(maxsize=None)
def _refine_kernel():
    triton = _triton()
    tl = triton.language

    @triton.jit
    def refine_kernel(q, weights, last, rows, valid, offsets, kept, token_ids, token_codes, centroids, books, out,
               count, n, dim, sub, R: tl.constexpr, LANES: tl.constexpr, DPAD: tl.constexpr, BLOCK: tl.constexpr,
               KEPT: tl.constexpr, PRECISION: tl.constexpr):
        pair = tl.program_id(0)  # b · count + c: query b's c-th candidate
        b = pair // count
        ok = tl.load(valid + pair) != 0
        row = tl.load(rows + pair, mask=ok, other=0)
        start = tl.load(offsets + row, mask=ok, other=0)
        length = tl.where(ok, tl.load(offsets + row + 1, mask=ok, other=0) - start, 0)
        lanes = tl.arange(0, DPAD)
        book = lanes // sub
        num = (pair * 0).to(tl.float32)
        den = (pair * 0).to(tl.float32)
        first = 0
        upto = tl.load(last + b)  # query b's tokens past its last real one score nothing
        while first < upto:  # LANES query tokens at a time (while loops: the interpreter takes no tensor bounds)
            tokens = first + tl.arange(0, LANES)
            query = tl.load(q + (b * n + tokens[None, :]).to(tl.int64) * dim + lanes[:, None],
                            mask=(tokens[None, :] < n) & (lanes[:, None] < dim), other=0.0)  # [DPAD, LANES]: q_bᵀ
            best = tl.full((LANES,), float("-inf"), tl.float32)
            j = 0
            while j < length:
                t = j + tl.arange(0, BLOCK)
                present = t < length
                pos = start + t
                if KEPT:
                    present = present & (tl.load(kept + pos, mask=present, other=0) != 0)
                # decode_kernel's decoding: c + r element by element, scaled to unit length
                cid = tl.load(token_ids + pos, mask=present, other=0).to(tl.int32) & 0xFFFF
                lane_ok = present[:, None] & (lanes[None, :] < dim)
                code = tl.load(token_codes + pos[:, None] * R + book[None, :], mask=lane_ok, other=0).to(tl.int32)
                residual = tl.load(books + (book[None, :] * 256 + code) * sub + (lanes - book * sub)[None, :],
                                   mask=lane_ok, other=0.0)
                centroid = tl.load(centroids + cid[:, None].to(tl.int64) * dim + lanes[None, :], mask=lane_ok,
                                   other=0.0)
                vector = tl.where(lane_ok, centroid + residual, 0.0)
                scale = 1.0 / tl.maximum(tl.sqrt(tl.sum(vector * vector, axis=1)), 1e-12)
                sim = tl.dot(vector * scale[:, None], query, input_precision=PRECISION)  # [BLOCK, LANES]
                best = tl.maximum(best, tl.max(tl.where(present[:, None], sim, float("-inf")), axis=0))
                j += BLOCK
            # maxsim_mean: Σ_i w_i·max_j s_ij / Σ_i w_i over the query tokens with a best token
            w = tl.load(weights + b * n + tokens, mask=tokens < n, other=0.0)
            found = best > float("-inf")
            num += tl.sum(tl.where(found, best, 0.0) * w, axis=0)
            den += tl.sum(tl.where(found, 1.0, 0.0) * w, axis=0)
            first += LANES
        score = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)  # 0 for a document without tokens
        tl.store(out + pair, tl.where(ok, score, float("-inf")))

    return refine_kernel


def refine_maxsim(q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor, offsets: Tensor,
                  kept: Tensor | None, token_ids: Tensor, token_codes: Tensor, centroids: Tensor, books: Tensor,
                  block: int = 16, lanes: int = 64) -> Tensor:
    """Top-k:1 (MaxSim) scores [B, C] (float32) of query b against its candidates ``rows[b, c]`` (shard-local, used
    where ``valid``; −inf elsewhere), each decoded ``block`` tokens at a time from its codes as :func:`decode_tokens`
    decodes it and never padded, against ``lanes`` query tokens at a time up to the query's last real one (products
    as :data:`REFINE_PRECISION` says): Σ_i w_i·max_j q_i·d_j / Σ_i w_i over the real query tokens i (w_i = 1, or
    ``q_sal``) and the document's tokens j (those ``kept`` when given), 0 for a document without tokens, as
    :func:`..alignment.alignment_scores_grouped` scores it. q [B, n, d] float32, q_mask [B, n] bool, q_sal [B, n] or None, rows [B, C] int64, valid [B, C] bool,
    offsets [N + 1] int64, kept [T] bool or None, token_ids [T] int16 (centroid ids stored as uint16), token_codes
    [T, R] uint8, centroids [nlist, d] float32, books [R, 256, d/R] float32."""
    batch, count = rows.shape
    n, dim = q.shape[1], q.shape[2]
    out = torch.empty(batch, count, dtype=torch.float32, device=q.device)
    if batch == 0 or count == 0:
        return out
    zero = torch.zeros((), device=q.device)
    weights = q_mask.float() if q_sal is None else torch.where(q_mask, q_sal.float(), zero)
    last = torch.where(q_mask, torch.arange(1, n + 1, device=q.device), 0).amax(1).int()  # [B]
    args = (q.float().contiguous(), weights.contiguous(), last, rows.contiguous(), valid.to(torch.uint8).contiguous(),
            offsets, token_codes if kept is None else kept.view(torch.uint8), token_ids, token_codes.contiguous(),
            centroids.contiguous(), books.contiguous(), out, count, n, dim, books.shape[2])
    with _LAUNCH:
        _refine_kernel()[(batch * count,)](*args, R=books.shape[0], LANES=lanes, BLOCK=block,
                                             DPAD=max(16, 1 << max(dim - 1, 0).bit_length()), KEPT=kept is not None,
                                             PRECISION=REFINE_PRECISION)
    return out


def refine_maxsim_reference(q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor,
                            offsets: Tensor, kept: Tensor | None, token_ids: Tensor, token_codes: Tensor,
                            centroids: Tensor, books: Tensor) -> Tensor:
    """:func:`refine_maxsim`, one candidate at a time in plain torch (slow; for tests)."""
    out = torch.full(rows.shape, -torch.inf)
    for b in range(rows.shape[0]):
        query = q[b][q_mask[b]].float()
        w = torch.ones(len(query)) if q_sal is None else q_sal[b][q_mask[b]].float()
        for c in range(rows.shape[1]):
            if not bool(valid[b, c]):
                continue
            row = int(rows[b, c])
            positions = torch.arange(int(offsets[row]), int(offsets[row + 1]))
            if kept is not None:
                positions = positions[kept[positions]]
            if len(positions) == 0 or float(w.sum()) <= 0:
                out[b, c] = 0.0
                continue
            tokens = decode_tokens_reference(positions, torch.ones(len(positions), dtype=torch.bool), token_ids,
                                             token_codes, centroids, books)
            best = (query @ tokens.T).max(dim=1).values
            out[b, c] = (best * w).sum() / w.sum()
    return out

"""Triton kernels for GPU builds and searches, each with the plain-torch computation it replaces as its reference.

- :func:`nearest`: the index of each vector's best centroid by inner product, without writing the [n, k] score
  matrix (the codec's assignment and its k-means).
- :func:`probe_scores`: the search's scores of every entry of each probe's inverted lists.
- :func:`interaction`: the search's centroid-interaction scores.

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
    def kernel(table, rows, valid, offsets, token_ids, q_mask, real, out, count, nlist,
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

    return kernel


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
    def kernel(x, centroids, out, n, k, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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

    return kernel


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
    def kernel(lut, cval, cidx, ivf_offsets, ivf_codes, ivf_docs, live, valid, score_out, docs_out, nprobe, cap,
               M: tl.constexpr, BLOCK: tl.constexpr):
        cell = tl.program_id(0)  # probe r's j-th list: r · nprobe + j
        r = cell // nprobe
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = e < cap
        lst = tl.load(cidx + cell)
        start = tl.load(ivf_offsets + lst)
        length = tl.load(ivf_offsets + lst + 1) - start
        ok = (e < length) & (tl.load(valid + r) != 0)
        pos = start + e
        residual = tl.load(lut + r * (M * 256) + tl.load(ivf_codes + pos * M, mask=ok, other=0).to(tl.int32),
                           mask=ok, other=0.0)
        for m in tl.static_range(1, M):  # the engine's order of additions, so its float32 sums to the bit
            code = tl.load(ivf_codes + pos * M + m, mask=ok, other=0).to(tl.int32)
            residual = residual + tl.load(lut + r * (M * 256) + m * 256 + code, mask=ok, other=0.0)
        doc = tl.load(ivf_docs + pos, mask=ok, other=0)
        ok = ok & (tl.load(live + doc, mask=ok, other=0) != 0)
        score = tl.load(cval + cell) + residual
        out = cell.to(tl.int64) * cap + e
        tl.store(score_out + out, tl.where(ok, score, float("-inf")), mask=inside)
        tl.store(docs_out + out, doc.to(tl.int64), mask=inside)

    return kernel


def probe_scores(lut: Tensor, cval: Tensor, cidx: Tensor, ivf_offsets: Tensor, ivf_codes: Tensor, ivf_docs: Tensor,
                 live: Tensor, valid: Tensor, cap: int, block: int = 256) -> tuple[Tensor, Tensor]:
    """(scores [R, P, cap] float32, shard-local docs [R, P, cap] int64) of the first ``cap`` entries of each probe's
    P lists: centroid score ``cval[r, j]`` plus the residual's look-up-table sum, −inf past a list's end, for dead
    documents and for probes not ``valid``. lut [R, M·256] float32, cval [R, P] float32, cidx [R, P] int64 (list
    ids), ivf_offsets [nlist + 1] int64, ivf_codes [E, M] uint8, ivf_docs [E] int32, live [N] bool, valid [R]
    bool."""
    r, nprobe = cidx.shape
    scores = torch.empty(r, nprobe, cap, dtype=torch.float32, device=lut.device)
    docs = torch.empty(r, nprobe, cap, dtype=torch.long, device=lut.device)
    if r == 0 or nprobe == 0 or cap == 0:
        return scores, docs
    grid = (r * nprobe, (cap + block - 1) // block)
    args = (lut.contiguous(), cval.contiguous(), cidx.contiguous(), ivf_offsets, ivf_codes, ivf_docs,
            live.view(torch.uint8), valid.to(torch.uint8).contiguous(), scores, docs, nprobe, cap)
    with _LAUNCH:
        _probe_kernel()[grid](*args, M=ivf_codes.shape[1], BLOCK=block)
    return scores, docs


def probe_scores_reference(lut: Tensor, cval: Tensor, cidx: Tensor, ivf_offsets: Tensor, ivf_codes: Tensor,
                           ivf_docs: Tensor, live: Tensor, valid: Tensor, cap: int) -> tuple[Tensor, Tensor]:
    """:func:`probe_scores`, one entry at a time in plain Python (slow; for tests; docs are 0 past a list's end)."""
    r, nprobe = cidx.shape
    m = ivf_codes.shape[1]
    scores = torch.full((r, nprobe, cap), -torch.inf)
    docs = torch.zeros((r, nprobe, cap), dtype=torch.long)
    for i in range(r):
        for j in range(nprobe):
            start, end = int(ivf_offsets[cidx[i, j]]), int(ivf_offsets[cidx[i, j] + 1])
            for e in range(min(end - start, cap)):
                doc = int(ivf_docs[start + e])
                docs[i, j, e] = doc
                residual = lut[i, int(ivf_codes[start + e, 0])]
                for book in range(1, m):
                    residual = residual + lut[i, book * 256 + int(ivf_codes[start + e, book])]
                if bool(valid[i]) and bool(live[doc]):
                    scores[i, j, e] = cval[i, j] + residual
    return scores, docs

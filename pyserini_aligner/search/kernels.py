"""Triton kernels for the GPU search, each with the plain-torch computation it replaces as its reference.

Used only where Triton and a CUDA device are present (:func:`available`); elsewhere the engine runs its torch code.
``PYSERINI_ALIGNER_TRITON=0`` turns them off; ``PYSERINI_ALIGNER_TRITON=interpret`` runs them on the CPU through
Triton's interpreter (which needs ``TRITON_INTERPRET=1`` set before Triton is imported; for tests).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
from torch import Tensor


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
        for j in range(0, tl.max(length, 0)):
            present = j < length
            cid = tl.load(token_ids + start + j, mask=present, other=0).to(tl.int32) & 0xFFFF
            values = tl.load(table + (b * nlist + cid[:, None]).to(tl.int64) * NPAD + lanes[None, :],
                             mask=present[:, None], other=float("-inf"))
            best = tl.maximum(best, values.to(tl.float32))
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
    _interaction_kernel()[grid](table.contiguous(), rows.contiguous(), valid.to(torch.int8).contiguous(), offsets,
                                token_ids, q_mask.to(torch.int8).contiguous(), real, out, count, nlist,
                                NPAD=npad, BLOCK=block)
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

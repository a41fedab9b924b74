"""A compressed index's codes searched by tensor operations: :class:`TorchCodes` (consecutive segments on one
device, a :class:`..codes.CodeShard`) and :class:`SegmentCodes` (every segment's memory-mapped codes on the CPU,
scored by a thread each)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch
from torch import Tensor

from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.search.backends.base import Scoring, Staged
from pyserini_aligner.search.codes import CodeShard, held_first, query_chunks


class TorchCodes(Staged):
    """A compressed index's codes (all or some consecutive segments: ``shard``) on one device."""

    def __init__(self, shard: CodeShard, scoring: Scoring):
        self.shard, self.device, self.scoring = shard, shard.device, scoring

    @property
    def num_rows(self) -> int:
        """Documents (rows) this backend holds."""
        return self.shard.num_rows

    def probe(self, probes, per_token, nprobe, allowed=None):
        return self.shard.probe(probes, per_token, nprobe, allowed)

    def interaction(self, q, q_mask, rows, valid):
        return self.shard.interaction(q, q_mask, rows, valid)

    def refine(self, q, q_mask, q_sal, rows, valid):
        return self.shard.refine(q, q_mask, q_sal, rows, valid, self.scoring.strategy, self.scoring.refine_width)

    def refine_held(self, q: Tensor, q_mask: Tensor, q_sal: Tensor | None, rows: Tensor, valid: Tensor) -> Tensor:
        """:meth:`refine` of only the candidates this shard holds (the others score −inf), so that a shard of a
        split index scores its own share of the candidates rather than a padded tensor of all of them. The queries
        go in the chunks that :meth:`..codes.CodeShard.refine` makes of the whole candidate list, each chunk's held
        candidates gathered to the front: every query-dependent table is computed over the same queries as on one
        device, so the scores are those of one device to float32 rounding. Scores [B, C] on this device."""
        shard = self.shard
        rows, valid = rows.to(self.device), valid.to(self.device)
        q, q_mask = q.to(self.device), q_mask.to(self.device)
        held = valid & (rows >= shard.row_base) & (rows < shard.row_base + shard.num_rows)
        out = torch.full(rows.shape, -torch.inf, device=self.device)
        padded = torch.full((len(rows),), rows.shape[1] * self.scoring.refine_width, device=self.device)
        budget = shard.elements if self.device.type == "cuda" else 1 << 22  # CodeShard.refine's chunks
        for part, _ in query_chunks(q_mask.sum(1), padded, 0, budget, padded * shard.centroids.shape[1]):
            mine = held[part]
            count = int(mine.sum(1).max())
            if count == 0:
                continue
            order = held_first(mine, count)
            picked, ok = rows[part].gather(1, order), mine.gather(1, order)
            scores = self.refine(q[part], q_mask[part], None if q_sal is None else q_sal[part].to(self.device),
                                 picked, ok)
            out[part] = out[part].scatter(1, order, torch.where(ok, scores, torch.full_like(scores, -torch.inf)))
        return out


class SegmentCodes:
    """Every segment's memory-mapped codes (``parts``, one CPU :class:`TorchCodes` each, in segment order), scored
    by a thread each, at most a thread a CPU core at once (tensor operations release the GIL while they run); each
    part scores only the candidates it holds and the parts' scores are combined by an element-wise maximum."""

    def __init__(self, parts: list[TorchCodes]):
        self.parts = parts
        workers = min(len(parts), os.cpu_count() or 1)  # more would only hold more scratch memory at once
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="aligner-segment") if len(parts) > 1 else None

    def _each(self, step: Callable, *inputs) -> Tensor:
        if self._pool is None:
            return step(self.parts[0], *inputs)
        out = [future.result() for future in [self._pool.submit(step, part, *inputs) for part in self.parts]]
        for part in out[1:]:
            out[0] = torch.maximum(out[0], part)
        return out[0]

    def interaction(self, q, q_mask, rows, valid) -> Tensor:
        return self._each(TorchCodes.interaction, q, q_mask, rows, valid)

    def refine(self, q, q_mask, q_sal, rows, valid) -> Tensor:
        return self._each(TorchCodes.refine_held, q, q_mask, q_sal, rows, valid)


def codes_on(store: StoredIndex, numbers: Sequence[int], device: torch.device | str, scoring: Scoring) -> TorchCodes:
    """:class:`TorchCodes` of segments ``numbers`` of ``store`` on ``device``; ValueError (:func:`room_error`) on
    a GPU whose free memory can't hold their codes."""
    device = torch.device(device)
    if device.type == "cuda":
        error = room_error(store, list(numbers), scoring.refine_with, device, torch.cuda.mem_get_info(device)[0])
        if error is not None:
            raise ValueError(error)
    return TorchCodes(CodeShard(store, list(numbers), device, scoring.refine_with), scoring)


def resident_bytes(store: StoredIndex, numbers: Sequence[int], refine_with: str, device: torch.device) -> int:
    """Bytes a :class:`..codes.CodeShard` of segments ``numbers`` takes on ``device``: every token's centroid id and
    residual code (and kept flag with refine_with "kept"), every inverted-list entry's document and code, two
    int64 and a flag per document, and the codec's tables."""
    spec, dim = store.codec_spec, store.manifest.dim
    infos = [store.segments[i].info for i in numbers]
    tokens, docs, entries = (sum(getattr(i, name) for i in infos) for name in ("num_tokens", "num_docs", "num_kept"))
    per_token = 2 + spec.residual_m + (1 if refine_with == "kept" else 0)
    tables = (spec.nlist + 512) * dim * 4 + (65536 * dim * 4 if device.type == "cuda" else 0)
    return tokens * per_token + docs * 17 + entries * (4 + spec.pq_m) + 16 * (spec.nlist + 1) + tables


def room_error(store: StoredIndex, numbers: Sequence[int], refine_with: str, device: torch.device,
               free: int) -> str | None:
    """The one-line error for codes of segments ``numbers`` that take more than ``free`` bytes of ``device``
    (:func:`resident_bytes`), naming the ways out; None when they fit."""
    need = resident_bytes(store, numbers, refine_with, device)
    if need <= free:
        return None
    return (f"{store.index_dir}: the codes of {len(numbers)} of its {len(store.segments)} segment(s) take "
            f"{need / 2 ** 30:.1f} GiB, more than the {free / 2 ** 30:.1f} GiB free on {device}: search it on several "
            "GPUs (--devices shares the segments out), on the CPU (--device cpu), or build it with a smaller "
            "--max-bytes-per-token")

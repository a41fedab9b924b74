"""A projection fitted to keep the backbone's own token MaxSim ranking, without labels.

PCA keeps the directions in which token states vary most; MaxSim ranks documents by each query token's best
match, which may lie in directions of little variance. :func:`fit_projection` instead minimises, over training
queries and candidate documents, KL(softmax(teacher / τ) || softmax(student / τ)) per query, where the teacher is
top-k:1 MaxSim over the L2-normalised backbone token states (hidden size, e.g. 384) and the student the same over
normalise(h Wᵀ) (``dim``, e.g. 128). Only W is fitted; the backbone is frozen and its states are computed once.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pyserini_aligner.alignment import alignment_scores
from pyserini_aligner.strategy import MAXSIM


@dataclass
class States:
    """Token states of N texts: vectors [N, L, H] (L2-normalised, zero at padding), mask [N, L] bool."""

    vectors: Tensor
    mask: Tensor

    def __getitem__(self, rows: Tensor | list[int]) -> "States":
        return States(self.vectors[rows], self.mask[rows])

    def __len__(self) -> int:
        return self.vectors.shape[0]


@dataclass
class FitGroup:
    """Queries and the documents they are ranked against (one corpus)."""

    queries: States
    docs: States


def backbone_states(model, ids: list[list[int]], batch_size: int) -> States:
    """L2-normalised backbone token states of pre-tokenised texts (the tokens the model keeps), padded to the
    longest; float16 on a GPU, float32 otherwise. The model is put in eval mode."""
    from pyserini_aligner.train.validate import pad_ids

    store = torch.float16 if model.device.type == "cuda" else torch.float32
    width = max(len(r) for r in ids)
    vectors = torch.zeros(len(ids), width, model.config.hidden_size, dtype=store, device=model.device)
    mask = torch.zeros(len(ids), width, dtype=torch.bool, device=model.device)
    model.eval()
    with torch.inference_mode():
        for s in range(0, len(ids), batch_size):
            input_ids, att = pad_ids(ids[s:s + batch_size], model.pad_id, model.device)
            h = model.backbone(input_ids=input_ids, attention_mask=att).last_hidden_state.float()
            keep = model.token_mask(input_ids, att)
            n = input_ids.shape[1]
            vectors[s:s + batch_size, :n] = (F.normalize(h, dim=-1) * keep.unsqueeze(-1)).to(store)
            mask[s:s + batch_size, :n] = keep
    return States(vectors, mask)


def project(states: States, weight: Tensor) -> Tensor:
    """normalise(h Wᵀ) at real tokens, 0 at padding: [N, L, dim] float32; weight [dim, H]."""
    out = F.normalize(states.vectors.float() @ weight.T, dim=-1)
    return out * states.mask.unsqueeze(-1)


def maxsim(queries: States, docs: States, weight: Tensor | None = None) -> Tensor:
    """Top-k:1 MaxSim [Q, N] of every query against every doc, over the states themselves (weight None) or
    their projection by ``weight`` [dim, H]."""
    if weight is None:
        return alignment_scores(queries.vectors.float(), queries.mask, docs.vectors.float(), docs.mask, MAXSIM)
    return alignment_scores(project(queries, weight), queries.mask, project(docs, weight), docs.mask, MAXSIM)


def ranking_kl(student: Tensor, teacher: Tensor, temperature: float, teacher_temperature: float | None = None,
               allowed: Tensor | None = None) -> Tensor:
    """Mean over rows of KL(softmax(teacher / τ_t) || softmax(student / τ)), each softmax over the row's allowed
    columns; student, teacher [Q, C], allowed [Q, C] bool (None = all), τ_t = τ unless given. Gradients reach
    ``student`` only."""
    if allowed is None:
        allowed = torch.ones(student.shape, dtype=torch.bool, device=student.device)
    tau_t = temperature if teacher_temperature is None else teacher_temperature
    log_s = (student / temperature).masked_fill(~allowed, -math.inf).log_softmax(-1).masked_fill(~allowed, 0.0)
    log_t = (teacher.detach() / tau_t).masked_fill(~allowed, -math.inf).log_softmax(-1).masked_fill(~allowed, 0.0)
    return (log_t.exp() * allowed * (log_t - log_s)).sum(-1).mean()


def held_out_kl(groups: list[FitGroup], weights: dict[str, Tensor], temperature: float) -> dict[str, float]:
    """Per named weight [dim, H]: :func:`ranking_kl` of its projected MaxSim against the backbone's over every doc of
    each group, averaged over all the groups' queries (each group's teacher scores computed once)."""
    totals = dict.fromkeys(weights, 0.0)
    count = sum(len(g.queries) for g in groups)
    with torch.no_grad():
        for group in groups:
            teacher = maxsim(group.queries, group.docs)
            for name, weight in weights.items():
                kl = ranking_kl(maxsim(group.queries, group.docs, weight), teacher, temperature)
                totals[name] += len(group.queries) * float(kl) / count
    return totals


def nearest(group: FitGroup, count: int, chunk: int = 256) -> Tensor:
    """Per query, the ``count`` docs of the group with the highest teacher MaxSim: [Q, count] rows (long)."""
    count = min(count, len(group.docs))
    rows = []
    with torch.inference_mode():
        for s in range(0, len(group.queries), chunk):
            part = group.queries[torch.arange(s, min(s + chunk, len(group.queries)))]
            scores = alignment_scores(part.vectors, part.mask, group.docs.vectors, group.docs.mask, MAXSIM)
            rows.append(scores.float().topk(count, dim=-1).indices)
    return torch.cat(rows)


def fit_projection(weight: Tensor, groups: list[FitGroup], steps: int, batch: int = 32, hard: int = 16,
                   candidates: int = 256, lr: float = 1e-3, temperature: float = 0.02, seed: int = 0,
                   progress=None) -> tuple[Tensor, list[float]]:
    """Adam on W [dim, H] (from ``weight``) minimising :func:`ranking_kl` of projected against backbone MaxSim.

    Each step takes ``batch`` queries of one group (groups drawn in proportion to their queries) and ranks them
    against one candidate set: every query's ``hard`` teacher-nearest docs, filled up with random docs of the group
    to ``candidates``. Returns the fitted W (float32, on weight's device) and the loss of every step.
    """
    rng = random.Random(seed)
    tops = [nearest(g, hard) for g in groups]
    w = weight.detach().float().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([w], lr=lr)
    sizes = [len(g.queries) for g in groups]
    losses = []
    for _ in range(steps):
        gi = rng.choices(range(len(groups)), weights=sizes)[0]
        group, top = groups[gi], tops[gi]
        rows = rng.sample(range(sizes[gi]), min(batch, sizes[gi]))
        cand = list(dict.fromkeys(top[rows].flatten().tolist()))
        rest = [r for r in rng.sample(range(len(group.docs)), min(len(group.docs), 2 * candidates)) if r not in cand]
        cand = (cand + rest)[:max(candidates, len(cand))]
        queries, docs = group.queries[rows], group.docs[cand]
        with torch.no_grad():
            teacher = maxsim(queries, docs).float()
        loss = ranking_kl(maxsim(queries, docs, w), teacher, temperature)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress.update(1)
    return w.detach(), losses

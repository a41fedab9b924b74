"""Salience heads trained for pruning by usage distillation (``objective: salience_distill``).

The encoder (backbone + projection of ``init``) is frozen, so document vectors do not change; only the
q_salience / d_salience Linear heads (on the backbone's last hidden states) are trained, full-batch, with a
listwise loss: per text, cross-entropy between softmax(logits over its real tokens) and a target distribution.

Targets ("retrieval margins"), from the training queries only (top-k:1 alignment, S = Q·Dᵀ). Pruned search
reaches a doc when one of its kept tokens is among a query token's ``prune_k_per_token`` nearest kept tokens, so
with τ_i = the similarity of query token i's ``distill_rank``-th nearest token over the whole corpus (≈ the
k_per_token-th among a β^d share of kept tokens):
- doc token j: Σ over (query, judged positive) pairs of Σ_{i: argmax_j' S_ij' = j} max(0, S_ij − τ_i), i.e. how much
  j, as the MaxSim partner of a query it is relevant to, clears that query token's retrieval threshold (docs
  judged for no training query, or never clearing it, are skipped);
- query token i: mean over the query's positives of max(0, max_j S_ij − τ_i), how well it retrieves them as a
  probe (queries whose targets are all 0 are skipped).
The loss is shift-invariant, so afterwards each head's bias is set to make s = ReLU(logit) positive on all but
0.1 % of the training tokens (s keeps the learned order; unary_salience's LP then keeps its α share).

Validation (validate.evaluate, β^d/β^q pruned search) of the result, plus doc-side pruning baselines at the same
β^d — first tokens, random scores (seeded), wordpiece IDF over the corpus — is written to ``pruning.json``.
Needs torch, transformers, safetensors, yaml, tqdm and ranx only (no Pyserini, no FAISS).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from pyserini_aligner.checkpoints import checkpoint_folder
from pyserini_aligner.model import CONFIG_FILE, DELTA_FILE, FORMAT_VERSION, HEADS_FILE
from pyserini_aligner.train.loop import LOG_FILE, Trainer
from pyserini_aligner.train.validate import (Encoded, encode_ids, mean_ndcg10, pad_ids, pruned_candidates, score_all,
                                             top_docids)

log = logging.getLogger(__name__)
POSITIVE_QUANTILE = 1e-3  # share of training tokens allowed a logit <= 0 after the bias shift


def idf_scores(ids: list[list[int]], width: int, device: torch.device) -> Tensor:
    """[N, width] float: ln(N / df) of each token's wordpiece id (df = docs of ``ids`` containing it), 0 at padding."""
    df: dict[int, int] = {}
    for row in ids:
        for t in set(row):
            df[t] = df.get(t, 0) + 1
    out = torch.zeros(len(ids), width)
    for r, row in enumerate(ids):
        out[r, :len(row)] = torch.tensor([math.log(len(ids) / df[t]) for t in row])
    return out.to(device)


class SalienceDistiller(Trainer):
    """Trainer set-up (bundle, tokenisation, validation), salience heads trained by usage distillation."""

    def __init__(self, cfg, output_dir=None, device=None, progress=True):
        super().__init__(cfg, output_dir=output_dir, device=device, progress=progress)
        for p in self.model.parameters():
            p.requires_grad_(False)
        with torch.no_grad():  # heads start from their untrained state (W=0, b=1) whatever ``init`` holds
            for head in (self.model.q_salience, self.model.d_salience):
                head.weight.zero_()
                head.bias.fill_(1.0)
        self.model.compute_dtype = None  # frozen encoder in fp32: the vectors match CPU inference

    # ------------------------------------------------------------------ features and targets
    def _hidden(self, ids: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Last hidden states [N, L, hidden] (fp16) and real-token masks [N, L] of pre-tokenised texts."""
        model, bs = self.model, self.cfg.eval_batch_size
        width = max(len(r) for r in ids)
        hidden = torch.zeros(len(ids), width, model.config.hidden_size, dtype=torch.float16, device=self.device)
        mask = torch.zeros(len(ids), width, dtype=torch.bool, device=self.device)
        model.eval()
        with torch.inference_mode():
            for s in range(0, len(ids), bs):
                input_ids, att = pad_ids(ids[s:s + bs], model.pad_id, self.device)
                h = model.backbone(input_ids=input_ids, attention_mask=att).last_hidden_state
                hidden[s:s + bs, :h.shape[1]] = h.half()
                mask[s:s + bs, :h.shape[1]] = model.token_mask(input_ids, att)
        return hidden, mask

    def targets(self) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        """{"d": (hidden, mask, target), "q": (...)}: targets [N, L] >= 0 (module docstring), rows with targets only."""
        q_rows, d_rows = [], []
        for name in sorted({q.corpus for q in self.sampler.queries}):
            corpus, ids = self.bundle.corpora[name], self.corpus_ids[name]
            docs = encode_ids(self.model, ids, False, self.cfg.eval_batch_size)
            usage = torch.zeros(docs.mask.shape, device=self.device)
            part = [i for i, q in enumerate(self.sampler.queries) if q.corpus == name]
            queries = encode_ids(self.model, [self.query_ids[i] for i in part], True, self.cfg.eval_batch_size)
            q_target = torch.zeros(queries.mask.shape, device=self.device)
            tau = self.thresholds(queries, docs)
            for row, i in enumerate(part):
                tq = self.sampler.queries[i]
                q = queries.vectors[row][queries.mask[row]].float()  # [n, d]
                pos = [corpus.row[d] for d, rel in sorted(tq.positives.items()) if rel > 0]
                margin = self._margins(q, tau[row][queries.mask[row]], docs, pos, usage)
                q_target[row, :q.shape[0]] = margin.mean(0)
            d_hidden, d_mask = self._hidden(ids)
            used = usage.sum(1) > 0
            d_rows.append((d_hidden[used], d_mask[used], usage[used]))
            q_hidden, q_mask = self._hidden([self.query_ids[i] for i in part])
            used = q_target.sum(1) > 0
            q_rows.append((q_hidden[used], q_mask[used], q_target[used]))
            log.info("%s: doc targets for %d of %d docs, query targets for %d of %d queries", name,
                     int(d_rows[-1][0].shape[0]), len(ids), int(used.sum()), len(part))
        return {"d": _cat(d_rows), "q": _cat(q_rows)}

    def thresholds(self, queries: Encoded, docs: Encoded, chunk: int = 1024) -> Tensor:
        """τ [Q, n]: each query token's similarity to its ``distill_rank``-th nearest doc token of the corpus."""
        tokens = docs.vectors[docs.mask]  # [T, d]
        probes = queries.vectors[queries.mask]  # [R, d]
        rank = min(self.cfg.distill_rank, tokens.shape[0])
        tau = torch.cat([(probes[s:s + chunk].to(tokens.dtype) @ tokens.T).float().topk(rank, dim=-1).values[:, -1]
                         for s in range(0, probes.shape[0], chunk)])
        return torch.zeros(queries.mask.shape, device=tau.device).masked_scatter(queries.mask, tau)

    @staticmethod
    def _margins(q: Tensor, tau: Tensor, docs: Encoded, rows: list[int], usage: Tensor) -> Tensor:
        """max(0, max_j S_ij − τ_i) [len(rows), n] of query vectors q [n, d] on doc ``rows``; adds each margin to
        ``usage`` [N, L] at the doc token j that is query token i's MaxSim partner."""
        vectors, mask = docs.vectors[rows].float(), docs.mask[rows]  # [P, m, d], [P, m]
        sim = torch.einsum("nh,pmh->pnm", q, vectors).masked_fill(~mask.unsqueeze(1), -math.inf)
        best, where = sim.max(-1)  # [P, n]
        margin = (best - tau).clamp_min(0)
        index = torch.tensor(rows, device=q.device).unsqueeze(1).expand_as(where)
        usage.index_put_((index, where), margin, accumulate=True)
        return margin

    # ------------------------------------------------------------------ training
    def fit_head(self, head: torch.nn.Linear, hidden: Tensor, mask: Tensor, target: Tensor) -> list[float]:
        """Full-batch listwise training of ``head``; then the bias shift (module docstring). Returns the losses."""
        cfg = self.cfg
        head.requires_grad_(True)
        opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr_salience, weight_decay=0.0)
        p = target / target.sum(1, keepdim=True)
        steps = cfg.max_steps or 300 * cfg.epochs
        losses = []
        for step in range(steps):
            logits = head(hidden.float()).squeeze(-1).masked_fill(~mask, -math.inf)
            loss = -(p * F.log_softmax(logits, dim=1).masked_fill(~mask, 0.0)).sum(1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            if step % 100 == 0 or step == steps - 1:
                log.info("head step %d/%d loss %.4f", step, steps, losses[-1])
        head.requires_grad_(False)
        with torch.no_grad():
            logits = head(hidden[mask].float()).squeeze(-1)
            low = torch.quantile(logits[torch.randperm(len(logits), device=logits.device)[:1 << 20]],
                                 POSITIVE_QUANTILE)
            head.bias.add_(1.0 - low)
        return losses

    def pruning_table(self) -> dict:
        """Pruned-search validation nDCG@10 per set × β^q ∈ {1, β^q} × doc method (learned, first, random, idf)."""
        cfg, model = self.cfg, self.model
        table: dict = {}
        for name, vset in self.bundle.validation.items():
            ids, docids = self.corpus_ids[vset.corpus], self.bundle.corpora[vset.corpus].docids
            docs = encode_ids(model, ids, False, cfg.eval_batch_size)
            queries = encode_ids(model, self.val_query_ids[name], True, cfg.eval_batch_size)
            full = score_all(model, queries, docs, self.strategy)
            gen = torch.Generator().manual_seed(cfg.seed)
            methods = {"learned": docs.salience, "first": docs.mask.float(),
                       "random": torch.rand(docs.mask.shape, generator=gen).to(self.device),
                       "idf": idf_scores(ids, docs.mask.shape[1], self.device)}
            qids = list(vset.queries)
            row = {"full": mean_ndcg10(top_docids(full, qids, docids), vset.qrels)}
            for beta_q in sorted({1.0, cfg.prune_beta_q}, reverse=True):
                for method, scores in methods.items():
                    variant = Encoded(docs.vectors, docs.mask, scores * docs.mask)
                    cand = pruned_candidates(queries, variant, beta_q, cfg.prune_beta_d, cfg.prune_k_per_token)
                    run = top_docids(torch.where(cand, full, torch.full_like(full, -math.inf)), qids, docids)
                    row[f"beta_q={beta_q:g}/{method}"] = mean_ndcg10(run, vset.qrels)
            table[name] = row
            del docs, queries, full
        return table

    def export(self, path: Path) -> None:
        """Checkpoint folder: config.json, heads.safetensors (projection unchanged, trained salience heads) and the
        init checkpoint's backbone_delta.safetensors copied byte for byte."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.config.save(path / CONFIG_FILE)
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.model.heads_state().items()},
                  str(path / HEADS_FILE), metadata={"format_version": str(FORMAT_VERSION)})
        source = checkpoint_folder(self.cfg.init) / DELTA_FILE
        if source.is_file():
            shutil.copyfile(source, path / DELTA_FILE)
        for name in (HEADS_FILE, DELTA_FILE):
            if (path / name).exists():
                (path / name).chmod(0o644)

    def run(self, resume: bool = False, stop_after: int | None = None) -> dict:
        """Targets, both heads, pruning validation; writes ``best/`` (the checkpoint), pruning.json, summary.json."""
        if resume or stop_after is not None:
            raise ValueError("objective 'salience_distill' trains in one go (no --resume / --stop-after)")
        import yaml

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False), encoding="utf-8")
        if (self.out / LOG_FILE).exists():
            (self.out / LOG_FILE).unlink()
        start = time.time()
        before = self._first_tokens_validation()
        self._log({"event": "baseline_first_tokens", **before})
        data = self.targets()
        losses = {}
        for side, head in (("q", self.model.q_salience), ("d", self.model.d_salience)):
            if side in self.cfg.train_salience:
                losses[side] = self.fit_head(head, *data[side])
                self._log({"event": "fit", "side": side, "texts": int(data[side][0].shape[0]),
                           "loss_first": losses[side][0], "loss_last": losses[side][-1]})
        del data
        after = self.validate()
        table = self.pruning_table()
        self.export(self.out / "best")
        summary = {"finished": True, "objective": "salience_distill", "first_tokens": before, "distilled": after,
                   "pruning": table, "seconds": round(time.time() - start, 1),
                   "improved": bool(after["sets"]) and all(after["sets"][n]["ndcg@10_pruned"] >= before["sets"][n][
                       "ndcg@10_pruned"] for n in after["sets"])}
        (self.out / "pruning.json").write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        self._log({"event": "done", **summary})
        return summary

    def _first_tokens_validation(self) -> dict:
        """Validation of the init model with use_salience off (every token 1: pruning keeps the first tokens)."""
        config = self.model.config
        saved = config.use_salience
        config.use_salience = False
        try:
            return self.validate()
        finally:
            config.use_salience = saved


def _cat(rows: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    width = max(r[0].shape[1] for r in rows)
    pad = [(F.pad(h, (0, 0, 0, width - h.shape[1])), F.pad(m, (0, width - m.shape[1])),
            F.pad(t, (0, width - t.shape[1]))) for h, m, t in rows]
    return tuple(torch.cat([p[k] for p in pad]) for k in range(3))

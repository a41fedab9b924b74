"""Contrastive training of AligneR: in-batch + hard negatives, alignment scores / temperature, cross-entropy.

Output folder: ``log.jsonl`` (loss, learning rates, validation nDCG@10), ``state.pt`` (resume state),
``best/`` and ``last/`` (checkpoint folders loadable with ``pyserini_aligner.resolve.load_model``: config.json,
heads.safetensors, backbone_delta.safetensors holding only the fine-tuned layers, in fp16), ``summary.json``
and ``config.yaml``. Needs torch, transformers, safetensors, yaml and tqdm only (no Pyserini, no FAISS).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm.auto import tqdm

from pyserini_aligner.alignment import alignment_scores
from pyserini_aligner.backbone import load_backbone
from pyserini_aligner.model import DELTA_FILE, FORMAT_VERSION, AlignerConfig, AlignerModel
from pyserini_aligner.resolve import UNTRAINED, load_model
from pyserini_aligner.strategy import MAXSIM
from pyserini_aligner.train.config import TrainConfig
from pyserini_aligner.train.data import BatchSampler, load_bundle, select
from pyserini_aligner.train.projection import FitGroup, backbone_states, fit_projection, held_out_kl, ranking_kl
from pyserini_aligner.train.teacher import WordpieceBM25, in_units_of, zscore_fusion
from pyserini_aligner.train.validate import encode_ids, evaluate, pad_ids, score_all
from pyserini_aligner.untrained import SEED

log = logging.getLogger(__name__)
STATE_FILE = "state.pt"
LOG_FILE = "log.jsonl"
# fields that may change between a run and its --resume without changing what is trained
_RESUME_FREE = {"output_dir", "eval_every", "checkpoint_every", "log_every", "eval_batch_size", "description"}


def build_model(cfg: TrainConfig) -> AlignerModel:
    """The starting model: "untrained" (MiniLM, projection seed 0, salience W=0 b=1) or a checkpoint (a shipped
    name or a folder), with the config's model fields applied."""
    fields = dict(dim=cfg.dim, query_maxlen=cfg.query_maxlen, doc_maxlen=cfg.doc_maxlen,
                  keep_special=cfg.keep_special, use_salience=cfg.use_salience,
                  salience_in_score=cfg.salience_in_score, salience_mode=cfg.salience_mode,
                  alpha_q=cfg.alpha_q, alpha_d=cfg.alpha_d, eps=cfg.eps, default_strategy=str(cfg.strategy),
                  description=cfg.description)
    if cfg.init == UNTRAINED:
        model = AlignerModel(AlignerConfig(**fields))
        model.reset_heads(seed=SEED)
        return model
    model = load_model(cfg.init)
    if model.config.dim != cfg.dim:
        raise ValueError(f"config field 'dim' = {cfg.dim} but checkpoint {cfg.init} has dim {model.config.dim}")
    for name, value in fields.items():
        setattr(model.config, name, value)
    model.config.validate()
    return model


def freeze(model: AlignerModel, train_layers: int) -> list[str]:
    """Freeze the backbone except its top ``train_layers`` transformer layers; returns their state-dict names."""
    layers = getattr(getattr(model.backbone, "encoder", None), "layer", None)
    if layers is None:
        raise ValueError(f"backbone {model.backbone_source} has no encoder.layer list; use train_layers: 0")
    if train_layers > len(layers):
        raise ValueError(f"config field 'train_layers' = {train_layers} but the backbone has {len(layers)} layers")
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    names = []
    for i in range(len(layers) - train_layers, len(layers)):
        for name, p in layers[i].named_parameters():
            p.requires_grad_(True)
            names.append(f"encoder.layer.{i}.{name}")
    return names


def export_checkpoint(model: AlignerModel, backbone_names: list[str], path: Path) -> None:
    """save_pretrained, then replace the backbone delta by the fine-tuned layers only, stored as fp16."""
    model.save_pretrained(path)
    state = model.backbone.state_dict()
    delta = {n: state[n].detach().to("cpu", torch.float16).contiguous() for n in backbone_names}
    if delta:
        save_file(delta, str(path / DELTA_FILE), metadata={"format_version": str(FORMAT_VERSION)})
        (path / DELTA_FILE).chmod(0o644)


@contextlib.contextmanager
def interpolated(model: torch.nn.Module, start: dict[str, torch.Tensor], alpha: float) -> Iterator[None]:
    """Within the block each parameter named in ``start`` holds start + alpha · (θ − start) (WiSE-FT weight
    interpolation between the starting and the trained model); the trained θ is restored afterwards."""
    if alpha == 1.0 or not start:
        yield
        return
    params = dict(model.named_parameters())
    trained = {n: params[n].detach().clone() for n in start}
    with torch.no_grad():
        for name, value in start.items():
            params[name].lerp_(value.to(params[name].device, params[name].dtype), 1.0 - alpha)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in trained.items():
                params[name].copy_(value)


def contrastive_loss(scores: torch.Tensor, allowed: torch.Tensor, temperature: float) -> torch.Tensor:
    """Cross-entropy of query i's positive (doc i) against the allowed docs; scores/allowed [B, D]."""
    logits = (scores / temperature).masked_fill(~allowed, -math.inf)
    return F.cross_entropy(logits, torch.arange(scores.shape[0], device=scores.device))


def anchor_loss(student: torch.Tensor, teacher: torch.Tensor, allowed: torch.Tensor, temperature: float,
                teacher_temperature: float) -> torch.Tensor:
    """Mean over queries of KL(p_teacher || p_student), each a softmax over the query's allowed docs; student and
    teacher scores [B, D], allowed [B, D] bool. Gradients reach ``student`` only."""
    return ranking_kl(student, teacher, temperature, teacher_temperature, allowed)


class Trainer:
    """One training run of ``cfg`` into ``output_dir`` (see module docstring)."""

    def __init__(self, cfg: TrainConfig, output_dir: str | Path | None = None, device: str | None = None,
                 progress: bool = True):
        self.cfg = cfg
        self.out = Path(output_dir or cfg.output_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.progress = progress
        self.strategy = cfg.strategy
        self.bundle = select(load_bundle(cfg.data), cfg.train_sets, cfg.validation_sets)
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.model = build_model(cfg).to(self.device)
        if self.device.type == "cuda" and cfg.precision == "bf16":
            self.model.compute_dtype = torch.bfloat16
        self.backbone_names = freeze(self.model, cfg.train_layers)
        for side, head in (("q", self.model.q_salience), ("d", self.model.d_salience)):
            head.requires_grad_(cfg.use_salience and side in cfg.train_salience)
        self.sampler = BatchSampler(self.bundle, cfg.batch_queries, cfg.negatives_per_query, cfg.negative_depth,
                                    cfg.in_batch_negatives, cfg.seed, cfg.negative_skip, cfg.max_pseudo_queries)
        self._tokenize()
        if cfg.projection_init in ("pca", "maxsim") and cfg.init == UNTRAINED:
            self.pca_projection()
        self.projection_fit: dict[str, float] = {}
        if cfg.projection_init == "maxsim" and cfg.init == UNTRAINED:
            self.maxsim_projection()
        if cfg.projection_init == "identity" and cfg.init == "untrained":
            if cfg.dim != self.model.config.hidden_size:
                raise ValueError(f"config field 'projection_init' = 'identity' needs dim = the backbone's hidden size "
                                 f"({self.model.config.hidden_size}), got dim {cfg.dim}")
            with torch.no_grad():
                self.model.projection.weight.copy_(torch.eye(cfg.dim))
        self.strategies = cfg.strategy_mix or [self.strategy]
        self.anchor_strategy = cfg.anchor_strategy
        self.teacher = None
        if cfg.anchor_weight > 0:  # a frozen copy of the starting model
            self.teacher = copy.deepcopy(self.model).eval().requires_grad_(False)
        # anchor "fusion": the untrained backbone (whatever the starting checkpoint fine-tuned) and BM25 per training
        # corpus
        self.raw_backbone: torch.nn.Module | None = None
        self.lexical: dict[str, WordpieceBM25] = {}
        if self.teacher is not None and cfg.anchor == "fusion":
            self.raw_backbone = load_backbone(self.model.backbone_source).to(self.device).eval().requires_grad_(False)
            skip = self.model.special_ids.tolist()
            self.lexical = {name: WordpieceBM25(self.corpus_ids[name], skip)
                            for name in sorted({q.corpus for q in self.sampler.queries})}
        # every trained tensor at the start (after the projection's initialisation): weight_interpolation and the
        # L2-to-init term (over its backbone tensors) measure from it
        self.start_state = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        self.pools = self.positive_pools() if cfg.positive_top else None
        self._apply_pools()
        self.per_epoch = len(self.sampler.epoch(0))
        if self.per_epoch == 0:
            raise ValueError(f"{cfg.data}: no training batch can be formed from train_sets {cfg.train_sets}")
        self.total = self.per_epoch * cfg.epochs
        if cfg.max_steps:
            self.total = min(self.total, cfg.max_steps)
        self.optimizer = torch.optim.AdamW(self._param_groups(), lr=cfg.lr_heads)
        warmup = int(cfg.warmup_ratio * self.total)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: (s + 1) / (warmup + 1) if s < warmup else max(0.0, (self.total - s) / max(
                1, self.total - warmup)))
        self.step, self.best, self.best_step, self.mined = 0, -math.inf, -1, None
        self._epoch: tuple[int, list[list[int]]] = (-1, [])

    # ------------------------------------------------------------------ set-up
    def _tokenize(self) -> None:
        tok = self.model.tokenize
        used = {q.corpus for q in self.sampler.queries} | {v.corpus for v in self.bundle.validation.values()}
        self.corpus_ids = {name: tok(self.bundle.corpora[name].texts, is_query=False)[0] for name in sorted(used)}
        self.query_ids = tok([q.text for q in self.sampler.queries], is_query=True)[0]
        self.val_query_ids = {name: tok(list(v.queries.values()), is_query=True)[0]
                              for name, v in self.bundle.validation.items()}
        dropped = [(i, q) for i, q in enumerate(self.sampler.queries) if q.drop is not None]
        texts = []
        for _, q in dropped:
            text = self.bundle.corpora[q.corpus].texts[self.bundle.corpora[q.corpus].row[next(iter(q.positives))]]
            texts.append((text[:q.drop[0]] + " " + text[q.drop[1]:]).strip())
        # pseudo-query rows: their positive with the query's span removed
        self.positive_ids = dict(zip([i for i, _ in dropped], tok(texts, is_query=False)[0]))

    def pca_projection(self, n_docs: int = 2000) -> None:
        """Projection := top-``dim`` eigenvectors of E[h hᵀ] over L2-normalised backbone token states of up to
        ``n_docs`` training docs (a seeded sample): the linear map to ``dim`` that best keeps their cosines."""
        rows = [(name, r) for name in sorted(self.corpus_ids) for r in range(len(self.corpus_ids[name]))]
        rows = random.Random(f"{self.cfg.seed}:pca").sample(rows, min(n_docs, len(rows)))
        model, hidden = self.model, self.model.config.hidden_size
        moment = torch.zeros(hidden, hidden, dtype=torch.float64, device=self.device)
        model.eval()
        with torch.inference_mode():
            for s in range(0, len(rows), self.cfg.eval_batch_size):
                ids, att = pad_ids([self.corpus_ids[n][r] for n, r in rows[s:s + self.cfg.eval_batch_size]],
                                   model.pad_id, self.device)
                h = model.backbone(input_ids=ids, attention_mask=att).last_hidden_state.float()
                h = F.normalize(h[model.token_mask(ids, att)], dim=-1).double()
                moment += h.T @ h
        vectors = torch.linalg.eigh(moment).eigenvectors[:, -model.config.dim:].flip(-1)  # [hidden, dim]
        with torch.no_grad():
            model.projection.weight.copy_(vectors.T.float())

    def maxsim_projection(self, n_queries: int = 2048, n_docs: int = 3000, held_out: float = 0.1) -> None:
        """Projection := the PCA projection refitted (``projection_fit_steps`` steps, see projection.py) to keep
        the backbone's token MaxSim ranking of up to ``n_queries`` training queries (a seeded sample of the labelled
        ones when there are any; only their text) against up to ``n_docs`` docs of their corpus (a seeded sample plus
        their positives). The fit is kept only when its ranking KL on the sample's ``held_out`` share of queries (at
        least one per corpus) is below PCA's by more than 1e-6; ``self.projection_fit`` records both."""
        rng = random.Random(f"{self.cfg.seed}:maxsim")
        queries, bs = self.sampler.queries, self.cfg.eval_batch_size
        # real query texts where there are any: a span cut from a document ranks that document alone
        pool = [i for i, q in enumerate(queries) if q.drop is None] or list(range(len(queries)))
        picked = sorted(rng.sample(pool, min(n_queries, len(pool))))
        groups, held = [], []
        for name in sorted({queries[i].corpus for i in picked}):
            mine = [i for i in picked if queries[i].corpus == name]
            corpus, size = self.bundle.corpora[name], len(self.corpus_ids[name])
            rows = set(rng.sample(range(size), min(n_docs, size)))
            rows |= {corpus.row[d] for i in mine for d in queries[i].positives if d in corpus.row}
            docs = backbone_states(self.model, [self.corpus_ids[name][r] for r in sorted(rows)], bs)
            cut = max(1, round(held_out * len(mine))) if len(mine) > 1 else 0
            if cut:
                held.append(FitGroup(backbone_states(self.model, [self.query_ids[i] for i in mine[:cut]], bs), docs))
            groups.append(FitGroup(backbone_states(self.model, [self.query_ids[i] for i in mine[cut:]], bs), docs))
        start = self.model.projection.weight.detach().clone()
        bar = tqdm(total=self.cfg.projection_fit_steps, desc="fit projection", disable=not self.progress)
        weight, losses = fit_projection(start, groups, self.cfg.projection_fit_steps, lr=self.cfg.lr_heads,
                                        temperature=self.cfg.anchor_temperature, seed=self.cfg.seed, progress=bar)
        bar.close()
        self.projection_fit = {"steps": len(losses), "held_out_queries": sum(len(g.queries) for g in held)}
        if held:
            kl = held_out_kl(held, {"pca": start, "fitted": weight}, self.cfg.anchor_temperature)
            self.projection_fit.update(kl_pca=kl["pca"], kl_fitted=kl["fitted"])
        keep = not held or self.projection_fit["kl_fitted"] < self.projection_fit["kl_pca"] - 1e-6
        self.projection_fit["kept"] = "fitted" if keep else "pca"
        if keep:
            with torch.no_grad():
                self.model.projection.weight.copy_(weight)
        log.info("projection fitted to MaxSim: %s", self.projection_fit)

    def _train_scores(self):
        """Yield (corpus, training-query indices, exhaustive scores [len(indices), N] on the model's device)."""
        for name in sorted({q.corpus for q in self.sampler.queries}):
            docs = encode_ids(self.model, self.corpus_ids[name], False, self.cfg.eval_batch_size)
            idx = [i for i, q in enumerate(self.sampler.queries) if q.corpus == name]
            for s in range(0, len(idx), 256):
                part = idx[s:s + 256]
                queries = encode_ids(self.model, [self.query_ids[i] for i in part], True, self.cfg.eval_batch_size)
                yield self.bundle.corpora[name], part, score_all(self.model, queries, docs, self.strategy)
            del docs

    def positive_pools(self) -> list[list[str]]:
        """Per training query, the ``positive_top`` positives the starting model scores highest (exhaustive)."""
        pools: list[list[str]] = [[] for _ in self.sampler.queries]
        for corpus, part, scores in self._train_scores():
            scores = scores.cpu()
            for row, i in enumerate(part):
                positives = sorted(self.sampler.queries[i].positives)
                values = scores[row, [corpus.row[d] for d in positives]].tolist()
                ranked = sorted(zip(values, positives), key=lambda vd: (-vd[0], vd[1]))
                pools[i] = [d for _, d in ranked[:self.cfg.positive_top]]
        return pools

    def _apply_pools(self) -> None:
        for i, q in enumerate(self.sampler.queries):
            q.sample_from = self.pools[i] if self.pools else None

    def _param_groups(self) -> list[dict]:
        decay, no_decay, heads, salience = [], [], [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            if name.startswith(("q_salience.", "d_salience.")):
                salience.append(p)
            elif not name.startswith("backbone."):
                heads.append(p)
            elif p.dim() < 2:
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [{"params": heads, "lr": self.cfg.lr_heads, "weight_decay": 0.0, "name": "heads"}]
        if salience:
            groups.append({"params": salience, "lr": self.cfg.lr_salience, "weight_decay": 0.0, "name": "salience"})
        if decay:
            groups += [{"params": decay, "lr": self.cfg.lr_backbone, "weight_decay": self.cfg.weight_decay,
                        "name": "backbone"},
                       {"params": no_decay, "lr": self.cfg.lr_backbone, "weight_decay": 0.0, "name": "backbone_nd"}]
        return groups

    def _set_train_mode(self) -> None:
        """Dropout only where weights are trained: frozen layers run in eval mode."""
        self.model.train()
        layers = self.model.backbone.encoder.layer
        self.model.backbone.embeddings.eval()
        for layer in layers[:len(layers) - self.cfg.train_layers]:
            layer.eval()

    # ------------------------------------------------------------------ steps
    def batch_strategy(self, epoch: int, number: int):
        """The alignment strategy of batch ``number`` of ``epoch``: seeded draw from strategy_mix (or `strategy`)."""
        if len(self.strategies) == 1:
            return self.strategies[0]
        return random.Random(f"{self.cfg.seed}:strategy:{epoch}:{number}").choice(self.strategies)

    def _backbone_maxsim(self, backbone: torch.nn.Module, q_in: tuple, d_in: tuple) -> torch.Tensor:
        """Top-k:1 MaxSim [B, D] over ``backbone``'s L2-normalised token states (the teacher's token mask)."""
        dtype = self.teacher.compute_dtype
        autocast = torch.autocast(self.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        sides = []
        for ids, att in (q_in, d_in):
            with autocast:
                hidden = backbone(input_ids=ids, attention_mask=att).last_hidden_state
            mask = self.teacher.token_mask(ids, att)
            sides.append((F.normalize(hidden.float(), dim=-1) * mask.unsqueeze(-1), mask))
        return alignment_scores(sides[0][0], sides[0][1], sides[1][0], sides[1][1], MAXSIM)

    def teacher_scores(self, q_in: tuple, d_in: tuple, strategy, texts: tuple | None = None,
                       allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen teacher's scores [B, D] of the batch (see TrainConfig.anchor); anchor "fusion" also needs
        ``texts`` = (corpus name, query id lists, doc id lists) and the ``allowed`` [B, D] candidates it fuses over.
        The starting model scores with ``anchor_strategy`` when it is set, else with the batch's ``strategy``."""
        teacher = self.teacher
        strategy = self.anchor_strategy or strategy
        with torch.no_grad():
            if self.cfg.anchor == "backbone":
                return self._backbone_maxsim(teacher.backbone, q_in, d_in)
            q, d = teacher(*q_in, is_query=True), teacher(*d_in, is_query=False)
            sal = teacher.scores_with_salience
            own = alignment_scores(q.vectors, q.mask, d.vectors, d.mask, strategy,
                                   q.salience if sal else None, d.salience if sal else None).float()
            if self.cfg.anchor == "init":
                return own
            corpus, query_ids, doc_ids = texts
            raw = self._backbone_maxsim(self.raw_backbone, q_in, d_in)
            lexical = self.lexical[corpus].scores(query_ids, doc_ids).to(self.device)
            return in_units_of(zscore_fusion([own, raw, lexical], allowed), own, allowed)

    def train_step(self, batch, strategy=None) -> dict[str, float]:
        """One optimisation step on a Batch (alignment ``strategy``, default the config's); returns loss, accuracy
        and active salience fractions (plus the anchor and L2-to-init terms when they are on)."""
        cfg, model = self.cfg, self.model
        strategy = strategy or self.strategy
        self._set_train_mode()
        corpus = self.corpus_ids[batch.corpus]
        n = len(batch.queries)
        docs = [self.positive_ids.get(qi, corpus[batch.doc_rows[j]]) for j, qi in enumerate(batch.queries)]
        docs += [corpus[r] for r in batch.doc_rows[n:]]
        q_in = pad_ids([self.query_ids[i] for i in batch.queries], model.pad_id, self.device)
        d_in = pad_ids(docs, model.pad_id, self.device)
        q, d = model(*q_in, is_query=True), model(*d_in, is_query=False)
        sal = model.scores_with_salience
        scores = alignment_scores(q.vectors, q.mask, d.vectors, d.mask, strategy,
                                  q.salience if sal else None, d.salience if sal else None)
        allowed = torch.tensor(batch.allowed, device=self.device)
        loss = cfg.contrastive_weight * contrastive_loss(scores, allowed, cfg.temperature)
        extra = {}
        if self.teacher is not None:
            texts = (batch.corpus, [self.query_ids[i] for i in batch.queries], docs)
            teacher = self.teacher_scores(q_in, d_in, strategy, texts, allowed)
            anchor = anchor_loss(scores, teacher, allowed, cfg.temperature, cfg.anchor_temperature)
            loss = loss + cfg.anchor_weight * anchor
            extra["anchor"] = float(anchor.detach())
        if cfg.l2_init_weight > 0:
            params = dict(model.named_parameters())
            drift = sum(((params[n] - w0) ** 2).sum() for n, w0 in self.start_state.items()
                        if n.startswith("backbone."))
            loss = loss + cfg.l2_init_weight * drift
            extra["l2_init"] = float(drift.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]],
                                           cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            masked = scores.masked_fill(~allowed, -math.inf)
            acc = (masked.argmax(1) == torch.arange(len(batch.queries), device=self.device)).float().mean()
            active = [((o.salience > 1e-3) & o.mask).sum() / o.mask.sum() for o in (q, d)]
        return {"loss": float(loss.detach()), "acc": float(acc), "q_active": float(active[0]),
                "d_active": float(active[1]), **extra}

    def validate(self, model: AlignerModel | None = None) -> dict:
        """Validation nDCG@10 per set plus the selection score (mean of select_metric)."""
        model = model or self.model
        cfg = self.cfg
        sets = evaluate(model, self.bundle.validation, self.corpus_ids,
                        {n: c.docids for n, c in self.bundle.corpora.items()}, self.val_query_ids, self.strategy,
                        cfg.eval_batch_size, cfg.prune_beta_q, cfg.prune_beta_d, cfg.prune_k_per_token)
        score = sum(row[cfg.select_metric] for row in sets.values()) / max(1, len(sets))
        return {"sets": sets, "score": score}

    def mine_negatives(self) -> list[list[str]]:
        """Top negative_depth non-positive docs per training query by the current model (exhaustive)."""
        mined: list[list[str]] = [[] for _ in self.sampler.queries]
        for corpus, part, scores in self._train_scores():
            for row, i in enumerate(part):
                scores[row, [corpus.row[d] for d in self.sampler.queries[i].positives]] = -math.inf
            top = scores.topk(min(self.cfg.negative_depth, scores.shape[1]), dim=1).indices.cpu().tolist()
            for row, i in enumerate(part):
                mined[i] = [corpus.docids[j] for j in top[row]]
        return mined

    def _apply_mined(self) -> None:
        for q, negatives in zip(self.sampler.queries, self.mined):
            q.negatives = negatives

    # ------------------------------------------------------------------ persistence
    def _log(self, record: dict) -> None:
        with (self.out / LOG_FILE).open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")

    def save_state(self) -> None:
        trainable = {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        state = {"step": self.step, "best": self.best, "best_step": self.best_step, "trainable": trainable,
                 "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "rng_cpu": torch.get_rng_state(), "mined": self.mined, "pools": self.pools,
                 "config": self.cfg.to_dict(),
                 "rng_cuda": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None}
        tmp = self.out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out / STATE_FILE)

    def load_state(self) -> None:
        path = self.out / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no {STATE_FILE} in {self.out}")
        state = torch.load(path, map_location="cpu", weights_only=False)
        config = self.cfg.to_dict()  # as the state holds it
        changed = sorted(k for k, v in state["config"].items() if k not in _RESUME_FREE and config.get(k) != v)
        if changed:
            raise ValueError(f"--resume: {path} was written with a different config; changed field(s) {changed}")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state["trainable"].items():
                params[name].copy_(tensor.to(self.device))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        self.step, self.best, self.best_step, self.mined = (state["step"], state["best"], state["best_step"],
                                                            state["mined"])
        if self.mined is not None:
            self._apply_mined()
        self.pools = state["pools"]
        self._apply_pools()
        log.info("resumed %s at step %d of %d", self.out, self.step, self.total)

    # ------------------------------------------------------------------ run
    def interpolated(self, alpha: float | None = None) -> contextlib.AbstractContextManager:
        """The model at weight_interpolation (or ``alpha``) between its start and its trained weights, for a block."""
        return interpolated(self.model, self.start_state, self.cfg.weight_interpolation if alpha is None else alpha)

    def _evaluate_and_keep(self, epoch: int) -> dict:
        start = time.time()
        with self.interpolated():
            result = self.validate()
            improved = result["score"] > self.best
            if improved:
                self.best, self.best_step = result["score"], self.step
                export_checkpoint(self.model, self.backbone_names, self.out / "best")
        record = {"event": "validation", "step": self.step, "epoch": epoch, **result, "best": self.best,
                  "improved": improved, "seconds": round(time.time() - start, 2)}
        self._log(record)
        log.info("step %d validation %s score %.4f%s", self.step,
                 {n: round(r["ndcg@10"], 4) for n, r in result["sets"].items()}, result["score"],
                 " (best)" if improved else "")
        return record

    def run(self, resume: bool = False, stop_after: int | None = None) -> dict:
        """Train to the end (or for ``stop_after`` more steps, keeping a resumable state); returns the summary."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        if resume:
            self.load_state()
        else:
            if (self.out / LOG_FILE).exists():
                (self.out / LOG_FILE).unlink()
            import yaml

            (self.out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
            self._log({"event": "start", "config": cfg.to_dict(), "device": str(self.device),
                       "steps": self.total, "steps_per_epoch": self.per_epoch,
                       "train_queries": len(self.sampler.queries), "backbone_tensors": len(self.backbone_names)})
            self._evaluate_and_keep(0)
        stop = self.total if stop_after is None else min(self.total, self.step + stop_after)
        bar = tqdm(total=self.total, initial=self.step, desc="train", unit="step", disable=not self.progress)
        started, running = time.time(), []
        while self.step < stop:
            epoch, number = divmod(self.step, self.per_epoch)
            if cfg.model_negatives_after_epoch == epoch and self.mined is None and number == 0:
                self.mined = self.mine_negatives()
                self._apply_mined()
                self._log({"event": "mined_negatives", "step": self.step, "epoch": epoch})
            if self._epoch[0] != epoch:
                self._epoch = (epoch, self.sampler.epoch(epoch))
            batch = self.sampler.batch(self._epoch[1][number], epoch, number)
            stats = self.train_step(batch, self.batch_strategy(epoch, number))
            self.step += 1
            running.append(stats["loss"])
            bar.update(1)
            bar.set_postfix(loss=f"{sum(running[-20:]) / len(running[-20:]):.3f}")
            if self.step % cfg.log_every == 0 or self.step == self.total:
                lrs = {g["name"]: g["lr"] for g in self.optimizer.param_groups}
                self._log({"event": "train", "step": self.step, "epoch": epoch, **stats, "lr": lrs,
                           "elapsed_s": round(time.time() - started, 2)})
            epoch_end = self.step % self.per_epoch == 0 or self.step == self.total
            if (cfg.eval_every and self.step % cfg.eval_every == 0) or (epoch_end and not cfg.eval_every) \
                    or self.step == self.total:
                self._evaluate_and_keep(epoch)
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or epoch_end or self.step == stop:
                self.save_state()
        bar.close()
        if self.step < self.total:
            return {"finished": False, "step": self.step, "steps": self.total}
        with self.interpolated():
            export_checkpoint(self.model, self.backbone_names, self.out / "last")
        summary = {"finished": True, "steps": self.total, "best_step": self.best_step, "best_score": self.best,
                   "select_metric": cfg.select_metric}
        if self.projection_fit:
            summary["projection_fit"] = self.projection_fit
        if (self.out / "best").is_dir():  # the shipped form (fp16 delta) re-validated
            reloaded = load_model(self.out / "best", self.device, self.model.compute_dtype)
            summary["best_reloaded"] = self.validate(reloaded)
            del reloaded
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        self._log({"event": "done", **summary})
        return summary

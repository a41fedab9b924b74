"""Training configuration: a flat dataclass read from YAML; bad values raise ValueError naming the field."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from pyserini_aligner.strategy import MAXSIM, Strategy, as_strategy

PRECISIONS = ("bf16", "fp32")
SALIENCE_MODES = ("lp", "relu", "hard")
PROJECTION_INITS = ("random", "pca", "maxsim", "identity")
ANCHORS = ("backbone", "init", "fusion")
SELECT_METRICS = ("ndcg@10", "ndcg@10_pruned")
OBJECTIVES = ("contrastive", "salience_distill")


@dataclass
class TrainConfig:
    """Everything one training run needs; YAML keys are these field names."""

    # data: a bundle written by ``python -m pyserini_aligner.train.prepare``
    data: str = "runs/train_data/bundle.json.gz"
    train_sets: list[str] = field(default_factory=lambda: ["scifact", "nfcorpus"])
    validation_sets: list[str] = field(default_factory=lambda: ["nfcorpus-dev", "scifact-heldout"])
    output_dir: str = "runs/train"
    # model: "untrained" = MiniLM + seeded Gaussian projection (make_default's init), or a checkpoint: a shipped
    # name ("aligner", "aligner-mix") or a folder
    init: str = "untrained"
    dim: int = 128
    query_maxlen: int = 64
    doc_maxlen: int = 256
    keep_special: bool = True
    use_salience: bool = True
    salience_in_score: bool = True  # False: saliences only choose the tokens kept by pruning
    salience_mode: str = "lp"
    alpha_q: float = 0.5
    alpha_d: float = 0.4
    eps: float = 0.002
    strategy: Strategy = MAXSIM
    train_layers: int = 2  # top transformer layers fine-tuned (0 = heads only)
    projection_init: str = "random"  # with init "untrained": "random" (seed-0 Gaussian, as make_default) | "pca"
    # | "maxsim" (PCA, then fitted without labels to keep the backbone's own token MaxSim ranking of the training
    # corpora; see projection.py) | "identity" (dim = hidden size: raw backbone token states, the untrained MaxSim floor)
    projection_fit_steps: int = 400  # projection_init "maxsim": optimisation steps of the fit
    description: str = ""
    # optimisation
    objective: str = "contrastive"  # or "salience_distill" (frozen encoder, salience heads only; see distill.py)
    distill_rank: int = 500  # salience_distill: τ = similarity of a query token's distill_rank-th nearest doc token
    seed: int = 13
    epochs: int = 2
    max_steps: int = 0  # > 0 stops after this many steps
    batch_queries: int = 32
    negatives_per_query: int = 3
    negative_depth: int = 30  # BM25 (or model) negatives are drawn from ranks [negative_skip, negative_depth)
    negative_skip: int = 0  # of the non-positive hits (skipping the top ones avoids unjudged relevant docs)
    positive_top: int = 0  # > 0: sample positives only among the positive_top ones the initial model scores highest
    in_batch_negatives: bool = True
    max_pseudo_queries: int = 0  # > 0: per epoch a fresh seeded sample of at most this many of each label-free set
    temperature: float = 0.02
    contrastive_weight: float = 1.0  # weight of the cross-entropy on the labelled (or pseudo-) positive; 0 with an
    # anchor trains on the teacher's ranking alone
    # per batch one of these (seeded); [] = always `strategy`
    strategy_mix: list[Strategy] = field(default_factory=list)
    # anchor: + anchor_weight * KL(teacher || student) over each query's batch candidates; the teacher is frozen:
    # "backbone" = the starting backbone's L2-normalised token states (hidden size), top-k:1 MaxSim;
    # "init" = the starting model itself (its projection) under the batch's strategy; "fusion" = the mean of per-query
    # z-scores of "init", the untrained backbone's MaxSim and wordpiece BM25 (teacher.py), in "init"'s units
    anchor: str = "backbone"
    anchor_weight: float = 0.0
    # anchor "init" / "fusion": the alignment the starting model scores with as teacher; None ("" in YAML) = the
    # batch's strategy. "top-k:1" with a strategy_mix teaches each top-p batch the starting model's top-k:1 ranking
    anchor_strategy: Strategy | None = None
    anchor_temperature: float = 0.02  # the teacher's softmax temperature (the student's is `temperature`)
    l2_init_weight: float = 0.0  # + l2_init_weight * Σ ||θ − θ₀||² over the trained backbone weights (L2-SP)
    # validated and exported weights: θ₀ + weight_interpolation · (θ − θ₀) over every trained tensor (WiSE-FT);
    # 1.0 keeps the trained weights, lower values stay closer to the starting model off the training domain
    weight_interpolation: float = 1.0
    lr_backbone: float = 2e-5
    lr_heads: float = 1e-3  # projection
    lr_salience: float = 1e-3  # salience heads
    train_salience: list[str] = field(default_factory=lambda: ["q", "d"])  # heads trained; others keep their init
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    precision: str = "bf16"  # autocast dtype on CUDA (CPU always runs fp32)
    model_negatives_after_epoch: int = -1  # >= 0: after that many epochs, re-mine negatives with the model
    # validation and checkpoints
    eval_every: int = 0  # steps between validations (0 = at epoch ends only); step 0 is always validated
    checkpoint_every: int = 0  # steps between resume states (0 = at epoch ends only)
    log_every: int = 10
    eval_batch_size: int = 128
    prune_beta_d: float = 0.2  # pruned-search proxy in validation (β^d, β^q, FAISS neighbours per query token)
    prune_beta_q: float = 0.5
    prune_k_per_token: int = 100
    select_metric: str = "ndcg@10"  # mean of this over validation_sets picks the 'best' checkpoint

    def validate(self, source: str = "TrainConfig") -> None:
        """Raise ValueError naming ``source`` and the offending field."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{source}: field '{name}' = {getattr(self, name)!r} {why}")

        for name, hint in get_type_hints(TrainConfig).items():
            value = getattr(self, name)
            if not _is_type(value, hint):
                raise bad(name, f"must be of type {_type_name(hint)}")
        positive = ("dim", "query_maxlen", "doc_maxlen", "epochs", "batch_queries", "negative_depth",
                    "log_every", "eval_batch_size", "prune_k_per_token")
        for name in positive:
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        for name in ("train_layers", "max_steps", "negatives_per_query", "negative_skip", "positive_top", "eval_every",
                     "checkpoint_every", "max_pseudo_queries", "projection_fit_steps"):
            if getattr(self, name) < 0:
                raise bad(name, "must be >= 0")
        if self.query_maxlen < 3 or self.doc_maxlen < 3:
            raise bad("query_maxlen" if self.query_maxlen < 3 else "doc_maxlen", "must be >= 3")
        for name in ("alpha_q", "alpha_d", "prune_beta_d", "prune_beta_q"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise bad(name, "must be in (0, 1]")
        for name in ("eps", "temperature", "anchor_temperature"):
            if not getattr(self, name) > 0.0:
                raise bad(name, "must be > 0")
        if self.negative_skip >= self.negative_depth:
            raise bad("negative_skip", f"must be < negative_depth ({self.negative_depth})")
        if not set(self.train_salience) <= {"q", "d"}:
            raise bad("train_salience", "may only list 'q' and 'd'")
        for name in ("lr_backbone", "lr_heads", "lr_salience", "weight_decay", "grad_clip", "anchor_weight",
                     "l2_init_weight", "contrastive_weight"):
            if getattr(self, name) < 0.0:
                raise bad(name, "must be >= 0")
        if not 0.0 < self.weight_interpolation <= 1.0:
            raise bad("weight_interpolation", "must be in (0, 1]")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise bad("warmup_ratio", "must be in [0, 1)")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"must be one of {PRECISIONS}")
        if self.projection_init not in PROJECTION_INITS:
            raise bad("projection_init", f"must be one of {PROJECTION_INITS}")
        if self.anchor not in ANCHORS:
            raise bad("anchor", f"must be one of {ANCHORS}")
        if self.salience_mode not in SALIENCE_MODES:
            raise bad("salience_mode", f"must be one of {SALIENCE_MODES}")
        if self.objective not in OBJECTIVES:
            raise bad("objective", f"must be one of {OBJECTIVES}")
        if self.objective == "salience_distill" and (self.init == "untrained" or not self.use_salience):
            raise bad("objective", "salience_distill needs a trained checkpoint as init and use_salience: true")
        if self.objective == "contrastive" and self.contrastive_weight == 0 and self.anchor_weight == 0:
            raise bad("contrastive_weight", "is 0 and so is anchor_weight: nothing would be trained")
        if self.distill_rank < 1:
            raise bad("distill_rank", "must be >= 1")
        if self.select_metric not in SELECT_METRICS:
            raise bad("select_metric", f"must be one of {SELECT_METRICS}")
        if not self.train_sets:
            raise bad("train_sets", "must name at least one training set")
        if self.model_negatives_after_epoch < -1:
            raise bad("model_negatives_after_epoch", "must be -1 (never) or an epoch count >= 0")
        if self.anchor_strategy and self.anchor == "backbone":
            raise bad("anchor_strategy", "applies to anchor 'init' and 'fusion' only (the backbone anchor is "
                                         "top-k:1 MaxSim)")

    def to_dict(self) -> dict[str, Any]:
        """The fields as YAML holds them (strategies as their strings, no anchor_strategy as "")."""
        return {**dataclasses.asdict(self), "strategy": str(self.strategy),
                "strategy_mix": [str(s) for s in self.strategy_mix],
                "anchor_strategy": "" if self.anchor_strategy is None else str(self.anchor_strategy)}

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> "TrainConfig":
        """Build and validate; unknown keys raise ValueError naming ``source`` and the key."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of field: value, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; known fields: {known}")
        hints = get_type_hints(cls)
        values = {name: (float(v) if hints[name] is float and type(v) is int else v) for name, v in data.items()}
        if values.get("anchor_strategy") == "":
            values["anchor_strategy"] = None  # the batch's strategy
        for name in ("strategy", "strategy_mix", "anchor_strategy"):  # the strategies, parsed once here
            specs = values.get(name)
            try:
                if isinstance(specs, str):
                    values[name] = as_strategy(specs)
                elif name == "strategy_mix" and isinstance(specs, list):
                    values[name] = [as_strategy(s) if isinstance(s, str) else s for s in specs]
            except ValueError as err:
                raise ValueError(f"{source}: field '{name}' = {specs!r} holds no alignment strategy ({err})") from None
        config = cls(**values)
        config.validate(source)
        return config


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
    """TrainConfig from a YAML file, then ``overrides`` ("field=value", value parsed as YAML) on top."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training config not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML ({err})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of field: value, got {type(data).__name__}")
    for item in overrides or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--set {item!r}: expected field=value")
        data[name.strip()] = yaml.safe_load(value)
    return TrainConfig.from_dict(data, source=str(path))


# model fields a run adapting a checkpoint takes from it (config field -> checkpoint config field)
INIT_MODEL_FIELDS = {"dim": "dim", "query_maxlen": "query_maxlen", "doc_maxlen": "doc_maxlen",
                     "keep_special": "keep_special", "use_salience": "use_salience",
                     "salience_in_score": "salience_in_score", "salience_mode": "salience_mode", "alpha_q": "alpha_q",
                     "alpha_d": "alpha_d", "eps": "eps", "strategy": "default_strategy", "description": "description"}


def init_model_fields(init: str | os.PathLike) -> dict[str, Any]:
    """The INIT_MODEL_FIELDS of checkpoint ``init`` (a folder or a shipped checkpoint's name), as TrainConfig
    values."""
    from pyserini_aligner.checkpoints import checkpoint_folder
    from pyserini_aligner.model import AlignerConfig

    folder = checkpoint_folder(init)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"init {init}: not an AligneR checkpoint folder (no config.json)")
    config = AlignerConfig.load(folder / "config.json").to_dict()
    return {field: config[source] for field, source in INIT_MODEL_FIELDS.items()}


def _is_type(value: Any, hint: Any) -> bool:
    if get_origin(hint) is list:
        (item,) = get_args(hint)
        return isinstance(value, list) and all(_is_type(v, item) for v in value)
    if hint is float:
        return isinstance(value, float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if get_origin(hint) is list:
        return f"list of {_type_name(get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))

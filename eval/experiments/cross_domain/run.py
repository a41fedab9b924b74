"""Cross-domain recipe choice (validation only), final training, label-free adaptation, then one test evaluation.

Stages (each writes results.json so far):
1. baselines on validation: the untrained backbone's raw 384-d token MaxSim (``raw384``), 128-d MaxSim under a
   PCA projection fitted on both corpora (``pca128``) and under that projection refitted to keep raw384's ranking of
   both corpora's training query texts (``fit128``, no labels);
2. per recipe, a SciFact-only and an NFCorpus-only run (last checkpoint, fp16 delta reloaded), each validated
   in-domain (SciFact held-out, NFCorpus dev) and off-domain (every labelled query of the other collection that the
   run never saw: ``OFF_VALIDATION``); a recipe named ``<recipe>@<alpha>`` is ``<recipe>``
   with ``weight_interpolation: alpha`` (WiSE-FT), exported from the same run as ``<recipe>``;
3. the recipe choice (:func:`choose_recipe`);
4. label-free adaptation of each single-domain model of that recipe to the other corpus (pseudo-queries of that
   corpus, anchored to the model it starts from or to the fused teacher), one run per candidate setting in
   ``ADAPTATIONS``, validated on the other corpus; the setting with the best mean validation gain is kept
   (``validation_only`` stops here); with a fused-teacher setting, the teacher and its parts are first ranked on
   the target's validation queries (``Evaluator.teachers``);
5. the final run of that recipe on both training sets (best checkpoint by the mean of both validation sets);
6. only now the test file is opened: nDCG@10 on SciFact / NFCorpus test of every model above (and of the shipped
   checkpoint, for reference), and the top-p response (top-k:1 against top-p values, p chosen on validation) of
   raw384 and the final model;
7. salience heads for pruning on the final model (as the shipped checkpoint), exported as ``checkpoint/``.
Separately, :meth:`Experiment.refine` trains the shipped checkpoint further under alignment mixes (``REFINEMENTS``),
chooses one on validation (:func:`choose_refinement`) and only then tests it (the ``aligner-mix`` checkpoint).
All scoring is exhaustive (every query against every document, all tokens, fp32 vectors).
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from pyserini_aligner.model import AlignerModel
from pyserini_aligner.resolve import load_model
from pyserini_aligner.strategy import MAXSIM, Strategy
from pyserini_aligner.train.config import TrainConfig, init_model_fields
from pyserini_aligner.train.data import Bundle, ValidationSet, load_bundle, read_gzip_json
from pyserini_aligner.train.loop import Trainer, export_checkpoint
from pyserini_aligner.train.teacher import WordpieceBM25, zscore_fusion
from pyserini_aligner.train.validate import Encoded, mean_ndcg10, score_all, top_docids

log = logging.getLogger(__name__)
CONFIGS = Path(__file__).resolve().parents[3] / "pyserini_aligner" / "train" / "configs"
BASE_CONFIG = CONFIGS / "aligner_default.yaml"
ADAPT_CONFIG = CONFIGS / "unsupervised.yaml"
SALIENCE_CONFIG = CONFIGS / "aligner_salience.yaml"
TEST_FORMAT = "pyserini-aligner-test-sets"
DOMAINS = ("scifact", "nfcorpus")
VALIDATION = {"scifact": "scifact-heldout", "nfcorpus": "nfcorpus-dev"}
TEST = {"scifact": "scifact-test", "nfcorpus": "nfcorpus-test"}
# off-domain validation: a single-domain model is judged on every labelled query of the other collection that it
# never saw (that collection's training queries and its validation queries), floors and adaptation gains likewise
OFF_VALIDATION = {"scifact": "scifact-train-all", "nfcorpus": "nfcorpus-train-dev"}
OTHER = {"scifact": "nfcorpus", "nfcorpus": "scifact"}
# top-p values of the response check: p of a document's m tokens (at least 1), so with doc_maxlen 256 any p below
# 2/256 aligns every query token with one doc token, as top-k:1 does
TOP_P = (0.01, 0.02, 0.03, 0.05)
# untrained baselines (fields over aligner_default.yaml): raw 384-d token MaxSim, 128-d under PCA, 128-d under the
# projection fitted to keep raw384's ranking of both corpora's training query texts
BASELINES: dict[str, dict[str, Any]] = {"raw384": {"projection_init": "identity"}, "pca128": {"projection_init": "pca"},
                                        "fit128": {"projection_init": "maxsim"}}
# per-batch strategies of the "mix" recipes: top-k:1 half the time, top-p the rest (the paper trains with several)
MIX = ["top-k:1", "top-k:1", "top-p:0.01", "top-p:0.02"]
_ANCHOR = {"anchor": "backbone", "anchor_weight": 1.0, "anchor_temperature": 0.02}
_WIDE = {"dim": 384, "projection_init": "identity"}  # MiniLM's hidden size
# (fields over aligner_default.yaml; "label_free": the training corpus's own label-free sets mixed in)
RECIPES: dict[str, dict[str, Any]] = {
    "default": {},  # the shipped recipe (aligner_default.yaml)
    "anchor": {**_ANCHOR},
    "anchor-mix": {**_ANCHOR, "strategy_mix": MIX},
    "anchor-mix-l2": {**_ANCHOR, "strategy_mix": MIX, "train_layers": 2, "lr_backbone": 2.0e-5,
                      "l2_init_weight": 1.0},
    "anchor-mix-pseudo": {**_ANCHOR, "strategy_mix": MIX, "label_free": ["pseudo"], "max_pseudo_queries": 256},
    "default-l1": {"train_layers": 1},
    "default-pseudo": {"label_free": ["pseudo", "titles"], "max_pseudo_queries": 512},
    "anchor-pseudo": {**_ANCHOR, "anchor_weight": 0.3, "label_free": ["pseudo", "titles"], "max_pseudo_queries": 512},
    # the projection refitted (no labels) to keep the backbone's 384-d MaxSim ranking, then trained as the others
    "fit": {"projection_init": "maxsim"},
    "fit-anchor": {"projection_init": "maxsim", **_ANCHOR, "anchor_weight": 0.3},
    "fit-anchor-pseudo": {"projection_init": "maxsim", **_ANCHOR, "anchor_weight": 0.3,
                          "label_free": ["pseudo", "titles"], "max_pseudo_queries": 512},
    "distill-mix-pseudo": {"anchor": "backbone", "anchor_weight": 4.0, "anchor_temperature": 0.02,
                           "strategy_mix": MIX, "label_free": ["pseudo", "titles"], "max_pseudo_queries": 512},
    # the backbone's own 384-d token space (no projection): step 0 is the untrained raw384 floor
    "wide": {**_WIDE},
    "wide-l2": {**_WIDE, "l2_init_weight": 1.0},
    "wide-anchor": {**_WIDE, **_ANCHOR, "anchor_weight": 0.3},
    "wide-anchor-pseudo": {**_WIDE, **_ANCHOR, "anchor_weight": 0.3, "label_free": ["pseudo", "titles"],
                           "max_pseudo_queries": 512},
    "wide-mix": {**_WIDE, "strategy_mix": MIX},
    # less drift from the start: half the epochs, or the projection moved ten times more slowly
    "wide-e4": {**_WIDE, "epochs": 4},
    "wide-slow-projection": {**_WIDE, "lr_heads": 1.0e-4},
}
DEFAULT_RECIPES = ("default", "default-pseudo", "anchor-pseudo")
REFINED_DESCRIPTION = ("AligneR over all-MiniLM-L6-v2 trained under a mix of alignments: the shipped aligner "
                       "checkpoint trained further on SciFact train + NFCorpus train with top-k:1 and top-p batches, "
                       "each top-p batch also taught the starting checkpoint's top-k:1 ranking; salience heads "
                       "trained for pruning by MaxSim-usage distillation with the encoder frozen; use_salience=true, "
                       "salience_in_score=false (u chooses pruned tokens only). See README.md.")
# continued training of the shipped checkpoint on both training sets (fields over aligner_default.yaml) under the
# alignment mix: its top-p batches learn from the labels alone ("mix") or also from the starting model's top-k:1
# ranking ("mix-self": anchored to the shipped checkpoint as it scores with top-k:1)
_REFINE = {"init": "aligner", "epochs": 2, "lr_backbone": 1.0e-5, "lr_heads": 1.0e-4,
           "description": REFINED_DESCRIPTION}
_SELF = {"anchor": "init", "anchor_weight": 1.0, "anchor_strategy": "top-k:1"}
_MIX_P = ["top-k:1", "top-p:0.01", "top-p:0.02", "top-p:0.03"]  # top-p in three batches of four
REFINEMENTS: dict[str, dict[str, Any]] = {
    "mix": {**_REFINE, "strategy_mix": MIX},
    "mix-self": {**_REFINE, **_SELF, "strategy_mix": MIX},
    "mix-self-p": {**_REFINE, **_SELF, "strategy_mix": _MIX_P},
    "mix-self-p-e4": {**_REFINE, **_SELF, "strategy_mix": _MIX_P, "epochs": 4},
    "mix-self-p-a2": {**_REFINE, **_SELF, "strategy_mix": _MIX_P, "anchor_weight": 2.0},
    "mix-self-p-a2-e4": {**_REFINE, **_SELF, "strategy_mix": _MIX_P, "anchor_weight": 2.0, "epochs": 4},
}
# label-free adaptation settings (fields over unsupervised.yaml; "sets": the target corpus's label-free sets used)
ADAPTATIONS: dict[str, dict[str, Any]] = {
    "anchored": {"sets": ["pseudo"]},  # unsupervised.yaml as it is
    "titles": {"sets": ["pseudo", "titles"]},
    "strong": {"sets": ["pseudo"], "anchor_weight": 0.3, "lr_backbone": 3.0e-5, "lr_heads": 3.0e-4, "epochs": 3},
    "strong-titles": {"sets": ["pseudo", "titles"], "anchor_weight": 0.3, "lr_backbone": 3.0e-5, "lr_heads": 3.0e-4,
                      "epochs": 3},
    # towards the fused teacher (the model, the untrained backbone's MaxSim and BM25; teacher.py), with and without
    # the pseudo-positive's cross-entropy
    "fused": {"sets": ["pseudo", "titles"], "anchor": "fusion", "lr_backbone": 3.0e-5, "lr_heads": 3.0e-4,
              "epochs": 3},
    "fused-distill": {"sets": ["pseudo", "titles"], "anchor": "fusion", "contrastive_weight": 0.0,
                      "lr_backbone": 3.0e-5, "lr_heads": 3.0e-4, "epochs": 3},
}
DEFAULT_ADAPTATIONS = tuple(ADAPTATIONS)
FUSION_POOL = 100  # the fused teacher's probe fuses each query's pool: the union of every scorer's top FUSION_POOL
IN_DOMAIN_TOLERANCE = 0.005  # a recipe may lose at most this much mean in-domain validation nDCG@10 to "default"
ADAPT_QUERIES = 2048  # pseudo-queries per adaptation epoch
# README numbers this experiment is read against: dense MiniLM and the shipped checkpoint on test
REFERENCE = {"dense": {"scifact": 0.6451, "nfcorpus": 0.3159}, "shipped": {"scifact": 0.7768, "nfcorpus": 0.3741}}


def split_recipe(name: str) -> tuple[str, float]:
    """"<recipe>@<alpha>" -> (recipe, alpha); a plain recipe name has alpha 1 (ValueError when unknown)."""
    base, sep, alpha = name.partition("@")
    try:
        value = float(alpha) if sep else 1.0
    except ValueError:
        value = -1.0
    if base not in RECIPES or not 0.0 < value <= 1.0:
        raise ValueError(f"--recipes: {name!r} is not <recipe> or <recipe>@<alpha> with alpha in (0, 1]; "
                         f"recipes: {sorted(RECIPES)}")
    return base, value


def off_domain_sets(bundle: Bundle) -> dict[str, ValidationSet]:
    """OFF_VALIDATION sets: each collection's labelled training queries plus its validation queries."""
    out = {}
    for domain, name in OFF_VALIDATION.items():
        vset = bundle.validation[VALIDATION[domain]]
        train = [q for q in bundle.train.get(domain, []) if q.drop is None]
        out[name] = ValidationSet(name, domain, {**{q.qid: q.text for q in train}, **vset.queries},
                                  {**{q.qid: dict(q.positives) for q in train}, **vset.qrels})
    return out


def load_test_sets(path: Path) -> dict[str, ValidationSet]:
    """The test sets of ``prepare.write_test_sets`` (ValueError naming the file when it is not one)."""
    data = read_gzip_json(path, "test-set file", TEST_FORMAT)
    return {name: ValidationSet(name, s["corpus"], s["queries"], s["qrels"]) for name, s in data["sets"].items()}


def choose_recipe(scores: dict[str, dict[str, dict[str, float]]], floors: dict[str, float],
                  control: str = "default", tolerance: float = IN_DOMAIN_TOLERANCE) -> tuple[str, str]:
    """The recipe that wins off-domain without losing in-domain, and why.

    scores: recipe -> training domain -> {"in": nDCG@10 on its own validation set, "off": on the other domain's
    off-domain validation set}; floors: domain -> the best untrained baseline on that domain's off-domain set. A recipe qualifies when each
    single-domain model's off-domain score reaches that domain's floor and its mean in-domain score is at most
    ``tolerance`` below ``control``'s (when the control ran); the qualifying recipe with the best mean off-domain
    score wins. Without a qualifying recipe: the best mean off-domain score among those keeping in-domain.
    """
    def mean(recipe: str, key: str) -> float:
        return sum(scores[recipe][d][key] for d in scores[recipe]) / len(scores[recipe])

    keeps = {r for r in scores if control not in scores or mean(r, "in") >= mean(control, "in") - tolerance}
    floor_ok = {r for r in scores if all(scores[r][d]["off"] >= floors[OTHER[d]] for d in scores[r])}
    for pool, why in ((keeps & floor_ok, "best mean off-domain among recipes at the untrained floor off-domain "
                                         "and within tolerance of the control in-domain"),
                      (keeps, "no recipe reached the untrained floor off-domain in both directions; best mean "
                              "off-domain among those within tolerance in-domain"),
                      (set(scores), "best mean off-domain")):
        if pool:
            return max(sorted(pool), key=lambda r: mean(r, "off")), why
    raise ValueError("no recipe was run")


def best_top_p_drop(scores: dict[str, float]) -> float:
    """The best top-p nDCG@10 minus top-k:1 in ``scores`` (strategy -> nDCG@10 of one query set)."""
    return max(v for s, v in scores.items() if s.startswith("top-p:")) - scores["top-k:1"]


def choose_refinement(validation: dict[str, dict[str, dict[str, float]]],
                      tolerance: float = IN_DOMAIN_TOLERANCE) -> tuple[str | None, str]:
    """The refinement that keeps the backbone's top-p response without losing in-domain, and why.

    validation: model -> in-domain validation set -> strategy -> nDCG@10, for "raw384", "shipped" and each
    refinement. A refinement qualifies when, on every set, its best top-p is no further below its top-k:1 than
    raw384's is, and its mean top-k:1 is at most ``tolerance`` below the shipped checkpoint's; the qualifying one
    with the best mean top-k:1 wins. None when none qualifies.
    """
    def mean(name: str) -> float:
        return sum(v["top-k:1"] for v in validation[name].values()) / len(validation[name])

    qualifying = [r for r in sorted(validation) if r not in ("raw384", "shipped")
                  and mean(r) >= mean("shipped") - tolerance
                  and all(best_top_p_drop(v) >= best_top_p_drop(validation["raw384"][s])
                          for s, v in validation[r].items())]
    if not qualifying:
        return None, ("no refinement kept raw384's top-p response on every validation set within tolerance of the "
                      "shipped checkpoint's top-k:1")
    return max(qualifying, key=mean), ("best mean top-k:1 among refinements keeping raw384's top-p response, within "
                                       "tolerance of the shipped checkpoint")


class Evaluator:
    """Exhaustive nDCG@10 of a model on named query sets over the bundle's corpora (tokenisation cached)."""

    def __init__(self, bundle: Bundle, device: torch.device, batch_size: int = 128):
        self.bundle, self.device, self.batch_size = bundle, device, batch_size
        self.sets: dict[str, ValidationSet] = {**bundle.validation, **off_domain_sets(bundle)}
        self._tokens: dict[tuple, list[list[int]]] = {}

    def _ids(self, model: AlignerModel, key: tuple, texts: list[str], is_query: bool) -> list[list[int]]:
        key = (*key, model.config.query_maxlen if is_query else model.config.doc_maxlen)
        if key not in self._tokens:
            self._tokens[key] = model.tokenize(texts, is_query=is_query)[0]
        return self._tokens[key]

    def _encode(self, model: AlignerModel, ids: list[list[int]], is_query: bool) -> Encoded:
        return Encoded(*model.encode_token_ids(ids, is_query, self.batch_size, torch.float32))

    def ndcg(self, model: AlignerModel, names: list[str], strategies: tuple[Strategy, ...] = (MAXSIM,)
             ) -> dict[str, dict[str, float]]:
        """set name -> strategy -> mean nDCG@10 (each corpus encoded once)."""
        model.to(self.device).eval()
        out: dict[str, dict[str, float]] = {}
        for corpus in sorted({self.sets[n].corpus for n in names}):
            texts = self.bundle.corpora[corpus].texts
            docs = self._encode(model, self._ids(model, ("doc", corpus), texts, False), False)
            for name in [n for n in names if self.sets[n].corpus == corpus]:
                vset = self.sets[name]
                queries = self._encode(model, self._ids(model, ("query", name), list(vset.queries.values()), True),
                                       True)
                out[name] = {}
                for strategy in strategies:
                    out[name][str(strategy)] = self.rank(name, score_all(model, queries, docs, strategy))
            del docs
        return out

    def matrix(self, model: AlignerModel, name: str) -> torch.Tensor:
        """Top-k:1 scores [Q, N] (CPU, float32) of set ``name``'s queries against its whole corpus."""
        model.to(self.device).eval()
        vset = self.sets[name]
        docs = self._encode(model, self._ids(model, ("doc", vset.corpus), self.bundle.corpora[vset.corpus].texts,
                                             False), False)
        queries = self._encode(model, self._ids(model, ("query", name), list(vset.queries.values()), True), True)
        return score_all(model, queries, docs, MAXSIM).float().cpu()

    def lexical(self, model: AlignerModel, name: str) -> torch.Tensor:
        """BM25 scores [Q, N] over ``model``'s wordpieces (as the fused teacher scores) of set ``name``."""
        vset = self.sets[name]
        docs = self._ids(model, ("doc", vset.corpus), self.bundle.corpora[vset.corpus].texts, False)
        queries = self._ids(model, ("query", name), list(vset.queries.values()), True)
        return WordpieceBM25(docs, model.special_ids.tolist()).scores(queries, docs)

    def rank(self, name: str, scores: torch.Tensor) -> float:
        """Mean nDCG@10 of the ranking ``scores`` [Q, N] of set ``name``."""
        vset = self.sets[name]
        return round(mean_ndcg10(top_docids(scores, list(vset.queries), self.bundle.corpora[vset.corpus].docids),
                                 vset.qrels), 4)

    def teachers(self, model: AlignerModel, raw: AlignerModel, name: str) -> dict[str, float]:
        """nDCG@10 on set ``name`` of the fused teacher's parts (the model, the untrained backbone's MaxSim, BM25),
        of each pair of them and of all three ("fusion", the teacher itself); a fusion ranks each query's pool, the
        union of its parts' top FUSION_POOL."""
        parts = {"model": self.matrix(model, name), "raw384": self.matrix(raw, name), "bm25": self.lexical(model, name)}
        out = {k: self.rank(name, v) for k, v in parts.items()}
        for combo in (("model", "raw384"), ("model", "bm25"), ("raw384", "bm25"), tuple(parts)):
            pool = torch.zeros(parts["model"].shape, dtype=torch.bool)
            for part in combo:
                pool.scatter_(1, parts[part].topk(min(FUSION_POOL, pool.shape[1]), dim=1).indices, True)
            fused = zscore_fusion([parts[p] for p in combo], pool).masked_fill(~pool, -float("inf"))
            out["fusion" if len(combo) == len(parts) else "+".join(combo)] = self.rank(name, fused)
        return out


class Experiment:
    """One run of the whole experiment into ``output`` (see module docstring)."""

    def __init__(self, bundle_dir: Path, output: Path, recipes: list[str], overrides: dict[str, Any],
                 device: str | None = None, progress: bool = True, salience: bool = True,
                 export: Path | None = None, adaptations: list[str] | None = None, validation_only: bool = False):
        self.data = bundle_dir / "bundle.json.gz"
        self.test_path = bundle_dir / "test.json.gz"
        for path in (self.data, self.test_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing (make it with python -m "
                                        "eval.experiments.cross_domain.prepare --output <dir>)")
        if not recipes:
            raise ValueError(f"--recipes: name at least one of {sorted(RECIPES)}")
        for recipe in recipes:
            split_recipe(recipe)
        adaptations = list(DEFAULT_ADAPTATIONS if adaptations is None else adaptations)
        unknown = [a for a in adaptations if a not in ADAPTATIONS]
        if unknown:
            raise ValueError(f"--adaptations: unknown setting(s) {unknown}; known: {sorted(ADAPTATIONS)}")
        self.out, self.recipes, self.overrides = output, recipes, overrides
        self.adaptations, self.validation_only = adaptations, validation_only
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.progress, self.salience, self.export = progress, salience, export
        self.bundle = load_bundle(self.data)
        self.evaluator = Evaluator(self.bundle, self.device)
        self.results: dict[str, Any] = {"recipes": {r: self.fields_of(r) for r in recipes},
                                        "adaptations": {a: ADAPTATIONS[a] for a in adaptations},
                                        "device": str(self.device), "overrides": overrides, "seconds": {}}
        self._started = time.time()

    # ------------------------------------------------------------------ helpers
    def save(self) -> None:
        self.results["seconds"]["total"] = round(time.time() - self._started, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2) + "\n", encoding="utf-8")
        tmp.replace(self.out / "results.json")
        if self.export is not None:  # kept current, so that a run cut short still hands back what it has
            self.export.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.out / "results.json", self.export / "results.json")

    def report(self) -> None:
        """results.md from the results so far (also under --export; save() keeps results.json there)."""
        write_markdown(self.results, self.out / "results.md")
        if self.export is not None:
            shutil.copy2(self.out / "results.md", self.export / "results.md")

    def _stage(self, name: str, started: float) -> None:
        self.results["seconds"][name] = round(time.time() - started, 1)
        log.info("stage %s done in %.1f s", name, time.time() - started)
        self.save()

    def config(self, base: Path, fields: dict[str, Any]) -> TrainConfig:
        data = yaml.safe_load(base.read_text(encoding="utf-8"))
        data.update({"data": str(self.data), "eval_every": 0, "checkpoint_every": 0, **fields, **self.overrides})
        return TrainConfig.from_dict(data, source=f"{base.name} + experiment fields")

    def train(self, name: str, cfg: TrainConfig) -> dict:
        trainer = Trainer(cfg, self.out / "runs" / name, device=str(self.device), progress=self.progress)
        summary = trainer.run()
        del trainer
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return summary

    def load(self, folder: Path) -> AlignerModel:
        return load_model(folder, device=self.device, dtype=None)

    @staticmethod
    def fields_of(recipe: str) -> dict[str, Any]:
        """The recipe's fields, with weight_interpolation for "<recipe>@<alpha>"."""
        base, alpha = split_recipe(recipe)
        return {**RECIPES[base], **({"weight_interpolation": alpha} if alpha != 1.0 else {})}

    def recipe_fields(self, recipe: str, domains: list[str], validation: list[str]) -> dict[str, Any]:
        fields = self.fields_of(recipe)
        label_free = fields.pop("label_free", [])
        train_sets = list(domains) + [f"{d}-{kind}" for d in domains for kind in label_free
                                      if f"{d}-{kind}" in self.bundle.train]
        return {**fields, "train_sets": train_sets, "validation_sets": validation}

    # ------------------------------------------------------------------ stages
    def untrained(self, name: str) -> AlignerModel:
        """Baseline ``name`` of BASELINES: the untrained backbone with that projection (fitted on both corpora's
        training texts, no labels), in fp32; its projection fit, if any, goes to results["projection_fit"]."""
        fields = dict(BASELINES[name])
        if fields.get("projection_init") == "identity":
            fields["dim"] = self.hidden_size()
        cfg = self.config(BASE_CONFIG, {**fields, "train_sets": list(DOMAINS), "validation_sets": [],
                                        "positive_top": 0, "init": "untrained"})
        trainer = Trainer(cfg, self.out / "runs" / name, device=str(self.device), progress=False)
        if trainer.projection_fit:
            self.results.setdefault("projection_fit", {})[name] = trainer.projection_fit
        model = trainer.model
        model.compute_dtype = None  # evaluated in fp32, as every reloaded checkpoint
        return model

    def baselines(self) -> dict[str, AlignerModel]:
        started = time.time()
        models = {name: self.untrained(name) for name in BASELINES}
        self.results["baselines"] = {name: self.evaluator.ndcg(m, [*VALIDATION.values(), *OFF_VALIDATION.values()])
                                     for name, m in models.items()}
        self._stage("baselines", started)
        return models

    def hidden_size(self) -> int:
        from transformers import AutoConfig

        from pyserini_aligner.model import resolve_backbone

        return AutoConfig.from_pretrained(resolve_backbone("minilm")).hidden_size

    def single_domain(self) -> dict[str, dict[str, dict[str, float]]]:
        """Each base recipe trained once per domain; each of its "@alpha" variants exported from that run."""
        started, scores = time.time(), {}
        self.results["single_domain"] = {}
        bases = list(dict.fromkeys(split_recipe(r)[0] for r in self.recipes))
        for base in bases:
            variants = [r for r in self.recipes if split_recipe(r)[0] == base]
            for domain in DOMAINS:
                cfg = self.config(BASE_CONFIG, {**self.recipe_fields(base, [domain], []), "eval_every": 10 ** 9})
                trainer = Trainer(cfg, self.out / "runs" / f"{base}.{domain}", device=str(self.device),
                                  progress=self.progress)
                summary = trainer.run()
                other = OFF_VALIDATION[OTHER[domain]]
                for recipe in variants:
                    folder = self.out / "runs" / f"{recipe}.{domain}" / "last"
                    if recipe != base:
                        with trainer.interpolated(split_recipe(recipe)[1]):
                            export_checkpoint(trainer.model, trainer.backbone_names, folder)
                    val = self.evaluator.ndcg(self.load(folder), [*VALIDATION.values(), other])
                    scores.setdefault(recipe, {})[domain] = {"in": val[VALIDATION[domain]]["top-k:1"],
                                                             "off": val[other]["top-k:1"]}
                    self.results["single_domain"][f"{recipe}.{domain}"] = {
                        "validation": val, "steps": summary["steps"],
                        **({"projection_fit": summary["projection_fit"]} if "projection_fit" in summary else {})}
                    self.save()
                del trainer
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        self._stage("single_domain", started)
        return scores

    def final(self, recipe: str) -> Path:
        started = time.time()
        cfg = self.config(BASE_CONFIG, self.recipe_fields(recipe, list(DOMAINS), list(VALIDATION.values())))
        summary = self.train("final", cfg)
        folder = self.out / "runs" / "final" / "best"
        self.results["final"] = {"recipe": recipe, "best_step": summary["best_step"], "steps": summary["steps"],
                                 "validation": self.evaluator.ndcg(self.load(folder), list(VALIDATION.values()))}
        self._stage("final", started)
        return folder

    def adapt(self, recipe: str, raw: AlignerModel) -> dict[str, Path]:
        """Each ADAPTATIONS setting in both directions (after measuring the fused teacher's parts on the target's
        validation queries, ``raw`` being the untrained 384-d baseline); returns the chosen setting's models (named
        ``adapt.<source>-to-<target>``)."""
        started, gains = time.time(), {}
        if not self.adaptations:
            return {}
        self.results["adaptation"] = {}
        single = self.results["single_domain"]
        if any(ADAPTATIONS[a].get("anchor") == "fusion" for a in self.adaptations):
            self.results["teachers"] = {
                f"{source}-to-{target}": self.evaluator.teachers(
                    self.load(self.out / "runs" / f"{recipe}.{source}" / "last"), raw, OFF_VALIDATION[target])
                for source, target in (("scifact", "nfcorpus"), ("nfcorpus", "scifact"))}
            self.save()
        for setting in self.adaptations:
            fields = dict(ADAPTATIONS[setting])
            kinds = fields.pop("sets")
            gains[setting] = []
            for source, target in (("scifact", "nfcorpus"), ("nfcorpus", "scifact")):
                init = self.out / "runs" / f"{recipe}.{source}" / "last"
                name = f"adapt-{setting}.{source}-to-{target}"
                train_sets = [f"{target}-{k}" for k in kinds if f"{target}-{k}" in self.bundle.train]
                cfg = self.config(ADAPT_CONFIG, {**init_model_fields(init), "init": str(init),
                                                 "train_sets": train_sets, "validation_sets": [VALIDATION[target]],
                                                 "max_pseudo_queries": ADAPT_QUERIES, **fields})
                summary = self.train(name, cfg)
                off = OFF_VALIDATION[target]
                val = self.evaluator.ndcg(self.load(self.out / "runs" / name / "last"), [*VALIDATION.values(), off])
                before = single[f"{recipe}.{source}"]["validation"][off]["top-k:1"]
                gains[setting].append(val[off]["top-k:1"] - before)
                self.results["adaptation"][name] = {"steps": summary["steps"], "validation": val}
                self.save()
        chosen = max(self.adaptations, key=lambda a: sum(gains[a]) / len(gains[a]))
        self.results["adaptation_choice"] = {"setting": chosen, "mean_validation_gain": {
            a: round(sum(g) / len(g), 4) for a, g in gains.items()}}
        self._stage("adaptation", started)
        return {f"adapt.{s}-to-{t}": self.out / "runs" / f"adapt-{chosen}.{s}-to-{t}" / "last"
                for s, t in (("scifact", "nfcorpus"), ("nfcorpus", "scifact"))}

    def test(self, models: dict[str, AlignerModel | Path], response: dict[str, AlignerModel | Path]) -> None:
        """Test nDCG@10 (top-k:1) of every model; top-p response of ``response`` (p chosen on validation)."""
        started = time.time()
        self.evaluator.sets.update(load_test_sets(self.test_path))
        tests = list(TEST.values())
        self.results["test"] = {}
        for name, model in models.items():
            model = self.load(model) if isinstance(model, Path) else model
            self.results["test"][name] = {s: v["top-k:1"] for s, v in self.evaluator.ndcg(model, tests).items()}
            self.save()
        self.results["top_p"] = {}
        for name, model in response.items():
            self.results["top_p"][name] = self.top_p_response(model)
            self.save()
        self._stage("test", started)

    def top_p_response(self, model: AlignerModel | Path) -> dict[str, dict[str, Any]]:
        """Per training domain: validation and test nDCG@10 at top-k:1 and each TOP_P value, the p chosen on
        validation, the best test top-p and its difference to top-k:1 (the test sets must be loaded)."""
        model = self.load(model) if isinstance(model, Path) else model
        strategies = (MAXSIM, *(Strategy("top-p", p=p) for p in TOP_P))
        val = self.evaluator.ndcg(model, list(VALIDATION.values()), strategies)
        test = self.evaluator.ndcg(model, list(TEST.values()), strategies)
        row, top_p = {}, [str(s) for s in strategies[1:]]
        for domain in DOMAINS:
            v, t = val[VALIDATION[domain]], test[TEST[domain]]
            chosen = max(top_p, key=lambda s: v[s])
            best = max(top_p, key=lambda s: t[s])
            row[domain] = {"validation": v, "test": t, "p_chosen_on_validation": chosen,
                           "test_at_chosen_p": t[chosen], "best_test_top_p": best,
                           "best_top_p_minus_top_k1": round(t[best] - t["top-k:1"], 4)}
        return row

    def salience_heads(self, final: Path, description: str | None = None) -> Path:
        """Salience heads for pruning on the final model (aligner_salience.yaml, with ``description`` when given);
        returns the exported folder."""
        started = time.time()
        data = yaml.safe_load(SALIENCE_CONFIG.read_text(encoding="utf-8"))
        keep = {k: v for k, v in self.overrides.items() if k in ("epochs", "max_steps", "eval_batch_size",
                                                                  "prune_k_per_token", "distill_rank")}
        shape = {k: v for k, v in init_model_fields(final).items() if k in ("dim", "query_maxlen", "doc_maxlen")}
        data.update({"data": str(self.data), **shape, "init": str(final), **keep})
        if description is not None:
            data["description"] = description
        cfg = TrainConfig.from_dict(data, source=f"{SALIENCE_CONFIG.name} + experiment fields")
        from pyserini_aligner.train.distill import SalienceDistiller

        summary = SalienceDistiller(cfg, output_dir=self.out / "runs" / "salience", device=str(self.device),
                                    progress=self.progress).run()
        folder = self.out / "runs" / "salience" / "best"
        self.results["salience"] = {k: v for k, v in summary.items() if k != "pruning"}
        self._stage("salience", started)
        return folder

    def refine(self, names: list[str]) -> dict:
        """Each REFINEMENTS setting trained from the shipped checkpoint on both training sets (last step kept),
        the choice on validation (:func:`choose_refinement`), then only for the chosen one: test nDCG@10 and
        top-p response against raw384 and the shipped checkpoint, salience heads and export (``validation_only``
        stops after the choice)."""
        unknown = [n for n in names if n not in REFINEMENTS]
        if unknown or not names:
            raise ValueError(f"--refine: unknown setting(s) {unknown}; known: {sorted(REFINEMENTS)}")
        started = time.time()
        self.results["refinements"] = {n: REFINEMENTS[n] for n in names}
        strategies = (MAXSIM, *(Strategy("top-p", p=p) for p in TOP_P))
        models: dict[str, AlignerModel | Path] = {"raw384": self.untrained("raw384"),
                                                  "shipped": load_model("aligner", device=self.device, dtype=None)}
        for name in names:
            cfg = self.config(BASE_CONFIG, {**init_model_fields("aligner"), **REFINEMENTS[name],
                                            "train_sets": list(DOMAINS), "validation_sets": list(VALIDATION.values())})
            summary = self.train(f"refine-{name}", cfg)
            models[name] = self.out / "runs" / f"refine-{name}" / "last"
            self.results.setdefault("refinement", {})[name] = {"steps": summary["steps"]}
            self.save()
        validation = {}
        for name, model in models.items():
            model = self.load(model) if isinstance(model, Path) else model
            validation[name] = self.evaluator.ndcg(model, list(VALIDATION.values()), strategies)
        chosen, why = choose_refinement(validation)
        self.results["refinement_choice"] = {"setting": chosen, "rule": why, "validation": validation}
        self._stage("refine", started)
        if chosen is None or self.validation_only:
            self.report()
            return self.results
        started = time.time()
        self.evaluator.sets.update(load_test_sets(self.test_path))
        response = {n: models[n] for n in ("raw384", "shipped", chosen)}
        self.results["top_p"] = {name: self.top_p_response(model) for name, model in response.items()}
        targets = top_p_checks(self.results["top_p"])
        for domain in DOMAINS:
            targets[f"{chosen} on {domain} test within 0.005 of the shipped"] = near_shipped(
                self.results["top_p"][chosen][domain]["test"]["top-k:1"], domain)
        self.results["targets"] = targets
        self._stage("test", started)
        checkpoint = self.salience_heads(models[chosen], REFINED_DESCRIPTION) if self.salience else models[chosen]
        self.save()
        self.report()
        if self.export is not None:
            self.export_checkpoint(checkpoint, models[chosen])
        return self.results

    def export_checkpoint(self, heads: Path, encoder: Path) -> None:
        """``export``/checkpoint/: config and salience heads from ``heads``, the backbone delta from ``encoder``."""
        (self.export / "checkpoint").mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "heads.safetensors"):
            shutil.copy2(heads / name, self.export / "checkpoint" / name)
        shutil.copy2(encoder / "backbone_delta.safetensors", self.export / "checkpoint" / "backbone_delta.safetensors")

    # ------------------------------------------------------------------ all
    def response_only(self, checkpoints: list[str]) -> dict:
        """Only the top-p response of raw384 and ``checkpoints`` (names or folders), with its checks."""
        started = time.time()
        self.evaluator.sets.update(load_test_sets(self.test_path))
        models = {"raw384": self.untrained("raw384"),
                  **{c: load_model(c, device=self.device, dtype=None) for c in checkpoints}}
        self.results["top_p"] = {name: self.top_p_response(m) for name, m in models.items()}
        self.results["targets"] = top_p_checks(self.results["top_p"])
        self._stage("top_p", started)
        self.report()
        return self.results

    def run(self) -> dict:
        baselines = self.baselines()
        scores = self.single_domain()
        floors = {d: max(self.results["baselines"][b][OFF_VALIDATION[d]]["top-k:1"] for b in baselines)
                  for d in DOMAINS}
        recipe, why = choose_recipe(scores, floors)
        self.results["choice"] = {"recipe": recipe, "rule": why, "scores": scores, "floors": floors}
        self.save()
        adapted = self.adapt(recipe, baselines["raw384"])
        if self.validation_only:
            self.report()
            return self.results
        final = self.final(recipe)
        single = {f"{recipe}.{d}": self.out / "runs" / f"{recipe}.{d}" / "last" for d in DOMAINS}
        shipped = load_model("aligner", device=self.device, dtype=None)
        self.test({**baselines, **single, "final": final, **adapted, "shipped": shipped},
                  {"raw384": baselines["raw384"], "final": final, "shipped": shipped})
        self.results["targets"] = targets(self.results, recipe)
        checkpoint = self.salience_heads(final) if self.salience else final
        self.save()
        self.report()
        if self.export is not None:
            self.export_checkpoint(checkpoint, final)
        return self.results


def targets(results: dict, recipe: str) -> dict[str, dict]:
    """The checks this experiment is read against (test nDCG@10, top-k:1)."""
    test = results["test"]
    out = {}
    for source in DOMAINS:
        target = OTHER[source]
        off = test[f"{recipe}.{source}"][TEST[target]]
        floor = test["raw384"][TEST[target]]
        out[f"{source}-only on {target} test"] = {
            "value": off, "raw384": floor, "dense": REFERENCE["dense"][target],
            "ok": off >= floor and off > REFERENCE["dense"][target]}
        if f"adapt.{source}-to-{target}" in test:
            in_domain = test[f"{recipe}.{target}"][TEST[target]]
            adapted = test[f"adapt.{source}-to-{target}"][TEST[target]]
            gap = in_domain - off
            out[f"adaptation {source}->{target} closes half the gap"] = {
                "off_domain": off, "adapted": adapted, "in_domain": in_domain,
                "closed": round((adapted - off) / gap, 3) if gap > 0 else None,
                "ok": gap <= 0 or adapted - off >= gap / 2}
        out[f"final on {source} test within 0.005 of the shipped"] = near_shipped(test["final"][TEST[source]], source)
    out.update(top_p_checks(results["top_p"]))
    return out


def near_shipped(value: float, domain: str) -> dict:
    """The check that test nDCG@10 ``value`` on ``domain`` is at most 0.005 below the shipped checkpoint's."""
    shipped = REFERENCE["shipped"][domain]
    return {"value": value, "shipped": shipped, "ok": value >= shipped - 0.005}


def top_p_checks(top_p: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per trained model of ``top_p`` and domain: its best test top-p minus top-k:1 is not below raw384's."""
    out = {}
    for name in [m for m in top_p if m != "raw384"]:
        for domain in DOMAINS:
            trained, backbone = (top_p[m][domain]["best_top_p_minus_top_k1"] for m in (name, "raw384"))
            out[f"top-p response of {name} on {domain} test"] = {name: trained, "raw384": backbone,
                                                                 "ok": trained >= backbone}
    return out


def write_markdown(results: dict, path: Path) -> None:
    """results.md: validation tables, the choice, test tables and the target checks."""
    val = [*VALIDATION.values(), *OFF_VALIDATION.values()]
    lines = ["# Cross-domain recipe choice, final training and label-free adaptation", "",
             "All nDCG@10, exhaustive scoring, top-k:1 unless stated. Off-domain validation sets: "
             + ", ".join(f"`{n}` ({d} training + validation queries)" for d, n in OFF_VALIDATION.items()) + "."]
    rows = [(n, r) for n, r in results.get("baselines", {}).items()]
    rows += [(n, r["validation"]) for n, r in results.get("single_domain", {}).items()]
    rows += [("final", results["final"]["validation"])] if "final" in results else []
    rows += [(n, r["validation"]) for n, r in results.get("adaptation", {}).items()]
    if rows:
        lines += ["", "## Validation", "", "| model | " + " | ".join(val) + " |", "|---|" + "---:|" * len(val)]
    for name, row in rows:
        lines.append(f"| {name} | " + " | ".join(f"{row[s]['top-k:1']:.4f}" if s in row else "" for s in val) + " |")
    choice = results.get("choice")
    if choice:
        lines += ["", f"Chosen recipe: **{choice['recipe']}** ({choice['rule']}); fields: "
                      f"`{json.dumps(results['recipes'][choice['recipe']])}`."]
    tests = list(TEST.values())
    if results.get("test"):
        lines += ["", "## Test (opened after the choice)", "", "| model | " + " | ".join(tests) + " |",
                  "|---|" + "---:|" * len(tests)]
    for name, row in results.get("test", {}).items():
        lines.append(f"| {name} | " + " | ".join(f"{row[s]:.4f}" for s in tests) + " |")
    if results.get("top_p"):
        lines += ["", "### Top-p response (test)", "", "| model | test set | top-k:1 | "
                  + " | ".join(f"top-p:{p}" for p in TOP_P) + " | p chosen on validation |",
                  "|---|---|---:|" + "---:|" * len(TOP_P) + "---|"]
        for name, row in results["top_p"].items():
            for domain, r in row.items():
                lines.append(f"| {name} | {TEST[domain]} | {r['test']['top-k:1']:.4f} | "
                             + " | ".join(f"{r['test'][f'top-p:{p}']:.4f}" for p in TOP_P)
                             + f" | {r['p_chosen_on_validation']} |")
    if results.get("targets"):
        lines += ["", "## Checks", "", "| check | values | ok |", "|---|---|---|"]
        for name, row in results["targets"].items():
            values = ", ".join(f"{k} {v}" for k, v in row.items() if k != "ok")
            lines.append(f"| {name} | {values} | {'yes' if row['ok'] else 'no'} |")
    if results.get("teachers"):
        parts = ("model", "raw384", "bm25", "model+raw384", "model+bm25", "raw384+bm25", "fusion")
        lines += ["", "## The fused teacher and its parts on the target (validation)", "",
                  "| source to target | set | " + " | ".join(parts) + " |", "|---|---|" + "---:|" * len(parts)]
        for direction, row in results["teachers"].items():
            target = direction.split("-to-")[1]
            lines.append(f"| {direction} | {OFF_VALIDATION[target]} | " + " | ".join(f"{row[p]:.4f}" for p in parts)
                         + " |")
    if results.get("refinement_choice"):
        choice = results["refinement_choice"]
        sets = list(VALIDATION.values())
        lines += ["", "## Refinements of the shipped checkpoint (validation)", "",
                  "| model | set | top-k:1 | " + " | ".join(f"top-p:{p}" for p in TOP_P) + " | best top-p − top-k:1 |",
                  "|---|---|---:|" + "---:|" * (len(TOP_P) + 1)]
        for name, row in choice["validation"].items():
            for s in sets:
                lines.append(f"| {name} | {s} | {row[s]['top-k:1']:.4f} | "
                             + " | ".join(f"{row[s][f'top-p:{p}']:.4f}" for p in TOP_P)
                             + f" | {best_top_p_drop(row[s]):+.4f} |")
        lines += ["", f"Refinement chosen: **{choice['setting']}** ({choice['rule']})."]
    if results.get("adaptation_choice"):
        choice = results["adaptation_choice"]
        lines += ["", f"Label-free adaptation setting kept: **{choice['setting']}** (mean validation gain on the "
                      f"target corpus: {json.dumps(choice['mean_validation_gain'])})."]
    lines += ["", "Seconds per stage: " + ", ".join(f"{k} {v}" for k, v in results["seconds"].items()), ""]
    path.write_text("\n".join(lines), encoding="utf-8")

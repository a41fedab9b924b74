"""Trainer on CPU with the real MiniLM: config errors, bundle, a few steps, resume, loss decrease, nDCG vs ranx."""

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from pyserini_aligner.model import DEFAULT_CHECKPOINT, AlignerModel
from pyserini_aligner.train.config import TrainConfig, load_config
from pyserini_aligner.train.data import BatchSampler, load_bundle, write_bundle
from pyserini_aligner.train.loop import Trainer, contrastive_loss
from pyserini_aligner.train.validate import mean_ndcg10

TOPICS = {
    "d0": "Insulin resistance and type 2 diabetes in obese adults.",
    "d1": "Metformin lowers blood glucose in diabetic patients.",
    "d2": "Vitamin D deficiency is linked to weak bones and fractures.",
    "d3": "Calcium and vitamin D supplements for osteoporosis.",
    "d4": "Red meat consumption and the risk of colorectal cancer.",
    "d5": "Processed meat, nitrites and bowel cancer incidence.",
    "d6": "Green tea catechins and cardiovascular health.",
    "d7": "Statins reduce LDL cholesterol and heart attacks.",
    "d8": "Sleep deprivation impairs memory consolidation.",
    "d9": "Exercise improves mood and reduces depression symptoms.",
    "d10": "Gut microbiota composition changes with dietary fibre.",
    "d11": "Probiotics and the intestinal microbiome in infants.",
}
QUERIES = {
    "q0": ("does metformin treat diabetes", {"d1": 1, "d0": 1}, ["d6", "d2", "d9"]),
    "q1": ("vitamin d and bone fractures", {"d2": 1}, ["d3", "d10", "d4"]),
    "q2": ("meat and colon cancer", {"d4": 1, "d5": 1}, ["d7", "d0", "d11"]),
    "q3": ("cholesterol lowering drugs", {"d7": 1}, ["d6", "d1", "d8"]),
    "q4": ("sleep and memory", {"d8": 1}, ["d9", "d2", "d5"]),
    "q5": ("fibre and gut bacteria", {"d10": 1, "d11": 1}, ["d6", "d3", "d7"]),
}


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    corpus = {"docids": list(TOPICS), "texts": list(TOPICS.values())}
    train = [{"qid": q, "text": t, "positives": p, "negatives": n} for q, (t, p, n) in QUERIES.items()]
    validation = {"tiny-dev": {"corpus": "tiny", "queries": {"v0": "statins and heart disease",
                                                             "v1": "depression and physical activity"},
                               "qrels": {"v0": {"d7": 2, "d6": 1}, "v1": {"d9": 1}}}}
    return write_bundle({"meta": {}, "corpora": {"tiny": corpus}, "train": {"tiny": train},
                         "validation": validation}, tmp_path_factory.mktemp("bundle") / "bundle.json.gz")


def tiny_config(bundle_path, **overrides) -> TrainConfig:
    fields = dict(data=str(bundle_path), train_sets=["tiny"], validation_sets=["tiny-dev"], query_maxlen=16,
                  doc_maxlen=24, train_layers=1, epochs=2, batch_queries=3, negatives_per_query=1,
                  negative_depth=3, precision="fp32", log_every=1, eval_batch_size=8, prune_k_per_token=4)
    fields.update(overrides)
    return TrainConfig.from_dict(fields)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="'temperature'"):
        TrainConfig.from_dict({"temperature": 0})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['learning_rate'\]"):
        TrainConfig.from_dict({"learning_rate": 1e-3})
    with pytest.raises(ValueError, match="'train_layers'.*type int"):
        TrainConfig.from_dict({"train_layers": "2"})
    with pytest.raises(ValueError, match="'salience_mode'"):
        TrainConfig.from_dict({"salience_mode": "soft"})
    with pytest.raises(ValueError, match="'strategy'"):
        TrainConfig.from_dict({"strategy": "top-q:3"})
    path = tmp_path / "c.yaml"
    path.write_text("lr_heads: 1\nepochs: 3\n")
    cfg = load_config(path, ["alpha_q=0.25", "train_sets=[scifact]"])
    assert (cfg.lr_heads, cfg.epochs, cfg.alpha_q, cfg.train_sets) == (1.0, 3, 0.25, ["scifact"])
    with pytest.raises(ValueError, match=str(path) + ".*'epochs'"):
        load_config(path, ["epochs=0"])
    with pytest.raises(FileNotFoundError, match="training config not found"):
        load_config(tmp_path / "missing.yaml")


def test_bundle_round_trip_and_sampler(bundle_path, tmp_path):
    bundle = load_bundle(bundle_path)
    assert len(bundle.train["tiny"]) == 6 and bundle.validation["tiny-dev"].corpus == "tiny"
    sampler = BatchSampler(bundle, 3, 2, 3, True, seed=1)
    assert sampler.epoch(0) == sampler.epoch(0) and sorted(sum(sampler.epoch(0), [])) == list(range(6))
    batch = sampler.batch(sampler.epoch(0)[0], 0, 0)
    assert batch == sampler.batch(sampler.epoch(0)[0], 0, 0) and len(batch.doc_rows) == 3 + 3 * 2
    corpus = bundle.corpora["tiny"]
    for i, qi in enumerate(batch.queries):
        q = sampler.queries[qi]
        assert corpus.docids[batch.doc_rows[i]] in q.positives and batch.allowed[i][i]
        for j, row in enumerate(batch.doc_rows):
            if j != i and corpus.docids[row] in q.positives:
                assert not batch.allowed[i][j]  # another copy of a positive is never a negative
    bad = tmp_path / "bad.json.gz"
    write_bundle({"meta": {}, "corpora": {"tiny": {"docids": ["a"], "texts": ["x"]}},
                  "train": {"tiny": [{"qid": "q", "text": "t", "positives": {"zz": 1}, "negatives": []}]},
                  "validation": {}}, bad)
    with pytest.raises(ValueError, match=r"train.tiny\[0\].*docids not in corpora.tiny"):
        load_bundle(bad)
    with pytest.raises(ValueError, match="'train_sets' names \\['nfcorpus'\\]"):
        Trainer(tiny_config(bundle_path, train_sets=["nfcorpus"]), tmp_path / "x", device="cpu", progress=False)


def test_validation_ndcg_averages_over_queries_with_a_relevant_document():
    qrels = {"a": {"x": 1}, "b": {"y": 0}, "c": {"z": 2}}
    run = {"a": {"x": 2.0, "w": 1.0}, "b": {"y": 1.0}, "c": {"w": 1.0, "z": 0.5}}
    assert mean_ndcg10(run, qrels) == pytest.approx((1.0 + 1 / math.log2(3)) / 2)  # "b" has none: left out
    assert mean_ndcg10(run, {"b": {"y": 0}}) == 0.0


def test_loss_decreases_on_a_repeated_batch(bundle_path, tmp_path):
    trainer = Trainer(tiny_config(bundle_path, lr_heads=3e-3, lr_backbone=1e-4, warmup_ratio=0.0, epochs=20),
                      tmp_path / "rep", device="cpu", progress=False)
    batch = trainer.sampler.batch([0, 1, 2], 0, 0)
    losses = [trainer.train_step(batch)["loss"] for _ in range(6)]
    assert losses[-1] < 0.7 * losses[0], losses
    allowed = torch.tensor([[True, False], [True, True]])
    loss = contrastive_loss(torch.tensor([[0.5, 0.9], [0.1, 0.3]]), allowed, 0.1)
    expected = (0.0 + (-3.0 + math.log(math.exp(1.0) + math.exp(3.0)))) / 2
    assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_train_resume_and_shipped_checkpoint(bundle_path, tmp_path):
    cfg = tiny_config(bundle_path, projection_init="pca", positive_top=1, model_negatives_after_epoch=1)
    trainer = Trainer(cfg, tmp_path / "straight", device="cpu", progress=False)
    weight = trainer.model.projection.weight  # PCA init: orthonormal rows
    torch.testing.assert_close(weight @ weight.T, torch.eye(cfg.dim), atol=1e-4, rtol=0)
    assert all(q.sample_from and len(q.sample_from) == 1 and q.sample_from[0] in q.positives
               for q in trainer.sampler.queries)
    straight = trainer.run()
    assert straight["finished"] and straight["steps"] == 4
    interrupted = Trainer(cfg, tmp_path / "resumed", device="cpu", progress=False).run(stop_after=1)
    assert not interrupted["finished"] and interrupted["step"] == 1
    resumed = Trainer(cfg, tmp_path / "resumed", device="cpu", progress=False).run(resume=True)
    assert resumed["finished"]
    a = load_file(str(tmp_path / "straight" / "last" / "heads.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "last" / "heads.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    delta = load_file(str(tmp_path / "straight" / "last" / "backbone_delta.safetensors"))
    assert delta and all(n.startswith("encoder.layer.5.") and t.dtype == torch.float16 for n, t in delta.items())
    records = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3, 4]
    vals = [r for r in records if r["event"] == "validation"]
    assert [r["step"] for r in vals] == [0, 2, 4] and 0.0 <= vals[0]["sets"]["tiny-dev"]["ndcg@10"] <= 1.0
    assert [r["step"] for r in records if r["event"] == "mined_negatives"] == [2]
    assert all(len(q.negatives) == 3 and not set(q.negatives) & set(q.positives) for q in trainer.sampler.queries)
    model = AlignerModel.from_pretrained(tmp_path / "straight" / "best")
    assert model.config.use_salience and model.config.doc_maxlen == 24
    reloaded = straight["best_reloaded"]["sets"]["tiny-dev"]["ndcg@10"]
    assert reloaded == pytest.approx(straight["best_score"], abs=0.05)  # fp16 delta keeps the ranking quality
    with pytest.raises(ValueError, match=r"changed field\(s\) \['temperature'\]"):
        Trainer(dataclasses.replace(cfg, temperature=0.5), tmp_path / "resumed", device="cpu",
                progress=False).run(resume=True)


def test_salience_distill_trains_heads_only(bundle_path, tmp_path):
    from pyserini_aligner.train.distill import SalienceDistiller

    with pytest.raises(ValueError, match="'objective'"):
        tiny_config(bundle_path, objective="salience_distill")  # needs a trained checkpoint as init
    cfg = tiny_config(bundle_path, init="aligner", objective="salience_distill", use_salience=True,
                      salience_in_score=False, train_layers=0, max_steps=20, lr_salience=1e-2, distill_rank=20)
    summary = SalienceDistiller(cfg, output_dir=tmp_path, device="cpu", progress=False).run()
    assert set(summary["pruning"]["tiny-dev"]) >= {"full", "beta_q=0.5/learned", "beta_q=1/idf", "beta_q=0.5/random"}
    shipped, trained = AlignerModel.from_pretrained("aligner"), AlignerModel.from_pretrained(tmp_path / "best")
    assert trained.config.use_salience and not trained.scores_with_salience
    assert torch.equal(shipped.projection.weight, trained.projection.weight)
    delta = "backbone_delta.safetensors"
    assert (tmp_path / "best" / delta).read_bytes() == (DEFAULT_CHECKPOINT / delta).read_bytes()
    text = "Metformin lowers blood glucose in diabetic patients."
    assert torch.equal(torch.from_numpy(shipped.encode([text], False)[0].vectors),
                       torch.from_numpy(trained.encode([text], False)[0].vectors))
    assert trained.d_salience.weight.abs().sum() > 0 and trained.q_salience.weight.abs().sum() > 0

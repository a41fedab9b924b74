"""Off-domain training levers (anchor, alignment mix, L2 to init, weight interpolation, label-free pairs) and
label-free adaptation."""

import json

import pytest
import torch

from pyserini_aligner.model import AlignerModel
from pyserini_aligner.train.config import TrainConfig
from pyserini_aligner.train.data import BatchSampler, load_bundle, write_bundle
from pyserini_aligner.train.loop import Trainer, anchor_loss, interpolated
from pyserini_aligner.train.pseudo import pseudo_queries, sentence_spans, title_queries
from tests.test_train import QUERIES, TOPICS, tiny_config

LONG = ("Vitamin D is made in the skin under sunlight. Low levels are common in winter months. "
        "Deficiency has been linked to weak bones and to fractures in older adults. "
        "Supplements raise blood levels within weeks in most people who take them daily.")


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    """The tiny labelled bundle of test_train plus a label-free set over the same corpus."""
    texts = {d: f"{t} {LONG}" for d, t in TOPICS.items()}
    corpus = {"docids": list(texts), "texts": list(texts.values())}
    train = [{"qid": q, "text": t, "positives": p, "negatives": n} for q, (t, p, n) in QUERIES.items()]
    pseudo = [{"qid": q.qid, "text": q.text, "positives": {q.docid: 1},
               "negatives": [d for d in TOPICS if d != q.docid][:3], "drop": list(q.span)}
              for q in pseudo_queries(texts.items(), min_rest_words=10)]
    validation = {"tiny-dev": {"corpus": "tiny", "queries": {"v0": "statins and heart disease"},
                               "qrels": {"v0": {"d7": 1}}}}
    return write_bundle({"meta": {}, "corpora": {"tiny": corpus}, "train": {"tiny": train, "tiny-pseudo": pseudo},
                         "train_corpus": {"tiny-pseudo": "tiny"}, "validation": validation},
                        tmp_path_factory.mktemp("offdomain") / "bundle.json.gz")


def batch_inputs(trainer: Trainer) -> tuple:
    """The trainer's first batch of queries 0-2, with its padded (ids, mask) query and document inputs."""
    from pyserini_aligner.train.validate import pad_ids

    b = trainer.sampler.batch([0, 1, 2], 0, 0)
    corpus = trainer.corpus_ids[b.corpus]
    q_in = pad_ids([trainer.query_ids[i] for i in b.queries], trainer.model.pad_id, trainer.device)
    d_in = pad_ids([corpus[r] for r in b.doc_rows], trainer.model.pad_id, trainer.device)
    return b, q_in, d_in


def scores_of(model: AlignerModel, q_in: tuple, d_in: tuple, strategies: list[str]) -> dict[str, torch.Tensor]:
    """``model``'s alignment scores [B, D] of the inputs under each strategy (no gradients)."""
    from pyserini_aligner.alignment import alignment_scores, parse_strategy

    with torch.no_grad():
        q, d = model(*q_in, is_query=True), model(*d_in, is_query=False)
        return {s: alignment_scores(q.vectors, q.mask, d.vectors, d.mask, parse_strategy(s)) for s in strategies}


def test_new_config_fields_are_checked():
    for field, value, match in (("anchor", "teacher", "'anchor'"), ("anchor_weight", -1.0, "'anchor_weight'"),
                                ("strategy_mix", ["top-k:1", "top-q:2"], "'strategy_mix'.*top-q:2"),
                                ("l2_init_weight", -0.5, "'l2_init_weight'"),
                                ("max_pseudo_queries", -1, "'max_pseudo_queries'"),
                                ("anchor_temperature", 0.0, "'anchor_temperature'"),
                                ("projection_init", "eye", "'projection_init'"),
                                ("weight_interpolation", 0.0, "'weight_interpolation'"),
                                ("weight_interpolation", 1.5, "'weight_interpolation'")):
        with pytest.raises(ValueError, match=match):
            TrainConfig.from_dict({field: value})
    with pytest.raises(ValueError, match="'anchor_strategy'.*top-q:2"):
        TrainConfig.from_dict({"anchor": "init", "anchor_strategy": "top-q:2"})
    with pytest.raises(ValueError, match="'anchor_strategy'.*'init' and 'fusion' only"):
        TrainConfig.from_dict({"anchor": "backbone", "anchor_strategy": "top-k:1"})


def test_anchor_loss_is_the_kl_over_allowed_docs():
    student = torch.tensor([[0.5, 0.2, 0.9], [0.1, 0.4, 0.3]], requires_grad=True)
    allowed = torch.tensor([[True, True, False], [True, True, True]])
    assert float(anchor_loss(student.detach(), student.detach(), allowed, 0.1, 0.1)) == pytest.approx(0.0, abs=1e-6)
    teacher = torch.tensor([[0.2, 0.6, -5.0], [0.3, 0.3, 0.3]])
    loss = anchor_loss(student, teacher, allowed, 0.1, 0.2)
    expected = 0.0
    for i in range(2):
        keep = allowed[i]
        p = torch.softmax(teacher[i][keep] / 0.2, -1)
        q = torch.log_softmax(student[i][keep].detach() / 0.1, -1)
        expected += float((p * (p.log() - q)).sum()) / 2
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6) and float(loss.detach()) > 0
    loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad[0, 2] == 0  # a masked doc gets no gradient


def test_label_free_rows_caps_and_hidden_span(bundle_path):
    bundle = load_bundle(bundle_path)
    pseudo = bundle.train["tiny-pseudo"]
    assert len(pseudo) == len(TOPICS) and all(q.corpus == "tiny" and q.source == "tiny-pseudo" for q in pseudo)
    sampler = BatchSampler(bundle, 3, 1, 3, True, seed=1, max_pseudo_queries=6)
    epochs = [sorted(sum(sampler.epoch(e), [])) for e in (0, 1)]
    labelled = [i for i, q in enumerate(sampler.queries) if q.drop is None]
    for chosen in epochs:
        assert set(labelled) <= set(chosen) and len(chosen) == len(labelled) + 6  # only the label-free set is cut
    assert epochs[0] != epochs[1]  # a fresh sample each epoch
    assert all(len({sampler.queries[i].source for i in b}) == 1 for b in sampler.epoch(0))  # one set per batch
    trainer = Trainer(tiny_config(bundle_path, train_sets=["tiny", "tiny-pseudo"], doc_maxlen=96, query_maxlen=48),
                      None, device="cpu", progress=False)
    i, q = next((i, q) for i, q in enumerate(trainer.sampler.queries) if q.drop is not None)
    docid = next(iter(q.positives))
    text = bundle.corpora["tiny"].texts[bundle.corpora["tiny"].row[docid]]
    assert text[q.drop[0]:q.drop[1]] == q.text
    decoded = trainer.model.tokenizer.decode(trainer.positive_ids[i])
    assert q.text.lower().rstrip(".") not in decoded.lower() and TOPICS[docid].split()[0].lower() in decoded.lower()
    assert len(trainer.positive_ids[i]) < len(trainer.corpus_ids["tiny"][bundle.corpora["tiny"].row[docid]])
    bad = json.loads(json.dumps({"meta": {}, "corpora": {"c": {"docids": ["a"], "texts": ["short text"]}},
                                 "train": {"p": [{"qid": "q", "text": "t", "positives": {"a": 1}, "negatives": [],
                                                  "drop": [3, 99]}]},
                                 "train_corpus": {"p": "c"}, "validation": {}}))
    with pytest.raises(ValueError, match=r"train.p\[0\].drop"):
        load_bundle(write_bundle(bad, bundle_path.parent / "bad.json.gz"))


def test_anchor_mix_and_l2_in_training(bundle_path, tmp_path):
    cfg = tiny_config(bundle_path, anchor_weight=1.0, strategy_mix=["top-k:1", "top-p:0.1"], l2_init_weight=10.0,
                      lr_backbone=1e-3, warmup_ratio=0.0)
    trainer = Trainer(cfg, tmp_path / "a", device="cpu", progress=False)
    draws = [str(trainer.batch_strategy(e, n)) for e in range(5) for n in range(4)]
    assert draws == [str(trainer.batch_strategy(e, n)) for e in range(5) for n in range(4)]
    assert set(draws) == {"top-k:1", "top-p:0.1"}
    teacher = {n: p.clone() for n, p in trainer.teacher.named_parameters()}
    batch = trainer.sampler.batch([0, 1, 2], 0, 0)
    first = trainer.train_step(batch, trainer.batch_strategy(0, 0))
    second = trainer.train_step(batch, trainer.batch_strategy(0, 1))
    assert first["l2_init"] == 0.0 and second["l2_init"] > 0.0 and second["anchor"] >= 0.0
    assert all(torch.equal(p, teacher[n]) for n, p in trainer.teacher.named_parameters())  # the teacher is frozen
    # the raw-backbone teacher: identity projection makes the model itself the untrained 384-d MaxSim floor
    raw = Trainer(tiny_config(bundle_path, dim=384, projection_init="identity", anchor_weight=1.0, lr_backbone=0.0,
                              lr_heads=0.0), tmp_path / "b", device="cpu", progress=False)
    raw.model.eval()
    _, q_in, d_in = batch_inputs(raw)
    own = scores_of(raw.model, q_in, d_in, ["top-k:1"])["top-k:1"]
    torch.testing.assert_close(raw.teacher_scores(q_in, d_in, raw.strategy), own, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="'identity' needs dim"):
        Trainer(tiny_config(bundle_path, projection_init="identity"), tmp_path / "c", device="cpu", progress=False)


def test_anchor_strategy_fixes_the_teachers_alignment(bundle_path, tmp_path):
    """With anchor_strategy top-k:1 a top-p batch is taught the starting model's top-k:1 scores; without it, its
    top-p scores."""
    mix = ["top-k:1", "top-p:0.1"]
    fixed = Trainer(tiny_config(bundle_path, anchor="init", anchor_weight=1.0, strategy_mix=mix,
                                anchor_strategy="top-k:1"), tmp_path / "a", device="cpu", progress=False)
    free = Trainer(tiny_config(bundle_path, anchor="init", anchor_weight=1.0, strategy_mix=mix), tmp_path / "b",
                   device="cpu", progress=False)
    b, q_in, d_in = batch_inputs(fixed)
    own = scores_of(fixed.teacher, q_in, d_in, mix)
    assert not torch.allclose(own["top-k:1"], own["top-p:0.1"], atol=1e-4)
    top_p = fixed.strategies[1]
    torch.testing.assert_close(fixed.teacher_scores(q_in, d_in, top_p), own["top-k:1"], atol=1e-5, rtol=0)
    torch.testing.assert_close(free.teacher_scores(q_in, d_in, top_p), own["top-p:0.1"], atol=1e-5, rtol=0)
    assert fixed.train_step(b, top_p)["anchor"] > 0.0


def test_interpolated_weights_are_start_plus_alpha_times_the_change():
    layer = torch.nn.Linear(3, 2)
    start = {"weight": torch.zeros(2, 3), "bias": torch.ones(2)}
    trained = {n: p.detach().clone() for n, p in layer.named_parameters()}
    with interpolated(layer, start, 0.25):
        for name, p in layer.named_parameters():
            torch.testing.assert_close(p.detach(), start[name] + 0.25 * (trained[name] - start[name]))
    assert all(torch.equal(p, trained[n]) for n, p in layer.named_parameters())  # restored
    with interpolated(layer, start, 1.0):
        assert all(torch.equal(p, trained[n]) for n, p in layer.named_parameters())


def test_weight_interpolation_is_what_training_exports(bundle_path, tmp_path):
    from safetensors.torch import load_file

    trainer = Trainer(tiny_config(bundle_path, weight_interpolation=0.5, epochs=1, lr_backbone=1e-3),
                      tmp_path / "w", device="cpu", progress=False)
    trainer.run()
    delta = load_file(str(tmp_path / "w" / "last" / "backbone_delta.safetensors"))
    params = dict(trainer.model.named_parameters())
    moved = 0.0
    for name, value in delta.items():
        start, trained = trainer.start_state[f"backbone.{name}"], params[f"backbone.{name}"].detach()
        torch.testing.assert_close(value.float(), start + 0.5 * (trained - start), atol=2e-3, rtol=2e-3)
        moved = max(moved, float((trained - start).abs().max()))
    assert moved > 1e-3  # the run did change the weights, so the check above is not start == trained


def test_titles_are_pseudo_queries_when_the_text_starts_with_them():
    docs = [("a", "Vitamin D and bones", f"Vitamin D and bones {LONG}"), ("b", "", LONG),
            ("c", "Other title", LONG), ("d", "Short", "Short body text")]
    queries = title_queries(docs)
    assert [(q.qid, q.docid, q.text, q.span) for q in queries] == [("a#title", "a", "Vitamin D and bones", (0, 19))]


def test_pseudo_queries_are_sentences_cut_from_their_document():
    docs = [("a", LONG), ("b", "Too short. Nothing here.")]
    queries = pseudo_queries(docs, per_doc=2, min_words=4, min_rest_words=10, seed=3)
    assert [q.docid for q in queries] == ["a", "a"] and [q.qid for q in queries] == ["a#0", "a#1"]
    for q in queries:
        assert LONG[q.span[0]:q.span[1]] == q.text and q.text.endswith(".") and 4 <= len(q.text.split()) <= 40
    assert queries == pseudo_queries(docs, per_doc=2, min_words=4, min_rest_words=10, seed=3)
    assert sentence_spans("Dose 2.5 mg daily. Next one") == [(0, 18), (19, 27)]
    with pytest.raises(ValueError, match="per_doc"):
        pseudo_queries(docs, per_doc=0)


def test_unsupervised_cli_prepares_trains_and_writes_a_checkpoint(corpus_file, tmp_path, capsys):
    from pyserini_aligner.train.__main__ import main

    small = tmp_path / "corpus.jsonl"
    small.write_text("".join(corpus_file.read_text().splitlines(keepends=True)[:40]))
    tiny = ["--set", "max_steps=2", "--set", "batch_queries=4", "--set", "doc_maxlen=48", "--set", "query_maxlen=24",
            "--set", "eval_batch_size=8", "--set", "precision=fp32", "--set", "train_layers=1"]
    out = tmp_path / "ckpt"
    assert main(["--corpus", str(small), "--unsupervised", "--output", str(out), "--device", "cpu", "--quiet",
                 *tiny]) == 0
    assert json.loads(capsys.readouterr().out)["finished"]
    bundle = load_bundle(out / "train" / "bundle.json.gz")
    rows = bundle.train["corpus-pseudo"]
    assert len(bundle.corpora["corpus"].docids) == 40 and len(rows) >= 30
    assert all(q.negatives and next(iter(q.positives)) not in q.negatives for q in rows)  # BM25, source excluded
    assert not (out / "train" / "state.pt").exists() and not (out / "train" / "lucene").exists()
    adapted, shipped = AlignerModel.from_pretrained(out), AlignerModel.from_pretrained("aligner")
    assert adapted.config.use_salience and not adapted.config.salience_in_score  # model fields from --init
    assert adapted.config.doc_maxlen == 48
    layer = "encoder.layer.5.attention.self.query.weight"
    assert not torch.equal(adapted.backbone.state_dict()[layer], shipped.backbone.state_dict()[layer])
    assert main(["--corpus", str(small), "--unsupervised", "--output", str(out), "--quiet"]) == 2  # never over a
    assert "not empty" in capsys.readouterr().err  # non-empty folder
    again = tmp_path / "from_bundle"  # the train step alone, from a prepared bundle (as on a machine without Java)
    assert main(["--bundle", str(out / "train" / "bundle.json.gz"), "--unsupervised", "--output", str(again),
                 "--init", str(out), "--device", "cpu", "--quiet", *tiny]) == 0
    assert (again / "backbone_delta.safetensors").is_file() and AlignerModel.from_pretrained(again).config.dim == 128
    assert main(["--unsupervised", "--output", str(tmp_path / "x"), "--quiet"]) == 2
    assert "exactly one of --corpus and --bundle" in capsys.readouterr().err

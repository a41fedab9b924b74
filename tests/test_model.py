"""AlignerModel with the real MiniLM backbone and the shipped default checkpoint (no mocks)."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.model import (DEFAULT_CHECKPOINT, AlignerConfig, AlignerModel, EncodedText,
                                    resolve_dtype)

TEXTS = [
    "How do sparse alignments help multi-vector retrieval?",
    "",
    "Short one.",
    "A considerably longer document about protein folding, which mentions several residues, a few "
    "hydrophobic interactions and the role of chaperones in preventing aggregation inside cells.",
    "Mid-length text with numbers 1234 and symbols %$#.",
]
LONG = "word " * 600


def _same(a: list[EncodedText], b: list[EncodedText], atol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.vectors.shape == y.vectors.shape
        np.testing.assert_allclose(x.vectors, y.vectors, atol=atol)
        np.testing.assert_allclose(x.salience, y.salience, atol=atol)
        assert x.truncated == y.truncated


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoint_files_are_small_and_documented(name):
    folder = SHIPPED[name]
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert {"config.json", "heads.safetensors", "backbone_delta.safetensors", "README.md"} <= set(files)
    assert sum(files.values()) < 15_000_000  # a delta over the MiniLM backbone, not a copy of it
    config = AlignerConfig.load(folder / "config.json")
    assert config.keep_special and config.default_strategy == "top-k:1"
    assert folder == DEFAULT_CHECKPOINT or name in (folder / "README.md").read_text(encoding="utf-8")


def test_vectors_unit_norm_shape_and_salience(model):
    for is_query in (True, False):
        for text, enc in zip(TEXTS, model.encode(TEXTS, is_query=is_query, batch_size=2)):
            n = len(model.tokenizer.ids([text])[0])
            assert enc.vectors.shape == (n, 128) and enc.vectors.dtype == np.float32
            np.testing.assert_allclose(np.linalg.norm(enc.vectors, axis=1), 1.0, atol=1e-5)
            assert enc.salience.shape == (n,) and (enc.salience >= 0).all() and enc.salience.max() > 0
            assert not enc.truncated


def test_salience_in_score_switch(model, monkeypatch):
    config = AlignerConfig.load(DEFAULT_CHECKPOINT / "config.json")
    assert config.use_salience and not config.salience_in_score  # shipped: saliences prune, MaxSim scores
    assert not model.scores_with_salience
    monkeypatch.setattr(model.config, "salience_in_score", True)
    assert model.scores_with_salience
    monkeypatch.setattr(model.config, "use_salience", False)
    assert not model.scores_with_salience
    data = {k: v for k, v in config.to_dict().items() if k != "salience_in_score"}
    assert AlignerConfig.from_dict(data).salience_in_score  # older configs: default True
    with pytest.raises(ValueError, match="'salience_in_score'"):
        AlignerConfig.from_dict({**data, "salience_in_score": "no"})


def test_padding_is_never_a_real_token(model):
    input_ids, attention = model.pad(model.tokenizer.ids(TEXTS[:3]))
    assert not attention.all()  # texts of different lengths: some padding
    out = model(input_ids, attention, is_query=False)
    assert torch.equal(out.mask, attention.bool())
    assert out.vectors[~out.mask].abs().max() == 0 and out.salience[~out.mask].abs().max() == 0
    # A text padded inside a batch encodes exactly as on its own.
    _same(model.encode([TEXTS[2]], is_query=False), model.encode([TEXTS[2], TEXTS[3]], is_query=False)[:1])


def test_keep_special_changes_the_mask(model, monkeypatch):
    with_special = model.encode(TEXTS, is_query=False)
    input_ids, attention = model.pad(model.tokenizer.ids(TEXTS[:1]))
    monkeypatch.setattr(model.config, "keep_special", False)
    mask = model(input_ids, attention, is_query=False).mask[0]
    assert not mask[0] and not mask[-1] and mask[1:-1].all()
    without = model.encode(TEXTS, is_query=False)
    for text, a, b in zip(TEXTS, with_special, without):
        if text:  # [CLS]/[SEP] dropped; content vectors unchanged (the backbone still sees them)
            assert b.vectors.shape[0] == a.vectors.shape[0] - 2
            np.testing.assert_allclose(b.vectors, a.vectors[1:-1], atol=1e-6)
        else:  # an empty text keeps its special tokens so it still has a vector
            assert b.vectors.shape[0] == a.vectors.shape[0] == 2


def test_encode_returns_input_order_despite_length_sorting(model):
    texts = TEXTS + [LONG, "tiny"]
    batched = model.encode(texts, is_query=False, batch_size=3)
    singles = [model.encode([t], is_query=False)[0] for t in texts]
    _same(batched, singles)
    assert model.encode([], is_query=True) == []


def test_truncation_is_counted_and_logged_once(model, caplog, monkeypatch):
    monkeypatch.setattr(model, "truncation_counts", {"query": 0, "doc": 0})
    with caplog.at_level(logging.WARNING, logger="pyserini_aligner.model"):
        docs = model.encode([LONG, "short", LONG], is_query=False)
        model.encode([LONG], is_query=False)
    assert [d.truncated for d in docs] == [True, False, True]
    assert docs[0].vectors.shape == (256, 128)
    assert model.truncation_counts["doc"] == 3
    assert [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()] == [
        "2 of 3 documents truncated to 256 tokens (running total in AlignerModel.truncation_counts: 2)"]
    query = model.encode([LONG], is_query=True)[0]
    assert query.truncated and query.vectors.shape == (64, 128)
    ids, cut = model.tokenize([LONG], is_query=True)
    assert cut == [True] and ids[0][-1] == model.tokenizer.sep_token_id


def test_salience_heads_per_side(model, monkeypatch):
    monkeypatch.setattr(model.config, "use_salience", True)
    monkeypatch.setattr(model.config, "salience_mode", "relu")
    with torch.no_grad():
        for head, bias in ((model.q_salience, 1.0), (model.d_salience, 2.0)):
            monkeypatch.setattr(head.weight, "data", torch.zeros_like(head.weight))
            monkeypatch.setattr(head.bias, "data", torch.full((1,), bias))
    q, d = model.encode([TEXTS[0]], is_query=True)[0], model.encode([TEXTS[0]], is_query=False)[0]
    np.testing.assert_allclose(q.salience, 1.0)
    np.testing.assert_allclose(d.salience, 2.0)
    monkeypatch.setattr(model.config, "salience_mode", "lp")
    d = model.encode([TEXTS[3]], is_query=False)[0]
    k = max(model.config.alpha_d * len(d.salience), 1.0)
    assert d.salience.min() >= 0 and abs(d.salience.sum() - 2.0 * k) < 1e-3


def test_save_from_pretrained_round_trip(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "backbone_delta.safetensors").exists()  # the shipped model tunes top layers
    again = AlignerModel.from_pretrained(tmp_path / "ckpt")
    assert again.fingerprint() == model.fingerprint()
    _same(again.encode(TEXTS, is_query=True), model.encode(TEXTS, is_query=True), atol=0)


def test_backbone_delta_round_trip(tmp_path):
    from pyserini_aligner.checkpoints.make_default import make_default

    make_default(tmp_path / "untrained")
    tuned = AlignerModel.from_pretrained(tmp_path / "untrained")
    assert not tuned.backbone_delta()
    base_fp = tuned.fingerprint()
    with torch.no_grad():
        tuned.backbone.encoder.layer[5].output.dense.bias.add_(0.05)
    assert tuned.fingerprint() != base_fp
    tuned.save_pretrained(tmp_path / "tuned")
    delta = load_file(str(tmp_path / "tuned" / "backbone_delta.safetensors"))
    assert list(delta) == ["encoder.layer.5.output.dense.bias"]
    again = AlignerModel.from_pretrained(tmp_path / "tuned")
    assert again.fingerprint() == tuned.fingerprint()
    _same(again.encode(TEXTS, is_query=False), tuned.encode(TEXTS, is_query=False), atol=0)


def _copy_default(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_CHECKPOINT, folder)
    return folder


def test_clear_errors_for_bad_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        AlignerModel.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match="afile"):
        AlignerModel.from_pretrained(tmp_path / "afile")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        AlignerModel.from_pretrained(tmp_path / "empty")

    folder = _copy_default(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for patch, match in [({"format_version": 99}, "format_version"), ({"colour": 1}, "colour"),
                         ({"salience_mode": "soft"}, "salience_mode"), ({"doc_maxlen": 4096}, "doc_maxlen"),
                         ({"hidden_size": 768}, "hidden_size")]:
        (folder / "config.json").write_text(json.dumps({**config, **patch}))
        with pytest.raises(ValueError, match=match):
            AlignerModel.from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        AlignerModel.from_pretrained(folder)


def test_clear_errors_for_bad_weights(tmp_path):
    folder = _copy_default(tmp_path)
    heads = load_file(str(folder / "heads.safetensors"))
    save_file({**heads, "projection.weight": torch.zeros(64, 384)}, str(folder / "heads.safetensors"))
    with pytest.raises(ValueError, match=r"heads.safetensors.*projection.weight.*\[64, 384\]"):
        AlignerModel.from_pretrained(folder)
    save_file({k: v for k, v in heads.items() if k != "q_salience.bias"}, str(folder / "heads.safetensors"))
    with pytest.raises(ValueError, match="missing.*q_salience.bias"):
        AlignerModel.from_pretrained(folder)
    (folder / "heads.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="heads.safetensors"):
        AlignerModel.from_pretrained(folder)

    folder = _copy_default(tmp_path / "b")
    save_file({"encoder.layer.9.bogus": torch.zeros(3)}, str(folder / "backbone_delta.safetensors"))
    with pytest.raises(ValueError, match="backbone_delta.safetensors.*encoder.layer.9.bogus"):
        AlignerModel.from_pretrained(folder)
    save_file({"encoder.layer.0.output.dense.bias": torch.zeros(5)}, str(folder / "backbone_delta.safetensors"))
    with pytest.raises(ValueError, match="backbone_delta.safetensors.*shape"):
        AlignerModel.from_pretrained(folder)
    (folder / "backbone_delta.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="backbone_delta.safetensors"):
        AlignerModel.from_pretrained(folder)


def test_config_json_round_trip(tmp_path):
    config = AlignerConfig(keep_special=False, alpha_d=0.3, description="x")
    config.save(tmp_path / "c.json")
    assert AlignerConfig.load(tmp_path / "c.json") == config
    with pytest.raises(ValueError, match="alpha_q"):
        AlignerConfig(alpha_q=0.0).validate()


def test_fingerprint_tracks_config_and_heads(model, monkeypatch):
    fp = model.fingerprint()
    assert len(fp) == 64 and fp == model.fingerprint()
    monkeypatch.setattr(model.config, "keep_special", False)
    assert model.fingerprint() != fp
    monkeypatch.setattr(model.config, "keep_special", True)
    monkeypatch.setattr(model.config, "description", "other words")
    assert model.fingerprint() == fp


def test_reduced_precision_autocast(model):
    full = model.encode(TEXTS, is_query=False)
    half = model.encode(TEXTS, is_query=False, dtype="bf16")
    assert model.compute_dtype is None
    for a, b in zip(full, half):
        assert b.vectors.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(b.vectors, axis=1), 1.0, atol=1e-4)
        assert (a.vectors * b.vectors).sum(1).min() > 0.97
    assert resolve_dtype("fp16") == torch.float16 and resolve_dtype("fp32") is None
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8")


def test_encoding_keeps_the_training_mode(model):
    """Encoding runs in eval mode and leaves the model in the mode it found (eval stays eval without a switch over
    every module; train mode comes back after encoding)."""
    texts = ["protein folding in cells", "cancer risk"]
    assert not model.training
    first = model.encode_padded(texts, is_query=True)
    assert not model.training
    model.train()
    try:
        again = model.encode_padded(texts, is_query=True)
        assert model.training and model.backbone.training
        encoded = model.encode(texts, is_query=False)
        assert model.training and len(encoded) == 2
    finally:
        model.eval()
    assert torch.equal(first.vectors, again.vectors)  # dropout was off while encoding

"""Query encoding on the CPU through ONNX Runtime against torch's eager pass of the same real weights."""
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from pyserini_aligner import onnx_runtime
from pyserini_aligner.resolve import load_model

QUERIES = ["What causes the loss of sensory hair cells?", "vitamin D deficiency and tuberculosis risk",
           "a", "0-dimensional biomaterials show inductive properties."]


def torch_encoding(model, texts):
    """The same texts through torch alone (the model's ONNX path switched off for the call)."""
    stamp, session = model._onnx_stamp, model._onnx
    model._onnx_stamp = None
    try:
        return model.encode_padded(texts, is_query=True, batch_size=3)
    finally:
        model._onnx_stamp, model._onnx = stamp, session


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(onnx_runtime.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(onnx_runtime.RUNTIME_ENV, raising=False)
    return tmp_path / "cache" / "onnx"


def test_queries_through_onnx_runtime_equal_torch_to_rounding(cache, monkeypatch):
    """In float32, a model loaded to search with encodes queries through an exported graph of its weights (one file
    in the cache, no partial file left), with vectors equal to torch's to float32 rounding, the same token mask, and
    saliences within 2e-3 (the salience LP magnifies the last bits of its logits); documents and a model that was
    trained since go through torch."""
    monkeypatch.setenv(onnx_runtime.RUNTIME_ENV, "onnx")
    model = load_model("aligner", device="cpu")
    got = model.encode_padded(QUERIES, is_query=True, batch_size=3)
    assert model._onnx is not None and [p.name for p in cache.iterdir()] == [model._onnx.path.name]
    want = torch_encoding(model, QUERIES)
    assert torch.equal(got.mask, want.mask)
    assert torch.allclose(got.vectors, want.vectors, rtol=0, atol=1e-5)
    assert torch.allclose(got.salience, want.salience, rtol=1e-3, atol=2e-3)
    one = model.encode_padded(QUERIES[:1], is_query=True, batch_size=1)  # a batch of one: no padding at all
    assert torch.allclose(one.vectors[0], got.vectors[0, :one.vectors.shape[1]], rtol=0, atol=1e-5)

    docs = model.encode_padded(QUERIES, is_query=False, batch_size=3)
    stamp, model._onnx_stamp = model._onnx_stamp, None
    assert torch.equal(model.encode_padded(QUERIES, is_query=False, batch_size=3).vectors, docs.vectors)
    model._onnx_stamp = stamp

    with torch.no_grad():
        model.projection.weight.mul_(0.5)  # as an optimiser step would: in place
    after = model.encode_padded(QUERIES, is_query=True, batch_size=3)
    assert model._onnx is None and model._onnx_stamp is None  # torch from now on, nothing exported again
    assert torch.allclose(after.vectors, got.vectors, rtol=0, atol=1e-5)  # unit vectors: the scale cancels
    assert len(list(cache.iterdir())) == 1


def test_the_default_8_bit_graph_keeps_the_vectors_and_the_rankings(cache, monkeypatch, default_index, caplog):
    """By default queries go through the 8-bit copy of the exported graph (both files in the cache, made without a
    line of the quantizer's notes in an INFO log): the same token mask, every token vector within a cosine of 0.97
    of torch's; and the default index ranks the judged queries' top 10 as with torch's vectors, but for a few swaps
    near the cut (mean overlap at least 0.9)."""
    import logging

    import numpy as np

    from pyserini_aligner.search import AlignerSearcher

    model = load_model("aligner", device="cpu")
    with caplog.at_level(logging.INFO):
        got = model.encode_padded(QUERIES, is_query=True, batch_size=3)
    assert not [r for r in caplog.records if r.name == "root"], caplog.text[:500]
    assert model._onnx.path.name.endswith(".int8.onnx")
    assert sorted(p.name for p in cache.iterdir()) == sorted([model._onnx.path.name,
                                                                model._onnx.path.name.replace(".int8", "")])
    want = torch_encoding(model, QUERIES)
    assert torch.equal(got.mask, want.mask)
    cosines = (got.vectors * want.vectors).sum(-1)[want.mask]
    assert cosines.min() > 0.97, cosines.min()

    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        queries = [json.loads(line)["text"] for line in archive.read("scifact/queries.jsonl").decode().splitlines()]
    queries, qids = queries[:40], [str(i) for i in range(40)]
    monkeypatch.setenv(onnx_runtime.RUNTIME_ENV, "torch")
    exact = AlignerSearcher(default_index, encoder=load_model("aligner", device="cpu")).batch_search(queries, qids)
    quick = AlignerSearcher(default_index, encoder=model).batch_search(queries, qids)
    overlaps = [len({h.docid for h in exact[q]} & {h.docid for h in quick[q]}) / 10 for q in qids]
    assert np.mean(overlaps) >= 0.9, overlaps


def test_the_runtime_is_chosen_by_the_environment(cache, monkeypatch):
    monkeypatch.setenv(onnx_runtime.RUNTIME_ENV, "torch")
    model = load_model("aligner", device="cpu")
    model.encode_padded(QUERIES[:1], is_query=True)
    assert model._onnx_stamp is None and model._onnx is None and not cache.exists()
    monkeypatch.setenv(onnx_runtime.RUNTIME_ENV, "tensorrt")
    with pytest.raises(ValueError, match=r"RUNTIME='tensorrt': expected one of onnx-int8, onnx, torch"):
        load_model("aligner", device="cpu")


def test_an_unwritable_cache_leaves_queries_in_torch(tmp_path, monkeypatch):
    """When the export cannot be written the model warns once and encodes its queries by torch."""
    from pyserini_aligner import model as model_module

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(onnx_runtime.CACHE_ENV, str(blocker))
    monkeypatch.delenv(onnx_runtime.RUNTIME_ENV, raising=False)
    warned = []  # read from the logger call itself: other tests may have configured where records go
    monkeypatch.setattr(model_module.logger, "warning", lambda message, *args: warned.append(message % args))
    model = load_model("aligner", device="cpu")
    got = model.encode_padded(QUERIES, is_query=True, batch_size=3)
    model.encode_padded(QUERIES[:1], is_query=True, batch_size=1)
    assert model._onnx is None and model._onnx_stamp is None
    assert len(warned) == 1 and warned[0].startswith("queries are encoded by torch: the ONNX Runtime export failed")
    assert torch.equal(got.vectors, torch_encoding(model, QUERIES).vectors)


def test_a_backbone_sharing_its_lower_layers_exports_every_layer(cache, monkeypatch):
    """A backbone that takes its lower layers' states from a shared store (as adaptation's checkpoints do) exports
    a graph of all its layers: queries of other lengths and batch sizes than any stored encode as torch does."""
    from pyserini_aligner.backbone import SharedLayers

    monkeypatch.setenv(onnx_runtime.RUNTIME_ENV, "onnx")
    model = load_model("aligner", device="cpu")
    layers = SharedLayers(model.backbone, 3)
    model.backbone.share(layers)
    try:
        model.encode_padded(QUERIES[:2], is_query=False, batch_size=2)  # states stored for two texts
        got = model.encode_padded(QUERIES, is_query=True, batch_size=3)
        assert model._onnx is not None
        want = torch_encoding(model, QUERIES)
    finally:
        model.backbone.share(None)
    assert torch.equal(got.mask, want.mask)
    assert torch.allclose(got.vectors, want.vectors, rtol=0, atol=1e-5)

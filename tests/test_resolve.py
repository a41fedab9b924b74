"""The model resolver: names, checkpoint folders and ready models to one loaded AlignerModel."""
from pathlib import Path

import pytest
import torch

from pyserini_aligner.checkpoints.make_default import make_default
from pyserini_aligner.encoders import AlignerQueryEncoder
from pyserini_aligner.model import DEFAULT_CHECKPOINT, resolve_backbone
from pyserini_aligner.resolve import is_checkpoint, load_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def untrained_folder(tmp_path_factory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("untrained") / "ckpt"
    return folder, make_default(folder)


def test_is_checkpoint_knows_an_aligner_folder_by_its_config(tmp_path, untrained_folder):
    assert is_checkpoint(DEFAULT_CHECKPOINT) and is_checkpoint(str(untrained_folder[0]))
    backbone = resolve_backbone("minilm")
    assert (Path(backbone) / "config.json").is_file() and not is_checkpoint(backbone)  # a plain HF model
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    (tmp_path / "file").write_text("x")
    assert not any(is_checkpoint(p) for p in (tmp_path / "bad", tmp_path / "file", tmp_path / "nowhere", "aligner"))


def test_names_and_folders_load_the_same_weights(model, untrained_folder):
    folder, fingerprint = untrained_folder
    untrained = load_model("untrained")
    assert untrained.fingerprint() == fingerprint == load_model(folder).fingerprint()
    assert untrained.config.use_salience is False and untrained.device == torch.device("cpu")
    assert load_model().fingerprint() == model.fingerprint() != fingerprint


def test_every_shipped_name_loads_its_own_checkpoint(model, monkeypatch):
    """"aligner-mix" is the default checkpoint trained further: same model settings and frozen layers, other
    trained weights; its name reaches Pyserini's CLIs as "aligner" does."""
    from pyserini_aligner.checkpoints import SHIPPED
    from pyserini_aligner.pyserini_patches.hooks import _argv_uses_aligner
    from pyserini_aligner.train.config import init_model_fields

    mix = load_model("aligner-mix")
    assert mix.fingerprint() != model.fingerprint() == load_model(SHIPPED["aligner"]).fingerprint()
    assert mix.config.dim == model.config.dim and mix.config.doc_maxlen == model.config.doc_maxlen
    embeddings = [m.backbone.embeddings.word_embeddings.weight for m in (model, mix)]
    top_layer = [m.backbone.encoder.layer[5].output.dense.weight for m in (model, mix)]
    assert torch.equal(*embeddings) and not torch.equal(*top_layer)
    assert init_model_fields("aligner-mix")["description"] == mix.config.description != model.config.description
    from pyserini_aligner.index.builder import model_name_of

    assert model_name_of("aligner-mix") == "aligner-mix"  # what an index's manifest records, not the folder
    for argv, uses in ((["--encoder", "aligner-mix"], True), (["--encoder=aligner"], True),
                       (["--encoder", "bge-base-en-v1.5"], False)):
        monkeypatch.setattr("sys.argv", ["pyserini.search.faiss", "--topics", "t", *argv])
        assert _argv_uses_aligner() is uses, argv


def test_ready_models_and_wrappers_are_used_as_they_are(model):
    encoder = AlignerQueryEncoder(model)
    assert load_model(model) is model and load_model(encoder) is model
    assert model.compute_dtype is None
    try:
        assert load_model(encoder, dtype="bf16").compute_dtype == torch.bfloat16
    finally:
        model.compute_dtype = None


def test_precision_defaults():
    assert load_model("untrained", dtype="fp16").compute_dtype == torch.float16
    assert load_model("untrained").compute_dtype is None  # auto on the CPU: fp32
    assert AlignerQueryEncoder("untrained").model.compute_dtype is None
    assert AlignerQueryEncoder("untrained", fp16=True).model.compute_dtype == torch.float16


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(TypeError, match="got int"):
        load_model(42)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


def test_only_the_resolver_loads_checkpoints():
    """Every library and evaluation module loads a model through pyserini_aligner.resolve."""
    callers = [str(p.relative_to(REPO)) for package in ("pyserini_aligner", "eval")
               for p in (REPO / package).rglob("*.py") if "AlignerModel.from_pretrained(" in p.read_text()]
    assert callers == ["pyserini_aligner/resolve.py"]


def test_every_checkpoint_folder_is_shipped_by_its_name(tmp_path):
    """A checkpoint folder added beside the shipped ones is a shipped name at once (``_`` written ``-``), after the
    default; a folder without a config.json is not."""
    from pyserini_aligner.checkpoints import SHIPPED, _shipped

    for name in ("aligner_mix", "aligner", "aligner_384", "notes"):
        (tmp_path / name).mkdir()
    for name in ("aligner_mix", "aligner", "aligner_384"):
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")  # a file, not a folder
    assert _shipped(tmp_path) == {"aligner": tmp_path / "aligner", "aligner-384": tmp_path / "aligner_384",
                                  "aligner-mix": tmp_path / "aligner_mix"}
    assert list(SHIPPED)[0] == "aligner" and "aligner-mix" in SHIPPED and SHIPPED["aligner"] == DEFAULT_CHECKPOINT

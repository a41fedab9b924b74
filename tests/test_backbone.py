"""The backbone in plain torch and its tokenizer against ``transformers``' BertModel and tokenizer (the reference):
the same weights under the same names, the same hidden states to float rounding, the same token ids."""
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from pyserini_aligner.backbone import Bert, BertConfig, WordPieces, load_backbone, load_tokenizer
from pyserini_aligner.model import resolve_backbone

SOURCE = resolve_backbone("minilm")


def scifact_texts(n: int) -> list[str]:
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        docs = archive.read("scifact/corpus.jsonl").decode().splitlines()[:n]
        queries = archive.read("scifact/queries.jsonl").decode().splitlines()[:n]
    return [json.loads(line)["text"] for line in docs + queries] + ["", "  ", "Ünïcödé — 𝔘 ½ 東京", "a"]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(SOURCE).float().eval(), AutoTokenizer.from_pretrained(SOURCE)


def test_the_tokenizer_gives_the_reference_ids(reference):
    _, hub = reference
    ours = load_tokenizer(SOURCE)
    assert isinstance(ours, WordPieces)
    texts = scifact_texts(200)
    for max_length in (None, 5, 65, 257):
        expected = hub(texts, add_special_tokens=True, truncation=max_length is not None, max_length=max_length)
        assert ours.ids(texts, max_length) == expected["input_ids"]
    assert ours.ids(texts[:20], special=False) == hub(texts[:20], add_special_tokens=False)["input_ids"]
    ids, spans = ours.ids_and_offsets(texts[0], 40)
    expected = hub(texts[0], truncation=True, max_length=40, return_offsets_mapping=True)
    assert ids == expected["input_ids"] and [tuple(s) for s in spans] == [tuple(s) for s in expected["offset_mapping"]]
    assert ours.tokens(ids) == hub.convert_ids_to_tokens(ids)
    assert (ours.cls_token_id, ours.sep_token_id, ours.pad_token_id) == (hub.cls_token_id, hub.sep_token_id,
                                                                         hub.pad_token_id)
    assert ours.decode(ids) == hub.decode(ids, skip_special_tokens=True)


def test_hidden_states_equal_the_reference_to_float_rounding(reference):
    hub_model, _ = reference
    ours = load_backbone(SOURCE)
    assert isinstance(ours, Bert) and not ours.training
    assert list(ours.state_dict()) == list(hub_model.state_dict())
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in hub_model.state_dict().items())
    rows = load_tokenizer(SOURCE).ids(scifact_texts(12), 80)
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    assert not mask.all()
    with torch.inference_mode():
        ours_hidden = ours(ids, mask).last_hidden_state
        expected = hub_model(input_ids=ids, attention_mask=mask).last_hidden_state
        alone = ours(ids[:1, :len(rows[0])], mask[:1, :len(rows[0])]).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(ours_hidden[real], expected[real], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(alone[0], ours_hidden[0, :len(rows[0])], atol=2e-5, rtol=1e-5)


def test_dropout_only_while_training():
    model = load_backbone(SOURCE)
    ids = torch.tensor([load_tokenizer(SOURCE).ids(["dropout acts only in training"])[0]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        first, second = (model(ids, mask).last_hidden_state for _ in range(2))
        assert torch.equal(first, second)
        model.train()
        torch.manual_seed(0)
        third, fourth = (model(ids, mask).last_hidden_state for _ in range(2))
    assert not torch.equal(third, fourth)


def test_other_architectures_are_not_taken_for_bert(tmp_path):
    config = json.loads((Path(SOURCE) / "config.json").read_text())
    assert BertConfig.read(Path(SOURCE)).num_hidden_layers == config["num_hidden_layers"]
    for change in ({"model_type": "roberta"}, {"hidden_act": "gelu_new"}, {"position_embedding_type": "relative_key"},
                   {"num_attention_heads": 5}):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        assert BertConfig.read(tmp_path) is None, change
    (tmp_path / "config.json").write_text("{not json")
    assert BertConfig.read(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Bert.load(tmp_path, BertConfig.read(tmp_path))


def test_the_speed_study_compares_both_backbones_on_cpu(tmp_path):
    import subprocess
    import sys

    zip_path = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"
    done = subprocess.run([sys.executable, "-m", "eval.experiments.backbone_speed", "--beir-zip", str(zip_path),
                           "--output", str(tmp_path), "--device", "cpu", "--docs", "4", "--queries", "2",
                           "--batch-size", "2", "--repeats", "1"], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "backbone_speed.json").read_text())
    assert set(report["rows"]) == {"plain torch", "transformers BertModel"}
    assert all(row["docs_s"] > 0 and row["query_eager_ms_p50"] > 0 for row in report["rows"].values())
    assert report["max_abs_diff_query_vectors"] < 1e-4 and report["max_abs_diff_doc_vectors"] < 1e-4
    assert "| plain torch |" in (tmp_path / "backbone_speed.md").read_text()


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    return (torch.tensor([row + [0] * (width - len(row)) for row in rows]),
            torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]))


def test_shared_layers_keep_each_texts_lower_states_for_every_backbone_with_those_weights():
    from pyserini_aligner.backbone import SharedLayers

    base, tuned, other = (load_backbone(SOURCE) for _ in range(3))
    with torch.no_grad():
        tuned.encoder.layer[4].output.dense.weight.mul_(1.1)  # fine-tuned above layer 3
        other.encoder.layer[1].output.dense.weight.mul_(1.1)
    rows = load_tokenizer(SOURCE).ids(scifact_texts(10), 60)
    ids, mask = padded(rows)
    layers = SharedLayers(base, depth=3)
    with pytest.raises(ValueError, match="first 3 layers differ"):
        other.share(layers)
    with torch.inference_mode():
        expected = {name: model(ids, mask).last_hidden_state for name, model in (("base", base), ("tuned", tuned))}
        base.share(layers)
        tuned.share(layers)
        first = base(ids[:7], mask[:7]).last_hidden_state  # 7 texts computed and kept
        assert (layers.computed, layers.reused) == (7, 0)
        ids_b, mask_b = padded(rows[::-1])  # other batches, another padding: the kept states are per text
        second = tuned(ids_b, mask_b).last_hidden_state.flip(0)
        assert (layers.computed, layers.reused) == (len(rows), 7)
        base.share(None)
        assert torch.equal(base(ids, mask).last_hidden_state, expected["base"])
    real = mask.bool()
    torch.testing.assert_close(first[real[:7]], expected["base"][:7][real[:7]], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(second[:, :ids.shape[1]][real], expected["tuned"][real], atol=2e-5, rtol=1e-5)
    assert not torch.allclose(expected["base"][real], expected["tuned"][real], atol=1e-3)
    distinct = {tuple(row) for row in rows}  # (two blank texts: one key)
    assert layers.bytes == sum(map(len, distinct)) * base.config.hidden_size * 4


def test_shared_layers_keep_the_states_of_each_precision_apart():
    """Under bf16 autocast the kept states are those the bf16 layers give, never the float32 ones (nor the
    reverse), and the upper layers continue from them as the plain bf16 forward does."""
    from pyserini_aligner.backbone import SharedLayers

    model = load_backbone(SOURCE)
    ids, mask = padded(load_tokenizer(SOURCE).ids(scifact_texts(6), 50))
    real = mask.bool()
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
    with torch.inference_mode():
        with bf16:
            expected_bf16 = model(ids, mask).last_hidden_state
        expected = model(ids, mask).last_hidden_state
        layers = SharedLayers(model, depth=3)
        model.share(layers)
        with bf16:
            first = model(ids, mask).last_hidden_state
        assert (layers.computed, layers.reused) == (len(ids), 0)
        plain = model(ids, mask).last_hidden_state  # float32: its own states, computed again
        assert (layers.computed, layers.reused) == (2 * len(ids), 0)
        with bf16:
            again = model(ids[:3], mask[:3]).last_hidden_state
        assert (layers.computed, layers.reused) == (2 * len(ids), 3)
        model.share(None)
    torch.testing.assert_close(first[real], expected_bf16[real], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(again[:, :first.shape[1]][real[:3]], first[:3][real[:3]], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(plain[real], expected[real], atol=2e-5, rtol=1e-5)
    assert not torch.allclose(first[real], plain[real], atol=1e-3)  # the bf16 states were not the float32 ones


def test_shared_layers_past_their_memory_compute_again_and_leave_training_alone():
    from pyserini_aligner.backbone import SharedLayers

    model = load_backbone(SOURCE)
    ids, mask = padded(load_tokenizer(SOURCE).ids(scifact_texts(4), 40))
    layers = SharedLayers(model, depth=2, max_bytes=0)
    model.share(layers)
    with torch.inference_mode():
        once, twice = (model(ids, mask).last_hidden_state for _ in range(2))
    assert (layers.computed, layers.reused, layers.bytes) == (2 * len(ids), 0, 0)
    torch.testing.assert_close(once, twice)
    model.train()
    model(ids, mask)
    assert layers.computed == 2 * len(ids)  # training runs every layer
    with pytest.raises(ValueError, match="depth"):
        SharedLayers(model, depth=7)

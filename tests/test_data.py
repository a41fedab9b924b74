"""Data loading through ir_datasets and local BEIR folders, with clear errors."""
import json
import os
import subprocess
import sys

import pytest

from pyserini_aligner.data import BEIR_DIR_ENV, DataError, Dataset, iter_corpus


def test_ir_datasets_scifact_test():
    dataset = Dataset("beir/scifact/test")
    assert len(dataset.queries()) == 300
    assert sum(len(docs) for docs in dataset.qrels().values()) == 339
    first = next(dataset.docs())
    assert first.docid and first.contents.startswith(first.title)


def test_nfcorpus_splits():
    assert len(Dataset("beir/nfcorpus/dev").queries()) == 324
    assert len(Dataset("beir/nfcorpus/train").qrels()) > 2000


def test_unknown_dataset_id():
    with pytest.raises(DataError, match="unknown dataset ID 'beir/nosuchset/test'"):
        Dataset("beir/nosuchset/test")


def test_missing_data_file(tmp_path, monkeypatch):
    monkeypatch.setenv(BEIR_DIR_ENV, str(tmp_path))  # a BEIR folder without scifact.zip
    monkeypatch.setenv("IR_DATASETS_HOME", str(tmp_path / "home"))
    with pytest.raises(DataError, match=r"data file missing .*scifact\.zip"):
        Dataset("beir/scifact/test")


def test_local_folder(scifact_small):
    dataset = Dataset(str(scifact_small))
    assert sum(1 for _ in dataset.docs()) == 150
    assert set(dataset.queries()) == set(dataset.qrels())


def test_corpus_line_not_json(scifact_small, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    lines = (scifact_small / "corpus.jsonl").read_text().splitlines()
    lines[6] = '{"_id": "x", "text": '
    (broken / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"corpus\.jsonl, line 7: not valid JSON"):
        list(iter_corpus(str(broken)))


def test_missing_field_named(tmp_path):
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "t"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: missing field 'text'"):
        list(iter_corpus(str(tmp_path)))


def test_empty_corpus(tmp_path):
    (tmp_path / "corpus.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty corpus"):
        list(iter_corpus(str(tmp_path)))


def test_missing_qrels_file(scifact_small):
    with pytest.raises(DataError, match=r"data file missing: .*qrels/dev\.tsv"):
        Dataset(str(scifact_small), split="dev").qrels()


def test_processes_reading_a_corpus_ir_datasets_has_not_stored_yet_all_read_it_whole(tmp_path):
    """Several processes opening the same ir_datasets corpus in a fresh cache (pytest workers, torchrun ranks): one
    builds the document store while the others wait for it, so none reads a half-written store."""
    script = ("from pyserini_aligner.data import Dataset; "
              "print(sum(1 for _ in Dataset('beir/scifact/test').docs()))")
    env = {**os.environ, "IR_DATASETS_HOME": str(tmp_path / "home")}
    children = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err
        assert out.split() == ["5183"]

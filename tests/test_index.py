"""Multi-vector index: streaming build, on-disk layout, atomicity, docid checks, β^d pruning, corpus readers, CLI."""
import copy
import json
import os
import math
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pyserini_aligner.index import (CorpusError, IndexFormatError, StoredIndex, build_index, derive_index,
                                    read_json_collection, read_manifest, set_default_strategy)
from pyserini_aligner.index import __main__ as cli
from pyserini_aligner.index import store
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY, keep_count

import reference

SCIFACT = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"  # set by conftest.py
N_DOCS = 200


def scifact_docs(n: int) -> list[dict]:
    """The first n SciFact documents as JsonCollection records (contents = title + text)."""
    records = []
    with zipfile.ZipFile(SCIFACT) as archive, archive.open("scifact/corpus.jsonl") as lines:
        for line in lines:
            if len(records) == n:
                break
            doc = json.loads(line)
            records.append({"id": doc["_id"], "contents": f"{doc['title']} {doc['text']}".strip()})
    return records


def write_jsonl(path: Path, records: list, extra_lines: dict[int, str] | None = None) -> Path:
    """Write records one per line; ``extra_lines`` maps a 1-based line number to a raw line inserted there."""
    lines = [json.dumps(r) for r in records]
    for number, raw in sorted((extra_lines or {}).items()):
        lines.insert(number - 1, raw)
    path.write_text("\n".join(lines) + "\n")
    return path


def short_records(n: int, words: int = 12) -> list[dict]:
    """n SciFact documents cut to their first ``words`` words (fast to encode)."""
    return [{"id": r["id"], "contents": " ".join(r["contents"].split()[:words])} for r in scifact_docs(n)]


@pytest.fixture(scope="session")
def model():
    return AlignerModel.from_pretrained("aligner")


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.getbasetemp() / "scifact200.jsonl", scifact_docs(N_DOCS))


@pytest.fixture(scope="session")
def index_dir(tmp_path_factory, model, corpus_file) -> Path:
    """Flat index of the first 200 SciFact documents (built once per session, shared with test_search.py)."""
    target = tmp_path_factory.getbasetemp() / "scifact200_flat"
    if not (target / store.MANIFEST).is_file():
        build_index(read_json_collection(corpus_file), target, model, progress=False, model_name="aligner")
    return target


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".building-" in p.name or ".old-" in p.name]


def test_build_writes_layout_and_counts(index_dir, model, corpus_file):
    m = read_manifest(index_dir)
    assert (m.format, m.model_name, m.dim, m.doc_prune, m.index_type) == (
        "pyserini-aligner", "aligner", 128, 1.0, "Flat")
    assert m.model_fingerprint == model.fingerprint()
    assert m.default_strategy == model.config.default_strategy
    assert m.num_docs == N_DOCS and m.num_kept == m.num_tokens and m.num_empty == 0
    sizes = {store.VECTORS: 2 * 128 * m.num_tokens, store.SALIENCE: 4 * m.num_tokens, store.KEPT: m.num_tokens,
             store.OFFSETS: 8 * (N_DOCS + 1), store.FAISS_IDS: 8 * m.num_kept}
    for name, size in sizes.items():
        assert (index_dir / name).stat().st_size == size, name
    stored = StoredIndex(index_dir)
    records = [json.loads(line) for line in corpus_file.read_text().splitlines()]
    assert stored.docids == [r["id"] for r in records]
    assert stored.faiss_index().ntotal == m.num_kept
    assert np.array_equal(stored.faiss_ids, np.arange(m.num_tokens))
    assert stored.lengths.max() <= model.config.doc_maxlen
    assert m.num_truncated == int((stored.lengths == model.config.doc_maxlen).sum())
    rows = [0, 7, N_DOCS - 1]
    encoded = model.encode([records[r]["contents"] for r in rows], is_query=False)
    vectors, mask, salience = stored.gather(np.array(rows))
    for i, e in enumerate(encoded):
        n = len(e.vectors)
        assert int(mask[i].sum()) == n == stored.lengths[rows[i]]
        assert torch.allclose(vectors[i, :n], torch.from_numpy(e.vectors), atol=2e-3)
        assert torch.allclose(salience[i, :n], torch.from_numpy(e.salience))


def test_build_is_atomic_on_late_error(tmp_path, model):
    corpus = write_jsonl(tmp_path / "docs.jsonl", short_records(30), extra_lines={25: "{not json"})
    target = tmp_path / "out" / "index"
    with pytest.raises(CorpusError, match=r"docs\.jsonl, line 25: not valid JSON"):
        build_index(read_json_collection(corpus), target, model, batch_size=2, progress=False)  # 16 docs written first
    assert not target.exists()
    assert leftovers(target.parent) == []


def test_failed_overwrite_keeps_old_index(tmp_path, model):
    target = tmp_path / "index"
    corpus = write_jsonl(tmp_path / "a.jsonl", short_records(3))
    build_index(read_json_collection(corpus), target, model, progress=False)
    with pytest.raises(FileExistsError, match="index target exists"):
        build_index([("x", "text")], target, model, progress=False)
    with pytest.raises(ValueError, match="empty corpus"):
        build_index([], target, model, progress=False, overwrite=True)
    assert read_manifest(target).num_docs == 3 and leftovers(tmp_path) == []
    build_index([("x", "some text")], target, model, progress=False, overwrite=True)
    assert read_manifest(target).num_docs == 1 and leftovers(tmp_path) == []


def test_duplicate_docids_refused(tmp_path, model):
    records = short_records(6)
    records[4]["id"] = records[1]["id"]
    corpus = write_jsonl(tmp_path / "dup.jsonl", records)
    target = tmp_path / "index"
    with pytest.raises(ValueError, match=rf"duplicate docid '{records[1]['id']}': first at .*dup\.jsonl, line 2, "
                                         r"again at .*dup\.jsonl, line 5"):
        build_index(read_json_collection(corpus), target, model, progress=False)
    assert not target.exists() and leftovers(tmp_path) == []
    expected = "duplicate docid 'a': first at corpus, document 1, again at corpus, document 3"
    with pytest.raises(ValueError, match=expected):
        build_index([("a", "x"), ("b", "y"), ("a", "z")], target, model, progress=False)


@pytest.fixture(scope="module")
def salient(model):
    """A model whose document salience varies from token to token."""
    salient = copy.deepcopy(model)
    salient.config.use_salience = True
    with torch.no_grad():
        weight = salient.d_salience.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    return salient


def test_doc_prune_keeps_most_salient(tmp_path, salient):
    records = short_records(12, words=40)
    beta = 0.3
    target = tmp_path / "pruned"
    m = build_index([(r["id"], r["contents"]) for r in records], target, salient, doc_prune=beta, progress=False,
                    prune_redundancy=None)
    stored = StoredIndex(target)
    assert m.doc_prune == beta and m.num_kept == int(stored.kept.sum()) < m.num_tokens
    assert m.prune_redundancy is None and read_manifest(target).prune_redundancy is None
    encoded = salient.encode([r["contents"] for r in records], is_query=False)
    for row, e in enumerate(encoded):
        kept = np.asarray(stored.kept[stored.offsets[row]:stored.offsets[row + 1]])
        assert kept.sum() == keep_count(len(e.salience), beta) == math.ceil(beta * len(e.salience))
        assert e.salience[kept].min() >= e.salience[~kept].max()
    assert np.array_equal(stored.faiss_ids, np.flatnonzero(stored.kept))


def test_redundancy_aware_doc_prune(tmp_path, salient):
    records = [{"id": r["id"], "contents": r["contents"] + " " + r["contents"]}  # every word twice
               for r in scifact_docs(8)]
    docs = [(r["id"], r["contents"]) for r in records]
    built = build_index(docs, tmp_path / "default", salient, doc_prune=0.3, progress=False)
    assert built.prune_redundancy == DEFAULT_PRUNE_REDUNDANCY
    stored = StoredIndex(tmp_path / "default")
    for row in range(stored.num_docs):
        doc = slice(stored.offsets[row], stored.offsets[row + 1])
        salience, vectors = np.asarray(stored.salience[doc]), np.asarray(stored.vectors[doc], dtype=np.float64)
        expected = reference.prune_redundant(salience.tolist(), [True] * len(salience), vectors.tolist(), 0.3,
                                             DEFAULT_PRUNE_REDUNDANCY)
        assert np.asarray(stored.kept[doc]).tolist() == expected
    plain = build_index(docs, tmp_path / "off", salient, doc_prune=0.3, progress=False, prune_redundancy=None)
    assert plain.num_kept == built.num_kept and not np.array_equal(StoredIndex(tmp_path / "off").kept, stored.kept)
    # derive: the source's rule by default, or the one asked for; the same masks as building with it
    assert derive_index(tmp_path / "default", tmp_path / "inherit", index_type="IVF4,Flat",
                        progress=False).prune_redundancy == DEFAULT_PRUNE_REDUNDANCY
    assert np.array_equal(StoredIndex(tmp_path / "inherit").kept, stored.kept)
    derive_index(tmp_path / "off", tmp_path / "on", prune_redundancy=DEFAULT_PRUNE_REDUNDANCY, progress=False)
    assert np.array_equal(StoredIndex(tmp_path / "on").kept, stored.kept)
    derive_index(tmp_path / "default", tmp_path / "plain", prune_redundancy=None, progress=False)
    assert np.array_equal(StoredIndex(tmp_path / "plain").kept, StoredIndex(tmp_path / "off").kept)
    for bad in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="prune_redundancy"):
            derive_index(tmp_path / "default", tmp_path / "bad", prune_redundancy=bad, progress=False)
    manifest = json.loads((tmp_path / "plain" / store.MANIFEST).read_text())
    (tmp_path / "plain" / store.MANIFEST).write_text(json.dumps({**manifest, "prune_redundancy": 2}))
    with pytest.raises(IndexFormatError, match="prune_redundancy"):
        read_manifest(tmp_path / "plain")


def test_derive_index_reprunes_without_encoding(tmp_path, index_dir):
    target = tmp_path / "derived"
    m = derive_index(index_dir, target, doc_prune=0.25, index_type="IVF8,Flat", progress=False)
    stored = StoredIndex(target)
    counts = np.add.reduceat(np.asarray(stored.kept), stored.offsets[:-1])
    assert np.array_equal(counts, [keep_count(int(n), 0.25) for n in stored.lengths])
    assert (m.index_type, m.num_kept, stored.faiss_index().ntotal) == ("IVF8,Flat", counts.sum(), counts.sum())
    assert read_manifest(index_dir).doc_prune == 1.0


def test_compressed_index_layout_and_decoding(tmp_path, index_dir):
    target = tmp_path / "compressed"
    m = derive_index(index_dir, target, doc_prune=0.25, codec="IVF32,PQ16", progress=False)
    assert (m.codec, m.index_type) == ("IVF32,PQ16", "IVF32,PQ16")
    sizes = {store.TOKEN_CENTROIDS: 2 * m.num_tokens, store.TOKEN_RESIDUALS: 16 * m.num_tokens,
             store.KEPT_BITS: math.ceil(m.num_tokens / 8), store.CODEC_CENTROIDS: 32 * 128,
             store.CODEC_SCALES: 4 * 32, store.CODEC_CODEBOOKS: 4 * 128 * 256}
    for name, size in sizes.items():
        assert (target / name).stat().st_size == size, name
    for name in (store.VECTORS, store.SALIENCE, store.KEPT, store.FAISS_IDS, store.FAISS_INDEX):
        assert not (target / name).exists(), name
    source, compressed = StoredIndex(index_dir), StoredIndex(target)
    assert np.array_equal(compressed.kept, StoredIndex(derive_index(index_dir, tmp_path / "p", doc_prune=0.25,
                                                                    progress=False) and tmp_path / "p").kept)
    rows = np.array([0, 5, N_DOCS - 1])
    exact, mask, _ = source.gather(rows)
    approx, mask2, salience = compressed.gather(rows)
    assert torch.equal(mask, mask2) and torch.all(salience[mask2] == 1)
    cosine = torch.nn.functional.cosine_similarity(exact[mask], approx[mask], dim=-1)
    positions = np.arange(compressed.offsets[rows[0]], compressed.offsets[rows[0] + 1])
    centroid_only = compressed.codec.decode(compressed.centroid_ids[positions])
    assert torch.allclose(approx[0][mask[0]], compressed.token_vectors(positions))
    coarse = torch.nn.functional.cosine_similarity(exact[0][mask[0]], centroid_only, dim=-1)
    assert cosine.mean() > 0.85 and cosine[:len(positions)].mean() > coarse.mean() + 0.05
    faiss_index = compressed.faiss_index()
    assert faiss_index.ntotal == m.num_kept and np.array_equal(compressed.faiss_ids, np.flatnonzero(compressed.kept))
    with pytest.raises(ValueError, match="its tokens are compressed"):
        derive_index(target, tmp_path / "again", progress=False)
    with open(target / store.TOKEN_RESIDUALS, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(IndexFormatError, match=r"token_residuals\.u8: \d+ bytes, the manifest implies"):
        StoredIndex(target)


def test_compressed_build_from_corpus(tmp_path, model):
    corpus = write_jsonl(tmp_path / "docs.jsonl", short_records(40, words=30))
    cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx"), "--codec", "IVF4,PQ8", "--quiet"])
    m = read_manifest(tmp_path / "idx")
    assert (m.num_docs, m.codec, m.num_kept) == (40, "IVF4,PQ8", m.num_tokens)
    with pytest.raises(SystemExit, match=r"error: bad codec 'PQ8'"):
        cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx2"), "--codec", "PQ8", "--quiet"])
    salient = copy.deepcopy(model)
    salient.config.use_salience = salient.config.salience_in_score = True
    with pytest.raises(ValueError, match="stores no token saliences, but the model scores with them"):
        build_index(read_json_collection(corpus), tmp_path / "idx3", salient, codec="IVF4,PQ8", progress=False)
    assert not (tmp_path / "idx2").exists() and not (tmp_path / "idx3").exists()


def test_bad_factory_string_fails_before_encoding(tmp_path, model):
    with pytest.raises(ValueError, match="index_type 'Bogus12'"):
        build_index([("a", "x")], tmp_path / "i", model, index_type="Bogus12", progress=False)
    with pytest.raises(ValueError, match=r"FAISS training on 3 kept token vectors failed \(Number of training points"):
        build_index([("a", "x")], tmp_path / "i", model, index_type="IVF64,Flat", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_stored_index_errors_name_the_file(tmp_path, index_dir):
    broken = tmp_path / "broken"
    shutil.copytree(index_dir, broken)
    with open(broken / store.VECTORS, "r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(IndexFormatError, match=r"doc_vectors\.f16: 1000 bytes"):
        StoredIndex(broken)
    (broken / store.VECTORS).unlink()
    with pytest.raises(FileNotFoundError, match=r"index file missing: .*doc_vectors\.f16"):
        StoredIndex(broken)
    (broken / store.MANIFEST).write_text("{")
    with pytest.raises(IndexFormatError, match=r"manifest\.json: not valid JSON"):
        StoredIndex(broken)
    with pytest.raises(FileNotFoundError, match="index folder not found"):
        StoredIndex(tmp_path / "nowhere")


def test_set_default_strategy(tmp_path, index_dir):
    target = tmp_path / "copy"
    derive_index(index_dir, target, progress=False)
    assert set_default_strategy(target, "top-p:0.015").default_strategy == "top-p:0.015"
    assert read_manifest(target).default_strategy == "top-p:0.015"
    with pytest.raises(ValueError, match="bad alignment strategy 'top-q:1'"):
        set_default_strategy(target, "top-q:1")
    assert read_manifest(target).default_strategy == "top-p:0.015"


def test_json_collection_reader(tmp_path):
    folder = tmp_path / "coll"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [{"id": "d1", "contents": "one"}], extra_lines={2: ""})
    (folder / "sub" / "b.json").write_text(json.dumps([{"id": 2, "contents": "two"}]))
    (folder / "notes.txt").write_text("ignored")
    assert [(d, t) for d, t, _ in read_json_collection(folder)] == [("d1", "one"), ("2", "two")]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "d1", "contents": "x"}, {"id": "d2"}])
    with pytest.raises(CorpusError, match=r"bad\.jsonl, line 2: missing field 'contents'"):
        list(read_json_collection(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(CorpusError, match="empty corpus"):
        list(read_json_collection(empty))
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        list(read_json_collection(tmp_path / "missing.jsonl"))


def test_cli_builds_and_reports_errors(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "docs.jsonl", short_records(4))
    cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx"), "--index-type", "HNSW8", "--quiet"])
    m = read_manifest(tmp_path / "idx")
    assert (m.num_docs, m.index_type, m.corpus) == (4, "HNSW8", str(corpus.resolve()))
    bad = write_jsonl(tmp_path / "bad.jsonl", short_records(2), extra_lines={2: "oops"})
    with pytest.raises(SystemExit, match=r"error: .*bad\.jsonl, line 2: not valid JSON"):
        cli.main(["--corpus", str(bad), "--index", str(tmp_path / "idx2"), "--quiet"])
    with pytest.raises(SystemExit, match="error: index target exists"):
        cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx"), "--quiet"])
    cli.main(["--from-index", str(tmp_path / "idx"), "--index", str(tmp_path / "idx3"), "--doc-prune", "0.5",
              "--quiet"])
    assert read_manifest(tmp_path / "idx3").index_type == "HNSW8"
    assert read_manifest(tmp_path / "idx3").prune_redundancy == DEFAULT_PRUNE_REDUNDANCY  # the source's
    cli.main(["--from-index", str(tmp_path / "idx"), "--index", str(tmp_path / "idx4"), "--doc-prune", "0.5",
              "--prune-redundancy", "off", "--quiet"])
    assert read_manifest(tmp_path / "idx4").prune_redundancy is None
    with pytest.raises(SystemExit):
        cli.main(["--from-index", str(tmp_path / "idx"), "--index", str(tmp_path / "idx5"), "--prune-redundancy",
                  "1.5", "--quiet"])
    assert "--prune-redundancy: expected 'off' or a number in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "idx2").exists() and leftovers(tmp_path) == []

"""Multi-vector index: streaming build, on-disk layout, atomicity, docid checks, β^d pruning, corpus readers, CLI."""
import copy
import json
import os
import math
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from pyserini_aligner.index import (CorpusError, IndexFormatError, StoredIndex, build_index, derive_index,
                                    read_json_collection, read_manifest, set_default_strategy)
from pyserini_aligner.index import __main__ as cli
from pyserini_aligner.index import checksums, reader
from pyserini_aligner.index.format import (CODEC_CENTROIDS, CODEC_CODEBOOKS, CODEC_REFINE_BOOKS, CODEC_SCALES, DOCIDS,
                                           FAISS_IDS, FAISS_INDEX, IVF_CODES, IVF_DOCS, IVF_OFFSETS, KEPT, KEPT_BITS,
                                           LOCK, MANIFEST, OFFSETS, SALIENCE, TOKEN_CENTROIDS, TOKEN_RESIDUALS, VECTORS)
from pyserini_aligner.index.io import file_record
from pyserini_aligner.index.codec import HIERARCHY_MIN_NLIST
from pyserini_aligner.index.codec_spec import AUTO_CODEC, CodecSpec, choose_nlist, parse_codec
from pyserini_aligner.index.options import DEFAULT_DOC_PRUNE, BuildOptions
from pyserini_aligner.model import AlignerModel
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY, keep_count

import reference
from conftest import N_DOCS, scifact_docs



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


def only_segment(index: Path) -> Path:
    """The folder of the single segment of ``index``."""
    (segment,) = read_manifest(index).segments
    return index / segment.name


def edit_manifest(index: Path, **fields) -> None:
    """Change manifest fields and re-seal the manifest's own checksum (as a careless tool might)."""
    data = json.loads((index / MANIFEST).read_text())
    data.pop("checksum")
    data.update(fields)
    data["checksum"] = zlib.crc32(json.dumps(data, sort_keys=True).encode("utf-8"))
    (index / MANIFEST).write_text(json.dumps(data))


def flip_byte(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".building-" in p.name or ".old-" in p.name]


def test_build_writes_layout_and_counts(index_dir, model, corpus_file):
    m = read_manifest(index_dir)
    assert (m.format, m.format_version, m.generation, m.model_name, m.dim, m.doc_prune, m.index_type) == (
        "pyserini-aligner", 2, 1, "aligner", 128, 1.0, "Flat")
    assert m.codec == CodecSpec() and not m.codec.compressed and str(m.codec) == "fp16"
    assert (m.codec_dir, m.codec_files) == (None, {})
    assert m.model_fingerprint == model.fingerprint()
    assert str(m.default_strategy) == model.config.default_strategy
    assert m.num_docs == N_DOCS and m.num_kept == m.num_tokens and m.num_empty == 0
    (seg,) = m.segments
    assert re.fullmatch(r"seg-000001-[0-9a-f]{8}", seg.name)
    assert {p.name for p in index_dir.iterdir()} - {LOCK} == {MANIFEST, seg.name}
    folder = index_dir / seg.name
    sizes = {VECTORS: 2 * 128 * m.num_tokens, SALIENCE: 4 * m.num_tokens, KEPT: m.num_tokens,
             OFFSETS: 8 * (N_DOCS + 1), FAISS_IDS: 8 * m.num_kept}
    assert set(seg.files) == set(sizes) | {DOCIDS, FAISS_INDEX}
    for name, record in seg.files.items():  # every file's size and CRC32 recorded in the manifest
        assert record == file_record(folder / name), name
    for name, size in sizes.items():
        assert (folder / name).stat().st_size == size, name
    stored = StoredIndex(index_dir)
    records = [json.loads(line) for line in corpus_file.read_text().splitlines()]
    assert stored.docids == [r["id"] for r in records]
    assert stored.segments[0].faiss_index().ntotal == m.num_kept
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
        assert torch.allclose(salience[i, :n], torch.from_numpy(e.salience), atol=1e-4)  # batch padding: fp noise


def test_default_build_is_compressed_with_inverted_lists(default_index, index_dir):
    """The store of build_index's defaults: codec auto (IVF<nlist>,PQ4,Refine(PQ32) at this size), β^d 0.2 with the
    redundancy rule; the segment's inverted lists hold exactly the kept tokens, grouped by centroid in token order,
    with their coarse codes; every token stores its fine code."""
    m, exact = read_manifest(default_index), StoredIndex(index_dir)
    nlist = int(re.fullmatch(r"IVF(\d+),PQ4,Refine\(PQ32\)", str(m.codec))[1])
    assert (m.index_type, m.doc_prune, m.prune_redundancy) == (str(m.codec), DEFAULT_DOC_PRUNE,
                                                                DEFAULT_PRUNE_REDUNDANCY)
    assert m.num_tokens == exact.manifest.num_tokens
    stored = StoredIndex(default_index)
    counts = np.add.reduceat(stored.kept.astype(np.int64), stored.offsets[:-1])
    assert np.array_equal(counts, [keep_count(int(n), 0.2) for n in stored.lengths]) and counts.sum() == m.num_kept
    codec_dir = default_index / m.codec_dir
    assert re.fullmatch(r"codec-000001-[0-9a-f]{8}", m.codec_dir)
    codec_sizes = {CODEC_CENTROIDS: nlist * 128, CODEC_SCALES: 4 * nlist,
                   CODEC_CODEBOOKS: 4 * 128 * 256, CODEC_REFINE_BOOKS: 4 * 128 * 256}
    assert {name: (codec_dir / name).stat().st_size for name in m.codec_files} == codec_sizes
    assert all(m.codec_files[name] == file_record(codec_dir / name) for name in codec_sizes)
    seg_dir, t, k = default_index / m.segments[0].name, m.num_tokens, m.num_kept
    sizes = {TOKEN_CENTROIDS: 2 * t, TOKEN_RESIDUALS: 32 * t, KEPT_BITS: math.ceil(t / 8),
             IVF_OFFSETS: 8 * (nlist + 1), IVF_DOCS: 4 * k, IVF_CODES: 4 * k,
             OFFSETS: 8 * (N_DOCS + 1)}
    assert set(m.segments[0].files) == set(sizes) | {DOCIDS}
    for name, size in sizes.items():
        assert (seg_dir / name).stat().st_size == size, name
        assert m.segments[0].files[name] == file_record(seg_dir / name), name
    seg = stored.segments[0]
    kept = np.flatnonzero(stored.kept)
    lists = np.asarray(seg.centroid_ids)[kept]
    order = np.argsort(lists, kind="stable")
    assert np.array_equal(seg.ivf_offsets, np.concatenate([[0], np.cumsum(np.bincount(lists, minlength=nlist))]))
    assert np.array_equal(seg.ivf_docs, stored.doc_of_token(kept)[order])
    positions = kept[order]
    ids = np.asarray(seg.centroid_ids)[positions]
    want = stored.codec.encode_list_codes(stored.token_vectors(positions), ids, np.asarray(seg.residuals)[positions])
    assert np.array_equal(seg.ivf_codes, want)  # the coarse code of each kept token's decoded token code
    # the codes decode close to the exact vectors, and closer than the centroids alone
    positions = np.arange(2000)
    truth = exact.token_vectors(positions)
    fine = torch.nn.functional.cosine_similarity(truth, stored.token_vectors(positions), dim=-1)
    coarse = torch.nn.functional.cosine_similarity(truth, stored.codec.decode(seg.centroid_ids[positions]), dim=-1)
    assert fine.mean() > 0.95 and fine.mean() > coarse.mean() + 0.03


def test_default_build_is_byte_deterministic(tmp_path, model):
    """Two builds of the same documents write the same bytes, with a two-tier codec large enough to train by
    two-level k-means and assign through its centroid search on a CPU; build_stats time the codec's parts."""
    docs = [(r["id"], r["contents"]) for r in scifact_docs(16)]
    first, second = (build_index(docs, tmp_path / name, model, progress=False, model_name="aligner",
                                 codec=f"IVF{HIERARCHY_MIN_NLIST},PQ4,Refine(PQ32)") for name in ("first", "second"))
    assert first.codec.nlist >= HIERARCHY_MIN_NLIST and first.num_tokens > 2 * first.codec.nlist  # k-means trains
    assert first.codec_files == second.codec_files  # sizes and CRC32 of every file
    assert [s.files for s in first.segments] == [s.files for s in second.segments]
    stats = first.segments[0].build_stats
    assert stats["codec_s"] == pytest.approx(stats["codec_train_s"] + stats["codec_encode_s"])
    assert stats["codec_train_s"] > 0 and 0 < stats["reconstruction_mse"] < 0.5


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
    first = read_manifest(target)
    assert first.num_docs == 3 and first.generation == 1 and leftovers(tmp_path) == []
    assert re.fullmatch(r"IVF\d+,PQ4,Refine\(PQ32\)", str(first.codec))  # the defaults
    assert first.index_type == str(first.codec)
    assert (first.doc_prune, first.prune_redundancy) == (DEFAULT_DOC_PRUNE, DEFAULT_PRUNE_REDUNDANCY)
    reader = StoredIndex(target)  # an open reader keeps its snapshot through the overwrite
    build_index([("x", "some text")], target, model, progress=False, overwrite=True)
    m = read_manifest(target)
    assert (m.num_docs, m.generation) == (1, 2) and leftovers(tmp_path) == []
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(("seg-", "codec-"))) == sorted(
        [m.segments[0].name, m.codec_dir])  # the new generation's folders only
    assert m.segments[0].name.startswith("seg-000002-") and reader.docids == [r["id"] for r in short_records(3)]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a pyserini-aligner index; it is never replaced"):
        build_index([("x", "text")], plain, model, progress=False, overwrite=True)
    assert [p.name for p in plain.iterdir()] == ["a.txt"]


# build options: one typed object, checked once


def test_doc_prune_by_corpus_size():
    """β^d left unset is DEFAULT_DOC_PRUNE below SCALE_DOCS documents or when the size is unknown, SCALE_DOC_PRUNE
    from there; a value given is kept."""
    from pyserini_aligner.index.options import SCALE_DOC_PRUNE, SCALE_DOCS, doc_prune_for

    assert [doc_prune_for(None, n) for n in (None, 1, SCALE_DOCS - 1, SCALE_DOCS, 10 ** 7)] == \
        [DEFAULT_DOC_PRUNE] * 3 + [SCALE_DOC_PRUNE] * 2
    assert doc_prune_for(0.3, 10 ** 7) == doc_prune_for(0.3, 5) == 0.3
    assert BuildOptions().sized(SCALE_DOCS).doc_prune == SCALE_DOC_PRUNE
    assert BuildOptions(doc_prune=0.1).sized(SCALE_DOCS).doc_prune == 0.1


def test_build_options_parse_the_codec_and_keep_the_defaults(tmp_path):
    assert BuildOptions().codec is AUTO_CODEC and str(BuildOptions().codec) == "auto"
    assert BuildOptions(codec="fp16").codec == CodecSpec() and BuildOptions(codec="fp16").fp16
    assert BuildOptions(codec=" IVF64,PQ4,Refine(PQ16) ").codec == CodecSpec(64, 4, 16)
    assert BuildOptions(codec=CodecSpec(8, 4)).codec == CodecSpec(8, 4)  # a typed codec is taken as it is
    assert BuildOptions(codec_from=str(tmp_path)).codec_from == tmp_path
    assert (BuildOptions().doc_prune, BuildOptions().prune_redundancy) == (None, DEFAULT_PRUNE_REDUNDANCY)
    changed = BuildOptions(codec="fp16").replace(doc_prune=0.5, prune_redundancy=None)
    assert (changed.doc_prune, changed.prune_redundancy, changed.codec) == (0.5, None, CodecSpec())


@pytest.mark.parametrize("field, value, message", [
    ("doc_prune", 0.0, "doc_prune must be None or in (0, 1], got 0.0"),
    ("doc_prune", 1.5, "doc_prune must be None or in (0, 1], got 1.5"),
    ("doc_prune", True, "doc_prune must be None or in (0, 1], got True"),
    ("codec", "PQ8", "codec: bad codec 'PQ8': expected 'auto', 'fp16'"),
    ("codec", "IVF1,PQ8", "codec: bad codec 'IVF1,PQ8': nlist must be in [2, 65536]"),
    ("codec", "IVF64,PQ8,Refine(PQ4)", "must be finer than PQ8"),
    ("codec", 8, "codec: codec must be a string, CodecSpec or AutoCodec, got int"),
    ("index_type", " ", "index_type must be a FAISS factory string"),
    ("max_bytes_per_token", 5, "max_bytes_per_token must be None or an integer >= 6"),
    ("prune_redundancy", 0.0, "prune_redundancy must be None or a cosine threshold in (0, 1], got 0.0"),
    ("prune_redundancy", "off", "prune_redundancy must be None or a cosine threshold"),
    ("max_length", 1, "max_length must be None or an integer >= 2 (room for the special tokens), got 1"),
    ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
    ("train_size", 2.5, "train_size must be an integer >= 1, got 2.5"),
    ("max_docs", 0, "max_docs must be None or an integer >= 1, got 0"),
    ("seed", "1", "seed must be an integer, got '1'"),
    ("progress", "no", "progress must be True or False, got 'no'"),
    ("codec_from", 3, "codec_from must be an index folder, got 3"),
    ("dtype", "int8", "dtype must be one of auto, fp32, fp16, bf16, got 'int8'"),
])
def test_build_options_name_the_bad_field(field, value, message):
    with pytest.raises(ValueError) as error:
        BuildOptions(**{field: value})
    assert str(error.value).startswith(field) and message in str(error.value)  # the field first
    with pytest.raises(ValueError, match=re.escape(message)):
        BuildOptions().replace(**{field: value})  # a change is checked as the constructor checks


def test_a_build_from_scale_docs_documents_indexes_the_scale_share(tmp_path, model, monkeypatch):
    """β^d left unset is chosen from the corpus's documents when the build starts and recorded in the manifest:
    the scale share from SCALE_DOCS documents (made small here), the default share below."""
    from pyserini_aligner.index import options
    from pyserini_aligner.salience import keep_count

    docs = [(f"d{i}", f"document {i} about alignment of tokens and their salience in retrieval") for i in range(12)]
    monkeypatch.setattr(options, "SCALE_DOCS", 10)
    large = build_index(docs, tmp_path / "large", model, codec="fp16", progress=False)
    small = build_index(docs[:9], tmp_path / "small", model, codec="fp16", progress=False)
    assert (large.doc_prune, small.doc_prune) == (options.SCALE_DOC_PRUNE, DEFAULT_DOC_PRUNE)
    lengths = StoredIndex(tmp_path / "large").lengths
    assert large.num_kept == sum(keep_count(int(n), options.SCALE_DOC_PRUNE) for n in lengths)


def test_build_index_takes_options_or_their_fields(tmp_path, model):
    """Keyword arguments go over an options object; a bad one is refused before anything is read or written, an
    unknown one names the fields there are."""
    docs = [(r["id"], r["contents"]) for r in short_records(4)]
    options = BuildOptions(codec="fp16", doc_prune=1.0, index_type="HNSW8", progress=False)
    first = build_index(docs, tmp_path / "a", model, options, model_name="aligner")
    assert (str(first.codec), first.doc_prune, first.index_type, first.model_name) == ("fp16", 1.0, "HNSW8", "aligner")
    second = build_index(docs, tmp_path / "b", model, options, doc_prune=0.5, corpus_name="four")
    assert (str(second.codec), second.doc_prune, second.index_type, second.corpus) == ("fp16", 0.5, "HNSW8", "four")
    with pytest.raises(ValueError, match=r"doc_prune must be None or in \(0, 1\], got 0"):
        build_index(iter(docs), tmp_path / "c", model, doc_prune=0)
    with pytest.raises(TypeError, match="unknown build option.* doc_prun; the fields of BuildOptions are doc_prune"):
        build_index(docs, tmp_path / "c", model, doc_prun=0.5)
    assert not (tmp_path / "c").exists() and leftovers(tmp_path) == []
    derived = derive_index(tmp_path / "a", tmp_path / "d", BuildOptions(doc_prune=0.25, codec="fp16",
                                                                        progress=False))
    assert (derived.doc_prune, derived.index_type) == (0.25, "Flat")  # an options object is the whole setting
    inherited = derive_index(tmp_path / "a", tmp_path / "e", doc_prune=0.25, progress=False)
    assert (inherited.doc_prune, inherited.index_type, str(inherited.codec)) == (0.25, "HNSW8", "fp16")  # the source's
    assert BuildOptions.of_index(read_manifest(tmp_path / "b")) == BuildOptions(
        doc_prune=0.5, codec="fp16", index_type="HNSW8", prune_redundancy=DEFAULT_PRUNE_REDUNDANCY)


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
    m = build_index([(r["id"], r["contents"]) for r in records], target, salient, doc_prune=beta, codec="fp16",
                    progress=False, prune_redundancy=None)
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
    built = build_index(docs, tmp_path / "default", salient, doc_prune=0.3, codec="fp16", progress=False)
    assert built.prune_redundancy == DEFAULT_PRUNE_REDUNDANCY
    stored = StoredIndex(tmp_path / "default")
    for row in range(stored.num_docs):
        doc = slice(stored.offsets[row], stored.offsets[row + 1])
        salience = stored.token_salience(np.arange(doc.start, doc.stop))
        vectors = stored.token_vectors(np.arange(doc.start, doc.stop)).double().numpy()
        expected = reference.prune_redundant(salience.tolist(), [True] * len(salience), vectors.tolist(), 0.3,
                                             DEFAULT_PRUNE_REDUNDANCY)
        assert np.asarray(stored.kept[doc]).tolist() == expected
    plain = build_index(docs, tmp_path / "off", salient, doc_prune=0.3, codec="fp16", progress=False,
                        prune_redundancy=None)
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
    edit_manifest(tmp_path / "plain", prune_redundancy=2)
    with pytest.raises(IndexFormatError, match="prune_redundancy"):
        read_manifest(tmp_path / "plain")


def test_derive_index_reprunes_without_encoding(tmp_path, index_dir):
    target = tmp_path / "derived"
    m = derive_index(index_dir, target, doc_prune=0.25, index_type="IVF8,Flat", progress=False)
    stored = StoredIndex(target)
    counts = np.add.reduceat(np.asarray(stored.kept), stored.offsets[:-1])
    assert np.array_equal(counts, [keep_count(int(n), 0.25) for n in stored.lengths])
    assert (m.index_type, m.num_kept, stored.segments[0].faiss_index().ntotal) == ("IVF8,Flat", counts.sum(),
                                                                                   counts.sum())
    assert read_manifest(index_dir).doc_prune == 1.0


def test_compressed_index_layout_and_decoding(tmp_path, index_dir):
    target = tmp_path / "compressed"
    m = derive_index(index_dir, target, doc_prune=0.25, codec="IVF32,PQ16", progress=False)
    assert (str(m.codec), m.index_type, m.generation) == ("IVF32,PQ16", "IVF32,PQ16", 1)
    seg_dir, codec_dir = only_segment(target), target / m.codec_dir
    sizes = {TOKEN_CENTROIDS: 2 * m.num_tokens, TOKEN_RESIDUALS: 16 * m.num_tokens,
             KEPT_BITS: math.ceil(m.num_tokens / 8), IVF_CODES: 16 * m.num_kept}
    for name, size in sizes.items():
        assert (seg_dir / name).stat().st_size == size, name
    codec_sizes = {CODEC_CENTROIDS: 32 * 128, CODEC_SCALES: 4 * 32, CODEC_CODEBOOKS: 4 * 128 * 256}
    for name, size in codec_sizes.items():
        assert (codec_dir / name).stat().st_size == size, name
    for name in (VECTORS, SALIENCE, KEPT, FAISS_IDS, FAISS_INDEX):
        assert not (seg_dir / name).exists(), name
    source, compressed = StoredIndex(index_dir), StoredIndex(target)
    derive_index(index_dir, tmp_path / "p", doc_prune=0.25, progress=False)
    assert np.array_equal(compressed.kept, StoredIndex(tmp_path / "p").kept)
    rows = np.array([0, 5, N_DOCS - 1])
    exact, mask, _ = source.gather(rows)
    approx, mask2, salience = compressed.gather(rows)
    assert torch.equal(mask, mask2) and torch.all(salience[mask2] == 1)
    cosine = torch.nn.functional.cosine_similarity(exact[mask], approx[mask], dim=-1)
    positions = np.arange(compressed.offsets[rows[0]], compressed.offsets[rows[0] + 1])
    centroid_only = compressed.codec.decode(compressed.segments[0].centroid_ids[positions])
    assert torch.allclose(approx[0][mask[0]], compressed.token_vectors(positions))
    coarse = torch.nn.functional.cosine_similarity(exact[0][mask[0]], centroid_only, dim=-1)
    assert cosine.mean() > 0.85 and cosine[:len(positions)].mean() > coarse.mean() + 0.05
    assert int(compressed.segments[0].ivf_offsets[-1]) == m.num_kept
    with pytest.raises(ValueError, match="its tokens are compressed"):
        derive_index(target, tmp_path / "again", progress=False)
    with open(seg_dir / TOKEN_RESIDUALS, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(IndexFormatError, match=r"token_residuals\.u8: \d+ bytes, the manifest implies"):
        StoredIndex(target)


def test_compressed_build_from_corpus(tmp_path, model, capsys):
    corpus = write_jsonl(tmp_path / "docs.jsonl", short_records(40, words=30))
    assert cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx"), "--codec", "IVF4,PQ8", "--quiet"]) == 0
    m = read_manifest(tmp_path / "idx")
    assert (m.num_docs, str(m.codec), m.doc_prune) == (40, "IVF4,PQ8", DEFAULT_DOC_PRUNE)
    assert m.num_kept == sum(keep_count(int(n), DEFAULT_DOC_PRUNE) for n in StoredIndex(tmp_path / "idx").lengths)
    assert cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx2"), "--codec", "PQ8", "--quiet"]) == 2
    assert "error: argument --codec: bad codec 'PQ8'" in capsys.readouterr().err
    salient = copy.deepcopy(model)
    salient.config.use_salience = salient.config.salience_in_score = True
    with pytest.raises(ValueError, match="stores no token saliences, but the model scores with them"):
        build_index(read_json_collection(corpus), tmp_path / "idx3", salient, progress=False)
    assert not (tmp_path / "idx2").exists() and not (tmp_path / "idx3").exists()


def test_bad_factory_string_fails_before_encoding(tmp_path, model):
    with pytest.raises(ValueError, match="index_type 'Bogus12'"):
        build_index([("a", "x")], tmp_path / "i", model, codec="fp16", index_type="Bogus12", progress=False)
    with pytest.raises(ValueError, match=r"FAISS training on 3 kept token vectors failed \(Number of training points"):
        build_index([("a", "x")], tmp_path / "i", model, codec="fp16", doc_prune=1.0, index_type="IVF64,Flat",
                    progress=False)
    assert list(tmp_path.iterdir()) == []


def test_stored_index_errors_name_the_file(tmp_path, index_dir):
    broken = tmp_path / "broken"
    shutil.copytree(index_dir, broken)
    seg_dir = only_segment(broken)
    with open(seg_dir / VECTORS, "r+b") as handle:
        handle.truncate(1000)
    with pytest.raises(IndexFormatError, match=r"doc_vectors\.f16: 1000 bytes"):
        StoredIndex(broken)
    (seg_dir / VECTORS).unlink()
    with pytest.raises(FileNotFoundError, match=r"index file missing: .*seg-.*/doc_vectors\.f16"):
        StoredIndex(broken)
    manifest = json.loads((broken / MANIFEST).read_text())
    (broken / MANIFEST).write_text(json.dumps({**manifest, "dim": 64}))
    with pytest.raises(IndexFormatError, match=r"manifest\.json: checksum mismatch"):
        StoredIndex(broken)
    (broken / MANIFEST).write_text("{")
    with pytest.raises(IndexFormatError, match=r"manifest\.json: not valid JSON"):
        StoredIndex(broken)
    with pytest.raises(FileNotFoundError, match="index folder not found"):
        StoredIndex(tmp_path / "nowhere")


def test_checksums_catch_flipped_bytes(tmp_path, default_index, monkeypatch, capsys):
    """A flipped byte fails the open: a small file's CRC32, a large token file's block CRC32s; a verify (API and
    CLI) finds it too."""
    broken = tmp_path / "broken"
    shutil.copytree(default_index, broken)
    seg_dir = only_segment(broken)
    flip_byte(seg_dir / DOCIDS, 3)
    with pytest.raises(IndexFormatError, match=re.escape(f"{seg_dir / DOCIDS}: checksum mismatch")):
        StoredIndex(broken)
    flip_byte(seg_dir / DOCIDS, 3)
    assert cli.main(["--index", str(broken), "--verify"]) == 0
    assert "every file matches its checksum" in capsys.readouterr().out
    residuals = seg_dir / TOKEN_RESIDUALS
    monkeypatch.setattr(reader, "SMALL_FILE", residuals.stat().st_size - 1)  # token_residuals.u8 counts as large
    flip_byte(residuals, residuals.stat().st_size // 2)
    size = residuals.stat().st_size
    assert size > checksums.BLOCK  # large files are checked block by block on open
    start = size // 2 // checksums.BLOCK * checksums.BLOCK
    with pytest.raises(IndexFormatError, match=re.escape(f"{residuals}: checksum mismatch in bytes {start}-"
                                                         f"{min(start + checksums.BLOCK, size)} (corrupt")):
        StoredIndex(broken)
    with pytest.raises(IndexFormatError, match=re.escape(f"{residuals}: checksum mismatch")):
        StoredIndex(broken, verify=True)
    assert cli.main(["--index", str(broken), "--verify"]) == 1
    assert f"{residuals}: checksum mismatch" in capsys.readouterr().err


def test_v1_index_is_refused_with_a_rebuild_command(tmp_path, model):
    old = tmp_path / "v1"
    old.mkdir()
    (old / MANIFEST).write_text(json.dumps({"format": "pyserini-aligner", "format_version": 1, "dim": 128,
                                                  "corpus": "beir/scifact", "doc_prune": 1.0}))
    (old / VECTORS).write_bytes(b"\0" * 256)
    (old / "notes.txt").write_text("mine")
    rebuild = re.escape(f"index format 1 is not read by this version (format 2); rebuild it: python -m "
                        f"pyserini_aligner.index --corpus beir/scifact --index {old} --overwrite")
    with pytest.raises(IndexFormatError, match=rebuild):
        StoredIndex(old)
    with pytest.raises(IndexFormatError, match=rebuild):
        read_manifest(old)
    with pytest.raises(FileExistsError, match="index target exists"):
        build_index([("a", "some text")], old, model, progress=False)
    m = build_index([("a", "some text"), ("b", "other text")], old, model, codec="fp16", overwrite=True,
                    progress=False)
    assert (m.format_version, StoredIndex(old).docids) == (2, ["a", "b"])
    assert not (old / VECTORS).exists() and (old / "notes.txt").read_text() == "mine"


def test_set_default_strategy(tmp_path, index_dir):
    target = tmp_path / "copy"
    derive_index(index_dir, target, progress=False)
    assert str(set_default_strategy(target, "top-p:0.015").default_strategy) == "top-p:0.015"
    m = read_manifest(target)
    assert (str(m.default_strategy), m.generation) == ("top-p:0.015", 2)
    with pytest.raises(ValueError, match="bad alignment strategy 'top-q:1'"):
        set_default_strategy(target, "top-q:1")
    assert str(read_manifest(target).default_strategy) == "top-p:0.015"


def test_json_collection_reader(tmp_path):
    folder = tmp_path / "coll"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [{"id": "d1", "contents": "one"}], extra_lines={2: ""})
    (folder / "sub" / "b.json").write_text(json.dumps([{"id": 2, "contents": "two"}]))
    (folder / "notes.txt").write_text("ignored")
    assert [(d, t) for d, t, *_ in read_json_collection(folder)] == [("d1", "one"), ("2", "two")]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "d1", "contents": "x"}, {"id": "d2"}])
    with pytest.raises(CorpusError, match=r"bad\.jsonl, line 2: missing field 'contents'"):
        list(read_json_collection(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(CorpusError, match="empty corpus"):
        list(read_json_collection(empty))
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        list(read_json_collection(tmp_path / "missing.jsonl"))


def test_an_old_index_inside_the_corpus_folder_is_skipped(tmp_path, caplog, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "docs.jsonl", short_records(3))
    assert cli.main(["--corpus", str(folder), "--index", str(tmp_path / "old"), "--codec", "fp16", "--quiet"]) == 0
    shutil.move(tmp_path / "old", folder / "old-idx")  # an earlier index kept beside the documents
    (folder / ".idx.building-x1y2").mkdir()  # and a build folder a killed build left there
    (folder / ".idx.building-x1y2" / "manifest.json").write_text("{}")
    with caplog.at_level("WARNING"):
        assert cli.main(["--corpus", str(folder), "--index", str(tmp_path / "new"), "--codec", "fp16", "--quiet"]) == 0
    assert read_manifest(tmp_path / "new").num_docs == 3
    assert f"skipping {folder / 'old-idx'}, a pyserini-aligner index" in caplog.text
    assert StoredIndex(tmp_path / "new").docids == [r["id"] for r in short_records(3)]
    assert cli.main(["--corpus", str(folder / "old-idx"), "--index", str(tmp_path / "other"), "--quiet"]) == 1
    assert "is a pyserini-aligner index, not a JsonCollection" in capsys.readouterr().err


def test_cli_builds_and_reports_errors(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "docs.jsonl", short_records(4))
    assert cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx"), "--codec", "fp16", "--index-type",
                     "HNSW8", "--quiet"]) == 0
    m = read_manifest(tmp_path / "idx")
    assert (m.num_docs, str(m.codec), m.index_type, m.corpus) == (4, "fp16", "HNSW8", str(corpus.resolve()))
    bad = write_jsonl(tmp_path / "bad.jsonl", short_records(2), extra_lines={2: "oops"})
    assert cli.main(["--corpus", str(bad), "--index", str(tmp_path / "idx2"), "--quiet"]) == 1
    assert re.search(r"^error: .*bad\.jsonl, line 2: not valid JSON", capsys.readouterr().err, re.M)
    assert cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "idx"), "--quiet"]) == 1
    assert capsys.readouterr().err.startswith("error: index target exists")
    assert cli.main(["--from-index", str(tmp_path / "idx"), "--index", str(tmp_path / "idx3"), "--doc-prune", "0.5",
                     "--quiet"]) == 0
    assert read_manifest(tmp_path / "idx3").index_type == "HNSW8"
    assert read_manifest(tmp_path / "idx3").prune_redundancy == DEFAULT_PRUNE_REDUNDANCY  # the source's
    assert cli.main(["--from-index", str(tmp_path / "idx"), "--index", str(tmp_path / "idx4"), "--doc-prune", "0.5",
                     "--prune-redundancy", "off", "--quiet"]) == 0
    assert read_manifest(tmp_path / "idx4").prune_redundancy is None
    assert cli.main(["--from-index", str(tmp_path / "idx"), "--index", str(tmp_path / "idx5"), "--prune-redundancy",
                     "1.5", "--quiet"]) == 2
    assert "--prune-redundancy: expected 'off' or a number in (0, 1]" in capsys.readouterr().err
    # an fp16 build derives to a compressed codec without re-encoding
    assert cli.main(["--from-index", str(tmp_path / "idx"), "--index", str(tmp_path / "small"), "--codec", "IVF4,PQ8",
                     "--doc-prune", "0.5", "--quiet"]) == 0
    small, source = StoredIndex(tmp_path / "small", verify=True), StoredIndex(tmp_path / "idx")
    assert small.manifest.codec == CodecSpec(4, 8) and small.manifest.index_type == "IVF4,PQ8"
    assert small.docids == source.docids
    assert np.array_equal(small.kept, StoredIndex(tmp_path / "idx3").kept)
    cosine = torch.nn.functional.cosine_similarity(small.token_vectors(np.arange(20)),
                                                   source.token_vectors(np.arange(20)), dim=-1)
    assert cosine.mean() > 0.8
    assert not (tmp_path / "idx2").exists() and leftovers(tmp_path) == []


def test_cli_encodes_in_the_precision_asked_for(tmp_path, capsys):
    """--dtype bf16 encodes under bf16 autocast: the same tokens, vectors within bf16's rounding of fp32's (not
    equal to them); a precision the build does not know is a usage error."""
    corpus = write_jsonl(tmp_path / "docs.jsonl", short_records(4))
    for dtype in ("fp32", "bf16"):
        assert cli.main(["--corpus", str(corpus), "--index", str(tmp_path / dtype), "--codec", "fp16", "--dtype",
                         dtype, "--quiet"]) == 0
    full, half = StoredIndex(tmp_path / "fp32"), StoredIndex(tmp_path / "bf16")
    assert full.docids == half.docids and np.array_equal(full.lengths, half.lengths)
    tokens = np.arange(int(full.lengths.sum()))
    cosine = torch.nn.functional.cosine_similarity(full.token_vectors(tokens), half.token_vectors(tokens), dim=-1)
    assert cosine.min() > 0.99 and cosine.mean() > 0.999 and cosine.mean() < 1 - 1e-7
    assert cli.main(["--corpus", str(corpus), "--index", str(tmp_path / "x"), "--dtype", "int8", "--quiet"]) == 2
    assert "argument --dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_auto_codec_is_sized_from_the_whole_corpus_not_a_slice():
    """A torchrun rank streams its slice of the corpus: "auto" resolves from the whole corpus's estimated tokens, so
    every rank count picks the codec of a one-process build (a slice of 12 of 24 documents once picked half the
    centroids)."""
    from pyserini_aligner.index.builder import EncodedChunk, sample_for_codec

    def chunks(docs: int, tokens: int = 300):
        for start in range(0, docs, 4):
            mask = torch.ones(min(4, docs - start), tokens, dtype=torch.bool)
            yield EncodedChunk([f"d{i}" for i in range(start, start + len(mask))], torch.zeros(*mask.shape, 8),
                               mask, mask.float(), 0, 0.0)

    _, whole = sample_for_codec(chunks(24), "auto", 8, 24, 100_000)
    _, half = sample_for_codec(chunks(12), "auto", 8, 24, 100_000)
    assert whole == half == parse_codec(f"IVF{choose_nlist(24 * 300)},PQ4,Refine(PQ8)", 8)
    _, unknown = sample_for_codec(chunks(24), "auto", 8, None, 100_000)  # no size given: what the stream held
    assert unknown == whole


def test_auto_codec_is_sized_from_the_whole_sample_not_the_first_chunk():
    """A corpus that opens with long documents (a collection's full texts before its passages): "auto" is sized from
    the mean length of every buffered document, as the corpus is, not from the first chunk's."""
    from pyserini_aligner.index.builder import EncodedChunk, sample_for_codec
    from pyserini_aligner.index.codec_spec import resolve_codec

    def chunks(docs: int):
        for start in range(0, docs, 4):
            tokens = 300 if start == 0 else 20
            mask = torch.ones(min(4, docs - start), tokens, dtype=torch.bool)
            yield EncodedChunk([f"d{i}" for i in range(start, start + len(mask))], torch.zeros(*mask.shape, 8),
                               mask, mask.float(), 0, 0.0)

    total = 4000
    buffered, spec = sample_for_codec(chunks(total), "auto", 8, total, 2_000)
    docs, tokens = sum(len(c.docids) for c in buffered), sum(c.num_tokens for c in buffered)
    assert len(buffered) > 1 and tokens < 20 * total
    assert spec == resolve_codec("auto", 8, round(tokens / docs * total))
    first_chunk = resolve_codec("auto", 8, 300 * total)
    assert spec.nlist == choose_nlist(round(tokens / docs * total)) < first_chunk.nlist


def test_max_bytes_per_token_is_refused_where_it_does_nothing(tmp_path, capsys):
    from pyserini_aligner.index.__main__ import option_flags, parse_args

    for argv, message in ((["--codec", "IVF64,PQ8"], "it does nothing with --codec IVF64,PQ8"),
                          (["--from-index", str(tmp_path)], "it does nothing with --codec fp16"),
                          (["--max-bytes-per-token", "5"], "expected an integer >= 6")):
        with pytest.raises(SystemExit) as stop:
            parse_args(["--index", str(tmp_path / "i"), *(["--corpus", "c"] if "--from-index" not in argv else []),
                        *argv, *(["--max-bytes-per-token", "18"] if "5" not in argv else [])])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    args = parse_args(["--corpus", "c", "--index", str(tmp_path / "i"), "--max-bytes-per-token", "18"])
    assert BuildOptions(**option_flags(args)).max_bytes_per_token == 18
    args = parse_args(["--corpus", "c", "--index", str(tmp_path / "i")])
    assert BuildOptions(**option_flags(args)).max_bytes_per_token is None  # 2 bits a dimension, from the model


@pytest.mark.parametrize("text", ["a\nb\nc\n", "a\nb\nc", "a\n\nc\n", "", "x\n", "é\u00e9\n\u4e2d\n\U0001f600 z\n",
                                  "".join(f"d{i}\n" for i in range(50))])
def test_docid_table_reads_as_the_list_it_replaces(tmp_path, monkeypatch, text):
    """Docids.read: the lines of docids.txt as ``read_text().split("\\n")`` less its last empty item gives them, by
    row, slice, negative row, iteration (across the blocks it decodes at once), length and joined tables."""
    monkeypatch.setattr(reader.Docids, "_DECODE_ROWS", 7)
    path = tmp_path / DOCIDS
    path.write_bytes(text.encode("utf-8"))
    want = text.split("\n")[:-1] if text.endswith("\n") or not text else text.split("\n")
    table = reader.Docids.read(path, len(want))
    assert len(table) == len(want) and list(table) == want and table == want and want == table
    assert [table[i] for i in range(len(want))] == want and [table[np.int64(i)] for i in range(len(want))] == want
    assert table[1:-1] == want[1:-1] and table[::3] == want[::3]
    if want:
        assert table[-1] == want[-1]
    with pytest.raises(IndexError):
        table[len(want)]
    joined = reader.Docids.join([table, reader.Docids(), table])
    assert list(joined) == joined[:] == want + want and len(joined) == 2 * len(want) and joined == table + want
    assert [joined[i] for i in range(len(joined))] == want + want and joined != want + ["extra"]


def test_docid_table_refuses_bad_files(tmp_path):
    path = tmp_path / DOCIDS
    path.write_bytes(b"a\n\xff\n")
    with pytest.raises(IndexFormatError, match=r"docids\.txt: not UTF-8 text"):
        reader.Docids.read(path, 2)
    path.write_bytes(b"a\nb\n")
    with pytest.raises(IndexFormatError, match=r"docids\.txt: 2 docids, the manifest says 3"):
        reader.Docids.read(path, 3)
    with pytest.raises(FileNotFoundError, match="index file missing"):
        reader.Docids.read(tmp_path / "gone.txt", 0)


def test_one_segment_shares_its_arrays(index_dir):
    """A one-segment index's document offsets and lengths are the segment's arrays, not copies of them."""
    store = StoredIndex(index_dir)
    assert len(store.segments) == 1 and store.offsets is store.segments[0].offsets
    assert store.lengths is store.segments[0].lengths and np.array_equal(store.lengths, np.diff(store.offsets))

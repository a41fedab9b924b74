"""Fields stored with the documents: round trips through builds (JsonCollection records, a BEIR folder's title and
metadata, ir_datasets documents, the CLI, torchrun), stay in step with add / upsert / delete / compact, merges of
shards and derived indexes (filters compared with a Python reference over the documents), survive a kill at every
write step with the generation a reader opens, and refuse bad input; indexes without fields keep opening."""
import json
import os
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from pyserini_aligner.filters import Filter, FilterError
from pyserini_aligner.index import (CorpusError, IndexFormatError, StoredIndex, build_index, derive_index,
                                    read_corpus, read_json_collection, read_manifest)
from pyserini_aligner.index import __main__ as index_cli
from pyserini_aligner.index.commit import write_manifest
from pyserini_aligner.index.faults import ENV as FAULT_ENV
from pyserini_aligner.index.format import FIELDS, MANIFEST, _crc_text
from pyserini_aligner.index.live import AlignerIndex
from pyserini_aligner.index.shards import merge_indexes

from conftest import killed_at, make_beir_folder, scifact_docs
from test_index import write_jsonl
from test_live import unreferenced

REPO = Path(__file__).resolve().parents[1]
JOURNALS = ["Nature", "Cell", "Science", "Cell Reports"]


def records(n: int, start: int = 0, words: int = 10) -> list[dict]:
    """JsonCollection records of SciFact documents with extra fields of every JSON type (some missing or null);
    every seventh has none."""
    out = []
    for i, doc in enumerate(scifact_docs(start + n)[start:], start):
        record = {"id": doc["id"], "contents": " ".join(doc["contents"].split()[:words])}
        if i % 7 != 3:
            record.update(year=1995 + i % 25, journal=JOURNALS[i % 4], open=i % 2 == 0,
                          authors=[f"a{i}", f"b{i}"], meta={"url": f"http://x/{i}" if i % 3 else None, "n": i},
                          **({"naïve \"key\"": i} if i % 5 == 0 else {}))
            if i % 11 == 0:
                record["year"] = None
        out.append(record)
    return out


def fields_of(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("id", "contents")}


def stored(index: Path) -> dict[str, dict]:
    """docid -> stored fields of the live documents, from the index."""
    store = StoredIndex(index)
    rows = np.flatnonzero(store.live)
    return dict(zip([store.docids[r] for r in rows], store.fields_of(rows)))


PREDICATES = {  # text -> the same test in Python over one document's fields
    "year >= 2010 AND journal LIKE 'Cell%'":
        lambda f: isinstance(f.get("year"), int) and f["year"] >= 2010 and f.get("journal", "").startswith("Cell"),
    "open = TRUE OR meta.url IS NULL": lambda f: f.get("open") is True or (f.get("meta") or {}).get("url") is None,
    "NOT journal IN ('Nature', 'Science')": lambda f: f.get("journal") is not None
                                                      and f["journal"] not in ("Nature", "Science"),
    "year IS NOT NULL AND NOT (year < 2000 OR year > 2015)":
        lambda f: f.get("year") is not None and 2000 <= f["year"] <= 2015,
}


def check_filters(index: Path, docs: dict[str, dict]) -> None:
    """Every predicate matches exactly the live documents of ``docs`` (docid -> fields) that the reference does."""
    store = StoredIndex(index)
    for text, test in PREDICATES.items():
        rows = np.flatnonzero(Filter.where(text).rows(store) & store.live)
        assert sorted(store.docids[r] for r in rows) == sorted(d for d, f in docs.items() if test(f)), text
    assert any(any(test(f) for f in docs.values()) for test in PREDICATES.values())


def test_json_collection_fields_round_trip_through_the_cli(tmp_path):
    rows = records(24)
    corpus = write_jsonl(tmp_path / "docs.jsonl", rows)
    target = tmp_path / "idx"
    assert index_cli.main(["--corpus", str(corpus), "--index", str(target), "--codec", "fp16", "--quiet"]) == 0
    manifest = read_manifest(target)
    (segment,) = manifest.segments
    assert segment.fields == ["authors", "journal", "meta", "naïve \"key\"", "open", "year"]
    assert FIELDS in segment.files and segment.files[FIELDS]["bytes"] == (target / segment.name / FIELDS).stat().st_size
    store = StoredIndex(target, verify=True)
    assert store.field_names == segment.fields
    assert store.fields_of(range(store.num_docs)) == [fields_of(r) for r in rows]
    assert store.fields_of([5, 3, 5]) == [fields_of(rows[5]), {}, fields_of(rows[5])]
    assert [d for d, _, _, _ in read_json_collection(corpus)] == store.docids
    check_filters(target, {r["id"]: fields_of(r) for r in rows})
    five = Filter.where('"naïve ""key""" = 5 OR "naïve ""key""" = 15').rows(store)
    assert [store.docids[r] for r in np.flatnonzero(five)] == [rows[5]["id"], rows[15]["id"]]


def test_beir_folder_and_ir_datasets_fields(tmp_path, model):
    """A BEIR folder's title and the entries of its metadata are stored, under the names ir_datasets gives the same
    corpus's documents (NFCorpus: title, url); a metadata object whose names clash is kept whole."""
    folder = make_beir_folder(tmp_path / "beir", name="nfcorpus", n_docs=30, words=8)
    corpus = [json.loads(line) for line in (folder / "corpus.jsonl").read_text().splitlines()]
    items = list(read_corpus(folder))
    assert [fields for *_, fields in items] == [{"title": r["title"], **r["metadata"]} for r in corpus]
    assert all(set(fields) == {"title", "url"} for *_, fields in items)
    from_ir_datasets = list(islice(read_corpus("beir/nfcorpus"), 30))
    assert [(d, f) for d, _, _, f in from_ir_datasets] == [(d, f) for d, _, _, f in items]
    assert str(from_ir_datasets[2][2]) == "beir/nfcorpus, document 3"

    target = tmp_path / "idx"
    build_index(read_corpus(folder), target, model, codec="fp16", progress=False, max_docs=12)
    store = StoredIndex(target)
    assert store.field_names == ["title", "url"]
    assert store.fields_of(range(12)) == [{"title": r["title"], **r["metadata"]} for r in corpus[:12]]
    url = corpus[4]["metadata"]["url"]
    assert np.flatnonzero(Filter.values("url", [url]).rows(store)).tolist() == [4]
    title = corpus[7]['title'].replace("'", "''")
    assert np.flatnonzero(Filter.where(f"title = '{title}'").rows(store)).tolist() == [7]

    clash = {**corpus[0], "metadata": {"title": "another", "url": "u"}}
    write_jsonl(folder / "corpus.jsonl", [clash])
    assert next(iter(read_corpus(folder)))[3] == {"title": corpus[0]["title"], "metadata": clash["metadata"]}


def test_live_updates_keep_fields_in_step(tmp_path, model):
    """Adds (JsonCollection dicts, (docid, text, fields) tuples, a CLI file), upserts that change or drop fields,
    deletes and compactions (codes copied, codec retrained): the filters always match what the documents say."""
    rows = records(40)
    target = tmp_path / "idx"
    build_index(rows[:24], target, model, codec="IVF8,PQ4", progress=False, model_name="aligner")
    docs = {r["id"]: fields_of(r) for r in rows[:24]}
    check_filters(target, docs)
    live = AlignerIndex(target, model)
    live.add(rows[24:30])  # JsonCollection records
    live.add([(r["id"], r["contents"], fields_of(r)) for r in rows[30:34]])
    docs.update({r["id"]: fields_of(r) for r in rows[24:34]})
    check_filters(target, docs)
    add_file = write_jsonl(tmp_path / "add.jsonl", rows[34:])
    assert index_cli.main(["--index", str(target), "--add", str(add_file), "--quiet"]) == 0
    docs.update({r["id"]: fields_of(r) for r in rows[34:]})
    changed = [(rows[2]["id"], "replaced text about cells", {"year": 2012, "journal": "Cell Reports"}),
               (rows[25]["id"], "replaced text without fields"), {**rows[31], "open": True, "journal": "Nature"}]
    live.upsert(changed)
    docs.update({rows[2]["id"]: changed[0][2], rows[25]["id"]: {}, rows[31]["id"]: fields_of(changed[2])})
    live.delete([rows[0]["id"], rows[30]["id"], rows[35]["id"]])
    for docid in (rows[0]["id"], rows[30]["id"], rows[35]["id"]):
        del docs[docid]
    assert len(read_manifest(target).segments) == 5
    assert stored(target) == docs
    check_filters(target, docs)

    live.compact()
    (segment,) = read_manifest(target).segments
    assert segment.fields == ["authors", "journal", "meta", "naïve \"key\"", "open", "year"]
    store = StoredIndex(target)
    assert store.fields_of(range(store.num_docs)) == [docs[d] for d in store.docids]  # in row order
    check_filters(target, docs)
    live.compact(retrain_codec=True)
    assert stored(target) == docs
    check_filters(target, docs)
    live.delete([d for d, f in docs.items() if f])  # only documents without fields are left
    live.compact()
    (segment,) = read_manifest(target).segments
    assert segment.fields == [] and FIELDS not in segment.files and not (target / segment.name / FIELDS).exists()
    with pytest.raises(FilterError, match="unknown field 'year'"):
        Filter.where("year = 1").rows(StoredIndex(target))


def test_merge_and_derive_keep_fields(tmp_path, model):
    rows = records(30)
    first, second = tmp_path / "shard0", tmp_path / "shard1"
    build_index(rows[:15], first, model, codec="fp16", progress=False, model_name="aligner")
    build_index([(r["id"], r["contents"]) for r in rows[15:20]] + rows[20:], second, model, codec="fp16",
                progress=False, model_name="aligner")
    AlignerIndex(second, model).delete([rows[22]["id"]])
    merged = tmp_path / "merged"
    merge_indexes([first, second], merged, progress=False)
    docs = {r["id"]: fields_of(r) if not 15 <= i < 20 else {} for i, r in enumerate(rows) if i != 22}
    assert [s.fields for s in read_manifest(merged).segments] == [s.fields for m in (first, second)
                                                                  for s in read_manifest(m).segments]
    assert stored(merged) == docs
    check_filters(merged, docs)

    derived = tmp_path / "derived"
    derive_index(merged, derived, codec="IVF8,PQ4", doc_prune=0.5, progress=False)
    assert stored(derived) == docs and StoredIndex(derived).num_docs == len(docs)  # the deleted row is gone
    check_filters(derived, docs)


def test_torchrun_build_stores_the_fields_of_every_rank(tmp_path, model):
    from test_distributed import torchrun

    rows = records(12, words=8)
    corpus = write_jsonl(tmp_path / "docs.jsonl", rows)
    one = tmp_path / "one"
    build_index(read_json_collection(corpus), one, model, codec="IVF8,PQ4", progress=False, model_name="aligner")
    result = torchrun("pyserini_aligner.index", "--corpus", corpus, "--index", tmp_path / "dist", "--codec-from",
                      one, "--dist-timeout", "60")
    assert result.returncode == 0, result.stderr[-6000:]
    manifest = read_manifest(tmp_path / "dist")
    assert len(manifest.segments) == 2 and all(s.fields for s in manifest.segments)
    assert stored(tmp_path / "dist") == stored(one) == {r["id"]: fields_of(r) for r in rows}


@pytest.fixture(scope="module")
def crash_base(tmp_path_factory, model) -> Path:
    target = tmp_path_factory.mktemp("fields_crash") / "idx"
    build_index(records(16), target, model, codec="IVF8,PQ4", progress=False, model_name="aligner")
    AlignerIndex(target, model).delete([records(16)[1]["id"]])
    return target


@pytest.mark.parametrize("operation, point", [
    ("add", "segment-finish"), ("add", "before-commit"), ("add", "after-commit"),
    ("compact", "segment-add"), ("compact", "segment-finish"), ("compact", "before-commit"),
    ("compact", "after-commit")])
def test_killed_write_leaves_fields_of_the_generation_a_reader_opens(tmp_path, model, crash_base, operation, point):
    """A write killed at any step leaves the fields of the generation that a reader then opens: the previous one
    until the manifest is renamed, the new one after; the next write removes the orphaned segment and its fields."""
    extra = records(4, start=16)
    add = write_jsonl(tmp_path / "add.jsonl", extra)
    args = ["--add", str(add)] if operation == "add" else ["--compact"]
    before = stored(crash_base)
    after = {**before, **{r["id"]: fields_of(r) for r in extra}} if operation == "add" else before
    work = shutil.copytree(crash_base, tmp_path / "work")
    snapshot = tmp_path / "snapshot"
    killed_at(point, work, snapshot, lambda: index_cli.main(["--index", str(work), *args, "--quiet"]))
    committed = point == "after-commit"
    assert read_manifest(snapshot).generation == read_manifest(crash_base).generation + committed
    assert stored(snapshot) == (after if committed else before)
    check_filters(snapshot, after if committed else before)
    AlignerIndex(snapshot, model).delete([next(iter(before))])
    assert unreferenced(snapshot) == []


def test_sigkill_before_commit_keeps_the_previous_fields(tmp_path, crash_base):
    """A real SIGKILL of the CLI process after the new segment's fields are written, before the commit."""
    index = shutil.copytree(crash_base, tmp_path / "idx")
    add = write_jsonl(tmp_path / "add.jsonl", records(3, start=16))
    env = dict(os.environ, **{FAULT_ENV: "before-commit"})
    process = subprocess.run([sys.executable, "-m", "pyserini_aligner.index", "--index", str(index), "--add",
                              str(add), "--quiet"], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert process.returncode == -9, process.stderr
    orphans = [p for p in index.iterdir() if p.name.startswith("seg-") and p.name not in
               {s.name for s in read_manifest(index).segments}]
    assert orphans and (orphans[0] / FIELDS).is_file()  # written, never committed
    assert stored(index) == stored(crash_base)


def test_bad_fields_are_refused_and_nothing_is_written(tmp_path, model):
    nan = tmp_path / "nan.jsonl"
    nan.write_text('{"id": "a", "contents": "one"}\n{"id": "b", "contents": "two", "score": NaN}\n')
    with pytest.raises(ValueError, match=rf"^{nan}, line 2: field 'score' is not a JSON value \(Out of range"):
        build_index(read_json_collection(nan), tmp_path / "idx", model, codec="fp16", progress=False)
    with pytest.raises(ValueError, match="corpus, document 1: field 'id' is the document's docid, not a stored field"):
        build_index([("a", "one", {"id": "x"})], tmp_path / "idx", model, codec="fp16", progress=False)
    with pytest.raises(ValueError, match=r"corpus, document 2: field 'when' is not a JSON value \(Object of type"):
        build_index([("a", "one"), ("b", "two", {"when": object()})], tmp_path / "idx", model, codec="fp16",
                    progress=False)
    with pytest.raises(ValueError, match="corpus item 1: expected"):
        build_index([("a", "one", {"x": 1}, {"y": 2})], tmp_path / "idx", model, codec="fp16", progress=False)
    with pytest.raises(CorpusError, match="missing field 'contents'"):
        build_index([{"id": "a", "text": "one"}], tmp_path / "idx", model, codec="fp16", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.jsonl"]


def test_indexes_without_fields_keep_opening_and_corruption_is_named(tmp_path, model):
    target = tmp_path / "idx"
    build_index(records(8), target, model, codec="fp16", progress=False)
    (segment,) = read_manifest(target).segments
    path = target / segment.name / FIELDS
    build_index([(r["id"], r["contents"]) for r in records(8)], tmp_path / "plain", model, codec="fp16",
                progress=False)
    plain = json.loads((tmp_path / "plain" / MANIFEST).read_text())  # as written before fields were stored
    for seg in plain["segments"]:
        del seg["fields"]
    plain.pop("checksum")
    plain["checksum"] = _crc_text(json.dumps(plain, sort_keys=True))
    (tmp_path / "plain" / MANIFEST).write_text(json.dumps(plain))
    store = StoredIndex(tmp_path / "plain")
    assert store.field_names == [] and store.fields_of([0]) == [{}]
    assert Filter.docids([store.docids[3]]).rows(store).nonzero()[0].tolist() == [3]

    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(IndexFormatError, match=rf"{path}: checksum mismatch"):
        StoredIndex(target)
    manifest = read_manifest(target)
    manifest.segments[0].files.pop(FIELDS)
    write_manifest(target, manifest)
    with pytest.raises(IndexFormatError, match=r"segments\[seg-.*\]\.fields must be a list of field names, with "
                                               r"the file fields.sqlite recorded"):
        read_manifest(target)

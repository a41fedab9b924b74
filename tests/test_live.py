"""Live index: add / upsert / delete / compact equal a rebuild, refuse bad updates, survive a kill at every write
step, and never show a reader a mixed generation; Pyserini's CLI searches an updated index."""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pyserini_aligner.index import __main__ as index_cli
from pyserini_aligner.index import StoredIndex, build_index, read_manifest
from pyserini_aligner.index.commit import _OWNED
from pyserini_aligner.index.format import MANIFEST
from pyserini_aligner.index.faults import ENV as FAULT_ENV
from pyserini_aligner.index.live import AlignerIndex, DeleteReport
from pyserini_aligner.search.searcher import AlignerSearcher
from pyserini_aligner.trec import read_run

from conftest import assert_same_ranking, cli_error, killed_at, make_beir_folder, run_module

SCIFACT = Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip"  # set by conftest.py
N_DOCS, N_EXTRA, WORDS = 80, 30, 40
NEW_TEXT = "Honeybee colony collapse disorder linked to neonicotinoid pesticide exposure of foraging bees"


def read_scifact() -> tuple[list[tuple[str, str]], list[str]]:
    """(the first N_DOCS + N_EXTRA SciFact docs cut to WORDS words, every test query)."""
    with zipfile.ZipFile(SCIFACT) as archive:
        docs = []
        with archive.open("scifact/corpus.jsonl") as lines:
            for line in lines:
                record = json.loads(line)
                docs.append((record["_id"], " ".join(f"{record['title']} {record['text']}".split()[:WORDS])))
                if len(docs) == N_DOCS + N_EXTRA:
                    break
        test_qids = {row.split("\t")[0] for row in archive.read("scifact/qrels/test.tsv").decode().splitlines()[1:]}
        queries = [json.loads(line) for line in archive.read("scifact/queries.jsonl").decode().splitlines()]
    return docs, [q["text"] for q in queries if q["_id"] in test_qids]


@pytest.fixture(scope="module")
def scifact():
    return read_scifact()


@pytest.fixture(scope="module")
def docs(scifact):
    return scifact[0][:N_DOCS]


@pytest.fixture(scope="module")
def extra(scifact):
    """Documents not in ``full``, for adds."""
    return scifact[0][N_DOCS:]


@pytest.fixture(scope="module")
def queries(scifact):
    return scifact[1][:10]


@pytest.fixture(scope="module")
def full(tmp_path_factory, model, docs) -> Path:
    """One-shot build of all N_DOCS documents; its codec is the one every other index here shares."""
    target = tmp_path_factory.mktemp("live") / "full"
    build_index(docs, target, model, progress=False, model_name="aligner")
    return target


def write_jsonl(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps({"id": docid, "contents": text}) + "\n" for docid, text in docs))
    return path


def cli(*args) -> None:
    """The index CLI in this process, which succeeds."""
    assert index_cli.main([*map(str, args), "--quiet"]) == 0


def cli_fails(*args) -> str:
    """The one-line error of the index CLI run in this process, which fails with exit status 1."""
    return cli_error(index_cli.main, *args, "--quiet")


def copy_index(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def ranking(index: Path, model, queries, k: int = 10):
    return AlignerSearcher(index, encoder=model).rank(queries, k)


def live_docids(index: Path) -> list[str]:
    stored = StoredIndex(index)
    return [docid for docid, live in zip(stored.docids, stored.live) if live]


def unreferenced(index: Path) -> list[str]:
    """Package-made entries of ``index`` that its manifest does not reference (none after a clean write)."""
    manifest = read_manifest(index)
    wanted = {s.name for s in manifest.segments} | {manifest.codec_dir}
    stray = [p.name for p in index.iterdir() if _OWNED.match(p.name) and p.name not in wanted]
    for seg in manifest.segments:
        stray += [f"{seg.name}/{p.name}" for p in (index / seg.name).iterdir() if p.name not in seg.files]
    return stray


def all_codes(index: Path):
    stored = StoredIndex(index)
    positions = np.arange(stored.offsets[-1])
    return stored.docids, stored.offsets, stored.kept, *stored.token_codes(positions)


# ---------------------------------------------------------------- parity with a rebuild
@pytest.fixture(scope="module")
def grown(tmp_path_factory, model, docs, full) -> Path:
    """Half the documents built with the codec of ``full``, the other half added in 5 batches (the first through
    the CLI, the others through AlignerIndex)."""
    root = tmp_path_factory.mktemp("grown")
    target = root / "index"
    build_index(docs[:N_DOCS // 2], target, model, progress=False, model_name="aligner", codec_from=full)
    rest = docs[N_DOCS // 2:]
    batches = [rest[i:i + len(rest) // 5] for i in range(0, len(rest), len(rest) // 5)]
    cli("--index", target, "--add", write_jsonl(root / "batch0.jsonl", batches[0]))
    index = AlignerIndex(target, encoder=model)
    for batch in batches[1:]:
        index.add(batch)
    return target


def test_add_in_batches_equals_one_shot_build(grown, full, model, queries):
    manifest = read_manifest(grown)
    assert len(manifest.segments) == 6 and manifest.num_docs == N_DOCS
    ours, reference = all_codes(grown), all_codes(full)
    assert ours[0] == reference[0]  # docids, in order
    for name, a, b in zip(("offsets", "kept", "centroid ids", "residual codes"), ours[1:], reference[1:]):
        assert np.array_equal(a, b), name
    assert ranking(grown, model, queries) == ranking(full, model, queries)  # same docids, same scores


def test_delete_then_compact_equals_build_without(tmp_path, grown, full, model, docs, queries, capsys):
    index = copy_index(grown, tmp_path / "index")
    gone = [docid for docid, _ in docs[::10]]
    (tmp_path / "gone.txt").write_text("\n".join(gone) + "\n")
    cli("--index", index, "--delete", tmp_path / "gone.txt")
    assert f"deleted {len(gone)}; {N_DOCS - len(gone)} live documents" in capsys.readouterr().out
    reference = tmp_path / "reference"
    build_index([doc for doc in docs if doc[0] not in gone], reference, model, progress=False,
                model_name="aligner", codec_from=full)
    assert sorted(live_docids(index)) == sorted(live_docids(reference))
    expected = ranking(reference, model, queries)
    assert ranking(index, model, queries) == expected
    assert not any(docid in gone for hits in expected for docid, _ in hits)

    cli("--index", index, "--compact")
    ours, theirs = read_manifest(index).segments, read_manifest(reference).segments
    assert len(ours) == 1 and len(theirs) == 1
    ours_dir, theirs_dir = index / ours[0].name, reference / theirs[0].name
    names = sorted(p.name for p in theirs_dir.iterdir())
    assert sorted(p.name for p in ours_dir.iterdir()) == names
    for name in names:
        assert (ours_dir / name).read_bytes() == (theirs_dir / name).read_bytes(), name
    assert ranking(index, model, queries) == expected
    assert unreferenced(index) == []


@pytest.mark.parametrize("codec", ["IVF256,PQ8", "fp16"])
def test_adds_and_deletes_rank_as_a_rebuild(tmp_path, model, scifact, codec):
    """300 SciFact documents: the first half built, the second half added, every fourth document of both segments
    deleted. Every sixth SciFact test query (50) ranks at k=100, through both backends (FAISS and torch), as over a
    rebuild of the live documents from their stored codes or vectors (the index compacted into one segment without
    tombstones: a build from the texts encodes them in other batches, where a vector can differ in its last bit):
    deleted rows never take one of a probe's entries, and the depth (nprobe from the live inverted-list entries)
    and the refinement width are those of the live documents."""
    folder = make_beir_folder(tmp_path / "beir", n_docs=300, words=WORDS)
    records = [json.loads(line) for line in (folder / "corpus.jsonl").read_text().splitlines()]
    corpus = [(r["_id"], f"{r['title']} {r['text']}") for r in records]
    index = tmp_path / "live"
    build_index(corpus[:150], index, model, progress=False, model_name="aligner", codec=codec)
    AlignerIndex(index, encoder=model).add(corpus[150:])
    gone = {docid for docid, _ in corpus[::4]}
    assert AlignerIndex(index, encoder=model).delete(sorted(gone)).deleted == len(gone)
    rebuilt = copy_index(index, tmp_path / "rebuilt")
    AlignerIndex(rebuilt).compact()
    assert len(read_manifest(rebuilt).segments) == 1 and StoredIndex(rebuilt).live.all()
    assert live_docids(index) == live_docids(rebuilt) == [doc for doc, _ in corpus if doc not in gone]
    queries = scifact[1][::6]
    for backend in ("faiss", "torch"):
        got = AlignerSearcher(index, encoder=model, backend=backend).rank(queries, 100)
        want = AlignerSearcher(rebuilt, encoder=model, backend=backend).rank(queries, 100)
        assert all(len(hits) == 100 for hits in want)
        for ours, theirs in zip(got, want):
            assert_same_ranking(ours, theirs)


# ---------------------------------------------------------------- upsert
def test_upsert_moves_the_ranking_to_the_new_text(tmp_path, full, model, docs, extra):
    index = copy_index(full, tmp_path / "index")
    target, old_text = docs[5]
    old_query = " ".join(old_text.split()[:12])
    before = ranking(index, model, [old_query, NEW_TEXT])
    assert before[0][0][0] == target and target not in [d for d, _ in before[1][:3]]
    AlignerIndex(index, encoder=model).upsert([(target, NEW_TEXT), extra[0]])
    after = ranking(index, model, [old_query, NEW_TEXT])
    assert after[1][0][0] == target
    old_score = dict(after[0]).get(target)
    assert after[0][0][0] != target and (old_score is None or old_score < before[0][0][1])
    live = live_docids(index)
    assert len(live) == N_DOCS + 1 and live.count(target) == 1 and extra[0][0] in live


# ---------------------------------------------------------------- refused or partial updates
def test_delete_unknown_ids_is_reported_and_strict_deletes_nothing(tmp_path, full, docs, capsys, caplog):
    index = copy_index(full, tmp_path / "index")
    (tmp_path / "ids.txt").write_text(f"{docs[0][0]}\nno-such-doc\n")
    cli("--index", index, "--delete", tmp_path / "ids.txt")
    assert "deleted 1;" in capsys.readouterr().out and "no-such-doc" in caplog.text
    generation = read_manifest(index).generation
    (tmp_path / "strict.txt").write_text(f"{docs[1][0]}\nno-such-doc\n")
    assert re.match("error: .*no-such-doc.*nothing deleted", cli_fails("--index", index, "--delete",
                                                                        tmp_path / "strict.txt", "--strict"))
    assert read_manifest(index).generation == generation and docs[1][0] in live_docids(index)


def test_adding_a_live_docid_is_refused_and_changes_nothing(tmp_path, full, docs, extra):
    index = copy_index(full, tmp_path / "index")
    manifest_bytes = (index / MANIFEST).read_bytes()
    assert re.match(f"error: .*{docs[7][0]!r}", cli_fails("--index", index, "--add",
                                                          write_jsonl(tmp_path / "dup.jsonl", [extra[0], docs[7]])))
    assert (index / MANIFEST).read_bytes() == manifest_bytes
    assert live_docids(index) == live_docids(full)
    AlignerIndex(index).delete([docs[0][0]])  # the next write removes whatever the refused one wrote
    assert unreferenced(index) == []


def test_refused_add_leaves_no_folder(tmp_path, full, model, docs, extra):
    index = copy_index(full, tmp_path / "index")
    entries = sorted(p.name for p in index.iterdir())
    with pytest.raises(ValueError, match=repr(docs[7][0])):
        AlignerIndex(index, encoder=model).add([extra[0], docs[7]])
    assert sorted(p.name for p in index.iterdir()) == entries


@pytest.mark.parametrize("single", ["12", b"12"])
def test_a_single_string_is_never_taken_for_a_list_of_docids(tmp_path, full, model, single):
    from pyserini_aligner.adapt.select import rescore
    from pyserini_aligner.encoders import AlignerDocumentEncoder
    from pyserini_aligner.explain import explain
    from pyserini_aligner.index.shards import merge_indexes
    from pyserini_aligner.search import AlignmentReranker

    index = copy_index(full, tmp_path / "index")
    AlignerIndex(index, encoder=model).add([("1", "one"), ("2", "two"), ("12", NEW_TEXT)])
    before = (index / MANIFEST).read_bytes()
    live = AlignerIndex(index, encoder=model)
    searcher = AlignerSearcher(index, encoder=model)
    calls = {"docids": lambda: live.delete(single), "docs": lambda: live.add(single),
             "docs ": lambda: live.upsert(single),
             "candidates": lambda: AlignmentReranker(index, encoder=model).rerank("bees", single),
             "queries": lambda: searcher.batch_search(single, ["1", "2"]), "queries ": lambda: searcher.rank(single),
             "texts": lambda: model.encode(single, is_query=True),
             "texts ": lambda: AlignerDocumentEncoder(model).encode(single),
             "inputs": lambda: merge_indexes(single, tmp_path / "merged", progress=False),
             "docids ": lambda: explain(index, "bees", docids=single, encoder=model),
             "candidates of a query": lambda: rescore(StoredIndex(index), model, {"q": "bees"}, {"q": single})}
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{name.strip()} must be a list .* not a single {type(single).__name__}"):
            call()
    assert (index / MANIFEST).read_bytes() == before  # "1" and "2" are still there
    assert {"1", "2", "12"} <= set(live_docids(index))
    assert live.delete(["12"]) == DeleteReport(deleted=1, unknown=[])
    assert {"1", "2"} <= set(live_docids(index)) and "12" not in live_docids(index)
    with pytest.raises(TypeError, match="not a path"):
        build_index(str(tmp_path / "corpus.jsonl"), tmp_path / "other", model, progress=False)


def test_updates_that_change_nothing_commit_nothing(tmp_path, full, model):
    index = copy_index(full, tmp_path / "index")
    before = (index / MANIFEST).read_bytes()
    live = AlignerIndex(index, encoder=model)
    assert live.add([]).generation == live.upsert(iter([])).generation == read_manifest(index).generation
    assert live.delete([]) == DeleteReport(deleted=0, unknown=[])
    assert live.delete(["no-such-doc"]) == DeleteReport(deleted=0, unknown=["no-such-doc"])
    assert (index / MANIFEST).read_bytes() == before and unreferenced(index) == []


def test_adding_with_another_model_is_refused(tmp_path, full, model, extra):
    other = copy.deepcopy(model)
    other.reset_heads(seed=1)
    other.save_pretrained(tmp_path / "untrained")
    index = copy_index(full, tmp_path / "index")
    generation = read_manifest(index).generation
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        AlignerIndex(index, encoder=str(tmp_path / "untrained")).add([extra[0]])
    assert read_manifest(index).generation == generation and unreferenced(index) == []


def test_read_only_index_gives_a_clear_error(tmp_path, full, docs):
    index = copy_index(full, tmp_path / "index")
    (tmp_path / "ids.txt").write_text(docs[0][0] + "\n")
    index.chmod(0o555)
    try:
        if os.access(index, os.W_OK):
            pytest.skip("this process ignores file permissions (root): a 0555 folder stays writable")
        error = cli_fails("--index", index, "--delete", tmp_path / "ids.txt")
    finally:
        index.chmod(0o755)
    assert "read-only" in error and str(index) in error
    assert docs[0][0] in live_docids(index)


# ---------------------------------------------------------------- crash safety
@pytest.fixture(scope="module")
def crash_base(tmp_path_factory, full, model, extra) -> Path:
    """Two segments with deletions in both, so that compact has work to do."""
    target = copy_index(full, tmp_path_factory.mktemp("crash") / "base")
    index = AlignerIndex(target, encoder=model)
    index.add(extra[:4])
    index.delete([extra[0][0], StoredIndex(target).docids[3]])
    return target


# operation -> (CLI arguments after --index, the fault points it passes through)
OPERATIONS = {
    "add": (["--add", "{add}"], ["segment-add", "segment-finish", "before-commit", "after-commit"]),
    "upsert": (["--upsert", "{upsert}"], ["tombstone"]),  # its other steps are those of add
    "delete": (["--delete", "{delete}"], ["tombstone", "before-commit", "after-commit"]),
    "compact": (["--compact"], ["segment-add", "segment-finish", "before-commit", "after-commit"]),
    "compact-retrain": (["--compact", "--retrain-codec"], ["segment-add"]),  # a new codec folder is left behind
}


def apply(index: Path, operation: str, inputs: dict, model) -> None:
    """``operation`` through the Python API, with the same inputs as the CLI runs."""
    live = AlignerIndex(index, encoder=model)
    if operation in ("add", "upsert"):
        live.add(inputs[operation + "_docs"], upsert=operation == "upsert")
    elif operation == "delete":
        assert live.delete(inputs["delete_ids"], strict=True).deleted == len(inputs["delete_ids"])
    else:
        live.compact(retrain_codec=operation == "compact-retrain")


@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_killed_write_leaves_the_previous_generation(tmp_path, crash_base, model, extra, queries, operation):
    base_docs = StoredIndex(crash_base).docids
    inputs = {"add_docs": extra[4:7], "upsert_docs": [(base_docs[10], NEW_TEXT), extra[7]],
              "delete_ids": [base_docs[1], base_docs[-1]]}
    files = {"add": write_jsonl(tmp_path / "add.jsonl", inputs["add_docs"]),
             "upsert": write_jsonl(tmp_path / "upsert.jsonl", inputs["upsert_docs"]),
             "delete": tmp_path / "delete.txt"}
    files["delete"].write_text("\n".join(inputs["delete_ids"]) + "\n")
    template, points = OPERATIONS[operation]
    args = [part.format(**files) for part in template]
    generation, before_docs = read_manifest(crash_base).generation, live_docids(crash_base)
    before = ranking(crash_base, model, queries)
    done = copy_index(crash_base, tmp_path / "done")
    apply(done, operation, inputs, model)
    after, after_docs = ranking(done, model, queries), live_docids(done)
    segments = {False: len(read_manifest(crash_base).segments), True: len(read_manifest(done).segments)}
    assert read_manifest(done).generation == generation + 1
    assert after == before if operation == "compact" else after != before  # compaction alone changes no result

    for point in points:
        index = tmp_path / point
        if (operation, point) == ("delete", "tombstone"):  # one step through a real SIGKILL of the CLI process
            copy_index(crash_base, index)
            env = dict(os.environ, **{FAULT_ENV: point})
            process = subprocess.run([sys.executable, "-m", "pyserini_aligner.index", "--index", str(index), *args,
                                      "--quiet"], env=env, capture_output=True, text=True, timeout=300)
            assert process.returncode == -9, f"{operation} at {point}: exit {process.returncode}\n{process.stderr}"
        else:
            work = copy_index(crash_base, tmp_path / "work")
            killed_at(point, work, index, lambda: cli("--index", work, *args))
            shutil.rmtree(work)
        committed = point == "after-commit"  # killed after the rename: the new generation is the state
        assert read_manifest(index).generation == generation + committed, point
        assert len(read_manifest(index).segments) == segments[committed], point
        assert ranking(index, model, queries) == (after if committed else before), point
        assert live_docids(index) == (after_docs if committed else before_docs), point
        if committed:
            AlignerIndex(index).delete([after_docs[0]])  # any next write clears what the killed one left
        else:
            apply(index, operation, inputs, model)  # the same write again, now whole
            assert ranking(index, model, queries) == after and live_docids(index) == after_docs, point
        assert unreferenced(index) == [], point


# ---------------------------------------------------------------- readers during updates
def test_readers_see_whole_generations_during_updates(tmp_path, full, model, docs, extra, queries):
    index = copy_index(full, tmp_path / "index")
    first = read_manifest(index).generation
    plan, count, expected = [], N_DOCS, {first: N_DOCS}
    for step in range(50):
        if step == 25:
            plan.append(("compact", None))
        elif step % 2 == 0:
            plan.append(("add", extra[step // 2]))
            count += 1
        else:
            plan.append(("delete", docs[step][0]))
            count -= 1
        expected[first + step + 1] = count
    stop, errors, seen = threading.Event(), [], set()

    def read() -> None:
        searcher = AlignerSearcher(index, encoder=model)
        turn = 0
        while not stop.is_set():
            try:
                searcher.reopen()
                snapshot = searcher.store if turn % 2 else StoredIndex(index)
                generation = snapshot.manifest.generation
                seen.add(generation)
                if snapshot.num_live != expected[generation] or len(snapshot.docids) != snapshot.manifest.num_rows:
                    errors.append(f"generation {generation}: {snapshot.num_live} live, expected "
                                  f"{expected[generation]}")
                hits = searcher.rank(queries[:1], 10)[0]
                live = {d for d, alive in zip(searcher.store.docids, searcher.store.live) if alive}
                if len(hits) != 10 or not {d for d, _ in hits} <= live:
                    errors.append(f"generation {searcher.manifest.generation}: hits {hits} not all live")
            except Exception as err:  # noqa: BLE001 -- every failure of a reader is the finding
                errors.append(f"{type(err).__name__}: {err}")
            turn += 1

    reader = threading.Thread(target=read)
    reader.start()
    writer = AlignerIndex(index, encoder=model)
    try:
        for kind, item in plan:
            if kind == "add":
                writer.add([item])
            elif kind == "delete":
                assert writer.delete([item]).deleted == 1
            else:
                writer.compact()
    finally:
        stop.set()
        reader.join(timeout=60)
    assert errors == []
    assert read_manifest(index).generation == first + 50 and StoredIndex(index).num_live == count
    assert len(seen) >= 3  # the reader really ran across several generations


# ---------------------------------------------------------------- Pyserini on an updated index
def test_pyserini_faiss_cli_searches_an_updated_index(tmp_path, full, model, docs, queries):
    index = copy_index(full, tmp_path / "index")
    AlignerIndex(index, encoder=model).add([("new-doc", NEW_TEXT)])
    gone = [docid for docid, _ in docs[:20:2]]
    (tmp_path / "gone.txt").write_text("\n".join(gone) + "\n")
    cli("--index", index, "--delete", tmp_path / "gone.txt")
    topics = {f"q{i}": text for i, text in enumerate(queries)} | {"qnew": NEW_TEXT}
    (tmp_path / "topics.tsv").write_text("".join(f"{qid}\t{text}\n" for qid, text in topics.items()))
    assert run_module("pyserini.search.faiss", "--index", index, "--encoder", "aligner", "--topics",
                      tmp_path / "topics.tsv", "--output", tmp_path / "run.trec", "--hits", 10) == 0
    run = read_run(tmp_path / "run.trec")
    assert set(run) == set(topics)
    assert max(run["qnew"], key=run["qnew"].get) == "new-doc"
    assert not any(docid in gone for hits in run.values() for docid in hits)
    expected = dict(zip(topics, ranking(index, model, list(topics.values()))))
    for qid, hits in run.items():
        assert sorted(hits, key=hits.get, reverse=True) == [d for d, _ in expected[qid]], qid

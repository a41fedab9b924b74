"""Fault probes of index writes and reads: --overwrite that could lose data, a searcher shared by threads, builds and
overwrites killed at every write step, leftovers, a full disk, and same-size corruption of every index file."""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pyserini_aligner.index import __main__ as index_cli
from pyserini_aligner.index import build_index, checksums
from pyserini_aligner.index.commit import write_manifest
from pyserini_aligner.index.format import MANIFEST, SMALL_FILE, IndexFormatError, read_manifest
from pyserini_aligner.index.reader import StoredIndex
from pyserini_aligner.search import AlignerSearcher
from pyserini_aligner.search import __main__ as search_cli

from eval.bench_checksums import without_block_checksums

from conftest import cli_error, killed_at, scifact_docs

REPO = Path(__file__).resolve().parents[1]
QUERIES = ["what causes cancer", "protein folding in cells", "vitamin D deficiency", "stem cells in the heart",
           "antibiotic resistance", "blood pressure drugs", "immune response to infection", "obesity and diabetes"]


def short_docs(n: int = 40, words: int = 30) -> list[tuple[str, str]]:
    return [(r["id"], " ".join(r["contents"].split()[:words])) for r in scifact_docs(n)]


def write_corpus(path: Path, docs) -> Path:
    path.write_text("".join(json.dumps({"id": d, "contents": t}) + "\n" for d, t in docs))
    return path


def killed_cli(*args: str, fault: str) -> subprocess.CompletedProcess:
    """The index CLI in a child process that SIGKILLs itself at fault point ``fault``."""
    env = dict(os.environ, PYSERINI_ALIGNER_FAULT=fault)
    return subprocess.run([sys.executable, "-m", "pyserini_aligner.index", *args, "--quiet"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def cli(*args: str) -> None:
    """The index CLI in this process, which succeeds."""
    assert index_cli.main([*args, "--quiet"]) == 0


def cli_fails(*args: str) -> str:
    """The one-line error of the index CLI run in this process, which fails with exit status 1."""
    return cli_error(index_cli.main, *args, "--quiet")


@pytest.fixture(scope="module")
def built(tmp_path_factory, model) -> Path:
    """A small default (compressed) index."""
    target = tmp_path_factory.mktemp("faults_index") / "idx"
    build_index(short_docs(), target, model, progress=False, model_name="aligner")
    return target


def test_overwrite_never_replaces_a_folder_that_is_not_an_index(tmp_path, model):
    project = tmp_path / "myproject"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a pyserini-aligner index"):
        build_index(short_docs(5), project, model, progress=False, overwrite=True)
    assert (project / "notes.txt").read_text() == "mine" and sorted(os.listdir(project)) == ["notes.txt"]
    corpus = write_corpus(tmp_path / "c.jsonl", short_docs(5))
    assert re.match("error: .*not a pyserini-aligner index", cli_fails("--corpus", corpus, "--index", project,
                                                                          "--overwrite"))
    assert sorted(os.listdir(project)) == ["notes.txt"]


@pytest.mark.parametrize("where", ["equal", "inside", "holds"])
def test_overwrite_never_touches_the_corpus(tmp_path, where):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_corpus(folder / "docs.jsonl", short_docs(5))
    index = {"equal": folder, "inside": folder / "idx", "holds": tmp_path}[where]
    assert re.match("error: .*corpus", cli_fails("--corpus", folder, "--index", index, "--overwrite"))
    assert sorted(os.listdir(folder)) == ["docs.jsonl"]


def test_index_path_under_a_file_is_named(tmp_path, model):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        build_index(short_docs(3), tmp_path / "file" / "idx", model, progress=False)


def test_a_searcher_shared_by_threads_answers_as_a_serial_one(built, model):
    searcher = AlignerSearcher(built, encoder=model)
    queries = QUERIES * 4
    serial = [searcher.search(q, k=10) for q in queries]
    results: dict[int, list] = {}

    def work(worker: int) -> None:
        for i in range(worker, len(queries), 4):
            results[i] = searcher.search(queries[i], k=10)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [[(h.docid, h.score) for h in results[i]] for i in range(len(queries))] == \
        [[(h.docid, h.score) for h in hits] for hits in serial]


@pytest.mark.parametrize("point", ["segment-add", "segment-finish", "before-commit", "before-rename"])
def test_a_build_killed_at_any_step_leaves_nothing(tmp_path, point):
    corpus = write_corpus(tmp_path / "c.jsonl", short_docs(12, 12))
    work = tmp_path / "work"
    work.mkdir()
    if point == "before-rename":  # one step through a real SIGKILL of the CLI process
        assert killed_cli("--corpus", str(corpus), "--index", str(work / "idx"), fault=point).returncode == -9
        left = work
    else:
        left = tmp_path / "killed"
        killed_at(point, work, left, lambda: cli("--corpus", str(corpus), "--index", str(work / "idx")))
    assert not (left / "idx").exists()
    assert any(p.name.startswith(".idx.building-") for p in left.iterdir())  # what the dead process left
    cli("--corpus", str(corpus), "--index", str(left / "idx"))
    assert not any(".building-" in p.name for p in left.iterdir())  # cleaned by the next build
    assert StoredIndex(left / "idx").num_docs == 12


@pytest.mark.parametrize("point", ["segment-add", "before-commit", "after-commit"])
def test_an_overwrite_killed_at_any_step_keeps_a_whole_index(tmp_path, built, model, point):
    work = tmp_path / "work"
    shutil.copytree(built, work / "idx")
    before = AlignerSearcher(work / "idx", encoder=model).rank(QUERIES, k=5)
    corpus = write_corpus(tmp_path / "c.jsonl", short_docs(12, 12))
    killed_at(point, work, tmp_path / "killed", lambda: cli("--corpus", str(corpus), "--index", str(work / "idx"),
                                                             "--overwrite"))
    index = tmp_path / "killed" / "idx"
    reopened = StoredIndex(index)  # never a mix: the old generation, or (killed after the rename) the new one
    if point == "after-commit":
        assert reopened.num_docs == 12
    else:
        assert reopened.manifest.generation == 1
        assert AlignerSearcher(index, encoder=model).rank(QUERIES, k=5) == before
    cli("--corpus", str(corpus), "--index", str(index), "--overwrite")
    manifest = read_manifest(index)
    names = {s.name for s in manifest.segments} | {manifest.codec_dir}
    assert {p.name for p in index.iterdir() if p.is_dir()} == names  # leftovers removed by the next write


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_same_size_corruption_of_every_file_is_caught(tmp_path, built):
    manifest = read_manifest(built)
    files = [(manifest.codec_dir, name) for name in manifest.codec_files]
    files += [(seg.name, name) for seg in manifest.segments for name in seg.files]
    assert len(files) >= 11
    for folder, name in files:
        copy = tmp_path / f"{folder}-{name}"
        shutil.copytree(built, copy)
        _flip(copy / folder / name)
        with pytest.raises(IndexFormatError, match=name.replace(".", r"\.")):
            StoredIndex(copy, verify=True)
        shutil.rmtree(copy)
    text = (built / MANIFEST).read_text()
    edited = tmp_path / "edited"
    shutil.copytree(built, edited)
    (edited / MANIFEST).write_text(text.replace('"doc_prune": 0.2', '"doc_prune": 0.3'))
    with pytest.raises(IndexFormatError, match="checksum"):
        StoredIndex(edited)


def test_same_size_corruption_of_a_large_file_fails_the_search(tmp_path, index_dir, model):
    """A flipped byte in the middle of a file over 1 MiB (memory-mapped, not read whole on open) fails the open with
    one line naming the file, before any ranking; an index written before block checksums still opens. The index is
    the session's exact one of 200 SciFact documents: its token vectors span several checksum blocks."""
    large = index_dir
    segment = read_manifest(large).segments[0]
    name, record = max(segment.files.items(), key=lambda item: item[1]["bytes"])
    assert record["bytes"] > SMALL_FILE and len(record["blocks"]["crc32"]) > 1
    broken = tmp_path / "broken"
    shutil.copytree(large, broken)
    _flip(broken / segment.name / name)
    topics = tmp_path / "topics.tsv"
    topics.write_text("".join(f"q{number}\t{query}\n" for number, query in enumerate(QUERIES)))
    run = tmp_path / "run.trec"
    line = cli_error(search_cli.main, "--index", broken, "--topics", topics, "--output", run, "--quiet")
    middle = record["bytes"] // 2 // checksums.BLOCK * checksums.BLOCK
    assert line == (f"error: {broken / segment.name / name}: checksum mismatch in bytes {middle}-"
                    f"{min(middle + checksums.BLOCK, record['bytes'])} (corrupt index file; rebuild the index)")
    assert not run.exists()
    with pytest.raises(IndexFormatError, match=re.escape(str(broken / segment.name / name))):
        AlignerSearcher(broken, encoder=model)
    old = tmp_path / "old"  # as written before block checksums: opens, its large files unverified
    without_block_checksums(large, old)
    assert "blocks" not in (old / MANIFEST).read_text()
    assert AlignerSearcher(old, encoder=model).rank(QUERIES, k=5) == AlignerSearcher(large, encoder=model).rank(
        QUERIES, k=5)


def test_false_manifest_fields_are_refused(tmp_path, built):
    for field, value in (("index_type", "Flat"), ("doc_prune", 1.5), ("corpus", 7)):
        copy = tmp_path / field
        shutil.copytree(built, copy)
        manifest = read_manifest(copy)
        setattr(manifest, field, value)
        write_manifest(copy, manifest)
        with pytest.raises(IndexFormatError, match=field):
            StoredIndex(copy)


def _small_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_fails_cleanly(tmp_path):
    disk = tmp_path / "disk"
    if not _small_tmpfs(disk, "64k"):  # less than the codec files need
        pytest.skip("mounting a small tmpfs needs privileges this machine does not grant")
    try:
        corpus = write_corpus(tmp_path / "c.jsonl", short_docs(40))
        assert re.match("error: .*No space left", cli_fails("--corpus", corpus, "--index", disk / "idx"))
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize("docid", ["a b", "a\tb", "a\nb", ""])
def test_docids_that_would_break_a_trec_run_are_refused(tmp_path, model, docid):
    with pytest.raises(ValueError, match="without spaces, tabs or line breaks"):
        build_index([("ok", "some text"), (docid, "more text")], tmp_path / "idx", model, progress=False)
    assert not (tmp_path / "idx").exists()


BLANK_TEXTS = {"empty": "", "spaces": " \t\n ", "nul": "\x00\x00", "zero-width": "\u200b\u200c\u200d\u2060",
               "format": "\ufeff\u00ad \u200e", "filler": "\u3164\u2800"}


def test_blank_documents_are_skipped_with_a_warning(tmp_path, model, caplog):
    from pyserini_aligner.index.live import AlignerIndex

    docs = short_docs(8)
    blank = [(f"blank-{name}", text) for name, text in BLANK_TEXTS.items()]
    with caplog.at_level("WARNING"):
        manifest = build_index(docs[:4] + blank + docs[4:], tmp_path / "idx", model, progress=False,
                               model_name="aligner")
    assert ("skipped 6 document(s) with no text (no letter or digit: empty, white space, punctuation or invisible "
            "characters only), not indexed: "
            "blank-empty, blank-spaces, blank-nul, blank-zero-width, blank-format, ...") in caplog.text
    assert StoredIndex(tmp_path / "idx").docids == [d for d, _ in docs]
    assert manifest.num_docs == 8 and manifest.num_empty == 6
    query = "\u3164"  # a query of invisible characters has no hits, as a blank document has no tokens
    assert AlignerSearcher(tmp_path / "idx", encoder=model).search(query, k=5) == []

    index = AlignerIndex(tmp_path / "idx", encoder=model)
    caplog.clear()
    with caplog.at_level("WARNING"):
        manifest = index.add([("new-blank", "\u200b \x00"), ("new", "vitamin D and bone density")])
    assert "skipped 1 document(s)" in caplog.text and "not indexed: new-blank" in caplog.text
    assert "new" in StoredIndex(tmp_path / "idx").docids and "new-blank" not in StoredIndex(tmp_path / "idx").docids
    assert manifest.num_docs == 9 and manifest.num_empty == 7
    generation = manifest.generation
    assert index.add([("only-blank", " \u200d ")]).generation == generation  # nothing to add: no commit
    manifest = index.upsert([(docs[0][0], "\x00")])  # upserted blank: skipped, and the earlier version goes
    live = StoredIndex(tmp_path / "idx")
    assert manifest.generation == generation + 1 and manifest.num_docs == 8
    assert docs[0][0] not in [d for d, alive in zip(live.docids, live.live) if alive]


@pytest.mark.parametrize("query", ["", "   ", "\x00", "\u200b\u200d", "\ufeff \x00"])
def test_blank_queries_have_no_hits(built, model, query):
    assert AlignerSearcher(built, encoder=model).search(query, k=5) == []

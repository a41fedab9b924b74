"""Fault probes: bad flags, bad or missing input files, interrupted and failed runs, a full Java heap.

One tiny index (20 SciFact documents, built from a local BEIR folder through the index CLI) serves the module.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import faiss
import numpy as np
import pytest

from pyserini_aligner.index.format import read_manifest

from conftest import run_module

REPO = Path(__file__).resolve().parents[1]
N_DOCS = 20


def run(*args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    """``python <args>`` with this interpreter, from the repository root."""
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def tiny_beir(folder: Path) -> Path:
    """A BEIR folder: the first 20 SciFact documents, 3 queries, each judged relevant to all of them (so that every
    ranking of 10 or more of them scores nDCG@10 > 0)."""
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        docs = archive.read("scifact/corpus.jsonl").decode().splitlines()[:N_DOCS]
        queries = archive.read("scifact/queries.jsonl").decode().splitlines()[:3]
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("\n".join(docs) + "\n")
    (folder / "queries.jsonl").write_text("\n".join(queries) + "\n")
    qids = [json.loads(q)["_id"] for q in queries]
    docids = [json.loads(d)["_id"] for d in docs]
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                               "".join(f"{q}\t{d}\t1\n" for q in qids for d in docids))
    return folder


@pytest.fixture(scope="module")
def beir(tmp_path_factory) -> Path:
    return tiny_beir(tmp_path_factory.mktemp("faults") / "beir")


@pytest.fixture(scope="module")
def index(beir) -> Path:
    """Built from the BEIR folder itself (corpus.jsonl with _id/title/text) by the index CLI."""
    from pyserini_aligner.index.__main__ import main

    target = beir.parent / "idx"
    assert main(["--corpus", str(beir), "--index", str(target), "--quiet"]) == 0
    return target


@pytest.fixture(scope="module")
def topics(beir) -> Path:
    path = beir.parent / "topics.tsv"
    lines = [json.loads(q) for q in (beir / "queries.jsonl").read_text().splitlines()]
    path.write_text("".join(f"{q['_id']}\t{q['text']}\n" for q in lines))
    return path


def stale_run(folder: Path) -> Path:
    path = folder / "run.trec"
    path.write_text("1 Q0 stale 1 1.0 old\n")
    return path


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.suffix in (".partial", ".tmp"))


# 1. exit status through Pyserini's entry points; no stale run under --output


@pytest.mark.parametrize("bad", [["--hits", "0"], ["--topics", "nowhere/missing.tsv"]], ids=["bad-flag", "no-topics"])
def test_lucene_entry_point_fails_nonzero_without_stale_run(index, topics, tmp_path, capsys, bad):
    output = stale_run(tmp_path)
    args = {"--index": str(index), "--topics": str(topics), "--output": str(output), "--hits": "5"}
    args.update(dict(zip(bad[::2], bad[1::2])))
    assert run_module("pyserini.search.lucene", *[x for pair in args.items() for x in pair]) != 0
    assert not output.exists() and leftovers(tmp_path) == []
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ("argument --hits" if bad[0] == "--hits" else "topics file nowhere/missing.tsv does not exist") in err


def test_faiss_entry_point_error_is_one_line_and_nonzero(index, topics, tmp_path, capsys):
    output = stale_run(tmp_path)
    assert run_module("pyserini.search.faiss", "--index", str(index), "--encoder", "aligner", "--topics", str(topics),
                      "--output", str(output), "--hits", "0") == 1
    err = capsys.readouterr().err
    assert "error: k must be >= 1, got 0" in err and "Traceback" not in err
    assert not output.exists() and leftovers(tmp_path) == []


def test_aligner_encoder_on_a_plain_faiss_index(topics, tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    flat = faiss.IndexFlatIP(8)
    flat.add(np.random.default_rng(0).random((3, 8), dtype=np.float32))
    faiss.write_index(flat, str(plain / "index"))
    (plain / "docid").write_text("a\nb\nc\n")
    assert run_module("pyserini.search.faiss", "--index", str(plain), "--encoder", "aligner", "--topics",
                      str(topics), "--output", str(tmp_path / "run.trec")) == 1
    err = capsys.readouterr().err
    assert f"error: {plain} is not a pyserini-aligner index" in err and "Traceback" not in err
    assert not (tmp_path / "run.trec").exists()


# 2. runs are written atomically; the output path is checked before any query runs


def test_write_run_failure_leaves_no_partial_file(tmp_path):
    from pyserini_aligner.trec import write_run

    def broken():
        yield "q1", [("d1", 1.0)]
        raise RuntimeError("disk gone")

    class Hits(dict):
        def items(self):
            return broken()

    target = tmp_path / "run.trec"
    with pytest.raises(RuntimeError):
        write_run(Hits(), target, tag="t")
    assert list(tmp_path.iterdir()) == []
    write_run({"q1": [("d1", 1.0)]}, target, tag="t")
    assert target.read_text() == "q1 Q0 d1 1 1.000000 t\n" and list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("where", ["folder", "under-a-file"])
def test_output_path_checked_before_the_search(index, topics, tmp_path, capsys, where):
    from pyserini_aligner.search.__main__ import main

    (tmp_path / "file").write_text("mine")
    output = tmp_path if where == "folder" else tmp_path / "file" / "run.trec"
    started = time.perf_counter()
    assert main(["--index", str(index), "--topics", str(topics), "--output", str(output), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert ("is a folder; name a file" if where == "folder" else "file is a file, not a folder") in err
    assert time.perf_counter() - started < 5  # no model was loaded
    assert (tmp_path / "file").read_text() == "mine"


# 3. adaptation


def test_qrels_need_four_columns(tmp_path):
    from pyserini_aligner.textio import InputError
    from pyserini_aligner.data import read_qrels

    path = tmp_path / "qrels.txt"
    path.write_text("1 0 d1 1\n2 d3 1\n")
    with pytest.raises(InputError, match=r"qrels\.txt, line 2: expected 'qid iteration docid relevance'.*got 3"):
        read_qrels(str(path))


def test_one_qrels_and_topics_reader():
    import pyserini_aligner.adapt.inputs as inputs
    import pyserini_aligner.data as data

    assert not hasattr(inputs, "read_qrels") and not hasattr(inputs, "read_topics")
    assert not hasattr(data, "load_qrels") and "csv" not in vars(data)
    library = [p for p in (REPO / "pyserini_aligner").rglob("*.py") if p.name != "__main__.py"]
    importers = [p.name for p in library if ".__main__ import" in p.read_text(encoding="utf-8")]
    assert importers == []


def test_adapt_refuses_to_save_when_every_strategy_scores_zero(index, topics, tmp_path, capsys, caplog):
    from pyserini_aligner.adapt.__main__ import main

    qrels = tmp_path / "qrels.txt"
    qids = [line.split("\t")[0] for line in topics.read_text().splitlines()]
    qrels.write_text("".join(f"{qid} 0 not-in-the-index 1\n" for qid in qids))
    before = (index / "manifest.json").read_bytes()
    assert main(["--index", str(index), "--topics", str(topics), "--qrels", str(qrels), "--candidates", "5",
                 "--strategies", "top-k:1", "top-k:2", "--quiet"]) == 1
    assert "every candidate scores ndcg@10 0" in capsys.readouterr().err
    assert "only 3 judged queries" in caplog.text
    assert (index / "manifest.json").read_bytes() == before



def test_adapt_keeps_the_stored_default_when_nothing_beats_it(index, topics, tmp_path, capsys):
    import shutil

    from pyserini_aligner.adapt.__main__ import main
    from pyserini_aligner.index.commit import set_default_strategy

    copy = Path(shutil.copytree(index, tmp_path / "idx"))
    set_default_strategy(copy, "top-p:0.02")
    before = (copy / "manifest.json").read_bytes()
    assert set_default_strategy(copy, "top-p:0.02").generation == read_manifest(copy).generation
    assert (copy / "manifest.json").read_bytes() == before  # the same strategy again writes nothing
    qrels = tmp_path / "qrels.txt"  # one judged query, every document relevant: no strategy can do better
    qid = topics.read_text().split("\t", 1)[0]
    qrels.write_text("".join(f"{qid} 0 {docid} 1\n" for docid in read_docids(copy)))
    assert main(["--index", str(copy), "--topics", str(topics), "--qrels", str(qrels), "--candidates", "20",
                 "--strategies", "top-k:1", "top-k:2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:2] == ["aligner", "top-p:0.02"]  # the index's default is the baseline
    assert "keeping aligner top-p:0.02: no candidate beats it" in out and "keeps default strategy top-p:0.02" in out
    assert (copy / "manifest.json").read_bytes() == before  # not rewritten: same setting, same generation


def read_docids(index: Path) -> list[str]:
    from pyserini_aligner.index.reader import StoredIndex

    return list(StoredIndex(index).docids)

# 4. one-line errors for bad flag values; Ctrl-C while indexing


@pytest.mark.parametrize("flag,value", [("--hits", "0"), ("--hits", "-1"), ("--threads", "0"), ("--batch-size", "0"),
                                        ("--query-prune", "1.5")])
def test_search_flag_values_are_checked_by_argparse(flag, value, capsys):
    from pyserini_aligner.search.__main__ import main

    assert main(["--index", "x", "--topics", "y", "--output", "z", flag, value]) == 2
    assert f"argument {flag}: expected" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--doc-prune", "0"), ("--doc-prune", "1.5"), ("--batch-size", "0")])
def test_index_flag_values_name_the_flag(flag, value, capsys):
    from pyserini_aligner.index.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--corpus", "c.jsonl", "--index", "i", flag, value])
    assert f"argument {flag}: expected" in capsys.readouterr().err


@pytest.mark.parametrize("stop, status, message", [(signal.SIGINT, 130, "interrupted"),
                                                    (signal.SIGTERM, 143, "terminated")])
def test_ctrl_c_while_indexing(beir, tmp_path, stop, status, message):
    """Ctrl-C or SIGTERM while a build encodes: one line, its exit status, nothing left (SIGTERM was exit status
    143 with no message and a hidden .NAME.building-* folder left until the next build)."""
    target = tmp_path / "idx"
    corpus = tmp_path.parent / f"{tmp_path.name}-long.jsonl"  # long enough to be still encoding when interrupted
    docs = [json.loads(line) for line in (beir / "corpus.jsonl").read_text().splitlines()]
    corpus.write_text("".join(json.dumps({"id": f"{d['_id']}-{i}", "contents": d["text"]}) + "\n"
                              for i in range(40) for d in docs))
    child = subprocess.Popen([sys.executable, "-m", "pyserini_aligner.index", "--corpus", str(corpus), "--index",
                              str(target), "--quiet", "--batch-size", "1"], cwd=REPO, stderr=subprocess.PIPE, text=True,
                             # as from a terminal: a job started in the background by a script inherits SIGINT ignored
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob(".idx.building-*")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.poll() is None, "the build ended before it could be interrupted"
    child.send_signal(stop)
    _, err = child.communicate(timeout=60)
    assert child.returncode == status
    assert err.strip().splitlines()[-1] == message and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_as_the_build_folder_is_made_leaves_nothing(beir, tmp_path):
    """A Ctrl-C that arrives between the creation of the build's temporary folder and the code that removes it on
    failure (a fault point there sends SIGINT) still leaves nothing behind."""
    child = subprocess.run([sys.executable, "-m", "pyserini_aligner.index", "--corpus", str(beir / "corpus.jsonl"),
                            "--index", str(tmp_path / "idx"), "--quiet"], cwd=REPO, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "PYSERINI_ALIGNER_FAULT": "work-folder-made:1:SIGINT"},
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), timeout=300)
    assert child.returncode == 130
    assert child.stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in child.stderr
    assert list(tmp_path.iterdir()) == []


# 5. clear errors for missing and mis-encoded inputs; beta names its flag


def test_missing_topics_file_is_named(tmp_path):
    from pyserini_aligner.data import load_topics

    for spec in (str(tmp_path / "topics.tsv"), "runs/topics.tsv", "./topics"):
        with pytest.raises(FileNotFoundError, match=f"topics file {spec} does not exist"):
            load_topics(spec)


def test_non_utf8_bytes_name_file_and_line(tmp_path):
    from pyserini_aligner.index.corpus import read_corpus
    from pyserini_aligner.textio import InputError
    from pyserini_aligner.data import load_topics, read_qrels

    (tmp_path / "topics.tsv").write_bytes(b"1\tfine\n2\tcaf\xe9\n")
    (tmp_path / "qrels.txt").write_bytes(b"1 0 d1 1\n1 0 d\xff 1\n")
    (tmp_path / "corpus.jsonl").write_bytes(b'{"id": "a", "contents": "x"}\n\n{"id": "b", "contents": "\xe9"}\n')
    with pytest.raises(InputError, match=r"topics\.tsv, line 2: not UTF-8"):
        load_topics(str(tmp_path / "topics.tsv"))
    with pytest.raises(InputError, match=r"qrels\.txt, line 2: not UTF-8"):
        read_qrels(str(tmp_path / "qrels.txt"))
    with pytest.raises(InputError, match=r"corpus\.jsonl, line 3: not UTF-8"):
        list(read_corpus(tmp_path / "corpus.jsonl"))


# 6. silent oddities


def test_topics_file_lines(tmp_path):
    from pyserini_aligner.textio import InputError
    from pyserini_aligner.data import load_topics

    path = tmp_path / "topics.tsv"
    path.write_text("1\tfirst\n2\tsecond\n\n1\tagain\n")
    with pytest.raises(InputError, match=r"topics\.tsv, line 4: query id '1' already given on line 1"):
        load_topics(str(path))
    path.write_text("1\tfirst\n2 no tab\n")
    with pytest.raises(InputError, match=r"topics\.tsv, line 2: expected 'qid<TAB>query text'"):
        load_topics(str(path))
    path.write_text("1\tquery text\textra column\n")  # as Pyserini's TSV reader: the second field only
    assert load_topics(str(path)) == {"1": "query text"}


def test_query_ids_with_white_space_are_refused(index, beir, tmp_path, capsys):
    import shutil

    from pyserini_aligner.data import load_topics
    from pyserini_aligner.search.__main__ import main as search
    from pyserini_aligner.textio import InputError
    from pyserini_aligner.trec import write_run

    message = "query id 'q 1' must be a non-empty string without spaces, tabs or line breaks"
    tsv, jsonl = tmp_path / "topics.tsv", tmp_path / "topics.jsonl"
    tsv.write_text("q0\tvitamin D\nq 1\tcancer cells\n")
    jsonl.write_text('{"_id": "q0", "text": "vitamin D"}\n{"_id": "q 1", "text": "cancer cells"}\n')
    folder = Path(shutil.copytree(beir, tmp_path / "beir"))
    first = json.loads((folder / "queries.jsonl").read_text().splitlines()[0])["_id"]
    for name in ("queries.jsonl", "qrels/test.tsv"):
        (folder / name).write_text((folder / name).read_text().replace(first, "q 1"))
    for spec, where in ((tsv, f"{tsv}, line 2"), (jsonl, f"{jsonl}, line 2"),
                        (folder, f"{folder / 'queries.jsonl'}, line 1")):
        with pytest.raises(InputError, match=re.escape(f"{where}: {message}")):
            load_topics(str(spec))

    output = stale_run(tmp_path)  # each CLI: one line naming the file and line, no run
    assert search(["--index", str(index), "--topics", str(tsv), "--output", str(output)]) == 1  # as Pyserini's CLI
    assert f"{tsv}, line 2: {message}" in capsys.readouterr().err and not output.exists()
    output = stale_run(tmp_path)
    assert run_module("pyserini.search.faiss", "--index", str(index), "--encoder", "aligner", "--topics", str(tsv),
                      "--output", str(output)) == 1
    err = capsys.readouterr().err
    assert f"{tsv}, line 2: {message}" in err and "Traceback" not in err
    assert not output.exists() and leftovers(tmp_path) == []

    for qid, docid in (("q 1", "d1"), ("q1", "d\t1")):  # the run writer's last guard: nothing written
        with pytest.raises(ValueError, match="without spaces, tabs or line breaks"):
            write_run({"q0": [("d0", 2.0)], qid: [(docid, 1.0)]}, tmp_path / "guard.trec", tag="t")
        assert not (tmp_path / "guard.trec").exists() and leftovers(tmp_path) == []


def test_reranker_k_must_be_none_or_positive(index):
    from pyserini_aligner.search import AlignmentReranker

    reranker = AlignmentReranker(index)
    docids = reranker.store.docids[:3]
    assert len(reranker.rerank("vitamin D", docids, k=None)) == 3
    for k in (-1, 0):
        with pytest.raises(ValueError, match="k must be None or an integer >= 1"):
            reranker.rerank("vitamin D", docids, k=k)


def test_explain_page_says_the_query_was_cut(index, beir):
    from pyserini_aligner.explain import explain, render_html

    short, = explain(index, "vitamin D deficiency", docids=[_first_docid(index)])
    long_query = " ".join(["vitamin D deficiency and bone density in older adults"] * 20)
    cut, = explain(index, long_query, docids=[_first_docid(index)])
    assert not short.query_truncated and cut.query_truncated
    assert "query was truncated" in render_html([cut]) and "query was truncated" not in render_html([short])


def _first_docid(index: Path) -> str:
    from pyserini_aligner.index import StoredIndex

    return StoredIndex(index).docids[0]


# 7. a BEIR folder wherever a dataset id works


def test_beir_folder_as_corpus_topics_and_qrels(index, beir, tmp_path, capsys):
    from pyserini_aligner.adapt.__main__ import main as adapt
    from pyserini_aligner.search.__main__ import main as search

    assert read_manifest(index).num_docs == N_DOCS
    output = tmp_path / "run.trec"
    assert search(["--index", str(index), "--topics", str(beir), "--output", str(output), "--hits", "2",
                   "--quiet"]) == 0
    assert len({line.split()[0] for line in output.read_text().splitlines()}) == 3
    assert adapt(["--index", str(index), "--topics", str(beir), "--qrels", str(beir), "--candidates", "20",
                  "--strategies", "top-k:1", "top-k:2", "--dry-run", "--quiet"]) == 0
    assert "(3 queries)" in capsys.readouterr().out


# 8. a full Java heap ends the process with a clear message instead of hanging


def test_java_out_of_memory_exits_with_a_message():
    started = time.perf_counter()
    result = run("-c", "from pyserini.pyclass import autoclass; autoclass('java.util.BitSet')(2**31 - 1); "
                       "print('survived')", env={"PYSERINI_ALIGNER_JVM_HEAP": "32m"}, timeout=60)
    assert result.returncode == 3 and "survived" not in result.stdout
    assert "error: the Java heap of Pyserini is full at 32m" in result.stderr
    assert time.perf_counter() - started < 30


def test_heap_options():
    from pyserini_aligner.jvm import memory_options

    assert memory_options([], available=8 << 30)[0] == "-Xmx4096m"
    assert memory_options([], heap="2g", available=8 << 30)[0] == "-Xmx2g"
    kept = memory_options(["-Xmx1g", "-XX:+CrashOnOutOfMemoryError"], heap="2g", available=8 << 30)
    assert kept == []
    with pytest.raises(ValueError, match="PYSERINI_ALIGNER_JVM_HEAP='lots'"):
        memory_options([], heap="lots")

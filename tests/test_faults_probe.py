"""Fault probes of a fresh install, each through the real command line or Python entry a user reaches: hit counts
beyond the index, ports, misplaced and misspelt indexes, Pyserini flags that mean nothing for AligneR, duplicate
query ids, SIGTERM during a build, tiny and punctuation-only corpora, one-query adaptation. Each gives its result
or one line, the right exit status, and leaves no stale or partial file.
"""
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from pyserini_aligner.trec import read_run

from conftest import messages, one_line_error, run, run_module, scifact_docs, stale_run

REPO = Path(__file__).resolve().parents[1]
N_DOCS = 30
HUGE = "1000000000"
QUERIES = {"q1": "vitamin D deficiency and bone density", "q2": "stem cells in the bone marrow"}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """A 30-document SciFact index (the defaults: codec auto) built by the command line from a corpus that also
    holds a punctuation-only document, and the build's stderr."""
    folder = tmp_path_factory.mktemp("faults_probe")
    corpus = folder / "corpus.jsonl"
    docs = scifact_docs(N_DOCS, 48)
    docs.insert(5, {"id": "dots", "contents": "..."})
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    result = run("-m", "pyserini_aligner.index", "--corpus", corpus, "--index", folder / "idx")
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "idx", result.stderr


@pytest.fixture(scope="module")
def index(built) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def topics(index) -> Path:
    path = index.parent / "topics.tsv"
    path.write_text("".join(f"{qid}\t{text}\n" for qid, text in QUERIES.items()))
    return path


def test_a_tiny_corpus_with_codec_auto_is_warned_and_punctuation_only_documents_are_skipped(built):
    index, stderr = built
    assert re.search(r"the corpus has only \d+ tokens: codec IVF\d+,PQ4.* --codec fp16 stores exact vectors for "
                     r"[0-9.]+ MB", stderr), stderr[-3000:]
    assert "skipped 1 document(s) with no text (no letter or digit: empty, white space, punctuation or invisible " \
           "characters only), not indexed: dots" in stderr
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(index)
    assert searcher.num_docs == N_DOCS and "dots" not in searcher.docids
    assert searcher.search("...", k=5) == [] and searcher.search("?!", k=5) == []  # no words: no hits


def test_a_huge_k_is_capped_at_the_live_documents(index, topics, tmp_path, capsys):
    """k = 10⁹ asked 164 GiB of the search's buffers (a MemoryError traceback); every entry now gets every live
    document, ranked as a search for exactly that many. The command lines run in this process (python -m)."""
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(index)
    everything = searcher.search(QUERIES["q1"], k=10 ** 9)
    assert [(h.docid, h.score) for h in everything] == [(h.docid, h.score)
                                                       for h in searcher.search(QUERIES["q1"], k=N_DOCS)]
    assert 10 < len(everything) <= N_DOCS  # the candidates found: at most every document
    want = dict(zip(QUERIES, searcher.rank(list(QUERIES.values()), k=N_DOCS)))
    assert searcher.rank(list(QUERIES.values()), k=10 ** 9) == list(want.values())

    assert run_module("pyserini_aligner.search", "--index", index, "--topics", topics, "--output",
                      tmp_path / "plugin.trec", "--hits", HUGE, "--quiet") == 0
    ranked = read_run(tmp_path / "plugin.trec")
    assert sorted(ranked) == sorted(QUERIES)
    for qid, hits in want.items():
        assert list(ranked[qid]) == [docid for docid, _ in hits]

    # Pyserini's faiss CLI, here without --encoder: the index's own model encodes the queries
    capsys.readouterr()
    assert run_module("pyserini.search.faiss", "--index", index, "--topics", topics, "--output",
                      tmp_path / "faiss.trec", "--hits", HUGE) == 0
    assert f"pyserini-aligner: --encoder aligner, the model index {index} was built with" in capsys.readouterr().err
    via_pyserini = read_run(tmp_path / "faiss.trec")
    for qid in QUERIES:
        assert list(via_pyserini[qid]) == list(ranked[qid])
        assert via_pyserini[qid] == pytest.approx(ranked[qid], abs=1e-4)


def test_a_huge_k_through_pyserini_hybrid(index, topics, tmp_path):
    """The command line runs in this process (python -m)."""
    from pyserini_aligner.bm25 import build_lucene_index
    from pyserini_aligner.data import Doc

    docs = [Doc(d["id"], "", d["contents"]) for d in scifact_docs(N_DOCS, 48)]
    lucene = build_lucene_index(docs, tmp_path / "lucene")
    assert run_module("pyserini.search.hybrid", "dense", "--index", index, "--encoder", "aligner", "sparse",
                      "--index", lucene, "fusion", "--alpha", "0.1", "run", "--topics", topics, "--output",
                      tmp_path / "hybrid.trec", "--hits", HUGE) == 0
    fused = read_run(tmp_path / "hybrid.trec")
    assert sorted(fused) == sorted(QUERIES) and all(10 < len(hits) <= N_DOCS for hits in fused.values())


def test_pyserini_faiss_flags_that_do_not_apply_to_aligner(index, topics, tmp_path, capsys):
    """--encoded-queries is refused (an AligneR index needs the query text); --query-prefix, --pooling, --l2-norm
    and --tokenizer are named in one warning line and change nothing (those two searches run in this process)."""
    refused = run("-m", "pyserini.search.faiss", "--index", index, "--encoded-queries", tmp_path, "--topics", topics,
                  "--output", stale_run(tmp_path))
    one_line_error(refused, 2, "--encoded-queries: an AligneR index is searched with one vector per query token")
    assert list(tmp_path.iterdir()) == []

    plain, flagged = tmp_path / "plain.trec", tmp_path / "flagged.trec"
    assert run_module("pyserini.search.faiss", "--index", index, "--encoder", "aligner", "--topics", topics,
                      "--output", plain) == 0
    capsys.readouterr()
    assert run_module("pyserini.search.faiss", "--index", index, "--encoder", "aligner", "--topics", topics,
                      "--output", flagged, "--query-prefix", "query: ", "--pooling", "mean", "--l2-norm") == 0
    warnings = [line for line in messages(capsys.readouterr().err) if line.startswith("warning:")]
    assert warnings == ["warning: ignoring flags that do not apply to the AligneR encoder: --query-prefix 'query: ' "
                        "--pooling mean --l2-norm"]
    assert read_run(flagged) == read_run(plain)


def test_misspelt_index_without_encoder_fails_without_stale_run(index, topics, tmp_path):
    """No --encoder and a misspelt --index: was Pyserini's "No encoded queries" traceback, the old run kept."""
    output = stale_run(tmp_path)
    result = run("-m", "pyserini.search.faiss", "--index", index.parent / "idz", "--topics", topics, "--output",
                 output)
    one_line_error(result, 2, f"--index {index.parent / 'idz'}: no such folder")
    assert list(tmp_path.iterdir()) == []


def test_faiss_searcher_with_a_misspelt_folder_fails_at_once(index):
    """Was 24 s of retries against the Hugging Face hub, then an OSError about huggingface.co."""
    from pyserini.search.faiss import FaissSearcher

    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"index_dir '{re.escape(str(index.parent / 'idz'))}': no such folder"):
        FaissSearcher(str(index.parent / "idz"), "aligner")
    assert time.monotonic() - started < 5


def test_duplicate_query_ids_are_refused(index, tmp_path):
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(index)
    with pytest.raises(ValueError, match=r"q_ids: 'q1' is given twice \(positions 0 and 2\)"):
        searcher.batch_search([QUERIES["q1"], QUERIES["q2"], "bone"], ["q1", "q2", "q1"])
    twice = tmp_path / "twice.tsv"
    twice.write_text(f"q1\t{QUERIES['q1']}\nq2\t{QUERIES['q2']}\nq1\tbone\n")
    output = stale_run(tmp_path)
    result = run("-m", "pyserini.search.faiss", "--index", index, "--encoder", "aligner", "--topics", twice,
                 "--output", output)
    one_line_error(result, 1, f"{twice}, line 3: query id 'q1' already given on line 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["twice.tsv"]


def test_serve_ports_ready_line_hit_cap_and_bm25_checks(index, tmp_path):
    """A port out of range is an argparse error; --port 0 listens on a free port named in the ready line; hits
    beyond the index give every document (as the command lines); a --bm25 that is no Lucene index is one line."""
    bad = run("-m", "pyserini_aligner.serve", "--rest", "--port", "99999", "--index", f"sci={index}")
    one_line_error(bad, 2, "argument --port: expected a port number from 0 to 65535, got '99999'")
    for path, reason in ((index, f"--bm25 sci={index} is an AligneR index; give it as the dense index (--index "
                                 f"sci={index})"),
                         (index.parent, f"--bm25 sci={index.parent} is not a Lucene index")):
        wrong = run("-m", "pyserini_aligner.serve", "--rest", "--index", f"sci={index}", "--bm25", f"sci={path}")
        one_line_error(wrong, 2, reason)
        assert "IndexNotFoundException" not in wrong.stderr

    server = subprocess.Popen([sys.executable, "-m", "pyserini_aligner.serve", "--rest", "--port", "0", "--index",
                               f"sci={index}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    timer = threading.Timer(600, server.kill)  # a server that never gets ready ends the read below
    timer.start()
    try:
        for line in server.stderr:
            lines.append(line)
            if "serving REST on" in line:
                break
        ready = re.search(r"^INFO pyserini_aligner.serve: serving REST on http://127\.0\.0\.1:(\d+)$",
                          lines[-1].strip() if lines else "")
        assert ready and int(ready.group(1)) > 0, "".join(lines)[-3000:]
        answer = requests.post(f"http://127.0.0.1:{ready.group(1)}/v1/indexes/sci/search",
                               json={"query": QUERIES["q1"], "hits": 10 ** 9}, timeout=120)
        assert answer.status_code == 200, answer.text
        from pyserini_aligner.search import AlignerSearcher

        want = [hit.docid for hit in AlignerSearcher(index).search(QUERIES["q1"], k=N_DOCS)]
        assert [hit["docid"] for hit in answer.json()["candidates"]] == want
    finally:
        timer.cancel()
        server.terminate()
        server.communicate(timeout=60)


def test_an_index_path_that_cannot_be_created_is_named_as_given(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in scifact_docs(4, 16)))
    result = run("-m", "pyserini_aligner.index", "--corpus", corpus, "--index", "/proc/idx", "--quiet")
    line = one_line_error(result, 1, "index path /proc/idx: can't create a folder in /proc (")
    assert "building" not in line


def test_adapt_on_one_query_prints_no_infinite_t(index, tmp_path, capsys):
    """The command line runs in this process (python -m)."""
    topic = tmp_path / "one.tsv"
    topic.write_text(f"q1\t{QUERIES['q1']}\n")
    from pyserini_aligner.search import AlignerSearcher

    judged = AlignerSearcher(index).search(QUERIES["q1"], k=5)[4].docid  # among the candidates, not the first
    qrels = tmp_path / "qrels.txt"
    qrels.write_text(f"q1 0 {judged} 1\n")
    capsys.readouterr()
    assert run_module("pyserini_aligner.adapt", "--index", index, "--topics", topic, "--qrels", qrels,
                      "--checkpoints", "aligner", "--strategies", "top-k:1", "top-k:4", "--dry-run") == 0
    stdout = capsys.readouterr().out
    assert not re.search(r"[+-]inf\b", stdout), stdout
    rows = [line for line in stdout.splitlines() if line.startswith("aligner ") and "<- current" not in line]
    assert rows and all(row.split()[4] == "n/a" for row in rows), stdout  # the t column
    verdict = next(line for line in stdout.splitlines() if line.startswith(("keeping", "replacing")))
    assert "t = n/a: one query gives no test" in verdict or verdict.endswith("no candidate beats it"), verdict

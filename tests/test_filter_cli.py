"""Filtered search from the command lines: ``python -m pyserini_aligner.search --filter EXPR|@FILE [--filter-field
FIELD]`` writes only matching documents, ranked as the Python API ranks them; a malformed filter or one naming a
field the index does not store exits 2 with one line naming it; a filter matching nothing writes a run without hits
(exit 0, one warning line). Pyserini's FAISS and hybrid command lines take the same flags: the hybrid restricts its
BM25 side with Lucene's own filtering, and both sides, and their fusion, hold only matching documents."""
import contextlib
import io
from pathlib import Path

import pytest

from conftest import FIELDED_DOCS, JOURNALS, assert_same_ranking, fielded_records, messages, run_module
from pyserini_aligner.search import __main__ as search_cli
from pyserini_aligner.trec import read_run

QUERIES = {"q1": "vitamin D deficiency and bone density", "q2": "stem cells in the bone marrow",
           "q3": "antibiotic resistance of bacteria"}
PREDICATE = "year >= 2005 AND kind = 'even'"
HITS = 5


def matching(predicate) -> set[str]:
    """The docids of the fielded corpus that ``predicate`` (a function of a record) holds for."""
    return {r["id"] for r in fielded_records() if predicate(r)}


BY_PREDICATE = matching(lambda r: r["year"] >= 2005 and r["kind"] == "even")


@pytest.fixture(scope="module")
def topics(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("filter_cli") / "topics.tsv"
    path.write_text("".join(f"{qid}\t{text}\n" for qid, text in QUERIES.items()))
    return path


@pytest.fixture(scope="module")
def searcher(fielded_index):
    from pyserini_aligner.search import AlignerSearcher

    return AlignerSearcher(fielded_index)


def api_run(searcher, flt, k: int = HITS) -> dict[str, list[tuple[str, float]]]:
    """The rankings that the Python API gives the topics with filter ``flt``."""
    return dict(zip(QUERIES, searcher.rank(list(QUERIES.values()), k=k, filter=flt)))


def assert_run_equals(path: Path, expected: dict[str, list[tuple[str, float]]], allowed: set[str]) -> None:
    """The run at ``path`` holds only ``allowed`` docids and ranks each query as ``expected``."""
    run = read_run(path)
    assert {docid for hits in run.values() for docid in hits} <= allowed
    assert list(run) == [qid for qid, hits in expected.items() if hits]
    for qid, hits in expected.items():
        if hits:
            assert_same_ranking(list(run[qid].items()), hits, atol=2e-6)


def search(*args) -> tuple[int, str]:
    """``python -m pyserini_aligner.search ARGS`` in this process: (exit status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = search_cli.main([*map(str, args), "--quiet"])
    return status, err.getvalue()


def test_cli_filter_by_predicate_and_by_file(fielded_index, searcher, topics, tmp_path):
    from pyserini_aligner.filters import Filter

    common = ["--index", fielded_index, "--topics", topics, "--hits", HITS]
    status, err = search(*common, "--output", tmp_path / "where.trec", "--filter", PREDICATE)
    assert status == 0, err
    assert_run_equals(tmp_path / "where.trec", api_run(searcher, Filter.where(PREDICATE)), BY_PREDICATE)

    docids = sorted(BY_PREDICATE)[:7]
    listed = tmp_path / "docids.txt"
    listed.write_text("\n".join(docids) + "\n\n")
    status, err = search(*common, "--output", tmp_path / "ids.trec", "--filter", f"@{listed}")
    assert status == 0, err
    assert_run_equals(tmp_path / "ids.trec", api_run(searcher, Filter.docids(docids)), set(docids))
    assert_run_equals(tmp_path / "ids.trec", api_run(searcher, docids), set(docids))  # a plain list of docids

    journals = tmp_path / "journals.txt"
    journals.write_text(f"{JOURNALS[0]}\n{JOURNALS[2]}\n")
    status, err = search(*common, "--output", tmp_path / "field.trec", "--filter", f"@{journals}", "--filter-field",
                         "journal")
    assert status == 0, err
    allowed = matching(lambda r: r.get("journal") in (JOURNALS[0], JOURNALS[2]))
    assert_run_equals(tmp_path / "field.trec", api_run(searcher, Filter.values("journal", JOURNALS[::2])), allowed)
    assert len(allowed) < FIELDED_DOCS


@pytest.mark.parametrize("flags, named", [
    (["--filter", "year >= 2005 ORR kind = 'even'"], "ORR"),
    (["--filter", "year >= "], "year >="),
    (["--filter", "kind = 'even"], "'even"),
    (["--filter", "@missing-values.txt"], "missing-values.txt"),
    (["--filter-field", "journal"], "--filter-field"),
    (["--filter", "year > 2000", "--filter-field", "journal"], "--filter-field"),
], ids=["unknown-keyword", "missing-value", "open-quote", "missing-file", "field-alone", "field-with-predicate"])
def test_a_malformed_filter_exits_2_naming_the_token(fielded_index, topics, tmp_path, flags, named):
    status, err = search("--index", fielded_index, "--topics", topics, "--output", tmp_path / "run.trec", *flags)
    errors = [line for line in messages(err) if "error:" in line]
    assert status == 2 and len(errors) == 1 and named in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "run.trec").exists()


def test_an_unknown_field_exits_2_naming_it(fielded_index, index_dir, topics, tmp_path):
    stale = tmp_path / "run.trec"
    stale.write_text("q1 Q0 stale 1 1.0 OLD\n")
    status, err = search("--index", fielded_index, "--topics", topics, "--output", stale, "--filter",
                         "colour = 'red'")
    errors = [line for line in messages(err) if line.startswith("error:")]
    assert status == 2 and len(errors) == 1 and "'colour'" in errors[0] and "year" in errors[0], err
    assert not stale.exists()  # an earlier run is not taken for this one's
    status, err = search("--index", index_dir, "--topics", topics, "--output", stale, "--filter", "year > 2000")
    assert status == 2 and "'year'" in err and "Traceback" not in err  # an index that stores no fields


def test_a_filter_matching_nothing_writes_a_run_without_hits(fielded_index, topics, tmp_path):
    output = tmp_path / "run.trec"
    status, err = search("--index", fielded_index, "--topics", topics, "--output", output, "--filter",
                         "year > 3000")
    warnings = [line for line in messages(err) if line.startswith("warning:")]
    assert status == 0 and len(warnings) == 1 and "matches no document" in warnings[0], err
    assert output.is_file() and read_run(output) == {}


def test_unknown_flags_stay_errors(fielded_index, topics, tmp_path):
    status, err = search("--index", fielded_index, "--topics", topics, "--output", tmp_path / "run.trec",
                         "--filtre", "year > 2000")
    assert status == 2 and "unrecognized arguments: --filtre" in err


def test_pyserini_faiss_cli_filters(fielded_index, searcher, topics, tmp_path):
    from pyserini_aligner.filters import Filter

    for batch in ("1", "2"):  # one query at a time (search) and in batches (batch_search)
        output = tmp_path / f"run{batch}.trec"
        assert run_module("pyserini.search.faiss", "--index", fielded_index, "--encoder", "aligner", "--topics",
                          topics, "--output", output, "--hits", HITS, "--batch-size", batch,
                          "--filter", PREDICATE) == 0
        assert_run_equals(output, api_run(searcher, Filter.where(PREDICATE)), BY_PREDICATE)


def test_pyserini_faiss_cli_refuses_a_bad_filter(fielded_index, topics, tmp_path, capsys):
    args = ["pyserini.search.faiss", "--index", fielded_index, "--encoder", "aligner", "--topics", topics,
            "--output", tmp_path / "run.trec"]
    assert run_module(*args, "--filter", "year >= 2005 ORR kind = 'even'") == 2
    assert run_module(*args, "--filter", "colour = 'red'") == 2
    assert run_module(*args, "--filter") == 2
    errors = [line for line in messages(capsys.readouterr().err) if line.startswith("error:")]
    assert len(errors) == 3 and "ORR" in errors[0] and "'colour'" in errors[1] and "--filter" in errors[2], errors
    assert not (tmp_path / "run.trec").exists()


def test_pyserini_hybrid_cli_filters_both_sides(fielded_index, fielded_lucene, searcher, topics, tmp_path):
    """The fused run is Pyserini's fusion of the filtered dense hits and the BM25 hits of the matching documents
    (Lucene's filtered scores equal its unfiltered ones)."""
    from pyserini.search.faiss import DenseSearchResult
    from pyserini.search.hybrid import HybridSearcher
    from pyserini.search.lucene import LuceneSearcher

    from pyserini_aligner.filters import Filter

    depth = 20
    output = tmp_path / "hybrid.trec"
    assert run_module("pyserini.search.hybrid", "dense", "--index", fielded_index, "--encoder", "aligner",
                      "sparse", "--index", fielded_lucene, "fusion", "--alpha", "0.1", "--hits", depth,
                      "run", "--topics", topics, "--output", output, "--hits", HITS, "--filter", PREDICATE) == 0
    bm25 = LuceneSearcher(str(fielded_lucene))
    expected, bm25_sides = {}, []
    for qid, text in QUERIES.items():
        dense = [DenseSearchResult(d, s) for d, s in searcher.rank([text], k=depth, filter=Filter.where(PREDICATE))[0]]
        sparse = [h for h in bm25.search(text, FIELDED_DOCS) if h.docid in BY_PREDICATE][:depth]
        assert dense and all(h.docid in BY_PREDICATE for h in dense)
        fused = HybridSearcher._hybrid_results(dense, sparse, 0.1, HITS)
        expected[qid] = [(h.docid, h.score) for h in fused]
        bm25_sides.append(len(sparse))
    assert any(bm25_sides)  # BM25 found matching documents for some query
    assert_run_equals(output, expected, BY_PREDICATE)
    unfiltered = tmp_path / "unfiltered.trec"
    assert run_module("pyserini.search.hybrid", "dense", "--index", fielded_index, "--encoder", "aligner",
                      "sparse", "--index", fielded_lucene, "fusion", "--alpha", "0.1", "--hits", depth,
                      "run", "--topics", topics, "--output", unfiltered, "--hits", HITS) == 0
    assert {d for hits in read_run(unfiltered).values() for d in hits} - BY_PREDICATE  # the filter took some out


def test_pyserini_lucene_cli_hands_the_filter_on(fielded_index, searcher, topics, tmp_path):
    from pyserini_aligner.filters import Filter

    output = tmp_path / "run.trec"
    assert run_module("pyserini.search.lucene", "--index", fielded_index, "--topics", topics, "--output", output,
                      "--hits", HITS, "--bm25", "--filter", PREDICATE) == 0
    assert_run_equals(output, api_run(searcher, Filter.where(PREDICATE)), BY_PREDICATE)


def test_pyserini_help_names_the_filter_flags_and_its_cache_follows_them(capsys):
    """The help is built in this process (the cached help of a child process: tests/test_startup.py)."""
    from pyserini_aligner.pyserini_patches import filtered, help_cache

    assert Path(filtered.__file__).resolve() in help_cache._sources("pyserini.search.faiss")
    assert run_module("pyserini.search.hybrid", "--help") == 0
    shown = capsys.readouterr()
    assert shown.out.startswith("usage:") and filtered.HELP_NOTE in " ".join(shown.out.split()), shown.err[-2000:]

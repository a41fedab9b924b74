"""Filtered search through the servers: a REST search request (Pyserini's route) and MCP's ``search`` tool take a
filter (``filter``: a predicate; ``docids``: a list; ``filter_field`` with ``values``), which restricts the AligneR
index, its BM25 pair and their hybrid alike; answers equal the Python API's; a malformed filter, or one naming a
field the index does not store, is a 400 (a tool error over MCP) with its one-line message and the server keeps
serving; concurrent queries with different filters are batched by filter, each answered as alone."""
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import JOURNALS, assert_same_ranking, fielded_records
from test_serve import free_port, mcp_call, recording_batch_search, scifact_queries

PREDICATE = "year >= 2005 AND kind = 'even'"
HITS = 5


def matching(predicate) -> set[str]:
    return {r["id"] for r in fielded_records() if predicate(r)}


BY_PREDICATE = matching(lambda r: r["year"] >= 2005 and r["kind"] == "even")


def wait_listening(process: subprocess.Popen, url: str, log) -> None:
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{url}: not listening"
        try:
            requests.get(url, timeout=2)
            return
        except (requests.ConnectionError, requests.Timeout):
            time.sleep(0.5)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, fielded_index, fielded_lucene):
    """A REST and an MCP server (python -m pyserini_aligner.serve) serving the fielded index as "f" with its BM25
    pair."""
    root = tmp_path_factory.mktemp("filter_serve")
    (root / "not-a-folder").write_text("")
    env = dict(os.environ, PYSERINI_CACHE=str(root / "not-a-folder"), OMP_NUM_THREADS="1")
    env.pop("OPENAI_API_KEY", None)
    rest_port, mcp_port = free_port(), free_port()
    common = ["--index", f"f={fielded_index}", "--bm25", f"f={fielded_lucene}", "--batch-wait-ms", "50"]
    started = [
        (subprocess.Popen([sys.executable, "-m", "pyserini_aligner.serve", "--rest", "--port", str(rest_port), *common],
                          env=env, stdout=subprocess.DEVNULL, stderr=open(root / "rest.log", "w")),
         f"http://127.0.0.1:{rest_port}/", root / "rest.log"),
        (subprocess.Popen([sys.executable, "-m", "pyserini_aligner.serve", "--mcp", "--transport", "http", "--port",
                           str(mcp_port), *common], env=env, stdout=subprocess.DEVNULL,
                          stderr=open(root / "mcp.log", "w")),
         f"http://127.0.0.1:{mcp_port}/mcp", root / "mcp.log")]
    try:
        for process, url, log in started:
            wait_listening(process, url, log)
        yield {"rest": f"http://127.0.0.1:{rest_port}/v1/indexes", "mcp": f"http://127.0.0.1:{mcp_port}/mcp"}
    finally:
        for process, _, _ in started:
            process.terminate()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def searcher(fielded_index):
    from pyserini_aligner.search import AlignerSearcher

    return AlignerSearcher(fielded_index)


def rest(base: str, index: str, body: dict) -> requests.Response:
    return requests.post(f"{base}/{index}/search", json={"hits": HITS, **body}, timeout=120)


def hits_of(answer: requests.Response) -> list[tuple[str, float]]:
    assert answer.status_code == 200, answer.text
    return [(c["docid"], c["score"]) for c in answer.json()["candidates"]]


def test_rest_filters_the_index_its_bm25_pair_and_their_hybrid(servers, searcher, fielded_lucene):
    from pyserini.search.lucene import LuceneSearcher

    from pyserini_aligner.filters import Filter

    query = scifact_queries(1)[0]
    docids = sorted(BY_PREDICATE)[:6]
    by_journal = matching(lambda r: r.get("journal") == JOURNALS[1])
    cases = [({"filter": PREDICATE}, Filter.where(PREDICATE), BY_PREDICATE),
             ({"docids": docids}, Filter.docids(docids), set(docids)),
             ({"filter_field": "journal", "values": [JOURNALS[1]]}, Filter.values("journal", [JOURNALS[1]]),
              by_journal)]
    bm25 = LuceneSearcher(str(fielded_lucene))
    for body, flt, allowed in cases:
        expected = searcher.rank([query], k=HITS, filter=flt)[0]
        assert_same_ranking(hits_of(rest(servers["rest"], "f", {"query": query, **body})), expected, atol=1e-6,
                            rtol=1e-5)
        in_query = {"query": {"query_txt": query, **body}}  # the filter inside the query object, as MCP passes it
        assert_same_ranking(hits_of(rest(servers["rest"], "f", in_query)), expected, atol=1e-6, rtol=1e-5)
        sparse = hits_of(rest(servers["rest"], "f.bm25", {"query": query, **body}))
        assert sparse == [(h.docid, pytest.approx(h.score)) for h in bm25.search(query, 100)
                          if h.docid in allowed][:HITS]
        hybrid = hits_of(rest(servers["rest"], "f.hybrid", {"query": query, **body}))
        assert hybrid and {docid for docid, _ in hybrid} <= allowed
    unfiltered = hits_of(rest(servers["rest"], "f.hybrid", {"query": query, "hits": 20}))
    assert {docid for docid, _ in unfiltered} - BY_PREDICATE
    nothing = rest(servers["rest"], "f", {"query": query, "filter": "year > 3000"})
    assert hits_of(nothing) == []


BAD_FILTERS = [
    ({"filter": "year >= 2005 ORR kind = 'even'"}, "ORR"),
    ({"filter": "colour = 'red'"}, "'colour'"),
    ({"filter": 2005}, "filter must be a string"),
    ({"docids": "d1"}, "docids must be a list"),
    ({"filter_field": "journal"}, "filter_field goes with values"),
    ({"filter": PREDICATE, "docids": ["d1"]}, "a filter is one of"),
]


@pytest.mark.parametrize("body, message", BAD_FILTERS, ids=[m for _, m in BAD_FILTERS])
def test_rest_refuses_a_bad_filter_with_400(servers, body, message):
    for index in ("f", "f.bm25", "f.hybrid"):
        answer = rest(servers["rest"], index, {"query": "cells", **body})
        assert answer.status_code == 400 and message in answer.json()["detail"], answer.text
        assert "\n" not in answer.json()["detail"] and "Traceback" not in answer.text
    prebuilt = rest(servers["rest"], "beir-v1.0.0-scifact.flat", {"query": "cells", "filter": PREDICATE})
    assert prebuilt.status_code == 400 and "AligneR indexes served here" in prebuilt.json()["detail"]
    assert hits_of(rest(servers["rest"], "f", {"query": "cells"}))  # still serving


def test_rest_concurrent_queries_with_different_filters_are_answered_as_alone(servers, searcher):
    from pyserini_aligner.filters import Filter

    queries = scifact_queries(6)
    filters = [PREDICATE, "kind = 'odd'", None]
    asked = [(query, filters[i % 3]) for i, query in enumerate(queries)]

    def one(pair):
        query, text = pair
        return hits_of(rest(servers["rest"], "f", {"query": query, **({"filter": text} if text else {})}))

    with ThreadPoolExecutor(len(asked)) as pool:
        got = list(pool.map(one, asked))
    for answer, (query, text) in zip(got, asked):
        flt = Filter.where(text) if text else None
        assert_same_ranking(answer, searcher.rank([query], k=HITS, filter=flt)[0], atol=1e-6, rtol=1e-5)


def test_mcp_search_takes_a_filter_and_refuses_a_bad_one(servers, searcher):
    from pyserini_aligner.filters import Filter

    query = scifact_queries(1)[0]
    found, hybrid, bad, unknown = mcp_call(servers["mcp"], [
        ("search", {"query": {"query_txt": query, "filter": PREDICATE}, "index_name": "f", "k": HITS}),
        ("search", {"query": {"query_txt": query, "filter": PREDICATE}, "index_name": "f.hybrid", "k": HITS}),
        ("search", {"query": {"query_txt": query, "filter": "year >= 2005 ORR kind = 'even'"}, "index_name": "f"}),
        ("search", {"query": {"query_txt": query, "filter": "colour = 'red'"}, "index_name": "f"}),
    ])[1:]
    docids = [line.split(" | ")[0].removeprefix("DocID: ") for line in found if line.startswith("DocID: ")]
    assert docids == [docid for docid, _ in searcher.rank([query], k=HITS, filter=Filter.where(PREDICATE))[0]]
    fused = {line.split(" | ")[0].removeprefix("DocID: ") for line in hybrid if line.startswith("DocID: ")}
    assert fused and fused <= BY_PREDICATE
    assert isinstance(bad, Exception) and "ORR" in str(bad)
    assert isinstance(unknown, Exception) and "'colour'" in str(unknown)


def test_batcher_searches_each_filter_apart(fielded_index, searcher):
    """Queries gathered in one batch with different filters go to the search function in one call per filter (equal
    filters share one), and each gets the hits of its own filter."""
    from pyserini_aligner.filters import Filter
    from pyserini_aligner.serve.batching import QueryBatcher

    queries = scifact_queries(6)
    filters = [Filter.where(PREDICATE), Filter.where("kind = 'odd'"), None]
    asked = [(query, filters[i % 3]) for i, query in enumerate(queries)]
    alone = [[(h.docid, h.score) for h in searcher.search(q, k=4, filter=f)] for q, f in asked]
    search_batch, sizes = recording_batch_search(searcher)
    batcher = QueryBatcher(search_batch, wait_ms=300, max_batch=len(asked))
    start = threading.Barrier(len(asked))

    def one(pair):
        start.wait()
        query, flt = pair
        return batcher.search(query, 4, Filter.where(flt.text) if flt is not None else None)  # equal, not the same

    with ThreadPoolExecutor(len(asked)) as pool:
        got = list(pool.map(one, asked))
    batcher.close()
    assert sum(sizes) == len(asked) and max(sizes) == 2  # two queries a filter: never more in one call
    for answer, expected in zip(got, alone):
        assert_same_ranking([(h.docid, h.score) for h in answer], expected)

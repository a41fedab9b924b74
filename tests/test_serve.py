"""Pyserini's own REST and MCP servers serving AligneR indexes, started as child processes on free ports and spoken
to over real HTTP (requests) and a real MCP client (fastmcp.Client): results equal offline searches and Pyserini's
hybrid CLI, bad requests get their 4xx and the server keeps serving, an index updated on disk is served without a
restart; and the batcher gathers concurrent queries into batches whose answers equal single searches."""
import asyncio
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import requests
import pytest

from conftest import N_DOCS, run_module
from conftest import assert_same_ranking as same_ranking

QUERIES = 8
HITS = 10


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scifact_queries(n: int) -> list[str]:
    with zipfile.ZipFile(Path(os.environ["PYSERINI_ALIGNER_BEIR_DIR"]) / "scifact.zip") as archive:
        lines = archive.read("scifact/queries.jsonl").decode().splitlines()
    return [json.loads(line)["text"] for line in lines[:n]]


def offline(index, queries: list[str], k: int = HITS, **kwargs) -> list[list[tuple[str, float]]]:
    from pyserini_aligner.search import AlignerSearcher

    searcher = AlignerSearcher(index, **kwargs)
    return [[(hit.docid, hit.score) for hit in searcher.search(query, k=k)] for query in queries]


assert_same_ranking = partial(same_ranking, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_index, corpus_file):
    """A REST server (python -m pyserini_aligner.serve) and an MCP server (python -m pyserini.server.mcp, indexes
    from the environment), both serving the 200-document index as "sci" with its BM25 pair, and a copy as "live"."""
    from pyserini_aligner.bm25 import build_lucene_index
    from pyserini_aligner.data import Doc

    root = tmp_path_factory.mktemp("serve")
    live = root / "live"
    shutil.copytree(default_index, live)
    records = [json.loads(line) for line in corpus_file.read_text().splitlines()]
    build_lucene_index((Doc(r["id"], "", r["contents"]) for r in records), root / "lucene")
    qrels = root / "qrels.txt"
    qrels.write_text(f"q1 0 {records[0]['id']} 1\nq1 0 {records[1]['id']} 1\n")
    (root / "not-a-folder").write_text("")
    rest_port, mcp_port = free_port(), free_port()
    env = dict(os.environ, PYSERINI_CACHE=str(root / "not-a-folder"), OMP_NUM_THREADS="1")
    env.pop("OPENAI_API_KEY", None)
    rest = subprocess.Popen(
        [sys.executable, "-m", "pyserini_aligner.serve", "--rest", "--port", str(rest_port), "--index",
         f"sci={default_index}", "--index", f"live={live}", "--bm25", f"sci={root / 'lucene'}", "--reload-interval",
         "0.2", "--batch-wait-ms", "20"], env=env, stdout=subprocess.DEVNULL, stderr=open(root / "rest.log", "w"))
    mcp = subprocess.Popen(
        [sys.executable, "-m", "pyserini.server.mcp", "--transport", "http", "--port", str(mcp_port)],
        env={**env, "PYSERINI_ALIGNER_INDEXES": f"sci={default_index}", "PYSERINI_ALIGNER_BM25": f"sci={root / 'lucene'}",
             "PYSERINI_ALIGNER_QRELS": f"sci={qrels}"},
        stdout=subprocess.DEVNULL, stderr=open(root / "mcp.log", "w"))
    try:
        deadline = time.monotonic() + 240
        for process, url, log in ((rest, f"http://127.0.0.1:{rest_port}/", "rest.log"),
                                  (mcp, f"http://127.0.0.1:{mcp_port}/mcp", "mcp.log")):
            while True:
                assert process.poll() is None, (root / log).read_text()[-3000:]
                assert time.monotonic() < deadline, f"{log}: not listening"
                try:
                    requests.get(url, timeout=2)
                    break
                except (requests.ConnectionError, requests.Timeout):  # not yet listening, or not yet answering
                    time.sleep(0.5)
        yield {"rest": f"http://127.0.0.1:{rest_port}/v1/indexes", "mcp": f"http://127.0.0.1:{mcp_port}/mcp",
               "index": default_index, "live": live, "lucene": root / "lucene", "root": root, "records": records}
    finally:
        for process in (rest, mcp):
            process.terminate()
            process.wait(timeout=30)


def rest_search(base: str, index: str, query: str, hits: int = HITS) -> list[tuple[str, float]]:
    answer = requests.post(f"{base}/{index}/search", json={"query": query, "hits": hits}, timeout=120)
    assert answer.status_code == 200, answer.text
    return [(c["docid"], c["score"]) for c in answer.json()["candidates"]]


def test_rest_concurrent_searches_equal_offline_searches(served):
    queries = scifact_queries(QUERIES)
    with ThreadPoolExecutor(QUERIES) as pool:
        got = list(pool.map(lambda q: rest_search(served["rest"], "sci", q), queries))
    for answer, expected in zip(got, offline(served["index"], queries)):
        assert_same_ranking(answer, expected)
    first = requests.post(f"{served['rest']}/sci/search", json={"query": queries[0], "hits": 3}).json()
    lucene = {r["id"]: r["contents"] for r in served["records"]}
    assert [c["document_txt"] for c in first["candidates"]] == [lucene[c["docid"]] for c in first["candidates"]]
    status = requests.get(f"{served['rest']}/sci/status").json()
    assert status["documents"] == N_DOCS and status["type"] == "aligner" and status["batched_queries"] >= QUERIES
    assert "msmarco-v1-passage" in requests.get(f"{served['rest']}/", params={"index_type": "tf"}).json()
    prebuilt = requests.get(f"{served['rest']}/beir-v1.0.0-scifact.flat/status")  # Pyserini's own answer
    assert prebuilt.status_code == 200 and prebuilt.json()["downloaded"] is False


def test_rest_hybrid_equals_pyserini_hybrid_cli(served, tmp_path):
    queries = scifact_queries(4)
    topics = tmp_path / "topics.tsv"
    topics.write_text("".join(f"q{i}\t{q}\n" for i, q in enumerate(queries)))
    assert run_module("pyserini.search.hybrid", "dense", "--index", served["index"], "--encoder", "aligner",
                      "sparse", "--index", served["lucene"], "fusion", "--alpha", "0.1", "--hits", "100",
                      "run", "--topics", topics, "--output", tmp_path / "run.trec", "--hits", HITS) == 0
    cli: dict[str, list] = {}
    for line in (tmp_path / "run.trec").read_text().splitlines():
        qid, _, docid, _, score, _ = line.split()
        cli.setdefault(qid, []).append((docid, float(score)))
    settings = requests.get(f"{served['rest']}/sci.hybrid/settings").json()
    assert settings["hits"] == 100 and settings["alpha"] == 0.1 and settings["normalization"] is False
    for i, query in enumerate(queries):
        assert_same_ranking(rest_search(served["rest"], "sci.hybrid", query), cli[f"q{i}"])
    bm25 = rest_search(served["rest"], "sci.bm25", queries[0])
    from pyserini.search.lucene import LuceneSearcher

    assert bm25 == [(h.docid, pytest.approx(h.score)) for h in LuceneSearcher(str(served["lucene"])).search(
        queries[0], HITS)]


def test_rest_settings_change_the_strategy_and_depth(served):
    base, query = served["rest"], scifact_queries(1)[0]
    assert requests.post(f"{base}/sci/settings", json={"strategy": "top-k:2", "depth": 64}).status_code == 200
    try:
        settings = requests.get(f"{base}/sci/settings").json()
        assert settings["strategy"] == "top-k:2" and settings["depth"] == 64
        assert_same_ranking(rest_search(base, "sci", query),
                            offline(served["index"], [query], strategy="top-k:2", max_candidates=64)[0])
    finally:
        assert requests.post(f"{base}/sci/settings", json={"strategy": "top-k:1", "depth": 128}).status_code == 200
    assert_same_ranking(rest_search(base, "sci", query), offline(served["index"], [query])[0])


BAD_REQUESTS = [
    ("post", "nope/search", {"query": "cells"}, 404, "unknown index 'nope'"),
    ("post", "sci/search", {"query": " \u200b "}, 422, "query is empty"),
    ("post", "sci/search", {"query": "cell " * 20_000}, 422, "characters long"),
    ("post", "sci/search", {"query": "cells", "hits": 0}, 422, "hits must be an integer >= 1, got 0"),
    ("post", "sci/search", {"query": "cells", "hits": -5}, 422, "hits must be an integer >= 1, got -5"),
    ("post", "sci/search", '{"query": ', 422, "JSON decode error"),
    ("post", "sci/search", {"hits": 3}, 422, "Field required"),
    ("post", "sci/settings", {"strategy": "top-z:3"}, 422, "unknown strategy"),
    ("post", "sci/settings", {"depth": 0}, 422, "depth must be an integer >= 1"),
    ("post", "sci/settings", {"colour": "red"}, 422, "unknown setting 'colour'"),
    ("get", "sci/documents/no-such-doc", None, 404, "document no-such-doc not found in index sci"),
    ("get", "live/documents/4983", None, 404, "keeps no document texts"),
    ("get", "nope/status", None, 404, "unknown index 'nope'"),
    ("get", "nope/settings", None, 404, "unknown index 'nope'"),
    # a prebuilt index that cannot be fetched (the cache is not a folder): Pyserini's own failure, as a 500
    ("post", "beir-v1.0.0-scifact.flat/search", {"query": "cells"}, 500, "internal error"),
]


@pytest.mark.parametrize("method, path, body, status, message", BAD_REQUESTS, ids=[f"{r[1]}-{r[3]}-{r[4][:20]}"
                                                                                     for r in BAD_REQUESTS])
def test_rest_bad_request_is_refused_and_the_server_keeps_serving(served, method, path, body, status, message):
    url = f"{served['rest']}/{path}"
    if isinstance(body, str):
        answer = requests.post(url, data=body, headers={"content-type": "application/json"})
    else:
        answer = requests.request(method.upper(), url, json=body, timeout=120)
    assert answer.status_code == status, answer.text
    assert message in answer.text and "Traceback" not in answer.text
    detail = answer.json()["detail"]
    assert "\n" not in detail if isinstance(detail, str) else detail[0]["msg"]  # one line, or FastAPI's list
    assert rest_search(served["rest"], "sci", "cells", hits=3)


def test_rest_serves_an_added_document_without_restart(served, tmp_path):
    base = served["rest"]
    before = requests.get(f"{base}/live/status").json()
    text = "Zebrafish fins regenerate through dedifferentiation of osteoblasts after amputation."
    (tmp_path / "new.jsonl").write_text(json.dumps({"id": "new-1", "contents": text}) + "\n")
    assert run_module("pyserini_aligner.index", "--index", served["live"], "--add", tmp_path / "new.jsonl",
                      "--quiet") == 0
    deadline = time.monotonic() + 60
    while requests.get(f"{base}/live/status").json()["generation"] == before["generation"]:
        assert time.monotonic() < deadline, "the new generation was not picked up"
        time.sleep(0.2)
    status = requests.get(f"{base}/live/status").json()
    assert status["documents"] == before["documents"] + 1
    assert rest_search(base, "live", text, hits=1)[0][0] == "new-1"
    assert_same_ranking(rest_search(base, "live", text), offline(served["live"], [text])[0])


def test_rest_workers_share_one_search_process(default_index, tmp_path):
    """--workers 2: Pyserini's app in two HTTP worker processes answering as one server: searches equal offline
    searches, a setting posted to one worker is what both answer with, an --add on disk is served without a restart,
    and the search processes go with the server."""
    live = tmp_path / "live"
    shutil.copytree(default_index, live)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pyserini_aligner.serve", "--rest", "--port", str(port), "--index", f"live={live}",
         "--workers", "2", "--reload-interval", "0.2"], env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "rest.log", "w"))
    base = f"http://127.0.0.1:{port}/v1/indexes"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "rest.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not listening"
            try:
                requests.get(f"http://127.0.0.1:{port}/", timeout=2)
                break
            except (requests.ConnectionError, requests.Timeout):  # not yet listening, or not yet answering
                time.sleep(0.5)
        queries = scifact_queries(QUERIES)
        with ThreadPoolExecutor(QUERIES) as pool:
            got = list(pool.map(lambda q: rest_search(base, "live", q), queries))
        for answer, expected in zip(got, offline(live, queries)):
            assert_same_ranking(answer, expected)
        assert requests.post(f"{base}/live/settings", json={"strategy": "top-k:2", "depth": 64}).status_code == 200
        seen = [requests.get(f"{base}/live/settings").json() for _ in range(8)]
        assert {(answer["strategy"], answer["depth"]) for answer in seen} == {("top-k:2", 64)}
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda q: rest_search(base, "live", q), queries[:4]))
        for answer, expected in zip(got, offline(live, queries[:4], strategy="top-k:2", max_candidates=64)):
            assert_same_ranking(answer, expected)
        text = "Zebrafish fins regenerate through dedifferentiation of osteoblasts after amputation."
        (tmp_path / "new.jsonl").write_text(json.dumps({"id": "new-1", "contents": text}) + "\n")
        assert run_module("pyserini_aligner.index", "--index", live, "--add", tmp_path / "new.jsonl", "--quiet") == 0
        deadline = time.monotonic() + 60
        while requests.get(f"{base}/live/status").json()["documents"] != N_DOCS + 1:
            assert time.monotonic() < deadline, "the new generation was not picked up"
            time.sleep(0.2)
        assert {rest_search(base, "live", text, hits=1)[0][0] for _ in range(4)} == {"new-1"}
        searching = subprocess.run(["pgrep", "-P", str(server.pid), "-f", "search_process"], capture_output=True,
                                   text=True).stdout.split()
        assert len(searching) == 1  # one search process, shared by both workers
    finally:
        server.terminate()
        server.wait(timeout=60)
    time.sleep(1)
    for pid in searching:
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


def mcp_call(url: str, calls: list[tuple[str, dict]]) -> list:
    """The tool names, then each tool call's result (its structured data, else the JSON of its one text block: a
    list that Pyserini's tools return), or the ToolError it raised."""
    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    async def run():
        results = []
        async with Client(url, timeout=120) as client:
            names = {tool.name for tool in await client.list_tools()}
            results.append(names)
            for name, arguments in calls:
                try:
                    result = await client.call_tool(name, arguments)
                except ToolError as error:
                    results.append(error)
                    continue
                results.append(result.data if result.data is not None else json.loads(result.content[0].text))
        return results

    return asyncio.run(run())


def test_mcp_tools_serve_the_index(served):
    from pyserini.search.faiss import DenseSearchResult
    from pyserini.search.hybrid import HybridSearcher

    queries = scifact_queries(2)
    records = served["records"]
    hits1 = [{"docid": records[0]["id"], "score": 2.0}, {"docid": records[1]["id"], "score": 1.0}]
    hits2 = [{"docid": records[2]["id"], "score": 5.0}, {"docid": records[0]["id"], "score": 4.0}]
    judged = {records[0]["id"]: 3.0, records[5]["id"]: 2.0, records[1]["id"]: 1.0}
    names, found, by_path, hybrid, doc, listed, status, fused, ndcg, ndcg_hybrid, unknown, empty, again = mcp_call(
            served["mcp"], [
        ("search", {"query": {"query_txt": queries[0]}, "index_name": "sci", "k": 5}),
        ("search", {"query": {"query_txt": queries[0]}, "index_name": str(served["index"]), "k": 5}),
        ("search", {"query": {"query_txt": queries[1]}, "index_name": "sci.hybrid", "k": 5}),
        ("get_document", {"docid": records[3]["id"], "index_name": "sci"}),
        ("list_indexes", {"index_type": "aligner"}),
        ("get_index", {"index_name": "sci"}),
        ("fuse_search_results", {"hits1": hits1, "hits2": hits2, "k": 3}),
        ("eval_hits", {"index_name": "sci", "metric": "ndcg", "query_id": "q1", "hits": judged}),
        ("eval_hits", {"index_name": "sci.hybrid", "metric": "ndcg", "query_id": "q1", "hits": judged}),
        ("search", {"query": {"query_txt": "cells"}, "index_name": "nope"}),
        ("search", {"query": {"query_txt": "  "}, "index_name": "sci"}),
        ("search", {"query": {"query_txt": queries[0]}, "index_name": "sci", "k": 5}),
    ])
    assert {"search", "get_document", "list_indexes", "get_index", "fuse_search_results", "eval_hits"} <= names
    docids = [line.split(" | ")[0].removeprefix("DocID: ") for line in found if line.startswith("DocID: ")]
    assert docids == [docid for docid, _ in offline(served["index"], queries[:1], k=5)[0]]
    assert again == found
    assert [line for line in by_path if line.startswith("DocID: ")] == [  # an index folder named by its path
        line for line in found if line.startswith("DocID: ")]
    assert sum(line.startswith("DocID: ") for line in hybrid) == 5
    assert doc == [records[3]["contents"]]
    assert set(listed) == {"sci", "sci.bm25", "sci.hybrid", str(served["index"])}  # and the one opened by path
    assert status["documents"] == N_DOCS and status["strategy"] == "top-k:1"
    expected = HybridSearcher._hybrid_results([DenseSearchResult(**h) for h in hits1],
                                              [DenseSearchResult(**h) for h in hits2], 1, 3, True)
    assert {h.docid: h.score for h in fused} == pytest.approx({h.docid: h.score for h in expected})  # ties: any order
    assert ndcg == pytest.approx((1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3)), abs=1e-4)  # judged at ranks 1, 3
    assert ndcg_hybrid == ndcg
    assert "unknown index 'nope'" in str(unknown) and "query is empty" in str(empty)


def recording_batch_search(searcher):
    """A QueryBatcher's search function over ``searcher`` that records each batch's size, and the list it records in."""
    sizes = []

    def search_batch(texts, k, flt):
        sizes.append(len(texts))
        found = searcher.batch_search(texts, [str(i) for i in range(len(texts))], k=k, filter=flt)
        return [found[str(i)] for i in range(len(texts))]

    return search_batch, sizes


def test_batcher_gathers_concurrent_queries_and_answers_each_as_alone(default_index):
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.serve.batching import QueryBatcher

    searcher = AlignerSearcher(default_index)
    queries = scifact_queries(12)
    alone = [searcher.search(q, k=5) for q in queries]
    search_batch, sizes = recording_batch_search(searcher)
    batcher = QueryBatcher(search_batch, wait_ms=200, max_batch=8)
    start = threading.Barrier(len(queries))

    def one(query):
        start.wait()
        return batcher.search(query, 5)

    with ThreadPoolExecutor(len(queries)) as pool:
        got = list(pool.map(one, queries))
    batcher.close()
    assert sum(sizes) == len(queries) and max(sizes) == 8 and len(sizes) < len(queries)
    for answer, expected in zip(got, alone):
        assert_same_ranking([(h.docid, h.score) for h in answer], [(h.docid, h.score) for h in expected])
    greedy = QueryBatcher(search_batch, wait_ms=0, max_batch=8)
    failing = QueryBatcher(lambda texts, k, flt: 1 / 0, wait_ms=0, max_batch=8)
    with pytest.raises(ZeroDivisionError):
        failing.search("cells", 5)
    assert [h.docid for h in greedy.search(queries[0], 3)] == [h.docid for h in alone[0][:3]]
    greedy.close()
    failing.close()


def test_batcher_waits_for_company_only_under_load(default_index):
    """After a batch of one query (a lone client), the next query starts at once with whatever is queued: three
    queries one after another take far less than one wait of 3 s each; the first, with no batch before it, waits."""
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.serve.batching import QueryBatcher

    searcher = AlignerSearcher(default_index)
    queries = scifact_queries(4)
    search_batch, sizes = recording_batch_search(searcher)
    batcher = QueryBatcher(search_batch, wait_ms=3000, max_batch=8)
    first = time.monotonic()
    batcher.search(queries[0], 3)
    assert time.monotonic() - first >= 3.0
    start = time.monotonic()
    for query in queries[1:]:
        batcher.search(query, 3)
    assert time.monotonic() - start < 3.0 and sizes == [1, 1, 1, 1]
    batcher.close()


def test_batcher_keeps_several_batches_in_flight(default_index):
    """With in_flight=3 the next batch is gathered and searched while earlier ones are still being searched (each of
    these three batches waits until all three are searching), and every query gets its own hits."""
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.serve.batching import QueryBatcher

    searcher = AlignerSearcher(default_index)
    queries = scifact_queries(6)
    alone = [[(h.docid, h.score) for h in searcher.search(q, k=4)] for q in queries]
    search_batch, sizes = recording_batch_search(searcher)
    together = threading.Barrier(3, timeout=60)

    def held(texts, k, flt):
        together.wait()
        return search_batch(texts, k, flt)

    batcher = QueryBatcher(held, wait_ms=200, max_batch=2, in_flight=3)
    futures = [batcher.submit(q, 4) for q in queries]
    got = [future.result(timeout=120) for future in futures]
    batcher.close()
    batcher.close()  # again: returns at once
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(queries[0], 4)
    assert sorted(sizes) == [2, 2, 2] and batcher.batches == 3 and batcher.queries == 6
    for answer, expected in zip(got, alone):
        assert_same_ranking([(h.docid, h.score) for h in answer], expected)
    with pytest.raises(ValueError, match="in_flight"):
        QueryBatcher(held, wait_ms=0, max_batch=2, in_flight=0)


def test_batcher_answers_coroutines_in_batches_as_alone(default_index):
    """Queries submitted by coroutines of one event loop are searched together and each gets its own hits; a
    batch's error reaches every coroutine of it."""
    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.serve.batching import QueryBatcher

    searcher = AlignerSearcher(default_index)
    queries = scifact_queries(10)
    alone = [[(h.docid, h.score) for h in searcher.search(q, k=4)] for q in queries]
    search_batch, sizes = recording_batch_search(searcher)
    batcher = QueryBatcher(search_batch, wait_ms=200, max_batch=6)
    failing = QueryBatcher(lambda texts, k, flt: 1 / 0, wait_ms=50, max_batch=6)

    async def run():
        got = await asyncio.gather(*(batcher.submit_async(q, 4) for q in queries))
        errors = await asyncio.gather(*(failing.submit_async(q, 4) for q in queries[:3]), return_exceptions=True)
        return got, errors

    got, errors = asyncio.run(run())
    batcher.close()
    failing.close()
    assert sum(sizes) == len(queries) and max(sizes) == 6 and len(sizes) < len(queries)
    for answer, expected in zip(got, alone):
        assert_same_ranking([(h.docid, h.score) for h in answer], expected)
    assert all(isinstance(error, ZeroDivisionError) for error in errors)


def test_search_process_answers_as_the_searcher_and_recovers_from_a_crash(default_index, tmp_path):
    """The server's search process gives a batch search's hits, applies settings between batches, refuses what the
    searcher refuses with its message, and a process that died fails only the call in flight."""
    import signal

    from pyserini_aligner.search import AlignerSearcher
    from pyserini_aligner.serve.search_process import SearchProcess, SearchProcessError

    queries = scifact_queries(5)
    expected = AlignerSearcher(default_index).batch_search(queries, [str(i) for i in range(5)], k=7)
    process = SearchProcess(default_index, "cpu", 8)
    try:
        assert process.info["documents"] == N_DOCS and process.info["strategy"] == "top-k:1"
        got = process.search(queries, 7)
        for i, answer in enumerate(got):
            assert_same_ranking(answer, [(h.docid, h.score) for h in expected[str(i)]])
        assert process.call("update", 32, "top-k:2") is None
        assert (process.info["depth"], process.info["strategy"]) == (32, "top-k:2")
        other = AlignerSearcher(default_index, strategy="top-k:2", max_candidates=32).search(queries[0], k=7)
        assert_same_ranking(process.search(queries[:1], 7)[0], [(h.docid, h.score) for h in other])
        with pytest.raises(ValueError, match="k must be"):
            process.search(queries[:1], 0)
        os.kill(process._process.pid, signal.SIGKILL)
        with pytest.raises(SearchProcessError, match="exited"):
            process.search(queries[:1], 7)
        assert_same_ranking(process.search(queries[:1], 7)[0], [(h.docid, h.score) for h in expected["0"]])
    finally:
        process.close()
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises((ValueError, OSError)):
        SearchProcess(tmp_path, "cpu", 8)


def test_search_process_merges_the_batches_of_its_connections(default_index, tmp_path):
    """Searches that several connections (the HTTP workers of --workers) send together are searched as one device
    batch, each answered as alone; a setting changed through one connection is what every other sees next; a search
    process that dies is started again and the connections reach the new one."""
    import signal

    from pyserini_aligner.serve.search_process import SearchClient, SearchProcess, SearchProcessError

    queries = scifact_queries(6)
    expected = offline(default_index, queries, k=7)
    address = str(tmp_path / "search.sock")
    owner = SearchProcess(default_index, "cpu", 8, listen=address, gather_ms=1500)
    owner.restart_on_exit(pause_s=0.1)
    first, second = SearchClient(address), SearchClient(address)
    try:
        assert first.info["documents"] == N_DOCS and first.info["batches"] == 0

        def batches_of(calls) -> int:
            """Device batches that the two ``calls`` (run at once) took; their answers are the offline ones."""
            owner.call("info")
            before = owner.info["batches"]
            with ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda call: call(), calls))
            for answer, want in zip(answers[0] + answers[1], expected):
                assert_same_ranking(answer, want)
            owner.call("info")
            return owner.info["batches"] - before

        # once both connections searched a moment ago, the first to ask waits for the other: one batch, not two (a
        # few tries: on a loaded machine a thread can stall past the moment)
        two_clients = [lambda: first.search(queries[:4], 7), lambda: second.search(queries[4:], 7)]
        assert batches_of(two_clients) in (1, 2)
        assert any(batches_of(two_clients) == 1 for _ in range(3))
        # one client called from two threads at once: two connections, merged the same way
        one_client = [lambda: first.search(queries[:3], 7), lambda: first.search(queries[3:], 7)]
        assert batches_of(one_client) in (1, 2)
        assert any(batches_of(one_client) == 1 for _ in range(3))
        first.call("update", 32, "top-k:2")
        second.search(queries[:1], 7)
        assert (second.info["depth"], second.info["strategy"]) == (32, "top-k:2")
        assert_same_ranking(second.search(queries[:1], 7)[0],
                            offline(default_index, queries[:1], k=7, strategy="top-k:2", max_candidates=32)[0])
        os.kill(owner._process.pid, signal.SIGKILL)
        with pytest.raises(SearchProcessError, match="went away"):
            first.search(queries[:1], 7)
        deadline = time.monotonic() + 120
        while True:  # restarted by the owner's watcher, on the index's own settings
            try:
                got = first.search(queries[:1], 7)
                break
            except SearchProcessError:
                assert time.monotonic() < deadline, "the search process was not started again"
                time.sleep(0.2)
        assert_same_ranking(got[0], expected[0])
    finally:
        for connection in (first, second, owner):
            connection.close()


def test_bench_serve_loads_the_server_and_checks_every_answer(served, tmp_path):
    from eval import bench_serve

    topics = tmp_path / "topics.tsv"
    topics.write_text("".join(f"q{i}\t{q}\n" for i, q in enumerate(scifact_queries(6))))
    assert bench_serve.main(["--index", str(served["index"]), "--url", f"{served['rest']}/sci", "--topics",
                             str(topics), "--output", str(tmp_path / "out"), "--duration", "2", "--clients", "1,4",
                             "--warm-up", "0.5", "--client-processes", "2", "--quiet"]) == 0
    report = json.loads((tmp_path / "out" / "bench_serve.json").read_text())
    assert [row["clients"] for row in report["levels"]] == [1, 4] and report["documents"] == N_DOCS
    assert [row["processes"] for row in report["levels"]] == [1, 2]
    for row in report["levels"]:
        assert row["requests"] > 0 and row["errors"] == 0 and row["wrong"] == 0 and row["qps"] > 0
        assert 0 < row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] and row["mean_batch"] >= 1
    assert "| 4 |" in (tmp_path / "out" / "bench_serve.md").read_text()


def test_a_bad_registration_stops_the_server_with_one_line(tmp_path):
    def run(*command, **env):
        return subprocess.run([sys.executable, "-m", *command], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=300)

    cli = run("pyserini_aligner.serve", "--rest", "--index", f"sci={tmp_path}")
    assert cli.returncode == 2 and f"--index sci={tmp_path}: not a pyserini-aligner index folder" in cli.stderr
    assert "Traceback" not in cli.stderr
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "manifest.json").write_text('{"format": "pyserini-aligner"}')  # never opened: refused first
    unpaired = run("pyserini_aligner.serve", "--mcp", "--index", f"sci={tmp_path / 'idx'}", "--bm25", "other=x")
    assert unpaired.returncode == 2 and "--bm25 other=x: no AligneR index 'other' is registered" in unpaired.stderr
    workers = run("pyserini_aligner.serve", "--mcp", "--index", f"sci={tmp_path / 'idx'}", "--workers", "2")
    assert workers.returncode == 2 and "--workers goes with --rest" in workers.stderr
    pyserini = run("pyserini.server.rest", "--port", str(free_port()), PYSERINI_ALIGNER_INDEXES="scifact")
    assert pyserini.returncode == 2 and "Traceback" not in pyserini.stderr
    assert pyserini.stderr.strip().splitlines()[-1] == (
        "error: PYSERINI_ALIGNER_INDEXES: expected NAME=PATH, got 'scifact'")

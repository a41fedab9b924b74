"""Serving under load: Pyserini's REST API (``python -m pyserini_aligner.serve --rest``) searched by 1, 8, 32 and
128 concurrent clients, each sending one query at a time.

    python -m eval.bench_serve --index INDEX --output DIR [--topics beir/scifact/test] [--device cpu|cuda]
        [--duration 60] [--clients 1,8,32,128] [--hits 10] [--batch-wait-ms 2] [--max-batch 32] [--workers 1]
        [--url URL] [--client-processes N]

The server runs as a child process serving ``--index`` (the plugin's batching: concurrent queries gathered for at most
``--batch-wait-ms`` into batches of at most ``--max-batch``, in each of ``--workers`` HTTP worker processes), or
``--url`` names one already running. Each level runs
for ``--duration`` seconds after a short warm-up, the clients (threads, spread over ``--client-processes`` processes)
cycling through the topics; it reports queries per second, latency percentiles (p50, p95, p99, each request's round
trip), errors (a status other than 200 or a failed connection) and whether every answer equalled the offline ranking
(``AlignerSearcher.search`` of that query alone, same device): ``wrong`` counts answers whose docids differ in order,
``near_ties`` those differing only where the offline scores of the swapped documents agree to float32 rounding (a
batch rounds its products its own way). Writes ``bench_serve.json`` and ``bench_serve.md`` under ``--output``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from eval.cli import configure_logging

log = logging.getLogger("eval.bench_serve")
TIE_TOLERANCE = 1e-5  # relative difference of two scores that float32 rounding of a batch can explain
CLIENT_STRIDE = 7  # a client steps through the topics this many at a time (clients start at different topics)
CLIENT_SWITCH_S = 0.0005  # a client thread whose answer arrived waits at most this long for the interpreter lock


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_serve", description=__doc__.splitlines()[0])
    parser.add_argument("--index", required=True, help="AligneR index folder to serve")
    parser.add_argument("--topics", default="beir/scifact/test",
                        help="queries: ir_datasets id, BEIR folder or TSV file of qid<TAB>text")
    parser.add_argument("--output", required=True, type=Path, help="folder for bench_serve.json/.md and the log")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: the server's and the reference's device")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds measured per client count")
    parser.add_argument("--clients", default="1,8,32,128", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--hits", type=int, default=10, help="hits asked for by each request")
    parser.add_argument("--warm-up", type=float, default=3.0, metavar="SECONDS",
                        help="seconds each level runs before it is measured")
    parser.add_argument("--batch-wait-ms", type=float, default=2.0, help="the server's --batch-wait-ms")
    parser.add_argument("--max-batch", type=int, default=32, help="the server's --max-batch")
    parser.add_argument("--workers", type=int, default=1, help="the server's --workers (HTTP worker processes)")
    parser.add_argument("--client-processes", type=int, default=max(1, (os.cpu_count() or 1) // 4),
                        help="processes the clients are spread over (default: a quarter of the CPU cores), so that "
                             "the load generator is not one interpreter's threads")
    parser.add_argument("--max-queries", type=int, default=None, help="use only the first N topics")
    parser.add_argument("--port", type=int, default=None, help="port of the server (default: a free one)")
    parser.add_argument("--url", default=None,
                        help="load a server already running instead (the URL of its index, e.g. "
                             "http://HOST:8081/v1/indexes/NAME, serving --index); --device is then the reference's")
    parser.add_argument("--quiet", action="store_true", help="no info logging")
    args = parser.parse_args(argv)
    try:
        args.levels = [int(part) for part in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients: expected comma-separated integers, got {args.clients!r}")
    if (not args.levels or min(args.levels) < 1 or args.duration <= 0 or args.hits < 1 or args.warm_up < 0
            or args.client_processes < 1):
        parser.error("--clients, --duration, --hits and --client-processes must be positive, --warm-up not negative")
    return args


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    """The REST server serving ``args.index`` as "bench", once it answers."""
    import requests

    command = [sys.executable, "-m", "pyserini_aligner.serve", "--rest", "--port", str(port), "--index",
               f"bench={args.index}", "--device", args.device, "--batch-wait-ms", str(args.batch_wait_ms),
               "--max-batch", str(args.max_batch), "--workers", str(args.workers), "--reload-interval", "0"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_path.open("w"))
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}): {log_path.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            server.terminate()
            raise RuntimeError(f"the server did not start within 600 s; see {log_path}")
        try:
            requests.get(f"http://127.0.0.1:{port}/", timeout=2)
            return server
        except (requests.ConnectionError, requests.Timeout):  # not yet listening, or not yet answering
            time.sleep(0.5)


def compare(got: list[tuple[str, float]], expected: list[tuple[str, float]]) -> str:
    """"same", "near_tie" (docids differ only where the scores agree to float32 rounding) or "wrong"."""
    if [d for d, _ in got] == [d for d, _ in expected]:
        return "same"
    if len(got) == len(expected) and all(abs(a - b) <= TIE_TOLERANCE * max(abs(a), abs(b), 1e-6)
                                         for (_, a), (_, b) in zip(got, expected)):
        return "near_tie"
    return "wrong"


def _clients(url: str, queries: list[str], reference: list[list], first: int, clients: int, measure_at: float,
             stop_at: float) -> tuple[list[float], dict]:
    """``clients`` threads, each a kept-alive HTTP connection (the standard library's: little work a request, so
    the load generator adds little to the latencies it measures) sending one query at a time until ``stop_at``
    (``time.time()``); the requests that finish in [``measure_at``, ``stop_at``) are counted. Returns their
    latencies (s) and outcomes."""
    import http.client
    from urllib.parse import urlsplit

    sys.setswitchinterval(CLIENT_SWITCH_S)
    where = urlsplit(url)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    outcomes = {"same": 0, "near_tie": 0, "wrong": 0, "errors": 0}
    lock = threading.Lock()
    bodies = [json.dumps({"query": query, "hits": len(expected) or 1}).encode() for query, expected in
              zip(queries, reference)]

    def client(number: int) -> None:
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        position = (first + number) % len(queries)
        while time.time() < stop_at:
            started = time.perf_counter()
            try:
                connection.request("POST", where.path, bodies[position], {"Content-Type": "application/json"})
                answer = connection.getresponse()
                data = answer.read()
                ok = answer.status == 200
                got = [(c["docid"], c["score"]) for c in json.loads(data)["candidates"]] if ok else None
            except (OSError, http.client.HTTPException, ValueError, KeyError):
                ok, got = False, None
                connection.close()  # connected again by the next request
            elapsed, finished = time.perf_counter() - started, time.time()
            if measure_at <= finished < stop_at:
                latencies[number].append(elapsed)
                outcome = compare(got, reference[position]) if ok else "errors"
                with lock:
                    outcomes[outcome] += 1
            position = (position + CLIENT_STRIDE) % len(queries)
        connection.close()

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [t for per_client in latencies for t in per_client], outcomes


def _client_process(url: str, queries: list[str], reference: list[list], first: int, clients: int, ready, go,
                    times, results) -> None:
    """One load-generating process: reports ready, waits for the window in ``times`` and puts its results."""
    ready.put(first)
    go.wait()
    results.put(_clients(url, queries, reference, first, clients, times[0], times[1]))


def run_level(url: str, queries: list[str], reference: list[list], clients: int, duration: float,
              warm_up: float, processes: int = 1) -> dict:
    """``clients`` concurrent clients, spread over ``processes`` processes (threads in this one when 1), each
    sending one query at a time for ``duration`` seconds after ``warm_up``."""
    processes = max(1, min(processes, clients))
    shares = [clients // processes + (p < clients % processes) for p in range(processes)]
    firsts = [sum(shares[:p]) for p in range(processes)]
    if processes == 1:
        measure_at = time.time() + warm_up
        parts = [_clients(url, queries, reference, 0, clients, measure_at, measure_at + duration)]
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        ready, results, go, times = context.Queue(), context.Queue(), context.Event(), context.Array("d", 2)
        workers = [context.Process(target=_client_process, daemon=True,
                                   args=(url, queries, reference, first, share, ready, go, times, results))
                   for first, share in zip(firsts, shares)]
        for worker in workers:
            worker.start()
        for _ in workers:
            ready.get(timeout=300)
        times[0] = time.time() + warm_up
        times[1] = times[0] + duration
        go.set()
        parts = [results.get(timeout=warm_up + duration + 300) for _ in workers]
        for worker in workers:
            worker.join(timeout=60)
    outcomes = {key: sum(part[1][key] for part in parts) for key in ("same", "near_tie", "wrong", "errors")}
    all_latencies = np.array([t for part in parts for t in part[0]]) * 1000
    answered = sum(outcomes.values())
    percentiles = np.percentile(all_latencies, [50, 95, 99]) if len(all_latencies) else [float("nan")] * 3
    return {"clients": clients, "processes": processes, "seconds": round(duration, 2), "requests": answered,
            "qps": round(answered / duration, 2), "p50_ms": round(float(percentiles[0]), 1),
            "p95_ms": round(float(percentiles[1]), 1), "p99_ms": round(float(percentiles[2]), 1), **outcomes}


def report_markdown(report: dict) -> str:
    lines = [f"Serving `{report['index']}` ({report['documents']} documents) on {report['device']}, "
             f"{report['queries']} queries of {report['topics']}, hits {report['hits']}, batches of at most "
             f"{report['max_batch']} gathered for at most {report['batch_wait_ms']} ms in each of "
             f"{report.get('workers', 1)} HTTP worker(s) (mean batch: queries a device batch); {report['duration']} s per "
             f"level; clients spread over {report['client_processes']} process(es); {report['machine']}.", "",
             "| clients | q/s | p50 ms | p95 ms | p99 ms | requests | errors | wrong | near ties | mean batch |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["levels"]:
        lines.append(f"| {row['clients']} | {row['qps']} | {row['p50_ms']} | {row['p95_ms']} | {row['p99_ms']} | "
                     f"{row['requests']} | {row['errors']} | {row['wrong']} | {row['near_tie']} | "
                     f"{row['mean_batch']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    import requests

    from pyserini_aligner.data import load_topics
    from pyserini_aligner.search import AlignerSearcher

    args.output.mkdir(parents=True, exist_ok=True)
    topics = load_topics(args.topics)
    queries = list(topics.values())[:args.max_queries]
    searcher = AlignerSearcher(args.index, device=args.device)
    log.info("offline rankings of %d queries", len(queries))
    reference = [[(hit.docid, hit.score) for hit in searcher.search(query, k=args.hits)] for query in queries]
    documents = searcher.num_docs
    del searcher
    server, base = None, args.url
    if base is None:
        port = args.port or free_port()
        server = start_server(args, port, args.output / "server.log")
        base = f"http://127.0.0.1:{port}/v1/indexes/bench"
    levels = []
    try:
        for clients in args.levels:
            before = requests.get(f"{base}/status", timeout=60).json()
            row = run_level(f"{base}/search", queries, reference, clients, args.duration, args.warm_up,
                            args.client_processes)
            after = requests.get(f"{base}/status", timeout=60).json()
            batches = after["batches"] - before["batches"]
            row["mean_batch"] = round((after["batched_queries"] - before["batched_queries"]) / max(batches, 1), 1)
            log.info("%d clients: %.1f q/s, p50 %.1f ms, p99 %.1f ms, %d errors, %d wrong", clients, row["qps"],
                     row["p50_ms"], row["p99_ms"], row["errors"], row["wrong"])
            levels.append(row)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    report = {"index": str(args.index), "documents": documents, "url": args.url, "topics": args.topics, "queries": len(queries),
              "device": args.device, "hits": args.hits, "duration": args.duration,
              "batch_wait_ms": args.batch_wait_ms, "max_batch": args.max_batch, "workers": args.workers,
              "client_processes": args.client_processes,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "levels": levels}
    (args.output / "bench_serve.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.output / "bench_serve.md").write_text(report_markdown(report))
    print(report_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

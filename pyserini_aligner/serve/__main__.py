"""``python -m pyserini_aligner.serve --index NAME=PATH [--bm25 NAME=PATH] --rest|--mcp [--host H] [--port P]``:
Pyserini's own REST app or MCP server (its routes and tools) serving the registered indexes."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pyserini_aligner.cli import (HelpFormatter, add_quiet_flag, device, non_negative, port_number, positive_int,
                                  run_main)
from pyserini_aligner.serve.config import (DEFAULT_BATCH_WAIT_MS, DEFAULT_MAX_BATCH, DEFAULT_MAX_QUERY_CHARS,
                                           DEFAULT_RELOAD_S, ENV_CONCURRENCY, ConfigError, ServeConfig, configure,
                                           parse_pair)

DEFAULT_CONCURRENCY = 256  # requests searched at once (worker threads); the rest wait without a thread
log = logging.getLogger("pyserini_aligner.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pyserini_aligner.serve", formatter_class=HelpFormatter,
        description="Serve AligneR indexes (and BM25 hybrids) from Pyserini's REST API or MCP server.\n\n"
                    "  python -m pyserini_aligner.serve --index scifact=indexes/scifact --rest --port 8081\n"
                    "  python -m pyserini_aligner.serve --index scifact=indexes/scifact --mcp --transport http")
    server = parser.add_mutually_exclusive_group(required=True)
    server.add_argument("--rest", action="store_true", help="Pyserini's REST API (FastAPI on uvicorn)")
    server.add_argument("--mcp", action="store_true", help="Pyserini's MCP server (FastMCP)")
    parser.add_argument("--index", action="append", default=[], metavar="NAME=PATH", required=True,
                        help="serve the AligneR index at PATH as NAME (repeatable)")
    parser.add_argument("--bm25", action="append", default=[], metavar="NAME=PATH",
                        help="a Lucene index (built with --storeRaw) of the same corpus as AligneR index NAME: "
                             "served as NAME.bm25, fused with NAME as NAME.hybrid, and the source of NAME's "
                             "document texts")
    parser.add_argument("--qrels", action="append", default=[], metavar="NAME=QRELS",
                        help="judgements (TREC or BEIR qrels file, BEIR folder, ir_datasets id) for eval_hits on NAME")
    parser.add_argument("--device", type=device, default="cpu", help="where queries are encoded and searched: cpu or cuda[:N]")
    parser.add_argument("--batch-wait-ms", type=non_negative, default=DEFAULT_BATCH_WAIT_MS, metavar="MS",
                        help="how long a batch waits for more concurrent queries after its first one")
    parser.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH,
                        help="most queries searched in one batch")
    parser.add_argument("--reload-interval", type=non_negative, default=DEFAULT_RELOAD_S, metavar="SECONDS",
                        help="how often each index's manifest is checked for a new generation (0: never)")
    parser.add_argument("--max-query-chars", type=positive_int, default=DEFAULT_MAX_QUERY_CHARS,
                        help="longer queries are refused")
    parser.add_argument("--concurrency", type=positive_int, default=DEFAULT_CONCURRENCY,
                        help="requests handled at once (worker threads; more wait their turn)")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="with --rest: HTTP worker processes (uvicorn's), sharing one search process per AligneR "
                             "index, which merges their batches (waiting up to --batch-wait-ms for those of the "
                             "others; up to workers x --max-batch queries)")
    parser.add_argument("--transport", choices=("stdio", "http"), default="stdio",
                        help="with --mcp: stdio (the client starts the server) or http")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port_number, default=None,
                        help="port to listen on, 0 for any free port (default: 8081 for --rest, 8000 for --mcp, as "
                             "Pyserini's)")
    add_quiet_flag(parser)
    return parser


def parse_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServeConfig:
    try:
        pairs = {field: dict(parse_pair(text, f"--{field}") for text in getattr(args, field))
                 for field in ("index", "bm25", "qrels")}
        for field, flag in (("index", "--index"), ("bm25", "--bm25"), ("qrels", "--qrels")):
            if len(pairs[field]) != len(getattr(args, field)):
                raise ConfigError(f"{flag}: a name is given twice")
        return ServeConfig(indexes=pairs["index"], bm25=pairs["bm25"], qrels=pairs["qrels"], device=args.device,
                           batch_wait_ms=args.batch_wait_ms, max_batch=args.max_batch,
                           reload_s=args.reload_interval, max_query_chars=args.max_query_chars).check()
    except ConfigError as error:
        parser.error(str(error))


def listening_socket(config):
    """The socket of uvicorn ``config`` (its host and port; port 0: a free port the system chooses), bound as uvicorn
    binds one and listening: connections wait in its backlog until the server takes them."""
    sock = config.bind_socket()
    sock.listen(config.backlog)
    return sock


def listen_rest(config) -> list:
    """:func:`listening_socket` of ``config``, after a line on stderr with its address: ``INFO
    pyserini_aligner.serve: serving REST on http://HOST:PORT`` (the port chosen, for ``--port 0``)."""
    sock = listening_socket(config)
    host, bound = sock.getsockname()[:2]
    log.info("serving REST on http://%s:%d", f"[{host}]" if ":" in host else host, bound)
    return [sock]


def serve_rest(host: str, port: int, concurrency: int) -> None:
    import asyncio

    import anyio.to_thread
    import uvicorn
    from pyserini.server.rest.app import app

    async def serve() -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = concurrency
        config = uvicorn.Config(app, host=host, port=port, log_level="warning")
        await uvicorn.Server(config).serve(sockets=listen_rest(config))

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve())


def serve_rest_workers(config: ServeConfig, host: str, port: int, concurrency: int, workers: int) -> None:
    """Pyserini's REST app in ``workers`` uvicorn worker processes. The search process of each AligneR index is
    started here, listening on a Unix socket in a private folder; every worker connects to it (the folder and the
    processes go when the server stops). Here also each index's manifest is polled for new generations, and a search
    process that dies is started again."""
    import uvicorn

    from pyserini_aligner.serve.search_process import SearchProcess
    from pyserini_aligner.serve.served import watch_generation

    folder = Path(tempfile.mkdtemp(prefix="aligner-serve-"))
    processes = []
    try:
        sockets = {}
        for number, (name, path) in enumerate(config.indexes.items()):
            sockets[name] = str(folder / f"{number}.sock")
            try:
                process = SearchProcess(path, config.device, config.max_batch * workers, listen=sockets[name],
                                        gather_ms=config.batch_wait_ms)
            except (ValueError, OSError, RuntimeError) as error:
                raise type(error)(f"--index {name}={path}: {error}") from None
            processes.append(process)
            process.restart_on_exit()
            if config.reload_s > 0:
                watch_generation(process, Path(path), name, config.reload_s)
        os.environ.update(dataclasses.replace(config, sockets=sockets).environment())
        os.environ[ENV_CONCURRENCY] = str(concurrency)
        from uvicorn.supervisors import Multiprocess

        rest = uvicorn.Config("pyserini.server.rest.app:app", host=host, port=port, workers=workers,
                              log_level="warning")
        Multiprocess(rest, sockets=listen_rest(rest)).run()  # as uvicorn.run(..., workers=N), the address printed
    finally:
        for process in processes:
            process.close()
        shutil.rmtree(folder, ignore_errors=True)


def event_loop_factory():
    """uvloop's event loop where it is installed (as uvicorn picks it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def serve_mcp(transport: str, host: str, port: int, concurrency: int) -> None:
    import anyio
    import anyio.to_thread
    from fastmcp import FastMCP
    from pyserini.server.mcp.tools import register_tools
    from pyserini.server.search_controller import get_controller

    mcp = FastMCP("mcpyserini")  # as python -m pyserini.server.mcp builds it
    register_tools(mcp, get_controller())

    async def serve() -> None:
        anyio.to_thread.current_default_thread_limiter().total_tokens = concurrency
        if transport == "http":
            chosen, sockets = port, None
            if port == 0:  # FastMCP's line names the port it is given: bound here, it names the one chosen
                import uvicorn

                sockets = [listening_socket(uvicorn.Config(mcp, host=host, port=0, log_level="warning"))]
                chosen = sockets[0].getsockname()[1]
            await mcp.run_async("http", show_banner=False, host=host, port=chosen, sockets=sockets)
        else:
            await mcp.run_async("stdio", show_banner=False)

    anyio.run(serve)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the checked :class:`ServeConfig` as ``config``; argparse errors for what can't be served."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.transport != "stdio" and not args.mcp:
        parser.error("--transport goes with --mcp")
    if args.workers > 1 and not args.rest:
        parser.error("--workers goes with --rest")
    args.config = parse_config(parser, args)
    return args


def serve(args: argparse.Namespace) -> None:
    """Register the indexes with Pyserini's server and serve them until stopped."""
    port = args.port if args.port is not None else 8081 if args.rest else 8000  # Pyserini's (0: any free port)
    if args.rest and args.workers > 1:
        serve_rest_workers(args.config, args.host, port, args.concurrency, args.workers)
        return
    configure(args.config)
    if args.rest:
        serve_rest(args.host, port, args.concurrency)
    else:
        serve_mcp(args.transport, args.host, port, args.concurrency)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (:func:`pyserini_aligner.cli.run_main`)."""
    return run_main(parse_args, serve, argv)


if __name__ == "__main__":
    sys.exit(main())

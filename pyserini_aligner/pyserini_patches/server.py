"""What the start-up hook does to Pyserini's server modules (``pyserini.server.*``), by module:

- ``models``: the index type ``aligner`` lists the served names; ``IndexStatus`` and ``IndexSetting`` carry the
  AligneR fields (documents, generation, strategy, depth, fusion settings), and the settings a request posts beyond
  Pyserini's reach the controller; ``SearchParams`` takes a filter (``filter``, or ``docids``, or ``filter_field``
  and ``values``), handed on in the query object, where MCP's ``search`` tool takes it too;
- ``search_controller``: ``SearchController`` serves the indexes of :mod:`.served` (others go to Pyserini's own
  code; an unknown name is a 404), and the default prebuilt index is not loaded when AligneR indexes are registered;
- ``rest.routes.indexes``: the routes' controller calls (synchronous in Pyserini's code) are awaited: a search of a
  served AligneR index waits for its batch on the event loop without holding a thread, every other call runs in one
  of FastAPI's worker threads, so the event loop never waits for a search and concurrent searches are batched;
- ``rest.app``: a refused request gets its 4xx with a one-line message, an internal error a 500 without traceback;
- ``pyserini.encode.optional._uniir`` imports without its optional package (M-BEIR encoders), as the server needs.

MCP tools are plain functions, which FastMCP already runs in worker threads.
"""
from __future__ import annotations

import ast
import contextvars
import functools
import gc
import logging
import os
import sys
from types import ModuleType
from typing import Any

from pyserini_aligner.serve import config as serve_config
from pyserini_aligner.serve.config import (BM25_SUFFIX, FILTER_KEYS, HYBRID_SUFFIX, BadFilter, RequestError,
                                           UnknownIndex)

log = logging.getLogger(__name__)
INDEX_TYPE = "aligner"
UNIIR_PACKAGE = "uniir_for_pyserini"
LISTED: dict[str, dict] = {}  # served name -> description: Pyserini's INDEX_TYPE["aligner"]
POSTED_SETTINGS: contextvars.ContextVar[dict] = contextvars.ContextVar("posted_settings", default={})
_REGISTRY: list = []
CONTROLLER_CALL = "_aligner_controller_call"  # the name routes call controller_call by


def registry():
    """The :class:`.served.Registry` of this process (opened on first use)."""
    if not _REGISTRY:
        from pyserini_aligner.serve.served import Registry

        _REGISTRY.append(Registry(serve_config.current(), LISTED))
    return _REGISTRY[0]


SWITCH_INTERVAL_S = 0.001  # the server's interpreter: longest a thread keeps the lock while another waits for it


def tune_interpreter() -> None:
    """For a server under load: every object alive now (the imports, the opened indexes) is left out of later
    garbage collections (a full collection over them stopped every thread for a few hundred ms), and a thread that
    waits for the interpreter lock (the batcher, back from reading a batch's answers) gets it within 1 ms instead of
    Python's 5 (it waits once or twice a batch while the event loop handles requests)."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def _exec_transformed(name: str, inner, module: ModuleType, transform) -> None:
    """Execute module ``name``'s source after ``transform(tree)``, under its own file name."""
    filename = inner.get_filename(name)
    tree = ast.parse(inner.get_source(name), filename=filename)
    transform(tree)
    exec(compile(tree, filename, "exec"), module.__dict__)


def _without_default_index(tree: ast.Module) -> None:
    """Drop the module-level ``controller.initialize_default_index()`` (the prebuilt index it loads is loaded on
    first use instead)."""
    tree.body = [node for node in tree.body if not (
        isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "initialize_default_index")]


class _ControllerCalls(ast.NodeTransformer):
    """``get_controller().NAME(args)`` becomes ``await _aligner_controller_call("NAME", get_controller(), args)``."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        target = node.func
        if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Call)
                and isinstance(target.value.func, ast.Name) and target.value.func.id == "get_controller"):
            call = ast.Call(func=ast.Name(CONTROLLER_CALL, ast.Load()),
                            args=[ast.Constant(target.attr), target.value, *node.args], keywords=node.keywords)
            return ast.copy_location(ast.Await(ast.copy_location(call, node)), node)
        return node


def _awaited_controller_calls(tree: ast.Module) -> None:
    """In module-level ``async def`` routes that await nothing, every controller call is awaited through
    :func:`controller_call`, so that no route blocks the event loop."""
    for node in tree.body:
        if isinstance(node, ast.AsyncFunctionDef) and not any(
                isinstance(inside, (ast.Await, ast.AsyncFor, ast.AsyncWith)) for inside in ast.walk(node)):
            _ControllerCalls().visit(node)
    ast.fix_missing_locations(tree)


async def controller_call(method: str, controller, *args: Any, **kwargs: Any) -> Any:
    """A REST route's call of ``SearchController.<method>``: the search of a served AligneR index awaits its batch
    on the event loop (no thread waits for it); every other call runs in one of FastAPI's worker threads."""
    if method == "search":
        served = registry().opened(args[1] if len(args) > 1 else kwargs.get("index_name"))
        if served is not None and hasattr(served, "search_async"):
            query, k, qid = _search_arguments(*args, **kwargs)
            return await served.search_async(query, k, qid)
    from starlette.concurrency import run_in_threadpool

    _limit_threads()
    return await run_in_threadpool(getattr(controller, method), *args, **kwargs)


@functools.cache
def _limit_threads() -> None:
    """In an HTTP worker of ``--workers``, the thread limit of ``--concurrency`` (from the environment), set once."""
    limit = os.environ.get(serve_config.ENV_CONCURRENCY, "").strip()
    if limit:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = int(limit)


def _search_arguments(query, index_name, k=10, qid="", *rest, **options) -> tuple[Any, Any, str]:
    """(query, k, qid) of a call of ``SearchController.search``."""
    return query, k, qid


def _exec_uniir(inner, module: ModuleType) -> None:
    """Pyserini's M-BEIR (UniIR) encoders, or, without their optional package, stand-ins that say it is missing
    when used (the server imports them for M-BEIR indexes only)."""
    try:
        inner.exec_module(module)
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith(UNIIR_PACKAGE):
            raise

        class _Missing:
            def __init__(self, *args, **kwargs):
                raise ImportError(f"M-BEIR indexes need the {UNIIR_PACKAGE} package: pip install uniir-for-pyserini")

        for missing in ("UniIRCorpusEncoder", "UniIRQueryEncoder"):
            setattr(module, missing, type(missing, (_Missing,), {"__module__": module.__name__}))


def exec_server_module(name: str, inner, module: ModuleType) -> None:
    """Execute Pyserini's server module ``name`` with the plugin's changes (see the module docstring)."""
    if name == "pyserini.encode.optional._uniir":
        _exec_uniir(inner, module)
    elif name == "pyserini.server.search_controller":
        try:
            registered = bool(serve_config.current().indexes)
            _exec_transformed(name, inner, module, _without_default_index if registered else lambda tree: None)
            patch_controller(module)
        except (ValueError, OSError) as error:  # a bad registration, an index that does not open: one line
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
    elif name == "pyserini.server.rest.routes.indexes":
        module.__dict__[CONTROLLER_CALL] = controller_call
        _exec_transformed(name, inner, module, _awaited_controller_calls)
    else:
        inner.exec_module(module)
        if name == "pyserini.server.models":
            patch_models(module)
        elif name == "pyserini.server.rest.app":
            patch_app(module)


def patch_models(models: ModuleType) -> None:
    """List the served names under index type "aligner"; let status and settings carry fields of their own."""
    from pydantic import ConfigDict, model_validator

    models.INDEX_TYPE[INDEX_TYPE] = LISTED

    class IndexStatus(models.IndexStatus):
        model_config = ConfigDict(extra="allow")

    class IndexSetting(models.IndexSetting):
        model_config = ConfigDict(extra="allow")

        @model_validator(mode="after")
        def _posted(self):
            POSTED_SETTINGS.set(dict(self.model_extra or {}))
            return self

    class SearchParams(models.SearchParams):  # the filter's types are checked with the query's (a 400 naming it)
        filter: Any = None
        filter_field: Any = None
        values: Any = None
        docids: Any = None

        @model_validator(mode="after")
        def _filter_in_query(self):
            """The filter goes to the controller in the query object ({"query_txt": ..., "filter": ...})."""
            given = {key: getattr(self, key) for key in FILTER_KEYS if getattr(self, key) is not None}
            if given:
                query = self.query if isinstance(self.query, dict) else {"query_txt": self.query}
                self.query = {**query, **given}
            return self

    for patched in (IndexStatus, IndexSetting, SearchParams):
        patched.__module__ = models.__name__
        setattr(models, patched.__name__, patched)


def patch_controller(module: ModuleType) -> None:
    """``SearchController`` serves the indexes of the registry first, then Pyserini's prebuilt ones."""
    cls = module.SearchController
    prebuilt = [module.TF_INDEX_INFO, module.LUCENE_FLAT_INDEX_INFO, module.LUCENE_HNSW_INDEX_INFO,
                module.IMPACT_INDEX_INFO, module.FAISS_INDEX_INFO, module.FAISS_INDEX_INFO_M_BEIR]
    original = {method: getattr(cls, method) for method in (
        "_add_index", "search", "get_document", "get_status", "update_settings", "get_settings", "eval_hits")}
    registry()  # open the registered indexes before the server listens
    tune_interpreter()

    def known(name: str) -> bool:
        return any(name in info for info in prebuilt) or ("shard" in name and "msmarco" in name)

    def pyserini_index(name: str) -> None:
        """Refuse a name that is neither served nor prebuilt."""
        if not known(name):
            raise UnknownIndex(registry().unknown_message(name))

    def _add_index(self, config):
        pyserini_index(config.name)
        return original["_add_index"](self, config)

    def search(self, query, index_name, k=10, qid="", ef_search=None, encoder=None, query_generator=None,
               instruction_config=None):
        served = registry().get(index_name)
        if served is None:
            if isinstance(query, dict) and any(query.get(key) is not None for key in FILTER_KEYS):
                raise BadFilter(f"index {index_name}: a filter applies to the AligneR indexes served here (and their "
                                f"{BM25_SUFFIX} and {HYBRID_SUFFIX} pairs)")
            return original["search"](self, query, index_name, k, qid, ef_search, encoder, query_generator,
                                      instruction_config)
        return served.search(query, k, qid)

    def get_document(self, docid, index_name):
        served = registry().get(index_name)
        return served.document(docid) if served else original["get_document"](self, docid, index_name)

    def get_status(self, index_name):
        served = registry().get(index_name)
        if served is not None:
            return served.status()
        pyserini_index(index_name)
        return original["get_status"](self, index_name)

    def get_settings(self, index_name):
        served = registry().get(index_name)
        if served is not None:
            return served.settings()
        pyserini_index(index_name)
        if index_name not in self.indexes:
            raise UnknownIndex(f"index {index_name} is not loaded yet: search it first")
        return original["get_settings"](self, index_name)

    def update_settings(self, index_name, ef_search=None, encoder=None, query_generator=None):
        posted, served = POSTED_SETTINGS.get(), registry().get(index_name)
        POSTED_SETTINGS.set({})
        if served is None:
            get_settings(self, index_name)
            return original["update_settings"](self, index_name, ef_search, encoder, query_generator)
        given = [flag for flag, value in (("efSearch", ef_search), ("encoder", encoder),
                                          ("queryGenerator", query_generator)) if value is not None]
        if given:
            raise RequestError(f"setting {given[0]} does not apply to index {index_name}; its settings are "
                               f"{', '.join(served.settings_keys) or 'none'}")
        served.update(posted)

    def eval_hits(self, index_name, metric, query_id, hits, cutoff=10):
        served = registry().get(index_name)
        if served is None:
            return original["eval_hits"](self, index_name, metric, query_id, hits, cutoff)
        if metric not in module.EVAL_METRICS:
            raise RequestError(f"unknown metric {metric!r}; one of {', '.join(module.EVAL_METRICS)}")
        return served.aligner.evaluate(metric, query_id, hits, cutoff, module.EVAL_METRICS[metric])

    for method in (_add_index, search, get_document, get_status, get_settings, update_settings, eval_hits):
        method.__doc__ = original[method.__name__].__doc__
        setattr(cls, method.__name__, method)


def _first_line(text: Any, limit: int = 300) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return line[:limit]


def patch_app(app_module: ModuleType) -> None:
    """Errors of Pyserini's REST app: a refused request (:class:`RequestError`, also when a route wrapped it in an
    HTTPException) gets its status and message; a 500 carries one line and the traceback goes to the log."""
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def refused(request, error: RequestError):
        return JSONResponse({"detail": str(error)}, status_code=error.status)

    async def http_error(request, error: HTTPException):
        cause = error.__context__
        if isinstance(cause, RequestError):
            return await refused(request, cause)
        if error.status_code >= 500:
            log.error("%s %s failed", request.method, request.url.path, exc_info=cause or error)
            return JSONResponse({"detail": f"internal error: {_first_line(error.detail)}"},
                                status_code=error.status_code)
        return await http_exception_handler(request, error)

    async def internal(request, error: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return JSONResponse({"detail": f"internal error: {type(error).__name__}"}, status_code=500)

    app = app_module.app
    app.add_exception_handler(RequestError, refused)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal)

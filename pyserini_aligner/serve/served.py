"""The indexes a server serves: AligneR indexes (batched searches, reloaded when a new generation is committed),
the Lucene BM25 index registered with one (``NAME.bm25``, also the source of its document texts) and their hybrid
(``NAME.hybrid``, Pyserini's HybridSearcher fusion). Each answers in the shapes of Pyserini's SearchController; a
search request may carry a filter (:func:`query_filter`), which restricts every side of it."""
from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from pyserini_aligner.serve.batching import QueryBatcher
from pyserini_aligner.serve.config import (BM25_SUFFIX, FILTER_KEYS, HYBRID_SUFFIX, BadFilter, NotFound,
                                           RequestError, ServeConfig, UnknownIndex)
from pyserini_aligner.serve.search_process import SearchClient, SearchProcess

if TYPE_CHECKING:
    from pyserini_aligner.filters import Filter

log = logging.getLogger(__name__)
FILTER_CACHE = 8  # filters whose docids a BM25 index keeps, for its filtered searches
DEFAULT_FUSION_HITS = 100  # hits taken from each side of a hybrid before fusion (Pyserini's fusion --hits)
# batches an HTTP worker of --workers has at its search process at once: the process merges what all workers sent
# while it searched, so a query waits for the batch running and its own, not for its worker's earlier batches
WORKER_BATCHES_IN_FLIGHT = 16


def query_text(query: Any, max_chars: int) -> str:
    """The text of a Pyserini search query (a string or {"query_txt": ...}), checked: not blank, not too long."""
    from pyserini_aligner.textio import is_blank

    if isinstance(query, dict):
        query = query.get("query_txt")
    if not isinstance(query, str):
        raise RequestError("query must be a string or an object with a string query_txt")
    if is_blank(query):
        raise RequestError("query is empty (no letter or digit)")
    if len(query) > max_chars:
        raise RequestError(f"query is {len(query)} characters long; at most {max_chars} are accepted")
    return query


def query_filter(query: Any) -> Filter | None:
    """The :class:`pyserini_aligner.filters.Filter` of a search request, from its query object ({"query_txt": ...}):
    ``filter`` (a predicate over the stored fields), ``docids`` (a list of docids), or ``values`` (a list) matched
    against ``filter_field`` (default: the docid); None without one. BadFilter (400) naming the key or the token."""
    if not isinstance(query, dict):
        return None
    given = {key: query[key] for key in FILTER_KEYS if query.get(key) is not None}
    if not given:
        return None
    from pyserini_aligner.filters import ID_FIELD, Filter, FilterError

    if "filter_field" in given and "values" not in given:
        raise BadFilter("filter_field goes with values")
    if len(given.keys() & {"filter", "docids", "values"}) != 1:
        raise BadFilter("a filter is one of filter (a predicate), docids (a list) or values (a list, with "
                        f"filter_field); got {', '.join(given)}")
    for key in ("filter", "filter_field"):
        if key in given and not isinstance(given[key], str):
            raise BadFilter(f"{key} must be a string, got {given[key]!r}")
    for key in ("docids", "values"):
        if key in given and not isinstance(given[key], list):
            raise BadFilter(f"{key} must be a list, got {given[key]!r}")
    if "docids" in given and not all(isinstance(docid, str) for docid in given["docids"]):
        raise BadFilter("docids must be a list of strings")
    try:
        if "filter" in given:
            return Filter.where(given["filter"])
        if "docids" in given:
            return Filter.docids(given["docids"])
        return Filter.values(given.get("filter_field", ID_FIELD), given["values"])
    except (FilterError, TypeError) as error:  # TypeError: a value that can't be hashed, such as a list
        raise BadFilter(str(error)) from None


def check_hits(k: Any) -> int:
    """A request's ``hits``: an integer >= 1 (more than the index holds gives them all: the searcher caps it, as for
    the command lines)."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise RequestError(f"hits must be an integer, got {k!r}")
    if k < 1:
        raise RequestError(f"hits must be an integer >= 1, got {k}")
    return k


def candidates(served, hits) -> list[dict[str, Any]]:
    """Pyserini's candidate records for ``hits`` (document text from the index's docstore; "" where it has none)."""
    out = []
    for hit in hits:
        doc = served.document_or_none(hit.docid) or {}
        out.append({"docid": hit.docid, "score": float(hit.score),
                    "document_txt": doc.get("contents") or doc.get("text") or doc.get("segment") or "",
                    "document_img_path": None, "encoded_img": None})
    return out


def filtered_search(search: Callable[[], list]) -> list:
    """``search()``, a FilterError (a field the index does not store) refused as :class:`BadFilter`."""
    from pyserini_aligner.filters import FilterError

    try:
        return search()
    except FilterError as error:
        raise BadFilter(str(error)) from None


async def filtered_wait(future) -> list:
    """The result of ``future`` (an awaitable search), a FilterError refused as :class:`BadFilter`."""
    from pyserini_aligner.filters import FilterError

    try:
        return await future
    except FilterError as error:
        raise BadFilter(str(error)) from None


class LuceneDocs:
    """Raw documents of a Lucene index (built with ``--storeRaw``) and its BM25 searcher."""

    def __init__(self, path: str):
        from pyserini.search.lucene import LuceneSearcher

        self.path = path
        self.searcher = LuceneSearcher(str(path))

    def get(self, docid: str) -> dict[str, str] | None:
        doc = self.searcher.doc(docid)
        if doc is None:
            return None
        raw = doc.raw()
        if raw is None:
            return {"id": docid, "contents": doc.contents() or ""}
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {"id": docid, "contents": raw}
        return {key: value if isinstance(value, str) else json.dumps(value) for key, value in parsed.items()} \
            if isinstance(parsed, dict) else {"id": docid, "contents": raw}


def watch_generation(process: SearchProcess, path: Path, name: str, interval_s: float) -> None:
    """Reopen the index of ``process`` whenever the manifest at ``path`` names a generation other than the one it
    serves, checked every ``interval_s`` seconds (a thread); a manifest that cannot be read keeps the generation open
    and is logged."""
    from pyserini_aligner.index.format import read_manifest

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            served = process.info["generation"]
            try:
                if read_manifest(path).generation != served:
                    process.call("reopen")
                    log.info("index %s: serving generation %d (%d documents)", name, process.info["generation"],
                             process.info["documents"])
            except Exception as error:  # noqa: BLE001 - keep serving the generation open
                log.warning("index %s: keeps serving generation %d; reading %s failed: %s", name, served, path,
                            error)

    threading.Thread(target=watch, name=f"aligner-reload-{name}", daemon=True).start()


class ServedIndex:
    """What every served index answers; ``name`` as clients call it, ``aligner`` the AligneR index it rests on."""

    kind = ""
    settings_keys: tuple[str, ...] = ()

    def __init__(self, name: str, config: ServeConfig, docs: LuceneDocs | None):
        self.name, self.config, self.docs = name, config, docs

    def hits(self, text: str, k: int, flt: Filter | None = None) -> list:
        """The top ``k`` hits of ``text`` among the documents filter ``flt`` matches (all without one)."""
        raise NotImplementedError

    def search(self, query: Any, k: int, qid: str = "") -> dict[str, Any]:
        """Pyserini's search answer: {"query": {"qid", "query_txt"}, "candidates": [...]}."""
        text, flt = query_text(query, self.config.max_query_chars), query_filter(query)
        k = check_hits(k)
        found = filtered_search(lambda: self.hits(text, k, flt))
        return {"query": {"qid": qid, "query_txt": text}, "candidates": candidates(self, found)}

    def document_or_none(self, docid: str) -> dict[str, str] | None:
        return self.docs.get(docid) if self.docs is not None else None

    def document(self, docid: str) -> dict[str, str]:
        if self.docs is None:
            raise NotFound(f"index {self.name} keeps no document texts: register a Lucene index of the same corpus "
                           f"(built with --storeRaw) with --bm25 {self.name.split('.')[0]}=PATH")
        doc = self.docs.get(docid)
        if doc is None:
            raise NotFound(f"document {docid} not found in index {self.name}")
        return doc

    def settings(self) -> dict[str, Any]:
        return {}

    def update(self, values: dict[str, Any]) -> None:
        unknown = sorted(set(values) - set(self.settings_keys))
        if unknown:
            raise RequestError(f"unknown setting {unknown[0]!r} for index {self.name}; its settings are "
                               f"{', '.join(self.settings_keys) or 'none'}")

    def status(self) -> dict[str, Any]:
        return {"downloaded": True, "type": self.kind, **self.settings()}


class Hit(NamedTuple):
    """One hit of a served AligneR index (what Pyserini's fusion and the candidate records read)."""

    docid: str
    score: float


class ServedAligner(ServedIndex):
    """An AligneR index, searched in a process of its own in batches gathered by a :class:`QueryBatcher`: this
    server's :class:`.search_process.SearchProcess`, reopened when its manifest's generation changes (polled every
    ``config.reload_s`` seconds), or, in an HTTP worker of ``--workers``, the one its parent started
    (``config.sockets``). Settings ``strategy`` (alignment) and ``depth`` (documents refined per query)."""

    kind = "aligner"
    settings_keys = ("strategy", "depth")

    def __init__(self, name: str, path: str, config: ServeConfig, docs: LuceneDocs | None = None,
                 qrels: str | None = None):
        super().__init__(name, config, docs)
        self.path, self.qrels, self.aligner = Path(path), qrels, self
        in_flight = 1
        if name in config.sockets:
            self.process, in_flight = SearchClient(config.sockets[name]), WORKER_BATCHES_IN_FLIGHT
        else:
            self.process = SearchProcess(path, config.device, config.max_batch)
            if config.reload_s > 0:
                watch_generation(self.process, self.path, name, config.reload_s)
        self.batcher = QueryBatcher(self._search_batch, config.batch_wait_ms, config.max_batch, name, in_flight)

    def _search_batch(self, queries: list[str], k: int, flt: Filter | None) -> list[list[Hit]]:
        """Hits per query of one batch (on the batcher's thread, searched by the index's process)."""
        return [[Hit(docid, score) for docid, score in found] for found in self.process.search(queries, k, flt)]

    def hits(self, text: str, k: int, flt: Filter | None = None) -> list:
        return self.batcher.search(text, k, flt)

    def docids(self, flt: Filter) -> list[str]:
        """The docids of the documents of the served generation that filter ``flt`` matches."""
        return self.process.call("docids", flt)

    async def search_async(self, query: Any, k: Any, qid: str = "") -> dict[str, Any]:
        """:meth:`search` for an event loop: awaits the batch without holding a thread (the document texts, read from
        Lucene, are fetched in a worker thread)."""
        text, flt = query_text(query, self.config.max_query_chars), query_filter(query)
        future = self.batcher.submit_async(text, check_hits(k), flt)
        found = await filtered_wait(future)
        answer = {"query": {"qid": qid, "query_txt": text}}
        if self.docs is None:
            return {**answer, "candidates": candidates(self, found)}
        from starlette.concurrency import run_in_threadpool

        return {**answer, "candidates": await run_in_threadpool(candidates, self, found)}

    def settings(self) -> dict[str, Any]:
        self.process.call("info")  # as the search process has them now (another worker may have changed them)
        info = self.process.info
        return {"strategy": info["strategy"], "depth": info["depth"]}

    def update(self, values: dict[str, Any]) -> None:
        from pyserini_aligner.search.options import SearchOptions

        super().update(values)
        depth = values.get("depth")
        if "depth" in values and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
            raise RequestError(f"depth must be an integer >= 1, got {depth!r}")
        strategy = None
        if "strategy" in values:
            try:
                strategy = SearchOptions(strategy=values["strategy"]).strategy  # the searcher's own coercion
            except ValueError as error:
                raise RequestError(f"unknown {error}") from None
        self.process.call("update", depth, strategy)  # between batches: a batch runs on one setting

    def status(self) -> dict[str, Any]:
        common = super().status()  # its settings() asks the search process for the information read here
        info = self.process.info
        return {**common, "size_bytes": str(info["size_bytes"]), "path": str(self.path),
                "generation": info["generation"], "documents": info["documents"], "segments": info["segments"],
                "codec": info["codec"], "model": info["model"], "device": info["device"],
                "batch_wait_ms": self.config.batch_wait_ms, "max_batch": self.config.max_batch,
                "batches": info["batches"], "batched_queries": info["batched_queries"]}

    def evaluate(self, metric: str, query_id: str, hits: dict[str, float], cutoff: int, args: list[str]) -> float:
        """Pyserini's trec_eval ``args`` (from its EVAL_METRICS) of ``hits`` against the registered qrels."""
        from pyserini.eval.trec_eval import trec_eval

        from pyserini_aligner.data import read_qrels

        if self.qrels is None:
            raise RequestError(f"index {self.name} has no qrels: register them with --qrels {self.name}=QRELS")
        judged = read_qrels(self.qrels).get(str(query_id))
        if not judged:
            raise RequestError(f"query {query_id} has no judgements in the qrels of index {self.name}")
        if isinstance(cutoff, bool) or not isinstance(cutoff, int) or cutoff < 1:
            raise RequestError(f"cutoff must be an integer >= 1, got {cutoff!r}")
        args = list(args)
        if metric in ("ndcg", "recall"):
            args[-1] += f".{cutoff}"
        else:
            args.insert(3, str(cutoff))
        ranked = sorted(hits.items(), key=lambda item: item[1], reverse=True)
        with tempfile.TemporaryDirectory(prefix="aligner-eval-") as folder:
            qrels_file, run_file = Path(folder) / "qrels.txt", Path(folder) / "run.txt"
            qrels_file.write_text("".join(f"{query_id} 0 {docid} {rel}\n" for docid, rel in judged.items()))
            run_file.write_text("".join(f"{query_id} Q0 {docid} {rank} {score} aligner\n"
                                        for rank, (docid, score) in enumerate(ranked, start=1)))
            return trec_eval(args + [str(qrels_file), str(run_file)], query_id=str(query_id))


class ServedLucene(ServedIndex):
    """The Lucene index registered with AligneR index ``aligner``, searched with BM25 (Pyserini's defaults). A
    filtered search is restricted by Lucene to the docids the filter matches in the AligneR index's served generation
    (kept for the last FILTER_CACHE filters)."""

    kind = "bm25"

    def __init__(self, name: str, aligner: ServedAligner):
        super().__init__(name, aligner.config, aligner.docs)
        self.aligner = aligner
        self._filtered: OrderedDict = OrderedDict()  # (filter, generation) -> FilteredLucene, the most recent last
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self.docs.searcher.num_docs

    def hits(self, text: str, k: int, flt: Filter | None = None) -> list:
        if flt is None:
            return self.docs.searcher.search(text, k)
        return self.filtered(flt).search(text, k)

    def filtered(self, flt: Filter):
        """The BM25 searcher restricted to the documents that ``flt`` matches in the served generation."""
        from pyserini_aligner.bm25 import FilteredLucene

        key = (flt, self.aligner.process.info["generation"])
        with self._lock:
            if key in self._filtered:
                self._filtered.move_to_end(key)
                return self._filtered[key]
        searcher = FilteredLucene(self.docs.searcher, self.aligner.docids(flt))
        with self._lock:
            self._filtered[key] = searcher
            while len(self._filtered) > FILTER_CACHE:
                self._filtered.popitem(last=False)
        return searcher

    def status(self) -> dict[str, Any]:
        size = sum(f.stat().st_size for f in Path(self.docs.path).iterdir() if f.is_file())
        return {**super().status(), "size_bytes": str(size), "path": str(self.docs.path), "documents": self.size}


class ServedHybrid(ServedIndex):
    """AligneR + BM25 fused by Pyserini's HybridSearcher rule: settings ``hits`` (taken from each side, as
    ``fusion --hits``), ``alpha``, ``normalization``, ``weight_on_dense``, and the AligneR side's."""

    kind = "hybrid"
    settings_keys = ("hits", "alpha", "normalization", "weight_on_dense", "strategy", "depth")

    def __init__(self, name: str, dense: ServedAligner, sparse: ServedLucene):
        super().__init__(name, dense.config, dense.docs)
        self.dense, self.sparse, self.aligner = dense, sparse, dense
        self.fusion = {"hits": DEFAULT_FUSION_HITS, "alpha": 0.1, "normalization": False, "weight_on_dense": False}

    def hits(self, text: str, k: int, flt: Filter | None = None) -> list:
        from pyserini.search.hybrid import HybridSearcher

        fusion = dict(self.fusion)
        dense = self.dense.batcher.submit(text, fusion["hits"], flt)
        sparse = self.sparse.hits(text, fusion["hits"], flt)
        return HybridSearcher._hybrid_results(dense.result(), sparse, fusion["alpha"], k, fusion["normalization"],
                                              fusion["weight_on_dense"])

    def settings(self) -> dict[str, Any]:
        return {**self.fusion, **self.dense.settings()}

    def update(self, values: dict[str, Any]) -> None:
        super().update(values)
        fusion = dict(self.fusion)
        for key in ("normalization", "weight_on_dense"):
            if key in values:
                if not isinstance(values[key], bool):
                    raise RequestError(f"{key} must be true or false, got {values[key]!r}")
                fusion[key] = values[key]
        if "alpha" in values:
            alpha = values["alpha"]
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha != alpha:
                raise RequestError(f"alpha must be a number, got {alpha!r}")
            fusion["alpha"] = float(alpha)
        if "hits" in values:
            hits = values["hits"]
            if isinstance(hits, bool) or not isinstance(hits, int) or hits < 1:
                raise RequestError(f"hits must be an integer >= 1, got {hits!r}")
            fusion["hits"] = hits
        self.dense.update({key: values[key] for key in ("strategy", "depth") if key in values})
        self.fusion = fusion

    def status(self) -> dict[str, Any]:
        dense, sparse = self.dense.status(), self.sparse.status()
        return {**dense, **super().status(), "size_bytes": str(int(dense["size_bytes"]) + int(sparse["size_bytes"])),
                "bm25_path": sparse["path"]}


class Registry:
    """The served indexes by name: those of ``config`` (opened now) and AligneR index folders named by their path
    (opened on first use). ``listed`` maps every served name to a short description (Pyserini's index list)."""

    def __init__(self, config: ServeConfig, listed: dict[str, dict]):
        self.config, self.listed = config, listed
        self._served: dict[str, ServedIndex] = {}
        self._lock = threading.Lock()
        for name, path in config.indexes.items():
            docs = LuceneDocs(config.bm25[name]) if name in config.bm25 else None
            aligner = ServedAligner(name, path, config, docs, config.qrels.get(name))
            self._add(aligner, f"AligneR index {path}")
            if docs is not None:
                sparse = ServedLucene(name + BM25_SUFFIX, aligner)
                self._add(sparse, f"BM25 over Lucene index {docs.path}")
                self._add(ServedHybrid(name + HYBRID_SUFFIX, aligner, sparse), f"AligneR {name} + BM25 hybrid")

    def _add(self, served: ServedIndex, description: str) -> None:
        self._served[served.name] = served
        self.listed[served.name] = {"description": description, "type": served.kind}

    def get(self, name: str) -> ServedIndex | None:
        """The served index ``name``; an AligneR index folder not yet served is opened under its path."""
        from pyserini_aligner.index.format import is_index

        served = self._served.get(name)
        if served is not None or not isinstance(name, str) or not is_index(name):
            return served
        with self._lock:
            if name not in self._served:
                self._add(ServedAligner(name, name, self.config), f"AligneR index {name}")
        return self._served[name]

    def opened(self, name: Any) -> ServedIndex | None:
        """The served index ``name`` if it is open already (never opens one)."""
        return self._served.get(name) if isinstance(name, str) else None

    def require(self, name: str) -> ServedIndex:
        served = self.get(name)
        if served is None:
            raise UnknownIndex(self.unknown_message(name))
        return served

    def unknown_message(self, name: str) -> str:
        return (f"unknown index {name!r}: not a served index ({', '.join(self._served) or 'none registered'}), an "
                "AligneR index folder or a Pyserini prebuilt index")

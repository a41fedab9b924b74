"""What a server serves: the registered indexes and the batching and reload knobs, from the command line of
``python -m pyserini_aligner.serve`` or from environment variables (for Pyserini's own entry points); and the errors
that a request can get."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

ENV_INDEXES = "PYSERINI_ALIGNER_INDEXES"  # NAME=PATH[,NAME=PATH...]: AligneR indexes
ENV_BM25 = "PYSERINI_ALIGNER_BM25"  # NAME=PATH[,...]: a Lucene index of the same corpus for AligneR index NAME
ENV_QRELS = "PYSERINI_ALIGNER_QRELS"  # NAME=QRELS[,...]: judgements for eval_hits on NAME
ENV_DEVICE = "PYSERINI_ALIGNER_DEVICE"
ENV_BATCH_WAIT_MS = "PYSERINI_ALIGNER_BATCH_WAIT_MS"
ENV_MAX_BATCH = "PYSERINI_ALIGNER_MAX_BATCH"
ENV_RELOAD_S = "PYSERINI_ALIGNER_RELOAD_S"
ENV_MAX_QUERY_CHARS = "PYSERINI_ALIGNER_MAX_QUERY_CHARS"
ENV_CONCURRENCY = "PYSERINI_ALIGNER_CONCURRENCY"  # requests an HTTP worker handles in threads at once
ENV_SOCKETS = "PYSERINI_ALIGNER_SEARCH_SOCKETS"  # NAME=PATH[,...]: the search process of NAME, started by the parent
BM25_SUFFIX, HYBRID_SUFFIX = ".bm25", ".hybrid"
FILTER_KEYS = ("filter", "filter_field", "values", "docids")  # a search request's filter, in its query object
DEFAULT_BATCH_WAIT_MS = 2.0
DEFAULT_MAX_BATCH = 32
DEFAULT_RELOAD_S = 1.0
DEFAULT_MAX_QUERY_CHARS = 4096


class ConfigError(ValueError):
    """A bad registration or knob; the message names the flag or environment variable."""


class RequestError(ValueError):
    """A request the server refuses; ``status`` is its HTTP status (a ValueError, as Pyserini's routes expect)."""

    status = 422


class BadFilter(RequestError):
    """A search request's filter that is malformed or that the index can't evaluate (a field it does not store)."""

    status = 400


class UnknownIndex(RequestError):
    status = 404


class NotFound(RequestError):
    status = 404


@dataclasses.dataclass
class ServeConfig:
    """Indexes by name (AligneR index folders; Lucene indexes paired with them; qrels specs for eval_hits) and the
    knobs: the search device, how long a batch waits for more queries (ms) and its size bound, how often the
    manifests are polled for a new generation (seconds, 0: never) and the longest query accepted (characters)."""

    indexes: dict[str, str] = dataclasses.field(default_factory=dict)
    bm25: dict[str, str] = dataclasses.field(default_factory=dict)
    qrels: dict[str, str] = dataclasses.field(default_factory=dict)
    device: str = "cpu"
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS
    max_batch: int = DEFAULT_MAX_BATCH
    reload_s: float = DEFAULT_RELOAD_S
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
    sockets: dict[str, str] = dataclasses.field(default_factory=dict)  # index name -> its search process's socket

    def check(self, source: dict[str, str] | None = None) -> "ServeConfig":
        """Raise ConfigError naming the flag (``source``: field -> its flag or variable) for a bad entry."""
        from pyserini_aligner.index.format import is_index

        where = {"indexes": "--index", "bm25": "--bm25", "qrels": "--qrels", "batch_wait_ms": "--batch-wait-ms",
                 "max_batch": "--max-batch", "reload_s": "--reload-interval",
                 "max_query_chars": "--max-query-chars", **(source or {})}
        for name, path in self.indexes.items():
            check_name(name, where["indexes"])
            if not is_index(path):
                raise ConfigError(f"{where['indexes']} {name}={path}: not a pyserini-aligner index folder (no "
                                  "manifest.json of this package)")
        for field in ("bm25", "qrels"):
            for name, path in getattr(self, field).items():
                if name not in self.indexes:
                    raise ConfigError(f"{where[field]} {name}={path}: no AligneR index {name!r} is registered "
                                      f"(registered: {', '.join(self.indexes) or 'none'})")
                if not Path(path).exists() and field == "bm25":
                    raise ConfigError(f"{where[field]} {name}={path}: no such Lucene index folder")
                problem = lucene_index_problem(path, f"{where['indexes']} {name}={path}", where[field]) \
                    if field == "bm25" else None
                if problem:
                    raise ConfigError(f"{where[field]} {name}={path} {problem}")
        for field, low in (("batch_wait_ms", 0.0), ("max_batch", 1), ("reload_s", 0.0), ("max_query_chars", 1)):
            if not getattr(self, field) >= low:
                raise ConfigError(f"{where[field]} must be >= {low}, got {getattr(self, field)}")
        return self

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "ServeConfig":
        """The configuration the ``PYSERINI_ALIGNER_*`` variables describe (defaults for those unset)."""
        env = os.environ if environ is None else environ
        numbers = {}
        for field, variable, kind in (("batch_wait_ms", ENV_BATCH_WAIT_MS, float), ("max_batch", ENV_MAX_BATCH, int),
                                      ("reload_s", ENV_RELOAD_S, float),
                                      ("max_query_chars", ENV_MAX_QUERY_CHARS, int)):
            if env.get(variable, "").strip():
                try:
                    numbers[field] = kind(env[variable])
                except ValueError:
                    raise ConfigError(f"{variable}: expected a number, got {env[variable]!r}") from None
        config = cls(indexes=parse_pairs(env.get(ENV_INDEXES, ""), ENV_INDEXES),
                     bm25=parse_pairs(env.get(ENV_BM25, ""), ENV_BM25),
                     qrels=parse_pairs(env.get(ENV_QRELS, ""), ENV_QRELS),
                     device=env.get(ENV_DEVICE, "").strip() or "cpu",
                     sockets=parse_pairs(env.get(ENV_SOCKETS, ""), ENV_SOCKETS), **numbers)
        return config.check({"indexes": ENV_INDEXES, "bm25": ENV_BM25, "qrels": ENV_QRELS,
                             "batch_wait_ms": ENV_BATCH_WAIT_MS, "max_batch": ENV_MAX_BATCH,
                             "reload_s": ENV_RELOAD_S, "max_query_chars": ENV_MAX_QUERY_CHARS})

    def environment(self) -> dict[str, str]:
        """The ``PYSERINI_ALIGNER_*`` variables that describe this configuration (:meth:`from_env` reads it back)."""
        def pairs(mapping: dict[str, str]) -> str:
            return ",".join(f"{name}={path}" for name, path in mapping.items())

        return {ENV_INDEXES: pairs(self.indexes), ENV_BM25: pairs(self.bm25), ENV_QRELS: pairs(self.qrels),
                ENV_DEVICE: self.device, ENV_BATCH_WAIT_MS: repr(self.batch_wait_ms),
                ENV_MAX_BATCH: str(self.max_batch), ENV_RELOAD_S: repr(self.reload_s),
                ENV_MAX_QUERY_CHARS: str(self.max_query_chars), ENV_SOCKETS: pairs(self.sockets)}


def lucene_index_problem(path: str, as_dense: str, sparse: str) -> str | None:
    """Why ``path`` can't be searched with BM25 (the sparse index of ``pyserini.search.hybrid``, ``--bm25`` here),
    or None: an AligneR index (``as_dense``: how to give it as the dense index instead; ``sparse``: where the Lucene
    index goes) or a folder that holds no Lucene index (Lucene would raise a Java IndexNotFoundException)."""
    from pyserini_aligner.index.format import is_index

    if is_index(path):
        return f"is an AligneR index; give it as the dense index ({as_dense}) and a Lucene index as {sparse}"
    if Path(path).is_dir() and not any(Path(path).glob("segments_*")):
        return "is not a Lucene index (it holds no segments_N file); build one with python -m pyserini.index.lucene"
    return None


def check_name(name: str, where: str) -> None:
    """An index name usable in a REST path and not taken by the served suffixes."""
    if not name or any(c in name for c in "/=,?#% ") or name.endswith((BM25_SUFFIX, HYBRID_SUFFIX)):
        raise ConfigError(f"{where}: bad index name {name!r} (no '/', '=', ',', '?', '#', '%' or spaces, and not "
                          f"ending in {BM25_SUFFIX} or {HYBRID_SUFFIX})")


def parse_pair(text: str, where: str) -> tuple[str, str]:
    """("NAME", "PATH") from "NAME=PATH"."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ConfigError(f"{where}: expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def parse_pairs(text: str, where: str) -> dict[str, str]:
    """{NAME: PATH} from "NAME=PATH[,NAME=PATH...]" (empty: none); a name given twice is an error."""
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, path = parse_pair(item, where)
        if name in pairs:
            raise ConfigError(f"{where}: index name {name!r} given twice")
        pairs[name] = path
    return pairs


_CURRENT: list[ServeConfig] = []


def configure(config: ServeConfig) -> None:
    """Serve ``config`` (called by ``python -m pyserini_aligner.serve`` before Pyserini's server is imported)."""
    _CURRENT[:] = [config]


def current() -> ServeConfig:
    """The configuration given to :func:`configure`, else the one of the environment variables."""
    if not _CURRENT:
        _CURRENT.append(ServeConfig.from_env())
    return _CURRENT[0]

"""What the start-up import hook does to Pyserini's modules (see ``pyserini_aligner._startup``)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from types import CodeType, ModuleType
from typing import TYPE_CHECKING

from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.cli import (ERROR_EXIT, INTERRUPTED_EXIT, USAGE_EXIT, UsageError, flag_value, one_line,
                                  search_filter)
from pyserini_aligner.pyserini_patches import filtered
from pyserini_aligner.pyserini_patches.filtered import FILTER_FLAGS

if TYPE_CHECKING:
    from pyserini_aligner.filters import Filter

MANIFEST = "manifest.json"
FORMAT_NAME = "pyserini-aligner"
CHECKPOINT_CONFIG = "config.json"
_CHECKPOINT_KEYS = frozenset({"format_version", "backbone", "dim"})  # what every AligneR config.json holds
_OPENAI_PLACEHOLDER = "unset-openai-api-key"
_HUB_CONFIG = "config.json"  # a Hugging Face model in the local cache has it
# AlignerSearcher keywords that Pyserini's --max-length sets (see guard_pyserini_main): applied to the AligneR
# searchers that FaissSearcher(...) builds in this process
_SEARCHER_KNOBS: dict[str, int] = {}
HELP_NOTE = ("pyserini-aligner: --encoder aligner (or aligner-mix, or an AligneR checkpoint folder) searches an "
             "AligneR index built by python -m pyserini_aligner.index; with it, --max-length sets the tokens per "
             "query (default: the model's query length, 64 for the shipped checkpoints). The alignment and "
             "pruning knobs: python -m pyserini_aligner.search --help")

# Flags of ``python -m pyserini.search.lucene`` (and ``pyserini.search``) that choose or tune Lucene's own ranking
# (BM25 and its parameters, RM3, Rocchio, QLD, impact and dense Lucene indexes, PRCL, analysers, field weights,
# dismax) or de-duplicate hits (AligneR's hits are unique documents already). They mean nothing for an AligneR
# index: when that CLI hands an AligneR --index to the plugin, they are dropped with one warning line. Any other
# flag the plugin does not know is an error. Flag -> number of values it takes ("+": one or more).
LUCENE_ONLY_FLAGS: dict[str, int | str] = {
    "--bm25": 0, "--k1": 1, "--b": 1, "--bm25qs": 0, "--qld": 0, "--rm3": 0, "--rocchio": 0,
    "--rocchio-use-negative": 0, "--impact": 0, "--min-idf": 1, "--encoded-corpus": 1, "--onnx-encoder": 1,
    "--dense": 0, "--hnsw": 0, "--flat": 0, "--ef-search": 1, "--prcl": "+", "--prcl.vectorizer": 1,
    "--prcl.r": 1, "--prcl.n": 1, "--prcl.alpha": 1, "--language": 1, "--pretokenized": 0, "--tokenizer": 1,
    "--stopwords": 1, "--fields": "+", "--dismax": 0, "--dismax.tiebreaker": 1, "--remove-duplicates": 0,
}

# Query-encoder flags of ``python -m pyserini.search.faiss`` (and the dense section of ``hybrid``) that an AligneR
# encoder has no use for: it keeps one unit vector per query token (no pooling, no normalisation to ask for), adds
# its own query marker (no prefix) and uses its model's tokenizer. With AligneR in the path they are named in one
# warning line; the run is the one without them. Flag -> number of values it takes.
ALIGNER_IGNORED_FLAGS: dict[str, int | str] = {"--query-prefix": 1, "--pooling": 1, "--l2-norm": 0, "--tokenizer": 1}


def is_aligner_index(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding a pyserini-aligner index manifest."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def is_aligner_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder whose ``config.json`` is an AligneR model config (whatever the folder's name)."""
    config = Path(path) / CHECKPOINT_CONFIG
    if not config.is_file():
        return False
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and _CHECKPOINT_KEYS <= data.keys()


def split_lucene_only(argv: list[str], flags: dict[str, int | str] = LUCENE_ONLY_FLAGS
                      ) -> tuple[list[str], list[str]]:
    """``argv`` less the ``flags`` (LUCENE_ONLY_FLAGS) and their values, and what was taken out."""
    kept, dropped, position = [], [], 0
    while position < len(argv):
        arg = argv[position]
        name, has_value = arg.split("=", 1)[0], "=" in arg
        arity = flags.get(name)
        if arity is None:
            kept.append(arg)
            position += 1
            continue
        end = position + 1
        if not has_value:
            if arity == "+":
                while end < len(argv) and not argv[end].startswith("--"):
                    end += 1
            else:
                end = min(position + 1 + arity, len(argv))
        dropped += argv[position:end]
        position = end
    return kept, dropped


def take_filter(argv: list[str]) -> tuple[list[str], Filter | None]:
    """``argv`` less the filter flags (in any section of ``hybrid``), and their Filter (None without them);
    UsageError naming the flag and the token for a malformed filter or a flag without its value."""
    from pyserini_aligner.filters import FilterError

    kept, taken = split_lucene_only(argv, FILTER_FLAGS)
    if not taken:
        return kept, None
    text, field = flag_value(taken, "--filter"), flag_value(taken, "--filter-field")
    for flag, value in (("--filter", text), ("--filter-field", field)):
        if value is None and any(arg.split("=", 1)[0] == flag for arg in taken):
            raise UsageError(f"{flag}: expected one value")
    if text is None:
        raise UsageError("--filter-field goes with --filter @FILE")
    try:
        return kept, search_filter(text, field)
    except FilterError as error:
        raise UsageError(f"--filter: {one_line(error)}") from None


@contextlib.contextmanager
def _openai_key_placeholder():
    """Pyserini builds an OpenAI client at import time, which raises without a key: lend one briefly."""
    if os.environ.get("OPENAI_API_KEY"):
        yield
        return
    os.environ["OPENAI_API_KEY"] = _OPENAI_PLACEHOLDER
    try:
        yield
    finally:
        os.environ.pop("OPENAI_API_KEY", None)


def _aligner_query_encoder(encoder_dir: str = "aligner", device: str = "cpu", fp16: bool = False, **_ignored):
    """Factory in Pyserini's ``query_encoder_class_map``: ``--encoder aligner`` (or a checkpoint folder)."""
    from pyserini_aligner.encoders import AlignerQueryEncoder

    return AlignerQueryEncoder(encoder_dir, device=device, fp16=fp16)


def _aligner_document_encoder(encoder_dir: str = "aligner", device: str = "cpu", fp16: bool = False, **_ignored):
    from pyserini_aligner.encoders import AlignerDocumentEncoder

    return AlignerDocumentEncoder(encoder_dir, device=device, fp16=fp16)


def register_encoders(encode: ModuleType) -> None:
    """Add ``aligner`` to Pyserini's encoder maps (looked up by keyword in ``--encoder``)."""
    encode.query_encoder_class_map.setdefault("aligner", _aligner_query_encoder)
    encode.document_encoder_class_map.setdefault("aligner", _aligner_document_encoder)


def register_checkpoint_encoders(encode: ModuleType, folders: list[str]) -> None:
    """Make each AligneR checkpoint folder in ``folders`` an ``--encoder`` of Pyserini's CLIs whatever its name.

    Pyserini picks the encoder class of ``--encoder NAME`` by the first key of its encoder map found inside
    ``NAME.lower()``; the folder's own name goes first in the map, so that a key such as "ance" inside the path
    can't win.
    """
    for encoder_map, factory in ((encode.query_encoder_class_map, _aligner_query_encoder),
                                 (encode.document_encoder_class_map, _aligner_document_encoder)):
        others = [(key, value) for key, value in encoder_map.items() if key not in {f.lower() for f in folders}]
        encoder_map.clear()
        encoder_map.update({folder.lower(): factory for folder in folders})
        encoder_map.update(others)


def _is_aligner_encoder(encoder) -> bool:
    """An AligneR query encoder object, or a name Pyserini would make one of (a shipped checkpoint, a folder)."""
    if isinstance(encoder, (str, os.PathLike)):
        return str(encoder) in SHIPPED or is_aligner_checkpoint(encoder)
    return type(encoder).__module__ == "pyserini_aligner.encoders"


def missing_index(where: str) -> str:
    """The error for an index folder that does not exist (``where``: its flag or argument and its value)."""
    return f"{where}: no such folder (an AligneR index is a folder written by python -m pyserini_aligner.index)"


def patch_faiss_searcher(searcher_module: ModuleType) -> None:
    """Make ``FaissSearcher(<aligner index>, encoder)`` return an ``AlignerSearcher`` (searching with the command's
    ``--filter``: :func:`.filtered.filtered_dense`); other indexes are untouched,
    except that an AligneR (multi-vector) query encoder on a plain FAISS index raises a clear ValueError."""
    faiss_searcher = searcher_module.FaissSearcher

    def __new__(cls, index_dir=None, *args, **kwargs):
        if cls is faiss_searcher and isinstance(index_dir, (str, os.PathLike)) and is_aligner_index(index_dir):
            from pyserini_aligner.search.searcher import AlignerSearcher

            return filtered.filtered_dense(
                AlignerSearcher.from_pyserini(index_dir, *args, **{**_SEARCHER_KNOBS, **kwargs}))
        aligner_encoder = _is_aligner_encoder(args[0] if args else kwargs.get("query_encoder"))
        if aligner_encoder and isinstance(index_dir, (str, os.PathLike)) and not Path(index_dir).exists():
            raise ValueError(missing_index(f"index_dir {str(index_dir)!r}"))
        if aligner_encoder:
            raise ValueError(f"{index_dir} is not a pyserini-aligner index: the aligner encoder gives one vector per "
                             "token and needs an index built by python -m pyserini_aligner.index (a plain FAISS "
                             "index needs a single-vector --encoder)")
        return object.__new__(cls)

    faiss_searcher.__new__ = __new__


def _argv_indexes() -> list[str]:
    argv = sys.argv[1:]
    found = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--index"]
    return found + [arg.split("=", 1)[1] for arg in argv if arg.startswith("--index=")]


def _argv_encoders() -> list[str]:
    argv = sys.argv[1:]
    found = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--encoder"]
    return found + [arg.split("=", 1)[1] for arg in argv if arg.startswith("--encoder=")]


def _argv_checkpoints() -> list[str]:
    """The --encoder values that are AligneR checkpoint folders."""
    return [encoder for encoder in _argv_encoders() if is_aligner_checkpoint(encoder)]


def _argv_uses_aligner() -> bool:
    """An AligneR index among the --index flags, --encoder with a shipped checkpoint's name (aligner, aligner-mix)
    or an AligneR checkpoint folder (hybrid runs have two --index flags)."""
    return (any(encoder in SHIPPED for encoder in _argv_encoders()) or bool(_argv_checkpoints())
            or any(is_aligner_index(index) for index in _argv_indexes()))


def _argv_misspelt_index(name: str) -> bool:
    """The dense --index of ``python -m pyserini.search.faiss`` / ``hybrid`` (``name``) names neither a path nor one
    of Pyserini's prebuilt FAISS indexes (a misspelt folder, AligneR's or not): Pyserini would fail on it with a
    traceback, or print "Unrecognized index name" and exit 0, leaving an earlier run in place."""
    argv = sys.argv[1:]
    if name == "pyserini.search.hybrid.__main__":
        argv = command_sections(argv, ("dense", "sparse", "fusion", "run")).get("dense", [])
    index = flag_value(argv, "--index")
    if index is None or Path(index).exists():
        return False
    from pyserini.prebuilt_index_info import FAISS_INDEX_INFO

    return index not in FAISS_INDEX_INFO and index not in _PYSERINI_FAISS_ALIASES


def _asks_help() -> bool:
    return any(arg in ("-h", "--help") for arg in sys.argv[1:])


def command_sections(argv: list[str], names: tuple[str, ...]) -> dict[str, list[str]]:
    """``argv`` of a Pyserini command line with sub-commands (``hybrid``: dense, sparse, fusion, run) split as
    Pyserini splits it: each sub-command's arguments under its name, those before the first under ""."""
    sections, current = {"": []}, ""
    for arg in argv:
        if arg in names:
            current = arg
            sections[current] = []
        else:
            sections[current].append(arg)
    return sections


def in_hub_cache(name: str) -> bool:
    """Whether ``name`` is a Hugging Face model id whose config is in the local cache (no network access)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, _HUB_CONFIG), str)
    except (ImportError, ValueError):  # an id the hub would refuse (HFValidationError is a ValueError)
        return False


def check_search_flags(name: str, argv: list[str]) -> dict[str, int]:
    """Check the flags of ``python -m pyserini.search.faiss`` / ``hybrid`` (``name``) with AligneR in the path
    before anything loads, and return the AlignerSearcher knobs they set (``--max-length``: ``query_max_length``).

    UsageError for: a dense --index that is no folder (Pyserini would take it for a prebuilt index name, print
    "Unrecognized index name" and exit 0); an --encoder for an AligneR index that is neither a shipped checkpoint,
    a folder nor a model in the local Hugging Face cache (Pyserini would retry the hub for a minute); a sparse
    --index of ``hybrid`` that is an AligneR index or a folder that holds no Lucene index; a --max-length below 3.
    """
    hybrid = name == "pyserini.search.hybrid.__main__"
    sections = command_sections(argv, ("dense", "sparse", "fusion", "run")) if hybrid else {"dense": argv}
    dense, sparse = sections.get("dense", []), sections.get("sparse", [])
    where = "dense " if hybrid else ""
    index, encoder = flag_value(dense, "--index"), flag_value(dense, "--encoder")
    if index is not None and not Path(index).exists():
        raise UsageError(missing_index(f"{where}--index {index}"))
    if (index is not None and is_aligner_index(index) and encoder is not None and encoder not in SHIPPED
            and not Path(encoder).is_dir() and not in_hub_cache(encoder)):
        raise UsageError(f"{where}--encoder {encoder}: not a shipped AligneR checkpoint ({', '.join(SHIPPED)}), "
                         "a checkpoint folder or a model in the local Hugging Face cache")
    sparse_index = flag_value(sparse, "--index")
    if sparse_index is not None:
        from pyserini_aligner.serve.config import lucene_index_problem

        problem = lucene_index_problem(sparse_index, f"dense --index {sparse_index} --encoder aligner",
                                       "the sparse one")
        if problem:
            raise UsageError(f"sparse --index {sparse_index} {problem}")
    knobs: dict[str, int] = {}
    max_length = flag_value(dense, "--max-length")
    if max_length is not None and (encoder in SHIPPED or is_aligner_checkpoint(encoder or "")
                                   or (index is not None and is_aligner_index(index))):
        if not max_length.isdigit() or int(max_length) < 3:
            raise UsageError(f"{where}--max-length {max_length}: the tokens per query must be an integer >= 3 (two "
                             "special tokens and one word)")
        knobs["query_max_length"] = int(max_length)
    return knobs


def index_model_name(index: str) -> str:
    """The model an AligneR index was built with, as its manifest records it ("" for an in-memory model)."""
    try:
        name = json.loads((Path(index) / MANIFEST).read_text(encoding="utf-8")).get("model_name")
    except (OSError, ValueError, AttributeError):
        return ""
    return name if isinstance(name, str) else ""


def complete_aligner_flags(name: str, argv: list[str]) -> list[str]:
    """``argv`` of ``python -m pyserini.search.faiss`` / ``hybrid`` (``name``) with AligneR in the path, completed:
    without ``--encoder`` (and without ``--encoded-queries``), an AligneR dense index is searched with the model it
    records, as ``--encoder <model>`` (one note on stderr; Pyserini alone looks for pre-encoded queries of the topics
    and fails); query-encoder flags that an AligneR encoder ignores (:data:`ALIGNER_IGNORED_FLAGS`) are named in one
    warning line. UsageError for ``--encoded-queries`` with an AligneR index (its queries are encoded per token by
    the index's model)."""
    hybrid = name == "pyserini.search.hybrid.__main__"
    sections = command_sections(argv, ("dense", "sparse", "fusion", "run")) if hybrid else {"dense": argv}
    dense, where = sections.get("dense", []), "dense " if hybrid else ""
    index, encoder = flag_value(dense, "--index"), flag_value(dense, "--encoder")
    aligner_index = index is not None and is_aligner_index(index)
    if aligner_index and flag_value(dense, "--encoded-queries") is not None:
        raise UsageError(f"{where}--encoded-queries: an AligneR index is searched with one vector per query token, "
                         "encoded by its own model from the query text; leave --encoded-queries out")
    if aligner_index and encoder is None:
        encoder = index_model_name(index)
        if not encoder:
            raise UsageError(f"{where}--index {index} records no model name (built with an in-memory model): give "
                             "--encoder with the checkpoint folder it was built with")
        print(f"pyserini-aligner: {where}--encoder {encoder}, the model index {index} was built with",
              file=sys.stderr)
        at = argv.index("dense") + 1 if hybrid else len(argv)
        argv = [*argv[:at], "--encoder", encoder, *argv[at:]]
    if aligner_index or (encoder is not None and _is_aligner_encoder(encoder)):
        _, ignored = split_lucene_only(dense, ALIGNER_IGNORED_FLAGS)
        if ignored:
            import shlex

            print(f"warning: ignoring flags that do not apply to the AligneR encoder: {shlex.join(ignored)}",
                  file=sys.stderr)
    return argv


# names that FaissSearcher.from_prebuilt_index maps to prebuilt indexes besides those of FAISS_INDEX_INFO
_PYSERINI_FAISS_ALIASES = ("msmarco-passage-tct_colbert-hnsw", "wikipedia-dpr-dkrr-nq")
_PYSERINI_MAIN: dict[str, CodeType] = {}  # Pyserini's own __main__ code, run under guard_pyserini_main
_GUARDED_MAINS = ("pyserini.search.faiss.__main__", "pyserini.search.hybrid.__main__")
_STUB = "from pyserini_aligner.pyserini_patches.hooks import {function} as _aligner_main\n_aligner_main({args})"


def main_code(name: str, inner) -> CodeType | None:
    """Code that ``python -m <name>`` should run instead of Pyserini's, or None to run Pyserini's.

    - ``pyserini.search.lucene`` with an AligneR ``--index``: the plugin's search CLI (:func:`run_plugin_search`), its
      exit status kept;
    - ``pyserini.search`` (deprecated alias): the same interpreter (``sys.executable``) runs
      ``pyserini.search.lucene`` and its exit status is passed on (Pyserini runs a bare ``python`` and drops it);
    - ``pyserini.search.faiss`` / ``hybrid`` with an AligneR index or encoder, or a dense index that does not exist
      (:func:`_argv_misspelt_index`): Pyserini's code under
      :func:`guard_pyserini_main`; with ``--help``, Pyserini's help and a line on the ``aligner`` encoder
      (:func:`pyserini_help`);
    - ``pyserini.encode`` with an AligneR encoder: refused (:func:`refuse_pyserini_encode`).
    """
    if name == "pyserini.search.lucene.__main__":
        indexes = _argv_indexes()
        if indexes and is_aligner_index(indexes[0]):
            return compile(_STUB.format(function="run_plugin_search", args=""), "<pyserini-aligner>", "exec")
    elif name == "pyserini.search.__main__":
        return compile(_STUB.format(function="forward_to_lucene", args=""), "<pyserini-aligner>", "exec")
    elif name in _GUARDED_MAINS and (_asks_help() or _argv_uses_aligner() or _argv_misspelt_index(name)):
        _PYSERINI_MAIN[name] = inner.get_code(name)
        function = "pyserini_help" if _asks_help() else "guard_pyserini_main"
        return compile(_STUB.format(function=function, args=f"{name!r}, globals()"), "<pyserini-aligner>", "exec")
    elif name == "pyserini.encode.__main__" and _argv_uses_aligner():
        return compile(_STUB.format(function="refuse_pyserini_encode", args=""), "<pyserini-aligner>", "exec")
    return None


def pyserini_help(name: str, namespace: dict) -> None:
    """``python -m pyserini.search.faiss`` / ``hybrid`` with ``--help``: Pyserini's help, then :data:`HELP_NOTE` and
    the filter flags' note (:data:`.filtered.HELP_NOTE`)."""
    try:
        exec(_PYSERINI_MAIN[name], namespace)
    except SystemExit as stop:
        if stop.code == 0:
            print(f"\n{HELP_NOTE}\n\n{filtered.HELP_NOTE}")
        raise


def refuse_pyserini_encode() -> None:
    """``python -m pyserini.encode ... --encoder aligner``: Pyserini's encoder writes one vector per document, which
    an AligneR model does not give; one line naming the command that builds an AligneR index, exit status 2,
    nothing written."""
    argv = sys.argv[1:]
    encoder = next(e for e in _argv_encoders() if e in SHIPPED or is_aligner_checkpoint(e))
    corpus, target = flag_value(argv, "--corpus") or "<corpus>", flag_value(argv, "--embeddings") or "<index>"
    print(f"error: pyserini.encode writes one vector per document, but the {encoder} encoder gives one per token; "
          f"build an AligneR index with python -m pyserini_aligner.index --corpus {corpus} --index {target} "
          f"--encoder {encoder}", file=sys.stderr)
    sys.exit(USAGE_EXIT)


def run_plugin_search() -> None:
    """``python -m pyserini.search.lucene --index <aligner index> ARGS``: the plugin's search CLI on ARGS less the
    LUCENE_ONLY_FLAGS (named in one warning line); its exit status is this process's."""
    import runpy

    kept, dropped = split_lucene_only(sys.argv[1:])
    if dropped:
        print(f"warning: ignoring Lucene-only flags for an AligneR index: {' '.join(dropped)}", file=sys.stderr)
    sys.argv[1:] = kept
    runpy.run_module("pyserini_aligner.search", run_name="__main__", alter_sys=True)


def forward_to_lucene() -> None:
    """``python -m pyserini.search ARGS``: run ``python -m pyserini.search.lucene ARGS`` with this interpreter and
    exit with its status (Ctrl-C: 130)."""
    import subprocess

    print("WARNING: directly calling pyserini.search is deprecated, please use pyserini.search.lucene instead")
    sys.stdout.flush()
    child = subprocess.Popen([sys.executable, "-m", "pyserini.search.lucene", *sys.argv[1:]])
    try:
        status = child.wait()
    except KeyboardInterrupt:
        child.wait()
        status = INTERRUPTED_EXIT
    sys.exit(status if status >= 0 else 128 - status)


def _atomic_output_writers(output_writer: ModuleType) -> None:
    """Pyserini's run writers (mode "w") write to a temporary file renamed into place when the run completes; the
    TREC and MS MARCO writers refuse a query id or docid that would break a line (:func:`~pyserini_aligner.trec.
    check_run_ids`)."""
    from pyserini_aligner.textio import atomic_output
    from pyserini_aligner.trec import check_run_ids

    for line_writer in (output_writer.TrecWriter, output_writer.MsMarcoWriter):
        if not getattr(line_writer.write, "checks_ids", False):
            line_writer.write = _checking_ids(line_writer.write, check_run_ids)

    writer = output_writer.OutputWriter
    enter, leave = writer.__enter__, writer.__exit__

    def __enter__(self):
        if self.mode != "w":
            return enter(self)
        self._aligner_output = atomic_output(self.file_path)
        self._file = self._aligner_output.__enter__()
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if getattr(self, "_aligner_output", None) is None:
            return leave(self, exc_type, exc_value, traceback)
        self._file.close()
        return self._aligner_output.__exit__(exc_type, exc_value, traceback)

    writer.__enter__, writer.__exit__ = __enter__, __exit__


def _checking_ids(write, check):
    """``write(self, topic, hits)`` of a Pyserini run writer, refusing ids that would break a run line first."""
    def checked(self, topic, hits):
        hits = list(hits)
        check(topic, [hit.docid for hit in hits], self.file_path)
        return write(self, topic, hits)

    checked.checks_ids = True
    return checked


def guard_pyserini_main(name: str, namespace: dict) -> None:
    """Run Pyserini's ``__main__`` code of ``name`` in ``namespace`` with an AligneR index or encoder involved.

    The --output path, the query ids of a TSV --topics file and the flags :func:`check_search_flags` checks are
    checked before any query runs; the run file appears only when complete; a flag that can't work prints one line
    and exits 2 (:class:`UsageError`), a plugin error (ValueError, OSError) one line and exit status 1, Pyserini
    stopping without a searcher (exit() after "Unrecognized index name") exit status 1; Ctrl-C prints
    "interrupted" and exits 130; after a failure no run (not even an earlier one) is left under --output.
    """
    import pyserini.output_writer

    from pyserini_aligner.textio import check_output_path, discard_output
    from pyserini_aligner.topics import TSV_SUFFIXES, check_tsv_qids

    output = flag_value(sys.argv[1:], "--output")
    topics = flag_value(sys.argv[1:], "--topics")
    status: int | str | None = ERROR_EXIT
    hybrid_class = None  # Pyserini's HybridSearcher, while a filtered one stands in for it
    try:
        if output:
            check_output_path(output)
        if topics and Path(topics).suffix.lower() in TSV_SUFFIXES and Path(topics).is_file():
            check_tsv_qids(topics)
        sys.argv[1:], command_filter = take_filter(sys.argv[1:])
        sys.argv[1:] = complete_aligner_flags(name, sys.argv[1:])
        _SEARCHER_KNOBS.update(check_search_flags(name, sys.argv[1:]))
        filtered.activate(command_filter)
        if command_filter is not None and name == "pyserini.search.hybrid.__main__":
            import pyserini.search.hybrid

            hybrid_class = pyserini.search.hybrid.HybridSearcher
            pyserini.search.hybrid.HybridSearcher = filtered.filtered_hybrid_class(hybrid_class)
        _atomic_output_writers(pyserini.output_writer)
        checkpoints = _argv_checkpoints()
        if checkpoints:
            import pyserini.encode

            register_checkpoint_encoders(pyserini.encode, checkpoints)
        exec(_PYSERINI_MAIN[name], namespace)
        status = 0
    except SystemExit as stop:
        if stop.code is not None:
            status = stop.code
            raise
        print("error: Pyserini stopped without a searcher (see its message above)", file=sys.stderr)
    except KeyboardInterrupt:
        status = INTERRUPTED_EXIT
        print("interrupted", file=sys.stderr)
    except UsageError as error:
        status = USAGE_EXIT
        print(f"error: {one_line(error)}", file=sys.stderr)
    except (ValueError, OSError) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
    finally:
        _SEARCHER_KNOBS.clear()  # this command's only
        filtered.activate(None)
        if hybrid_class is not None:
            pyserini.search.hybrid.HybridSearcher = hybrid_class
        if status not in (0, None) and discard_output(output):
            print(f"removed {output}: an earlier run that this failed search did not replace", file=sys.stderr)
    sys.exit(status)


def running_a_command() -> bool:
    """Whether this process runs a command line of Pyserini or of the plugin (``python -m ...``), where an error
    in the set-up of the JVM ends the process with one line, rather than a program or session that imports them,
    which gets the exception."""
    if sys.argv[:1] == ["-m"]:  # python -m, while the module's packages are imported
        return True
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name.split(".")[0] in ("pyserini", "pyserini_aligner")


def exec_hooked(name: str, inner, module: ModuleType) -> None:
    """Execute a hooked module with its hook around it."""
    if name == "pyserini.search":
        from pyserini_aligner.pyserini_patches import help_cache

        command = help_cache.help_request()
        if command and help_cache.print_cached(command):
            sys.exit(0)
        if command:
            help_cache.record(command)
        if running_a_command() and _argv_uses_aligner():  # before torch and faiss load: see _startup.quiet_openmp
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if name == "jnius":
        from pyserini_aligner.jvm import prepare_jvm

        try:
            prepare_jvm()
        except (ValueError, RuntimeError) as error:  # a bad PYSERINI_ALIGNER_JVM_HEAP (2), no Java 21+ (1)
            if not running_a_command():
                raise
            print(f"error: {error}", file=sys.stderr)
            sys.exit(USAGE_EXIT if isinstance(error, ValueError) else ERROR_EXIT)
    if name == "pyserini.encode._openai":
        with _openai_key_placeholder():
            inner.exec_module(module)
        return
    if name.startswith("pyserini.server.") or name == "pyserini.encode.optional._uniir":
        from pyserini_aligner.pyserini_patches.server import exec_server_module

        exec_server_module(name, inner, module)
        return
    if name == "pyserini.encode" and running_a_command():
        from pyserini_aligner.pyserini_patches.deferred import exec_deferring

        exec_deferring(inner, module)
    else:
        inner.exec_module(module)
    if name == "pyserini.encode":
        register_encoders(module)
    elif name == "pyserini.search.faiss._searcher":
        patch_faiss_searcher(module)

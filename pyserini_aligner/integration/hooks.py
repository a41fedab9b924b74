"""What the start-up import hook does to Pyserini's modules (see ``pyserini_aligner._startup``)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from types import CodeType, ModuleType

MANIFEST = "manifest.json"
FORMAT_NAME = "pyserini-aligner"
_OPENAI_PLACEHOLDER = "unset-openai-api-key"


def is_aligner_index(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding a pyserini-aligner index manifest."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


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


def patch_faiss_searcher(searcher_module: ModuleType) -> None:
    """Make ``FaissSearcher(<aligner index>, encoder)`` return an ``AlignerSearcher``; other indexes are untouched."""
    faiss_searcher = searcher_module.FaissSearcher

    def __new__(cls, index_dir=None, *args, **kwargs):
        if cls is faiss_searcher and isinstance(index_dir, (str, os.PathLike)) and is_aligner_index(index_dir):
            from pyserini_aligner.search.searcher import AlignerSearcher

            return AlignerSearcher.from_pyserini(index_dir, *args, **kwargs)
        return object.__new__(cls)

    faiss_searcher.__new__ = __new__


def _argv_index() -> str | None:
    argv = sys.argv[1:]
    for position, arg in enumerate(argv):
        if arg == "--index" and position + 1 < len(argv):
            return argv[position + 1]
        if arg.startswith("--index="):
            return arg.split("=", 1)[1]
    return None


def main_code(name: str, inner) -> CodeType | None:
    """Code that ``python -m <name>`` should run instead of Pyserini's, or None to run Pyserini's."""
    if name == "pyserini.search.lucene.__main__":
        index = _argv_index()
        if index and is_aligner_index(index):
            return compile("from pyserini_aligner.search.__main__ import main\nmain()", "<pyserini-aligner>", "exec")
    return None


def exec_hooked(name: str, inner, module: ModuleType) -> None:
    """Execute a hooked module with its hook around it."""
    if name == "jnius":
        from pyserini_aligner.jvm import prepare_jvm

        prepare_jvm()
    if name == "pyserini.encode._openai":
        with _openai_key_placeholder():
            inner.exec_module(module)
        return
    inner.exec_module(module)
    if name == "pyserini.encode":
        register_encoders(module)
    elif name == "pyserini.search.faiss._searcher":
        patch_faiss_searcher(module)

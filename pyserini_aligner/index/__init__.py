"""Multi-vector AligneR index: streaming builder, on-disk layout and corpus readers."""
from pyserini_aligner.index.builder import build_index, derive_index, faiss_factory_string
from pyserini_aligner.index.corpus import CorpusError, Location, read_corpus, read_json_collection
from pyserini_aligner.index.options import BuildOptions
from pyserini_aligner.index.store import (IndexFormatError, Manifest, StoredIndex, Workspace, read_manifest,
                                          set_default_strategy)

__all__ = ["BuildOptions", "build_index", "derive_index", "faiss_factory_string", "CorpusError", "Location",
           "read_corpus", "read_json_collection", "IndexFormatError", "Manifest", "StoredIndex", "Workspace",
           "read_manifest", "set_default_strategy"]

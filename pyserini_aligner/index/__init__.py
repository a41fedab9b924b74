"""Multi-vector AligneR index: streaming builder, on-disk layout and corpus readers."""
from pyserini_aligner.index.builder import build_index, derive_index
from pyserini_aligner.index.commit import set_default_strategy
from pyserini_aligner.index.corpus import CorpusError, Location, read_corpus, read_json_collection
from pyserini_aligner.index.format import IndexFormatError, Manifest, faiss_factory_string, read_manifest
from pyserini_aligner.index.options import BuildOptions
from pyserini_aligner.index.reader import StoredIndex, Workspace

__all__ = ["BuildOptions", "build_index", "derive_index", "faiss_factory_string", "CorpusError", "Location",
           "read_corpus", "read_json_collection", "IndexFormatError", "Manifest", "StoredIndex", "Workspace",
           "read_manifest", "set_default_strategy"]

"""The names that the search package imports from here: read access lives in :mod:`.reader`, the manifest in
:mod:`.format`."""
from pyserini_aligner.index.format import MANIFEST, read_manifest
from pyserini_aligner.index.reader import StoredIndex, Workspace

__all__ = ["MANIFEST", "StoredIndex", "Workspace", "read_manifest"]

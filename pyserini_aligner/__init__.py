"""AligneR multi-vector retrieval for Pyserini."""

__version__ = "0.1.0"

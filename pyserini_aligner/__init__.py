"""AligneR multi-vector retrieval for Pyserini.

Importing the package installs the same start-up hook as ``pyserini_aligner.pth`` (Java >= 21 for
Pyserini's JVM, ``aligner`` encoders and indexes in Pyserini's command lines).
"""
from pyserini_aligner import _startup  # noqa: F401  (installs the import hook)

__version__ = "0.1.0"

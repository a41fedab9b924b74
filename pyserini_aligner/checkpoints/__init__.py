"""Shipped AligneR checkpoints (folders loadable with AlignerModel.from_pretrained), by name.

- ``aligner``: the default; trained on SciFact and NFCorpus train with top-k:1 alignment.
- ``aligner-mix``: ``aligner`` trained further under a mix of top-k:1 and top-p alignments, so that top-p (and the
  alignment ``pyserini_aligner.adapt`` chooses) keeps working with it.

Kept free of heavy imports: the start-up hook reads the names.
"""
from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
SHIPPED = {"aligner": _HERE / "aligner", "aligner-mix": _HERE / "aligner_mix"}


def checkpoint_folder(name_or_path: str | os.PathLike) -> Path:
    """The folder of a shipped checkpoint's name (SHIPPED), else ``name_or_path`` as a path."""
    return SHIPPED.get(str(name_or_path), Path(name_or_path))

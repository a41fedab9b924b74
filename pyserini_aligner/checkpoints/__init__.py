"""Shipped AligneR checkpoints (folders loadable with AlignerModel.from_pretrained), by name.

Every folder here with a ``config.json`` is a shipped checkpoint, named after the folder with ``_`` written ``-``
(``aligner_mix`` is ``aligner-mix``); ``aligner`` comes first, the others in name order. Today:

- ``aligner``: the default; trained on SciFact and NFCorpus train with top-k:1 alignment.
- ``aligner-384``: the same training in the backbone's own 384-d token space (identity projection, weights 0.7 of the
  way from the untrained backbone), chosen for collections unlike the training ones.
- ``aligner-mix``: ``aligner`` trained further under a mix of top-k:1 and top-p alignments, so that top-p (and the
  alignment ``pyserini_aligner.adapt`` chooses) keeps working with it.

Kept free of heavy imports: the start-up hook reads the names.
"""
from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent
DEFAULT_NAME = "aligner"


def _shipped(folder: Path) -> dict[str, Path]:
    """Name -> folder of every checkpoint folder in ``folder`` (one holding a config.json), the default first."""
    found = {entry.name.replace("_", "-"): Path(entry.path) for entry in os.scandir(folder)
             if entry.is_dir() and os.path.isfile(os.path.join(entry.path, "config.json"))}
    return dict(sorted(found.items(), key=lambda item: (item[0] != DEFAULT_NAME, item[0])))


SHIPPED = _shipped(_HERE)


def checkpoint_folder(name_or_path: str | os.PathLike) -> Path:
    """The folder of a shipped checkpoint's name (SHIPPED), else ``name_or_path`` as a path."""
    return SHIPPED.get(str(name_or_path), Path(name_or_path))

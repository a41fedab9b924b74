"""Pruned variants of an index without re-encoding: same stored tokens, another β^d (the paper's index pruning)."""
from __future__ import annotations

import os
from pathlib import Path

from pyserini_aligner.index.format import MANIFEST, Manifest
from pyserini_aligner.index.builder import derive_index


def derive_pruned_index(src_dir: str | os.PathLike, dst_dir: str | os.PathLike, doc_prune: float,
                        index_type: str | None = None, progress: bool = False,
                        overwrite: bool = False, prune_redundancy: float | None | str = "source") -> Manifest:
    """Write ``dst_dir``: the index ``src_dir`` with only the β^d = ``doc_prune`` most salient tokens of each
    document in FAISS (ties by position), rebuilt from its stored vectors and saliences.

    Every stored token stays in the refinement store; ``index_type`` (FAISS factory string) defaults to the
    source's; prune_redundancy: see builder.build_index ("source": the source's). Built in a temporary folder and renamed into place; returns the new manifest.
    """
    if not isinstance(doc_prune, (int, float)) or not 0.0 < float(doc_prune) <= 1.0:
        raise ValueError(f"doc_prune must be in (0, 1], got {doc_prune!r}")
    if not (Path(src_dir) / MANIFEST).is_file():
        raise FileNotFoundError(f"source index not found: {Path(src_dir) / MANIFEST} is missing")
    changes = {} if index_type is None else {"index_type": index_type}
    if prune_redundancy != "source":
        changes["prune_redundancy"] = prune_redundancy
    return derive_index(src_dir, dst_dir, doc_prune=float(doc_prune), progress=progress, overwrite=overwrite,
                        **changes)

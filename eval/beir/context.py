"""What every system of the harness sees: the dataset, where to keep indexes and shared knobs (``Context``)."""
from __future__ import annotations

import argparse

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eval.beir.cache import Hits
from pyserini_aligner.adapt.select import ALPHA, MIN_GAIN
from pyserini_aligner.data import Dataset

log = logging.getLogger(__name__)


@dataclass
class Context:
    """What every system sees: the dataset, where to keep indexes, and shared knobs."""

    dataset: Dataset
    work: Path  # indexes and caches for this dataset
    hits: int = 1000
    threads: int = 2
    progress: bool = True
    encoder: str = "aligner"  # AligneR checkpoint: a shipped name ("aligner", "aligner-mix") or a folder
    dtype: str = "fp32"  # the precision corpora are encoded in: "fp32" or "bf16" (see harness_dtype)
    candidates: int = 100  # aligner hits rescored per query by aligner-adapted to choose a checkpoint and strategy
    adapt_checkpoints: tuple[str, ...] | None = None  # aligner-adapted: the checkpoints tried (None: every shipped one)
    fold_size: int = 8
    alpha: float = ALPHA  # aligner-adapted: significance level a candidate must reach to replace the default
    min_gain: float = MIN_GAIN  # aligner-adapted: and its smallest mean nDCG@10 gain on the fold
    seed: int = 0
    runs: dict[str, Hits] = field(default_factory=dict)  # systems already run (for fusion)
    extras: dict[str, dict] = field(default_factory=dict)  # per system: numbers for results.json

    def _lazy(self, name: str, make: Callable):
        if name not in self.__dict__:
            self.__dict__[name] = make()
        return self.__dict__[name]

    @property
    def queries(self) -> dict[str, str]:
        return self._lazy("_queries", self.dataset.queries)

    @property
    def qrels(self) -> dict[str, dict[str, int]]:
        return self._lazy("_qrels", self.dataset.qrels)

    @property
    def model(self):
        """The AligneR model (loaded once)."""
        from pyserini_aligner.resolve import load_model

        return self._lazy("_model", lambda: load_model(self.encoder))

    def checkpoint(self, encoder: str | None = None):
        """The AligneR model of ``encoder`` (a shipped name or a checkpoint folder; default ``encoder``: ``model``),
        loaded once."""
        if encoder is None or encoder == self.encoder:
            return self.model
        from pyserini_aligner.resolve import load_model

        return self._lazy(f"_model {encoder}", lambda: load_model(encoder))

    @property
    def layers(self):
        """The lower layers of all-MiniLM-L6-v2 that the dense baseline and every checkpoint the run may encode a
        corpus with (``encoder`` and the ``adapt_checkpoints``) have unchanged, computed once per document
        (:class:`~pyserini_aligner.backbone.SharedLayers`), or None when they share none."""
        return self._lazy("_layers", self._shared_layers)

    def _shared_layers(self):
        from eval.beir.dense import minilm_folder
        from pyserini_aligner.backbone import Bert, SharedLayers, load_backbone, part_digests, shared_depth
        from pyserini_aligner.checkpoints import SHIPPED

        base = load_backbone(minilm_folder())
        names = dict.fromkeys([self.encoder, *(self.adapt_checkpoints or SHIPPED)])
        backbones = [self.checkpoint(name).backbone for name in names]
        if not all(isinstance(b, Bert) for b in (base, *backbones)):
            return None
        depth = shared_depth([part_digests(b) for b in (base, *backbones)])
        log.info("the corpus's states after %d of %d backbone layers are computed once for %d models", depth,
                 len(base.encoder.layer), len(backbones) + 1)
        return SharedLayers(base, depth) if depth else None

    @contextmanager
    def sharing(self, backbone):
        """Documents encoded by ``backbone`` in the block take its lower layers from :attr:`layers` where its
        weights there are theirs (else they are computed as usual)."""
        from pyserini_aligner.backbone import Bert

        layers, attached = self.layers, False
        if layers is not None and isinstance(backbone, Bert):
            try:
                backbone.share(layers)
                attached = True
            except ValueError:  # other weights below layer ``depth``
                pass
        try:
            yield
        finally:
            if attached:
                backbone.share(None)

    @property
    def dtype_suffix(self) -> str:
        """What names an index encoded in ``dtype`` apart from the float32 one ("" for fp32)."""
        return "" if self.dtype == "fp32" else f"-{self.dtype}"

    @property
    def fingerprint(self) -> str:
        return self._lazy("_fingerprint", self.model.fingerprint)

    @property
    def strategy(self) -> str:
        """The checkpoint's default strategy: explicit, so that adapting a cached index cannot change the runs."""
        return self.model.config.default_strategy


def harness_dtype(choice: str = "auto") -> str:
    """The precision the harness encodes corpora in: "fp32" or "bf16" as given; "auto": bf16 where the CPU
    computes it natively (:func:`~pyserini_aligner.model.native_bf16`: about twice as fast), else fp32."""
    from pyserini_aligner.model import native_bf16

    if choice not in ("auto", "fp32", "bf16"):
        raise ValueError(f"dtype must be auto, fp32 or bf16, got {choice!r}")
    return ("bf16" if native_bf16() else "fp32") if choice == "auto" else choice


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--cache``, ``--dtype`` and ``--quiet`` flags of a study that reuses the harness's indexes."""
    parser.add_argument("--cache", default=".cache/indexes", help="folder of the harness's indexes")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or info logging")


def study_context(args: argparse.Namespace, **fields) -> Context:
    """The harness's context over ``args.dataset`` in its index folder under ``args.cache``, encoding in
    ``args.dtype``, with progress bars unless ``args.quiet`` (:func:`add_study_arguments`); ``fields``: the
    context's other fields."""
    dataset = Dataset(args.dataset)
    return Context(dataset=dataset, work=work_dir(dataset, args.cache), progress=not args.quiet,
                   dtype=harness_dtype(args.dtype), **fields)


def work_dir(dataset: Dataset, root: str | os.PathLike) -> Path:
    """``<root>/<dataset name with / as _>``: one folder of indexes per corpus."""
    corpus = dataset.name.rsplit("/", 1)[0] if not dataset.folder else dataset.folder.resolve().as_posix()
    return Path(root) / corpus.strip("/").replace("/", "_")

"""How an index is built: one typed, validated object that the builders take (:class:`BuildOptions`), and the
argparse type of its codec flag."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from pyserini_aligner.index.codec_spec import AUTO_CODEC, DEFAULT_PQ_M, FP16, AutoCodec, CodecSpec, codec_choice
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

DEFAULT_INDEX_TYPE = "Flat"
DEFAULT_CODEC = AUTO_CODEC
DEFAULT_DOC_PRUNE = 0.2  # β^d of a corpus of fewer than SCALE_DOCS documents
SCALE_DOC_PRUNE = 0.5  # β^d from SCALE_DOCS documents (see doc_prune_for)
SCALE_DOCS = 50_000
DEFAULT_BATCH_SIZE = 32
DEFAULT_TRAIN_SIZE = 100_000
DTYPES = ("auto", "fp32", "fp16", "bf16")  # the precision documents are encoded in


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class BuildOptions:
    """Every setting of an index build (:func:`.builder.build_index`, :func:`.builder.derive_index`,
    :func:`.distributed.build_distributed`); ValueError naming the field for a value no build can use.

    doc_prune: β^d in (0, 1], the fraction of each document's most salient tokens indexed for candidate generation
    (refinement scores with all tokens); None: by the corpus size (:func:`doc_prune_for`). codec: :data:`.codec.AUTO_CODEC` ("auto": IVF<nlist>,PQ4,Refine(PQ<R>),
    nlist and R from the corpus size and ``max_bytes_per_token``) or a :class:`.codec.CodecSpec`
    (IVF<nlist>,PQ<M>[,Refine(PQ<R>)], or fp16: exact vectors plus a FAISS ``index_type`` index); a codec string
    is parsed here. codec_from: take the trained codec of that compressed index instead of training one (shards,
    updates). prune_redundancy: cosine threshold of redundancy-aware pruning (salience.prune_mask); None: salience
    alone. max_length: tokens per document (None: the model's doc_maxlen). batch_size: documents encoded together;
    device: "cpu", "cuda[:N]" or None (the model's choice). dtype: the precision documents are encoded in, one of
    DTYPES ("auto": the loaded model's, fp16 on a GPU and fp32 on a CPU; "bf16" about halves a CPU's encoding time
    where :func:`~pyserini_aligner.model.native_bf16` holds). max_docs: index only the first N documents. train_size:
    tokens sampled to train the codec's residual codebooks (and a FAISS index), with ``seed``. progress: progress
    bars. overwrite: replace an existing index of this package (never any other folder). model_name: the model name
    the manifest records (None: the encoder's); corpus_name: the corpus it records.
    """

    doc_prune: float | None = None
    codec: CodecSpec | AutoCodec = DEFAULT_CODEC
    index_type: str = DEFAULT_INDEX_TYPE
    max_bytes_per_token: int | None = None  # None: by the dimension and corpus size (default_max_bytes_per_token)
    codec_from: Path | None = None
    prune_redundancy: float | None = DEFAULT_PRUNE_REDUNDANCY
    max_length: int | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    device: str | None = None
    dtype: str = "auto"
    max_docs: int | None = None
    train_size: int = DEFAULT_TRAIN_SIZE
    seed: int = 0
    progress: bool = True
    overwrite: bool = False
    model_name: str | None = None
    corpus_name: str = ""

    def __post_init__(self) -> None:
        try:
            codec = codec_choice(self.codec)
        except (TypeError, ValueError) as error:
            raise ValueError(f"codec: {error}") from None
        object.__setattr__(self, "codec", codec)
        if self.codec_from is not None:
            if not isinstance(self.codec_from, (str, os.PathLike)):
                raise ValueError(f"codec_from must be an index folder, got {self.codec_from!r}")
            object.__setattr__(self, "codec_from", Path(self.codec_from))
        if self.doc_prune is not None and (not _number(self.doc_prune) or not 0.0 < self.doc_prune <= 1.0):
            raise ValueError(f"doc_prune must be None or in (0, 1], got {self.doc_prune!r}")
        if not isinstance(self.index_type, str) or not self.index_type.strip():
            raise ValueError(f"index_type must be a FAISS factory string such as 'Flat' or 'IVF256,Flat', got "
                             f"{self.index_type!r}")
        least = 2 + DEFAULT_PQ_M
        if self.max_bytes_per_token is not None and (not _count(self.max_bytes_per_token)
                                                     or self.max_bytes_per_token < least):
            raise ValueError(f"max_bytes_per_token must be None or an integer >= {least} (a centroid id and a "
                             f"{DEFAULT_PQ_M}-byte residual), got {self.max_bytes_per_token!r}")
        if self.prune_redundancy is not None and (not _number(self.prune_redundancy)
                                                  or not 0.0 < self.prune_redundancy <= 1.0):
            raise ValueError(f"prune_redundancy must be None or a cosine threshold in (0, 1], got "
                             f"{self.prune_redundancy!r}")
        if self.max_length is not None and (not _count(self.max_length) or self.max_length < 2):
            raise ValueError(f"max_length must be None or an integer >= 2 (room for the special tokens), got "
                             f"{self.max_length!r}")
        for name in ("batch_size", "train_size"):
            if not _count(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_docs is not None and (not _count(self.max_docs) or self.max_docs < 1):
            raise ValueError(f"max_docs must be None or an integer >= 1, got {self.max_docs!r}")
        if not _count(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device is not None and not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))  # a torch.device
        for name in ("progress", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.model_name is not None and not isinstance(self.model_name, str):
            raise ValueError(f"model_name must be None or a string, got {self.model_name!r}")
        if not isinstance(self.corpus_name, str):
            raise ValueError(f"corpus_name must be a string, got {self.corpus_name!r}")

    def sized(self, num_docs: int | None) -> "BuildOptions":
        """These options with β^d resolved for a corpus of ``num_docs`` documents (:func:`doc_prune_for`)."""
        return self.replace(doc_prune=doc_prune_for(self.doc_prune, num_docs))

    @property
    def compute(self) -> str | None:
        """The encoding precision to impose on the model (``dtype``), or None to keep the loaded model's."""
        return None if self.dtype == "auto" else self.dtype

    @property
    def fp16(self) -> bool:
        """Whether the tokens are stored as exact float16 vectors (no codec)."""
        return isinstance(self.codec, CodecSpec) and not self.codec.compressed

    def replace(self, **changes) -> "BuildOptions":
        """These options with ``changes`` (field=value), checked again; TypeError naming an unknown field."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown build option(s) {', '.join(unknown)}; the fields of BuildOptions are "
                            f"{', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def of_index(cls, manifest) -> "BuildOptions":
        """The options an fp16 index was built with, as its manifest records them (β^d, FAISS factory string,
        redundancy threshold, tokens per document): where :func:`.builder.derive_index` starts from."""
        return cls(doc_prune=manifest.doc_prune, codec=FP16, index_type=manifest.index_type,
                   prune_redundancy=manifest.prune_redundancy, max_length=manifest.doc_maxlen)


def doc_prune_for(doc_prune: float | None, num_docs: int | None) -> float:
    """β^d of a build: ``doc_prune`` when given; else DEFAULT_DOC_PRUNE (0.2) below SCALE_DOCS documents (or when
    the corpus size is unknown) and SCALE_DOC_PRUNE (0.5) from there. In a large corpus a passage whose best-matching
    tokens were pruned is never reached by the probes, and such passages are most of what the candidates miss: at 1M
    passages 0.5 keeps 0.988 of the top 10 of exhaustive scoring of the codes (0.968 with 0.2) for 5,110 bytes a
    passage instead of 4,937 (eval/results/scale/sweep_1m_doc_prune_h200.md); at BEIR sizes 0.2 already reaches
    nearly all of it."""
    if doc_prune is not None:
        return float(doc_prune)
    return SCALE_DOC_PRUNE if num_docs is not None and num_docs >= SCALE_DOCS else DEFAULT_DOC_PRUNE


def build_options(options: BuildOptions | None = None, base: BuildOptions | None = None,
                  **changes) -> BuildOptions:
    """``options`` (else ``base``, else the defaults) with ``changes``: how the public builders take either one
    BuildOptions or its fields as keyword arguments."""
    return (options or base or BuildOptions()).replace(**changes)


def codec_arg(text: str) -> CodecSpec | AutoCodec:
    """argparse ``type`` of ``--codec``: "auto", "fp16", "IVF<nlist>,PQ<M>" or "IVF<nlist>,PQ<M>,Refine(PQ<R>)"
    (whether the PQ codes split the model's vectors is checked when the model is loaded)."""
    try:
        return codec_choice(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None

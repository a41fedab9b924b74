"""Codec names: how an index stores its token vectors, as FAISS-style factory strings, parsed into typed specs.

- ``fp16``: every token as float16 (2·d bytes); FAISS keeps its own copy of the kept tokens (``index_type``).
- ``IVF<nlist>,PQ<M>``: a residual codec (:mod:`pyserini_aligner.index.codec`): a coarse centroid id and an M-byte
  product-quantised residual per token.
- ``IVF<nlist>,PQ<M>,Refine(PQ<R>)``: the same with a finer R-byte residual code per token for refinement.
- ``auto``: IVF<nlist>,PQ4,Refine(PQ<R>), nlist and R chosen from the corpus size (:func:`resolve_codec`).

A codec string is parsed once where it enters (the ``--codec`` argparse type, :class:`.options.BuildOptions`, the
manifest reader); everything inward takes a :class:`CodecSpec`. Kept free of torch: the manifest reader uses it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

FP16 = "fp16"
AUTO = "auto"  # IVF<nlist>,PQ<DEFAULT_PQ_M>,Refine(PQ<R>): nlist and R chosen from the corpus size
DEFAULT_PQ_M = 4  # bytes of a list entry's code under "auto" (candidate generation)
FINE_CODE_TOKENS = 4_000_000  # "auto": from this many tokens (about 55k passages) residuals of 64 bytes at least
PQ_CENTROIDS = 256  # 8-bit sub-quantizer codes
MIN_POINTS_PER_CENTROID = 32  # "auto": tokens per coarse centroid at least (tiny corpora get few centroids)
SMALL_CORPUS_TOKENS = 50_000  # below this many tokens "auto" warns that fp16 costs little and loses nothing
_SPEC = re.compile(r"IVF(\d+),PQ(\d+)(?:,Refine\(PQ(\d+)\))?")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed codec string: nlist = 0 means fp16 (no compression). pq_m: bytes of an inverted-list entry's code;
    refine_m: bytes of every token's residual code when finer than pq_m (0: the tokens store the pq_m codes).
    ValueError for sizes no codec has; whether PQ<M> and PQ<R> split the vectors is checked by :meth:`check` once
    their dimension is known."""

    nlist: int = 0
    pq_m: int = 0
    refine_m: int = 0

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.nlist, self.pq_m, self.refine_m)):
            raise ValueError(f"codec sizes must be integers, got {self.nlist!r}, {self.pq_m!r}, {self.refine_m!r}")
        if self.nlist == 0:
            if self.pq_m or self.refine_m:
                raise ValueError(f"an fp16 codec (nlist 0) has no PQ codes, got PQ{self.pq_m}")
            return
        if not 2 <= self.nlist <= 65536:
            raise ValueError(f"bad codec {str(self)!r}: nlist must be in [2, 65536] (centroid ids are uint16), got "
                             f"{self.nlist}")
        if self.pq_m < 1 or self.refine_m < 0:
            raise ValueError(f"bad codec {str(self)!r}: PQ<M> needs M >= 1")
        if self.refine_m and self.refine_m <= self.pq_m:
            raise ValueError(f"bad codec {str(self)!r}: the refinement code PQ{self.refine_m} must be finer than "
                             f"PQ{self.pq_m}")

    def check(self, dim: int) -> "CodecSpec":
        """This spec, once its PQ codes split ``dim``-d vectors into equal sub-vectors (else ValueError)."""
        for m in (self.pq_m, self.refine_m) if self.refine_m else (self.pq_m,) if self.compressed else ():
            if dim % m:
                raise ValueError(f"bad codec {str(self)!r}: PQ{m} must split the {dim}-d vectors into equal "
                                 "sub-vectors")
        return self

    @property
    def compressed(self) -> bool:
        return self.nlist > 0

    @property
    def residual_m(self) -> int:
        """Bytes of every stored token's residual code."""
        return self.refine_m or self.pq_m

    @property
    def bytes_per_token(self) -> int:
        """Bytes every stored token costs (centroid id and residual; list entries not counted)."""
        return 2 + self.residual_m if self.compressed else 0

    def __str__(self) -> str:
        if not self.compressed:
            return FP16
        refine = f",Refine(PQ{self.refine_m})" if self.refine_m else ""
        return f"IVF{self.nlist},PQ{self.pq_m}{refine}"


@dataclass(frozen=True)
class AutoCodec:
    """The codec "auto": IVF<nlist>,PQ<DEFAULT_PQ_M>,Refine(PQ<R>) with nlist and R chosen from the corpus size
    when an index is built (:func:`resolve_codec`)."""

    def __str__(self) -> str:
        return AUTO


AUTO_CODEC = AutoCodec()
_FORMS = ("expected 'auto', 'fp16', 'IVF<nlist>,PQ<M>' or 'IVF<nlist>,PQ<M>,Refine(PQ<R>)' (e.g. IVF4096,PQ16 or "
          "IVF4096,PQ4,Refine(PQ32))")


def codec_choice(spec: "str | CodecSpec | AutoCodec") -> "CodecSpec | AutoCodec":
    """The typed codec of "auto", "fp16", "IVF<nlist>,PQ<M>" or "IVF<nlist>,PQ<M>,Refine(PQ<R>)" (2 <= nlist <=
    65536, R > M; a CodecSpec or AutoCodec is returned as it is); ValueError naming the problem. Whether the PQ
    codes split the vectors is checked once their dimension is known (:meth:`CodecSpec.check`)."""
    if isinstance(spec, (CodecSpec, AutoCodec)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"codec must be a string, CodecSpec or AutoCodec, got {type(spec).__name__}")
    text = spec.strip()
    if text.lower() == AUTO:
        return AUTO_CODEC
    if text.lower() == FP16:
        return CodecSpec()
    match = _SPEC.fullmatch(text)
    if not match:
        raise ValueError(f"bad codec {spec!r}: {_FORMS}")
    try:
        return CodecSpec(int(match[1]), int(match[2]), int(match[3] or 0))
    except ValueError as error:  # name the string as given
        raise ValueError(str(error).replace(repr(text), repr(spec), 1)) from None


def parse_codec(spec: "str | CodecSpec", dim: int | None = None) -> CodecSpec:
    """Parse "fp16", "IVF<nlist>,PQ<M>" or "IVF<nlist>,PQ<M>,Refine(PQ<R>)" (see :func:`codec_choice`; M and R
    divide ``dim`` when given); ValueError naming the problem ("auto" is resolved by :func:`resolve_codec` once the
    corpus size is known)."""
    choice = codec_choice(spec)
    if isinstance(choice, AutoCodec):
        raise ValueError("codec 'auto' is resolved from the corpus size when an index is built")
    return choice if dim is None else choice.check(dim)


def choose_nlist(num_tokens: int) -> int:
    """Coarse centroids for a corpus of ``num_tokens`` tokens: the power of two nearest below 16·sqrt(tokens) (as
    PLAID sizes its centroids), in [16, 65536], and at most one per MIN_POINTS_PER_CENTROID tokens, so that k-means
    has points to fit (e.g. 16384 for 1.3M tokens, 65536 from 17M, 8 for 500 tokens; at least 2). Fewer centroids
    leave residuals that 4 PQ bytes cannot carry: on SciFact, 4096 centroids cost about six nDCG@10 points against
    exact vectors."""
    target = 16.0 * float(max(num_tokens, 1)) ** 0.5
    import numpy as np

    nlist = 1 << max(4, min(16, int(np.floor(np.log2(max(target, 1.0))))))
    room = max(num_tokens // MIN_POINTS_PER_CENTROID, 2)
    return max(2, min(nlist, 1 << int(np.floor(np.log2(room)))))


def default_max_bytes_per_token(dim: int, num_tokens: int = 0) -> int:
    """Bytes a token that "auto" stores at most unless told: a 2-byte centroid id and a residual of 2 bits a
    dimension, as ColBERTv2's, never under 32 bytes, and from FINE_CODE_TOKENS tokens never under 64 (4 bits a
    dimension at 128-d): the larger the corpus, the finer the margins that order its top 10. At 1M passages
    (72.5M tokens) exhaustive scoring of 128-d codes keeps 0.959 of the exact top 10 with 64 bytes, 0.917 with 32
    (eval/experiments/results/token_precision, docs/scaling.md); SciFact and NFCorpus (1.3M and 0.5M tokens) lose
    under 0.3 nDCG@10 point with 32."""
    return 2 + max(64 if num_tokens >= FINE_CODE_TOKENS else 32, dim // 4)


def choose_refine_m(dim: int, num_tokens: int, max_bytes_per_token: int | None = None) -> int:
    """Residual bytes per token for "auto": the largest even R dividing ``dim`` with 2 + R <= ``max_bytes_per_token``
    (default :func:`default_max_bytes_per_token` for a corpus of ``num_tokens``), at least DEFAULT_PQ_M. With the
    defaults: 32 bytes at 128-d (PQ32, four dimensions a sub-quantiser) below FINE_CODE_TOKENS tokens, 64 from
    there (two dimensions a sub-quantiser); 96 at 384-d. Fidelity sets the size, not memory: the codes of 8.8M
    passages of 72 tokens at 66 bytes are 42 GB, which one GPU of 80 GB or more holds (several GPUs hold shards of
    them: ``--devices``)."""
    budget = default_max_bytes_per_token(dim, num_tokens) if max_bytes_per_token is None else max_bytes_per_token
    if budget < 2 + DEFAULT_PQ_M:
        raise ValueError(f"max_bytes_per_token must be >= {2 + DEFAULT_PQ_M} (a centroid id and a "
                         f"{DEFAULT_PQ_M}-byte residual), got {budget}")
    fits = [m for m in range(DEFAULT_PQ_M, dim + 1, 2) if dim % m == 0 and 2 + m <= budget]
    return max(fits, default=DEFAULT_PQ_M)


def resolve_codec(spec: "str | CodecSpec | AutoCodec", dim: int, num_tokens: int,
                  max_bytes_per_token: int | None = None) -> CodecSpec:
    """The codec of ``spec`` for ``dim``-d vectors: "auto" becomes IVF<choose_nlist(num_tokens)>,PQ<DEFAULT_PQ_M>,
    Refine(PQ<R>) with R from :func:`choose_refine_m` (plain IVF<nlist>,PQ<DEFAULT_PQ_M> where R is no finer)."""
    choice = codec_choice(spec)
    if isinstance(choice, AutoCodec):
        refine = choose_refine_m(dim, num_tokens, max_bytes_per_token)
        pq_m = min(DEFAULT_PQ_M, dim)
        choice = CodecSpec(choose_nlist(num_tokens), pq_m, refine if refine > pq_m else 0)
    return choice.check(dim)

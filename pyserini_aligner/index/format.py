"""On-disk format of a pyserini-aligner index: its layout, file names and the manifest, read and checked.

An index is a folder of immutable segments sharing one codec, named by ``manifest.json`` (the commit point, in the
manner of Lucene's segment generations). Every change writes new files, then swaps the manifest by an atomic rename,
so a reader sees either the old or the new state, never a mix; an open reader keeps its snapshot.

    <index>/manifest.json        format, model, codec, pruning rule, generation, the segment list and every file's
                                 size and CRC32 (the manifest checks itself with a CRC32 too)
    <index>/codec-<gen>/         compressed indexes: centroids.i8 [nlist, d], scales.f32 [nlist] (centroid = int8 ·
                                 scale), codebooks.f32 [M, 256, d/M], refine_codebooks.f32 [R, 256, d/R] (only
                                 with a refinement tier, ``Refine(PQ<R>)``)
    <index>/seg-<gen>-<id>/      one segment of n documents, T tokens, K kept (the β^d indexed tokens):
        docids.txt               n lines
        doc_offsets.i64          [n+1] document i owns tokens offsets[i] .. offsets[i+1]-1
        deletes-<gen>.bits       tombstones, bit-packed [n] (only after deletions)
        fields.sqlite            the documents' stored fields (only when some document has any): SQLite table
                                 ``fields(row INTEGER PRIMARY KEY, doc TEXT)``, one JSON object per segment row
                                 that has fields (a JsonCollection record's keys besides ``id`` and ``contents``);
                                 the manifest lists the segment's top-level field names (``SegmentInfo.fields``)
      compressed (codec ``IVF<nlist>,PQ<M>`` or ``IVF<nlist>,PQ<M>,Refine(PQ<R>)``):
        token_centroids.u16      [T] coarse centroid of every token
        token_residuals.u8       [T, R] PQ code of every token's residual (R = M without a refinement tier)
        kept.bits                [T] bit-packed kept mask
        ivf_offsets.i64          [nlist+1] inverted lists of the kept tokens: list c is entries offsets[c]..offsets[c+1]-1
        ivf_docs.i32             [K] segment-local document row of each entry
        ivf_codes.u8             [K, M] the entry's residual code
      exact (codec ``fp16``):
        doc_vectors.f16          [T, d]; doc_salience.f32 [T]; kept.bool [T]
        faiss_ids.i64            [K] FAISS label -> segment token position; faiss.index (FAISS ``index_type``)

Small files are checked against their CRC32 whenever the index is opened, larger ones block by block when a process
first opens them (:mod:`.checksums`; indexes written before block checksums leave them unchecked); every file's whole
CRC32 on demand (:meth:`.reader.StoredIndex.verify`, ``python -m pyserini_aligner.index --index DIR --verify``). Commits:
:mod:`.commit`; reading the token data: :mod:`.reader`. Kept free of numpy and torch: the manifest is read
before any of them is needed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from pyserini_aligner.index.codec_spec import CodecSpec, parse_codec
from pyserini_aligner.strategy import Strategy, parse_strategy

FORMAT_NAME = "pyserini-aligner"  # also read by pyserini_aligner.pyserini_patches.hooks.is_aligner_index
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LOCK = "write.lock"
DOCIDS = "docids.txt"
FIELDS = "fields.sqlite"
OFFSETS = "doc_offsets.i64"
VECTORS = "doc_vectors.f16"
SALIENCE = "doc_salience.f32"
KEPT = "kept.bool"
FAISS_IDS = "faiss_ids.i64"
FAISS_INDEX = "faiss.index"
TOKEN_CENTROIDS = "token_centroids.u16"
TOKEN_RESIDUALS = "token_residuals.u8"
KEPT_BITS = "kept.bits"
IVF_OFFSETS = "ivf_offsets.i64"
IVF_DOCS = "ivf_docs.i32"
IVF_CODES = "ivf_codes.u8"
CODEC_CENTROIDS = "centroids.i8"
CODEC_SCALES = "scales.f32"
CODEC_CODEBOOKS = "codebooks.f32"
CODEC_REFINE_BOOKS = "refine_codebooks.f32"
SMALL_FILE = 1 << 20  # files up to this size are CRC-checked on every open


class IndexFormatError(ValueError):
    """A corrupt, truncated or inconsistent index file; the message names the file."""


@dataclass
class SegmentInfo:
    """One immutable segment as the manifest records it."""

    name: str
    num_docs: int
    num_tokens: int
    num_kept: int
    num_truncated: int = 0
    num_empty: int = 0  # documents skipped for blank text (not indexed)
    deletes: str | None = None  # tombstone file inside the segment folder
    num_deleted: int = 0
    files: dict = field(default_factory=dict)  # file name -> {"bytes": int, "crc32": int[, "blocks": {...}]}
    build_stats: dict = field(default_factory=dict)  # seconds spent encoding, pruning, compressing, writing
    fields: list = field(default_factory=list)  # sorted top-level names of the documents' stored fields (FIELDS)


@dataclass
class Manifest:
    """Contents of ``manifest.json``: index-wide settings plus the segment list of one commit generation."""

    model_name: str  # what AlignerModel.from_pretrained was given (a shipped name or a checkpoint folder)
    model_fingerprint: str
    dim: int
    doc_prune: float  # β^d: fraction of each document's tokens indexed for candidate generation
    index_type: str  # fp16: FAISS factory string of each segment's FAISS index; compressed: the codec string
    default_strategy: Strategy  # alignment strategy used when the searcher is not told one
    codec: CodecSpec = CodecSpec()  # fp16 or IVF<nlist>,PQ<M>[,Refine(PQ<R>)] (pyserini_aligner.index.codec_spec)
    prune_redundancy: float | None = None  # cosine threshold of redundancy-aware β^d pruning; None: salience only
    doc_maxlen: int | None = None  # tokens per document at encoding time (None: the model's doc_maxlen)
    corpus: str = ""  # where the texts came from (JsonCollection path or ir_datasets id), when known
    generation: int = 1
    codec_dir: str | None = None
    codec_files: dict = field(default_factory=dict)
    segments: list = field(default_factory=list)  # [SegmentInfo]
    created: str = ""
    package_version: str = ""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        """Parse ``codec`` and ``default_strategy`` given as the strings the JSON holds (ValueError naming the
        field); typed values are kept as they are."""
        try:
            self.codec = parse_codec(self.codec)
        except (TypeError, ValueError) as err:
            raise ValueError(f"field 'codec': {err}") from None
        try:
            self.default_strategy = parse_strategy(self.default_strategy)
        except ValueError as err:
            raise ValueError(f"field 'default_strategy': {err}") from None

    @property
    def num_docs(self) -> int:
        """Live (not deleted) documents."""
        return sum(s.num_docs - s.num_deleted for s in self.segments)

    @property
    def num_rows(self) -> int:
        """Document rows, deleted ones included."""
        return sum(s.num_docs for s in self.segments)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def num_kept(self) -> int:
        return sum(s.num_kept for s in self.segments)

    @property
    def num_truncated(self) -> int:
        return sum(s.num_truncated for s in self.segments)

    @property
    def num_empty(self) -> int:
        return sum(s.num_empty for s in self.segments)

    @property
    def build_stats(self) -> dict:
        """Seconds per build phase, summed over segments."""
        total: dict = {}
        for segment in self.segments:
            for key, value in segment.build_stats.items():
                if key.endswith("_s"):
                    total[key] = total.get(key, 0.0) + value
        return total

    def to_json(self) -> str:
        """The manifest file's text: the fields (codec and strategy as their strings) and their CRC32."""
        data = dataclasses.asdict(self)
        data["codec"], data["default_strategy"] = str(self.codec), str(self.default_strategy)
        data["checksum"] = _crc_text(json.dumps(data, sort_keys=True))
        return json.dumps(data, indent=1) + "\n"


def _crc_text(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def _check_number(path: Path, name: str, value, low: float, high: float, integer: bool = False,
                  low_open: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    ok = ok and (low < value if low_open else low <= value) and value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        raise IndexFormatError(f"{path}: field '{name}' must be {kind} in {'(' if low_open else '['}{low}, {high}], "
                               f"got {value!r}")


def is_index(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding a manifest of this package's format (it is not validated)."""
    manifest = Path(path) / MANIFEST
    try:
        return json.loads(manifest.read_text(encoding="utf-8")).get("format") == FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(index_dir: str | os.PathLike) -> Manifest:
    """Parse and check ``<index_dir>/manifest.json``; FileNotFoundError / IndexFormatError name the file."""
    path = Path(index_dir) / MANIFEST
    if not Path(index_dir).is_dir():
        raise FileNotFoundError(f"index folder not found: {index_dir}")
    if not path.is_file():
        raise FileNotFoundError(f"index file missing: {path} (not a pyserini-aligner index folder?)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise IndexFormatError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise IndexFormatError(f"{path}: not a pyserini-aligner manifest (field 'format' != {FORMAT_NAME!r})")
    if data.get("format_version") != FORMAT_VERSION:
        corpus = data.get("corpus") or "<corpus>"
        raise IndexFormatError(f"{path}: index format {data.get('format_version')!r} is not read by this version "
                               f"(format {FORMAT_VERSION}); rebuild it: python -m pyserini_aligner.index --corpus "
                               f"{corpus} --index {index_dir} --overwrite")
    checksum = data.pop("checksum", None)
    if checksum != _crc_text(json.dumps(data, sort_keys=True)):
        raise IndexFormatError(f"{path}: checksum mismatch (the manifest was edited or corrupted)")
    fields = {f.name: f for f in dataclasses.fields(Manifest)}
    unknown = sorted(set(data) - set(fields))
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if unknown or missing:
        raise IndexFormatError(f"{path}: unknown field(s) {unknown}, missing field(s) {missing}")
    seg_fields = {f.name for f in dataclasses.fields(SegmentInfo)}
    segments = []
    for number, seg in enumerate(data["segments"] if isinstance(data["segments"], list) else [None]):
        if not isinstance(seg, dict) or set(seg) - seg_fields or not isinstance(seg.get("name"), str):
            raise IndexFormatError(f"{path}: segment {number} is malformed")
        segments.append(SegmentInfo(**seg))
    data["segments"] = segments
    try:
        manifest = Manifest(**data)
    except ValueError as err:
        raise IndexFormatError(f"{path}: {err}") from None
    _check_number(path, "dim", manifest.dim, 1, 65536, integer=True)
    _check_number(path, "doc_prune", manifest.doc_prune, 0.0, 1.0, low_open=True)
    _check_number(path, "generation", manifest.generation, 1, 2 ** 62, integer=True)
    if manifest.prune_redundancy is not None:
        _check_number(path, "prune_redundancy", manifest.prune_redundancy, 0.0, 1.0, low_open=True)
    if not isinstance(manifest.corpus, str) or not isinstance(manifest.model_name, str):
        raise IndexFormatError(f"{path}: fields 'corpus' and 'model_name' must be strings")
    spec = manifest.codec
    try:
        spec.check(manifest.dim)
    except ValueError as err:
        raise IndexFormatError(f"{path}: field 'codec': {err}") from None
    if spec.compressed and manifest.index_type != str(spec):
        raise IndexFormatError(f"{path}: field 'index_type' {manifest.index_type!r} must equal the codec {spec}")
    if not spec.compressed:
        try:
            check_factory_string(manifest.dim, manifest.index_type)
        except ValueError as err:
            raise IndexFormatError(f"{path}: field 'index_type': {err}") from None
    for seg in segments:
        for name in ("num_docs", "num_tokens", "num_kept", "num_truncated", "num_empty", "num_deleted"):
            _check_number(path, f"segments[{seg.name}].{name}", getattr(seg, name), 0, 2 ** 62, integer=True)
        if seg.num_kept > seg.num_tokens or seg.num_deleted > seg.num_docs:
            raise IndexFormatError(f"{path}: segment {seg.name} counts are inconsistent")
        if not isinstance(seg.fields, list) or not all(isinstance(name, str) for name in seg.fields) \
                or (seg.fields and FIELDS not in seg.files):
            raise IndexFormatError(f"{path}: segments[{seg.name}].fields must be a list of field names, with the "
                                   f"file {FIELDS} recorded in its files")
    return manifest


_FLAT_ALIASES = {"indexflatip": "Flat", "flatip": "Flat", "flat": "Flat"}


def faiss_factory_string(index_type: str) -> str:
    """FAISS factory string for ``index_type``; "IndexFlatIP"/"FlatIP" mean exact inner product ("Flat")."""
    if not isinstance(index_type, str) or not index_type.strip():
        raise ValueError(f"index_type must be a FAISS factory string such as 'Flat' or 'IVF256,Flat', "
                         f"got {index_type!r}")
    return _FLAT_ALIASES.get(index_type.strip().lower(), index_type.strip())


def new_faiss_index(dim: int, index_type: str):
    """An empty inner-product FAISS index; ValueError naming ``index_type`` when FAISS rejects it."""
    import faiss

    spec = faiss_factory_string(index_type)
    try:
        return faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise ValueError(f"index_type {index_type!r}: FAISS cannot build it ({faiss_error_message(err)}); "
                         "examples: 'Flat', 'IVF256,Flat', 'IVF256,PQ16x8', 'HNSW32'") from None


def check_factory_string(dim: int, index_type: str) -> None:
    """ValueError when FAISS cannot build ``index_type`` for ``dim``-d vectors."""
    new_faiss_index(dim, index_type)


def faiss_error_message(err: RuntimeError) -> str:
    """The useful part of a FAISS C++ exception ("Error in <function> at <file>: Error: '<check>' failed: <why>")."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    message = re.sub(r"^Error in .*? at \S+:\d+: ", "", lines[-1] if lines else "unknown FAISS error")
    return message.rsplit("failed: ", 1)[-1].removeprefix("Error: ")


"""On-disk layout of a pyserini-aligner index, its commits, and checked read access to it.

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
first opens them (:mod:`pyserini_aligner.index.checksums`; indexes written before block checksums leave them
unchecked); every file's whole CRC32 on demand (:meth:`StoredIndex.verify`, ``python -m pyserini_aligner.index
--index DIR --verify``).
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import secrets
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pyserini_aligner.index import checksums

FORMAT_NAME = "pyserini-aligner"  # also read by pyserini_aligner.integration.hooks.is_aligner_index
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
LOCK = "write.lock"
DOCIDS = "docids.txt"
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
_OWNED = re.compile(r"^(seg-\d+-[0-9a-f]+|codec-\d+(-[0-9a-f]+)?|\.tmp-.*|\.manifest\..*)$")  # names this package creates


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


@dataclass
class Manifest:
    """Contents of ``manifest.json``: index-wide settings plus the segment list of one commit generation."""

    model_name: str  # what AlignerModel.from_pretrained was given (a shipped name or a checkpoint folder)
    model_fingerprint: str
    dim: int
    doc_prune: float  # β^d: fraction of each document's tokens indexed for candidate generation
    index_type: str  # fp16: FAISS factory string of each segment's FAISS index; compressed: the codec string
    default_strategy: str  # alignment strategy used when the searcher is not told one
    codec: str = "fp16"  # "fp16" or "IVF<nlist>,PQ<M>" (pyserini_aligner.index.codec)
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
        data = dataclasses.asdict(self)
        data["checksum"] = _crc_text(json.dumps(data, sort_keys=True))
        return json.dumps(data, indent=1) + "\n"


def _crc_text(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def file_record(path: Path) -> dict:
    """{"bytes": size, "crc32": CRC32} of a file, read in 16 MiB blocks (with its block CRC32s past one block)."""
    sums = checksums.BlockCrc()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            sums.update(block)
    return sums.record()


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
    from pyserini_aligner.index.codec import parse_codec

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
    manifest = Manifest(**data)
    _check_number(path, "dim", manifest.dim, 1, 65536, integer=True)
    _check_number(path, "doc_prune", manifest.doc_prune, 0.0, 1.0, low_open=True)
    _check_number(path, "generation", manifest.generation, 1, 2 ** 62, integer=True)
    if manifest.prune_redundancy is not None:
        _check_number(path, "prune_redundancy", manifest.prune_redundancy, 0.0, 1.0, low_open=True)
    if not isinstance(manifest.corpus, str) or not isinstance(manifest.model_name, str):
        raise IndexFormatError(f"{path}: fields 'corpus' and 'model_name' must be strings")
    try:
        spec = parse_codec(manifest.codec, manifest.dim)
    except (TypeError, ValueError) as err:
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
    return manifest


def write_manifest(index_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Commit ``manifest`` (atomic: temporary file, fsync, rename, fsync of the folder)."""
    if not manifest.created:
        manifest.created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic_write(Path(index_dir) / MANIFEST, manifest.to_json())


def set_default_strategy(index_dir: str | os.PathLike, strategy) -> Manifest:
    """Record ``strategy`` (spec string or Strategy) as the index's default alignment strategy; returns the manifest.
    When it is the default already, nothing is written (no new generation)."""
    from pyserini_aligner.alignment import parse_strategy

    with IndexLock(index_dir):
        manifest = read_manifest(index_dir)
        spec = str(parse_strategy(strategy))
        if spec != manifest.default_strategy:
            manifest.default_strategy = spec
            manifest.generation += 1
            write_manifest(index_dir, manifest)
    return manifest


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in folder ``path`` durable."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never a part."""
    from pyserini_aligner.index import faults

    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        faults.point("before-commit")
        os.replace(tmp, path)
        fsync_dir(path.parent)
        faults.point("after-commit")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class IndexLock:
    """Exclusive write lock of an index folder (``write.lock``, flock); readers never take it."""

    def __init__(self, index_dir: str | os.PathLike):
        self.path = Path(index_dir) / LOCK
        self.handle = None

    def __enter__(self) -> "IndexLock":
        if not os.access(self.path.parent, os.W_OK):
            raise PermissionError(f"index {self.path.parent} is read-only: cannot update it")
        self.handle = open(self.path, "a")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            raise RuntimeError(f"index {self.path.parent} is being updated by another process") from None
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def new_name(prefix: str, generation: int) -> str:
    """A fresh name for a segment or codec folder of ``generation``."""
    return f"{prefix}-{generation:06d}-{secrets.token_hex(4)}"


def remove_unreferenced(index_dir: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Delete what this package left in ``index_dir`` that ``manifest`` does not reference (folders of segments and
    codecs, stale tombstones, temporary files of an interrupted write); never anything else. Call under the lock."""
    root = Path(index_dir)
    live = {s.name for s in manifest.segments} | ({manifest.codec_dir} if manifest.codec_dir else set())
    removed = []
    for path in root.iterdir():
        if path.name in live or not _OWNED.match(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    for seg in manifest.segments:
        for path in (root / seg.name).glob("deletes-*.bits"):
            if path.name != seg.deletes:
                path.unlink(missing_ok=True)
                removed.append(f"{seg.name}/{path.name}")
    return removed


def faiss_error_message(err: RuntimeError) -> str:
    """The useful part of a FAISS C++ exception ("Error in <function> at <file>: Error: '<check>' failed: <why>")."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    message = re.sub(r"^Error in .*? at \S+:\d+: ", "", lines[-1] if lines else "unknown FAISS error")
    return message.rsplit("failed: ", 1)[-1].removeprefix("Error: ")


def _memmap(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Read-only memmap (an empty array for zero-size files, which numpy cannot map)."""
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def _expected_sizes(seg: SegmentInfo, dim: int, pq_m: int, nlist: int, residual_m: int = 0) -> dict[str, int]:
    n, t, k = seg.num_docs, seg.num_tokens, seg.num_kept
    sizes = {OFFSETS: 8 * (n + 1)}
    if pq_m:
        sizes.update({TOKEN_CENTROIDS: 2 * t, TOKEN_RESIDUALS: t * (residual_m or pq_m), KEPT_BITS: (t + 7) // 8,
                      IVF_OFFSETS: 8 * (nlist + 1), IVF_DOCS: 4 * k, IVF_CODES: k * pq_m})
    else:
        sizes.update({VECTORS: 2 * t * dim, SALIENCE: 4 * t, KEPT: t, FAISS_IDS: 8 * k})
    if seg.deletes:
        sizes[seg.deletes] = (n + 7) // 8
    return sizes


def _check_files(folder: Path, records: dict, sizes: dict[str, int], verify_all: bool) -> dict[str, Path]:
    """Check presence, size (against the manifest's counts) and, for small files or ``verify_all``, the CRC32."""
    paths = {}
    for name, record in records.items():
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"index file missing: {path}")
        size = path.stat().st_size
        expected = sizes.get(name, record.get("bytes"))
        if size != record.get("bytes") or size != expected:
            raise IndexFormatError(f"{path}: {size} bytes, the manifest implies {expected} "
                                   "(truncated or corrupt index file; rebuild the index)")
        if (verify_all or size <= SMALL_FILE) and file_record(path)["crc32"] != record.get("crc32"):
            raise IndexFormatError(f"{path}: checksum mismatch (corrupt index file; rebuild the index)")
        if not verify_all and size > SMALL_FILE and (problem := checksums.bad_block(path, record)):
            raise IndexFormatError(f"{path}: {problem} (corrupt index file; rebuild the index)")
        paths[name] = path
    missing = sorted(set(sizes) - set(records))
    if missing:
        raise IndexFormatError(f"{folder}: the manifest records no file(s) {missing}")
    return paths


class Segment:
    """Read access to one segment's files (memory-mapped token data, docids, offsets, tombstones)."""

    def __init__(self, root: Path, info: SegmentInfo, manifest: Manifest, pq_m: int, nlist: int,
                 verify_all: bool = False, residual_m: int = 0):
        """pq_m: bytes of a list entry's code; residual_m: bytes of a token's residual code (0: pq_m)."""
        self.info, self.folder = info, root / info.name
        sizes = _expected_sizes(info, manifest.dim, pq_m, nlist, residual_m)
        paths = _check_files(self.folder, info.files, sizes, verify_all)
        n, t, k, d = info.num_docs, info.num_tokens, info.num_kept, manifest.dim
        self.offsets = np.fromfile(paths[OFFSETS], dtype=np.int64)
        lengths = np.diff(self.offsets)
        if self.offsets[0] != 0 or self.offsets[-1] != t or (lengths < 0).any():
            raise IndexFormatError(f"{paths[OFFSETS]}: offsets are not a non-decreasing run from 0 to {t} "
                                   "(corrupt index file)")
        self.lengths = lengths
        self.deleted = np.zeros(n, dtype=bool)
        if info.deletes:
            self.deleted = np.unpackbits(np.fromfile(paths[info.deletes], dtype=np.uint8), count=n).astype(bool)
            if int(self.deleted.sum()) != info.num_deleted:
                raise IndexFormatError(f"{paths[info.deletes]}: {int(self.deleted.sum())} tombstones, the manifest "
                                       f"says {info.num_deleted}")
        if pq_m:
            self.centroid_ids = _memmap(paths[TOKEN_CENTROIDS], np.uint16, (t,))
            self.residuals = _memmap(paths[TOKEN_RESIDUALS], np.uint8, (t, residual_m or pq_m))
            self.kept_bits = np.fromfile(paths[KEPT_BITS], dtype=np.uint8)
            self.ivf_offsets = np.fromfile(paths[IVF_OFFSETS], dtype=np.int64)
            if self.ivf_offsets[0] != 0 or self.ivf_offsets[-1] != k or (np.diff(self.ivf_offsets) < 0).any():
                raise IndexFormatError(f"{paths[IVF_OFFSETS]}: not a non-decreasing run from 0 to {k} (corrupt)")
            self.ivf_docs = _memmap(paths[IVF_DOCS], np.int32, (k,))
            self.ivf_codes = _memmap(paths[IVF_CODES], np.uint8, (k, pq_m))
            self.vectors = self.salience = None
        else:
            self.vectors = _memmap(paths[VECTORS], np.float16, (t, d))
            self.salience = _memmap(paths[SALIENCE], np.float32, (t,))
            self.kept_bool = _memmap(paths[KEPT], np.bool_, (t,))
            self.faiss_ids = np.fromfile(paths[FAISS_IDS], dtype=np.int64)
            if k and (self.faiss_ids.min() < 0 or self.faiss_ids.max() >= t):
                raise IndexFormatError(f"{paths[FAISS_IDS]}: token positions out of range [0, {t})")
        self.docids = _read_docids(paths[DOCIDS] if DOCIDS in paths else self.folder / DOCIDS, n)

    @property
    def kept(self) -> np.ndarray:
        """bool [T]: tokens indexed for candidate generation."""
        if self.vectors is not None:
            return np.asarray(self.kept_bool)
        return np.unpackbits(self.kept_bits, count=self.info.num_tokens).astype(bool)

    def faiss_index(self):
        """The segment's FAISS index (fp16 segments), checked against the manifest."""
        import faiss

        path = self.folder / FAISS_INDEX
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as err:
            raise IndexFormatError(f"{path}: FAISS cannot read it ({faiss_error_message(err)})") from None
        if index.ntotal != self.info.num_kept:
            raise IndexFormatError(f"{path}: FAISS index holds {index.ntotal} vectors, the manifest says "
                                   f"{self.info.num_kept}")
        return index


def _read_docids(path: Path, count: int) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"index file missing: {path}")
    try:
        docids = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise IndexFormatError(f"{path}: not UTF-8 text ({err})") from None
    if docids and docids[-1] == "":
        docids.pop()
    if len(docids) != count:
        raise IndexFormatError(f"{path}: {len(docids)} docids, the manifest says {count}")
    return docids


def load_codec(index_dir: Path, manifest: Manifest, verify_all: bool = False):
    """The index's ResidualCodec (None for fp16 indexes)."""
    import torch

    from pyserini_aligner.index.codec import PQ_CENTROIDS, ResidualCodec, dequantize_centroids, parse_codec

    spec = parse_codec(manifest.codec, manifest.dim)
    if not spec.compressed:
        return None
    if not manifest.codec_dir:
        raise IndexFormatError(f"{index_dir / MANIFEST}: a compressed index needs field 'codec_dir'")
    folder = index_dir / manifest.codec_dir
    sizes = {CODEC_CENTROIDS: spec.nlist * manifest.dim, CODEC_SCALES: 4 * spec.nlist,
             CODEC_CODEBOOKS: 4 * manifest.dim * PQ_CENTROIDS}
    if spec.refine_m:
        sizes[CODEC_REFINE_BOOKS] = 4 * manifest.dim * PQ_CENTROIDS
    paths = _check_files(folder, manifest.codec_files, sizes, verify_all)
    centroids = np.fromfile(paths[CODEC_CENTROIDS], dtype=np.int8).reshape(spec.nlist, manifest.dim)
    scales = np.fromfile(paths[CODEC_SCALES], dtype=np.float32)
    books = np.fromfile(paths[CODEC_CODEBOOKS], dtype=np.float32).reshape(spec.pq_m, PQ_CENTROIDS, -1)
    refine = (torch.from_numpy(np.fromfile(paths[CODEC_REFINE_BOOKS], dtype=np.float32)
                               .reshape(spec.refine_m, PQ_CENTROIDS, -1)) if spec.refine_m else None)
    return ResidualCodec(dequantize_centroids(centroids, scales), torch.from_numpy(books), refine)


class StoredIndex:
    """Read access to one committed generation of an index: all its segments as one row space.

    Document rows run over the segments in manifest order (deleted rows included; ``live`` marks the others), and
    token positions likewise. A reader that opens while a writer commits retries on the newer manifest, so it never
    sees a mixed state. ``verify=True`` also checks the CRC32 of the large token files.
    """

    def __init__(self, index_dir: str | os.PathLike, verify: bool = False):
        self.index_dir = Path(index_dir)
        for attempt in range(5):
            try:
                self._open(verify)
                break
            except (FileNotFoundError, IndexFormatError):
                if attempt == 4 or not (self.index_dir / MANIFEST).is_file():
                    raise
                previous = getattr(self, "manifest", None)
                if previous is not None and read_manifest(self.index_dir).generation == previous.generation:
                    raise  # a real defect, not a concurrent commit
                time.sleep(0.05)

    def _open(self, verify: bool) -> None:
        from pyserini_aligner.index.codec import parse_codec

        self.manifest = m = read_manifest(self.index_dir)
        self.codec_spec = spec = parse_codec(m.codec, m.dim)
        self.codec = load_codec(self.index_dir, m, verify)
        self.segments = [Segment(self.index_dir, info, m, spec.pq_m, spec.nlist, verify, spec.refine_m)
                         for info in m.segments]
        counts = [s.info.num_docs for s in self.segments]
        tokens = [s.info.num_tokens for s in self.segments]
        self.row_base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.token_base = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        self.offsets = np.concatenate([[0]] + [s.offsets[1:] + base for s, base in
                                                zip(self.segments, self.token_base)]).astype(np.int64)
        self.lengths = np.diff(self.offsets)
        self.deleted = np.concatenate([s.deleted for s in self.segments]) if self.segments else np.zeros(0, bool)
        self.live = ~self.deleted
        self.live.flags.writeable = False  # one generation's documents: the count below stays true
        self._num_live = int(self.live.sum())
        self.docids = [docid for s in self.segments for docid in s.docids]
        self._docid_rows: dict[str, int] | None = None
        self._kept = None

    @property
    def num_docs(self) -> int:
        """Document rows (deleted rows included; see ``live``)."""
        return len(self.docids)

    @property
    def num_live(self) -> int:
        """Documents not deleted."""
        return self._num_live

    def verify(self) -> None:
        """Check every file's CRC32 (IndexFormatError naming the first corrupt file)."""
        StoredIndex(self.index_dir, verify=True)

    def row_of(self, docid: str) -> int | None:
        """Row of live document ``docid`` (None when absent or deleted)."""
        if self._docid_rows is None:
            self._docid_rows = {d: row for row, d in enumerate(self.docids) if self.live[row]}
        return self._docid_rows.get(docid)

    @property
    def kept(self) -> np.ndarray:
        """bool [T] over all segments: tokens indexed for candidate generation."""
        if self._kept is None:
            self._kept = np.concatenate([s.kept for s in self.segments]) if self.segments else np.zeros(0, bool)
        return self._kept

    @property
    def faiss_ids(self) -> np.ndarray:
        """int64 [K]: global positions of the indexed tokens, in segment order."""
        return np.flatnonzero(self.kept)

    def doc_of_token(self, positions: np.ndarray) -> np.ndarray:
        """Document row of each global token position (int64 array, same shape)."""
        return np.searchsorted(self.offsets, positions, side="right") - 1

    def _by_segment(self, positions: np.ndarray):
        """(segment number, local positions, indices into ``positions``) for each segment holding some of them."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(self.segments) == 1:
            yield 0, positions, slice(None)
            return
        seg_of = np.searchsorted(self.token_base, positions, side="right") - 1
        for number in np.unique(seg_of):
            where = np.flatnonzero(seg_of == number)
            yield int(number), positions[where] - self.token_base[number], where

    def token_codes(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(centroid ids [t] uint16, residual codes [t, R] uint8) at global ``positions`` (compressed indexes)."""
        positions = np.asarray(positions, dtype=np.int64)
        ids = np.empty(len(positions), dtype=np.uint16)
        codes = np.empty((len(positions), self.codec_spec.residual_m), dtype=np.uint8)
        for number, local, where in self._by_segment(positions):
            seg = self.segments[number]
            ids[where], codes[where] = seg.centroid_ids[local], seg.residuals[local]
        return ids, codes

    def token_vectors(self, positions: np.ndarray, device="cpu"):
        """float32 tensor [t, d] of the stored (decoded) vectors at global token ``positions`` [t]."""
        import torch

        positions = np.asarray(positions, dtype=np.int64)
        if self.codec is not None:
            return self.codec.decode(*self.token_codes(positions), device=device)
        out = np.empty((len(positions), self.manifest.dim), dtype=np.float32)
        for number, local, where in self._by_segment(positions):
            out[where] = self.segments[number].vectors[local]
        return torch.from_numpy(out).to(device)

    def token_salience(self, positions: np.ndarray) -> np.ndarray:
        """float32 [t] stored saliences (ones for a compressed index, which stores none)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.codec is not None:
            return np.ones(len(positions), dtype=np.float32)
        out = np.empty(len(positions), dtype=np.float32)
        for number, local, where in self._by_segment(positions):
            out[where] = self.segments[number].salience[local]
        return out

    def token_layout(self, rows: np.ndarray, kept_only: bool = False):
        """Token positions of documents ``rows``, flattened: (positions [t], owner [t] = index into rows,
        within [t] = rank inside its document, lengths [len(rows)])."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, lengths = self.offsets[rows], self.lengths[rows]
        owner = np.repeat(np.arange(len(rows)), lengths)
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        positions = np.repeat(starts, lengths) + within
        if kept_only:
            keep = self.kept[positions]
            positions, owner = positions[keep], owner[keep]
            lengths = np.bincount(owner, minlength=len(rows))
            within = np.arange(len(positions)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return positions, owner, within, lengths

    def gather(self, rows: np.ndarray, kept_only: bool = False, workspace: "Workspace | None" = None):
        """Token vectors of documents ``rows`` as padded tensors.

        Returns (vectors [B, m, d] float32, mask [B, m] bool, salience [B, m] float32); m = longest selected doc.
        ``kept_only`` selects only the indexed tokens. With a ``workspace``, vectors is a view into its memory, valid
        until the workspace's next use (saves page-faulting a fresh buffer on every call).
        """
        import torch

        positions, owner, within, lengths = self.token_layout(rows, kept_only)
        batch, width, d = len(lengths), max(int(lengths.max()) if len(lengths) else 0, 1), self.manifest.dim
        vectors = workspace.take(batch, width, d) if workspace is not None else torch.empty(batch, width, d)
        vectors.zero_()
        vectors[torch.from_numpy(owner), torch.from_numpy(within)] = self.token_vectors(positions)
        salience = np.zeros((batch, width), dtype=np.float32)
        salience[owner, within] = self.token_salience(positions)
        mask = torch.arange(width)[None, :] < torch.from_numpy(np.asarray(lengths))[:, None]
        return vectors, mask, torch.from_numpy(salience)


class Workspace:
    """Reusable float32 scratch memory for :meth:`StoredIndex.gather` (one user at a time)."""

    def __init__(self):
        self._buffer = None

    def take(self, *shape: int):
        """A float32 tensor of ``shape`` over this workspace's memory (contents undefined)."""
        import torch

        size = int(np.prod(shape))
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = torch.empty(size)
        return self._buffer[:size].view(*shape)


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

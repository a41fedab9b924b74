"""On-disk layout of a pyserini-aligner multi-vector index, and checked read access to it.

An index folder holds (T tokens over N documents, K = tokens kept in FAISS, d = vector dimension):

- ``manifest.json``     format, model fingerprint/name, counts, FAISS factory string, default strategy;
- ``docids.txt``        N lines, document i's id on line i+1;
- ``doc_offsets.i64``   [N+1] int64, document i owns token positions offsets[i] .. offsets[i+1]-1;
- ``doc_vectors.f16``   [T, d] float16, every token vector (memory-mapped at search time);
- ``doc_salience.f32``  [T] float32, unary salience of every token;
- ``kept.bool``         [T] bool, True where the token is in FAISS (the β^d most salient of its document);
- ``faiss_ids.i64``     [K] int64, FAISS row → token position;
- ``faiss.index``       FAISS index over the K kept vectors (inner product).

With a compressed codec (``IVF<nlist>,PQ<M>``, see :mod:`pyserini_aligner.index.codec`) the token files are instead:

- ``token_centroids.u16``  [T] uint16, each token's coarse centroid id;
- ``token_residuals.u8``   [T, M] uint8, each token's PQ residual code;
- ``kept.bits``            [ceil(T/8)] the kept mask, bit-packed (numpy.packbits);
- ``codec_centroids.i8``   [nlist, d] int8 and ``codec_scales.f32`` [nlist] float32 (centroid = int8 · scale);
- ``codec_codebooks.f32``  [M, 256, d/M] float32, the PQ codebooks;

and there is no FAISS file: the searcher builds an ``IndexIVFPQ`` from the kept tokens' codes when it loads.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_NAME = "pyserini-aligner"  # also read by pyserini_aligner.integration.hooks.is_aligner_index
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
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
CODEC_CENTROIDS = "codec_centroids.i8"
CODEC_SCALES = "codec_scales.f32"
CODEC_CODEBOOKS = "codec_codebooks.f32"


class IndexFormatError(ValueError):
    """A corrupt, truncated or inconsistent index file; the message names the file."""


@dataclass
class Manifest:
    """Contents of ``manifest.json``."""

    model_name: str  # what AlignerModel.from_pretrained was given ("aligner" or a checkpoint folder)
    model_fingerprint: str
    dim: int
    doc_prune: float  # β^d: fraction of each document's tokens kept in FAISS
    index_type: str  # FAISS factory string, e.g. "Flat", "IVF256,Flat", "HNSW32"
    num_docs: int
    num_tokens: int
    num_kept: int
    num_truncated: int  # documents cut at the model's doc_maxlen
    num_empty: int  # documents whose text was blank
    default_strategy: str  # alignment strategy used when the searcher is not told one
    corpus: str = ""  # where the texts came from (JsonCollection path or ir_datasets id), when known
    codec: str = "fp16"  # token store codec: "fp16" or "IVF<nlist>,PQ<M>" (pyserini_aligner.index.codec)
    prune_redundancy: float | None = None  # cosine threshold of redundancy-aware β^d pruning; None: salience only
    created: str = ""
    package_version: str = ""
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


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
        raise IndexFormatError(f"{path}: format_version {data.get('format_version')!r} is not supported "
                               f"(this version reads {FORMAT_VERSION}); rebuild the index")
    fields = {f.name: f for f in dataclasses.fields(Manifest)}
    missing = [name for name, f in fields.items()
               if name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise IndexFormatError(f"{path}: missing field(s) {missing}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise IndexFormatError(f"{path}: unknown field(s) {unknown}")
    manifest = Manifest(**data)
    for name in ("dim", "num_docs", "num_tokens", "num_kept", "num_truncated", "num_empty"):
        value = getattr(manifest, name)
        if not isinstance(value, int) or value < 0:
            raise IndexFormatError(f"{path}: field '{name}' must be a non-negative integer, got {value!r}")
    if manifest.num_kept > manifest.num_tokens:
        raise IndexFormatError(f"{path}: num_kept {manifest.num_kept} > num_tokens {manifest.num_tokens}")
    redundancy = manifest.prune_redundancy
    if redundancy is not None and (isinstance(redundancy, bool) or not isinstance(redundancy, (int, float))
                                   or not 0.0 < redundancy <= 1.0):
        raise IndexFormatError(f"{path}: field 'prune_redundancy' must be null or a number in (0, 1], "
                               f"got {redundancy!r}")
    from pyserini_aligner.index.codec import parse_codec

    try:
        parse_codec(manifest.codec, manifest.dim)
    except (TypeError, ValueError) as err:
        raise IndexFormatError(f"{path}: field 'codec': {err}") from None
    return manifest


def write_manifest(index_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (temporary file + rename)."""
    if not manifest.created:
        manifest.created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _atomic_write(Path(index_dir) / MANIFEST, manifest.to_json())


def set_default_strategy(index_dir: str | os.PathLike, strategy) -> Manifest:
    """Record ``strategy`` (spec string or Strategy) as the index's default alignment strategy; returns the manifest."""
    from pyserini_aligner.alignment import parse_strategy

    manifest = read_manifest(index_dir)
    manifest.default_strategy = str(parse_strategy(strategy))
    write_manifest(index_dir, manifest)
    return manifest


def _atomic_write(path: Path, text: str) -> None:
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def faiss_error_message(err: RuntimeError) -> str:
    """The useful part of a FAISS C++ exception ("Error in <function> at <file>: Error: '<check>' failed: <why>")."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    message = re.sub(r"^Error in .*? at \S+:\d+: ", "", lines[-1] if lines else "unknown FAISS error")
    return message.rsplit("failed: ", 1)[-1].removeprefix("Error: ")


def _checked_file(path: Path, expected_bytes: int) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"index file missing: {path}")
    size = path.stat().st_size
    if size != expected_bytes:
        raise IndexFormatError(f"{path}: {size} bytes, the manifest implies {expected_bytes} "
                               "(truncated or corrupt index file; rebuild the index)")
    return path


def _memmap(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Read-only memmap (an empty array for zero-size files, which numpy cannot map)."""
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class StoredIndex:
    """Read access to an index folder: docids, offsets and memory-mapped token vectors/saliences.

    Every file's size is checked against the manifest on open; the FAISS index is read by :meth:`faiss_index`.
    """

    def __init__(self, index_dir: str | os.PathLike):
        from pyserini_aligner.index.codec import parse_codec

        self.index_dir = Path(index_dir)
        self.manifest = m = read_manifest(self.index_dir)
        d = m.dim
        self.codec_spec = spec = parse_codec(m.codec, d)
        if spec.compressed:
            files = {OFFSETS: 8 * (m.num_docs + 1), TOKEN_CENTROIDS: 2 * m.num_tokens, KEPT_BITS: (m.num_tokens + 7) // 8,
                     TOKEN_RESIDUALS: m.num_tokens * spec.pq_m, CODEC_CENTROIDS: spec.nlist * d,
                     CODEC_SCALES: 4 * spec.nlist, CODEC_CODEBOOKS: 4 * d * 256}
        else:
            files = {OFFSETS: 8 * (m.num_docs + 1), VECTORS: 2 * m.num_tokens * d, SALIENCE: 4 * m.num_tokens,
                     KEPT: m.num_tokens, FAISS_IDS: 8 * m.num_kept}
        paths = {name: _checked_file(self.index_dir / name, size) for name, size in files.items()}
        self.offsets = np.fromfile(paths[OFFSETS], dtype=np.int64)
        lengths = np.diff(self.offsets)
        if self.offsets[0] != 0 or self.offsets[-1] != m.num_tokens or (lengths < 0).any():
            raise IndexFormatError(f"{paths[OFFSETS]}: offsets are not a non-decreasing run from 0 to "
                                   f"num_tokens={m.num_tokens} (corrupt index file)")
        self.lengths = lengths
        self.vectors = self.salience = self.codec = None
        if spec.compressed:
            self._open_compressed(paths)
        else:
            self.vectors = _memmap(paths[VECTORS], np.float16, (m.num_tokens, d))
            self.salience = _memmap(paths[SALIENCE], np.float32, (m.num_tokens,))
            self.kept = _memmap(paths[KEPT], np.bool_, (m.num_tokens,))
            self.faiss_ids = np.fromfile(paths[FAISS_IDS], dtype=np.int64)
            if len(self.faiss_ids) and (self.faiss_ids.min() < 0 or self.faiss_ids.max() >= m.num_tokens):
                raise IndexFormatError(f"{paths[FAISS_IDS]}: token positions out of range [0, {m.num_tokens})")
        self.docids = self._read_docids(self.index_dir / DOCIDS, m.num_docs)
        self._docid_rows: dict[str, int] | None = None
        self._vectors_tensor = None

    def _open_compressed(self, paths: dict[str, Path]) -> None:
        import torch

        from pyserini_aligner.index.codec import PQ_CENTROIDS, ResidualCodec, dequantize_centroids

        m, spec = self.manifest, self.codec_spec
        self.kept = np.unpackbits(np.fromfile(paths[KEPT_BITS], dtype=np.uint8), count=m.num_tokens).astype(bool)
        if int(self.kept.sum()) != m.num_kept:
            raise IndexFormatError(f"{paths[KEPT_BITS]}: {int(self.kept.sum())} kept tokens, the manifest says "
                                   f"num_kept={m.num_kept} (corrupt index file)")
        self.faiss_ids = np.flatnonzero(self.kept)  # FAISS label → token position, derived from the kept mask
        self.centroid_ids = _memmap(paths[TOKEN_CENTROIDS], np.uint16, (m.num_tokens,))
        self.residuals = _memmap(paths[TOKEN_RESIDUALS], np.uint8, (m.num_tokens, spec.pq_m))
        centroids = np.fromfile(paths[CODEC_CENTROIDS], dtype=np.int8).reshape(spec.nlist, m.dim)
        scales = np.fromfile(paths[CODEC_SCALES], dtype=np.float32)
        books = np.fromfile(paths[CODEC_CODEBOOKS], dtype=np.float32).reshape(spec.pq_m, PQ_CENTROIDS, -1)
        self.codec = ResidualCodec(dequantize_centroids(centroids, scales), torch.from_numpy(books))
        if m.num_tokens and int(self.centroid_ids.max()) >= spec.nlist:
            raise IndexFormatError(f"{paths[TOKEN_CENTROIDS]}: centroid ids out of range [0, {spec.nlist})")

    @staticmethod
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
            raise IndexFormatError(f"{path}: {len(docids)} docids, the manifest says num_docs={count}")
        return docids

    @property
    def num_docs(self) -> int:
        return self.manifest.num_docs

    def row_of(self, docid: str) -> int | None:
        """Row of ``docid`` in the index (None when absent)."""
        if self._docid_rows is None:
            self._docid_rows = {docid: row for row, docid in enumerate(self.docids)}
        return self._docid_rows.get(docid)

    def doc_of_token(self, positions: np.ndarray) -> np.ndarray:
        """Document row of each token position (int64 array, same shape)."""
        return np.searchsorted(self.offsets, positions, side="right") - 1

    def faiss_index(self):
        """Read ``faiss.index`` and check it against the manifest (IndexFormatError naming the file otherwise)."""
        import faiss

        if self.codec is not None:
            kept = self.faiss_ids  # FAISS label i is kept token i, as for fp16 indexes
            return self.codec.faiss_index(self.centroid_ids[kept], self.residuals[kept], np.arange(len(kept)))
        path = self.index_dir / FAISS_INDEX
        if not path.is_file():
            raise FileNotFoundError(f"index file missing: {path}")
        try:
            index = faiss.read_index(str(path))
        except RuntimeError as err:
            raise IndexFormatError(f"{path}: FAISS cannot read it ({faiss_error_message(err)})") from None
        if index.d != self.manifest.dim or index.ntotal != self.manifest.num_kept:
            raise IndexFormatError(f"{path}: FAISS index has d={index.d}, ntotal={index.ntotal}; the manifest says "
                                   f"dim={self.manifest.dim}, num_kept={self.manifest.num_kept}")
        return index

    def token_vectors(self, positions: np.ndarray, device="cpu"):
        """float32 tensor [t, d] of the stored (decoded) vectors at token ``positions`` [t]."""
        import torch

        positions = np.asarray(positions, dtype=np.int64)
        if self.codec is None:
            return torch.from_numpy(np.asarray(self.vectors[positions], dtype=np.float32)).to(device)
        return self.codec.decode(self.centroid_ids[positions], self.residuals[positions], device=device)

    def token_salience(self, positions: np.ndarray) -> np.ndarray:
        """float32 [t] saliences at token ``positions`` (ones for a compressed index, which stores none)."""
        if self.salience is None:
            return np.ones(len(positions), dtype=np.float32)
        return np.asarray(self.salience[np.asarray(positions, dtype=np.int64)], dtype=np.float32)

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

    def padded_salience(self, rows: np.ndarray):
        """(salience [B, m] float32, mask [B, m] bool) tensors of documents ``rows``, padded to the longest."""
        import torch

        positions, owner, within, lengths = self.token_layout(rows)
        width = max(int(lengths.max()) if len(lengths) else 0, 1)
        salience = torch.zeros(len(lengths), width)
        mask = torch.zeros(len(lengths), width, dtype=torch.bool)
        salience[owner, within] = torch.from_numpy(self.token_salience(positions))
        mask[owner, within] = True
        return salience, mask

    def gather(self, rows: np.ndarray, kept_only: bool = False, workspace: "Workspace | None" = None):
        """Token vectors of documents ``rows`` as padded tensors.

        Returns (vectors [B, m, d] float32, mask [B, m] bool, salience [B, m] float32); m = longest selected doc.
        ``kept_only`` selects only the tokens that are in FAISS. With a ``workspace``, vectors is a view into its
        memory, valid until the workspace's next use (saves page-faulting a fresh buffer on every call).
        """
        import torch

        positions, owner, within, lengths = self.token_layout(rows, kept_only)
        batch, width, d = len(lengths), max(int(lengths.max()) if len(lengths) else 0, 1), self.manifest.dim
        vectors = workspace.take(batch, width, d) if workspace is not None else torch.empty(batch, width, d)
        if self.codec is not None:  # decode, then scatter into the padded layout
            vectors.zero_()
            vectors[torch.from_numpy(owner), torch.from_numpy(within)] = self.token_vectors(positions)
        elif kept_only:  # kept tokens are scattered: gather them first, then copy document by document
            source = torch.from_numpy(np.ascontiguousarray(self.vectors[positions]))
            begins = np.cumsum(lengths) - lengths
        else:
            source, begins = self._vector_tensor(), self.offsets[np.asarray(rows, dtype=np.int64)]
        if self.codec is None:
            for i, (begin, length) in enumerate(zip(begins.tolist(), lengths.tolist())):
                vectors[i, :length].copy_(source[begin:begin + length])
                vectors[i, length:].zero_()
        salience = np.zeros((batch, width), dtype=np.float32)
        salience[owner, within] = self.token_salience(positions)
        mask = torch.arange(width)[None, :] < torch.from_numpy(np.asarray(lengths))[:, None]
        return vectors, mask, torch.from_numpy(salience)

    def _vector_tensor(self):
        """doc_vectors as a read-only float16 torch tensor [T, d] sharing the memmap (never written to)."""
        import torch

        if self._vectors_tensor is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch warns that the memmap is not writable
                self._vectors_tensor = torch.from_numpy(self.vectors)
        return self._vectors_tensor


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

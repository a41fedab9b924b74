"""Checked read access to one committed generation of an index (:class:`StoredIndex`), segment by segment
(:class:`Segment`), with the trained codec of a compressed index (:func:`load_codec`) and reusable scratch memory
for gathering token vectors (:class:`Workspace`). Layout and manifest: :mod:`.format`.
"""
from __future__ import annotations

import codecs
import operator
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from pyserini_aligner.index.codec_spec import PQ_CENTROIDS, CodecSpec
from pyserini_aligner.index.format import (CODEC_CENTROIDS, CODEC_CODEBOOKS, CODEC_REFINE_BOOKS, CODEC_SCALES,
                                           DOCIDS, FAISS_IDS, FAISS_INDEX, FIELDS, IVF_CODES, IVF_DOCS, IVF_OFFSETS,
                                           KEPT, KEPT_BITS, MANIFEST, OFFSETS, SALIENCE, SMALL_FILE, TOKEN_CENTROIDS,
                                           TOKEN_RESIDUALS, VECTORS, IndexFormatError, Manifest, SegmentInfo,
                                           faiss_error_message, read_manifest)
from pyserini_aligner.index import checksums
from pyserini_aligner.index.fields import read_column, read_records
from pyserini_aligner.index.io import file_record


_ROWS_AT_ONCE = 1 << 16  # documents whose tokens are gathered at once when counting the deleted ones' kept tokens


def memmap(path: Path, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Read-only memmap (an empty array for zero-size files, which numpy cannot map)."""
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class RowFile:
    """A file of fixed-size rows (``dtype``, each of ``row_shape``) read by position into memory of the reader's own
    (``pread``), never mapped: a read of a few rows adds them to the kernel's page cache, not to the process's
    resident memory (a memory-mapped read maps the kernel's whole page-cache folio around each byte it touches, up
    to megabytes, so that random reads of a few candidates soon make a large file resident whole). The file is
    opened once, with the segment, and stays readable while this object lives, as a memory map does: a reader of an
    index generation keeps its files though a live update removes them."""

    def __init__(self, path: Path, dtype, row_shape: tuple[int, ...] = ()):
        self.path, self.dtype, self.row_shape = path, np.dtype(dtype), tuple(row_shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(row_shape))
        self._fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def ranges(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Rows [Σ counts, *row_shape] of the runs ``starts[i]`` .. ``starts[i] + counts[i]``, one after the other
        (a run that starts where the one before it ends is read with it, in one call)."""
        starts, counts = np.asarray(starts, np.int64), np.asarray(counts, np.int64)
        out = np.empty((int(counts.sum()), *self.row_shape), self.dtype)
        if not len(out):
            return out
        starts, counts = starts[counts > 0], counts[counts > 0]
        first = np.flatnonzero(np.concatenate([[True], starts[1:] != starts[:-1] + counts[:-1]]))
        lengths = np.add.reduceat(counts, first) * self.row_bytes
        view = memoryview(out.reshape(-1).view(np.uint8))
        at = 0
        for offset, length in zip((starts[first] * self.row_bytes).tolist(), lengths.tolist()):
            if os.preadv(self._fd, [view[at:at + length]], offset) != length:
                raise IndexFormatError(f"{self.path}: shorter than its rows (truncated index file; rebuild the "
                                       "index)")
            at += length
        return out


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
            self.centroid_ids = memmap(paths[TOKEN_CENTROIDS], np.uint16, (t,))
            self.residuals = memmap(paths[TOKEN_RESIDUALS], np.uint8, (t, residual_m or pq_m))
            self.kept_bits = memmap(paths[KEPT_BITS], np.uint8, ((t + 7) // 8,))
            self.ivf_offsets = np.fromfile(paths[IVF_OFFSETS], dtype=np.int64)
            if self.ivf_offsets[0] != 0 or self.ivf_offsets[-1] != k or (np.diff(self.ivf_offsets) < 0).any():
                raise IndexFormatError(f"{paths[IVF_OFFSETS]}: not a non-decreasing run from 0 to {k} (corrupt)")
            self.ivf_docs = memmap(paths[IVF_DOCS], np.int32, (k,))
            self.ivf_codes = memmap(paths[IVF_CODES], np.uint8, (k, pq_m))
            self._files = (RowFile(paths[TOKEN_CENTROIDS], np.uint16), RowFile(paths[TOKEN_RESIDUALS], np.uint8,
                                                                             (residual_m or pq_m,)),
                           RowFile(paths[IVF_DOCS], np.int32), RowFile(paths[IVF_CODES], np.uint8, (pq_m,)))
            self.vectors = self.salience = None
        else:
            self.vectors = memmap(paths[VECTORS], np.float16, (t, d))
            self._vector_tensor = None
            self.salience = memmap(paths[SALIENCE], np.float32, (t,))
            self.kept_bool = memmap(paths[KEPT], np.bool_, (t,))
            self.faiss_ids = np.fromfile(paths[FAISS_IDS], dtype=np.int64)
            if k and (self.faiss_ids.min() < 0 or self.faiss_ids.max() >= t):
                raise IndexFormatError(f"{paths[FAISS_IDS]}: token positions out of range [0, {t})")
        self.docids = Docids.read(paths[DOCIDS] if DOCIDS in paths else self.folder / DOCIDS, n)
        self.fields_path = paths.get(FIELDS)  # None: no document of the segment has stored fields

    def read_tokens(self, rows: np.ndarray, residuals: bool = True) -> tuple[np.ndarray, np.ndarray,
                                                                             np.ndarray | None]:
        """(token counts [N] int64, centroid ids [T] uint16, residual codes [T, R] uint8, or None without
        ``residuals``) of segment ``rows`` [N] (ascending, so that neighbours are read at once), their tokens in row
        order, read from the files by position (:class:`RowFile`): what centroid interaction and refinement need of
        a few candidates of a large index, without making the codes resident. Compressed segments only."""
        centroid_ids, codes, _, _ = self._files
        lengths, starts = self.lengths[rows], self.offsets[rows]
        return lengths, centroid_ids.ranges(starts, lengths), codes.ranges(starts, lengths) if residuals else None

    def read_lists(self, lists: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(entries [L] int64, segment rows [E] int32, codes [E, M] uint8) of inverted lists ``lists`` [L]
        (ascending), their entries list after list, read from the files by position (:class:`RowFile`).
        Compressed segments only."""
        _, _, docs, codes = self._files
        starts, counts = self.ivf_offsets[lists], self.ivf_offsets[lists + 1] - self.ivf_offsets[lists]
        return counts, docs.ranges(starts, counts), codes.ranges(starts, counts)

    @property
    def vector_tensor(self):
        """The stored float16 vectors [T, d] (fp16 segments) as a torch tensor over the same memory map, made once;
        never written."""
        if self._vector_tensor is None:
            import torch

            with warnings.catch_warnings():  # a read-only map: torch warns that writes would fail
                warnings.simplefilter("ignore", UserWarning)
                self._vector_tensor = torch.from_numpy(self.vectors)
        return self._vector_tensor

    @property
    def kept(self) -> np.ndarray:
        """bool [T]: tokens indexed for candidate generation."""
        if self.vectors is not None:
            return np.asarray(self.kept_bool)
        return np.unpackbits(self.kept_bits, count=self.info.num_tokens).astype(bool)

    @property
    def num_live_kept(self) -> int:
        """Tokens of the live documents indexed for candidate generation: the segment's count less the deleted
        documents' (read a block of documents at a time, never a flag per token of the segment)."""
        deleted = np.flatnonzero(self.deleted)
        gone = 0
        for first in range(0, len(deleted), _ROWS_AT_ONCE):
            rows = deleted[first:first + _ROWS_AT_ONCE]
            lengths = self.lengths[rows]
            positions = np.repeat(self.offsets[rows] - (np.cumsum(lengths) - lengths), lengths) \
                + np.arange(int(lengths.sum()))
            if self.vectors is not None:
                gone += int(np.count_nonzero(self.kept_bool[positions]))
            else:  # packbits order: a byte's first token in its high bit
                gone += int(((self.kept_bits[positions >> 3] >> (7 - (positions & 7))) & 1).sum())
        return self.info.num_kept - gone

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


class Docids(Sequence[str]):
    """The docids of consecutive rows, kept as the UTF-8 bytes of ``docids.txt`` files with the offset of each line
    (about 5 bytes beside its text a docid, where a list of Python strings takes about 60): ``docids[row]``, a
    slice (a list), ``len``, iteration, and ``==`` / ``+`` with another sequence of docids as with a list.

    parts: (file bytes, starts [n + 1] uint32 or int64: the offset of each line and one past the last line's end)
    per file, in row order."""

    _DECODE_ROWS = 1 << 16  # docids decoded at once by iteration

    def __init__(self, parts: Sequence[tuple[bytes, np.ndarray]] = ()):
        self._parts = [(blob, starts) for blob, starts in parts if len(starts) > 1]
        self._base = np.cumsum([0] + [len(starts) - 1 for _, starts in self._parts]).astype(np.int64)

    @classmethod
    def read(cls, path: Path, count: int) -> "Docids":
        """The docids of a ``docids.txt`` file (one a line, UTF-8), which must hold ``count`` of them."""
        if not path.is_file():
            raise FileNotFoundError(f"index file missing: {path}")
        blob = path.read_bytes()
        decoder = codecs.getincrementaldecoder("utf-8")()
        view = memoryview(blob)
        try:
            for start in range(0, len(blob), 1 << 24):  # checked a block at a time, never all decoded at once
                decoder.decode(view[start:start + (1 << 24)], final=start + (1 << 24) >= len(blob))
        except UnicodeDecodeError as err:
            raise IndexFormatError(f"{path}: not UTF-8 text ({err})") from None
        if blob and not blob.endswith(b"\n"):
            blob += b"\n"  # a last line without its newline is a docid too
        ends = np.flatnonzero(np.frombuffer(blob, dtype=np.uint8) == ord("\n"))
        if len(ends) != count:
            raise IndexFormatError(f"{path}: {len(ends)} docids, the manifest says {count}")
        starts = np.concatenate([[0], ends + 1]).astype(np.uint32 if len(blob) < 1 << 32 else np.int64)
        return cls([(blob, starts)])

    @classmethod
    def join(cls, tables: Sequence["Docids"]) -> "Docids":
        """The rows of ``tables`` one after the other (their bytes shared, not copied)."""
        return cls([part for table in tables for part in table._parts])

    def __len__(self) -> int:
        return int(self._base[-1])

    def __getitem__(self, row):
        if isinstance(row, slice):
            return [self[i] for i in range(*row.indices(len(self)))]
        row = operator.index(row)
        if row < 0:
            row += len(self)
        if not 0 <= row < len(self):
            raise IndexError(f"docid row {row} out of range [0, {len(self)})")
        number = 0 if len(self._parts) == 1 else int(np.searchsorted(self._base, row, side="right")) - 1
        blob, starts = self._parts[number]
        local = row - int(self._base[number])
        return blob[int(starts[local]):int(starts[local + 1]) - 1].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        for blob, starts in self._parts:
            for first in range(0, len(starts) - 1, self._DECODE_ROWS):
                last = min(first + self._DECODE_ROWS, len(starts) - 1)
                yield from blob[int(starts[first]):int(starts[last]) - 1].decode("utf-8").split("\n")

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # mutable-sequence semantics of the list it stands for: compared by value

    def __add__(self, other: Sequence[str]) -> list[str]:
        return [*self, *other]

    def __repr__(self) -> str:
        return f"Docids({len(self)} rows)"


def load_codec(index_dir: Path, manifest: Manifest, verify_all: bool = False):
    """The index's ResidualCodec (None for fp16 indexes)."""
    import torch

    from pyserini_aligner.index.codec import ResidualCodec, dequantize_centroids

    spec = manifest.codec
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
        self.manifest = m = read_manifest(self.index_dir)
        spec = m.codec
        self.codec = load_codec(self.index_dir, m, verify)
        self.segments = [Segment(self.index_dir, info, m, spec.pq_m, spec.nlist, verify, spec.refine_m)
                         for info in m.segments]
        counts = [s.info.num_docs for s in self.segments]
        tokens = [s.info.num_tokens for s in self.segments]
        self.row_base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.token_base = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        if len(self.segments) == 1:  # the segment's own arrays (8 bytes a document each), not copies
            self.offsets, self.lengths = self.segments[0].offsets, self.segments[0].lengths
        else:
            self.offsets = np.concatenate([[0]] + [s.offsets[1:] + base for s, base in
                                                    zip(self.segments, self.token_base)]).astype(np.int64)
            self.lengths = np.diff(self.offsets)
        self.deleted = np.concatenate([s.deleted for s in self.segments]) if self.segments else np.zeros(0, bool)
        self.live = ~self.deleted
        self.live.flags.writeable = False  # one generation's documents: the count below stays true
        self._num_live = int(self.live.sum())
        self.docids = Docids.join([s.docids for s in self.segments])
        self._docid_rows: dict[str, int] | None = None
        self._kept = None
        self._num_live_kept: int | None = None

    @property
    def codec_spec(self) -> CodecSpec:
        """The index's codec (``manifest.codec``); ``codec_spec.compressed`` tells whether ``codec`` is set."""
        return self.manifest.codec

    @property
    def num_docs(self) -> int:
        """Document rows (deleted rows included; see ``live``)."""
        return len(self.docids)

    @property
    def num_live(self) -> int:
        """Documents not deleted."""
        return self._num_live

    @property
    def num_live_kept(self) -> int:
        """Tokens of the live documents indexed for candidate generation (the inverted-list entries, or FAISS index
        vectors, that a search can return), as a build of only those documents counts them in ``num_kept``."""
        if self._num_live_kept is None:
            self._num_live_kept = sum(s.num_live_kept for s in self.segments)
        return self._num_live_kept

    def verify(self) -> None:
        """Check every file's CRC32 (IndexFormatError naming the first corrupt file)."""
        StoredIndex(self.index_dir, verify=True)

    def row_of(self, docid: str) -> int | None:
        """Row of live document ``docid`` (None when absent or deleted)."""
        if self._docid_rows is None:
            self._docid_rows = {d: row for row, d in enumerate(self.docids) if self.live[row]}
        return self._docid_rows.get(docid)

    @property
    def field_names(self) -> list[str]:
        """Sorted names of the fields stored with the documents of this generation (those of any segment)."""
        return sorted({name for s in self.segments for name in s.info.fields})

    def fields_of(self, rows) -> list[dict]:
        """The stored fields of documents ``rows`` (global rows, deleted ones included), in order: a dict each,
        empty for a document without fields."""
        rows = np.asarray(rows, dtype=np.int64)
        out: list[dict] = [{} for _ in range(len(rows))]
        seg_of = np.searchsorted(self.row_base, rows, side="right") - 1
        for number in np.unique(seg_of):
            seg, base = self.segments[number], int(self.row_base[number])
            if seg.fields_path is not None:
                where = np.flatnonzero(seg_of == number)
                found = read_records(seg.fields_path, rows[where] - base)
                for i in where:
                    out[i] = found.get(int(rows[i]) - base, out[i])
        return out

    def field_column(self, keys: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The stored value at nested ``keys`` (``("metadata", "url")``) of every row: (type codes uint8
        [num_docs], values object [num_docs]) as :func:`.fields.read_column` gives them (NULL where a document has
        no such field)."""
        parts = [read_column(s.fields_path if keys[0] in s.info.fields else None, keys, s.info.num_docs)
                 for s in self.segments]
        if not parts:
            return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=object)
        return np.concatenate([c for c, _ in parts]), np.concatenate([v for _, v in parts])

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
        if self.codec_spec.compressed:
            return self.codec.decode(*self.token_codes(positions), device=device)
        out = torch.empty(len(positions), self.manifest.dim)
        for number, local, where in self._by_segment(positions):
            part = self.segments[number].vector_tensor.index_select(0, torch.from_numpy(local))
            if isinstance(where, slice):
                out[where] = part  # (torch converts float16 several times faster than numpy)
            else:
                out[torch.from_numpy(where)] = part.float()
        return out.to(device)

    def token_salience(self, positions: np.ndarray) -> np.ndarray:
        """float32 [t] stored saliences (ones for a compressed index, which stores none)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.codec_spec.compressed:
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

"""Writing one immutable segment (layout in :mod:`pyserini_aligner.index.format`) from batches of encoded documents.

Each batch is pruned (β^d, redundancy-aware) and, with a compressed codec, assigned to centroids and PQ-coded on the
device it arrives on; only codes reach the disk, appended as they come, so a build writes no fp16 intermediate and
its memory does not grow with the corpus beyond the kept tokens' inverted-list entries (a few bytes each).
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.index import checksums, faults
from pyserini_aligner.index.fields import FieldsWriter
from pyserini_aligner.index.format import (CODEC_CENTROIDS, CODEC_CODEBOOKS, CODEC_REFINE_BOOKS, CODEC_SCALES, DOCIDS,
                                           FAISS_IDS, FAISS_INDEX, FIELDS, IVF_CODES, IVF_DOCS, IVF_OFFSETS, KEPT,
                                           KEPT_BITS, OFFSETS, SALIENCE, TOKEN_CENTROIDS, TOKEN_RESIDUALS, VECTORS,
                                           SegmentInfo, faiss_error_message)
from pyserini_aligner.index.io import file_record
from pyserini_aligner.index.reader import memmap
from pyserini_aligner.index.format import new_faiss_index
from pyserini_aligner.index.codec import ResidualCodec, quantize_centroids
from pyserini_aligner.index.codec_spec import PQ_CENTROIDS

_ADD_CHUNK = 1 << 16  # vectors per FAISS add() call


class _Sink:
    """A file written in appends, with its size and CRC32s (whole file, blocks) kept as it grows."""

    def __init__(self, path: Path):
        self.handle, self.sums = path.open("wb"), checksums.BlockCrc()

    def write(self, data: bytes) -> None:
        self.handle.write(data)
        self.sums.update(data)

    def close(self) -> dict:
        self.handle.flush()
        import os

        os.fsync(self.handle.fileno())
        self.handle.close()
        return self.sums.record()


def write_files(folder: Path, contents: dict[str, bytes]) -> dict[str, dict]:
    """Write small files whole; returns their manifest records."""
    records = {}
    for name, data in contents.items():
        sink = _Sink(folder / name)
        sink.write(data)
        records[name] = sink.close()
    return records


def write_codec(folder: Path, codec: ResidualCodec) -> dict[str, dict]:
    """Write a codec folder (centroids as int8 + scale, codebooks as float32, and the refinement's codebooks when
    it has them); returns the file records."""
    folder.mkdir(parents=True, exist_ok=False)
    values, scales = quantize_centroids(codec.centroids)
    files = {CODEC_CENTROIDS: values.tobytes(), CODEC_SCALES: scales.tobytes(),
             CODEC_CODEBOOKS: codec.codebooks.cpu().numpy().astype(np.float32).tobytes()}
    if codec.refine_books is not None:
        files[CODEC_REFINE_BOOKS] = codec.refine_books.cpu().numpy().astype(np.float32).tobytes()
    return write_files(folder, files)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SegmentWriter:
    """Appends documents to a new segment folder; :meth:`finish` completes its files and returns its SegmentInfo.

    codec: the index's ResidualCodec (compressed) or None (fp16, with a FAISS ``index_type`` index over the kept
    tokens). doc_prune: β^d. redundancy: cosine threshold of redundancy-aware pruning, or None.
    """

    def __init__(self, folder: Path, dim: int, doc_prune: float, redundancy: float | None,
                 codec: ResidualCodec | None, index_type: str = "Flat"):
        self.folder, self.dim, self.doc_prune, self.redundancy = folder, dim, doc_prune, redundancy
        self.codec, self.index_type = codec, index_type
        folder.mkdir(parents=True, exist_ok=False)
        names = ([TOKEN_CENTROIDS, TOKEN_RESIDUALS, KEPT_BITS] if codec is not None
                 else [VECTORS, SALIENCE, KEPT])
        self.sinks = {name: _Sink(folder / name) for name in names + [OFFSETS, DOCIDS]}
        self.sinks[OFFSETS].write(np.zeros(1, dtype=np.int64).tobytes())
        self.num_docs = self.num_tokens = self.num_kept = self.num_truncated = 0
        self._bits_carry = np.zeros(0, dtype=bool)
        self._ivf: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (centroid, doc row, code) of kept tokens
        self._fields: FieldsWriter | None = None  # opened with the first document that has fields
        self.seconds = {"prune_s": 0.0, "codec_s": 0.0, "write_s": 0.0}
        if codec is not None:
            self.seconds["codec_encode_s"] = 0.0  # assigning and quantising every token (codec_s adds training)

        self._error, self._error_tokens = 0.0, 0  # squared reconstruction error of the tokens encoded here
        if codec is not None and codec.codebooks.shape[1] != PQ_CENTROIDS:
            raise ValueError("codec codebooks must have 256 entries per sub-quantizer")

    def add(self, docids: list[str], vectors: Tensor, mask: Tensor, salience: Tensor, truncated: int = 0,
            fields: list[dict] | None = None) -> None:
        """Append documents: vectors [B, L, d] (L2-normalised, any device and float dtype), mask [B, L] bool,
        salience [B, L]; ``truncated``: how many of them were cut at the length limit; ``fields``: [B] each one's
        stored fields (dicts, empty when none), or None."""
        from pyserini_aligner.salience import prune_mask

        device = vectors.device
        begin = time.perf_counter()
        mask = mask.to(device=device, dtype=torch.bool)
        need_vectors = self.redundancy is not None and self.doc_prune < 1.0
        kept = prune_mask(salience.float(), mask, self.doc_prune, vectors.float() if need_vectors else None,
                          self.redundancy)
        flat, flat_kept = vectors[mask], kept[mask]
        lengths = mask.sum(1).cpu().numpy().astype(np.int64)
        _sync(device)
        self.seconds["prune_s"] += time.perf_counter() - begin
        self.add_tokens(docids, lengths, flat, flat_kept.cpu().numpy(), salience=salience.float()[mask],
                        truncated=truncated, fields=fields)

    def add_tokens(self, docids: list[str], lengths: np.ndarray, vectors, kept: np.ndarray, salience=None,
                   codes: tuple[np.ndarray, np.ndarray] | None = None, truncated: int = 0,
                   fields: list[dict] | None = None) -> None:
        """Append documents given as flat tokens: lengths [B], vectors [t, d] (tensor or array; None when ``codes``
        = (centroid ids [t], residual codes [t, M]) are given), kept [t] bool, salience [t] (fp16 store only),
        fields [B] (dicts, empty when none) or None."""
        begin = time.perf_counter()
        for row, record in enumerate(fields or (), self.num_docs):
            if record:
                if self._fields is None:
                    self._fields = FieldsWriter(self.folder / FIELDS)
                self._fields.add(row, record)
        lengths = np.asarray(lengths, dtype=np.int64)
        kept = np.asarray(kept, dtype=bool)
        if self.codec is not None:
            if codes is None:
                x = torch.as_tensor(vectors).float()
                ids = self.codec.encode_centroids(x)
                residuals = self.codec.encode_residuals(x, ids)
                decoded = self.codec.decode(ids, residuals, device=x.device)
                self._error += float(((decoded - x) ** 2).sum())
                self._error_tokens += len(x)
            else:
                ids, residuals = (np.ascontiguousarray(c) for c in codes)
            where = np.flatnonzero(kept)  # list codes: the coarse codes of the kept tokens' decoded token codes,
            stored = self.codec.decode(ids[where], residuals[where], device=self.codec.centroids.device)
            list_codes = self.codec.encode_list_codes(stored, ids[where], residuals[where])  # a function of the codes
            elapsed = time.perf_counter() - begin
            self.seconds["codec_s"] += elapsed
            self.seconds["codec_encode_s"] += elapsed
            begin = time.perf_counter()
            owner = np.repeat(np.arange(len(lengths), dtype=np.int32) + self.num_docs, lengths)
            self._ivf.append((ids[kept], owner[kept], list_codes))
            self.sinks[TOKEN_CENTROIDS].write(ids.astype(np.uint16).tobytes())
            self.sinks[TOKEN_RESIDUALS].write(residuals.astype(np.uint8).tobytes())
            bits = np.concatenate([self._bits_carry, kept])
            whole = len(bits) // 8 * 8
            self.sinks[KEPT_BITS].write(np.packbits(bits[:whole]).tobytes())
            self._bits_carry = bits[whole:]
        else:
            x = torch.as_tensor(vectors)
            self.sinks[VECTORS].write(x.to(torch.float16).cpu().numpy().tobytes())
            sal = torch.as_tensor(salience) if salience is not None else torch.ones(len(x))
            self.sinks[SALIENCE].write(sal.float().cpu().numpy().tobytes())
            self.sinks[KEPT].write(kept.tobytes())
        self.sinks[OFFSETS].write((self.num_tokens + np.cumsum(lengths)).astype(np.int64).tobytes())
        self.sinks[DOCIDS].write("".join(f"{docid}\n" for docid in docids).encode("utf-8"))
        self.num_docs += len(docids)
        self.num_tokens += int(lengths.sum())
        self.num_kept += int(kept.sum())
        self.num_truncated += truncated
        self.seconds["write_s"] += time.perf_counter() - begin
        faults.point("segment-add")

    def finish(self, train_size: int = 100_000, seed: int = 0, progress: bool = False) -> SegmentInfo:
        """Close the streamed files and write the inverted lists (compressed) or the FAISS index (fp16)."""
        begin = time.perf_counter()
        if self.codec is not None and len(self._bits_carry):
            self.sinks[KEPT_BITS].write(np.packbits(self._bits_carry).tobytes())
        files = {name: sink.close() for name, sink in self.sinks.items()}
        names = sorted(self._fields.names) if self._fields is not None else []
        if self._fields is not None:
            files[FIELDS] = self._fields.finish()
            self._fields = None
        if self.codec is not None:
            files.update(self._write_ivf())
        else:
            files.update(self._write_faiss(train_size, seed, progress))
        self.seconds["write_s"] += time.perf_counter() - begin
        if self._error_tokens:
            self.seconds["reconstruction_mse"] = self._error / self._error_tokens
        faults.point("segment-finish")
        return SegmentInfo(name=self.folder.name, num_docs=self.num_docs, num_tokens=self.num_tokens,
                           num_kept=self.num_kept, num_truncated=self.num_truncated,
                           files=files, build_stats=dict(self.seconds), fields=names)

    def abort(self) -> None:
        """Close and remove the unfinished segment folder."""
        for sink in self.sinks.values():
            sink.handle.close()
        if self._fields is not None:
            self._fields.abort()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _write_ivf(self) -> dict[str, dict]:
        nlist, m = len(self.codec.centroids), len(self.codec.codebooks)
        if self._ivf:
            ids, docs, codes = (np.concatenate(part) for part in zip(*self._ivf))
        else:
            ids, docs, codes = np.zeros(0, np.uint16), np.zeros(0, np.int32), np.zeros((0, m), np.uint8)
        self._ivf = []
        order = np.argsort(ids, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(np.bincount(ids, minlength=nlist))]).astype(np.int64)
        return write_files(self.folder, {IVF_OFFSETS: offsets.tobytes(),
                                         IVF_DOCS: docs[order].astype(np.int32).tobytes(),
                                         IVF_CODES: np.ascontiguousarray(codes[order]).tobytes()})

    def _write_faiss(self, train_size: int, seed: int, progress: bool) -> dict[str, dict]:
        """faiss_ids.i64 and faiss.index over the kept tokens of the fp16 files just written."""
        import faiss
        from tqdm.auto import tqdm

        total = self.num_tokens
        vectors = memmap(self.folder / VECTORS, np.float16, (total, self.dim))
        kept = memmap(self.folder / KEPT, np.bool_, (total,))
        faiss_ids = np.flatnonzero(np.asarray(kept)).astype(np.int64)
        index = new_faiss_index(self.dim, self.index_type)
        if not index.is_trained:
            count = min(train_size, len(faiss_ids))
            sample = np.sort(np.random.default_rng(seed).choice(len(faiss_ids), size=count, replace=False))
            try:
                index.train(np.ascontiguousarray(vectors[faiss_ids[sample]], dtype=np.float32))
            except RuntimeError as err:
                raise ValueError(f"index_type {self.index_type!r}: FAISS training on {count} kept token vectors "
                                 f"failed ({faiss_error_message(err)}); use a smaller index or more "
                                 "documents") from None
        for start in tqdm(range(0, len(faiss_ids), _ADD_CHUNK), desc="faiss add", unit="chunk",
                          disable=not progress):
            index.add(np.ascontiguousarray(vectors[faiss_ids[start:start + _ADD_CHUNK]], dtype=np.float32))
        del vectors, kept
        faiss.write_index(index, str(self.folder / FAISS_INDEX))
        records = write_files(self.folder, {FAISS_IDS: faiss_ids.tobytes()})
        records[FAISS_INDEX] = file_record(self.folder / FAISS_INDEX)
        return records

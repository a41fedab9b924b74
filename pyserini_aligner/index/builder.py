"""Streaming build of a multi-vector index (layout in :mod:`pyserini_aligner.index.store`).

Documents are encoded in chunks and their token vectors appended straight to disk, so peak memory grows with the
batch size, not the corpus. The β^d most salient tokens of each document then go into FAISS, read back from the
memory-mapped vector file in chunks. Everything is written to a temporary folder next to the target and renamed
into place at the end; on any error the temporary folder is removed and the target is left untouched.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from pyserini_aligner.index import store
from pyserini_aligner.index.codec import FP16, ResidualCodec, parse_codec, quantize_centroids
from pyserini_aligner.index.corpus import Location
from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

log = logging.getLogger(__name__)

DEFAULT_INDEX_TYPE = "IndexFlatIP"
_FLAT_ALIASES = {"indexflatip": "Flat", "flatip": "Flat", "flat": "Flat"}
_ADD_CHUNK = 1 << 16  # vectors per FAISS add() call
CODEC_POINTS_PER_CENTROID = 32  # k-means sample: at least this many tokens per coarse centroid (all when fewer)


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
        raise ValueError(f"index_type {index_type!r}: FAISS cannot build it ({store.faiss_error_message(err)}); "
                         "examples: 'IndexFlatIP', 'IVF256,Flat', 'IVF256,PQ16x8', 'HNSW32'") from None


class _Writer:
    """Appends per-document token data to the index files of ``folder``."""

    def __init__(self, folder: Path):
        self.files = {name: (folder / name).open("wb") for name in
                      (store.VECTORS, store.SALIENCE, store.KEPT, store.OFFSETS, store.DOCIDS)}
        self.num_docs = self.num_tokens = self.num_kept = 0
        self.files[store.OFFSETS].write(np.zeros(1, dtype=np.int64).tobytes())

    def add(self, docids: list[str], vectors: list[np.ndarray], salience: list[np.ndarray],
            kept: list[np.ndarray]) -> None:
        """Append documents: vectors [len, d], salience [len] and kept [len] (bool) per document."""
        lengths = np.array([len(v) for v in vectors], dtype=np.int64)
        if lengths.sum():
            self.files[store.VECTORS].write(np.concatenate(vectors).astype(np.float16).tobytes())
            self.files[store.SALIENCE].write(np.concatenate(salience).astype(np.float32).tobytes())
            self.files[store.KEPT].write(np.concatenate(kept).astype(np.bool_).tobytes())
        self.files[store.OFFSETS].write((self.num_tokens + np.cumsum(lengths)).tobytes())
        self.files[store.DOCIDS].write("".join(f"{docid}\n" for docid in docids).encode("utf-8"))
        self.num_docs += len(docids)
        self.num_tokens += int(lengths.sum())
        self.num_kept += int(sum(int(k.sum()) for k in kept))

    def __enter__(self) -> "_Writer":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.files.values():
            handle.close()


def _load_model(encoder, device: str | None):
    from pyserini_aligner.model import AlignerModel

    if isinstance(encoder, AlignerModel):
        return encoder.to(device) if device else encoder
    if hasattr(encoder, "model") and isinstance(encoder.model, AlignerModel):  # Pyserini-style encoder wrapper
        return encoder.model.to(device) if device else encoder.model
    return AlignerModel.from_pretrained(str(encoder), device=device or "cpu")


def model_name_of(encoder) -> str:
    """Name to record in the manifest: "aligner", an absolute checkpoint folder, or for an in-memory model its
    ``name_or_path`` attribute when it has one (else "": searchers must then be given the model)."""
    if isinstance(encoder, (str, os.PathLike)):
        name = str(encoder)
        return name if name == "aligner" or not Path(name).exists() else str(Path(name).resolve())
    model = getattr(encoder, "model", encoder)
    return str(getattr(model, "name_or_path", "") or "")


def _checked_items(corpus: Iterable, max_docs: int | None, docids: "_DocidRegistry") -> Iterator[tuple[str, str]]:
    """(docid, text) from (docid, text) or (docid, text, Location) items; refuses duplicate or malformed docids."""
    for position, item in enumerate(islice(corpus, max_docs), 1):
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise ValueError(f"corpus item {position}: expected (docid, text) or (docid, text, Location), "
                             f"got {item!r:.80}")
        where = item[2] if len(item) == 3 else Location("corpus", position, "document")
        if not isinstance(where, Location):
            raise TypeError(f"corpus item {position}: location must be a Location, got {type(where).__name__}")
        docid, text = item[0], item[1]
        docids.add(docid, where)
        if not isinstance(text, str):
            raise ValueError(f"{where}: text of docid {docid!r} must be a string, got {type(text).__name__}")
        yield docid, text


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


class _DocidRegistry:
    """Refuses duplicate or malformed docids; remembers where each docid was first seen, compactly."""

    def __init__(self):
        self.first: dict[str, int] = {}
        self.sources: list[str] = []
        self._source_ids: dict[str, int] = {}

    def _pack(self, where: Location) -> int:
        source, number, unit = where
        key = f"{unit}\0{source}"
        if key not in self._source_ids:
            self._source_ids[key] = len(self.sources)
            self.sources.append(key)
        return (self._source_ids[key] << 40) | number

    def _unpack(self, packed: int) -> str:
        unit, source = self.sources[packed >> 40].split("\0", 1)
        return str(Location(source, packed & ((1 << 40) - 1), unit))

    def add(self, docid, where: Location) -> None:
        if not isinstance(docid, str) or not docid or "\n" in docid or "\r" in docid:
            raise ValueError(f"{where}: docid {docid!r} must be a non-empty string without line breaks")
        packed = self._pack(where)
        first = self.first.setdefault(docid, packed)
        if first != packed:
            raise ValueError(f"duplicate docid {docid!r}: first at {self._unpack(first)}, again at {where}")


def _encode_chunk(model, chunk: list[tuple[str, str]], writer: "_Writer", batch_size: int, doc_prune: float,
                  redundancy: float | None) -> int:
    """Encode a chunk of (docid, text), prune with β^d and append it to ``writer``; returns how many were truncated."""
    from pyserini_aligner.salience import prune_mask

    encoded = model.encode([text for _, text in chunk], is_query=False, batch_size=batch_size)
    lengths = torch.tensor([len(e.vectors) for e in encoded])
    width = max(int(lengths.max()), 1)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    salience = torch.zeros(len(encoded), width)
    vectors = torch.zeros(len(encoded), width, model.config.dim) if redundancy is not None and doc_prune < 1 else None
    for row, e in enumerate(encoded):
        salience[row, :len(e.salience)] = torch.from_numpy(e.salience)
        if vectors is not None:
            vectors[row, :len(e.vectors)] = torch.from_numpy(np.asarray(e.vectors, dtype=np.float16).astype(np.float32))
    kept = prune_mask(salience, mask, doc_prune, vectors, redundancy).numpy()
    writer.add([docid for docid, _ in chunk], [e.vectors for e in encoded], [e.salience for e in encoded],
               [kept[row, :len(e.vectors)] for row, e in enumerate(encoded)])
    return sum(e.truncated for e in encoded)


def build_index(corpus: Iterable, index_dir: str | os.PathLike, encoder="aligner", *, doc_prune: float = 1.0,
                index_type: str = DEFAULT_INDEX_TYPE, batch_size: int = 32, device: str | None = None,
                max_docs: int | None = None, progress: bool = True, train_size: int = 100_000,
                overwrite: bool = False, seed: int = 0, model_name: str | None = None,
                corpus_name: str = "", codec: str = FP16,
                prune_redundancy: float | None = DEFAULT_PRUNE_REDUNDANCY) -> store.Manifest:
    """Encode ``corpus`` and write an index folder at ``index_dir``; returns its manifest.

    corpus: (docid, text) or (docid, text, Location) items. encoder: "aligner", a checkpoint folder or an
    AlignerModel. doc_prune: β^d in (0, 1], the fraction of each document's most salient tokens put in FAISS
    (all tokens are stored for refinement). index_type: FAISS factory string (inner product); trained indexes
    are trained on up to ``train_size`` kept vectors sampled with ``seed``. model_name: what to record as the
    model's name in the manifest (default: derived from ``encoder``). corpus_name: where the texts came from
    (JsonCollection path or ir_datasets id), recorded in the manifest. prune_redundancy: cosine threshold of
    redundancy-aware pruning (salience.prune_mask: a document's near-duplicate tokens go to FAISS only when its
    distinct tokens do not fill the β^d budget); None prunes by salience alone.
    """
    from pyserini_aligner.salience import keep_count

    keep_count(1, doc_prune)  # validates β^d
    _check_redundancy(prune_redundancy)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"max_docs must be >= 1, got {max_docs}")
    target = Path(index_dir).absolute()
    _check_target(target, overwrite)
    started = time.time()
    model = _load_model(encoder, device)
    dim = model.config.dim
    index_type = _check_codec(codec, dim, index_type, model.scores_with_salience)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        docids = _DocidRegistry()
        num_truncated = num_empty = 0
        chunk_docs = batch_size * 8  # encode() sorts each chunk by length, so bigger chunks pad less
        with _Writer(work) as writer, tqdm(total=max_docs, unit="doc", desc="index", disable=not progress) as bar:
            for chunk in _chunks(_checked_items(corpus, max_docs, docids), chunk_docs):
                num_truncated += _encode_chunk(model, chunk, writer, batch_size, doc_prune, prune_redundancy)
                num_empty += sum(not text.strip() for _, text in chunk)
                bar.update(len(chunk))
        if writer.num_docs == 0:
            raise ValueError("empty corpus: no documents to index")
        if num_empty:
            log.warning("%d of %d documents have empty text", num_empty, writer.num_docs)
        from pyserini_aligner import __version__

        manifest = store.Manifest(
            model_name=model_name if model_name is not None else model_name_of(encoder),
            model_fingerprint=model.fingerprint(), dim=dim,
            doc_prune=float(doc_prune), index_type=faiss_factory_string(index_type), num_docs=writer.num_docs,
            num_tokens=writer.num_tokens, num_kept=writer.num_kept, num_truncated=num_truncated,
            num_empty=num_empty, default_strategy=model.config.default_strategy, corpus=corpus_name,
            package_version=__version__, codec=str(parse_codec(codec, dim)), prune_redundancy=prune_redundancy)
        _finish(work, target, manifest, train_size, seed, progress, overwrite, device)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("indexed %d documents (%d tokens, %d in FAISS %s) into %s in %.1f s", manifest.num_docs,
             manifest.num_tokens, manifest.num_kept, manifest.index_type, target, time.time() - started)
    return manifest


def derive_index(source_dir: str | os.PathLike, index_dir: str | os.PathLike, *, doc_prune: float | None = None,
                 index_type: str | None = None, progress: bool = True, train_size: int = 100_000,
                 overwrite: bool = False, seed: int = 0, codec: str = FP16,
                 device: str | None = None, prune_redundancy: float | None | str = "source") -> store.Manifest:
    """A new index from an existing fp16 one without re-encoding: the same stored tokens with another β^d
    (recomputed from the stored saliences and vectors), FAISS factory string and/or compressed ``codec``; returns
    the new manifest. prune_redundancy: as in :func:`build_index`, or "source" (default) for the source's.
    The token files are hard-linked when the file system allows (copied otherwise)."""
    from pyserini_aligner.salience import prune_mask

    source = store.StoredIndex(source_dir)
    old = source.manifest
    if source.codec is not None:
        raise ValueError(f"cannot derive from {source_dir}: its tokens are compressed ({old.codec}); derive from the "
                         "fp16 index it was built from")
    doc_prune = old.doc_prune if doc_prune is None else doc_prune
    index_type = old.index_type if index_type is None else index_type
    redundancy = old.prune_redundancy if prune_redundancy == "source" else prune_redundancy
    _check_redundancy(redundancy)
    if not 0.0 < doc_prune <= 1.0:
        raise ValueError(f"doc_prune must be in (0, 1], got {doc_prune}")
    target = Path(index_dir).absolute()
    if target == source.index_dir.absolute():
        raise ValueError(f"derive_index needs a new folder, got the source itself: {target}")
    _check_target(target, overwrite)
    index_type = _check_codec(codec, old.dim, index_type, False)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        for name in (store.VECTORS, store.SALIENCE, store.OFFSETS, store.DOCIDS):  # never modified in place
            try:
                os.link(source.index_dir / name, work / name)
            except OSError:  # another file system, or no hard links there
                shutil.copyfile(source.index_dir / name, work / name)
        num_kept = 0
        with_vectors = redundancy is not None and doc_prune < 1.0  # the redundancy rule compares token vectors
        step = 256 if with_vectors else 4096
        with (work / store.KEPT).open("wb") as out:
            for start in range(0, old.num_docs, step):
                rows = np.arange(start, min(start + step, old.num_docs))
                if with_vectors:
                    vectors, mask, salience = source.gather(rows)
                else:
                    (salience, mask), vectors = source.padded_salience(rows), None
                kept = prune_mask(salience, mask, doc_prune, vectors, redundancy)[mask].numpy()
                out.write(kept.tobytes())
                num_kept += int(kept.sum())
        manifest = dataclasses.replace(old, doc_prune=float(doc_prune), index_type=faiss_factory_string(index_type),
                                       num_kept=num_kept, created="", codec=str(parse_codec(codec, old.dim)),
                                       prune_redundancy=redundancy)
        _finish(work, target, manifest, train_size, seed, progress, overwrite, device)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("derived %s (%s, codec %s, doc_prune=%g) from %s", target, manifest.index_type, manifest.codec,
             doc_prune, source.index_dir)
    return manifest


def _check_redundancy(threshold) -> None:
    """prune_redundancy must be None or a cosine threshold in (0, 1]."""
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0.0 < threshold <= 1.0):
        raise ValueError(f"prune_redundancy must be None or a cosine threshold in (0, 1], got {threshold!r}")


def _check_codec(codec: str, dim: int, index_type: str, scores_with_salience: bool) -> str:
    """Validate codec and index_type together; returns the FAISS factory string to record."""
    spec = parse_codec(codec, dim)
    if not spec.compressed:
        new_faiss_index(dim, index_type)  # fail fast on a bad factory string
        return index_type
    if scores_with_salience:
        raise ValueError(f"codec {spec} stores no token saliences, but the model scores with them; use codec fp16")
    return str(spec)  # FAISS searches the codec's own IVF-PQ codes


def _finish(work: Path, target: Path, manifest: store.Manifest, train_size: int, seed: int, progress: bool,
            overwrite: bool, device: str | None = None) -> None:
    """Build FAISS (or compress the token store) in ``work``, write the manifest, then move ``work`` to ``target``."""
    if parse_codec(manifest.codec).compressed:
        _compress(work, manifest, train_size, seed, progress, device or "cpu")
    else:
        _build_faiss(work, manifest.dim, manifest.index_type, manifest.num_tokens, manifest.num_kept, train_size,
                     seed, progress)
    store.write_manifest(work, manifest)
    for path in work.iterdir():
        path.chmod(0o644)
    work.chmod(0o755)
    _move_into_place(work, target, overwrite)


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not overwrite:
        if not target.is_dir() or any(target.iterdir()):
            raise FileExistsError(f"index target exists: {target} (pass overwrite=True / --overwrite to replace it)")


def _move_into_place(work: Path, target: Path, overwrite: bool) -> None:
    _check_target(target, overwrite)
    if target.exists():
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "index")
            os.replace(work, target)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.replace(work, target)


def _build_faiss(folder: Path, dim: int, index_type: str, num_tokens: int, num_kept: int, train_size: int,
                 seed: int, progress: bool) -> None:
    """Write ``faiss_ids.i64`` and ``faiss.index`` from the kept tokens of the vector files in ``folder``."""
    import faiss

    vectors = np.memmap(folder / store.VECTORS, dtype=np.float16, mode="r", shape=(num_tokens, dim))
    kept = np.memmap(folder / store.KEPT, dtype=np.bool_, mode="r", shape=(num_tokens,))
    with (folder / store.FAISS_IDS).open("wb") as out:
        for start in range(0, num_tokens, 1 << 22):
            out.write((start + np.flatnonzero(kept[start:start + (1 << 22)])).astype(np.int64).tobytes())
    faiss_ids = np.memmap(folder / store.FAISS_IDS, dtype=np.int64, mode="r", shape=(num_kept,))
    index = new_faiss_index(dim, index_type)
    if not index.is_trained:
        count = min(train_size, num_kept)
        sample = np.sort(np.random.default_rng(seed).choice(num_kept, size=count, replace=False))
        log.info("training FAISS %s on %d of %d kept vectors", index_type, count, num_kept)
        try:
            index.train(np.ascontiguousarray(vectors[faiss_ids[sample]], dtype=np.float32))
        except RuntimeError as err:
            raise ValueError(f"index_type {index_type!r}: FAISS training on {count} kept token vectors failed "
                             f"({store.faiss_error_message(err)}); use a smaller index or more documents") from None
    for start in tqdm(range(0, num_kept, _ADD_CHUNK), desc="faiss add", unit="chunk", disable=not progress):
        rows = faiss_ids[start:start + _ADD_CHUNK]
        index.add(np.ascontiguousarray(vectors[rows], dtype=np.float32))
    faiss.write_index(index, str(folder / store.FAISS_INDEX))
    del vectors, kept, faiss_ids


def _compress(folder: Path, manifest: store.Manifest, train_size: int, seed: int, progress: bool,
              device: str) -> None:
    """Replace the fp16 token files in ``folder`` by ``manifest.codec`` codes (layout in :mod:`..store`)."""
    spec = parse_codec(manifest.codec, manifest.dim)
    total, dim = manifest.num_tokens, manifest.dim
    vectors = np.memmap(folder / store.VECTORS, dtype=np.float16, mode="r", shape=(total, dim))
    kept = np.array(np.memmap(folder / store.KEPT, dtype=np.bool_, mode="r", shape=(total,)))
    rng = np.random.default_rng(seed)
    sample = rng.choice(total, min(total, max(train_size, CODEC_POINTS_PER_CENTROID * spec.nlist)), replace=False)
    log.info("training codec %s on %d of %d tokens on %s", spec, len(sample), total, device)
    sample_vectors = torch.from_numpy(np.asarray(vectors[np.sort(sample)], dtype=np.float32)).to(device)
    residual_vectors = torch.from_numpy(np.asarray(vectors[np.sort(sample[:train_size])], dtype=np.float32)).to(device)
    codec = ResidualCodec.train(spec, sample_vectors, residual_vectors, seed=seed)
    del sample_vectors, residual_vectors
    with (folder / store.TOKEN_CENTROIDS).open("wb") as ids_out, \
            (folder / store.TOKEN_RESIDUALS).open("wb") as residuals_out:
        for start in tqdm(range(0, total, _ADD_CHUNK), desc="compress", unit="chunk", disable=not progress):
            x = torch.from_numpy(np.asarray(vectors[start:start + _ADD_CHUNK], dtype=np.float32)).to(device)
            ids = codec.encode_centroids(x)
            ids_out.write(ids.tobytes())
            residuals_out.write(codec.encode_residuals(x, ids).tobytes())
    (folder / store.KEPT_BITS).write_bytes(np.packbits(kept).tobytes())
    values, scales = quantize_centroids(codec.centroids)
    (folder / store.CODEC_CENTROIDS).write_bytes(values.tobytes())
    (folder / store.CODEC_SCALES).write_bytes(scales.tobytes())
    (folder / store.CODEC_CODEBOOKS).write_bytes(codec.codebooks.cpu().numpy().astype(np.float32).tobytes())
    del vectors
    for name in (store.VECTORS, store.SALIENCE, store.KEPT):  # links to a source index are only unlinked
        (folder / name).unlink()

"""Streaming build of an index (layout in :mod:`pyserini_aligner.index.format`).

A compressed build (the default) reads the corpus once into a temporary file and trains its codec on the token
vectors of a uniform sample of its documents (:mod:`.sample`), then encodes the corpus chunk by chunk on the model's
device, prunes, compresses and appends the codes of each chunk to one new segment: it writes no fp16 intermediate,
so peak disk is the final index and the corpus's text. A fresh index is built in a temporary
folder beside the target and renamed into place. ``--overwrite`` of an existing index commits a new generation
inside it (readers keep their snapshot) and never touches a folder that is not an index of this package.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.index.codec import ResidualCodec
from pyserini_aligner.index.codec_spec import SMALL_CORPUS_TOKENS, AutoCodec, CodecSpec, resolve_codec
from pyserini_aligner.index.commit import check_target, new_name, write_index
from pyserini_aligner.index.corpus import DocidRegistry, checked_items
from pyserini_aligner.index.format import (MANIFEST, Manifest, SegmentInfo, check_factory_string,
                                           faiss_factory_string, read_manifest)
from pyserini_aligner.index.options import BuildOptions, build_options
from pyserini_aligner.index.reader import StoredIndex, load_codec
from pyserini_aligner.index.sample import Spill, uniform_is_worth_it
from pyserini_aligner.index.segment import SegmentWriter, write_codec
from pyserini_aligner.resolve import load_model

log = logging.getLogger(__name__)

CODEC_POINTS_PER_CENTROID = 32  # k-means sample: this many tokens per coarse centroid (all tokens when fewer)


def model_name_of(encoder) -> str:
    """Name to record in the manifest: a shipped checkpoint's name ("aligner", "aligner-mix"), an absolute
    checkpoint folder, or for an in-memory model its ``name_or_path`` attribute when it has one (else "": searchers
    must then be given the model)."""
    if isinstance(encoder, (str, os.PathLike)):
        name = str(encoder)
        return name if name in SHIPPED or not Path(name).exists() else str(Path(name).resolve())
    model = getattr(encoder, "model", encoder)
    return str(getattr(model, "name_or_path", "") or "")


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


@dataclasses.dataclass
class EncodedChunk:
    """One chunk of encoded documents, padded, on the model's device."""

    docids: list[str]
    vectors: torch.Tensor  # [B, L, d]
    mask: torch.Tensor  # [B, L] bool
    salience: torch.Tensor  # [B, L]
    truncated: int
    seconds: float  # encoding time
    fields: list | None = None  # [B] each document's stored fields (a dict, empty when none); None: none at all

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def encode_chunks(model, items: Iterable[tuple], batch_size: int, maxlen: int | None,
                  chunk_docs: int | None = None, compute: str | None = None) -> Iterator[EncodedChunk]:
    """Encode (docid, text) or (docid, text, fields) items chunk by chunk (length-sorted batches inside a chunk;
    fp16 vectors on a GPU; ``compute``: the autocast precision, as :meth:`AlignerModel.encode_token_ids` takes it);
    the fields ride along with their documents. The next chunk is read and tokenised in a background thread while
    the model encodes the current one."""
    dtype = torch.float16 if model.device.type == "cuda" else torch.float32
    chunks = _chunks(items, chunk_docs or batch_size * 16)

    def read_next():
        chunk = next(chunks, None)
        if chunk is None:
            return None
        return chunk, *model.tokenize([item[1] for item in chunk], is_query=False, maxlen=maxlen)

    with ThreadPoolExecutor(1, thread_name_prefix="aligner-tokenize") as pool:
        pending = pool.submit(read_next)
        while (ready := pending.result()) is not None:
            pending = pool.submit(read_next)
            begin = time.perf_counter()
            chunk, ids, truncated = ready
            model.report_truncation("doc", sum(truncated), len(ids), maxlen)
            out = model.encode_token_ids(ids, is_query=False, batch_size=batch_size, dtype=dtype, compute=compute)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            fields = [item[2] if len(item) > 2 else {} for item in chunk]
            yield EncodedChunk([item[0] for item in chunk], out.vectors, out.mask, out.salience, sum(truncated),
                               time.perf_counter() - begin, fields if any(fields) else None)


def train_codec(spec: CodecSpec, chunks: list[EncodedChunk], train_size: int, seed: int) -> ResidualCodec:
    """Fit the codec on the token vectors of ``chunks``: centroids on up to max(train_size, 32·nlist) tokens and PQ
    codebooks on up to ``train_size`` residuals, drawn with ``seed`` from all the chunks' tokens, on the chunks'
    device (TF32 matmuls on a GPU; two-level k-means for a large codec on a CPU)."""
    flat = torch.cat([c.vectors[c.mask] for c in chunks]).float()
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(flat), generator=gen).to(flat.device)
    cuda = flat.device.type == "cuda"
    sample = flat[order[:max(train_size, CODEC_POINTS_PER_CENTROID * spec.nlist)]]
    residual = flat[order[:train_size]]
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = cuda
    try:
        return ResidualCodec.train(spec, sample, residual, seed=seed)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def record_codec_training(stats: dict, seconds: float) -> None:
    """Add the codec's training time to a segment's ``build_stats``: ``codec_train_s``, and ``codec_s`` (training
    plus assigning and quantising every token, ``codec_encode_s``)."""
    stats["codec_train_s"] = stats.get("codec_train_s", 0.0) + seconds
    stats["codec_s"] = stats.get("codec_s", 0.0) + seconds


def codec_source(path: str | os.PathLike) -> tuple[ResidualCodec, Path, dict]:
    """(trained codec, its folder, its file records) of a compressed index folder, or of the codec folder inside
    one (``<index>/codec-*``), for ``codec_from``."""
    path = Path(path)
    index_dir = path if (path / MANIFEST).is_file() or not (path.parent / MANIFEST).is_file() \
        else path.parent
    manifest = read_manifest(index_dir)
    if index_dir != path and manifest.codec_dir != path.name:
        raise ValueError(f"codec_from {path}: not the codec folder of index {index_dir} (it uses "
                         f"{manifest.codec_dir})")
    if not manifest.codec.compressed:
        raise ValueError(f"codec_from {path}: that index stores fp16 vectors and has no codec")
    return load_codec(index_dir, manifest), index_dir / manifest.codec_dir, manifest.codec_files


def copy_codec(source: Path, records: dict, folder: Path) -> dict:
    """Copy a codec folder byte for byte (shards that share a codec then hold identical codec files)."""
    folder.mkdir(parents=True, exist_ok=False)
    for name in records:
        shutil.copyfile(source / name, folder / name)
    return dict(records)


def check_max_length(model, max_length: int | None) -> None:
    """ValueError, before any document is encoded, when ``max_length`` tokens exceed the positions of the model's
    backbone (512 for the shipped checkpoints)."""
    positions = getattr(model.backbone.config, "max_position_embeddings", None)
    if max_length is not None and positions is not None and max_length > positions:
        raise ValueError(f"max_length {max_length} exceeds the {positions} token positions of the model; use at most "
                         f"{positions}")


def check_codec(model, codec: CodecSpec | AutoCodec, index_type: str) -> None:
    """ValueError, before any document is encoded, for a codec that can't store ``model``'s vectors: PQ codes that
    don't split them, a FAISS ``index_type`` FAISS can't build (fp16), or a compressed codec for a model that scores
    with token saliences (which only fp16 stores)."""
    dim = model.config.dim
    if isinstance(codec, CodecSpec):
        codec.check(dim)
        if not codec.compressed:
            check_factory_string(dim, index_type)
            return
    if model.scores_with_salience:
        raise ValueError("a compressed codec stores no token saliences, but the model scores with them; use codec fp16")


def build_index(corpus: Iterable, index_dir: str | os.PathLike, encoder="aligner",
                options: BuildOptions | None = None, *, corpus_path: str | os.PathLike | None = None,
                num_docs_hint: int | None = None, **changes) -> Manifest:
    """Encode ``corpus`` and write an index folder at ``index_dir``; returns its manifest.

    corpus: (docid, text) or (docid, text, Location) items. encoder: "aligner", a checkpoint folder or an
    AlignerModel. options: how to build (:class:`.options.BuildOptions`: β^d, codec, ...; default: its defaults);
    ``changes``: BuildOptions fields as keyword arguments, applied over ``options``, e.g. ``build_index(docs,
    "idx", codec="fp16", doc_prune=0.5)``. corpus_path: the corpus file/folder, which the index may never hold or
    overwrite. num_docs_hint: the corpus size when known (progress bar total, and the corpus size for "auto").
    """
    opts = build_options(options, **changes)
    if isinstance(corpus, (str, bytes, os.PathLike)):
        raise TypeError(f"corpus must be (docid, text) items, not a path or a single string ({corpus!r:.60}); read "
                        "a file or folder with pyserini_aligner.index.read_corpus(path)")
    target = Path(index_dir).absolute()
    check_target(target, opts.overwrite, corpus_path)
    model = load_model(encoder, opts.device)
    dim = model.config.dim
    source_codec, *source_files = codec_source(opts.codec_from) if opts.codec_from is not None else (None,)
    codec = source_codec.spec if source_codec is not None else opts.codec
    check_codec(model, codec, opts.index_type)
    check_max_length(model, opts.max_length)
    if opts.max_length is not None and opts.max_length > model.config.doc_maxlen:
        log.info("max_length %d exceeds the model's doc_maxlen %d", opts.max_length, model.config.doc_maxlen)
    sizes = [x for x in (num_docs_hint, opts.max_docs, _sized(corpus)) if x is not None]
    total = min(sizes) if sizes else None

    def write(root: Path, generation: int) -> Manifest:
        started = time.perf_counter()
        docids = DocidRegistry()
        bar = tqdm(total=total, unit="doc", desc="index", disable=not opts.progress, smoothing=0.05)
        items = checked_items(corpus, opts.max_docs, docids)
        chunks, trained, codec_files, codec_dir, codec_seconds = [], source_codec, {}, None, 0.0
        spill = None
        try:
            if isinstance(codec, CodecSpec) and not codec.compressed:
                spec, stream = codec, encode_chunks(model, items, opts.batch_size, opts.max_length,
                                                    compute=opts.compute)
            elif trained is None:  # the codec is trained on a sample of the whole corpus
                spill = spill_corpus(root, items, total, opts)
                bar.total = spill.count
                trained, chunks, stream, codec_seconds = sampled_codec(model, spill, codec, spill.count, opts)
                spec = trained.spec
            else:  # a given codec: the first chunks only size the spec
                stream = encode_chunks(model, items, opts.batch_size, opts.max_length, compute=opts.compute)
                chunks, spec = sample_for_codec(stream, codec, dim, total, opts.train_size, opts.max_bytes_per_token)
            if trained is not None:
                codec_dir = new_name("codec", generation)
                codec_files = copy_codec(*source_files, root / codec_dir) if source_files else \
                    write_codec(root / codec_dir, trained)
                trained = trained.to(model.device)
                spec = trained.spec
            sized = opts.sized(bar.total)
            info = write_segment(root / new_name("seg", generation), _chain(chunks, stream), dim,
                                 sized.doc_prune, opts.prune_redundancy, trained, opts.index_type, opts.train_size,
                                 opts.seed, opts.progress, bar.update)
        finally:
            bar.close()
            if spill is not None:
                spill.close()
        info.num_empty = docids.blank
        if spec.compressed:
            record_codec_training(info.build_stats, codec_seconds)
        info.build_stats["total_s"] = time.perf_counter() - started
        return new_manifest(model, encoder, spec, sized, codec_dir, codec_files, [info])

    manifest = write_index(target, opts.overwrite, corpus_path, write)
    log.info("indexed %d documents (%d tokens, %d indexed, codec %s) into %s", manifest.num_docs,
             manifest.num_tokens, manifest.num_kept, manifest.codec, target)
    return manifest


def _sized(corpus) -> int | None:
    try:
        return len(corpus)
    except TypeError:
        return None


def _chain(first: list, rest: Iterator) -> Iterator:
    while first:
        yield first.pop(0)
    yield from rest


def sample_for_codec(stream: Iterator[EncodedChunk], codec: CodecSpec | AutoCodec, dim: int, total: int | None,
                     train_size: int, max_bytes_per_token: int | None = None
                     ) -> tuple[list[EncodedChunk], CodecSpec]:
    """Buffer the first chunks of ``stream`` until they hold the codec's training sample; returns them with the
    codec spec ("auto" resolved from the tokens of the whole corpus of ``total`` documents, estimated from the mean
    length of all the buffered documents, not of the first chunk alone, so that a corpus opening with long documents
    is not sized as if every document were as long; the buffered tokens themselves when ``total`` is unknown and the
    stream ends). The stream may be one slice of the corpus (a torchrun rank's): the choice depends on the corpus,
    not on the number of slices. ValueError for an empty stream."""
    first = next(stream, None)
    if first is None:
        raise ValueError("empty corpus: no documents to index")
    chunks, docs, buffered = [first], len(first.docids), first.num_tokens

    def size() -> tuple[CodecSpec, int]:
        """The spec from the buffered mean length and the tokens its training sample needs."""
        estimate = int(round(buffered / max(docs, 1) * total)) if total else None
        spec = resolve_codec(codec, dim, estimate or 4 * first.num_tokens, max_bytes_per_token)
        return spec, min(max(train_size, CODEC_POINTS_PER_CENTROID * spec.nlist), estimate or 1 << 62)

    spec, need = size()
    while buffered < need and (chunk := next(stream, None)) is not None:
        chunks.append(chunk)
        docs, buffered = docs + len(chunk.docids), buffered + chunk.num_tokens
        spec, need = size()
    tokens = int(round(buffered / max(docs, 1) * total)) if total else None  # the corpus's, as sized
    if buffered < need:  # the stream ended inside the sample: size the codec from what it holds
        tokens = int(round(buffered / max(docs, 1) * max(total, docs))) if total else buffered
        spec = resolve_codec(codec, dim, tokens, max_bytes_per_token)
    if isinstance(codec, AutoCodec) and tokens is not None and tokens < SMALL_CORPUS_TOKENS:
        log.warning("the corpus has only %d tokens: codec %s has %d centroids to learn from them; at this size "
                    "--codec fp16 stores exact vectors for %.1f MB", tokens, spec, spec.nlist, tokens * dim * 2 / 1e6)
    return chunks, spec


def spill_corpus(folder: Path, items: Iterable, total: int | None, opts: BuildOptions) -> Spill:
    """``items`` read once into a :class:`.sample.Spill` in ``folder`` (a progress bar over ``total`` documents)."""
    return Spill(folder, seed=opts.seed).read(tqdm(items, total=total, unit="doc", desc="read",
                                                   disable=not opts.progress, leave=False))


def sampled_codec(model, spill: Spill, codec: CodecSpec | AutoCodec, total: int, opts: BuildOptions
                  ) -> tuple[ResidualCodec, list[EncodedChunk], Iterator[EncodedChunk], float]:
    """(the codec trained on :func:`codec_sample`'s documents, the chunks to write: those already encoded and the
    rest of the stream, seconds spent sampling and training) for a corpus read into ``spill``."""
    begin = time.perf_counter()
    sample, spec, chunks, stream = codec_sample(model, spill, codec, total, opts)
    trained = train_codec(spec, sample, opts.train_size, opts.seed)
    return trained, chunks, stream, time.perf_counter() - begin


def codec_sample(model, spill: Spill, codec: CodecSpec | AutoCodec, total: int, opts: BuildOptions
                 ) -> tuple[list[EncodedChunk], CodecSpec, list[EncodedChunk], Iterator[EncodedChunk]]:
    """(the encoded documents to train the codec on, the codec spec, then the chunks to write: those already encoded
    and the rest of the stream) for a corpus read into ``spill`` (a slice of ``total`` documents when it is a
    torchrun rank's). The sample is the reservoir's documents, encoded for the codec alone, where they are at most
    :data:`.sample.UNIFORM_SHARE` of the tokens (``"auto"`` sized from the sampled documents' mean length); else
    the first documents, encoded once (:func:`sample_for_codec`)."""
    dim = model.config.dim
    sample = spill.sample()
    limit = opts.max_length or model.config.doc_maxlen
    probe = model.tokenizer.ids([item[1] for item in sample[:2048]], max_length=limit)
    mean = sum(map(len, probe)) / max(len(probe), 1)  # tokens a document, to size "auto" before encoding
    spec = resolve_codec(codec, dim, int(mean * total), opts.max_bytes_per_token)
    if uniform_is_worth_it(max(opts.train_size, CODEC_POINTS_PER_CENTROID * spec.nlist), int(mean * spill.count)):
        chunks, spec = sample_for_codec(encode_chunks(model, iter(sample), opts.batch_size, opts.max_length,
                                                      compute=opts.compute),
                                        codec, dim, total, opts.train_size, opts.max_bytes_per_token)
        log.info("training codec %s on %d documents drawn uniformly from the %d read", spec,
                 sum(len(c.docids) for c in chunks), spill.count)
        return chunks, spec, [], encode_chunks(model, spill.items(), opts.batch_size, opts.max_length,
                                               compute=opts.compute)
    stream = encode_chunks(model, spill.items(), opts.batch_size, opts.max_length, compute=opts.compute)
    chunks, spec = sample_for_codec(stream, codec, dim, total, opts.train_size, opts.max_bytes_per_token)
    log.info("training codec %s on the first %d documents", spec, sum(len(c.docids) for c in chunks))
    return chunks, spec, chunks, stream


def write_segment(folder: Path, chunks: Iterable[EncodedChunk], dim: int, doc_prune: float,
                  prune_redundancy: float | None, codec: ResidualCodec | None, index_type: str, train_size: int,
                  seed: int, progress: bool, on_chunk: Callable[[int], object] | None = None) -> SegmentInfo:
    """Prune, compress and write encoded ``chunks`` as one new segment at ``folder``; ``on_chunk(documents)`` is
    called after each chunk. ValueError when there are no documents."""
    writer = SegmentWriter(folder, dim, doc_prune, prune_redundancy, codec,
                           str(codec.spec) if codec is not None else faiss_factory_string(index_type))
    encode_seconds = 0.0
    try:
        for chunk in chunks:
            encode_seconds += chunk.seconds
            writer.add(chunk.docids, chunk.vectors, chunk.mask, chunk.salience, chunk.truncated, chunk.fields)
            if on_chunk is not None:
                on_chunk(len(chunk.docids))
        if writer.num_docs == 0:
            raise ValueError("empty corpus: no documents to index")
        info = writer.finish(train_size, seed, progress)
    except BaseException:
        writer.abort()
        raise
    info.build_stats["encode_s"] = encode_seconds
    return info


def new_manifest(model, encoder, spec: CodecSpec, options: BuildOptions, codec_dir: str | None, codec_files: dict,
                 segments: list) -> Manifest:
    """The manifest of a freshly built index (generation set by :func:`write_index`)."""
    from pyserini_aligner import __version__

    return Manifest(
        model_name=options.model_name if options.model_name is not None else model_name_of(encoder),
        model_fingerprint=model.fingerprint(), dim=model.config.dim, doc_prune=float(options.doc_prune),
        index_type=str(spec) if spec.compressed else faiss_factory_string(options.index_type),
        default_strategy=model.config.default_strategy, codec=spec, prune_redundancy=options.prune_redundancy,
        doc_maxlen=options.max_length, corpus=options.corpus_name, codec_dir=codec_dir, codec_files=codec_files,
        segments=segments, package_version=__version__)


def derive_index(source_dir: str | os.PathLike, index_dir: str | os.PathLike, options: BuildOptions | None = None,
                 **changes) -> Manifest:
    """A new index from an existing fp16 one without re-encoding: the same stored tokens with another β^d
    (recomputed from the stored saliences and vectors), FAISS factory string and/or codec; returns the new
    manifest. options: the new index's settings (default: the source's, :meth:`BuildOptions.of_index`: its β^d,
    FAISS factory string and redundancy threshold, codec fp16); ``changes``: BuildOptions fields as keyword
    arguments, applied over them (``derive_index(src, dst, doc_prune=0.5)``). The options of encoding (max_length,
    batch_size, max_docs, codec_from) and of the manifest (model_name, corpus_name: the source's) play no part."""
    source = StoredIndex(source_dir)
    old = source.manifest
    if old.codec.compressed:
        raise ValueError(f"cannot derive from {source_dir}: its tokens are compressed ({old.codec}); derive from an "
                         "fp16 index (build with --codec fp16)")
    opts = build_options(options, BuildOptions.of_index(old), **changes)
    target = Path(index_dir).absolute()
    if target == source.index_dir.absolute():
        raise ValueError(f"derive_index needs a new folder, got the source itself: {target}")
    spec = resolve_codec(opts.codec, old.dim, old.num_tokens, opts.max_bytes_per_token)
    if not spec.compressed:
        check_factory_string(old.dim, opts.index_type)
    doc_prune, index_type, redundancy = opts.sized(old.num_docs).doc_prune, opts.index_type, opts.prune_redundancy
    train_size, seed, progress = opts.train_size, opts.seed, opts.progress
    dev = torch.device(opts.device or "cpu")

    def chunks_of(rows: np.ndarray, step: int = 256) -> Iterator[EncodedChunk]:
        for start in range(0, len(rows), step):
            part = rows[start:start + step]
            vectors, mask, salience = source.gather(part)
            yield EncodedChunk([source.docids[r] for r in part], vectors.to(dev), mask.to(dev), salience.to(dev),
                               0, 0.0, source.fields_of(part) if source.field_names else None)

    def write(root: Path, generation: int) -> Manifest:
        trained, codec_dir, codec_files = None, None, {}
        if spec.compressed:
            rng = np.random.default_rng(seed)
            count = min(old.num_tokens, max(train_size, CODEC_POINTS_PER_CENTROID * spec.nlist))
            positions = np.sort(rng.choice(old.num_tokens, size=count, replace=False))
            sample = source.token_vectors(positions).to(dev)
            mask = torch.ones(1, len(sample), dtype=torch.bool, device=dev)
            trained = train_codec(spec, [EncodedChunk([], sample[None], mask, mask.float(), 0, 0.0)],
                                  train_size, seed)
            codec_dir = new_name("codec", generation)
            codec_files = write_codec(root / codec_dir, trained)
            trained = trained.to(dev)
        segments = []
        for seg_info, base in zip(old.segments, source.row_base):
            rows = np.arange(base, base + seg_info.num_docs)
            rows = rows[source.live[rows]]
            writer = SegmentWriter(root / new_name("seg", generation), old.dim, doc_prune, redundancy,
                                   trained, faiss_factory_string(index_type) if not spec.compressed else str(spec))
            try:
                for chunk in tqdm(chunks_of(rows), total=(len(rows) + 255) // 256, desc="derive", unit="chunk",
                                  disable=not progress):
                    writer.add(chunk.docids, chunk.vectors, chunk.mask, chunk.salience, fields=chunk.fields)
                info = writer.finish(train_size, seed, progress)
            except BaseException:
                writer.abort()
                raise
            info.num_truncated, info.num_empty = seg_info.num_truncated, seg_info.num_empty
            segments.append(info)
        return dataclasses.replace(old, doc_prune=float(doc_prune), codec=spec, codec_dir=codec_dir,
                                   codec_files=codec_files, segments=segments, created="",
                                   index_type=str(spec) if spec.compressed else faiss_factory_string(index_type),
                                   prune_redundancy=redundancy)

    manifest = write_index(target, opts.overwrite, None, write)
    log.info("derived %s (codec %s, doc_prune=%g) from %s", target, manifest.codec, doc_prune, source.index_dir)
    return manifest

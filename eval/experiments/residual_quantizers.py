"""Which quantiser of a token's residual keeps the most of the exact ranking for its bytes? The index's centroids
stay as they are (the inverted lists' ``IVF<nlist>``); the residual of every token after its centroid is coded by
each FAISS quantiser named by a factory string (``PQ16``, ``OPQ16,PQ16``, ``RQ16x8``, ``LSQ16x8``, ...), decoded,
and every passage is scored exhaustively with the decoded tokens against its exact tokens.

    python -m eval.experiments.residual_quantizers --beir-zip scifact.zip --size 20k --device cpu \
        --quantizers PQ16 OPQ16,PQ16 RQ16x8 LSQ16x8 PQ32 --output <json>

Every passage's tokens are encoded once; the judged queries of the split are ranked by top-k:1 alignment over all
passages, first with the exact vectors, then with each quantiser's. Reports each quantiser's bytes a token
(residual code plus the 2-byte centroid id), mean squared error a token, overlap@10 with the exact ranking and the
seconds it took to train and code.
"""
from __future__ import annotations

import argparse
import json
import time

import faiss
import numpy as np
import torch

from eval.bench_scale.exact import exhaustive_top
from eval.bench_scale.measure import overlap_at_k
from eval.experiments.codec_fidelity import corpus_arguments, exact_reference, ranking, write_report
from pyserini_aligner.index.codec import ResidualCodec
from pyserini_aligner.index.codec_spec import resolve_codec

CENTROID_BYTES = 2  # a token's centroid id (uint16)
STEP = 1 << 18  # tokens coded at once


def train_quantizer(factory: str, train: np.ndarray) -> faiss.Index:
    """The FAISS standalone codec ``factory`` (a factory string) trained on ``train`` [n, d] float32. A product
    quantiser skips the polysemous training that ``index_factory`` turns on for ``PQ<M>``: it only reorders the
    codewords (for Hamming distances between codes), which coding and decoding ignore, and takes minutes."""
    index = faiss.index_factory(train.shape[1], factory)
    inner = faiss.downcast_index(index)
    if isinstance(inner, faiss.IndexPreTransform):  # OPQ<M>,PQ<M>: the rotation, then the product quantiser
        inner = faiss.downcast_index(inner.index)
    if isinstance(inner, faiss.IndexPQ):
        inner.do_polysemous_training = False
    index.train(np.ascontiguousarray(train))
    return index


def code_residuals(index: faiss.Index, residuals: np.ndarray) -> np.ndarray:
    """Decoded residuals [T, d] float32 of ``residuals`` [T, d] float32, coded by the trained codec ``index``."""
    out = np.empty_like(residuals)
    for a in range(0, len(residuals), STEP):
        out[a:a + STEP] = index.sa_decode(index.sa_encode(np.ascontiguousarray(residuals[a:a + STEP])))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.residual_quantizers",
                                     description=__doc__.split("\n\n")[0])
    corpus_arguments(parser)
    parser.add_argument("--quantizers", nargs="+", required=True, help="FAISS factory strings of residual codecs")
    parser.add_argument("--nlist", type=int, default=None, help="centroids (default: what --codec auto picks)")
    args = parser.parse_args(argv)
    tokens, _, lengths, q, q_mask, exact, report = exact_reference(args)

    spec = resolve_codec("auto" if args.nlist is None else f"IVF{args.nlist},PQ4", tokens.shape[1], len(tokens))
    gen = torch.Generator().manual_seed(0)
    sample = tokens[torch.randperm(len(tokens), generator=gen)[:max(args.train_size, 32 * spec.nlist)]
                    .to(tokens.device)].float()
    codec = ResidualCodec.train(spec, sample, sample[:args.train_size])
    ids = np.concatenate([codec.encode_centroids(tokens[a:a + STEP].float()) for a in range(0, len(tokens), STEP)])
    centroids = codec.decode(ids, device=tokens.device)
    residuals = (tokens.float() - centroids).cpu().numpy()
    train = residuals[np.random.default_rng(0).permutation(len(residuals))[:args.train_size]]
    report.update(nlist=spec.nlist, residual_norm2=round(float((residuals ** 2).sum(1).mean()), 5), quantizers=[])
    for factory in args.quantizers:
        start = time.perf_counter()
        quantizer = train_quantizer(factory, train)
        decoded, code_bytes = code_residuals(quantizer, residuals), quantizer.sa_code_size()
        code_s = time.perf_counter() - start
        vectors = centroids + torch.from_numpy(decoded).to(tokens.device)
        error = float(((vectors - tokens.float()) ** 2).sum(1).mean())
        ranked = ranking(*exhaustive_top(q, q_mask, vectors, lengths, 10))
        row = {"quantizer": factory, "bytes_per_token": code_bytes + CENTROID_BYTES,
               "bytes_per_passage": round((code_bytes + CENTROID_BYTES) * len(tokens) / len(lengths), 1),
               "squared_error": round(error, 5), "overlap@10": round(overlap_at_k(ranked, exact, 10), 4),
               "train_code_s": round(code_s, 1)}
        report["quantizers"].append(row)
        print(json.dumps(row), flush=True)
    write_report(report, args.output)


if __name__ == "__main__":
    main()

"""How much of the exact ranking does each residual precision keep? Exhaustive scoring with decoded codes against
exhaustive scoring with the exact token vectors, per codec, on synthetic passages (no candidate generation: the
ceiling of an index searched on those codes).

    python -m eval.experiments.codec_fidelity --beir-zip scifact.zip --size 1m --device cuda \
        --codecs IVF65536,PQ4 IVF65536,PQ8 IVF65536,PQ16 --output <json>

Every passage's tokens are encoded once (float16, kept on the device); the 300 judged queries of the split are
ranked by top-k:1 alignment (mean over query tokens of the best document token) over all passages, first with the
exact vectors, then with each codec's decoded vectors. Reports overlap@10 with the exact ranking, the mean squared
reconstruction error per token and the code bytes per token (centroid id and residual).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from eval.bench_scale.corpus import SyntheticCorpus, parse_size, read_beir_zip
from eval.bench_scale.measure import overlap_at_k
from pyserini_aligner.index.codec import ResidualCodec, parse_codec, resolve_codec
from pyserini_aligner.resolve import load_model

TOKENS_PER_BLOCK = 1 << 18  # document tokens scored at once
TRAIN_SIZE = 100_000  # residuals the PQ codebooks train on (the build's default)
STEP = 1 << 20  # tokens coded at once


def encode_corpus(model, texts: list[str], batch: int, progress: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [T, d] float16, lengths [N] int64) of every text, on the model's device."""
    parts, lengths = [], []
    for start in tqdm(range(0, len(texts), 8192), desc="encode", disable=not progress):
        out = model.encode_padded(texts[start:start + 8192], is_query=False, batch_size=batch)
        parts.append(out.vectors[out.mask].half())
        lengths.append(out.mask.sum(1))
    return torch.cat(parts), torch.cat(lengths).long()


def exhaustive_top(q: torch.Tensor, q_mask: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, k: int,
                   decode=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, k], rows [B, k]) of top-k:1 alignment over all documents. q [B, n, d] float32; tokens [T, d]
    (or codes that ``decode`` turns into float32 vectors block by block)."""
    flat = q[q_mask]  # [Q, d]
    owner = torch.repeat_interleave(torch.arange(len(q), device=q.device), q_mask.sum(1))
    weights = torch.zeros(len(flat), len(q), device=q.device)
    weights[torch.arange(len(flat)), owner] = 1.0 / q_mask.sum(1)[owner].float()
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    best_s = torch.full((len(q), 0), -torch.inf, device=q.device)
    best_r = torch.zeros((len(q), 0), dtype=torch.long, device=q.device)
    doc = 0
    while doc < len(lengths):
        stop = int(torch.searchsorted(offsets, offsets[doc] + TOKENS_PER_BLOCK, right=True)) - 1
        stop = max(stop, doc + 1)
        a, b = int(offsets[doc]), int(offsets[stop])
        block = tokens[a:b].float() if decode is None else decode(a, b)
        sims = block @ flat.T  # [t, Q]
        best = torch.segment_reduce(sims, "max", lengths=lengths[doc:stop], axis=0, unsafe=True)  # [docs, Q]
        scores = (best @ weights).T  # [B, docs]
        rows = torch.arange(doc, stop, device=q.device).expand(len(q), -1)
        both_s, both_r = torch.cat([best_s, scores], 1), torch.cat([best_r, rows], 1)
        top = both_s.topk(min(k, both_s.shape[1]), dim=1)
        best_s, best_r = top.values, both_r.gather(1, top.indices)
        doc = stop
    return best_s, best_r


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.codec_fidelity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--beir-zip", required=True)
    parser.add_argument("--size", type=parse_size, required=True, help="passages, e.g. 100k or 1m")
    parser.add_argument("--codecs", nargs="+", required=True, help="codec strings, 'auto' included")
    parser.add_argument("--encoder", default="aligner")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--max-queries", type=int, default=300)
    parser.add_argument("--output", required=True)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False

    corpus = SyntheticCorpus(read_beir_zip(args.beir_zip))
    texts = [text for _, text in corpus.passages(args.size)]
    model = load_model(args.encoder, device=args.device)
    start = time.perf_counter()
    tokens, lengths = encode_corpus(model, texts, args.batch_size, not args.quiet)
    encode_s = time.perf_counter() - start
    queries = list(corpus.source.queries.values())[:args.max_queries]
    out = model.encode_padded(queries, is_query=True, batch_size=64)
    q, q_mask = out.vectors.float(), out.mask
    ref_scores, ref_rows = exhaustive_top(q, q_mask, tokens, lengths, 10)
    exact = [[(int(r), float(s)) for r, s in zip(rows, scores)]
             for rows, scores in zip(ref_rows.tolist(), ref_scores.tolist())]
    report = {"passages": len(lengths), "tokens": len(tokens), "queries": len(queries), "encode_s": round(encode_s, 1),
              "codecs": []}
    gen = torch.Generator().manual_seed(0)
    for name in args.codecs:
        spec = resolve_codec(name, tokens.shape[1], len(tokens))
        parse_codec(str(spec), tokens.shape[1])
        start = time.perf_counter()
        sample = tokens[torch.randperm(len(tokens), generator=gen)[:max(TRAIN_SIZE, 32 * spec.nlist)]
                        .to(tokens.device)].float()
        codec = ResidualCodec.train(spec, sample, sample[:TRAIN_SIZE])
        ids = np.concatenate([codec.encode_centroids(tokens[a:a + STEP].float())
                              for a in range(0, len(tokens), STEP)])
        codes = np.concatenate([codec.encode_residuals(tokens[a:a + STEP].float(), ids[a:a + STEP])
                                for a in range(0, len(tokens), STEP)])
        code_s = time.perf_counter() - start

        def decode(a: int, b: int) -> torch.Tensor:
            return codec.decode(ids[a:b], codes[a:b], device=tokens.device)

        error = float(np.mean([float(((decode(a, min(a + STEP, len(tokens))) -
                                        tokens[a:a + STEP].float()) ** 2).sum(1).mean())
                               for a in range(0, len(tokens), STEP)]))
        scores, rows = exhaustive_top(q, q_mask, codes, lengths, 10, decode)
        ranked = [[(int(r), float(s)) for r, s in zip(rr, ss)] for rr, ss in zip(rows.tolist(), scores.tolist())]
        row = {"codec": str(spec), "asked": name, "bytes_per_token": 2 + spec.pq_m, "train_encode_s": round(code_s, 1),
               "squared_error": round(error, 5), "overlap@10": round(overlap_at_k(ranked, exact, 10), 4)}
        report["codecs"].append(row)
        print(json.dumps(row), flush=True)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

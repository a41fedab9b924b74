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
from typing import NamedTuple

import numpy as np
import torch

from eval.bench_scale.corpus import SyntheticCorpus, parse_size, read_beir_zip
from eval.bench_scale.exact import encode_tokens, exhaustive_top
from eval.bench_scale.measure import overlap_at_k
from pyserini_aligner.index.codec import ResidualCodec
from pyserini_aligner.index.codec_spec import resolve_codec
from pyserini_aligner.resolve import load_model

TRAIN_SIZE = 100_000  # residuals the PQ codebooks train on by default (the build's default)
STEP = 1 << 20  # tokens coded at once


def corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the corpus, model and queries that the codec studies share."""
    parser.add_argument("--beir-zip", required=True)
    parser.add_argument("--size", type=parse_size, required=True, help="passages, e.g. 100k or 1m")
    parser.add_argument("--encoder", default="aligner")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--max-queries", type=int, default=300)
    parser.add_argument("--train-size", type=int, default=TRAIN_SIZE, help="residuals the codebooks train on")
    parser.add_argument("--output", required=True)
    parser.add_argument("--quiet", action="store_true")


class Reference(NamedTuple):
    """The exact side of a codec study: every passage's stored tokens [T, d] float16 with their salience [T] and
    lengths [N], the judged queries [B, n, d] float32 with their mask [B, n], each query's exact top 10 as
    [(row, score)] and the report's first fields."""

    tokens: torch.Tensor
    salience: torch.Tensor
    lengths: torch.Tensor
    q: torch.Tensor
    q_mask: torch.Tensor
    exact: list
    report: dict


def exact_reference(args: argparse.Namespace) -> Reference:
    """The :class:`Reference` of the synthetic passages and judged queries ``args`` name."""
    torch.backends.cuda.matmul.allow_tf32 = False
    corpus = SyntheticCorpus(read_beir_zip(args.beir_zip))
    texts = [text for _, text in corpus.passages(args.size)]
    model = load_model(args.encoder, device=args.device)
    start = time.perf_counter()
    tokens, salience, lengths = encode_tokens(model, texts, args.batch_size, not args.quiet)
    encode_s = time.perf_counter() - start
    queries = list(corpus.source.queries.values())[:args.max_queries]
    out = model.encode_padded(queries, is_query=True, batch_size=64)
    q, q_mask = out.vectors.float(), out.mask
    exact = ranking(*exhaustive_top(q, q_mask, tokens, lengths, 10))
    report = {"passages": len(lengths), "tokens": len(tokens), "queries": len(queries), "encode_s": round(encode_s, 1)}
    return Reference(tokens, salience, lengths, q, q_mask, exact, report)


def ranking(scores: torch.Tensor, rows: torch.Tensor) -> list[list[tuple[int, float]]]:
    """[(row, score)] a query, best first, of exhaustive scores [B, k] and rows [B, k]."""
    return [[(int(r), float(s)) for r, s in zip(rr, ss)] for rr, ss in zip(rows.tolist(), scores.tolist())]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.codec_fidelity",
                                     description=__doc__.split("\n\n")[0])
    corpus_arguments(parser)
    parser.add_argument("--codecs", nargs="+", required=True, help="codec strings, 'auto' included")
    args = parser.parse_args(argv)
    tokens, _, lengths, q, q_mask, exact, report = exact_reference(args)
    report["codecs"] = []
    gen = torch.Generator().manual_seed(0)
    for name in args.codecs:
        spec = resolve_codec(name, tokens.shape[1], len(tokens))
        start = time.perf_counter()
        sample = tokens[torch.randperm(len(tokens), generator=gen)[:max(args.train_size, 32 * spec.nlist)]
                        .to(tokens.device)].float()
        codec = ResidualCodec.train(spec, sample, sample[:args.train_size])
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
        ranked = ranking(scores, rows)
        row = {"codec": str(spec), "asked": name, "bytes_per_token": spec.bytes_per_token,
               "train_encode_s": round(code_s, 1),
               "squared_error": round(error, 5), "overlap@10": round(overlap_at_k(ranked, exact, 10), 4)}
        report["codecs"].append(row)
        print(json.dumps(row), flush=True)
    write_report(report, args.output)


def write_report(report: dict, output: str) -> None:
    """``report`` as JSON in the file ``output`` (its folder made)."""
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

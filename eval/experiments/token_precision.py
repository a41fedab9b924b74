"""Where should a token's residual bytes go? Exhaustive scoring with decoded codes against exhaustive scoring with
the exact token vectors, for codes of one precision for every token, codes whose precision varies by token, and
passages that keep only their most salient tokens.

    python -m eval.experiments.token_precision --beir-zip scifact.zip --size 1m --device cuda \
        --plans fp16 keep0.8:fp16 PQ8 PQ16 PQ32 PQ32/PQ8:0.2:error --output <json>

The index's centroids stay as ``--codec auto`` trains them; every token's residual after its centroid is coded by
product quantisers of 4, 8, 16 and 32 bytes (trained once, on ``--train-size`` residuals, 100,000 by default; 0 bytes:
the centroid alone). A plan is ``[keep<share>:](fp16 | PQ<M> | PQ<F>/PQ<C>:<share>:<rank>)``:

- ``fp16``: the exact vectors; ``PQ<M>``: every token's residual in M bytes;
- ``PQ<F>/PQ<C>:<share>:<rank>``: the ``share`` of all tokens ranked first by ``rank`` get F-byte codes, the others
  C-byte ones. Ranks: ``error`` (the squared error of the C-byte code: tokens their coarse code serves worst go
  fine), ``salience`` (the model's salience u^d: tokens most likely to be aligned go fine), ``both`` (their product);
- ``keep<share>:``: each passage keeps only the ceil(share · length) most salient of its tokens (the others are not
  stored and never aligned).

Every coded plan is scored twice: decoded as centroid + residual, and that sum scaled to unit length as the index
decodes it (:func:`pyserini_aligner.index.codec.unit_rows`; the model's tokens are unit vectors). Reports bytes a
token (the 2-byte centroid id and the codes, of the kept tokens, a token of the passage), squared error a token and
overlap@10 with the exact ranking, for each.
"""
from __future__ import annotations

import argparse
import json
import re
import time

import numpy as np
import torch

from eval.bench_scale.exact import exhaustive_top
from eval.bench_scale.measure import overlap_at_k
from eval.experiments.codec_fidelity import corpus_arguments, exact_reference, ranking, write_report
from pyserini_aligner.index.codec import ResidualCodec, pq_encode, train_pq, unit_rows
from pyserini_aligner.index.codec_spec import resolve_codec

LEVELS = (0, 4, 8, 16, 32)  # residual bytes of the product quantisers every plan draws on (0: the centroid alone)
CENTROID_BYTES = 2
STEP = 1 << 20  # tokens coded or decoded at once
_SHARE = r"(\d*\.?\d+)"
_PLAN = re.compile(rf"(?:keep{_SHARE}:)?(?:fp16|PQ(\d+)(?:/PQ(\d+):{_SHARE}:(error|salience|both))?)")


def parse_plan(text: str) -> tuple[float, int, int, float, str]:
    """(share of a passage's tokens kept, fine bytes, coarse bytes, share of tokens fine, rank) of a plan string;
    ``PQ<M>`` is (1.0, M, M, 1.0, ""), ``fp16`` has fine bytes -1 (the exact vectors)."""
    match = _PLAN.fullmatch(text)
    if not match or any(m and int(m) not in LEVELS for m in (match[2], match[3])):
        raise ValueError(f"bad plan {text!r}: expected [keep<share>:](fp16|PQ<M>|PQ<F>/PQ<C>:<share>:<error|"
                         f"salience|both>), M in {LEVELS}")
    keep = 1.0 if match[1] is None else float(match[1])
    share = 1.0 if match[4] is None else float(match[4])
    if not (0.0 < keep <= 1.0 and 0.0 <= share <= 1.0):
        raise ValueError(f"bad plan {text!r}: shares must be in [0, 1] (kept tokens above 0)")
    if match[2] is None:
        return keep, -1, -1, 1.0, ""
    fine = int(match[2])
    return keep, fine, fine if match[3] is None else int(match[3]), share, match[5] or ""


def plan_argument(text: str) -> tuple:
    """(text, *:func:`parse_plan`) for argparse (a bad plan is a usage error naming it)."""
    try:
        return (text, *parse_plan(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def kept_stand_ins(keep: float, salience: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """int64 [T]: for each token, itself where it is among the ceil(keep · length) most salient of its passage, else
    the passage's most salient token (a copy of a kept token never changes a best match: dropping it exactly)."""
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    order = torch.argsort(salience.to(owner.device), descending=True, stable=True)
    order = order[torch.argsort(owner[order], stable=True)]  # passage by passage, most salient first
    start = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=order.device) - start[owner[order]]
    best = order[start]  # the first of each passage in salience order
    kept = rank < torch.ceil(keep * lengths.double()).long()[owner]
    return torch.where(kept, torch.arange(len(owner), device=owner.device), best[owner])


def fine_mask(share: float, rank: str, error: torch.Tensor, salience: torch.Tensor) -> torch.Tensor:
    """bool [T]: the ``share`` of tokens ranked first by ``rank`` (error [T] of their coarse codes, salience [T])."""
    key = {"error": error, "salience": salience, "both": error * salience}[rank].float()
    count = int(round(share * len(key)))
    mask = torch.zeros(len(key), dtype=torch.bool, device=key.device)
    if count:
        mask[key.topk(count).indices] = True
    return mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.token_precision",
                                     description=__doc__.split("\n\n")[0])
    corpus_arguments(parser)
    parser.add_argument("--plans", nargs="+", required=True, type=plan_argument,
                        help="[keep<share>:](fp16 | PQ<M> | PQ<F>/PQ<C>:<share>:<error|salience|both>)")
    args = parser.parse_args(argv)
    plans = args.plans
    keeps = sorted({plan[1] for plan in plans})
    tokens, salience, lengths, q, q_mask, exact, report = exact_reference(args)

    start = time.perf_counter()
    spec = resolve_codec("auto", tokens.shape[1], len(tokens))
    gen = torch.Generator().manual_seed(0)
    sample = tokens[torch.randperm(len(tokens), generator=gen)[:max(args.train_size, 32 * spec.nlist)]
                    .to(tokens.device)].float()
    codec = ResidualCodec.train(spec, sample, sample[:args.train_size])
    ids = np.concatenate([codec.encode_centroids(tokens[a:a + STEP].float()) for a in range(0, len(tokens), STEP)])
    ids = torch.from_numpy(ids.astype(np.int64)).to(tokens.device)
    centroids = codec.centroids.to(tokens.device)

    def residual(a: int, b: int) -> torch.Tensor:
        return tokens[a:b].float() - centroids[ids[a:b]]

    picked = torch.randperm(len(tokens), generator=gen)[:args.train_size].to(tokens.device)
    train = tokens[picked].float() - centroids[ids[picked]]
    books, codes, errors = {}, {}, {}
    for m in LEVELS:
        if m == 0:
            books[m] = train.new_zeros(0, 256, 1)
            codes[m] = torch.zeros(len(tokens), 0, dtype=torch.uint8, device=tokens.device)
        else:
            books[m] = train_pq(train, m).to(tokens.device)
            codes[m] = torch.cat([torch.from_numpy(pq_encode(residual(a, min(a + STEP, len(tokens))), books[m]))
                                  .to(tokens.device) for a in range(0, len(tokens), STEP)])
        errors[m] = torch.cat([((decode_residual(codes[m][a:a + STEP], books[m], tokens.shape[1]) -
                                 residual(a, min(a + STEP, len(tokens)))) ** 2).sum(1)
                               for a in range(0, len(tokens), STEP)])
    report.update(nlist=spec.nlist, code_s=round(time.perf_counter() - start, 1),
                  residual_norm2=round(float(torch.cat([(residual(a, min(a + STEP, len(tokens))) ** 2).sum(1)
                                                        for a in range(0, len(tokens), STEP)]).mean()), 5),
                  plans=[])

    stand_ins = {keep: kept_stand_ins(keep, salience, lengths) for keep in keeps}
    for text, keep, fine, coarse, share, rank in plans:
        mask = fine_mask(share, rank, errors[coarse], salience) if fine != coarse else None
        for unit in (False, True) if fine >= 0 else (False,):
            def vectors(t: torch.Tensor) -> torch.Tensor:
                if fine < 0:
                    return tokens[t].float()
                r = decode_residual(codes[coarse][t], books[coarse], tokens.shape[1])
                if mask is not None:
                    where = mask[t]
                    r[where] = decode_residual(codes[fine][t][where], books[fine], tokens.shape[1])
                v = centroids[ids[t]] + r
                return unit_rows(v) if unit else v

            def decode(a: int, b: int) -> torch.Tensor:
                return vectors(stand_ins[keep][a:b])

            error = float(sum(float(((decode(a, min(a + STEP, len(tokens))) - tokens[a:a + STEP].float()) ** 2)
                                    .sum()) for a in range(0, len(tokens), STEP)) / len(tokens))
            ranked = ranking(*exhaustive_top(q, q_mask, None, lengths, 10, decode))
            fine_share = 1.0 if mask is None else float(mask.float().mean())
            kept = float((stand_ins[keep] == torch.arange(len(tokens), device=tokens.device)).float().mean())
            code = 2 * tokens.shape[1] if fine < 0 else CENTROID_BYTES + fine * fine_share + coarse * (1 - fine_share)
            row = {"plan": text, "unit_length": unit, "kept": round(kept, 4),
                   "bytes_per_token": round(kept * code, 2),
                   "squared_error": round(error, 5), "overlap@10": round(overlap_at_k(ranked, exact, 10), 4)}
            report["plans"].append(row)
            print(json.dumps(row), flush=True)
    write_report(report, args.output)


def decode_residual(codes: torch.Tensor, books: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 [n, dim] residuals of PQ codes [n, M] (uint8) in codebooks [M, 256, dim/M] (M = 0: zeros)."""
    m = books.shape[0]
    if m == 0:
        return books.new_zeros(len(codes), dim)
    return books[torch.arange(m, device=codes.device), codes.long()].reshape(len(codes), -1)


if __name__ == "__main__":
    main()

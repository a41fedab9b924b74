"""Why does the default search miss part of the exact top 10? Every exact top-10 passage that the default search does
not return, by cause, and the overlap@10 of a few other candidate sets, on synthetic passages.

    python -m eval.experiments.candidate_misses --beir-zip scifact.zip --size 1m --device cuda --output DIR
        [--queries 300] [--work DIR] [--depth K:nprobe:C[:W]]

Every passage is encoded once (float16, on the device): the exact top 10 of each judged query is exhaustive top-k:1
scoring of those tokens (:mod:`eval.bench_scale.exact`), and the default index (β^d = 0.2, ``--codec auto``) is built
from the same tokens (or reused from ``--work``). The torch backend then searches at the searcher's default depth for
the device (or ``--depth``), step by step (probe, candidate rule, centroid interaction, refinement), and each missed
passage gets the first cause that applies:

- ``codes``: refined, but its refined score ranks it below the 10th;
- ``interaction``: among the W probe candidates, dropped when centroid interaction narrows them to C;
- ``pruned tokens``: not a probe candidate, but it would be one were all its tokens, not only the kept 20 %, in the
  inverted lists: its proxy, recomputed with every token coded as the build codes a kept one, wherever a probe scans
  the token's list and the entry's score reaches the probe's K-th, passes the last candidate's (the probes' K-th
  scores and the candidate threshold held as they were; recomputed from the kept tokens alone, it is the search's
  own proxy);
- ``candidate limit``: some probe found it, but its proxy ranks past the W-th (C-th without interaction);
- ``probe depth``: no probe's K best entries hold one of its kept tokens (K, nprobe).

Variants (candidate sets refined with the index's codes, scored by overlap@10 with the exact ranking and by the share
of the exact top 10 among the refined candidates): C ×2 and ×4, W ×4, every query token probing (β^q = 1), the C best
passages by centroid interaction over every passage (PLAID's stage 2 over all of each passage's tokens; an oracle, not
a product step) alone and merged with the default candidates. Writes candidate_misses.json and candidate_misses.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from eval.bench_peers.replay import EncodedCorpus, ReplayModel
from eval.bench_scale.corpus import SyntheticCorpus, read_beir_zip, size_label
from eval.bench_scale.exact import encode_tokens, exact_top, float32_products
from eval.bench_scale.measure import machine_info
from eval.bench_scale.run import build, judged_queries, release_memory
from eval.bench_scale.sweep import parse_settings
from eval.cli import configure_logging, corpus_size, positive_int
from pyserini_aligner.index.codec import pq_encode
from pyserini_aligner.salience import prune_mask
from pyserini_aligner.search.backends.base import Queries
from pyserini_aligner.search.candidates import ascending, narrow, probe_floors, rank_candidates, top_hits
from pyserini_aligner.search.encoding import EagerEncoder

CAUSES = ("pruned tokens", "candidate limit", "probe depth", "interaction", "codes")
ORACLE_STEP = 1 << 16  # passages scored at once by the exhaustive centroid interaction
K = 10


def depth_setting(text: str) -> tuple[int, int, int, int]:
    """argparse type: one K:nprobe:C[:W] (:func:`eval.bench_scale.sweep.parse_settings`) as (K, nprobe, C, W)."""
    if "," in text or len(text.split(":")) not in (3, 4):
        raise argparse.ArgumentTypeError(f"expected K:nprobe:C[:W], got {text!r}")
    return parse_settings(text)[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.experiments.candidate_misses",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--beir-zip", type=Path, required=True, help="a BEIR zip with qrels/test.tsv, e.g. scifact.zip")
    parser.add_argument("--size", type=corpus_size, required=True, help="passages, e.g. 100k or 1m")
    parser.add_argument("--queries", type=positive_int, help="only the first N judged queries (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", type=Path, required=True, help="folder for candidate_misses.json and .md")
    parser.add_argument("--work", type=Path, help="keep (or reuse) the index in this folder (default: a temporary one)")
    parser.add_argument("--depth", type=depth_setting,
                        help="K:nprobe:C[:W] (default: the searcher's defaults for the device)")
    parser.add_argument("--codec", default="auto")
    parser.add_argument("--batch-size", type=positive_int, default=512, help="passages per encoding batch")
    parser.add_argument("--search-batch", type=positive_int, default=100, help="queries searched at once")
    parser.add_argument("--quiet", action="store_true")
    return parser.parse_args(argv)


def merged(*parts: Tensor) -> tuple[Tensor, Tensor]:
    """(rows [B, W] ascending, valid [B, W]) of the union of candidate ``parts`` [B, W_i] (−1 where none)."""
    rows, _ = ascending(torch.cat(parts, dim=1))
    repeat = torch.zeros_like(rows, dtype=torch.bool)
    repeat[:, 1:] = (rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)
    return ascending(torch.where(repeat, torch.full_like(rows, -1), rows))


def interaction_top(engine, q: Tensor, q_mask: Tensor, count: int) -> Tensor:
    """Rows [B, count] of each query's best passages by centroid interaction over every passage, best first."""
    total = engine.shard.num_rows
    best_s = torch.full((len(q), 0), -torch.inf, device=engine.device)
    best_r = torch.zeros((len(q), 0), dtype=torch.long, device=engine.device)
    for start in range(0, total, ORACLE_STEP):
        rows = torch.arange(start, min(start + ORACLE_STEP, total), device=engine.device).expand(len(q), -1)
        scores = engine.interaction(q, q_mask, rows, torch.ones_like(rows, dtype=torch.bool))
        both_s, both_r = torch.cat([best_s, scores], 1), torch.cat([best_r, rows], 1)
        top = both_s.topk(min(count, both_s.shape[1]), dim=1)
        best_s, best_r = top.values, both_r.gather(1, top.indices)
    return best_r


class Step:
    """One batch of queries searched step by step as :meth:`.backends.Staged.search` does, its intermediate sets
    kept: ``ranked`` [B, ·] every passage some probe found, by proxy (``proxy``), best first; ``wide`` the probe
    candidates (W, or C without interaction), ``refined`` the candidates refined, ``top`` [B, 10] the result."""

    def __init__(self, searcher, texts: list[str], depth: tuple[int, int, int, int]):
        self.engine, self.depth = searcher.engine, depth
        encode = EagerEncoder(searcher.model, torch.get_num_threads(), searcher.batch_size, searcher.query_max_length)
        q, mask, salience = encode(texts)
        self.queries = Queries(q, mask, salience, prune_mask(salience, mask, searcher.query_prune),
                               searcher.use_salience)
        per_token, nprobe, wide, limit = depth
        owner, token = self.queries.probe_mask.nonzero(as_tuple=True)
        self.probes, self.owner = q[owner, token], owner.to(self.engine.device)
        scores, rows = self.engine.probe(self.probes, per_token, nprobe)
        self.weights = salience[owner, token].to(scores.device) if searcher.use_salience else None
        self.floors = probe_floors(scores, per_token)
        self.proxy, self.ranked = rank_candidates(scores, rows, self.owner, len(q), self.engine.shard.num_rows,
                                                  self.weights)
        self.width = wide or limit
        self.wide = ascending(self.ranked[:, :self.width])
        self.interaction = self.engine.interaction(q, mask, *self.wide) if wide else None
        self.refined = self.narrowed(limit)
        self.top = self.refine(*self.refined)

    def narrowed(self, limit: int) -> tuple[Tensor, Tensor]:
        """The ``limit`` best probe candidates by centroid interaction (by proxy without interaction)."""
        if self.interaction is None:
            return ascending(self.ranked[:, :limit])
        return narrow(self.interaction, self.wide[0].to(self.engine.device), limit)

    def refine(self, rows: Tensor, valid: Tensor) -> Tensor:
        """Rows [B, 10] of the top 10 of candidates ``rows`` [B, C] (where ``valid``) by their refined scores."""
        q = self.queries
        scores = self.engine.refine(q.vectors, q.mask, q.refine_salience, rows, valid)
        return top_hits(scores, rows.to(scores.device), K)[1]

    def threshold(self, b: int) -> float:
        """The proxy of query ``b``'s last probe candidate (−inf when fewer passages were found than fit)."""
        if self.proxy.shape[1] < self.width or not torch.isfinite(self.proxy[b, self.width - 1]):
            return -float("inf")
        return float(self.proxy[b, self.width - 1])

    def proxy_with_tokens(self, b: int, row: int, kept: Tensor | None) -> float:
        """Proxy of passage ``row`` for query ``b`` were its tokens (only those where ``kept`` [T], or all) entries of
        the inverted lists, each coded as the build codes an entry (its decoded token code): each probe's
        best entry score over the tokens in the lists it scans, minus its K-th score where it reaches it, weighted
        and summed over the query's probes; −inf where no probe reaches any of them."""
        shard = self.engine.shard
        probes = (self.owner == b).nonzero().squeeze(1)
        q, floors = self.probes[probes].to(shard.device), self.floors[probes].to(shard.device)
        lists = (q @ shard.centroids.T).topk(min(self.depth[1], shard.nlist), dim=1).indices  # [P, nprobe]
        local = row - shard.row_base
        positions = torch.arange(int(shard.offsets[local]), int(shard.offsets[local + 1]), device=shard.device)
        ids = shard.token_ids[positions].long() & 0xFFFF
        centroids = shard.centroids[ids]
        codes = torch.from_numpy(pq_encode(shard.decode(positions) - centroids, shard.books)).long()
        table = torch.einsum("pms,mks->pmk", q.view(len(q), shard.m, -1), shard.books)  # [P, M, 256]
        residual = table[:, torch.arange(shard.m), codes.to(shard.device)].sum(-1)  # [P, L]
        scores = q @ centroids.T + residual
        reach = (lists[:, :, None] == ids[None, None, :]).any(1) & (scores >= floors[:, None])
        if kept is not None:
            reach &= kept[positions]
        if not reach.any():
            return -float("inf")
        gain = torch.where(reach, scores - floors[:, None], torch.zeros_like(scores)).amax(1)
        weights = torch.ones_like(gain) if self.weights is None else self.weights[probes].to(shard.device)
        return float((weights * gain).sum())


def classify(step: Step, b: int, row: int, kept: Tensor) -> dict:
    """Why query ``b`` of ``step`` misses passage ``row`` of its exact top 10: {"cause", and the figures behind
    it}."""
    def holds(rows: Tensor, valid: Tensor) -> bool:
        return bool(((rows[b] == row) & valid[b].to(rows.device)).any())

    if holds(*step.refined):
        return {"cause": "codes"}
    if step.interaction is not None and holds(*step.wide):
        return {"cause": "interaction"}
    found = (step.ranked[b] == row).nonzero()
    rank = int(found[0, 0]) if len(found) else None
    threshold = step.threshold(b)
    every, only_kept = step.proxy_with_tokens(b, row, None), step.proxy_with_tokens(b, row, kept)
    if every > threshold:
        cause = "pruned tokens"
    else:
        cause = "candidate limit" if rank is not None else "probe depth"
    proxy = float(step.proxy[b, rank]) if rank is not None else -float("inf")
    return {"cause": cause, "proxy_rank": rank, "proxy": finite(proxy), "threshold": finite(threshold),
            "proxy_all_tokens": finite(every), "proxy_kept_tokens": finite(only_kept),
            "kept_tokens_pass": only_kept > threshold}


def finite(value: float) -> float | None:
    """``value`` to 4 decimals, None where it is infinite."""
    return round(value, 4) if np.isfinite(value) else None


def variants(step: Step, oracle: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Candidate sets (rows [B, ·] ascending, valid) of the variants, by name."""
    _, _, wide, limit = step.depth
    out = {"default": step.refined, "C ×2": step.narrowed(2 * limit), "C ×4": step.narrowed(4 * limit)}
    if wide:
        candidates = ascending(step.ranked[:, :4 * wide])
        q = step.queries
        out["W ×4"] = narrow(step.engine.interaction(q.vectors, q.mask, *candidates), candidates[0], limit)
    every = Queries(step.queries.vectors, step.queries.mask, step.queries.salience, step.queries.mask,
                    step.queries.weighted)
    rows, valid = step.engine.candidates(every, step.depth)
    if wide:
        rows, valid = narrow(step.engine.interaction(every.vectors, every.mask, rows, valid), rows, limit)
    out["all query tokens probe"] = rows, valid
    out["oracle interaction top C"] = ascending(oracle[:, :limit])
    out["default ∪ oracle top C"] = merged(step.refined[0], oracle[:, :limit])
    return out


def study(searcher, texts: list[str], exact_rows: list[list[int]], depth, batch: int, kept: Tensor) -> dict:
    """Misses by cause and the variants' figures over the queries ``texts`` with exact top-10 rows ``exact_rows``;
    ``kept`` [T]: the index's kept flags."""
    misses, rows_of = [], {}
    same, seconds = 0, {"search": 0.0, "oracle": 0.0, "classify": 0.0, "variants": 0.0}
    for start in range(0, len(texts), batch):
        clock = time.perf_counter()
        step = Step(searcher, texts[start:start + batch], depth)
        same += int((searcher.engine.search(step.queries, depth, K)[1].cpu() == step.top.cpu()).all(1).sum())
        seconds["search"] += time.perf_counter() - clock
        clock = time.perf_counter()
        oracle = interaction_top(step.engine, step.queries.vectors, step.queries.mask, depth[3])
        seconds["oracle"] += time.perf_counter() - clock
        clock = time.perf_counter()
        for b in range(len(step.queries)):
            returned = set(step.top[b].tolist())
            in_oracle = set(oracle[b].tolist())
            for rank, row in enumerate(exact_rows[start + b]):
                if row not in returned:
                    misses.append({"query": start + b, "exact_rank": rank + 1, "row": row, "in_oracle_top_c":
                                   row in in_oracle, **classify(step, b, row, kept)})
        seconds["classify"] += time.perf_counter() - clock
        clock = time.perf_counter()
        for name, (rows, valid) in variants(step, oracle).items():
            top = step.refine(rows, valid).cpu().tolist()
            held = [set(r[v].tolist()) for r, v in zip(rows.cpu(), valid.cpu())]
            entry = rows_of.setdefault(name, {"overlap": [], "recall": [], "refined": []})
            for b, query in enumerate(range(start, start + len(top))):
                exact = set(exact_rows[query])
                entry["overlap"].append(len(exact & set(top[b])) / K)
                entry["recall"].append(len(exact & held[b]) / K)
                entry["refined"].append(len(held[b]))
        seconds["variants"] += time.perf_counter() - clock
    total = K * len(texts)
    causes = {cause: sum(1 for m in misses if m["cause"] == cause) for cause in CAUSES}
    return {
        "exact_top10": total, "missed": len(misses), "overlap@10": round(1 - len(misses) / total, 4),
        "same_as_engine_search": same,
        "kept_tokens_pass_threshold": sum(1 for m in misses if m.pop("kept_tokens_pass", False)),
        "causes": {cause: {"misses": n, "share_of_exact_top10": round(n / total, 4),
                           "in_oracle_top_c": sum(1 for m in misses if m["cause"] == cause and m["in_oracle_top_c"])}
                   for cause, n in causes.items()},
        "variants": [{"variant": name, "refined": round(float(np.mean(v["refined"])), 1),
                      "recall@refined": round(float(np.mean(v["recall"])), 4),
                      "overlap@10": round(float(np.mean(v["overlap"])), 4)} for name, v in rows_of.items()],
        "seconds": {name: round(s, 2) for name, s in seconds.items()}, "misses": misses}


def command(args: argparse.Namespace) -> str:
    """The command line of the run, with its folders as placeholders."""
    parts = ["python -m eval.experiments.candidate_misses", f"--beir-zip {args.beir_zip.name}",
             f"--size {size_label(args.size)}", f"--device {args.device}"]
    parts += [f"--queries {args.queries}"] if args.queries else []
    parts += [f"--depth {':'.join(map(str, args.depth))}"] if args.depth else []
    parts += [f"--codec {args.codec}"] if args.codec != "auto" else []
    parts += ["--work DIR"] if args.work else []
    return " ".join(parts + ["--output DIR"])


def markdown(report: dict) -> str:
    """The report as markdown: the run, the misses by cause, the variants."""
    s, r = report["settings"], report["result"]
    k, nprobe, wide, limit = s["depth"]
    lines = [f"# Misses of the default search at {s['label']} passages ({report['machine']['gpu'] or 'CPU'})", "",
             f"`{s['command']}`", "",
             f"Codec {s['codec']}, β^d = 0.2, {s['queries']} queries; depth K={k}, nprobe={nprobe}, W={wide}, "
             f"C={limit}. The default search returns {r['overlap@10']} of the exact top 10 ({r['missed']} of "
             f"{r['exact_top10']} passages missed; the step-by-step search equals the engine's on "
             f"{r['same_as_engine_search']} of {s['queries']} queries). Of the passages that were no probe candidate, "
             f"{r['kept_tokens_pass_threshold']} pass the candidate threshold by the recomputed proxy of their kept "
             "tokens alone (the recomputation's own error).", "",
             "| cause | misses | share of the exact top 10 | exact rank ≤ 5 | found by a probe | in the oracle's top C |",
             "|---|---:|---:|---:|---:|---:|"]
    for cause, c in r["causes"].items():
        mine = [m for m in r["misses"] if m["cause"] == cause]
        found = sum(1 for m in mine if m.get("proxy_rank") is not None) if cause not in ("codes", "interaction") \
            else "–"
        lines.append(f"| {cause} | {c['misses']} | {c['share_of_exact_top10']} | "
                     f"{sum(1 for m in mine if m['exact_rank'] <= 5)} | {found} | {c['in_oracle_top_c']} |")
    lines += ["", "| candidates refined | mean refined | exact top 10 among them | overlap@10 |",
              "|---|---:|---:|---:|"]
    lines += [f"| {v['variant']} | {v['refined']} | {v['recall@refined']} | {v['overlap@10']} |" for v in r["variants"]]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict:
    from pyserini_aligner.resolve import load_model
    from pyserini_aligner.search import AlignerSearcher

    corpus = SyntheticCorpus(read_beir_zip(args.beir_zip))
    queries = judged_queries(corpus, args.size, args.queries)
    texts = list(queries.values())
    passages = list(corpus.passages(args.size))
    model = load_model("aligner", device=args.device)
    clock = time.perf_counter()
    with float32_products():
        encoded = EncodedCorpus(*encode_tokens(model, [text for _, text in passages], args.batch_size,
                                               not args.quiet))
    docids = [docid for docid, _ in passages]
    exact = exact_top(model, texts, encoded.tokens, encoded.lengths, docids, K)
    seconds = {"exact": round(time.perf_counter() - clock, 2)}
    with ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="candidate-misses-")))
        folder = work / size_label(args.size)
        if (folder / "index" / "manifest.json").is_file():
            index_dir = folder / "index"
        else:
            clock = time.perf_counter()
            replay = ReplayModel(model, [text for _, text in passages], encoded, "aligner")
            index_dir, _ = build(corpus, args.size, folder, args.device, args.batch_size, args.codec, replay,
                                 args.quiet)
            seconds["build"] = round(time.perf_counter() - clock, 2)
            del replay
        del encoded
        release_memory(args.device)
        k, nprobe, limit, wide = args.depth or (None,) * 4
        searcher = AlignerSearcher(index_dir, encoder=model, device=args.device, backend="torch",
                                   k_per_token=k, nprobe=nprobe, max_candidates=limit, interaction_candidates=wide,
                                   batch_size=args.search_batch)
        if list(searcher.docids) != docids:
            raise ValueError(f"{index_dir} does not hold the {size_label(args.size)} synthetic passages in order")
        depth = searcher.depth(K)
        row_of = {docid: row for row, docid in enumerate(docids)}
        exact_rows = [[row_of[docid] for docid, _ in hits] for hits in exact]
        kept = torch.from_numpy(np.concatenate([s.kept for s in searcher.store.segments])).to(searcher.engine.device)
        result = study(searcher, texts, exact_rows, depth, args.search_batch, kept)
    for miss in result["misses"]:
        miss["docid"] = docids[miss.pop("row")]
    return {"machine": machine_info(args.device),
            "settings": {"command": command(args), "size": args.size, "label": size_label(args.size),
                         "queries": len(texts), "codec": str(searcher.manifest.codec), "depth": list(depth)},
            "seconds": {**seconds, **result.pop("seconds")}, "result": result}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.quiet)
    report = run(args)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "candidate_misses.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (args.output / "candidate_misses.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

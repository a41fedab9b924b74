"""FastPlaid (lightonai/fast-plaid, a Rust/CUDA PLAID engine) as the benchmark drives it: built over given token
vectors with its default settings, searched with query vectors from this project's model."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from eval.bench_scale.measure import Ranking
from eval.bench_scale.run import Ranker, measured_build

WHEEL = "fast-plaid==1.7.0.2110"  # the release built for torch 2.11
NBITS = 4  # bits a dimension of each token's residual (FastPlaid's default)


class FastPlaidMissing(RuntimeError):
    """fast-plaid cannot be imported here; the message is one line."""


def fast_plaid_search():
    """FastPlaid's ``fast_plaid.search`` module; FastPlaidMissing when it is not installed, or was built for
    another torch."""
    try:
        from fast_plaid import search
    except (ImportError, OSError) as err:
        reason = " ".join(str(err).split())
        raise FastPlaidMissing(f"FastPlaid cannot be imported ({reason}); install {WHEEL} (built for torch 2.11, "
                               f"this is torch {torch.__version__}) to compare with it") from None
    return search


def fast_plaid_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fast-plaid")
    except PackageNotFoundError:
        return "unknown"


def build(passages: Sequence[torch.Tensor], folder: Path, device: str) -> tuple[Path, dict]:
    """A FastPlaid index of ``passages`` (one [length, d] float16 tensor each, in docid order) at
    ``folder/index``, with FastPlaid's defaults (k-means centroids, NBITS-bit residuals); (index folder, build
    figures as :func:`eval.bench_scale.run.build` gives them)."""
    search = fast_plaid_search()
    index_dir = folder / "index"

    def make() -> dict:
        engine = search.FastPlaid(str(index_dir), device=device)
        engine.create(documents_embeddings=list(passages), nbits=NBITS)
        engine.close()
        return {"docs": len(passages), "codec": f"PLAID nbits={NBITS}", "tokens": sum(len(p) for p in passages)}

    return index_dir, measured_build(folder, index_dir, device, make)


def ranker(index_dir: Path, model, docids: Sequence[str], device: str, n_ivf_probe: int,
           n_full_scores: int) -> Ranker:
    """Top-10 (docid, score) from the FastPlaid index at ``index_dir`` (loaded here, placed on the GPU as FastPlaid
    chooses), queries encoded by ``model`` (every token, as exact scoring takes them), in batches of the given
    size."""
    search = fast_plaid_search()
    engine = search.FastPlaid(str(index_dir), device=device)

    def rank(texts: list[str], batch: int) -> Ranking:
        ranked = []
        for start in range(0, len(texts), batch):
            out = model.encode_padded(texts[start:start + batch], is_query=True, batch_size=batch)
            queries = [vectors[mask].half() for vectors, mask in zip(out.vectors, out.mask)]
            hits = engine.search(queries, top_k=10, n_ivf_probe=n_ivf_probe, n_full_scores=n_full_scores,
                                 show_progress=False)
            ranked += [[(docids[row], float(score)) for row, score in found] for found in hits]
        return ranked

    return rank

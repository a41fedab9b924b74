"""The pruning sweep as a PNG: nDCG@10 against index bytes per document (FAISS part, and FAISS + refinement store)."""
from __future__ import annotations

from pathlib import Path


def plot_pruning(rows: list[dict], path: Path, title: str) -> Path:
    """One line per β^q, a point per β^d (labelled); left: FAISS bytes/doc, right: total bytes/doc."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, part, label in ((axes[0], "faiss", "FAISS index bytes / document"),
                            (axes[1], "total", "total index bytes / document (FAISS + refinement store)")):
        for query_prune in sorted({r["query_prune"] for r in rows}, reverse=True):
            line = sorted((r for r in rows if r["query_prune"] == query_prune), key=lambda r: r[f"{part}_bytes_per_doc"])
            xs, ys = [r[f"{part}_bytes_per_doc"] for r in line], [r["ndcg@10"] for r in line]
            ax.plot(xs, ys, marker="o", label=rf"$\beta^q$ = {query_prune:g}")
            for r, x, y in zip(line, xs, ys):
                ax.annotate(rf"$\beta^d$={r['doc_prune']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("nDCG@10")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""The backbone in plain torch (:mod:`pyserini_aligner.backbone`) against transformers' ``BertModel`` with the same
weights, in one process: the same AlignerModel encodes with one backbone, then the other.

``python -m eval.experiments.backbone_speed --beir-zip scifact.zip --output DIR [--device cuda] [--docs N]
[--queries N] [--repeats 3]``

Measures (medians over ``--repeats`` rounds, the two backbones alternating): encoding the first ``--docs`` documents of the zip's corpus (title + text, batches of
``--batch-size``, fp16 on a GPU, fp32 on the CPU), one query at a time eagerly, and on a GPU a captured CUDA graph of
a batch of 300, 32 and 1 queries (:class:`~pyserini_aligner.search.graphs.GraphedQueryEncoder`); and the largest
difference between the two backbones' token vectors. Writes ``backbone_speed.json`` and ``backbone_speed.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zipfile
from pathlib import Path

import torch

from eval.cli import positive_int


def read_texts(beir_zip: Path, docs: int, queries: int) -> tuple[list[str], list[str]]:
    """The first ``docs`` documents ("title text") and ``queries`` queries of a BEIR zip."""
    with zipfile.ZipFile(beir_zip) as archive:
        names = archive.namelist()
        corpus = next(n for n in names if n.endswith("corpus.jsonl"))
        topics = next(n for n in names if n.endswith("queries.jsonl"))
        records = [json.loads(line) for line in archive.read(corpus).decode().splitlines()[:docs]]
        texts = [json.loads(line)["text"] for line in archive.read(topics).decode().splitlines()[:queries]]
    return [f"{r.get('title', '')} {r['text']}".strip() for r in records], texts


def timed(call, repeats: int, sync) -> float:
    """Median seconds of ``call()`` over ``repeats`` runs after one untimed run."""
    call()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, docs: list[str], queries: list[str], batch_size: int) -> tuple[dict, tuple]:
    """Seconds of each encoding step with the model's current backbone (one timed run after an untimed one; graphs:
    median of 10), and its outputs for the comparison."""
    cuda = model.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    row = {"docs_s": timed(lambda: model.encode(docs, is_query=False, batch_size=batch_size), 1, sync)}
    singles = [timed(lambda q=q: model.encode_padded([q], is_query=True), 1, sync) for q in queries]
    row["query_eager_ms_p50"] = statistics.median(singles) * 1000
    if cuda:
        from pyserini_aligner.search.graphs import GraphedQueryEncoder

        graphed = GraphedQueryEncoder(model)
        for n in (300, 32, 1):
            batch = (queries * (300 // len(queries) + 1))[:n]
            call = (lambda: graphed(batch[0])) if n == 1 else (lambda: graphed.encode_batch(batch))
            row[f"query_graph_b{n}_ms"] = timed(call, 10, sync) * 1000
    with torch.inference_mode():
        outputs = (model.encode_padded(queries, is_query=True), model.encode(docs[:200], is_query=False))
    return row, outputs


def compare(beir_zip: Path, device: str, n_docs: int, n_queries: int, batch_size: int, repeats: int) -> dict:
    from transformers import AutoModel

    from pyserini_aligner.resolve import load_model

    docs, queries = read_texts(beir_zip, n_docs, n_queries)
    model = load_model("aligner", device, "fp16" if device.startswith("cuda") else None)
    plain = model.backbone
    reference = AutoModel.from_pretrained(model.backbone_source).float().to(device).eval()
    reference.load_state_dict(plain.state_dict())
    rounds, outputs = {}, {}
    for _ in range(repeats):  # alternating, so that a device warming up or a busy neighbour weighs on both
        for name, backbone in (("plain torch", plain), ("transformers BertModel", reference)):
            model.backbone = backbone
            row, outputs[name] = measure(model, docs, queries, batch_size)
            rounds.setdefault(name, []).append(row)
    model.backbone = plain
    rows = {name: {key: statistics.median(row[key] for row in runs) for key in runs[0]}
            for name, runs in rounds.items()}
    (q_a, d_a), (q_b, d_b) = outputs.values()
    return {
        "command": "python -m eval.experiments.backbone_speed " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "torch_threads": torch.get_num_threads(), "docs": len(docs), "queries": len(queries),
        "batch_size": batch_size, "repeats": repeats, "dtype": "fp16" if device.startswith("cuda") else "fp32",
        "rows": {name: {k: round(v, 4) for k, v in row.items()} for name, row in rows.items()},
        "max_abs_diff_query_vectors": float((q_a.vectors - q_b.vectors)[q_a.mask].abs().max()),
        "max_abs_diff_doc_vectors": max(float(abs(a.vectors - b.vectors).max()) for a, b in zip(d_a, d_b)),
    }


def markdown(report: dict) -> str:
    keys = list(next(iter(report["rows"].values())))
    lines = [f"Backbones on {report['device']} ({report['dtype']}, {report['torch_threads']} threads): "
             f"{report['docs']} documents in batches of {report['batch_size']}, {report['queries']} queries; medians.",
             "", f"`{report['command']}`", "", "| backbone | " + " | ".join(keys) + " |",
             "|---|" + "---:|" * len(keys)]
    lines += [f"| {name} | " + " | ".join(str(row[k]) for k in keys) + " |" for name, row in report["rows"].items()]
    lines += ["", f"Largest difference of token vectors: queries {report['max_abs_diff_query_vectors']:.2e}, "
                  f"documents {report['max_abs_diff_doc_vectors']:.2e}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--beir-zip", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--docs", type=positive_int, default=5183, help="documents encoded (default: SciFact's)")
    parser.add_argument("--queries", type=positive_int, default=200)
    parser.add_argument("--batch-size", type=positive_int, default=256)
    parser.add_argument("--repeats", type=positive_int, default=5, help="rounds of both backbones")
    args = parser.parse_args()
    report = compare(args.beir_zip, args.device, args.docs, args.queries, args.batch_size, args.repeats)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "backbone_speed.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (args.output / "backbone_speed.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))


if __name__ == "__main__":
    main()

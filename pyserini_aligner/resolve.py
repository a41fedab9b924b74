"""The one way from a model name, a checkpoint folder or a ready model to a loaded :class:`AlignerModel`.

Names: every shipped checkpoint (``SHIPPED``: each folder of :mod:`pyserini_aligner.checkpoints`, such as
``"aligner"``, the default, and ``"aligner-mix"``, trained further under a mix of alignments), ``"untrained"`` (the
initialisation they were trained from: MiniLM as is, seeded Gaussian projection, uniform salience; see
:mod:`pyserini_aligner.untrained`). Any other string is a checkpoint folder, recognised by its
``config.json`` (:func:`is_checkpoint`). Every command and class that takes an encoder (index builder, live index,
searchers, reranker, Pyserini encoders, evaluation, adaptation) loads it here, and checks it against an index with
:func:`check_index_model`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.onnx_runtime import INT8, TORCH, query_runtime
from pyserini_aligner.model import CONFIG_FILE, AlignerModel, resolve_dtype
from pyserini_aligner.untrained import untrained_model

DEFAULT = "aligner"
UNTRAINED = "untrained"
AUTO = "auto"  # dtype: fp16 for a checkpoint loaded onto CUDA, else fp32; a ready model keeps its own


def is_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder whose ``config.json`` is an AligneR config (it has ``format_version``,
    which a plain Hugging Face model's config has not); the folder is not otherwise validated."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "format_version" in config


def load_model(source=DEFAULT, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = AUTO) -> AlignerModel:
    """The AlignerModel named by ``source``.

    source: an AlignerModel, or an encoder holding one in ``.model`` (used as is); "aligner"; "untrained"; a
    checkpoint folder (errors name the missing or bad file). device: where a loaded model goes (default cpu); a
    ready model is moved there only when given. dtype: "auto", or fp32/fp16/bf16 (None = fp32) for the backbone's
    autocast, set on loaded and ready models alike.
    """
    if isinstance(source, AlignerModel) or isinstance(getattr(source, "model", None), AlignerModel):
        model = source if isinstance(source, AlignerModel) else source.model
        if device is not None:
            model = model.to(device)
        if dtype != AUTO:
            model.compute_dtype = resolve_dtype(dtype)
        return model
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"encoder must be a shipped checkpoint's name ({', '.join(SHIPPED)}), 'untrained', a "
                        f"checkpoint folder or an AlignerModel, got {type(source).__name__}")
    device = device or "cpu"
    if dtype == AUTO:
        dtype = "fp16" if str(device).startswith("cuda") else None
    if str(source) == UNTRAINED:
        model = untrained_model().to(device)
        model.compute_dtype = resolve_dtype(dtype)
    else:
        model = AlignerModel.from_pretrained(str(source), device=device, dtype=dtype)
    runtime = query_runtime()
    if runtime != TORCH:  # a model loaded to search with: its queries on a CPU through ONNX Runtime
        model.use_onnx_queries(int8=runtime == INT8)
    return model


def check_index_model(model: AlignerModel, manifest, index_dir: str | os.PathLike) -> AlignerModel:
    """``model`` when its vectors can query the index (its manifest: same dim and model fingerprint), else
    ValueError naming the index, the model it was built with and what to do."""
    if model.config.dim != manifest.dim:
        raise ValueError(f"encoder produces {model.config.dim}-d vectors but index {index_dir} holds "
                         f"{manifest.dim}-d vectors")
    fingerprint = model.fingerprint()
    if fingerprint != manifest.model_fingerprint:
        raise ValueError(f"model fingerprint mismatch: index {index_dir} was built with model "
                         f"{manifest.model_name or '<in-memory>'} (fingerprint {manifest.model_fingerprint[:12]}…), "
                         f"the encoder given has fingerprint {fingerprint[:12]}…; use the index's model or rebuild "
                         "the index")
    return model


def model_for_index(encoder, manifest, index_dir: str | os.PathLike,
                    device: str | torch.device | None = None) -> AlignerModel:
    """The model to query an index with: ``encoder`` (as :func:`load_model` takes it; a ready model is used where
    it is, a named one is loaded onto ``device``) or, when None, the model named in the index's manifest; checked
    with :func:`check_index_model`."""
    if encoder is None:
        if not manifest.model_name:
            raise ValueError(f"index {index_dir} was built with an in-memory model and records no model name; "
                             "pass the encoder (checkpoint folder or AlignerModel) explicitly")
        encoder = manifest.model_name
    named = isinstance(encoder, (str, os.PathLike))
    return check_index_model(load_model(encoder, device if named else None), manifest, index_dir)

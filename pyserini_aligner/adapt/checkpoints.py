"""Choosing the checkpoint as well as the alignment from a few labelled queries, without re-encoding the corpus.

Every checkpoint compared (by default each shipped one, :data:`pyserini_aligner.checkpoints.SHIPPED`, and the
index's own) rescores the same candidates: the candidate documents' texts, from the Lucene index the candidates came
from (its stored raw documents) or from the corpus the AligneR index was built from, are encoded with it, and
nothing else is. Each (checkpoint, strategy) pair is a :class:`.select.Candidate` of :func:`.select.choose`. When a
pair of another checkpoint wins, :func:`index_command` is the command line that indexes the corpus with it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from pyserini_aligner.adapt.select import CANDIDATE_STRATEGIES, Candidate, Hits, rescore_texts
from pyserini_aligner.checkpoints import SHIPPED
from pyserini_aligner.resolve import UNTRAINED, is_checkpoint
from pyserini_aligner.strategy import Strategy

log = logging.getLogger(__name__)


def checkpoint_label(name_or_path: str | os.PathLike) -> str:
    """What a checkpoint is called in reports and commands: its shipped name (also for a shipped checkpoint's
    folder) or "untrained", else the folder as an absolute path."""
    name = str(name_or_path)
    if name in SHIPPED or name == UNTRAINED:
        return name
    folder = Path(name).resolve()
    return next((shipped for shipped, path in SHIPPED.items() if path.resolve() == folder), str(folder))


def check_checkpoints(names: Sequence[str]) -> None:
    """ValueError naming the first of ``names`` that is neither a shipped checkpoint, "untrained" nor a checkpoint
    folder."""
    for name in names:
        if not (str(name) in SHIPPED or str(name) == UNTRAINED or is_checkpoint(name)):
            raise ValueError(f"{name} is neither a shipped checkpoint ({', '.join(SHIPPED)}) nor an AligneR "
                             "checkpoint folder (one with an AligneR config.json)")


def lucene_texts(index_dir: str | os.PathLike, docids: Sequence[str]) -> dict[str, str]:
    """Text of each of ``docids`` stored in a Pyserini Lucene index: its raw document (``contents``, or title +
    text), else its stored contents; docids without stored text are left out."""
    from pyserini.search.lucene import LuceneSearcher

    from pyserini_aligner.search.rerank import text_of_raw

    searcher = LuceneSearcher(str(index_dir))
    texts = {}
    for docid in dict.fromkeys(docids):
        doc = searcher.doc(docid)
        if doc is None:
            continue
        raw = doc.raw()
        text = text_of_raw(raw) if raw is not None else doc.contents()
        if isinstance(text, str):
            texts[docid] = text
    return texts


def candidate_texts(docids: Sequence[str], lucene_index: str | os.PathLike | None = None,
                    corpus: str | os.PathLike | None = None) -> dict[str, str]:
    """docid -> text for ``docids``: from the Lucene index's stored documents when given, the rest from ``corpus``
    (JsonCollection file/folder, BEIR folder or ir_datasets id, read until every docid is found). ValueError names
    what is missing."""
    from pyserini_aligner.explain import load_texts

    wanted = list(dict.fromkeys(docids))
    texts = lucene_texts(lucene_index, wanted) if lucene_index is not None else {}
    rest = [d for d in wanted if d not in texts]
    if rest and corpus is None:
        source = "no corpus is given" if lucene_index is None else f"the Lucene index {lucene_index} stores none"
        raise ValueError(f"no text for {len(rest)} candidate documents (e.g. {rest[0]!r}): {source}; pass --corpus")
    if rest:
        texts.update(load_texts(corpus, rest))
    return texts


@dataclass
class Rescored:
    """One checkpoint's rescoring of the candidates."""

    checkpoint: str  # as checkpoint_label gives it
    runs: dict[str, Hits]  # strategy -> qid -> [(docid, score)] best first
    encoded: int  # documents encoded (the distinct candidates)
    default_strategy: str  # the checkpoint's own default
    scores_with_salience: bool  # its scores weigh token saliences, which only fp16 stores keep


def rescore_checkpoints(checkpoints: Sequence, queries: Mapping[str, str], candidates: Mapping[str, Sequence[str]],
                        texts: Mapping[str, str], strategies: Sequence[Strategy] = CANDIDATE_STRATEGIES,
                        maxlen: int | None = None, device: str | None = None, batch_size: int = 32,
                        progress: bool = False) -> list[Rescored]:
    """Every checkpoint's :func:`.select.rescore_texts` of the same candidates, one checkpoint loaded at a time.

    checkpoints: (label, source) pairs, source as ``load_model`` takes it (a name, a folder or a loaded model); a
    checkpoint with the same weights (fingerprint) as an earlier one is skipped. maxlen: tokens per document (the
    index's, so that every checkpoint sees the text the index saw; default each model's doc_maxlen). On a CPU, the
    lower layers that every checkpoint's backbone has unchanged (fine-tuned from one backbone above a layer) are
    computed once per candidate (:func:`shared_lower_layers`).
    """
    from pyserini_aligner.resolve import load_model

    layers = shared_lower_layers([source for _, source in checkpoints], device)
    seen, rescored = set(), []
    for label, source in checkpoints:
        model = load_model(source, device)
        fingerprint = model.fingerprint()
        if fingerprint in seen:
            log.info("checkpoint %s has the weights of one compared already; skipped", label)
            continue
        seen.add(fingerprint)
        attached = layers is not None and _attach(model.backbone, layers)
        try:
            runs, encoded = rescore_texts(model, queries, candidates, texts, strategies, batch_size, maxlen,
                                          progress)
        finally:
            if attached:
                model.backbone.share(None)
        rescored.append(Rescored(label, runs, encoded, model.config.default_strategy, model.scores_with_salience))
        del model
    return rescored


def shared_lower_layers(sources: Sequence, device: str | None = None):
    """A :class:`~pyserini_aligner.backbone.SharedLayers` over the embeddings and leading layers that the backbones
    of ``sources`` (as ``load_model`` takes them, each loaded and let go in turn) all have the same weights in, or
    None: on a GPU (where the lower layers cost less than keeping their states), for fewer than two sources, a
    backbone of another kind, or none of the layers shared."""
    from pyserini_aligner.backbone import Bert, SharedLayers, part_digests, shared_depth
    from pyserini_aligner.resolve import load_model

    if len(sources) < 2 or (device is not None and not str(device).startswith("cpu")):
        return None
    digests, reference = [], None
    for source in sources:
        model = load_model(source, device)
        if not isinstance(model.backbone, Bert) or model.device.type != "cpu":
            return None
        digests.append(part_digests(model.backbone))
        if reference is None:
            reference = model.backbone
        del model
    depth = shared_depth(digests)
    if depth == 0:
        return None
    log.info("the candidates' states after %d of %d backbone layers are computed once for %d checkpoints", depth,
             len(reference.encoder.layer), len(sources))
    return SharedLayers(reference, depth)


def _attach(backbone, layers) -> bool:
    """Whether ``backbone`` now takes its lower layers from ``layers`` (False where its weights there differ)."""
    try:
        backbone.share(layers)
    except (AttributeError, ValueError):  # not a Bert, or other weights below the shared depth
        return False
    return True


def candidate_runs(rescored: Sequence[Rescored]) -> dict[Candidate, Hits]:
    """``Candidate(checkpoint, strategy) -> run`` over every rescored checkpoint, in order."""
    return {Candidate(r.checkpoint, spec): run for r in rescored for spec, run in r.runs.items()}


def index_command(manifest, target: str | os.PathLike, corpus: str | None, checkpoint: str, strategy: str,
                  checkpoint_default: str, device: str = "cpu", salience: bool = False) -> list[str]:
    """``python -m pyserini_aligner.index`` arguments that index ``corpus`` at ``target`` with ``checkpoint`` as
    the index of ``manifest`` was built (its codec family, β^d, redundancy rule and document length), recording
    ``strategy`` as the default when it is not the checkpoint's own (``checkpoint_default``). A compressed index
    gives ``--codec auto`` (the default), which sizes the codec for the new checkpoint's vectors, unless the
    checkpoint scores with token saliences (``salience``), which only ``--codec fp16`` keeps; ``corpus`` None gives
    the placeholder ``<corpus>``."""
    from pyserini_aligner.index.options import DEFAULT_DOC_PRUNE, DEFAULT_INDEX_TYPE
    from pyserini_aligner.salience import DEFAULT_PRUNE_REDUNDANCY

    argv = ["python", "-m", "pyserini_aligner.index", "--corpus", corpus or "<corpus>", "--index", str(target),
            "--encoder", checkpoint]
    if strategy != checkpoint_default:
        argv += ["--strategy", strategy]
    if not manifest.codec.compressed or salience:
        index_type = manifest.index_type if not manifest.codec.compressed else DEFAULT_INDEX_TYPE
        argv += ["--codec", "fp16"] + ([] if index_type == DEFAULT_INDEX_TYPE else ["--index-type", index_type])
    if manifest.doc_prune != DEFAULT_DOC_PRUNE:
        argv += ["--doc-prune", f"{manifest.doc_prune:g}"]
    if manifest.prune_redundancy != DEFAULT_PRUNE_REDUNDANCY:
        argv += ["--prune-redundancy", "off" if manifest.prune_redundancy is None else
                 f"{manifest.prune_redundancy:g}"]
    if manifest.doc_maxlen is not None:
        argv += ["--max-length", str(manifest.doc_maxlen)]
    if str(device) != "cpu":
        argv += ["--device", str(device)]
    return argv

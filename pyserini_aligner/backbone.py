"""The transformer backbone and its tokenizer without the ``transformers`` package, for BERT-family models (MiniLM).

:class:`Bert` is BERT's encoder in plain torch, with the module and parameter names of ``transformers``'
``BertModel`` (so checkpoints, backbone deltas and fingerprints are the same), scaled-dot-product attention and no
per-call mask building. :class:`WordPieces` tokenizes with the model's ``tokenizer.json`` through the ``tokenizers``
package. Importing ``transformers`` costs seconds of every process's start-up; other architectures, and folders
without a ``tokenizer.json``, load through it (:func:`load_backbone`, :func:`load_tokenizer`).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that the forward pass uses."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @classmethod
    def read(cls, folder: Path) -> "BertConfig | None":
        """The folder's config.json as a BertConfig, or None when the model is not one this module runs (another
        architecture, a position embedding other than absolute, an activation other than exact GELU)."""
        try:
            data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if (data.get("model_type") != "bert" or data.get("hidden_act", "gelu") != "gelu"
                or data.get("position_embedding_type", "absolute") != "absolute" or data.get("is_decoder")):
            return None
        names = {f.name for f in fields(cls)}
        try:
            config = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError:
            return None
        if config.hidden_size % config.num_attention_heads:
            return None
        return config


class BackboneOutput(NamedTuple):
    last_hidden_state: Tensor  # [B, L, hidden]


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        def table(rows: int, **kwargs) -> nn.Embedding:  # uninitialised: Bert.load gives it the file's weights
            return nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size), **kwargs)

        self.word_embeddings = table(config.vocab_size, padding_idx=config.pad_token_id)
        self.position_embeddings = table(config.max_position_embeddings)
        self.token_type_embeddings = table(config.type_vocab_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor) -> Tensor:
        """[B, L] token ids → [B, L, hidden] (token type 0 everywhere, positions 0..L-1)."""
        length = input_ids.shape[1]
        embedded = (self.word_embeddings(input_ids) + self.position_embeddings.weight[:length]
                    + self.token_type_embeddings.weight[0])
        return self.dropout(self.LayerNorm(embedded))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, hidden: Tensor, bias: Tensor | None) -> Tensor:
        """[B, L, hidden], additive bias [B, 1, 1, L] (−inf at padding) or None → [B, L, hidden]."""
        batch, length, width = hidden.shape
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (proj(hidden).view(shape).transpose(1, 2) for proj in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                             dropout_p=self.dropout_p if self.training else 0.0)
        return out.transpose(1, 2).reshape(batch, length, width)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig, width: int):
        super().__init__()
        self.dense = nn.Linear(width, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)

    def forward(self, hidden: Tensor, bias: Tensor | None) -> Tensor:
        return self.output(self.self(hidden, bias), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.gelu(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)

    def forward(self, hidden: Tensor, bias: Tensor | None) -> Tensor:
        attended = self.attention(hidden, bias)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """Kept for the weights' names and values (a checkpoint's fingerprint covers them); the forward pass does not
    use it."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class Bert(nn.Module):
    """BERT's encoder: ``forward(input_ids, attention_mask)`` ([B, L] each) → BackboneOutput ([B, L, hidden])."""

    shared: "SharedLayers | None" = None  # where the lower layers' states come from (:meth:`share`)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> BackboneOutput:
        shared = self.shared
        if shared is not None and not self.training and not torch.jit.is_tracing():  # a traced graph has every layer
            hidden = shared.hidden(self, input_ids, attention_mask)
            layers = self.encoder.layer[shared.depth:]
        else:
            hidden, layers = self.embeddings(input_ids), self.encoder.layer
        bias = attention_bias(attention_mask, hidden.dtype)
        for layer in layers:
            hidden = layer(hidden, bias)
        return BackboneOutput(hidden)

    def lower(self, input_ids: Tensor, attention_mask: Tensor | None, depth: int) -> Tensor:
        """[B, L, hidden]: the hidden states after the embeddings and the first ``depth`` layers."""
        hidden = self.embeddings(input_ids)
        bias = attention_bias(attention_mask, hidden.dtype)
        for layer in self.encoder.layer[:depth]:
            hidden = layer(hidden, bias)
        return hidden

    def share(self, layers: "SharedLayers | None") -> None:
        """Take the states after the first ``layers.depth`` layers from ``layers`` (computed there once per text for
        every backbone attached to it) in inference; None detaches. ValueError when this
        backbone's weights there differ from those ``layers`` was made for."""
        if layers is not None and prefix_digest(self, layers.depth) != layers.digest:
            raise ValueError(f"this backbone's embeddings and first {layers.depth} layers differ from those the shared "
                             "layers were made for")
        self.shared = layers

    @classmethod
    def load(cls, folder: Path, config: BertConfig) -> "Bert":
        """The weights of ``folder`` (model.safetensors or pytorch_model.bin; names with or without a ``bert.``
        prefix), fp32; ValueError naming the file when one the model needs is missing or has another shape."""
        path = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
        if path is None:
            raise FileNotFoundError(f"{folder}: no {' or '.join(WEIGHT_FILES)}")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        with torch.device("meta"):  # no random initialisation of the weights read next (nor memory for them)
            model = cls(config)
        expected = model.state_dict()
        state = {}
        for name, tensor in tensors.items():
            name = name.removeprefix("bert.")
            if name in expected:
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise ValueError(f"{path}: tensor '{name}' has shape {list(tensor.shape)}, "
                                     f"the model expects {list(expected[name].shape)}")
                state[name] = tensor.float()
        missing = sorted(set(expected) - set(state) - {"pooler.dense.weight", "pooler.dense.bias"})
        if missing:
            raise ValueError(f"{path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if any(name.startswith("pooler.") for name in set(expected) - set(state)):  # unused; initialised as usual
            model.pooler = BertPooler(config)
            state = {name: tensor for name, tensor in state.items() if not name.startswith("pooler.")}
        model.load_state_dict(state, strict=False, assign=True)
        return model.eval()


def attention_bias(attention_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Additive attention bias [B, 1, 1, L] (−inf at padding), or None where nothing is padded. Without padding no
    mask is needed; the check would wait for a GPU (and break CUDA graph capture), so it is made on the CPU only."""
    if attention_mask is None or (attention_mask.device.type == "cpu" and bool(attention_mask.all())):
        return None
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill_(attention_mask == 0, -math.inf)[:, None, None, :]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` now, or None outside autocast."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def prefix_digest(backbone: Bert, depth: int) -> str:
    """sha256 over the embeddings' and the first ``depth`` layers' weights (fp32)."""
    digest = hashlib.sha256()
    prefixes = ("embeddings.",) + tuple(f"encoder.layer.{i}." for i in range(depth))
    for name, tensor in sorted(backbone.state_dict().items()):
        if name.startswith(prefixes):
            digest.update(name.encode())
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def part_digests(backbone: Bert) -> list[str]:
    """[embeddings, layer 0, ..., layer L−1]: sha256 over each part's weight names and fp32 values."""
    parts = [hashlib.sha256() for _ in range(len(backbone.encoder.layer) + 1)]
    for name, tensor in sorted(backbone.state_dict().items()):
        if name.startswith("embeddings."):
            part = 0
        elif name.startswith("encoder.layer."):
            part = int(name.split(".")[2]) + 1
        else:
            continue
        parts[part].update(name.encode())
        parts[part].update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return [part.hexdigest() for part in parts]


def shared_depth(digests: list[list[str]]) -> int:
    """How many leading layers backbones with these :func:`part_digests` all have the same weights in (0 where their
    embeddings differ, or for fewer than two backbones)."""
    if len(digests) < 2 or len({d[0] for d in digests}) > 1:
        return 0
    depth = 0
    while all(len(d) > depth + 1 for d in digests) and len({d[depth + 1] for d in digests}) == 1:
        depth += 1
    return depth


class SharedLayers:
    """The hidden states after the embeddings and the first ``depth`` layers of a :class:`Bert`, kept per text (by
    its token ids) for every backbone with the same weights there: checkpoints fine-tuned above layer ``depth``
    from one backbone, encoding one corpus each, compute its lower layers once (:meth:`Bert.share`). States are
    kept per precision (computed without autocast, or under one autocast dtype: each its own states), as the layers
    return them, on the CPU up to ``max_bytes``; texts past that are computed each time. Not thread-safe: one
    encoding at a time."""

    def __init__(self, reference: Bert, depth: int, max_bytes: int = 4 << 30):
        if not 0 < depth <= len(reference.encoder.layer):
            raise ValueError(f"depth must be in 1..{len(reference.encoder.layer)}, got {depth}")
        self.depth = depth
        self.digest = prefix_digest(reference, depth)
        self.max_bytes = max_bytes
        self.bytes = 0
        self.computed = self.reused = 0  # texts
        self._states: dict[bytes, Tensor] = {}

    def hidden(self, backbone: Bert, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """[B, L, hidden] after layer ``depth`` for ``input_ids`` [B, L] padded on the right (zeros at padding):
        each text's states as kept, the others computed by ``backbone`` (together, padded to the longest of them)
        and kept."""
        ids = input_ids.cpu().numpy()
        lengths = (attention_mask.sum(dim=1).cpu().numpy() if attention_mask is not None
                   else np.full(len(ids), ids.shape[1]))
        precision = str(autocast_dtype(input_ids.device.type)).encode()
        keys = [precision + ids[row, :length].tobytes() for row, length in enumerate(lengths)]
        missing = [row for row, key in enumerate(keys) if key not in self._states]
        fresh = {}
        if missing:
            width = int(lengths[missing].max())
            rows = torch.as_tensor(missing, device=input_ids.device)
            mask = None if attention_mask is None else attention_mask[rows, :width]
            computed = backbone.lower(input_ids[rows, :width], mask, self.depth).cpu()
            for i, row in enumerate(missing):
                fresh[row] = computed[i, :lengths[row]]
                if keys[row] not in self._states and self.bytes + fresh[row].nbytes <= self.max_bytes:
                    self._states[keys[row]] = fresh[row].clone()
                    self.bytes += fresh[row].nbytes
        self.computed += len(missing)
        self.reused += len(keys) - len(missing)
        first = fresh[0] if 0 in fresh else self._states[keys[0]]
        hidden = torch.zeros(*ids.shape, backbone.config.hidden_size, dtype=first.dtype)
        for row, key in enumerate(keys):
            hidden[row, :lengths[row]] = fresh[row] if row in fresh else self._states[key]
        return hidden.to(input_ids.device)


class WordPieces:
    """A model's tokenizer.json through ``tokenizers``: ids with the special tokens, cut to a length."""

    def __init__(self, tokenizer, special: dict[str, int | None]):
        self._tokenizer = tokenizer
        self._cut: dict[int, object] = {}  # max_length → a copy set to truncate there (threads share a tokenizer)
        self._lock = threading.Lock()
        self.cls_token_id = special.get("cls")
        self.sep_token_id = special.get("sep")
        self.pad_token_id = special.get("pad")
        self.bos_token_id = special.get("bos")
        self.eos_token_id = special.get("eos")

    def __getstate__(self) -> dict:  # copies and pickles leave out the lock and the truncating copies
        return {**self.__dict__, "_cut": {}, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    @classmethod
    def read(cls, folder: Path) -> "WordPieces | None":
        """The folder's tokenizer.json, or None when it has none."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        special = {}
        config_path = folder / "tokenizer_config.json"
        names = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        for role in ("cls", "sep", "pad", "bos", "eos"):
            token = names.get(f"{role}_token")
            if isinstance(token, dict):
                token = token.get("content")
            special[role] = tokenizer.token_to_id(token) if isinstance(token, str) else None
        return cls(tokenizer, special)

    def ids(self, texts: list[str], max_length: int | None = None, special: bool = True) -> list[list[int]]:
        """Token ids of each text, the special tokens included when ``special`` (and counted in ``max_length``)."""
        return [encoding.ids for encoding in self._encode(texts, max_length, special)]

    def ids_and_offsets(self, text: str, max_length: int | None = None) -> tuple[list[int], list[tuple[int, int]]]:
        """One text's ids (special tokens included) and each token's (start, end) characters in ``text``."""
        encoding = self._encode([text], max_length, True)[0]
        return encoding.ids, encoding.offsets

    def tokens(self, ids: list[int]) -> list[str]:
        """The vocabulary's strings of ``ids``."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token string and its id."""
        return self._tokenizer.get_vocab()

    def _encode(self, texts: list[str], max_length: int | None, special: bool):
        tokenizer = self._tokenizer
        if max_length is not None:
            with self._lock:
                if max_length not in self._cut:
                    from tokenizers import Tokenizer

                    copy = Tokenizer.from_str(self._tokenizer.to_str())
                    copy.enable_truncation(max_length)
                    self._cut[max_length] = copy
                tokenizer = self._cut[max_length]
        return tokenizer.encode_batch(list(texts), add_special_tokens=special)


class HubTokenizer:
    """``transformers``' tokenizer behind the :class:`WordPieces` interface, for folders without tokenizer.json."""

    def __init__(self, source: str):
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(source)
        for role in ("cls", "sep", "pad", "bos", "eos"):
            setattr(self, f"{role}_token_id", getattr(self._tokenizer, f"{role}_token_id"))

    def ids(self, texts: list[str], max_length: int | None = None, special: bool = True) -> list[list[int]]:
        return self._tokenizer(list(texts), add_special_tokens=special, truncation=max_length is not None,
                               max_length=max_length, return_attention_mask=False,
                               return_token_type_ids=False)["input_ids"]

    def ids_and_offsets(self, text: str, max_length: int | None = None) -> tuple[list[int], list[tuple[int, int]]]:
        if not getattr(self._tokenizer, "is_fast", False):
            raise ValueError("character offsets need a fast tokenizer (a tokenizer.json in the backbone folder)")
        enc = self._tokenizer(text, add_special_tokens=True, truncation=max_length is not None,
                              max_length=max_length, return_offsets_mapping=True, return_attention_mask=False,
                              return_token_type_ids=False)
        return enc["input_ids"], enc["offset_mapping"]

    def tokens(self, ids: list[int]) -> list[str]:
        return self._tokenizer.convert_ids_to_tokens(ids)

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        return self._tokenizer.get_vocab()


def load_backbone(source: str) -> nn.Module:
    """The backbone at ``source`` (a folder or a model name) in fp32: :class:`Bert` for a BERT folder, else
    ``transformers``' AutoModel."""
    folder = Path(source)
    config = BertConfig.read(folder) if folder.is_dir() else None
    if config is not None and any((folder / name).is_file() for name in WEIGHT_FILES):
        return Bert.load(folder, config)
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return AutoModel.from_pretrained(source).float()
    finally:
        if bar:
            hf_logging.enable_progress_bar()


def load_tokenizer(source: str) -> WordPieces | HubTokenizer:
    """The tokenizer at ``source``: its tokenizer.json through ``tokenizers``, else ``transformers``' AutoTokenizer."""
    folder = Path(source)
    return (WordPieces.read(folder) if folder.is_dir() else None) or HubTokenizer(source)

"""One encoding of a corpus, given to both engines: the exact token vectors as FastPlaid takes them (one tensor a
passage) and a model that hands them to this project's index builder instead of encoding the texts again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pyserini_aligner.model import AlignerModel, TokenOutput


@dataclass
class EncodedCorpus:
    """Every stored token of N passages, passage after passage (:func:`eval.bench_scale.exact.encode_tokens`)."""

    tokens: torch.Tensor  # [T, d] float16
    salience: torch.Tensor  # [T] float32
    lengths: torch.Tensor  # [N] int64, on the tokens' device

    def __post_init__(self) -> None:
        self.offsets = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)])  # [N + 1]

    def to(self, device: str | torch.device) -> "EncodedCorpus":
        return EncodedCorpus(self.tokens.to(device), self.salience.to(device), self.lengths.to(device))

    def passages(self) -> list[torch.Tensor]:
        """Each passage's tokens [length, d] (views of ``tokens``, nothing copied)."""
        return list(torch.split(self.tokens, self.lengths.tolist()))

    def padded(self, rows: Sequence[int], dtype: torch.dtype, device: str | torch.device) -> TokenOutput:
        """The passages ``rows`` as :meth:`AlignerModel.encode_token_ids` returns them: vectors [B, L, d] in
        ``dtype``, mask [B, L] and salience [B, L] on ``device``, zero past each passage's length (L: the
        longest)."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.lengths.device)
        lengths, starts = self.lengths[index], self.offsets[index]
        positions = torch.arange(max(int(lengths.max()), 1) if len(index) else 1, device=self.lengths.device)
        mask = positions < lengths[:, None]
        where = (starts[:, None] + positions)[mask]
        vectors = self.tokens.new_zeros(len(index), len(positions), self.tokens.shape[1], dtype=dtype)
        vectors[mask] = self.tokens[where].to(dtype)
        salience = self.salience.new_zeros(len(index), len(positions))
        salience[mask] = self.salience[where]
        return TokenOutput(vectors.to(device), mask.to(device), salience.to(device))


class ReplayModel(AlignerModel):
    """``model`` (its weights, config and tokenizer: shared, not copied) having already encoded ``texts`` into
    ``encoded``: an index built with it stores those very tokens. ``tokenize`` gives each passage's row (a text
    given twice gets its last row: the same tokens), ``encode_token_ids`` gathers the rows; queries are not
    replayed. ``name``: the checkpoint name the index records, so its searchers load the model by themselves."""

    def __init__(self, model: AlignerModel, texts: Sequence[str], encoded: EncodedCorpus, name: str):
        self.__dict__.update(model.__dict__)  # no AlignerModel.__init__: the modules are model's own
        self.rows = {text: row for row, text in enumerate(texts)}
        self.encoded, self.name_or_path = encoded, name

    def tokenize(self, texts: list[str], is_query: bool, maxlen: int | None = None) -> tuple[list[list[int]],
                                                                                              list[bool]]:
        """[[row], ...] of the passages ``texts``, none truncated (the encoding reported its truncation)."""
        if is_query or maxlen is not None:
            raise ValueError("ReplayModel replays passages as they were encoded: no queries, no max_length")
        missing = next((text for text in texts if text not in self.rows), None)
        if missing is not None:
            raise ValueError(f"ReplayModel: a passage that was not encoded: {missing!r:.80}")
        return [[self.rows[text]] for text in texts], [False] * len(texts)

    def encode_token_ids(self, ids: list[list[int]], is_query: bool, batch_size: int = 32,
                         dtype: torch.dtype = torch.float32, compute: str | None = None) -> TokenOutput:
        """The stored tokens of the rows ``ids`` ([[row], ...] from :meth:`tokenize`), padded, on the model's
        device (``compute`` is ignored: the tokens were encoded already)."""
        if is_query:
            raise ValueError("ReplayModel replays passages only")
        return self.encoded.padded([row for row, in ids], dtype, self.device)

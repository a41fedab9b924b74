"""Label-free training pairs from a corpus: pseudo-queries cut from its own documents.

Each pseudo-query is a sentence of a document (``min_words``..``max_words`` words), or its title; its positive is
that document with the query's text removed (the bundle row's ``drop`` span), so the model must match the query to
the rest of the text, not to its own copy. Negatives are mined with BM25 over the same corpus (``prepare.prepare_corpus``).
Standard library only.
"""

from __future__ import annotations

import random
import re
from typing import Iterable, NamedTuple

_SENTENCE = re.compile(r"\S.*?(?:[.!?](?=\s|$)|$)", re.S)


class PseudoQuery(NamedTuple):
    qid: str  # "<docid>#<n>"
    docid: str
    text: str
    span: tuple[int, int]  # characters [start, end) of the document that the query was cut from


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the sentences of ``text`` (split after . ! ? followed by a space)."""
    return [m.span() for m in _SENTENCE.finditer(text)]


def pseudo_queries(docs: Iterable[tuple[str, str]], per_doc: int = 1, min_words: int = 6, max_words: int = 40,
                   min_rest_words: int = 20, seed: int = 0) -> list[PseudoQuery]:
    """Up to ``per_doc`` pseudo-queries per (docid, text): distinct sentences of ``min_words``..``max_words`` words
    whose removal leaves at least ``min_rest_words`` words; seeded per document (independent of corpus order)."""
    if per_doc < 1 or min_words < 1 or max_words < min_words or min_rest_words < 0:
        raise ValueError(f"need per_doc >= 1 and 1 <= min_words <= max_words, min_rest_words >= 0; got {per_doc}, "
                         f"{min_words}, {max_words}, {min_rest_words}")
    out = []
    for docid, text in docs:
        total = len(text.split())
        spans = [(s, e) for s, e in sentence_spans(text)
                 if min_words <= len(text[s:e].split()) <= max_words
                 and total - len(text[s:e].split()) >= min_rest_words]
        chosen = random.Random(f"{seed}:{docid}").sample(spans, min(per_doc, len(spans)))
        out += [PseudoQuery(f"{docid}#{n}", docid, text[s:e], (s, e)) for n, (s, e) in enumerate(sorted(chosen))]
    return out


def title_queries(docs: Iterable[tuple[str, str, str]], max_words: int = 40, min_rest_words: int = 20
                  ) -> list[PseudoQuery]:
    """The title of each (docid, title, contents) as a pseudo-query ("<docid>#title") when ``contents`` starts with
    it, it has at most ``max_words`` words and the rest of ``contents`` at least ``min_rest_words``."""
    out = []
    for docid, title, contents in docs:
        title = title.strip()
        if (title and contents.startswith(title) and len(title.split()) <= max_words
                and len(contents[len(title):].split()) >= min_rest_words):
            out.append(PseudoQuery(f"{docid}#title", docid, title, (0, len(title))))
    return out

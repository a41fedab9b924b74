"""Which documents a search may return: a :class:`Filter`, by docids, by the values of a stored field, or by an
SQL-like predicate over the fields stored with the index (:meth:`Filter.where`), parsed once at the edge (the CLIs'
``--filter``, the servers' requests) and resolved against one index generation into a row mask (:meth:`Filter.rows`).

Predicates (:meth:`Filter.where`)::

    year >= 2015 AND (journal = 'Nature' OR journal LIKE 'Cell%') AND NOT retracted = TRUE
    metadata.url IS NOT NULL AND id NOT IN ('d1', 'd2')

- A field is a name of ASCII letters, digits and ``_`` (not starting with a digit), or any text in double quotes
  (``"two words"``, ``""`` for a quote); dots reach into objects (``metadata.url``). ``id`` is the docid.
- Literals: 'strings' (``''`` for a quote), numbers (``12``, ``-1.5e3``), ``TRUE``, ``FALSE``. Keywords are
  case-insensitive: ``AND OR NOT IN LIKE IS NULL TRUE FALSE``; precedence NOT, then AND, then OR.
- ``= != <> < <= > >=`` compare values of one type: numbers with numbers, strings with strings (by code point),
  booleans with booleans. A value of another type (a string "2015" against 2015, an object, an array) is never
  equal and never ordered: ``=``, ``<`` ... are false for it and ``!=`` is true.
- ``IN (...)`` / ``NOT IN (...)``: equal to one of the literals / to none. ``LIKE 'pat'`` / ``NOT LIKE``: strings
  only, ``%`` any run of characters, ``_`` one character, case-sensitive.
- A missing field or JSON null is NULL, with SQL's three-valued logic: a comparison, IN or LIKE with NULL is
  unknown, ``NOT`` unknown is unknown, ``AND`` / ``OR`` as in SQL, and a document matches only when the whole
  predicate is true. ``IS NULL`` / ``IS NOT NULL`` test for it.

A field that no segment of the index stores is an error (:class:`FilterError` naming it and the stored fields).
Evaluation reads each field named once as a column (SQLite's ``json_extract`` per segment, parameters bound, never
formatted into SQL) and evaluates the predicate over all rows with numpy: seconds for a million documents.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Union

import numpy as np

ID_FIELD = "id"  # the field name of a document's docid
# type codes of a field's column (StoredIndex.field_column): JSON null or missing, true/false, number, string,
# object or array
NULL, BOOL, NUMBER, STRING, COMPOSITE = range(5)
KEYWORDS = frozenset({"AND", "OR", "NOT", "IN", "LIKE", "IS", "NULL", "TRUE", "FALSE"})
_COMPARISONS = {"=", "!=", "<>", "<", "<=", ">", ">="}


class FilterError(ValueError):
    """A malformed filter: the one-line message names the token, file or line."""


# ---- the parsed form: frozen, hashable nodes ----------------------------------------------------------------------

FieldPath = tuple  # nested keys of a field: ("metadata", "url"); ("id",) is the docid


@dataclass(frozen=True)
class Compare:
    """``path op literal``; ``literal`` is (type code, value), so that 1 and TRUE stay apart."""

    path: FieldPath
    op: str
    literal: tuple


@dataclass(frozen=True)
class InSet:
    """``path IN (...)``: the literals split by type (strings, numbers, booleans)."""

    path: FieldPath
    strings: frozenset = frozenset()
    numbers: frozenset = frozenset()
    booleans: frozenset = frozenset()


@dataclass(frozen=True)
class Like:
    path: FieldPath
    pattern: str


@dataclass(frozen=True)
class IsNull:
    path: FieldPath


@dataclass(frozen=True)
class Not:
    operand: "Node"


@dataclass(frozen=True)
class Both:
    """AND of two predicates."""

    left: "Node"
    right: "Node"


@dataclass(frozen=True)
class Either:
    """OR of two predicates."""

    left: "Node"
    right: "Node"


Node = Union[Compare, InSet, Like, IsNull, Not, Both, Either]


# ---- the filter ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Filter:
    """Documents matching ``predicate`` (the parsed form; ``text`` says it in words, for messages). Build one with
    :meth:`docids`, :meth:`values`, :meth:`from_file` or :meth:`where`; combine two with ``a & b`` (AND). Equal
    filters (same predicate) hash alike, so a resolved mask can be cached by filter."""

    predicate: Node
    text: str = field(default="", compare=False)

    @classmethod
    def docids(cls, ids: Iterable[str]) -> "Filter":
        """The documents ``ids`` (a collection of docids; a single str is refused, never read as its characters)."""
        return cls.values(ID_FIELD, ids)

    @classmethod
    def values(cls, field: str, values: Iterable) -> "Filter":
        """The documents whose ``field`` (a name as in :meth:`where`: ``metadata.url``) is one of ``values``
        (strings, numbers or booleans, each matching values of its own type)."""
        if isinstance(values, (str, bytes)):
            raise TypeError("filter values must be a collection of values, not a single string")
        path = parse_field(field)
        node = in_set(path, values, where=f"values of {field!r}")
        return cls(node, f"{_path_text(path)} IN {_count(node)} value(s)")

    @classmethod
    def from_file(cls, path: str | os.PathLike, field: str = ID_FIELD) -> "Filter":
        """The documents whose ``field`` is one of the lines of the text file ``path`` (blank lines skipped, white
        space around a line ignored). A line matches a string value equal to it; for a field other than ``id``, a
        line that reads as a JSON number, ``true`` or ``false`` also matches that number or boolean."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FilterError(f"filter file not found: {path}") from None
        except UnicodeDecodeError as err:
            raise FilterError(f"{path}: not UTF-8 text (byte {err.start})") from None
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        values = list(lines)
        if parse_field(field) != (ID_FIELD,):
            values += [v for v in map(_json_scalar, lines) if v is not None]
        return cls.values(field, values)

    @classmethod
    def where(cls, expression: str) -> "Filter":
        """The documents matching ``expression``, an SQL-like predicate over the stored fields (grammar in the
        module's documentation); FilterError naming the offending token and its position."""
        if not isinstance(expression, str):
            raise TypeError(f"a filter expression must be a string, got {type(expression).__name__}")
        return cls(_Parser(expression).parse(), expression.strip())

    def __and__(self, other: "Filter") -> "Filter":
        """The documents both filters match."""
        if not isinstance(other, Filter):
            return NotImplemented
        return Filter(Both(self.predicate, other.predicate), f"({self.text}) AND ({other.text})")

    def __str__(self) -> str:
        return self.text

    @property
    def fields(self) -> list[str]:
        """The top-level field names the filter reads (``id`` included), sorted."""
        return sorted({path[0] for path in _paths(self.predicate)})

    def rows(self, store) -> np.ndarray:
        """bool [store.num_docs]: the rows of index generation ``store`` (a :class:`.index.reader.StoredIndex`)
        whose document matches, deleted rows included (a search also masks those). FilterError naming a field that
        the index does not store."""
        known = set(store.field_names)
        for name in self.fields:
            if name != ID_FIELD and name not in known:
                stored = ", ".join(sorted(known)) if known else "none besides id (the docid)"
                raise FilterError(f"filter {self.text!r}: unknown field {name!r}; the index stores: {stored}")
        columns: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

        def column(path: tuple) -> tuple[np.ndarray, np.ndarray]:
            if path not in columns:
                if path == (ID_FIELD,):
                    columns[path] = (np.full(store.num_docs, STRING, dtype=np.uint8),
                                     np.array(store.docids, dtype=object))
                elif path[0] == ID_FIELD:
                    raise FilterError(f"filter {self.text!r}: {_path_text(path)}: id (the docid) is a string, it "
                                      "has no keys")
                else:
                    columns[path] = store.field_column(path)
            return columns[path]

        true, _ = evaluate(self.predicate, column, store.num_docs)
        return true


def _count(node: InSet) -> int:
    return len(node.strings) + len(node.numbers) + len(node.booleans)


def _json_scalar(line: str):
    """The finite number or the boolean a line reads as in JSON (None otherwise)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    finite = isinstance(value, (int, float)) and math.isfinite(value)
    return value if isinstance(value, bool) or finite else None


def in_set(path: tuple, values: Iterable, where: str) -> InSet:
    """An IN node over ``values`` (strings, numbers, booleans); FilterError for any other value."""
    strings, numbers, booleans = set(), set(), set()
    for value in values:
        if isinstance(value, bool):
            booleans.add(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            numbers.add(value)
        elif isinstance(value, str):
            strings.add(value)
        else:
            raise FilterError(f"{where}: {value!r:.40} is not a string, a finite number or a boolean")
    return InSet(path, frozenset(strings), frozenset(numbers), frozenset(booleans))


def _paths(node: Node) -> Iterable[tuple]:
    if isinstance(node, (Both, Either)):
        yield from _paths(node.left)
        yield from _paths(node.right)
    elif isinstance(node, Not):
        yield from _paths(node.operand)
    else:
        yield node.path


def _path_text(path: tuple) -> str:
    return ".".join(key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) and key.upper() not in KEYWORDS
                    else '"' + key.replace('"', '""') + '"' for key in path)


# ---- evaluation: three-valued logic over columns ------------------------------------------------------------------

Truth = tuple[np.ndarray, np.ndarray]  # (true [n], unknown [n]); false = neither


def evaluate(node: Node, column: Callable[[tuple], tuple[np.ndarray, np.ndarray]], count: int) -> Truth:
    """(true, unknown) bool [count] of ``node`` over rows whose field values ``column(path)`` gives as (type codes
    uint8 [count], values object [count])."""
    if isinstance(node, Not):
        true, unknown = evaluate(node.operand, column, count)
        return ~true & ~unknown, unknown
    if isinstance(node, (Both, Either)):
        (t1, u1), (t2, u2) = evaluate(node.left, column, count), evaluate(node.right, column, count)
        f1, f2 = ~t1 & ~u1, ~t2 & ~u2
        if isinstance(node, Both):
            true, false = t1 & t2, f1 | f2
        else:
            true, false = t1 | t2, f1 & f2
        return true, ~true & ~false
    codes, values = column(node.path)
    null = codes == NULL
    if isinstance(node, IsNull):
        return null, np.zeros(count, dtype=bool)
    if isinstance(node, Compare):
        kind, literal = node.literal
        if node.op in ("!=", "<>"):
            equal = _where(codes, values, kind, lambda v: v == literal)
            return ~null & ~equal, null
        return _where(codes, values, kind, _OPS[node.op](literal)), null
    if isinstance(node, InSet):
        true = np.zeros(count, dtype=bool)
        for kind, wanted in ((STRING, node.strings), (NUMBER, node.numbers), (BOOL, node.booleans)):
            if wanted:
                true |= _where(codes, values, kind, lambda v, wanted=wanted: np.fromiter(
                    (x in wanted for x in v), dtype=bool, count=len(v)))
        return true, null
    matcher = _like_regex(node.pattern).fullmatch
    return _where(codes, values, STRING, lambda v: np.fromiter((matcher(x) is not None for x in v), dtype=bool,
                                                                count=len(v))), null


_OPS = {"=": lambda c: lambda v: v == c, "<": lambda c: lambda v: v < c, "<=": lambda c: lambda v: v <= c,
        ">": lambda c: lambda v: v > c, ">=": lambda c: lambda v: v >= c}


def _where(codes: np.ndarray, values: np.ndarray, kind: int, test: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """bool [n]: rows of type ``kind`` whose value passes ``test`` (given the object array of those values)."""
    out = np.zeros(len(codes), dtype=bool)
    rows = np.flatnonzero(codes == kind)
    if len(rows):
        out[rows] = np.asarray(test(values[rows]), dtype=bool)
    return out


def _like_regex(pattern: str) -> re.Pattern:
    """LIKE's pattern as a regular expression: ``%`` any run, ``_`` one character, everything else literal."""
    return re.compile("".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in pattern), re.DOTALL)


# ---- parsing --------------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>'(?:[^']|'')*')
  | (?P<quoted>"(?:[^"]|"")*")
  | (?P<number>-?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?(?![A-Za-z_]))
  | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><=|>=|<>|!=|=|<|>)
  | (?P<punct>[(),.])
""", re.VERBOSE)


@dataclass(frozen=True)
class _Token:
    kind: str  # string, quoted, number, word, keyword, op, punct, end
    text: str
    position: int  # 1-based character position in the expression


def parse_field(name: str) -> tuple:
    """The nested keys of field ``name`` written as in :meth:`Filter.where` (``metadata.url``, ``"a b".c``)."""
    if not isinstance(name, str):
        raise TypeError(f"a field name must be a string, got {type(name).__name__}")
    parser = _Parser(name)
    path = parser.path()
    parser.expect_end()
    return path


class _Parser:
    """Recursive descent over the tokens of one expression."""

    def __init__(self, text: str):
        self.text, self.tokens, self.at = text, self._tokenize(text), 0

    def _fail(self, token: _Token, expected: str) -> FilterError:
        got = "the end" if token.kind == "end" else repr(token.text)
        return FilterError(f"filter {self.text.strip()!r:.200}: expected {expected} at position {token.position}, got "
                           f"{got}")

    def _tokenize(self, text: str) -> list[_Token]:
        tokens, at = [], 0
        while at < len(text):
            match = _TOKEN.match(text, at)
            if match is None:
                char, where = text[at], f"position {at + 1}"
                if char in "'\"":
                    problem = f"unterminated {'string' if char == chr(39) else 'quoted name'} starting at {where}"
                elif char.isdigit() or char == "-":
                    problem = f"malformed number {text[at:].split()[0]!r} at {where}"
                else:
                    problem = f"unexpected character {char!r} at {where}"
                raise FilterError(f"filter {text.strip()!r:.200}: {problem}")
            kind = match.lastgroup
            if kind != "space":
                value = match.group()
                if kind == "word" and value.upper() in KEYWORDS:
                    kind, value = "keyword", value.upper()
                tokens.append(_Token(kind, value, at + 1))
            at = match.end()
        tokens.append(_Token("end", "", len(text) + 1))
        return tokens

    @property
    def token(self) -> _Token:
        return self.tokens[self.at]

    def _take(self, kind: str, text: str | None = None) -> _Token | None:
        token = self.token
        if token.kind == kind and (text is None or token.text == text):
            self.at += 1
            return token
        return None

    def expect_end(self) -> None:
        if self.token.kind != "end":
            raise self._fail(self.token, "the end of the filter")

    def parse(self) -> Node:
        if self.token.kind == "end":
            raise self._fail(self.token, "a predicate such as year >= 2015")
        node = self._or()
        if self.token.kind == "punct" and self.token.text == ")":
            raise self._fail(self.token, "AND, OR or the end (a ')' without its '(')")
        if self.token.kind != "end":
            raise self._fail(self.token, "AND, OR or the end")
        return node

    def _or(self) -> Node:
        node = self._and()
        while self._take("keyword", "OR"):
            node = Either(node, self._and())
        return node

    def _and(self) -> Node:
        node = self._not()
        while self._take("keyword", "AND"):
            node = Both(node, self._not())
        return node

    def _not(self) -> Node:
        if self._take("keyword", "NOT"):
            return Not(self._not())
        if self._take("punct", "("):
            node = self._or()
            if not self._take("punct", ")"):
                raise self._fail(self.token, "')'")
            return node
        return self._predicate()

    def _key(self) -> str:
        token = self.token
        if token.kind == "word":
            self.at += 1
            return token.text
        if token.kind == "quoted":
            self.at += 1
            return token.text[1:-1].replace('""', '"')
        raise self._fail(token, "a field name" if token.kind != "keyword" else
                         f"a field name (write the keyword as a name in double quotes: \"{token.text.lower()}\")")

    def path(self) -> tuple:
        keys = [self._key()]
        while self._take("punct", "."):
            if self.token.kind == "number" and re.fullmatch(r"\d+", self.token.text):
                keys.append(self.token.text)  # a.0: a key made of digits
                self.at += 1
            else:
                keys.append(self._key())
        return tuple(keys)

    def _predicate(self) -> Node:
        path = self.path()
        token = self.token
        if token.kind == "op":
            self.at += 1
            return Compare(path, "!=" if token.text == "<>" else token.text, self._literal())
        if self._take("keyword", "IS"):
            negated = bool(self._take("keyword", "NOT"))
            if not self._take("keyword", "NULL"):
                raise self._fail(self.token, "NULL")
            return Not(IsNull(path)) if negated else IsNull(path)
        negated = bool(self._take("keyword", "NOT"))
        if self._take("keyword", "IN"):
            node = self._in_list(path)
        elif self._take("keyword", "LIKE"):
            pattern = self._literal()
            if pattern[0] != STRING:
                raise self._fail(self.tokens[self.at - 1], "a 'pattern' string after LIKE")
            node = Like(path, pattern[1])
        else:
            raise self._fail(self.token, "IN or LIKE after NOT" if negated else
                             "a comparison (= != <> < <= > >=), IN, LIKE or IS")
        return Not(node) if negated else node

    def _in_list(self, path: tuple) -> InSet:
        if not self._take("punct", "("):
            raise self._fail(self.token, "'(' after IN")
        values = [self._literal()[1]]
        while self._take("punct", ","):
            values.append(self._literal()[1])
        if not self._take("punct", ")"):
            raise self._fail(self.token, "',' or ')' in the IN list")
        return in_set(path, values, "IN list")

    def _literal(self) -> tuple:
        token = self.token
        self.at += 1
        if token.kind == "string":
            return STRING, token.text[1:-1].replace("''", "'")
        if token.kind == "number":
            value = float(token.text) if re.search(r"[.eE]", token.text) else int(token.text)
            if not math.isfinite(value):
                raise self._fail(token, "a finite number")
            return NUMBER, value
        if token.kind == "keyword" and token.text in ("TRUE", "FALSE"):
            return BOOL, token.text == "TRUE"
        self.at -= 1
        if token.kind == "keyword" and token.text == "NULL":
            raise self._fail(token, "a value (test for NULL with IS NULL / IS NOT NULL)")
        raise self._fail(token, "a value: a 'string', a number, TRUE or FALSE")

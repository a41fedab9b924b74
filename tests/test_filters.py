"""Filter predicates: the parser names the offending token and its position; evaluation over a real index's stored
fields (SQLite, two segments, documents with and without fields, NULLs, nested keys) equals a slow Python reference
with SQL's three-valued logic on random expressions; docids, values, files and ``&``."""
import json
import random
import re

import numpy as np
import pytest

from pyserini_aligner.filters import Filter, FilterError
from pyserini_aligner.index import StoredIndex, build_index
from pyserini_aligner.index.live import AlignerIndex

WORDS = ["alpha", "beta", "gamma", "delta", "Alpha", "al%pha", "it's", "ünïcode", ""]
TAGS = ["red", "green", "blue"]
N_DOCS = 60


def random_fields(rng: random.Random) -> dict:
    """Fields of one document: every key may be missing or null; values of mixed types."""
    fields = {}
    choices = {
        "year": lambda: rng.choice([rng.randint(1990, 2020), rng.randint(1990, 2020) + 0.5,
                                    str(rng.randint(1990, 2020))]),
        "title": lambda: rng.choice(WORDS) + rng.choice(["", " x", "_y", "%"]),
        "flag": lambda: rng.choice([True, False, 1, 0]),
        "tag": lambda: rng.choice(TAGS + [["red"], {"k": 1}]),
        "meta": lambda: {"url": rng.choice(["http://a", "http://b", None]), "n": rng.randint(0, 3)},
        'odd "key"': lambda: rng.choice(["q", "r"]),
        "naïve": lambda: rng.randint(0, 2),
    }
    for key, make in choices.items():
        roll = rng.random()
        if roll < 0.15:
            fields[key] = None
        elif roll < 0.85:
            fields[key] = make()
    return fields if rng.random() > 0.1 else {}


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, str, dict]]:
    rng = random.Random(7)
    return [(f"doc{i}", f"{rng.choice(WORDS[:4])} {rng.choice(TAGS)} document {i}", random_fields(rng))
            for i in range(N_DOCS)]


@pytest.fixture(scope="module")
def store(tmp_path_factory, model, docs) -> StoredIndex:
    """Two segments (a build, then an add); one document deleted."""
    target = tmp_path_factory.mktemp("filters") / "idx"
    build_index(docs[:40], target, model, codec="fp16", progress=False, model_name="aligner")
    live = AlignerIndex(target, model)
    live.add(docs[40:])
    live.delete(["doc3"])
    return StoredIndex(target)


# ---- a slow reference: one document at a time, SQL's three-valued logic (None = unknown) -------------------------

def lookup(docid: str, fields: dict, path: tuple):
    if path == ("id",):
        return docid
    value = fields
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "other"


def reference(tree, docid: str, fields: dict):
    op = tree[0]
    if op == "not":
        inner = reference(tree[1], docid, fields)
        return None if inner is None else not inner
    if op in ("and", "or"):
        a, b = reference(tree[1], docid, fields), reference(tree[2], docid, fields)
        if op == "and":
            return False if a is False or b is False else (None if a is None or b is None else True)
        return True if a is True or b is True else (None if a is None or b is None else False)
    value = lookup(docid, fields, tree[1])
    if op == "isnull":
        return value is None
    if value is None:
        return None
    if op == "cmp":
        cmp, literal = tree[2], tree[3]
        same = kind(value) == kind(literal)
        if cmp in ("!=", "<>"):
            return not (same and value == literal)
        if not same:
            return False
        return {"=": value == literal, "<": value < literal, "<=": value <= literal, ">": value > literal,
                ">=": value >= literal}[cmp]
    if op == "in":
        return any(kind(value) == kind(v) and value == v for v in tree[2])
    if op == "like":
        if not isinstance(value, str):
            return False
        regex = "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in tree[2])
        return re.fullmatch(regex, value, re.DOTALL) is not None
    raise AssertionError(op)


# ---- random expressions and their text ------------------------------------------------------------------------------

PATHS = [("year",), ("title",), ("flag",), ("tag",), ("meta", "url"), ("meta", "n"), ('odd "key"',), ("naïve",),
         ("id",)]
LITERALS = [2000, 2005, 2010.5, -1, 0, 1, "2005", "red", "alpha", "Alpha", "it's", "", True, False, "doc7",
            "http://a", "q"]


def literal_text(value, rng: random.Random) -> str:
    if isinstance(value, bool):
        return rng.choice(["TRUE", "true", "True"]) if value else rng.choice(["FALSE", "false"])
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def path_text(path: tuple) -> str:
    return ".".join(key if re.fullmatch(r"[A-Za-z_]\w*", key, re.ASCII) else '"' + key.replace('"', '""') + '"'
                    for key in path)


def random_tree(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.3:
        path = rng.choice(PATHS)
        roll = rng.random()
        if roll < 0.45:
            return "cmp", path, rng.choice(["=", "!=", "<>", "<", "<=", ">", ">="]), rng.choice(LITERALS)
        if roll < 0.65:
            return "in", path, tuple(rng.sample(LITERALS, rng.randint(1, 4)))
        if roll < 0.8:
            return "like", path, rng.choice(["al%", "%a", "_lpha", "al\\%%", "%", "it's", "al%pha%", "%_%"])
        return "isnull", path
    roll = rng.random()
    if roll < 0.2:
        return "not", random_tree(rng, depth - 1)
    return rng.choice(["and", "or"]), random_tree(rng, depth - 1), random_tree(rng, depth - 1)


PRECEDENCE = {"or": 1, "and": 2, "not": 3}


def render(tree, rng: random.Random, outer: int = 0) -> str:
    """The text of ``tree`` with the fewest parentheses precedence needs, and now and then some more."""
    op = tree[0]
    if op in PRECEDENCE:
        mine = PRECEDENCE[op]
        if op == "not":
            text = f"{rng.choice(['NOT', 'not'])} {render(tree[1], rng, mine)}"
        else:
            # left-associative: a right operand of the same operator needs parentheses to keep the tree's shape
            text = (f"{render(tree[1], rng, mine)} {rng.choice([op.upper(), op])} "
                    f"{render(tree[2], rng, mine + 0.5)}")
        return f"({text})" if mine < outer or rng.random() < 0.1 else text
    path = path_text(tree[1])
    if op == "cmp":
        text = f"{path} {tree[2]} {literal_text(tree[3], rng)}"
    elif op == "in":
        text = f"{path} IN ({', '.join(literal_text(v, rng) for v in tree[2])})"
    elif op == "like":
        text = f"{path} LIKE {literal_text(tree[2], rng)}"
    else:
        text = f"{path} IS NULL"
    return f"({text})" if rng.random() < 0.1 else text


def expected_rows(tree, store: StoredIndex, docs) -> np.ndarray:
    by_id = {docid: fields for docid, _, fields in docs}
    return np.array([reference(tree, docid, by_id[docid]) is True for docid in store.docids])


def test_random_predicates_equal_the_python_reference(store, docs):
    rng = random.Random(11)
    matched = 0
    for _ in range(300):
        tree = random_tree(rng, rng.randint(0, 4))
        text = render(tree, rng)
        got = Filter.where(text).rows(store)
        assert got.dtype == bool and got.shape == (store.num_docs,)
        want = expected_rows(tree, store, docs)
        assert np.array_equal(got, want), (text, np.flatnonzero(got != want))
        matched += int(want.sum())
    assert matched > 300  # the predicates are not all empty


@pytest.mark.parametrize("text, tree", [
    ("tag = 'red' OR tag = 'blue' AND year > 2000",
     ("or", ("cmp", ("tag",), "=", "red"), ("and", ("cmp", ("tag",), "=", "blue"), ("cmp", ("year",), ">", 2000)))),
    ("NOT tag = 'red' AND year > 2000",
     ("and", ("not", ("cmp", ("tag",), "=", "red")), ("cmp", ("year",), ">", 2000))),
    ("NOT (tag = 'red' AND year > 2000)",
     ("not", ("and", ("cmp", ("tag",), "=", "red"), ("cmp", ("year",), ">", 2000)))),
    ("year NOT IN (2000, 2001) or meta.url is not null",
     ("or", ("not", ("in", ("year",), (2000, 2001))), ("not", ("isnull", ("meta", "url"))))),
    ("title NOT LIKE 'al%'", ("not", ("like", ("title",), "al%"))),
    ("\"odd \"\"key\"\"\" = 'q' AND \"naïve\" >= 1", ("and", ("cmp", ('odd "key"',), "=", "q"),
                                                       ("cmp", ("naïve",), ">=", 1))),
])
def test_precedence_and_negations(store, docs, text, tree):
    """NOT binds tighter than AND, AND tighter than OR; NOT IN, NOT LIKE, IS NOT NULL; quoted names."""
    want = expected_rows(tree, store, docs)
    assert want.any() and not want.all()
    assert np.array_equal(Filter.where(text).rows(store), want)


def test_nulls_follow_three_valued_logic(store, docs):
    """A document without ``year`` matches neither ``year = 2000`` nor ``NOT year = 2000``, and ``year != 2000``
    is unknown for it too; an object or array is not NULL and never equals a literal."""
    by_id = {docid: fields for docid, _, fields in docs}
    missing = np.array([by_id[docid].get("year") is None for docid in store.docids])
    assert missing.any() and not missing.all()
    for text in ("year = 2000", "NOT year = 2000", "year != 2000", "year IN (2000, '2000')", "year LIKE '%'"):
        assert not (Filter.where(text).rows(store) & missing).any(), text
    assert np.array_equal(Filter.where("year IS NULL").rows(store), missing)
    composite = np.array([isinstance(by_id[docid].get("tag"), (list, dict)) for docid in store.docids])
    assert composite.any()
    assert not (Filter.where("tag IS NULL").rows(store) & composite).any()
    assert not (Filter.where("tag IN ('red', 'green', 'blue')").rows(store) & composite).any()
    assert (Filter.where("tag != 'red'").rows(store) & composite).sum() == composite.sum()


def test_docids_values_and_files(store, docs, tmp_path):
    rows = {d: i for i, d in enumerate(store.docids)}
    assert np.flatnonzero(Filter.docids(["doc5", "doc50", "nosuch"]).rows(store)).tolist() == \
        sorted([rows["doc5"], rows["doc50"]])
    assert np.array_equal(Filter.docids(["doc3"]).rows(store), np.eye(store.num_docs, dtype=bool)[rows["doc3"]])
    by_id = {d: f for d, _, f in docs}
    want = np.array([by_id[d].get("tag") in ("red", "blue") for d in store.docids])
    assert np.array_equal(Filter.values("tag", ["red", "blue"]).rows(store), want)
    numbers = np.array([kind(by_id[d].get("year")) == "number" and by_id[d]["year"] in (2000, 2005)
                        for d in store.docids])
    strings = np.array([by_id[d].get("year") in ("2000", "2005") for d in store.docids])
    assert np.array_equal(Filter.values("year", [2000, 2005]).rows(store), numbers)
    (tmp_path / "years.txt").write_text("2000\n\n 2005 \n")
    assert np.array_equal(Filter.from_file(tmp_path / "years.txt", "year").rows(store), numbers | strings)
    (tmp_path / "ids.txt").write_text("doc1\ndoc2\n")
    assert Filter.from_file(tmp_path / "ids.txt") == Filter.docids(["doc2", "doc1"])
    urls = np.array([(by_id[d].get("meta") or {}).get("url") == "http://a" for d in store.docids])
    assert np.array_equal(Filter.values("meta.url", ["http://a"]).rows(store), urls)
    assert np.array_equal((Filter.values("meta.url", ["http://a"]) & Filter.where("tag = 'red'")).rows(store),
                          urls & Filter.where("tag = 'red'").rows(store))
    with pytest.raises(TypeError, match="not a single string"):
        Filter.docids("doc1")
    with pytest.raises(FilterError, match="filter file not found"):
        Filter.from_file(tmp_path / "missing.txt")


def test_unknown_fields_are_named(store, tmp_path, model):
    with pytest.raises(FilterError, match=r"unknown field 'yaer'; the index stores: flag, meta, naïve, "
                                          r"odd \"key\", tag, title, year$"):
        Filter.where("yaer > 2000").rows(store)
    with pytest.raises(FilterError, match="unknown field 'colour'"):
        (Filter.docids(["doc1"]) & Filter.values("colour", ["red"])).rows(store)
    with pytest.raises(FilterError, match=r"id\.x: id \(the docid\) is a string"):
        Filter.where("id.x = 1").rows(store)
    assert not Filter.where("meta.nosuch = 1").rows(store).any()  # a nested key: NULL where absent
    plain = tmp_path / "plain"
    build_index([("a", "one document"), ("b", "another one")], plain, model, codec="fp16", progress=False)
    old = StoredIndex(plain)
    assert old.field_names == [] and old.fields_of([0, 1]) == [{}, {}]
    assert Filter.where("id = 'b' OR id LIKE 'x%'").rows(old).tolist() == [False, True]
    with pytest.raises(FilterError, match="unknown field 'year'; the index stores: none besides id"):
        Filter.where("year = 1").rows(old)


VALUE = "expected a value: a 'string', a number, TRUE or FALSE"


@pytest.mark.parametrize("text, message", [
    ("", "expected a predicate such as year >= 2015 at position 1, got the end"),
    ("year >", f"{VALUE} at position 7, got the end"),
    ("year >= 2015 AND", "expected a field name at position 17, got the end"),
    ("(year = 1", "expected ')' at position 10, got the end"),
    ("year = 1)", "expected AND, OR or the end (a ')' without its '(') at position 9, got ')'"),
    ("title = 'abc", "unterminated string starting at position 9"),
    ('"title = 1', "unterminated quoted name starting at position 1"),
    ("year = NULL", "expected a value (test for NULL with IS NULL / IS NOT NULL) at position 8, got 'NULL'"),
    ("year IN 2015", "expected '(' after IN at position 9, got '2015'"),
    ("year IN (1, 2", "expected ',' or ')' in the IN list at position 14, got the end"),
    ("year IN ()", f"{VALUE} at position 10, got ')'"),
    ("in = 1", 'expected a field name (write the keyword as a name in double quotes: "in") at position 1, got \'IN\''),
    ("title LIKE 5", "expected a 'pattern' string after LIKE at position 12, got '5'"),
    ("year == 5", f"{VALUE} at position 7, got '='"),
    ("year ! 5", "unexpected character '!' at position 6"),
    ("year = 5x", "malformed number '5x' at position 8"),
    ("year = 1 tag = 'a'", "expected AND, OR or the end at position 10, got 'tag'"),
    ("year IS 5", "expected NULL at position 9, got '5'"),
    ("year NOT = 5", "expected IN or LIKE after NOT at position 10, got '='"),
    ("2015 < year", "expected a field name at position 1, got '2015'"),
    ("year = 1e999", "expected a finite number at position 8, got '1e999'"),
    ("meta. = 1", "expected a field name at position 7, got '='"),
])
def test_parser_errors_name_the_token_and_position(text, message):
    with pytest.raises(FilterError) as caught:
        Filter.where(text)
    assert str(caught.value) == f"filter {text!r}: {message}"


def test_filters_are_values():
    """Parsed once into a hashable form: equal predicates are equal filters whatever their spelling; 1 and TRUE,
    strings and numbers stay apart."""
    assert Filter.where("year = 1 and TAG in ('a','b')") == Filter.where("(year=1) AND TAG IN ('b', 'a')")
    assert hash(Filter.where("a <> 1")) == hash(Filter.where("a != 1"))
    assert Filter.where("a = 1") != Filter.where("a = TRUE")
    assert Filter.where("a = 1") != Filter.where("a = '1'")
    assert Filter.values("a", [1, True]) != Filter.values("a", [1])
    assert Filter.where("x = 'it''s'").predicate.literal == (3, "it's")
    combined = Filter.docids(["d1"]) & Filter.where("year > 2000")
    assert combined.fields == ["id", "year"] and "AND" in str(combined)
    with pytest.raises(FilterError, match="not a string, a finite number or a boolean"):
        Filter.values("year", [None])
    with pytest.raises(FilterError, match="expected a field name"):
        Filter.values("", ["x"])
    assert json.dumps(str(Filter.where(" year >= 2015 "))) == '"year >= 2015"'

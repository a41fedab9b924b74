"""A strategy string is parsed only where it enters: the ``--strategy`` argparse type, the manifest reader and the
one coercion of the public constructors (``as_strategy``); everything inward takes a Strategy."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARSERS = ("parse_strategy", "as_strategy")
ALLOWED = {
    ("pyserini_aligner/cli.py", "strategy", "parse_strategy"),  # the argparse type
    ("pyserini_aligner/index/format.py", "Manifest.__post_init__", "parse_strategy"),  # the manifest reader
    ("pyserini_aligner/strategy.py", "as_strategy", "parse_strategy"),  # the public constructors' coercion:
    ("pyserini_aligner/search/options.py", "SearchOptions.__post_init__", "as_strategy"),
    ("pyserini_aligner/search/exhaustive.py", "ExhaustiveScorer.__init__", "as_strategy"),
    ("pyserini_aligner/search/rerank.py", "AlignmentReranker.__init__", "as_strategy"),
    ("pyserini_aligner/index/commit.py", "set_default_strategy", "as_strategy"),
    ("pyserini_aligner/train/config.py", "TrainConfig.from_dict", "as_strategy"),
}


def parse_sites(source: str, path: str) -> set[tuple[str, str, str]]:
    """(path, qualified name of the enclosing function, parser called) for each call of a PARSERS function."""
    sites = set()

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = (*scope, node.name)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in PARSERS:
                sites.add((path, ".".join(scope), name))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(source), ())
    return sites


def product_sites() -> set[tuple[str, str, str]]:
    sites = set()
    for folder in ("pyserini_aligner", "eval"):
        for file in sorted((ROOT / folder).rglob("*.py")):
            sites |= parse_sites(file.read_text(encoding="utf-8"), file.relative_to(ROOT).as_posix())
    return sites


def test_strategy_strings_are_parsed_only_at_the_edges():
    assert product_sites() == ALLOWED


def test_a_parse_inside_is_found():
    inner = "from pyserini_aligner.strategy import parse_strategy\n\n" \
            "class Scorer:\n    def score(self, strategy):\n        return parse_strategy(strategy)\n"
    coerced = "import pyserini_aligner.strategy as s\n\ndef rank(strategy):\n    return s.as_strategy(strategy)\n"
    sites = product_sites() | parse_sites(inner, "pyserini_aligner/x.py") | parse_sites(coerced, "eval/y.py")
    assert sites - ALLOWED == {("pyserini_aligner/x.py", "Scorer.score", "parse_strategy"),
                               ("eval/y.py", "rank", "as_strategy")}

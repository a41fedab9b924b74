"""No module of the project (``pyserini_aligner`` and ``eval``) reaches into another module's private state: an
attribute whose name starts with one underscore is read, written or called only on ``self``/``cls``, or where the
module itself defines that name (a class of the module handling another instance of itself). Everything another
module needs has a public name."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pyserini_aligner", "eval")
# underscore names that are public by convention: namedtuple's API, the exit that skips clean-up handlers
CONVENTIONAL = {"_replace", "_asdict", "_fields", "_make", "_exit"}
# known exceptions, by file and name: a marker set on a third-party class, Pyserini's dense-sparse fusion and torch's
# in-place version counter of a tensor (no public equivalent)
ALLOWED = {("pyserini_aligner/data.py", "_pyserini_aligner_quiet"),
           ("pyserini_aligner/serve/served.py", "_hybrid_results"),
           ("pyserini_aligner/digests.py", "_version")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in CONVENTIONAL


def defined_names(tree: ast.AST) -> set[str]:
    """The underscore names a module defines: its functions, classes and their attributes (``self._x = ...``,
    class-level assignments, methods)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def private_accesses(path: Path, root: Path) -> list[str]:
    """``file:line: receiver.name`` for every access to an underscore attribute of an object other than
    ``self``/``cls`` whose name the module does not define itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = defined_names(tree)
    name = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr) or node.attr in own \
                or (name, node.attr) in ALLOWED:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def project_violations(root: Path) -> list[str]:
    return sorted(hit for package in PACKAGES for path in sorted((root / package).rglob("*.py"))
                  for hit in private_accesses(path, root))


def test_no_module_reaches_into_another_modules_private_state():
    assert project_violations(REPO) == []


def test_a_private_access_is_found(tmp_path):
    (tmp_path / "pyserini_aligner" / "serve").mkdir(parents=True)
    (tmp_path / "eval").mkdir()
    (tmp_path / "pyserini_aligner" / "serve" / "child.py").write_text(
        "class Child:\n"
        "    def __init__(self, searcher):\n"
        "        self._searcher = searcher\n"
        "        self._searcher.ok = 1\n"
        "    def update(self, strategy):\n"
        "        self.searcher._strategy_spec = strategy\n"
        "        self.searcher._reopen(None)\n"
        "    def copy(self, other: 'Child'):\n"
        "        return other._searcher\n")
    (tmp_path / "eval" / "steps.py").write_text("def run(searcher):\n    return searcher._search_batch([], 10)\n"
                                                "def point(p):\n    return p._replace(x=1)\n")
    assert project_violations(tmp_path) == [
        "eval/steps.py:2: searcher._search_batch",
        "pyserini_aligner/serve/child.py:6: self.searcher._strategy_spec",
        "pyserini_aligner/serve/child.py:7: self.searcher._reopen"]

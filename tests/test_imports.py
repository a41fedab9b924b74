"""The import graph of the project's own modules (``pyserini_aligner`` and ``eval``) has no cycle, no module other
than a ``__main__`` imports a ``__main__`` module (command-line front ends depend on the library, never the
reverse), and the layers hold: indexing never imports search, the core modules (``pyserini_aligner/<name>.py``)
import neither, the index's format, durable-write and commit modules import neither the reader nor the builders,
Pyserini's patches are imported only by the start-up hook and the command lines, the untrained checkpoint's
command line by nothing, and the package never imports the harness and benchmarks of ``eval``. Every import counts: top
level, inside functions and under ``TYPE_CHECKING``, absolute and relative."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pyserini_aligner", "eval")
# what the search backends are made of: the options, query encoding, the candidate rule, the codes and the graphs
SEARCH_CORE = {f"pyserini_aligner.search.{name}" for name in ("options", "encoding", "candidates", "codes", "graphs",
                                                              "allowed")}


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` under each package of ``root``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a import b`` counts as ``a.b`` when that is a module,
    else ``a``; importing ``a.b.c`` also imports its packages ``a`` and ``a.b``)."""
    modules = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _absolute(module, is_package, node.level, node.module) if node.level else node.module
                for alias in node.names:
                    names.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        found = set()
        for name in names:
            parts = name.split(".")
            found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in modules)
        found.discard(module)
        # a package's own modules are loaded through it; an import of the package from inside it is no cycle
        graph[module] = {m for m in found if not module.startswith(m + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def main_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every non-``__main__`` module importing a ``__main__`` module."""
    return sorted(f"{m} -> {t}" for m, targets in graph.items() if not m.endswith("__main__")
                  for t in targets if t.endswith("__main__"))


INDEX_FOUNDATION = ("pyserini_aligner.index.format", "pyserini_aligner.index.io", "pyserini_aligner.index.commit",
                    "pyserini_aligner.index.codec_spec")  # what every reader and writer of an index stands on
INDEX_ABOVE = ("pyserini_aligner.index.reader", "pyserini_aligner.index.builder", "pyserini_aligner.index.live",
               "pyserini_aligner.index.segment", "pyserini_aligner.index.codec",
               "pyserini_aligner.search")
PATCHES = "pyserini_aligner.pyserini_patches"
MAKE_DEFAULT = "pyserini_aligner.checkpoints.make_default"


def layering_violations(graph: dict[str, set[str]], core: set[str]) -> list[str]:
    """``importer -> imported (rule)`` for every import across a layer: ``pyserini_aligner.index`` imports
    ``pyserini_aligner.search``; a ``core`` module imports either; an :data:`INDEX_FOUNDATION` module imports one of
    :data:`INDEX_ABOVE`; a module other than ``_startup``, a command line or the patches themselves imports
    :data:`PATCHES`; any module imports :data:`MAKE_DEFAULT`; a ``pyserini_aligner`` module imports ``eval``;
    a search backend imports the searcher or the command line; a module of SEARCH_CORE imports a backend or the
    searcher."""
    def under(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    rules = [(lambda m: under(m, "pyserini_aligner.index"), ("pyserini_aligner.search",), "index never imports search"),
             (lambda m: m in core, ("pyserini_aligner.index", "pyserini_aligner.search"),
              "the core imports neither index nor search"),
             (lambda m: m in INDEX_FOUNDATION, INDEX_ABOVE,
              "the index format, I/O and commit modules import neither the reader, the builders nor search"),
             (lambda m: m != "pyserini_aligner._startup" and not m.endswith("__main__") and not under(m, PATCHES),
              (PATCHES,), "Pyserini's patches are imported only by the start-up hook and command lines"),
             (lambda m: True, (MAKE_DEFAULT,), "the untrained checkpoint's command line is imported by no module"),
             (lambda m: under(m, "pyserini_aligner"), ("eval",), "the package never imports eval"),
             (lambda m: under(m, "pyserini_aligner.search.backends"),
              ("pyserini_aligner.search.searcher", "pyserini_aligner.search.__main__"),
              "backends never import the searcher or the command line"),
             (lambda m: m in SEARCH_CORE, ("pyserini_aligner.search.backends", "pyserini_aligner.search.searcher"),
              "search's options, encoding and steps import no backend and no searcher")]
    return sorted(f"{m} -> {t} ({reason})" for m, targets in graph.items() for t in targets
                  for applies, banned, reason in rules if applies(m) and any(under(t, b) for b in banned))


def core_modules(root: Path) -> set[str]:
    """The modules of ``pyserini_aligner/<name>.py`` (not its sub-packages)."""
    return {f"pyserini_aligner.{path.stem}" for path in (root / "pyserini_aligner").glob("*.py")
            if path.name != "__init__.py"}


def test_the_layers_hold():
    core = core_modules(REPO)
    assert {"pyserini_aligner.model", "pyserini_aligner.alignment", "pyserini_aligner.resolve"} <= core
    assert layering_violations(import_graph(REPO, PACKAGES), core) == []


def test_an_import_across_a_layer_is_found(tmp_path):
    _write(tmp_path, {"pyserini_aligner/__init__.py": "", "pyserini_aligner/model.py": "X = 1\n",
                      "pyserini_aligner/index/__init__.py": "", "pyserini_aligner/search/__init__.py": "",
                      "pyserini_aligner/index/builder.py": "def f():\n    from pyserini_aligner.search import engine\n",
                      "pyserini_aligner/search/engine.py": "from pyserini_aligner.index import builder\n",
                      "pyserini_aligner/resolve.py": "from pyserini_aligner.index.builder import f\n",
                      "pyserini_aligner/search/bench.py": "import eval.tools\n",
                      "eval/__init__.py": "", "eval/tools.py": "from pyserini_aligner.search import engine\n"})
    graph = import_graph(tmp_path, PACKAGES)
    assert layering_violations(graph, core_modules(tmp_path)) == [
        "pyserini_aligner.index.builder -> pyserini_aligner.search (index never imports search)",
        "pyserini_aligner.index.builder -> pyserini_aligner.search.engine (index never imports search)",
        "pyserini_aligner.resolve -> pyserini_aligner.index (the core imports neither index nor search)",
        "pyserini_aligner.resolve -> pyserini_aligner.index.builder (the core imports neither index nor search)",
        "pyserini_aligner.search.bench -> eval (the package never imports eval)",
        "pyserini_aligner.search.bench -> eval.tools (the package never imports eval)"]


@pytest.mark.parametrize("files, found", [
    ({"pyserini_aligner/search/backends/choose.py": "def f():\n    from pyserini_aligner.search import searcher\n"},
     ["pyserini_aligner.search.backends.choose -> pyserini_aligner.search.searcher (backends never import the "
      "searcher or the command line)"]),
    ({"pyserini_aligner/search/backends/workers.py": "from pyserini_aligner.search.__main__ import main\n"},
     ["pyserini_aligner.search.backends.workers -> pyserini_aligner.search.__main__ (backends never import the "
      "searcher or the command line)"]),
    ({"pyserini_aligner/search/options.py": "from .backends.choose import open_backend\n"},
     ["pyserini_aligner.search.options -> pyserini_aligner.search.backends (search's options, encoding and steps "
      "import no backend and no searcher)",
      "pyserini_aligner.search.options -> pyserini_aligner.search.backends.choose (search's options, encoding and "
      "steps import no backend and no searcher)"]),
    ({"pyserini_aligner/search/candidates.py": "import pyserini_aligner.search.searcher\n"},
     ["pyserini_aligner.search.candidates -> pyserini_aligner.search.searcher (search's options, encoding and steps "
      "import no backend and no searcher)"]),
])
def test_a_search_layer_crossed_is_found(tmp_path, files, found):
    base = {"pyserini_aligner/__init__.py": "", "pyserini_aligner/search/__init__.py": "",
            "pyserini_aligner/search/__main__.py": "def main():\n    pass\n",
            "pyserini_aligner/search/searcher.py": "from pyserini_aligner.search.backends.choose import open_backend\n",
            "pyserini_aligner/search/options.py": "", "pyserini_aligner/search/candidates.py": "",
            "pyserini_aligner/search/backends/__init__.py": "",
            "pyserini_aligner/search/backends/choose.py": "from pyserini_aligner.search.options import x\n",
            "pyserini_aligner/search/backends/workers.py": "", "eval/__init__.py": ""}
    _write(tmp_path, {**base, **files})
    assert layering_violations(import_graph(tmp_path, PACKAGES), core_modules(tmp_path)) == found


def test_each_rule_of_the_new_layers_fails_on_a_violation(tmp_path):
    _write(tmp_path, {"pyserini_aligner/__init__.py": "", "pyserini_aligner/index/__init__.py": "",
                      "pyserini_aligner/index/reader.py": "X = 1\n",
                      "pyserini_aligner/index/format.py": "from pyserini_aligner.index.reader import X\n",
                      "pyserini_aligner/index/commit.py": "def f():\n    from pyserini_aligner.index import builder\n",
                      "pyserini_aligner/index/builder.py": "X = 1\n",
                      "pyserini_aligner/pyserini_patches/__init__.py": "", "pyserini_aligner/pyserini_patches/hooks.py":
                      "from pyserini_aligner.pyserini_patches import server\n",
                      "pyserini_aligner/pyserini_patches/server.py": "X = 1\n",
                      "pyserini_aligner/_startup.py": "from pyserini_aligner.pyserini_patches import hooks\n",
                      "pyserini_aligner/serve/__init__.py": "",
                      "pyserini_aligner/serve/__main__.py": "import pyserini_aligner.pyserini_patches.server\n",
                      "pyserini_aligner/serve/served.py": "from pyserini_aligner.pyserini_patches.server import X\n",
                      "pyserini_aligner/checkpoints/__init__.py": "", "pyserini_aligner/checkpoints/make_default.py": "",
                      "pyserini_aligner/resolve.py": "from pyserini_aligner.checkpoints import make_default\n"})
    graph = import_graph(tmp_path, PACKAGES)
    assert layering_violations(graph, core_modules(tmp_path)) == [
        "pyserini_aligner.index.commit -> pyserini_aligner.index.builder (the index format, I/O and commit modules "
        "import neither the reader, the builders nor search)",
        "pyserini_aligner.index.format -> pyserini_aligner.index.reader (the index format, I/O and commit modules "
        "import neither the reader, the builders nor search)",
        "pyserini_aligner.resolve -> pyserini_aligner.checkpoints.make_default (the untrained checkpoint's command "
        "line is imported by no module)",
        "pyserini_aligner.serve.served -> pyserini_aligner.pyserini_patches (Pyserini's patches are imported only by "
        "the start-up hook and command lines)",
        "pyserini_aligner.serve.served -> pyserini_aligner.pyserini_patches.server (Pyserini's patches are imported "
        "only by the start-up hook and command lines)"]


def test_project_has_no_import_cycle():
    graph = import_graph(REPO, PACKAGES)
    assert len(graph) > 50 and "pyserini_aligner.model" in graph["pyserini_aligner.encoders"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_library_modules_do_not_import_command_line_modules():
    assert main_imports(import_graph(REPO, PACKAGES)) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("files, cycle", [
    ({"pkg/a.py": "from pkg import b\n", "pkg/b.py": "import pkg.a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    ({"pkg/a.py": "def f():\n    from .sub.c import g\n", "pkg/sub/__init__.py": "",
      "pkg/sub/c.py": "from ..a import f\n"}, ["pkg.a", "pkg.sub.c", "pkg.a"]),
    ({"pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import X\n",
      "pkg/b.py": "from . import a\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
])
def test_a_cycle_is_found(tmp_path, files, cycle):
    _write(tmp_path, {"pkg/__init__.py": "", **files})
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == cycle


def test_acyclic_package_and_main_imports(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "from pkg.a import f\n", "pkg/a.py": "import os\nfrom pkg import b\n",
                      "pkg/b.py": "X = 1\n", "pkg/cli/__init__.py": "", "pkg/cli/__main__.py": "from pkg.a import f\n",
                      "pkg/c.py": "from pkg.cli.__main__ import main\n"})
    graph = import_graph(tmp_path, ("pkg",))
    assert find_cycle(graph) is None
    assert graph["pkg.a"] == {"pkg.b"}
    assert main_imports(graph) == ["pkg.c -> pkg.cli.__main__"]

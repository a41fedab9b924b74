"""Interpreter start-up hook, run from ``pyserini_aligner.pth`` (and on ``import pyserini_aligner``).

It installs one import hook and imports nothing heavy: the work happens only when Pyserini's own
modules are imported. Hooks, by module name:

- ``jnius`` (before it starts the JVM): pick a Java >= 21 and drop JVM options the runtime lacks;
- ``pyserini.encode._openai``: let it import when ``OPENAI_API_KEY`` is unset;
- ``pyserini.encode`` (after): register the ``aligner`` encoders in Pyserini's encoder maps;
- ``pyserini.search`` (before), run by ``python -m pyserini.search.faiss`` or ``hybrid`` with ``--help``: the help
  saved by an earlier ``--help`` is printed before Pyserini loads (``integration.help_cache``);
- ``pyserini.search.faiss._searcher`` (after): ``FaissSearcher(<aligner index>, ...)`` gives an ``AlignerSearcher``;
- ``pyserini.search.lucene.__main__`` (run by ``python -m``): an AligneR ``--index`` is searched with AligneR, the
  Lucene-only flags (``hooks.LUCENE_ONLY_FLAGS``) dropped with a warning;
- ``pyserini.search.__main__``: forwarded to ``pyserini.search.lucene`` with this interpreter, exit status kept;
- ``pyserini.search.faiss.__main__``, ``pyserini.search.hybrid.__main__``: with an AligneR index or encoder (``aligner``
  or a checkpoint folder, told by its config.json), errors give one line and a non-zero exit and the run file appears
  only when complete; with ``--help``, Pyserini's help ends with a line on the ``aligner`` encoder;
- ``pyserini.encode.__main__`` with an AligneR encoder: refused, naming the command that builds an AligneR index;
- ``pyserini.server.models``, ``.search_controller``, ``.rest.routes.indexes``, ``.rest.app``: Pyserini's REST and MCP
  servers serve AligneR indexes; ``pyserini.encode.optional._uniir`` imports without its optional package (M-BEIR
  encoders) so that they start (``pyserini_aligner.serve.pyserini_server``).
"""
import importlib.machinery
import os
import sys

_HOOKED = frozenset({
    "jnius",
    "pyserini.encode",
    "pyserini.encode._openai",
    "pyserini.encode.__main__",
    "pyserini.search",
    "pyserini.search.faiss._searcher",
    "pyserini.search.lucene.__main__",
    "pyserini.search.__main__",
    "pyserini.search.faiss.__main__",
    "pyserini.search.hybrid.__main__",
    "pyserini.encode.optional._uniir",
    "pyserini.server.models",
    "pyserini.server.search_controller",
    "pyserini.server.rest.routes.indexes",
    "pyserini.server.rest.app",
})


class _HookedLoader:
    """Wraps the real loader of a hooked module; everything not overridden is delegated."""

    def __init__(self, inner, name: str) -> None:
        self._inner = inner
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(self._inner, attr)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        from pyserini_aligner.integration import hooks

        hooks.exec_hooked(self._name, self._inner, module)

    def get_code(self, fullname: str):
        """``runpy`` (``python -m``) executes this code object instead of calling ``exec_module``."""
        from pyserini_aligner.integration import hooks

        return hooks.main_code(self._name, self._inner) or self._inner.get_code(fullname)


class _Finder:
    """A meta path finder (plain class: importing importlib.abc would cost start-up time)."""

    def find_spec(self, name, path, target=None):
        if name not in _HOOKED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, name)
        return spec


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def quiet_openmp() -> None:
    """On the plugin's command lines (``python -m pyserini_aligner...``), OpenMP threads that wait sleep instead of
    spinning (``OMP_WAIT_POLICY=PASSIVE`` unless it is set), before torch and faiss load their OpenMP runtimes (one
    each): spinning threads hold the cores that the single-threaded start-up (imports, loading the model) needs; on
    2 cores a 5-query search took a quarter longer with them."""
    argv = getattr(sys, "orig_argv", [])
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1].startswith("pyserini_aligner."):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


install()
quiet_openmp()

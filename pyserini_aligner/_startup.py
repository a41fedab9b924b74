"""Interpreter start-up hook, run from ``pyserini_aligner.pth`` (and on ``import pyserini_aligner``).

It installs one import hook and imports nothing heavy: the work happens only when Pyserini's own modules named in
:data:`pyserini_aligner.pyserini_patches.HOOKED` are imported, and is done by :mod:`pyserini_aligner.pyserini_patches`
(what each patch does is listed there).
"""
import importlib.machinery
import os
import sys

from pyserini_aligner.pyserini_patches import HOOKED


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
        from pyserini_aligner.pyserini_patches import hooks

        hooks.exec_hooked(self._name, self._inner, module)

    def get_code(self, fullname: str):
        """``runpy`` (``python -m``) executes this code object instead of calling ``exec_module``."""
        from pyserini_aligner.pyserini_patches import hooks

        return hooks.main_code(self._name, self._inner) or self._inner.get_code(fullname)


class _Finder:
    """A meta path finder (plain class: importing importlib.abc would cost start-up time)."""

    def find_spec(self, name, path, target=None):
        if name not in HOOKED:
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

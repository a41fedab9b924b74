"""Pyserini's encoder package with its encoders imported when first used, for a command line of Pyserini or of the
plugin: ``pyserini.encode`` imports some twenty encoder modules, and through them transformers' model classes,
scikit-learn and the OpenAI client, seconds of start-up that a BM25 or an AligneR search, a server or an index
build never uses (a command that uses an encoder imports its module then).

The package's own code runs as published, with one change: ``from .module import Name`` (a submodule other than
:data:`EAGER`) binds a stand-in class for ``Name`` instead of importing the submodule. A stand-in imports its
module when it is called or an attribute of it is read, and answers ``isinstance``/``issubclass`` without importing
(nothing is an instance of a class whose module was never imported).
"""

from __future__ import annotations

import builtins
import importlib
import sys
from types import ModuleType

PACKAGE = "pyserini.encode"
EAGER = frozenset({"pyserini.encode._base"})  # the base classes every searcher and encoder derives from


class Deferred(type):
    """The metaclass of a stand-in for class ``__deferred__ = (module, name)``."""

    def real(cls) -> type:
        """The class itself (its module imported now if it was not)."""
        module, name = type.__getattribute__(cls, "__deferred__")
        return getattr(importlib.import_module(module), name)

    def __call__(cls, *args, **kwargs):
        return cls.real()(*args, **kwargs)

    def __getattr__(cls, attr: str):
        return getattr(cls.real(), attr)

    def __instancecheck__(cls, obj) -> bool:
        real = cls.loaded()
        return real is not None and isinstance(obj, real)

    def __subclasscheck__(cls, sub) -> bool:
        real = cls.loaded()
        return real is not None and issubclass(sub, real)

    def loaded(cls) -> type | None:
        """The class when its module has been imported, else None."""
        module, name = type.__getattribute__(cls, "__deferred__")
        return getattr(sys.modules[module], name, None) if module in sys.modules else None

    def __repr__(cls) -> str:
        module, name = type.__getattribute__(cls, "__deferred__")
        return f"<class '{module}.{name}' (not imported yet)>"


class DeferredModule(ModuleType):
    """What ``from .module import Name`` sees of a deferred submodule: a stand-in class for every name."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Deferred(name, (), {"__deferred__": (self.__name__, name), "__module__": self.__name__})


def resolve(name: str, package: str | None, level: int) -> str:
    """The absolute module name of ``import`` with ``level`` leading dots from ``package``."""
    if level == 0:
        return name
    base = (package or "").rsplit(".", level - 1)[0]
    return f"{base}.{name}" if name else base


def deferring_import(name, globals=None, locals=None, fromlist=(), level=0):
    """``__import__`` for the package's code: a ``from`` import of an encoder submodule not yet imported gets a
    :class:`DeferredModule`; every other import is the real one."""
    absolute = resolve(name, (globals or {}).get("__package__"), level)
    if (fromlist and absolute.startswith(PACKAGE + ".") and absolute not in EAGER
            and absolute not in sys.modules):
        return DeferredModule(absolute)
    return builtins.__import__(name, globals, locals, fromlist, level)


def exec_deferring(inner, module: ModuleType) -> None:
    """Execute ``module`` (the package ``pyserini.encode``) with its encoder submodules deferred."""
    module.__dict__["__builtins__"] = {**builtins.__dict__, "__import__": deferring_import}
    try:
        inner.exec_module(module)
    finally:
        module.__dict__["__builtins__"] = builtins

"""``--help`` of Pyserini's faiss and hybrid command lines without loading Pyserini.

``python -m pyserini.search.faiss --help`` first imports the packages ``pyserini.search`` and
``pyserini.search.faiss``, which start Pyserini's JVM and load every encoder (seconds, before the help is built).
The help text, Pyserini's with the plugin's note, depends only on the installed code, so the first ``--help`` of
each command saves it under ``$XDG_CACHE_HOME/pyserini-aligner`` (``~/.cache/pyserini-aligner``), keyed by the
Python version and the sources that build it (Pyserini's ``__main__``, the plugin's hooks), and later ones print it
from there when ``pyserini.search`` is first imported, before anything loads. A
cache that can't be read or written is skipped: the help is then built as usual.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

COMMANDS = ("pyserini.search.faiss", "pyserini.search.hybrid")
_HELP_FLAGS = ("-h", "--help")


def help_request() -> str | None:
    """The command of :data:`COMMANDS` that this interpreter runs as ``python -m <command> ... --help``, or None."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" not in argv[:-1]:
        return None
    at = argv.index("-m")
    command, rest = argv[at + 1], argv[at + 2:]
    return command if command in COMMANDS and any(arg in _HELP_FLAGS for arg in rest) else None


def _sources(command: str) -> list[Path]:
    """Pyserini's ``__main__`` of ``command`` (found without importing its packages) and the plugin's hook
    modules that add to its help (the notes of :mod:`.hooks` and :mod:`.filtered`)."""
    spec = importlib.util.find_spec("pyserini")
    if spec is None or not spec.submodule_search_locations:
        raise OSError("pyserini is not installed")
    main = Path(list(spec.submodule_search_locations)[0], *command.split(".")[1:], "__main__.py")
    here = Path(__file__).resolve().parent
    return [main, here / "hooks.py", here / "filtered.py", Path(__file__).resolve()]


def cache_file(command: str) -> Path:
    """Where the help of ``command`` is kept for the installed Pyserini and plugin."""
    digest = hashlib.sha256(sys.version.encode())
    for path in _sources(command):
        digest.update(path.read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pyserini-aligner"
    return root / f"help-{command}-{digest.hexdigest()[:16]}.txt"


def print_cached(command: str) -> bool:
    """Print the saved help of ``command``; False when there is none (or it can't be read)."""
    try:
        text = cache_file(command).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    sys.stdout.write(text)
    sys.stdout.flush()
    return True


def save(command: str, text: str) -> None:
    """Keep ``text`` as the help of ``command`` (written whole under a temporary name, then renamed)."""
    try:
        path = cache_file(command)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except OSError:
        pass


def record(command: str) -> None:
    """Keep what this process writes to stdout and save it as the help of ``command`` when the process ends, if it
    is a help (argparse's ``usage:`` first: on a flag error argparse writes to stderr instead)."""
    recorder = Recorder(sys.stdout)
    sys.stdout = recorder

    def keep() -> None:
        text = recorder.text()
        if text.startswith("usage:"):
            save(command, text)

    atexit.register(keep)


class Recorder:
    """A stand-in for ``sys.stdout`` that passes everything on and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def text(self) -> str:
        return "".join(self.parts)

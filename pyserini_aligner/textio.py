"""Text files in and out: line-numbered UTF-8 reading (every input error names its file and line), and output
written to a temporary file next to the target, renamed into place when complete."""
from __future__ import annotations

import contextlib
import json
import os
import unicodedata
import uuid
from pathlib import Path
from typing import IO, Iterable, Iterator, Sequence


class InputError(ValueError):
    """Bad input file; the message names the file and line."""


_FILLERS = frozenset("\u115f\u1160\u3164\uffa0")  # Hangul fillers: blank, though of a letter's category


def is_blank(text: str) -> bool:
    """True for a text with nothing to index or search: no letter or digit (of any script; Unicode categories L and
    N), only white space, control characters (NUL), format characters (zero-width spaces and joiners, BOM, soft
    hyphen, direction marks), blank fillers, punctuation and symbols. Indexed, a document "..." would be the tokens of
    its punctuation and special tokens, which match every query's."""
    return not any(unicodedata.category(c)[0] in "LN" and c not in _FILLERS for c in text)


def check_collection(value, name: str) -> None:
    """TypeError when ``value``, an argument that takes a collection (docids, texts, documents), is a single str or
    bytes: iterating it would take each character for an item (``delete("12")`` would delete "1" and "2")."""
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a list or other collection, not a single {type(value).__name__}; "
                        f"wrap one item in a list: [{value!r:.60}]")


def check_unique_ids(ids: Sequence[str], name: str) -> None:
    """ValueError naming the first id of ``ids`` (query ids of a batch) given twice: results are keyed by id, so the
    later query's would silently replace the earlier one's."""
    first: dict[str, int] = {}
    for position, value in enumerate(ids):
        if value in first:
            raise ValueError(f"{name}: {value!r} is given twice (positions {first[value]} and {position}); each query "
                             "needs its own id, else its results would replace the other's")
        first[value] = position


def text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line number, line without its newline)`` for every line of a UTF-8 file (a BOM is dropped).

    A byte sequence that is not UTF-8 raises InputError naming the file, line and byte offset within the line.
    """
    with open(path, "rb") as handle:
        yield from decoded_lines(handle, path)


def decoded_lines(handle: Iterable[bytes], source: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """:func:`text_lines` over an open binary stream (a file, a zip member); errors name ``source``."""
    for number, raw in enumerate(handle, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"{source}, line {number}: not UTF-8 (byte 0x{raw[error.start]:02x} at column "
                             f"{error.start + 1})") from None
        if number == 1 and line.startswith("\ufeff"):
            line = line[1:]
        yield number, line.rstrip("\r\n")


def json_records(lines: Iterable[tuple[int, str]], source: str | os.PathLike,
                 error: type[ValueError] = InputError) -> Iterator[tuple[int, dict]]:
    """``(line number, JSON object)`` for every non-blank line of a JSONL stream (from :func:`text_lines` or
    :func:`decoded_lines`); a line that is not a JSON object raises ``error`` naming ``source`` and the line."""
    for number, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise error(f"{source}, line {number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise error(f"{source}, line {number}: expected a JSON object")
        yield number, record


class OutputPathError(ValueError):
    """An output path that can't be written (a folder, under a file, in a read-only folder)."""


def check_output_path(path: str | os.PathLike) -> Path:
    """Check, before any work, that a file can be written at ``path``; its missing folders are created (as
    Pyserini's run writers do). OutputPathError names the path and the reason."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"output {path} is a folder; name a file")
    parent = path.parent
    blocker = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OutputPathError(f"output {path}: {blocker} is a file, not a folder")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputPathError(f"output {path}: can't create its folder {parent} ({error.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"output {path}: its folder {parent} is not writable")
    probe = parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.probe"
    try:  # the folder may refuse new files all the same (/proc, a read-only mount when run as root)
        probe.touch(exist_ok=False)
    except OSError as error:
        raise OutputPathError(f"output {path}: can't create a file in its folder {parent} ({error.strerror})") from None
    probe.unlink()
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """The path of a temporary file next to ``path`` (not created) that replaces ``path`` when the block ends
    cleanly, for writers that open their file themselves.

    On any error (or Ctrl-C) the temporary file is removed and ``path`` is left as it was: readers never see a
    partial file under the final name.
    """
    path = check_output_path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield temporary
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """A handle on a temporary file next to ``path`` that replaces ``path`` when the block ends cleanly (see
    :func:`atomic_path`). ``mode``: "w" (UTF-8 text) or "wb"."""
    with atomic_path(path) as temporary, \
            open(temporary, mode.replace("w", "x"), **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
        yield handle


def discard_output(path: str | os.PathLike | None) -> bool:
    """Remove the file at ``path`` (a failed command's earlier output, which must not pass for this run's);
    folders and missing paths are left alone. True when a file was removed."""
    if path is None:
        return False
    path = Path(path)
    if path.is_file() or path.is_symlink():
        path.unlink()
        return True
    return False

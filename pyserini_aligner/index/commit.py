"""The commit protocol of an index folder: how a writer changes an index so that a reader sees the old or the new
state, never a mix (layout: :mod:`.format`).

A writer takes the folder's lock (:class:`IndexLock`, ``write.lock``), writes new segment and codec folders under
fresh names (:func:`new_name`), then commits by writing ``manifest.json`` atomically (:func:`write_manifest`:
temporary file, fsync, rename, fsync of the folder) and removes what the new manifest no longer references
(:func:`remove_unreferenced`). A new index is built in a temporary folder beside the target, renamed into place
(:func:`write_index`, with Ctrl-C and SIGTERM held while the temporary folder is made so that none is left behind);
an existing one gets a new generation inside it. Nothing else in the package takes the lock, renames a commit into
place or deletes files of an index.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from pyserini_aligner.index import faults
from pyserini_aligner.index.format import LOCK, MANIFEST, Manifest, is_index, read_manifest
from pyserini_aligner.index.io import atomic_write, fsync_dir
from pyserini_aligner.strategy import Strategy, as_strategy

_OWNED = re.compile(r"^(seg-\d+-[0-9a-f]+|codec-\d+(-[0-9a-f]+)?|\.tmp-.*|\.manifest\..*)$")  # names this package creates
_V1_FILES = ("doc_vectors.f16", "doc_salience.f32", "kept.bool", "faiss_ids.i64", "faiss.index", "doc_offsets.i64",
             "docids.txt", "token_centroids.u16", "token_residuals.u8", "kept.bits", "codec_centroids.i8",
             "codec_scales.f32", "codec_codebooks.f32")  # files of format 1, removed when it is overwritten


class IndexLock:
    """Exclusive write lock of an index folder (``write.lock``, flock); readers never take it."""

    def __init__(self, index_dir: str | os.PathLike):
        self.path = Path(index_dir) / LOCK
        self.handle = None

    def __enter__(self) -> "IndexLock":
        if not os.access(self.path.parent, os.W_OK):
            raise PermissionError(f"index {self.path.parent} is read-only: cannot update it")
        self.handle = open(self.path, "a")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.close()
            raise RuntimeError(f"index {self.path.parent} is being updated by another process") from None
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        self.handle.close()


def write_manifest(index_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Commit ``manifest`` (atomic: temporary file, fsync, rename, fsync of the folder)."""
    if not manifest.created:
        manifest.created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    atomic_write(Path(index_dir) / MANIFEST, manifest.to_json())


def set_default_strategy(index_dir: str | os.PathLike, strategy: Strategy | str) -> Manifest:
    """Record ``strategy`` (a Strategy, or its string: a public entry point) as the index's default alignment
    strategy; returns the manifest. When it is the default already, nothing is written (no new generation)."""
    strategy = as_strategy(strategy)
    with IndexLock(index_dir):
        manifest = read_manifest(index_dir)
        if strategy != manifest.default_strategy:
            manifest.default_strategy = strategy
            manifest.generation += 1
            write_manifest(index_dir, manifest)
    return manifest


def commit(index_dir: str | os.PathLike, manifest: Manifest) -> Manifest:
    """Under the lock: write ``manifest`` as the index's new commit, then remove what it no longer references."""
    write_manifest(index_dir, manifest)
    remove_unreferenced(index_dir, manifest)
    return manifest


def new_name(prefix: str, generation: int) -> str:
    """A fresh name for a segment or codec folder of ``generation``."""
    return f"{prefix}-{generation:06d}-{secrets.token_hex(4)}"


def remove_unreferenced(index_dir: str | os.PathLike, manifest: Manifest) -> list[str]:
    """Delete what this package left in ``index_dir`` that ``manifest`` does not reference (folders of segments and
    codecs, stale tombstones, temporary files of an interrupted write); never anything else. Call under the lock."""
    root = Path(index_dir)
    live = {s.name for s in manifest.segments} | ({manifest.codec_dir} if manifest.codec_dir else set())
    removed = []
    for path in root.iterdir():
        if path.name in live or not _OWNED.match(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    for seg in manifest.segments:
        for path in (root / seg.name).glob("deletes-*.bits"):
            if path.name != seg.deletes:
                path.unlink(missing_ok=True)
                removed.append(f"{seg.name}/{path.name}")
    return removed


def check_target(target: Path, overwrite: bool, corpus_path: str | os.PathLike | None = None) -> None:
    """Refuse a target that would lose a user's data: an existing non-empty folder that is not an index of this
    package (even with ``overwrite``), an index without ``overwrite``, a path under a file, or a folder that holds,
    equals or lies inside the corpus being indexed."""
    for parent in target.parents:
        if parent.exists() and not parent.is_dir():
            raise NotADirectoryError(f"index path {target}: {parent} is a file, not a folder")
    if corpus_path is not None and Path(corpus_path).exists():
        corpus = Path(corpus_path).resolve()
        resolved = target.resolve()
        if resolved == corpus or corpus.is_relative_to(resolved) or resolved.is_relative_to(corpus):
            raise ValueError(f"index path {target} holds, equals or lies inside the corpus {corpus_path}; "
                             "choose an index folder apart from the corpus")
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"index target {target} is a file")
    if not any(target.iterdir()):
        return
    if not is_index(target):
        raise FileExistsError(f"index target {target} exists and is not a pyserini-aligner index; it is never "
                              "replaced (choose a new folder)")
    if not overwrite:
        raise FileExistsError(f"index target exists: {target} (pass overwrite=True / --overwrite to replace it)")


def _remove_stale_work(target: Path) -> None:
    """Remove ``.<name>.building-*`` folders of builds into ``target`` whose process is gone (lock not held)."""
    for work in target.parent.glob(f".{target.name}.building-*"):
        lock = work / LOCK
        try:
            handle = open(lock, "a") if work.is_dir() else None
        except OSError:
            continue
        if handle is None:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        shutil.rmtree(work, ignore_errors=True)
        handle.close()


def write_index(target: Path, overwrite: bool, corpus_path, write: Callable[[Path, int], Manifest]) -> \
        Manifest:
    """Run ``write(root, generation) -> Manifest`` (which writes codec and segment folders under ``root``) and commit
    its manifest: into a temporary folder renamed to ``target`` for a new index, or as a new generation inside an
    existing index (``overwrite``). Nothing is left behind on failure."""
    check_target(target, overwrite, corpus_path)
    if target.exists() and any(target.iterdir()):
        with IndexLock(target):
            generation = _current_generation(target) + 1
            _clean_orphans(target)
            try:
                manifest = write(target, generation)
                manifest.generation = generation
                write_manifest(target, manifest)
            except BaseException:
                _clean_orphans(target)
                raise
            remove_unreferenced(target, manifest)
            for name in _V1_FILES:
                (target / name).unlink(missing_ok=True)
        return manifest
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_work(target)
    held = _hold_signals()
    try:
        try:
            work = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
        except OSError as error:  # named by the user's path, not the hidden build folder's
            raise OSError(f"index path {target}: can't create a folder in {target.parent} "
                          f"({error.strerror or error})") from None
        faults.point("work-folder-made")
    except BaseException:
        _release_signals(held)
        raise
    try:
        _release_signals(held)  # Ctrl-C while the folder was made is raised here, where the folder is removed
        lock = open(work / LOCK, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            manifest = write(work, 1)
            manifest.generation = 1
            write_manifest(work, manifest)
            work.chmod(0o755)
            faults.point("before-rename")
            check_target(target, False, corpus_path)
            if target.exists():
                target.rmdir()  # an empty folder the user made for the index
            os.replace(work, target)
            fsync_dir(target.parent)
        finally:
            lock.close()
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _hold_signals() -> tuple[dict, list]:
    """Hold SIGINT and SIGTERM (those with Python-level handlers; only the main thread can) until
    :func:`_release_signals`: ({signal: its handler}, the signals that arrived meanwhile)."""
    handlers: dict = {}
    came: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for number in _HELD_SIGNALS:
            if signal.getsignal(number) is not None:
                handlers[number] = signal.signal(number, lambda caught, _frame: came.append(caught))
    return handlers, came


def _release_signals(held: tuple[dict, list]) -> None:
    """Put the handlers of :func:`_hold_signals` back and raise each signal that arrived meanwhile again, so its
    handler runs now (Ctrl-C: KeyboardInterrupt)."""
    handlers, came = held
    for number, handler in handlers.items():
        signal.signal(number, handler)
    for number in dict.fromkeys(came):
        signal.raise_signal(number)


def _current_generation(target: Path) -> int:
    try:
        return int(json.loads((target / MANIFEST).read_text(encoding="utf-8")).get("generation", 1))
    except (OSError, ValueError, TypeError):
        return 1


def _clean_orphans(target: Path) -> None:
    """Under the lock: remove what an interrupted write left in ``target`` (unreferenced segments and codecs)."""
    try:
        manifest = read_manifest(target)
    except (OSError, ValueError):
        return  # an older format: its files are replaced at the end of the overwrite
    remove_unreferenced(target, manifest)

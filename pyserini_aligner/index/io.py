"""Durable file writes of an index: atomic replacement, folder fsync, and the size and CRC32 record of a file."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pyserini_aligner.index import checksums, faults


def file_record(path: Path) -> dict:
    """{"bytes": size, "crc32": CRC32} of a file, read in 16 MiB blocks (with its block CRC32s past one block)."""
    sums = checksums.BlockCrc()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            sums.update(block)
    return sums.record()


def fsync_dir(path: Path) -> None:
    """Make a rename or new entry in folder ``path`` durable."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never a part."""
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        faults.point("before-commit")
        os.replace(tmp, path)
        fsync_dir(path.parent)
        faults.point("after-commit")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

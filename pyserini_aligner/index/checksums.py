"""Block checksums of index files: the CRC32 of every 1 MiB block, recorded when a file is written and checked when
a reader opens the file, so that corruption of a large (memory-mapped) file fails the open instead of changing a
ranking.

A file record in the manifest is ``{"bytes": size, "crc32": CRC32 of the whole file}``; a file larger than one block
also carries ``"blocks": {"bytes": block size, "crc32": [CRC32 of each block]}``. Files written before block
checksums have no ``"blocks"`` and open unverified (``--verify`` still checks their whole-file CRC32). A file that
passed is remembered by (path, device, inode, size, modification time) for the life of the process, so reopening an
index (a live searcher after each commit) checks only the files it has not seen.
"""
from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = 1 << 20  # bytes per checksummed block
_THREADS = min(8, os.cpu_count() or 1)  # zlib.crc32 releases the GIL: blocks are checked in parallel
_verified: set[tuple] = set()
_lock = threading.Lock()


class BlockCrc:
    """Running CRC32 of a byte stream and of each of its ``block``-byte blocks, fed in pieces of any size."""

    def __init__(self, block: int = BLOCK):
        self.block, self.size, self.crc = block, 0, 0
        self.blocks: list[int] = []
        self._block_crc, self._fill = 0, 0

    def update(self, data) -> None:
        """Add ``data`` (bytes or any C-contiguous buffer) to the stream."""
        view = memoryview(data).cast("B")
        self.crc, self.size = zlib.crc32(view, self.crc), self.size + len(view)
        while len(view):
            take = min(len(view), self.block - self._fill)
            self._block_crc, self._fill = zlib.crc32(view[:take], self._block_crc), self._fill + take
            view = view[take:]
            if self._fill == self.block:
                self.blocks.append(self._block_crc)
                self._block_crc, self._fill = 0, 0

    def record(self) -> dict:
        """The manifest record of the stream so far: size, CRC32 and, past one block, the block CRC32s."""
        record = {"bytes": self.size, "crc32": self.crc}
        blocks = self.blocks + ([self._block_crc] if self._fill else [])
        if len(blocks) > 1:
            record["blocks"] = {"bytes": self.block, "crc32": blocks}
        return record


def bad_block(path: Path, record: dict) -> str | None:
    """Check ``path`` block by block against ``record["blocks"]``: what is wrong with it (the first bad block's
    byte range), or None when every block matches or the record has no blocks (a file written before block
    checksums, left unverified)."""
    blocks = record.get("blocks")
    if not blocks:
        return None
    stat = os.stat(path)
    key = (str(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key in _verified:
        return None
    size, expected = blocks.get("bytes"), blocks.get("crc32")
    if not isinstance(size, int) or size <= 0 or not isinstance(expected, list) \
            or len(expected) != -(-stat.st_size // size):
        return f"the manifest's block checksums do not fit a file of {stat.st_size} bytes"
    fd = os.open(path, os.O_RDONLY)
    try:
        def matches(number: int) -> bool:
            return zlib.crc32(os.pread(fd, size, number * size)) == expected[number]

        with ThreadPoolExecutor(min(_THREADS, len(expected))) as pool:
            good = list(pool.map(matches, range(len(expected))))
    finally:
        os.close(fd)
    if not all(good):
        start = good.index(False) * size
        return f"checksum mismatch in bytes {start}-{min(start + size, stat.st_size)}"
    with _lock:
        _verified.add(key)
    return None

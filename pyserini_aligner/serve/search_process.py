"""An AligneR index searched in a process of its own, for a server.

In the server's process, the searches would share one interpreter lock with the request handling: every torch call of
a search gives the lock away, and a busy request thread keeps it for up to the switch interval (5 ms) before the
search gets it back, so under load a batch waits far longer for the lock than for the device. The server's
:class:`SearchProcess` starts ``python -m pyserini_aligner.serve.search_process READ_FD WRITE_FD``, which opens the
index and answers one request at a time over two pipes (pickled frames: an 8-byte length, then the pickle); between two
requests the index may be reopened or its settings changed, so a batch always runs on one generation and one setting.
The child exits when the server closes its end (or dies).
"""
from __future__ import annotations

import gc
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, BinaryIO

_HEADER = struct.Struct("<Q")
_READ_BUFFER = 1 << 20  # bytes a pipe read asks for


class SearchProcessError(RuntimeError):
    """The search process died or could not be started; the message says how."""


def _write(fd: int, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read(reader: BinaryIO) -> Any:
    """The next message from ``reader`` (buffered: a whole reply usually arrives in one system call, so the reading
    thread gives the interpreter lock away once); EOFError when the other side closed the pipe."""
    header = reader.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    size = _HEADER.unpack(header)[0]
    data = reader.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def _reader(fd: int) -> BinaryIO:
    return os.fdopen(fd, "rb", buffering=_READ_BUFFER)


def index_info(searcher) -> dict[str, Any]:
    """What a server reports of the index ``searcher`` has open: documents, generation, segments, codec, model,
    bytes on disk, device, alignment strategy and depth (documents refined per query)."""
    manifest = searcher.manifest
    size = sum(record["bytes"] for info in manifest.segments for record in info.files.values())
    size += sum(record["bytes"] for record in manifest.codec_files.values())
    return {"documents": searcher.num_docs, "generation": manifest.generation, "segments": len(manifest.segments),
            "codec": manifest.codec, "model": manifest.model_name, "size_bytes": size, "device": searcher.device,
            "strategy": str(searcher.strategy), "depth": searcher.max_candidates}


class _Child:
    """The child's side: the searcher and the operations the server asks for."""

    def __init__(self, path: str, device: str, batch_size: int):
        import torch

        from pyserini_aligner.search.searcher import AlignerSearcher

        where = torch.device(device)
        if where.type == "cuda" and where.index is not None:
            torch.cuda.set_device(where)
        self.searcher = AlignerSearcher(path, device=device, batch_size=batch_size)

    def search(self, queries: list[str], k: int) -> list[list[tuple[str, float]]]:
        ids = [str(i) for i in range(len(queries))]
        found = self.searcher.batch_search(queries, ids, k=k)
        return [[(hit.docid, float(hit.score)) for hit in found[i]] for i in ids]

    def reopen(self) -> dict[str, Any]:
        self.searcher.reopen()
        return index_info(self.searcher)

    def update(self, depth: int | None, strategy: str | None) -> dict[str, Any]:
        searcher = self.searcher
        if depth is not None:
            searcher.max_candidates = depth
        if strategy is not None and strategy != str(searcher.strategy):
            searcher._strategy_arg = strategy
            searcher._load(searcher.store, None)  # the engines (and a captured GPU plan) on the new strategy
        return index_info(searcher)

    def info(self) -> dict[str, Any]:
        return index_info(self.searcher)


def _serve(read_fd: int, write_fd: int) -> None:
    """Answer the server's requests until it closes the pipe: ("open", path, device, batch_size) first, then
    ("search", queries, k), ("reopen",), ("update", depth, strategy) or ("info",); each reply is ("ok", value) or
    ("error", "value" | "os" | "other", the first line of the exception)."""
    child, reader = None, _reader(read_fd)
    while True:
        try:
            operation, *arguments = _read(reader)
        except EOFError:
            return
        try:
            if operation == "open":
                child = _Child(*arguments)
                value = child.info()
                gc.collect()
                gc.freeze()  # the model and the index stay out of later collections (no pauses between batches)
            else:
                value = getattr(child, operation)(*arguments)
            reply = ("ok", value)
        except Exception as error:  # noqa: BLE001 - every failure goes back to the server, which decides
            kind = "value" if isinstance(error, ValueError) else "os" if isinstance(error, OSError) else "other"
            text = str(error).strip()
            reply = ("error", kind, text.splitlines()[0] if text else type(error).__name__)
        _write(write_fd, reply)


class SearchProcess:
    """The server's side: one child process searching the index at ``path`` on ``device``; calls from any thread
    (one at a time). A child that dies fails the call in flight with :class:`SearchProcessError` and is started
    again for the next one."""

    def __init__(self, path: str, device: str, batch_size: int):
        self._open = (str(path), device, batch_size)
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._to_child, self._from_child = -1, None
        with self._lock:
            self.info = self._start()

    def _start(self) -> dict[str, Any]:
        child_read, to_child = os.pipe()
        from_child, child_write = os.pipe()
        self._to_child, self._from_child = to_child, _reader(from_child)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(child_read), str(child_write)], pass_fds=(child_read, child_write),
                stdin=subprocess.DEVNULL, stdout=2)  # its output goes to the server's log, never to an MCP stdio pipe
        except OSError:
            self._process = None
            self._stop()
            raise
        finally:
            os.close(child_read)
            os.close(child_write)
        try:
            return self._ask("open", *self._open)
        except Exception:
            self._stop()
            raise

    def _stop(self) -> None:
        if self._to_child >= 0:
            os.close(self._to_child)
        if self._from_child is not None:
            self._from_child.close()
        self._to_child, self._from_child = -1, None
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _ask(self, *request: Any) -> Any:
        try:
            _write(self._to_child, request)
            reply = _read(self._from_child)
        except (EOFError, OSError):
            self._stop()
            code = self._process.returncode if self._process is not None else None
            raise SearchProcessError(f"the search process of {self._open[0]} exited (code {code})") from None
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        raise {"value": ValueError, "os": OSError}.get(kind, RuntimeError)(message)

    def call(self, operation: str, *arguments: Any) -> Any:
        """The child's answer to ``operation`` (``search``, ``reopen``, ``update`` or ``info``); its exception (as
        ValueError, OSError or RuntimeError, message kept) if it raised one."""
        with self._lock:
            if self._to_child < 0:
                self.info = self._start()
            value = self._ask(operation, *arguments)
            if isinstance(value, dict):
                self.info = value
            return value

    def search(self, queries: list[str], k: int) -> list[list[tuple[str, float]]]:
        """(docid, score) of the top ``k`` of each query, best first, as ``AlignerSearcher.batch_search``."""
        return self.call("search", queries, k)

    def close(self) -> None:
        """Close the pipes; the child exits."""
        with self._lock:
            self._stop()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))

"""An AligneR index searched in a process of its own, for one server or several HTTP worker processes.

In the server's process, the searches would share one interpreter lock with the request handling: every torch call of
a search gives the lock away, and a busy request thread keeps it for up to the switch interval before the search gets
it back. :class:`SearchProcess` starts ``python -m pyserini_aligner.serve.search_process FD [LISTEN_FD]``, which
opens the index and answers requests over Unix sockets (pickled frames: an 8-byte length, then the pickle): the
owner's socket pair and, with ``listen``, the connections of other processes (:class:`SearchClient`: HTTP workers of
``--workers``, a few connections each). Each connection has one request in flight. The searches that arrived while
the process was busy, from every connection, are searched together as one batch per ``k`` and filter; other requests
(reopen, update, info, docids) run first, between batches, so a batch always runs on one generation and one setting.
Every reply carries the index's current information, so each connection sees settings and generations changed through
another.
The process exits when its owner closes its end (or dies).
"""
from __future__ import annotations

import gc
import os
import pickle
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from pyserini_aligner.filters import Filter

_HEADER = struct.Struct("<Q")
_READ_BUFFER = 1 << 20  # bytes a socket read asks for
ACTIVE_S = 2.0  # a connection whose search was answered this recently is waited for by the next batch


class SearchProcessError(RuntimeError):
    """The search process died, could not be started or cannot be reached; the message says how."""


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _read(reader: BinaryIO) -> Any:
    """The next message from ``reader`` (buffered: a whole reply usually arrives in one system call, so the reading
    thread gives the interpreter lock away once); EOFError when the other side closed."""
    header = reader.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    size = _HEADER.unpack(header)[0]
    data = reader.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def split_frames(buffer: bytearray) -> list[Any]:
    """The complete messages at the front of ``buffer``, removed from it (a partial one stays)."""
    messages, start = [], 0
    while len(buffer) - start >= _HEADER.size:
        size = _HEADER.unpack_from(buffer, start)[0]
        if len(buffer) - start - _HEADER.size < size:
            break
        messages.append(pickle.loads(buffer[start + _HEADER.size:start + _HEADER.size + size]))
        start += _HEADER.size + size
    del buffer[:start]
    return messages


def index_info(searcher) -> dict[str, Any]:
    """What a server reports of the index ``searcher`` has open: documents, generation, segments, codec, model,
    bytes on disk, device, alignment strategy and depth (documents refined per query)."""
    manifest = searcher.manifest
    size = sum(record["bytes"] for info in manifest.segments for record in info.files.values())
    size += sum(record["bytes"] for record in manifest.codec_files.values())
    return {"documents": searcher.num_docs, "generation": manifest.generation, "segments": len(manifest.segments),
            "codec": str(manifest.codec), "model": manifest.model_name, "size_bytes": size, "device": searcher.device,
            "strategy": str(searcher.strategy), "depth": searcher.max_candidates}


class _Child:
    """The child's side: the searcher, the operations the server asks for, and counts of the batches searched."""

    def __init__(self, path: str, device: str, batch_size: int):
        import torch

        from pyserini_aligner.search.searcher import AlignerSearcher

        where = torch.device(device)
        if where.type == "cuda" and where.index is not None:
            torch.cuda.set_device(where)
        self.searcher = AlignerSearcher(path, device=device, batch_size=batch_size)
        self.batches = self.queries = 0
        self._info = index_info(self.searcher)

    def search(self, queries: list[str], k: int, flt: Filter | None = None) -> list[list[tuple[str, float]]]:
        found = self.searcher.rank(queries, k=k, filter=flt)
        self.batches, self.queries = self.batches + 1, self.queries + len(queries)
        return found

    def docids(self, flt: Filter) -> list[str]:
        """The docids of the live documents that filter ``flt`` matches (the BM25 side of a filtered hybrid)."""
        from pyserini_aligner.bm25 import filtered_docids

        return filtered_docids(flt, self.searcher.store)

    def reopen(self) -> None:
        self.searcher.reopen()
        self._info = index_info(self.searcher)

    def update(self, depth: int | None, strategy) -> None:
        """Search with ``depth`` documents refined per query and the alignment ``strategy`` (a Strategy), each
        where given (a new strategy reopens the backend, and a captured GPU plan, on the open generation)."""
        changes = {"max_candidates": depth, "strategy": strategy}
        self.searcher.configure(**{name: value for name, value in changes.items() if value is not None})
        self._info = index_info(self.searcher)

    def info(self) -> dict[str, Any]:
        return {**self._info, "batches": self.batches, "batched_queries": self.queries}


def _failure(error: Exception) -> tuple[str, str]:
    from pyserini_aligner.filters import FilterError

    kind = ("filter" if isinstance(error, FilterError) else "value" if isinstance(error, ValueError)
            else "os" if isinstance(error, OSError) else "other")
    text = str(error).strip()
    return kind, text.splitlines()[0] if text else type(error).__name__


class _Service:
    """The child's loop: read what every connection sent, answer it, repeat."""

    def __init__(self, owner: socket.socket, listener: socket.socket | None, gather_s: float = 0.0):
        self.owner, self.listener, self.child, self.gather_s = owner, listener, None, gather_s
        self.searched: dict[socket.socket, float] = {}  # connection -> when its last search was answered
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytearray] = {}
        self._add(owner)
        if listener is not None:
            self.selector.register(listener, selectors.EVENT_READ)

    def _add(self, conn: socket.socket) -> None:
        self.buffers[conn] = bytearray()
        self.selector.register(conn, selectors.EVENT_READ)

    def _drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        del self.buffers[conn]
        self.searched.pop(conn, None)
        conn.close()

    def run(self) -> None:
        """Serve until the owner's connection closes. What arrived while a batch ran is answered as soon as it ends.
        With ``gather_s``, a search that finds the process idle waits up to that long for the searches of the
        connections that searched in the last ACTIVE_S seconds and have none pending yet, so that at a moderate load
        their queries share a device batch; a lone client waits for nobody."""
        while True:
            pending = self.receive(0)
            if pending is None:
                return
            if pending:
                self.answer(pending)
                continue
            pending = self.receive(None)
            if pending is None:
                return
            deadline = time.monotonic() + self.gather_s
            while self.gather_s > 0 and any(message[0] == "search" for _, message in pending):
                asking, now = {conn for conn, _ in pending}, time.monotonic()
                remaining = deadline - now
                if remaining <= 0 or all(conn in asking for conn, last in self.searched.items()
                                         if now - last <= ACTIVE_S):
                    break
                more = self.receive(remaining)
                if more is None:
                    return
                pending += more
            self.answer(pending)

    def receive(self, timeout: float | None) -> list[tuple[socket.socket, tuple]] | None:
        """The messages that arrive within ``timeout`` seconds (None: wait for some), with their connections; None
        when the owner's connection closed."""
        pending = []
        for key, _ in self.selector.select(timeout):
            conn = key.fileobj
            if conn is self.listener:
                if self.child is not None:  # others connect once the index is open
                    self._add(self.listener.accept()[0])
                continue
            try:
                data = conn.recv(_READ_BUFFER)
            except OSError:
                data = b""
            if not data:
                if conn is self.owner:
                    return None
                self._drop(conn)
                continue
            self.buffers[conn] += data
            pending += [(conn, message) for message in split_frames(self.buffers[conn])]
        return pending

    def answer(self, pending: list[tuple[socket.socket, tuple]]) -> None:
        """Requests other than searches first, in the order received; then the searches, one batch per k and filter
        (equal filters share one)."""
        batches: list[tuple[int, Any, list[tuple[socket.socket, list[str]]]]] = []
        for conn, (operation, *arguments) in pending:
            if operation == "search":
                queries, k, flt = arguments
                batch = next((b for b in batches if b[0] == k and b[1] == flt), None)
                if batch is None:
                    batches.append((k, flt, [(conn, queries)]))
                else:
                    batch[2].append((conn, queries))
                continue
            try:
                result = None
                if operation == "open":
                    self.child = _Child(*arguments)
                    gc.collect()
                    gc.freeze()  # the model and the index stay out of later collections (no pauses between batches)
                elif operation in ("reopen", "update", "docids"):
                    result = getattr(self.child, operation)(*arguments)
                elif operation != "info":
                    raise ValueError(f"unknown operation {operation!r}")
                reply = ("ok", result)
            except Exception as error:  # noqa: BLE001 - every failure goes back to the caller, which decides
                reply = ("error", *_failure(error))
            self.send(conn, reply)
        for k, flt, asked in batches:
            texts = [text for _, queries in asked for text in queries]
            try:
                found = self.child.search(texts, k, flt)
            except Exception as error:  # noqa: BLE001 - the batch's error goes to every caller in it
                for conn, _ in asked:
                    self.send(conn, ("error", *_failure(error)))
                continue
            start, now = 0, time.monotonic()
            for conn, queries in asked:
                self.searched[conn] = now
                self.send(conn, ("ok", found[start:start + len(queries)]))
                start += len(queries)

    def send(self, conn: socket.socket, reply: tuple) -> None:
        """``reply`` with the index's information appended; a connection that went away is dropped."""
        info = self.child.info() if self.child is not None else None
        try:
            conn.sendall(_frame((*reply, info)))
        except OSError:
            if conn is not self.owner and conn in self.buffers:
                self._drop(conn)


class _Connection:
    """A connection to a search process: calls from any thread, one at a time; ``info`` is what the last reply said
    of the index."""

    info: dict[str, Any]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader: BinaryIO | None = None

    def _attach(self, sock: socket.socket) -> None:
        self._sock, self._reader = sock, sock.makefile("rb", buffering=_READ_BUFFER)

    def _detach(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None

    def _connect(self) -> None:
        raise NotImplementedError

    def _lost(self) -> SearchProcessError:
        raise NotImplementedError

    def _ask(self, *request: Any) -> Any:
        try:
            self._sock.sendall(_frame(request))
            reply = _read(self._reader)
        except (EOFError, OSError):
            raise self._lost() from None
        if reply[-1] is not None:
            self.info = reply[-1]
        if reply[0] == "ok":
            return reply[1]
        _, kind, message, _ = reply
        from pyserini_aligner.filters import FilterError

        raise {"filter": FilterError, "value": ValueError, "os": OSError}.get(kind, RuntimeError)(message)

    def call(self, operation: str, *arguments: Any) -> Any:
        """The search process's answer to ``operation`` (``search``, ``docids`` (of a filter), ``reopen``, ``update``
        or ``info``; the last three answer None; every answer refreshes ``info``); its exception (as FilterError,
        ValueError, OSError or RuntimeError, message kept) if it raised one."""
        with self._lock:
            if self._sock is None:
                self._connect()
            return self._ask(operation, *arguments)

    def search(self, queries: list[str], k: int, flt: Filter | None = None) -> list[list[tuple[str, float]]]:
        """(docid, score) of the top ``k`` of each query among the documents filter ``flt`` matches (all without
        one), best first, as ``AlignerSearcher.rank``."""
        return self.call("search", queries, k, flt)

    def close(self) -> None:
        with self._lock:
            self._detach()


class SearchProcess(_Connection):
    """The owner's side: one child process searching the index at ``path`` on ``device`` (batches of at most
    ``batch_size`` queries on the device); with ``listen``, it also answers :class:`SearchClient` connections at that
    Unix socket path, a search waiting up to ``gather_ms`` for theirs. A child that dies fails the calls in flight
    with :class:`SearchProcessError` and is started again for the owner's next call (listening again at the same
    path)."""

    def __init__(self, path: str, device: str, batch_size: int, listen: str | None = None, gather_ms: float = 0.0):
        super().__init__()
        self._open, self._gather_ms = (str(path), device, batch_size), gather_ms
        self._process: subprocess.Popen | None = None
        self._listener, self._closed = None, False
        if listen is not None:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(listen)
            self._listener.listen(64)
        try:
            with self._lock:
                self._connect()
        except BaseException:
            if self._listener is not None:
                self._listener.close()
            raise

    def _connect(self) -> None:
        if self._closed:
            raise SearchProcessError(f"the search process of {self._open[0]} was closed")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        passed = [theirs.fileno()] + ([self._listener.fileno()] if self._listener is not None else [])
        gather = [str(self._gather_ms)] if self._listener is not None else []
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, *map(str, passed), *gather], pass_fds=passed, stdin=subprocess.DEVNULL,
                stdout=2)  # its output goes to the server's log, never to an MCP stdio pipe
        except OSError:
            mine.close()
            self._process = None
            raise
        finally:
            theirs.close()
        self._attach(mine)
        try:
            self._ask("open", *self._open)
        except Exception:
            self._stop()
            raise

    def _stop(self) -> None:
        self._detach()
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _lost(self) -> SearchProcessError:
        self._stop()
        code = self._process.returncode if self._process is not None else None
        return SearchProcessError(f"the search process of {self._open[0]} exited (code {code})")

    def restart_on_exit(self, pause_s: float = 1.0) -> None:
        """Start the child again whenever it exits, without waiting for the owner's next call (other processes reach
        it through the listening socket); a start that fails is tried again after ``pause_s`` seconds."""
        def watch() -> None:
            while not self._closed:
                process = self._process
                if process is None:
                    time.sleep(pause_s)
                    continue
                process.wait()
                if self._closed:
                    return
                try:
                    self.call("info")
                except SearchProcessError:  # the dead child's connection, now closed: the next call starts one
                    pass
                except Exception:  # noqa: BLE001 - the index did not open: try again
                    time.sleep(pause_s)

        threading.Thread(target=watch, name="aligner-search-process", daemon=True).start()

    def close(self) -> None:
        """Close the connection (the child exits) and the listening socket."""
        self._closed = True
        with self._lock:
            self._stop()
            if self._listener is not None:
                self._listener.close()
                self._listener = None


class _ClientConnection(_Connection):
    """One connection to the search process listening at ``address``; connected again on the next call after the
    process went away."""

    def __init__(self, address: str):
        super().__init__()
        self.address = address

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.address)
        except OSError as error:
            sock.close()
            raise SearchProcessError(f"the search process at {self.address} cannot be reached: {error}") from None
        self._attach(sock)

    def _lost(self) -> SearchProcessError:
        self._detach()
        return SearchProcessError(f"the search process at {self.address} went away")


class SearchClient:
    """Calls to the search process of another process's :class:`SearchProcess` listening at ``address`` (a Unix
    socket path), from any number of threads at once: each call takes an idle connection or opens one, so calls
    overlap and the search process merges them. ``info`` is what the last reply said of the index."""

    info: dict[str, Any]

    def __init__(self, address: str):
        self.address = address
        self._lock = threading.Lock()
        self._idle: list[_ClientConnection] = []
        self.call("info")

    def call(self, operation: str, *arguments: Any) -> Any:
        """As :meth:`_Connection.call`, on a connection no other call uses meanwhile."""
        with self._lock:
            connection = self._idle.pop() if self._idle else _ClientConnection(self.address)
        try:
            result = connection.call(operation, *arguments)
            self.info = connection.info
            return result
        finally:
            with self._lock:
                self._idle.append(connection)  # the most recent first: a lone caller keeps using one connection

    def search(self, queries: list[str], k: int, flt: Filter | None = None) -> list[list[tuple[str, float]]]:
        """(docid, score) of the top ``k`` of each query among the documents filter ``flt`` matches (all without
        one), best first, as ``AlignerSearcher.rank``."""
        return self.call("search", queries, k, flt)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


def _serve(owner_fd: int, listen_fd: int | None, gather_ms: float) -> None:
    owner = socket.socket(fileno=owner_fd)
    listener = socket.socket(fileno=listen_fd) if listen_fd is not None else None
    _Service(owner, listener, gather_ms / 1000.0).run()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None,
           float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)

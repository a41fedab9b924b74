"""Gather concurrent single-query searches into batches for one worker thread.

Each caller's thread (a worker thread of the web server) submits its query and waits on a future; the batcher's own
thread takes the first query waiting, gathers those that arrive within ``wait_ms`` (at most ``max_batch``), runs
them as one batch per hit count and hands every caller its own hits. The event loop only ever awaits.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

SearchBatch = Callable[[list[str], int], Sequence[list]]  # (queries, k) -> hits per query, in order


@dataclasses.dataclass
class _Pending:
    query: str
    k: int
    future: Future


class QueryBatcher:
    """Run ``search_batch`` over batches of the queries submitted concurrently.

    A batch holds the queries waiting when the worker becomes free plus those arriving within ``wait_ms`` of the
    first one, up to ``max_batch``; queries asking for different numbers of hits are searched as separate batches
    (the depth of a search depends on it, so each answer is the one a search of that query alone gives).
    """

    def __init__(self, search_batch: SearchBatch, wait_ms: float, max_batch: int, name: str = "batcher"):
        if wait_ms < 0 or max_batch < 1:
            raise ValueError(f"wait_ms must be >= 0 and max_batch >= 1, got {wait_ms} and {max_batch}")
        self.search_batch, self.wait_s, self.max_batch = search_batch, wait_ms / 1000.0, max_batch
        self.batches = self.queries = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"aligner-{name}", daemon=True)
        self._thread.start()

    def submit(self, query: str, k: int) -> Future:
        """A future of the hits of ``query`` (top ``k``)."""
        future: Future = Future()
        self._queue.put(_Pending(query, k, future))
        return future

    def search(self, query: str, k: int) -> list:
        """The hits of ``query``, searched in the next batch (waits for it)."""
        return self.submit(query, k).result()

    def close(self) -> None:
        """Stop after the queries already submitted."""
        self._queue.put(None)
        self._thread.join()

    def _gather(self, first: _Pending) -> tuple[list[_Pending], bool]:
        batch, deadline = [first], time.monotonic() + self.wait_s
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            batch, stop = self._gather(first)
            by_k: dict[int, list[_Pending]] = {}
            for item in batch:
                if item.future.set_running_or_notify_cancel():
                    by_k.setdefault(item.k, []).append(item)
            for k, items in by_k.items():
                try:
                    found = self.search_batch([item.query for item in items], k)
                except BaseException as error:  # noqa: BLE001 - handed to every caller of the batch
                    for item in items:
                        item.future.set_exception(error)
                    continue
                self.batches, self.queries = self.batches + 1, self.queries + len(items)
                for item, hits in zip(items, found):
                    item.future.set_result(hits)

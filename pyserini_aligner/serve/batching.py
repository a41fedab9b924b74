"""Gather concurrent single-query searches into batches for one worker thread.

A caller submits its query and waits on a future: a thread (a worker thread of the web server) on a
``concurrent.futures.Future``, a coroutine on an asyncio future of its event loop. The batcher's own thread takes the
first query waiting with every query queued behind it and, while there is load (its last batch held more than one
query), those that arrive within ``wait_ms`` (at most ``max_batch``), so that a lone client never waits for company;
it runs them as one batch per hit count and filter and hands every caller its own hits: the asyncio futures of one
loop are all settled by one callback on that loop, so a batch wakes the loop once rather than once per query (each
wake-up makes the batcher's thread wait for the interpreter lock while the loop works). The event loop only ever awaits.

With ``in_flight`` above one, each batch is searched on a thread of its own (at most ``in_flight`` at once) and the
next is gathered at once, so a searcher that merges the batches it receives (a search process serving several
connections) sees every query waiting, not only those whose batch's turn came.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from pyserini_aligner.filters import Filter

SearchBatch = Callable[[list[str], int, "Filter | None"], Sequence[list]]  # (queries, k, filter) -> hits per query


@dataclasses.dataclass
class _Pending:
    query: str
    k: int
    filter: Filter | None
    future: Future | asyncio.Future
    loop: asyncio.AbstractEventLoop | None = None  # the loop of an asyncio future


def _settle(settled: list[tuple[asyncio.Future, list | None, BaseException | None]]) -> None:
    """Set asyncio futures on their loop: (future, hits, error) each; futures cancelled meanwhile are skipped."""
    for future, hits, error in settled:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(hits)


class QueryBatcher:
    """Run ``search_batch`` over batches of the queries submitted concurrently.

    A batch holds the queries waiting when one of ``in_flight`` batches may start plus, unless the batch before held
    a single query (a lone client's: nobody else is coming), those arriving within ``wait_ms`` of the first one, up
    to ``max_batch``; queries asking for different numbers of hits or with different
    filters are searched as separate batches (the depth of a search depends on the first, and one search call takes
    one filter, so each answer is the one a search of that query alone gives). ``search_batch`` is called from up to
    ``in_flight`` threads at once.
    """

    def __init__(self, search_batch: SearchBatch, wait_ms: float, max_batch: int, name: str = "batcher",
                 in_flight: int = 1):
        if wait_ms < 0 or max_batch < 1 or in_flight < 1:
            raise ValueError(f"wait_ms must be >= 0, max_batch and in_flight >= 1, got {wait_ms}, {max_batch} and "
                             f"{in_flight}")
        self.search_batch, self.wait_s, self.max_batch = search_batch, wait_ms / 1000.0, max_batch
        self.batches = self.queries = 0
        self._counted = threading.Lock()
        self.name, self.in_flight, self._slots = name, in_flight, threading.Semaphore(in_flight)
        self._closing, self._closed = threading.Lock(), False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loaded = True  # whether the last batch held more than one query (a batch waits for more only then)
        self._thread = threading.Thread(target=self._run, name=f"aligner-{name}", daemon=True)
        self._thread.start()

    def submit(self, query: str, k: int, flt: Filter | None = None) -> Future:
        """A future of the hits of ``query`` (top ``k`` of the documents filter ``flt`` matches; all without one)."""
        self._check_open()
        future: Future = Future()
        self._queue.put(_Pending(query, k, flt, future))
        return future

    def submit_async(self, query: str, k: int, flt: Filter | None = None) -> asyncio.Future:
        """An asyncio future (of the running event loop) of the hits of ``query`` (top ``k``, filter ``flt``)."""
        self._check_open()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put(_Pending(query, k, flt, future, loop))
        return future

    def search(self, query: str, k: int, flt: Filter | None = None) -> list:
        """The hits of ``query`` (top ``k``, filter ``flt``), searched in the next batch (waits for it)."""
        return self.submit(query, k, flt).result()

    def close(self) -> None:
        """Stop after the queries already submitted; later calls return at once."""
        with self._closing:
            if self._closed:
                return
            self._closed = True  # refuse new queries from now on
            self._queue.put(None)
            self._thread.join()
            for _ in range(self.in_flight):  # the batches in flight are answered
                self._slots.acquire()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.name} is closed")

    def _gather(self, first: _Pending) -> tuple[list[_Pending], bool]:
        batch, deadline = [first], time.monotonic() + (self.wait_s if self._loaded else 0.0)
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
            self._slots.acquire()  # a batch may start: gather what waits
            first = self._queue.get()
            if first is None:
                self._slots.release()
                return
            batch, stop = self._gather(first)
            self._loaded = len(batch) > 1
            if self.in_flight == 1:
                self._search(batch)
            else:
                threading.Thread(target=self._search, args=(batch,), name=f"aligner-{self.name}-batch",
                                 daemon=True).start()

    def _search(self, batch: list[_Pending]) -> None:
        """Search ``batch``, one search per hit count and filter, and answer its callers; frees the batch's slot."""
        try:
            groups: list[list[_Pending]] = []  # filters are compared by value (equal filters share a search)
            for item in batch:
                if item.loop is not None or item.future.set_running_or_notify_cancel():
                    group = next((g for g in groups if g[0].k == item.k and g[0].filter == item.filter), None)
                    if group is None:
                        groups.append([item])
                    else:
                        group.append(item)
            for items in groups:
                try:
                    found = self.search_batch([item.query for item in items], items[0].k, items[0].filter)
                except BaseException as error:  # noqa: BLE001 - handed to every caller of the batch
                    self._answer(items, [None] * len(items), error)
                    continue
                with self._counted:
                    self.batches, self.queries = self.batches + 1, self.queries + len(items)
                self._answer(items, list(found), None)
        finally:
            self._slots.release()

    @staticmethod
    def _answer(items: list[_Pending], found: list, error: BaseException | None) -> None:
        """Every caller its hits (or the batch's error): threads' futures here, asyncio futures by one callback on
        each loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for item, hits in zip(items, found):
            if item.loop is not None:
                by_loop.setdefault(item.loop, []).append((item.future, hits, error))
            elif error is not None:
                item.future.set_exception(error)
            else:
                item.future.set_result(hits)
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, settled)
            except RuntimeError:  # the loop closed: its callers are gone
                pass

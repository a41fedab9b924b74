"""Search on several devices of one machine, so that the devices work at once.

Placement "replicate": every device holds a whole copy of the codes. The first device is searched in this process
by a one-device searcher (:class:`~pyserini_aligner.search.searcher.AlignerSearcher`); every other device gets a worker
process (started with "spawn") holding such a searcher, with its own Python interpreter, so that no device waits on
another's kernel launches or host work. A batch of texts is split into consecutive parts (balanced by load,
:func:`text_parts`): the workers' parts are sent first, this process searches the first part meanwhile, and one
query is searched here alone (through the CUDA-graph plan), with no hand-over. A GPU worker's torch threads are its
share of the cores. Placement "shard": every device gets a worker process; the workers form a process group (NCCL
on GPUs, Gloo on CPUs), each holds consecutive segments, and all of them search every batch in lockstep as the ranks
of a torchrun job do (:class:`.exchanged.Exchanged`): each ranks the candidates it holds, the
best of all are kept and scored, and the first worker returns the ranking. Either way the ranking is the one a
single device computes over the whole index. The workers open the index generation the parent opened and are
stopped with the backend. A filtered search's rows (:class:`..allowed.AllowedRows`, resolved here) go to the workers
packed one bit a row.
"""
from __future__ import annotations

import os
import tempfile
import time
import weakref
from typing import Any, Sequence

from pyserini_aligner.search.allowed import AllowedRows
from pyserini_aligner.search.backends.base import Clock, no_clock
from pyserini_aligner.search.encoding import text_parts
from pyserini_aligner.search.options import Depth, SearchOptions

START_TIMEOUT_S = 1800.0  # seconds the workers may take to load the index
POLL_S = 1.0  # how often a waiting parent checks that its workers are still alive


def gpu_worker_threads(workers: int) -> int:
    """Torch threads of each of ``workers`` GPU worker processes: this process's usable cores shared among them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(workers, 1))


def _serve(conn, rank: int, world: int, device: str, placement: str, index_dir: str, searcher_class: type,
           encoder, options: SearchOptions, threads: int, group_file: str | None) -> None:
    """A worker's life: open the index on ``device`` (in the process group for "shard"), report ("ready",
    generation, rows held), then answer ("search", texts, k, threads, vectors, allowed rows packed or None) with
    ("ok", vectors or None, hits, seconds the search took here) until ("stop",) or the parent goes away, then leave
    the process group. Errors are reported as ("error", one line)."""
    try:
        import torch
        import torch.distributed as dist

        from pyserini_aligner.dist import Collectives, DistContext, join_group

        torch.set_num_threads(threads)
        exchange = None
        if device.startswith("cuda"):  # kernels (Triton's too) launch on the current device
            torch.cuda.set_device(torch.device(device))
        if placement == "shard":
            ctx, _ = join_group(DistContext(rank, world, rank), device=device, cuda_backend="nccl",
                                rendezvous=group_file, timeout_s=START_TIMEOUT_S)
            exchange = Collectives(ctx)
        searcher = searcher_class(index_dir, encoder, options.replace(device=device, backend="torch",
                                                                      exchange=exchange, placement=placement
                                                                      if exchange is not None else "auto"))
        conn.send(("ready", searcher.manifest.generation, searcher.num_rows))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", _one_line(err)))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if message[0] == "stop":
            break
        try:
            _, texts, k, threads, want_vectors, packed = message
            start = time.perf_counter()
            vectors, hits = searcher.search_texts(texts, k, threads, want_vectors,
                                                  None if packed is None else AllowedRows.unpack(packed))
            conn.send(("ok", vectors if want_vectors else None, hits if rank == 0 or placement != "shard" else None,
                       time.perf_counter() - start))
        except BaseException as err:  # noqa: BLE001
            conn.send(("error", _one_line(err)))
    if dist.is_initialized():  # a shard's process group, released before the interpreter exits
        dist.destroy_process_group()


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _stop(processes: list, conns: list, group_file: str | None) -> None:
    """Ask every worker to stop, end the ones that do not, and remove the process group's file."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
    for conn in conns:
        conn.close()
    if group_file is not None and os.path.exists(group_file):
        os.unlink(group_file)


class Workers:
    """The backend of several devices (see the module's text). index_dir: the index; generation: the one the parent
    opened (a worker that finds another refuses, so that rows mean the same documents); devices: the devices, the
    first one this process's with placement "replicate"; placement: "replicate" or "shard"; searcher_class: the
    searcher each device gets (AlignerSearcher), with ``encoder`` and the one-device ``options``. A front end
    (:class:`.base.FrontEnd`) of its own: the devices encode the texts."""

    has_interaction = True

    def __init__(self, index_dir: str | os.PathLike, generation: int, devices: Sequence[str], placement: str,
                 searcher_class: type, encoder, options: SearchOptions):
        import torch
        import torch.multiprocessing as mp

        if placement not in ("replicate", "shard"):
            raise ValueError(f"placement must be 'replicate' or 'shard' here, got {placement!r}")
        self.devices, self.placement = [str(d) for d in devices], placement
        self.device = torch.device(self.devices[0])
        # the devices of worker processes: every one for "shard", all but the first (searched here) for "replicate"
        self.worker_devices = self.devices if placement == "shard" else self.devices[1:]
        context = mp.get_context("spawn")
        group_file = None
        if placement == "shard":
            handle, group_file = tempfile.mkstemp(prefix="aligner-group-")
            os.close(handle)
            os.unlink(group_file)  # the process group's rendezvous file: created by its first member
        cpu_threads = torch.get_num_threads()  # the parent's: a CPU's vectors depend on its thread count
        self.processes, self.conns = [], []
        for rank, device in enumerate(self.worker_devices):
            parent, child = context.Pipe()
            # a GPU worker's host work (tokens, launches, small tensors) gets its share of the cores, so that the
            # workers' thread pools do not contend for them
            threads = cpu_threads if not device.startswith("cuda") else gpu_worker_threads(len(self.devices))
            process = context.Process(target=_serve, name=f"aligner-search-{device}", daemon=True,
                                      args=(child, rank, len(self.worker_devices), device, placement, str(index_dir),
                                            searcher_class, encoder, options, threads, group_file))
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        # the group's rendezvous file serves for as long as the group: NCCL connects at the first collective
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns, group_file)
        self.local = None  # the first replica, searched in this process
        try:
            if placement == "replicate":  # opened while the workers load theirs
                self.local = searcher_class(index_dir, encoder, options.replace(device=self.devices[0], backend="torch"))
            ready = self._replies(range(len(self.worker_devices)), START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        found = {reply[1] for reply in ready} | ({self.local.manifest.generation} if self.local is not None else set())
        if found != {generation}:
            self.close()
            raise RuntimeError(f"index {index_dir} changed while its search workers opened it (generation "
                               f"{generation}, workers found {sorted(found)}); open the searcher again")
        # documents (rows) each device holds
        self.rows_held = ([self.local.num_rows] if self.local is not None else []) + \
            [reply[2] for reply in ready]
        # seconds each device searched in the last batch (None for one it did not reach), and the batch's wall
        # seconds here: how much of a batch the hand-over and the slowest part cost
        self.last_seconds: list[float | None] = [None] * len(self.devices)
        self.last_wall = 0.0

    def close(self) -> None:
        """Stop the workers (also done when the backend is collected) and let go of this process's replica."""
        self._finalizer()
        self.local = None

    def _send(self, rank: int, message: tuple) -> None:
        """Send ``message`` to worker ``rank``; RuntimeError naming the device if it has gone (the workers are then
        stopped)."""
        try:
            self.conns[rank].send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.processes[rank].join(timeout=1)
            code = self.processes[rank].exitcode
            self.close()
            raise RuntimeError(f"search worker on {self.worker_devices[rank]}: exited with code {code}") from None

    def _replies(self, ranks: Sequence[int], timeout_s: float | None = None) -> list:
        """The next message of each worker in ``ranks``, taken as each arrives; RuntimeError naming the device if
        one reports an error or exits (the workers are then stopped: a lockstep group cannot go on without one of
        its members)."""
        from multiprocessing.connection import wait

        pending = {self.conns[rank]: rank for rank in ranks}
        out: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            for conn in wait(list(pending), timeout=POLL_S):
                rank = pending.pop(conn)
                try:
                    out[rank] = conn.recv()
                except EOFError:
                    self.processes[rank].join(timeout=1)
                    out[rank] = ("error", f"exited with code {self.processes[rank].exitcode}")
                if out[rank][0] == "error":
                    self.close()
                    raise RuntimeError(f"search worker on {self.worker_devices[rank]}: {out[rank][1]}")
            for conn, rank in list(pending.items()):
                if not self.processes[rank].is_alive() and not conn.poll():
                    self.close()
                    raise RuntimeError(f"search worker on {self.worker_devices[rank]}: exited with code "
                                       f"{self.processes[rank].exitcode}")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"search workers did not answer within {timeout_s:.0f} s")
        return [out[rank] for rank in ranks]

    @property
    def num_rows(self) -> int:
        """Documents (rows) the devices hold together (each row on one device, or on every one)."""
        return sum(self.rows_held) if self.placement == "shard" else self.rows_held[0]

    @property
    def engine(self) -> "Workers":
        """The backend searched: these workers."""
        return self

    def search_texts(self, texts: list[str], depth: Depth, k: int, threads: int | None, vectors: bool,
                     clock: Clock = no_clock, allowed: AllowedRows | None = None) -> tuple[list | None, list]:
        """(query vectors per text, or None unless ``vectors``; [(doc row, score)] per text) of non-blank texts;
        ``threads``: the search threads (None: each device's default); ``allowed``: the only rows a filtered search
        may return. Each device searches at its own depth for k (``depth`` is this process's)."""
        found = self._search(texts, k, threads, vectors, allowed)
        clock("search")
        return found

    def _search(self, texts: list[str], k: int, threads: int | None, vectors: bool,
                allowed: AllowedRows | None) -> tuple[list | None, list]:
        if not self._finalizer.alive:
            raise RuntimeError("the search workers were stopped (after an error); open the searcher again")
        start = time.perf_counter()
        self.last_seconds = [None] * len(self.devices)
        packed = None if allowed is None else allowed.packed()
        if self.placement == "shard":
            for rank in range(len(self.conns)):
                self._send(rank, ("search", texts, k, threads, vectors, packed))
            replies = self._replies(range(len(self.conns)))
            self.last_wall = time.perf_counter() - start
            self.last_seconds = [reply[3] for reply in replies]
            return replies[0][1], replies[0][2]
        parts = text_parts(texts, len(self.devices)) if len(texts) > 1 else [slice(0, len(texts))]
        busy = [rank for rank, part in enumerate(parts[1:]) if part.stop > part.start]
        for rank in busy:  # the workers' parts first, so that they search while this process searches its own
            self._send(rank, ("search", texts[parts[rank + 1]], k, threads, vectors, packed))
        try:
            local_vectors, local_hits = self.local.search_texts(texts[parts[0]], k, threads, vectors, allowed)
        except BaseException:
            self._replies(busy)  # the workers' answers to this batch, so that the next batch reads its own
            raise
        self.last_seconds[0] = time.perf_counter() - start
        replies = self._replies(busy)
        self.last_wall = time.perf_counter() - start
        for rank, reply in zip(busy, replies):
            self.last_seconds[rank + 1] = reply[3]
        hits = local_hits + [h for reply in replies for h in reply[2]]
        return (local_vectors + [v for reply in replies for v in reply[1]] if vectors else None), hits

"""One index built by several processes: ``torchrun --nproc-per-node G -m pyserini_aligner.index --corpus ...``.

Every rank encodes a contiguous slice of the corpus (:func:`.shards.shard_range`, Pyserini's convention) on
``cuda:LOCAL_RANK`` (or the CPU) into its own segment folder inside one temporary build folder beside the target;
rank 0 trains the codec on the first documents (its slice's) and broadcasts it first, gathers the segments'
SegmentInfos, checks docids across the ranks and commits one manifest (segments in rank order), renamed into place
as a one-process build is. The ranks therefore share a file system: on several machines the target must lie on a
shared file system (NFS, Lustre, ...).

Failure handling: collectives run with a timeout (``--dist-timeout``); every rank keeps a small status file in the
build folder (pid, host, documents done, outcome), so rank 0 shows one progress bar over the whole corpus and
notices a rank that died on its host without waiting for the timeout. When any rank fails, rank 0 removes the build
folder and exits non-zero with a message naming the rank; the others exit non-zero too.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from pyserini_aligner.dist import (DEFAULT_TIMEOUT_S, Collectives, DistContext, dist_context, join_group,
                                   lost_rank_message)
from pyserini_aligner.index.commit import new_name
from pyserini_aligner.index.format import DOCIDS, Manifest, SegmentInfo
from pyserini_aligner.index.reader import Docids
from pyserini_aligner.index.builder import (DocidRegistry, check_codec, check_max_length, checked_items,
                                            codec_source, copy_codec, encode_chunks,
                                            new_manifest, record_codec_training, sample_for_codec, sampled_codec,
                                            spill_corpus, write_index, write_segment)
from pyserini_aligner.index.codec_spec import CodecSpec
from pyserini_aligner.index.options import BuildOptions, build_options
from pyserini_aligner.index.segment import write_codec
from pyserini_aligner.index.shards import check_unique_docids, shard_corpus, shard_range
from pyserini_aligner.resolve import load_model

log = logging.getLogger(__name__)

POLL_S = 0.5  # rank 0 re-reads the status files this often while it waits for the other ranks


class Stopped(RuntimeError):
    """The launcher ended this rank (SIGTERM): torchrun does so to every rank when one fails."""


def _on_sigterm(signum, frame):
    raise Stopped("stopped by SIGTERM")


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


class _Status:
    """The status file of one rank inside the build folder: ``.tmp-rank-<r>.json``."""

    def __init__(self, root: Path, rank: int):
        self.path = root / f".tmp-rank-{rank}.json"

    def write(self, **fields) -> None:
        tmp = self.path.with_name(self.path.name + ".part")
        tmp.write_text(json.dumps(fields), encoding="utf-8")
        os.replace(tmp, self.path)

    def read(self) -> dict:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}


class _Job(Collectives):
    """The collectives and status files of one distributed build."""

    def __init__(self, ctx: DistContext):
        super().__init__(ctx)
        self.host = socket.gethostname()
        self.peers: list[dict] = []
        self.root: Path | None = None

    def status(self, rank: int) -> _Status:
        return _Status(self.root, rank)

    def failures(self) -> list[str]:
        """What went wrong with the other ranks, one phrase each ("rank 1 failed: ..." / "rank 1 died ...")."""
        found = []
        for rank in range(1, self.ctx.world_size):
            status = self.status(rank).read() if self.root is not None else {}
            peer = self.peers[rank] if rank < len(self.peers) else {}
            if status.get("state") == "failed":
                found.append(f"rank {rank} failed: {status.get('error')}")
            elif status.get("state") != "done" and peer.get("host") == self.host and \
                    not _process_alive(peer.get("pid", -1)):
                found.append(f"rank {rank} (pid {peer.get('pid')}) died without reporting (killed or crashed)")
        return found

    def progress(self) -> int:
        """Documents encoded by the other ranks so far."""
        return sum(self.status(r).read().get("done", 0) for r in range(1, self.ctx.world_size))


def _device_for(device: str, ctx: DistContext) -> str:
    if str(device).startswith("cuda"):
        if str(device) not in ("cuda", f"cuda:{ctx.local_rank}"):
            log.info("rank %d encodes on cuda:%d (LOCAL_RANK), not %s", ctx.rank, ctx.local_rank, device)
        return f"cuda:{ctx.local_rank}"
    return "cpu"


def build_distributed(corpus: str, index_dir: str | os.PathLike, encoder="aligner",
                      options: BuildOptions | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                      **changes) -> Manifest | None:
    """Build one index of ``corpus`` (a JsonCollection path or an ir_datasets id) with every rank of the torchrun
    job this process belongs to; all ranks call it with the same arguments. Returns the manifest on rank 0, None on
    the others; raises (on every rank) when any rank fails. ``options`` and ``changes`` as in
    :func:`.builder.build_index`; device "cuda" means cuda:LOCAL_RANK. The process group (NCCL + Gloo on CUDA, Gloo
    on the CPU) is created with a ``timeout_s`` timeout unless one exists already."""
    ctx = dist_context()
    if ctx is None:
        raise RuntimeError("build_distributed runs under torchrun (RANK, WORLD_SIZE and MASTER_ADDR are not set)")
    if timeout_s <= 0:
        raise ValueError(f"--dist-timeout must be > 0 seconds, got {timeout_s}")
    opts = build_options(options, **changes)
    dev = _device_for(opts.device or "cpu", ctx)
    opts = opts.replace(device=dev)
    # torchrun sets OMP_NUM_THREADS=1; tokenising, pruning and writing want this rank's share of the cores
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    _, created = join_group(ctx, device=dev, timeout_s=timeout_s)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    job = _Job(ctx)
    try:
        try:
            job.peers = job.all_gather({"host": job.host, "pid": os.getpid()})
        except RuntimeError as err:  # a rank died between joining the group and this first exchange
            raise RuntimeError(f"rank {ctx.rank} lost contact with another rank at start-up: "
                               f"{lost_rank_message(err)}") from None
        if ctx.rank == 0:
            return _lead(job, corpus, Path(index_dir).absolute(), encoder, opts, timeout_s)
        _follow(job, corpus, encoder, opts)
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)
        if created:
            dist.destroy_process_group()


def _slice(corpus: str, rank: int, world: int, max_docs: int | None, total: int | None = None):
    items, start, end, total = shard_corpus(corpus, rank, world, max_docs, total)
    if total < world:
        raise ValueError(f"the corpus has {total} documents, fewer than the {world} ranks")
    return items, start, end, total


def _lead(job: _Job, corpus: str, target: Path, encoder, opts: BuildOptions, timeout_s: float) -> Manifest:
    """Rank 0: train and broadcast the codec, encode slice 0, wait for the others, check docids, commit."""
    world = job.ctx.world_size
    stage = {"announced": False, "gathered": False}

    def announce(payload: dict) -> None:
        stage["announced"] = True
        job.broadcast(payload)

    def write(root: Path, generation: int) -> Manifest:
        started = time.perf_counter()
        job.root = root
        model = load_model(encoder, opts.device)
        check_max_length(model, opts.max_length)
        dim = model.config.dim
        source = codec_source(opts.codec_from) if opts.codec_from is not None else None
        codec = source[0].spec if source else opts.codec
        check_codec(model, codec, opts.index_type)
        items, start, end, total = _slice(corpus, 0, world, opts.max_docs)
        sized = opts.sized(total)
        bar = tqdm(total=total, unit="doc", desc=f"index ({world} ranks)", disable=not opts.progress,
                   smoothing=0.05)
        stack = ExitStack()
        try:
            registry = DocidRegistry()
            checked = checked_items(items, None, registry)
            chunks, trained, codec_dir, codec_files, codec_seconds = [], None, None, {}, 0.0
            spec = CodecSpec()
            if isinstance(codec, CodecSpec) and not codec.compressed:
                stream = encode_chunks(model, checked, opts.batch_size, opts.max_length, compute=opts.compute)
            else:
                codec_dir = new_name("codec", generation)
                if source:
                    stream = encode_chunks(model, checked, opts.batch_size, opts.max_length, compute=opts.compute)
                    chunks, spec = sample_for_codec(stream, codec, dim, total, opts.train_size,
                                                    opts.max_bytes_per_token)
                    trained = source[0]
                    codec_files = copy_codec(source[1], source[2], root / codec_dir)
                else:  # a uniform sample of this rank's slice
                    spill = stack.enter_context(spill_corpus(root, checked, end - start, opts))
                    trained, chunks, stream, codec_seconds = sampled_codec(model, spill, codec, total, opts)
                    codec_files = write_codec(root / codec_dir, trained)
                spec = trained.spec
            announce({"root": str(root), "generation": generation, "total": total,
                      "codec": None if trained is None else trained.to("cpu")})
            own = [0]

            def advance(count: int) -> None:
                own[0] += count
                bar.update(own[0] + job.progress() - bar.n)

            info = write_segment(root / new_name("seg", generation), _chain(chunks, stream), dim,
                                 sized.doc_prune, opts.prune_redundancy,
                                 None if trained is None else trained.to(model.device), opts.index_type,
                                 opts.train_size, opts.seed, progress=False, on_chunk=advance)
            record_codec_training(info.build_stats, codec_seconds)
            info.num_empty = registry.blank
            info.build_stats["total_s"] = time.perf_counter() - started
            _wait_for_ranks(job, bar, own, timeout_s)
        except BaseException as err:
            raise _named(job, err) from None
        finally:
            bar.close()
            stack.close()
        outcomes = job.all_gather((True, asdict(info)))
        stage["gathered"] = True
        failed = [f"rank {r} failed: {o[1]}" for r, o in enumerate(outcomes) if not o[0]]
        if failed:
            raise RuntimeError("; ".join(failed))
        infos = [SegmentInfo(**o[1]) for o in outcomes]
        bounds = [shard_range_text(r, world, total) for r in range(world)]
        check_unique_docids([(f"rank {r} ({bounds[r]})", Docids.read(root / i.name / DOCIDS, i.num_docs), None)
                             for r, i in enumerate(infos)])
        for rank in range(world):
            job.status(rank).path.unlink(missing_ok=True)
        return new_manifest(model, encoder, spec, sized, codec_dir, codec_files, infos)

    try:
        manifest = write_index(target, opts.overwrite, corpus if Path(corpus).exists() else None, write)
    except BaseException as err:
        if not stage["announced"] or stage["gathered"]:  # the other ranks wait in a broadcast: tell them
            try:
                job.broadcast({"error": str(err)})
            except (RuntimeError, dist.DistError):
                pass
        raise
    job.broadcast({"ok": True})
    log.info("indexed %d documents (%d tokens, %d indexed, codec %s) with %d ranks into %s", manifest.num_docs,
             manifest.num_tokens, manifest.num_kept, manifest.codec, world, target)
    return manifest


def shard_range_text(rank: int, world: int, total: int) -> str:
    """"corpus documents a-b" (1-based, inclusive) of rank ``rank``'s slice."""
    start, end = shard_range(total, rank, world)
    return f"corpus documents {start + 1}-{end}"


def _chain(first: list, rest):
    while first:
        yield first.pop(0)
    yield from rest


def _wait_for_ranks(job: _Job, bar, own: list, timeout_s: float) -> None:
    """Rank 0, its slice done: follow the others' progress until each reports done, one fails or dies, or the
    timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        failures = job.failures()
        if failures:
            raise RuntimeError("; ".join(failures))
        states = [job.status(r).read().get("state") for r in range(1, job.ctx.world_size)]
        bar.update(own[0] + job.progress() - bar.n)
        if all(state == "done" for state in states):
            return
        if time.monotonic() > deadline:
            waiting = [r + 1 for r, state in enumerate(states) if state != "done"]
            raise RuntimeError(f"rank(s) {waiting} did not finish within --dist-timeout {timeout_s:g} s")
        time.sleep(POLL_S)


def _named(job: _Job, err: BaseException) -> BaseException:
    """The error to report for ``err`` on rank 0: the other ranks' failures first when there are any."""
    failures = job.failures()
    if failures and not (isinstance(err, RuntimeError) and str(err) == "; ".join(failures)):
        return RuntimeError("; ".join(failures))
    if isinstance(err, Stopped):
        return RuntimeError("stopped by the launcher (SIGTERM) after another rank failed; see its report")
    if isinstance(err, dist.DistBackendError):
        return RuntimeError(f"lost contact with another rank ({str(err).splitlines()[0]})")
    return err


def _follow(job: _Job, corpus: str, encoder, opts: BuildOptions) -> None:
    """Rank r > 0: encode slice r into a segment of rank 0's build folder; report its SegmentInfo."""
    rank, world = job.ctx.rank, job.ctx.world_size
    try:
        model = load_model(encoder, opts.device)
        error = None
    except Exception as err:  # reported to rank 0 once the build folder exists
        model, error = None, err
    header = job.broadcast()
    if "error" in header:
        raise RuntimeError(f"rank 0 failed: {header['error']}")
    job.root = Path(header["root"])
    status = job.status(rank)
    info = None
    try:
        if not job.root.is_dir():
            raise FileNotFoundError(f"rank {rank} on {job.host} cannot see the build folder {job.root}: with "
                                    "several machines the index must be on a shared file system")
        if error is not None:
            raise error
        status.write(state="running", done=0)
        items, start, end, _ = _slice(corpus, rank, world, opts.max_docs, header["total"])
        opts = opts.sized(header["total"])
        registry = DocidRegistry()
        stream = encode_chunks(model, checked_items(items, None, registry), opts.batch_size, opts.max_length,
                               compute=opts.compute)
        trained = header["codec"].to(model.device) if header["codec"] is not None else None
        done = [0]

        def advance(count: int) -> None:
            done[0] += count
            status.write(state="running", done=done[0])

        info = write_segment(job.root / new_name("seg", header["generation"]), stream, model.config.dim,
                             opts.doc_prune, opts.prune_redundancy, trained, opts.index_type, opts.train_size,
                             opts.seed, progress=False, on_chunk=advance)
        info.num_empty = registry.blank
        status.write(state="done", done=done[0])
        outcome = (True, asdict(info))
    except Exception as err:
        status.write(state="failed", error=str(err)) if job.root.is_dir() else None
        outcome = (False, str(err))
    try:
        job.all_gather(outcome)
        final = job.broadcast()
    except (RuntimeError, dist.DistError) as err:  # rank 0 gave up (it reports why)
        final = {"error": f"lost contact with rank 0 ({str(err).splitlines()[0] if str(err) else type(err).__name__})"}
    if not outcome[0]:
        raise RuntimeError(f"rank {rank} failed: {outcome[1]}")
    if "error" in final:
        raise RuntimeError(f"rank 0 failed: {final['error']}")

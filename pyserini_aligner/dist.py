"""The torchrun job a process belongs to, and the collectives that distributed builds and searches exchange.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR for every process it starts; :func:`dist_context` reads
them. :class:`Collectives` broadcasts (from rank 0) and gathers picklable objects over torch.distributed's default
process group; both the distributed build (:mod:`pyserini_aligner.index.distributed`) and the distributed search
(:mod:`pyserini_aligner.search.backends.exchanged`) exchange their small CPU objects through it, in the process
group :func:`join_group` joins.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT_S = 1800.0  # seconds a collective waits for the other ranks
BYTE_WIRED = (torch.bool, torch.int16)  # tensor types sent by all_to_all_rows as their bytes


@dataclass(frozen=True)
class DistContext:
    """This process's place in a torchrun job (from RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int


def dist_context() -> DistContext | None:
    """The torch.distributed job this process belongs to (torchrun's environment), or None outside one."""
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return DistContext(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def lost_rank_message(error: BaseException) -> str:
    """One line for a collective that failed, e.g. because another rank died or was killed: the first line of the
    error (Gloo's "Connection closed by peer ...") without its source-file prefix."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", line)


class Collectives:
    """``broadcast`` (from rank 0) and ``all_gather`` of picklable objects, and all-gather, all-to-all (of equal or of
    varying row counts) and element-wise maximum of tensors, over the default process group, for the rank ``ctx``
    describes. Tensors travel from the device they are on where the group carries device tensors (NCCL, alone or
    beside Gloo for CPU tensors), else through the host, and come back on the device they were given on.
    ``on_device`` (default: whether the group has NCCL) also tells the search to split its work among the ranks, as
    on GPUs (:mod:`pyserini_aligner.search.backends.exchanged`); True under Gloo runs that path on CPUs."""

    def __init__(self, ctx: DistContext, on_device: bool | None = None):
        self.ctx = ctx
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.on_device = "nccl" in str(dist.get_backend()) if on_device is None else on_device

    def _wire(self, tensor: Tensor) -> Tensor:
        return tensor.contiguous() if self.on_device else tensor.cpu().contiguous()

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (the others' ``obj`` is ignored)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order."""
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_gather_tensor(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (the same shape and dtype on every rank), in rank order, on its device."""
        send = self._wire(tensor)
        out = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(out, send)
        return [t.to(tensor.device) for t in out]

    def all_to_all_tensor(self, parts: list[Tensor]) -> list[Tensor]:
        """Part i of ``parts`` (one a rank, all of one shape and dtype) sent to rank i; returns the part each rank
        sent to this one, in rank order, on the parts' device."""
        send = [self._wire(part) for part in parts]
        out = [torch.empty_like(send[0]) for _ in range(self.world_size)]
        dist.all_to_all(out, send)
        return [t.to(parts[0].device) for t in out]

    def all_to_all_rows(self, parts: list[Tensor], received: list[int] | None = None) -> list[Tensor]:
        """Part i of ``parts`` (one a rank, any number of rows, the same trailing shape and dtype) sent to rank i;
        returns the part each rank sent to this one, in rank order, on the parts' device. ``received``: the rows each
        rank sends here, where the caller knows them (else they are exchanged first)."""
        device, dtype = parts[0].device, parts[0].dtype
        sent = [len(part) for part in parts]
        if received is None:
            counts = torch.tensor(sent, dtype=torch.long, device=device)
            received = torch.cat(self.all_to_all_tensor(list(counts.view(-1, 1)))).tolist()
        send = torch.cat(parts)
        if dtype in BYTE_WIRED:  # types NCCL does not carry travel as their bytes
            send = send.unsqueeze(-1).view(torch.uint8)
        send = self._wire(send)
        out = send.new_empty((sum(received), *send.shape[1:]))
        dist.all_to_all_single(out, send, output_split_sizes=received, input_split_sizes=sent)
        out = out.to(device)
        if dtype in BYTE_WIRED:
            out = out.view(dtype).squeeze(-1)
        return list(out.split(received))

    def all_reduce_max(self, tensor: Tensor) -> Tensor:
        """The element-wise maximum of every rank's ``tensor`` (same shape and dtype), on its device."""
        send = self._wire(tensor)
        dist.all_reduce(send, op=dist.ReduceOp.MAX)
        return send.to(tensor.device)


def torchrun_context() -> DistContext:
    """:func:`dist_context`, or RuntimeError outside a torchrun job."""
    ctx = dist_context()
    if ctx is None:
        raise RuntimeError("--distributed runs under torchrun (RANK, WORLD_SIZE and MASTER_ADDR are not set)")
    return ctx


def rank_device(device: str, ctx: DistContext) -> str:
    """The device rank ``ctx`` of a job on ``device`` uses: a CUDA device means cuda:LOCAL_RANK, else the CPU."""
    return f"cuda:{ctx.local_rank}" if str(device).startswith("cuda") else "cpu"


def join_group(ctx: DistContext | None = None, *, device: str = "cpu", cuda_backend: str = "cpu:gloo,cuda:nccl",
               rendezvous: str | os.PathLike | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[DistContext, bool]:
    """(this rank's context, whether the default process group was created here). ``ctx``: the rank (default:
    torchrun's environment; RuntimeError outside one). The group's backend is Gloo for a CPU ``device`` and
    ``cuda_backend`` ("nccl", or by default "cpu:gloo,cuda:nccl": NCCL for device tensors, Gloo for the CPU objects
    that builds and searches exchange) for a CUDA one, which becomes this process's current
    device. ``rendezvous``: a file the ranks meet at (processes of one machine, ``ctx`` given), else torchrun's
    address (MASTER_ADDR, MASTER_PORT). An existing default process group is used as it is."""
    ctx = ctx or torchrun_context()
    if dist.is_initialized():
        return ctx, False
    cuda = str(device).startswith("cuda")
    if cuda:  # kernels (Triton's too) and NCCL's streams run on the current device
        torch.cuda.set_device(torch.device(device))
    where = {} if rendezvous is None else dict(init_method=Path(rendezvous).as_uri(), rank=ctx.rank,
                                               world_size=ctx.world_size)
    dist.init_process_group(cuda_backend if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s), **where)
    return ctx, True

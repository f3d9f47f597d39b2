"""Process-group plumbing for runs under ``torchrun`` (gloo on CPU, NCCL on GPUs).

Each process trains on a slice of whole groups of the global batch; after backward the
gradients are summed across processes, and the losses are scaled so that the sum of the local
losses is the loss of the global batch. Gradients are therefore those of one process on the union
batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of ``value`` over the processes (a new tensor; ``value`` is left as is)."""
        out = value.detach().clone()
        if self.size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def sum_gradients(self, parameters) -> None:
        if self.size == 1:
            return
        for p in parameters:
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def init_world() -> World:
    """The process group of a ``torchrun`` launch, or a single-process world."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return World(rank=dist.get_rank(), size=dist.get_world_size())


def close_world(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()

"""torchrun integration: process group from the environment, rank helpers, reductions."""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "all_reduce_sum", "init_distributed", "world_size"]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_size() -> int:
    """Processes in this run, as torchrun's environment says (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group torchrun describes (NCCL on GPU, gloo on CPU); a single process otherwise.

    Args:
        device: ``auto`` (CUDA when available), ``cuda`` or ``cpu``.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but no CUDA device is available")
    world = world_size()
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    target = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(target)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return DistInfo(rank, world, local_rank, target)


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    """Sum each value over all processes (float64)."""
    if not info.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(tensor)
    return tensor.tolist()

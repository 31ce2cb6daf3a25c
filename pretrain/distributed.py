"""Process-group plumbing shared by the trainer and the benchmarks: one world whether the
job came from the DeepSpeed launcher, torchrun or a plain ``python``."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist


def init_distributed() -> tuple[int, int]:
    """(rank, world size) under the DeepSpeed launcher, torchrun, or a plain single process."""
    import deepspeed

    if "RANK" not in os.environ:  # plain `python launch/pretrain.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(verbose=False)
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather(obj, world: int) -> list:
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out

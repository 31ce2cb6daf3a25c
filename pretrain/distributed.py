"""Process-group plumbing shared by the trainer and the benchmarks: one world whether the
job came from the DeepSpeed launcher, torchrun or a plain ``python``."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
from typing import Optional

import torch.distributed as dist

from pretrain.data.info import StorageUnreachable


class RendezvousFailed(StorageUnreachable):
    """The ranks did not all meet at the start: exit code 1, as a crash (the node may come
    back), in one line instead of a store's traceback on every rank that came; by the first
    rank of each node that came (pretrain/cli.py)."""
    per_node = True


WAITING_NOTE_S = 30.0


def init_distributed() -> tuple[int, int]:
    """(rank, world size) under the DeepSpeed launcher, torchrun, or a plain single process."""
    import deepspeed

    world_of_one_unless_launched()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    world = os.environ.get("WORLD_SIZE", "1")
    with _noted_while_waiting(where, world):
        try:
            deepspeed.init_distributed(verbose=False)
        except dist.DistError as e:  # (DistStoreError: a timeout; DistNetworkError)
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RendezvousFailed(
                f"rank {os.environ.get('RANK')} (on {socket.gethostname()}) could not meet the "
                f"other ranks of a world of {world} at {where} ({cause}): a node did not start, "
                f"or cannot reach that address (a firewall, NCCL_SOCKET_IFNAME naming another "
                f"network); the wait is DEEPSPEED_TIMEOUT="
                f"{os.environ.get('DEEPSPEED_TIMEOUT', '10')} (minutes)") from None
    release_shm_buffers()
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def _noted_while_waiting(where: str, world: str):
    """While the ranks meet, the first rank of each node says every WAITING_NOTE_S seconds
    that it is still waiting: a node that never comes otherwise leaves the log silent for the
    whole timeout."""
    done = threading.Event()

    def note() -> None:
        waited = 0.0
        while not done.wait(WAITING_NOTE_S):
            waited += WAITING_NOTE_S
            sys.stderr.write(f"[rank{os.environ.get('RANK')}] still waiting at {where} for the "
                             f"other ranks of a world of {world} ({waited:.0f} s)\n")
            sys.stderr.flush()

    noter = threading.Thread(target=note, name="rendezvous-note", daemon=True)
    if os.environ.get("LOCAL_RANK", "0") == "0" and world != "1":
        noter.start()
    try:
        yield
    finally:
        done.set()


def world_of_one_unless_launched() -> None:
    """A plain ``python launch/...`` process (no launcher set ``$RANK``) becomes rank 0 of a
    world of one, which DeepSpeed needs a process group for."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


def release_shm_buffers() -> None:
    """DeepSpeed's CPU all-reduce (its shm op, used with gloo) puts a 69 MB file per rank in
    /dev/shm and never removes it: each CPU job would leave its files behind, in RAM, until the
    machine reboots (the test suite alone filled 21 GB). ``init_distributed`` returns on a rank
    once it has mapped every rank's file; after a barrier that holds everywhere, so the names
    can go now -- the memory itself is freed when the last rank exits, however it exits."""
    import glob

    if dist.get_backend() != "gloo":  # GPU runs: NCCL, no such files
        return
    dist.barrier()  # every rank, whether or not it has a file: a barrier must be collective
    for f in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_"
                       f"{os.environ.get('MASTER_PORT')}_{dist.get_rank()}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)


def leave() -> None:
    """Destroy the process group at a clean end (finished, or stopped by a signal), as torch
    asks: left to the interpreter's exit, torch 2.14's gloo groups sometimes abort the process
    ("terminate called without an active exception", exit code 134) after its work is done,
    which a launcher or SLURM script then reads as a crash instead of 0 or 4."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank() -> int:
    return rank_world()[0]


def first_of_node() -> bool:
    """Rank 0, or the first rank of its node ($LOCAL_RANK 0): where a node's own facts (its
    page cache, its installed packages) are acted on or reported once. Without $LOCAL_RANK
    every rank counts as the first of its node."""
    return rank() == 0 or os.environ.get("LOCAL_RANK", "0") == "0"


def agreed(exc: BaseException) -> BaseException:
    """Mark an error that every rank raises alike, decided together (after a collective): the
    launchers print its line from rank 0 only, not once per rank."""
    exc.agreed = True
    return exc


# what gloo says when the process at the other end of a connection is gone
_PEER_GONE = re.compile(r"Connection (?:reset|closed) by peer|Broken pipe")


def peer_gone(exc: BaseException) -> Optional[str]:
    """The one-line cause where ``exc`` is a collective that failed because another rank's
    process is gone (killed, crashed), else None. Its traceback is noise: every surviving rank
    printed one, and none says why that rank went (the launcher's log and its output do)."""
    text = str(exc)
    found = _PEER_GONE.search(text) if isinstance(exc, RuntimeError) else None
    if found is None or not ("gloo" in text or isinstance(exc, dist.DistError)):
        return None
    return f"a collective failed, {found.group(0)} (gloo): another rank's process is gone"


def barrier() -> None:
    """Wait for every rank; nothing to wait for outside a process group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_distributed() -> bool:
    """A process group of more than one rank (Accelerate leaves a world of one uninitialised)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def raise_together(error: Optional[BaseException], world: int) -> None:
    """Collective, after a check every rank makes alike (a folder it cannot make, data it cannot
    read): where any rank met an error, every rank raises the first one, agreed, and rank 0
    says it once, not each rank of the job (a line per GPU). ``error``: this rank's, or None."""
    first = next((e for e in gather(error, world) if e is not None), None)
    if first is not None:
        raise agreed(error if error is not None else first)


def gather(obj, world: int) -> list:
    """Every rank's ``obj``, in rank order (collective)."""
    if not is_distributed():
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def job_store(timeout_s: float) -> dist.TCPStore:
    """A connection of our own to the job's rendezvous store (``$MASTER_ADDR:$MASTER_PORT``,
    which every launcher starts), with our own timeout: the process group's own store waits up
    to the group's timeout (10 min) for a frozen host, and no longer for slow work."""
    import datetime
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=min(timeout_s, 60)),
                          wait_for_workers=False)  # (a store already gone: a minute, not hours)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def job_key(name: str) -> str:
    """A key of ours on the job's store, new for each start of the ranks: torchrun's store
    outlives its restarts of them (--max-restarts), and an earlier try's keys with it."""
    return f"vitscale/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def rank_0_does(work, key: str, within_s: float) -> None:
    """``work()`` on rank 0 while the other ranks wait up to ``within_s`` seconds, longer than a
    barrier may (the process group's timeout); rank 0's failure ends every rank alike, the
    others with :class:`RankZeroFailed`. Collective; ``key`` is new for each call of a job."""
    if not is_distributed():
        work()
        return
    store, key = job_store(within_s), job_key(f"rank0/{key}")
    if dist.get_rank() == 0:
        try:
            work()
        except BaseException as e:
            store.set(key, f"failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            raise
        store.set(key, "done")
        return
    said = store.get(key).decode()  # (waits for the key, up to within_s)
    if said != "done":
        raise agreed(RankZeroFailed(f"rank 0 {said}; its line above says more"))


class RankZeroFailed(RuntimeError):
    """What the other ranks raise when rank 0 failed work they waited for; rank 0 says why."""


def broadcast_from_0(obj):
    """Rank 0's ``obj`` on every rank (collective)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(values: list, device) -> list[float]:
    """Sums over ranks of a few scalars or vectors (tensors or numbers), in one collective;
    the sums come back flat, in order."""
    import torch
    t = torch.cat([torch.as_tensor(v, dtype=torch.float32, device=device).reshape(-1)
                   for v in values])
    if is_distributed():
        dist.all_reduce(t)
    return t.tolist()

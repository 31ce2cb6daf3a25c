"""What both loaders share about running in torch data-loader worker processes.

The batch tensors are made in shared memory, a worker's :class:`LoaderError` comes back as an
item and is raised in the main process, workers stuck in their fork are started again (see
:mod:`pretrain.data.fork_guard`), every batch read counts as the rank's progress (see
:mod:`pretrain.watchdog`), and every worker is ended, by SIGKILL, when its iteration ends or at
exit.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import weakref
from typing import Any, Iterator, NamedTuple

import torch
from torch.utils.data import DataLoader, get_worker_info

from pretrain.data.fork_guard import stuck_in_fork  # (importing it installs the fork hook)
from pretrain.data.shards import LoaderError, ShardUnreachable
from pretrain.helper_processes import ignore_stop_signals
from pretrain.watchdog import dump_stacks_on_sigquit, progress

log = logging.getLogger(__name__)
START_ATTEMPTS = 3


class Failed(NamedTuple):
    """A worker's LoaderError, passed as an item: raised in the worker it would reach the
    user wrapped in torch's multi-line traceback text instead of its one line."""
    message: str
    unreachable: bool = False  # a ShardUnreachable: the storage may come back


def failed(e: LoaderError) -> Failed:
    return Failed(str(e), isinstance(e, ShardUnreachable))


def raise_failed(item) -> None:
    if isinstance(item, Failed):
        raise (ShardUnreachable if item.unreachable else LoaderError)(item.message)


def seed_generator() -> torch.Generator:
    """Where a DataLoader draws its workers' base seed from (unused: every sample's draws come
    from its own seeded rng). Without one it takes a draw from torch's global generator each
    time an iterator is made, so a resumed run's dropout and stochastic-depth masks were one
    draw off an uninterrupted run's on the CPU."""
    return torch.Generator().manual_seed(0)


# Workers ignore SIGTERM, but SIGTERM is how torch ends a worker it could not join and how
# multiprocessing ends daemon children at exit -- and at exit it then joins them, forever, when
# the iterator was not freed before (a reference cycle is enough). So the loaders end their
# own workers with SIGKILL: when their iteration ends, and at exit for any left over.
_WORKERS: "weakref.WeakSet" = weakref.WeakSet()


def _kill(workers) -> None:
    for w in list(workers):
        if w.is_alive():
            w.kill()
            w.join()


atexit.register(_kill, _WORKERS)  # runs before multiprocessing's own exit handler (LIFO)


def live_workers() -> list:
    """The pids of this process's loader workers that are still running."""
    return sorted(w.pid for w in list(_WORKERS) if w.is_alive())


def start_method(num_workers: int):
    """How a loader's workers start: by fork, wherever there is one. They rely on it: they
    inherit the rank's logging setup and the watchdog's stacks file, and import nothing. Python
    3.14 made forkserver the default on Linux, whose workers re-import the launch script (and
    fail to: it finds its helpers next to itself)."""
    if num_workers and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return None


def init_worker(_worker_id: int) -> None:
    """Every loader worker's start: it ignores the signals a scheduler sends to every process
    of a job (torch's workers die of them, and the rank, which stops at a step boundary, needs
    batches until then), and SIGQUIT shows where it is (the stall watchdog asks for that)."""
    ignore_stop_signals()
    dump_stacks_on_sigquit()


def worker_loader(dataset, num_workers: int, **options) -> DataLoader:
    """The DataLoader both loaders run their workers through: the dataset yields whole
    batches, the workers start by fork and as :func:`init_worker` says, and the base seed
    leaves torch's global generator alone (:func:`seed_generator`)."""
    return DataLoader(dataset, batch_size=None, num_workers=num_workers,
                      worker_init_fn=init_worker, generator=seed_generator(),
                      multiprocessing_context=start_method(num_workers), **options)


def iterate_workers(loader: DataLoader) -> Iterator[Any]:
    it, workers = _start(loader)
    try:
        for item in it:
            progress()
            yield item
    finally:
        del it  # torch's shutdown: the workers get a few seconds to finish cleanly
        _kill(workers)


def _start(loader: DataLoader):
    """A new iterator of ``loader`` and its worker processes, all past their fork."""
    for attempt in range(1, START_ATTEMPTS + 1):
        it = iter(loader)  # each new iterator starts from the same dataset state
        workers = list(getattr(it, "_workers", ()))
        _WORKERS.update(workers)
        stuck = stuck_in_fork(workers)
        if not stuck:
            return it, workers
        it = None  # torch's shutdown of those workers
        _kill(workers)
        log.warning("%d data-loader worker(s) stuck in their fork (pids %s; see "
                    "pretrain/data/fork_guard.py); starting the loader's workers again",
                    len(stuck), ", ".join(str(w.pid) for w in stuck))
    raise LoaderError(f"data-loader workers stuck in their fork {START_ATTEMPTS} times in a "
                      f"row; Python 3.11.10 or later (or 3.12) has the fix of the interpreter "
                      f"bug behind it (see pretrain/data/fork_guard.py)")


def new_batch_images(batch_size: int, size: int) -> torch.Tensor:
    images = torch.empty((batch_size, 3, size, size), dtype=torch.uint8)
    # In a worker process, allocating in shared memory saves the copy the queue would make.
    return images.share_memory_() if get_worker_info() is not None else images

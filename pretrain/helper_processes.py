"""What the helper processes of a rank or of ``prepare_data.py`` do first: leave stopping to
their parent, and never outlive it.

Kept apart from :mod:`pretrain.stopping` so that processes without torch can use it.
"""
from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import signal
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, Optional


def die_with_parent() -> None:
    """Have the kernel end this process when its parent dies (Linux: PR_SET_PDEATHSIG). A
    pool's workers otherwise live on after a SIGKILL of their parent until their task is done
    (a shard: seconds), holding what they inherited, such as the lock of ``prepare_data.py``'s
    output folder, and then print a BrokenPipeError traceback each."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker notices within seconds anyway
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl above
        os._exit(1)


def ignore_stop_signals(*_) -> None:
    """For the helper processes of a rank (data-loader workers, a checkpoint conversion):
    SLURM signals every process of a job step, and those must not die of it before the rank
    has stopped at its step boundary; the rank ends them itself -- and should the rank die
    first, the kernel ends them with it, so a launcher waiting for the rank's whole process
    tree is not kept waiting by them."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()


class WorkerDied(OSError):
    """A worker process of a pool was killed (the OOM killer, a signal) or crashed."""


def pool_map(fn: Callable, items: Iterable, workers: int, *, ahead: int, ordered: bool = True,
             initializer: Optional[Callable] = None, initargs: tuple = ()) -> Iterator:
    """``fn`` over ``items`` in ``workers`` processes that die with this one (then run
    ``initializer(*initargs)``): the results in the order of ``items``, or as they come
    (``ordered=False``), with at most ``ahead`` tasks given out before their results are taken.

    Unlike ``multiprocessing.Pool``, a worker that dies mid-task raises :class:`WorkerDied`
    here instead of leaving its task unanswered forever; and unlike ``Pool.imap``, results do
    not pile up without bound while the caller is slower than the workers.
    """
    items = iter(items)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(),
                               initializer=_start_worker, initargs=(initializer, initargs))
    pending = collections.deque()
    finished = False
    try:
        pending.extend(pool.submit(fn, item) for item in itertools.islice(items, ahead))
        while pending:
            if ordered:
                done = pending.popleft()
            else:
                done = next(iter(wait(pending, return_when=FIRST_COMPLETED)[0]))
                pending.remove(done)
            result = done.result()
            for item in itertools.islice(items, 1):
                pending.append(pool.submit(fn, item))  # raises too once a worker has died
            yield result
        finished = True
    except BrokenProcessPool:
        raise WorkerDied(f"a worker process of {workers} died (the OOM killer, or a "
                         f"signal)") from None
    finally:
        if not finished:  # an error, Ctrl-C, or the caller stopped: the tasks under way are
            # not wanted (a shard in flight is a .tmp file that a rerun removes)
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
        # Joined here, the pool's thread is not left to the interpreter's exit, where in
        # CPython 3.11 its closing races concurrent.futures' exit hook ("OSError: Bad file
        # descriptor" traceback after the run's own one-line error)
        pool.shutdown(wait=True, cancel_futures=True)


def _start_worker(initializer: Optional[Callable], initargs: tuple) -> None:
    # A Ctrl-C reaches the whole foreground process group; only the parent acts on it (it ends
    # the pool), instead of every worker printing a traceback. SIGTERM gets its default back
    # (a forked worker inherits the parent's handler): it is how the pool's workers are ended.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent()
    if initializer is not None:
        initializer(*initargs)

"""What the helper processes of a rank or of ``prepare_data.py`` do first: leave stopping to
their parent, and never outlive it.

Kept apart from :mod:`pretrain.stopping` so that processes without torch can use it.
"""
from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Have the kernel end this process when its parent dies (Linux: PR_SET_PDEATHSIG). A
    multiprocessing pool's workers otherwise live on after a SIGKILL of their parent, each
    waiting on a task pipe that the others keep open -- holding what they inherited, such as
    the lock of ``prepare_data.py``'s output folder."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker notices within seconds anyway
        pass


def ignore_stop_signals(*_) -> None:
    """For the helper processes of a rank (data-loader workers, a checkpoint conversion):
    SLURM signals every process of a job step, and those must not die of it before the rank
    has stopped at its step boundary; the rank ends them itself -- and should the rank die
    first, the kernel ends them with it, so a launcher waiting for the rank's whole process
    tree is not kept waiting by them."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent()


def pool_worker_starts() -> None:
    """For the pools of ``prepare_data.py``: a Ctrl-C reaches the whole foreground process
    group, and only the parent acts on it (it ends the pool) -- not a traceback from every
    worker; SIGTERM keeps its default, which is how the parent ends the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()

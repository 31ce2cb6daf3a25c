"""Forking loader workers from a rank that runs C++ threads, without the child deadlocking.

CPython before 3.11.10 (3.10.15, 3.9.20; 3.12 has the fix) can deadlock a forked child before
any of its code runs: PyOS_AfterFork_Child takes the interpreter's thread-list lock, which is
only reset after, so a lock some other thread held at the fork is never released (CPython
gh-112275). torch's C++ threads take that lock, without the GIL, whenever they drop a tensor
that Python still references -- gloo's and NCCL's threads do after every collective -- and one
that is descheduled while holding it at the moment a loader worker is forked leaves that worker
stuck, and the rank waiting for it (seen in 2-rank ZeRO-3 runs on a 2-core machine, where gloo's
threads are busy and often descheduled). Two defences, both used by the loaders:

- before every fork, a hook waits until no thread holds that lock. That leaves only a thread
  taking it in the microseconds until the fork itself: 0 to 1 stuck children in 3000 forks
  where there were 12 to 20 without (tests/test_fork_safety.py, CPython 3.11.7);
- :func:`stuck_in_fork` tells which new workers never reached their first line, so the loader
  can start them again.
"""
import os
import signal
import sys
import time

# A worker reaches its first line in milliseconds after the fork (no imports: it has the
# rank's memory); seconds on a machine that is very busy.
START_TIMEOUT_S = 60.0

# Right before a fork, sys._current_frames() takes and releases that lock, so a holder is waited
# out; what remains is a thread taking it in the microseconds until the fork itself.
_FORK_LOCK_BUG = sys.implementation.name == "cpython" and (
    sys.version_info < (3, 10, 15) or (3, 11) <= sys.version_info < (3, 11, 10))
if _FORK_LOCK_BUG and hasattr(os, "register_at_fork"):
    os.register_at_fork(before=sys._current_frames)


def handles_sigquit(pid: int) -> bool:
    """Whether ``pid`` has a SIGQUIT handler: a loader worker has one from its first line on
    (``loader_workers.init_worker``). Linux (/proc); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGQUIT - 1) & 1)


def stuck_in_fork(workers) -> list:
    """Those of the just started ``workers`` (multiprocessing processes) that are alive but
    did not reach their first line within :data:`START_TIMEOUT_S`; always none where /proc
    cannot tell."""
    if not os.path.exists("/proc/self/status"):
        return []
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = list(workers)
    while True:
        waiting = [w for w in waiting if w.is_alive() and not handles_sigquit(w.pid)]
        if not waiting or time.monotonic() > deadline:
            return waiting
        time.sleep(0.01)

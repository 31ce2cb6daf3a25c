"""End a rank that stopped making progress, after showing where it is stuck.

Some hangs never end on their own: a data-loader worker blocked on a hung network filesystem
or object store, a worker deadlocked on a lock it inherited at fork, a thread that never
returns. torch waits for a live but silent worker forever (it only notices dead ones), and a
collective waits for such a rank until the process group's timeout, so the job holds its GPUs
to the time limit and the log shows nothing. :class:`StallWatchdog` is a thread of each rank
that checks when the rank last made progress -- read a batch (train or eval), finished a step,
wrote a checkpoint -- and when that is ``train.stall_timeout_s`` ago it writes the Python stacks
of every thread of the rank and of its loader workers to stderr (the job's log), then ends the
rank with :data:`EXIT_STALLED`. The launcher then stops the other ranks, and relaunching the
same command resumes from the newest complete checkpoint.

A rank's stacks, without ending anything, on request: ``kill -QUIT <pid>`` on the rank (Python's
own ``faulthandler``, registered for SIGQUIT, which no scheduler uses to stop jobs).
``faulthandler.dump_traceback_later`` alone would not do: it cannot ask the loader workers, whose
stacks show where a stuck read is, and it exits with code 1, the code of any crash.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

from pretrain import job_status
from pretrain.progress_board import ProgressBoard
from pretrain.stopping import exit_now

log = logging.getLogger(__name__)

# A rank that made no progress for train.stall_timeout_s exits with this code (see stopping.py
# for the others): relaunching resumes from the newest complete checkpoint.
EXIT_STALLED = job_status.STALLED

_last_progress = time.monotonic()
# An unlinked temporary file, made by the watchdog before any loader worker is forked: each
# worker inherits it and writes its stacks there on SIGQUIT, where the rank reads them back, one
# worker after the other. Written straight to the shared stderr, the dumps of the workers and of
# the ranks that stall at the same moment would be mixed character by character.
_worker_stacks = None


def progress() -> None:
    """Note that this rank is making progress (one float store: cheap enough per batch)."""
    global _last_progress
    _last_progress = time.monotonic()


def _last_progress_wall() -> float:
    return time.time() - (time.monotonic() - _last_progress)


def dump_stacks_on_sigquit(file=None) -> None:
    """``kill -QUIT`` writes this process's Python stacks (to ``file``, default stderr) and
    lets it run on; in a loader worker, to where the rank's watchdog reads them."""
    faulthandler.register(signal.SIGQUIT, file=file or _worker_stacks or sys.stderr,
                          all_threads=True, chain=False)


class StallWatchdog:
    """While started, ends this rank (exit code :data:`EXIT_STALLED`) once :func:`progress`
    was last called ``timeout_s`` ago; ``timeout_s=0`` turns it off."""

    def __init__(self, timeout_s: float, rank: int,
                 last_words: Optional[Callable[[str], None]] = None, world: int = 1):
        self.timeout_s, self.rank = timeout_s, rank
        self.last_words = last_words  # given why, before the end (bounded: see exit_now)
        self.every_s = min(30.0, max(0.5, timeout_s / 10))
        # where the others can see how this rank is doing, so that a stall names the rank to
        # look at (pretrain/progress_board.py)
        self.board = ProgressBoard(rank, world, self.every_s, _last_progress_wall) \
            if timeout_s > 0 and ProgressBoard.wanted(world) else None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "StallWatchdog":
        global _worker_stacks
        dump_stacks_on_sigquit(sys.stderr)
        if self.timeout_s > 0:
            if _worker_stacks is None:
                _worker_stacks = tempfile.TemporaryFile()
            progress()
            self._thread = threading.Thread(target=self._watch, name="stall-watchdog",
                                            daemon=True)
            self._thread.start()
            if self.board is not None:
                self.board.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.board is not None:
            self.board.stop()

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            idle = time.monotonic() - _last_progress
            if idle >= self.timeout_s:
                self._end(idle)

    def _end(self, idle: float) -> None:
        """Write the stacks, then end the process; nothing here touches output_dir, which may
        be on the very filesystem that hangs."""
        from pretrain.data.fork_guard import handles_sigquit
        from pretrain.data.loader_workers import live_workers

        report = [f"[rank{self.rank}] stalled: no batch read, step finished or checkpoint "
                  f"written in {idle:.0f} s; the stacks of this rank's threads:\n".encode()]
        with tempfile.TemporaryFile() as own:
            faulthandler.dump_traceback(own, all_threads=True)
            own.seek(0)
            report.append(own.read())
        workers = live_workers()
        for pid in workers:
            report.append(f"[rank{self.rank}] the stacks of its loader worker {pid}:\n".encode())
            if not handles_sigquit(pid):  # SIGQUIT's default would end it with a core dump
                report.append(b"(never reached its first line: stuck in the fork, see "
                              b"pretrain/data/fork_guard.py)\n")
                continue
            report.append(_worker_dump(pid) or b"(no answer within 2 s)\n")
        os.write(sys.stderr.fileno(), b"".join(report))  # one write: not mixed with other ranks'
        why = (f"stalled: rank {self.rank} made no progress (no batch read, step finished or "
               f"checkpoint written) in {idle:.0f} s, over train.stall_timeout_s="
               f"{self.timeout_s:g}")
        look_at = self.board.whom_to_look_at() if self.board is not None else None
        log.error("%s; its stacks are above%s. Ending it (exit code %d): relaunch the same "
                  "command to resume from the newest complete checkpoint", why,
                  f"; {look_at}" if look_at else "", EXIT_STALLED)
        if look_at:
            why = f"{why}; {look_at}"
        for handler in logging.getLogger().handlers:
            handler.flush()
        for pid in workers:  # one stuck before its start never learnt to die with the rank
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        exit_now(EXIT_STALLED, why, self.last_words)


def _worker_dump(pid: int, wait_s: float = 2.0) -> bytes:
    """Ask the loader worker ``pid`` for its stacks; what it wrote to ``_worker_stacks``."""
    fd = _worker_stacks.fileno()
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        os.kill(pid, signal.SIGQUIT)
    except ProcessLookupError:
        return b""
    deadline, size = time.monotonic() + wait_s, start
    while time.monotonic() < deadline:  # done when it has written something, then stopped
        time.sleep(0.1)
        now = os.fstat(fd).st_size
        if now > start and now == size:
            break
        size = now
    return os.pread(fd, size - start, start)

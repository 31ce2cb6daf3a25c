"""Stop on a signal with nothing lost: the time limit, a preemption, ``scancel``, Ctrl-C.

Schedulers end a job step with a signal and a grace period: SLURM sends SIGTERM to every
process of the step and SIGKILL ``KillWait`` later (30 s by default; ``--signal=B:USR1@180``
asks for an earlier SIGUSR1 to the batch shell, which ``launch/slurm_job.sh`` passes to the
ranks: a plain ``USR1@180`` also reaches the launchers, which die of it), Kubernetes sends
SIGTERM and kills after ``terminationGracePeriodSeconds`` (30 s), a terminal's Ctrl-C sends SIGINT to the foreground
process group, and the per-node launchers (DeepSpeed's ``launch.py``, ``torchrun``) pass
SIGTERM on to every rank when they receive SIGINT or SIGTERM themselves.

A signal reaches the ranks at different moments, often in the middle of a collective, so the
handler only notes it. At every step boundary :meth:`StopSignals.agreed` asks all ranks whether
any of them was signalled; the answer is the same everywhere, so every rank finishes the same
step, writes its part of the same checkpoint and leaves -- none saves alone, none waits forever
in a collective for a rank that left. The question travels on a separate gloo (CPU) group and
is answered one step late: the reduction of step N's flags is started after step N and read
after step N+1, so the GPU stream never waits for it. A signal therefore stops the run one step
after it arrived, which costs a second or so of a grace period of tens of seconds. After a
periodic checkpoint the question is answered at once: a signal that came while it was written
stops the run on it, with no second checkpoint a step later.

A second signal while the checkpoint is being written is noted and ignored: the save finishes
(a SIGKILL cannot be ignored, and a checkpoint cut short by one is never loaded: see
:mod:`pretrain.checkpoint`).

One case must not wait: a rank died (a crash, the OOM killer) and its launcher now sends
SIGTERM to the others. They cannot agree with a dead rank nor write a checkpoint without it, and
they sit in a collective that will never finish, where no Python signal handler runs; ignoring
the signal would only make the launcher wait its 30 s per rank before SIGKILL. So a thread of
each rank exchanges a heartbeat with the others every few seconds on its own gloo group: when a
peer's process is gone its connections close and the heartbeat fails. A stop signal on a rank
whose peer is gone ends that rank at once (exit code 1, nothing written; the relaunch resumes
from the newest complete checkpoint). The thread hears of signals through
``signal.set_wakeup_fd``, which the interpreter writes to even while the main thread is stuck.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from pretrain import job_status

log = logging.getLogger(__name__)

# A rank process that stopped on a signal after a complete checkpoint of its last step exits
# with this code; relaunching the same command resumes there (0: finished, 2: bad input,
# 3: stopped for a person to decide, e.g. non-finite losses or a failed checkpoint write;
# 5: stalled, see pretrain/watchdog.py).
EXIT_STOPPED = 4
HEARTBEAT_S = 2.0  # how often the ranks check on each other
# what a signalled process keeps of its grace period to record what it leaves undone and exit
EXIT_MARGIN_S = 5.0
# the per-node launchers (DeepSpeed's launch.py, torchrun) pass SIGTERM and SIGINT on to the
# ranks and SIGKILL them this long after, whatever the scheduler's grace period
LAUNCHER_KILL_S = 30.0


def unignore_stop_signals(names: Sequence[str]) -> None:
    """Give an inherited "ignore" of the stop signals back its default. A batch script's
    ``trap '' USR1 TERM`` (launch/slurm_job.sh: the shell must live on to requeue) passes through
    exec to the launcher and the ranks, so a stop signal in a rank's start-up, before
    :class:`StopSignals` notes them, vanished and the job trained on to the hard limit; with
    the default it ends the rank at once, and the job is requeued. SIGINT gets Python's own
    default (KeyboardInterrupt: the run's ``finally`` clauses still run); SIGHUP stays ignored
    where it was, as ``nohup`` asks."""
    for name in names:
        sig = getattr(signal, name)
        if sig != signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)


def _named(flag: torch.Tensor) -> str:
    return signal.Signals(int(flag.item())).name


_exiting = threading.Lock()  # held by the thread that ends this process with exit_now


def exit_now(code: int, why: str, last_words: Optional[Callable[[str], None]] = None,
             within_s: float = 15.0) -> None:
    """End this process at once with ``code`` (its main thread is stuck: nothing else would),
    after ``last_words(why)`` -- ending the MLflow run FAILED, say -- has had ``within_s``
    seconds: it may be stuck too (an unreachable server, a hung filesystem). The job's batch
    script hears of ``code`` (pretrain/job_status.py) within the same bound."""
    if not _exiting.acquire(blocking=False):  # another thread of ours is ending the process
        while True:  # (the watchdog and the signal watcher may both get here): its os._exit
            time.sleep(60)  # ends this thread too, and its last words are not cut short
    from pretrain import job_status

    # each on its own: the status file's storage may hang, and so may the tracking server
    sayers = [threading.Thread(target=job_status.note, args=("exit", code), daemon=True)]
    if last_words is not None:
        sayers.append(threading.Thread(target=last_words, args=(why,), daemon=True))
    deadline = time.monotonic() + within_s
    for sayer in sayers:
        sayer.start()
    for sayer in sayers:
        sayer.join(max(0.0, deadline - time.monotonic()))
    os._exit(code)


class StoppedBySignal(Exception):
    """The ranks stopped together on a signal after writing a complete checkpoint; ``left``:
    the work after the last step that was not done (the final evaluation, the exports)."""

    def __init__(self, signal_name: str, step: int, checkpoint, left: Optional[str] = None):
        self.signal, self.step, self.checkpoint = signal_name, step, checkpoint
        if left:
            super().__init__(f"{signal_name} received after the last step ({step}), before "
                             f"{left}; the checkpoint at {checkpoint} is complete: relaunch the "
                             f"same command to do the rest (exit code {EXIT_STOPPED})")
        else:
            super().__init__(f"{signal_name} received: stopped after step {step} with a "
                             f"complete checkpoint at {checkpoint}; relaunch the same command "
                             f"to resume there (exit code {EXIT_STOPPED})")


class StopSignals:
    """Notes the signals named in ``checkpoint.stop_signals``; the ranks agree on stopping."""

    def __init__(self, names: Sequence[str], grace_period_s: float,
                 last_words: Optional[Callable[[str], None]] = None):
        self.grace_period_s = grace_period_s
        self.last_words = last_words  # for exit_now, when a signal comes while a peer is gone
        self.received: Optional[int] = None  # the first signal this process got
        self.received_at: Optional[float] = None
        self._previous = {}
        self._group = None
        self._pending = None  # (work, tensor) of the reduction started at the last boundary
        self.signals = [getattr(signal, name) for name in names]
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)
            # restart interrupted system calls: a collective library's blocking read must not
            # fail with EINTR because a signal was noted
            signal.siginterrupt(sig, False)
        asked = job_status.stop_asked()  # by the batch script while this rank was starting
        if asked is not None and asked[0] in self.signals and self.received is None:
            self.received, self.received_at = asked[0], time.monotonic() - asked[1]
        self.peer_lost = False
        self._ending = threading.Event()  # the run is over: a lost peer no longer matters
        self._watcher = None
        if self.signals and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            # every rank creates them at the same point; gloo: no GPU work, no stream sync
            self._group = dist.new_group(backend="gloo")
            self._heartbeat_group = dist.new_group(backend="gloo")
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup = read
            self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, name="stop-signal-watch",
                                             daemon=True)
            self._watcher.start()

    def _note(self, signum, frame) -> None:  # a signal handler: set flags only
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()

    def _watch(self) -> None:
        """The heartbeat thread (see the module docstring)."""
        beat = torch.zeros(1, dtype=torch.int32)
        while True:
            beat.fill_(int(self._ending.is_set()))
            try:
                dist.all_reduce(beat, op=dist.ReduceOp.MAX, group=self._heartbeat_group)
            except Exception:  # noqa: BLE001 -- a peer's process is gone: its sockets closed
                self.peer_lost = True
                break
            if beat.item() and self._ending.is_set():
                return  # every rank is ending: stop together
            self._listen(HEARTBEAT_S)
        while not self._ending.is_set():  # no more beats on a broken group; keep listening
            self._listen(HEARTBEAT_S)

    def _listen(self, seconds: float) -> None:
        """Note the signals the interpreter wrote to the wakeup pipe for ``seconds``; leave at
        once when one arrives while a peer is gone."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._wakeup], [], [], max(left, 0.0))
            for signum in os.read(self._wakeup, 64) if ready else b"":
                if self.received is None and signum in self.signals:
                    self.received, self.received_at = signum, time.monotonic()
            if self.peer_lost and self.received is not None and not self._ending.is_set():
                why = (f"{signal.Signals(self.received).name} received while another rank is "
                       f"gone: no checkpoint can be written")
                os.write(2, f"error: {why}; exiting now. Relaunching resumes from the newest "
                            f"complete checkpoint\n".encode())
                exit_now(1, why, self.last_words)
            if left <= 0:
                return

    def ending(self) -> None:
        """The stop checkpoint is complete, or the run is over: from here a lost peer is no
        reason to leave in a hurry (it may just have finished first)."""
        self._ending.set()

    def leave_by(self) -> Optional[float]:
        """When (``time.monotonic()``) this process should be gone, a stop signal having come:
        its grace period (no longer than a launcher waits after a SIGTERM or SIGINT), less
        :data:`EXIT_MARGIN_S` for leaving; None before any signal. The end of a job (the
        MLflow delivery) waits no longer than this: a SIGKILL would cut it short with nothing
        recorded."""
        if self.received_at is None:
            return None
        grace = self.grace_period_s
        if self.received in (signal.SIGTERM, signal.SIGINT):
            grace = min(grace, LAUNCHER_KILL_S)
        return self.received_at + grace - EXIT_MARGIN_S

    @property
    def name(self) -> Optional[str]:
        return signal.Signals(self.received).name if self.received else None

    def agreed(self) -> Optional[str]:
        """Collective, at every step boundary: the name of the signal some rank received (the
        same answer on every rank, one boundary late), or None to go on."""
        if not self.signals:
            return None
        if self._group is None:  # a world of one: nobody to agree with
            return self.name
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            self._pending = None
            if flag.item():
                return _named(flag)
        self._pending = self._reduce(async_op=True)
        return None

    def _reduce(self, async_op: bool):
        """(work, flag): the largest signal number noted on any rank (0: none), in ``flag``."""
        flag = torch.tensor([self.received or 0], dtype=torch.int32)
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group,
                               async_op=async_op), flag

    def agreed_now(self) -> Optional[str]:
        """Collective, right after a periodic checkpoint and around an evaluation: as
        :meth:`agreed`, answered at once. A signal that came while it was written then stops
        the run on it, instead of a boundary later with a second checkpoint (twice the time of
        a grace period); one before an evaluation, before it. A blocking reduction of one
        integer is nothing next to a save or an evaluation."""
        if not self.signals:
            return None
        if self._group is None:
            return self.name
        self.drain()  # its flags are in this one too: a rank's signal stays noted
        _, flag = self._reduce(async_op=False)
        return _named(flag) if flag.item() else None

    def drain(self) -> None:
        """Finish a reduction still in flight (collective): call before the process group
        goes away, or before a path on which ``agreed`` will not be called again."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def report_save(self, seconds: float, signame: str) -> None:
        """Say how long the stop checkpoint took; warn when it came close to the grace
        period after which the scheduler kills the job. Collective; rank 0 speaks for all."""
        # from the moment this rank was signalled (another rank may have been, not this one)
        since = seconds if self.received_at is None else time.monotonic() - self.received_at
        if self._group is not None:  # the kill comes first where the signal came first
            longest = torch.tensor([since], dtype=torch.float64)
            try:
                dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self._group)
                since = longest.item()
            except Exception:  # noqa: BLE001 -- a peer left after the checkpoint: own figure
                pass
            if self.received_at is None:  # only another rank was signalled: its time counts
                self.received_at = time.monotonic() - since  # (leave_by)
            if dist.get_rank() != 0:
                return
        msg = (f"{signame}: checkpoint written in {seconds:.1f} s, {since:.1f} s after the "
               f"signal reached the first rank")
        if since > 0.5 * self.grace_period_s:
            log.warning("%s: that is more than half of checkpoint.grace_period_s=%.0f s; "
                        "ask the scheduler for an earlier signal (SLURM: "
                        "SBATCH_SIGNAL=B:USR1@600) or a longer grace period", msg,
                        self.grace_period_s)
        else:
            log.info("%s", msg)

    def restore(self) -> None:
        """Put the previous handlers back (a later signal then acts as it did before) and end
        the heartbeat (collective, but bounded: a rank that is gone only costs a few seconds)."""
        self._ending.set()
        if self._watcher is not None:
            self._watcher.join(timeout=3 * HEARTBEAT_S)
            signal.set_wakeup_fd(self._previous_wakeup)
            self._watcher = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
